// Offloaded checkpoints and the activation plan under data parallel: offload equals the plain
// recompute bit for bit on every rank, and "auto" runs rank 0's plan on every rank (a recompute's
// doors gather comm groups, so the ranks must choose alike). Run as one process (ctest's
// discovered tests) and under mpirun with 2 and 4 ranks (distributed.mpi_*_ranks).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <string>
#include <vector>

#include "distributed/data_parallel_helpers.h"
#include "distributed/ranks.h"
#include "engine/gpt_training.h"
#include "patrickstar/models/gpt.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar {
namespace activation_offload_dp_test {

using namespace test;  // NOLINT: the shared helpers of the engine tests

struct PolicyRun {
  std::vector<double> losses;
  std::vector<std::pair<std::string, at::Tensor>> weights;
  ActivationPlanReport plan;
  int64_t offloaded = 0;
};

PolicyRun train_with(const std::string& policy, int steps) {
  models::GptSpec spec = tiny(/*checkpointed=*/true);
  spec.layers = 6;
  // Every rank builds from another seed: the engine starts all of them from rank 0's weights.
  torch::manual_seed(1 + 17 * static_cast<uint64_t>(me()));
  models::Gpt model(spec);
  const Config config = tight_config(R"({"client": {"device": {"capacity_bytes": 6291456}},
                       "activation_checkpointing": {"policy": ")" +
                                     policy + "\"}}");
  Engine engine(model.ptr(), config, comm());
  PolicyRun run;
  std::vector<IterationReport> reports;
  run.losses = train_steps(engine, model, 0, steps, /*sharded=*/true, &reports);
  run.weights = engine.fp32_state_dict();
  run.plan = engine.activation_plan();
  run.offloaded = reports.back().activation_offload_bytes;
  return run;
}

TEST(ActivationOffloadDp, OffloadEqualsRecomputeAndAutoRunsOnePlanOnEveryRank) {
  constexpr int kSteps = 4;
  const PolicyRun recompute = train_with("recompute", kSteps);
  const PolicyRun offload = train_with("offload", kSteps);
  const PolicyRun automatic = train_with("auto", kSteps);
  ASSERT_EQ(offload.losses.size(), recompute.losses.size());
  for (size_t i = 0; i < offload.losses.size(); ++i) {
    EXPECT_EQ(offload.losses[i], recompute.losses[i]) << "step " << i;
  }
  ASSERT_EQ(offload.weights.size(), recompute.weights.size());
  for (size_t i = 0; i < offload.weights.size(); ++i) {
    EXPECT_TRUE(torch::equal(offload.weights[i].second, recompute.weights[i].second))
        << offload.weights[i].first;
  }
  EXPECT_GT(offload.offloaded, 0);
  // One plan: every call's choice is rank 0's.
  ASSERT_TRUE(automatic.plan.planned);
  ASSERT_EQ(automatic.plan.calls.size(), 6u);
  for (const ActivationCallPlan& c : automatic.plan.calls) {
    const double code = c.choice == "keep" ? 0 : c.choice == "recompute" ? 1 : 2;
    EXPECT_EQ(max_over_ranks(code), -max_over_ranks(-code)) << "call " << c.call;
  }
  // The kept and the recomputed forward compute the same thing (1e-5 relative, as the other
  // checkpointing tests).
  for (size_t i = 0; i < automatic.losses.size(); ++i) {
    EXPECT_NEAR(automatic.losses[i], recompute.losses[i], 1e-5 * std::abs(recompute.losses[i]));
  }
  if (me() == 0) {
    std::printf(
        "%d rank(s): offload equals recompute bit for bit over %d steps (offloaded %lld B "
        "per iteration on rank 0); auto's plan, the same on every rank:\n%s",
        ranks(), kSteps, static_cast<long long>(offload.offloaded), automatic.plan.text().c_str());
  }
}

}  // namespace activation_offload_dp_test
}  // namespace patrickstar
