// Engine: trains a LibTorch module whose parameters, gradients and Adam states live in chunks that
// move between the host and the (emulated or CUDA) device, moment by moment (docs/design.md section 4).
//
// Most users reach it through patrickstar::initialize_engine (patrickstar/patrickstar.h). Directly:
//
//   patrickstar::Engine engine(model.ptr(), config);     // registers every parameter into chunks
//   loss = model->loss(x, y);                            // forward: the doors find the engine
//   engine.backward(loss);                               // scaled for fp16; gradients into chunks
//   engine.step();                                       // hybrid Adam; returns the report
//   engine.zero_grad();
//
// What happens to the model: each parameter keeps its identity (tensor, name, shape, requires_grad)
// but its data becomes a window into its chunk, valid only between a door's pre- and post-forward
// (and during that module's backward). Outside, the parameter has no data: any operator that reads
// it throws a c10::Error naming the parameter, its module and the door to use (a module called
// without its door, an L2 penalty over model->parameters()). GatheredParameters
// (gathered_parameters.h) makes chosen parameters real fp32 tensors for a while (saving, penalties
// as values, re-initialization). Mixed precision turns parameters into bf16/fp16 (and fp32 buffers,
// such as BatchNorm's running statistics, into the same dtype); the fp32 master lives in the
// `param_fp32` chunks. fp32_state_dict() returns the fp32 weights by name. Destroying
// the engine gives the model ordinary fp32 parameters holding the master weights.
// Activation checkpointing (patrickstar::checkpoint) works under the engine: the dropped forward is
// traced like any training forward, and its recompute in backward goes through the doors again.
//
// Iterations (docs/design.md section 7): an iteration runs from one step() to the next. The first
// records the trace of moments; when a later iteration's moments differ (control flow changed), the
// engine warns, re-records the trace from there (IterationReport::retraced) and goes on. A forward
// that throws, or whose loss is dropped unused, is forgotten: the next forward starts where it
// started. A backward that throws, or a step whose trace the scheduler rejects, discards the
// iteration's gradients (weights and optimizer state unchanged). zero_grad() may come anywhere.
// The emulated device is charged for what iterations allocate: what the process held before the
// engine's first forward (a dataset, the trainer's state) is host memory.
//
// Thread-safety: one training thread drives the engine (as with a LibTorch optimizer); the entry
// points autograd and the doors call (forward doors, backward hooks, gradients, a backward's start
// and end) are serialized by a recursive mutex, since on CUDA autograd runs a backward's CPU and GPU
// work on different threads. Nothing else may be called from two threads at once.
// Ownership: the engine shares ownership of the model, and owns its chunks, tiers, scheduler,
// tracer and optimizer. Two engines may live side by side; on the emulated device each measures
// its own peaks (a peak window of its own), on CUDA they share the caching allocator's peak, which
// each one resets.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
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
#include "patrickstar/engine/memory_breakdown.h"
#include "patrickstar/engine/module_hooks.h"
#include "patrickstar/memtracer/memory_probe.h"
#include "patrickstar/memtracer/scheduler.h"
#include "patrickstar/memtracer/trace.h"
#include "patrickstar/optimizer/hybrid_adam.h"

namespace patrickstar {
namespace engine_detail {
class GatheredBytesProbe;  // engine/src/engine_internal.h
class DiskStates;          // engine/src/disk_states.h
}  // namespace engine_detail

class GatheredParameters;

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
  // Data parallel (world size > 1; all zero with one process). Bytes as Communicator counts them:
  // a group gather is one all-gather of the group's world_size param chunks into one buffer
  // (world_size x a param chunk's bytes); a group reduce sends each of its fp32 gradient chunks to
  // its owner (world_size x chunk_elems x 4); all-reduces agree on the loss's finiteness and the
  // gradient norm.
  int64_t group_gathers = 0;      // comm groups gathered (forward and backward)
  int64_t group_reduces = 0;      // comm groups whose gradients were reduced into their owners
  // The most device bytes that gathered group buffers held at once (the doors place them, not the
  // scheduler; the trace counts them as non-model bytes, so non_model_peak_bytes includes them).
  int64_t gathered_peak_bytes = 0;
  int64_t gather_bytes = 0;
  int64_t reduce_bytes = 0;
  int64_t all_reduce_bytes = 0;
  double collective_seconds = 0;  // wall time inside collectives
};

// Model-data figures, fixed after registration.
struct RegistrationReport {
  int64_t params = 0;             // registered elements (tied parameters once)
  int64_t tensors = 0;
  int64_t trainable_params = 0;
  int64_t chunk_elems = 0;
  int64_t chunks_per_kind = 0;
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

class Engine final : public ModuleHookHandler {
 public:
  // Moves every parameter of `model` into chunks per `config` and frees the parameters' original
  // storage. `model` must be on the CPU in fp32 and own at least one parameter; parameters shared
  // by several modules are registered once; frozen ones (requires_grad false) are kept in chunks
  // but never updated. Throws c10::Error on bad input, leaving `model` untouched, and when memory
  // runs out during registration, leaving the model's parameters with their values (one process).
  // Data parallel: with a communicator of world size N > 1 (every process builds the same model
  // and engine), rank 0's initial weights and buffers are broadcast, and this process keeps the
  // fp32 master, momentum and variance (and gradient space) of the chunks it owns only
  // (docs/design.md section 9). Every process must then make the same calls in the same order.
  Engine(std::shared_ptr<torch::nn::Module> model, Config config,
         std::shared_ptr<Communicator> comm = nullptr);
  ~Engine() override;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  torch::nn::Module& module() const { return *model_; }
  const std::shared_ptr<torch::nn::Module>& module_ptr() const { return model_; }
  const Config& config() const { return config_; }

  // Makes this engine the active handler on this thread while the returned guard lives. The doors
  // do not need it: they find the engine from the modules it registered (module_hooks.h), and an
  // engine takes no unregistered module's door, so forwards run the same with or without it.
  ActiveHandlerGuard activate() { return ActiveHandlerGuard(this); }

  // Backward of `loss` (a scalar; multiplied by the loss scale in fp16). Throws c10::Error when no
  // forward ran since the last backward/step, or when the loss is not finite in fp32/bf16 (then the
  // forward is discarded and the engine is ready for a new one). When autograd throws during the
  // backward (a capacity error, the user's own backward), the iteration's gradients are discarded,
  // weights and optimizer state are unchanged, and the error is rethrown.
  // The loss is divided by gradient_accumulation_steps (as DeepSpeed does).
  void backward(const at::Tensor& loss);
  // One Adam/AdamW step over every chunk, on the device for the chunks the placement keeps there
  // and on the host for the rest. Throws c10::Error when no backward ran since the last step, or
  // before the gradient_accumulation_steps-th backward; when the recorded trace does not fit the
  // device (checked before any weight changes), the iteration's gradients are discarded.
  IterationReport step();
  // Discards the gradients accumulated since the last step, at any point of an iteration. Where
  // gradients sit in the half weights' slots (mixed precision without a gradient space) the half
  // weights come back from the fp32 master. `set_to_none` false keeps, as in LibTorch, the
  // gradients defined at zero: the next step updates those parameters even where the loss does
  // not reach them (see the README's table of LibTorch idioms for data parallel).
  void zero_grad(bool set_to_none = true);
  // A leaf tensor whose .grad() the engine keeps defined. torch::optim::Optimizer::zero_grad (not
  // virtual) resets or zeroes it when EngineOptimizer is used through a torch::optim::Optimizer&;
  // the engine takes that as zero_grad() at its next call outside a backward (a door, backward(),
  // the start of a plain backward, step(), load_checkpoint(), a GatheredParameters scope).
  const at::Tensor& zero_grad_marker() const { return zero_grad_marker_; }

  // The learning rate of the next steps (LR schedules; EngineOptimizer passes its param group's).
  void set_lr(double lr);
  double lr() const;

  // fp32 weights by parameter name (the master copy), as new tensors.
  std::vector<std::pair<std::string, at::Tensor>> fp32_state_dict() const;
  // Saves fp32_state_dict() as a plain LibTorch archive (torch::load(module, path) reads it into a
  // module of the same structure without this library).
  void save_weights(const std::string& path) const;
  // Saves weights, optimizer state, loss scaler, Adam steps, the iteration and the config in use;
  // load_checkpoint restores the weights, optimizer state, loss scaler and Adam steps into an
  // engine over the same model structure (checked: names, shapes and precision; the engine keeps
  // its own config and iteration count).
  // Both saves are atomic (atomic_file.h): a save that fails (a full disk, a missing folder) or is
  // killed leaves the file at `path` as it was, and a failure throws c10::Error saying why.
  void save_checkpoint(const std::string& path) const;
  void load_checkpoint(const std::string& path);

  const RegistrationReport& registration() const { return registration_; }
  // initialize_engine measures the factory's peak host allocation and folds it in here.
  void note_model_construction_peak(int64_t bytes);
  // The last kHistoryKept iterations' reports, oldest first (nothing grows with the run).
  static constexpr size_t kHistoryKept = 64;
  const std::vector<IterationReport>& history() const { return history_; }
  // Keeps the chunk timeline from now on (scheduler().moves() and moment_records(), the copy
  // thread's spans), or stops. Off by default: it grows with every iteration (ps_bench turns it on
  // for --trace, --plot and --predict).
  void set_record_timeline(bool on);
  // Where the bytes were at the moment of highest device use (its tier's blocks plus the live
  // non-model bytes) and at the moment of highest host-tier use, over every iteration so far;
  // taken once each moment's chunks are in place (a move within a moment can pass it briefly:
  // the tiers' peak_bytes() are the exact highs).
  const MemoryBreakdown& device_peak_breakdown() const { return device_peak_breakdown_; }
  const MemoryBreakdown& host_peak_breakdown() const { return host_peak_breakdown_; }
  int64_t iteration() const { return iteration_; }
  // Iterations whose moments differed from the trace, so that it was re-recorded.
  int64_t retrace_count() const { return retraces_; }
  double loss_scale() const { return adam_->loss_scale(); }
  const ChunkStore& chunks() const { return *store_; }
  const Scheduler& scheduler() const { return *scheduler_; }
  const TraceRecorder& tracer() const { return *recorder_; }
  MemoryTier& device_tier() const { return *device_; }
  MemoryTier& host_tier() const { return *host_; }
  // Adam for chunk index i runs on the device: decided at the first step() after the trace was
  // dropped (the first iteration's, and the one after each retrace) from the margin its moments
  // measured; a warm-up repeated because its trace did not fit keeps the placement it had.
  const std::vector<bool>& adam_on_device() const { return adam_on_device_; }
  // Chunk index i belongs to CPU embeddings (use_cpu_embedding): it never moves to the device.
  bool host_only(int64_t chunk_index) const { return host_only_[chunk_index]; }
  // Data parallel: this process's rank, the number of processes, and whether this rank owns chunk
  // index i (keeps its optimizer state; always true with one process).
  int rank() const { return rank_; }
  int world_size() const { return world_; }
  bool owns(int64_t chunk_index) const {
    return store_->layout().owner_rank(chunk_index) == rank_;
  }
  const Communicator& communicator() const { return *comm_; }

  // ModuleHookHandler (called by the doors).
  int64_t pre_forward(torch::nn::Module& module) override;
  std::vector<at::Tensor> wrap_inputs(int64_t token, std::vector<at::Tensor> inputs) override;
  std::vector<at::Tensor> post_forward(int64_t token, std::vector<at::Tensor> outputs) override;
  void forward_failed(int64_t token) override;
  // An engine takes only the doors of the modules it registered.
  bool handles_unregistered_modules() const override { return false; }
  // The first hook of a backward pass (the engine's backward() or plain loss.backward()): the
  // engine queues its end-of-backward work on that pass.
  void backward_started() override;

 private:
  struct Param {
    std::string name;
    at::Tensor tensor;  // the user's parameter (same TensorImpl throughout)
    // The parameter's storage in a door: re-pointed at the chunk slot (views autograd saved share
    // it). Outside the doors the parameter holds `fence`, which has no data and throws an error
    // naming the parameter when an operator reads it.
    c10::Storage live;
    c10::Storage fence;
    bool gathered = false;  // a GatheredParameters scope holds it as a real fp32 tensor
    TensorId id = -1;
    bool trainable = true;
    int compute_refs = 0;  // open doors / backward uses holding it
    bool has_grad = false;  // gradient written since the last step (or kept at zero: the step)
    // The autograd passes that will bring this parameter a gradient in the next backward: the
    // plain forward is one, each checkpointed call that uses it another (its recompute has a
    // backward of its own). With two or more, a recompute may still read the weight after a
    // gradient arrived, so gradients wait in pending_grad (mixed precision without a gradient
    // space). last_segment: the pass of the latest use (0 plain, else the checkpoint's serial).
    int segments = 0;
    int64_t last_segment = -1;
    void forget_segments() {  // a forward forgotten, a backward ended or abandoned
      segments = 0;
      last_segment = -1;
    }
    at::Tensor pending_grad;  // fp32 sum of such gradients, written to the half slot at the end
    // An evaluation forward on CUDA whose chunk is on the host reads this device copy of the slot
    // (the schedule is not followed outside training; the copy goes when the door closes).
    mutable at::Tensor eval_copy;
    // Data parallel: gradients written this backward (the group is reduced once every trainable
    // tensor of it has `segments` of them), and whether a door used it since its group's gather.
    int grads_this_backward = 0;
    bool touched = false;
    // The gradient as LibTorch code sees it (engine_grad_handles.cpp). grad_defined: LibTorch's
    // tensor.grad() would be defined (a gradient came since the last reset). grad_handle: what the
    // engine set tensor.grad() to: a view of the chunk slot holding the gradient (grad_view, over
    // grad_storage, fenced when withdrawn) or a marker without data. grad_consumed: a step used
    // the gradient and overwrote its half slot (mixed precision without a gradient space).
    bool grad_defined = false;
    bool grad_view = false;
    bool grad_consumed = false;
    at::Tensor grad_handle;
    c10::Storage grad_storage;
    int64_t grad_handle_version = 0;
    int64_t adam_steps = 0;  // Adam updates applied to it (torch::optim::Adam counts per parameter)
  };
  struct ModuleInfo {
    std::string label;
    std::vector<TensorId> params;  // its own and its descendants', registered order
    int64_t hook_id = -1;       // pre-backward (on its outputs)
    int64_t post_hook_id = -1;  // post-backward (on its inputs)
  };
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
  enum class Phase { kIdle, kForward, kBackwardDone };
  class Mover;

  void register_parameters();
  // The model's parameters become plain fp32 tensors with the master weights again (the
  // destructor; a constructor that fails after registration). may_gather: data parallel, the
  // other ranks take part (false while an error unwinds: they are elsewhere).
  void give_back_model(bool may_gather);
  void report_config_warnings() const;
  ModuleInfo& module_info(torch::nn::Module& module);
  // A moment: tick, record, schedule the chunks of `params` (plus gradient chunks when asked), then
  // set each parameter COMPUTE and point it at its chunk. Returns the tensors it acquired.
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
  bool half_slots_hold_gradients() const { return grads_in_half_slots_; }
  void flush_pending_gradients();
  // A backward that began (in_backward_) but whose end never came: autograd threw inside a plain
  // loss.backward(). Drops the iteration, with a warning naming `where` the engine noticed.
  void recover_from_a_dead_backward(const char* where);
  // Parameters whose requires_grad changed since registration start or stop training now.
  void sync_trainable();
  void point_at_chunk(const Param& p);
  // The parameter leaves its chunk: it holds its fence (no data) again.
  void point_at_nothing(const Param& p);
  // Refuses a door over parameters that a GatheredParameters scope holds (before any change).
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
  TensorId id_of(const at::Tensor& t) const;
  friend class GatheredParameters;
  // --- data parallel (engine_distributed.cpp) ---
  bool distributed() const { return world_ > 1; }
  int64_t comm_group_of(TensorId id) const;
  // Makes the param chunks of `ids` present (all-gathering their comm groups from the owners),
  // and, with `with_grad_chunks`, zeroed host gradient chunks for a CPU embedding's remote ones
  // (other remote gradient chunks start as zeros when the Mover first puts them on the device).
  void ensure_gathered(const std::vector<TensorId>& ids, bool with_grad_chunks);
  void gather_group(int64_t group);
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
  void decide_adam_placement();
  // Tells the scheduler the last moment's compute is over (its prefetch point).
  void close_moment();
  // Keeps the breakdown of this moment when it is the highest device or host use so far.
  void note_memory(const std::string& moment);
  // "param chunk 0 (id 0) (wte.weight); ...": resident chunks that may not move, for errors.
  std::string describe_pinned() const;
  // Registration: marks optimizer-state chunks to go to the device for good, covering `shortfall`
  // bytes the host budget lacks, and sets registration_.device_state_bytes. Returns "" when it
  // did (or the disk tier handles it), else why not, for the host-budget error.
  std::string place_states_on_device(int64_t shortfall);
  IterationReport run_adam();
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
  bool grad_space_ = false;  // a separate kGrad chunk list (fp32, or accumulation > 1)
  std::vector<Param> params_;
  std::unordered_map<const c10::TensorImpl*, TensorId> param_of_impl_;
  std::unordered_map<const torch::nn::Module*, std::string> module_names_;
  std::unordered_map<const torch::nn::Module*, std::unique_ptr<ModuleInfo>> modules_;

  std::unique_ptr<CopyEngine> copy_queue_;  // asynchronous moves; outlives the store (declared first)
  double copy_wait_at_iteration_start_ = 0;
  std::unique_ptr<MemoryTier> host_;
  std::unique_ptr<MemoryTier> device_;
  std::unique_ptr<ChunkStore> store_;
  std::unique_ptr<engine_detail::DiskStates> disk_;  // the disk tier (null without); goes before store_
  std::unique_ptr<MemoryProbe> probe_;
  CpuMemoryProbe* cpu_probe_ = nullptr;  // probe_, on the emulated device
  // Data parallel: probe_, which adds the gathered groups' device bytes to the base probe's.
  engine_detail::GatheredBytesProbe* gathered_probe_ = nullptr;
  int64_t gathered_peak_bytes_ = 0;  // this iteration's (IterationReport::gathered_peak_bytes)
  bool probe_floor_set_ = false;
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

  Phase phase_ = Phase::kIdle;
  bool in_iteration_ = false;
  bool in_backward_ = false;
  bool grads_in_half_slots_ = false;
  bool handles_shown_ = false;    // some parameter's grad() is an engine handle
  bool views_shown_ = false;      // ... and some of them are views of chunk slots
  bool warned_consumed_ = false;  // the backward-after-step-without-zero_grad warning was given
  int open_scopes_ = 0;
  int64_t forward_start_moment_ = 0;  // moments of the iteration before the forward in progress
  bool hooks_in_forward_ = false;     // the forward in progress put pre-backward nodes in a graph
  int64_t retraces_ = 0;
  bool retraced_this_iteration_ = false;
  int backwards_since_step_ = 0;
  int64_t iteration_ = 0;
  std::vector<OpenScope> scopes_;
  int64_t open_moment_ = -1;  // the last moment, until close_moment()
  std::vector<bool> adam_on_device_;
  std::vector<bool> host_only_;  // per chunk index: a CPU embedding's chunk, never on the device
  // Host plus device: per chunk id, an optimizer-state chunk placed on the device for good at
  // registration; per chunk index, whether it has one (its Adam always runs on the device).
  std::vector<bool> states_on_device_;
  std::vector<bool> adam_device_only_;
  bool placement_decided_ = false;
  MoveCounters counters_at_iteration_start_;
  RegistrationReport registration_;
  std::vector<IterationReport> history_;
  MemoryBreakdown device_peak_breakdown_;
  MemoryBreakdown host_peak_breakdown_;
  at::Tensor zero_grad_marker_;
  at::Tensor zero_grad_marker_grad_;
  int64_t zero_grad_marker_version_ = 0;
  int64_t gathered_ = 0;  // parameters held by GatheredParameters scopes
  int64_t gathered_for_write_ = 0;  // of which by read-write scopes
  std::vector<GatheredParameters*> gathered_scopes_;  // open scopes (told when the engine goes)
  std::vector<at::Tensor> cast_buffers_;  // fp32 buffers cast to the compute dtype (mixed precision)

  // Data parallel.
  std::shared_ptr<Communicator> comm_;
  int rank_ = 0;
  int world_ = 1;
  std::vector<char> group_gathered_;     // per comm group: its remote param chunks are present
  std::vector<char> group_has_grads_;    // per comm group: gradients written, not reduced yet
  std::vector<int64_t> group_touched_;   // per comm group: tensors used since the gather
  std::vector<int64_t> group_tensors_;   // per comm group: tensors in its chunks
  std::vector<at::Tensor> reduced_grads_;  // per owned chunk index (mixed, no gradient space): fp32
  int64_t group_gathers_ = 0;
  int64_t group_reduces_ = 0;
  mutable double collective_seconds_ = 0;  // also spent by const collectives (fp32_state_dict)
  CollectiveCounters comm_at_iteration_start_;
  int64_t group_gathers_at_iteration_start_ = 0;
  int64_t group_reduces_at_iteration_start_ = 0;
  double collective_seconds_at_iteration_start_ = 0;
};

}  // namespace patrickstar
