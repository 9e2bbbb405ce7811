// Host Adam kernels with Highway dynamic dispatch: this file is compiled once per SIMD target by
// hwy/foreach_target.h (it includes itself); the HWY_ONCE part at the end holds the dispatchers,
// the thread split and the at::Tensor wrappers. See cpu_adam.h for the contract.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/cpu_adam.cpp"
#include <hwy/foreach_target.h>  // must come before highway.h
#include <hwy/highway.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>

#include "patrickstar/optimizer/adam_rule.h"

// Whether hwy's float->fp16 DemoteTo on this target is the hardware conversion (round to nearest
// even, as c10::Half). Elsewhere Highway 1.0 emulates it by truncation, so we convert per lane.
// (Re-evaluated for every target: this file is included once per target.)
#undef PS_HWY_FP16_DEMOTE_IS_RNE
#if (HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)) || \
    (HWY_ARCH_ARM_A64 && HWY_TARGET != HWY_EMU128 && HWY_TARGET != HWY_SCALAR)
#define PS_HWY_FP16_DEMOTE_IS_RNE 1
#else
#define PS_HWY_FP16_DEMOTE_IS_RNE 0
#endif

HWY_BEFORE_NAMESPACE();
namespace patrickstar {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;
// Largest number of float lanes of this target: the size of the padded tail buffers.
constexpr size_t kMaxFloatLanes = HWY_MAX_BYTES / sizeof(float);

// The last `tail` (< one vector) elements of arrays of any element type, through zero-padded
// copies one full vector long, so the vector code never touches memory past the end: copies in,
// `vectors(copies...)` over one vector, and copies back into the arrays that are not const.
template <typename T>
struct PaddedLanes {
  HWY_ALIGN std::remove_const_t<T> data[kMaxFloatLanes] = {};
};
template <typename T>
void CopyBack(T* dst, const T* src, size_t n) {
  std::memcpy(dst, src, n * sizeof(T));
}
template <typename T>
void CopyBack(const T* /*dst*/, const T* /*src*/, size_t /*n*/) {}
template <typename Fn, typename... T>
HWY_INLINE void PaddedTail(size_t body, size_t tail, Fn&& vectors, T*... arrays) {
  std::tuple<PaddedLanes<T>...> pads;
  std::apply(
      [&](auto&... pad) {
        (std::memcpy(pad.data, arrays + body, tail * sizeof(T)), ...);
        vectors(pad.data...);
        (CopyBack(arrays + body, pad.data, tail), ...);
      },
      pads);
}

// a * b + c rounded once, as fmaf. Highway's MulAdd is two roundings on targets without FMA
// (SSSE3, SSE4, the scalar baseline); there each lane goes through std::fma instead: slow, but
// those targets only serve CPUs older than AVX2 and keep the results identical everywhere.
HWY_INLINE VF Fma(DF df, VF a, VF b, VF c) {
#if HWY_NATIVE_FMA
  (void)df;
  return hn::MulAdd(a, b, c);
#else
  HWY_ALIGN float la[kMaxFloatLanes];
  HWY_ALIGN float lb[kMaxFloatLanes];
  HWY_ALIGN float lc[kMaxFloatLanes];
  hn::Store(a, df, la);
  hn::Store(b, df, lb);
  hn::Store(c, df, lc);
  for (size_t i = 0; i < hn::Lanes(df); ++i) la[i] = std::fma(la[i], lb[i], lc[i]);
  return hn::Load(df, la);
#endif
}

// The rule of adam_rule.h, lane-wise; the same operations in the same order.
HWY_INLINE void AdamVec(DF df, VF& p, VF& m, VF& v, VF g, const AdamStepConstants& c) {
  g = hn::Mul(g, hn::Set(df, c.grad_multiplier));
  if (c.l2_weight_decay != 0.0f) g = Fma(df, p, hn::Set(df, c.l2_weight_decay), g);
  if (c.decoupled_decay_factor != 1.0f) p = hn::Mul(p, hn::Set(df, c.decoupled_decay_factor));
  m = Fma(df, g, hn::Set(df, c.one_minus_beta1), hn::Mul(m, hn::Set(df, c.beta1)));
  v = Fma(df, hn::Mul(hn::Set(df, c.one_minus_beta2), g), g, hn::Mul(v, hn::Set(df, c.beta2)));
  const VF denom =
      hn::Add(hn::Div(hn::Sqrt(v), hn::Set(df, c.bias_correction2_sqrt)), hn::Set(df, c.eps));
  p = hn::Add(p, hn::Div(hn::Mul(hn::Set(df, c.neg_step_size), m), denom));
}

// ---- half <-> float, Lanes(df) elements ----

template <class D>
HWY_INLINE hn::Vec<D> LoadBf16(D df, const uint16_t* HWY_RESTRICT src) {
  const hn::RebindToUnsigned<D> du32;
  const hn::Rebind<uint16_t, D> du16;
  return hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(du32, hn::LoadU(du16, src))));
}

template <class D>
HWY_INLINE hn::Vec<D> LoadFp16(D df, const uint16_t* HWY_RESTRICT src) {
  const hn::Rebind<hwy::float16_t, D> dh;
  return hn::PromoteTo(df, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(src)));
}

// Round to nearest even on the bit pattern, NaN -> 0x7FC0: c10::BFloat16's rule (Highway 1.0's
// DemoteTo truncates, so it is not used).
HWY_INLINE void StoreBf16(DF df, VF f, uint16_t* HWY_RESTRICT dst) {
  const hn::RebindToUnsigned<DF> du32;
  const hn::RebindToSigned<DF> di32;
  const hn::Rebind<uint16_t, DF> du16;
  const auto bits = hn::BitCast(du32, f);
  const auto bias =
      hn::Add(hn::Set(du32, 0x7fffu), hn::And(hn::ShiftRight<16>(bits), hn::Set(du32, 1u)));
  auto rounded = hn::ShiftRight<16>(hn::Add(bits, bias));
  rounded = hn::IfThenElse(hn::RebindMask(du32, hn::IsNaN(f)), hn::Set(du32, 0x7fc0u), rounded);
  hn::StoreU(hn::DemoteTo(du16, hn::BitCast(di32, rounded)), du16, dst);
}

HWY_INLINE void StoreFp16(DF df, VF f, uint16_t* HWY_RESTRICT dst) {
#if PS_HWY_FP16_DEMOTE_IS_RNE
  const hn::Rebind<hwy::float16_t, DF> dh;
  hn::StoreU(hn::DemoteTo(dh, f), dh, reinterpret_cast<hwy::float16_t*>(dst));
#else
  HWY_ALIGN float lanes[kMaxFloatLanes];
  hn::Store(f, df, lanes);
  const size_t n = hn::Lanes(df);
  for (size_t i = 0; i < n; ++i) dst[i] = float_to_fp16(lanes[i]);
#endif
}

// Momentum and variance as stored: fp32, or bf16 bits (rounded once per step, see adam_rule.h).
HWY_INLINE VF LoadState(DF df, const float* HWY_RESTRICT s) {
  return hn::LoadU(df, s);
}
HWY_INLINE VF LoadState(DF df, const uint16_t* HWY_RESTRICT s) {
  return LoadBf16(df, s);
}
HWY_INLINE void StoreState(DF df, VF f, float* HWY_RESTRICT s) {
  hn::StoreU(f, df, s);
}
HWY_INLINE void StoreState(DF df, VF f, uint16_t* HWY_RESTRICT s) {
  StoreBf16(df, f, s);
}

// ---- Adam over a range. Full vectors, then the tail through the same vector code on a zero-padded
// stack copy (so every element gets the identical instruction sequence). ----

template <bool kBf16, typename S>
HWY_INLINE void MixedVectors(DF df, uint16_t* HWY_RESTRICT half, float* HWY_RESTRICT p,
                             S* HWY_RESTRICT m, S* HWY_RESTRICT v, size_t n,
                             const AdamStepConstants& c) {
  const size_t lanes = hn::Lanes(df);
  for (size_t i = 0; i < n; i += lanes) {
    VF pv = hn::LoadU(df, p + i);
    VF mv = LoadState(df, m + i);
    VF vv = LoadState(df, v + i);
    const VF g = kBf16 ? LoadBf16(df, half + i) : LoadFp16(df, half + i);
    AdamVec(df, pv, mv, vv, g, c);
    hn::StoreU(pv, df, p + i);
    StoreState(df, mv, m + i);
    StoreState(df, vv, v + i);
    if (kBf16) {
      StoreBf16(df, pv, half + i);
    } else {
      StoreFp16(df, pv, half + i);
    }
  }
}

template <typename S>
HWY_INLINE void MixedRange(uint16_t* HWY_RESTRICT half, int32_t bf16, float* HWY_RESTRICT p,
                           S* HWY_RESTRICT m, S* HWY_RESTRICT v, int64_t numel,
                           const AdamStepConstants& c) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  const size_t n = static_cast<size_t>(numel);
  const size_t body = n - n % lanes;
  if (bf16) {
    MixedVectors<true>(df, half, p, m, v, body, c);
  } else {
    MixedVectors<false>(df, half, p, m, v, body, c);
  }
  const size_t tail = n - body;
  if (tail == 0) return;
  PaddedTail(
      body, tail,
      [&](uint16_t* th, float* tp, S* tm, S* tv) {
        if (bf16) {
          MixedVectors<true>(df, th, tp, tm, tv, lanes, c);
        } else {
          MixedVectors<false>(df, th, tp, tm, tv, lanes, c);
        }
      },
      half, p, m, v);
}

void AdamMixedRange(uint16_t* HWY_RESTRICT half, int32_t bf16, float* HWY_RESTRICT p,
                    float* HWY_RESTRICT m, float* HWY_RESTRICT v, int64_t numel,
                    const AdamStepConstants& c) {
  MixedRange(half, bf16, p, m, v, numel, c);
}

void AdamMixedRangeBf16States(uint16_t* HWY_RESTRICT half, int32_t bf16, float* HWY_RESTRICT p,
                              uint16_t* HWY_RESTRICT m, uint16_t* HWY_RESTRICT v, int64_t numel,
                              const AdamStepConstants& c) {
  MixedRange(half, bf16, p, m, v, numel, c);
}

template <typename S>
HWY_INLINE void Fp32Vectors(DF df, float* HWY_RESTRICT p, const float* HWY_RESTRICT g,
                            S* HWY_RESTRICT m, S* HWY_RESTRICT v, size_t n,
                            const AdamStepConstants& c) {
  const size_t lanes = hn::Lanes(df);
  for (size_t i = 0; i < n; i += lanes) {
    VF pv = hn::LoadU(df, p + i);
    VF mv = LoadState(df, m + i);
    VF vv = LoadState(df, v + i);
    AdamVec(df, pv, mv, vv, hn::LoadU(df, g + i), c);
    hn::StoreU(pv, df, p + i);
    StoreState(df, mv, m + i);
    StoreState(df, vv, v + i);
  }
}

template <typename S>
HWY_INLINE void Fp32Range(float* HWY_RESTRICT p, const float* HWY_RESTRICT g, S* HWY_RESTRICT m,
                          S* HWY_RESTRICT v, int64_t numel, const AdamStepConstants& c) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  const size_t n = static_cast<size_t>(numel);
  const size_t body = n - n % lanes;
  Fp32Vectors(df, p, g, m, v, body, c);
  const size_t tail = n - body;
  if (tail == 0) return;
  PaddedTail(
      body, tail,
      [&](float* tp, const float* tg, S* tm, S* tv) { Fp32Vectors(df, tp, tg, tm, tv, lanes, c); },
      p, g, m, v);
}

void AdamFp32Range(float* HWY_RESTRICT p, const float* HWY_RESTRICT g, float* HWY_RESTRICT m,
                   float* HWY_RESTRICT v, int64_t numel, const AdamStepConstants& c) {
  Fp32Range(p, g, m, v, numel, c);
}

void AdamFp32RangeBf16States(float* HWY_RESTRICT p, const float* HWY_RESTRICT g,
                             uint16_t* HWY_RESTRICT m, uint16_t* HWY_RESTRICT v, int64_t numel,
                             const AdamStepConstants& c) {
  Fp32Range(p, g, m, v, numel, c);
}

// ---- squared norm in double: Lanes(dd) elements per step, two accumulators ----

// format: 0 = fp32, 1 = bf16, 2 = fp16.
double SumSquaresRange(const void* HWY_RESTRICT grad, int32_t format, int64_t numel) {
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> dfh;
  const size_t lanes = hn::Lanes(dd);
  const size_t n = static_cast<size_t>(numel);
  auto acc0 = hn::Zero(dd);
  auto acc1 = hn::Zero(dd);
  size_t i = 0;
  const auto load = [&](size_t at) {
    if (format == 0) return hn::LoadU(dfh, static_cast<const float*>(grad) + at);
    if (format == 1) return LoadBf16(dfh, static_cast<const uint16_t*>(grad) + at);
    return LoadFp16(dfh, static_cast<const uint16_t*>(grad) + at);
  };
  for (; i + 2 * lanes <= n; i += 2 * lanes) {
    const auto a = hn::PromoteTo(dd, load(i));
    const auto b = hn::PromoteTo(dd, load(i + lanes));
    acc0 = hn::MulAdd(a, a, acc0);
    acc1 = hn::MulAdd(b, b, acc1);
  }
  double sum = hn::GetLane(hn::SumOfLanes(dd, hn::Add(acc0, acc1)));
  for (; i < n; ++i) {
    float x;
    if (format == 0) {
      x = static_cast<const float*>(grad)[i];
    } else if (format == 1) {
      x = bf16_to_float(static_cast<const uint16_t*>(grad)[i]);
    } else {
      x = fp16_to_float(static_cast<const uint16_t*>(grad)[i]);
    }
    sum += static_cast<double>(x) * static_cast<double>(x);
  }
  return sum;
}

void HalfFromMasterRange(uint16_t* HWY_RESTRICT half, int32_t bf16, const float* HWY_RESTRICT p,
                         int64_t numel) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  const size_t n = static_cast<size_t>(numel);
  size_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    if (bf16) {
      StoreBf16(df, hn::LoadU(df, p + i), half + i);
    } else {
      StoreFp16(df, hn::LoadU(df, p + i), half + i);
    }
  }
  for (; i < n; ++i) half[i] = bf16 ? float_to_bf16(p[i]) : float_to_fp16(p[i]);
}

void AddOneRange(float* HWY_RESTRICT data, int64_t numel) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  const size_t n = static_cast<size_t>(numel);
  const VF one = hn::Set(df, 1.0f);
  size_t i = 0;
  for (; i + lanes <= n; i += lanes)
    hn::StoreU(hn::Add(hn::LoadU(df, data + i), one), df, data + i);
  for (; i < n; ++i) data[i] += 1.0f;
}

const char* TargetName() {
  return hwy::TargetName(HWY_TARGET);
}

}  // namespace HWY_NAMESPACE
}  // namespace patrickstar
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

#include <ATen/Parallel.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

#include <algorithm>
#include <atomic>
#include <string_view>
#include <vector>

#include "patrickstar/optimizer/cpu_adam.h"
#include "src/cpu_adam_avx512bf16.h"

namespace patrickstar {

HWY_EXPORT(AdamMixedRange);
HWY_EXPORT(AdamFp32Range);
HWY_EXPORT(AdamMixedRangeBf16States);
HWY_EXPORT(AdamFp32RangeBf16States);
HWY_EXPORT(SumSquaresRange);
HWY_EXPORT(HalfFromMasterRange);
HWY_EXPORT(AddOneRange);
HWY_EXPORT(TargetName);

namespace {

// Block boundaries are multiples of this many elements: every vector width up to 2048 bits, and
// whole 64-byte lines for fp32 payloads.
constexpr int64_t kBlockAlignElems = 64;
// Below this many elements one thread does it all (thread wake-up would cost more).
constexpr int64_t kSerialBelowElems = 1 << 15;

struct BlockSplit {
  int64_t blocks = 1;
  int64_t block_elems = 0;
};

BlockSplit split_blocks(int64_t numel) {
  BlockSplit split;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  if (numel < kSerialBelowElems || threads == 1 || at::in_parallel_region()) {
    split.block_elems = numel;
    return split;
  }
  const int64_t per_thread = (numel + threads - 1) / threads;
  split.block_elems = (per_thread + kBlockAlignElems - 1) / kBlockAlignElems * kBlockAlignElems;
  split.blocks = (numel + split.block_elems - 1) / split.block_elems;
  return split;
}

// Runs fn(begin, end) over static aligned blocks, one per thread of LibTorch's pool.
template <class Fn>
void for_each_block(int64_t numel, const Fn& fn) {
  if (numel <= 0) return;
  const BlockSplit split = split_blocks(numel);
  if (split.blocks == 1) {
    fn(int64_t{0}, numel);
    return;
  }
  at::parallel_for(0, split.blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const int64_t begin = b * split.block_elems;
      fn(begin, std::min(numel, begin + split.block_elems));
    }
  });
}

// The AVX512-BF16 kernels (cpu_adam_avx512bf16.h) in place of Highway's for the ranges with bf16
// stores: where the CPU has the instruction and Highway's AVX3 target is the one dispatched (a test
// that points Highway at another target gets that target's kernels).
std::atomic<bool> g_bf16_conversions{true};

bool bf16_conversions() {
  return g_bf16_conversions.load(std::memory_order_relaxed) && detail::avx512bf16_usable() &&
         (hwy::SupportedTargets() & (HWY_AVX3 | HWY_AVX3_DL)) != 0;
}

// Makes Highway pick its target before any parallel region calls through the dispatch table.
void ensure_dispatch_ready() {
  static const char* const name = cpu_adam_simd_target();
  (void)name;
}

GradStats grad_stats_raw(const void* grad, int32_t format, int64_t numel, size_t elem_bytes) {
  ensure_dispatch_ready();
  GradStats stats;
  if (numel <= 0) return stats;
  const BlockSplit split = split_blocks(numel);
  if (split.blocks == 1) {
    stats.sum_squares = HWY_DYNAMIC_DISPATCH(SumSquaresRange)(grad, format, numel);
    return stats;
  }
  std::vector<double> partial(static_cast<size_t>(split.blocks), 0.0);  // before the loop
  const auto* bytes = static_cast<const unsigned char*>(grad);
  at::parallel_for(0, split.blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const int64_t begin = b * split.block_elems;
      const int64_t end = std::min(numel, begin + split.block_elems);
      partial[static_cast<size_t>(b)] = HWY_DYNAMIC_DISPATCH(SumSquaresRange)(
          bytes + static_cast<size_t>(begin) * elem_bytes, format, end - begin);
    }
  });
  for (const double s : partial) stats.sum_squares += s;  // fixed order: deterministic
  return stats;
}

int32_t format_code(HalfFormat format) {
  return format == HalfFormat::kBFloat16 ? 1 : 2;
}

}  // namespace

void cpu_adam_use_bf16_conversions(bool on) {
  g_bf16_conversions.store(on, std::memory_order_relaxed);
}

const char* cpu_adam_simd_target() {
  const char* name = HWY_DYNAMIC_DISPATCH(TargetName)();
  return bf16_conversions() && std::string_view(name) == "AVX3" ? "AVX3+BF16" : name;
}

void cpu_adam_mixed(uint16_t* half_param_grad, HalfFormat format, float* master, float* exp_avg,
                    float* exp_avg_sq, int64_t numel, const AdamStepConstants& constants) {
  ensure_dispatch_ready();
  const int32_t bf16 = format == HalfFormat::kBFloat16 ? 1 : 0;
  const bool hw = bf16 != 0 && bf16_conversions();
  for_each_block(numel, [&](int64_t begin, int64_t end) {
    if (hw) {
      detail::adam_mixed_bf16_avx512bf16(half_param_grad + begin, master + begin, exp_avg + begin,
                                         exp_avg_sq + begin, end - begin, constants);
      return;
    }
    HWY_DYNAMIC_DISPATCH(AdamMixedRange)
    (half_param_grad + begin, bf16, master + begin, exp_avg + begin, exp_avg_sq + begin,
     end - begin, constants);
  });
}

void cpu_adam_fp32(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                   int64_t numel, const AdamStepConstants& constants) {
  ensure_dispatch_ready();
  for_each_block(numel, [&](int64_t begin, int64_t end) {
    HWY_DYNAMIC_DISPATCH(AdamFp32Range)
    (param + begin, grad + begin, exp_avg + begin, exp_avg_sq + begin, end - begin, constants);
  });
}

void cpu_adam_mixed(uint16_t* half_param_grad, HalfFormat format, float* master, uint16_t* exp_avg,
                    uint16_t* exp_avg_sq, int64_t numel, const AdamStepConstants& constants) {
  ensure_dispatch_ready();
  const int32_t bf16 = format == HalfFormat::kBFloat16 ? 1 : 0;
  const bool hw = bf16 != 0 && bf16_conversions();
  for_each_block(numel, [&](int64_t begin, int64_t end) {
    if (hw) {
      detail::adam_mixed_bf16_avx512bf16(half_param_grad + begin, master + begin, exp_avg + begin,
                                         exp_avg_sq + begin, end - begin, constants);
      return;
    }
    HWY_DYNAMIC_DISPATCH(AdamMixedRangeBf16States)
    (half_param_grad + begin, bf16, master + begin, exp_avg + begin, exp_avg_sq + begin,
     end - begin, constants);
  });
}

void cpu_adam_fp32(float* param, const float* grad, uint16_t* exp_avg, uint16_t* exp_avg_sq,
                   int64_t numel, const AdamStepConstants& constants) {
  ensure_dispatch_ready();
  const bool hw = bf16_conversions();
  for_each_block(numel, [&](int64_t begin, int64_t end) {
    if (hw) {
      detail::adam_fp32_avx512bf16(param + begin, grad + begin, exp_avg + begin, exp_avg_sq + begin,
                                   end - begin, constants);
      return;
    }
    HWY_DYNAMIC_DISPATCH(AdamFp32RangeBf16States)
    (param + begin, grad + begin, exp_avg + begin, exp_avg_sq + begin, end - begin, constants);
  });
}

GradStats cpu_grad_stats_half(const uint16_t* grad, HalfFormat format, int64_t numel) {
  return grad_stats_raw(grad, format_code(format), numel, sizeof(uint16_t));
}

GradStats cpu_grad_stats_fp32(const float* grad, int64_t numel) {
  return grad_stats_raw(grad, 0, numel, sizeof(float));
}

void cpu_restore_half_from_master(uint16_t* half_param, HalfFormat format, const float* master,
                                  int64_t numel) {
  ensure_dispatch_ready();
  const int32_t bf16 = format == HalfFormat::kBFloat16 ? 1 : 0;
  const bool hw = bf16 != 0 && bf16_conversions();
  for_each_block(numel, [&](int64_t begin, int64_t end) {
    if (hw) {
      detail::half_from_master_avx512bf16(half_param + begin, master + begin, end - begin);
      return;
    }
    HWY_DYNAMIC_DISPATCH(HalfFromMasterRange)
    (half_param + begin, bf16, master + begin, end - begin);
  });
}

void cpu_adam_threads_on_this_thread(int threads) {
  TORCH_CHECK(threads > 0, "cpu_adam_threads_on_this_thread: ", threads, " threads");
  (void)at::get_num_threads();  // LibTorch's per-thread setup first, so that it does not undo this
#if defined(_OPENMP)
  omp_set_num_threads(threads);
#endif
}

void cpu_memory_rmw(float* data, int64_t numel) {
  ensure_dispatch_ready();
  for_each_block(numel, [&](int64_t begin, int64_t end) {
    HWY_DYNAMIC_DISPATCH(AddOneRange)(data + begin, end - begin);
  });
}

}  // namespace patrickstar

#endif  // HWY_ONCE
