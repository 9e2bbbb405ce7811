// The host Adam kernels: one pass over a chunk's contiguous payloads (fp32 master, momentum,
// variance and either the half param/grad slot or a separate fp32 gradient), plus the fused
// gradient check (non-finite + squared L2 norm) and the half-from-master rewrite.
//
// Choice: Google Highway 1.0 with dynamic dispatch (AVX-512, AVX2, SSE4, NEON, SVE... from one
// source; the target is picked at the first call on the running CPU, see cpu_adam_simd_target()).
// Hand-written intrinsics only where Highway 1.0 has no operation for an instruction the CPU has:
// the AVX512-BF16 conversion (optimizer/src/cpu_adam_avx512bf16.h), used for the kernels that
// store bf16 where Highway dispatches its AVX3 target on a CPU with it, same bits. The lane-wise
// math is adam_update() of adam_rule.h exactly: fma where torch fuses (on targets without FMA, SSE4
// and older, per-lane std::fma keeps it exact), true division, IEEE sqrt (Highway's Sqrt: an
// instruction, no errno); the library builds with -ffp-contract=off so the compiler adds no fusion
// of its own. bf16 rounding is done on the bits (Highway 1.0's DemoteTo truncates); fp16 uses the
// hardware conversion where it rounds to nearest even (F16C, Arm) and a per-lane conversion
// elsewhere. The tail of a range goes through the same vector code on a zero-padded stack copy, so
// every element sees identical arithmetic; a unit test checks every target this CPU supports
// against the scalar rule, bit for bit. Threads: at::parallel_for over at::get_num_threads() static
// blocks whose boundaries are aligned to 64 elements (a multiple of every vector width and of a
// cache line), i.e. LibTorch's own OpenMP pool (cpu_adam.cpp is compiled with -fopenmp for that).
// No allocation or lock in loops.
//
// Figures: BENCHMARKS.md, "The host Adam against the memory stream"
// (benchmarks/micro/adam_bench.cpp, 64M parameters, interleaved medians against ATen's fused fp32
// kernel and a read-modify-write stream of the same threads, per SIMD target).
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

// The same two with momentum and variance stored in bf16 (raw bits): adam_update_stored() of
// adam_rule.h per element (the update in fp32, the stored moments rounded to nearest even once).
void cpu_adam_mixed(uint16_t* half_param_grad, HalfFormat format, float* master, uint16_t* exp_avg,
                    uint16_t* exp_avg_sq, int64_t numel, const AdamStepConstants& constants);
void cpu_adam_fp32(float* param, const float* grad, uint16_t* exp_avg, uint16_t* exp_avg_sq,
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

// How many threads the kernels split a chunk over when called from the calling thread (LibTorch's
// OpenMP pool sizes itself per thread): an optimizer thread that runs beside the training thread
// takes its own share of the cores. Results do not depend on it (the update is element-wise; a
// gradient's statistics do, which is why the step computes them on one thread).
void cpu_adam_threads_on_this_thread(int threads);

// Name of the Highway target the dispatcher picked on this CPU (e.g. "AVX3", "AVX2", "NEON"), and
// "AVX3+BF16" where the kernels that store bf16 use the AVX512-BF16 conversion (below).
const char* cpu_adam_simd_target();

// Where the CPU has AVX512-BF16 and Highway's AVX3 target is dispatched, the kernels that store
// bf16 (the half weight, bf16 states) convert with VCVTNEPS2BF16, one instruction for the eight of
// the bit-pattern rounding, with the same bits (NaNs and denormals take the bit rule). On by
// default; off runs Highway's kernels there too (the benchmarks compare the two). Not thread-safe
// against kernels running.
void cpu_adam_use_bf16_conversions(bool on);

// ---- at::Tensor wrappers: check dtype/device/contiguity/sizes, then call the kernels above ----

// half_param_grad: kBFloat16 or kHalf; master: kFloat; exp_avg/exp_avg_sq: both kFloat or both
// kBFloat16 (bf16 states, see above); all CPU, contiguous, same numel.
void adam_step_mixed(const at::Tensor& half_param_grad, const at::Tensor& master,
                     const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                     const AdamStepConstants& constants);
void adam_step_fp32(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const AdamStepConstants& constants);
// grad: kBFloat16, kHalf or kFloat, CPU, contiguous.
GradStats grad_stats(const at::Tensor& grad);
void restore_half_from_master(const at::Tensor& half_param, const at::Tensor& master);

}  // namespace patrickstar
