// "plan": "auto" under data parallel: every rank runs rank 0's chunk size and activations (a
// recompute's doors gather comm groups, so the ranks must run their calls alike), each with the
// step schedule and the Adam placement it chose for the indices it steps, and training computes
// what it computes without a plan. Run as one process (ctest's discovered tests) and under mpirun
// with 2 and 4 ranks (distributed.mpi_*_ranks).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "distributed/data_parallel_helpers.h"
#include "distributed/ranks.h"
#include "engine/gpt_training.h"
#include "patrickstar/models/gpt.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar {
namespace plan_data_parallel_test {

using namespace test;  // NOLINT: the shared helpers of the engine tests

struct PlanRun {
  std::vector<double> losses;
  PlanReport plan;
  ActivationPlanReport activations;
  std::string failed;  // the error of the step that failed
  int planned_at = -1;  // the step whose report holds the plan
};

// The tiny GPT of six checkpointed blocks at a 6 MiB device, "auto" activations; `extra` merged
// into the config. At step `fail_at` (0-based) the last rank's forward holds 16 MiB more than the
// device has (a CPU tensor: the emulated device's counting allocator sees it), so that every rank's
// step fails (the iteration is dropped and training goes on).
PlanRun train_with(const std::string& extra, int steps, int fail_at = -1) {
  models::GptSpec spec = tiny(/*checkpointed=*/true);
  spec.layers = 6;
  // Every rank builds from another seed: the engine starts all of them from rank 0's weights.
  torch::manual_seed(1 + 17 * static_cast<uint64_t>(me()));
  models::Gpt model(spec);
  Config config = tight_config(R"({"client": {"device": {"capacity_bytes": 6291456}},
                                   "activation_checkpointing": {"policy": "auto"}})");
  nlohmann::json j = config.to_json();
  j.merge_patch(nlohmann::json::parse(extra));
  config = Config::from_json(j);
  use_test_device(config);
  Engine engine(model.ptr(), config, comm());
  PlanRun run;
  for (int step = 0; step < steps; ++step) {
    auto batch = on_test_device(batch_of_step(step));
    const bool fail = step == fail_at;
    engine.zero_grad();
    at::Tensor loss;
    {
      auto active = engine.activate();
      loss = model->loss(my_rows(batch.tokens), my_rows(batch.targets));
      if (fail && me() == ranks() - 1) loss = loss + torch::ones({int64_t{1} << 22}).sum() * 0;
    }
    engine.backward(loss);
    if (!fail) {
      const IterationReport report = engine.step();
      if (run.planned_at < 0 && report.plan_decision.find("chosen: ") != std::string::npos) {
        run.planned_at = step;
      }
      run.losses.push_back(mean_over_ranks(loss.item<double>()));
      continue;
    }
    try {
      engine.step();
      ADD_FAILURE() << "rank " << me() << ": step " << step << " was taken";
    } catch (const c10::Error& e) {
      run.failed = e.what_without_backtrace();
    }
  }
  run.plan = engine.plan();
  run.activations = engine.activation_plan();
  return run;
}

std::string joined(const std::vector<std::string>& words) {
  std::string out;
  for (const std::string& w : words) out += (out.empty() ? "" : ",") + w;
  return out;
}

// The same number on every rank.
bool same_on_every_rank(double value) {
  return max_over_ranks(value) == -max_over_ranks(-value);
}

// A number for a text (equal texts, equal numbers), exact in a double.
double text_code(const std::string& text) {
  return static_cast<double>(std::hash<std::string>{}(text) % (uint64_t{1} << 52));
}

// The plan every rank made: after the same step, with one chunk size and one way per call on every
// rank (null, with the failures added, where there is none).
const PlanCandidateReport* one_plan(const PlanRun& planned) {
  EXPECT_TRUE(planned.plan.planned) << planned.plan.why;
  EXPECT_TRUE(same_on_every_rank(planned.planned_at))
      << "rank " << me() << ": " << planned.planned_at;
  if (!planned.plan.planned || planned.plan.chosen < 0) {
    ADD_FAILURE() << "rank " << me() << ": no plan: " << planned.plan.why;
    return nullptr;
  }
  const PlanCandidateReport& chosen =
      planned.plan.candidates[static_cast<size_t>(planned.plan.chosen)];
  EXPECT_TRUE(same_on_every_rank(static_cast<double>(chosen.chunk_elems)));
  const std::string activations = chosen.activations + ": " + joined(chosen.activation_calls);
  EXPECT_TRUE(same_on_every_rank(text_code(activations))) << "rank " << me() << ": " << activations;
  return &chosen;
}

// A kept call and a recomputed one compute the same thing (1e-5 relative, as the other
// checkpointing tests); the schedule and the placement change nothing.
void expect_losses_as(const PlanRun& planned, const PlanRun& reference) {
  ASSERT_EQ(planned.losses.size(), reference.losses.size());
  for (size_t i = 0; i < planned.losses.size(); ++i) {
    EXPECT_NEAR(planned.losses[i], reference.losses[i], 1e-5 * std::abs(reference.losses[i]))
        << "step " << i;
  }
}

TEST(PlanDataParallel, EveryRankRunsRankZerosActivationsAndTrainsAsWithoutAPlan) {
  constexpr int kSteps = 9;  // two warm-ups, the measured iteration, the plan's, its check
  // Ranks other than 0 move chunks synchronously (their copies exposed): each rank weighs the
  // schedules and placements on its own moves.
  const std::string moves =
      me() == 0 ? "{}" : R"({"client": {"scheduler": {"async_moves": false}}})";
  nlohmann::json extra = nlohmann::json::parse(moves);
  extra["plan"] = "auto";
  const PlanRun planned = train_with(extra.dump(), kSteps);
  extra["plan"] = "off";
  const PlanRun reference = train_with(extra.dump(), kSteps);

  const PlanCandidateReport* one = one_plan(planned);
  ASSERT_NE(one, nullptr);
  const PlanCandidateReport& chosen = *one;
  EXPECT_GE(planned.planned_at, 0);
  // The calls ran the ways every rank chose.
  const std::string activations = chosen.activations + ": " + joined(chosen.activation_calls);
  ASSERT_EQ(planned.activations.calls.size(), 6u);
  std::vector<std::string> ran;
  for (const ActivationCallPlan& c : planned.activations.calls) ran.push_back(c.choice);
  if (!chosen.activation_calls.empty()) {
    EXPECT_EQ(ran, chosen.activation_calls);
  }
  EXPECT_TRUE(same_on_every_rank(text_code(joined(ran))));
  if (ranks() > 1) {
    // Each rank chose among the candidates that run rank 0's activations (and where its check
    // planned again, among those that run the activations every rank runs); only rank 0 searched.
    const std::string why = planned.plan.replanned ? " ranks, with the activations they run"
                                                   : " ranks, with rank 0's activations";
    EXPECT_NE(planned.plan.why.find("data parallel over " + std::to_string(ranks()) + why),
              std::string::npos)
        << planned.plan.why;
    if (me() != 0) {
      EXPECT_EQ(planned.plan.activation_search.find("the per-call search weighed"),
                std::string::npos)
          << planned.plan.activation_search;
    }
  }
  expect_losses_as(planned, reference);
  if (me() == 0) {
    std::printf("%d rank(s), every rank running %s; rank 0's plan:\n%s", ranks(),
                activations.c_str(), planned.plan.text().c_str());
  }
}

TEST(PlanDataParallel, AStepThatFailsOnEveryRankBeforeThePlanDelaysItOnEveryRank) {
  // Step 1 (the second, 0-based) would record the trace the plan measures after; it fails on every
  // rank (the last rank's memory), and the ranks plan after a later one, together.
  constexpr int kSteps = 10;
  const PlanRun planned = train_with(R"({"plan": "auto"})", kSteps, /*fail_at=*/1);
  const PlanRun reference = train_with(R"({"plan": "off"})", kSteps, /*fail_at=*/1);
  EXPECT_NE(planned.failed.find("the step was not taken"), std::string::npos) << planned.failed;
  ASSERT_NE(one_plan(planned), nullptr);
  EXPECT_GT(planned.planned_at, 1);  // past the step that failed
  expect_losses_as(planned, reference);
}

TEST(PlanDataParallel, APlanOnSomeRanksOnlyIsRefusedOnEveryRank) {
  if (ranks() == 1) GTEST_SKIP() << "one process: nothing to agree on";
  // The ranks plan together (collectives after the measured iteration): "auto" on rank 0 alone
  // would leave it waiting for the others.
  try {
    train_with(me() == 0 ? R"({"plan": "auto"})" : R"({"plan": "off"})", 1);
    ADD_FAILURE() << "rank " << me() << ": the engine was built";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("\"plan\" is \"auto\" on some ranks"), std::string::npos)
        << e.what();
  }
}

}  // namespace plan_data_parallel_test
}  // namespace patrickstar
