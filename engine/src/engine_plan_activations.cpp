// "plan": "auto" with "auto" activations (run_plan.h): the activation plan's alternatives as
// layouts of every chunk size the plan considers (its whole-model ways, and a per-call mix searched
// jointly with the chunk size, the schedule and the Adam placement), and running the one a
// candidate names.
#include "engine_core.h"

#include <algorithm>
#include <iterator>
#include <limits>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
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

// The shortest predicted step of any fitting candidate of `layouts` (infinity where none fits),
// with the rest of `all` (its layouts set aside meanwhile, not copied).
double best_step(PlanInputs& all, std::vector<PlanLayout> layouts, const PlanProfile& profile) {
  struct SetAside {
    PlanInputs& in;
    std::vector<PlanLayout> layouts;
    ~SetAside() { in.layouts.swap(layouts); }
  } aside{all, {}};
  aside.layouts.swap(all.layouts);
  all.layouts = std::move(layouts);
  double best = std::numeric_limits<double>::infinity();
  for (const PlanCandidateReport& c : evaluate_plan(all, profile).candidates) {
    if (c.fits) best = std::min(best, c.predicted_step_seconds);
  }
  return best;
}

// Whether a layout of `in` runs the calls `choices`' ways.
bool has_activation_mix(const PlanInputs& in, const std::vector<ActivationChoice>& choices) {
  return std::any_of(in.layouts.begin(), in.layouts.end(), [&](const PlanLayout& l) {
    return !l.activation_calls.empty() && activation_choices_named(l.activation_calls) == choices;
  });
}

}  // namespace

std::vector<PlanLayout> EngineCore::plan_activation_layouts_of(
    ActivationPlanner::Alternative a, const std::vector<double>& compute,
    const std::vector<int64_t>& sizes) const {
  std::vector<double> seconds = alternative_compute(a, compute);
  // The margin's peak: the one the engine's placement was decided with (the probe's, which sees
  // inside a moment) moved by the model's change, and never below a moment of the alternative.
  int64_t peak = plan_.placement_peak() + a.peak_delta;
  for (const Moment& m : a.trace.moments) peak = std::max(peak, m.non_model_bytes);
  peak = std::max(peak, a.trace.tail_non_model_bytes);
  std::vector<PlanLayout> out;
  for (int64_t size : sizes) {
    // Another size: each door moment's tensors as the warm-up ran them, packed at that size.
    if (size == store().chunk_elems()) continue;
    if (std::optional<PlanLayout> other = plan_layout_of(size, a.trace, peak)) {
      out.push_back(std::move(*other));
    }
  }
  out.insert(out.begin(), plan_layout_now(std::move(a.trace), peak));
  for (PlanLayout& layout : out) {
    layout.activations = a.every ? policy_word(*a.every) : "per call";
    layout.activation_calls = way_names(a.choices);
    layout.compute_seconds = seconds;
    layout.extra_seconds = a.exposed_delta;
  }
  return out;
}

std::vector<std::string> EngineCore::running_activation_calls() const {
  if (activations_->planned_chunk_elems != store().chunk_elems()) return {};
  return way_names(activations_->planner.running_choices());
}

std::vector<PlanLayout> EngineCore::plan_activation_layouts(
    const std::vector<double>& compute, const std::vector<int64_t>& sizes) const {
  std::vector<PlanLayout> out;
  const Trace& running = scheduler_->trace();
  // (The warm-up's moments the alternatives take are chunks of the size it ran.)
  if (static_cast<int64_t>(compute.size()) != running.size() ||
      activations_->planned_chunk_elems != store().chunk_elems()) {
    return out;
  }
  // Each way at the engine's size first (the order of preference), then at the other sizes.
  std::vector<PlanLayout> others;
  for (ActivationPlanner::Alternative& a :
       activations_->planner.alternatives(running, /*why=*/nullptr)) {
    std::vector<PlanLayout> layouts = plan_activation_layouts_of(std::move(a), compute, sizes);
    out.push_back(std::move(layouts.front()));
    std::move(layouts.begin() + 1, layouts.end(), std::back_inserter(others));
  }
  std::move(others.begin(), others.end(), std::back_inserter(out));
  return out;
}

bool EngineCore::searches_activation_calls(const PlanInputs& in) const {
  return !activations_->planner.call_ways().empty() && !in.layouts.empty() &&
         !in.layouts.front().activation_calls.empty() &&
         static_cast<int64_t>(in.compute_seconds.size()) == scheduler_->trace().size() &&
         activations_->planned_chunk_elems == store().chunk_elems();
}

std::vector<PlanLayout> EngineCore::activation_mix_layouts(
    const PlanInputs& in, const std::vector<ActivationChoice>& choices,
    const std::vector<int64_t>& sizes) const {
  std::optional<ActivationPlanner::Alternative> a =
      activations_->planner.alternative(scheduler_->trace(), choices, /*why=*/nullptr);
  if (!a) return {};
  return plan_activation_layouts_of(std::move(*a), in.compute_seconds, sizes);
}

void EngineCore::insert_activation_mix(PlanInputs& in, std::vector<PlanLayout> layouts) const {
  // The engine's size's after the other activations at that size, the rest after every layout.
  const auto own_size_end =
      std::find_if(in.layouts.rbegin(), in.layouts.rend(), [&](const PlanLayout& l) {
        return l.chunk_elems == store().chunk_elems();
      }).base();
  in.layouts.insert(own_size_end, std::move(layouts.front()));
  std::move(layouts.begin() + 1, layouts.end(), std::back_inserter(in.layouts));
}

void EngineCore::add_activation_mix(PlanInputs& in, const std::string& text) const {
  if (text.empty() || !searches_activation_calls(in)) return;
  const std::vector<std::string> names = absl::StrSplit(text, ',');
  const std::vector<ActivationChoice> choices = activation_choices_named(names);
  in.activation_search = absl::StrCat("the per-call search ran on rank 0: per call (",
                                      absl::StrJoin(way_names(choices), ", "), ")");
  if (has_activation_mix(in, choices)) return;
  std::vector<PlanLayout> layouts = activation_mix_layouts(in, choices, plan_chunk_sizes());
  if (layouts.empty()) {
    absl::StrAppend(&in.activation_search, ", which this rank's running trace cannot run");
    return;
  }
  insert_activation_mix(in, std::move(layouts));
}

std::string EngineCore::search_activation_calls(PlanInputs& in, const PlanProfile& profile) const {
  const ActivationPlanner& planner = activations_->planner;
  const Trace& running = scheduler_->trace();
  const std::vector<std::vector<ActivationChoice>> ways = planner.call_ways();
  if (!searches_activation_calls(in)) return "";
  if (std::string why; !planner.runs_model_trace(running, &why)) {
    in.activation_search = absl::StrCat("no per-call search: ", why);
    return "";
  }
  // From the best of the activations there (the own and the whole-model ways, each at its best
  // chunk size).
  constexpr double kNever = std::numeric_limits<double>::infinity();
  std::vector<ActivationChoice> best;
  double best_s = kNever;
  for (size_t i = 0; i < in.layouts.size(); ++i) {
    const PlanLayout& layout = in.layouts[i];
    if (layout.activation_calls.empty()) continue;
    std::vector<ActivationChoice> calls = activation_choices_named(layout.activation_calls);
    const double s = best_step(in, {in.layouts[i]}, profile);
    if (s < best_s || best.empty()) {
      best = std::move(calls);
      best_s = s;
    }
  }
  const std::vector<ActivationChoice> best_start = best;
  auto there = [&](const std::vector<ActivationChoice>& choices) {
    return has_activation_mix(in, choices);
  };
  const std::vector<int64_t> sizes = plan_chunk_sizes();
  auto layouts_of = [&](const std::vector<ActivationChoice>& choices) {
    return activation_mix_layouts(in, choices, sizes);
  };
  // Then one call at a time while the best predicted step (at any size) gets shorter. (A way
  // there already is the start, or no shorter than it.)
  const WaysFound found =
      search_ways(std::move(best), ways, [&](const std::vector<ActivationChoice>& choices) {
        if (there(choices)) return choices == best_start ? best_s : kNever;
        std::vector<PlanLayout> layouts = layouts_of(choices);
        return layouts.empty() ? kNever : best_step(in, std::move(layouts), profile);
      });
  in.activation_search =
      absl::StrCat("the per-call search weighed ", found.weighed, " ways of the ", ways.size(),
                   " checkpoint calls with every ", sizes.empty() ? "" : "chunk size, ",
                   "schedule and Adam placement, from the best there (",
                   absl::StrJoin(way_names(best_start), ", "), ")");
  std::vector<PlanLayout> layouts =
      there(found.best) ? std::vector<PlanLayout>{} : layouts_of(found.best);
  if (layouts.empty()) {
    absl::StrAppend(&in.activation_search, ": none shorter");
    return "";
  }
  absl::StrAppendFormat(&in.activation_search, ": per call (%s), predicted %.4g s against %.4g s",
                        absl::StrJoin(layouts.front().activation_calls, ", "), found.seconds,
                        best_s);
  insert_activation_mix(in, std::move(layouts));
  return absl::StrJoin(way_names(found.best), ",");
}

bool EngineCore::run_plan_activations(const PlanCandidateReport& candidate) {
  ActivationPlanner& planner = activations_->planner;
  if (candidate.activations == "per call") {
    return planner.run_choices(activation_choices_named(candidate.activation_calls));
  }
  std::optional<ActivationChoice> every;
  if (candidate.activations == "none") every = ActivationChoice::kKeep;
  if (candidate.activations == "offload") every = ActivationChoice::kOffload;
  if (candidate.activations == "recompute") every = ActivationChoice::kRecompute;
  return planner.run_alternative(every);
}

}  // namespace patrickstar
