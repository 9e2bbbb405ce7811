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
// What this project's tests and benchmarks look at inside (the chunk store, the scheduler, the
// tiers) is in engine_inspect.h, a test-only header (engine/testing/, not installed); the
// implementation is private (engine/src, docs/design.md "Architecture").
// Ownership: the engine shares ownership of the model, and owns its chunks, tiers, scheduler,
// tracer and optimizer. Two engines may live side by side; on the emulated device each measures
// its own peaks (a peak window of its own), on CUDA they share the caching allocator's peak, which
// each one resets.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "patrickstar/engine/config.h"
#include "patrickstar/engine/memory_breakdown.h"
#include "patrickstar/engine/module_hooks.h"
#include "patrickstar/engine/reports.h"
#include "patrickstar/engine/safetensors.h"

namespace patrickstar {

class Communicator;
namespace engine_detail {
class EngineImpl;  // the engine's implementation (engine/src/engine_core.h)
}  // namespace engine_detail
class EngineInspector;
class GatheredParameters;

// Adam's options a trainer may change between steps, for the model or one param group
// (Engine::set_adam_hyperparameters, set_lr, set_param_group_options).
struct AdamHyperparameters {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  double lr = 1e-3;
  bool operator==(const AdamHyperparameters&) const = default;
};

// One parameter group of the optimizer (OptimizerConfig::param_groups, "params.no_decay"): what it
// is called, its options now, and its parameters' names in registration order.
struct ParamGroupInfo {
  std::string label;  // "default" (group 0), "param_groups[i]", "no_decay"
  AdamHyperparameters options;
  std::vector<std::string> names;
};

class Engine final {
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
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  torch::nn::Module& module() const;
  const std::shared_ptr<torch::nn::Module>& module_ptr() const;
  const Config& config() const;

  // Makes this engine the active handler on this thread while the returned guard lives. The doors
  // do not need it: they find the engine from the modules it registered (module_hooks.h), and an
  // engine takes no unregistered module's door, so forwards run the same with or without it.
  ActiveHandlerGuard activate();

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
  const at::Tensor& zero_grad_marker() const;

  // The learning rate of the next steps (LR schedules; EngineOptimizer passes each param group's
  // through set_param_group_options).
  void set_lr(double lr);
  double lr() const;
  // Adam's betas, eps and weight decay of the next steps (the config's until set). Throws
  // c10::Error naming the value, changing nothing, for a beta outside [0, 1), a negative or
  // non-finite eps or weight decay, or a beta too close to 1 for bf16 optimizer states
  // ("state_dtype": "bf16", as the config refuses it).
  void set_adam_hyperparameters(double beta1, double beta2, double eps, double weight_decay);
  AdamHyperparameters adam_hyperparameters() const;
  // With param groups: set_lr and set_adam_hyperparameters set an option of group 0 and of every
  // group that follows group 0 in it. A group holds an option of its own once the config set it
  // (the no_decay group: its weight decay 0) or set_param_group_options gave it a value other
  // than group 0's; lr() and adam_hyperparameters() are group 0's.

  // The optimizer's parameter groups (one, "default", unless the config has param_groups or
  // no_decay): each parameter's Adam update runs with its group's options.
  std::vector<ParamGroupInfo> param_groups() const;
  // Each group's options alone (param_groups() without the names).
  std::vector<AdamHyperparameters> param_group_options() const;
  // Every group's options for the next steps, one per group in param_groups()'s order. All are
  // checked before any is applied (as set_adam_hyperparameters checks, and lr finite and not
  // negative): a refusal names the group and the option, and changes nothing.
  void set_param_group_options(const std::vector<AdamHyperparameters>& options);

  // The overlapped step ("zero_optimization.overlap_step", "auto" by default) on (whatever the
  // cores) or off from the next backward; off undoes what the backward in progress updated ahead.
  // Not with a disk tier or the delayed update (there every update runs at the step, or in the next
  // iteration, and turning it on is an error; under "plan": "auto" with the delayed update allowed,
  // an error only while the plan has the delayed update on).
  void set_overlap_step(bool on);

  // fp32 weights by parameter name (the master copy), as new tensors.
  std::vector<std::pair<std::string, at::Tensor>> fp32_state_dict() const;
  // Saves fp32_state_dict() as a plain LibTorch archive (torch::load(module, path) reads it into a
  // module of the same structure without this library).
  void save_weights(const std::string& path) const;
  // Writes the fp32 master weights as a Hugging Face safetensors checkpoint in `folder` (created
  // when missing; patrickstar/engine/safetensors.h): one chunk's values at a time, in chunk order,
  // so the host never holds the model; shards past options.max_shard_bytes with their index. Every
  // file is written and flushed before any is renamed into place (the index last): a failed save
  // (a full disk) throws c10::Error and leaves the folder's checkpoint as it was. Data parallel: a
  // collective (every rank calls it); each chunk comes from its owner and rank 0 writes the one
  // checkpoint (the report is empty elsewhere); a failed write throws on every rank.
  SafetensorsSaveReport save_safetensors(const std::string& folder,
                                         const SafetensorsOptions& options = {}) const;
  // Saves weights, optimizer state, loss scaler, Adam steps, the iteration and the config in use;
  // load_checkpoint restores the weights, optimizer state, loss scaler and Adam steps into an
  // engine over the same model structure (checked: names, shapes and precision; the engine keeps
  // its own config and iteration count).
  // Both saves are atomic (atomic_file.h): a save that fails (a full disk, a missing folder) or is
  // killed leaves the file at `path` as it was, and a failure throws c10::Error saying why.
  void save_checkpoint(const std::string& path) const;
  void load_checkpoint(const std::string& path);

  const RegistrationReport& registration() const;
  // initialize_engine measures the factory's peak host allocation and folds it in here.
  void note_model_construction_peak(int64_t bytes);
  // The last kHistoryKept iterations' reports, oldest first (nothing grows with the run).
  static constexpr size_t kHistoryKept = 64;
  const std::vector<IterationReport>& history() const;
  // The activation plan: each patrickstar::checkpoint call of an iteration, what the first
  // iteration measured of it and what it does; with "activation_checkpointing": {"policy":
  // "auto"}, the candidates the cost model compared after it (IterationReport::
  // activation_plan_made marks that step). text() prints it.
  ActivationPlanReport activation_plan() const;
  // "plan": "auto": every candidate setting the engine predicted after the first scheduled
  // iteration, the one it chose and why, and its check against the measured step
  // (IterationReport::plan_decision marks those steps); empty (planned false) before, or with
  // "plan": "off". text() prints it; config_json() pins the choice in a config.
  PlanReport plan() const;
  // Keeps the chunk timeline from now on (scheduler().moves() and moment_records(), the copy
  // thread's spans), or stops. Off by default: it grows with every iteration (ps_bench turns it on
  // for --trace, --plot and --predict).
  void set_record_timeline(bool on);
  // Where the bytes were at the moment of highest device use (its tier's blocks plus the live
  // non-model bytes) and at the moment of highest host-tier use, over every iteration so far;
  // taken once each moment's chunks are in place (a move within a moment can pass it briefly:
  // the tiers' peak_bytes() are the exact highs).
  const MemoryBreakdown& device_peak_breakdown() const;
  const MemoryBreakdown& host_peak_breakdown() const;
  int64_t iteration() const;
  // Iterations whose moments differed from the trace, so that it was re-recorded.
  int64_t retrace_count() const;
  double loss_scale() const;
  // Data parallel: this process's rank and the number of processes (0 and 1 with one process).
  int rank() const;
  int world_size() const;
  // The ranks each chunk is sharded over: world_size(), or with hybrid sharding the size of this
  // rank's shard group (zero_optimization.shard_group_size; the groups replicate one another).
  int shard_group_size() const;

 private:
  friend class EngineInspector;
  friend class GatheredParameters;
  std::unique_ptr<engine_detail::EngineImpl> core_;
};

}  // namespace patrickstar
