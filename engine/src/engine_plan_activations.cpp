// "plan": "auto" with "auto" activations (run_plan.h): the activation plan's alternatives as
// layouts of the engine's chunk size (its whole-model ways, and a per-call mix searched jointly
// with the schedule and the Adam placement), and running the one a candidate names.
#include "engine_core.h"

#include <algorithm>
#include <limits>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "engine_internal.h"

namespace patrickstar {
using namespace engine_detail;  // NOLINT: this folder's private helpers

namespace {

// As "activation_checkpointing.policy" names a whole-model choice.
const char* policy_word(ActivationChoice every) {
  switch (every) {
    case ActivationChoice::kKeep:
      return "none";
    case ActivationChoice::kOffload:
      return "offload";
    case ActivationChoice::kRecompute:
      break;
  }
  return "recompute";
}

std::vector<std::string> way_names(const std::vector<ActivationChoice>& choices) {
  std::vector<std::string> out;
  for (ActivationChoice c : choices) out.emplace_back(activation_choice_name(c));
  return out;
}

std::vector<ActivationChoice> ways_of(const std::vector<std::string>& names) {
  std::vector<ActivationChoice> out;
  for (const std::string& name : names) out.push_back(activation_choice_named(name));
  return out;
}

// The shortest predicted step of any fitting candidate of `layout` (infinity where none fits), with
// the rest of `all` (its layouts set aside meanwhile, not copied).
double best_step(PlanInputs& all, PlanLayout layout, const PlanProfile& profile) {
  struct SetAside {
    PlanInputs& in;
    std::vector<PlanLayout> layouts;
    ~SetAside() { in.layouts.swap(layouts); }
  } aside{all, {}};
  aside.layouts.swap(all.layouts);
  all.layouts.push_back(std::move(layout));
  double best = std::numeric_limits<double>::infinity();
  for (const PlanCandidateReport& c : evaluate_plan(all, profile).candidates) {
    if (c.fits) best = std::min(best, c.predicted_step_seconds);
  }
  return best;
}

}  // namespace

PlanLayout EngineCore::plan_activation_layout(ActivationPlanner::Alternative a,
                                              const std::vector<double>& compute) const {
  std::vector<double> seconds = alternative_compute(a, compute);
  // The margin's peak: the one the engine's placement was decided with (the probe's, which sees
  // inside a moment) moved by the model's change, and never below a moment of the alternative.
  int64_t peak = plan_.placement_peak() + a.peak_delta;
  for (const Moment& m : a.trace.moments) peak = std::max(peak, m.non_model_bytes);
  peak = std::max(peak, a.trace.tail_non_model_bytes);
  PlanLayout layout = plan_layout_now(std::move(a.trace), peak);
  layout.activations = a.every ? policy_word(*a.every) : "per call";
  layout.activation_calls = way_names(a.choices);
  layout.compute_seconds = std::move(seconds);
  layout.extra_seconds = a.exposed_delta;
  return layout;
}

std::vector<std::string> EngineCore::running_activation_calls() const {
  if (activations_->planned_chunk_elems != store().chunk_elems()) return {};
  return way_names(activations_->planner.running_choices());
}

std::vector<PlanLayout> EngineCore::plan_activation_layouts(
    const std::vector<double>& compute) const {
  std::vector<PlanLayout> out;
  const Trace& running = scheduler_->trace();
  // (The warm-up's moments the alternatives take are chunks of the size it ran.)
  if (static_cast<int64_t>(compute.size()) != running.size() ||
      activations_->planned_chunk_elems != store().chunk_elems()) {
    return out;
  }
  for (ActivationPlanner::Alternative& a :
       activations_->planner.alternatives(running, /*why=*/nullptr)) {
    out.push_back(plan_activation_layout(std::move(a), compute));
  }
  return out;
}

void EngineCore::search_activation_calls(PlanInputs& in, const PlanProfile& profile) const {
  const ActivationPlanner& planner = activations_->planner;
  const Trace& running = scheduler_->trace();
  const std::vector<std::vector<ActivationChoice>> ways = planner.call_ways();
  if (ways.empty() || in.layouts.empty() || in.layouts.front().activation_calls.empty() ||
      static_cast<int64_t>(in.compute_seconds.size()) != running.size() ||
      activations_->planned_chunk_elems != store().chunk_elems()) {
    return;
  }
  if (std::string why; !planner.runs_model_trace(running, &why)) {
    in.activation_search = absl::StrCat("no per-call search: ", why);
    return;
  }
  // From the best of the engine's size's activations there (its own and the whole-model ways).
  constexpr double kNever = std::numeric_limits<double>::infinity();
  std::vector<ActivationChoice> best;
  double best_s = kNever;
  for (size_t i = 0; i < in.layouts.size(); ++i) {
    const PlanLayout& layout = in.layouts[i];
    if (layout.chunk_elems != store().chunk_elems() || layout.activation_calls.empty()) continue;
    std::vector<ActivationChoice> calls = ways_of(layout.activation_calls);
    const double s = best_step(in, in.layouts[i], profile);
    if (s < best_s || best.empty()) {
      best = std::move(calls);
      best_s = s;
    }
  }
  const std::vector<ActivationChoice> best_start = best;
  auto there = [&](const std::vector<ActivationChoice>& choices) {
    return std::any_of(in.layouts.begin(), in.layouts.end(), [&](const PlanLayout& l) {
      return l.chunk_elems == store().chunk_elems() && ways_of(l.activation_calls) == choices;
    });
  };
  auto layout_of = [&](const std::vector<ActivationChoice>& choices) -> std::optional<PlanLayout> {
    std::optional<ActivationPlanner::Alternative> a =
        planner.alternative(running, choices, /*why=*/nullptr);
    if (!a) return std::nullopt;
    return plan_activation_layout(std::move(*a), in.compute_seconds);
  };
  // Then one call at a time while the best predicted step gets shorter. (A way there already is
  // the start, or no shorter than it.)
  const WaysFound found =
      search_ways(std::move(best), ways, [&](const std::vector<ActivationChoice>& choices) {
        if (there(choices)) return choices == best_start ? best_s : kNever;
        std::optional<PlanLayout> layout = layout_of(choices);
        return layout ? best_step(in, std::move(*layout), profile) : kNever;
      });
  in.activation_search = absl::StrCat(
      "the per-call search weighed ", found.weighed, " ways of the ", ways.size(),
      " checkpoint calls with every schedule and Adam placement, from the best there (",
      absl::StrJoin(way_names(best_start), ", "), ")");
  std::optional<PlanLayout> layout = there(found.best) ? std::nullopt : layout_of(found.best);
  if (!layout) {
    absl::StrAppend(&in.activation_search, ": none shorter");
    return;
  }
  absl::StrAppendFormat(&in.activation_search, ": per call (%s), predicted %.4g s against %.4g s",
                        absl::StrJoin(layout->activation_calls, ", "), found.seconds, best_s);
  in.layouts.push_back(std::move(*layout));
}

bool EngineCore::run_plan_activations(const PlanCandidateReport& candidate) {
  ActivationPlanner& planner = activations_->planner;
  if (candidate.activations == "per call") {
    return planner.run_choices(ways_of(candidate.activation_calls));
  }
  std::optional<ActivationChoice> every;
  if (candidate.activations == "none") every = ActivationChoice::kKeep;
  if (candidate.activations == "offload") every = ActivationChoice::kOffload;
  if (candidate.activations == "recompute") every = ActivationChoice::kRecompute;
  return planner.run_alternative(every);
}

}  // namespace patrickstar
