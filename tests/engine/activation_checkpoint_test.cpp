// patrickstar::checkpoint and GptSpec::checkpoint_activations: the same numbers as without it, in
// plain LibTorch and through the engine (with evictions every iteration), and less non-model
// memory.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <iostream>

#include "gpt_training.h"
#include "patrickstar/engine/engine_inspect.h"
#include "patrickstar/models/gpt.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar {
namespace activation_checkpoint_test {

using models::Gpt;
using models::GptSpec;

using namespace test;  // NOLINT: the shared helpers of gpt_training.h

// On the emulated device, or on the CUDA engine with PATRICKSTAR_TEST_DEVICE=cuda.
class ActivationCheckpoint : public OnTestDevice {};

constexpr int kSteps = 20;

struct EngineRun {
  std::vector<double> losses;
  std::vector<IterationReport> reports;
  int64_t moments_per_iteration = 0;
  int64_t moments_checked = 0;  // moments after the warm-up, with the trace's non-model bytes
  int64_t moments_over = 0;     // of those, moments whose chunk + non-model bytes exceed the device
};

EngineRun train_engine(bool checkpointed, const Config& config, int steps) {
  Gpt model = make_model(1, checkpointed);
  Engine engine(model.ptr(), config);
  engine.set_record_timeline(true);  // read below
  EngineRun run;
  for (int s = 0; s < steps; ++s) {
    double loss = 0;
    run.reports.push_back(train_step(engine, model, s, &loss));
    run.losses.push_back(loss);
  }
  for (const MomentRecord& m : inspect(engine).scheduler().moment_records()) {
    if (m.non_model_bytes < 0) continue;
    ++run.moments_checked;
    if (m.chunk_bytes + m.non_model_bytes > config.device.capacity_bytes) ++run.moments_over;
  }
  run.moments_per_iteration = inspect(engine).tracer().warmup_trace().size();
  return run;
}

TEST_F(ActivationCheckpoint, RunsTheFunctionAgainInBackwardOnly) {
  torch::manual_seed(0);
  at::Tensor w = torch::randn({3, 3}, torch::requires_grad());
  at::Tensor x = torch::randn({2, 3}, torch::requires_grad());
  int calls = 0;
  auto fn = [&](const at::Tensor& h) {
    ++calls;
    return torch::tanh(torch::matmul(h, w)).sum(1);
  };
  at::Tensor y = checkpoint(fn, x);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(y.grad_fn()->name(), "patrickstar::CheckpointBackward");
  y.sum().backward();
  EXPECT_EQ(calls, 2);
  const at::Tensor x_grad = x.grad().clone(), w_grad = w.grad().clone();
  x.mutable_grad().reset();
  w.mutable_grad().reset();
  fn(x).sum().backward();
  EXPECT_TRUE(torch::allclose(x.grad(), x_grad, 1e-6, 0));
  EXPECT_TRUE(torch::allclose(w.grad(), w_grad, 1e-6, 0));

  // Evaluation, or an input that needs no gradient: a plain call.
  {
    torch::NoGradGuard no_grad;
    EXPECT_FALSE(checkpoint(fn, x).requires_grad());
  }
  EXPECT_EQ(checkpoint(fn, x.detach()).grad_fn()->name(), fn(x.detach()).grad_fn()->name());
  EXPECT_EQ(calls, 6);
}

TEST_F(ActivationCheckpoint, PlainLibTorchGptGivesTheSameLossAndGradients) {
  // Tolerance: 1e-6 relative. The recompute repeats the same kernels on the same values; only the
  // order in which a block input's two gradients (residual and LayerNorm path) are summed may
  // differ, which is fp32 rounding.
  Gpt plain = make_model(1, false);
  Gpt checkpointed = make_model(1, true);
  EXPECT_EQ(checkpointed->parameters().size(), plain->parameters().size());
  EXPECT_EQ(tiny(true).parameter_count(), tiny(false).parameter_count());
  auto batch = batch_of_step(0);
  at::Tensor loss_plain = plain->loss(batch.tokens, batch.targets);
  at::Tensor loss_checkpointed = checkpointed->loss(batch.tokens, batch.targets);
  loss_plain.backward();
  loss_checkpointed.backward();
  const double a = loss_checkpointed.item<double>(), b = loss_plain.item<double>();
  EXPECT_LE(std::abs(a - b) / std::abs(b), 1e-6);

  const auto expected = plain->named_parameters();
  double worst = 0;
  for (const auto& item : checkpointed->named_parameters()) {
    const at::Tensor& reference = expected[item.key()].grad();
    ASSERT_TRUE(item.value().grad().defined()) << item.key() << " got no gradient";
    const double scale = std::max(1e-12, reference.abs().max().item<double>());
    const double diff = (item.value().grad() - reference).abs().max().item<double>() / scale;
    EXPECT_LE(diff, 1e-6) << item.key();
    worst = std::max(worst, diff);
  }
  std::cout << "plain LibTorch: loss " << a << " vs " << b << ", max relative gradient difference "
            << worst << "\n";
}

TEST_F(ActivationCheckpoint, EngineFp32MatchesPlainLibTorchWithEvictionsEveryIteration) {
  // Checkpointing frees activation memory for chunks: the device is smaller than EngineTraining's
  // so that chunks are still evicted every iteration.
  const std::vector<double> plain = train_plain(kSteps);
  const EngineRun run = train_engine(
      /*checkpointed=*/true, tight_config(R"({"client": {"device": {"capacity_bytes": 1500000}}})"),
      kSteps);
  const double diff = max_relative_difference(run.losses, plain);
  EXPECT_LE(diff, 1e-5);
  EXPECT_LT(plain.back(), plain.front()) << "the reference must actually train";
  for (size_t i = 1; i < run.reports.size(); ++i) {
    EXPECT_GT(run.reports[i].evictions, 0) << "iteration " << i << " evicted nothing";
  }
  EXPECT_GT(run.moments_checked, (kSteps - 1) * run.moments_per_iteration / 2);
  EXPECT_EQ(run.moments_over, 0) << "resident chunks + measured non-model bytes fit the device";
  std::cout << "fp32 checkpointed through the engine: max relative loss difference " << diff
            << " over " << kSteps << " steps; evictions in the last iteration "
            << run.reports.back().evictions << "\n";
}

TEST_F(ActivationCheckpoint, LowersTheNonModelPeakTheEngineMeasures) {
  constexpr int kShortSteps = 3;  // the warm-up and two scheduled iterations
  const EngineRun full = train_engine(/*checkpointed=*/false, tight_config(), kShortSteps);
  const EngineRun dropped = train_engine(/*checkpointed=*/true, tight_config(), kShortSteps);
  const int64_t without = full.reports.back().non_model_peak_bytes;
  const int64_t with = dropped.reports.back().non_model_peak_bytes;
  std::cout << "non-model peak bytes, gpt_tiny batch " << kBatch << "x" << kSeq << ": without "
            << "checkpointing " << without << ", with " << with << " ("
            << static_cast<double>(with) / static_cast<double>(without) << "x); moments per "
            << "iteration " << full.moments_per_iteration << " -> " << dropped.moments_per_iteration
            << "\n";
  EXPECT_GT(without, 0);
  EXPECT_LT(with, without);
  // Each block's six doors come again in backward, as forward moments of the recompute.
  EXPECT_EQ(dropped.moments_per_iteration, full.moments_per_iteration + 6 * tiny(false).layers);
}

TEST_F(ActivationCheckpoint, Bf16TrainsThroughTheEngine) {
  // The bound of EngineTraining.Bf16TracksFp32WithinTwoPercent: bf16 rounding, not checkpointing.
  const std::vector<double> plain = train_plain(kSteps);
  const EngineRun run = train_engine(
      /*checkpointed=*/true,
      tight_config(
          R"({"bf16": {"enabled": true}, "client": {"device": {"capacity_bytes": 900000}}})"),
      kSteps);
  for (double loss : run.losses) EXPECT_TRUE(std::isfinite(loss));
  EXPECT_LT(run.losses.back(), run.losses.front());
  const double diff = max_relative_difference(run.losses, plain);
  EXPECT_LE(diff, 2e-2);
  std::cout << "bf16 checkpointed through the engine: max relative loss difference to fp32 " << diff
            << " over " << kSteps << " steps\n";
}

TEST_F(ActivationCheckpoint, EvaluationUnderTheEngineStaysTheEvaluationPath) {
  Gpt model = make_model(1, true);
  Engine engine(model.ptr(), tight_config());
  auto batch = on_test_device(batch_of_step(0));
  at::Tensor loss;
  {
    auto active = engine.activate();
    loss = model->loss(batch.tokens, batch.targets);
  }
  engine.backward(loss);
  engine.step();
  const MoveCounters before = inspect(engine).chunks().move_counters();
  const int64_t moments = inspect(engine).tracer().current_trace().size();
  {
    torch::NoGradGuard no_grad;
    auto active = engine.activate();
    loss = model->loss(batch.tokens, batch.targets);
  }
  EXPECT_FALSE(loss.requires_grad());
  EXPECT_TRUE(std::isfinite(loss.item<double>()));
  EXPECT_EQ(inspect(engine).chunks().move_counters().h2d_bytes, before.h2d_bytes) << "no chunk moved";
  EXPECT_EQ(inspect(engine).tracer().current_trace().size(), moments) << "no moment recorded";
}

}  // namespace activation_checkpoint_test
}  // namespace patrickstar
