#include "patrickstar/engine/config.h"

#include <cmath>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <set>
#include <sstream>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace patrickstar {
namespace {

using json = nlohmann::json;

std::string show(const json& value) {
  std::string text = value.dump();
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return text;
}

// Walks one JSON object, remembering which keys it read, collecting problems with their paths.
class ObjectReader {
 public:
  ObjectReader(const json* object, std::string path, std::vector<std::string>* errors,
               std::vector<std::string>* unknown)
      : object_(object), path_(std::move(path)), errors_(errors), unknown_(unknown) {
    if (object_ != nullptr && !object_->is_object()) {
      error(path_, *object_, "an object");
      object_ = nullptr;
    }
  }

  // Reports keys that no getter asked for. Call once, after all getters.
  void finish() {
    if (object_ == nullptr) return;
    for (const auto& [key, value] : object_->items()) {
      if (!known_.count(key)) {
        std::vector<std::string> known(known_.begin(), known_.end());
        unknown_->push_back(absl::StrCat("unknown key ", child_path(key), " (known here: ",
                                         absl::StrJoin(known, ", "), ")"));
      }
    }
  }

  // Marks `key` as known without reading it (keys accepted for compatibility).
  void accept(const std::string& key) { known_.insert(key); }

  const json* find(const std::string& key) {
    known_.insert(key);
    if (object_ == nullptr) return nullptr;
    auto it = object_->find(key);
    if (it == object_->end() || it->is_null()) return nullptr;
    return &*it;
  }

  ObjectReader child(const std::string& key) {
    return ObjectReader(find(key), child_path(key), errors_, unknown_);
  }

  void boolean(const std::string& key, bool& out) {
    if (const json* v = find(key)) {
      if (v->is_boolean()) {
        out = v->get<bool>();
      } else {
        error(child_path(key), *v, "true or false");
      }
    }
  }

  // A number in [min, max]; `open_min` excludes min itself.
  void number(const std::string& key, double& out, double min, double max, bool open_min = false) {
    if (const json* v = find(key)) read_number(*v, child_path(key), out, min, max, open_min);
  }

  void integer(const std::string& key, int& out, int min, int max) {
    if (const json* v = find(key)) {
      if (v->is_number_integer() || (v->is_number_float() && is_whole(v->get<double>()))) {
        const double d = v->get<double>();
        if (d >= min && d <= max) {
          out = static_cast<int>(d);
          return;
        }
      }
      error(child_path(key), *v, absl::StrCat("an integer from ", min, " to ", max));
    }
  }

  void byte_size(const std::string& key, int64_t& out) {
    if (const json* v = find(key)) read_byte_size(*v, child_path(key), out);
  }

  // A positive byte count, or the string "auto" (any case), read as `auto_value` (0 is refused:
  // it would read as "auto").
  void byte_size_or_auto(const std::string& key, int64_t& out, int64_t auto_value) {
    const json* v = find(key);
    if (v == nullptr) return;
    if (v->is_string() && absl::AsciiStrToLower(v->get<std::string>()) == "auto") {
      out = auto_value;
      return;
    }
    int64_t bytes = -1;
    read_byte_size(*v, child_path(key), bytes, ", or \"auto\"");
    if (bytes == 0) error(child_path(key), *v, "a positive byte count, or \"auto\"");
    if (bytes > 0) out = bytes;
  }

  template <typename Enum>
  void choice(const std::string& key, Enum& out,
              std::initializer_list<std::pair<const char*, Enum>> options) {
    if (const json* v = find(key)) {
      if (v->is_string()) {
        const std::string text = absl::AsciiStrToLower(v->get<std::string>());
        for (const auto& [name, value] : options) {
          if (text == absl::AsciiStrToLower(name)) {
            out = value;
            return;
          }
        }
      }
      std::vector<std::string> names;
      for (const auto& option : options) names.push_back(absl::StrCat("\"", option.first, "\""));
      error(child_path(key), *v, absl::StrCat("one of ", absl::StrJoin(names, ", ")));
    }
  }

  std::string child_path(const std::string& key) const { return absl::StrCat(path_, ".", key); }

  void error(const std::string& path, const json& value, const std::string& expected) {
    errors_->push_back(absl::StrCat(path, ": expected ", expected, ", got ", show(value)));
  }

  void read_number(const json& v, const std::string& path, double& out, double min, double max,
                   bool open_min) {
    if (v.is_number()) {
      const double d = v.get<double>();
      if (std::isfinite(d) && (open_min ? d > min : d >= min) && d <= max) {
        out = d;
        return;
      }
    }
    const std::string range = max == std::numeric_limits<double>::max()
                                  ? absl::StrCat(open_min ? "> " : ">= ", min)
                                  : absl::StrCat("in ", open_min ? "(" : "[", min, ", ", max, "]");
    error(path, v, absl::StrCat("a number ", range));
  }

  void read_byte_size(const json& v, const std::string& path, int64_t& out,
                      const char* alternative = "") {
    const bool fits = v.is_number_unsigned()
                          ? v.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX)
                          : v.is_number_integer() && v.get<int64_t>() >= 0;
    if (fits) {
      out = v.get<int64_t>();
      return;
    }
    if (v.is_string()) {
      try {
        out = parse_byte_size(v.get<std::string>(), path);
        return;
      } catch (const c10::Error&) {
      }
    }
    error(path, v,
          absl::StrCat("a byte count: a non-negative integer or a string such as \"2GiB\"",
                       alternative));
  }

  static bool is_whole(double d) { return std::isfinite(d) && d == std::floor(d); }

 private:
  const json* object_;
  std::string path_;
  std::vector<std::string>* errors_;
  std::vector<std::string>* unknown_;
  std::set<std::string> known_;
};

constexpr double kMax = std::numeric_limits<double>::max();

}  // namespace

std::string_view to_string(OptimizerType type) {
  return type == OptimizerType::kAdam ? "Adam" : "AdamW";
}
std::string_view to_string(Precision precision) {
  switch (precision) {
    case Precision::kFp32: return "fp32";
    case Precision::kBf16: return "bf16";
    case Precision::kFp16: return "fp16";
  }
  return "?";
}
std::string_view to_string(DeviceType type) {
  return type == DeviceType::kEmulated ? "emulated" : "cuda";
}
std::string_view to_string(StateDtype dtype) {
  return dtype == StateDtype::kFp32 ? "fp32" : "bf16";
}

std::string bf16_state_problem(const OptimizerConfig& optimizer) {
  if (optimizer.state_dtype != StateDtype::kBf16) return "";
  // Rounded to nearest, a bf16 moment moves only when a step changes it by more than half a bf16
  // step below or above it: 2^-9 to 2^-8 of its value. A step moves it by (1 - beta) of the way
  // to the new gradient term at most, so with 1 - beta <= 2^-8 it may never decay (with beta2
  // 0.999 the variance would stick at its largest value, silently).
  std::string problem;
  for (const auto& [name, beta] : {std::pair<const char*, double>{"beta1", optimizer.beta1},
                                   std::pair<const char*, double>{"beta2", optimizer.beta2}}) {
    if (1.0 - beta > kBf16StateMinDecay) continue;
    absl::StrAppend(&problem, problem.empty() ? "" : "\n  ", "$.optimizer.params.betas: ", name,
                    " ", beta,
                    " with $.optimizer.params.state_dtype \"bf16\": a moment stored in bf16 "
                    "(rounded to nearest) moves only when a step changes it by more than half a "
                    "bf16 step, 2^-9 to 2^-8 of its value, and with this beta a step changes it by "
                    "at most ",
                    1.0 - beta,
                    " of it: it could never decay. Use betas below 0.99609375 (1 - 2^-8; e.g. "
                    "[0.9, 0.95]) or \"state_dtype\": \"fp32\"");
  }
  return problem;
}

int64_t parse_byte_size(std::string_view text, std::string_view what) {
  // Debian's Abseil has its own string_view type, not std::string_view.
  std::string s(absl::StripAsciiWhitespace(absl::string_view(text.data(), text.size())));
  size_t unit_at = s.size();
  while (unit_at > 0 && std::isalpha(static_cast<unsigned char>(s[unit_at - 1]))) --unit_at;
  const std::string number(absl::StripAsciiWhitespace(s.substr(0, unit_at)));
  const std::string unit = absl::AsciiStrToLower(s.substr(unit_at));
  double value = 0;
  const bool parsed = !number.empty() && absl::SimpleAtod(number, &value);
  double scale = 0;
  if (unit.empty() || unit == "b") scale = 1;
  else if (unit == "kb") scale = 1e3;
  else if (unit == "mb") scale = 1e6;
  else if (unit == "gb") scale = 1e9;
  else if (unit == "tb") scale = 1e12;
  else if (unit == "kib" || unit == "k") scale = 1024.0;
  else if (unit == "mib" || unit == "m") scale = 1024.0 * 1024;
  else if (unit == "gib" || unit == "g") scale = 1024.0 * 1024 * 1024;
  else if (unit == "tib" || unit == "t") scale = 1024.0 * 1024 * 1024 * 1024;
  const double bytes = value * scale;
  TORCH_CHECK(parsed && scale > 0 && std::isfinite(bytes) && bytes >= 0 && bytes < 9.2e18 &&
                  bytes == std::floor(bytes),
              what, ": cannot read \"", std::string(text),
              "\" as a byte size; write a whole number of bytes or a number with a unit, e.g. "
              "\"2GiB\", \"512MiB\", \"1.5GB\"");
  return static_cast<int64_t>(bytes);
}

Precision Config::precision() const {
  if (fp16.enabled) return Precision::kFp16;
  if (bf16) return Precision::kBf16;
  return Precision::kFp32;
}

Config Config::from_json(const json& document) {
  Config c;
  std::vector<std::string> errors, unknown;
  ObjectReader root(&document, "$", &errors, &unknown);

  root.boolean("strict", c.strict);
  // DeepSpeed keys that describe the training loop, which the user's own loop owns.
  for (const char* key : {"train_batch_size", "train_micro_batch_size_per_gpu", "steps_per_print",
                          "wall_clock_breakdown"}) {
    root.accept(key);
  }
  // ZeRO: only offload_optimizer's "device" and "nvme_path" are patrickstar's to read; every
  // other key (stage, buckets, offload_param, pin_memory, ..., and DeepSpeed's old boolean form)
  // describes what patrickstar always does, or DeepSpeed's own machinery: accepted.
  if (const json* zero = root.find("zero_optimization"); zero != nullptr && zero->is_object()) {
    if (const auto overlap = zero->find("overlap_step"); overlap != zero->end()) {
      if (overlap->is_boolean()) {
        c.overlap_step.mode = overlap->get<bool>() ? OverlapMode::kOn : OverlapMode::kOff;
      } else if (overlap->is_string() && overlap->get<std::string>() == "auto") {
        c.overlap_step.mode = OverlapMode::kAuto;
      } else {
        root.error("$.zero_optimization.overlap_step", *overlap, "\"auto\", true or false");
      }
    }
    if (const auto bytes = zero->find("overlap_step_max_bytes"); bytes != zero->end()) {
      root.read_byte_size(*bytes, "$.zero_optimization.overlap_step_max_bytes",
                          c.overlap_step.max_bytes);
    }
    if (const auto frozen = zero->find("frozen_parameters"); frozen != zero->end()) {
      const std::string text = frozen->is_string() ? frozen->get<std::string>() : "";
      if (text == "lean") {
        c.frozen_parameters = FrozenParameters::kLean;
      } else if (text == "full_state") {
        c.frozen_parameters = FrozenParameters::kFullState;
      } else {
        root.error("$.zero_optimization.frozen_parameters", *frozen, "\"lean\" or \"full_state\"");
      }
    }
    if (const auto delayed = zero->find("delayed_param_update"); delayed != zero->end()) {
      if (delayed->is_boolean()) {
        c.delayed_update.enabled = delayed->get<bool>();
      } else {
        root.error("$.zero_optimization.delayed_param_update", *delayed, "true or false");
      }
    }
    if (const auto warmup = zero->find("delayed_param_update_warmup_steps");
        warmup != zero->end()) {
      if (warmup->is_number_integer() && warmup->get<int64_t>() >= 0) {
        c.delayed_update.warmup_steps = warmup->get<int64_t>();
      } else {
        root.error("$.zero_optimization.delayed_param_update_warmup_steps", *warmup,
                   "a whole number of steps, 0 or more");
      }
    }
    const auto offload = zero->find("offload_optimizer");
    if (offload != zero->end() && offload->is_object()) {
      const std::string path = "$.zero_optimization.offload_optimizer";
      if (const auto device = offload->find("device");
          device != offload->end() && !device->is_null()) {
        const std::string text =
            device->is_string() ? absl::AsciiStrToLower(device->get<std::string>()) : "";
        if (text == "nvme") {
          c.offload_optimizer.nvme = true;
        } else if (text != "cpu" && text != "none") {
          root.error(path + ".device", *device, "one of \"none\", \"cpu\", \"nvme\"");
        }
      }
      if (const auto p = offload->find("nvme_path"); p != offload->end() && !p->is_null()) {
        if (p->is_string()) {
          c.offload_optimizer.nvme_path = p->get<std::string>();
        } else if (c.offload_optimizer.nvme) {
          root.error(path + ".nvme_path", *p, "the path of a folder");
        }
      }
      if (c.offload_optimizer.nvme && c.offload_optimizer.nvme_path.empty()) {
        errors.push_back(path + ".nvme_path: expected the folder of the disk tier (with "
                         "\"device\": \"nvme\"), got nothing");
      }
    }
  }
  {
    ObjectReader opt = root.child("optimizer");
    opt.choice("type", c.optimizer.type,
               {{"Adam", OptimizerType::kAdam}, {"AdamW", OptimizerType::kAdamW}});
    ObjectReader params = opt.child("params");
    params.number("lr", c.optimizer.lr, 0, kMax);
    if (const json* betas = params.find("betas")) {
      const std::string path = params.child_path("betas");
      if (betas->is_array() && betas->size() == 2) {
        params.read_number((*betas)[0], path + "[0]", c.optimizer.beta1, 0.0, 1.0, false);
        params.read_number((*betas)[1], path + "[1]", c.optimizer.beta2, 0.0, 1.0, false);
        if (c.optimizer.beta1 == 1 || c.optimizer.beta2 == 1) {
          params.error(path, *betas, "two numbers in [0, 1)");
        }
      } else {
        params.error(path, *betas, "an array of two numbers in [0, 1)");
      }
    }
    params.number("eps", c.optimizer.eps, 0, kMax, /*open_min=*/true);
    params.number("weight_decay", c.optimizer.weight_decay, 0, kMax);
    params.boolean("use_hybrid_adam", c.optimizer.use_hybrid_adam);
    params.choice("state_dtype", c.optimizer.state_dtype,
                  {{"fp32", StateDtype::kFp32}, {"bf16", StateDtype::kBf16}});
    params.finish();
    opt.finish();
  }
  {
    ObjectReader fp16 = root.child("fp16");
    fp16.boolean("enabled", c.fp16.enabled);
    fp16.number("loss_scale", c.fp16.loss_scale, 0, kMax);
    fp16.integer("initial_scale_power", c.fp16.initial_scale_power, 0, 126);
    fp16.integer("loss_scale_window", c.fp16.loss_scale_window, 1, std::numeric_limits<int>::max());
    fp16.integer("hysteresis", c.fp16.hysteresis, 1, std::numeric_limits<int>::max());
    fp16.number("min_loss_scale", c.fp16.min_loss_scale, 0, kMax, /*open_min=*/true);
    fp16.finish();
  }
  {
    ObjectReader bf16 = root.child("bf16");
    bf16.boolean("enabled", c.bf16);
    bf16.finish();
  }
  root.number("gradient_clipping", c.gradient_clipping, 0, kMax);
  root.integer("gradient_accumulation_steps", c.gradient_accumulation_steps, 1,
               std::numeric_limits<int>::max());
  if (const json* size = root.find("default_chunk_size")) {
    if (size->is_string() && absl::AsciiStrToLower(size->get<std::string>()) == "auto") {
      c.chunk_size_auto = true;
    } else if (size->is_number_integer() && size->get<int64_t>() > 0 &&
               size->get<int64_t>() <= Config::kMaxChunkElems) {
      c.default_chunk_size = size->get<int64_t>();
      c.chunk_size_auto = false;
    } else {
      root.error("$.default_chunk_size", *size,
                 absl::StrCat("a number of elements from 1 to ", Config::kMaxChunkElems,
                              " (2^40), or \"auto\""));
    }
  }
  root.boolean("release_after_init", c.release_after_init);
  root.boolean("use_cpu_embedding", c.use_cpu_embedding);
  {
    ObjectReader client = root.child("client");
    ObjectReader tracer = client.child("mem_tracer");
    tracer.number("warmup_gpu_chunk_mem_ratio", c.mem_tracer.warmup_gpu_chunk_mem_ratio, 0, 1, true);
    tracer.number("overall_gpu_mem_ratio", c.mem_tracer.overall_gpu_mem_ratio, 0, 1, true);
    tracer.number("overall_cpu_mem_ratio", c.mem_tracer.overall_cpu_mem_ratio, 0, 1, true);
    tracer.number("margin_use_ratio", c.mem_tracer.margin_use_ratio, 0, 1);
    tracer.boolean("use_async_mem_monitor", c.mem_tracer.use_async_mem_monitor);
    tracer.boolean("with_static_partition", c.mem_tracer.with_static_partition);
    tracer.accept("use_fake_dist");  // a single-GPU imitation of many; multi-GPU is real here
    tracer.finish();

    ObjectReader device = client.child("device");
    device.choice("type", c.device.type,
                  {{"emulated", DeviceType::kEmulated}, {"cuda", DeviceType::kCuda}});
    device.byte_size_or_auto("capacity_bytes", c.device.capacity_bytes,
                             DeviceConfig::kAutoCapacity);
    device.byte_size("host_capacity_bytes", c.device.host_capacity_bytes);
    device.finish();

    ObjectReader scheduler = client.child("scheduler");
    scheduler.choice("policy", c.scheduler.policy,
                     {{"opt", EvictionPolicy::kOpt},
                      {"lru", EvictionPolicy::kLru},
                      {"static", EvictionPolicy::kStatic}});
    scheduler.integer("prefetch_depth", c.scheduler.prefetch_depth, 0, 64);
    scheduler.byte_size("reserve_bytes", c.scheduler.reserve_bytes);
    scheduler.boolean("async_moves", c.scheduler.async_moves);
    scheduler.integer("copy_delay_max_us", c.scheduler.copy_delay_max_us, 0, 1000000);
    scheduler.integer("copy_delay_seed", c.scheduler.copy_delay_seed, 0, 2147483647);
    scheduler.finish();
    client.finish();
  }
  root.finish();

  if (c.fp16.enabled && c.bf16) {
    errors.push_back("$.fp16.enabled and $.bf16.enabled: expected at most one, got both true");
  }
  if (c.mem_tracer.with_static_partition && c.scheduler.policy != EvictionPolicy::kStatic) {
    if (document.contains("client") && document["client"].contains("scheduler") &&
        document["client"]["scheduler"].contains("policy")) {
      errors.push_back(absl::StrCat(
          "$.client.mem_tracer.with_static_partition: true contradicts $.client.scheduler.policy \"",
          std::string(eviction_policy_name(c.scheduler.policy)), "\"; set one of them"));
    }
    c.scheduler.policy = EvictionPolicy::kStatic;
  }
  if (c.delayed_update.enabled) {
    const std::string key = "$.zero_optimization.delayed_param_update: true";
    if (c.fp16.enabled) {
      errors.push_back(key +
                       " with $.fp16.enabled: fp16's loss scale would be decided a step "
                       "late (the delayed update runs in fp32 or bf16)");
    }
    if (c.offload_optimizer.nvme) {
      errors.push_back(key +
                       " with the disk tier ($.zero_optimization.offload_optimizer.device "
                       "\"nvme\"): the delayed update keeps every optimizer state in memory");
    }
    if (c.overlap_step.mode == OverlapMode::kOn) {
      errors.push_back(key +
                       " with $.zero_optimization.overlap_step: true: the update runs during "
                       "the next iteration instead of in backward; set one of them");
    }
  }
  if (std::string problem = bf16_state_problem(c.optimizer); !problem.empty()) {
    errors.push_back(std::move(problem));
  }
  if (c.overlap_step.mode == OverlapMode::kOn && c.offload_optimizer.nvme) {
    errors.push_back(
        "$.zero_optimization.overlap_step: true with the disk tier "
        "($.zero_optimization.offload_optimizer.device \"nvme\"): the overlapped step "
        "runs without a disk tier; set it to \"auto\" or false");
  }
  if (c.device.type == DeviceType::kCuda && c.scheduler.copy_delay_max_us > 0) {
    errors.push_back(absl::StrCat(
        "$.client.scheduler.copy_delay_max_us: ", c.scheduler.copy_delay_max_us,
        " with $.client.device.type \"cuda\": injected copy delays test the emulated device's copy "
        "thread; CUDA copies run on a stream (set it to 0)"));
  }
  if (c.strict && !unknown.empty()) errors.insert(errors.end(), unknown.begin(), unknown.end());
  TORCH_CHECK(errors.empty(), "invalid patrickstar config (", errors.size(), " problem",
              errors.size() == 1 ? "" : "s", "):\n  ", absl::StrJoin(errors, "\n  "));
  c.warnings = std::move(unknown);
  return c;
}

Config Config::from_string(std::string_view text) {
  json document;
  try {
    document = json::parse(text);
  } catch (const json::exception& e) {  // a syntax error, or a number out of range (out_of_range)
    TORCH_CHECK(false, "invalid patrickstar config: not JSON: ", e.what());
  }
  return from_json(document);
}

Config Config::from_file(const std::string& path) {
  std::ifstream in(path);
  TORCH_CHECK(in.good(), "patrickstar config: cannot open \"", path, "\"");
  std::stringstream text;
  text << in.rdbuf();
  try {
    return from_string(text.str());
  } catch (c10::Error& e) {
    e.add_context(absl::StrCat("while reading ", path));
    throw;
  }
}

json Config::to_json() const {
  json j;
  j["strict"] = strict;
  j["optimizer"] = {{"type", std::string(to_string(optimizer.type))},
                    {"params",
                     {{"lr", optimizer.lr},
                      {"betas", {optimizer.beta1, optimizer.beta2}},
                      {"eps", optimizer.eps},
                      {"weight_decay", optimizer.weight_decay},
                      {"use_hybrid_adam", optimizer.use_hybrid_adam},
                      {"state_dtype", std::string(to_string(optimizer.state_dtype))}}}};
  j["fp16"] = {{"enabled", fp16.enabled},
               {"loss_scale", fp16.loss_scale},
               {"initial_scale_power", fp16.initial_scale_power},
               {"loss_scale_window", fp16.loss_scale_window},
               {"hysteresis", fp16.hysteresis},
               {"min_loss_scale", fp16.min_loss_scale}};
  j["bf16"] = {{"enabled", bf16}};
  j["gradient_clipping"] = gradient_clipping;
  j["gradient_accumulation_steps"] = gradient_accumulation_steps;
  if (chunk_size_auto) {
    j["default_chunk_size"] = "auto";
  } else {
    j["default_chunk_size"] = default_chunk_size;
  }
  j["zero_optimization"]["offload_optimizer"] = {
      {"device", offload_optimizer.nvme ? "nvme" : "none"}};
  if (!offload_optimizer.nvme_path.empty()) {
    j["zero_optimization"]["offload_optimizer"]["nvme_path"] = offload_optimizer.nvme_path;
  }
  j["zero_optimization"]["overlap_step"] =
      overlap_step.mode == OverlapMode::kAuto
          ? nlohmann::json("auto")
          : nlohmann::json(overlap_step.mode == OverlapMode::kOn);
  j["zero_optimization"]["overlap_step_max_bytes"] = overlap_step.max_bytes;
  j["zero_optimization"]["frozen_parameters"] =
      frozen_parameters == FrozenParameters::kLean ? "lean" : "full_state";
  j["zero_optimization"]["delayed_param_update"] = delayed_update.enabled;
  j["zero_optimization"]["delayed_param_update_warmup_steps"] = delayed_update.warmup_steps;
  j["release_after_init"] = release_after_init;
  j["use_cpu_embedding"] = use_cpu_embedding;
  j["client"]["mem_tracer"] = {{"warmup_gpu_chunk_mem_ratio", mem_tracer.warmup_gpu_chunk_mem_ratio},
                               {"overall_gpu_mem_ratio", mem_tracer.overall_gpu_mem_ratio},
                               {"overall_cpu_mem_ratio", mem_tracer.overall_cpu_mem_ratio},
                               {"margin_use_ratio", mem_tracer.margin_use_ratio},
                               {"use_async_mem_monitor", mem_tracer.use_async_mem_monitor},
                               {"with_static_partition", mem_tracer.with_static_partition}};
  j["client"]["device"] = {{"type", std::string(to_string(device.type))},
                           {"capacity_bytes", device.capacity_bytes == DeviceConfig::kAutoCapacity
                                                  ? nlohmann::json("auto")
                                                  : nlohmann::json(device.capacity_bytes)},
                           {"host_capacity_bytes", device.host_capacity_bytes}};
  j["client"]["scheduler"] = {{"policy", std::string(eviction_policy_name(scheduler.policy))},
                              {"prefetch_depth", scheduler.prefetch_depth},
                              {"reserve_bytes", scheduler.reserve_bytes},
                              {"async_moves", scheduler.async_moves},
                              {"copy_delay_max_us", scheduler.copy_delay_max_us},
                              {"copy_delay_seed", scheduler.copy_delay_seed}};
  return j;
}

}  // namespace patrickstar
