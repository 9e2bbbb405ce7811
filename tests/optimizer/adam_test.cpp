// The update rule against torch::optim::Adam / AdamW over 20 steps: fp32 (separate fp32 gradient)
// and mixed precision (bf16 / fp16 gradient in the half slot, rewritten with the new half weight).
#include <gtest/gtest.h>
#include <hwy/targets.h>
#include <torch/torch.h>
#include <ATen/Version.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "optimizer_test_util.h"
#include "patrickstar/optimizer/adam_rule.h"
#include "patrickstar/optimizer/cpu_adam.h"

namespace patrickstar {
namespace adam_test {

using testing::bit_equal;
using testing::max_norm_rel_diff;

// ||a - b||_inf / max(||b||_inf, scale).
double max_diff_relative_to(const torch::Tensor& a, const torch::Tensor& b, double scale) {
  const double diff = (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
  return diff / std::max(b.abs().max().item<double>(), scale);
}

constexpr int kSteps = 20;
constexpr double kLr = 1e-2;
constexpr double kBeta1 = 0.9;
constexpr double kBeta2 = 0.99;
constexpr double kEps = 1e-8;
constexpr double kWeightDecay = 0.1;

enum class Mode { kFp32, kBf16, kFp16 };

std::string mode_name(Mode mode) {
  return mode == Mode::kFp32 ? "fp32" : (mode == Mode::kBf16 ? "bf16" : "fp16");
}

// Runs 20 steps of torch::optim and of our kernel on the same gradients, then compares.
class AdamVsTorch : public ::testing::TestWithParam<std::tuple<bool, Mode, int64_t>> {};

TEST_P(AdamVsTorch, TwentyStepsMatch) {
  const auto [decoupled, mode, numel] = GetParam();
  torch::manual_seed(1234 + numel);
  const auto init = torch::randn({numel});

  // torch's side.
  auto torch_param = init.clone().requires_grad_(true);
  std::unique_ptr<torch::optim::Optimizer> reference;
  if (decoupled) {
    reference = std::make_unique<torch::optim::AdamW>(std::vector<torch::Tensor>{torch_param},
                                                      torch::optim::AdamWOptions(kLr)
                                                          .betas({kBeta1, kBeta2})
                                                          .eps(kEps)
                                                          .weight_decay(kWeightDecay));
  } else {
    reference = std::make_unique<torch::optim::Adam>(std::vector<torch::Tensor>{torch_param},
                                                     torch::optim::AdamOptions(kLr)
                                                         .betas({kBeta1, kBeta2})
                                                         .eps(kEps)
                                                         .weight_decay(kWeightDecay));
  }

  // Ours: chunk-like flat buffers.
  auto master = init.clone();
  auto exp_avg = torch::zeros({numel});
  auto exp_avg_sq = torch::zeros({numel});
  const auto half_dtype = mode == Mode::kBf16 ? torch::kBFloat16 : torch::kHalf;
  auto half_slot = torch::empty({numel}, half_dtype);
  // A power-of-two loss scale in mixed modes: the rule divides it out by multiplying.
  const double loss_scale = mode == Mode::kFp32 ? 1.0 : 1024.0;

  double gradient_scale = 0;  // the largest gradient element of the 20 steps
  for (int step = 1; step <= kSteps; ++step) {
    const auto raw = torch::randn({numel}) * loss_scale;
    const auto constants = make_adam_step_constants(kLr, kBeta1, kBeta2, kEps, kWeightDecay,
                                                    decoupled, step, 1.0 / loss_scale);
    torch::Tensor reference_grad;
    const auto gradient_scale_of = [&] { return reference_grad.abs().max().item<double>(); };
    if (mode == Mode::kFp32) {
      reference_grad = raw.clone();
      adam_step_fp32(master, raw, exp_avg, exp_avg_sq, constants);
    } else {
      const auto half_grad = raw.to(half_dtype);
      half_slot.copy_(half_grad);  // backward writes the gradient over the half weight
      reference_grad = half_grad.to(torch::kFloat) * static_cast<float>(1.0 / loss_scale);
      adam_step_mixed(half_slot, master, exp_avg, exp_avg_sq, constants);
      // The half slot now holds the rounding of the new master, bit for bit.
      ASSERT_TRUE(bit_equal(half_slot, master.to(half_dtype)))
          << mode_name(mode) << " step " << step;
    }
    torch_param.mutable_grad() = reference_grad;
    gradient_scale = std::max(gradient_scale, gradient_scale_of());
    reference->step();
  }

  auto& state = reference->state().at(torch_param.unsafeGetTensorImpl());
  torch::Tensor ref_exp_avg, ref_exp_avg_sq;
  if (decoupled) {
    auto& s = static_cast<torch::optim::AdamWParamState&>(*state);
    ref_exp_avg = s.exp_avg();
    ref_exp_avg_sq = s.exp_avg_sq();
  } else {
    auto& s = static_cast<torch::optim::AdamParamState&>(*state);
    ref_exp_avg = s.exp_avg();
    ref_exp_avg_sq = s.exp_avg_sq();
  }
  const auto param = torch_param.detach();
  // Max relative difference = ||ours - torch||_inf / ||torch||_inf. What holds on every CPU: torch's
  // vectorized CPU kernels (sqrt, division) are not correctly rounded and how often they are an
  // ulp off depends on the kernel the CPU dispatches (AVX2, AVX-512, with or without bf16/VNNI), so
  // only the norm-wise bound is asserted here, never a count of differing elements; the bit-exact
  // comparison with torch's op sequence is TorchOpsWithExactSqrtBitwise below.
  // The moments are averages of gradients that can cancel (one element: the average may be far
  // smaller than the gradients), so their difference is measured against the gradients' scale.
  EXPECT_LE(max_norm_rel_diff(master, param), 1e-6);
  EXPECT_LE(max_diff_relative_to(exp_avg, ref_exp_avg, gradient_scale), 1e-6);
  EXPECT_LE(max_diff_relative_to(exp_avg_sq, ref_exp_avg_sq, gradient_scale * gradient_scale), 1e-6);
  // The parameters moved: the comparison is not of two untouched copies.
  EXPECT_GT((master - init).abs().max().item<double>(), 1e-3);
}

INSTANTIATE_TEST_SUITE_P(
    Sizes, AdamVsTorch,
    ::testing::Combine(::testing::Bool(), ::testing::Values(Mode::kFp32, Mode::kBf16, Mode::kFp16),
                       ::testing::Values<int64_t>(1, 7, 1000003)),
    [](const ::testing::TestParamInfo<AdamVsTorch::ParamType>& info) {
      return std::string(std::get<0>(info.param) ? "AdamW_" : "Adam_") +
             mode_name(std::get<1>(info.param)) + "_" + std::to_string(std::get<2>(info.param));
    });

// torch::optim's exact op sequence on CPU, with the square root taken correctly rounded (in double,
// then rounded: exact for float): our kernel reproduces it bit for bit, on a size with a tail, when
// ATen dispatches its vectorized kernels (AVX2, AVX-512), which round a * b + c once as we do. ATen's
// baseline kernels (ATEN_CPU_CAPABILITY=default, or a CPU without AVX2) round it twice: there the
// guarantee is a difference of a few ulps (1e-6 relative).
TEST(CpuAdam, TorchOpsWithExactSqrtBitwise) {
  const std::string capability = at::get_cpu_capability();  // "DEFAULT", "AVX2", "AVX512", ...
  const bool vectorized = capability != "DEFAULT" && capability != "NO AVX";
  std::printf("ATen CPU capability %s: %s\n", capability.c_str(),
              vectorized ? "bitwise comparison" : "1e-6 comparison");
  const int64_t numel = 1000003;
  for (const bool decoupled : {false, true}) {
    torch::manual_seed(99);
    auto p_ref = torch::randn({numel});
    auto m_ref = torch::zeros({numel});
    auto v_ref = torch::zeros({numel});
    auto p = p_ref.clone(), m = m_ref.clone(), v = v_ref.clone();
    for (int step = 1; step <= kSteps; ++step) {
      const auto grad = torch::randn({numel});
      const double bias_correction1 = 1 - std::pow(kBeta1, step);
      const double bias_correction2 = 1 - std::pow(kBeta2, step);
      auto g = grad;
      if (decoupled) {
        p_ref.mul_(1 - kLr * kWeightDecay);
      } else {
        g = grad.add(p_ref, kWeightDecay);
      }
      m_ref.mul_(kBeta1).add_(g, 1 - kBeta1);
      v_ref.mul_(kBeta2).addcmul_(g, g, 1 - kBeta2);
      const auto exact_sqrt = v_ref.to(torch::kDouble).sqrt().to(torch::kFloat);
      const auto denom = (exact_sqrt / std::sqrt(bias_correction2)).add_(kEps);
      p_ref.addcdiv_(m_ref, denom, -kLr / bias_correction1);

      adam_step_fp32(
          p, grad, m, v,
          make_adam_step_constants(kLr, kBeta1, kBeta2, kEps, kWeightDecay, decoupled, step));
      const std::string where = "step " + std::to_string(step) + (decoupled ? " AdamW" : " Adam");
      if (vectorized) {
        ASSERT_TRUE(bit_equal(m, m_ref)) << where;
        ASSERT_TRUE(bit_equal(v, v_ref)) << where;
        ASSERT_TRUE(bit_equal(p, p_ref)) << where << ": " << testing::count_bit_diffs(p, p_ref)
                                         << " differ";
      } else {
        ASSERT_LE(max_norm_rel_diff(m, m_ref), 1e-6) << where;
        ASSERT_LE(max_norm_rel_diff(v, v_ref), 1e-6) << where;
        ASSERT_LE(max_norm_rel_diff(p, p_ref), 1e-6) << where;
      }
    }
  }
}

// The SIMD kernel is the scalar rule of adam_rule.h, lane for lane: identical bits, on every SIMD
// target this build compiles and this CPU can run (Highway is pointed at each in turn), including
// the padded tail. Targets the CPU cannot run are named in the output.
TEST(CpuAdam, EverySimdTargetEqualsScalarRuleBitwise) {
  std::string ran, skipped;
  for (int shift = 0; shift < 63; ++shift) {
    const int64_t bit = int64_t{1} << shift;
    if ((static_cast<int64_t>(HWY_TARGETS) & bit) == 0) continue;
    std::string& list = (hwy::SupportedTargets() & bit) != 0 ? ran : skipped;
    list += std::string(list.empty() ? "" : ", ") + hwy::TargetName(bit);
  }
  std::printf("SIMD targets compiled and run: %s; compiled but not supported by this CPU: %s\n",
              ran.c_str(), skipped.empty() ? "none" : skipped.c_str());
  ASSERT_FALSE(hwy::SupportedAndGeneratedTargets().empty());
  const int64_t numel = 4099;  // not a multiple of any vector width
  torch::manual_seed(7);
  const auto init = torch::randn({numel});
  const auto grads = torch::randn({numel}).mul_(512.0);
  const auto m0 = torch::randn({numel}).mul_(0.1);
  const auto v0 = torch::rand({numel}).mul_(0.01);
  for (const bool decoupled : {false, true}) {
    const auto c = make_adam_step_constants(1e-3, 0.9, 0.999, 1e-8, 0.01, decoupled, 3, 1.0 / 512);
    for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
      // The scalar rule, element by element.
      auto p = init.clone(), m = m0.clone(), v = v0.clone();
      const auto half_grad = grads.to(dtype);
      const auto g = half_grad.to(torch::kFloat);
      auto* pp = p.data_ptr<float>();
      auto* mp = m.data_ptr<float>();
      auto* vp = v.data_ptr<float>();
      const auto* gp = g.data_ptr<float>();
      for (int64_t i = 0; i < numel; ++i) adam_update(pp[i], mp[i], vp[i], gp[i], c);

      for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
        hwy::SetSupportedTargetsForTest(target);
        auto kp = init.clone(), km = m0.clone(), kv = v0.clone();
        auto slot = half_grad.clone();
        adam_step_mixed(slot, kp, km, kv, c);
        const std::string where = std::string(cpu_adam_simd_target()) + " " +
                                  (dtype == torch::kHalf ? "fp16" : "bf16") +
                                  (decoupled ? " AdamW" : " Adam");
        EXPECT_TRUE(bit_equal(kp, p)) << where;
        EXPECT_TRUE(bit_equal(km, m)) << where;
        EXPECT_TRUE(bit_equal(kv, v)) << where;
        EXPECT_TRUE(bit_equal(slot, p.to(dtype))) << where;
        // The fp32 kernel (fp32 gradient) on the same target.
        auto fp = init.clone(), fm = m0.clone(), fv = v0.clone();
        adam_step_fp32(fp, g, fm, fv, c);
        EXPECT_TRUE(bit_equal(fp, p)) << where << " fp32";
        EXPECT_TRUE(bit_equal(fm, m)) << where << " fp32";
      }
      hwy::SetSupportedTargetsForTest(0);
    }
  }
}

// The bf16 rounding of every kernel that stores bf16 (the half weight, bf16 states), on every SIMD
// target, against adam_rule.h's float_to_bf16 (c10::BFloat16's rule) on the values where hardware
// conversions differ from it: ties to even, NaNs of every sign and payload (the rule gives 0x7FC0),
// denormals (AVX512-BF16's VCVTNEPS2BF16 treats them as zero), values that round up to infinity,
// infinities and zeros; in vectors of ordinary values too, and in the padded tail.
TEST(CpuAdam, Bf16RoundingOnEveryTargetIsTheRuleOnSpecialValues) {
  std::vector<uint32_t> bits = {
      0x3F808000u, 0x3F818000u, 0xBF808000u, 0x3F80FFFFu, 0x3F807FFFu,  // ties and near-ties
      0x7FC00000u, 0xFFC00001u, 0x7F800001u, 0x7FBFFFFFu, 0xFFFFFFFFu,  // NaNs
      0x00000001u, 0x807FFFFFu, 0x00400000u, 0x00008000u, 0x80018000u,  // denormals
      0x7F7FFFFFu, 0xFF7FFFFFu, 0x7F7F8000u, 0x7F800000u, 0xFF800000u,  // huge and infinite
      0x00000000u, 0x80000000u, 0x00800000u, 0x3F800000u, 0xC0490FDBu,  // zeros, normals
  };
  // Whole vectors of special values, vectors with one among ordinary values, and a tail.
  std::vector<uint32_t> all;
  for (int repeat = 0; repeat < 3; ++repeat) all.insert(all.end(), bits.begin(), bits.end());
  for (uint32_t b : bits) {
    for (int k = 0; k < 15; ++k) all.push_back(0x3F800000u + 0x1000u * static_cast<uint32_t>(k));
    all.push_back(b);
  }
  const int64_t numel = static_cast<int64_t>(all.size());
  auto master = torch::empty({numel}, torch::kFloat);
  std::memcpy(master.data_ptr<float>(), all.data(), all.size() * sizeof(uint32_t));
  std::vector<uint16_t> expected(all.size());
  for (size_t i = 0; i < all.size(); ++i) expected[i] = float_to_bf16(master.data_ptr<float>()[i]);
  for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    const std::string where = cpu_adam_simd_target();
    auto half = torch::empty({numel}, torch::kBFloat16);
    restore_half_from_master(half, master);
    const auto* got = static_cast<const uint16_t*>(half.data_ptr());
    int wrong = 0;
    for (int64_t i = 0; i < numel; ++i) {
      if (got[i] == expected[static_cast<size_t>(i)]) continue;
      if (++wrong <= 5) {
        ADD_FAILURE() << where << ": element " << i << " (bits 0x" << std::hex
                      << all[static_cast<size_t>(i)] << ") became 0x" << got[i]
                      << ", the rule gives 0x" << expected[static_cast<size_t>(i)] << std::dec;
      }
    }
    // The Adam kernels store through the same rounding: a step with a zero learning rate and no
    // decay leaves the weights as they are, so the half slot and bf16 moments are their roundings.
    const auto c = make_adam_step_constants(0.0, 0.9, 0.999, 1e-8, 0.0, true, 1);
    auto p = master.clone();
    auto slot = torch::zeros({numel}, torch::kBFloat16);
    auto m = torch::zeros({numel}, torch::kFloat), v = torch::zeros({numel}, torch::kFloat);
    adam_step_mixed(slot, p, m, v, c);
    EXPECT_EQ(std::memcmp(slot.data_ptr(), expected.data(), expected.size() * 2), 0) << where;
    auto fp = torch::zeros({numel}, torch::kFloat);
    auto bm = torch::empty({numel}, torch::kBFloat16), bv = torch::zeros({numel}, torch::kBFloat16);
    // Momentum = (1 - beta1) * gradient: the gradient 10 x master makes it master (rounded once in
    // fp32 first, so compare with the rule applied to what the fp32 update gives).
    auto g = master.mul(10.0f);
    auto m32 = torch::zeros({numel}, torch::kFloat), v32 = torch::zeros({numel}, torch::kFloat);
    auto fp32 = torch::zeros({numel}, torch::kFloat);
    adam_step_fp32(fp32, g, m32, v32, c);
    bm.zero_();
    adam_step_fp32(fp, g, bm, bv, c);
    std::vector<uint16_t> m_expected(all.size());
    for (size_t i = 0; i < all.size(); ++i) m_expected[i] = float_to_bf16(m32.data_ptr<float>()[i]);
    EXPECT_EQ(std::memcmp(bm.data_ptr(), m_expected.data(), m_expected.size() * 2), 0) << where;
  }
  hwy::SetSupportedTargetsForTest(0);
}

// bf16 states ("state_dtype": "bf16"): on every SIMD target, the kernels (mixed bf16/fp16 and fp32
// gradients) are adam_update_stored() of adam_rule.h bit for bit: widen, update in fp32, round the
// stored moments to nearest even, including the padded tail. The states must really be rounded: the
// result differs from the fp32-state update.
TEST(CpuAdam, Bf16StatesEverySimdTargetEqualsScalarRuleBitwise) {
  ASSERT_FALSE(hwy::SupportedAndGeneratedTargets().empty());
  const int64_t numel = 4099;  // not a multiple of any vector width
  torch::manual_seed(11);
  const auto init = torch::randn({numel});
  const auto grads = torch::randn({numel}).mul_(512.0);
  const auto m0 = torch::randn({numel}).mul_(0.1).to(torch::kBFloat16);
  const auto v0 = torch::rand({numel}).mul_(0.01).to(torch::kBFloat16);
  for (const bool decoupled : {false, true}) {
    const auto c = make_adam_step_constants(1e-3, 0.9, 0.999, 1e-8, 0.01, decoupled, 3, 1.0 / 512);
    for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
      auto p = init.clone(), m = m0.clone(), v = v0.clone();
      const auto half_grad = grads.to(dtype);
      const auto g = half_grad.to(torch::kFloat);
      auto* pp = p.data_ptr<float>();
      auto* mp = static_cast<uint16_t*>(m.data_ptr());
      auto* vp = static_cast<uint16_t*>(v.data_ptr());
      const auto* gp = g.data_ptr<float>();
      for (int64_t i = 0; i < numel; ++i) adam_update_stored(pp[i], mp[i], vp[i], gp[i], c);
      // The fp32-state update from the same (widened) states: the rounding must show.
      auto p32 = init.clone(), m32 = m0.to(torch::kFloat), v32 = v0.to(torch::kFloat);
      adam_step_fp32(p32, g, m32, v32, c);
      EXPECT_TRUE(bit_equal(p32, p)) << "the weight moves with the unrounded moments";
      EXPECT_FALSE(bit_equal(m32, m.to(torch::kFloat))) << "the stored momentum is rounded";
      EXPECT_TRUE(bit_equal(m32.to(torch::kBFloat16), m)) << "to nearest even, as c10::BFloat16";
      EXPECT_TRUE(bit_equal(v32.to(torch::kBFloat16), v));

      for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
        hwy::SetSupportedTargetsForTest(target);
        const std::string where = std::string(cpu_adam_simd_target()) + " " +
                                  (dtype == torch::kHalf ? "fp16" : "bf16") +
                                  (decoupled ? " AdamW" : " Adam") + ", bf16 states";
        auto kp = init.clone(), km = m0.clone(), kv = v0.clone();
        auto slot = half_grad.clone();
        adam_step_mixed(slot, kp, km, kv, c);
        EXPECT_TRUE(bit_equal(kp, p)) << where;
        EXPECT_TRUE(bit_equal(km, m)) << where;
        EXPECT_TRUE(bit_equal(kv, v)) << where;
        EXPECT_TRUE(bit_equal(slot, p.to(dtype))) << where;
        auto fp = init.clone(), fm = m0.clone(), fv = v0.clone();
        adam_step_fp32(fp, g, fm, fv, c);
        EXPECT_TRUE(bit_equal(fp, p)) << where << " fp32";
        EXPECT_TRUE(bit_equal(fm, m)) << where << " fp32";
        EXPECT_TRUE(bit_equal(fv, v)) << where << " fp32";
      }
      hwy::SetSupportedTargetsForTest(0);
    }
  }
}

// bf16 states against plain LibTorch ops that round the same way: torch::optim's op sequence on
// fp32 copies of the bf16 moments (square root correctly rounded, as above), the weight updated
// from the fp32 moments, then the moments stored with .to(kBFloat16). Bit for bit over 20 steps
// where ATen's kernels are vectorized; with its baseline kernels (two roundings for a * b + c) an
// fp32 moment one ulp off can round to the neighbouring bf16 value, so there the bound is 2^-7
// relative on the moments and 1e-4 on the weights (a flipped moment moves its weight by up to 2^-8
// of one update).
TEST(CpuAdam, Bf16StatesMatchTorchOpsThatRoundTheSameWay) {
  const std::string capability = at::get_cpu_capability();
  const bool vectorized = capability != "DEFAULT" && capability != "NO AVX";
  const int64_t numel = 100003;
  double worst = 0;
  for (const bool decoupled : {false, true}) {
    torch::manual_seed(99);
    auto p_ref = torch::randn({numel});
    auto m_ref = torch::zeros({numel}, torch::kBFloat16);
    auto v_ref = torch::zeros({numel}, torch::kBFloat16);
    auto p = p_ref.clone(), m = m_ref.clone(), v = v_ref.clone();
    for (int step = 1; step <= kSteps; ++step) {
      const auto grad = torch::randn({numel});
      const double bias_correction1 = 1 - std::pow(kBeta1, step);
      const double bias_correction2 = 1 - std::pow(kBeta2, step);
      auto g = grad;
      if (decoupled) {
        p_ref.mul_(1 - kLr * kWeightDecay);
      } else {
        g = grad.add(p_ref, kWeightDecay);
      }
      auto m32 = m_ref.to(torch::kFloat).mul_(kBeta1).add_(g, 1 - kBeta1);
      auto v32 = v_ref.to(torch::kFloat).mul_(kBeta2).addcmul_(g, g, 1 - kBeta2);
      const auto exact_sqrt = v32.to(torch::kDouble).sqrt().to(torch::kFloat);
      const auto denom = (exact_sqrt / std::sqrt(bias_correction2)).add_(kEps);
      p_ref.addcdiv_(m32, denom, -kLr / bias_correction1);
      m_ref = m32.to(torch::kBFloat16);
      v_ref = v32.to(torch::kBFloat16);

      adam_step_fp32(
          p, grad, m, v,
          make_adam_step_constants(kLr, kBeta1, kBeta2, kEps, kWeightDecay, decoupled, step));
      const std::string where = "step " + std::to_string(step) + (decoupled ? " AdamW" : " Adam");
      ASSERT_EQ(m.scalar_type(), torch::kBFloat16) << where;
      if (vectorized) {
        ASSERT_TRUE(bit_equal(m, m_ref)) << where;
        ASSERT_TRUE(bit_equal(v, v_ref)) << where;
        ASSERT_TRUE(bit_equal(p, p_ref))
            << where << ": " << testing::count_bit_diffs(p, p_ref) << " differ";
      } else {
        ASSERT_LE(max_norm_rel_diff(m.to(torch::kFloat), m_ref.to(torch::kFloat)), 1.0 / 128)
            << where;
        ASSERT_LE(max_norm_rel_diff(v.to(torch::kFloat), v_ref.to(torch::kFloat)), 1.0 / 128)
            << where;
        ASSERT_LE(max_norm_rel_diff(p, p_ref), 1e-4) << where;
        worst = std::max(worst, max_norm_rel_diff(p, p_ref));
      }
    }
  }
  if (!vectorized) std::printf("baseline ATen kernels: weights within %.3g\n", worst);
}

// Why bf16 states need 1 - beta above 2^-8: rounded to nearest, a stored moment moves only when a
// step changes it by more than half a bf16 step (2^-9 to 2^-8 of its value). With zero gradients
// the variance should decay by beta2 each step: with beta2 0.999 the stored bf16 variance never
// moves at all, with 0.99 it falls at every step (what the engine's config check is built on).
TEST(CpuAdam, Bf16StatesDecayOnlyWithBetasBelowTheBound) {
  const int64_t numel = 1031;
  torch::manual_seed(3);
  const auto v0 = torch::rand({numel}).add_(0.5).to(torch::kBFloat16);  // values of every mantissa
  const auto zero = torch::zeros({numel});
  for (const double beta2 : {0.999, 0.99}) {
    auto p = torch::zeros({numel});
    auto m = torch::zeros({numel}, torch::kBFloat16);
    auto v = v0.clone();
    for (int step = 1; step <= 50; ++step) {
      const auto before = v.clone();
      adam_step_fp32(p, zero, m, v,
                     make_adam_step_constants(1e-3, 0.9, beta2, 1e-8, 0.0, true, step));
      if (beta2 == 0.999) {
        ASSERT_TRUE(bit_equal(v, before)) << "beta2 0.999, step " << step << ": the variance moved";
      } else {
        ASSERT_TRUE((v.to(torch::kFloat) < before.to(torch::kFloat)).all().item<bool>())
            << "beta2 0.99, step " << step << ": some variance did not decay";
      }
    }
  }
}

TEST(CpuAdam, RejectsMismatchedViews) {
  auto master = torch::zeros({8});
  auto m = torch::zeros({8});
  auto v = torch::zeros({7});
  auto half = torch::zeros({8}, torch::kBFloat16);
  const AdamStepConstants c;
  EXPECT_THROW(adam_step_mixed(half, master, m, v, c), c10::Error);
  EXPECT_THROW(adam_step_mixed(half.to(torch::kFloat), master, m, m.clone(), c), c10::Error);
  EXPECT_THROW(adam_step_fp32(master, torch::zeros({16}).slice(0, 0, 16, 2), m, m.clone(), c),
               c10::Error);
  // States of two dtypes, or of one the kernels do not store.
  const auto m16 = torch::zeros({8}, torch::kBFloat16);
  EXPECT_THROW(adam_step_mixed(half, master, m16, m.clone(), c), c10::Error);
  EXPECT_THROW(adam_step_fp32(master, m.clone(), m.clone(), m16, c), c10::Error);
  EXPECT_THROW(adam_step_fp32(master, m.clone(), m.to(torch::kHalf), m.to(torch::kHalf), c),
               c10::Error);
}

}  // namespace adam_test
}  // namespace patrickstar
