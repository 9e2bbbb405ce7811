// Data parallel through the engine (docs/design.md section 9), run as one process (ctest's
// discovered tests: world size 1) and under mpirun with 2 and 4 ranks (distributed.mpi_2_ranks,
// distributed.mpi_4_ranks: every test on every rank; a failing rank fails the run). Each rank trains
// on its rows of the global batch; the reference is plain LibTorch on the whole global batch, which
// every rank computes for itself.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "distributed/data_parallel_helpers.h"
#include "distributed/ranks.h"
#include "engine/gpt_training.h"
#include "engine/small_net.h"
#include "patrickstar/engine/engine_inspect.h"
#include "patrickstar/memtracer/simulator.h"
#include "patrickstar/models/gpt.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar {
namespace data_parallel_test {

using namespace test;  // NOLINT: the shared helpers of the engine tests

constexpr int kSteps = 20;

// fp32 weights after training, data parallel against one process: the ranks sum the gradient in
// another order (rounding, ~1e-7 relative), and Adam divides each update by sqrt(v), so where a
// gradient is small the rounding becomes a visible part of the step; over 20 steps it compounds to
// 1e-6..1.5e-5 relative per tensor, depending on the CPU's kernels (1.42e-5 on an AMD EPYC with
// AVX-512 at 4 ranks, under 1e-5 on an earlier machine). The bound leaves a CPU 7x that; the
// losses beside it are held to 1e-5.
constexpr double kWeightTolerance = 1e-4;

TEST(DataParallel, Fp32GptMatchesPlainLibTorchOnTheGlobalBatch) {
  const std::vector<double> plain = train_plain(kSteps);
  const EngineRun run = train_gpt(tight_config(), kSteps);
  const EngineRun one = train_gpt(tight_config(), kSteps, /*sharded=*/false);
  const double losses = max_relative_difference(run.losses, plain);
  const double losses_one = max_relative_difference(run.losses, one.losses);
  const double weights = weight_difference(run, one);
  if (me() == 0) {
    std::printf("fp32, %d rank(s), %d steps: max relative loss difference %.3g to plain LibTorch, "
                "%.3g to one process; weights %.3g to one process\n",
                ranks(), kSteps, losses, losses_one, weights);
  }
  EXPECT_LE(losses, 1e-5);
  EXPECT_LE(losses_one, 1e-5);
  EXPECT_LE(weights, kWeightTolerance);
  EXPECT_LT(run.losses.back(), run.losses.front());
  for (const IterationReport& r : run.reports) {
    EXPECT_GT(r.h2d_bytes, 0) << "iteration " << r.iteration << ": chunks move every iteration";
    if (ranks() > 1) {
      // The formula (docs/design.md section 9), whatever gathers the GPT's tied and shared uses
      // cost: every comm group reduced once per backward.
      EXPECT_GT(r.group_gathers, 0) << "iteration " << r.iteration;
      EXPECT_EQ(r.group_reduces, run.chunks_per_kind / run.shard) << "iteration " << r.iteration;
      EXPECT_EQ(r.gather_bytes, r.group_gathers * run.shard * run.param_chunk_bytes);
      EXPECT_EQ(r.reduce_bytes, r.group_reduces * run.shard * run.chunk_elems * 4);
      EXPECT_EQ(r.all_reduce_bytes,
                all_reduce_bytes_per_iteration(run.shard, run.chunks_per_kind, run.chunk_elems));
    }
  }
}

// The doors gather a comm group into one buffer of N param chunks on the device; the scheduler
// places only this rank's chunks (and the gradient chunks a backward fills), and its budgets leave
// room for the gathered buffers because the warm-up trace measured them as non-model bytes. So:
// gathered buffers on the device every iteration (N param chunks at least), no scheduled chunk is
// another rank's param chunk, chunks + non-model bytes within the capacity at every scheduled
// moment, and the traffic within 2% of the OPT bound of this rank's trace, as with one process.
TEST(DataParallel, GatheredGroupsSitOnTheDeviceInsideTheSchedulersBudget) {
  const Config config = tight_config();
  constexpr int kIterations = 10;
  TrafficBound bound;
  int64_t peak_device = 0;
  int64_t other_ranks_param_chunks_scheduled = 0;
  const EngineRun run = train_gpt(config, kIterations, /*sharded=*/true, [&](Engine& engine) {
    bound = opt_traffic_bound(inspect(engine).tracer().warmup_trace(), inspect(engine).scheduler().chunks(),
                              inspect(engine).scheduler().options());
    const ChunkStore& store = inspect(engine).chunks();
    for (const auto& entry : inspect(engine).scheduler().chunks()) {
      const int64_t index = store.index_of(entry.first);
      if (store.kind_of(entry.first) == ChunkKind::kParam && !inspect(engine).owns(index) &&
          !inspect(engine).host_only(index)) {
        ++other_ranks_param_chunks_scheduled;
      }
    }
    for (const IterationStats& stats : inspect(engine).scheduler().history()) {
      if (!stats.warmup) peak_device = std::max(peak_device, stats.peak_device_bytes);
    }
  });
  double traffic = 0;
  for (size_t i = 2; i < run.reports.size(); ++i) {
    traffic += static_cast<double>(run.reports[i].h2d_bytes + run.reports[i].d2h_bytes);
  }
  traffic /= static_cast<double>(run.reports.size() - 2);
  const double bound_bytes = static_cast<double>(bound.h2d_bytes + bound.d2h_bytes) /
                             static_cast<double>(std::max<int64_t>(1, bound.period_iterations));
  std::printf("rank %d of %d: traffic %.0f bytes per iteration, OPT bound %.0f (ratio %.4f); "
              "gathered buffers at most %lld bytes on the device; scheduled peak %lld of %lld\n",
              me(), ranks(), traffic, bound_bytes, traffic / std::max(1.0, bound_bytes),
              static_cast<long long>(run.reports.back().gathered_peak_bytes),
              static_cast<long long>(peak_device),
              static_cast<long long>(config.device.capacity_bytes));
  EXPECT_EQ(other_ranks_param_chunks_scheduled, 0);
  EXPECT_LE(peak_device, config.device.capacity_bytes);
  EXPECT_GT(bound_bytes, 0) << "the device should force moves";
  EXPECT_LE(traffic, 1.02 * bound_bytes);
  for (const IterationReport& r : run.reports) {
    if (ranks() == 1) {
      EXPECT_EQ(r.gathered_peak_bytes, 0);
      continue;
    }
    EXPECT_GE(r.gathered_peak_bytes, run.shard * run.param_chunk_bytes)
        << "iteration " << r.iteration;
    EXPECT_LE(r.gathered_peak_bytes, r.non_model_peak_bytes) << "iteration " << r.iteration;
    EXPECT_LE(r.device_chunk_peak_bytes, config.device.capacity_bytes);
  }
}

// CPU embeddings are sharded like the rest (their comm groups hold only embedding chunks, gathered
// and reduced on the host).
TEST(DataParallel, Fp32WithHybridAdamOffAccumulationAndCpuEmbeddingMatches) {
  const std::vector<double> plain = train_plain(kSteps / 2);
  for (const std::string extra : {R"({"optimizer": {"params": {"use_hybrid_adam": false}}})",
                                   R"({"gradient_accumulation_steps": 2})",
                                   R"({"use_cpu_embedding": true})"}) {
    if (ranks() == 4 && extra.find("accumulation") != std::string::npos) continue;  // 1 row each
    const EngineRun run = train_gpt(tight_config(extra), kSteps / 2);
    const EngineRun one = train_gpt(tight_config(extra), kSteps / 2, /*sharded=*/false);
    const double losses = max_relative_difference(run.losses, plain);
    if (me() == 0) {
      std::printf("%s, %d rank(s): max relative loss difference %.3g\n", extra.c_str(), ranks(),
                  losses);
    }
    EXPECT_LE(losses, 1e-5) << extra;
    EXPECT_LE(weight_difference(run, one), kWeightTolerance) << extra;
  }
}

// bf16 rounds weights, activations and gradients to 8 significant bits (2^-9 ~ 0.2% relative): as
// in one process (EngineTraining.Bf16TracksFp32WithinTwoPercent), the loss stays within 2% of the
// fp32 reference. The reduction sums the ranks' bf16 gradients in fp32, so sharding adds no
// rounding of its own beyond the per-rank gradients'.
TEST(DataParallel, Bf16TracksFp32WithinTwoPercent) {
  const std::vector<double> plain = train_plain(kSteps);
  const EngineRun run = train_gpt(
      tight_config(R"({"bf16": {"enabled": true}, "client": {"device": {"capacity_bytes": 1100000}}})"),
      kSteps);
  const double losses = max_relative_difference(run.losses, plain);
  if (me() == 0) {
    std::printf("bf16, %d rank(s): max relative loss difference to fp32 %.3g over %d steps\n",
                ranks(), losses, kSteps);
  }
  EXPECT_LE(losses, 0.02);
  EXPECT_LT(run.losses.back(), run.losses.front());
}

// bf16 optimizer states: each owner keeps its chunks' moments in bf16 and nothing of them crosses
// ranks, so N ranks train as one process with bf16 states does, and bf16 precision with bf16 states
// stays within 2% of fp32 training. The weights' bound is 10x the fp32 one: the ranks sum gradients
// in another order than one process (an ulp apart), and an ulp can move a moment to the
// neighbouring bf16 value, 2^-8 of it, where fp32 states differ by 2^-23 (measured: 2.8e-4 at 2
// ranks).
TEST(DataParallel, Bf16StatesTrainAsInOneProcess) {
  const Config config = tight_config(R"({"optimizer": {"params": {"state_dtype": "bf16"}}})");
  const EngineRun run = train_gpt(config, kSteps / 2);
  const EngineRun one = train_gpt(config, kSteps / 2, /*sharded=*/false);
  const double losses_one = max_relative_difference(run.losses, one.losses);
  const double weights = weight_difference(run, one);
  const std::vector<double> plain = train_plain(kSteps);
  const EngineRun mixed = train_gpt(
      tight_config(R"({"bf16": {"enabled": true}, "optimizer": {"params": {"state_dtype": "bf16"}},
                       "client": {"device": {"capacity_bytes": 1100000}}})"),
      kSteps);
  const double mixed_losses = max_relative_difference(mixed.losses, plain);
  if (me() == 0) {
    std::printf(
        "bf16 states, %d rank(s): fp32 losses within %.3g and weights within %.3g of one "
        "process; bf16 losses within %.3g of fp32 with fp32 states\n",
        ranks(), losses_one, weights, mixed_losses);
  }
  EXPECT_LE(losses_one, 1e-5);
  EXPECT_LE(weights, 10 * kWeightTolerance);
  EXPECT_LE(mixed_losses, 0.02);
  EXPECT_EQ(run.registration.model_data_bytes * 16,
            train_gpt(tight_config(), 0).registration.model_data_bytes * 12)
      << "2 + 2 bytes of moments instead of 4 + 4, on every rank";
}

// Each rank keeps the payloads of the chunk indices it owns: 1/N of the chunks, the chunk count
// padded to a multiple of N (per tensor group), so per rank = (one-rank bytes + padding) / N, where
// the one-rank figure counts its last index at full size (one process cuts it to what it holds;
// sharded chunks keep one size).
TEST(DataParallel, ModelDataPerRankIsTheShareOfTheOneRankFigurePlusPadding) {
  for (const char* extra : {"{}", R"({"bf16": {"enabled": true}})",
                            R"({"default_chunk_size": 70000})"}) {
    const Config config = tight_config(extra);
    models::Gpt one = make_model(1);
    Engine single(one.ptr(), config);  // one process, whatever the launcher started
    models::Gpt many = make_model(1);
    Engine sharded(many.ptr(), config, comm());
    const int64_t chunks_one = inspect(single).chunks().chunks_per_kind();
    const int64_t chunks_many = inspect(sharded).chunks().chunks_per_kind();
    const int k = sharded.shard_group_size();  // N unless hybrid sharding
    EXPECT_EQ(chunks_many % k, 0);
    EXPECT_GE(chunks_many, chunks_one);
    EXPECT_LT(chunks_many, chunks_one + 2 * k);  // at most k - 1 per tensor group (1 here)
    int64_t per_index = 0;  // every kind's chunk of a full index
    int64_t cut = 0;        // what one process saves on its last index
    const ChunkStore& store = inspect(single).chunks();
    for (int k = 0; k < kChunkKindCount; ++k) {
      const auto kind = static_cast<ChunkKind>(k);
      if (!store.has_kind(kind)) continue;
      per_index += store.chunk_bytes(store.chunk_id(kind, 0));
      cut += store.chunk_bytes(store.chunk_id(kind, 0)) -
             store.chunk_bytes(store.chunk_id(kind, chunks_one - 1));
    }
    EXPECT_EQ(single.registration().model_data_bytes, chunks_one * per_index - cut) << extra;
    const int64_t padding = (chunks_many - chunks_one) * per_index;
    const int64_t sharded_cut = ranks() > 1 ? 0 : cut;  // one rank is one process: it cuts too
    EXPECT_EQ(sharded.registration().model_data_bytes * k,
              single.registration().model_data_bytes + cut - sharded_cut + padding)
        << extra;
    EXPECT_EQ(sharded.registration().model_data_bytes, chunks_many / k * per_index - sharded_cut)
        << extra;
    if (me() == 0) {
      std::printf(
          "%s: model data %lld bytes in one process, %lld per rank with %d ranks in "
          "shard groups of %d; formula (one-process bytes + cut + padding) / %d = %lld "
          "(padding %lld bytes)\n",
          extra, static_cast<long long>(single.registration().model_data_bytes),
          static_cast<long long>(sharded.registration().model_data_bytes), ranks(), k, k,
          static_cast<long long>(
              (single.registration().model_data_bytes + cut - sharded_cut + padding) / k),
          static_cast<long long>(padding));
    }
  }
}

}  // namespace data_parallel_test
}  // namespace patrickstar
