#include "cpu_adam_avx512bf16.h"

#include <c10/util/Exception.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PS_AVX512BF16_KERNELS 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define PS_AVX512BF16_KERNELS 0
#endif

namespace patrickstar::detail {

#if PS_AVX512BF16_KERNELS

// GCC 12's AVX-512 intrinsics start their results from _mm512_undefined_*(), a self-initialized
// variable that -Wmaybe-uninitialized reports once they are inlined here (a known false positive).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace {

#define PS_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

constexpr int kLanes = 16;

PS_TARGET inline __mmask16 tail_mask(int64_t count) {
  return count >= kLanes ? static_cast<__mmask16>(0xFFFF)
                         : static_cast<__mmask16>((1u << count) - 1u);
}

PS_TARGET inline __m512 load_f32(const float* src, __mmask16 mask) {
  return _mm512_maskz_loadu_ps(mask, src);
}
PS_TARGET inline void store_f32(float* dst, __m512 f, __mmask16 mask) {
  _mm512_mask_storeu_ps(dst, mask, f);
}

// bf16 bits widened exactly: the 16 bits become the high half of the fp32 pattern.
PS_TARGET inline __m512 load_bf16(const uint16_t* src, __mmask16 mask) {
  const __m256i bits = _mm256_maskz_loadu_epi16(mask, src);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// c10::BFloat16's rule on the bit pattern (cpu_adam.cpp's StoreBf16): round to nearest even,
// NaN -> 0x7FC0.
PS_TARGET inline __m256i bf16_by_bits(__m512 f) {
  const __m512i bits = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb);
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(rounded);
}

// The same bits through VCVTNEPS2BF16 (round to nearest even), unless a lane is a NaN or a nonzero
// denormal, which the instruction would not treat as the rule does.
PS_TARGET inline void store_bf16(uint16_t* dst, __m512 f, __mmask16 mask) {
  // VFPCLASSPS: quiet NaN (0x01), denormal (0x20), signaling NaN (0x80), in one instruction.
  const __mmask16 special = _mm512_fpclass_ps_mask(f, 0xA1);
  __m256i out;
  if (__builtin_expect(special != 0, 0)) {
    out = bf16_by_bits(f);
  } else {
    out = (__m256i)_mm512_cvtneps_pbh(f);  // NOLINT: a vector type's bits as another's
  }
  _mm256_mask_storeu_epi16(dst, mask, out);
}

PS_TARGET inline __m512 load_state(const float* s, __mmask16 mask) {
  return load_f32(s, mask);
}
PS_TARGET inline __m512 load_state(const uint16_t* s, __mmask16 mask) {
  return load_bf16(s, mask);
}
PS_TARGET inline void store_state(float* s, __m512 f, __mmask16 mask) {
  store_f32(s, f, mask);
}
PS_TARGET inline void store_state(uint16_t* s, __m512 f, __mmask16 mask) {
  store_bf16(s, f, mask);
}

// adam_rule.h's update, lane-wise, in cpu_adam.cpp's AdamVec order (fma where it fuses).
PS_TARGET inline void adam_lanes(__m512& p, __m512& m, __m512& v, __m512 g,
                                 const AdamStepConstants& c) {
  g = _mm512_mul_ps(g, _mm512_set1_ps(c.grad_multiplier));
  if (c.l2_weight_decay != 0.0f) g = _mm512_fmadd_ps(p, _mm512_set1_ps(c.l2_weight_decay), g);
  if (c.decoupled_decay_factor != 1.0f)
    p = _mm512_mul_ps(p, _mm512_set1_ps(c.decoupled_decay_factor));
  m = _mm512_fmadd_ps(g, _mm512_set1_ps(c.one_minus_beta1),
                      _mm512_mul_ps(m, _mm512_set1_ps(c.beta1)));
  v = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(c.one_minus_beta2), g), g,
                      _mm512_mul_ps(v, _mm512_set1_ps(c.beta2)));
  const __m512 denom =
      _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), _mm512_set1_ps(c.bias_correction2_sqrt)),
                    _mm512_set1_ps(c.eps));
  p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(c.neg_step_size), m), denom));
}

// Mixed: the bf16 slot holds the gradient on entry and the new weight's rounding on return.
template <typename S>
PS_TARGET void mixed_range(uint16_t* half, float* p, S* m, S* v, int64_t n,
                           const AdamStepConstants& c) {
  int64_t i = 0;
  const __mmask16 all = 0xFFFF;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    __m512 p0 = load_f32(p + i, all), p1 = load_f32(p + i + kLanes, all);
    __m512 m0 = load_state(m + i, all), m1 = load_state(m + i + kLanes, all);
    __m512 v0 = load_state(v + i, all), v1 = load_state(v + i + kLanes, all);
    const __m512 g0 = load_bf16(half + i, all), g1 = load_bf16(half + i + kLanes, all);
    adam_lanes(p0, m0, v0, g0, c);
    adam_lanes(p1, m1, v1, g1, c);
    store_f32(p + i, p0, all);
    store_f32(p + i + kLanes, p1, all);
    store_state(m + i, m0, all);
    store_state(m + i + kLanes, m1, all);
    store_state(v + i, v0, all);
    store_state(v + i + kLanes, v1, all);
    store_bf16(half + i, p0, all);
    store_bf16(half + i + kLanes, p1, all);
  }
  for (; i < n; i += kLanes) {
    const __mmask16 mask = tail_mask(n - i);
    __m512 pv = load_f32(p + i, mask);
    __m512 mv = load_state(m + i, mask);
    __m512 vv = load_state(v + i, mask);
    adam_lanes(pv, mv, vv, load_bf16(half + i, mask), c);
    store_f32(p + i, pv, mask);
    store_state(m + i, mv, mask);
    store_state(v + i, vv, mask);
    store_bf16(half + i, pv, mask);
  }
}

PS_TARGET void fp32_range(float* p, const float* g, uint16_t* m, uint16_t* v, int64_t n,
                          const AdamStepConstants& c) {
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 mask = tail_mask(n - i);
    __m512 pv = load_f32(p + i, mask);
    __m512 mv = load_bf16(m + i, mask);
    __m512 vv = load_bf16(v + i, mask);
    adam_lanes(pv, mv, vv, load_f32(g + i, mask), c);
    store_f32(p + i, pv, mask);
    store_bf16(m + i, mv, mask);
    store_bf16(v + i, vv, mask);
  }
}

PS_TARGET void half_range(uint16_t* half, const float* p, int64_t n) {
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 mask = tail_mask(n - i);
    store_bf16(half + i, load_f32(p + i, mask), mask);
  }
}

#undef PS_TARGET

bool detect() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
  const bool f = (ebx & (1u << 16)) != 0, dq = (ebx & (1u << 17)) != 0;
  const bool bw = (ebx & (1u << 30)) != 0, vl = (ebx & (1u << 31)) != 0;
  if (!(f && dq && bw && vl)) return false;
  if (__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) == 0) return false;
  if ((eax & (1u << 5)) == 0) return false;  // AVX512_BF16
  // The OS saves the registers: XCR0 has SSE, AVX, opmask, ZMM_Hi256 and Hi16_ZMM set.
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0 || (ecx & (1u << 27)) == 0) return false;
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo & 0xE6u) == 0xE6u;
}

}  // namespace

bool avx512bf16_usable() {
  static const bool usable = detect();
  return usable;
}

void adam_mixed_bf16_avx512bf16(uint16_t* half, float* p, float* m, float* v, int64_t n,
                                const AdamStepConstants& c) {
  mixed_range(half, p, m, v, n, c);
}
void adam_mixed_bf16_avx512bf16(uint16_t* half, float* p, uint16_t* m, uint16_t* v, int64_t n,
                                const AdamStepConstants& c) {
  mixed_range(half, p, m, v, n, c);
}
void adam_fp32_avx512bf16(float* p, const float* g, uint16_t* m, uint16_t* v, int64_t n,
                          const AdamStepConstants& c) {
  fp32_range(p, g, m, v, n, c);
}
void half_from_master_avx512bf16(uint16_t* half, const float* p, int64_t n) {
  half_range(half, p, n);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#else  // not x86-64 with GCC or clang: never usable, never called

bool avx512bf16_usable() {
  return false;
}
void adam_mixed_bf16_avx512bf16(uint16_t*, float*, float*, float*, int64_t,
                                const AdamStepConstants&) {
  TORCH_INTERNAL_ASSERT(false, "AVX512-BF16 kernels are not built here");
}
void adam_mixed_bf16_avx512bf16(uint16_t*, float*, uint16_t*, uint16_t*, int64_t,
                                const AdamStepConstants&) {
  TORCH_INTERNAL_ASSERT(false, "AVX512-BF16 kernels are not built here");
}
void adam_fp32_avx512bf16(float*, const float*, uint16_t*, uint16_t*, int64_t,
                          const AdamStepConstants&) {
  TORCH_INTERNAL_ASSERT(false, "AVX512-BF16 kernels are not built here");
}
void half_from_master_avx512bf16(uint16_t*, const float*, int64_t) {
  TORCH_INTERNAL_ASSERT(false, "AVX512-BF16 kernels are not built here");
}

#endif

}  // namespace patrickstar::detail
