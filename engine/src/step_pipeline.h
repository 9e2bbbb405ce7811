// Private to engine/src: the step pipeline, everything on the optimizer side of the engine. It owns
// the hybrid Adam, where each chunk index's Adam runs (AdamPlacement), the overlapped step (its
// optimizer thread, its "auto" trial, its pause, what it updated ahead) and the delayed update (its
// thread and buffers), and it stages the disk tier's optimizer states for whoever reads them. The
// engine tells it what happens (a backward moment passed, an index is about to be used, the
// gradients change, a retrace, the step with its inputs) and takes its reports; docs/design.md,
// "Inside the engine", has the picture.
//
// Invariants:
// - Weights and optimizer states are read or written outside the pipeline only through a
//   StateAccess, which the pipeline hands out after taking back every update made ahead and
//   landing the delayed update in flight: its holder sees the committed values, and the optimizer
//   threads are quiet while it reads (the functions that take one as a parameter cannot be called
//   without it). Releasing it writes back what was written through staged views and frees them.
// - An index updated ahead is one whose chunks no moment of this iteration touches again and whose
//   gradients nobody changed since the optimizer thread read them; every event below that breaks
//   that takes the update back first, so the step commits exactly what the serial step computes.
// - At most one delayed update is in flight; a forward and its backward read the weights they
//   began with (a landing in between only waits for it), and the step lands it before its own.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include <ATen/core/Tensor.h>

#include "patrickstar/chunk/types.h"
#include "patrickstar/engine/config.h"
#include "patrickstar/engine/reports.h"
#include "patrickstar/memtracer/scheduler.h"
#include "patrickstar/optimizer/hybrid_adam.h"

#include "adam_placement.h"
#include "delayed_update.h"
#include "gradient_state.h"
#include "iteration_tracker.h"
#include "model_storage.h"
#include "overlap_trial.h"
#include "param_table.h"
#include "step_overlap.h"

namespace patrickstar::engine_detail {

// Every kind of chunk an index's Adam update reads or writes (those the store has).
inline constexpr ChunkKind kAdamKinds[] = {ChunkKind::kParam, ChunkKind::kGrad,
                                           ChunkKind::kParamFp32, ChunkKind::kMomentum,
                                           ChunkKind::kVariance};

// The most elements of one Adam run (an AdamChunk of the step): 4 Mi elements, undo buffers of
// 48 MiB (56 in mixed precision) when the overlapped step updates it ahead.
inline constexpr int64_t kAdamRunElems = int64_t{1} << 22;

class StepPipeline;

// Access to weights and optimizer states (move-only; StepPipeline::access hands it out). Every
// function that reads or writes them takes one, so none can run while the optimizer threads could
// still change what it reads.
class StateAccess {
 public:
  StateAccess(StateAccess&& other) noexcept : pipeline_(other.pipeline_) { other.pipeline_ = nullptr; }
  StateAccess& operator=(StateAccess&&) = delete;
  StateAccess(const StateAccess&) = delete;
  StateAccess& operator=(const StateAccess&) = delete;
  ~StateAccess();
  // An optimizer-state view of one parameter (master, momentum, variance) wherever it lives: with a
  // disk tier its chunk index is staged into host memory (one index at a time). `write`: what is
  // written through it goes back to the file at finish_views().
  at::Tensor state(TensorId id, ChunkKind kind, bool write = false) const;
  // The weights a parameter's fp32 value comes from: its master, or for a lean index its param
  // chunk (in mixed precision the half weight, which is all there is).
  at::Tensor weight(TensorId id, bool write = false) const;
  // After a pass of views: writes back what was written and frees the staging (throws when a
  // write fails; the destructor does it too, and warns instead).
  void finish_views() const;

 private:
  friend class StepPipeline;
  explicit StateAccess(const StepPipeline* pipeline) : pipeline_(pipeline) {}
  const StepPipeline* pipeline_;
};

// What the pipeline reads of the engine's other components.
struct PipelineWiring {
  const Config& config;
  ParamTable& params;  // has_grad, pending gradients, segments; it advances adam_steps
  ModelStorage& storage;
  const GradientState& gradients;  // data parallel: the reduced sums
  const IterationTracker& tracker;
  std::function<const Scheduler&()> scheduler;  // rebuilt by "auto"'s retry
  std::function<ChunkMover&()> mover;
  bool shards_gradients = false;  // data parallel: reduced sums hold the owners' gradients
  bool mixed = false;        // bf16 or fp16: half weights, fp32 masters
  std::function<bool(int64_t index)> owns;  // data parallel: this rank steps index `index`
  // The parameter group of each tensor (param_groups.h): the options its update runs with.
  std::function<int32_t(TensorId id)> group_of;
  // Data parallel: index `index`'s comm group holds gradients still to be reduced.
  std::function<bool(int64_t index)> reduction_pending;
};

// What the step asks of the pipeline, and what the pipeline reports back.
struct StepInputs {
  std::vector<bool> on_device;  // per chunk index: its Adam runs on the device in this step
  bool delayed = false;         // the update goes to the delayed update's thread
  std::function<void()> staged;  // a disk tier's states are staged (the host's peak)
};

// The margin hybrid Adam may fill with optimizer states: what the device keeps free at the peak of
// non-model bytes with every param (and gradient) chunk resident and the states placed there for
// good, times "margin_use_ratio" (StepPipeline::decide_placement; the plan places other chunk sizes
// with it).
inline int64_t adam_margin_bytes(int64_t usable_device_bytes, int64_t peak_non_model,
                                 int64_t resident_model_bytes, int64_t device_state_bytes,
                                 double margin_use_ratio) {
  return static_cast<int64_t>(static_cast<double>(usable_device_bytes - peak_non_model -
                                                  resident_model_bytes - device_state_bytes) *
                              margin_use_ratio);
}

// What the step has for the streamed placement (AdamSite::kStreamed): the usable device less the
// non-model bytes live at the step, times "margin_use_ratio". The device sides (param, gradient,
// states) of every index whose Adam runs on the device must fit it at once.
inline int64_t streamed_budget_bytes(int64_t usable_device_bytes, int64_t step_non_model,
                                     double margin_use_ratio) {
  return static_cast<int64_t>(static_cast<double>(usable_device_bytes - step_non_model) *
                              margin_use_ratio);
}

// The streamed placement: `on_device` (the margin's and the device-only indices, whose device
// sides are taken from `budget` first), plus, in index order, every `candidate` index whose device
// side fits what is left (first fit). One entry per index in each vector.
std::vector<bool> streamed_placement(const std::vector<int64_t>& device_side_bytes,
                                     std::vector<bool> on_device,
                                     const std::vector<bool>& candidate, int64_t budget);

// Where the config puts Adam when no plan chose: streamed with "stream_states", else the margin.
inline AdamSite config_adam_site(const Config& config) {
  return config.optimizer.stream_states ? AdamSite::kStreamed : AdamSite::kMargin;
}

// The figures a placement is decided from.
struct PlacementFigures {
  int64_t peak_non_model = 0;  // the trace's peak (the margin)
  int64_t step_non_model = 0;  // live at the step (the streamed placement)
  int64_t usable_device_bytes = 0;
  int64_t device_state_bytes = 0;  // states on the device for good
};

class StepPipeline {
 public:
  explicit StepPipeline(PipelineWiring wiring);
  ~StepPipeline();
  StepPipeline(const StepPipeline&) = delete;
  StepPipeline& operator=(const StepPipeline&) = delete;

  // Registration: the optimizer thread, if any (`overlap_max_bytes`: the overlapped step's undo
  // buffers at most; `host_blocks` allocates the thread's buffers from the host tier; `clock`: the
  // time line of its spans), then the optimizer (`grad_space`: a separate fp32 gradient chunk
  // list).
  enum class Thread { kNone, kOverlap, kDelayed };
  void build_thread(Thread thread, int64_t overlap_max_bytes,
                    std::function<at::Tensor(int64_t, at::ScalarType)> host_blocks,
                    std::function<int64_t()> clock);
  void build_adam(const AdamOptions& options, LossScaler scaler, bool grad_space);
  // The optimizer threads stop (the engine goes), after their updates were taken.
  void stop_threads();

  // --- access to weights and states ---
  // Takes back every update made ahead and lands the delayed update (between a forward and its
  // backward it only waits for it, unless `even_mid_iteration`: the engine's end).
  StateAccess access(bool even_mid_iteration = false);

  // --- events ---
  // The chunks of index `index` are about to be read or changed (a moment, a gradient, a gather
  // or reduction of its group): what was updated ahead for it is taken back.
  void on_index_used(int64_t index);
  // The gradients change (a new backward, zero_grad, edits by the trainer, a dropped iteration).
  void on_gradients_change();
  // An evaluation forward reads the weights of `indices` where they are.
  void on_evaluation_reads(const std::vector<int64_t>& indices);
  // The trace was dropped: the placement and what the overlap assumed are decided again.
  void on_retrace();
  // The iteration was dropped: its updates ahead go, and its counters.
  void on_iteration_dropped();
  // A new layout of `chunks` chunk ids over `indices` chunk indices ("auto"'s retry).
  void on_new_layout(int64_t chunks, int64_t indices);
  // Backward moment `moment` is recorded: indices the trace no longer accesses before the step go
  // to the optimizer thread (when the overlap applies).
  void on_backward_moment(int64_t moment, bool retraced);
  // The backward ended; `views_shown`: the trainer may now write gradients through grad() views.
  void on_backward_end(bool views_shown);
  // Chunk `id` is about to move: the thread that reads it leaves it first.
  void before_chunk_move(ChunkId id);

  // --- the step ---
  // Decides where each index's Adam runs (adam_site()), from the peak of non-model bytes the trace
  // measured (and, streamed, what is live at the step).
  void decide_placement(const PlacementFigures& figures);
  // The placement `site` would decide from `figures` (per chunk index, the device-only indices
  // included).
  std::vector<bool> placement_for(AdamSite site, const PlacementFigures& figures) const;
  // Lands the delayed update in flight (its weights are written before this step's views).
  void begin_step();
  // Lands the delayed update in flight whatever the phase, and gives its kept buffers back (the
  // model moves into other chunks: the next hand-over's runs have other sizes).
  void land_delayed_now();
  // Whether this step hands its update over to the delayed update (past its warm-up).
  bool delayed_due(int64_t iteration, bool has_trace) const;
  // Updates every run of this rank's indices with a gradient; fills the report's update figures
  // (skipped, loss scale, norm, updates ahead committed and undone, where each index's Adam ran).
  void update(const StepInputs& inputs, IterationReport& report);
  // After a step that succeeded: every update ahead was committed or undone (the report gets the
  // optimizer thread's figures), and the next backward looks at every index again.
  void after_step(IterationReport& report);
  // A step that failed: "auto"'s trial does not time the next iteration.
  void step_failed();
  // Whether the overlap applies to a backward now, and whether it may update ahead (under "auto",
  // the trial's way).
  bool overlap_applies(bool retraced) const;
  bool early_updates_may_start(bool retraced) const;
  // The end of step(): under "auto", the trial gets this iteration's wall time (`measurable`: the
  // backward ran the trial's way).
  void end_trial_iteration(bool measurable, IterationReport& report);

  // --- settings and what the engine reports ---
  double lr() const { return adam_->options().lr(); }
  // Every parameter group's options (HybridAdam::set_groups) for the next steps, after the update
  // in flight (it finishes with its own).
  void set_group_options(const std::vector<AdamOptions>& groups);
  void set_overlap_step(bool on);
  // "plan": "auto" with zero_optimization.delayed_param_update: whether the steps past its
  // warm-up hand their update to the delayed update's thread (every Adam then on the host). The
  // overlapped step must be off to turn it on, and the other way round. Between iterations: off
  // lands the update in flight and gives its buffers back to the host tier.
  void set_delayed_update(bool on);
  bool delayed_update_on() const { return delayed_on_; }
  // Whether the delayed update's thread exists (the config enables it).
  bool delayed_possible() const { return delayed_ != nullptr; }
  // The config's "overlap_step" again ("auto": its trial from the start), or with
  // delayed_param_update the delayed update alone, after "plan": "auto" held the schedule and
  // made no plan.
  void restore_overlap_mode();
  // Where the next placement puts Adam (decided again after the engine drops its trace): the
  // config's ("stream_states": streamed, else the margin), or the plan's choice.
  void set_adam_site(AdamSite site) { adam_site_ = site; }
  AdamSite adam_site() const { return adam_site_; }
  // Whether an optimizer thread for the overlapped step exists (no disk tier; with the delayed
  // update only under "plan": "auto", which runs one of the two).
  bool overlap_possible() const { return overlap_.thread != nullptr; }
  void set_record_spans(bool on);
  std::vector<CopySpan> optimizer_spans() const;
  HybridAdam& adam() { return *adam_; }
  const HybridAdam& adam() const { return *adam_; }
  AdamPlacement& placement() { return placement_; }
  const AdamPlacement& placement() const { return placement_; }
  bool mixed() const { return mixed_; }
  // Where Adam's fp32 weights live: the fp32 master chunks in mixed precision, else the params.
  ChunkKind master_kind() const { return mixed_ ? ChunkKind::kParamFp32 : ChunkKind::kParam; }
  // The optimizer states of a chunk index, which live where its Adam runs (or in the disk tier's
  // files): the fp32 master in mixed precision (in fp32 the params are the master and move with the
  // doors), momentum, variance. Every kind is fp32 of the chunk's size.
  static std::span<const ChunkKind> state_kinds(bool mixed) {
    static constexpr ChunkKind kMixed[] = {ChunkKind::kParamFp32, ChunkKind::kMomentum,
                                           ChunkKind::kVariance};
    static constexpr ChunkKind kFp32[] = {ChunkKind::kMomentum, ChunkKind::kVariance};
    if (mixed) return kMixed;
    return kFp32;
  }
  // The host's logical cores (read once).
  static int host_cores();
  bool is_state_kind(ChunkKind kind) const {
    for (ChunkKind k : state_kinds(mixed_)) {
      if (k == kind) return true;
    }
    return false;
  }
  // The optimizer states' bytes of chunk index `index` (every kind fp32 of the chunk's size).
  int64_t state_bytes(int64_t index) const;
  // Whether chunk index `index` holds a parameter that trains.
  bool index_trains(int64_t index) const;

 private:
  friend class StateAccess;
  struct RunSpan {  // a run of consecutive tensors with gradients, at one Adam step, of one group
    int64_t begin = 0;
    int64_t end = 0;
    int64_t step = 0;
    int32_t group = 0;
  };
  struct RunAt {  // a step run's chunk index and span
    int64_t index = 0;
    RunSpan span;
  };
  ChunkStore& store() const { return *wiring_.storage.store(); }
  bool lean(int64_t index) const { return wiring_.storage.lean()[static_cast<size_t>(index)]; }
  at::Tensor state_view(TensorId id, ChunkKind kind, bool write) const;
  at::Tensor weight_view(TensorId id, bool write) const;
  void finish_state_views() const;
  // --- the overlapped step (step_pipeline_overlap.cpp) ---
  std::vector<RunSpan> run_spans(int64_t index) const;
  // Index `index`'s Adam views of one span (its states from the disk tier: none given).
  AdamChunk adam_views(int64_t index, const RunSpan& span, bool states_from_disk) const;
  void start_early_update(int64_t index);
  // "auto" on the emulated device overlaps only where a core is free of compute.
  bool auto_overlap_may_run() const;
  // Host-Adam kernel threads for an optimizer thread (the overlapped step's, the delayed
  // update's): on a GPU the host's cores but kCudaBusyHostThreads (autograd's device thread and
  // the training thread keep one each), at most compute's threads; on the emulated device compute
  // keeps its threads and the optimizer thread takes the cores left (at least one).
  static constexpr int kCudaBusyHostThreads = 2;
  int optimizer_thread_kernels() const;
  void undo_early_update(EarlyIndex& job) const;
  void cancel_early_update(int64_t index);
  void cancel_early_updates();
  // The step: each run updated ahead whose index's runs are the step's carries its update.
  void attach_early_updates(std::vector<AdamChunk>& runs, const std::vector<RunAt>& where,
                            const std::vector<bool>& on_device);
  // --- the delayed update (step_pipeline_delayed.cpp) ---
  void hand_over_delayed_update(const std::vector<AdamChunk>& views,
                                const std::vector<RunAt>& where);
  void land_delayed_update(bool even_mid_iteration);
  void write_delayed_weights(const DelayedJob& taken, bool skip_gradients);
  void write_half_weights(int64_t index, int64_t begin, int64_t end, bool skip_gradients);

  PipelineWiring wiring_;
  const bool mixed_;
  bool grad_space_ = false;
  std::unique_ptr<HybridAdam> adam_;
  AdamPlacement placement_;
  // The overlapped step: the optimizer thread (null when off), each index's last moment in the
  // trace, the indices looked at in this backward; paused after a step that clipped or skipped.
  struct Overlap {
    std::unique_ptr<StepOverlap> thread;
    std::vector<int64_t> last_use;
    std::vector<bool> tried;
    bool last_use_known = false;
    bool on = false;    // the config's key, or set_overlap_step()
    bool automatic = false;  // "auto": measured (trial), where a core is free of compute
    OverlapTrial trial;
    std::optional<std::chrono::steady_clock::time_point> last_step_end;  // the trial's clock
    bool paused = false;
    bool verify = false;     // grad() views were shown since the last step
    int64_t cancelled = 0;   // indices taken back since the last step
  } overlap_;
  AdamSite adam_site_ = AdamSite::kMargin;  // set at construction from the config
  // The delayed update (null unless zero_optimization.delayed_param_update): its thread and
  // buffers, and the report of the update landed since the last step (for the step's report).
  std::unique_ptr<DelayedUpdate> delayed_;
  std::optional<StepReport> delayed_taken_;
  bool delayed_on_ = false;  // the steps past its warm-up hand over (the thread exists)
};

}  // namespace patrickstar::engine_detail
