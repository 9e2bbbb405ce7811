// The store of offloaded checkpoint inputs (engine/src/activation_offload.h) on its own, with the
// emulated device's copy thread delaying its copies at random, and inputs taken back on another
// thread as autograd's would: the values come back as they left, the host tier's blocks all return,
// and (under ThreadSanitizer) nothing races.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <thread>
#include <vector>

#include "activation_offload.h"
#include "patrickstar/chunk/copy_queue.h"
#include "patrickstar/chunk/memory_tier.h"

namespace patrickstar {
namespace activation_store_test {

using engine_detail::ActivationStore;

struct Tiers {
  EmulatedDeviceTier device{int64_t{1} << 26};
  HostTier host;
  CopyQueue copies{CopyQueueOptions{.threaded = true, .max_delay_us = 300, .delay_seed = 7}};
};

TEST(ActivationStore, InputsComeBackAsTheyLeftAndEveryHostBlockReturns) {
  Tiers t;
  ActivationStore store(t.device, t.host, &t.copies);
  for (int round = 0; round < 20; ++round) {
    torch::manual_seed(round);
    std::vector<at::Tensor> inputs, copies;
    std::vector<std::unique_ptr<OffloadedActivation>> saved;
    int64_t bytes = 0;
    for (int call = 0; call < 6; ++call) {
      inputs.push_back(torch::randn({64 + call, 33}));
      copies.push_back(inputs.back().clone());
      bytes += static_cast<int64_t>(inputs.back().nbytes());
      store.call_forward_done();  // the inputs before this call leave the device
      saved.push_back(store.offload(call, inputs.back()));
      ASSERT_NE(saved.back(), nullptr);
      inputs.back() = at::Tensor();  // only the store holds the input now
    }
    EXPECT_EQ(store.figures().host_bytes, bytes);
    // Backward, on another thread: calls in reverse, each recompute first.
    std::vector<at::Tensor> back(saved.size());
    std::thread autograd([&] {
      for (int call = 5; call >= 0; --call) {
        store.recompute_begins();
        back[call] = saved[call]->take();
      }
    });
    autograd.join();
    for (int call = 0; call < 6; ++call) {
      EXPECT_TRUE(torch::equal(back[call], copies[call])) << "round " << round << ", call " << call;
    }
    const engine_detail::OffloadFigures f = store.figures();
    EXPECT_EQ(f.offloaded_bytes, bytes);
    // The last input never left; every other came back.
    EXPECT_EQ(f.prefetched_bytes, bytes - static_cast<int64_t>(copies[5].nbytes()));
    EXPECT_EQ(f.host_bytes, 0);
    EXPECT_EQ(t.host.used_bytes(), 0);
    store.reset_figures();
  }
}

TEST(ActivationStore, DroppedUntakenOrRefusedPastTheHostCapacityNothingStays) {
  Tiers t;
  {
    ActivationStore store(t.device, t.host, &t.copies);
    std::vector<std::unique_ptr<OffloadedActivation>> saved;
    for (int call = 0; call < 4; ++call) {
      store.call_forward_done();
      saved.push_back(store.offload(call, torch::ones({128, 16})));
    }
    store.call_forward_done();
    EXPECT_GT(t.host.used_bytes(), 0);
    saved.clear();  // a graph freed without its backward
    EXPECT_EQ(t.host.used_bytes(), 0);
    EXPECT_EQ(store.figures().host_bytes, 0);
  }
  // A host tier that holds one input beside what the device's chunks would need.
  EmulatedDeviceTier device(int64_t{1} << 20);
  HostTier host(3 * 128 * 16 * 4 / 2);
  void* chunk = device.allocate(128 * 16 * 4 / 2);  // a chunk on the device: its eviction's room
  ActivationStore store(device, host, &t.copies);
  auto first = store.offload(0, torch::ones({128, 16}));
  auto second = store.offload(1, torch::ones({128, 16}));
  EXPECT_NE(first, nullptr);
  EXPECT_EQ(second, nullptr) << "the second input would take the room an eviction needs";
  EXPECT_EQ(store.figures().refused_bytes, 128 * 16 * 4);
  first.reset();
  device.deallocate(chunk);
}

TEST(ActivationStore, AnInputTakenAfterTheStoreClosedIsRefusedNamingTheEngine) {
  Tiers t;
  ActivationStore store(t.device, t.host, &t.copies);
  auto saved = store.offload(0, torch::ones({8, 8}));
  store.call_forward_done();
  store.close();
  EXPECT_EQ(t.host.used_bytes(), 0);
  try {
    saved->take();
    ADD_FAILURE() << "an input came back from a closed store";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("engine that offloaded"), std::string::npos) << e.what();
  }
}

}  // namespace activation_store_test
}  // namespace patrickstar
