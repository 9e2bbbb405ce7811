// Private to engine/src: the optimizer's parameter groups ("optimizer.param_groups" and
// "optimizer.params.no_decay", or OptimizerConfig's in C++), as torch::optim's: which group each
// registered parameter is in, and what each group is called and holds. The step runs a tensor's
// Adam update with its group's options; those options live in HybridAdam (set from initial_options
// here, changed by the trainer between steps).
//
// Invariants: every registered tensor is in exactly one group; group 0 always exists (the
// parameters no configured group takes, with the optimizer's options); every configured group takes
// at least one parameter (assign refuses a group whose patterns and predicate take nothing: a typo
// would otherwise decay what was meant not to be).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "patrickstar/chunk/types.h"
#include "patrickstar/engine/config.h"
#include "patrickstar/engine/engine.h"
#include "patrickstar/optimizer/hybrid_adam.h"

namespace patrickstar::engine_detail {

class ParamGroups {
 public:
  // Gives each of `params` (the registered parameters by TensorId: name and tensor) its group, per
  // `optimizer`; `model` tells each parameter's module type. Throws c10::Error, changing nothing,
  // when a configured group takes no parameter.
  void assign(const OptimizerConfig& optimizer, const torch::nn::Module& model,
              const std::vector<std::pair<std::string, at::Tensor>>& params);

  size_t count() const { return labels_.size(); }
  int32_t group_of(TensorId id) const { return group_of_[static_cast<size_t>(id)]; }
  // "default", "param_groups[0]", ..., "no_decay".
  const std::string& label(size_t group) const { return labels_[group]; }
  // The tensors of group `group`, in registration order.
  std::vector<TensorId> members(size_t group) const;
  // Each group's options as the config sets them, on top of `base` (the optimizer's).
  std::vector<AdamOptions> initial_options(const OptimizerConfig& optimizer,
                                           const AdamOptions& base) const;

  // Which options a group holds of its own (the config set them, or a trainer gave it a value
  // other than group 0's); the others follow group 0 in Engine::set_lr and
  // set_adam_hyperparameters. Group 0 follows nothing.
  using Option = double AdamHyperparameters::*;
  bool follows_group_zero(size_t group, Option option) const;
  // Options set for every group (in order): a group > 0 given a value other than group 0's holds
  // that option of its own from now on.
  void note_options(const std::vector<AdamHyperparameters>& options);

 private:
  std::vector<int32_t> group_of_;  // by TensorId
  std::vector<std::string> labels_;
  std::vector<std::vector<Option>> own_;  // by group
};

}  // namespace patrickstar::engine_detail
