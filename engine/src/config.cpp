#include "patrickstar/engine/config.h"

#include <cmath>
#include <fstream>
#include <initializer_list>
#include <set>
#include <sstream>
#include <string_view>
#include <vector>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "config_keys.h"

namespace patrickstar {
namespace {

using json = nlohmann::json;
using config_keys::ConfigKey;
using config_keys::ConfigSection;
using config_keys::ValueReader;

// The names of a dot-separated key path: "client.scheduler.policy" -> client, scheduler, policy.
std::vector<std::string_view> path_names(std::string_view path) {
  std::vector<std::string_view> names;
  for (size_t dot; (dot = path.find('.')) != std::string_view::npos; path.remove_prefix(dot + 1)) {
    names.push_back(path.substr(0, dot));
  }
  names.push_back(path);
  return names;
}

// One object of the document as the walk over the key table reads it: it remembers which keys the
// rows asked for, so that the others can be reported when the walk leaves the object.
class ObjectReader {
 public:
  ObjectReader(const json* object, std::string_view name, std::string path,
               const ConfigSection* section, std::vector<std::string>* errors)
      : object_(object), name_(name), path_(std::move(path)), section_(section), errors_(errors) {
    if (object_ != nullptr && !object_->is_object()) {
      if (!open()) ValueReader(path_, errors_).error(*object_, "an object");
      object_ = nullptr;
    }
  }

  std::string_view name() const { return name_; }
  std::string child_path(std::string_view key) const {
    return absl::StrCat(path_, ".", std::string(key));
  }

  // Marks `key` as known without reading it (keys accepted for compatibility).
  void accept(std::string_view key) { known_.emplace(key); }

  // Marks `key` as known; its value, or nullptr when it is absent (or null, unless the section
  // reads null as a value).
  const json* find(std::string_view key) {
    known_.emplace(key);
    if (object_ == nullptr) return nullptr;
    auto it = object_->find(std::string(key));
    if (it == object_->end()) return nullptr;
    if (it->is_null() && (section_ == nullptr || !section_->null_is_value)) return nullptr;
    return &*it;
  }

  ObjectReader child(std::string_view key) {
    std::string path = child_path(key);
    // The section's path below "$": the walk's own path without its leading "$.".
    const ConfigSection* section = config_keys::find_section(std::string_view(path).substr(2));
    return ObjectReader(find(key), key, std::move(path), section, errors_);
  }

  // Runs the section's check and reports the keys that no row asked for (none in an open
  // section). Call once, after every row of the object.
  void finish(const Config& config, std::vector<std::string>* unknown) {
    if (section_ != nullptr && section_->check != nullptr) section_->check(config, *errors_);
    if (object_ == nullptr || open()) return;
    for (const auto& [key, value] : object_->items()) {
      if (!known_.count(key)) {
        std::vector<std::string> known(known_.begin(), known_.end());
        unknown->push_back(absl::StrCat("unknown key ", child_path(key), " (known here: ",
                                        absl::StrJoin(known, ", "), ")"));
      }
    }
  }

 private:
  bool open() const { return section_ != nullptr && section_->open; }

  const json* object_;
  std::string_view name_;
  std::string path_;
  const ConfigSection* section_;
  std::vector<std::string>* errors_;
  std::set<std::string, std::less<>> known_;
};

// Reads every key of the table from `document` into `c`, in the table's order. The objects the
// current key lies in stay open, the document first; an object is finished (its unknown keys
// reported) as soon as the walk reaches a key outside it, which is why a section's keys are
// consecutive in the table.
void read_keys(const json& document, Config& c, std::vector<std::string>& errors,
               std::vector<std::string>& unknown) {
  std::vector<ObjectReader> open;
  open.emplace_back(&document, "$", "$", nullptr, &errors);
  for (const ConfigKey& key : config_keys::config_keys()) {
    const std::vector<std::string_view> names = path_names(key.path);
    const size_t depth = names.size() - 1;  // the objects above the key, below the document
    size_t shared = 0;
    while (shared < depth && shared + 1 < open.size() && open[shared + 1].name() == names[shared]) {
      ++shared;
    }
    for (; open.size() > shared + 1; open.pop_back()) open.back().finish(c, &unknown);
    while (open.size() < depth + 1) open.push_back(open.back().child(names[open.size() - 1]));
    ObjectReader& object = open.back();
    if (key.read == nullptr) {
      object.accept(names.back());
    } else if (const json* value = object.find(names.back())) {
      key.read(*value, ValueReader(object.child_path(names.back()), &errors), c);
    }
  }
  for (; !open.empty(); open.pop_back()) open.back().finish(c, &unknown);
}

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
std::string_view to_string(ActivationPolicy policy) {
  switch (policy) {
    case ActivationPolicy::kRecompute:
      return "recompute";
    case ActivationPolicy::kOffload:
      return "offload";
    case ActivationPolicy::kNone:
      return "none";
    case ActivationPolicy::kAuto:
      return "auto";
  }
  return "?";
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

namespace {

// The checks of keys that depend on each other, after the walk, in the order of their problems.

void check_one_precision(const Config& c, std::vector<std::string>& errors) {
  if (c.fp16.enabled && c.bf16) {
    errors.push_back("$.fp16.enabled and $.bf16.enabled: expected at most one, got both true");
  }
}

// with_static_partition is PatrickStar's spelling of the static policy: it sets the policy, and
// contradicts a policy the document names otherwise.
void apply_static_partition(const json& document, Config& c, std::vector<std::string>& errors) {
  if (!c.mem_tracer.with_static_partition || c.scheduler.policy == EvictionPolicy::kStatic) return;
  if (document.contains("client") && document["client"].contains("scheduler") &&
      document["client"]["scheduler"].contains("policy")) {
    errors.push_back(absl::StrCat(
        "$.client.mem_tracer.with_static_partition: true contradicts $.client.scheduler.policy \"",
        std::string(eviction_policy_name(c.scheduler.policy)), "\"; set one of them"));
  }
  c.scheduler.policy = EvictionPolicy::kStatic;
}

// zero_hpz_partition_size (DeepSpeed's spelling) beside shard_group_size: it may only agree (its 1,
// hpZ off, says nothing); a second value read and dropped would go unnoticed.
void check_shard_group_spellings(const json& document, std::vector<std::string>& errors) {
  if (!document.contains("zero_optimization") || !document["zero_optimization"].is_object()) return;
  const json& zero = document["zero_optimization"];
  if (!zero.contains("shard_group_size") || !zero.contains("zero_hpz_partition_size")) return;
  const json& hpz = zero["zero_hpz_partition_size"];
  if (hpz.is_number_integer() && hpz.get<int64_t>() == 1) return;
  if (hpz == zero["shard_group_size"]) return;
  errors.push_back(absl::StrCat("$.zero_optimization.zero_hpz_partition_size: ", hpz.dump(),
                                " contradicts $.zero_optimization.shard_group_size ",
                                zero["shard_group_size"].dump(),
                                " (the same setting in DeepSpeed's spelling); set one of them"));
}

void check_delayed_update(const Config& c, std::vector<std::string>& errors) {
  if (!c.delayed_update.enabled) return;
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

void check_bf16_states(const Config& c, std::vector<std::string>& errors) {
  if (std::string problem = bf16_state_problem(c.optimizer); !problem.empty()) {
    errors.push_back(std::move(problem));
  }
  if (std::string problem = param_group_problem(c.optimizer, /*values_read=*/true);
      !problem.empty()) {
    errors.push_back(std::move(problem));
  }
}

void check_overlap_step(const Config& c, std::vector<std::string>& errors) {
  if (c.overlap_step.mode == OverlapMode::kOn && c.offload_optimizer.nvme) {
    errors.push_back(
        "$.zero_optimization.overlap_step: true with the disk tier "
        "($.zero_optimization.offload_optimizer.device \"nvme\"): the overlapped step "
        "runs without a disk tier; set it to \"auto\" or false");
  }
}

void check_stream_states(const Config& c, std::vector<std::string>& errors) {
  if (!c.optimizer.stream_states) return;
  const std::string key = "$.optimizer.params.stream_states: true";
  if (!c.optimizer.use_hybrid_adam) {
    errors.push_back(key +
                     " with $.optimizer.params.use_hybrid_adam: false: the states stream "
                     "to hybrid Adam's device side, which is off");
  }
  if (c.scheduler.policy == EvictionPolicy::kStatic) {
    errors.push_back(key +
                     " with the static policy, which runs every Adam on the host (use "
                     "\"opt\" or \"lru\")");
  }
  if (c.offload_optimizer.nvme) {
    errors.push_back(key +
                     " with the disk tier ($.zero_optimization.offload_optimizer.device "
                     "\"nvme\"): the states stream between the host and the device, not the disk");
  }
  if (c.delayed_update.enabled && c.plan.mode != PlanMode::kAuto) {
    errors.push_back(key +
                     " with $.zero_optimization.delayed_param_update: true, which runs every "
                     "Adam on the host; set one of them (or \"plan\": \"auto\", which "
                     "chooses)");
  }
}

void check_copy_delay(const Config& c, std::vector<std::string>& errors) {
  if (c.device.type == DeviceType::kCuda && c.scheduler.copy_delay_max_us > 0) {
    errors.push_back(absl::StrCat(
        "$.client.scheduler.copy_delay_max_us: ", c.scheduler.copy_delay_max_us,
        " with $.client.device.type \"cuda\": injected copy delays test the emulated device's copy "
        "thread; CUDA copies run on a stream (set it to 0)"));
  }
}

}  // namespace

Config Config::from_json(const json& document) {
  Config c;
  std::vector<std::string> errors, unknown;
  read_keys(document, c, errors, unknown);
  check_one_precision(c, errors);
  apply_static_partition(document, c, errors);
  check_shard_group_spellings(document, errors);
  check_delayed_update(c, errors);
  check_bf16_states(c, errors);
  check_overlap_step(c, errors);
  check_stream_states(c, errors);
  check_copy_delay(c, errors);
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
  for (const ConfigKey& key : config_keys::config_keys()) {
    json value = key.write == nullptr ? json() : key.write(*this);
    if (value.is_null()) continue;  // a key to_json does not write, or not for this config
    json* at = &j;
    for (std::string_view name : path_names(key.path)) at = &(*at)[std::string(name)];
    *at = std::move(value);
  }
  return j;
}

}  // namespace patrickstar
