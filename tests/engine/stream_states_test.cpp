// optimizer.params.stream_states (docs/design.md, "Where Adam runs"): hybrid Adam also updates on
// the device the chunk indices whose param, gradient and states fit what the device has free at
// the step. It trains the same bits as the margin's placement (and as plain LibTorch), puts more
// indices' Adam on the device, keeps within the device, and is refused where it cannot run.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "error_message.h"
#include "gpt_training.h"

namespace patrickstar::stream_states_test {

using test::make_model;
using test::tight_config;
using test::train_step;
using ::testing::HasSubstr;

struct Training {
  std::vector<double> losses;
  std::vector<IterationReport> reports;
  std::vector<bool> on_device;  // per chunk index, after the last step
};

Training train(const Config& config, int steps) {
  models::Gpt model = make_model(1);
  Engine engine(model.ptr(), config);
  Training run;
  for (int s = 0; s < steps; ++s) {
    double loss = 0;
    run.reports.push_back(train_step(engine, model, s, &loss));
    run.losses.push_back(loss);
  }
  run.on_device = inspect(engine).adam_on_device();
  return run;
}

constexpr char kStreamed[] = R"({"optimizer": {"params": {"stream_states": true}}})";

// Steady steps (past the warm-up that records the trace and decides the placement).
constexpr int kSteps = 6;
constexpr int kSteady = 2;

TEST(StreamStates, TrainsAsTheMarginsPlacementAndAsLibTorchWithMoreAdamOnTheDevice) {
  const Training margin = train(tight_config(), kSteps);
  const Training streamed = train(tight_config(kStreamed), kSteps);
  // The device Adam is the same update as the host's: the same bits, and LibTorch's training.
  EXPECT_EQ(streamed.losses, margin.losses);
  EXPECT_LT(test::max_relative_difference(streamed.losses, test::train_plain(kSteps)), 1e-6);
  // tight_config's device holds part of the model: the margin places little or nothing, the step's
  // room more (every index's Adam that ran on the device is a whole device side at the step).
  const auto count = [](const std::vector<bool>& v) {
    return std::count(v.begin(), v.end(), true);
  };
  EXPECT_GT(count(streamed.on_device), count(margin.on_device));
  for (int s = kSteady; s < kSteps; ++s) {
    const IterationReport& a = margin.reports[static_cast<size_t>(s)];
    const IterationReport& b = streamed.reports[static_cast<size_t>(s)];
    EXPECT_GT(b.adam.chunks_device, a.adam.chunks_device) << "step " << s;
    EXPECT_LT(b.adam.bytes_host, a.adam.bytes_host) << "step " << s;
    // The streamed states leave the device in the next forward and come back for the step.
    EXPECT_GT(b.h2d_bytes, 0) << "step " << s;
  }
  // A device that holds the whole model with room: the margin's placement is every index already,
  // and streaming adds nothing.
  Config roomy = tight_config();
  roomy.device.capacity_bytes = int64_t{1} << 30;
  Config roomy_streamed = tight_config(kStreamed);
  roomy_streamed.device.capacity_bytes = roomy.device.capacity_bytes;
  const Training all = train(roomy, 3);
  const Training all_streamed = train(roomy_streamed, 3);
  EXPECT_EQ(all_streamed.on_device, all.on_device);
  EXPECT_EQ(count(all.on_device), static_cast<int64_t>(all.on_device.size()));
}

TEST(StreamStates, TheStepsRoomDecidesHowManyStream) {
  // A device half as large again as tight_config's streams more indices than it (the first fit
  // over the step's room: RunPlan.TheStreamedPlacementFillsTheStepsRoomFirstFitAfterWhatIsThere).
  const auto count = [](const Config& config) {
    const Training run = train(config, 3);
    return std::count(run.on_device.begin(), run.on_device.end(), true);
  };
  Config larger = tight_config(kStreamed);
  larger.device.capacity_bytes = tight_config().device.capacity_bytes * 3 / 2;
  const int64_t at_tight = count(tight_config(kStreamed));
  EXPECT_GT(count(larger), at_tight);
  EXPECT_GT(at_tight, 0);
}

TEST(StreamStates, ConfigurationsItCannotRunAreRefused) {
  auto refusal = [](const std::string& extra) {
    return test::error_of([&] {
      Config::from_string(R"({"optimizer": {"params": {"stream_states": true)" + extra + "}}}");
    });
  };
  EXPECT_THAT(refusal(R"(, "use_hybrid_adam": false)"), HasSubstr("use_hybrid_adam: false"));
  EXPECT_THAT(test::error_of([] {
                Config::from_string(R"({"optimizer": {"params": {"stream_states": true}},
                                        "client": {"scheduler": {"policy": "static"}}})");
              }),
              HasSubstr("static policy"));
  EXPECT_THAT(test::error_of([] {
                Config::from_string(R"({"optimizer": {"params": {"stream_states": true}},
                                        "zero_optimization": {"offload_optimizer":
                                          {"device": "nvme", "nvme_path": "/tmp"}}})");
              }),
              HasSubstr("not the disk"));
  EXPECT_THAT(test::error_of([] {
                Config::from_string(R"({"optimizer": {"params": {"stream_states": true}},
                                        "zero_optimization": {"delayed_param_update": true}})");
              }),
              HasSubstr("set one of them"));
  // Under the plan the delayed update is a candidate, and so is streaming: both allowed.
  const Config planned = Config::from_string(R"({"plan": "auto",
      "optimizer": {"params": {"stream_states": true}},
      "zero_optimization": {"delayed_param_update": true}})");
  EXPECT_TRUE(planned.optimizer.stream_states);
  EXPECT_THAT(test::error_of([] {
                Config::from_string(R"({"optimizer": {"params": {"stream_states": 1}}})");
              }),
              HasSubstr("stream_states"));
}

}  // namespace patrickstar::stream_states_test
