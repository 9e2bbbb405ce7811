// Offloaded checkpoints and the activation plan ("activation_checkpointing"): offloading a
// checkpoint's saved input changes no number (bit for bit the plain recompute, fp32 and bf16, with
// and without the copy queue, with the overlapped step, two engines in one loop), lowers the device
// peak by the inputs it takes away, gives its host blocks back every iteration, and "auto" plans
// every call and trains as LibTorch does.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "gpt_training.h"
#include "patrickstar/engine/engine_inspect.h"
#include "patrickstar/memtracer/counting_allocator.h"
#include "patrickstar/models/gpt.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar {
namespace activation_offload_test {

using models::Gpt;
using models::GptSpec;
using namespace test;  // NOLINT: the shared helpers of gpt_training.h

constexpr int64_t kLayers = 6;  // gpt_tiny with more blocks: several inputs to take away

GptSpec six_blocks() {
  GptSpec spec = tiny(/*checkpointed=*/true);
  spec.layers = kLayers;
  return spec;
}

Gpt make_six(uint64_t seed = 1) {
  torch::manual_seed(seed);
  return Gpt(six_blocks());
}

std::string with_policy(const std::string& policy, const std::string& extra = "") {
  return "{\"activation_checkpointing\": {\"policy\": \"" + policy + "\"}" +
         (extra.empty() ? "" : ", " + extra) + "}";
}

// The non-model peak of one step of the six-block model, recomputing, on a device that holds it.
int64_t recompute_peak() {
  Config config = tight_config(with_policy("recompute"));
  config.device.capacity_bytes = int64_t{1} << 30;
  Gpt model = make_six();
  Engine engine(model.ptr(), config);
  return train_step(engine, model, 0).non_model_peak_bytes;
}

// A device that forces chunk moves every iteration whatever the policy: the recompute's peak plus
// room for a few chunks.
Config moving(const std::string& policy, const std::string& extra = "") {
  Config config = tight_config(with_policy(policy, extra));
  config.device.capacity_bytes = recompute_peak() + 640000;
  return config;
}

struct OffloadRun {
  std::vector<double> losses;
  std::vector<IterationReport> reports;
  std::vector<std::pair<std::string, at::Tensor>> weights;
  ActivationPlanReport plan;
  int64_t host_tier_after_warmup = -1;
  std::vector<int64_t>
      host_tier_reserved_peak;               // after each step: the most it held from the system
  std::vector<int64_t> cpu_allocator_bytes;  // LibTorch's CPU allocations live after each step
};

OffloadRun train(const Config& config, int steps) {
  Gpt model = make_six();
  Engine engine(model.ptr(), config);
  OffloadRun run;
  for (int s = 0; s < steps; ++s) {
    double loss = 0;
    run.reports.push_back(train_step(engine, model, s, &loss));
    run.losses.push_back(loss);
    run.host_tier_reserved_peak.push_back(inspect(engine).host_tier().peak_reserved_bytes());
    run.cpu_allocator_bytes.push_back(CountingCpuAllocator::installed()->live_bytes());
  }
  run.weights = engine.fp32_state_dict();
  run.plan = engine.activation_plan();
  return run;
}

void expect_bit_for_bit(const OffloadRun& a, const OffloadRun& b, const std::string& what) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_EQ(a.losses[i], b.losses[i]) << what << ": step " << i;
  }
  ASSERT_EQ(a.weights.size(), b.weights.size());
  for (size_t i = 0; i < a.weights.size(); ++i) {
    EXPECT_TRUE(torch::equal(a.weights[i].second, b.weights[i].second))
        << what << ": " << a.weights[i].first;
  }
}

int64_t input_bytes(const OffloadRun& run, int64_t call) {
  return run.plan.calls.at(static_cast<size_t>(call)).input_bytes;
}

TEST(ActivationOffload, EqualsThePlainRecomputeBitForBitInFp32AndBf16) {
  constexpr int kSteps = 4;
  // fp32 and bf16; synchronous moves (no copy queue); the overlapped step.
  for (const std::string extra :
       {"", R"("bf16": {"enabled": true})", R"("client": {"scheduler": {"async_moves": false}})",
        R"("bf16": {"enabled": true}, "client": {"scheduler": {"async_moves": false}})",
        R"("zero_optimization": {"overlap_step": true})"}) {
    {
      const OffloadRun recompute = train(moving("recompute", extra), kSteps);
      const OffloadRun offload = train(moving("offload", extra), kSteps);
      const std::string what = extra.empty() ? "fp32" : extra;
      expect_bit_for_bit(offload, recompute, what);
      ASSERT_EQ(offload.plan.calls.size(), static_cast<size_t>(kLayers)) << what;
      int64_t all_inputs = 0;
      for (int64_t c = 0; c < kLayers; ++c) {
        EXPECT_EQ(offload.plan.calls[c].choice, "offload");
        EXPECT_EQ(recompute.plan.calls[c].choice, "recompute");
        all_inputs += input_bytes(offload, c);
      }
      for (size_t i = 0; i < offload.reports.size(); ++i) {
        const IterationReport& r = offload.reports[i];
        EXPECT_GT(r.evictions + r.h2d_bytes, 0) << what << ": the device must force moves";
        // Every input is copied out; all but the last come back (backward takes the last one,
        // still on the device, first).
        EXPECT_EQ(r.activation_offload_bytes, all_inputs) << what << ", step " << i;
        EXPECT_EQ(r.activation_prefetch_bytes, all_inputs - input_bytes(offload, kLayers - 1));
        EXPECT_EQ(r.activation_host_bytes, 0) << "every host block is back at the step";
        EXPECT_GE(r.activation_host_peak_bytes, all_inputs - input_bytes(offload, kLayers - 1));
        EXPECT_EQ(recompute.reports[i].activation_offload_bytes, 0);
      }
      std::cout << what << ": offload equals recompute bit for bit over " << kSteps
                << " steps; offloaded " << offload.reports.back().activation_offload_bytes
                << " B per iteration\n";
    }
  }
}

TEST(ActivationOffload, LowersTheDevicePeakBelowRecomputeByTheInputsItTakesAway) {
  constexpr int kSteps = 3;
  const OffloadRun recompute = train(moving("recompute"), kSteps);
  const OffloadRun offload = train(moving("offload"), kSteps);
  const int64_t with_recompute = recompute.reports.back().non_model_peak_bytes;
  const int64_t with_offload = offload.reports.back().non_model_peak_bytes;
  // At the recompute's peak (the end of the forward, the first recomputes) every block's input is
  // on the device; offloading leaves the last two there (the last never leaves; the one before it
  // comes back while the last recomputes).
  int64_t away = 0;
  for (int64_t c = 0; c + 2 < kLayers; ++c) away += input_bytes(offload, c);
  EXPECT_GT(away, 0);
  EXPECT_LE(with_offload + away, with_recompute)
      << "offload's device peak must be below recompute's by the inputs it takes away";
  std::cout << "non-model peak: recompute " << with_recompute << " B, offload " << with_offload
            << " B (" << with_recompute - with_offload << " B lower; inputs away " << away
            << " B)\n";
}

TEST(ActivationOffload, HostMemoryReturnsToItsLevelAfterEveryIteration) {
  // 500 iterations: no offloaded input is left behind, and host memory does not grow.
  constexpr int kSteps = 500;
  const OffloadRun run = train(moving("offload"), kSteps);
  // No growth: the host tier held no more from the system by the last step than by step 100,
  // LibTorch's CPU allocations live after every step are the same bytes, and the offloaded inputs
  // hold nothing at any step.
  const int64_t level = run.host_tier_reserved_peak.at(100);
  const int64_t cpu_level = run.cpu_allocator_bytes.at(1);
  EXPECT_EQ(run.host_tier_reserved_peak.back(), level);
  for (int s = 1; s < kSteps; ++s) {
    ASSERT_EQ(run.cpu_allocator_bytes[s], cpu_level) << "step " << s;
    ASSERT_EQ(run.reports[s].activation_host_bytes, 0) << "step " << s;
    ASSERT_GT(run.reports[s].activation_offload_bytes, 0) << "step " << s;
    ASSERT_EQ(run.reports[s].activation_host_peak_bytes, run.reports[1].activation_host_peak_bytes);
  }
  std::cout << "host tier's most held from the system: " << level << " B after step 100, "
            << run.host_tier_reserved_peak.back() << " B after step " << kSteps
            << "; LibTorch's CPU allocations live after every step: " << cpu_level
            << " B; offloaded inputs' host peak per iteration "
            << run.reports.back().activation_host_peak_bytes << " B\n";
}

TEST(ActivationOffload, AutoKeepsEveryBlockWhereTheModelFitsAndPlansEveryCallWhereItDoesNot) {
  constexpr int kSteps = 6;
  // A device that holds everything: keeping costs no move and saves every recompute.
  Config roomy = tight_config(with_policy("auto"));
  roomy.device.capacity_bytes = int64_t{1} << 30;
  const OffloadRun fits = train(roomy, kSteps);
  ASSERT_TRUE(fits.plan.planned);
  EXPECT_TRUE(fits.reports[0].activation_plan_made);
  for (size_t i = 1; i < fits.reports.size(); ++i)
    EXPECT_FALSE(fits.reports[i].activation_plan_made);
  ASSERT_EQ(fits.plan.calls.size(), static_cast<size_t>(kLayers));
  for (const ActivationCallPlan& c : fits.plan.calls) {
    EXPECT_EQ(c.choice, "keep") << "call " << c.call;
    EXPECT_GT(c.kept_bytes, c.input_bytes) << "a block's activations outweigh its input";
    EXPECT_GT(c.forward_seconds, 0);
  }
  std::cout << fits.plan.text();

  // A device where moves are forced: what it chose fits.
  const OffloadRun moves = train(moving("auto"), kSteps);
  ASSERT_TRUE(moves.plan.planned);
  const ActivationCandidate& chosen = moves.plan.candidates.back();
  EXPECT_EQ(chosen.name, "chosen");
  EXPECT_TRUE(chosen.fits);
  std::cout << moves.plan.text();

  // Both train as plain LibTorch does (the recompute and the kept forward compute the same
  // thing; 1e-5 relative, as the other checkpointing tests).
  const std::vector<double> plain = train_plain(kSteps, make_six());
  EXPECT_LE(max_relative_difference(fits.losses, plain), 1e-5);
  EXPECT_LE(max_relative_difference(moves.losses, plain), 1e-5);
}

TEST(ActivationOffload, AutoActivationsThenTheRunPlanTrainAsLibTorch) {
  // "auto" activations plan after the warm-up and record the trace again; "plan": "auto" then
  // measures a scheduled iteration under that activation plan and plans the step on its trace.
  constexpr int kSteps = 8;
  Gpt model = make_six();
  Engine engine(model.ptr(), moving("auto", R"("plan": "auto")"));
  std::vector<double> losses;
  int activations_planned = -1;
  int run_planned = -1;
  for (int s = 0; s < kSteps; ++s) {
    double loss = 0;
    const IterationReport r = train_step(engine, model, s, &loss);
    losses.push_back(loss);
    if (r.activation_plan_made && activations_planned < 0) activations_planned = s;
    if (r.plan_decision.find("chosen: ") != std::string::npos && run_planned < 0) run_planned = s;
  }
  ASSERT_EQ(activations_planned, 0);
  ASSERT_GT(run_planned, activations_planned) << engine.plan().text();
  ASSERT_TRUE(engine.activation_plan().planned);
  ASSERT_GE(engine.plan().chosen, 0) << engine.plan().text();
  EXPECT_LE(max_relative_difference(losses, train_plain(kSteps, make_six())), 1e-5);
}

bool trains(const std::string& policy, int64_t capacity, int steps = 3) {
  Config config = tight_config(with_policy(policy));
  config.device.capacity_bytes = capacity;
  try {
    train(config, steps);
    return true;
  } catch (const c10::Error&) {
    return false;
  }
}

TEST(ActivationOffload, AutoTrainsOnADeviceWhereOnlyOffloadTrains) {
  // The least capacity recompute trains at (bisected to 4 KiB), less 16 KiB: offload takes 64 KiB
  // of inputs off the device at the recompute's peak, so it trains there and recompute does not.
  int64_t bad = recompute_peak(), good = bad + 4000000;
  ASSERT_FALSE(trains("recompute", bad));
  ASSERT_TRUE(trains("recompute", good));
  while (good - bad > 4096) {
    const int64_t mid = (good + bad) / 2;
    (trains("recompute", mid) ? good : bad) = mid;
  }
  const int64_t capacity = good - 16384;
  EXPECT_FALSE(trains("recompute", capacity));
  ASSERT_TRUE(trains("offload", capacity)) << "offload needs less device memory than recompute";
  EXPECT_TRUE(trains("auto", capacity, 6)) << "auto is refused where offload trains";
  std::cout << "at " << capacity << " B: recompute refused, offload and auto train (recompute "
            << "needs " << good << " B)\n";
}

// A model written the way LibTorch's examples write one, with its own checkpoint calls: layer i
// with options[i].
struct StackImpl : torch::nn::Module {
  explicit StackImpl(std::vector<std::optional<bool>> offload) : offload_(std::move(offload)) {
    for (size_t i = 0; i < offload_.size(); ++i) {
      layers.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(32, 32)));
    }
    head = register_module("head", torch::nn::Linear(32, 1));
  }
  at::Tensor forward(at::Tensor x, bool scale_in_place = false) {
    for (size_t i = 0; i < layers.size(); ++i) {
      const at::Tensor input = x;
      x = patrickstar::checkpoint(
          [fc = layers[i]](const at::Tensor& h) mutable {
            return torch::tanh(patrickstar::call(fc, h));
          },
          x, {.offload = offload_[i]});
      // After call 1's forward its input (call 0's output) changes: its backward must refuse.
      if (scale_in_place && i == 1) input.mul_(2);
    }
    return patrickstar::call(head, x);
  }
  std::vector<std::optional<bool>> offload_;
  std::vector<torch::nn::Linear> layers;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Stack);

struct StackRun {
  std::vector<double> losses;
  std::vector<IterationReport> reports;
};

StackRun train_stack(const std::vector<std::optional<bool>>& offload, int steps) {
  torch::manual_seed(3);
  Stack model(offload);
  Config config = tight_config(R"({"default_chunk_size": 2000})");
  config.device.capacity_bytes = int64_t{1} << 30;
  Engine engine(model.ptr(), config);
  StackRun run;
  for (int s = 0; s < steps; ++s) {
    torch::manual_seed(100 + s);
    at::Tensor x = torch::randn({8, 32}, torch::requires_grad());
    at::Tensor y = torch::randn({8, 1});
    engine.zero_grad();
    at::Tensor loss = torch::mse_loss(model->forward(x), y);
    engine.backward(loss);
    run.reports.push_back(engine.step());
    run.losses.push_back(loss.item<double>());
  }
  return run;
}

TEST(ActivationOffload, ACallsOwnOptionOffloadsUnnamedBlocksAlsoBesideRecomputedOnes) {
  const StackRun recomputed = train_stack({false, false, false, false}, 4);
  const StackRun offloaded = train_stack({true, true, true, true}, 4);
  // Offloaded calls between recomputed ones: each leaves the device when the next call's forward
  // is done, and comes back when the recompute after it in backward begins.
  const StackRun mixed = train_stack({true, false, true, false}, 4);
  const int64_t input = 8 * 32 * 4;  // each layer's input: [8, 32] fp32
  for (size_t i = 0; i < recomputed.losses.size(); ++i) {
    EXPECT_EQ(offloaded.losses[i], recomputed.losses[i]) << "step " << i;
    EXPECT_EQ(mixed.losses[i], recomputed.losses[i]) << "step " << i;
    EXPECT_EQ(recomputed.reports[i].activation_offload_bytes, 0);
    EXPECT_EQ(offloaded.reports[i].activation_offload_bytes, 4 * input);
    EXPECT_EQ(offloaded.reports[i].activation_prefetch_bytes, 3 * input) << "all but the last";
    EXPECT_EQ(mixed.reports[i].activation_offload_bytes, 2 * input);
    EXPECT_EQ(mixed.reports[i].activation_prefetch_bytes, 2 * input) << "both came back";
    EXPECT_EQ(mixed.reports[i].activation_host_bytes, 0);
  }
}

TEST(ActivationOffload, AnOffloadedInputModifiedInPlaceIsRefusedAtBackwardAsASavedOneIs) {
  for (const bool offload : {false, true}) {
    torch::manual_seed(3);
    Stack model(std::vector<std::optional<bool>>(3, offload));
    Config config = tight_config(R"({"default_chunk_size": 2000})");
    config.device.capacity_bytes = int64_t{1} << 30;
    Engine engine(model.ptr(), config);
    at::Tensor x = torch::randn({8, 32}, torch::requires_grad());
    at::Tensor loss = model->forward(x, /*scale_in_place=*/true).sum();
    try {
      engine.backward(loss);
      ADD_FAILURE() << "offload " << offload << ": the backward went on with a changed input";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("inplace operation"), std::string::npos) << e.what();
    }
  }
}

TEST(ActivationOffload, ConfigReadsThePolicyAndDeepSpeedsCpuCheckpointing) {
  EXPECT_EQ(Config::from_string("{}").activation_checkpointing.policy,
            ActivationPolicy::kRecompute);
  EXPECT_EQ(Config::from_string(R"({"activation_checkpointing": {"policy": "AUTO"}})")
                .activation_checkpointing.policy,
            ActivationPolicy::kAuto);
  EXPECT_EQ(Config::from_string(
                R"({"activation_checkpointing": {"cpu_checkpointing": true,
                    "partition_activations": false, "number_checkpoints": 4}})")
                .activation_checkpointing.policy,
            ActivationPolicy::kOffload);
  try {
    Config::from_string(R"({"activation_checkpointing": {"policy": "sometimes"}})");
    ADD_FAILURE() << "an unknown policy was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("activation_checkpointing.policy"), std::string::npos)
        << e.what();
  }
  const Config back = Config::from_json(
      Config::from_string(R"({"activation_checkpointing": {"policy": "none"}})").to_json());
  EXPECT_EQ(back.activation_checkpointing.policy, ActivationPolicy::kNone);
}

TEST(ActivationOffload, ConfigReadsThePinnedCallsOfAutoOnly) {
  const Config pinned = Config::from_string(
      R"({"activation_checkpointing": {"policy": "auto", "calls": ["keep", "Offload", "recompute"]}})");
  EXPECT_EQ(pinned.activation_checkpointing.calls,
            (std::vector<std::string>{"keep", "offload", "recompute"}));
  EXPECT_EQ(Config::from_json(pinned.to_json()).activation_checkpointing.calls,
            pinned.activation_checkpointing.calls);
  EXPECT_TRUE(Config::from_string("{}").activation_checkpointing.calls.empty());
  // (An empty list pins nothing, with any policy: what the plan writes for a whole-model way.)
  EXPECT_TRUE(
      Config::from_string(R"({"activation_checkpointing": {"policy": "none", "calls": []}})")
          .activation_checkpointing.calls.empty());
  const std::pair<const char*, const char*> refused[] = {
      {R"({"activation_checkpointing": {"policy": "recompute", "calls": ["keep"]}})",
       "unless \"policy\" is \"auto\""},
      {R"({"activation_checkpointing": {"calls": ["keep"]}})", "unless \"policy\" is \"auto\""},
      {R"({"activation_checkpointing": {"policy": "auto", "calls": ["keep", "sometimes"]}})",
       "activation_checkpointing.calls[1]"},
      {R"({"activation_checkpointing": {"policy": "auto", "calls": "keep"}})",
       "activation_checkpointing.calls: expected an array"}};
  for (const auto& [text, expected] : refused) {
    try {
      Config::from_string(text);
      ADD_FAILURE() << "accepted: " << text;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  }
}

}  // namespace activation_offload_test
}  // namespace patrickstar
