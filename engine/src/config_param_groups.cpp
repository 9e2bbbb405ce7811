// The param group keys' readers and writer (config_keys.h), and the check of the groups' values
// that a Config built in C++ gets too (param_group_problem, config.h).
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "config_keys.h"

namespace patrickstar {
namespace config_keys {
namespace {

using json = nlohmann::json;
constexpr double kUnbounded = std::numeric_limits<double>::max();

void read_param_group(const json& v, const ValueReader& r, const OptimizerConfig& optimizer,
                      ParamGroupConfig& group);

}  // namespace

// A list of name patterns: non-empty strings.
void read_patterns(const json& v, const ValueReader& r, std::vector<std::string>& out) {
  if (!v.is_array()) {
    r.error(v, "an array of name patterns (non-empty strings)");
    return;
  }
  std::vector<std::string> patterns;
  for (size_t i = 0; i < v.size(); ++i) {
    if (!v[i].is_string() || v[i].get<std::string>().empty()) {
      r.element(static_cast<int>(i)).error(v[i], "a non-empty string");
      return;
    }
    patterns.push_back(v[i].get<std::string>());
  }
  out = std::move(patterns);
}

void read_param_groups(const json& v, const ValueReader& r, OptimizerConfig& optimizer) {
  if (!v.is_array()) {
    r.error(v, "an array of param groups");
    return;
  }
  std::vector<ParamGroupConfig> groups(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    read_param_group(v[i], r.element(static_cast<int>(i)), optimizer, groups[i]);
  }
  optimizer.param_groups = std::move(groups);
}

json param_groups_json(const OptimizerConfig& optimizer) {
  if (optimizer.param_groups.empty()) return json();
  json groups = json::array();
  for (const ParamGroupConfig& g : optimizer.param_groups) {
    json group = {{"names", g.names}};  // (a C++ predicate has no JSON)
    if (g.lr) group["lr"] = *g.lr;
    if (g.beta1 || g.beta2) {
      group["betas"] =
          json::array({g.beta1.value_or(optimizer.beta1), g.beta2.value_or(optimizer.beta2)});
    }
    if (g.eps) group["eps"] = *g.eps;
    if (g.weight_decay) group["weight_decay"] = *g.weight_decay;
    groups.push_back(std::move(group));
  }
  return groups;
}

namespace {

void read_param_group(const json& v, const ValueReader& r, const OptimizerConfig& optimizer,
                      ParamGroupConfig& group) {
  if (!v.is_object()) {
    r.error(v,
            "an object {\"names\": [...], and any of \"lr\", \"betas\", \"eps\", "
            "\"weight_decay\"}");
    return;
  }
  for (const auto& [key, value] : v.items()) {
    const ValueReader reader = r.child(key);
    double d = 0;
    if (key == "names") {
      read_patterns(value, reader, group.names);
      if (group.names.empty() && value.is_array()) reader.error(value, "at least one pattern");
    } else if (key == "lr") {
      reader.number(value, d, 0, kUnbounded);
      group.lr = d;
    } else if (key == "eps") {
      reader.number(value, d, 0, kUnbounded, /*open_min=*/true);
      group.eps = d;
    } else if (key == "weight_decay") {
      reader.number(value, d, 0, kUnbounded);
      group.weight_decay = d;
    } else if (key == "betas") {
      double b1 = optimizer.beta1, b2 = optimizer.beta2;
      if (value.is_array() && value.size() == 2) {
        reader.element(0).number(value[0], b1, 0.0, 1.0);
        reader.element(1).number(value[1], b2, 0.0, 1.0);
        if (b1 == 1 || b2 == 1) reader.error(value, "two numbers in [0, 1)");
      } else {
        reader.error(value, "an array of two numbers in [0, 1)");
      }
      group.beta1 = b1;
      group.beta2 = b2;
    } else {
      reader.problem(absl::StrCat("unknown key ", reader.path(),
                                  " (known here: names, lr, betas, eps, weight_decay)"));
    }
  }
  if (!v.contains("names")) {
    r.problem(absl::StrCat(r.path(),
                           ": expected \"names\", the patterns of the parameters the "
                           "group takes, got none"));
  }
}

}  // namespace
}  // namespace config_keys

std::string param_group_problem(const OptimizerConfig& optimizer, bool values_read) {
  std::string problem;
  auto add = [&](const std::string& text) {
    absl::StrAppend(&problem, problem.empty() ? "" : "\n  ", text);
  };
  constexpr double kAny = std::numeric_limits<double>::infinity();
  auto empty_pattern = [](const std::vector<std::string>& names) {
    for (const std::string& n : names) {
      if (n.empty()) return true;
    }
    return false;
  };
  if (!values_read && empty_pattern(optimizer.no_decay)) {
    add("$.optimizer.params.no_decay: an empty pattern, which would take every parameter");
  }
  for (size_t g = 0; g < optimizer.param_groups.size(); ++g) {
    const ParamGroupConfig& group = optimizer.param_groups[g];
    const std::string at = absl::StrCat("$.optimizer.param_groups[", g, "]");
    // A Config built in C++ has not been through the JSON reader's checks: the same ones here.
    auto check = [&](const std::optional<double>& value, const char* name, double low, bool open,
                     double high) {
      if (value &&
          !(std::isfinite(*value) && (open ? *value > low : *value >= low) && *value < high)) {
        add(absl::StrCat(at, ".", name, ": ", *value, " is not a number in ", open ? "(" : "[", low,
                         ", ", high, ")"));
      }
    };
    if (!values_read) {
      check(group.lr, "lr", 0, false, kAny);
      check(group.beta1, "betas[0]", 0, false, 1.0);
      check(group.beta2, "betas[1]", 0, false, 1.0);
      check(group.eps, "eps", 0, true, kAny);
      check(group.weight_decay, "weight_decay", 0, false, kAny);
      if (group.names.empty() && !group.predicate) {
        add(absl::StrCat(at, ": neither names nor a predicate: the group could take no parameter"));
      }
      if (empty_pattern(group.names)) {
        add(absl::StrCat(at, ".names: an empty pattern, which would take every parameter"));
      }
    }
    if (!group.beta1 && !group.beta2) continue;  // the optimizer's own betas
    OptimizerConfig with = optimizer;
    with.beta1 = group.beta1.value_or(with.beta1);
    with.beta2 = group.beta2.value_or(with.beta2);
    if (with.beta1 >= 1.0 || with.beta2 >= 1.0) continue;  // out of range: said above
    if (std::string bf16 = bf16_state_problem(with); !bf16.empty())
      add(absl::StrCat(at, ": ", bf16));
  }
  return problem;
}

}  // namespace patrickstar
