#include "patrickstar/models/lora.h"

#include <cmath>

#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/nn/init.h>

namespace patrickstar::models {

LoraAdapterImpl::LoraAdapterImpl(int64_t in, int64_t out, int64_t rank, double alpha) {
  TORCH_CHECK(in > 0 && out > 0 && rank > 0, "LoraAdapter: sizes must be positive, got in ", in,
              ", out ", out, ", rank ", rank);
  TORCH_CHECK(std::isfinite(alpha) && alpha > 0,
              "LoraAdapter: alpha must be finite and positive, "
              "got ",
              alpha);
  scale_ = alpha / static_cast<double>(rank);
  down = register_parameter("down", at::empty({rank, in}));
  up = register_parameter("up", at::zeros({out, rank}));
  torch::NoGradGuard no_grad;
  // nn::Linear's draw for a weight [rank, in]: Kaiming uniform with a = sqrt(5).
  torch::nn::init::kaiming_uniform_(down, std::sqrt(5.0));
}

at::Tensor LoraAdapterImpl::forward(const at::Tensor& x) {
  return at::matmul(at::matmul(x, down.t()), up.t()) * scale_;
}

int64_t freeze_all_but_adapters(torch::nn::Module& model) {
  int64_t trainable = 0;
  auto set = [&trainable](const torch::nn::Module& module) {
    const bool adapter = dynamic_cast<const LoraAdapterImpl*>(&module) != nullptr;
    for (at::Tensor& p : module.parameters(/*recurse=*/false)) {
      p.requires_grad_(adapter);
      if (adapter) trainable += p.numel();
    }
  };
  // Not named_modules(include_self): a model still in its constructor has no shared_ptr yet.
  set(model);
  for (const auto& child : model.modules(/*include_self=*/false)) set(*child);
  return trainable;
}

}  // namespace patrickstar::models
