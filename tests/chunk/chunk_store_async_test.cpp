// ChunkStore with asynchronous moves: copies on the queue's thread that keep bytes and free their
// sources after them, a failed copy reported where the chunk is next used, which wait compute and
// host code get, and what a release waits for.
#include "patrickstar/chunk/chunk_store.h"
#include "patrickstar/chunk/copy_queue.h"

#include <ATen/ops/equal.h>
#include <ATen/ops/randn.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <future>
#include <string>
#include <utility>
#include <vector>

#include "chunk_store_test_util.h"
#include "error_message.h"

namespace patrickstar {
namespace chunk_store_async_test {

using ::testing::HasSubstr;
using test::error_of;
using namespace chunk_store_testing;  // NOLINT: the chunk store tests' shared helpers

// An emulated device whose copies can be made to fail (a link that goes down).
class FlakyDevice final : public MemoryTier {
 public:
  explicit FlakyDevice(int64_t capacity) : MemoryTier(Tier::kDevice, "flaky_device", capacity, false) {}
  ~FlakyDevice() override { release_all(); }
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  void copy(void* dst, const void* src, int64_t bytes, CopyDirection direction) override {
    TORCH_CHECK(!fail.load(), "the link went down");
    MemoryTier::copy(dst, src, bytes, direction);
  }
  std::atomic<bool> fail{false};

 protected:
  void* raw_allocate(int64_t bytes, int64_t alignment) override {
    return std::aligned_alloc(static_cast<size_t>(alignment),
                              static_cast<size_t>((bytes + alignment - 1) / alignment * alignment));
  }
  void raw_deallocate(void* ptr, int64_t, int64_t) override { std::free(ptr); }
};

// Asynchronous moves: the copy runs on the queue's thread (held back by seeded delays here), the
// chunk's views wait for it and see the bytes, the source stays allocated until the copy that reads
// it completed, and a release while the copy still writes waits too. Every seed gives the same bytes.
TEST_F(ChunkStoreTest, AsynchronousMovesKeepBytesAndFreeSourcesAfterTheirCopies) {
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    CopyQueue queue(CopyQueueOptions{true, 3000, seed});
    ChunkStore store(small_layout(), {{ChunkKind::kParam, at::kFloat}}, host_, device_);
    store.set_copy_queue(&queue);
    const ChunkId c0 = store.chunk_id(ChunkKind::kParam, 0);
    const ChunkId c1 = store.chunk_id(ChunkKind::kParam, 1);
    store.allocate(c0, Tier::kHost);
    store.allocate(c1, Tier::kHost);
    const at::Tensor expected0 = at::randn({64});
    const at::Tensor expected1 = at::randn({64});
    store.chunk_view(c0).copy_(expected0);
    store.chunk_view(c1).copy_(expected1);
    // There and back and there again, without waiting in between: the copies run in order.
    EXPECT_TRUE(store.move(c0, Tier::kDevice));
    EXPECT_TRUE(store.move(c1, Tier::kDevice));
    EXPECT_TRUE(store.move(c0, Tier::kHost));
    EXPECT_TRUE(store.move(c0, Tier::kDevice));
    EXPECT_EQ(store.tier(c0), Tier::kDevice);
    EXPECT_EQ(store.move_counters().h2d_bytes, 3 * 256);
    store.set_state(0, ChunkKind::kParam, TensorState::kCompute);  // waits for c0's last copy
    EXPECT_TRUE(store.copy_complete(c0));
    EXPECT_TRUE(at::equal(store.chunk_view(c0), expected0)) << "seed " << seed;
    EXPECT_TRUE(at::equal(store.chunk_view(c1), expected1)) << "seed " << seed;
    store.set_state(0, ChunkKind::kParam, TensorState::kHold);
    // A release while the copy writing the payload is queued: the memory waits for it.
    store.move(c1, Tier::kHost);
    store.release(c1);
    store.finish_copies();
    EXPECT_EQ(store.pending_frees(), 0);
    EXPECT_EQ(host_.used_bytes(), 0);
    EXPECT_EQ(device_.used_bytes(), 256);
  }
}

TEST_F(ChunkStoreTest, AMoveWaitsForTheSourceItFreesWhenTheTierIsFull) {
  // Room for one chunk on the device: moving c1 there right after c0 left needs c0's payload,
  // which its (slow) copy to the host still reads; the store waits for that copy and goes on.
  EmulatedDeviceTier one_chunk(256);
  CopyQueue queue(CopyQueueOptions{true, 20000, 7});
  ChunkStore store(small_layout(), {{ChunkKind::kParam, at::kFloat}}, host_, one_chunk);
  store.set_copy_queue(&queue);
  const ChunkId c0 = store.chunk_id(ChunkKind::kParam, 0);
  const ChunkId c1 = store.chunk_id(ChunkKind::kParam, 1);
  store.allocate(c0, Tier::kDevice);
  store.allocate(c1, Tier::kHost);
  store.chunk_view(c0).fill_(3.0f);
  store.chunk_view(c1).fill_(5.0f);
  store.move(c0, Tier::kHost);
  store.move(c1, Tier::kDevice);
  EXPECT_EQ(store.chunk_view(c0)[10].item<float>(), 3.0f);
  EXPECT_EQ(store.chunk_view(c1)[10].item<float>(), 5.0f);
  EXPECT_EQ(one_chunk.used_bytes(), 256);
}

TEST_F(ChunkStoreTest, AFailedCopyIsReportedWhereTheChunkIsNextUsedNamingIt) {
  FlakyDevice flaky(1 << 20);
  {
    CopyQueue queue;
    ChunkStore store(small_layout(), {{ChunkKind::kParam, at::kFloat}}, host_, flaky);
    store.set_copy_queue(&queue);
    const ChunkId c1 = store.chunk_id(ChunkKind::kParam, 1);
    store.allocate(c1, Tier::kHost);
    flaky.fail = true;
    EXPECT_TRUE(store.move(c1, Tier::kDevice));  // returns at once; the copy fails on the thread
    const std::string message = error_of([&] { store.chunk_view(c1); });
    EXPECT_THAT(message, HasSubstr("param chunk 1 (id 1) to the device"));
    EXPECT_THAT(message, HasSubstr("the link went down"));
  }
  EXPECT_EQ(flaky.used_bytes(), 0);
  EXPECT_EQ(host_.used_bytes(), 0);
}

// A copy engine that records which of its two waits the store asks for, over a real copy thread
// (seeded delays): order_compute_after() for compute reading a device payload (on CUDA the stream
// waits on the GPU and the host goes on), wait() for host code reading a host payload.
class RecordingEngine final : public CopyEngine {
 public:
  CopyEvent submit_copy(MemoryTier& device, void* dst, const void* src, int64_t bytes,
                        CopyDirection direction, std::string label) override {
    return queue.submit_copy(device, dst, src, bytes, direction, std::move(label));
  }
  void wait(CopyEvent event) override {
    host_waits.push_back(event);
    queue.wait(event);
  }
  void order_compute_after(CopyEvent event) override {
    compute_waits.push_back(event);
    queue.wait(event);  // compute runs on the host here
  }
  bool done(CopyEvent event) const override { return queue.done(event); }
  void drain() override { queue.drain(); }
  CopyEvent last_submitted() const override { return queue.last_submitted(); }
  double waited_seconds() const override { return queue.waited_seconds(); }
  void reset_waited_seconds() override { queue.reset_waited_seconds(); }
  void set_clock(std::function<int64_t()> now_us) override { queue.set_clock(std::move(now_us)); }
  void set_record_spans(bool on) override { queue.set_record_spans(on); }
  std::vector<CopySpan> spans() const override { return queue.spans(); }
  void clear_spans() override { queue.clear_spans(); }

  CopyQueue queue{CopyQueueOptions{true, 2000, 3}};
  std::vector<CopyEvent> host_waits;
  std::vector<CopyEvent> compute_waits;
};

TEST_F(ChunkStoreTest, ComputeIsOrderedAfterDeviceCopiesAndHostCodeWaitsForHostOnes) {
  RecordingEngine engine;
  ChunkStore store(small_layout(), {{ChunkKind::kParam, at::kFloat}}, host_, device_);
  store.set_copy_queue(&engine);
  const ChunkId c0 = store.chunk_id(ChunkKind::kParam, 0);
  const ChunkId c1 = store.chunk_id(ChunkKind::kParam, 1);
  store.allocate(c0, Tier::kHost);
  store.allocate(c1, Tier::kHost);
  store.chunk_view(c0).fill_(2.0f);
  store.chunk_view(c1).fill_(4.0f);
  EXPECT_TRUE(engine.host_waits.empty() && engine.compute_waits.empty()) << "no copy yet";

  // Entering COMPUTE on a device payload: compute is ordered after the copy writing it, once.
  store.move(c0, Tier::kDevice);
  const CopyEvent c0_to_device = engine.last_submitted();
  store.set_state(0, ChunkKind::kParam, TensorState::kCompute);  // layer.w, in chunk 0
  EXPECT_EQ(engine.compute_waits, std::vector<CopyEvent>{c0_to_device});
  EXPECT_TRUE(engine.host_waits.empty());
  EXPECT_TRUE(store.copy_complete(c0));
  EXPECT_EQ(store.view(0, ChunkKind::kParam)[1][2].item<float>(), 2.0f);
  EXPECT_EQ(engine.compute_waits.size(), 1u) << "the copy was waited for already";
  store.set_state(0, ChunkKind::kParam, TensorState::kHold);

  // Host code reading a host payload (the host Adam, a checkpoint): a wait on the host.
  store.move(c0, Tier::kHost);
  const CopyEvent c0_to_host = engine.last_submitted();
  EXPECT_EQ(store.chunk_view(c0)[5].item<float>(), 2.0f);
  EXPECT_EQ(engine.host_waits, std::vector<CopyEvent>{c0_to_host});
  EXPECT_EQ(engine.compute_waits.size(), 1u);

  // A whole device chunk's view (the device Adam's) is compute's too.
  store.move(c1, Tier::kDevice);
  const CopyEvent c1_to_device = engine.last_submitted();
  EXPECT_EQ(store.chunk_view(c1)[3].item<float>(), 4.0f);
  EXPECT_EQ(engine.compute_waits, (std::vector<CopyEvent>{c0_to_device, c1_to_device}));
  EXPECT_EQ(engine.host_waits.size(), 1u);

  store.finish_copies();
  EXPECT_EQ(store.pending_frees(), 0);
  EXPECT_EQ(host_.used_bytes(), 256);
  EXPECT_EQ(device_.used_bytes(), 256);
}

// What a release waits for: the copies that read or write the payloads (held back here behind a
// gate on the copy thread), never compute. A device payload compute was ordered after and no
// queued copy touches goes back at once (on CUDA, its next writer is ordered after the compute
// stream).
TEST_F(ChunkStoreTest, ReleaseWaitsForQueuedCopiesNotForCompute) {
  RecordingEngine engine;
  ChunkStore store(small_layout(), {{ChunkKind::kParam, at::kFloat}}, host_, device_);
  store.set_copy_queue(&engine);
  const ChunkId c0 = store.chunk_id(ChunkKind::kParam, 0);
  const ChunkId c1 = store.chunk_id(ChunkKind::kParam, 1);
  store.allocate(c0, Tier::kHost);
  store.allocate(c1, Tier::kHost);

  std::promise<void> go;
  std::shared_future<void> gate = go.get_future().share();
  engine.queue.submit([gate] { gate.wait(); }, "gate");
  store.move(c0, Tier::kDevice);  // queued behind the gate: reads the host source, writes the device
  store.release(c0);
  EXPECT_EQ(store.pending_frees(), 2) << "the host source and the device destination wait";
  EXPECT_EQ(host_.used_bytes(), 512);
  EXPECT_EQ(device_.used_bytes(), 256);
  go.set_value();
  store.finish_copies();
  EXPECT_EQ(store.pending_frees(), 0);
  EXPECT_EQ(host_.used_bytes(), 256);
  EXPECT_EQ(device_.used_bytes(), 0);

  store.move(c1, Tier::kDevice);
  store.chunk_view(c1).fill_(1.0f);  // compute, ordered after the copy
  EXPECT_EQ(engine.compute_waits.size(), 1u);
  store.release(c1);
  EXPECT_EQ(store.pending_frees(), 0);
  EXPECT_EQ(device_.used_bytes(), 0);
  EXPECT_EQ(host_.used_bytes(), 0);
  EXPECT_TRUE(engine.host_waits.empty()) << "no release blocked the host";
}

}  // namespace chunk_store_async_test
}  // namespace patrickstar
