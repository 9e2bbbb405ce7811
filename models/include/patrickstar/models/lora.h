// A low-rank adapter (LoRA; Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", 2021)
// for fine-tuning a frozen base: next to a frozen linear layer W, the adapter adds
// (alpha / rank) * x A^T B^T with A [rank, in] and B [out, rank], and only A and B train.
//
//   patrickstar::models::LoraAdapter adapter(/*in=*/768, /*out=*/768, /*rank=*/8, /*alpha=*/16.0);
//   at::Tensor y = patrickstar::call(base, x) + patrickstar::call(adapter, x);
//
// A is drawn as nn::Linear draws its weight (Kaiming uniform) and B starts at zero, so the adapted
// layer starts equal to the base. The adapter owns its two parameters (no submodules): one door
// covers it. Not thread-safe (like any nn::Module).
#pragma once

#include <cstdint>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

namespace patrickstar::models {

class LoraAdapterImpl : public torch::nn::Module {
 public:
  // Throws c10::Error unless in, out and rank are positive and alpha is finite and positive.
  LoraAdapterImpl(int64_t in, int64_t out, int64_t rank, double alpha);
  // x [..., in] -> [..., out]
  at::Tensor forward(const at::Tensor& x);

  at::Tensor down;  // A: [rank, in]
  at::Tensor up;    // B: [out, rank]

 private:
  double scale_;  // alpha / rank
};
TORCH_MODULE(LoraAdapter);

// Sets requires_grad to false on every parameter of `model` that no LoraAdapter owns, and true on
// the adapters' parameters. Returns the number of trainable elements left.
int64_t freeze_all_but_adapters(torch::nn::Module& model);

}  // namespace patrickstar::models
