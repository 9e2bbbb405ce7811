// Private to engine/src: the engine's implementation behind patrickstar::Engine (engine.h, whose
// comment says what it does for its user). It orchestrates the libraries one level down
// (ChunkStore, Scheduler, TraceRecorder, HybridAdam, Communicator) and the engine's own components,
// each of which owns its state (ParamTable, ModelStorage, GradientState, IterationTracker,
// IterationMetrics, AdamPlacement, CommGroups: engine/src/*.h); docs/design.md, "Inside the
// engine", has the picture.
//
// Thread-safety: one training thread drives it; the entry points autograd and the doors call are
// serialized by entry_gate_ (on CUDA autograd runs a backward's CPU and GPU work on different
// threads), which also measures their host time (entry_gate.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
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

#include "activation_plan.h"
#include "chunk_size_retry.h"
#include "data_parallel.h"
#include "entry_gate.h"
#include "gradient_state.h"
#include "iteration_metrics.h"
#include "iteration_tracker.h"
#include "model_storage.h"
#include "non_model_probe.h"
#include "param_groups.h"
#include "param_table.h"
#include "parameter_gathering.h"
#include "run_plan.h"
#include "step_pipeline.h"

namespace patrickstar {
namespace engine_detail {
struct CheckpointIndex;
struct IndexTensor;
class DataFileReader;
}  // namespace engine_detail
class GatheredParameters;

class EngineCore : public ModuleHookHandler, public engine_detail::ParameterGathering {
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
  const at::Tensor& zero_grad_marker() const { return gradients_.marker(); }
  void set_lr(double lr);
  double lr() const;
  void set_adam_hyperparameters(double beta1, double beta2, double eps, double weight_decay);
  AdamHyperparameters adam_hyperparameters() const;
  // The optimizer's parameter groups (engine_param_groups.cpp).
  std::vector<ParamGroupInfo> param_groups() const;
  std::vector<AdamHyperparameters> param_group_options() const;
  void set_param_group_options(const std::vector<AdamHyperparameters>& options);
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
  int64_t iteration() const { return tracker_.iteration(); }
  int64_t retrace_count() const { return tracker_.retraces(); }
  double loss_scale() const { return pipeline_->adam().loss_scale(); }
  int rank() const { return dp_.rank(); }
  int world_size() const { return dp_.world(); }
  int shard_group_size() const { return dp_.shard_size(); }

  // What tests and benchmarks inspect (engine_inspect.h documents them).
  // (Updates the overlapped step made ahead are undone first: the chunks hold what the serial
  // step's would.)
  // (A delayed update in flight is written in first: the chunks hold the weights it makes.)
  const ChunkStore& chunks() const {
    pipeline_->access();
    return store();
  }
  const Scheduler& scheduler() const { return *scheduler_; }
  const TraceRecorder& tracer() const { return *recorder_; }
  MemoryTier& device_tier() const { return *storage_.device(); }
  MemoryTier& host_tier() const { return *storage_.host(); }
  const std::vector<bool>& adam_on_device() const { return pipeline_->placement().on_device(); }
  bool host_only(int64_t chunk_index) const { return storage_.host_only()[chunk_index]; }
  bool owns(int64_t chunk_index) const { return dp_.owns(store().layout(), chunk_index); }
  const Communicator& communicator() const { return dp_.comm(); }
  std::vector<CopySpan> optimizer_spans() const { return pipeline_->optimizer_spans(); }

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
  // patrickstar::checkpoint's questions (engine_activations.cpp): the activation plan.
  CheckpointPlan plan_checkpoint(const torch::nn::Module* block,
                                 std::optional<bool> offload) override;
  void checkpoint_forward_done(int64_t call, const at::Tensor& input, double seconds) override;
  std::unique_ptr<OffloadedActivation> offload_activation(int64_t call,
                                                          const at::Tensor& input) override;
  void checkpoint_recompute_begins(int64_t call) override;
  void checkpoint_recompute_done(int64_t call, double seconds) override;
  ActivationPlanReport activation_plan() const;
  PlanReport plan() const { return plan_.report(); }
  // Tests (EngineInspector): applies the plan's candidate `candidate` as if chosen (-1: as if none
  // fitted, the config's settings); the trace the plan predicts for chunks of `chunk_elems`
  // (nullopt without a trace or the warm-up's needs), the trace it weighed for its candidate
  // `candidate` (its chunk size and activations; nullopt before the plan), and the sizes it
  // considers.
  void apply_plan_candidate(int candidate);
  std::optional<Trace> plan_trace_of(int64_t chunk_elems) const;
  std::optional<Trace> plan_candidate_trace(int candidate) const;
  std::vector<int64_t> plan_sizes() const { return plan_chunk_sizes(); }

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

  void register_parameters();  // engine_registration.cpp: the stages below, in this order
  // What one stage hands to the next (defined in engine_registration.cpp, its only user).
  struct Registration;
  // Collects each parameter once and checks it (nothing moves); leaves the list, the CPU
  // embedding's parameters and each parameter's module for packing.
  void collect_parameters(Registration& reg);
  // Decides the chunk kinds, the layout groups and the chunk size; leaves the packed layout.
  void pack_layout(Registration& reg);
  // Builds the tiers and the chunk store over that layout, no payload allocated; leaves which
  // indices are lean and host-only in storage_.
  void build_store(Registration& reg);
  // Checks the host budget before anything moves (states on the device for good where it lacks)
  // and opens the disk tier; leaves Adam's placement and this rank's share of the model data.
  void place_model_data(Registration& reg);
  // Allocates the payloads index by index, copies the weights in (deferred values, checkpoint
  // reads) and fences the parameters; leaves the parameter table complete.
  void fill_chunks(Registration& reg);
  // fill_chunks failed: the parameters it moved get their values back (false where some could not).
  bool restore_moved(const Registration& reg);
  // Hooks the trainable parameters' gradients, moves (casts) the buffers; leaves the model ready.
  void attach_model(const Registration& reg);
  // Builds the scheduler, the tracer, the optimizer thread and the mover over the filled store.
  void build_scheduling();
  // Builds HybridAdam (and, data parallel, the comm groups); leaves only the report to write.
  void build_optimizer();
  // Writes the registration report's figures.
  void report_registration(const Registration& reg);
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
  // step (ChunkSizeRetry::chosen); throws when there is none or the move would not fit the host,
  // and rethrows `why` when the retry is not armed.
  void choose_retry_chunk_size(const Trace& trace, const c10::Error& why);
  // After the step: the model moves into chunks of `chunk_elems`, the size the retry chose
  // (`retried`: it warns and counts the retry) or the plan's (every kind's slots copied, kind by
  // kind); the scheduler and the mover are rebuilt; the next iteration is a warm-up.
  void move_to_chunk_size(int64_t chunk_elems, bool retried = true);
  // Registration gave up: every chunk and the parameter table go (the parameters are restored by
  // the caller where they moved).
  void abandon_registration();
  // The model's parameters become plain fp32 tensors with the master weights again (the
  // destructor; a constructor that fails after registration). may_gather: data parallel, the
  // other ranks take part (false while an error unwinds: they are elsewhere).
  void give_back_model(const engine_detail::StateAccess& access, bool may_gather);
  // Data parallel: every chunk index's fp32 master from its owner into `masters`; returns why not
  // ("" when gathered), and then leave_model_without_values takes over.
  std::string gather_masters(const engine_detail::StateAccess& access, bool may_gather,
                             std::vector<at::Tensor>& masters);
  // Warns with `failure`; every parameter keeps its fence, and the cast buffers go back to fp32.
  void leave_model_without_values(const std::string& failure);
  // One chunk index at a time, its parameters get their values (from `masters` with data parallel)
  // and (one process) its payloads are released; returns how many values could not be made.
  int64_t give_back_parameters(const engine_detail::StateAccess& access,
                               const std::vector<at::Tensor>& masters);
  // One process: chunk index `index`'s payloads of every kind go back to the system.
  void release_index_payloads(const engine_detail::StateAccess& access, int64_t index);
  // The buffers go back to the CPU (the cast ones in fp32); returns how many could not be moved.
  int64_t give_back_buffers();
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
  bool half_slots_hold_gradients() const { return gradients_.in_half_slots(); }
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
  // `access`: where restores_half_weight(p) (mixed precision without a gradient space, a
  // gradient in the half slot of an index this rank owns), the access to its master.
  void drop_gradient(const Param& p, const engine_detail::StateAccess* access);
  bool restores_half_weight(const Param& p) const;
  // A forward between doors whose graph is gone (its loss was dropped): forgotten.
  void forget_dropped_forward();
  // ParameterGathering (GatheredParameters; gathered_parameters.cpp).
  TensorId gathered_id(const at::Tensor& t) const override { return id_of(t); }
  bool cast_buffer(const at::Tensor& buffer) const override;
  int64_t parameter_version(TensorId id) const override;
  void gather_begin(const std::vector<TensorId>& ids, bool write_back) override;
  void gather_end(const std::vector<TensorId>& ids, bool write_back) override;
  void add_scope(GatheredParameters* scope) override;
  void remove_scope(GatheredParameters* scope) override;
  // The registered parameter behind `t`, or -1.
  TensorId id_of(const at::Tensor& t) const { return params_.id_of(t); }
  // Data parallel: the gathers, drops and reductions of chunk groups are dp_'s, and so are the
  // questions of what several ranks change (data_parallel.h).
  // Every parameter's fp32 value, by name (fp32_state_dict, save_weights).
  // Checkpoints (checkpoint_io.cpp; format 3: engine_state_io.cpp).
  void write_data_file(const engine_detail::StateAccess& access, const std::string& file,
                       uint64_t save_id, at::Tensor& table, at::Tensor& files) const;
  engine_detail::CheckpointIndex describe_save(const std::string& path, const at::Tensor& table,
                                               const at::Tensor& files) const;
  void match_checkpoint(const std::string& path, const engine_detail::CheckpointIndex& index,
                        std::vector<const engine_detail::IndexTensor*>& entries) const;
  // Param groups in checkpoints (engine_param_groups.cpp): what a tensor's entry saves, and the
  // groups' options a checkpoint restores (a group saved as it is now, with options this engine
  // can follow; any other keeps its own, with a warning when the checkpoint has options for it).
  void describe_group_options(engine_detail::IndexTensor& entry, TensorId id) const;
  std::vector<AdamHyperparameters> checkpoint_group_options(
      const std::string& path, const std::vector<const engine_detail::IndexTensor*>& entries) const;
  // Every group's options checked (naming the group and option), as the Adam step takes them.
  std::vector<AdamOptions> checked_group_options(
      const std::vector<AdamHyperparameters>& options) const;
  // Group 0's `option`, and every group's that follows group 0 in it, take `value`.
  void follow_group_zero(std::vector<AdamHyperparameters>& options,
                         double AdamHyperparameters::*option, double value) const;
  void apply_checkpoint(const engine_detail::StateAccess& access, const std::string& path,
                        engine_detail::DataFileReader& reader,
                        const std::vector<const engine_detail::IndexTensor*>& entries,
                        const at::Tensor& buffer);
  void load_checkpoint_format3(const engine_detail::StateAccess& access, const std::string& path);
  std::vector<std::pair<std::string, at::Tensor>> fp32_values(
      const engine_detail::StateAccess& access) const;
  void decide_adam_placement();
  // The chunks chunk index `index`'s Adam reads on the device (`device`), or needs on the host.
  std::vector<int64_t> adam_side_chunks(int64_t index, bool device) const;
  // "plan": "auto" (engine_plan.cpp): the refusals before registration, the measured iteration's
  // marks, and after each step the plan, its application and its check.
  void check_plan_config() const;
  engine_detail::RunPlanner::Mark plan_mark() const;
  void note_plan_moment(int64_t moment) {
    if (!plan_.enabled() || (moment != 0 && !plan_.measuring())) return;
    const engine_detail::RunPlanner::Mark mark = plan_mark();
    if (moment == 0) plan_.iteration_began(mark);
    plan_.note_moment(moment, mark);
  }
  void plan_after_step(IterationReport& report);
  // Data parallel, before the plan: a step that threw on this rank before plan_after_step takes
  // its turn in the plan's agreement (nothing measured), so that the ranks whose step went on do
  // not wait for it.
  void plan_missed_turn();
  // step()'s work (step() adds the plan's turn when it throws).
  IterationReport take_step();
  // Plans on the measured iteration's `compute` (per moment), then applies the choice.
  void plan_now(std::vector<double> compute, double adam_seconds, double bandwidth,
                IterationReport& report);
  // Data parallel: every rank runs rank 0's chunk size and activations, with the schedule and the
  // Adam placement it chooses among them; none plans where some rank has no such candidate that
  // fits or could not plan (the lowest such rank is named; collectives every rank calls). One
  // process: `chosen`.
  const PlanCandidateReport* agree_on_activations(const PlanCandidateReport* chosen);
  // An iteration on the plan: its check, and the one re-plan when the check says so.
  void check_plan(IterationReport& report, const engine_detail::RunPlanner::Mark& now);
  engine_detail::PlanInputs plan_inputs(std::vector<double> compute) const;
  // The plan's chunk sizes (engine_plan_layouts.cpp): the engine's own, and with "auto" the
  // others it considers, each with the trace it would run (nullopt where the warm-up's needs do
  // not cover the trace).
  // The engine's own size on `trace` (the running one, or an activation alternative's edit of it),
  // its margin decided at `peak_non_model`.
  engine_detail::PlanLayout plan_layout_now(Trace trace, int64_t peak_non_model) const;
  // With "auto" activations, each of the activation plan's whole-model alternatives at the
  // engine's size and at the plan's other `sizes` (engine_plan_activations.cpp); `compute` per
  // moment of the running trace.
  std::vector<engine_detail::PlanLayout> plan_activation_layouts(
      const std::vector<double>& compute, const std::vector<int64_t>& sizes) const;
  // How each checkpoint call runs now ("keep", ...), where "auto" planned at the engine's size.
  std::vector<std::string> running_activation_calls() const;
  // One alternative at the engine's size, then at each of `sizes` its trace allows: its trace,
  // compute, margin and copies.
  std::vector<engine_detail::PlanLayout> plan_activation_layouts_of(
      engine_detail::ActivationPlanner::Alternative a, const std::vector<double>& compute,
      const std::vector<int64_t>& sizes) const;
  // The per-call search joint with the rest: one call's way changed at a time while the best
  // candidate's predicted step (any chunk size, schedule and placement) gets shorter, from the
  // best of the layouts there; a mix it ends on that is not there yet is added ("per call").
  // Returns the mix added (its ways joined by ","), "" where none was.
  std::string search_activation_calls(engine_detail::PlanInputs& inputs,
                                      const engine_detail::PlanProfile& profile) const;
  // Whether the per-call search (and a mix from another rank) applies to `inputs`.
  bool searches_activation_calls(const engine_detail::PlanInputs& inputs) const;
  // A mix's layouts (the engine's size first, then `sizes`), empty where the running trace cannot
  // run it.
  std::vector<engine_detail::PlanLayout> activation_mix_layouts(
      const engine_detail::PlanInputs& inputs, const std::vector<ActivationChoice>& choices,
      const std::vector<int64_t>& sizes) const;
  // A mix's layouts into the order of preference: the engine's size's after the other activations
  // at that size, the rest last.
  void insert_activation_mix(engine_detail::PlanInputs& inputs,
                             std::vector<engine_detail::PlanLayout> layouts) const;
  // Data parallel, ranks but 0: rank 0's search's mix (`text` as search_activation_calls returns
  // it) among this rank's layouts.
  void add_activation_mix(engine_detail::PlanInputs& inputs, const std::string& text) const;
  // Runs the activations `candidate` names (the activation plan's own where it names none); true
  // when they changed.
  bool run_plan_activations(const PlanCandidateReport& candidate);
  std::vector<int64_t> plan_chunk_sizes() const;
  // Another size on `trace` (the running one or an alternative's edit of it, every door moment
  // one the warm-up ran), its margin decided at `peak_non_model`.
  std::optional<engine_detail::PlanLayout> plan_layout_of(int64_t chunk_elems, const Trace& trace,
                                                          int64_t peak_non_model) const;
  engine_detail::PlanProfile plan_profile(const engine_detail::PlanInputs& inputs,
                                          double adam_seconds, double copy_bytes_per_s) const;
  void apply_plan(const PlanCandidateReport& chosen);
  // No plan: the config's step schedule (with the delayed update allowed, the delayed update,
  // whose all-host placement is then decided again after a new trace).
  void keep_config_schedule();
  // The next iteration records the trace again (a warm-up), and its step decides the Adam placement
  // again.
  void record_trace_again();
  // The delayed update's copies in the host tier (zero_optimization.delayed_param_update).
  int64_t delayed_copy_bytes() const;
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
  // The step's parts (engine_step.cpp). Its moment: ticked, recorded, scheduled; where each
  // index's Adam runs, which indices update, and the bytes the host's Adam brings home.
  struct StepMoment {
    int64_t moment = 0;
    bool warmup = false;
    std::vector<bool> on_device;
    std::vector<bool> updates;
    int64_t adam_host_d2h_bytes = 0;
  };
  StepMoment step_moment();
  // Gradients kept at zero (zero_grad(false)) that no loss reached this iteration: stepped too.
  void step_kept_zero_gradients();
  // step()'s checks before anything changes: no read-write GatheredParameters, backward passes
  // as gradient_accumulation_steps asks.
  void check_step_allowed();
  // A gradient assigned to grad() where the engine shows none is refused, after `discard`.
  void refuse_undelivered_gradients(const std::function<void(const std::string&)>& discard);
  // The update (run_adam, with the Adam placement decided first), timed, with its disk figures;
  // `step_failed` runs before a failure is rethrown.
  IterationReport update_timed(engine_detail::StepAgreement& agreement,
                               const std::function<void(const std::string&)>& step_failed);
  // After the update: tensor states, Adam step counts, gradients consumed.
  void settle_parameters(const IterationReport& report);
  // The warm-up's trace set (or recorded again), the scheduler's figures and the report's.
  void report_iteration(IterationReport& report, bool warmup);
  // Every chunk an update reads is in the tier where its Adam runs.
  void check_adam_tiers(const StepMoment& at) const;
  // The warm-up's trace must fit the device before any weight changes ("auto": or a smaller
  // chunk size is chosen for after the step).
  void check_warmup_trace();
  // After an iteration: the offloaded inputs' figures into `report`; "auto" plans after its first
  // measured iteration when `may_plan` (then true: the caller records the trace again instead of
  // setting it).
  bool report_activations(IterationReport& report, bool may_plan);
  // The pipeline's view of the engine's components (the constructor wires it once).
  engine_detail::PipelineWiring pipeline_wiring();
  std::shared_ptr<torch::nn::Module> model_;
  Config config_;
  // Data parallel: the ranks, the comm groups, the collectives (data_parallel.h). With one process
  // it answers for one rank and issues no collective.
  engine_detail::DataParallel dp_;
  // bf16 or fp16: half weights and gradients, fp32 masters.
  bool mixed() const { return config_.precision() != Precision::kFp32; }
  // Where Adam's fp32 weights live: the fp32 master chunks in mixed precision, else the params.
  ChunkKind master_kind() const { return pipeline_->master_kind(); }
  // The optimizer states' kinds of a chunk index (StepPipeline::state_kinds).
  std::vector<ChunkKind> state_kinds() const {
    const std::span<const ChunkKind> kinds = engine_detail::StepPipeline::state_kinds(mixed());
    return {kinds.begin(), kinds.end()};
  }
  // Whether chunk index `index` holds frozen parameters in its param chunk alone (ModelStorage).
  bool lean(int64_t index) const { return storage_.lean()[static_cast<size_t>(index)]; }
  bool lean_param(TensorId id) const { return lean(store().layout().placement(id).chunk_index); }
  // The registered parameters and the modules whose doors open over them (param_table.h).
  engine_detail::ParamTable params_;
  engine_detail::ParamGroups groups_;  // each parameter's optimizer group (param_groups.h)

  engine_detail::ModelStorage storage_;  // tiers, chunk store, disk tier (model_storage.h)
  ChunkStore& store() const { return *storage_.store(); }
  // Non-model memory as the tracer and the scheduler read it (non_model_probe.h).
  std::unique_ptr<engine_detail::NonModelProbe> probe_;
  // "default_chunk_size": "auto"'s retry with a smaller size (chunk_size_retry.h).
  engine_detail::ChunkSizeRetry retry_;
  // "plan": "auto": the measured iteration, the candidates, the choice and its check (run_plan.h).
  engine_detail::RunPlanner plan_{config_.plan};
  std::function<int64_t()> clock_;  // the scheduler's, the copy thread's and the optimizer thread's
  std::unique_ptr<TraceRecorder> recorder_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<Mover> mover_;
  HookTable hooks_;
  // Held by every entry point autograd or a door calls (the doors, the backward hooks, gradients,
  // a backward's start and end): the engine's state is one thread's at a time; the gate measures
  // their host time and counts the host synchronizations per iteration (entry_gate.h).
  engine_detail::EntryGate entry_gate_;

  engine_detail::IterationTracker tracker_;  // the phase of the iteration (iteration_tracker.h)
  engine_detail::GradientState gradients_;  // half slots, grad() handles, marker (gradient_state.h)
  engine_detail::OpenDoors<OpenScope> doors_;    // the doors open now, by token (param_table.h)
  engine_detail::IterationMetrics metrics_;      // reports, history, peaks (iteration_metrics.h)
  // The activation plan and the offloaded checkpoint inputs (activation_plan.h). Declared after
  // the storage whose tiers and copy queue its store uses: it goes first.
  std::unique_ptr<engine_detail::Activations> activations_;

  // The optimizer side: Adam, its placement, the overlapped step, the delayed update
  // (step_pipeline.h). Declared after the storage it reads: it goes first.
  std::unique_ptr<engine_detail::StepPipeline> pipeline_;
};

namespace engine_detail {
// What Engine holds (engine.h names this, not EngineCore): the engine itself.
class EngineImpl final : public EngineCore {
 public:
  using EngineCore::EngineCore;
};
}  // namespace engine_detail

}  // namespace patrickstar
