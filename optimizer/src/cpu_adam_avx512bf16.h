// Private to optimizer/src: the host Adam kernels whose bf16 stores use the AVX512-BF16 conversion
// (VCVTNEPS2BF16), for x86-64 CPUs that have it (AMD Zen 4 and later, Intel Cooper Lake and
// Sapphire Rapids and later). The conversion is one instruction where the bit-pattern rounding of
// cpu_adam.cpp takes eight, and on a CPU that executes 512-bit vectors in two halves (Zen 4) those
// eight were a third of the mixed kernel's work. The results are the same bits: the instruction
// rounds to nearest even as c10::BFloat16 does, and a vector holding a NaN or a denormal (which
// the instruction quiets with its payload, or flushes to zero) is converted by the bit-pattern
// rule instead. The arithmetic is adam_rule.h's, in the same order as cpu_adam.cpp's AdamVec.
// cpu_adam.cpp calls these in place of its Highway kernels where Highway's AVX3 target is the
// chosen one and avx512bf16_usable() holds; the bit-for-bit tests over every SIMD target cover
// them there.
#pragma once

#include <cstdint>

#include "patrickstar/optimizer/adam_rule.h"

namespace patrickstar::detail {

// The CPU has AVX512F, BW, VL, DQ and BF16, and the OS saves the AVX-512 registers. False on other
// architectures and compilers.
bool avx512bf16_usable();

// cpu_adam.h's kernels for one range, bf16 half slot (mixed) or fp32 gradient; momentum and
// variance fp32 or bf16 bits. Call only where avx512bf16_usable().
void adam_mixed_bf16_avx512bf16(uint16_t* half, float* p, float* m, float* v, int64_t n,
                                const AdamStepConstants& c);
void adam_mixed_bf16_avx512bf16(uint16_t* half, float* p, uint16_t* m, uint16_t* v, int64_t n,
                                const AdamStepConstants& c);
void adam_fp32_avx512bf16(float* p, const float* g, uint16_t* m, uint16_t* v, int64_t n,
                          const AdamStepConstants& c);
void half_from_master_avx512bf16(uint16_t* half, const float* p, int64_t n);

}  // namespace patrickstar::detail
