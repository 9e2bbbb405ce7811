// Shared by the param group tests (one process and data parallel): the recipe of almost every LLM
// trainer, AdamW with weight decay on the matrices and none on biases, norms and embeddings, each
// group with its own schedule; the engine's config for it and torch::optim::AdamW's reference
// groups, built from the modules' types (dynamic_cast), independently of the engine's patterns.
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpt_training.h"
#include "patrickstar/models/llama.h"

namespace patrickstar::test {

inline constexpr double kDecay = 0.1;
// The engine's two groups: group 0 (decay), then no_decay.
inline constexpr const char* kNoDecay =
    R"({"optimizer": {"params": {"weight_decay": 0.1, "no_decay": ["bias", "norm", "embedding"]}}})";

// tight_config(extra) with the two groups.
inline Config grouped_config(const std::string& extra) {
  nlohmann::json j = nlohmann::json::parse(extra);
  j.merge_patch(nlohmann::json::parse(kNoDecay));
  return tight_config(j.dump());
}

// Each group's own schedule (set before step s, the same way in both loops): a linear decay for
// the matrices, an exponential one for the rest. Steps 2 and 5 also change the no-decay group's
// weight decay and the first group's betas through the options, as a trainer may.
inline void schedule(torch::optim::Optimizer& optimizer, int s) {
  auto& decay = static_cast<torch::optim::AdamWOptions&>(optimizer.param_groups()[0].options());
  auto& no_decay = static_cast<torch::optim::AdamWOptions&>(optimizer.param_groups()[1].options());
  decay.set_lr(3e-3 * (1.0 - 0.05 * s));
  no_decay.set_lr(2e-3 * std::pow(0.8, s));
  if (s == 2) no_decay.weight_decay(0.02);
  if (s == 5) decay.betas({0.85, 0.97});
}

// The parameters LibTorch's recipe leaves undecayed: biases, and every parameter of a norm or an
// embedding module.
template <typename Module>
std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> split(Module& model) {
  std::vector<at::Tensor> decay, no_decay;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    const torch::nn::Module* m = item.value().get();
    const bool whole = dynamic_cast<const torch::nn::LayerNormImpl*>(m) != nullptr ||
                       dynamic_cast<const models::RmsNormImpl*>(m) != nullptr ||
                       dynamic_cast<const torch::nn::EmbeddingImpl*>(m) != nullptr;
    for (const auto& p : m->named_parameters(/*recurse=*/false)) {
      if (!seen.insert(p.value().unsafeGetTensorImpl()).second) continue;
      const bool bias = p.key() == "bias";
      (whole || bias ? no_decay : decay).push_back(p.value());
    }
  }
  return {decay, no_decay};
}

inline torch::optim::AdamW two_group_adamw(const std::vector<at::Tensor>& decay,
                                           const std::vector<at::Tensor>& no_decay) {
  const auto options = torch::optim::AdamWOptions(3e-3).betas({0.9, 0.95}).eps(1e-8);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                 torch::optim::AdamWOptions(options).weight_decay(kDecay)));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                    torch::optim::AdamWOptions(options).weight_decay(0.0)));
  return torch::optim::AdamW(std::move(groups), options);
}

}  // namespace patrickstar::test
