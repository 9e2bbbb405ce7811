// The GPT model zoo: a GPT-2-style decoder (pre-LayerNorm, GELU MLP, causal self-attention, learned
// positions, LM head tied to the token embedding) in plain LibTorch, with PatrickStar's named sizes
// and small ones that train in seconds on two CPU cores.
//
//   auto spec = patrickstar::models::gpt_spec("gpt_tiny");
//   spec.checkpoint_activations = true;                // optional: recompute blocks in backward
//   patrickstar::models::Gpt model(spec);
//   at::Tensor loss = model->loss(tokens, targets);   // tokens, targets: [batch, seq] int64
//
// Every parameter-owning submodule runs through patrickstar::call, so the engine sees each module's
// forward; without an engine the model is ordinary LibTorch. Not thread-safe (like any nn::Module).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "patrickstar/engine/deferred_init.h"
#include "patrickstar/models/lora.h"

namespace patrickstar::models {

struct GptSpec {
  std::string name;
  int64_t layers = 0;
  int64_t hidden = 0;
  int64_t heads = 0;
  int64_t vocab = 50257;
  int64_t max_seq = 1024;  // positions the model has; a batch may use fewer
  // Run each block through patrickstar::checkpoint: a block keeps only its input for backward and
  // computes its forward again there. Less activation memory for one more forward of the blocks.
  // Each block is named to the call (checkpoint(block, ...)), so an engine's
  // "activation_checkpointing" policy can also offload its input or keep its activations.
  bool checkpoint_activations = false;
  // Dropout probability, as GPT-2's config applies it (embd_pdrop, attn_pdrop and resid_pdrop all
  // equal): after the embeddings' sum, on the attention probabilities, and after each residual
  // branch (attention projection, MLP) before it is added. Applied while the module is training;
  // 0 draws nothing. With checkpoint_activations the recompute replays the masks (checkpoint.h).
  double dropout = 0.0;
  // Fine-tuning with low-rank adapters (lora.h) when positive: each block's attention projections
  // (qkv and proj) get a LoraAdapter of this rank, and every other parameter is frozen
  // (requires_grad false) when the model is built.
  int64_t lora_rank = 0;
  double lora_alpha = 16.0;
  // Deferred initialization (patrickstar/engine/deferred_init.h): each module's parameters are
  // freed as soon as it is built, so the host never holds the whole model in fp32; the engine
  // writes each one's value into its chunk at registration (GptImpl::initialize_parameter), and
  // patrickstar::materialize_parameters gives them their values for plain LibTorch. The values
  // follow the same rules as without it (normal(0, 0.02) weights, zero biases, unit LayerNorm) but
  // are drawn per parameter from a seed of its name and of the CPU generator's seed at
  // construction (torch::manual_seed; two models built after one manual_seed get the same
  // values), so they differ from a model built whole. The adapters keep their data (they are
  // small and train).
  bool deferred_init = false;

  // Exact parameter count (tied LM head counted once): V*h + S*h + L*(12h^2 + 13h) + 2h, plus
  // L*6hr of adapters with lora_rank r.
  int64_t parameter_count() const;
  // The parameters that train: all of them, or the adapters' L*6hr with lora_rank r.
  int64_t trainable_count() const;
};

// A named size: PatrickStar's (GPT2small ... GPT_175B) or a small one (gpt_tiny, gpt_mini,
// gpt_small_cpu), without activation checkpointing. Throws c10::Error listing the known names when
// `name` is none of them.
GptSpec gpt_spec(const std::string& name);
std::vector<std::string> gpt_spec_names();

class GptBlockImpl : public torch::nn::Module {
 public:
  // lora_rank > 0: qkv and proj get adapters (qkv_lora, proj_lora) of that rank.
  GptBlockImpl(int64_t hidden, int64_t heads, int64_t lora_rank = 0, double lora_alpha = 16.0,
               double dropout = 0.0);
  at::Tensor forward(const at::Tensor& x);
  // Defers the parameters of every submodule but the adapters (GptSpec::deferred_init).
  void defer_base();

  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc{nullptr}, fc_out{nullptr};
  LoraAdapter qkv_lora{nullptr}, proj_lora{nullptr};  // null without adapters

 private:
  int64_t heads_;
  double dropout_;
};
TORCH_MODULE(GptBlock);

class GptImpl : public torch::nn::Module, public ParameterInitializer {
 public:
  explicit GptImpl(const GptSpec& spec);
  // Logits [batch, seq, vocab] for token ids [batch, seq].
  at::Tensor forward(const at::Tensor& tokens);
  // Mean cross-entropy of next-token prediction against `targets` [batch, seq].
  at::Tensor loss(const at::Tensor& tokens, const at::Tensor& targets);

  const GptSpec& spec() const { return spec_; }
  // A deferred parameter's value (GptSpec::deferred_init): `name` as named_parameters() names it.
  void initialize_parameter(const std::string& name, at::Tensor& value) const override;

  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};

 private:
  GptSpec spec_;
  uint64_t init_seed_ = 0;  // the CPU generator's seed at construction (deferred_init)
};
TORCH_MODULE(Gpt);

// Random token ids in [0, vocab) and their next-token targets, from a generator seeded with `seed`.
struct TokenBatch {
  at::Tensor tokens;
  at::Tensor targets;
};
TokenBatch random_tokens(const GptSpec& spec, int64_t batch, int64_t seq, uint64_t seed);

}  // namespace patrickstar::models
