// "plan": "auto" in the engine: it plans after the first scheduled iteration, trains as plain
// LibTorch does (every exact candidate gives the same training; the delayed update, where the
// config allows it, trains as the config's own), keeps and prints its plan, checks it, writes it as
// a config that loads, and refuses what it cannot plan.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "error_message.h"
#include "gpt_training.h"

namespace patrickstar::plan_test {

using test::make_model;
using test::tight_config;
using test::train_step;
using ::testing::HasSubstr;

struct PlanRun {
  std::vector<double> losses;
  std::vector<std::string> decisions;  // IterationReport::plan_decision per step
  PlanReport plan;
};

PlanRun train(const Config& config, int steps) {
  models::Gpt model = make_model(1);
  Engine engine(model.ptr(), config);
  PlanRun run;
  for (int s = 0; s < steps; ++s) {
    double loss = 0;
    const IterationReport r = train_step(engine, model, s, &loss);
    run.losses.push_back(loss);
    run.decisions.push_back(r.plan_decision);
  }
  run.plan = engine.plan();
  return run;
}

TEST(PlanAuto, PlansAfterTheFirstScheduledIterationAndTrainsAsLibTorch) {
  const int steps = 8;
  const PlanRun planned =
      train(tight_config(R"({"plan": "auto", "plan_check_iterations": 2})"), steps);
  const PlanRun off = train(tight_config(), steps);
  const std::vector<double> reference = test::train_plain(steps);
  // Every candidate updates as the serial step does: the same bits as the config's own run.
  EXPECT_EQ(planned.losses, off.losses);
  EXPECT_LT(test::max_relative_difference(planned.losses, reference), 1e-6);

  const PlanReport& plan = planned.plan;
  ASSERT_TRUE(plan.planned);
  ASSERT_GE(plan.chosen, 0);
  ASSERT_LT(plan.chosen, static_cast<int>(plan.candidates.size()));
  double best = 1e30;
  for (const PlanCandidateReport& c : plan.candidates) {
    if (c.fits) best = std::min(best, c.predicted_step_seconds);
    EXPECT_TRUE(c.schedule == "serial" || c.schedule == "overlapped") << c.name;
    EXPECT_TRUE(c.adam == "margin" || c.adam == "host" || c.adam == "streamed") << c.name;
  }
  const PlanCandidateReport& chosen = plan.candidates[static_cast<size_t>(plan.chosen)];
  EXPECT_TRUE(chosen.fits);
  EXPECT_GT(chosen.predicted_step_seconds, 0);
  EXPECT_LE(chosen.predicted_step_seconds, best * 1.01);
  EXPECT_EQ(plan.predicted_step_seconds, chosen.predicted_step_seconds);
  EXPECT_THAT(plan.profile, HasSubstr("\"measured"));  // (", corrected" after a re-plan)
  // The device holds part of the model: every candidate moves chunks.
  EXPECT_GT(chosen.h2d_bytes, 0);
  EXPECT_GT(chosen.device_peak_bytes, 0);
  EXPECT_LE(chosen.device_peak_bytes, tight_config().device.capacity_bytes);

  // Step 0 is the warm-up, step 1 measured: its report carries the plan, with every candidate.
  EXPECT_TRUE(planned.decisions[0].empty());
  ASSERT_FALSE(planned.decisions[1].empty());
  for (const PlanCandidateReport& c : plan.candidates) {
    EXPECT_THAT(planned.decisions[1], HasSubstr(c.name));
  }
  EXPECT_THAT(planned.decisions[1], HasSubstr("chosen: " + chosen.name));
  // What planning took between the two iterations, said beside the candidates.
  EXPECT_GT(plan.planning_seconds, 0);
  EXPECT_THAT(planned.decisions[1],
              HasSubstr("for " + std::to_string(plan.candidates.size()) + " candidates"));
  // Two iterations on the plan, then its check (the iteration after a re-placement is a warm-up
  // and does not count).
  EXPECT_TRUE(plan.checked);
  EXPECT_GT(plan.measured_step_seconds, 0);
  const int check_step = static_cast<int>(
      std::find_if(planned.decisions.begin() + 2, planned.decisions.end(),
                   [](const std::string& d) { return !d.empty(); }) -
      planned.decisions.begin());
  ASSERT_LT(check_step, steps);
  EXPECT_THAT(planned.decisions[check_step], HasSubstr("median step"));

  // The plan as a config: it loads and pins the choice.
  const Config pinned = Config::from_string(plan.config_json());
  EXPECT_EQ(pinned.plan.mode, PlanMode::kOff);
  EXPECT_EQ(pinned.overlap_step.mode,
            chosen.schedule == "overlapped" ? OverlapMode::kOn : OverlapMode::kOff);
  EXPECT_EQ(pinned.optimizer.use_hybrid_adam, chosen.adam != "host");
  EXPECT_EQ(pinned.optimizer.stream_states, chosen.adam == "streamed");
  const PlanRun again = train(tight_config(nlohmann::json::parse(plan.config_json()).dump()), steps);
  EXPECT_EQ(again.losses, off.losses);
  EXPECT_FALSE(again.plan.planned);
}

// "default_chunk_size": "auto" with the plan: the device of tight_config() holds part of the model.
Config auto_size_config() {
  return tight_config(R"({"plan": "auto", "default_chunk_size": "auto"})");
}

std::vector<int64_t> sorted(std::vector<int64_t> v) {
  std::sort(v.begin(), v.end());
  return v;
}

TEST(PlanAuto, ThePredictedTraceOfTheEnginesOwnChunkSizeIsTheTraceItRuns) {
  models::Gpt model = make_model(1);
  Engine engine(model.ptr(), auto_size_config());
  train_step(engine, model, 0);  // the warm-up: the trace, the placement, the per-moment tensors
  const Trace& runs = inspect(engine).scheduler().trace();
  const std::optional<Trace> predicted =
      inspect(engine).plan_trace_of(engine.registration().chunk_elems);
  ASSERT_TRUE(predicted.has_value());
  ASSERT_EQ(predicted->size(), runs.size());
  for (int64_t m = 0; m < runs.size(); ++m) {
    const Moment& a = predicted->moments[static_cast<size_t>(m)];
    const Moment& b = runs.moments[static_cast<size_t>(m)];
    EXPECT_EQ(a.kind, b.kind) << m;
    EXPECT_EQ(a.label, b.label) << m;
    EXPECT_EQ(sorted(a.chunk_ids), sorted(b.chunk_ids)) << m << " " << b.label;
    EXPECT_EQ(sorted(a.host_chunk_ids), sorted(b.host_chunk_ids)) << m << " " << b.label;
    EXPECT_EQ(a.non_model_bytes, b.non_model_bytes) << m;
  }
  // The other sizes: smaller, each with a trace of the same moments.
  const std::vector<int64_t> sizes = inspect(engine).plan_chunk_sizes();
  ASSERT_FALSE(sizes.empty());
  for (int64_t size : sizes) {
    EXPECT_LT(size, engine.registration().chunk_elems);
    const std::optional<Trace> other = inspect(engine).plan_trace_of(size);
    ASSERT_TRUE(other.has_value()) << size;
    EXPECT_EQ(other->size(), runs.size());
  }
}

TEST(PlanAuto, EveryCandidateTheEngineConsidersTrainsAsLibTorch) {
  const int steps = 8;
  const PlanRun planned = train(auto_size_config(), steps);
  ASSERT_TRUE(planned.plan.planned);
  const std::vector<double> reference = test::train_plain(steps);
  EXPECT_LT(test::max_relative_difference(planned.losses, reference), 1e-6);
  std::set<int64_t> sizes;
  for (const PlanCandidateReport& c : planned.plan.candidates) sizes.insert(c.chunk_elems);
  EXPECT_GE(sizes.size(), 2u) << planned.plan.text();
  // Each candidate applied after the plan (the model moved into its chunks, its Adam placed, its
  // schedule set): the same training.
  for (int c = 0; c < static_cast<int>(planned.plan.candidates.size()); ++c) {
    const PlanCandidateReport& candidate = planned.plan.candidates[static_cast<size_t>(c)];
    if (!candidate.fits) continue;
    models::Gpt model = make_model(1);
    Config config = auto_size_config();
    config.plan.check_iterations = 1000;  // no check, no second plan: the candidate stays
    Engine engine(model.ptr(), config);
    std::vector<double> losses(steps);
    IterationReport last;
    for (int s = 0; s < steps; ++s) {
      last = train_step(engine, model, s, &losses[static_cast<size_t>(s)]);
      if (s == 1) {
        // From the settings the engine measured with (its own size, serial, the margin's
        // placement: candidate 0), whatever it chose on this machine, to the candidate.
        EngineInspector::apply_plan_candidate(engine, 0);
        EngineInspector::apply_plan_candidate(engine, c);
      }
    }
    EXPECT_EQ(losses, planned.losses) << candidate.name;
    EXPECT_EQ(engine.registration().chunk_elems, candidate.chunk_elems) << candidate.name;
    EXPECT_EQ(last.early_updates_allowed, candidate.schedule == "overlapped") << candidate.name;
    // The placement the engine decides is the one the candidate predicted (streamed: from the
    // step's non-model bytes it measures, the prediction's from the trace's).
    const std::vector<bool>& on_device = inspect(engine).adam_on_device();
    EXPECT_EQ(std::count(on_device.begin(), on_device.end(), true), candidate.adam_device_indices)
        << candidate.name;
  }
}

// zero_optimization.delayed_param_update under the plan: allowed, not on; with "auto" chunk sizes.
// Without the plan: the delayed update from its fourth step (at the engine's fixed size).
Config delayed_config(bool plan) {
  return tight_config(plan ? R"({"plan": "auto", "plan_check_iterations": 1000,
                                 "default_chunk_size": "auto", "zero_optimization":
                                 {"delayed_param_update": true,
                                  "delayed_param_update_warmup_steps": 4}})"
                           : R"({"zero_optimization": {"delayed_param_update": true,
                                  "delayed_param_update_warmup_steps": 4}})");
}

TEST(PlanAuto, WhereTheConfigAllowsTheDelayedUpdateItIsACandidateThatTrainsAsTheConfigsOwn) {
  const int steps = 8;
  const PlanRun exact = train(tight_config(), steps);
  const PlanRun stale = train(delayed_config(false), steps);
  ASSERT_NE(exact.losses, stale.losses) << "the delayed update changes training";
  // The plan's own choice trains as that choice's reference does.
  const PlanRun planned = train(delayed_config(true), steps);
  ASSERT_TRUE(planned.plan.planned);
  ASSERT_GE(planned.plan.chosen, 0) << planned.plan.text();
  // A delayed candidate at every chunk size the plan considers (the model moves between sizes with
  // the delayed update's thread there, and lands its update in flight first).
  int delayed = -1;
  std::set<int64_t> sizes, delayed_sizes;
  for (int c = 0; c < static_cast<int>(planned.plan.candidates.size()); ++c) {
    const PlanCandidateReport& candidate = planned.plan.candidates[static_cast<size_t>(c)];
    sizes.insert(candidate.chunk_elems);
    if (candidate.schedule != "delayed") continue;
    if (delayed < 0) delayed = c;
    delayed_sizes.insert(candidate.chunk_elems);
    EXPECT_EQ(candidate.adam, "host") << candidate.name;
  }
  ASSERT_GE(delayed, 0) << planned.plan.text();
  EXPECT_GE(sizes.size(), 2u) << planned.plan.text();
  EXPECT_EQ(delayed_sizes, sizes) << planned.plan.text();
  const bool chose_delayed =
      planned.plan.candidates[static_cast<size_t>(planned.plan.chosen)].schedule == "delayed";
  EXPECT_EQ(planned.losses, chose_delayed ? stale.losses : exact.losses) << planned.plan.text();
  // Each candidate applied after the plan: the delayed one trains as the config's delayed update
  // (from its warm-up steps on), every other one as the exact step.
  for (int c = 0; c < static_cast<int>(planned.plan.candidates.size()); ++c) {
    const PlanCandidateReport& candidate = planned.plan.candidates[static_cast<size_t>(c)];
    if (!candidate.fits) continue;
    models::Gpt model = make_model(1);
    Engine engine(model.ptr(), delayed_config(true));
    std::vector<double> losses(steps);
    std::vector<bool> handed_over(steps);
    for (int s = 0; s < steps; ++s) {
      const IterationReport r = train_step(engine, model, s, &losses[static_cast<size_t>(s)]);
      handed_over[static_cast<size_t>(s)] = r.update_delayed;
      if (s == 1) {
        EngineInspector::apply_plan_candidate(engine, 0);
        EngineInspector::apply_plan_candidate(engine, c);
      }
    }
    const bool is_delayed = candidate.schedule == "delayed";
    EXPECT_EQ(losses, is_delayed ? stale.losses : exact.losses) << candidate.name;
    for (int s = 0; s < steps; ++s) {
      EXPECT_EQ(handed_over[static_cast<size_t>(s)], is_delayed && s >= 4)
          << candidate.name << ", step " << s;
    }
  }
  // No plan (as where no candidate fits): the config's delayed update, every Adam on the host (the
  // margin's placement, decided with it off, is decided again), training as the config's own.
  {
    Config roomy = delayed_config(true);  // a device with a margin: some Adam there
    roomy.device.capacity_bytes = int64_t{1} << 30;
    models::Gpt model = make_model(1);
    Engine engine(model.ptr(), roomy);
    std::vector<double> losses(steps);
    for (int s = 0; s < steps; ++s) {
      const IterationReport r = train_step(engine, model, s, &losses[static_cast<size_t>(s)]);
      if (s == 1) {
        ASSERT_GT(engine.plan().candidates.at(0).adam_device_indices, 0) << "a margin to undo";
        EngineInspector::apply_plan_candidate(engine, 0);
        EngineInspector::apply_plan_candidate(engine, -1);
      }
      if (s >= 4) {
        EXPECT_TRUE(r.update_delayed) << "step " << s;
        EXPECT_EQ(r.adam.chunks_device, 0) << "step " << s;
      }
    }
    EXPECT_EQ(losses, stale.losses);
    EXPECT_EQ(engine.plan().chosen, -1);
  }
  // An update in flight when a re-plan moves the model into another size: it lands first, and its
  // weights are in the new chunks (as the config's delayed update has them after the same steps).
  int other = -1;
  for (int c = 0; c < static_cast<int>(planned.plan.candidates.size()); ++c) {
    const PlanCandidateReport& candidate = planned.plan.candidates[static_cast<size_t>(c)];
    if (candidate.schedule == "delayed" && candidate.fits &&
        candidate.chunk_elems !=
            planned.plan.candidates[static_cast<size_t>(delayed)].chunk_elems) {
      other = c;
    }
  }
  ASSERT_GE(other, 0) << planned.plan.text();
  auto weights_after_six = [&](const Config& config, bool plan) {
    models::Gpt model = make_model(1);
    Engine engine(model.ptr(), config);
    for (int s = 0; s < 6; ++s) {
      const IterationReport r = train_step(engine, model, s);
      if (plan && s == 1) {
        EngineInspector::apply_plan_candidate(engine, 0);
        EngineInspector::apply_plan_candidate(engine, delayed);
      }
      if (plan && s == 5) {
        EXPECT_TRUE(r.update_delayed) << "an update is in flight";
        EngineInspector::apply_plan_candidate(engine, other);
      }
    }
    return engine.fp32_state_dict();
  };
  const auto moved = weights_after_six(delayed_config(true), true);
  const auto reference = weights_after_six(delayed_config(false), false);
  ASSERT_EQ(moved.size(), reference.size());
  for (size_t i = 0; i < moved.size(); ++i) {
    EXPECT_TRUE(torch::equal(moved[i].second, reference[i].second)) << moved[i].first;
  }
  // The pinned plan says which: the delayed update on or off.
  PlanReport pinned = planned.plan;
  pinned.chosen = delayed;
  EXPECT_TRUE(Config::from_string(pinned.config_json()).delayed_update.enabled);
  pinned.chosen = delayed == 0 ? 1 : 0;
  EXPECT_FALSE(Config::from_string(pinned.config_json()).delayed_update.enabled);
}

TEST(PlanAuto, NamedProfilesPlanWithTheirRates) {
  const PlanRun run = train(tight_config(R"({"plan": "auto", "plan_profile": "h200"})"), 3);
  ASSERT_TRUE(run.plan.planned);
  EXPECT_THAT(run.plan.profile, HasSubstr("\"h200\""));
  EXPECT_THAT(run.plan.profile, HasSubstr("H200"));
  EXPECT_FALSE(run.decisions[1].empty());
}

TEST(PlanAuto, RefusesWhatItCannotPlan) {
  models::Gpt model = make_model(1);
  EXPECT_THAT(test::error_of([&] {
                Engine engine(model.ptr(),
                              tight_config(R"({"plan": "auto", "client":
                                  {"scheduler": {"policy": "static"}}})"));
              }),
              HasSubstr("nothing to plan"));
  EXPECT_THAT(test::error_of([] { Config::from_string(R"({"plan_profile": "a100"})"); }),
              HasSubstr("one of \"measured\", \"h100\", \"h200\""));
  EXPECT_THAT(test::error_of([] { Config::from_string(R"({"plan": "yes"})"); }),
              HasSubstr("one of \"off\", \"auto\""));
  EXPECT_THAT(test::error_of([] { Config::from_string(R"({"plan_tolerance": 0})"); }),
              HasSubstr("plan_tolerance"));
  // The model is untouched by a refusal: a new engine takes it.
  Engine engine(model.ptr(), tight_config());
  EXPECT_FALSE(engine.plan().planned);
}

// LibTorch warnings (TORCH_WARN) on this thread while it lives.
class Warnings : public c10::WarningHandler {
 public:
  Warnings() : guard_(this) {}
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
  bool any(const std::string& text) const {
    return std::any_of(messages.begin(), messages.end(),
                       [&](const std::string& m) { return m.find(text) != std::string::npos; });
  }
  std::vector<std::string> messages;

 private:
  c10::WarningUtils::WarningHandlerGuard guard_;
};

TEST(PlanAuto, KeysThatDoNothingSaySo) {
  models::Gpt model = make_model(1);
  {
    Warnings warnings;
    Engine engine(model.ptr(), tight_config(R"({"plan_profile": "h200"})"));
    EXPECT_TRUE(warnings.any("have no effect without \"plan\": \"auto\""))
        << warnings.messages.size();
  }
  {
    Warnings warnings;
    Engine engine(model.ptr(), tight_config(R"({"plan": "auto", "zero_optimization":
                                                   {"overlap_step": true}})"));
    EXPECT_TRUE(warnings.any("makes the overlapped one a candidate, not the setting"));
  }
  {
    Warnings warnings;
    Engine engine(model.ptr(), tight_config(R"({"plan": "auto"})"));
    EXPECT_FALSE(warnings.any("plan")) << "the defaults say nothing";
  }
}

}  // namespace patrickstar::plan_test
