// Hybrid sharding (zero_optimization.shard_group_size, docs/design.md section 9): chunks sharded
// within groups of k ranks and replicated across them. Run as one process (ctest's discovered
// tests), under mpirun with 2 and 4 ranks, with 4 ranks in groups of 2 (distributed.mpi_4_ranks_
// hybrid, which runs every data parallel test that way), and on two test hosts of 2 ranks each
// (distributed.two_hosts, scripts/test-hosts). What only hybrid sharding has is tested here: the
// groups that form (explicit, the host's ranks by default, refused sizes), the model data per rank,
// and the gradients of several micro-batches summed over the replicas exactly once.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "distributed/data_parallel_helpers.h"
#include "distributed/ranks.h"
#include "engine/gpt_training.h"
#include "patrickstar/engine/engine_inspect.h"
#include "patrickstar/models/gpt.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar {
namespace hybrid_shard_test {

using namespace test;  // NOLINT: the shared helpers of the engine tests

std::string error_building(const Config& config) {
  models::Gpt model = make_model(1);
  try {
    Engine engine(model.ptr(), config, comm());
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "<no error>";
}

// tight_config with `extra`, its shard group size `value` whatever PATRICKSTAR_TEST_SHARD_GROUP
// says.
Config with_shard_group(const std::string& value, const std::string& extra = "{}") {
  Config config = tight_config(extra);
  nlohmann::json j;
  j["zero_optimization"]["shard_group_size"] = nlohmann::json::parse(value);
  config.shard_group_size = Config::from_json(j).shard_group_size;
  return config;
}

// The ranks the launcher started on this rank's host, as it says (Open MPI's mpirun, torchrun).
int ranks_on_this_host() {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE"}) {
    if (const char* local = std::getenv(name); local != nullptr) return std::atoi(local);
  }
  return ranks();
}

TEST(HybridShard, GroupsFormAsConfiguredAndBadSizesAreRefusedOnEveryRank) {
  // "world": plain ZeRO-3 whatever the hosts.
  {
    models::Gpt model = make_model(1);
    Engine engine(model.ptr(), with_shard_group("\"world\""), comm());
    EXPECT_EQ(engine.shard_group_size(), ranks());
  }
  // The default: the ranks of one host, when every host runs the same number of 2 or more (this
  // launcher's: each host the same, checked over the ranks), else the world.
  {
    const int here = ranks_on_this_host();
    const int fewest = -static_cast<int>(max_over_ranks(-here));
    const int most = static_cast<int>(max_over_ranks(here));
    const int expected = fewest == most && fewest >= 2 && fewest < ranks() ? fewest : ranks();
    models::Gpt model = make_model(1);
    Engine engine(model.ptr(), with_shard_group("0"), comm());
    EXPECT_EQ(engine.shard_group_size(), expected)
        << here << " rank(s) on this host, " << ranks() << " in all";
    if (me() == 0) {
      std::printf("default shard group: %d rank(s) (%d on this host, %d ranks)\n",
                  engine.shard_group_size(), here, ranks());
    }
  }
  if (ranks() == 1) {
    // One process has nothing to shard: a config written for many ranks runs as it is.
    models::Gpt model = make_model(1);
    Engine engine(model.ptr(), with_shard_group("2"), comm());
    EXPECT_EQ(engine.shard_group_size(), 1);
    return;
  }
  // A size that does not divide the ranks: the same error on every rank, before anything is sent
  // (the next collective finds every rank in step).
  const std::string error = error_building(with_shard_group(std::to_string(ranks() + 1)));
  EXPECT_NE(error.find("does not divide the " + std::to_string(ranks()) + " ranks"),
            std::string::npos)
      << error;
  EXPECT_EQ(max_over_ranks(1.0), 1.0);
}

// Groups of 2 of 4 ranks: 2 replicas. Model data per rank is 1/2 of the padded total; the
// all-gathers stay in the group (2 chunks each) and each owned chunk's gradients cross the
// replicas once per iteration, also with 2 micro-batches (the first leaves the group's sums at the
// owner). Training equals one process on the global batch.
TEST(HybridShard, TwoReplicasTrainAsOneProcessAndSumEachGradientOnce) {
  if (ranks() < 4 || ranks() % 2 != 0) {
    GTEST_SKIP() << "needs 4 or more ranks (an even number) for 2 replicas of groups; this run has "
                 << ranks();
  }
  const int k = ranks() / 2;
  for (const std::string& extra :
       std::vector<std::string>{"{}", R"({"gradient_accumulation_steps": 2})",
                                R"({"bf16": {"enabled": true}, "gradient_clipping": 0.05})"}) {
    // One row per rank and micro-batch; one process on all of them needs a larger device.
    nlohmann::json j = nlohmann::json::parse(extra);
    j["client"]["device"]["capacity_bytes"] = 4 << 20;
    const Config config = with_shard_group(std::to_string(k), j.dump());
    const int64_t rows = int64_t{ranks()} * config.gradient_accumulation_steps;
    const EngineRun run = train_gpt(config, 6, /*sharded=*/true, nullptr, rows);
    // bf16 rounds each rank's gradients to bf16 before the fp32 sums, one process its whole
    // batch's: 2^-9 apart by construction. There the reference is the same ranks sharded over the
    // whole world (ZeRO-3), whose per-rank gradients are the same; fp32 is held to one process.
    const bool bf16 = config.precision() == Precision::kBf16;
    const EngineRun one = bf16 ? train_gpt(with_shard_group("\"world\"", j.dump()), 6,
                                           /*sharded=*/true, nullptr, rows)
                               : train_gpt(config, 6, /*sharded=*/false, nullptr, rows);
    ASSERT_EQ(run.shard, k);
    const double losses = max_relative_difference(run.losses, one.losses);
    const double weights = weight_difference(run, one);
    const IterationReport& r = run.reports.back();
    if (me() == 0) {
      std::printf(
          "%s, %d ranks in 2 replicas of %d: losses %.3g and weights %.3g relative to %s"
          "; per iteration gather %lld bytes, reduce %lld, all-reduce %lld "
          "(formula %lld)\n",
          extra.c_str(), ranks(), k, losses, weights,
          bf16 ? "the same ranks sharded over the world" : "one process",
          static_cast<long long>(r.gather_bytes), static_cast<long long>(r.reduce_bytes),
          static_cast<long long>(r.all_reduce_bytes),
          static_cast<long long>(
              all_reduce_bytes_per_iteration(k, run.chunks_per_kind, run.chunk_elems)));
    }
    EXPECT_LE(losses, 1e-6) << extra;
    EXPECT_LE(weights, 1e-4) << extra;  // data_parallel_test.cpp's bound, and why
    EXPECT_EQ(r.all_reduce_bytes,
              all_reduce_bytes_per_iteration(k, run.chunks_per_kind, run.chunk_elems) +
                  (extra.find("accumulation") != std::string::npos ? 4 : 0))
        << extra << ": one loss check per micro-batch, the replicas' sums once";
    EXPECT_EQ(r.gather_bytes, r.group_gathers * k * run.param_chunk_bytes) << extra;
  }
}

// fp32 gradients accumulate in place at their owner, so with gradient_accumulation_steps 1 a
// second backward before the step would add the replicas' sums twice: refused, naming the key.
TEST(HybridShard, ASecondBackwardWithoutAccumulationIsRefusedWithFp32Gradients) {
  if (ranks() < 4 || ranks() % 2 != 0) {
    GTEST_SKIP() << "needs 4 or more ranks (an even number) for 2 replicas of groups; this run has "
                 << ranks();
  }
  models::Gpt model = make_model(1);
  Engine engine(model.ptr(), with_shard_group(std::to_string(ranks() / 2)), comm());
  const auto batch = batch_of_step(0);
  engine.zero_grad();
  for (int pass = 0; pass < 2; ++pass) {
    at::Tensor loss;
    {
      auto active = engine.activate();
      loss = model->loss(my_rows(batch.tokens), my_rows(batch.targets));
    }
    if (pass == 0) {
      engine.backward(loss);
      continue;
    }
    try {
      engine.backward(loss);
      ADD_FAILURE() << "a second backward was taken";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find("gradient_accumulation_steps"),
                std::string::npos)
          << e.what_without_backtrace();
    }
  }
  EXPECT_EQ(max_over_ranks(1.0), 1.0);  // every rank is still in step
}

}  // namespace hybrid_shard_test
}  // namespace patrickstar
