// The delayed update's thread (engine/src/delayed_update.h) on its own: an update handed over runs
// while the training thread goes on, and what result() gives is bit for bit HybridAdam's serial
// step; buffers kept between updates; an update that throws reports it at result() until done().
// Built and run under ThreadSanitizer too (scripts/test), with one OpenMP thread per thread.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <stdexcept>
#include <vector>

#include "delayed_update.h"
#include "patrickstar/optimizer/hybrid_adam.h"

namespace patrickstar::engine_detail {
namespace delayed_update_test {

at::Tensor plain(int64_t numel, at::ScalarType dtype) {
  return at::empty({numel}, at::dtype(dtype));
}

struct States {
  at::Tensor master, grad, exp_avg, exp_avg_sq;
};

States make_states(int64_t numel, uint64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({numel}), torch::randn({numel}) * 0.1, torch::randn({numel}) * 0.01,
          torch::rand({numel}) * 0.01};
}

TEST(DelayedUpdate, TheThreadsUpdateIsTheSerialStepBitForBit) {
  HybridAdam adam(AdamOptions().lr(1e-2).weight_decay(0.01).max_grad_norm(0.5));
  HybridAdam serial(AdamOptions().lr(1e-2).weight_decay(0.01).max_grad_norm(0.5));
  DelayedUpdate delayed(plain);
  std::vector<States> ours, reference;
  for (int k = 0; k < 4; ++k) {
    ours.push_back(make_states(50000 + 1000 * k, 20 + k));
    reference.push_back({ours.back().master.clone(), ours.back().grad.clone(),
                         ours.back().exp_avg.clone(), ours.back().exp_avg_sq.clone()});
  }
  for (int step = 0; step < 3; ++step) {
    // As the engine hands over: the gradient in a buffer of the update, the states in place.
    DelayedJob job;
    for (size_t k = 0; k < ours.size(); ++k) {
      at::Tensor grad = delayed.buffer(k, ours[k].grad.numel(), at::kFloat);
      grad.copy_(ours[k].grad);
      AdamChunk run;
      run.master = ours[k].master;
      run.grad_fp32 = grad;
      run.exp_avg = ours[k].exp_avg;
      run.exp_avg_sq = ours[k].exp_avg_sq;
      job.runs.push_back(run);
      job.where.push_back({static_cast<int64_t>(k), 0, grad.numel()});
    }
    job.params = {7};
    // As many host-Adam threads as the serial step below has: the gradient statistics are summed
    // per thread.
    delayed.launch(
        std::move(job), [&adam](const DelayedJob& j) { return adam.step(j.runs); },
        at::get_num_threads());
    EXPECT_TRUE(delayed.pending());
    // Meanwhile the training thread writes the next gradients (the update has its copies).
    for (States& r : ours) r.grad.mul_(1.5);
    std::vector<AdamChunk> chunks;
    for (const States& r : reference) {
      AdamChunk c;
      c.master = r.master;
      c.grad_fp32 = r.grad;
      c.exp_avg = r.exp_avg;
      c.exp_avg_sq = r.exp_avg_sq;
      chunks.push_back(c);
    }
    const StepReport expected = serial.step(chunks);
    for (States& r : reference) r.grad.mul_(1.5);
    if (step == 1) delayed.join();  // joined first: the result stays pending
    EXPECT_TRUE(delayed.pending());
    auto [taken, report] = delayed.result();
    EXPECT_TRUE(delayed.pending());  // until done(): a caller that fails to write it in retries
    const std::vector<int64_t> params = taken->params;
    delayed.done();
    EXPECT_FALSE(delayed.pending());
    EXPECT_EQ(report.grad_norm, expected.grad_norm);
    EXPECT_EQ(report.clip_coef, expected.clip_coef);
    EXPECT_LT(report.clip_coef, 1.0f) << "the clipping must be active";
    EXPECT_EQ(params, std::vector<int64_t>{7});
    for (size_t k = 0; k < ours.size(); ++k) {
      EXPECT_TRUE(torch::equal(ours[k].master, reference[k].master)) << "step " << step;
      EXPECT_TRUE(torch::equal(ours[k].exp_avg_sq, reference[k].exp_avg_sq)) << "step " << step;
    }
  }
  EXPECT_EQ(delayed.buffer_bytes(), (50000 + 51000 + 52000 + 53000) * 4);
  EXPECT_GT(delayed.take_busy_seconds(), 0.0);
  EXPECT_EQ(delayed.take_busy_seconds(), 0.0);
}

TEST(DelayedUpdate, WhatTheUpdateThrowsReachesResultUntilDone) {
  DelayedUpdate delayed(plain);
  delayed.launch(
      DelayedJob(),
      [](const DelayedJob&) -> StepReport { throw std::runtime_error("the update failed"); }, 1);
  EXPECT_THROW(delayed.result(), std::runtime_error);
  EXPECT_TRUE(delayed.pending());
  EXPECT_THROW(delayed.result(), std::runtime_error);  // as often as asked
  delayed.done();
  EXPECT_FALSE(delayed.pending());
  // The next update runs.
  delayed.launch(
      DelayedJob(), [](const DelayedJob&) { return StepReport(); }, 1);
  EXPECT_NO_THROW(delayed.result());
  delayed.done();
}

}  // namespace delayed_update_test
}  // namespace patrickstar::engine_detail
