// The Llama model of the zoo: a decoder of the Llama architecture (RMSNorm before attention and
// MLP, rotary position embeddings, grouped-query attention, SwiGLU MLP, an output head of its own
// or tied to the token embedding) in plain LibTorch, named like Hugging Face's LlamaForCausalLM so
// that its checkpoints load as they are (llama_pretrained.h):
//
//   auto spec = patrickstar::models::llama_spec("llama_tiny");
//   patrickstar::models::Llama model(spec);
//   at::Tensor loss = model->loss(tokens, targets);   // tokens, targets: [batch, seq] int64
//
// Our parameter names are transformers' without its "model." prefix ("layers.3.mlp.up_proj.weight"
// is "model.layers.3.mlp.up_proj.weight" there; "lm_head.weight" is the same). Every
// parameter-owning submodule runs through patrickstar::call, so the engine sees each module's
// forward; without an engine the model is ordinary LibTorch. Not thread-safe (like any nn::Module).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include "patrickstar/engine/deferred_init.h"
#include "patrickstar/models/lora.h"

namespace patrickstar {
class SafetensorsCheckpoint;
}

namespace patrickstar::models {

struct LlamaSpec {
  std::string name;
  int64_t layers = 0;
  int64_t hidden = 0;
  int64_t intermediate = 0;  // the SwiGLU MLP's width
  int64_t heads = 0;         // query heads
  int64_t kv_heads = 0;      // key/value heads: heads is a multiple of it (grouped-query attention)
  int64_t vocab = 32000;
  int64_t max_seq = 2048;  // the longest sequence the model takes
  double rope_theta = 10000.0;
  double rms_eps = 1e-5;
  bool tie_embeddings = false;  // the output head is the token embedding's weight
  // Rotary frequencies: "default", or "llama3" (Llama 3.1's long-context scaling of the low
  // frequencies by rope_factor, between low_freq_factor and high_freq_factor of rope_original_seq).
  std::string rope_type = "default";
  double rope_factor = 1.0, low_freq_factor = 1.0, high_freq_factor = 4.0;
  int64_t rope_original_seq = 8192;
  // As GptSpec's: recompute each block in backward; adapters of this rank on the attention's query
  // and value projections (q_lora, v_lora; everything else frozen); deferred initialization (each
  // module's parameters freed as soon as it is built; values from initialize_parameter, drawn per
  // parameter from its name and torch::manual_seed's seed, or from a checkpoint:
  // LlamaImpl::initialize_from).
  // Each block is named to the call (checkpoint(block, ...)), so an engine's
  // "activation_checkpointing" policy can also offload its input or keep its activations.
  bool checkpoint_activations = false;
  // Dropout on the attention probabilities while training (transformers' attention_dropout, read
  // from config.json by llama_spec_from_pretrained; Llama's own configs have 0). With
  // checkpoint_activations the recompute replays the masks (patrickstar/engine/checkpoint.h).
  double dropout = 0.0;
  int64_t lora_rank = 0;
  double lora_alpha = 16.0;
  bool deferred_init = false;
  // The embedding row of this token id gets no gradient (transformers' padding_idx); -1: none.
  int64_t pad_token_id = -1;
  // The config.json the spec was read from (llama_spec_from_pretrained), kept so that a checkpoint
  // written back carries its other fields (token ids, generation settings); empty for a zoo size.
  std::string source_config{};

  int64_t head_dim() const { return heads > 0 ? hidden / heads : 0; }
  // Exact: V*h (twice untied) + L*(2h*h + 2h*kv*d + 3h*i + 2h) + h, plus L*r*(3h + kv*d) of
  // adapters with lora_rank r (d: head_dim).
  int64_t parameter_count() const;
  int64_t trainable_count() const;
};

// A named size: llama_tiny, llama_mini, llama_small_cpu (CPU-sized), or the shapes of Llama 3.2 1B
// and 3B (tied head) and Llama 3 8B (llama_1B, llama_3B, llama_8B: layers, widths, heads and
// vocabulary as Meta's config.json files give them). Throws c10::Error listing the known names.
LlamaSpec llama_spec(const std::string& name);
std::vector<std::string> llama_spec_names();

class RmsNormImpl : public torch::nn::Module {
 public:
  RmsNormImpl(int64_t hidden, double eps);
  // x * rsqrt(mean(x^2) + eps) in fp32, back to x's dtype, times the weight.
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RmsNorm);

class LlamaAttentionImpl : public torch::nn::Module {
 public:
  explicit LlamaAttentionImpl(const LlamaSpec& spec);
  // x [batch, seq, hidden]; cos, sin [seq, head_dim] in x's dtype.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  LoraAdapter q_lora{nullptr}, v_lora{nullptr};  // null without adapters

 private:
  int64_t heads_, kv_heads_, head_dim_;
  double dropout_;  // LlamaSpec::dropout
};
TORCH_MODULE(LlamaAttention);

class LlamaMlpImpl : public torch::nn::Module {
 public:
  LlamaMlpImpl(int64_t hidden, int64_t intermediate);
  at::Tensor forward(const at::Tensor& x);  // down(silu(gate(x)) * up(x))
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(LlamaMlp);

class LlamaBlockImpl : public torch::nn::Module {
 public:
  explicit LlamaBlockImpl(const LlamaSpec& spec);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
  // Defers every parameter but the adapters' (LlamaSpec::deferred_init).
  void defer_base();
  RmsNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  LlamaAttention self_attn{nullptr};
  LlamaMlp mlp{nullptr};
};
TORCH_MODULE(LlamaBlock);

class LlamaImpl : public torch::nn::Module, public ParameterInitializer {
 public:
  explicit LlamaImpl(const LlamaSpec& spec);
  // Logits [batch, seq, vocab] for token ids [batch, seq].
  at::Tensor forward(const at::Tensor& tokens);
  // Mean cross-entropy (over fp32 logits) of next-token prediction against `targets` [batch, seq].
  at::Tensor loss(const at::Tensor& tokens, const at::Tensor& targets);

  const LlamaSpec& spec() const { return spec_; }
  // A deferred parameter's value: from the checkpoint initialize_from gave, else drawn (see
  // LlamaSpec::deferred_init).
  void initialize_parameter(const std::string& name, at::Tensor& value) const override;
  // The values of `checkpoint` (transformers' names: "model." + ours, and "lm_head.weight"),
  // every parameter but the adapters'. Everything is checked first (a tensor missing or
  // unexpected, of another shape, of a dtype other than fp32, bf16 or fp16): an error names the
  // tensor and its file and changes nothing. A deferred model keeps the checkpoint and reads each
  // tensor when registration (or materialize_parameters) asks for it; a model built whole gets
  // its values now.
  void initialize_from(std::shared_ptr<const SafetensorsCheckpoint> checkpoint);
  // transformers' name for our parameter `name` (empty for an adapter's: they have none there).
  static std::string hf_name(const std::string& name);

  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RmsNorm norm{nullptr};
  torch::nn::Linear lm_head{nullptr};  // null when tied

 private:
  LlamaSpec spec_;
  at::Tensor inv_freq_;     // [head_dim / 2] fp32: the rotary frequencies
  uint64_t init_seed_ = 0;  // the CPU generator's seed at construction (deferred_init)
  std::shared_ptr<const SafetensorsCheckpoint> source_;
};
TORCH_MODULE(Llama);

}  // namespace patrickstar::models
