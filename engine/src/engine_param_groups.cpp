// EngineCore's optimizer parameter groups (param_groups.h): their options as the trainer reads and
// sets them between steps.
#include <cmath>
#include <optional>

#include <c10/util/Exception.h>

#include "checkpoint_index.h"
#include "engine_core.h"

namespace patrickstar {

using namespace engine_detail;  // NOLINT: this folder's private helpers

// Group 0's option, and the same option of every group that follows group 0 in it (one that did not
// set its own), take `value`.
void EngineCore::follow_group_zero(std::vector<AdamHyperparameters>& options,
                                   double AdamHyperparameters::*option, double value) const {
  for (size_t g = 0; g < options.size(); ++g) {
    if (g == 0 || groups_.follows_group_zero(g, option)) options[g].*option = value;
  }
}

void EngineCore::set_adam_hyperparameters(double beta1, double beta2, double eps,
                                          double weight_decay) {
  std::lock_guard<engine_detail::EntryGate> lock(entry_gate_);  // the read and the write
  std::vector<AdamHyperparameters> options = param_group_options();
  follow_group_zero(options, &AdamHyperparameters::beta1, beta1);
  follow_group_zero(options, &AdamHyperparameters::beta2, beta2);
  follow_group_zero(options, &AdamHyperparameters::eps, eps);
  follow_group_zero(options, &AdamHyperparameters::weight_decay, weight_decay);
  set_param_group_options(options);
}

std::vector<AdamHyperparameters> EngineCore::param_group_options() const {
  std::vector<AdamHyperparameters> options;
  const HybridAdam& adam = pipeline_->adam();
  for (size_t g = 0; g < groups_.count(); ++g) {
    const AdamOptions& o = adam.group_options(g);
    options.push_back({o.beta1(), o.beta2(), o.eps(), o.weight_decay(), o.lr()});
  }
  return options;
}

AdamHyperparameters EngineCore::adam_hyperparameters() const {
  const AdamOptions& o = pipeline_->adam().group_options(0);
  return {o.beta1(), o.beta2(), o.eps(), o.weight_decay(), o.lr()};
}

std::vector<ParamGroupInfo> EngineCore::param_groups() const {
  std::vector<ParamGroupInfo> groups;
  const HybridAdam& adam = pipeline_->adam();
  for (size_t g = 0; g < groups_.count(); ++g) {
    const AdamOptions& o = adam.group_options(g);
    ParamGroupInfo info{
        groups_.label(g), {o.beta1(), o.beta2(), o.eps(), o.weight_decay(), o.lr()}, {}};
    for (TensorId id : groups_.members(g)) info.names.push_back(params_[id].name);
    groups.push_back(std::move(info));
  }
  return groups;
}

std::vector<AdamOptions> EngineCore::checked_group_options(
    const std::vector<AdamHyperparameters>& options) const {
  TORCH_CHECK(options.size() == groups_.count(),
              "patrickstar: set_param_group_options: ", options.size(), " groups' options for the ",
              groups_.count(), " param groups");
  std::vector<AdamOptions> groups;
  for (size_t g = 0; g < options.size(); ++g) {
    const AdamHyperparameters& o = options[g];
    const std::string group = "param group " + std::to_string(g) + " (" + groups_.label(g) + ")";
    TORCH_CHECK(o.lr >= 0 && std::isfinite(o.lr), "patrickstar: ", group, ": lr ", o.lr,
                ": the learning rate must be finite and not negative");
    TORCH_CHECK(o.beta1 >= 0 && o.beta1 < 1, "patrickstar: ", group, ": beta1 ", o.beta1,
                " is outside [0, 1)");
    TORCH_CHECK(o.beta2 >= 0 && o.beta2 < 1, "patrickstar: ", group, ": beta2 ", o.beta2,
                " is outside [0, 1)");
    TORCH_CHECK(o.eps >= 0 && std::isfinite(o.eps), "patrickstar: ", group, ": eps ", o.eps,
                " must be finite and not negative");
    TORCH_CHECK(o.weight_decay >= 0 && std::isfinite(o.weight_decay), "patrickstar: ", group,
                ": weight_decay ", o.weight_decay, " must be finite and not negative");
    // bf16 moments cannot follow a beta too close to 1 (the config's own check).
    OptimizerConfig wanted = config_.optimizer;
    wanted.beta1 = o.beta1;
    wanted.beta2 = o.beta2;
    const std::string bf16_states = bf16_state_problem(wanted);
    TORCH_CHECK(bf16_states.empty(), "patrickstar: ", group, ": betas (", o.beta1, ", ", o.beta2,
                "): ", bf16_states);
    groups.push_back(AdamOptions(pipeline_->adam().options())
                         .lr(o.lr)
                         .beta1(o.beta1)
                         .beta2(o.beta2)
                         .eps(o.eps)
                         .weight_decay(o.weight_decay));
  }
  return groups;
}

void EngineCore::set_param_group_options(const std::vector<AdamHyperparameters>& options) {
  std::lock_guard<engine_detail::EntryGate> lock(entry_gate_);
  pipeline_->set_group_options(checked_group_options(options));
  groups_.note_options(options);
}

void EngineCore::describe_group_options(IndexTensor& entry, TensorId id) const {
  const AdamOptions& o = pipeline_->adam().group_options(static_cast<size_t>(groups_.group_of(id)));
  entry.options = IndexOptions{
      o.lr(),  o.beta1(),        o.beta2(),
      o.eps(), o.weight_decay(), groups_.label(static_cast<size_t>(groups_.group_of(id)))};
}

std::vector<AdamHyperparameters> EngineCore::checkpoint_group_options(
    const std::string& path, const std::vector<const IndexTensor*>& entries) const {
  std::vector<AdamHyperparameters> options = param_group_options();
  for (size_t g = 0; g < groups_.count(); ++g) {
    // Restored when the group was saved as it is now: the same label on exactly its tensors, with
    // one set of options.
    const std::vector<TensorId> members = groups_.members(g);
    std::optional<IndexOptions> saved;
    bool same = true;
    int64_t with_options = 0;
    for (TensorId id : members) {
      const std::optional<IndexOptions>& o = entries[static_cast<size_t>(id)]->options;
      if (!o) continue;  // written before param groups
      ++with_options;
      if (saved && !(*saved == *o)) same = false;
      if (!saved) saved = o;
    }
    if (with_options == 0) continue;  // the config's
    int64_t labelled = 0;
    for (const IndexTensor* t : entries)
      labelled += t->options && t->options->group == groups_.label(g);
    same = same && with_options == static_cast<int64_t>(members.size()) &&
           saved->group == groups_.label(g) && labelled == with_options;
    if (!same) {
      TORCH_WARN("patrickstar: load_checkpoint(\"", path, "\"): param group ", g, " (",
                 groups_.label(g),
                 ") is not the group the checkpoint saved (its tensors were saved "
                 "in other groups, or with different options); it keeps its options now");
      continue;
    }
    // Options this engine cannot follow (beta2 0.999 saved by a run with fp32 states, resumed
    // with bf16 ones) are not restored; the weights and states are.
    std::vector<AdamHyperparameters> restored = options;
    restored[g] = {saved->beta1, saved->beta2, saved->eps, saved->weight_decay, saved->lr};
    try {
      checked_group_options(restored);
      options = std::move(restored);
    } catch (const c10::Error& e) {
      TORCH_WARN("patrickstar: load_checkpoint(\"", path, "\"): param group ", g, " (",
                 groups_.label(g), ") keeps its options: the saved ones are refused here (",
                 e.what_without_backtrace(), ")");
    }
  }
  return options;
}

void EngineCore::set_lr(double lr) {
  TORCH_CHECK(lr >= 0 && std::isfinite(lr), "patrickstar: set_lr(", lr,
              "): the learning rate must be finite and not negative");
  std::lock_guard<engine_detail::EntryGate> lock(entry_gate_);  // the read and the write
  std::vector<AdamHyperparameters> options = param_group_options();
  follow_group_zero(options, &AdamHyperparameters::lr, lr);
  set_param_group_options(options);  // under the entry gate
}

double EngineCore::lr() const {
  return pipeline_->lr();
}

}  // namespace patrickstar
