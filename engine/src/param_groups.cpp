#include "param_groups.h"

#include <algorithm>
#include <cctype>
#include <unordered_map>

#include <c10/util/Exception.h>

namespace patrickstar::engine_detail {
namespace {

std::string lower(std::string_view text) {
  std::string out(text);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "\"" : ", \"") + n + "\"";
  return "[" + out + "]";
}

}  // namespace

void ParamGroups::assign(const OptimizerConfig& optimizer, const torch::nn::Module& model,
                         const std::vector<std::pair<std::string, at::Tensor>>& params) {
  // Each parameter's module type: the first module that owns it (a tied one: where it is first).
  std::unordered_map<const c10::TensorImpl*, std::string> type_of;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    for (const at::Tensor& t : item.value()->parameters(/*recurse=*/false)) {
      type_of.emplace(t.unsafeGetTensorImpl(), item.value()->name());
    }
  }
  struct Group {
    std::string label;
    const std::vector<std::string>* names;
    const std::function<bool(const ParamInfo&)>* predicate;
  };
  std::vector<Group> configured;
  for (size_t g = 0; g < optimizer.param_groups.size(); ++g) {
    configured.push_back({"param_groups[" + std::to_string(g) + "]",
                          &optimizer.param_groups[g].names, &optimizer.param_groups[g].predicate});
  }
  if (!optimizer.no_decay.empty()) configured.push_back({"no_decay", &optimizer.no_decay, nullptr});

  std::vector<int32_t> group_of(params.size(), 0);
  std::vector<int64_t> taken(configured.size() + 1, 0);
  for (size_t id = 0; id < params.size(); ++id) {
    const auto& [name, tensor] = params[id];
    const std::string& type = type_of[tensor.unsafeGetTensorImpl()];
    const ParamInfo info{name, type, tensor.dim()};
    for (size_t g = 0; g < configured.size(); ++g) {
      const Group& group = configured[g];
      const bool by_name =
          std::any_of(group.names->begin(), group.names->end(),
                      [&](const std::string& p) { return pattern_takes_parameter(p, name, type); });
      if (by_name || (group.predicate != nullptr && *group.predicate && (*group.predicate)(info))) {
        group_of[id] = static_cast<int32_t>(g + 1);
        break;
      }
    }
    ++taken[static_cast<size_t>(group_of[id])];
  }
  for (size_t g = 0; g < configured.size(); ++g) {
    TORCH_CHECK(
        taken[g + 1] > 0, "patrickstar: optimizer.", configured[g].label,
        configured[g].names->empty() ? std::string(" (by its predicate)")
                                     : " with names " + joined(*configured[g].names),
        " takes no parameter of the model (a pattern takes a parameter whose name, or whose "
        "module's type name, contains it, ignoring case; an earlier group takes a parameter "
        "first)");
  }
  group_of_ = std::move(group_of);
  labels_ = {"default"};
  for (const Group& group : configured) labels_.push_back(group.label);
  own_.assign(labels_.size(), {});
  for (size_t g = 0; g < optimizer.param_groups.size(); ++g) {
    const ParamGroupConfig& c = optimizer.param_groups[g];
    std::vector<Option>& own = own_[g + 1];
    if (c.lr) own.push_back(&AdamHyperparameters::lr);
    if (c.beta1) own.push_back(&AdamHyperparameters::beta1);
    if (c.beta2) own.push_back(&AdamHyperparameters::beta2);
    if (c.eps) own.push_back(&AdamHyperparameters::eps);
    if (c.weight_decay) own.push_back(&AdamHyperparameters::weight_decay);
  }
  if (!optimizer.no_decay.empty()) own_.back() = {&AdamHyperparameters::weight_decay};
}

bool ParamGroups::follows_group_zero(size_t group, Option option) const {
  if (group == 0) return false;
  const std::vector<Option>& own = own_[group];
  return std::find(own.begin(), own.end(), option) == own.end();
}

void ParamGroups::note_options(const std::vector<AdamHyperparameters>& options) {
  for (size_t g = 1; g < options.size() && g < own_.size(); ++g) {
    for (Option option :
         {&AdamHyperparameters::lr, &AdamHyperparameters::beta1, &AdamHyperparameters::beta2,
          &AdamHyperparameters::eps, &AdamHyperparameters::weight_decay}) {
      if (options[g].*option != options[0].*option && follows_group_zero(g, option)) {
        own_[g].push_back(option);
      }
    }
  }
}

std::vector<TensorId> ParamGroups::members(size_t group) const {
  std::vector<TensorId> ids;
  for (size_t id = 0; id < group_of_.size(); ++id) {
    if (static_cast<size_t>(group_of_[id]) == group) ids.push_back(static_cast<TensorId>(id));
  }
  return ids;
}

std::vector<AdamOptions> ParamGroups::initial_options(const OptimizerConfig& optimizer,
                                                      const AdamOptions& base) const {
  std::vector<AdamOptions> options = {base};
  for (const ParamGroupConfig& g : optimizer.param_groups) {
    AdamOptions o = base;
    if (g.lr) o.lr(*g.lr);
    if (g.beta1) o.beta1(*g.beta1);
    if (g.beta2) o.beta2(*g.beta2);
    if (g.eps) o.eps(*g.eps);
    if (g.weight_decay) o.weight_decay(*g.weight_decay);
    options.push_back(o);
  }
  if (!optimizer.no_decay.empty()) options.push_back(AdamOptions(base).weight_decay(0.0));
  return options;
}

}  // namespace patrickstar::engine_detail

namespace patrickstar {

bool pattern_takes_parameter(std::string_view pattern, std::string_view name,
                             std::string_view module_type) {
  const std::string p = engine_detail::lower(pattern);
  return engine_detail::lower(name).find(p) != std::string::npos ||
         engine_detail::lower(module_type).find(p) != std::string::npos;
}

}  // namespace patrickstar
