// Fine-tuning with low-rank adapters (LoRA): a GPT from the model zoo whose base is frozen and
// whose attention projections carry adapters (patrickstar::models::LoraAdapter), trained the way a
// LibTorch program trains it, then the same program through the engine.
//
// The plain program builds the model, leaves the base frozen (requires_grad false: the zoo does it
// when GptSpec::lora_rank is set; freeze_all_but_adapters does it for any model), gives AdamW the
// parameters that train, and loops: zero_grad, forward, backward, step. The port is the doors (the
// zoo's modules call patrickstar::call already) and initialize_engine, which takes the whole model:
// the frozen parameters are registered too (they are read in every forward and backward) and are
// never updated.
//
// The program trains 20 steps each way, in fp32, on an emulated device that holds less than the
// model data (chunks move every step), and exits non-zero when a loss or an adapter weight differs
// from the plain run by more than 1e-4 of max(|value|, 1e-3), when a frozen weight changed at all,
// or when an adapter did not train.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "patrickstar/models/gpt.h"
#include "patrickstar/models/lora.h"
#include "patrickstar/patrickstar.h"

namespace {

namespace models = patrickstar::models;

constexpr int kSteps = 20;
constexpr int64_t kBatch = 4;
constexpr double kLr = 1e-3;
constexpr double kWeightDecay = 0.01;

models::GptSpec lora_spec() {
  models::GptSpec spec = models::gpt_spec("gpt_tiny");
  spec.lora_rank = 4;
  spec.lora_alpha = 8.0;
  return spec;
}

struct Record {
  std::vector<double> losses;
  std::vector<std::pair<std::string, at::Tensor>> weights;  // every parameter after training
  std::vector<bool> trained;                                // requires_grad, per weight
  int64_t steps_with_moves = 0;  // steps after the warm-up that moved chunks (engine only)
  double bytes_per_param = 0;    // the engine's model data per parameter
  int64_t retraces = 0;          // traces re-recorded (engine only)
};

Record train(bool use_engine) {
  torch::manual_seed(7);
  const models::GptSpec spec = lora_spec();
  Record record;
  auto step_loop = [&](auto& model, torch::optim::Optimizer& optimizer) {
    for (int s = 0; s < kSteps; ++s) {
      const models::TokenBatch data = models::random_tokens(spec, kBatch, spec.max_seq, 100 + s);
      optimizer.zero_grad();
      at::Tensor loss = model->loss(data.tokens, data.targets);
      loss.backward();
      optimizer.step();
      record.losses.push_back(loss.item<double>());
    }
  };
  auto keep_weights = [&](torch::nn::Module& model) {
    for (const auto& p : model.named_parameters()) {
      record.weights.emplace_back(p.key(), p.value().detach().clone());
      record.trained.push_back(p.value().requires_grad());
    }
  };
  if (!use_engine) {
    models::Gpt model(spec);
    std::vector<at::Tensor> trainable;
    for (const at::Tensor& p : model->parameters()) {
      if (p.requires_grad()) trainable.push_back(p);
    }
    torch::optim::AdamW optimizer(trainable,
                                  torch::optim::AdamWOptions(kLr).weight_decay(kWeightDecay));
    step_loop(model, optimizer);
    keep_weights(*model);
    return record;
  }
  // 2 MiB of emulated device for the activations (about 1.5 MiB at the peak) and 138 K parameters
  // (2.3 MiB of model data in fp32, 0.55 MiB of it param chunks): the param chunks the forward and
  // backward read come and go every step.
  auto config = patrickstar::Config::from_string(
      R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.001, "weight_decay": 0.01}},
          "default_chunk_size": 32768,
          "client": {"device": {"capacity_bytes": 2097152}}})");
  auto [model, optimizer] = patrickstar::initialize_engine([&] { return models::Gpt(spec); },
                                                           /*local_rank=*/0, config);
  step_loop(model, optimizer);
  const patrickstar::Engine& engine = model.engine();
  for (const patrickstar::IterationReport& report : engine.history()) {
    if (report.iteration > 0 && report.h2d_bytes + report.d2h_bytes > 0) ++record.steps_with_moves;
  }
  record.bytes_per_param = engine.registration().model_data_bytes_per_param;
  record.retraces = engine.retrace_count();
  {
    patrickstar::GatheredParameters gathered(model.module(),
                                             patrickstar::GatheredParameters::Mode::kReadOnly);
    keep_weights(model.module());
  }
  return record;
}

double relative(double a, double b) {
  return std::abs(a - b) / std::max(std::abs(b), 1e-3);
}

}  // namespace

int main() {
  torch::set_num_threads(1);  // the same reduction order both ways
  const Record plain = train(false);
  const Record engine = train(true);
  if (plain.weights.size() != engine.weights.size()) {
    std::printf("FAILED: %zu parameters plain, %zu through the engine\n", plain.weights.size(),
                engine.weights.size());
    return 1;
  }
  double loss_diff = 0, adapter_diff = 0, frozen_diff = 0, adapter_moved = 0;
  int64_t frozen = 0, trained = 0;
  for (int s = 0; s < kSteps; ++s)
    loss_diff = std::max(loss_diff, relative(engine.losses[s], plain.losses[s]));
  models::Gpt initial = [] {
    torch::manual_seed(7);
    return models::Gpt(lora_spec());
  }();
  const auto start = initial->named_parameters();
  for (size_t i = 0; i < plain.weights.size(); ++i) {
    const at::Tensor& mine = engine.weights[i].second;
    const at::Tensor& theirs = plain.weights[i].second;
    const at::Tensor& before = start[plain.weights[i].first];
    if (engine.trained[i]) {
      trained += theirs.numel();
      const double scale = std::max(theirs.abs().max().item<double>(), 1e-3);
      adapter_diff = std::max(adapter_diff, (mine - theirs).abs().max().item<double>() / scale);
      adapter_moved = std::max(adapter_moved, (theirs - before).abs().max().item<double>());
    } else {
      frozen += theirs.numel();
      frozen_diff = std::max(frozen_diff, (mine - before).abs().max().item<double>());
    }
  }
  std::printf("LoRA on %s: %lld trained parameters (adapters, rank %lld), %lld frozen\n",
              lora_spec().name.c_str(), static_cast<long long>(trained),
              static_cast<long long>(lora_spec().lora_rank), static_cast<long long>(frozen));
  std::printf("losses %.4f -> %.4f (plain), %.4f -> %.4f (engine)\n", plain.losses.front(),
              plain.losses.back(), engine.losses.front(), engine.losses.back());
  std::printf(
      "engine vs plain: max relative difference %.3g in the losses, %.3g in the adapters; "
      "frozen weights moved by %.3g; adapters moved by up to %.3g\n",
      loss_diff, adapter_diff, frozen_diff, adapter_moved);
  std::printf(
      "engine: %.2f model-data bytes per parameter; %lld of %d steps after the warm-up "
      "moved chunks; traces re-recorded: %lld\n",
      engine.bytes_per_param, static_cast<long long>(engine.steps_with_moves), kSteps - 1,
      static_cast<long long>(engine.retraces));
  const bool ok = loss_diff <= 1e-4 && adapter_diff <= 1e-4 && frozen_diff == 0 &&
                  adapter_moved > 1e-4 && engine.steps_with_moves == kSteps - 1 &&
                  engine.retraces == 0 && trained > 0 && trained == lora_spec().trainable_count();
  std::printf("%s\n", ok ? "PASSED" : "FAILED");
  return ok ? 0 : 1;
}
