// "plan": "auto" with "auto" activations (run_plan.h): the activation plan's whole-model
// alternatives as layouts of the engine's chunk size, and running the one a candidate names.
#include "engine_core.h"

#include <algorithm>
#include <optional>

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

}  // namespace

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
    std::vector<double> seconds = alternative_compute(a, compute);
    // The margin's peak: the one the engine's placement was decided with (the probe's, which sees
    // inside a moment) moved by the model's change, and never below a moment of the alternative.
    int64_t peak = plan_.placement_peak() + a.peak_delta;
    for (const Moment& m : a.trace.moments) peak = std::max(peak, m.non_model_bytes);
    peak = std::max(peak, a.trace.tail_non_model_bytes);
    PlanLayout layout = plan_layout_now(std::move(a.trace), peak);
    layout.activations = policy_word(a.every);
    layout.compute_seconds = std::move(seconds);
    layout.extra_seconds = a.exposed_delta;
    out.push_back(std::move(layout));
  }
  return out;
}

bool EngineCore::run_plan_activations(const std::string& candidate) {
  std::optional<ActivationChoice> every;
  if (candidate == "none") every = ActivationChoice::kKeep;
  if (candidate == "offload") every = ActivationChoice::kOffload;
  if (candidate == "recompute") every = ActivationChoice::kRecompute;
  return activations_->planner.run_alternative(every);
}

}  // namespace patrickstar
