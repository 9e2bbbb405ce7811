// Shared by the engine's training tests: the smallest GPT of the model zoo, its data, a config whose
// device holds only part of the model data, and the plain LibTorch reference run.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "patrickstar/models/gpt.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar::test {

inline constexpr int64_t kBatch = 4;
inline constexpr int64_t kSeq = 16;

inline models::GptSpec tiny(bool checkpointed = false) {
  models::GptSpec spec = models::gpt_spec("gpt_tiny");
  spec.checkpoint_activations = checkpointed;
  return spec;
}

// The same initial weights for a seed, checkpointed or not (the flag adds no parameter).
inline models::Gpt make_model(uint64_t seed = 1, bool checkpointed = false) {
  torch::manual_seed(seed);
  return models::Gpt(tiny(checkpointed));
}

// Three batches in rotation, so the loss can fall within a few steps.
inline models::TokenBatch batch_of_step(int step) {
  return models::random_tokens(tiny(), kBatch, kSeq, 100 + step % 3);
}

// Small chunks (so there are several) and a device that holds only part of the model data.
inline Config tight_config(const std::string& extra = "{}") {
  nlohmann::json j = {
      {"optimizer",
       {{"type", "AdamW"},
        {"params", {{"lr", 3e-3}, {"betas", {0.9, 0.95}}, {"eps", 1e-8}, {"weight_decay", 0.01}}}}},
      {"default_chunk_size", 40000},
      {"client",
       {{"device", {{"capacity_bytes", 1843200}}},
        {"mem_tracer", {{"warmup_gpu_chunk_mem_ratio", 0.7}, {"overall_gpu_mem_ratio", 1.0}}}}}};
  j.merge_patch(nlohmann::json::parse(extra));
  return Config::from_json(j);
}

// The reference: plain LibTorch and torch::optim::AdamW (the same hyperparameters), fp32, no
// checkpointing. Returns the loss of every step.
inline std::vector<double> train_plain(int steps) {
  models::Gpt model = make_model(1);
  torch::optim::AdamW adamw(
      model->parameters(),
      torch::optim::AdamWOptions(3e-3).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.01));
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    auto batch = batch_of_step(s);
    adamw.zero_grad();
    at::Tensor loss = model->loss(batch.tokens, batch.targets);
    loss.backward();
    adamw.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

inline double max_relative_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    worst = std::max(worst, std::abs(a[i] - b[i]) / std::max(1e-12, std::abs(b[i])));
  }
  return a.size() == b.size() ? worst : INFINITY;
}

}  // namespace patrickstar::test
