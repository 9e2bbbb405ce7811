// What the emulated device charges, what budget errors tell the user, and what the engine reports
// about its config when it is built.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <c10/util/Exception.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
#include <nlohmann/json.hpp>

#include "error_message.h"
#include "patrickstar/engine/engine_inspect.h"
#include "patrickstar/chunk/cuda_device_tier.h"
#include "patrickstar/chunk/memory_tier.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar {
namespace engine_device_test {

using test::error_of;

torch::nn::Sequential small_mlp() {
  torch::manual_seed(5);
  return torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(),
                               torch::nn::Linear(64, 8));
}

TEST(EmulatedDevice, TensorsHeldBeforeTheFirstForwardAreHostMemory) {
  // The trainer's in-memory dataset (8 MB) is alive for the whole run, on a 256 KiB device: it is
  // host memory, and the device is charged for what the iterations allocate.
  CountingCpuAllocator::install();  // so that the dataset is counted, as in a real trainer
  const at::Tensor dataset = torch::randn({2'000'000});
  const at::Tensor targets = torch::randn({2'000'000});
  auto batch = [&](int s) { return dataset.narrow(0, s * 128, 128).view({4, 32}); };
  auto target = [&](int s) { return targets.narrow(0, s * 32, 32).view({4, 8}); };

  torch::nn::Sequential plain = small_mlp();
  torch::optim::Adam adam(plain->parameters(), torch::optim::AdamOptions(1e-2));
  torch::nn::Sequential model = small_mlp();
  Engine engine(model.ptr(), Config::from_string(R"({"default_chunk_size": 2112,
      "optimizer": {"params": {"lr": 0.01}},
      "client": {"device": {"capacity_bytes": "256KiB"}}})"));
  for (int s = 0; s < 5; ++s) {
    engine.zero_grad();
    at::Tensor loss;
    {
      auto active = engine.activate();
      loss = torch::mse_loss(patrickstar::call(model, batch(s)), target(s));
    }
    engine.backward(loss);
    const IterationReport report = engine.step();
    EXPECT_LT(report.non_model_peak_bytes, 256 * 1024) << "step " << s;
    adam.zero_grad();
    at::Tensor reference = torch::mse_loss(plain->forward(batch(s)), target(s));
    reference.backward();
    adam.step();
    EXPECT_NEAR(loss.item<double>(), reference.item<double>(), 1e-5 * reference.item<double>());
  }
}

TEST(EmulatedDevice, HostChunksAreNeverPinned) {
  // The emulated device's host tier is plain memory, on a machine with a GPU too (scripts/gpu-check
  // runs EmulatedDevice.* there): pinning would create a CUDA context for a run that never uses it.
  torch::nn::Sequential model = small_mlp();
  Engine engine(model.ptr(), Config::from_string(R"({"default_chunk_size": 2112,
      "client": {"device": {"capacity_bytes": "256KiB"}}})"));
  const auto* host = dynamic_cast<const HostTier*>(&inspect(engine).host_tier());
  ASSERT_NE(host, nullptr);
  EXPECT_FALSE(host->pinned());
}

// Six layers of one chunk each (4160 elements) under an outer door over the whole module, which
// keeps all six chunks in use while the inner doors run. The warm-up budget covers the chunks of
// the last four moments, so by the fifth layer the six pinned chunks need more than it gives.
struct NestedImpl : torch::nn::Module {
  NestedImpl() {
    torch::manual_seed(9);
    for (int i = 0; i < 6; ++i) {
      layers.push_back(register_module("layer" + std::to_string(i), torch::nn::Linear(64, 64)));
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    ModuleScope scope(*this);
    at::Tensor h = x;
    for (auto& layer : layers) h = torch::relu(patrickstar::call(layer, h));
    return scope.done(h);
  }
  std::vector<torch::nn::Linear> layers;
};

Config nested_config(double warmup_ratio) {
  nlohmann::json j = {{"default_chunk_size", 4160},
                      {"client",
                       {{"device", {{"capacity_bytes", 1 << 20}}},
                        {"mem_tracer", {{"warmup_gpu_chunk_mem_ratio", warmup_ratio}}}}}};
  return Config::from_json(j);
}

TEST(BudgetErrors, WarmupThatRunsOutOfRoomNamesTheRatioThatFits) {
  // Each failing warm-up names a warmup_gpu_chunk_mem_ratio; set to that, the moment that failed
  // fits (the backward, which also pins the gradient chunks, may then name a larger one).
  const at::Tensor x = torch::randn({2, 64});
  const std::string key = "set client.mem_tracer.warmup_gpu_chunk_mem_ratio to ";
  double ratio = 0.01;
  int failures = 0;
  bool trained = false;
  for (int round = 0; round < 4 && !trained; ++round) {
    auto model = std::make_shared<NestedImpl>();
    Engine engine(model, nested_config(ratio));
    const std::string error = error_of([&] {
      at::Tensor loss;
      {
        auto active = engine.activate();
        loss = model->forward(x).pow(2).mean();
      }
      engine.backward(loss);
      engine.step();
    });
    if (error == "<no error>") {
      trained = true;
      break;
    }
    ++failures;
    const size_t at = error.find(key);
    ASSERT_NE(at, std::string::npos) << error;
    const double next = std::strtod(error.c_str() + at + key.size(), nullptr);
    std::printf("warm-up ratio %.2f: the error names %.2f\n", ratio, next);
    EXPECT_GT(next, ratio) << error;
    EXPECT_LE(next, 1.0);
    ratio = next;
  }
  EXPECT_GE(failures, 1) << "the first ratio must be too small for the test to mean anything";
  EXPECT_TRUE(trained) << "the named ratios never fit";
}

// Collects LibTorch warnings (TORCH_WARN) on this thread while it lives.
class WarningCollector : public c10::WarningHandler {
 public:
  WarningCollector() : guard_(this) {}
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
  int64_t count(const std::string& text) const {
    int64_t n = 0;
    for (const std::string& m : messages) n += m.find(text) != std::string::npos ? 1 : 0;
    return n;
  }
  std::vector<std::string> messages;

 private:
  c10::WarningUtils::WarningHandlerGuard guard_;
};

TEST(EngineWarnings, UnknownConfigKeysAreReportedOnceWhenTheEngineIsBuilt) {
  const Config config = Config::from_string(
      R"({"optimizer": {"params": {"lr": 0.01, "weight_decy": 0.1}}, "default_chunk_size": 2112})");
  ASSERT_EQ(config.warnings.size(), 1u);
  WarningCollector warnings;
  torch::nn::Sequential model = small_mlp();
  Engine engine(model.ptr(), config);
  EXPECT_EQ(warnings.count("weight_decy"), 1) << ::testing::PrintToString(warnings.messages);
  EXPECT_EQ(warnings.count("unknown key"), 1);
}

TEST(EngineWarnings, AChunkSizeThatWastesMoreThanHalfIsReported) {
  {
    // One process cuts the last chunk to what it holds, but never below 1,024 elements: a
    // 110-parameter model in a chunk of 1,000 leaves most of it empty.
    WarningCollector warnings;
    torch::nn::Linear model(10, 10);
    Engine engine(model.ptr(), Config::from_string(R"({"default_chunk_size": 1000})"));
    EXPECT_EQ(warnings.count("default_chunk_size 1000 leaves"), 1)
        << ::testing::PrintToString(warnings.messages);
    EXPECT_GT(engine.registration().chunk_waste_fraction, 0.5);
  }
  {
    // A chunk far larger than the model: the one chunk is cut to the model's 2,632 parameters
    // rounded up to 3,072, so the size costs little and is not reported.
    WarningCollector warnings;
    torch::nn::Sequential model = small_mlp();
    Engine engine(model.ptr(), Config::from_string(R"({"default_chunk_size": 1048576})"));
    EXPECT_EQ(warnings.count("default_chunk_size"), 0) << ::testing::PrintToString(warnings.messages);
    EXPECT_NEAR(engine.registration().chunk_waste_fraction, 440.0 / 3072.0, 1e-12);
    EXPECT_EQ(inspect(engine).chunks().chunk(0).capacity_elems, 3072);
  }
  {
    // Without the key the engine chooses the size: little waste, no warning.
    WarningCollector warnings;
    torch::nn::Sequential model = small_mlp();
    Engine engine(model.ptr(), Config::from_string("{}"));
    EXPECT_EQ(warnings.count("default_chunk_size"), 0) << ::testing::PrintToString(warnings.messages);
    EXPECT_LT(engine.registration().chunk_waste_fraction, 0.5);
  }
}

// Where the CUDA engine cannot run (no GPU, or a build without CUDA), asking for it is refused at
// construction with the reason, and the model is left as it was. (On a GPU scripts/gpu-check
// trains through it instead.)
TEST(CudaDevice, RefusedWithItsReasonWhereItCannotRun) {
  if (torch::cuda::is_available()) {
    GTEST_SKIP() << "a GPU is present, so the refusal cannot happen; scripts/gpu-check trains on it";
  }
  torch::nn::Sequential model = small_mlp();
  std::vector<at::Tensor> before;
  for (const at::Tensor& p : model->parameters()) before.push_back(p.detach().clone());
  const std::string error = error_of([&] {
    Engine engine(model.ptr(), Config::from_string(R"({"client": {"device": {"type": "cuda"}}})"));
  });
#ifdef PATRICKSTAR_HAVE_CUDA
  EXPECT_NE(error.find("device type \"cuda\": LibTorch sees no CUDA device"), std::string::npos)
      << error;
#else
  EXPECT_NE(error.find("device type \"cuda\": this build of patrickstar has no CUDA support"),
            std::string::npos)
      << error;
#endif
  EXPECT_NE(error.find("\"type\": \"emulated\""), std::string::npos) << error;
  // Untouched: the same fp32 CPU tensors, which plain LibTorch still trains.
  const auto params = model->parameters();
  ASSERT_EQ(params.size(), before.size());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(params[i].device().is_cpu());
    EXPECT_TRUE(torch::equal(params[i], before[i])) << "parameter " << i;
  }
  torch::mse_loss(model->forward(torch::ones({2, 32})), torch::zeros({2, 8})).backward();
  EXPECT_TRUE(params[0].grad().defined());
}

// "auto" (the default capacity) is resolved when the engine is built, and config() reports the
// capacity in use: 4 GiB on the emulated device; on CUDA what GPU 0 has, or, without a GPU, the
// refusal with the device's reason.
TEST(DeviceCapacity, AutoIsResolvedWhenTheEngineIsBuilt) {
  torch::nn::Sequential model = small_mlp();
  Engine engine(model.ptr(), Config::from_string("{}"));
  EXPECT_EQ(engine.config().device.capacity_bytes, int64_t{4} << 30);
  EXPECT_EQ(inspect(engine).device_tier().capacity_bytes(), int64_t{4} << 30);

  Config cuda;
  cuda.device.type = DeviceType::kCuda;
#ifdef PATRICKSTAR_HAVE_CUDA
  if (torch::cuda::is_available()) {
    const int64_t capacity = resolved_device_capacity(cuda);
    EXPECT_GT(capacity, 0);
    EXPECT_LE(capacity, CudaDeviceTier::total_memory_bytes(0));
    return;
  }
#endif
  const std::string error = error_of([&] { resolved_device_capacity(cuda); });
  EXPECT_NE(error.find("device type \"cuda\": "), std::string::npos) << error;
}

// Copy delays test the emulated device's copy thread: a Config built in code (from_json refuses
// the pair itself) that asks for them on "cuda" is refused at construction, before the device's
// own checks, so the same on every machine, GPU or not; the model is left as it was.
TEST(CudaDevice, CopyDelaysAreRefusedBeforeAnythingIsBuilt) {
  torch::nn::Sequential model = small_mlp();
  const at::Tensor before = model->parameters()[0].detach().clone();
  Config config;
  config.device.type = DeviceType::kCuda;
  config.scheduler.copy_delay_max_us = 40;
  const std::string error = error_of([&] { Engine engine(model.ptr(), config); });
  EXPECT_NE(error.find("client.scheduler.copy_delay_max_us is 40"), std::string::npos) << error;
  EXPECT_NE(error.find("copy thread"), std::string::npos) << error;
  EXPECT_TRUE(model->parameters()[0].device().is_cpu());
  EXPECT_TRUE(torch::equal(model->parameters()[0], before));
}

}  // namespace engine_device_test
}  // namespace patrickstar
