// The delayed parameter update (zero_optimization.delayed_param_update): past its warm-up, each
// step's update runs while the next iteration's forward and backward read the weights from before
// it (one step stale). Measured against plain LibTorch applying the same stale-by-one update: a
// master model stepped by torch::optim::Adam and a forward copy that gets the master's weights
// just before each delayed step. The stale trajectory must differ from plain training (else these
// tests would prove nothing), and anything that reads the weights must see the update written in.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <string>
#include <vector>

#include "error_message.h"
#include "gpt_training.h"
#include "patrickstar/patrickstar.h"
#include "small_net.h"

namespace patrickstar {
namespace delayed_update_test {

using test::compute_loss;
using test::error_of;
using test::Net;
using test::plain_adam;
using test::seeded_net;
using test::small_device;

class DelayedParamUpdate : public test::OnTestDevice {};

double evaluate(Net& model) {
  torch::NoGradGuard no_grad;
  return compute_loss(model, 99).item<double>();
}

struct Trajectory {
  std::vector<double> losses;
  std::vector<double> metrics;      // an evaluation between each training forward and its backward
  std::vector<at::Tensor> weights;  // after the last update
};

void copy_weights(Net& from, Net& to) {
  torch::NoGradGuard no_grad;
  auto source = from->parameters();
  auto target = to->parameters();
  for (size_t k = 0; k < source.size(); ++k) target[k].copy_(source[k]);
}

std::vector<at::Tensor> weights_of(Net& net) {
  std::vector<at::Tensor> weights;
  for (const at::Tensor& p : net->parameters()) weights.push_back(p.detach().cpu().clone());
  return weights;
}

// Plain LibTorch. Steps from `delay_from` on are delayed: the forward copy gets the master's
// weights (the last update's) before the master steps, so the next forward reads them one step
// stale. delay_from >= steps: plain training. max_norm > 0: clip_grad_norm_ on the gradients the
// update reads (the engine's gradient_clipping).
Trajectory reference(int steps, int delay_from, double max_norm = 0.0) {
  Net master = seeded_net();
  Net forward = seeded_net();
  torch::optim::Adam adam = plain_adam(master->parameters());
  Trajectory t;
  for (int s = 0; s < steps; ++s) {
    forward->zero_grad();
    at::Tensor loss = compute_loss(forward, s);
    t.metrics.push_back(evaluate(forward));
    loss.backward();
    t.losses.push_back(loss.item<double>());
    auto from = forward->parameters();
    auto to = master->parameters();
    for (size_t k = 0; k < from.size(); ++k) to[k].mutable_grad() = from[k].grad().clone();
    if (max_norm > 0) torch::nn::utils::clip_grad_norm_(master->parameters(), max_norm);
    if (s >= delay_from) copy_weights(master, forward);
    adam.step();
    if (s < delay_from) copy_weights(master, forward);
  }
  t.weights = weights_of(master);
  return t;
}

Config delayed_config(int warmup, const std::string& extra = "{}") {
  nlohmann::json j = {
      {"zero_optimization",
       {{"delayed_param_update", true}, {"delayed_param_update_warmup_steps", warmup}}}};
  j.merge_patch(nlohmann::json::parse(extra));
  return small_device(j.dump());
}

double max_difference(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double worst = 0;
  for (size_t k = 0; k < a.size(); ++k) {
    worst = std::max(worst, (a[k] - b[k]).abs().max().item<double>());
  }
  return worst;
}

class DelayedVsReference : public DelayedParamUpdate,
                           public ::testing::WithParamInterface<std::tuple<int, double>> {};

TEST_P(DelayedVsReference, TrainsAsPlainLibTorchWithTheSameStaleByOneUpdate) {
  const auto [warmup, max_norm] = GetParam();
  constexpr int kSteps = 10;
  // The first iteration records the memory trace: its step is never delayed.
  const int delay_from = std::max(warmup, 1);
  const Trajectory expected = reference(kSteps, delay_from, max_norm);
  const Trajectory plain = reference(kSteps, kSteps, max_norm);

  Net net = seeded_net();
  std::vector<double> losses;
  {
    const std::string clip = "{\"gradient_clipping\": " + std::to_string(max_norm) + "}";
    auto [model, optimizer] =
        initialize_engine([&] { return net; }, 0, delayed_config(warmup, clip));
    for (int s = 0; s < kSteps; ++s) {
      optimizer.zero_grad();
      at::Tensor loss = compute_loss(net, s);
      loss.backward();
      const IterationReport report = optimizer.step();
      losses.push_back(loss.item<double>());
      EXPECT_EQ(report.update_delayed, s >= delay_from) << "step " << s;
      if (report.update_delayed) {
        // Copies of every gradient and fp32 weight (the model's 676 elements, 4 bytes each).
        EXPECT_EQ(report.delayed_update_buffer_bytes, 676 * 8) << "step " << s;
      }
      if (max_norm > 0 && s > delay_from) {
        EXPECT_GT(report.grad_norm, max_norm) << "the clipping must be active (step " << s << ")";
      }
    }
  }  // the engine goes: the model gets the weights of every update, the one in flight included
  double stale_vs_plain = 0;
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_NEAR(losses[s], expected.losses[s], 1e-6 * expected.losses[s]) << "step " << s;
    stale_vs_plain =
        std::max(stale_vs_plain, std::abs(expected.losses[s] - plain.losses[s]) / plain.losses[s]);
  }
  const double final_difference = max_difference(weights_of(net), expected.weights);
  std::printf(
      "delayed update (warm-up %d, clipping %g): final weights vs reference %.3g; the "
      "stale reference's losses differ from plain training's by up to %.3g (relative)\n",
      warmup, max_norm, final_difference, stale_vs_plain);
  EXPECT_LT(final_difference, 1e-5);
  EXPECT_GT(stale_vs_plain, 1e-3) << "the delayed steps must change the trajectory";
}

INSTANTIATE_TEST_SUITE_P(WarmupAndClipping, DelayedVsReference,
                         ::testing::Values(std::make_tuple(3, 0.0), std::make_tuple(0, 0.0),
                                           std::make_tuple(2, 0.05)));

// bf16: the forward copy in bf16 (its gradients, bf16, reach the fp32 master as they are; with
// accumulation each micro-batch's bf16 gradients of loss / passes are summed in fp32), the master
// fp32 with LibTorch's Adam, its weights rounded into the copy. `delay_from` as above.
at::Tensor bf16_loss(Net& model, int step) {
  const c10::Device device = model->fc1->weight.device();
  const at::Tensor out = model->forward(test::input_of(step).to(device, at::kBFloat16));
  return torch::mse_loss(out.to(at::kFloat), test::target_of(step).to(device));
}

Trajectory bf16_reference(int steps, int delay_from, int passes) {
  Net master = seeded_net();
  Net forward = seeded_net();
  forward->to(at::kBFloat16);
  torch::optim::Adam adam = plain_adam(master->parameters());
  Trajectory t;
  for (int s = 0; s < steps; ++s) {
    auto to = master->parameters();
    for (at::Tensor& p : to) p.mutable_grad() = torch::zeros_like(p);
    double loss = 0;
    for (int k = 0; k < passes; ++k) {
      forward->zero_grad();
      at::Tensor l = bf16_loss(forward, passes * s + k);
      (l / passes).backward();
      loss += l.item<double>();
      auto from = forward->parameters();
      for (size_t j = 0; j < from.size(); ++j)
        to[j].mutable_grad().add_(from[j].grad().to(at::kFloat));
    }
    t.losses.push_back(loss);
    if (s >= delay_from) copy_weights(master, forward);
    adam.step();
    if (s < delay_from) copy_weights(master, forward);
  }
  t.weights = weights_of(master);
  return t;
}

class DelayedBf16 : public DelayedParamUpdate, public ::testing::WithParamInterface<int> {};

TEST_P(DelayedBf16, TrainsAsPlainLibTorchWithTheSameStaleByOneUpdate) {
  // One pass per step: the gradients in the half slots, which get the weights back at hand-over.
  // Two: a gradient space (fp32) the update copies.
  const int passes = GetParam();
  constexpr int kSteps = 10;
  const Trajectory expected = bf16_reference(kSteps, 2, passes);
  const Trajectory plain = bf16_reference(kSteps, kSteps, passes);
  Net net = seeded_net();
  std::vector<double> losses;
  std::vector<at::Tensor> saved;
  {
    const std::string extra = R"({"bf16": {"enabled": true}, "gradient_accumulation_steps": )" +
                              std::to_string(passes) + "}";
    auto [model, optimizer] = initialize_engine([&] { return net; }, 0, delayed_config(2, extra));
    for (int s = 0; s < kSteps; ++s) {
      optimizer.zero_grad();
      double loss = 0;
      for (int k = 0; k < passes; ++k) {
        at::Tensor l = bf16_loss(net, passes * s + k);
        l.backward();
        loss += l.item<double>();
      }
      const IterationReport report = optimizer.step();
      losses.push_back(loss);
      EXPECT_EQ(report.update_delayed, s >= 2) << "step " << s;
      if (report.update_delayed) {
        // bf16 copies of the gradients (2 bytes per element), or fp32 ones and the half weights
        // HybridAdam writes (6) with a gradient space.
        EXPECT_EQ(report.delayed_update_buffer_bytes, 676 * (passes == 1 ? 2 : 6)) << "step " << s;
      }
    }
    for (const auto& [name, value] : model.engine().fp32_state_dict()) saved.push_back(value);
  }
  // The reference's Adam is LibTorch's, ours the SIMD kernel: their fp32 masters may differ in the
  // last bit, which can flip a bf16 rounding now and then.
  double stale_vs_plain = 0;
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_NEAR(losses[s], expected.losses[s], 1e-3 * expected.losses[s]) << "step " << s;
    stale_vs_plain =
        std::max(stale_vs_plain, std::abs(expected.losses[s] - plain.losses[s]) / plain.losses[s]);
  }
  const double final_difference = max_difference(saved, expected.weights);
  std::printf(
      "delayed update in bf16 (%d pass%s): fp32 masters vs reference %.3g; the stale "
      "reference's losses differ from plain training's by up to %.3g (relative)\n",
      passes, passes == 1 ? "" : "es", final_difference, stale_vs_plain);
  EXPECT_LT(final_difference, 1e-3);
  EXPECT_GT(stale_vs_plain, 1e-2) << "the delayed steps must change the trajectory";
}

INSTANTIATE_TEST_SUITE_P(Passes, DelayedBf16, ::testing::Values(1, 2));

// gpt_tiny on a device that holds part of its model data (chunks move every iteration, while the
// update's thread runs), against plain LibTorch's AdamW with the same stale-by-one update.
std::vector<double> gpt_stale_reference(int steps, int delay_from) {
  models::Gpt master = test::make_model(1);
  models::Gpt forward = test::make_model(1);
  torch::optim::AdamW adamw(
      master->parameters(),
      torch::optim::AdamWOptions(3e-3).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.01));
  std::vector<double> losses;
  auto copy = [&] {
    torch::NoGradGuard no_grad;
    auto from = master->parameters();
    auto to = forward->parameters();
    for (size_t k = 0; k < from.size(); ++k) to[k].copy_(from[k]);
  };
  for (int s = 0; s < steps; ++s) {
    auto batch = test::batch_of_step(s);
    forward->zero_grad();
    at::Tensor loss = forward->loss(batch.tokens, batch.targets);
    loss.backward();
    losses.push_back(loss.item<double>());
    auto from = forward->parameters();
    auto to = master->parameters();
    for (size_t k = 0; k < from.size(); ++k) to[k].mutable_grad() = from[k].grad().clone();
    if (s >= delay_from) copy();
    adamw.step();
    if (s < delay_from) copy();
  }
  return losses;
}

struct GptCase {
  const char* name;
  const char* extra;
  bool checkpointed;
};

class DelayedGpt : public DelayedParamUpdate, public ::testing::WithParamInterface<GptCase> {};

TEST_P(DelayedGpt, TrainsAsPlainLibTorchWithTheSameStaleByOneUpdateWhileChunksMove) {
  const GptCase c = GetParam();
  constexpr int kSteps = 8;
  const std::vector<double> expected = gpt_stale_reference(kSteps, 2);
  const std::vector<double> plain = test::train_plain(kSteps);
  nlohmann::json extra = nlohmann::json::parse(c.extra);
  extra["zero_optimization"]["delayed_param_update"] = true;
  extra["zero_optimization"]["delayed_param_update_warmup_steps"] = 2;
  models::Gpt model = test::make_model(1, c.checkpointed);
  std::vector<double> losses;
  int64_t evictions = 0;
  {
    Engine engine(model.ptr(), test::tight_config(extra.dump()));
    for (int s = 0; s < kSteps; ++s) {
      double loss = 0;
      const IterationReport report = test::train_step(engine, model, s, &loss);
      losses.push_back(loss);
      EXPECT_EQ(report.update_delayed, s >= 2) << c.name << ", step " << s;
      if (report.update_delayed) evictions += report.evictions;
    }
  }
  EXPECT_GT(evictions, 0) << c.name << ": chunks must move while the update runs";
  EXPECT_LE(test::max_relative_difference(losses, expected), 1e-5) << c.name;
  EXPECT_GT(test::max_relative_difference(expected, plain), 1e-4)
      << "the delayed steps must change the trajectory";
}

INSTANTIATE_TEST_SUITE_P(
    Configurations, DelayedGpt,
    ::testing::Values(GptCase{"tight device", "{}", false},
                      GptCase{"CPU embedding", R"({"use_cpu_embedding": true})", false},
                      GptCase{"checkpointed",
                              R"({"client": {"device": {"capacity_bytes": 1500000}}})", true}),
    [](const ::testing::TestParamInfo<GptCase>& info) {
      std::string name = info.param.name;
      for (char& ch : name) {
        if (ch == ' ') ch = '_';
      }
      return name;
    });

TEST_F(DelayedParamUpdate, AnEvaluationReadsTheWeightsOfTheLastStep) {
  // Each evaluation writes the update in flight in before it reads the weights, so the next
  // forward reads them too: with one after every step, training is plain LibTorch Adam's.
  constexpr int kSteps = 6;
  Net plain = seeded_net();
  torch::optim::Adam adam = plain_adam(plain->parameters());
  Net net = seeded_net();
  auto [model, optimizer] = initialize_engine([&] { return net; }, 0, delayed_config(1));
  for (int s = 0; s < kSteps; ++s) {
    adam.zero_grad();
    at::Tensor expected = compute_loss(plain, s);
    expected.backward();
    adam.step();
    optimizer.zero_grad();
    at::Tensor loss = compute_loss(net, s);
    loss.backward();
    const IterationReport report = optimizer.step();
    EXPECT_EQ(report.update_delayed, s >= 1) << "step " << s;
    EXPECT_NEAR(loss.item<double>(), expected.item<double>(), 1e-6 * expected.item<double>())
        << "step " << s;
    const double wanted = evaluate(plain);
    EXPECT_NEAR(evaluate(net), wanted, 1e-6 * wanted) << "step " << s;
  }
}

TEST_F(DelayedParamUpdate, AnEvaluationBetweenAForwardAndItsBackwardLeavesTheUpdateInFlight) {
  // A metric computed between the training forward and its backward reads the weights that
  // forward read: writing the update in there would give the backward other weights than its
  // activations came from. Training stays the stale reference's.
  constexpr int kSteps = 6;
  const Trajectory expected = reference(kSteps, 1);
  Net net = seeded_net();
  auto [model, optimizer] = initialize_engine([&] { return net; }, 0, delayed_config(1));
  for (int s = 0; s < kSteps; ++s) {
    optimizer.zero_grad();
    at::Tensor loss = compute_loss(net, s);
    const double metric = evaluate(net);
    loss.backward();
    optimizer.step();
    EXPECT_NEAR(loss.item<double>(), expected.losses[s], 1e-6 * expected.losses[s]) << "step " << s;
    EXPECT_NEAR(metric, expected.metrics[s], 1e-6 * expected.metrics[s]) << "step " << s;
  }
}

TEST_F(DelayedParamUpdate, CopiesTheHostCannotHoldAreRefusedAtTheStart) {
  // Net: 676 elements in two chunks of 600; fp32 keeps parameter, gradient, momentum and variance
  // chunks (19200 bytes); the update's copies would take 676 x 8 = 5408 more.
  Net net = seeded_net();
  const std::string error = error_of([&] {
    initialize_engine(
        [&] { return net; }, 0,
        delayed_config(1, R"({"client": {"device": {"host_capacity_bytes": 20000}}})"));
  });
  EXPECT_THAT(error, ::testing::HasSubstr("copies of 5408 bytes"));
  EXPECT_THAT(error, ::testing::HasSubstr("only 800 bytes beyond the model's chunks"));
}

TEST_F(DelayedParamUpdate, TheStateDictHoldsTheUpdateInFlight) {
  Net net = seeded_net();
  const Trajectory expected = reference(5, 1);
  auto [model, optimizer] = initialize_engine([&] { return net; }, 0, delayed_config(1));
  for (int s = 0; s < 5; ++s) {
    optimizer.zero_grad();
    compute_loss(net, s).backward();
    optimizer.step();
  }
  std::vector<at::Tensor> saved;
  for (const auto& [name, value] : model.engine().fp32_state_dict()) saved.push_back(value);
  EXPECT_LT(max_difference(saved, expected.weights), 1e-5);
}

TEST_F(DelayedParamUpdate, ConfigurationsItCannotRunAreRefused) {
  EXPECT_THAT(error_of([] { delayed_config(1, R"({"fp16": {"enabled": true}})"); }),
              ::testing::HasSubstr("loss scale would be decided a step late"));
  EXPECT_THAT(
      error_of([] { delayed_config(1, R"({"zero_optimization": {"overlap_step": true}})"); }),
      ::testing::HasSubstr("set one of them"));
  EXPECT_THAT(error_of([] {
                delayed_config(1, R"({"zero_optimization": {"offload_optimizer":
                                      {"device": "nvme", "nvme_path": "/tmp"}}})");
              }),
              ::testing::HasSubstr("keeps every optimizer state in memory"));
  EXPECT_THAT(
      error_of([] {
        Config::from_string(R"({"zero_optimization": {"delayed_param_update_warmup_steps": -1}})");
      }),
      ::testing::HasSubstr("delayed_param_update_warmup_steps"));
  EXPECT_THAT(error_of([] {
                Config::from_string(R"({"zero_optimization": {"overlap_step": true,
                    "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}})");
              }),
              ::testing::HasSubstr("runs without a disk tier"));
  const Config c = delayed_config(4);
  EXPECT_TRUE(Config::from_json(c.to_json()).delayed_update.enabled);
  EXPECT_EQ(Config::from_json(c.to_json()).delayed_update.warmup_steps, 4);
}

}  // namespace delayed_update_test
}  // namespace patrickstar
