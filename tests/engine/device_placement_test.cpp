// Host plus device: a model whose data the host budget cannot hold registers with some of its
// optimizer states placed on the device for good (their Adam runs there), trains like plain
// LibTorch, and those states never move; a model that host and device together cannot hold is
// refused with both figures, the model untouched.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <set>
#include <string>

#include "error_message.h"
#include "gpt_training.h"
#include "patrickstar/engine/engine_inspect.h"
#include "patrickstar/models/gpt.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar {
namespace device_placement_test {

using models::Gpt;
using namespace test;  // NOLINT: the shared helpers of gpt_training.h

constexpr int kSteps = 20;
// How far the host budget falls short of the model data: two 40000-element fp32 state chunks
// (320,000 bytes) cover it, one does not. The last chunk index is cut to what it holds (one
// process), so its state chunks are smaller and the placement may take three.
constexpr int64_t kShortBy = 300000;
constexpr int64_t kFullStateChunkBytes = 160000;

struct Case {
  std::string name;
  std::string extra;     // config patch
  // Device bytes for chunks next to this CPU's non-model peak, as the training tests size them
  // (0: tight_config's device, which the fp32 training tests use).
  int64_t chunk_room;
  double tolerance;      // against plain fp32 LibTorch, as EngineTraining holds each precision
};

class HostPlusDevice : public ::testing::TestWithParam<Case> {};

int64_t model_data_bytes(const Config& config) {
  Gpt model = make_model(1);
  Engine engine(model.ptr(), config);
  return engine.registration().model_data_bytes;
}

TEST_P(HostPlusDevice, StatesTheHostCannotHoldLiveOnTheDeviceAndTrainingMatchesLibTorch) {
  const Case& c = GetParam();
  Config config =
      c.chunk_room > 0 ? config_with_chunk_room(c.extra, c.chunk_room) : tight_config(c.extra);
  const int64_t needed = model_data_bytes(config);
  // The states placed on the device take their own room: the chunks that move keep theirs.
  config.device.capacity_bytes += kShortBy + kFullStateChunkBytes;
  config.device.host_capacity_bytes = needed - kShortBy;

  const std::vector<double> plain = train_plain(kSteps);
  Gpt model = make_model(1);
  Engine engine(model.ptr(), config);
  engine.set_record_timeline(true);  // the moves are read below
  const ChunkStore& store = inspect(engine).chunks();
  const RegistrationReport& r = engine.registration();
  EXPECT_EQ(r.model_data_bytes, needed);
  EXPECT_GE(r.device_state_bytes, kShortBy);
  EXPECT_LT(r.device_state_bytes, kShortBy + kFullStateChunkBytes)
      << "no more than the host lacks, a chunk at a time";

  // The chunks placed: optimizer states only, on the device, their bytes the report's.
  std::set<int64_t> placed;
  int64_t placed_bytes = 0;
  for (ChunkId id = 0; id < store.chunk_count(); ++id) {
    if (!inspect(engine).scheduler().chunks().at(id).device_only) continue;
    placed.insert(id);
    placed_bytes += store.chunk_bytes(id);
    const ChunkKind kind = store.kind_of(id);
    EXPECT_TRUE(kind == ChunkKind::kMomentum || kind == ChunkKind::kVariance ||
                kind == ChunkKind::kParamFp32)
        << "chunk " << id << " of kind " << static_cast<int>(kind);
    EXPECT_EQ(store.tier(id), Tier::kDevice) << "chunk " << id << " after registration";
  }
  EXPECT_EQ(placed_bytes, r.device_state_bytes);
  ASSERT_FALSE(placed.empty());

  std::vector<double> losses;
  std::vector<IterationReport> reports;
  for (int s = 0; s < kSteps; ++s) {
    double loss = 0;
    reports.push_back(train_step(engine, model, s, &loss));
    losses.push_back(loss);
  }
  EXPECT_LE(max_relative_difference(losses, plain), c.tolerance);
  EXPECT_LT(plain.back(), plain.front()) << "the reference must actually train";
  std::printf("%s: host budget %lld of %lld bytes of model data, %lld bytes of states on the "
              "device, max relative loss difference %.3g over %d steps\n",
              c.name.c_str(), static_cast<long long>(config.device.host_capacity_bytes),
              static_cast<long long>(needed), static_cast<long long>(r.device_state_bytes),
              max_relative_difference(losses, plain), kSteps);

  // The other chunks still move every iteration: the device is not simply large.
  for (size_t i = 1; i < reports.size(); ++i) {
    EXPECT_GT(reports[i].evictions, 0) << "iteration " << i;
  }
  // The placed states never moved; their Adam ran on the device; the host stayed in its budget.
  for (const MoveEvent& move : inspect(engine).scheduler().moves()) {
    EXPECT_EQ(placed.count(move.chunk_id), 0u) << "chunk " << move.chunk_id << " moved";
  }
  for (int64_t id : placed) {
    EXPECT_EQ(store.tier(id), Tier::kDevice) << "chunk " << id << " after training";
    EXPECT_TRUE(inspect(engine).adam_on_device()[static_cast<size_t>(store.index_of(id))]);
  }
  EXPECT_GT(reports.front().adam.chunks_device, 0) << "the warm-up updates them on the device too";
  EXPECT_LE(inspect(engine).host_tier().peak_bytes(), config.device.host_capacity_bytes);
  EXPECT_GT(inspect(engine).host_tier().peak_bytes(), config.device.host_capacity_bytes - 2 * 160000)
      << "the host budget was the limit, so the host tier ran near it";
}

INSTANTIATE_TEST_SUITE_P(
    Precisions, HostPlusDevice,
    ::testing::Values(Case{"fp32", "{}", 0, 1e-5},
                      Case{"bf16", R"({"bf16": {"enabled": true}})", 240000, 2e-2}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// Host and device together too small, or a policy that keeps every state's home on the host: a
// clear error with the figures, nothing registered, the model's weights as they were.
TEST(HostPlusDeviceErrors, RefusedWhenTheDeviceCannotTakeWhatTheHostLacks) {
  Config config = tight_config();
  const int64_t needed = model_data_bytes(config);
  config.device.host_capacity_bytes = needed - kShortBy;
  struct Refusal {
    std::string why;
    std::function<void(Config&)> change;
    std::string message;
  };
  const std::vector<Refusal> refusals = {
      {"a device whose usable half is below the shortfall",
       [](Config& c) { c.device.capacity_bytes = 500000; },
       "at most 250000 bytes of optimizer states on the device"},
      {"the static policy", [](Config& c) { c.scheduler.policy = EvictionPolicy::kStatic; },
       "the static policy"},
      {"hybrid Adam off", [](Config& c) { c.optimizer.use_hybrid_adam = false; },
       "use_hybrid_adam"},
  };
  for (const Refusal& refusal : refusals) {
    SCOPED_TRACE(refusal.why);
    Config bad = config;
    refusal.change(bad);
    Gpt model = make_model(1);
    const at::Tensor before = model->parameters()[0].detach().clone();
    const std::string error = error_of([&] { Engine engine(model.ptr(), bad); });
    EXPECT_NE(error.find("bytes of host memory but the host budget has"), std::string::npos)
        << error;
    EXPECT_NE(error.find(refusal.message), std::string::npos) << error;
    EXPECT_NE(error.find("nothing was registered"), std::string::npos) << error;
    EXPECT_TRUE(torch::equal(model->parameters()[0], before));
  }
}

// The states fit half the device, but their chunk index's Adam would need every kind of that index
// on the device at the step, more than the device has. The placement takes the last index, cut to
// the 32,768 elements it holds (rounded up): bf16 65,536 + 3 x 131,072 bytes.
TEST(HostPlusDeviceErrors, RefusedWhenThePlacedIndexCannotStepOnTheDevice) {
  Config config = tight_config(R"({"bf16": {"enabled": true}})");
  const int64_t needed = model_data_bytes(config);
  config.device.host_capacity_bytes = needed - 100000;  // one 131,072-byte variance chunk covers it
  config.device.capacity_bytes = 400000;
  Gpt model = make_model(1);
  const std::string error = error_of([&] { Engine engine(model.ptr(), config); });
  EXPECT_NE(error.find("the 131072 bytes of optimizer states the host lacks would go to the device, "
                       "but their chunk indices' Adam would then need 458752 bytes"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("nothing was registered"), std::string::npos) << error;
}

}  // namespace device_placement_test
}  // namespace patrickstar
