// The one Adam / AdamW update rule, for one element, shared by the CPU SIMD kernel (which mirrors
// it lane-wise, see cpu_adam.h) and the CUDA kernel (which calls it per element, see adam_cuda.h).
// Pure functions on values: thread-safe, no ownership. Usable from C++ and CUDA (PS_HOST_DEVICE).
//
// The arithmetic order copies what torch::optim::Adam / AdamW run on CPU in LibTorch 2.11, so that
// fp32 results agree to rounding (checked in tests/optimizer/adam_test.cpp):
//   AdamW:  p = p * (1 - lr*wd)                              (torch: p.mul_)
//   Adam:   g = fma(p, wd, g)                                (torch: grad.add(p, wd), vectorized
//   fmadd) m = fma(g, 1-beta1, m*beta1)                             (exp_avg.mul_(b1).add_(g,
//   1-b1)) v = fma((1-beta2)*g, g, v*beta2) (exp_avg_sq.mul_(b2).addcmul_(g, g, 1-b2)) denom =
//   sqrt(v) / sqrt(1-beta2^t) + eps                  (true division, as torch's div) p = p + (-(lr
//   / (1-beta1^t)) * m) / denom                (p.addcdiv_(m, denom, -step_size))
// One deliberate difference: torch's vectorized CPU sqrt (AVX-512 build of 2.11) is not correctly
// rounded (about 0.6% of results 1 ulp off); ours is IEEE sqrt. With an exact sqrt put into
// torch's op sequence, the results are bit-identical (tests/optimizer/adam_test.cpp).
// The per-step scalars are computed in double on the host and rounded to float once, as torch does
// when it passes double Scalars to float kernels. The gradient is first multiplied by
// grad_multiplier = clip_coef / loss_scale (exact for power-of-two scales).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define PS_HOST_DEVICE __host__ __device__
#else
#define PS_HOST_DEVICE
#endif

namespace patrickstar {

// Per-step constants of the rule, computed on the host once per step (make_adam_step_constants) and
// passed by value to every kernel. All fields are plain floats so the struct can cross to a device.
struct AdamStepConstants {
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float one_minus_beta1 = 0.1f;
  float one_minus_beta2 = 0.001f;
  float neg_step_size = -1e-3f;        // -(lr / (1 - beta1^step))
  float bias_correction2_sqrt = 1.0f;  // sqrt(1 - beta2^step)
  float eps = 1e-8f;
  float l2_weight_decay = 0.0f;         // Adam (coupled): added to the gradient; 0 for AdamW
  float decoupled_decay_factor = 1.0f;  // AdamW: 1 - lr * weight_decay; 1 for Adam
  float grad_multiplier = 1.0f;         // clip_coef / loss_scale, applied to the raw gradient
};

// Builds the constants of step `step` (1-based, as torch counts). `decoupled` selects AdamW.
// Doubles in, rounded to float once, matching torch::optim's Scalar handling.
inline AdamStepConstants make_adam_step_constants(double lr, double beta1, double beta2, double eps,
                                                  double weight_decay, bool decoupled, int64_t step,
                                                  double grad_multiplier = 1.0) {
  AdamStepConstants c;
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  c.beta1 = static_cast<float>(beta1);
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.neg_step_size = static_cast<float>(-(lr / bias_correction1));
  c.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  c.eps = static_cast<float>(eps);
  c.l2_weight_decay = decoupled ? 0.0f : static_cast<float>(weight_decay);
  c.decoupled_decay_factor = decoupled ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  c.grad_multiplier = static_cast<float>(grad_multiplier);
  return c;
}

// One element of Adam/AdamW: updates master weight p, momentum m and variance v in place from the
// raw gradient (still multiplied by the loss scale; the rule removes it via grad_multiplier).
PS_HOST_DEVICE inline void adam_update(float& p, float& m, float& v, float raw_grad,
                                       const AdamStepConstants& c) {
  float g = raw_grad * c.grad_multiplier;
  if (c.l2_weight_decay != 0.0f) g = fmaf(p, c.l2_weight_decay, g);
  if (c.decoupled_decay_factor != 1.0f) p = p * c.decoupled_decay_factor;
  m = fmaf(g, c.one_minus_beta1, m * c.beta1);
  v = fmaf(c.one_minus_beta2 * g, g, v * c.beta2);
  const float denom = sqrtf(v) / c.bias_correction2_sqrt + c.eps;
  p = p + (c.neg_step_size * m) / denom;
}

// ---- Half formats as raw 16-bit patterns, rounded to nearest even exactly like c10::Half /
// c10::BFloat16 (NaN -> 0x7FC0 for bf16, quiet NaN keeping the sign for fp16). ----

PS_HOST_DEVICE inline uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

PS_HOST_DEVICE inline float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

PS_HOST_DEVICE inline float bf16_to_float(uint16_t h) {
  return bits_float(uint32_t{h} << 16);
}

PS_HOST_DEVICE inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

PS_HOST_DEVICE inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return bits_float(sign | float_bits(magnitude));
  }
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

PS_HOST_DEVICE inline uint16_t float_to_fp16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00;   // NaN
  if (magnitude >= 0x477ff000u) return sign | 0x7c00;  // rounds to >= 65520: infinity
  if (magnitude < 0x38800000u) {
    // Below 2^-14: a half subnormal. Adding 0.5f rounds |f| to a multiple of 2^-24 (the float ulp
    // at 0.5 equals the half subnormal step), to nearest even, in the float adder.
    const float rounded = bits_float(magnitude) + 0.5f;
    return sign | static_cast<uint16_t>(float_bits(rounded) - 0x3f000000u);
  }
  const uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);
  return sign | static_cast<uint16_t>((rounded - 0x38000000u) >> 13);
}

// ---- Stored optimizer states: fp32, or bf16 ("state_dtype": "bf16", 2 bytes each for momentum and
// variance). A bf16 state is widened to fp32 (exact), the update runs in fp32 exactly as
// adam_update(), the weight moves with the unrounded fp32 moments, and only the stored moments are
// rounded to bf16, once per step, to nearest even (c10::BFloat16's rule). ----

PS_HOST_DEVICE inline float state_to_float(float s) {
  return s;
}
PS_HOST_DEVICE inline float state_to_float(uint16_t s) {
  return bf16_to_float(s);
}
PS_HOST_DEVICE inline void store_state(float& s, float f) {
  s = f;
}
PS_HOST_DEVICE inline void store_state(uint16_t& s, float f) {
  s = float_to_bf16(f);
}

// adam_update() on stored states of type S (float, or uint16_t holding bf16 bits).
template <typename S>
PS_HOST_DEVICE inline void adam_update_stored(float& p, S& m, S& v, float raw_grad,
                                              const AdamStepConstants& c) {
  float mf = state_to_float(m);
  float vf = state_to_float(v);
  adam_update(p, mf, vf, raw_grad, c);
  store_state(m, mf);
  store_state(v, vf);
}

}  // namespace patrickstar
