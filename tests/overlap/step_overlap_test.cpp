// The overlapped step's optimizer thread (engine/src/step_overlap.h) on its own, with the host
// Adam's kernels (speculative_update.h): jobs handed over, waited for while queued or running, the
// thread stopped with work queued; the results bit for bit HybridAdam's. Built and run
// under ThreadSanitizer too (scripts/test), with one OpenMP thread per thread.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <memory>
#include <vector>

#include "patrickstar/optimizer/hybrid_adam.h"
#include "patrickstar/optimizer/speculative_update.h"
#include "step_overlap.h"

namespace patrickstar::engine_detail {
namespace step_overlap_test {

// One chunk index's tensors: fp32 (master is the parameter) or mixed (a bf16 half slot holding
// the gradient, no gradient space).
struct Chunk {
  at::Tensor half, master, grad, exp_avg, exp_avg_sq;
  AdamChunk views() const {
    AdamChunk c;
    c.master = master;
    c.exp_avg = exp_avg;
    c.exp_avg_sq = exp_avg_sq;
    c.step = 3;
    if (half.defined()) {
      c.half_param_grad = half;
    } else {
      c.grad_fp32 = grad;
    }
    return c;
  }
  Chunk clone() const {
    Chunk c;
    for (auto [to, from] : {std::pair{&c.half, &half},
                            {&c.master, &master},
                            {&c.grad, &grad},
                            {&c.exp_avg, &exp_avg},
                            {&c.exp_avg_sq, &exp_avg_sq}}) {
      if (from->defined()) *to = from->clone();
    }
    return c;
  }
};

Chunk make_chunk(int64_t numel, bool mixed, uint64_t seed) {
  torch::manual_seed(seed);
  Chunk c;
  c.master = torch::randn({numel});
  c.exp_avg = torch::randn({numel}) * 0.01;
  c.exp_avg_sq = torch::rand({numel}) * 0.01;
  if (mixed) {
    c.half = (torch::randn({numel}) * 0.1).to(at::kBFloat16);
  } else {
    c.grad = torch::randn({numel}) * 0.1;
  }
  return c;
}

bool same(const Chunk& a, const Chunk& b) {
  bool equal = torch::equal(a.master, b.master) && torch::equal(a.exp_avg, b.exp_avg) &&
               torch::equal(a.exp_avg_sq, b.exp_avg_sq);
  if (a.half.defined()) equal = equal && torch::equal(a.half, b.half);
  return equal;
}

StepOverlap::Allocate plain_memory() {
  return [](int64_t numel, at::ScalarType dtype) { return at::empty({numel}, at::dtype(dtype)); };
}

std::unique_ptr<EarlyIndex> job_for(int64_t index, const Chunk& chunk, const HybridAdam& adam) {
  auto job = std::make_unique<EarlyIndex>();
  job->index = index;
  job->threads = 1;
  job->inputs.push_back(chunk.views());
  EarlyRun run;
  run.begin = 0;
  run.end = chunk.master.numel();
  run.step = 3;
  run.update.constants = adam.constants_without_clipping(3);
  job->runs.push_back(std::move(run));
  return job;
}

TEST(StepOverlap, UpdatesAheadAreHybridAdamsBitForBitWhateverIsWaitedFor) {
  HybridAdam adam(AdamOptions().lr(1e-2).weight_decay(0.01));
  constexpr int kIndices = 8;
  std::vector<Chunk> ours, reference;
  for (int i = 0; i < kIndices; ++i) {
    ours.push_back(make_chunk(70000 + 1000 * i, /*mixed=*/i % 2 == 1, 10 + i));
    reference.push_back(ours.back().clone());
  }
  StepOverlap overlap(int64_t{1} << 30, plain_memory());
  for (int i = 0; i < kIndices; ++i) {
    auto job = job_for(i, ours[i], adam);
    ASSERT_TRUE(overlap.prepare(*job));
    overlap.submit(std::move(job));
    // While the thread works: the training thread reads what it reads (reads only), and withdraws
    // or waits for some indices.
    EXPECT_TRUE(torch::isfinite(ours[i].master).all().item<bool>());
    if (i == 3) overlap.quiesce(1);
    if (i == 5) overlap.quiesce(5);  // just handed over: waited for
  }
  overlap.drain();
  // The step: each record committed as HybridAdam would.
  std::vector<AdamChunk> chunks;
  for (const Chunk& c : ours) chunks.push_back(c.views());
  for (int i = 0; i < kIndices; ++i) {
    EarlyIndex* job = overlap.record(i);
    ASSERT_NE(job, nullptr) << "index " << i;
    EXPECT_EQ(job->runs[0].update.state, SpeculativeUpdate::State::kApplied);
    chunks[static_cast<size_t>(i)].speculative = &job->runs[0].update;
  }
  std::vector<AdamChunk> reference_chunks;
  for (const Chunk& c : reference) reference_chunks.push_back(c.views());
  HybridAdam serial(AdamOptions().lr(1e-2).weight_decay(0.01));
  const StepReport expected = serial.step(reference_chunks);
  const StepReport got = adam.step(chunks);
  EXPECT_EQ(got.grad_norm, expected.grad_norm);
  EXPECT_EQ(got.speculative_committed, kIndices);
  EXPECT_EQ(got.speculative_undone, 0);
  for (int i = 0; i < kIndices; ++i) EXPECT_TRUE(same(ours[i], reference[i])) << "index " << i;
  overlap.clear();
  EXPECT_GT(overlap.buffer_bytes(), 0);  // kept for the next iteration
}

TEST(StepOverlap, ClippingUndoesExactlyAndTheThreadStopsWithWorkQueued) {
  // Clipping active: every update made ahead is undone and recomputed, bit for bit the serial one.
  HybridAdam adam(AdamOptions().lr(1e-2).max_grad_norm(1e-3));
  HybridAdam serial(AdamOptions().lr(1e-2).max_grad_norm(1e-3));
  Chunk ours = make_chunk(100000, /*mixed=*/false, 3);
  Chunk reference = ours.clone();
  {
    StepOverlap overlap(int64_t{1} << 30, plain_memory());
    auto job = job_for(0, ours, adam);
    ASSERT_TRUE(overlap.prepare(*job));
    overlap.submit(std::move(job));
    overlap.quiesce(0);
    std::vector<AdamChunk> chunks{ours.views()};
    if (EarlyIndex* job0 = overlap.record(0)) chunks[0].speculative = &job0->runs[0].update;
    std::vector<AdamChunk> reference_chunks{reference.views()};
    serial.step(reference_chunks);
    const StepReport got = adam.step(chunks);
    EXPECT_LT(got.clip_coef, 1.0f);
    EXPECT_EQ(got.speculative_committed, 0);
    EXPECT_TRUE(same(ours, reference));
    // Work queued when the thread stops: the destructor waits for the job in progress only.
    std::vector<Chunk> more;
    for (int i = 1; i < 6; ++i) more.push_back(make_chunk(200000, false, 40 + i));
    for (int i = 1; i < 6; ++i) {
      auto next = job_for(i, more[static_cast<size_t>(i - 1)], adam);
      ASSERT_TRUE(overlap.prepare(*next));
      overlap.submit(std::move(next));
    }
  }
}

TEST(StepOverlap, TheFingerprintSeesEveryEditOfTheGradient) {
  // A run of 4 Mi floats (2^21 words), the step's largest: scaling by a power of two, two signs
  // flipped, one element changed by one unit in the last place, each changes the fingerprint.
  torch::manual_seed(5);
  const at::Tensor grad = torch::randn({int64_t{1} << 22});
  const uint64_t before = gradient_fingerprint(grad);
  EXPECT_EQ(gradient_fingerprint(grad.clone()), before);
  EXPECT_NE(gradient_fingerprint(grad * 0.5), before);
  EXPECT_NE(gradient_fingerprint(grad * 2), before);
  at::Tensor flipped = grad.clone();
  flipped[1] = -flipped[1];
  flipped[3] = -flipped[3];
  EXPECT_NE(gradient_fingerprint(flipped), before);
  at::Tensor nudged = grad.clone();
  nudged[12345] = std::nextafter(nudged[12345].item<float>(), 1e9f);
  EXPECT_NE(gradient_fingerprint(nudged), before);
  // bf16 (2-byte elements, a tail shorter than a word).
  const at::Tensor half = torch::randn({1001}).to(at::kBFloat16);
  EXPECT_NE(gradient_fingerprint(half * 0.5), gradient_fingerprint(half));
}

TEST(StepOverlap, TheMemoryBoundRefusesWhatWouldPassIt) {
  HybridAdam adam(AdamOptions().lr(1e-2));
  Chunk small = make_chunk(1000, false, 1);
  Chunk large = make_chunk(100000, false, 2);
  // 12 bytes per element in fp32: room for the small index, not for both.
  StepOverlap overlap(12 * 1000 + 12 * 50000, plain_memory());
  auto first = job_for(0, small, adam);
  EXPECT_TRUE(overlap.fits(0, 12 * 1000));
  ASSERT_TRUE(overlap.prepare(*first));
  overlap.submit(std::move(first));
  EXPECT_FALSE(overlap.fits(1, 12 * 100000));
  auto second = job_for(1, large, adam);
  EXPECT_FALSE(overlap.prepare(*second));
  EXPECT_EQ(overlap.buffer_bytes(), 12 * 1000);
  overlap.clear();
}

}  // namespace step_overlap_test
}  // namespace patrickstar::engine_detail
