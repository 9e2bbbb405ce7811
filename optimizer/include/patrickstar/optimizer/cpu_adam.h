// The host Adam kernels: one pass over a chunk's contiguous payloads (fp32 master, momentum,
// variance and either the half param/grad slot or a separate fp32 gradient), plus the fused
// gradient check (non-finite + squared L2 norm) and the half-from-master rewrite.
//
// Choice and figures (benchmarks/micro/adam_bench.cpp): Google Highway with dynamic dispatch
// (AVX-512, AVX2, SSE4, NEON, SVE... from one source; the target is chosen at first call on the
// running CPU, see cpu_adam_simd_target()); the lane-wise math mirrors adam_update() in adam_rule.h
// exactly (fma where torch fuses, true division, IEEE sqrt; the library builds with
// -ffp-contract=off so the compiler adds no fusion of its own). The tail of a range goes through
// the same vector code on a padded stack copy, so every element sees identical arithmetic.
// Threads: at::parallel_for over at::get_num_threads() static blocks whose boundaries are aligned
// to 64 elements (a multiple of every vector width and of a cache line), i.e. LibTorch's own
// OpenMP pool, so one OpenMP runtime serves torch and us. No allocation or lock inside the loops.
//
// Thread-safety: the functions are reentrant; concurrent calls on disjoint chunks are fine. The
// caller owns every buffer; nothing is retained.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "patrickstar/optimizer/adam_rule.h"

namespace patrickstar {

// The 16-bit format of the param/grad slot in mixed precision.
enum class HalfFormat : uint8_t { kBFloat16, kFloat16 };

// Squared L2 norm of one chunk's gradient, accumulated in double. Any Inf/NaN element makes it
// non-finite (squares of finite floats cannot overflow a double), so one number answers both
// "overflow?" and "norm?". Sum over chunks with operator+=.
struct GradStats {
  double sum_squares = 0.0;
  bool finite() const { return std::isfinite(sum_squares); }
  GradStats& operator+=(const GradStats& other) {
    sum_squares += other.sum_squares;
    return *this;
  }
};

// ---- raw-pointer kernels (what the engine calls on chunk payloads) ----

// Mixed precision: `half_param_grad` holds the gradient on entry and the new half weight (the
// rounding of the new fp32 master) on return. All pointers cover `numel` elements, no overlap.
void cpu_adam_mixed(uint16_t* half_param_grad, HalfFormat format, float* master, float* exp_avg,
                    float* exp_avg_sq, int64_t numel, const AdamStepConstants& constants);

// All fp32: the parameter is the master; the gradient has its own buffer (read only).
void cpu_adam_fp32(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                   int64_t numel, const AdamStepConstants& constants);

// One read of the gradient: its squared norm (non-finite if any element is).
GradStats cpu_grad_stats_half(const uint16_t* grad, HalfFormat format, int64_t numel);
GradStats cpu_grad_stats_fp32(const float* grad, int64_t numel);

// Rewrites the half slot with the rounding of the fp32 master (after an overflowed backward, the
// slot holds gradients; this puts the weights back).
void cpu_restore_half_from_master(uint16_t* half_param, HalfFormat format, const float* master,
                                  int64_t numel);

// The bandwidth probe the benchmarks compare Adam with: adds 1 to every element in place, with the
// same SIMD target and thread split as the kernels above (one read and one write per element).
void cpu_memory_rmw(float* data, int64_t numel);

// Name of the Highway target the dispatcher picked on this CPU (e.g. "AVX3", "AVX2", "NEON").
const char* cpu_adam_simd_target();

// ---- at::Tensor wrappers: check dtype/device/contiguity/sizes, then call the kernels above ----

// half_param_grad: kBFloat16 or kHalf; master/exp_avg/exp_avg_sq: kFloat; all CPU, contiguous,
// same numel.
void adam_step_mixed(const at::Tensor& half_param_grad, const at::Tensor& master,
                     const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                     const AdamStepConstants& constants);
void adam_step_fp32(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const AdamStepConstants& constants);
// grad: kBFloat16, kHalf or kFloat, CPU, contiguous.
GradStats grad_stats(const at::Tensor& grad);
void restore_half_from_master(const at::Tensor& half_param, const at::Tensor& master);

}  // namespace patrickstar
