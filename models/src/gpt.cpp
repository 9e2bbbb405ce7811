#include "patrickstar/models/gpt.h"

#include <cstdint>
#include <initializer_list>

#include <ATen/ops/arange.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/dropout.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/core/Generator.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <torch/nn/init.h>

#include "absl/strings/str_join.h"
#include "patrickstar/engine/checkpoint.h"
#include "patrickstar/engine/module_hooks.h"
#include "seeded_init.h"

namespace patrickstar::models {
namespace {

const std::vector<GptSpec>& all_gpt_specs() {
  // PatrickStar's sizes (layers / hidden / heads) from its benchmark model list; GPT2small trains at
  // sequence length 128 there, the others at 1024. The last three are ours, for CPU-sized runs.
  static const std::vector<GptSpec> specs = {
      {"GPT2small", 24, 1536, 16, 50257, 128},
      {"GPT2_1B", 20, 2048, 16, 50257, 1024},
      {"megatron_1.3B", 24, 2048, 32, 50257, 1024},
      {"GPT2_2B", 40, 2048, 16, 50257, 1024},
      {"megatron_3.9B", 24, 2560, 40, 50257, 1024},
      {"GPT2_4B", 64, 2304, 16, 50257, 1024},
      {"GPT3_6B", 53, 3072, 16, 50257, 1024},
      {"GPT3_8B", 72, 3072, 16, 50257, 1024},
      {"GPT3_10B", 50, 4096, 16, 50257, 1024},
      {"GPT3_11B", 55, 4096, 16, 50257, 1024},
      {"GPT3_12B", 60, 4096, 16, 50257, 1024},
      {"GPT3_13B", 65, 4096, 16, 50257, 1024},
      {"GPT3_15B", 78, 4096, 16, 50257, 1024},
      {"GPT3_18B", 90, 4096, 16, 50257, 1024},
      {"GPT_175B", 96, 12288, 96, 50257, 1024},
      {"gpt_tiny", 2, 64, 4, 512, 32},
      {"gpt_mini", 4, 128, 4, 2048, 64},
      {"gpt_small_cpu", 6, 256, 8, 8192, 128},
  };
  return specs;
}

}  // namespace

int64_t GptSpec::parameter_count() const {
  return vocab * hidden + max_seq * hidden + layers * (12 * hidden * hidden + 13 * hidden) +
         2 * hidden + (lora_rank > 0 ? trainable_count() : 0);
}

int64_t GptSpec::trainable_count() const {
  // qkv's adapter: [r, h] and [3h, r]; proj's: [r, h] and [h, r].
  return lora_rank > 0 ? layers * 6 * hidden * lora_rank : parameter_count();
}

GptSpec gpt_spec(const std::string& name) {
  for (const GptSpec& spec : all_gpt_specs()) {
    if (spec.name == name) return spec;
  }
  TORCH_CHECK(false, "unknown GPT model \"", name, "\"; known: ", absl::StrJoin(gpt_spec_names(), ", "));
}

std::vector<std::string> gpt_spec_names() {
  std::vector<std::string> names;
  for (const GptSpec& spec : all_gpt_specs()) names.push_back(spec.name);
  return names;
}

GptBlockImpl::GptBlockImpl(int64_t hidden, int64_t heads, int64_t lora_rank, double lora_alpha,
                           double dropout)
    : heads_(heads), dropout_(dropout) {
  TORCH_CHECK(heads > 0 && hidden % heads == 0, "GPT block: hidden size ", hidden,
              " is not a multiple of the head count ", heads);
  TORCH_CHECK(dropout >= 0.0 && dropout < 1.0, "GPT block: dropout ", dropout,
              " is not a probability in [0, 1)");
  ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({hidden})));
  qkv = register_module("qkv", torch::nn::Linear(hidden, 3 * hidden));
  proj = register_module("proj", torch::nn::Linear(hidden, hidden));
  ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({hidden})));
  fc = register_module("fc", torch::nn::Linear(hidden, 4 * hidden));
  fc_out = register_module("fc_out", torch::nn::Linear(4 * hidden, hidden));
  if (lora_rank > 0) {
    qkv_lora = register_module("qkv_lora", LoraAdapter(hidden, 3 * hidden, lora_rank, lora_alpha));
    proj_lora = register_module("proj_lora", LoraAdapter(hidden, hidden, lora_rank, lora_alpha));
  }
}

at::Tensor GptBlockImpl::forward(const at::Tensor& x) {
  const int64_t batch = x.size(0), seq = x.size(1), hidden = x.size(2);
  const int64_t head_dim = hidden / heads_;
  const at::Tensor normed = call(ln1, x);
  at::Tensor h = call(qkv, normed);
  if (qkv_lora) h = h + call(qkv_lora, normed);
  // [batch, seq, 3, heads, head_dim] -> three [batch, heads, seq, head_dim]
  auto parts = h.view({batch, seq, 3, heads_, head_dim}).permute({2, 0, 3, 1, 4}).unbind(0);
  const double p = is_training() ? dropout_ : 0.0;
  at::Tensor attn = at::scaled_dot_product_attention(parts[0], parts[1], parts[2], {}, p,
                                                     /*is_causal=*/true);
  attn = attn.transpose(1, 2).reshape({batch, seq, hidden});
  at::Tensor projected = call(proj, attn);
  if (proj_lora) projected = projected + call(proj_lora, attn);
  at::Tensor y = x + at::dropout(projected, p, is_training());
  return y + at::dropout(call(fc_out, at::gelu(call(fc, call(ln2, y)))), p, is_training());
}

void GptBlockImpl::defer_base() {
  for (torch::nn::Module* m : std::initializer_list<torch::nn::Module*>{
           ln1.get(), qkv.get(), proj.get(), ln2.get(), fc.get(), fc_out.get()}) {
    defer_parameters(*m);
  }
}

GptImpl::GptImpl(const GptSpec& spec) : spec_(spec) {
  TORCH_CHECK(spec.layers > 0 && spec.hidden > 0 && spec.vocab > 0 && spec.max_seq > 0 &&
                  spec.lora_rank >= 0,
              "GPT spec \"", spec.name, "\" has a non-positive size");
  init_seed_ = at::detail::getDefaultCPUGenerator().current_seed();
  // Deferred: each module's fp32 weights are freed as soon as it is built (one block at a time).
  auto made = [&](torch::nn::Module& m) {
    if (spec.deferred_init) defer_parameters(m);
  };
  wte = register_module("wte", torch::nn::Embedding(spec.vocab, spec.hidden));
  made(*wte);
  wpe = register_module("wpe", torch::nn::Embedding(spec.max_seq, spec.hidden));
  made(*wpe);
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < spec.layers; ++i) {
    GptBlock block(spec.hidden, spec.heads, spec.lora_rank, spec.lora_alpha, spec.dropout);
    if (spec.deferred_init) block->defer_base();
    blocks->push_back(block);
  }
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({spec.hidden})));
  made(*ln_f);
  // GPT-2's initialisation: normal(0, 0.02) weights, zero biases, unit LayerNorm (the adapters
  // draw their own; a deferred parameter gets its value from initialize_parameter).
  torch::NoGradGuard no_grad;
  for (auto& p : named_parameters()) {
    if (p.key().find("ln") != std::string::npos || p.key().find("_lora.") != std::string::npos ||
        is_deferred(p.value())) {
      continue;
    }
    if (p.key().find("bias") != std::string::npos) {
      p.value().zero_();
    } else {
      torch::nn::init::normal_(p.value(), 0.0, 0.02);
    }
  }
  if (spec.lora_rank > 0) freeze_all_but_adapters(*this);
}

void GptImpl::initialize_parameter(const std::string& name, at::Tensor& value) const {
  if (name.find("ln") != std::string::npos) {  // ln1, ln2, ln_f: unit weight, zero bias
    value.fill_(name.size() >= 6 && name.compare(name.size() - 6, 6, "weight") == 0 ? 1.0 : 0.0);
  } else if (name.find("bias") != std::string::npos) {
    value.zero_();
  } else {
    value.normal_(0.0, 0.02, generator_for(name, init_seed_));
  }
}

at::Tensor GptImpl::forward(const at::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2, "GPT: tokens must be [batch, seq], got ", tokens.sizes());
  const int64_t seq = tokens.size(1);
  TORCH_CHECK(seq <= spec_.max_seq, "GPT \"", spec_.name, "\": sequence length ", seq,
              " exceeds the model's ", spec_.max_seq, " positions");
  at::Tensor positions = at::arange(seq, tokens.options());
  at::Tensor x = call(wte, tokens) + call(wpe, positions);
  if (spec_.dropout > 0.0) x = at::dropout(x, spec_.dropout, is_training());
  for (auto& block : *blocks) {
    GptBlockImpl* b = block->as<GptBlockImpl>();
    if (spec_.checkpoint_activations) {
      x = checkpoint(
          *b, [b](const at::Tensor& h) { return b->forward(h); }, x);
    } else {
      x = b->forward(x);
    }
  }
  x = call(ln_f, x);
  // The LM head shares the token embedding's weight: the embedding module's door covers it.
  ModuleScope head(*wte);
  return head.done(at::matmul(head.input(x), wte->weight.t()));
}

at::Tensor GptImpl::loss(const at::Tensor& tokens, const at::Tensor& targets) {
  at::Tensor logits = forward(tokens);
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

TokenBatch random_tokens(const GptSpec& spec, int64_t batch, int64_t seq, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor ids = at::randint(spec.vocab, {batch, seq + 1}, gen, at::TensorOptions(at::kLong));
  return {ids.narrow(1, 0, seq).contiguous(), ids.narrow(1, 1, seq).contiguous()};
}

}  // namespace patrickstar::models
