// Private to engine/src: the engine's implementation behind patrickstar::Engine (engine.h, whose
// comment says what it does for its user). It orchestrates the libraries one level down
// (ChunkStore, Scheduler, TraceRecorder, HybridAdam, Communicator) and the engine's own components,
// each of which owns its state (ParamTable, ModelStorage, GradientState, IterationTracker,
// IterationMetrics, AdamPlacement, CommGroups: engine/src/*.h); docs/design.md, "Inside the
// engine", has the picture.
//
// Thread-safety: one training thread drives it; the entry points autograd and the doors call are
// serialized by entry_mutex_ (on CUDA autograd runs a backward's CPU and GPU work on different
// threads).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>
#include <torch/nn/module.h>

#include "patrickstar/chunk/chunk_store.h"
#include "patrickstar/comm/communicator.h"
#include "patrickstar/engine/autograd_hooks.h"
#include "patrickstar/engine/config.h"
#include "patrickstar/engine/engine.h"
#include "patrickstar/engine/memory_breakdown.h"
#include "patrickstar/engine/reports.h"
#include "patrickstar/engine/module_hooks.h"
#include "patrickstar/memtracer/memory_probe.h"
#include "patrickstar/memtracer/scheduler.h"
#include "patrickstar/memtracer/trace.h"
#include "patrickstar/optimizer/hybrid_adam.h"

#include "adam_placement.h"
#include "chunk_size_choice.h"
#include "comm_groups.h"
#include "delayed_update.h"
#include "gradient_state.h"
#include "iteration_metrics.h"
#include "iteration_tracker.h"
#include "model_storage.h"
#include "overlap_trial.h"
#include "param_table.h"
#include "step_overlap.h"

namespace patrickstar {
namespace engine_detail {
class GatheredBytesProbe;  // engine/src/engine_internal.h
}  // namespace engine_detail

class GatheredParameters;


class EngineCore final : public ModuleHookHandler {
 public:
  // engine.h documents what each of these does for the user; Engine forwards to them.
  EngineCore(std::shared_ptr<torch::nn::Module> model, Config config,
             std::shared_ptr<Communicator> comm = nullptr);
  ~EngineCore() override;
  EngineCore(const EngineCore&) = delete;
  EngineCore& operator=(const EngineCore&) = delete;

  torch::nn::Module& module() const { return *model_; }
  const std::shared_ptr<torch::nn::Module>& module_ptr() const { return model_; }
  const Config& config() const { return config_; }
  ActiveHandlerGuard activate() { return ActiveHandlerGuard(this); }

  void backward(const at::Tensor& loss);
  IterationReport step();
  void zero_grad(bool set_to_none = true);
  const at::Tensor& zero_grad_marker() const { return gradients_.marker; }
  void set_lr(double lr);
  double lr() const;
  void set_overlap_step(bool on);
  std::vector<std::pair<std::string, at::Tensor>> fp32_state_dict() const;
  void save_weights(const std::string& path) const;
  SafetensorsSaveReport save_safetensors(const std::string& folder,
                                         const SafetensorsOptions& options) const;
  void save_checkpoint(const std::string& path) const;
  void load_checkpoint(const std::string& path);

  const RegistrationReport& registration() const { return metrics_.registration(); }
  void note_model_construction_peak(int64_t bytes);
  const std::vector<IterationReport>& history() const { return metrics_.history(); }
  void set_record_timeline(bool on);
  const MemoryBreakdown& device_peak_breakdown() const { return metrics_.device_peak(); }
  const MemoryBreakdown& host_peak_breakdown() const { return metrics_.host_peak(); }
  int64_t iteration() const { return iteration_; }
  int64_t retrace_count() const { return retraces_; }
  double loss_scale() const { return adam_->loss_scale(); }
  int rank() const { return rank_; }
  int world_size() const { return world_; }

  // What tests and benchmarks inspect (engine_inspect.h documents them).
  // (Updates the overlapped step made ahead are undone first: the chunks hold what the serial
  // step's would.)
  // (A delayed update in flight is written in first: the chunks hold the weights it makes.)
  const ChunkStore& chunks() const {
    cancel_early_updates();
    settle_delayed_update();
    return store();
  }
  const Scheduler& scheduler() const { return *scheduler_; }
  const TraceRecorder& tracer() const { return *recorder_; }
  MemoryTier& device_tier() const { return *storage_.device; }
  MemoryTier& host_tier() const { return *storage_.host; }
  const std::vector<bool>& adam_on_device() const { return adam_placement_.on_device(); }
  bool host_only(int64_t chunk_index) const { return storage_.host_only[chunk_index]; }
  bool owns(int64_t chunk_index) const { return store().layout().owner_rank(chunk_index) == rank_; }
  const Communicator& communicator() const { return *comm_; }
  std::vector<CopySpan> optimizer_spans() const {
    return overlap_ != nullptr ? overlap_->spans() : std::vector<CopySpan>{};
  }

  // ModuleHookHandler (called by the doors).
  int64_t pre_forward(torch::nn::Module& module) override;
  std::vector<at::Tensor> wrap_inputs(int64_t token, std::vector<at::Tensor> inputs) override;
  std::vector<at::Tensor> post_forward(int64_t token, std::vector<at::Tensor> outputs) override;
  void forward_failed(int64_t token) override;
  // An engine takes only the doors of the modules it registered.
  bool handles_unregistered_modules() const override { return false; }
  // The first hook of a backward pass. In a plain loss.backward() it begins the engine's backward
  // and queues finish_backward() for the end of that pass; under the engine's backward(), which
  // began the backward and finishes it itself, it does nothing.
  void backward_started() override;

 private:
  using Param = engine_detail::Param;
  using ModuleInfo = engine_detail::ModuleInfo;
  // What a door's forward is part of, decided at its pre_forward.
  enum class ForwardKind {
    kTraining,      // grad mode on: a moment; outputs and inputs get the backward hooks
    kCheckpointed,  // inside patrickstar::checkpoint, no grad: a moment, no hooks (recomputed later)
    kEvaluation,    // no grad: no moment, parameters read where they are
  };
  struct OpenScope {
    ModuleInfo* module = nullptr;
    std::vector<TensorId> acquired;
    ForwardKind kind = ForwardKind::kTraining;
  };
  class Mover;

  void register_parameters();  // engine_registration.cpp
  // --- what is built over the chunk layout, and "auto"'s retry (engine_layout.cpp) ---
  // The scheduler's chunk table: the store's chunks, their sizes and device-only states.
  std::map<int64_t, ChunkInfo> scheduler_chunks() const;
  // The scheduler over that table, with the config's options.
  void build_scheduler();
  // The mover over the store, waiting for the optimizer thread's chunks before a move.
  void build_mover();
  // A warm-up moment of module `module` (its tensors, and their gradient chunks when asked): kept
  // for the choice below while "auto"'s retry is armed.
  void note_warmup_need(int64_t moment, const ModuleInfo& module, MomentKind kind, bool with_grads);
  // The warm-up's trace does not fit the device (`why`, check_trace's error): with the retry armed,
  // picks the least-waste smaller chunk size with which every moment of `trace` fits, for after the
  // step (retry_chunk_elems_); throws when there is none or the move would not fit the host, and
  // rethrows `why` when the retry is not armed.
  void choose_retry_chunk_size(const Trace& trace, const c10::Error& why);
  // After the step: the model moves into chunks of `chunk_elems` (every kind's slots copied, kind
  // by kind); the scheduler and the mover are rebuilt; the next iteration is a warm-up.
  void move_to_chunk_size(int64_t chunk_elems);
  // Registration gave up: every chunk and the parameter table go (the parameters are restored by
  // the caller where they moved).
  void abandon_registration();
  // The model's parameters become plain fp32 tensors with the master weights again (the
  // destructor; a constructor that fails after registration). may_gather: data parallel, the
  // other ranks take part (false while an error unwinds: they are elsewhere).
  void give_back_model(bool may_gather);
  void report_config_warnings() const;
  ModuleInfo& module_info(torch::nn::Module& module);
  // A moment: tick, record, schedule the chunks of `module`'s parameters (plus gradient chunks when
  // asked), then set each parameter COMPUTE and point it at its chunk. Returns the tensors it
  // acquired.
  std::vector<TensorId> access(const ModuleInfo& module, MomentKind kind, bool with_grad_chunks);
  void release(TensorId id, TensorState to);
  void pre_backward(ModuleInfo& module);
  void post_backward(ModuleInfo& module);
  void post_backward_release(ModuleInfo& module);
  void on_gradient(TensorId id, const at::Tensor& param);
  void begin_iteration_if_needed();
  void finish_backward();
  // The moment about to be recorded differs from the trace: warn, re-record from here.
  void follow_trace(MomentKind kind, const std::string& label);
  // The forward in progress will never reach backward (it threw, or its loss was dropped).
  void abandon_forward();
  // Drops the iteration in progress: gradients, tensor states, the trace's moments.
  void drop_iteration();
  // Gradients since the last step are dropped; half weights restored where gradients overwrote them.
  void discard_gradients();
  // True when a half slot holds a gradient instead of a weight (mixed, no gradient space).
  bool half_slots_hold_gradients() const { return gradients_.in_half_slots; }
  void flush_pending_gradients();
  // A backward that began (Phase::kBackward) but whose end never came: autograd threw inside a plain
  // loss.backward(). Drops the iteration, with a warning naming `where` the engine noticed.
  void recover_from_a_dead_backward(const char* where);
  // Parameters whose requires_grad changed since registration start or stop training now.
  void sync_trainable();
  void point_at_chunk(const Param& p);
  // The parameter leaves its chunk: it holds its fence (no data) again.
  void point_at_nothing(const Param& p);
  // Refuses a door over parameters that a GatheredParameters scope holds (in pre_forward before
  // anything changes; in pre_backward after the backward has begun).
  void check_not_gathered(const ModuleInfo& module) const;
  // zero_grad() when the marker's gradient was reset, replaced or zeroed (zero_grad through
  // torch::optim::Optimizer&); not inside a backward, where it waits for the next call.
  // `door`: called by a door, where markers alone are looked at only before the forward (the
  // backward's start looks at them again before anything accumulates).
  void zero_grad_if_marker_reset(bool door = false);
  void arm_zero_grad_marker();
  // --- gradients as LibTorch code sees them (engine_grad_handles.cpp) ---
  // At the end of a backward or a step: tensor.grad() of every parameter with a gradient becomes a
  // view of its slot (one process, fp32/bf16), a marker that refuses reads but takes zero_(), or,
  // right after a backward with data parallel or fp16, a fence that refuses every access.
  enum class GradientsShown { kAfterBackward, kAfterStep, kWithdrawn };
  void show_gradients(GradientsShown when);
  // What LibTorch code did to them since (Module::zero_grad, clipping in place, assignment),
  // applied to the chunks; views are withdrawn (fenced) and markers put in their place.
  void take_gradient_edits(bool door);
  // Before autograd accumulates a new backward's gradients: every handle goes.
  void clear_gradient_handles();
  // One parameter's gradient dropped (set_to_none on it alone): its slot zeroed or its half weight
  // restored from the fp32 master.
  void drop_gradient(Param& p);
  // A forward between doors whose graph is gone (its loss was dropped): forgotten.
  void forget_dropped_forward();
  // GatheredParameters: checks every id, then makes each a real fp32 tensor with the master
  // weights; gather_end writes them back (write_back) and returns them to their fences.
  void gather_begin(const std::vector<TensorId>& ids, bool write_back);
  void gather_end(const std::vector<TensorId>& ids, bool write_back);
  // The registered parameter behind `t`, or -1.
  TensorId id_of(const at::Tensor& t) const { return params_.id_of(t); }
  friend class GatheredParameters;
  // --- data parallel (engine_distributed.cpp) ---
  bool distributed() const { return world_ > 1; }
  int64_t comm_group_of(TensorId id) const;
  // Makes the param chunks of `ids` present (all-gathering their comm groups from the owners),
  // and, with `with_grad_chunks`, zeroed host gradient chunks for a CPU embedding's remote ones
  // (other remote gradient chunks start as zeros when the Mover first puts them on the device).
  void ensure_gathered(const std::vector<TensorId>& ids, bool with_grad_chunks);
  void gather_group(int64_t group);
  // In a backward, before a lean group is gathered: drops the other lean groups gathered here and
  // not in use (none holding a tensor of `ids`).
  void release_lean_groups_except(const std::vector<TensorId>& ids);
  // Outside a backward: drops the remote chunks of the groups of `ids` whose every tensor was used
  // since their gather and none is in use.
  void release_used_groups(const std::vector<TensorId>& ids);
  // In a backward: reduces (and drops) the groups of `ids` whose gradients are all final.
  void reduce_ready_groups(const std::vector<TensorId>& ids);
  void reduce_group(int64_t group);
  // End of backward: every group not reduced yet is reduced (unused parameters' zeros included).
  void reduce_remaining_groups();
  // Frees every remote payload; `discard` also drops gradients not reduced yet (else such groups
  // are kept).
  void release_remote(bool discard);
  void release_group(int64_t group);
  void broadcast_initial_state(const std::vector<std::pair<std::string, at::Tensor>>& params);
  // Every rank agrees: true when `local` is true on every rank (one small all-reduce).
  bool all_ranks_agree(bool local) const;
  // fp32 master of chunk index i on every rank (broadcast from its owner).
  at::Tensor master_chunk_everywhere(int64_t index) const;
  // Tensor `id`'s value, shaped and its own, from a copy of its chunk (as the one above returns).
  at::Tensor value_in(const at::Tensor& chunk, TensorId id) const;
  void decide_adam_placement();
  // Tells the scheduler the last moment's compute is over (its prefetch point).
  void close_moment();
  // Keeps the breakdown of this moment when it is the highest device or host use so far.
  void note_memory(const std::string& moment);
  // The counters an iteration's report takes differences of, now.
  engine_detail::RunningTotals running_totals() const;
  // "param chunk 0 (id 0) (wte.weight); ...": resident chunks that may not move, for errors.
  std::string describe_pinned() const;
  // Registration: marks optimizer-state chunks to go to the device for good, covering `shortfall`
  // bytes the host budget lacks, and sets the registration report's device_state_bytes. Returns "" when it
  // did (or the disk tier handles it), else why not, for the host-budget error.
  std::string place_states_on_device(int64_t shortfall);
  IterationReport run_adam();
  // --- the overlapped step (engine_overlap.cpp) ---
  struct RunSpan {  // a run of consecutive tensors with gradients, at one Adam step
    int64_t begin = 0;
    int64_t end = 0;
    int64_t step = 0;
  };
  struct RunAt {  // a step run's chunk index and span
    int64_t index = 0;
    RunSpan span;
  };
  std::vector<RunSpan> run_spans(int64_t index) const;
  // Index `index`'s Adam views of one span (its states from the disk tier: none given).
  AdamChunk adam_views(int64_t index, const RunSpan& span, bool states_from_disk) const;
  // At backward moment `moment`: hands every index whose chunks the trace no longer accesses
  // before the step to the optimizer thread (when the overlap applies at all).
  void start_early_updates(int64_t moment);
  void start_early_update(int64_t index);
  // "auto" on the emulated device overlaps only where a core is free of compute (always on CUDA).
  bool auto_overlap_may_run() const;
  // Whether the overlap applies to a backward now: on, not paused, no disk tier, a steady iteration
  // with its Adam placement decided (and under "auto" a core for it). A backward may update ahead
  // when it does and, under "auto", the trial's way is the overlapped one.
  bool overlap_applies() const;
  bool early_updates_may_start() const;
  // The end of step(): under "auto", gives the trial this iteration's wall time (step end to step
  // end; `measurable`: overlap_applies() held for its backward, so it ran the trial's way) and puts
  // a decision made into `report`.
  void end_overlap_trial_iteration(bool measurable, IterationReport& report);
  // Host-Adam kernel threads for an optimizer thread (the overlapped step's, the delayed update's):
  // on a GPU the host's cores are its; on the emulated device compute keeps its threads and the
  // optimizer thread takes the cores left (at least one).
  int optimizer_thread_kernels() const;
  void undo_early_update(engine_detail::EarlyIndex& job) const;
  // What was updated ahead for `index` (or every index) is undone: its chunks or gradients are
  // about to be read or changed.
  void cancel_early_update(int64_t index) const;
  void cancel_early_updates() const;
  // The step: each run updated ahead whose index's runs are the step's carries its update.
  void attach_early_updates(std::vector<AdamChunk>& runs, const std::vector<RunAt>& where,
                            const std::vector<bool>& on_device);
  // --- the delayed update (engine_delayed.cpp) ---
  // This step's update is handed to the delayed update's thread (past its warm-up steps, in the
  // steady state).
  bool delayed_due() const;
  // The step's part: copies what the next forward and backward overwrite, puts the weights back
  // in the half slots that held gradients, and hands over the update of `views` (this step's runs,
  // at `where`; the update in flight was landed before they were made).
  void hand_over_delayed_update(const std::vector<AdamChunk>& views,
                                const std::vector<RunAt>& where);
  // Takes the update in flight, if any, and writes the weights it made into the parameters, except
  // the half slots that hold this iteration's gradients (they get theirs at the step); its report
  // waits in delayed_taken_ for the next step's. The step calls it first; so does anything that
  // reads or replaces the weights or the optimizer state outside training.
  // In the middle of a forward and its backward it only waits for the update (the weights stay
  // those the forward began with), unless `even_mid_iteration` (the engine's end).
  void land_delayed_update(bool even_mid_iteration = false);
  void settle_delayed_update() const;  // the same, for the const readers (the state functions)
  // Writes the weights of the update `taken` made (fp32: from its buffers; mixed: each half weight
  // rounded from its fp32 master, skipping half slots that hold gradients when `skip_gradients`).
  void write_delayed_weights(const engine_detail::DelayedJob& taken, bool skip_gradients);
  void write_half_weights(int64_t index, int64_t begin, int64_t end, bool skip_gradients);
  // An optimizer-state view of one parameter (master, momentum, variance) wherever it lives: with a
  // disk tier its chunk index is staged into host memory (one index at a time). After a pass of
  // such views, finish_state_views() writes back what was written (`write`) and frees the staging.
  at::Tensor state_view(TensorId id, ChunkKind kind, bool write = false) const;
  void finish_state_views() const;

  std::shared_ptr<torch::nn::Module> model_;
  Config config_;
  bool mixed_ = false;
  // Where Adam's fp32 weights live: the fp32 master chunks in mixed precision, else the params.
  ChunkKind master_kind() const { return mixed_ ? ChunkKind::kParamFp32 : ChunkKind::kParam; }
  // The optimizer states of a chunk index, which live where its Adam runs (or in the disk tier's
  // files): the fp32 master in mixed precision (in fp32 the params are the master and move with the
  // doors), momentum, variance. Their bytes: every kind is fp32 of the chunk's size.
  std::vector<ChunkKind> state_kinds() const {
    if (mixed_) return {ChunkKind::kParamFp32, ChunkKind::kMomentum, ChunkKind::kVariance};
    return {ChunkKind::kMomentum, ChunkKind::kVariance};
  }
  bool is_state_kind(ChunkKind kind) const {
    return kind == ChunkKind::kMomentum || kind == ChunkKind::kVariance ||
           (mixed_ && kind == ChunkKind::kParamFp32);
  }
  // Whether chunk index `index` holds frozen parameters in its param chunk alone (ModelStorage).
  bool lean(int64_t index) const { return storage_.lean[static_cast<size_t>(index)]; }
  bool lean_param(TensorId id) const { return lean(store().layout().placement(id).chunk_index); }
  // The weights a parameter's fp32 value comes from: its master (state_view), or for a lean
  // index its param chunk (in mixed precision the half weight, which is all there is).
  at::Tensor weight_view(TensorId id, bool write = false) const {
    return lean_param(id) ? store().view(id, ChunkKind::kParam)
                          : state_view(id, master_kind(), write);
  }
  // Whether chunk index `index` holds a parameter that trains (false: every tensor in it frozen).
  bool index_trains(int64_t index) const {
    for (TensorId t : store().layout().tensors_in_chunk(index)) {
      if (params_[t].trainable) return true;
    }
    return false;
  }
  int64_t state_bytes(int64_t index) const {
    int64_t bytes = 0;
    for (ChunkKind kind : state_kinds())
      bytes += store().chunk_bytes(store().chunk_id(kind, index));
    return bytes;
  }
  bool grad_space_ = false;  // a separate kGrad chunk list (fp32, or accumulation > 1)
  // The registered parameters and the modules whose doors open over them (param_table.h).
  engine_detail::ParamTable params_;

  engine_detail::ModelStorage storage_;  // tiers, chunk store, disk tier (model_storage.h)
  ChunkStore& store() const { return *storage_.store; }
  std::unique_ptr<MemoryProbe> probe_;
  // The CPU probe on the emulated device: probe_ itself, or with data parallel the base probe that
  // probe_ wraps.
  CpuMemoryProbe* cpu_probe_ = nullptr;
  // Data parallel: probe_, which adds the gathered groups' device bytes to the base probe's.
  engine_detail::GatheredBytesProbe* gathered_probe_ = nullptr;
  bool probe_floor_set_ = false;
  // "default_chunk_size": "auto" (engine_layout.cpp): the registered tensors not placed yet (every
  // size is packed from it), whether a warm-up whose trace does not fit retries with a smaller
  // size (one process, no disk tier, no delayed update, no states placed on the device for good),
  // the warm-up's moments as the choice sees them, the size chosen at its step (0: none), and why.
  Layout layout_base_;
  bool chunk_retry_armed_ = false;
  std::vector<engine_detail::MomentNeed> warmup_needs_;
  int64_t retry_chunk_elems_ = 0;
  std::string retry_reason_;
  std::function<int64_t()> clock_;  // the scheduler's, the copy thread's and the optimizer thread's
  std::unique_ptr<TraceRecorder> recorder_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<Mover> mover_;
  std::unique_ptr<HybridAdam> adam_;
  HookTable hooks_;
  // Held by every entry point autograd or a door calls (the doors, the backward hooks, gradients,
  // a backward's start and end): on CUDA autograd runs a backward's CPU work (a CPU embedding) and GPU
  // work on different threads, and the engine's state is one thread's at a time. Recursive: a
  // checkpoint's recompute opens doors from inside a backward hook's work.
  std::recursive_mutex entry_mutex_;

  engine_detail::IterationTracker tracker_;  // the phase of the iteration (iteration_tracker.h)
  engine_detail::GradientState gradients_;  // half slots, grad() handles, marker (gradient_state.h)
  int64_t retraces_ = 0;
  bool retraced_this_iteration_ = false;
  int64_t iteration_ = 0;
  engine_detail::OpenDoors<OpenScope> doors_;    // the doors open now, by token (param_table.h)
  int64_t open_moment_ = -1;                     // the last moment, until close_moment()
  engine_detail::AdamPlacement adam_placement_;  // where each index's Adam runs (adam_placement.h)
  engine_detail::IterationMetrics metrics_;      // reports, history, peaks (iteration_metrics.h)
  std::vector<GatheredParameters*> gathered_scopes_;  // open scopes (told when the engine goes)
  std::vector<at::Tensor> cast_buffers_;  // fp32 buffers cast to the compute dtype (mixed precision)

  // Data parallel.
  std::shared_ptr<Communicator> comm_;
  int rank_ = 0;
  int world_ = 1;
  engine_detail::CommGroups groups_;
  // The overlapped step: the optimizer thread (null when off), each index's last moment in the
  // trace, the indices looked at in this backward; paused after a step that clipped or skipped.
  std::unique_ptr<engine_detail::StepOverlap> overlap_;
  std::vector<int64_t> early_last_use_;
  std::vector<bool> early_tried_;
  bool early_last_use_known_ = false;
  bool overlap_on_ = false;    // the config's key, or set_overlap_step()
  bool overlap_auto_ = false;  // "auto": measured (overlap_trial_), where a core is free of compute
  engine_detail::OverlapTrial overlap_trial_;
  std::optional<std::chrono::steady_clock::time_point> last_step_end_;  // the trial's clock
  bool early_paused_ = false;
  bool early_verify_ = false;            // grad() views were shown since the last step
  mutable int64_t early_cancelled_ = 0;  // indices taken back since the last step
  // The delayed update (null unless zero_optimization.delayed_param_update): its thread and
  // buffers, and the report of the update landed since the last step (for the step's report).
  std::unique_ptr<engine_detail::DelayedUpdate> delayed_;
  std::optional<StepReport> delayed_taken_;
  mutable double collective_seconds_ = 0;  // also spent by const collectives (fp32_state_dict)
};

}  // namespace patrickstar
