// "plan": "auto" with "auto" activations: the run plan weighs the activation plan's whole-model
// alternatives (every call kept, recomputed or offloaded) beside its own choice, each with the
// Adam placement, chunk moves and step its activations leave room for; every alternative it
// considers runs as it predicted (the calls' ways, the Adam placement) and trains as LibTorch does,
// and one it chooses is pinned by the plan's config.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpt_training.h"
#include "patrickstar/engine/engine_inspect.h"
#include "patrickstar/models/gpt.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar {
namespace plan_activations_test {

using models::Gpt;
using models::GptSpec;
using namespace test;  // NOLINT: the shared helpers of gpt_training.h

constexpr int kSteps = 8;

Gpt make_six() {
  GptSpec spec = tiny(/*checkpointed=*/true);
  spec.layers = 6;
  torch::manual_seed(1);
  return Gpt(spec);
}

// "auto" activations and "plan": "auto" (no check: the candidate applied stays) on a device of
// `capacity` bytes.
Config planned_config(int64_t capacity) {
  Config config = tight_config(R"({"activation_checkpointing": {"policy": "auto"},
                                   "plan": "auto", "plan_check_iterations": 1000})");
  config.device.capacity_bytes = capacity;
  return config;
}

struct Trained {
  std::vector<double> losses;
  PlanReport plan;
  ActivationPlanReport activations;
  int64_t adam_device_indices = 0;
  int64_t retraces = 0;  // iterations whose moments left the trace (IterationReport::retraces)
  std::optional<PlanCandidateReport> applied;  // this engine's candidate of train()'s `first`
};

const char* call_choice(const std::string& activations) {
  return activations == "none" ? "keep" : activations.c_str();
}

// The way call `call` runs in candidate `c` (another than the activation plan's).
std::string call_way(const PlanCandidateReport& c, int64_t call) {
  return c.activations == "per call" ? c.activation_calls.at(static_cast<size_t>(call))
                                     : call_choice(c.activations);
}

std::string joined(const std::vector<std::string>& ways) {
  std::string out;
  for (const std::string& w : ways) out += (out.empty() ? "" : ", ") + w;
  return out;
}

// The index of the candidate in `plan` with `wanted`'s settings, or -1 (each engine plans on its
// own measurements: the activation plan's choice, so the candidates' order, may differ).
int index_of(const PlanReport& plan, const PlanCandidateReport& wanted) {
  for (size_t i = 0; i < plan.candidates.size(); ++i) {
    const PlanCandidateReport& c = plan.candidates[i];
    if (c.chunk_elems == wanted.chunk_elems && c.schedule == wanted.schedule &&
        c.adam == wanted.adam && c.activations == wanted.activations &&
        (c.activations != "per call" || c.activation_calls == wanted.activation_calls)) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

// Trains kSteps; applies `first` after the third step (from candidate 0, the settings the engine
// measured with), and with `back` candidate 0 again after the sixth.
Trained train(const Config& config, const PlanCandidateReport* first = nullptr, bool back = false) {
  Gpt model = make_six();
  Engine engine(model.ptr(), config);
  Trained out;
  for (int s = 0; s < kSteps; ++s) {
    double loss = 0;
    out.retraces = train_step(engine, model, s, &loss).retraces;
    out.losses.push_back(loss);
    if (s == 2 && first != nullptr) {
      const int index = index_of(engine.plan(), *first);
      if (index < 0) {  // (this engine's activation plan chose that way itself)
        std::cout << "this engine's plan has no candidate " << first->name << "\n"
                  << engine.plan().text();
        break;
      }
      out.applied = engine.plan().candidates[static_cast<size_t>(index)];
      EngineInspector::apply_plan_candidate(engine, 0);
      EngineInspector::apply_plan_candidate(engine, index);
    }
    if (s == 5 && back) EngineInspector::apply_plan_candidate(engine, 0);
  }
  out.plan = engine.plan();
  out.activations = engine.activation_plan();
  const std::vector<bool>& on_device = inspect(engine).adam_on_device();
  out.adam_device_indices = std::count(on_device.begin(), on_device.end(), true);
  return out;
}

// 6 MiB: every call kept leaves the margin room for 3 of the 10 chunk indices' Adam, every call
// recomputed or offloaded for 6 (the non-model peak 2,140,296 B against 671,368 B and 605,832 B).
constexpr int64_t kCapacity = int64_t{6} << 20;

TEST(PlanActivations, TheRunPlanWeighsEveryWholeModelWayOfTheActivationsAndEachTrainsAsLibTorch) {
  const Trained planned = train(planned_config(kCapacity));
  ASSERT_TRUE(planned.plan.planned);
  ASSERT_TRUE(planned.activations.planned);
  const std::vector<double> plain = train_plain(kSteps, make_six());
  EXPECT_LE(max_relative_difference(planned.losses, plain), 1e-5);
  std::set<std::string> ways;
  for (const PlanCandidateReport& c : planned.plan.candidates) {
    if (c.activations != "per call") ways.insert(c.activations);  // (the search's: below)
  }
  // The activation plan's own choice (every call kept here: it saves every recompute) and the
  // whole-model ways it did not choose.
  std::set<std::string> others = {"", "recompute", "offload", "none"};
  // (The ways the calls ran when the engine planned: candidate 0's, the engine's own. The report's
  // calls say how they run now, after the plan's choice.)
  const std::vector<std::string>& own = planned.plan.candidates[0].activation_calls;
  ASSERT_EQ(own.size(), planned.activations.calls.size()) << planned.plan.text();
  const std::set<std::string> own_ways(own.begin(), own.end());
  const bool every_call_kept = own_ways == std::set<std::string>{"keep"};
  if (own_ways.size() == 1) others.erase(*own_ways.begin() == "keep" ? "none" : *own_ways.begin());
  EXPECT_EQ(ways, others) << planned.plan.text();
  if (every_call_kept) {
    // Recomputing every call adds each call's measured forward to the step (its moments come from
    // the warm-up's trace); with every Adam on the host both steps update the same.
    double forwards = 0;
    for (const ActivationCallPlan& c : planned.activations.calls) forwards += c.forward_seconds;
    const PlanCandidateReport* own = nullptr;
    const PlanCandidateReport* recomputed = nullptr;
    for (const PlanCandidateReport& c : planned.plan.candidates) {
      if (c.schedule != "serial" || c.adam != "host") continue;
      if (c.activations.empty()) own = &c;
      if (c.activations == "recompute") recomputed = &c;
    }
    ASSERT_TRUE(own != nullptr && recomputed != nullptr) << planned.plan.text();
    EXPECT_NEAR(recomputed->compute_seconds - own->compute_seconds, forwards, forwards * 1e-6);
  } else {
    std::cout << "the activation plan kept not every call here: the recompute's time is not "
                 "checked\n"
              << planned.activations.text();
  }

  int alternatives = 0;
  for (const PlanCandidateReport& c : planned.plan.candidates) {
    if (c.activations.empty() || !c.fits) continue;
    ++alternatives;
    EXPECT_NE(c.name.find(", activations " + c.activations), std::string::npos) << c.name;
    EXPECT_EQ(c.chunk_elems, planned.plan.candidates[0].chunk_elems) << c.name;
    const Trained run = train(planned_config(kCapacity), &c);
    if (!run.applied) continue;  // (said above)
    EXPECT_LE(max_relative_difference(run.losses, plain), 1e-5) << c.name;
    // Every call runs the candidate's way, and the Adam placement the engine decides under it is
    // the one the candidate predicted (the margin from the activations' peak).
    for (const ActivationCallPlan& call : run.activations.calls) {
      EXPECT_EQ(call.choice, call_way(c, call.call)) << c.name << ": call " << call.call;
    }
    EXPECT_EQ(run.activations.run_plan_instead,
              c.activations == "per call"
                  ? "per call: " + joined(c.activation_calls)
                  : std::string("every call: ") + call_choice(c.activations))
        << c.name;
    EXPECT_EQ(run.adam_device_indices, run.applied->adam_device_indices) << c.name;
    // The engine records the trace again for the new activations: no moment takes it by surprise.
    EXPECT_EQ(run.retraces, 0) << c.name;
  }
  EXPECT_GE(alternatives, 4) << planned.plan.text();
  // The per-call search ran from the best of those: a mix it adds is predicted shorter than every
  // candidate of the engine's size with other activations.
  EXPECT_NE(planned.plan.activation_search.find("the per-call search weighed"), std::string::npos)
      << planned.plan.text();
  double mix = std::numeric_limits<double>::infinity();
  double rest = std::numeric_limits<double>::infinity();
  for (const PlanCandidateReport& c : planned.plan.candidates) {
    if (!c.fits || c.chunk_elems != planned.plan.candidates[0].chunk_elems) continue;
    (c.activations == "per call" ? mix : rest) =
        std::min(c.activations == "per call" ? mix : rest, c.predicted_step_seconds);
  }
  if (std::isfinite(mix)) {
    EXPECT_LT(mix, rest) << planned.plan.text();
  } else {
    EXPECT_NE(planned.plan.activation_search.find("none shorter"), std::string::npos)
        << planned.plan.activation_search;
  }
}

TEST(PlanActivations, BackToACandidateOfTheActivationPlansOwnItRunsItsChoicesAgain) {
  const Trained planned = train(planned_config(kCapacity));
  const PlanCandidateReport* alternative = nullptr;
  for (const PlanCandidateReport& c : planned.plan.candidates) {
    if (!c.activations.empty() && c.fits && alternative == nullptr) alternative = &c;
  }
  ASSERT_NE(alternative, nullptr) << planned.plan.text();
  const Trained back = train(planned_config(kCapacity), alternative, /*back=*/true);
  if (!back.applied) GTEST_SKIP() << "this engine's activation plan chose that way itself";
  // Every call runs the activation plan's own choice again (the report says no other runs), which
  // differs from the alternative in some call (else it would not be one).
  EXPECT_EQ(back.activations.run_plan_instead, "");
  int differ = 0;
  for (const ActivationCallPlan& call : back.activations.calls) {
    differ += call.choice != call_choice(alternative->activations) ? 1 : 0;
  }
  EXPECT_GT(differ, 0) << back.activations.text();
  EXPECT_EQ(back.adam_device_indices, back.plan.candidates[0].adam_device_indices);
  EXPECT_EQ(back.retraces, 0);
  EXPECT_LE(max_relative_difference(back.losses, train_plain(kSteps, make_six())), 1e-5);
}

TEST(PlanActivations, PinnedCallsRunAsTheConfigNamesThemAndTrainAsLibTorch) {
  const std::vector<std::string> pinned = {"keep",    "recompute", "offload",
                                           "offload", "keep",      "recompute"};
  Config config = tight_config(R"({"activation_checkpointing": {"policy": "auto", "calls":
      ["keep", "recompute", "offload", "offload", "keep", "recompute"]}})");
  config.device.capacity_bytes = kCapacity;
  const Trained run = train(config);
  ASSERT_TRUE(run.activations.planned);
  ASSERT_EQ(run.activations.calls.size(), pinned.size());
  for (const ActivationCallPlan& call : run.activations.calls) {
    EXPECT_EQ(call.choice, pinned[static_cast<size_t>(call.call)]) << "call " << call.call;
  }
  ASSERT_FALSE(run.activations.candidates.empty());
  EXPECT_EQ(run.activations.candidates.front().name, "pinned (calls)");
  EXPECT_LE(max_relative_difference(run.losses, train_plain(kSteps, make_six())), 1e-5);
}

TEST(PlanActivations, ThePlansConfigPinsTheWaysItsCandidateRunsTheCalls) {
  const Trained planned = train(planned_config(kCapacity));
  ASSERT_TRUE(planned.plan.planned);
  // (The ways the calls ran when the engine planned: candidate 0's.)
  const std::vector<std::string> own = planned.plan.candidates[0].activation_calls;
  ASSERT_EQ(own.size(), planned.activations.calls.size());
  for (size_t i = 0; i < planned.plan.candidates.size(); ++i) {
    const PlanCandidateReport& c = planned.plan.candidates[i];
    PlanReport one = planned.plan;
    one.chosen = static_cast<int>(i);
    const nlohmann::json pins = nlohmann::json::parse(one.config_json());
    const nlohmann::json& activations = pins.at("activation_checkpointing");
    if (c.activations.empty() || c.activations == "per call") {
      EXPECT_EQ(activations.at("policy"), "auto") << c.name;
      EXPECT_EQ(activations.at("calls").get<std::vector<std::string>>(),
                c.activations.empty() ? own : c.activation_calls)
          << c.name;
    } else {
      EXPECT_EQ(activations.at("policy"), c.activations) << c.name;
      EXPECT_TRUE(activations.at("calls").empty()) << c.name;
    }
  }
  // An engine pinned to the activation plan's own candidate runs its ways without choosing again.
  PlanReport first = planned.plan;
  first.chosen = 0;
  nlohmann::json j = planned_config(kCapacity).to_json();
  j.merge_patch(nlohmann::json::parse(first.config_json()));
  const Trained pinned = train(Config::from_json(j));
  EXPECT_FALSE(pinned.plan.planned);
  std::vector<std::string> ran;
  for (const ActivationCallPlan& call : pinned.activations.calls) ran.push_back(call.choice);
  EXPECT_EQ(ran, own);
  EXPECT_EQ(pinned.activations.candidates.front().name, "pinned (calls)");
  EXPECT_LE(max_relative_difference(pinned.losses, planned.losses), 1e-5);
}

// With "default_chunk_size": "auto" too: the plan's other sizes.
Config sized_config(int64_t capacity) {
  Config config = tight_config(R"({"activation_checkpointing": {"policy": "auto"},
                                   "plan": "auto", "plan_check_iterations": 1000,
                                   "default_chunk_size": "auto"})");
  config.device.capacity_bytes = capacity;
  return config;
}

std::string ways_key(const PlanCandidateReport& c) {
  return c.activations + " (" + joined(c.activation_calls) + ")";
}

TEST(PlanActivations, EveryChunkSizeIsWeighedUnderEveryWayOfTheActivations) {
  const Trained planned = train(sized_config(kCapacity));
  ASSERT_TRUE(planned.plan.planned);
  std::set<int64_t> sizes;
  std::map<std::string, std::set<int64_t>> sizes_of;  // per way of the activations
  for (const PlanCandidateReport& c : planned.plan.candidates) {
    sizes.insert(c.chunk_elems);
    sizes_of[ways_key(c)].insert(c.chunk_elems);
  }
  ASSERT_GE(sizes.size(), 2u) << planned.plan.text();
  // The activations the engine runs, the whole-model ways it does not, and any mix the search
  // found (weighed at every size), each at every size. (The activation plan keeps calls here, so
  // its trace skips their recomputes: another size's trace takes each moment's tensors from the
  // warm-up's moment of the same module and kind.)
  ASSERT_GE(sizes_of.size(), 3u) << planned.plan.text();
  for (const auto& [ways, at] : sizes_of) EXPECT_EQ(at, sizes) << ways;
  EXPECT_NE(planned.plan.activation_search.find("with every chunk size"), std::string::npos)
      << planned.plan.activation_search;
  const std::vector<double> plain = train_plain(kSteps, make_six());
  EXPECT_LE(max_relative_difference(planned.losses, plain), 1e-5);
}

TEST(PlanActivations, AnotherChunkSizeUnderOtherActivationsRunsTheTraceThePlanPredicted) {
  const Trained planned = train(sized_config(kCapacity));
  ASSERT_TRUE(planned.plan.planned);
  const int64_t own_size = planned.plan.candidates[0].chunk_elems;
  const std::vector<double> plain = train_plain(kSteps, make_six());
  std::set<std::string> tried;  // one candidate per size and way of the activations
  for (const PlanCandidateReport& wanted : planned.plan.candidates) {
    if (wanted.chunk_elems == own_size || wanted.activations.empty() || !wanted.fits ||
        !tried.insert(std::to_string(wanted.chunk_elems) + ways_key(wanted)).second) {
      continue;
    }
    Gpt model = make_six();
    Engine engine(model.ptr(), sized_config(kCapacity));
    std::vector<double> losses;
    std::optional<Trace> predicted;
    std::optional<PlanCandidateReport> applied;
    for (int s = 0; s < kSteps; ++s) {
      double loss = 0;
      EXPECT_EQ(train_step(engine, model, s, &loss).retraces, 0) << wanted.name << " step " << s;
      losses.push_back(loss);
      if (s != 2) continue;
      const int index = index_of(engine.plan(), wanted);
      if (index < 0) break;  // (this engine's activation plan chose that way itself)
      applied = engine.plan().candidates[static_cast<size_t>(index)];
      predicted = inspect(engine).plan_candidate_trace(index);  // what the plan weighed
      EngineInspector::apply_plan_candidate(engine, 0);
      EngineInspector::apply_plan_candidate(engine, index);
    }
    if (!applied) {
      std::cout << "this engine's plan has no candidate " << wanted.name << "\n";
      continue;
    }
    ASSERT_TRUE(predicted.has_value()) << wanted.name;
    EXPECT_LE(max_relative_difference(losses, plain), 1e-5) << wanted.name;
    // The model moved into the size, the calls run the ways, and the trace recorded after is the
    // predicted one: each moment's module and kind, and the chunks it accessed.
    EXPECT_EQ(inspect(engine).chunks().chunk_elems(), wanted.chunk_elems) << wanted.name;
    const ActivationPlanReport activations = engine.activation_plan();
    for (const ActivationCallPlan& call : activations.calls) {
      EXPECT_EQ(call.choice, call_way(*applied, call.call))
          << wanted.name << ": call " << call.call;
    }
    const Trace& runs = inspect(engine).scheduler().trace();
    ASSERT_EQ(runs.size(), predicted->size()) << wanted.name;
    for (int64_t m = 0; m < runs.size(); ++m) {
      const Moment& a = predicted->moments[static_cast<size_t>(m)];
      const Moment& b = runs.moments[static_cast<size_t>(m)];
      EXPECT_EQ(a.kind, b.kind) << wanted.name << " " << m;
      EXPECT_EQ(a.label, b.label) << wanted.name << " " << m;
      if (b.kind == MomentKind::kStep) continue;  // (its Adam placement: below)
      std::vector<int64_t> want = a.chunk_ids;
      std::vector<int64_t> got = b.chunk_ids;
      std::sort(want.begin(), want.end());
      std::sort(got.begin(), got.end());
      EXPECT_EQ(want, got) << wanted.name << " " << m << " " << b.label;
    }
    const std::vector<bool>& on_device = inspect(engine).adam_on_device();
    EXPECT_EQ(std::count(on_device.begin(), on_device.end(), true), applied->adam_device_indices)
        << wanted.name;
  }
  EXPECT_GE(tried.size(), 3u) << planned.plan.text();
}

TEST(PlanActivations, AFixedActivationPolicyHasNoAlternative) {
  for (const char* policy : {"recompute", "offload"}) {
    Config config = tight_config(std::string(R"({"activation_checkpointing": {"policy": ")") +
                                 policy + R"("}, "plan": "auto", "plan_check_iterations": 1000})");
    config.device.capacity_bytes = kCapacity;
    const Trained run = train(config);
    ASSERT_TRUE(run.plan.planned) << policy;
    for (const PlanCandidateReport& c : run.plan.candidates) {
      EXPECT_EQ(c.activations, "") << policy << ": " << c.name;
    }
  }
}

}  // namespace plan_activations_test
}  // namespace patrickstar
