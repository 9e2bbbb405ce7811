// HybridAdam end to end on chunk-like views: overflow skips and restores, clipping folded into the
// update matches clip_grad_norm_ + torch::optim::AdamW, the fused gradient check, placement report.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>
#include <vector>

#include "optimizer_test_util.h"
#include "patrickstar/optimizer/hybrid_adam.h"

namespace patrickstar {
namespace hybrid_adam_test {

using testing::bit_equal;
using testing::max_norm_rel_diff;

// Chunks of the given sizes with random master weights and mid-training states.
std::vector<AdamChunk> make_mixed_chunks(const std::vector<int64_t>& sizes, torch::Dtype half) {
  std::vector<AdamChunk> chunks;
  for (const int64_t n : sizes) {
    AdamChunk c;
    c.master = torch::randn({n});
    c.exp_avg = torch::randn({n}).mul_(0.01);
    c.exp_avg_sq = torch::rand({n}).mul_(1e-4);
    c.half_param_grad = torch::empty({n}, half);
    chunks.push_back(c);
  }
  return chunks;
}

class OverflowStep : public ::testing::TestWithParam<float> {};

TEST_P(OverflowStep, LeavesEveryWeightAndStateBitIdentical) {
  torch::manual_seed(5);
  auto chunks = make_mixed_chunks({4096, 1000003 % 5000}, torch::kHalf);
  LossScalerOptions so;
  so.initial_scale_power = 12;
  so.hysteresis = 1;
  HybridAdam adam(AdamOptions().lr(1e-3).weight_decay(0.01).max_grad_norm(1.0), LossScaler(so));
  // One clean step first, so the states are not trivially the initial ones.
  for (auto& c : chunks) c.half_param_grad.copy_(torch::randn(c.master.sizes()) * 4096);
  ASSERT_FALSE(adam.step(chunks).skipped);
  ASSERT_EQ(adam.step_count(), 1);

  std::vector<torch::Tensor> master, m, v;
  for (const auto& c : chunks) {
    master.push_back(c.master.clone());
    m.push_back(c.exp_avg.clone());
    v.push_back(c.exp_avg_sq.clone());
  }
  for (auto& c : chunks) c.half_param_grad.copy_(torch::randn(c.master.sizes()) * 4096);
  chunks[1].half_param_grad[chunks[1].half_param_grad.numel() - 1] = GetParam();  // in the tail
  const double scale_before = adam.loss_scale();
  const StepReport report = adam.step(chunks);

  EXPECT_TRUE(report.skipped);
  EXPECT_EQ(report.step, 1);
  EXPECT_EQ(adam.step_count(), 1);
  EXPECT_EQ(report.placement.chunks_device + report.placement.chunks_host, 0);
  EXPECT_EQ(adam.loss_scale(), scale_before / 2);  // hysteresis 1: halved at once
  for (size_t i = 0; i < chunks.size(); ++i) {
    EXPECT_TRUE(bit_equal(chunks[i].master, master[i])) << i;
    EXPECT_TRUE(bit_equal(chunks[i].exp_avg, m[i])) << i;
    EXPECT_TRUE(bit_equal(chunks[i].exp_avg_sq, v[i])) << i;
    // The half slots held gradients; they hold the weights again.
    EXPECT_TRUE(bit_equal(chunks[i].half_param_grad, master[i].to(torch::kHalf))) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(NonFinite, OverflowStep,
                         ::testing::Values(std::numeric_limits<float>::infinity(),
                                           -std::numeric_limits<float>::infinity(),
                                           std::numeric_limits<float>::quiet_NaN()));

// Two chunks, 20 steps, clipping active, against clip_grad_norm_ + torch::optim::AdamW on fp32
// copies fed the same (unscaled) gradients.
class MixedWithClipping : public ::testing::TestWithParam<torch::Dtype> {};

TEST_P(MixedWithClipping, MatchesClipGradNormAndTorchAdamW) {
  const torch::Dtype half = GetParam();
  torch::manual_seed(11);
  const std::vector<int64_t> sizes = {3000, 777};
  std::vector<AdamChunk> chunks;
  std::vector<torch::Tensor> params;
  for (const int64_t n : sizes) {
    AdamChunk c;
    c.master = torch::randn({n});
    c.exp_avg = torch::zeros({n});
    c.exp_avg_sq = torch::zeros({n});
    c.half_param_grad = c.master.to(half);
    chunks.push_back(c);
    params.push_back(c.master.clone().requires_grad_(true));
  }
  const double max_norm = 5.0;
  LossScalerOptions so;
  so.initial_scale_power = 8;
  so.loss_scale_window = 7;  // the scale grows during the run: the multiplier follows it
  HybridAdam adam(AdamOptions().lr(1e-2).weight_decay(0.05).max_grad_norm(max_norm),
                  half == torch::kHalf ? LossScaler(so) : LossScaler::disabled());
  torch::optim::AdamW reference(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.05));

  int clipped_steps = 0;
  for (int step = 1; step <= 20; ++step) {
    const double scale = adam.loss_scale();
    for (size_t i = 0; i < chunks.size(); ++i) {
      // Gradient norms around 2..20 so that some steps clip and some do not.
      const auto g = torch::randn({sizes[i]}) * (0.05 * step);
      chunks[i].half_param_grad.copy_((g * scale).to(half));
      params[i].mutable_grad() =
          chunks[i].half_param_grad.to(torch::kFloat) * static_cast<float>(1.0 / scale);
    }
    const double torch_norm = torch::nn::utils::clip_grad_norm_(params, max_norm);
    reference.step();
    const StepReport report = adam.step(chunks);
    ASSERT_FALSE(report.skipped);
    EXPECT_NEAR(report.grad_norm, torch_norm, 1e-6 * torch_norm) << "step " << step;
    if (report.clip_coef < 1.0f) ++clipped_steps;
    for (size_t i = 0; i < chunks.size(); ++i) {
      ASSERT_TRUE(bit_equal(chunks[i].half_param_grad, chunks[i].master.to(half)));
    }
  }
  EXPECT_GT(clipped_steps, 3);
  EXPECT_LT(clipped_steps, 20);
  if (half == torch::kHalf) {
    EXPECT_GT(adam.loss_scale(), 256.0);  // grew after the window
  }
  for (size_t i = 0; i < chunks.size(); ++i) {
    EXPECT_LE(max_norm_rel_diff(chunks[i].master, params[i].detach()), 1e-6) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, MixedWithClipping,
                         ::testing::Values(torch::kBFloat16, torch::kHalf));

TEST(GradientClipping, MultiplierMatchesClipGradNorm) {
  torch::manual_seed(3);
  for (const double max_norm : {0.5, 1e9}) {
    std::vector<torch::Tensor> params;
    GradStats total;
    for (const int64_t n : {1, 7, 100000}) {
      auto p = torch::zeros({n}).requires_grad_(true);
      p.mutable_grad() = torch::randn({n});
      total += grad_stats(p.grad());
      params.push_back(p);
    }
    std::vector<torch::Tensor> ours;
    const GradMultiplier mult = gradient_multiplier(total, 1.0, max_norm);
    for (const auto& p : params) ours.push_back(p.grad() * mult.multiplier);
    const double norm = torch::nn::utils::clip_grad_norm_(params, max_norm);
    EXPECT_NEAR(mult.grad_norm, norm, 1e-6 * norm);
    EXPECT_EQ(mult.clip_coef < 1.0f, max_norm < 1.0);
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_LE(max_norm_rel_diff(ours[i], params[i].grad()), 1e-6) << max_norm << " " << i;
    }
  }
}

TEST(GradStatsTest, SumOfSquaresAndNonFiniteInEveryFormat) {
  torch::manual_seed(8);
  for (const auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    for (const int64_t n : {1, 7, 100003}) {
      auto g = torch::randn({n}).to(dtype);
      const double expected = g.to(torch::kDouble).square().sum().item<double>();
      const GradStats stats = grad_stats(g);
      EXPECT_TRUE(stats.finite());
      EXPECT_NEAR(stats.sum_squares, expected, 1e-12 * expected + 1e-300);
      for (const int64_t at : {int64_t{0}, n / 2, n - 1}) {
        for (const float bad :
             {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
          auto copy = g.clone();
          copy[at] = bad;
          EXPECT_FALSE(grad_stats(copy).finite()) << dtype << " n=" << n << " at " << at;
        }
      }
    }
  }
  // Large finite fp32 values square beyond float range but not beyond double: still finite.
  EXPECT_TRUE(grad_stats(torch::full({5}, 3e38f)).finite());
}

TEST(HybridAdamTest, ReportsPlacementAndRejectsBadPlansUntouched) {
  torch::manual_seed(4);
  auto chunks = make_mixed_chunks({256, 256, 256}, torch::kBFloat16);
  for (auto& c : chunks) c.half_param_grad.copy_(torch::randn({256}));
  HybridAdam adam{AdamOptions()};
  std::vector<int64_t> bytes;
  for (const auto& c : chunks) bytes.push_back(c.state_bytes());
  EXPECT_EQ(bytes[0], 256 * 14);  // 4 + 4 + 4 + 2 bytes per parameter

  const auto master0 = chunks[0].master.clone();
  EXPECT_THROW(adam.step(chunks, plan_placement(std::vector<int64_t>{1, 2}, 10)), c10::Error);
  EXPECT_TRUE(bit_equal(chunks[0].master, master0));
  EXPECT_EQ(adam.step_count(), 0);

  // The emulated device is CPU memory: device chunks run the host kernel on it.
  const StepReport report = adam.step(chunks, plan_placement(bytes, 2 * 256 * 14 + 100));
  EXPECT_FALSE(report.skipped);
  EXPECT_EQ(report.placement.chunks_device, 2);
  EXPECT_EQ(report.placement.chunks_host, 1);
  EXPECT_EQ(report.placement.bytes_device, 2 * 256 * 14);
  EXPECT_FALSE(bit_equal(chunks[0].master, master0));

  // fp32 chunk: separate gradient, no half slot.
  AdamChunk fp32;
  fp32.master = torch::randn({100});
  fp32.grad_fp32 = torch::randn({100});
  fp32.exp_avg = torch::zeros({100});
  fp32.exp_avg_sq = torch::zeros({100});
  EXPECT_EQ(fp32.state_bytes(), 1600);
  const auto before = fp32.master.clone();
  EXPECT_FALSE(adam.step({fp32}).skipped);
  EXPECT_FALSE(bit_equal(fp32.master, before));
}

// Mixed precision with a gradient space: the fp32 gradient feeds the update as it is (the fp32
// kernel on the master), and the half slot receives the new weight, rounded once.
TEST(HybridAdamMixedFp32Gradient, UpdatesFromTheFp32GradientNotItsHalfRounding) {
  for (const auto half : {torch::kBFloat16, torch::kHalf}) {
    torch::manual_seed(21);
    auto chunks = make_mixed_chunks({1000, 37}, half);
    std::vector<AdamChunk> reference;
    for (auto& c : chunks) {
      c.grad_fp32 = torch::randn(c.master.sizes()).mul_(1e-3);  // values a half cannot hold
      c.half_param_grad.copy_(c.master);
      AdamChunk r;
      r.master = c.master.clone();
      r.exp_avg = c.exp_avg.clone();
      r.exp_avg_sq = c.exp_avg_sq.clone();
      r.grad_fp32 = c.grad_fp32.clone();
      reference.push_back(r);
    }
    const AdamOptions options = AdamOptions().lr(1e-2).eps(1e-3).weight_decay(0.01);
    HybridAdam ours(options);
    HybridAdam fp32(options);
    ASSERT_FALSE(ours.step(chunks).skipped);
    ASSERT_FALSE(fp32.step(reference).skipped);
    for (size_t i = 0; i < chunks.size(); ++i) {
      EXPECT_TRUE(bit_equal(chunks[i].master, reference[i].master)) << i;
      EXPECT_TRUE(bit_equal(chunks[i].exp_avg, reference[i].exp_avg)) << i;
      EXPECT_TRUE(bit_equal(chunks[i].exp_avg_sq, reference[i].exp_avg_sq)) << i;
      EXPECT_TRUE(bit_equal(chunks[i].half_param_grad, reference[i].master.to(half))) << i;
    }
    // Rounding the gradient to half first gives another update: the test can tell them apart.
    torch::manual_seed(21);
    auto rounded = make_mixed_chunks({1000, 37}, half);
    for (size_t i = 0; i < rounded.size(); ++i) {
      rounded[i].half_param_grad.copy_(reference[i].grad_fp32);  // the old way
    }
    HybridAdam(options).step(rounded);
    EXPECT_FALSE(bit_equal(rounded[0].master, reference[0].master));
  }
}

// Parameter groups: chunks of two groups stepped together equal each group's chunks stepped by a
// HybridAdam of that group's options alone, bit for bit (mixed precision, bf16 halves; fp32 and
// bf16 states), and a refused group changes no group.
class HybridAdamGroups : public ::testing::TestWithParam<torch::Dtype> {};

TEST_P(HybridAdamGroups, EachChunkRunsWithItsGroupsOptions) {
  torch::manual_seed(3);
  const std::vector<int64_t> sizes = {1000, 37, 4096, 5};
  const auto decay = AdamOptions().lr(1e-3).beta1(0.9).beta2(0.95).weight_decay(0.1);
  const auto no_decay = AdamOptions(decay).lr(2e-4).beta1(0.8).beta2(0.9).eps(1e-6).weight_decay(0);
  std::vector<AdamChunk> together = make_mixed_chunks(sizes, torch::kBFloat16);
  std::vector<AdamChunk> apart;
  for (AdamChunk& c : together) {
    c.exp_avg = c.exp_avg.to(GetParam());
    c.exp_avg_sq = c.exp_avg_sq.to(GetParam());
    c.half_param_grad.copy_(torch::randn(c.half_param_grad.sizes()).mul_(0.1));
    AdamChunk copy = c;
    copy.master = c.master.clone();
    copy.exp_avg = c.exp_avg.clone();
    copy.exp_avg_sq = c.exp_avg_sq.clone();
    copy.half_param_grad = c.half_param_grad.clone();
    apart.push_back(copy);
  }
  for (size_t k = 0; k < together.size(); ++k) together[k].group = static_cast<int32_t>(k % 2);
  AdamChunk wrong = apart[1];  // chunk 1 with group 0's options
  wrong.master = apart[1].master.clone();
  wrong.exp_avg = apart[1].exp_avg.clone();
  wrong.exp_avg_sq = apart[1].exp_avg_sq.clone();
  wrong.half_param_grad = apart[1].half_param_grad.clone();
  HybridAdam(decay).step({wrong});
  HybridAdam grouped(decay);
  grouped.set_groups({decay, no_decay});
  grouped.step(together);
  HybridAdam first(decay), second(no_decay);
  first.step({apart[0], apart[2]});
  second.step({apart[1], apart[3]});
  for (size_t k = 0; k < together.size(); ++k) {
    EXPECT_TRUE(bit_equal(together[k].master, apart[k].master)) << "chunk " << k;
    EXPECT_TRUE(bit_equal(together[k].exp_avg_sq, apart[k].exp_avg_sq)) << "chunk " << k;
    EXPECT_TRUE(bit_equal(together[k].half_param_grad, apart[k].half_param_grad)) << "chunk " << k;
  }
  // Group 0's options give chunk 1 other weights: the test sees the groups.
  EXPECT_FALSE(bit_equal(wrong.master, together[1].master));
  // A refused group changes nothing; a chunk of a group that does not exist is refused.
  EXPECT_THROW(grouped.set_groups({decay, AdamOptions(no_decay).beta2(1.0)}), c10::Error);
  EXPECT_EQ(grouped.group_options(1).beta2(), 0.9);
  together[0].group = 2;
  EXPECT_THROW(grouped.step(together), c10::Error);
  // set_lr sets every group's.
  grouped.set_lr(5e-4);
  EXPECT_EQ(grouped.group_options(0).lr(), 5e-4);
  EXPECT_EQ(grouped.group_options(1).lr(), 5e-4);
}

INSTANTIATE_TEST_SUITE_P(States, HybridAdamGroups,
                         ::testing::Values(torch::kFloat, torch::kBFloat16));

}  // namespace hybrid_adam_test
}  // namespace patrickstar
