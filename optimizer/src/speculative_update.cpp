#include "patrickstar/optimizer/speculative_update.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <cstring>

#include "patrickstar/optimizer/cpu_adam.h"
#include "patrickstar/optimizer/hybrid_adam.h"

namespace patrickstar {

namespace {

// `buffer` as a tensor like `like` (reused when it already is one).
void copy_into(at::Tensor& buffer, const at::Tensor& like) {
  if (!buffer.defined() || buffer.numel() != like.numel() ||
      buffer.scalar_type() != like.scalar_type()) {
    buffer = at::empty({like.numel()}, like.options());
  }
  buffer.copy_(like.view({-1}));
}

void check_host_chunk(const AdamChunk& chunk) {
  TORCH_CHECK(!chunk.states_from_source && chunk.master.defined() && chunk.master.device().is_cpu(),
              "speculate: the chunk's states must be in host memory");
}

}  // namespace

uint64_t gradient_fingerprint(const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(),
              "gradient_fingerprint: a contiguous CPU tensor");
  const auto* bytes = static_cast<const unsigned char*>(t.data_ptr());
  const auto size = static_cast<size_t>(t.numel()) * t.element_size();
  const size_t words = size / 8;
  // splitmix64's finalizer: a bijection of 64-bit words, far from linear, so that structured edits
  // (every float scaled by a power of two, signs flipped in pairs) do not cancel in the sum.
  auto mix = [](uint64_t word, size_t k) {
    uint64_t z = word + 0x9E3779B97F4A7C15ULL * (static_cast<uint64_t>(k) + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  };
  uint64_t sum = 0;
  for (size_t k = 0; k < words; ++k) {
    uint64_t word;
    std::memcpy(&word, bytes + 8 * k, 8);
    sum += mix(word, k);
  }
  if (size % 8 != 0) {
    uint64_t word = 0;
    std::memcpy(&word, bytes + 8 * words, size % 8);
    sum += mix(word, words);
  }
  return sum;
}

namespace {
// The update itself, in place (the undo log taken).
void apply(const AdamChunk& chunk, const AdamStepConstants& constants, SpeculativeUpdate& update) {
  if (chunk.mixed() && chunk.grad_fp32.defined()) {
    // A gradient space: the fp32 update, then the half weight from the new master (as step()).
    adam_step_fp32(chunk.master, chunk.grad_fp32, chunk.exp_avg, chunk.exp_avg_sq, constants);
    if (!update.new_half.defined() || update.new_half.numel() != chunk.master.numel() ||
        update.new_half.scalar_type() != chunk.half_param_grad.scalar_type()) {
      update.new_half = at::empty({chunk.master.numel()}, chunk.half_param_grad.options());
    }
    restore_half_from_master(update.new_half, chunk.master);
  } else if (chunk.mixed()) {
    // The half slot holds the gradient: the kernel reads it from a copy and leaves the new half
    // weight there.
    copy_into(update.new_half, chunk.half_param_grad);
    adam_step_mixed(update.new_half, chunk.master, chunk.exp_avg, chunk.exp_avg_sq, constants);
  } else {
    adam_step_fp32(chunk.master, chunk.grad_fp32, chunk.exp_avg, chunk.exp_avg_sq, constants);
  }
}
}  // namespace

bool same_constants(const AdamStepConstants& a, const AdamStepConstants& b) {
  static_assert(sizeof(AdamStepConstants) == 10 * sizeof(float), "AdamStepConstants has padding");
  return std::memcmp(&a, &b, sizeof(AdamStepConstants)) == 0;
}

int64_t speculative_bytes(const AdamChunk& chunk) {
  const int64_t numel = chunk.master.numel();
  return numel * (4 + 2 * chunk.moment_bytes() + (chunk.mixed() ? 2 : 0));
}

void speculate(const AdamChunk& chunk, const AdamStepConstants& constants,
               SpeculativeUpdate& update) {
  TORCH_CHECK(update.state == SpeculativeUpdate::State::kPending,
              "speculate: the update was already applied");
  check_host_chunk(chunk);
  const auto start = std::chrono::steady_clock::now();
  update.grad_fingerprint =
      gradient_fingerprint(chunk.grad_fp32.defined() ? chunk.grad_fp32 : chunk.half_param_grad);
  copy_into(update.old_master, chunk.master);
  copy_into(update.old_exp_avg, chunk.exp_avg);
  copy_into(update.old_exp_avg_sq, chunk.exp_avg_sq);
  try {  // a throw leaves the chunk as it was and the update pending
    apply(chunk, constants, update);
  } catch (...) {
    // Nothing half-applied: the old values go back and the update stays pending.
    chunk.master.view({-1}).copy_(update.old_master);
    chunk.exp_avg.view({-1}).copy_(update.old_exp_avg);
    chunk.exp_avg_sq.view({-1}).copy_(update.old_exp_avg_sq);
    throw;
  }
  update.constants = constants;
  update.state = SpeculativeUpdate::State::kApplied;
  update.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void commit(const AdamChunk& chunk, SpeculativeUpdate& update) {
  TORCH_CHECK(update.state == SpeculativeUpdate::State::kApplied,
              "commit: the speculative update is not applied");
  if (chunk.mixed()) chunk.half_param_grad.view({-1}).copy_(update.new_half);
  update.state = SpeculativeUpdate::State::kCommitted;
}

void undo(const AdamChunk& chunk, SpeculativeUpdate& update) {
  TORCH_CHECK(update.state == SpeculativeUpdate::State::kApplied,
              "undo: the speculative update is not applied");
  check_host_chunk(chunk);
  chunk.master.view({-1}).copy_(update.old_master);
  chunk.exp_avg.view({-1}).copy_(update.old_exp_avg);
  chunk.exp_avg_sq.view({-1}).copy_(update.old_exp_avg_sq);
  update.state = SpeculativeUpdate::State::kUndone;
}

}  // namespace patrickstar
