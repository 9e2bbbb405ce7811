// The 16-bit conversions of adam_rule.h (used by the CUDA kernel and the kernels' tails) and the
// SIMD half-from-master rewrite, against c10::Half / c10::BFloat16 rounding.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstring>
#include <random>

#include "optimizer_test_util.h"
#include "patrickstar/optimizer/adam_rule.h"
#include "patrickstar/optimizer/cpu_adam.h"

namespace patrickstar {
namespace half_conversion_test {

uint16_t bits_of(c10::Half h) {
  return h.x;
}
uint16_t bits_of(c10::BFloat16 h) {
  return h.x;
}

TEST(HalfConversion, ScalarMatchesC10OnRandomAndEdgeBitPatterns) {
  std::mt19937 rng(1);
  std::vector<float> values = {0.0f,
                               -0.0f,
                               1.0f,
                               65504.0f,
                               65519.99f,
                               65520.0f,
                               1e-8f,
                               6e-8f,
                               3e-8f,
                               2.98e-8f,
                               6.1035156e-5f,
                               6.1e-5f,
                               1e30f,
                               -1e-30f,
                               std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::denorm_min()};
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = rng();
    float f;
    std::memcpy(&f, &u, 4);
    if (std::isnan(f)) continue;
    values.push_back(f);
    values.push_back(std::ldexp(static_cast<float>(rng() % 100000) / 1e5f, -(int)(rng() % 30)));
  }
  for (const float f : values) {
    ASSERT_EQ(float_to_fp16(f), bits_of(c10::Half(f))) << f;
    ASSERT_EQ(float_to_bf16(f), bits_of(c10::BFloat16(f))) << f;
    const uint16_t h = float_to_fp16(f);
    ASSERT_EQ(float_bits(fp16_to_float(h)), float_bits(static_cast<float>(c10::Half(f)))) << f;
  }
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::quiet_NaN()), 0x7fc0);
  EXPECT_TRUE(std::isnan(fp16_to_float(float_to_fp16(std::nanf("")))));
}

TEST(HalfConversion, RestoreHalfFromMasterIsTorchRounding) {
  torch::manual_seed(2);
  for (const int64_t n : {1, 7, 100003}) {
    // Normal values, fp16 subnormals and values near fp16's overflow edge.
    auto master =
        torch::cat({torch::randn({n}), torch::randn({n}) * 1e-6, torch::randn({n}) * 6e4});
    for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
      auto half = torch::zeros({master.numel()}, dtype);
      restore_half_from_master(half, master);
      EXPECT_TRUE(testing::bit_equal(half, master.to(dtype))) << dtype << " n=" << n;
    }
  }
}

}  // namespace half_conversion_test
}  // namespace patrickstar
