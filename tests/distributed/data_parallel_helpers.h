// What the data parallel test files share: this rank and the world, collectives over per-rank
// values, and a GPT trained through the engine on this rank's rows (or in one process on the whole
// global batch), with what the tests compare.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include "distributed/ranks.h"
#include "engine/gpt_training.h"
#include "patrickstar/engine/engine_inspect.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar::test {

inline int ranks() { return comm()->world_size(); }
inline int me() { return comm()->rank(); }

// A path under the test folder, the same on every rank (rank 0's pid): a checkpoint every rank
// writes its part of and reads.
inline std::string shared_path(const std::string& stem) {
  at::Tensor tag = at::full({1}, me() == 0 ? static_cast<double>(::getpid()) : 0.0, at::kDouble);
  comm()->broadcast(tag, 0);
  return ::testing::TempDir() + "/" + stem + std::to_string(tag.item<int64_t>()) + ".ckpt";
}

// The mean over ranks of a per-rank value (each rank's loss is the mean over its rows).
inline double mean_over_ranks(double value) {
  at::Tensor t = at::full({1}, value, at::kDouble);
  comm()->all_reduce(t, ReduceOp::kSum);
  return t.item<double>() / ranks();
}

// The bytes one iteration's all-reduces carry: the loss's finiteness (4) and the squared norm (8),
// and with hybrid sharding (`shard` < ranks()) each owned chunk's reduced gradients summed over
// the replicas once (chunk_elems x 4, chunks / shard of them).
inline int64_t all_reduce_bytes_per_iteration(int shard, int64_t chunks, int64_t chunk_elems) {
  return 4 + 8 + (shard < ranks() ? chunks / shard * chunk_elems * 4 : 0);
}

inline double max_over_ranks(double value) {
  at::Tensor t = at::full({1}, value, at::kDouble);
  comm()->all_reduce(t, ReduceOp::kMax);
  return t.item<double>();
}

// One step through `engine` on this rank's rows of a global batch (`sharded`) or on all of it, as
// a LibTorch loop writes it; `loss` gets the loss this rank computed.
template <class Model>
IterationReport train_step(Engine& engine, Model& model, const at::Tensor& tokens,
                           const at::Tensor& targets, bool sharded, at::Tensor& loss) {
  engine.zero_grad();
  {
    auto active = engine.activate();
    loss = sharded ? model->loss(my_rows(tokens), my_rows(targets)) : model->loss(tokens, targets);
  }
  engine.backward(loss);
  return engine.step();
}

// Steps [from, to) of the GPT batches through `engine`: on this rank's rows (`sharded`; the loss is
// the mean over ranks, the global batch's) or on the whole global batch in one process.
inline std::vector<double> train_steps(Engine& engine, models::Gpt& model, int from, int to,
                                       bool sharded,
                                       std::vector<IterationReport>* reports = nullptr) {
  std::vector<double> losses;
  for (int s = from; s < to; ++s) {
    auto batch = on_test_device(batch_of_step(s));
    at::Tensor loss;
    const IterationReport report =
        train_step(engine, model, batch.tokens, batch.targets, sharded, loss);
    if (reports != nullptr) reports->push_back(report);
    losses.push_back(sharded ? mean_over_ranks(loss.item<double>()) : loss.item<double>());
  }
  return losses;
}

struct EngineRun {
  std::vector<double> losses;  // the global batch's loss (mean over ranks)
  std::vector<IterationReport> reports;
  std::vector<std::pair<std::string, at::Tensor>> weights;  // fp32, at the end
  RegistrationReport registration;
  int64_t chunks_per_kind = 0;
  int64_t chunk_elems = 0;
  int64_t param_chunk_bytes = 0;
  int shard = 1;  // the ranks a chunk is sharded over (ranks() unless hybrid sharding)
};

// The engine on this rank's rows (`sharded`; else one process on the whole global batch of
// `rows`); gradient_accumulation_steps micro-batches per step split those rows further.
inline EngineRun train_gpt(const Config& config, int steps, bool sharded = true,
                           const std::function<void(Engine&)>& at_end = nullptr,
                           int64_t rows = kBatch) {
  // Every rank builds its model from another seed: the engine starts all of them from rank 0's.
  models::Gpt model = make_model(sharded ? 1 + static_cast<uint64_t>(me()) * 17 : 1);
  auto engine = sharded ? std::make_shared<Engine>(model.ptr(), config, comm())
                        : std::make_shared<Engine>(model.ptr(), config);
  auto rows_of = [&](const at::Tensor& global) { return sharded ? my_rows(global) : global; };
  EngineRun run;
  run.registration = engine->registration();
  const ChunkStore& store = inspect(*engine).chunks();
  run.chunks_per_kind = store.chunks_per_kind();
  run.chunk_elems = store.chunk_elems();
  run.param_chunk_bytes = store.chunk_bytes(store.chunk_id(ChunkKind::kParam, 0));
  run.shard = engine->shard_group_size();
  const int micro = config.gradient_accumulation_steps;
  for (int s = 0; s < steps; ++s) {
    auto batch = on_test_device(batch_of_step(s, rows));
    const at::Tensor tokens = rows_of(batch.tokens);
    const at::Tensor targets = rows_of(batch.targets);
    const int64_t rows = tokens.size(0) / micro;
    engine->zero_grad();
    double loss_sum = 0;
    for (int k = 0; k < micro; ++k) {
      at::Tensor loss;
      {
        auto active = engine->activate();
        loss = model->loss(tokens.narrow(0, k * rows, rows), targets.narrow(0, k * rows, rows));
      }
      engine->backward(loss);
      loss_sum += loss.item<double>();
    }
    run.reports.push_back(engine->step());
    run.losses.push_back(sharded ? mean_over_ranks(loss_sum / micro) : loss_sum / micro);
  }
  run.weights = engine->fp32_state_dict();
  if (at_end) at_end(*engine);
  return run;
}

// The largest relative difference ||a - b|| / ||b|| over the parameters. The key third of each
// attention's qkv.bias is left out: a bias on the keys adds the same q.b to every score of a row,
// which softmax ignores, so its gradient is zero up to rounding, and Adam turns that rounding noise
// into full +-lr steps whose signs depend on the summation order (one process against plain
// LibTorch differs there as much). PS_DEBUG_WEIGHTS=1 prints every parameter.
inline double weight_difference(const EngineRun& a, const EngineRun& b) {
  double worst = 0;
  for (size_t i = 0; i < a.weights.size(); ++i) {
    const std::string& name = a.weights[i].first;
    at::Tensor x = a.weights[i].second.clone();
    at::Tensor y = b.weights[i].second.clone();
    if (name.size() > 8 && name.compare(name.size() - 8, 8, "qkv.bias") == 0) {
      const int64_t hidden = x.numel() / 3;
      x.narrow(0, hidden, hidden).zero_();
      y.narrow(0, hidden, hidden).zero_();
    }
    const double d = ((x - y).norm() / y.norm().clamp_min(1e-12)).item<double>();
    if (std::getenv("PS_DEBUG_WEIGHTS") != nullptr) std::printf("%s %.3g\n", name.c_str(), d);
    worst = std::max(worst, d);
  }
  return worst;
}

}  // namespace patrickstar::test
