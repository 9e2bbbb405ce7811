// What the engine reports: one IterationReport per optimizer step, one RegistrationReport for the
// model data. Exact byte counts; times are wall-clock seconds.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "patrickstar/optimizer/placement.h"

namespace patrickstar {

// What one optimizer step (one iteration) did: exact bytes, where Adam ran, the loss scale.
struct IterationReport {
  int64_t iteration = 0;          // 0 is the warm-up
  bool warmup = false;
  bool skipped = false;           // fp16 overflow: weights unchanged, scale lowered
  double loss_scale = 1.0;
  double grad_norm = 0.0;
  int64_t h2d_bytes = 0;          // every chunk move this iteration, both directions
  int64_t d2h_bytes = 0;
  // Of the warm-up's h2d_bytes: the chunks brought back at its end for the first scheduled
  // iteration (the warm start, at most the device's chunk budget); 0 in other iterations.
  int64_t warm_start_h2d_bytes = 0;
  // Asynchronous moves: how long compute waited for chunk copies this iteration (the copy time
  // that did not overlap compute); 0 with synchronous moves, whose copies are all exposed. On CUDA
  // also the time the compute stream stood waiting on a copy's event on the GPU, in the first
  // report made once the GPU has passed that wait (reports never wait for the GPU).
  double copy_wait_seconds = 0;
  int64_t device_chunk_peak_bytes = 0;  // the device tier's peak during the iteration
  int64_t non_model_peak_bytes = 0;     // the probe's peak during the iteration
  int64_t evictions = 0;
  int64_t prefetches = 0;
  // Of d2h_bytes: chunks sent to the host for the host-side Adam (gradients in, new weights out);
  // they return at their next use. The rest of the traffic is the scheduler's choice.
  int64_t adam_host_d2h_bytes = 0;
  // "default_chunk_size": "auto": this warm-up's trace did not fit the device with the chunk size
  // in use, and the model moved into chunks of this many elements after the step (the least waste
  // with which every moment fits; the next iteration is a warm-up again). 0: no change.
  int64_t chunk_elems_retried = 0;
  // The moments differed from the trace, which was re-recorded in this iteration (a warm-up
  // schedule from that moment on); retraces counts such iterations since the engine was built.
  bool retraced = false;
  int64_t retraces = 0;
  PlacementReport adam;           // chunks and bytes of optimizer state updated on device / host
  // The disk tier (zero_optimization.offload_optimizer.device "nvme"): optimizer-state bytes read
  // from and written to its files this iteration (0 without it).
  int64_t disk_read_bytes = 0;
  int64_t disk_written_bytes = 0;
  // Wall time of the optimizer step (both Adams, the disk tier's I/O included), and of it the time
  // the engine waited for the disk tier (reads not done ahead, writes still going at the end).
  double adam_seconds = 0;
  double disk_wait_seconds = 0;
  // What the engine cost the host outside the step, since the last step: the wall time inside its
  // entry points (the doors, the backward hooks, gradient arrival, a backward's start and end; an
  // entry nested in another counts once) and how many there were. And the host synchronizations
  // (waits for the device's queued work: the loss's finiteness check, the gradient norm's read, a
  // synchronous copy, a copy stream's wait; chunk/host_syncs.h), the step's included. On the
  // emulated device the loss check and the norm read count where CUDA's would.
  double engine_host_seconds = 0;
  int64_t engine_entries = 0;
  int64_t host_syncs = 0;
  // The overlapped step ("zero_optimization.overlap_step"): runs of tensors whose host Adam ran
  // on the optimizer thread during backward and that the step committed as they were, or undid
  // (clipping, an overflow, another learning rate) and recomputed; chunk indices taken back before
  // the step (a late gradient, the trainer's gradient edits, a door); the optimizer thread's busy
  // seconds (hidden behind backward but for what the step waited, which adam_seconds includes);
  // the undo buffers it holds (kept between iterations).
  int64_t early_updates_committed = 0;
  int64_t early_updates_undone = 0;
  int64_t early_updates_cancelled = 0;
  double optimizer_thread_seconds = 0;
  int64_t early_update_buffer_bytes = 0;
  // Whether this iteration's backward could update ahead (the overlap on and not paused; under
  // "auto", the way its trial measured in this iteration, or the one it kept), and, on the
  // iteration where "auto" decided, the decision with its measurements (docs/design.md, "The
  // overlapped step"); else empty.
  bool early_updates_allowed = false;
  std::string overlap_step_decision;
  // "plan": "auto": on the iteration where the engine planned, checked its plan or planned again,
  // what it did (PlanReport::text() of Engine::plan() has every candidate); else empty.
  std::string plan_decision;
  // The delayed update ("zero_optimization.delayed_param_update"), past its warm-up: this step's
  // update was handed to the optimizer thread and runs during the next iteration. skipped,
  // grad_norm and loss_scale are then those of the update written in since the last step (the
  // last step's, whose thread seconds optimizer_thread_seconds counts; defaults on the first
  // delayed step, which had none); delayed_update_wait_seconds is how long the training thread
  // waited for it since the last step (at this step, or earlier where something read the weights:
  // what the forward and backward did not hide); delayed_update_buffer_bytes the copies it keeps
  // (gradients; in fp32 also the weights).
  bool update_delayed = false;
  double delayed_update_wait_seconds = 0;
  int64_t delayed_update_buffer_bytes = 0;
  // Data parallel (world size > 1; all zero with one process). Bytes as Communicator counts them,
  // over the world, the shard group and the replica group together, with k the shard group's size
  // (Engine::shard_group_size(), world_size unless hybrid sharding): a group gather is one
  // all-gather of the group's k param chunks into one buffer (k x a param chunk's bytes); a group
  // reduce sends each of its fp32 gradient chunks to its owner (k x chunk_elems x 4); all-reduces
  // agree on the loss's finiteness and the gradient norm and, with hybrid sharding, add each
  // owner's reduced chunk over the replicas once per iteration (chunk_elems x 4 each).
  int64_t group_gathers = 0;      // comm groups gathered (forward and backward)
  int64_t group_reduces = 0;      // comm groups whose gradients were reduced into their owners
  // The most device bytes that gathered group buffers held at once (the doors place them, not the
  // scheduler; the trace counts them as non-model bytes, so non_model_peak_bytes includes them).
  int64_t gathered_peak_bytes = 0;
  int64_t gather_bytes = 0;
  int64_t reduce_bytes = 0;
  int64_t all_reduce_bytes = 0;
  double collective_seconds = 0;  // wall time inside collectives
  // Offloaded checkpoint inputs (patrickstar::checkpoint, "activation_checkpointing"): bytes copied
  // to the host tier and back this iteration, bytes left on the device because the host tier was
  // full, the most host-tier bytes they held at once, and what they hold at the step (0 once
  // every backward has taken its inputs back).
  int64_t activation_offload_bytes = 0;
  int64_t activation_prefetch_bytes = 0;
  int64_t activation_refused_bytes = 0;
  int64_t activation_host_peak_bytes = 0;
  int64_t activation_host_bytes = 0;
  // "policy": "auto": true on the iteration whose warm-up the plan was made from
  // (Engine::activation_plan()); the next iteration records the trace again under it.
  bool activation_plan_made = false;
};

// The activation plan ("activation_checkpointing": {"policy": ...}; docs/design.md,
// "Activations"): what the warm-up measured of each checkpointed call of an iteration, what each
// call does, and for "auto" the candidates the cost model compared.
struct ActivationCallPlan {
  int64_t call = 0;            // in call order within an iteration
  bool named = false;          // checkpoint(block, ...): may be kept
  int64_t input_bytes = 0;     // the saved input
  int64_t kept_bytes = 0;      // its activations when kept (measured in the recompute)
  double forward_seconds = 0;  // its forward (the least of the forward and the recompute)
  std::string choice;          // "keep", "recompute" or "offload"
};
struct ActivationCandidate {
  std::string name;  // "every call: recompute", ..., "chosen"
  bool fits = false;
  std::string why_not;  // when it does not fit
  int64_t non_model_peak_bytes = 0;
  int64_t traffic_bytes = 0;  // chunk moves per iteration (the OPT bound at this plan's budgets)
  double predicted_seconds = 0;
};
struct ActivationPlanReport {
  std::string policy;    // "recompute", "offload", "none" or "auto"
  bool planned = false;  // "auto" made its choice (after the warm-up)
  std::vector<ActivationCallPlan> calls;
  std::vector<ActivationCandidate> candidates;
  // The cost model's figures: the copy bandwidth measured here, the compute every plan shares (the
  // warm-up's time less its recomputes and its chunk moves), whether copies overlap compute.
  double copy_bytes_per_s = 0;
  double common_seconds = 0;
  bool copies_overlap = false;
  double predicted_step_seconds = 0;  // the chosen plan's
  // With "plan": "auto": the ways the run plan runs instead of this plan's choice ("every call:
  // recompute", "every call: offload" or "every call: keep", or "per call: keep, recompute, ..." in
  // call order, a mix its own search found; empty: this plan's own).
  std::string run_plan_instead;
  // Lines for a log: the calls, the candidates and the choice.
  std::string text() const;
};

// "plan": "auto" (Engine::plan(); docs/design.md, "The plan"): one candidate setting and what the
// cost model predicts for it on the measured trace.
struct PlanCandidateReport {
  std::string name;        // "chunks 3448832, serial, Adam margin (1 of 2 on the device)", ...
  int64_t chunk_elems = 0;  // elements per chunk
  std::string schedule;     // "serial", "overlapped" or "delayed"
  // "margin" (the margin's indices on the device), "host", or "streamed" (also the indices the
  // step's free device memory holds, their states brought in for the update)
  std::string adam;
  // With "auto" activations, where this candidate runs the checkpoint calls another way than the
  // activation plan chose: every call "recompute", "offload" or "none" (keep), as the policy names
  // them, or "per call" (a mix the plan's own search found, in activation_calls)
  std::string activations;
  // With "auto" activations: each call's way in this candidate ("keep", "recompute", "offload"),
  // which config_json() pins (activation_checkpointing.calls) where it is not a whole-model way
  std::vector<std::string> activation_calls;
  int64_t adam_device_indices = 0;  // chunk indices whose Adam runs on the device
  bool fits = false;
  std::string why_not;  // when it does not fit
  double predicted_step_seconds = 0;
  double compute_seconds = 0;       // with the serial step's host Adam
  double host_adam_seconds = 0;     // wherever it runs
  double exposed_copy_seconds = 0;  // compute waiting for copies
  // Work on other threads (copies, the optimizer thread's updates) the prediction hides behind
  // compute: the self-check's lever when the measured step is longer.
  double beside_seconds = 0;
  int64_t device_peak_bytes = 0;    // chunks and non-model bytes, the steady iteration's
  int64_t h2d_bytes = 0;            // per iteration
  int64_t d2h_bytes = 0;
  double measured_step_seconds = 0;  // the chosen one's, once the check measured it
};
struct PlanReport {
  bool planned = false;
  std::string profile;  // the profile's figures and their sources
  std::vector<PlanCandidateReport> candidates;
  int chosen = -1;  // into candidates
  std::string why;
  // With "auto" activations: what the per-call search joint with the schedule and the Adam
  // placement weighed and found (a "per call" candidate, or nothing shorter).
  std::string activation_search;
  double predicted_step_seconds = 0;  // the chosen candidate's
  // What the last plan took on the training thread, between two iterations: the candidates'
  // traces, the per-call search and every candidate's replay (not the copy-rate probe before).
  double planning_seconds = 0;
  // The self-check: the median step over plan_check_iterations iterations on the plan, and
  // whether its difference from the prediction passed the tolerance and the engine planned again.
  double measured_step_seconds = 0;
  bool checked = false;
  bool replanned = false;
  std::string check;  // the check's line
  // Lines for a log: every candidate, the choice, the check.
  std::string text() const;
  // The chosen settings as a config document's keys ("plan": "off", "default_chunk_size", the
  // keys that pin the step schedule and the Adam placement, and the activation policy where the
  // candidate runs another than the activation plan's),
  // for --write-plan; empty before the plan.
  std::string config_json() const;
};

// Model-data figures, fixed after registration.
struct RegistrationReport {
  int64_t params = 0;             // registered elements (tied parameters once)
  int64_t tensors = 0;
  int64_t trainable_params = 0;
  // The chunk size in use (after "auto"'s retries, see IterationReport::chunk_elems_retried).
  int64_t chunk_elems = 0;
  int64_t chunks_per_kind = 0;
  int64_t chunk_size_retries = 0;  // times "auto" moved the model into smaller chunks
  int64_t chunk_waste_elems = 0;
  double chunk_waste_fraction = 0;
  int64_t model_data_bytes = 0;   // every payload of every kind this rank owns (all, one rank)
  // Of model_data_bytes: optimizer states kept in the disk tier's files (0 without one).
  int64_t disk_bytes = 0;
  // Of model_data_bytes: optimizer states placed on the device for good because the host budget
  // could not hold them (0 when it could; docs/design.md, "Host plus device").
  int64_t device_state_bytes = 0;
  double model_data_bytes_per_param = 0;
  // Host memory during initialization: the peak of LibTorch's CPU allocations (through the
  // counting allocator) plus the host tier, over building the model (when initialize_engine built
  // it) and registering it. Registration streams chunk by chunk, so the goal is
  // init_goal_bytes: the model data plus the largest module's own parameters in fp32.
  int64_t host_peak_bytes_during_init = 0;
  int64_t model_construction_peak_bytes = 0;  // the factory's part (0 when not measured)
  int64_t largest_module_param_bytes = 0;     // fp32 bytes of one module's own parameters, largest
  int64_t init_goal_bytes = 0;
};

}  // namespace patrickstar
