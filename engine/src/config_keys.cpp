#include "config_keys.h"

#include <cmath>
#include <limits>

#include <c10/util/Exception.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace patrickstar::config_keys {
namespace {

using json = nlohmann::json;

constexpr double kMax = std::numeric_limits<double>::max();
constexpr int kIntMax = std::numeric_limits<int>::max();

}  // namespace

namespace {

using enum KeyUse;

// The rows, in the order from_json has always read the keys (its problems are listed in this
// order). Each row: path, type, default (as JSON), help, use, read, write.
constexpr ConfigKey kKeys[] = {
    {"strict", "true or false", "false", "unknown keys are errors instead of warnings", kUsed,
     [](const json& v, const ValueReader& r, Config& c) { r.boolean(v, c.strict); },
     [](const Config& c) { return json(c.strict); }},

    // DeepSpeed's keys that describe the training loop, which the user's own loop owns.
    {"train_batch_size", "anything", "", "DeepSpeed's; the training loop owns it", kIgnored,
     nullptr, nullptr},
    {"train_micro_batch_size_per_gpu", "anything", "", "DeepSpeed's; the training loop owns it",
     kIgnored, nullptr, nullptr},
    {"steps_per_print", "anything", "", "DeepSpeed's; the training loop owns it", kIgnored, nullptr,
     nullptr},
    {"wall_clock_breakdown", "anything", "", "DeepSpeed's; the training loop owns it", kIgnored,
     nullptr, nullptr},

    // ZeRO: only these keys are patrickstar's to read; the section's others are accepted (see
    // kSections).
    {"zero_optimization.overlap_step", "\"auto\", true or false", "\"auto\"",
     "the overlapped step: host Adam on an optimizer thread during backward, undoably", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       if (v.is_boolean()) {
         c.overlap_step.mode = v.get<bool>() ? OverlapMode::kOn : OverlapMode::kOff;
       } else if (v.is_string() && v.get<std::string>() == "auto") {
         c.overlap_step.mode = OverlapMode::kAuto;
       } else {
         r.error(v, "\"auto\", true or false");
       }
     },
     [](const Config& c) {
       return c.overlap_step.mode == OverlapMode::kAuto
                  ? json("auto")
                  : json(c.overlap_step.mode == OverlapMode::kOn);
     }},
    {"zero_optimization.overlap_step_max_bytes", "a byte count", "\"2GiB\"",
     "bound on the overlapped step's undo buffers", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.byte_size(v, c.overlap_step.max_bytes);
     },
     [](const Config& c) { return json(c.overlap_step.max_bytes); }},
    {"zero_optimization.shard_group_size",
     "0 (the ranks of one host), \"world\" or a number of ranks from 2", "0",
     "hybrid sharding: chunks sharded within groups of this many ranks, replicated across them",
     kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       if (v.is_string() && absl::AsciiStrToLower(v.get<std::string>()) == "world") {
         c.shard_group_size = kShardWholeWorld;
       } else if (v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() != 1 &&
                  v.get<int64_t>() <= kIntMax) {
         c.shard_group_size = static_cast<int>(v.get<int64_t>());
       } else {
         r.error(v, "0 (the ranks of one host), \"world\" or a number of ranks from 2");
       }
     },
     [](const Config& c) {
       return c.shard_group_size == kShardWholeWorld ? json("world") : json(c.shard_group_size);
     }},
    {"zero_optimization.zero_hpz_partition_size", "a number of ranks from 1", "1",
     "DeepSpeed's spelling of shard_group_size; its 1 (hpZ off) is the default", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       int k = 1;
       r.integer(v, k, 1, kIntMax);
       if (k > 1) c.shard_group_size = k;
     },
     nullptr},
    {"zero_optimization.frozen_parameters", "\"lean\" or \"full_state\"", "\"lean\"",
     "what a parameter frozen at registration costs", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       const std::string text = v.is_string() ? v.get<std::string>() : "";
       if (text == "lean") {
         c.frozen_parameters = FrozenParameters::kLean;
       } else if (text == "full_state") {
         c.frozen_parameters = FrozenParameters::kFullState;
       } else {
         r.error(v, "\"lean\" or \"full_state\"");
       }
     },
     [](const Config& c) {
       return json(c.frozen_parameters == FrozenParameters::kLean ? "lean" : "full_state");
     }},
    {"zero_optimization.delayed_param_update", "true or false", "false",
     "the delayed parameter update (one step stale), opt-in; under \"plan\": \"auto\" a candidate",
     kUsed,
     [](const json& v, const ValueReader& r, Config& c) { r.boolean(v, c.delayed_update.enabled); },
     [](const Config& c) { return json(c.delayed_update.enabled); }},
    {"zero_optimization.delayed_param_update_warmup_steps", "a whole number of steps, 0 or more",
     "10", "ordinary steps before the delayed update starts", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       if (v.is_number_integer() && v.get<int64_t>() >= 0) {
         c.delayed_update.warmup_steps = v.get<int64_t>();
       } else {
         r.error(v, "a whole number of steps, 0 or more");
       }
     },
     [](const Config& c) { return json(c.delayed_update.warmup_steps); }},
    {"zero_optimization.offload_optimizer.device", "one of \"none\", \"cpu\", \"nvme\"", "\"none\"",
     "\"nvme\": the host Adam's optimizer states live in files (the disk tier)", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       const std::string text = v.is_string() ? absl::AsciiStrToLower(v.get<std::string>()) : "";
       if (text == "nvme") {
         c.offload_optimizer.nvme = true;
       } else if (text != "cpu" && text != "none") {
         r.error(v, "one of \"none\", \"cpu\", \"nvme\"");
       }
     },
     [](const Config& c) { return json(c.offload_optimizer.nvme ? "nvme" : "none"); }},
    // Read after "device": a path that is not a string is a problem only for the disk tier.
    {"zero_optimization.offload_optimizer.nvme_path", "the path of a folder", "null",
     "the disk tier's folder", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       if (v.is_string()) {
         c.offload_optimizer.nvme_path = v.get<std::string>();
       } else if (c.offload_optimizer.nvme) {
         r.error(v, "the path of a folder");
       }
     },
     [](const Config& c) {
       return c.offload_optimizer.nvme_path.empty() ? json() : json(c.offload_optimizer.nvme_path);
     }},

    {"plan", "\"auto\" or \"off\"", "\"off\"",
     "auto: the engine chooses the chunk size, step schedule and Adam placement from its trace",
     kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.choice(v, c.plan.mode, {{"off", PlanMode::kOff}, {"auto", PlanMode::kAuto}});
     },
     [](const Config& c) { return json(c.plan.mode == PlanMode::kAuto ? "auto" : "off"); }},
    {"plan_profile", "one of \"measured\", \"h100\", \"h200\"", "\"measured\"",
     "the plan's copy and Adam rates: measured here, or a GPU's", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       static constexpr const char* kProfiles[] = {"measured", "h100", "h200"};
       if (const int i = r.choice_index(v, {kProfiles[0], kProfiles[1], kProfiles[2]}); i >= 0) {
         c.plan.profile = kProfiles[i];
       }
     },
     [](const Config& c) { return json(c.plan.profile); }},
    {"plan_check_iterations", "an integer in [1, 1000]", "3",
     "iterations on the plan before its measured step is compared with the prediction", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.integer(v, c.plan.check_iterations, 1, 1000);
     },
     [](const Config& c) { return json(c.plan.check_iterations); }},
    {"plan_tolerance", "a number in (0, 10]", "0.25",
     "relative difference of measured and predicted step past which the engine plans again once",
     kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.number(v, c.plan.tolerance, 0, 10, /*open_min=*/true);
     },
     [](const Config& c) { return json(c.plan.tolerance); }},

    {"activation_checkpointing.policy", "one of \"recompute\", \"offload\", \"none\", \"auto\"",
     "\"recompute\"",
     "what each patrickstar::checkpoint call does with its activations (auto: planned per call)",
     kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.choice(v, c.activation_checkpointing.policy,
                {{"recompute", ActivationPolicy::kRecompute},
                 {"offload", ActivationPolicy::kOffload},
                 {"none", ActivationPolicy::kNone},
                 {"auto", ActivationPolicy::kAuto}});
     },
     [](const Config& c) {
       return json(std::string(to_string(c.activation_checkpointing.policy)));
     }},
    {"activation_checkpointing.cpu_checkpointing", "true or false", "false",
     "DeepSpeed's: true is \"policy\": \"offload\"", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       bool on = false;
       r.boolean(v, on);
       if (on) c.activation_checkpointing.policy = ActivationPolicy::kOffload;
     },
     nullptr},
    // Read after "policy" and "cpu_checkpointing": "calls" pins "auto"'s choice only.
    {"activation_checkpointing.calls",
     "an array of \"keep\", \"recompute\" or \"offload\" per checkpoint call, with \"policy\": "
     "\"auto\"",
     "[]", "\"auto\"'s way for each checkpoint call in call order, pinned (the run plan writes it)",
     kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       if (!v.is_array()) {
         r.error(v, "an array of \"keep\", \"recompute\" or \"offload\"");
         return;
       }
       if (!v.empty() && c.activation_checkpointing.policy != ActivationPolicy::kAuto) {
         r.error(v, "no calls unless \"policy\" is \"auto\" (they pin its choice)");
         return;
       }
       static constexpr const char* kWays[] = {"keep", "recompute", "offload"};
       std::vector<std::string> calls;
       for (size_t i = 0; i < v.size(); ++i) {
         const int way =
             r.element(static_cast<int>(i)).choice_index(v[i], {kWays[0], kWays[1], kWays[2]});
         if (way < 0) return;
         calls.emplace_back(kWays[way]);
       }
       c.activation_checkpointing.calls = std::move(calls);
     },
     [](const Config& c) { return json(c.activation_checkpointing.calls); }},

    {"optimizer.type", "one of \"Adam\", \"AdamW\"", "\"Adam\"",
     "Adam (L2 decay) or AdamW (decoupled), as torch.optim", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.choice(v, c.optimizer.type,
                {{"Adam", OptimizerType::kAdam}, {"AdamW", OptimizerType::kAdamW}});
     },
     [](const Config& c) { return json(std::string(to_string(c.optimizer.type))); }},
    {"optimizer.params.lr", "a number >= 0", "1e-3", "the learning rate", kUsed,
     [](const json& v, const ValueReader& r, Config& c) { r.number(v, c.optimizer.lr, 0, kMax); },
     [](const Config& c) { return json(c.optimizer.lr); }},
    {"optimizer.params.betas", "an array of two numbers in [0, 1)", "[0.9, 0.999]",
     "Adam's decay rates of the momentum and the variance", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       if (v.is_array() && v.size() == 2) {
         r.element(0).number(v[0], c.optimizer.beta1, 0.0, 1.0);
         r.element(1).number(v[1], c.optimizer.beta2, 0.0, 1.0);
         if (c.optimizer.beta1 == 1 || c.optimizer.beta2 == 1) r.error(v, "two numbers in [0, 1)");
       } else {
         r.error(v, "an array of two numbers in [0, 1)");
       }
     },
     [](const Config& c) {
       return json::array({c.optimizer.beta1, c.optimizer.beta2});
     }},
    {"optimizer.params.eps", "a number > 0", "1e-8", "added to the variance's square root", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.number(v, c.optimizer.eps, 0, kMax, /*open_min=*/true);
     },
     [](const Config& c) { return json(c.optimizer.eps); }},
    {"optimizer.params.weight_decay", "a number >= 0", "0", "L2 (Adam) or decoupled (AdamW) decay",
     kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.number(v, c.optimizer.weight_decay, 0, kMax);
     },
     [](const Config& c) { return json(c.optimizer.weight_decay); }},
    {"optimizer.params.use_hybrid_adam", "true or false", "true",
     "Adam on the device for the chunks that fit there", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.boolean(v, c.optimizer.use_hybrid_adam);
     },
     [](const Config& c) { return json(c.optimizer.use_hybrid_adam); }},
    {"optimizer.params.stream_states", "true or false", "false",
     "also the step's free device memory for hybrid Adam, states streamed", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.boolean(v, c.optimizer.stream_states);
     },
     [](const Config& c) { return json(c.optimizer.stream_states); }},
    {"optimizer.params.state_dtype", "one of \"fp32\", \"bf16\"", "\"fp32\"",
     "how Adam's momentum and variance are stored", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.choice(v, c.optimizer.state_dtype,
                {{"fp32", StateDtype::kFp32}, {"bf16", StateDtype::kBf16}});
     },
     [](const Config& c) { return json(std::string(to_string(c.optimizer.state_dtype))); }},
    {"optimizer.params.no_decay", "an array of name patterns", "[]",
     "a last param group with weight decay 0 of these patterns (e.g. [\"bias\", \"norm\"])", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       read_patterns(v, r, c.optimizer.no_decay);
     },
     [](const Config& c) {
       return c.optimizer.no_decay.empty() ? json() : json(c.optimizer.no_decay);
     }},
    {"optimizer.param_groups",
     "an array of groups {\"names\", \"lr\", \"betas\", \"eps\", "
     "\"weight_decay\"}",
     "[]",
     "param groups 1, 2, ...: the parameters their name patterns take, with their own options",
     kUsed,
     [](const json& v, const ValueReader& r, Config& c) { read_param_groups(v, r, c.optimizer); },
     [](const Config& c) { return param_groups_json(c.optimizer); }},

    {"fp16.enabled", "true or false", "false", "fp16 mixed precision with loss scaling", kUsed,
     [](const json& v, const ValueReader& r, Config& c) { r.boolean(v, c.fp16.enabled); },
     [](const Config& c) { return json(c.fp16.enabled); }},
    {"fp16.loss_scale", "a number >= 0", "0", "a fixed loss scale; 0: dynamic", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.number(v, c.fp16.loss_scale, 0, kMax);
     },
     [](const Config& c) { return json(c.fp16.loss_scale); }},
    {"fp16.initial_scale_power", "an integer from 0 to 126", "16",
     "the dynamic loss scale starts at 2^this", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.integer(v, c.fp16.initial_scale_power, 0, 126);
     },
     [](const Config& c) { return json(c.fp16.initial_scale_power); }},
    {"fp16.loss_scale_window", "an integer from 1 to 2147483647", "1000",
     "steps without overflow before the loss scale grows", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.integer(v, c.fp16.loss_scale_window, 1, kIntMax);
     },
     [](const Config& c) { return json(c.fp16.loss_scale_window); }},
    {"fp16.hysteresis", "an integer from 1 to 2147483647", "2",
     "overflows tolerated before the loss scale shrinks", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.integer(v, c.fp16.hysteresis, 1, kIntMax);
     },
     [](const Config& c) { return json(c.fp16.hysteresis); }},
    {"fp16.min_loss_scale", "a number > 0", "1", "the dynamic loss scale's floor", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.number(v, c.fp16.min_loss_scale, 0, kMax, /*open_min=*/true);
     },
     [](const Config& c) { return json(c.fp16.min_loss_scale); }},

    {"bf16.enabled", "true or false", "false", "bf16 parameters and gradients, fp32 master", kUsed,
     [](const json& v, const ValueReader& r, Config& c) { r.boolean(v, c.bf16); },
     [](const Config& c) { return json(c.bf16); }},

    {"gradient_clipping", "a number >= 0", "0", "global L2 norm to clip to; 0: off", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.number(v, c.gradient_clipping, 0, kMax);
     },
     [](const Config& c) { return json(c.gradient_clipping); }},
    {"gradient_accumulation_steps", "an integer from 1 to 2147483647", "1",
     "micro-batches per step", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.integer(v, c.gradient_accumulation_steps, 1, kIntMax);
     },
     [](const Config& c) { return json(c.gradient_accumulation_steps); }},
    {"default_chunk_size", "a number of elements from 1 to 2^40, or \"auto\"", "\"auto\"",
     "elements per chunk; \"auto\": the size with the least waste", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       if (v.is_string() && absl::AsciiStrToLower(v.get<std::string>()) == "auto") {
         c.chunk_size_auto = true;
       } else if (v.is_number_integer() && v.get<int64_t>() > 0 &&
                  v.get<int64_t>() <= Config::kMaxChunkElems) {
         c.default_chunk_size = v.get<int64_t>();
         c.chunk_size_auto = false;
       } else {
         r.error(v, absl::StrCat("a number of elements from 1 to ", Config::kMaxChunkElems,
                                 " (2^40), or \"auto\""));
       }
     },
     [](const Config& c) { return c.chunk_size_auto ? json("auto") : json(c.default_chunk_size); }},
    {"release_after_init", "true or false", "false",
     "PatrickStar's; other ranks' chunks are never held after initialization anyway", kIgnored,
     [](const json& v, const ValueReader& r, Config& c) { r.boolean(v, c.release_after_init); },
     [](const Config& c) { return json(c.release_after_init); }},
    {"use_cpu_embedding", "true or false", "false",
     "embedding parameters in chunks of their own that stay on the host", kUsed,
     [](const json& v, const ValueReader& r, Config& c) { r.boolean(v, c.use_cpu_embedding); },
     [](const Config& c) { return json(c.use_cpu_embedding); }},

    {"client.mem_tracer.warmup_gpu_chunk_mem_ratio", "a number in (0, 1]", "0.1",
     "device share for chunks in the warm-up", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.number(v, c.mem_tracer.warmup_gpu_chunk_mem_ratio, 0, 1, /*open_min=*/true);
     },
     [](const Config& c) { return json(c.mem_tracer.warmup_gpu_chunk_mem_ratio); }},
    {"client.mem_tracer.overall_gpu_mem_ratio", "a number in (0, 1]", "0.8",
     "device share the runtime plans with", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.number(v, c.mem_tracer.overall_gpu_mem_ratio, 0, 1, /*open_min=*/true);
     },
     [](const Config& c) { return json(c.mem_tracer.overall_gpu_mem_ratio); }},
    {"client.mem_tracer.overall_cpu_mem_ratio", "a number in (0, 1]", "0.8",
     "PatrickStar's; the host tier uses host_capacity_bytes as it is", kIgnored,
     [](const json& v, const ValueReader& r, Config& c) {
       r.number(v, c.mem_tracer.overall_cpu_mem_ratio, 0, 1, /*open_min=*/true);
     },
     [](const Config& c) { return json(c.mem_tracer.overall_cpu_mem_ratio); }},
    {"client.mem_tracer.margin_use_ratio", "a number in [0, 1]", "0.8",
     "share of the spare margin given to device Adam", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.number(v, c.mem_tracer.margin_use_ratio, 0, 1);
     },
     [](const Config& c) { return json(c.mem_tracer.margin_use_ratio); }},
    {"client.mem_tracer.use_async_mem_monitor", "true or false", "false",
     "PatrickStar's; peaks are measured exactly by the counting allocator", kIgnored,
     [](const json& v, const ValueReader& r, Config& c) {
       r.boolean(v, c.mem_tracer.use_async_mem_monitor);
     },
     [](const Config& c) { return json(c.mem_tracer.use_async_mem_monitor); }},
    {"client.mem_tracer.with_static_partition", "true or false", "false",
     "the same as client.scheduler.policy \"static\"", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.boolean(v, c.mem_tracer.with_static_partition);
     },
     [](const Config& c) { return json(c.mem_tracer.with_static_partition); }},
    {"client.mem_tracer.use_fake_dist", "anything", "",
     "PatrickStar's single-GPU imitation of many; multi-GPU is real here", kIgnored, nullptr,
     nullptr},

    {"client.device.type", "one of \"emulated\", \"cuda\"", "\"emulated\"",
     "where chunks live: the emulated device or GPU 0", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.choice(v, c.device.type,
                {{"emulated", DeviceType::kEmulated}, {"cuda", DeviceType::kCuda}});
     },
     [](const Config& c) { return json(std::string(to_string(c.device.type))); }},
    {"client.device.index", "a GPU index from 0, or \"auto\"", "\"auto\"",
     "the GPU on \"cuda\"; \"auto\": the process's local rank (one GPU per rank)", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       if (v.is_string() && absl::AsciiStrToLower(v.get<std::string>()) == "auto") {
         c.device.index = DeviceConfig::kLocalRankIndex;
       } else {
         r.integer(v, c.device.index, 0, 1023);
       }
     },
     [](const Config& c) {
       return c.device.index == DeviceConfig::kLocalRankIndex ? json("auto") : json(c.device.index);
     }},
    {"client.device.capacity_bytes", "a positive byte count, or \"auto\"", "\"auto\"",
     "the device's capacity; \"auto\": 4 GiB emulated, what GPU 0 has on \"cuda\"", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.byte_size_or_auto(v, c.device.capacity_bytes, DeviceConfig::kAutoCapacity);
     },
     [](const Config& c) {
       return c.device.capacity_bytes == DeviceConfig::kAutoCapacity
                  ? json("auto")
                  : json(c.device.capacity_bytes);
     }},
    {"client.device.host_capacity_bytes", "a byte count", "0", "the host's capacity; 0: unlimited",
     kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.byte_size(v, c.device.host_capacity_bytes);
     },
     [](const Config& c) { return json(c.device.host_capacity_bytes); }},

    {"client.scheduler.policy", "one of \"opt\", \"lru\", \"static\"", "\"opt\"",
     "which chunks leave the device first", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.choice(v, c.scheduler.policy,
                {{"opt", EvictionPolicy::kOpt},
                 {"lru", EvictionPolicy::kLru},
                 {"static", EvictionPolicy::kStatic}});
     },
     [](const Config& c) { return json(std::string(eviction_policy_name(c.scheduler.policy))); }},
    {"client.scheduler.prefetch_depth", "an integer from 0 to 64", "4",
     "moments ahead to prefetch; 0: off", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.integer(v, c.scheduler.prefetch_depth, 0, 64);
     },
     [](const Config& c) { return json(c.scheduler.prefetch_depth); }},
    {"client.scheduler.reserve_bytes", "a byte count", "0",
     "device bytes kept free at every moment", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.byte_size(v, c.scheduler.reserve_bytes);
     },
     [](const Config& c) { return json(c.scheduler.reserve_bytes); }},
    {"client.scheduler.async_moves", "true or false", "true",
     "chunk copies run while compute goes on", kUsed,
     [](const json& v, const ValueReader& r, Config& c) { r.boolean(v, c.scheduler.async_moves); },
     [](const Config& c) { return json(c.scheduler.async_moves); }},
    {"client.scheduler.copy_delay_max_us", "an integer from 0 to 1000000", "0",
     "testing: a seeded random delay before each emulated copy", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.integer(v, c.scheduler.copy_delay_max_us, 0, 1000000);
     },
     [](const Config& c) { return json(c.scheduler.copy_delay_max_us); }},
    {"client.scheduler.copy_delay_seed", "an integer from 0 to 2147483647", "0",
     "testing: the seed of those delays", kUsed,
     [](const json& v, const ValueReader& r, Config& c) {
       r.integer(v, c.scheduler.copy_delay_seed, 0, 2147483647);
     },
     [](const Config& c) { return json(c.scheduler.copy_delay_seed); }},
};

// The disk tier needs its folder; checked when the walk leaves offload_optimizer, so that the
// problem is listed right after the section's own (a folder that is not a string is both).
void check_disk_tier_folder(const Config& c, std::vector<std::string>& errors) {
  if (c.offload_optimizer.nvme && c.offload_optimizer.nvme_path.empty()) {
    errors.push_back(
        "$.zero_optimization.offload_optimizer.nvme_path: expected the folder of the disk tier "
        "(with \"device\": \"nvme\"), got nothing");
  }
}

constexpr ConfigSection kSections[] = {
    {"zero_optimization", /*open=*/true, /*null_is_value=*/true, nullptr},
    {"activation_checkpointing", /*open=*/true, /*null_is_value=*/true, nullptr},
    {"zero_optimization.offload_optimizer", /*open=*/true, /*null_is_value=*/false,
     check_disk_tier_folder},
};

}  // namespace

std::span<const ConfigKey> config_keys() {
  return kKeys;
}

const ConfigSection* find_section(std::string_view path) {
  for (const ConfigSection& section : kSections) {
    if (section.path == path) return &section;
  }
  return nullptr;
}

}  // namespace patrickstar::config_keys
