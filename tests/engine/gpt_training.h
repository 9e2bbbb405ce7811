// Shared by the engine's training tests: the smallest GPT of the model zoo, its data, a config whose
// device holds only part of the model data, and the plain LibTorch reference run.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "patrickstar/engine/engine_inspect.h"
#include "patrickstar/models/gpt.h"
#include "patrickstar/patrickstar.h"
#include "test_device.h"

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

// Three batches in rotation, so the loss can fall within a few steps (`rows` of them).
inline models::TokenBatch batch_of_step(int step, int64_t rows = kBatch) {
  return models::random_tokens(tiny(), rows, kSeq, 100 + step % 3);
}

// A batch where the trainer puts it for the engine (the GPU under PATRICKSTAR_TEST_DEVICE=cuda).
inline models::TokenBatch on_test_device(models::TokenBatch batch) {
  if (!test_device().is_cpu()) {
    batch.tokens = batch.tokens.to(test_device());
    batch.targets = batch.targets.to(test_device());
  }
  return batch;
}

// Small chunks (so there are several) and a device that holds only part of the model data (on the
// test device: tests/test_device.h).
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
  Config config = Config::from_json(j);
  use_test_device(config);
  return config;
}

// One training step of `model` through `engine` on the batch of `step`: the forward under the
// engine's doors, backward, step. Returns the step's report; the loss goes to *loss when given.
inline IterationReport train_step(Engine& engine, models::Gpt& model, int step,
                                  double* loss = nullptr) {
  auto batch = on_test_device(batch_of_step(step));
  engine.zero_grad();
  at::Tensor out;
  {
    auto active = engine.activate();
    out = model->loss(batch.tokens, batch.targets);
  }
  engine.backward(out);
  IterationReport report = engine.step();
  if (loss != nullptr) *loss = out.item<double>();
  return report;
}

// The non-model peak (activations and temporaries, the most over the warm-up's moments and its
// tail) of one training step under tight_config(extra), the whole batch in one backward, on a device
// that holds everything, measured on this machine. It is not a constant across x86-64 CPUs: a bf16 matmul goes through oneDNN and
// its scratch buffers on a CPU with AVX512-BF16 and through ATen's own kernels elsewhere (bf16
// gpt_tiny needed 627716 bytes at one moment on an AMD EPYC with AVX512-BF16, where a fixed
// 700000-byte device had passed on an earlier machine). Tests that want a device "just big enough
// to force moves" size it from this figure.
inline int64_t non_model_peak_bytes(const std::string& extra = "{}") {
  Config config = tight_config(extra);
  config.device.capacity_bytes = int64_t{1} << 30;
  config.gradient_accumulation_steps = 1;  // the whole batch at once: at least a micro-batch's peak
  models::Gpt model = make_model(1);
  Engine engine(model.ptr(), config);
  train_step(engine, model, 0);
  const Trace& trace = inspect(engine).tracer().warmup_trace();
  int64_t peak = trace.tail_non_model_bytes;
  for (const Moment& moment : trace.moments) peak = std::max(peak, moment.non_model_bytes);
  return peak;
}

// tight_config(extra) with a device of the measured non-model peak plus `chunk_room` bytes for
// chunks: moves every iteration on every CPU, whatever its kernels allocate.
inline Config config_with_chunk_room(const std::string& extra, int64_t chunk_room) {
  Config config = tight_config(extra);
  config.device.capacity_bytes = non_model_peak_bytes(extra) + chunk_room;
  return config;
}

// The reference: plain LibTorch and torch::optim::AdamW (the same hyperparameters), fp32, on
// `model` (make_model(1) unless given: no checkpointing); `before_step(adamw, s)`, when given, runs
// before step s (a trainer's changes to the options). Returns the loss of every step.
inline std::vector<double> train_plain(
    int steps, models::Gpt model = nullptr,
    const std::function<void(torch::optim::Optimizer&, int)>& before_step = nullptr) {
  if (model.is_empty()) model = make_model(1);
  torch::optim::AdamW adamw(
      model->parameters(),
      torch::optim::AdamWOptions(3e-3).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.01));
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    auto batch = batch_of_step(s);
    if (before_step) before_step(adamw, s);
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
