// Private to engine/src: the activation plan ("activation_checkpointing": {"policy": ...};
// docs/design.md, "Activations"). Numbers the checkpointed calls of an iteration, answers what
// each does, records what the warm-up measured of them, and for "auto" chooses per call keep,
// recompute or offload with the cost model below.
//
// Invariants:
// - Calls are numbered 0, 1, ... in call order from the last step (or dropped iteration); the
//   plan's choices are per number, so an iteration must make its calls in the same order (as its
//   doors must, for the trace).
// - A call's options win over the policy (CheckpointOptions::offload); an unnamed call (asked after
//   its forward) is never kept.
// - "auto" runs its first iteration with every call offloaded (the least device memory: where any
//   way trains, this one does; the warm-up measures it), then plans once; the engine records the
//   trace again under the plan.
// - The cost model: a plan's trace is the warm-up's with each kept call's activations added from
//   its forward to its recompute (and the recompute's moments removed), and each call's input
//   away from the next call's forward to that call's recompute where the plan offloads it (put
//   back where the warm-up offloaded it and the plan does not); it must pass the
//   scheduler's check, and its chunk moves are the OPT bound at its budgets. Predicted step =
//   common compute + the forwards recomputed + moves / bandwidth + each offload's copies not
//   hidden behind the next call's forward (all of them without a copy queue).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "patrickstar/engine/config.h"
#include "patrickstar/engine/module_hooks.h"
#include "patrickstar/engine/reports.h"
#include "patrickstar/memtracer/scheduler.h"
#include "patrickstar/memtracer/trace.h"

#include "activation_offload.h"

namespace patrickstar::engine_detail {

// The way activation_choice_name() names ("keep", "offload"; anything else: recompute).
inline ActivationChoice activation_choice_named(std::string_view name) {
  return name == "keep"      ? ActivationChoice::kKeep
         : name == "offload" ? ActivationChoice::kOffload
                             : ActivationChoice::kRecompute;
}

inline std::vector<ActivationChoice> activation_choices_named(
    const std::vector<std::string>& names) {
  std::vector<ActivationChoice> out;
  for (const std::string& name : names) out.push_back(activation_choice_named(name));
  return out;
}

class ActivationPlanner {
 public:
  // `config.calls` pins "auto"'s choice (config.h).
  explicit ActivationPlanner(const ActivationConfig& config);
  explicit ActivationPlanner(ActivationPolicy policy)
      : ActivationPlanner(ActivationConfig{.policy = policy, .calls = {}}) {}

  ActivationPolicy policy() const { return policy_; }
  // The next call is number 0 again (a step, a dropped iteration); what was measured keeps this
  // iteration's calls only.
  void restart();
  // A forward begins (its first door), and it was abandoned (its calls' numbers are given again).
  void forward_begins() { forward_start_call_ = next_call_; }
  void forward_abandoned() { next_call_ = std::min(next_call_, forward_start_call_); }
  // The number and the choice of the next call: `named` (checkpoint(block, ...)), `offload` its
  // options' wish; `moment`: the trace's last moment ticked now.
  ModuleHookHandler::CheckpointPlan plan(bool named, std::optional<bool> offload, int64_t moment);
  // What the warm-up measures: `moment` is the trace's last moment ticked then, `live_bytes` the
  // non-model bytes live then. Calls after the first iteration's are ignored.
  void forward_done(int64_t call, int64_t input_bytes, double seconds, int64_t moment);
  void recompute_begins(int64_t call, int64_t moment, int64_t live_bytes);
  void recompute_done(int64_t call, double seconds, int64_t moment, int64_t live_bytes);
  // The measured iteration ended (the first step): "auto" plans now (make_plan) when true.
  bool wants_plan() const;
  // Nothing more is measured (any policy but "auto" after its first step).
  void stop_measuring() { measuring_ = false; }

  struct PlanInputs {
    const Trace* trace = nullptr;  // the warm-up's
    std::map<int64_t, ChunkInfo> chunks;
    const Scheduler* scheduler = nullptr;
    double copy_bytes_per_s = 0;
    bool copies_overlap = false;
    double warmup_seconds = 0;  // the warm-up iteration's wall time
  };
  // Chooses every call's way; fills report().
  void make_plan(const PlanInputs& in);
  // "auto"'s choice per measured call (ActivationChoice values; recompute where none was made), to
  // agree on across ranks.
  std::vector<uint8_t> choices() const;
  void set_choices(const std::vector<uint8_t>& choices);
  // The calls measured and their choices (any policy), and "auto"'s candidates.
  ActivationPlanReport report() const;

  // "auto"'s other ways, for the run plan (run_plan.h) to weigh with its own candidates: every
  // call kept ("none", where every call names its block), recomputed or offloaded, or a mix of
  // per-call ways (the run plan's own search), each as an edit of `running`, the trace recorded
  // under the current choices (the warm-up's as make_plan kept it, reshaped by the same model): a
  // moment both have is `running`'s with the model's change of its non-model bytes; a recompute
  // the current choices skip (a kept call) comes from the warm-up's trace, its forward's time
  // spread over its moments.
  struct Alternative {
    std::vector<ActivationChoice> choices;  // each call's way, as it runs (runs_as)
    std::optional<ActivationChoice> every;  // a whole-model way; none: a mix
    Trace trace;
    std::vector<int64_t> moment_of;         // per moment: its moment in `running`, or -1
    std::vector<double> recompute_seconds;  // per moment: recompute time it adds (or takes)
    int64_t peak_delta = 0;                 // the non-model peak's change
    // Forwards no longer recomputed, on the moments the alternative drops (newly kept calls).
    double recompute_saved = 0;
    // Its offloads' copies not hidden behind compute, less what of the current choices' the
    // measured compute holds (with a copy queue none: its waits are taken out).
    double exposed_delta = 0;
  };
  // Empty with `why` set where there is none to offer (not "auto", not planned, or `running` is
  // not the model's trace of the current choices: other moments).
  std::vector<Alternative> alternatives(const Trace& running, std::string* why) const;
  // "auto" planned and `running` is the model's trace of the current choices (else there is no
  // alternative: `why`).
  bool runs_model_trace(const Trace& running, std::string* why) const;
  // The alternative where the calls run `choices` (a call's own option and an unnamed call's
  // recompute win); none (with `why`) where alternatives() offers none, or `choices` run as the
  // current choices do.
  std::optional<Alternative> alternative(const Trace& running,
                                         const std::vector<ActivationChoice>& choices,
                                         std::string* why) const;
  // The ways each call may take in an alternative (its own option: its way only; an unnamed call:
  // not kept), and how the current choices run; empty unless "auto" planned.
  std::vector<std::vector<ActivationChoice>> call_ways() const;
  std::vector<ActivationChoice> running_choices() const {
    return planned_ ? runs_as(choices_) : std::vector<ActivationChoice>{};
  }
  // Runs every call `every`, or with nullopt the plan's own choices again; true when that changed
  // the choices (the trace must be recorded again).
  bool run_alternative(std::optional<ActivationChoice> every);
  // Runs each call as `choices` says (a mix the run plan found); true when that changed them.
  bool run_choices(const std::vector<ActivationChoice>& choices);
  bool runs_own_plan() const { return runs_as(choices_) == runs_as(own_choices_); }
  // The current choices' offload copies not hidden behind compute that the measured compute does
  // not hold (with a copy queue, all of them: its waits are taken out); 0 unless "auto" planned.
  double unmeasured_exposed_seconds() const;

 private:
  struct Call {
    bool named = false;
    bool forced = false;  // its own option ({.offload = ...}) chose its way
    int64_t input_bytes = 0;
    int64_t kept_bytes = 0;
    double forward_seconds = 0;
    int64_t plan_moment = -1;  // when the call was planned (before a named call's forward)
    int64_t forward_moment = -1;
    int64_t recompute_begin = -1;
    int64_t recompute_end = -1;
    int64_t live_at_recompute = 0;
    ActivationChoice measured = ActivationChoice::kRecompute;  // the way it ran when measured
  };
  struct Evaluation {
    bool fits = false;
    std::string why_not;
    int64_t peak = 0;
    int64_t traffic = 0;
    double seconds = 0;
  };
  // The warm-up trace reshaped to `choices`: the moments left (their warm-up numbers in `from`),
  // the forwards recomputed and the offload copies not hidden.
  struct Shaped {
    Trace trace;
    std::vector<int64_t> from;
    double recomputed = 0;
    double exposed = 0;
    int64_t peak = 0;
  };
  Shaped shape(const Trace& warmup, const std::vector<ActivationChoice>& choices, double bw,
               bool copies_overlap) const;
  Evaluation evaluate(const PlanInputs& in, const std::vector<ActivationChoice>& choices) const;
  std::vector<ActivationChoice> every_call(ActivationChoice every) const;
  // The whole-model ways in order (recompute, offload, keep): keep only where every call names its
  // block.
  std::vector<ActivationChoice> whole_model_ways() const;
  // How `choices` run: a call's own option and an unnamed call's recompute win.
  std::vector<ActivationChoice> runs_as(std::vector<ActivationChoice> choices) const;
  ActivationChoice default_choice(bool named) const;
  // The ways each measured call may take (call_ways() without the plan).
  std::vector<std::vector<ActivationChoice>> ways_of_calls() const;
  // The current choices' shape of the warm-up where `running` is that trace (its moments), else
  // none (with `why`): what runs_model_trace() checks and every alternative is edited against.
  std::optional<Shaped> running_shape(const Trace& running, std::string* why) const;
  // The alternative of `choices` (as they run) against `running`, whose shape is `now`; none where
  // they run as now.
  std::optional<Alternative> edit(const Trace& running, const Shaped& now,
                                  const std::vector<ActivationChoice>& choices) const;
  // Makes `choices` the current ones (the report names `instead`); true when they run otherwise.
  bool run(std::vector<ActivationChoice> choices, std::string instead);
  // The search for the shortest predicted step (make_plan), from the way the warm-up ran.
  std::vector<ActivationChoice> search(const PlanInputs& in, std::vector<ActivationChoice> best);
  // evaluate(), and kept in the report's candidates as `name`.
  Evaluation candidate(const PlanInputs& in, std::string name,
                       const std::vector<ActivationChoice>& choices);

  const ActivationPolicy policy_;
  std::vector<ActivationChoice> pinned_;  // "calls": the choice, not searched
  int64_t next_call_ = 0;
  int64_t forward_start_call_ = 0;
  bool measuring_ = true;
  bool planned_ = false;
  std::vector<Call> calls_;
  std::vector<ActivationChoice> choices_;      // "auto"'s, once planned (or an alternative's)
  std::vector<ActivationChoice> own_choices_;  // the plan's own
  Trace warmup_;                               // "auto"'s warm-up trace, kept by make_plan
  double copy_bytes_per_s_ = 0;
  bool copies_overlap_ = false;
  double common_seconds_ = 0;
  ActivationPlanReport report_;
};

// The per-call search both plans run (the activation plan's own with its model, the run plan's
// joint with the schedule and the Adam placement): from `start`, one call's way changed at a time
// in call order (to each of `ways[call]`), twice over, a change kept where `step` (a choice's
// predicted step; infinity where it does not fit) is shorter. Nothing is searched where `start`
// does not fit.
struct WaysFound {
  std::vector<ActivationChoice> best;
  double seconds = 0;
  int weighed = 0;  // choices `step` was asked for
};
WaysFound search_ways(std::vector<ActivationChoice> start,
                      const std::vector<std::vector<ActivationChoice>>& ways,
                      const std::function<double(const std::vector<ActivationChoice>&)>& step);

// The alternative's compute per moment from `running`'s measured compute (one per moment): a moment
// both have keeps its own; one the alternative adds (a recompute) takes its share of the call's
// forward; one it drops (a newly kept call's recompute) measured the recompute and what else ran
// until the next door (the block's backward): that time less the recomputes saved (in proportion,
// over every moment dropped) stays, on the moment before it.
std::vector<double> alternative_compute(const ActivationPlanner::Alternative& alternative,
                                        const std::vector<double>& running);

// The engine's activation component: the plan, the store of offloaded inputs (made at the first
// offload, over the engine's tiers and copy queue), and when the iteration being measured began.
struct Activations {
  explicit Activations(const ActivationConfig& config) : planner(config) {}
  ActivationPlanner planner;
  std::unique_ptr<ActivationStore> store;
  std::chrono::steady_clock::time_point iteration_start{};
  int64_t planned_chunk_elems = 0;  // the chunk size of the warm-up trace "auto" planned on
};

// The bytes per second of a copy between the tiers (the best of a few of `bytes`), or 0 where the
// host tier cannot spare the block.
double measure_copy_bandwidth(MemoryTier& device, MemoryTier& host, const c10::Device& where,
                              int64_t bytes);

}  // namespace patrickstar::engine_detail
