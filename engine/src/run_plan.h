// Private to engine/src: "plan": "auto" (docs/design.md, "The plan"). After the first scheduled
// iteration the engine knows the trace of every moment, and that iteration measured what each
// moment computes. The planner enumerates the settings that trace allows, predicts each one's step
// with memtracer's cost model (its chunk moves by replaying the scheduler on the candidate's trace
// at the device's budget), and keeps the fastest that fits the device. After a few iterations on
// the plan it compares the measured step with the prediction; past the tolerance it corrects the
// profile with what it measured and plans once more.
//
// The candidates, per chunk size, activations, step schedule and Adam placement:
// - the engine's chunk size, and with "default_chunk_size": "auto" the smallest of its grid and the
//   least-waste size between (the model moves into the chosen size between iterations);
// - with "activation_checkpointing": {"policy": "auto"}, at each of those chunk sizes, the
//   activation plan's whole-model alternatives to its own choice (every call recomputed,
//   offloaded, or kept), and the per-call mix the engine's search joint with the chunk size, the
//   schedule and the placement ends on (EngineCore::search_activation_calls), their traces edited
//   by its model: the activations change what the device keeps free, so the Adam placement, the
//   chunk moves and the step;
// - "serial" or "overlapped" (an optimizer thread updates each chunk index during backward, as
//   soon as its gradients are final; the same bits as serial);
// - Adam on the device for the chunk indices the margin holds ("margin"), on the host for all
//   ("host": the device keeps only what forward and backward need), or on the device also for
//   the indices whose param, gradient and states fit the step's free device memory ("streamed":
//   their states come in for the step and leave in the next forward, as the scheduler's replay
//   says);
// - "delayed" (every Adam on the host, on the delayed update's thread during the next iteration),
//   only where the config allows it (zero_optimization.delayed_param_update: true): it changes what
//   training computes (the weights are one update old), so it is never a candidate otherwise.
//
// Invariants:
// - evaluate_plan() is a pure function of its inputs; RunPlanner holds what it measured and what
//   it chose, and plans at most twice (the plan and one re-plan).
// - A candidate that does not fit (the scheduler refuses its trace) is never chosen; the engine's
//   own placement under the serial step always fits (it is the trace the engine runs).
// - Data parallel (EngineCore::agree_on_activations): every rank runs rank 0's chunk size and
//   activations; a rank's own choice (choose_within()) and its re-plan are among the candidates
//   that run them. Its candidates are the engine's own chunk size (the retry is one process's) and
//   no streamed placement or delayed update (one process's too).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "patrickstar/engine/config.h"
#include "patrickstar/engine/reports.h"
#include "patrickstar/memtracer/cost_model.h"
#include "patrickstar/memtracer/scheduler.h"
#include "patrickstar/memtracer/trace.h"

namespace patrickstar::engine_detail {

// What the machine does, as the plan assumes it.
struct PlanProfile {
  std::string name;  // "measured", or a named GPU model's rates for copies and Adam
  double h2d_bytes_per_s = 0;
  double d2h_bytes_per_s = 0;
  double host_adam_params_per_s = 0;
  // Device Adam: parameters per second (the emulated device runs the host kernel on its memory),
  // or, when 0, its chunks' bytes read and written once at device_memory_bytes_per_s.
  double device_adam_params_per_s = 0;
  double device_memory_bytes_per_s = 0;
  // The share of the work on other threads (the copy queue, the optimizer thread) that runs beside
  // compute: 1 on a GPU; on the emulated device 1 where a core is free of compute threads, else 0
  // (it takes compute's cores).
  double beside_compute = 1;
  // Every moment's measured compute is multiplied by this (the self-check's correction).
  double compute_scale = 1;
  std::string sources;  // where each figure comes from
};

// One chunk index that updates at the step.
struct PlanIndex {
  double params = 0;                 // elements its Adam updates
  std::vector<int64_t> device_side;  // chunks its Adam reads on the device (step moment accesses)
  std::vector<int64_t> host_side;    // chunks its Adam needs on the host
  int64_t device_adam_bytes = 0;     // bytes of device_side
  int64_t undo_bytes = 0;            // what the overlapped step copies to undo an update ahead
  std::vector<int64_t> own = {};     // its param and gradient chunks (find_ready_moments)
  int64_t ready_after = -1;          // its gradients are final after this moment
  bool on_device = false;            // on the device under the margin's placement
  bool streamed = false;             // on the device under the streamed placement
  bool ran_on_device = false;        // in the measured step (the engine's placement then)
  bool device_only = false;          // states on the device for good: Adam there in every plan
};

// One chunk size: its trace (the chunks each moment accesses, the step moment's with the
// placement the engine ran: the candidates move indices between its two sides), its chunks and the
// indices that update.
struct PlanLayout {
  int64_t chunk_elems = 0;
  Trace trace;
  std::map<int64_t, ChunkInfo> chunks;
  std::vector<PlanIndex> indices;
  // The delayed update's copies fit the host beside this size's chunks (where it is allowed).
  bool delayed_fits = true;
  // With "auto" activations, a whole-model way the activation plan did not choose
  // ("activation_checkpointing.policy": "recompute", "offload" or "none"), or "per call" (a mix the
  // run plan's own search found); empty: the activations the engine runs. `activation_calls`:
  // each call's way ("keep", "recompute", "offload"; empty unless "auto" planned at the engine's
  // chunk size). Its trace and
  // per-moment compute (empty: PlanInputs::compute_seconds) are the measured ones edited by the
  // activation plan's model, and `extra_seconds` is what that model
  // adds beyond the measured compute (offload copies not hidden, whose waits the measured compute
  // leaves out; also for the activations the engine runs).
  std::string activations;
  std::vector<std::string> activation_calls;
  std::vector<double> compute_seconds;
  double extra_seconds = 0;
};

struct PlanInputs {
  // The engine's size and scheduled trace first, then the other sizes "auto" allows (their traces
  // made from the warm-up's per-moment tensors), then the engine's size under each activation
  // alternative and the per-call search's mix, then those at the other sizes: the order of
  // preference on a tie.
  std::vector<PlanLayout> layouts;
  SchedulerOptions scheduler;
  std::vector<double> compute_seconds;  // per moment: measured, the step moment without Adam
  // An optimizer thread exists (no disk tier) and "overlap_step" is not false.
  bool overlap_possible = false;
  // The config allows the delayed update (its thread exists): what its hand-over and landing copy
  // on the training thread per parameter updated (the gradient's copy, in fp32 the weight's, the
  // weights written back), at the profile's copy rate back (a GPU profile's PCIe rate is
  // optimistic for host copies).
  bool delayed_possible = false;
  double delayed_bytes_per_param = 0;
  bool async_moves = true;        // copies on a queue beside compute (else inline: all exposed)
  bool host_placement_possible = true;
  // The streamed placement is a candidate (hybrid Adam, no disk tier) where it puts more indices
  // on the device than the margin's.
  bool streamed_possible = false;
  std::string activation_search;  // the per-call search's line (PlanReport::activation_search)
};

// The trace's (last) step moment, or -1.
int64_t step_moment_of(const Trace& trace);
// The non-model bytes at the trace's step: its moment's interval and the tail after it (0 without
// a step moment).
int64_t step_non_model_of(const Trace& trace);

// Each index's ready_after: the last moment before the (last) step moment whose accesses or host
// chunks include one of its own chunks (the step moment less one when none does).
void find_ready_moments(PlanLayout& layout);

// The layout of `inputs` a candidate of theirs was predicted on (its chunk size and activations),
// or null.
const PlanLayout* layout_of(const PlanInputs& inputs, const PlanCandidateReport& candidate);

// Every candidate's prediction, in the order of preference on a tie (the engine's chunk size
// first, serial before overlapped before delayed, margin before host before streamed), and the
// index of the chosen one (-1 when none fits).
struct PlanEvaluation {
  std::vector<PlanCandidateReport> candidates;
  int chosen = -1;
  std::string why;
};
PlanEvaluation evaluate_plan(const PlanInputs& inputs, const PlanProfile& profile);
// What a candidate runs that every rank must run alike under data parallel: its chunk size and
// activations.
std::string activation_key(const PlanCandidateReport& candidate);

// The plan's choice among `candidates` (those `allowed` admits; null: all): the fastest predicted
// step that fits, or within 1% of it the first in the order of preference; -1 where none fits.
// `why` says which and what came next.
int choose_candidate(const std::vector<PlanCandidateReport>& candidates,
                     const std::function<bool(const PlanCandidateReport&)>& allowed,
                     std::string& why);

// A named profile ("h100", "h200": memtracer's GPU cost models' copy and Adam rates); throws
// c10::Error for another name.
PlanProfile named_plan_profile(const std::string& name);

// The planner's state over the run (EngineCore's plan component).
class RunPlanner {
 public:
  explicit RunPlanner(const PlanConfig& config) : config_(config) {}
  bool enabled() const { return config_.mode == PlanMode::kAuto; }
  const PlanConfig& config() const { return config_; }

  // The iteration measured for the plan (the first scheduled one): each moment's start, with the
  // copy wait and the bytes moved so far.
  bool measuring() const { return measuring_; }
  // Data parallel, before the plan: every rank takes one turn in the plan's agreement per step()
  // (plan_after_step, or the step's failure path where the step threw before it).
  void begin_turn() { turn_taken_ = false; }
  // Marks this step's turn taken; false when it was already.
  bool take_turn() { return !std::exchange(turn_taken_, true); }
  struct Mark {
    double time = 0;  // seconds on the steady clock
    double copy_wait = 0;
    int64_t moved_bytes = 0;
  };
  // The next iteration is measured, from its first moment to the end of its step (the engine's
  // own iteration: what the trainer does between its step and its next forward is not planned).
  void begin_measuring() {
    measuring_ = true;
    marks_.clear();
  }
  void note_moment(int64_t moment, const Mark& mark);
  // The measured iteration's end (`mark` after its step; `adam_seconds` the step's update):
  // each moment's compute, the step moment's without the update. Empty when the marks are not one
  // per moment of `moments`.
  // The copy wait from moment `moment`'s mark to `mark` (0 without one): what the step moment's
  // update time holds of copies.
  double copy_wait_since(int64_t moment, const Mark& mark) const {
    if (!measuring_ || moment < 0 || moment >= static_cast<int64_t>(marks_.size())) return 0;
    return mark.copy_wait - marks_[static_cast<size_t>(moment)].copy_wait;
  }
  std::vector<double> end_measuring(int64_t moments, int64_t step_moment, const Mark& mark,
                                    double adam_seconds, double copy_bytes_per_s, bool sync_moves);

  // Plans (the first time) or re-plans: keeps the evaluation; returns the chosen candidate, or
  // null when none fits (the report says so; the engine keeps the config's settings).
  const PlanCandidateReport* plan(const PlanInputs& inputs, const PlanProfile& profile);
  // Data parallel: the choice among the candidates whose activation_key() is `key` (the plan's
  // own where it is one of them, else chosen again among them by the same rule), `why` leading
  // the reason; null when none of them fits.
  const PlanCandidateReport* choose_within(const std::string& key, const std::string& why);
  // The plan could not be made (`why`): the report says so, and nothing is planned again.
  void give_up(const std::string& why);
  bool planned() const { return report_.planned; }
  const PlanReport& report() const { return report_; }
  PlanReport& report() { return report_; }
  const PlanInputs& inputs() const { return inputs_; }
  const PlanProfile& profile() const { return profile_; }

  // An iteration on the plan ended, `seconds` from its first moment; `counted`: it ran the plan
  // as planned (not retraced, skipped or clipped). Returns true when the check found the
  // prediction off by more than the tolerance and the profile was corrected (the caller re-plans
  // with profile()); the report holds the check's line either way.
  bool end_iteration(bool counted, double seconds);
  int checks() const { return checks_; }
  // Under a delayed plan: whether this iteration (`handed_over`: its step handed its update over)
  // is a steady one, the step before having handed over too.
  bool steady_hand_over(bool handed_over) {
    const bool steady = handed_over && last_handed_over_;
    last_handed_over_ = handed_over;
    return steady;
  }
  // The peak of non-model bytes the engine's Adam placement was decided with (the margin's).
  void note_placement_peak(int64_t bytes) { placement_peak_ = bytes; }
  int64_t placement_peak() const { return placement_peak_; }
  // The plan's size did not fit after all and the chunk-size retry moved the model (`why`): the
  // check stops (its prediction was another size's).
  void stop_checking(const std::string& why);
  // The first moment of the iteration in progress (the check times iterations from there to the
  // end of their step).
  const Mark& iteration_start() const { return iteration_start_; }
  void iteration_began(const Mark& mark) { iteration_start_ = mark; }

 private:
  PlanConfig config_;
  bool measuring_ = false;
  bool turn_taken_ = false;
  Mark iteration_start_;
  std::vector<Mark> marks_;
  int checks_ = 0;
  bool last_handed_over_ = false;
  int64_t placement_peak_ = 0;
  PlanInputs inputs_;
  PlanProfile profile_;
  std::vector<double> samples_;
  PlanReport report_;
};

}  // namespace patrickstar::engine_detail
