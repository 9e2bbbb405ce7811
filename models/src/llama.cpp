#include "patrickstar/models/llama.h"

#include <cmath>
#include <initializer_list>

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/outer.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/where.h>
#include <c10/util/Exception.h>
#include <torch/nn/init.h>

#include "absl/strings/str_join.h"
#include "patrickstar/engine/checkpoint.h"
#include "patrickstar/engine/module_hooks.h"
#include "patrickstar/engine/safetensors.h"
#include "seeded_init.h"

namespace patrickstar::models {
namespace {

const std::vector<LlamaSpec>& all_llama_specs() {
  // name, layers, hidden, intermediate, heads, kv_heads, vocab, max_seq, rope_theta, rms_eps, tied.
  // The last three: the shapes of Meta's Llama 3.2 1B and 3B and Llama 3 8B (their config.json
  // files); the first three are ours, for tests and CPU-sized runs.
  static const std::vector<LlamaSpec> specs = {
      {"llama_tiny", 2, 64, 176, 4, 2, 512, 32, 10000.0, 1e-5, false},
      {"llama_mini", 4, 128, 344, 4, 2, 2048, 64, 10000.0, 1e-5, false},
      {"llama_small_cpu", 6, 256, 688, 8, 4, 8192, 128, 10000.0, 1e-5, false},
      {"llama_1B", 16, 2048, 8192, 32, 8, 128256, 1024, 500000.0, 1e-5, true},
      {"llama_3B", 28, 3072, 8192, 24, 8, 128256, 1024, 500000.0, 1e-5, true},
      {"llama_8B", 32, 4096, 14336, 32, 8, 128256, 1024, 500000.0, 1e-5, false},
  };
  return specs;
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// [..., d] -> [-x[..., d/2:], x[..., :d/2]]
at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// Rotary frequencies as transformers computes them (fp32), with Llama 3.1's scaling for "llama3".
at::Tensor rotary_frequencies(const LlamaSpec& spec) {
  const int64_t d = spec.head_dim();
  at::Tensor exponents = at::arange(0, d, 2, at::TensorOptions(at::kLong)).to(at::kFloat) / d;
  at::Tensor inv_freq = 1.0 / at::pow(spec.rope_theta, exponents);
  if (spec.rope_type == "default") return inv_freq;
  const double old = static_cast<double>(spec.rope_original_seq);
  const double low_wavelen = old / spec.low_freq_factor, high_wavelen = old / spec.high_freq_factor;
  const at::Tensor wavelen = 2 * M_PI / inv_freq;
  at::Tensor scaled = at::where(wavelen > low_wavelen, inv_freq / spec.rope_factor, inv_freq);
  const at::Tensor smooth =
      (old / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor);
  const at::Tensor smoothed = (1 - smooth) * scaled / spec.rope_factor + smooth * scaled;
  const at::Tensor medium = (wavelen >= high_wavelen).logical_and(wavelen <= low_wavelen);
  return at::where(medium, smoothed, scaled);
}

}  // namespace

int64_t LlamaSpec::parameter_count() const {
  const int64_t kv = kv_heads * head_dim();
  return vocab * hidden * (tie_embeddings ? 1 : 2) +
         layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * intermediate + 2 * hidden) +
         hidden + (lora_rank > 0 ? trainable_count() : 0);
}

int64_t LlamaSpec::trainable_count() const {
  // q_lora: [r, h] and [h, r]; v_lora: [r, h] and [kv*d, r].
  return lora_rank > 0 ? layers * lora_rank * (3 * hidden + kv_heads * head_dim())
                       : parameter_count();
}

LlamaSpec llama_spec(const std::string& name) {
  for (const LlamaSpec& spec : all_llama_specs()) {
    if (spec.name == name) return spec;
  }
  TORCH_CHECK(false, "unknown Llama model \"", name,
              "\"; known: ", absl::StrJoin(llama_spec_names(), ", "));
}

std::vector<std::string> llama_spec_names() {
  std::vector<std::string> names;
  for (const LlamaSpec& spec : all_llama_specs()) names.push_back(spec.name);
  return names;
}

RmsNormImpl::RmsNormImpl(int64_t hidden, double eps) : eps_(eps) {
  weight = register_parameter("weight", at::ones({hidden}));
}

at::Tensor RmsNormImpl::forward(const at::Tensor& x) {
  const at::Tensor h = x.to(at::kFloat);
  const at::Tensor normed = h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps_);
  return weight * normed.to(x.scalar_type());
}

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaSpec& spec)
    : heads_(spec.heads), kv_heads_(spec.kv_heads), head_dim_(spec.head_dim()), dropout_(spec.dropout) {
  const int64_t h = spec.hidden, kv = spec.kv_heads * head_dim_;
  auto linear = [](int64_t in, int64_t out) {
    return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
  };
  q_proj = register_module("q_proj", linear(h, h));
  k_proj = register_module("k_proj", linear(h, kv));
  v_proj = register_module("v_proj", linear(h, kv));
  o_proj = register_module("o_proj", linear(h, h));
  if (spec.lora_rank > 0) {
    q_lora = register_module("q_lora", LoraAdapter(h, h, spec.lora_rank, spec.lora_alpha));
    v_lora = register_module("v_lora", LoraAdapter(h, kv, spec.lora_rank, spec.lora_alpha));
  }
}

at::Tensor LlamaAttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos,
                                       const at::Tensor& sin) {
  const int64_t batch = x.size(0), seq = x.size(1);
  at::Tensor q = call(q_proj, x), k = call(k_proj, x), v = call(v_proj, x);
  if (q_lora) q = q + call(q_lora, x);
  if (v_lora) v = v + call(v_lora, x);
  // [batch, seq, heads * d] -> [batch, heads, seq, d]
  q = q.view({batch, seq, heads_, head_dim_}).transpose(1, 2);
  k = k.view({batch, seq, kv_heads_, head_dim_}).transpose(1, 2);
  v = v.view({batch, seq, kv_heads_, head_dim_}).transpose(1, 2);
  q = q * cos + rotate_half(q) * sin;
  k = k * cos + rotate_half(k) * sin;
  if (kv_heads_ != heads_) {  // query head j reads key/value head j / (heads / kv_heads)
    const int64_t rep = heads_ / kv_heads_;
    k = k.unsqueeze(2)
            .expand({batch, kv_heads_, rep, seq, head_dim_})
            .reshape({batch, heads_, seq, head_dim_});
    v = v.unsqueeze(2)
            .expand({batch, kv_heads_, rep, seq, head_dim_})
            .reshape({batch, heads_, seq, head_dim_});
  }
  const double p = is_training() ? dropout_ : 0.0;
  at::Tensor attn = at::scaled_dot_product_attention(q, k, v, {}, p, /*is_causal=*/true);
  return call(o_proj, attn.transpose(1, 2).reshape({batch, seq, heads_ * head_dim_}));
}

LlamaMlpImpl::LlamaMlpImpl(int64_t hidden, int64_t intermediate) {
  auto linear = [](int64_t in, int64_t out) {
    return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
  };
  gate_proj = register_module("gate_proj", linear(hidden, intermediate));
  up_proj = register_module("up_proj", linear(hidden, intermediate));
  down_proj = register_module("down_proj", linear(intermediate, hidden));
}

at::Tensor LlamaMlpImpl::forward(const at::Tensor& x) {
  return call(down_proj, at::silu(call(gate_proj, x)) * call(up_proj, x));
}

LlamaBlockImpl::LlamaBlockImpl(const LlamaSpec& spec) {
  input_layernorm = register_module("input_layernorm", RmsNorm(spec.hidden, spec.rms_eps));
  self_attn = register_module("self_attn", LlamaAttention(spec));
  post_attention_layernorm =
      register_module("post_attention_layernorm", RmsNorm(spec.hidden, spec.rms_eps));
  mlp = register_module("mlp", LlamaMlp(spec.hidden, spec.intermediate));
}

at::Tensor LlamaBlockImpl::forward(const at::Tensor& x, const at::Tensor& cos,
                                   const at::Tensor& sin) {
  const at::Tensor h = x + self_attn->forward(call(input_layernorm, x), cos, sin);
  return h + mlp->forward(call(post_attention_layernorm, h));
}

void LlamaBlockImpl::defer_base() {
  for (torch::nn::Module* m : std::initializer_list<torch::nn::Module*>{
           input_layernorm.get(), self_attn->q_proj.get(), self_attn->k_proj.get(),
           self_attn->v_proj.get(), self_attn->o_proj.get(), post_attention_layernorm.get(),
           mlp.get()}) {
    defer_parameters(*m);
  }
}

LlamaImpl::LlamaImpl(const LlamaSpec& spec) : spec_(spec) {
  TORCH_CHECK(spec.layers > 0 && spec.hidden > 0 && spec.intermediate > 0 && spec.vocab > 0 &&
                  spec.max_seq > 0 && spec.lora_rank >= 0,
              "Llama spec \"", spec.name, "\" has a non-positive size");
  TORCH_CHECK(spec.heads > 0 && spec.kv_heads > 0 && spec.hidden % spec.heads == 0 &&
                  spec.heads % spec.kv_heads == 0 && spec.head_dim() % 2 == 0,
              "Llama spec \"", spec.name, "\": hidden size ", spec.hidden, ", ", spec.heads,
              " heads and ", spec.kv_heads,
              " key/value heads need heads | hidden, kv_heads | heads and an even head size");
  TORCH_CHECK(spec.dropout >= 0.0 && spec.dropout < 1.0, "Llama spec \"", spec.name, "\": dropout ",
              spec.dropout, " is not a probability in [0, 1)");
  TORCH_CHECK(spec.rope_type == "default" || spec.rope_type == "llama3", "Llama spec \"", spec.name,
              "\": rotary type \"", spec.rope_type,
              "\" is not supported (\"default\" or \"llama3\")");
  init_seed_ = at::detail::getDefaultCPUGenerator().current_seed();
  inv_freq_ = rotary_frequencies(spec);
  auto made = [&](torch::nn::Module& m) {
    if (spec.deferred_init) defer_parameters(m);
  };
  TORCH_CHECK(spec.pad_token_id < spec.vocab, "Llama spec \"", spec.name, "\": pad token ",
              spec.pad_token_id, " is outside the vocabulary of ", spec.vocab);
  torch::nn::EmbeddingOptions embedding(spec.vocab, spec.hidden);
  if (spec.pad_token_id >= 0) embedding.padding_idx(spec.pad_token_id);
  embed_tokens = register_module("embed_tokens", torch::nn::Embedding(embedding));
  made(*embed_tokens);
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < spec.layers; ++i) {
    LlamaBlock block(spec);
    if (spec.deferred_init) block->defer_base();
    layers->push_back(block);
  }
  norm = register_module("norm", RmsNorm(spec.hidden, spec.rms_eps));
  made(*norm);
  if (!spec.tie_embeddings) {
    lm_head = register_module(
        "lm_head",
        torch::nn::Linear(torch::nn::LinearOptions(spec.hidden, spec.vocab).bias(false)));
    made(*lm_head);
  }
  // transformers' initialization: normal(0, 0.02) weights, unit norms (the adapters draw their
  // own; a deferred parameter gets its value from initialize_parameter).
  torch::NoGradGuard no_grad;
  for (auto& p : named_parameters()) {
    if (ends_with(p.key(), "norm.weight") || hf_name(p.key()).empty() || is_deferred(p.value())) {
      continue;
    }
    torch::nn::init::normal_(p.value(), 0.0, 0.02);
  }
  if (spec.pad_token_id >= 0 && !is_deferred(embed_tokens->weight)) {
    embed_tokens->weight[spec.pad_token_id].zero_();  // as transformers initializes it
  }
  if (spec.lora_rank > 0) freeze_all_but_adapters(*this);
}

std::string LlamaImpl::hf_name(const std::string& name) {
  if (name.find("_lora.") != std::string::npos) return "";
  return name == "lm_head.weight" ? name : "model." + name;
}

void LlamaImpl::initialize_parameter(const std::string& name, at::Tensor& value) const {
  if (source_) {
    source_->read_into(hf_name(name), value);
  } else if (ends_with(name, "norm.weight")) {
    value.fill_(1.0);
  } else {
    value.normal_(0.0, 0.02, generator_for(name, init_seed_));
  }
}

at::Tensor LlamaImpl::forward(const at::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2, "Llama: tokens must be [batch, seq], got ", tokens.sizes());
  const int64_t seq = tokens.size(1);
  TORCH_CHECK(seq <= spec_.max_seq, "Llama \"", spec_.name, "\": sequence length ", seq,
              " exceeds the model's ", spec_.max_seq);
  at::Tensor x = call(embed_tokens, tokens);
  // cos, sin [seq, head_dim]: positions times frequencies, in fp32, then in the compute dtype.
  const at::Tensor freqs = at::outer(at::arange(seq, at::TensorOptions(at::kFloat)), inv_freq_);
  const at::Tensor angles = at::cat({freqs, freqs}, -1).to(x.device());
  const at::Tensor cos = angles.cos().to(x.scalar_type()), sin = angles.sin().to(x.scalar_type());
  for (auto& layer : *layers) {
    LlamaBlockImpl* b = layer->as<LlamaBlockImpl>();
    if (spec_.checkpoint_activations) {
      x = checkpoint(
          *b, [b, cos, sin](const at::Tensor& h) { return b->forward(h, cos, sin); }, x);
    } else {
      x = b->forward(x, cos, sin);
    }
  }
  x = call(norm, x);
  if (lm_head) return call(lm_head, x);
  // Tied: the head is the token embedding's weight, under the embedding module's door.
  ModuleScope head(*embed_tokens);
  return head.done(at::matmul(head.input(x), embed_tokens->weight.t()));
}

at::Tensor LlamaImpl::loss(const at::Tensor& tokens, const at::Tensor& targets) {
  const at::Tensor logits = forward(tokens).to(at::kFloat);
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

}  // namespace patrickstar::models
