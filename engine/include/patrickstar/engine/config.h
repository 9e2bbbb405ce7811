// The training configuration: PatrickStar's DeepSpeed-style JSON, parsed into a typed struct.
//
//   auto config = patrickstar::Config::from_file("config.json");   // throws c10::Error on bad input
//   std::cout << config.to_json().dump(2);                          // the effective config, defaults filled
//
// Every key is optional; a missing section takes the defaults documented below (and in README.md).
// A wrong type or value is an error naming the JSON path, the value and what is expected; all problems
// of a document are reported together, and nothing is returned for a rejected document. Unknown keys
// are listed in `Config::warnings` with their path, or rejected when `"strict": true`. The keys, each
// with its type, default and check, are the rows of a table (engine/src/config_keys.cpp) that
// from_json and to_json walk.
// Value type: copyable, no shared state; thread-compatible.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "patrickstar/memtracer/scheduler.h"  // EvictionPolicy

namespace patrickstar {

enum class OptimizerType { kAdam, kAdamW };
enum class Precision { kFp32, kBf16, kFp16 };
enum class DeviceType { kEmulated, kCuda };
// How Adam's momentum and variance are stored ("optimizer.params.state_dtype").
enum class StateDtype { kFp32, kBf16 };

std::string_view to_string(OptimizerType type);
std::string_view to_string(Precision precision);
std::string_view to_string(DeviceType type);
std::string_view to_string(StateDtype dtype);

// What a parameter group's predicate sees of one parameter.
struct ParamInfo {
  std::string_view name;  // its qualified name, as named_parameters() gives it
  std::string_view
      module_type;  // the type of the module owning it, e.g. "torch::nn::LayerNormImpl"
  int64_t dim = 0;  // its number of dimensions
};

// A parameter group, as torch::optim's: the parameters it takes, and the options it sets for them
// (an option not set is the optimizer's). A parameter is in the first group that takes it, or else
// in group 0 with the optimizer's options.
struct ParamGroupConfig {
  // Patterns: the group takes a parameter whose name, or whose module's type name, contains one of
  // them, ignoring case ("bias" takes every bias, "norm" every LayerNorm's and RMSNorm's
  // parameters, "embedding" every torch::nn::Embedding's).
  std::vector<std::string> names;
  // In C++ only, besides the patterns: the group also takes a parameter for which this is true.
  std::function<bool(const ParamInfo&)> predicate;
  std::optional<double> lr;
  std::optional<double> beta1;
  std::optional<double> beta2;
  std::optional<double> eps;
  std::optional<double> weight_decay;
};

// Whether a param group's pattern takes the parameter named `name` of a module of type
// `module_type`: one of them contains it, ignoring case.
bool pattern_takes_parameter(std::string_view pattern, std::string_view name,
                             std::string_view module_type);

// "optimizer": {"type": "Adam"|"AdamW", "params": {...}, "param_groups": [...]}. Adam adds
// weight_decay * w to the gradient (L2), AdamW decays the weight itself, as torch.optim does.
struct OptimizerConfig {
  OptimizerType type = OptimizerType::kAdam;
  double lr = 1e-3;
  double beta1 = 0.9;  // "betas": [beta1, beta2]
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool use_hybrid_adam = true;  // Adam on the device for the chunks that fit there, host for the rest
  // "stream_states": hybrid Adam also updates on the device the chunk indices past the margin whose
  // param, gradient and states fit what the device has free at the step (the activations gone):
  // their states come to the device for the update and go back when the next forward needs the
  // room. Faster where the host Adam is slower than the copies (a GPU with fast copies); the same
  // bits as on the host. Needs use_hybrid_adam, the opt or lru policy, no disk tier and one
  // process; "plan": "auto" considers it whatever this says (in one process).
  bool stream_states = false;
  // "state_dtype": "fp32" | "bf16". bf16 stores momentum and variance in 2 bytes each (mixed
  // precision: 10 bytes of model data per parameter instead of 14; fp32: 12 instead of 16); the
  // fp32 master stays, the update runs in fp32 and the stored moments are rounded to nearest even
  // once per step, on the host and on the device alike. Refused unless both betas are below
  // 1 - kBf16StateMinDecay (a moment rounded to nearest moves only when a step changes it by more
  // than half a bf16 step: with beta2 0.999 the variance could never decay).
  StateDtype state_dtype = StateDtype::kFp32;
  // "param_groups": groups 1, 2, ... in this order (group 0 holds the parameters none takes).
  std::vector<ParamGroupConfig> param_groups;
  // "params.no_decay": a last group of these patterns with weight decay 0 (Hugging Face's recipe:
  // ["bias", "norm"]); nothing when empty.
  std::vector<std::string> no_decay;
};
inline constexpr double kBf16StateMinDecay = 1.0 / 256;  // 2^-8
// What is wrong with `optimizer`'s param groups (values out of range, a group that names nothing,
// an empty pattern, betas bf16 states cannot hold; one line each), or "" when nothing is.
// `values_read`: the values came through Config::from_json, which checked all but the betas'
// bf16 problem. Config::from_json and the engine's constructor refuse such a config with it.
std::string param_group_problem(const OptimizerConfig& optimizer, bool values_read = false);
// Why `optimizer`'s betas cannot go with its bf16 states (one line per beta), or "" when they can.
// Config::from_json and the engine's constructor refuse such a config with it.
std::string bf16_state_problem(const OptimizerConfig& optimizer);

// "fp16": DeepSpeed's loss-scaling keys. loss_scale 0 means dynamic, starting at 2^initial_scale_power.
struct Fp16Config {
  bool enabled = false;
  double loss_scale = 0.0;
  int initial_scale_power = 16;
  int loss_scale_window = 1000;
  int hysteresis = 2;
  double min_loss_scale = 1.0;
};

// "client": {"mem_tracer": {...}}: PatrickStar's memory-tracer keys. Ratios are of the device capacity.
struct MemTracerConfig {
  double warmup_gpu_chunk_mem_ratio = 0.1;  // chunk budget during the warm-up iteration
  double overall_gpu_mem_ratio = 0.8;       // the share of the device the runtime may plan with
  double overall_cpu_mem_ratio = 0.8;       // accepted for compatibility: no effect (the host tier
                                            // uses host_capacity_bytes as it is)
  double margin_use_ratio = 0.8;            // share of the post-backward margin hybrid Adam may use
  bool use_async_mem_monitor = false;       // accepted for compatibility: peaks are measured exactly
                                            // by the counting allocator, so no sampling thread exists
  bool with_static_partition = false;       // same as "client.scheduler.policy": "static"
};

// "client": {"device": {...}}: where chunks live. Sizes are bytes, as numbers or strings with a unit
// ("2GiB", "512MiB", "1.5GB").
struct DeviceConfig {
  // capacity_bytes = kAutoCapacity (0, or "auto" in JSON; the default): the emulated device gets
  // kEmulatedAutoCapacity; CUDA gets what GPU 0 has for this process when the engine is built (the
  // driver's free memory plus what LibTorch's caching allocator holds there). The engine's
  // config() reports the capacity it used.
  static constexpr int64_t kAutoCapacity = 0;
  static constexpr int64_t kEmulatedAutoCapacity = int64_t{4} << 30;  // 4 GiB

  // index = kLocalRankIndex (-1, or "auto" in JSON; the default): on "cuda" the process's local
  // rank: initialize_engine's local_rank, else the launcher's (LOCAL_RANK under torchrun,
  // OMPI_COMM_WORLD_LOCAL_RANK under mpirun), else 0: one GPU per rank. The engine makes it
  // LibTorch's current CUDA device, as a DDP trainer's set_device does. Unused on the emulated
  // device (always 0 there).
  static constexpr int kLocalRankIndex = -1;

  DeviceType type = DeviceType::kEmulated;
  int index = kLocalRankIndex;             // the GPU ("cuda")
  int64_t capacity_bytes = kAutoCapacity;  // the device's hard capacity (a cap below a GPU's memory)
  int64_t host_capacity_bytes = 0;         // 0: unlimited
};

// "client": {"scheduler": {...}}: how chunks move once the warm-up trace exists.
struct SchedulerConfig {
  EvictionPolicy policy = EvictionPolicy::kOpt;
  int prefetch_depth = 4;      // moments ahead to prefetch; 0 turns prefetching off
  int64_t reserve_bytes = 0;   // device bytes kept free at every moment
  // Chunk moves on a copy engine that overlap compute (a copy thread on the emulated device, a
  // CUDA copy stream on "cuda"); false: every move completes before the call that made it returns.
  bool async_moves = true;
  // Testing: the emulated device's copy thread sleeps a seeded pseudo-random time in
  // [0, copy_delay_max_us] before each copy (results must not change). Refused on "cuda".
  int copy_delay_max_us = 0;
  int copy_delay_seed = 0;
};

// "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}}, as
// DeepSpeed writes it: the optimizer states of the chunks whose Adam runs on the host (fp32 master
// in mixed precision, momentum, variance) live in files in nvme_path (the disk tier) and come into
// host memory a chunk at a time. "cpu" and "none" keep them in memory (the default). The other
// offload_optimizer keys DeepSpeed knows (pin_memory, buffer_count, ...) are accepted and ignored.
struct OffloadConfig {
  bool nvme = false;
  std::string nvme_path;
};

// "zero_optimization": {"overlap_step": "auto", "overlap_step_max_bytes": "2GiB"}: the overlapped
// step (docs/design.md, "The overlapped step"). A chunk index's host Adam runs on an optimizer
// thread as soon as its gradients are final in backward, undoably, and the step commits it (bit for
// bit the serial step) or undoes it and updates the chunk itself. max_bytes bounds the undo buffers
// (12 bytes per element, 14 in mixed precision, 4 fewer with bf16 states, host-tier blocks kept
// between iterations; with a
// host capacity also at most what it holds beyond every chunk); indices past it update at the step.
// Not with a disk tier; with data parallel, by each index's owner once its comm group is reduced.
// "auto" (the default): measured. After the warm-up three overlapped and three serial iterations
// alternate and the way with the lower median iteration stays (docs/design.md, "The overlapped
// step"); on the emulated device only while LibTorch's compute threads leave a core free (there the
// thread would otherwise take compute's cores: measured slower, BENCHMARKS.md). true: always;
// false: every update at the step.
enum class OverlapMode : uint8_t { kAuto, kOn, kOff };
struct OverlapStepConfig {
  OverlapMode mode = OverlapMode::kAuto;
  int64_t max_bytes = int64_t{2} << 30;
};

// "zero_optimization": {"delayed_param_update": true, "delayed_param_update_warmup_steps": 10}:
// the delayed parameter update, opt-in (docs/design.md, "The delayed update"). After warmup_steps
// ordinary steps, step() hands the update of this iteration's gradients to the optimizer thread and
// returns; the next forward and backward run on the weights from before it (one step stale, as
// ZeRO-Offload's DPU), and the next step() writes its result into the weights before handing over
// the next. Every Adam runs on the host. Anything that reads or replaces the weights outside
// training (an evaluation forward, GatheredParameters, the state and checkpoint functions) writes
// the pending update in first. One process, fp32 or bf16 (fp16's loss scale would be decided a
// step late), no disk tier, and not with "overlap_step": true. The default of 10 warm-up steps is
// our choice.
struct DelayedUpdateConfig {
  bool enabled = false;
  int64_t warmup_steps = 10;
};

// "plan": "auto": the engine chooses the chunk size (with "default_chunk_size": "auto"), the step
// schedule (serial, overlapped, or where zero_optimization.delayed_param_update allows it the
// delayed update) and where each chunk index's Adam runs (the margin's indices on the device, or
// every one on the host) from the
// first scheduled iteration's trace and measured compute, with memtracer's cost model; it prints
// every candidate's prediction, keeps it in Engine::plan() and IterationReport::plan_decision,
// and after "plan_check_iterations" iterations on the plan compares the measured step with the
// prediction: past "plan_tolerance" (a relative difference) it corrects the profile with the
// measurement and plans once more (docs/design.md, "The plan"). "plan_profile": "measured" (copy
// bandwidth and Adam rates measured here) or a GPU model's rates ("h100", "h200"). Exact only
// unless the config allows the delayed update (then a candidate, not the setting). Data parallel:
// every rank runs rank 0's chunk size (the engine's own) and activations, each choosing its own
// schedule and Adam placement with them; set alike on every rank. Not with the static policy.
// "off" (the default): the config's own settings.
enum class PlanMode : uint8_t { kOff, kAuto };
struct PlanConfig {
  PlanMode mode = PlanMode::kOff;
  std::string profile = "measured";
  int check_iterations = 3;
  double tolerance = 0.25;
};

// "zero_optimization": {"frozen_parameters": "lean"}: what a parameter frozen at registration
// (requires_grad false when initialize_engine takes the model) costs. "lean" (the default): frozen
// parameters get chunk indices of their own holding their param chunk only (no fp32 master,
// momentum, variance or gradient chunk: 2 bytes per parameter in bf16), and requires_grad_(true)
// on such a parameter later is an error naming it. With data parallel, where chunks of their own
// take fewer bytes per rank than sharing chunks with the trained parameters (each group rounds up
// to world_size chunks; a large frozen base), sharded and gathered like the others and never
// reduced; else they share chunks, with full state. "full_state": every parameter keeps full
// optimizer state, for gradual unfreezing (docs/design.md, "Frozen parameters").
enum class FrozenParameters : uint8_t { kLean, kFullState };

// "zero_optimization": {"shard_group_size": k}: hybrid sharding with data parallel. Chunks are
// sharded within groups of k ranks and replicated across the world_size / k groups: a gather stays
// in its group, gradients are reduced in the group and all-reduced across the groups for the
// owner's shard only, and each rank holds 1/k of the model data (docs/design.md section 9).
// 0 (the default): the ranks of one host, when every host runs the same number (else the whole
// world); "world" (kShardWholeWorld): the whole world, plain ZeRO-3. Else k must be at least 2 and
// divide the number of ranks. DeepSpeed's spelling "zero_hpz_partition_size" is read too, its 1
// (DeepSpeed's default, hpZ off) as the default here.
inline constexpr int kShardWholeWorld = -1;

// "activation_checkpointing": {"policy": ...}: what each patrickstar::checkpoint call does
// (checkpoint.h; docs/design.md, "Activations"). "recompute" (the default): its activations are
// dropped and recomputed in backward from its saved input, which stays on the device. "offload":
// recomputed, with the saved input in the host tier meanwhile (copied out after the forward,
// prefetched back before the recompute). "none": kept, as without checkpointing (calls that name
// their block; others recompute). "auto": the first iteration offloads every call and measures
// each one's saved input, kept activations and forward time; then the cost model chooses per call
// keep, recompute or offload for the shortest predicted step that fits the device
// (Engine::activation_plan()). A call's own {.offload = ...} wins. DeepSpeed's
// "cpu_checkpointing": true reads as "offload"; its other keys there are accepted and ignored.
// "calls" (with "auto" only) pins "auto"'s choice: each call's way in call order, "keep",
// "recompute" or "offload" (what the run plan's --write-plan writes); the first iteration still
// measures; where the iteration makes another number of calls "auto" warns and chooses as without
// it; where the number matches but its model says the pinned ways do not fit, it warns and runs
// them.
enum class ActivationPolicy : uint8_t { kRecompute, kOffload, kNone, kAuto };
std::string_view to_string(ActivationPolicy policy);  // "recompute", ...
struct ActivationConfig {
  ActivationPolicy policy = ActivationPolicy::kRecompute;
  std::vector<std::string> calls;  // "keep", "recompute" or "offload" per call; empty: chosen
};

struct Config {
  OptimizerConfig optimizer;
  int shard_group_size = 0;  // 0: the ranks of one host; kShardWholeWorld; else k
  FrozenParameters frozen_parameters = FrozenParameters::kLean;
  OffloadConfig offload_optimizer;
  OverlapStepConfig overlap_step;
  DelayedUpdateConfig delayed_update;
  ActivationConfig activation_checkpointing;
  PlanConfig plan;
  Fp16Config fp16;
  bool bf16 = false;                         // "bf16": {"enabled": true}
  double gradient_clipping = 0.0;            // global L2 norm; 0 turns clipping off
  int gradient_accumulation_steps = 1;
  // Elements per chunk. Without "default_chunk_size" in the document (or with "auto") the engine
  // searches the size with the least waste (chunk_size_auto); a number sets it, at most
  // kMaxChunkElems (so elements x 8 bytes never overflows int64_t).
  static constexpr int64_t kMaxChunkElems = int64_t{1} << 40;
  int64_t default_chunk_size = int64_t{32} << 20;  // used when chunk_size_auto is false
  bool chunk_size_auto = true;
  bool release_after_init = false;
  bool use_cpu_embedding = false;
  MemTracerConfig mem_tracer;
  DeviceConfig device;
  SchedulerConfig scheduler;
  bool strict = false;  // unknown keys are errors instead of warnings

  // Unknown keys found while parsing, e.g. "unknown key $.optimizer.parms (known: type, params)".
  std::vector<std::string> warnings;

  Precision precision() const;

  // Parses a document. Throws c10::Error listing every problem (path, value, expectation).
  static Config from_json(const nlohmann::json& document);
  static Config from_string(std::string_view text);
  static Config from_file(const std::string& path);

  // The effective configuration, every key present; from_json(to_json()) gives this config back
  // (but a param group's C++ predicate, which has no JSON: its group is written with its names).
  nlohmann::json to_json() const;
};

// The device capacity an engine built now with `config` uses: its capacity_bytes, or for "auto"
// DeviceConfig::kEmulatedAutoCapacity on the emulated device and what GPU 0 has for this process
// now on CUDA. Throws c10::Error, with the reason, when the device cannot be used here.
int64_t resolved_device_capacity(const Config& config);
// The GPU an engine built now with `config` uses (DeviceConfig::index resolved); 0 on the emulated
// device.
int resolved_device_index(const Config& config);

// Parses a byte size: a non-negative integer, or a string "<number>[unit]" with unit B, KB, MB, GB,
// TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024). Throws c10::Error naming `what`.
int64_t parse_byte_size(std::string_view text, std::string_view what = "size");

}  // namespace patrickstar
