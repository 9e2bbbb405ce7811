// The engine recovers from what a trainer can throw at it: a forward that throws (between doors or
// inside one), a loss dropped before backward, a backward that throws, zero_grad() anywhere, a
// trace the device cannot hold, and control flow that changes between iterations. After each, no
// tensor stays in COMPUTE, weights and optimizer state are as before, and training goes on exactly
// as a run that never saw the failure.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <c10/util/Exception.h>

#include <string>
#include <vector>
#include <nlohmann/json.hpp>

#include "error_message.h"
#include "gpt_training.h"
#include "patrickstar/engine/engine_inspect.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar {
namespace engine_recovery_test {

using test::error_of;
using test::test_device;

enum class Failure { kNone, kBetweenDoors, kInsideDoor, kInBackward, kBigTemporary, kBranch };

// Identity forward whose backward throws, as a user's custom autograd function might.
struct ThrowInBackward : torch::autograd::Function<ThrowInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) {
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list) {
    TORCH_CHECK(false, "user error in backward");
    return {};
  }
};

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
    extra = register_module("extra", torch::nn::Linear(16, 16));
  }
  at::Tensor forward(const at::Tensor& x, Failure failure = Failure::kNone) {
    at::Tensor h = torch::tanh(patrickstar::call(fc1, x));
    h = torch::tanh(patrickstar::call(extra, h));
    switch (failure) {
      case Failure::kNone: break;
      case Failure::kBetweenDoors: TORCH_CHECK(false, "user shape error between doors");
      case Failure::kInsideDoor: return patrickstar::call(fc2, h.narrow(1, 0, 3));  // Linear throws
      case Failure::kInBackward: h = ThrowInBackward::apply(h); break;
      case Failure::kBigTemporary: {
        // A temporary larger than the device (on the device the forward runs on), freed before
        // the next moment: the warm-up's live readings never see it, the trace's interval peak
        // does.
        at::Tensor big = torch::ones({1 << 20}, h.device());
        h = h + big.sum() * 0;
        break;
      }
      case Failure::kBranch: h = torch::tanh(patrickstar::call(extra, h)); break;  // twice
    }
    return patrickstar::call(fc2, h);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, extra{nullptr};
};
TORCH_MODULE(Net);

Config net_config(const std::string& extra = "{}") {
  nlohmann::json j = {{"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}}}}},
                      {"default_chunk_size", 300},
                      {"client", {{"device", {{"capacity_bytes", 1 << 20}}}}}};
  j.merge_patch(nlohmann::json::parse(extra));
  Config config = Config::from_json(j);
  test::use_test_device(config);
  return config;
}

at::Tensor input_of(int step) {
  torch::manual_seed(500 + step);
  return torch::randn({4, 8});
}
at::Tensor target_of(int step) {
  torch::manual_seed(900 + step);
  return torch::randn({4, 4});
}

struct Trainer {
  explicit Trainer(const Config& config) {
    torch::manual_seed(7);
    net = Net();
    engine = std::make_unique<Engine>(net.ptr(), config);
  }
  at::Tensor loss(int step, Failure failure = Failure::kNone) {
    auto active = engine->activate();
    at::Tensor x = input_of(step).to(test_device());
    if (engine->config().precision() != Precision::kFp32) x = x.to(at::kBFloat16);
    return torch::mse_loss(net->forward(x, failure).to(at::kFloat),
                           target_of(step).to(test_device()));
  }
  double train_step(int step, Failure failure = Failure::kNone) {
    engine->zero_grad();
    at::Tensor l = loss(step, failure);
    engine->backward(l);
    engine->step();
    return l.item<double>();
  }
  // Weights and optimizer state (every chunk but the gradient space), and the loss scale. Copied
  // to the host: a chunk may be on either tier, and on another one when compared.
  std::vector<at::Tensor> state() const {
    std::vector<at::Tensor> out;
    const ChunkStore& store = inspect(*engine).chunks();
    for (ChunkId id = 0; id < store.chunk_count(); ++id) {
      if (store.kind_of(id) != ChunkKind::kGrad) {
        out.push_back(store.chunk_view(id).to(at::kCPU, /*non_blocking=*/false, /*copy=*/true));
      }
    }
    out.push_back(torch::tensor(engine->loss_scale()));
    return out;
  }
  int64_t tensors_in_compute() const {
    int64_t n = 0;
    const ChunkStore& store = inspect(*engine).chunks();
    for (ChunkId id = 0; id < store.chunk_count(); ++id) {
      n += store.chunk_state(id)[TensorState::kCompute];
    }
    return n;
  }
  Net net{nullptr};
  std::unique_ptr<Engine> engine;
};

bool same(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i], b[i])) return false;
  }
  return true;
}

// The losses of `steps` clean steps, for comparison with a run that had failures in between.
std::vector<double> clean_losses(const Config& config, int steps) {
  Trainer run(config);
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) losses.push_back(run.train_step(s));
  return losses;
}

// On the emulated device, or on the CUDA engine with PATRICKSTAR_TEST_DEVICE=cuda (the engine's
// nets get their batches on test_device(); the plain twins stay on the CPU).
class EngineRecovery : public test::OnTestDevice,
                       public ::testing::WithParamInterface<std::string> {
 protected:
  Config config() const { return net_config(GetParam()); }
};

// After the failure at `fail_before_step` (in the warm-up when 0), training goes on as if it never
// happened: same losses as a clean run, no re-recorded trace, nothing left in COMPUTE.
void expect_recovers(const Config& config, Failure failure, int fail_before_step) {
  const std::vector<double> clean = clean_losses(config, 6);
  Trainer run(config);
  std::vector<double> losses;
  for (int s = 0; s < 6; ++s) {
    if (s == fail_before_step) {
      const std::vector<at::Tensor> before = run.state();
      const std::string error = error_of([&] {
        at::Tensor l = run.loss(s, failure);
        run.engine->backward(l);
      });
      EXPECT_NE(error, "<no error>");
      EXPECT_EQ(run.tensors_in_compute(), 0) << error;
      EXPECT_TRUE(same(run.state(), before)) << "weights or optimizer state changed: " << error;
      if (failure == Failure::kInBackward) {
        EXPECT_NE(error.find("iteration was discarded"), std::string::npos) << error;
      }
    }
    losses.push_back(run.train_step(s));
  }
  EXPECT_EQ(losses, clean);
  EXPECT_EQ(run.engine->retrace_count(), 0);
  EXPECT_EQ(run.tensors_in_compute(), 0);
}

TEST_P(EngineRecovery, ForwardThatThrowsBetweenDoors) {
  expect_recovers(config(), Failure::kBetweenDoors, 0);
  expect_recovers(config(), Failure::kBetweenDoors, 3);
}

TEST_P(EngineRecovery, ForwardThatThrowsInsideADoor) {
  expect_recovers(config(), Failure::kInsideDoor, 0);
  expect_recovers(config(), Failure::kInsideDoor, 3);
}

TEST_P(EngineRecovery, BackwardThatThrows) {
  expect_recovers(config(), Failure::kInBackward, 0);
  expect_recovers(config(), Failure::kInBackward, 3);
}

TEST_P(EngineRecovery, DroppedLossIsForgotten) {
  const std::vector<double> clean = clean_losses(config(), 6);
  Trainer run(config());
  std::vector<double> losses;
  for (int s = 0; s < 6; ++s) {
    if (s == 0 || s == 3) {
      const std::vector<at::Tensor> before = run.state();
      { at::Tensor dropped = run.loss(s); }  // a discarded micro-batch: never reaches backward
      EXPECT_EQ(run.tensors_in_compute(), 0);
      EXPECT_TRUE(same(run.state(), before));
    }
    losses.push_back(run.train_step(s));
  }
  EXPECT_EQ(losses, clean);
  EXPECT_EQ(run.engine->retrace_count(), 0);
}

TEST_P(EngineRecovery, ZeroGradAnywhere) {
  const std::vector<double> clean = clean_losses(config(), 6);
  Trainer run(config());
  std::vector<double> losses;
  for (int s = 0; s < 6; ++s) {
    run.engine->zero_grad();
    at::Tensor l = run.loss(s);
    run.engine->zero_grad();  // between forward and backward, as many LibTorch loops do
    run.engine->backward(l);
    run.engine->step();
    run.engine->zero_grad();  // an extra one at the end of the step
    run.engine->zero_grad();
    losses.push_back(l.item<double>());
  }
  EXPECT_EQ(losses, clean);
  EXPECT_EQ(run.engine->retrace_count(), 0);
}

TEST_P(EngineRecovery, ZeroGradAfterBackwardDiscardsTheGradients) {
  // A backward whose gradients are thrown away by zero_grad() (a GAN's discriminator after the
  // generator's step): the step after it sees only the next backward's gradients, and the half
  // weights the gradients overwrote (mixed precision) are back.
  const std::vector<double> clean = clean_losses(config(), 6);
  Trainer run(config());
  std::vector<double> losses;
  for (int s = 0; s < 6; ++s) {
    if (s == 2) {
      const std::vector<at::Tensor> before = run.state();
      at::Tensor l = run.loss(s + 40);
      run.engine->backward(l);
      run.engine->zero_grad();
      EXPECT_TRUE(same(run.state(), before));
    }
    losses.push_back(run.train_step(s));
  }
  EXPECT_EQ(losses, clean);
  // zero_grad() after a backward forgets that backward's moments too: the trace stands.
  EXPECT_EQ(run.engine->retrace_count(), 0);
}

TEST_P(EngineRecovery, ControlFlowThatChangesReRecordsTheTrace) {
  // Two forward shapes alternate (an optional branch): every iteration after the first re-records
  // its trace with a warning instead of failing, and training matches plain LibTorch.
  Trainer run(config());
  torch::manual_seed(7);
  Net plain;
  torch::optim::AdamW adamw(plain->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0));
  const bool fp32 = run.engine->config().precision() == Precision::kFp32;
  for (int s = 0; s < 6; ++s) {
    const Failure shape = s % 2 == 0 ? Failure::kNone : Failure::kBranch;
    run.engine->zero_grad();
    at::Tensor l = run.loss(s, shape);
    run.engine->backward(l);
    const IterationReport report = run.engine->step();
    EXPECT_EQ(report.retraced, s > 0) << "step " << s;
    EXPECT_EQ(report.retraces, s);
    adamw.zero_grad();
    at::Tensor reference = torch::mse_loss(plain->forward(input_of(s), shape), target_of(s));
    reference.backward();
    adamw.step();
    if (fp32) {
      EXPECT_NEAR(l.item<double>(), reference.item<double>(), 1e-5 * reference.item<double>());
    } else {  // bf16 compute: the same training within bf16 rounding
      EXPECT_NEAR(l.item<double>(), reference.item<double>(), 5e-2 * reference.item<double>());
    }
  }
  EXPECT_EQ(run.engine->retrace_count(), 5);
  EXPECT_EQ(run.tensors_in_compute(), 0);
}

TEST_P(EngineRecovery, TraceTheDeviceCannotHoldIsRejectedBeforeAdam) {
  // A 4 MiB temporary inside the forward on a 1 MiB device: the step's trace check rejects it
  // before any weight changes, and the engine trains on afterwards.
  Trainer run(config());
  const std::vector<at::Tensor> before = run.state();
  run.engine->zero_grad();
  at::Tensor l = run.loss(0, Failure::kBigTemporary);
  run.engine->backward(l);
  const std::string error = error_of([&] { run.engine->step(); });
  EXPECT_NE(error.find("non-model data"), std::string::npos) << error;
  EXPECT_NE(error.find("the step was not taken"), std::string::npos) << error;
  EXPECT_TRUE(same(run.state(), before)) << "Adam ran before the trace was checked";
  EXPECT_EQ(run.tensors_in_compute(), 0);
  const std::vector<double> clean = clean_losses(config(), 3);
  std::vector<double> losses;
  for (int s = 0; s < 3; ++s) losses.push_back(run.train_step(s));
  EXPECT_EQ(losses, clean);
}

INSTANTIATE_TEST_SUITE_P(Precisions, EngineRecovery,
                         ::testing::Values(R"({})", R"({"bf16": {"enabled": true}})",
                                           R"({"bf16": {"enabled": true},
                                               "gradient_accumulation_steps": 1,
                                               "optimizer": {"params": {"use_hybrid_adam": false}}})"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return std::string(info.index == 0   ? "fp32"
                                              : info.index == 1 ? "bf16"
                                                                : "bf16_host_adam");
                         });

// The same on the GPT of the model zoo with a device that forces moves every iteration: a dropped
// micro-batch in the middle of training leaves no trace behind. On the test device, as above.
class EngineRecoveryGpt : public test::OnTestDevice {};

TEST_F(EngineRecoveryGpt, DroppedMicroBatchWithMovesEveryIteration) {
  using namespace test;  // NOLINT: the shared helpers of gpt_training.h
  const std::vector<double> plain = train_plain(6);
  models::Gpt model = make_model(1);
  Engine engine(model.ptr(), tight_config());
  std::vector<double> losses;
  for (int s = 0; s < 6; ++s) {
    auto batch = on_test_device(batch_of_step(s));
    engine.zero_grad();
    if (s == 2) {
      auto active = engine.activate();
      at::Tensor dropped = model->loss(batch.tokens, batch.targets);
    }
    at::Tensor loss;
    {
      auto active = engine.activate();
      loss = model->loss(batch.tokens, batch.targets);
    }
    engine.backward(loss);
    const IterationReport report = engine.step();
    if (s > 0) {
      EXPECT_GT(report.evictions, 0) << "step " << s;
    }
    losses.push_back(loss.item<double>());
  }
  EXPECT_LE(max_relative_difference(losses, plain), 1e-5);
  EXPECT_EQ(engine.retrace_count(), 0);
}

}  // namespace engine_recovery_test
}  // namespace patrickstar
