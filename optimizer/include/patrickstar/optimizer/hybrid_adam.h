// HybridAdam: one optimizer step over a model's chunks. It checks every chunk's gradient once
// (non-finite + squared norm, fused), skips the step on overflow (restoring the half weights from
// the fp32 master so nothing is corrupted) and otherwise folds loss-scale removal and global-norm
// clipping into one gradient multiplier and runs the Adam/AdamW update per chunk: on the device for
// the chunks the placement puts there, on the host (SIMD kernel, cpu_adam.h) for the rest.
// Not thread-safe: one instance per engine, step() called from one thread. It owns no chunk memory;
// the AdamChunk views must stay valid during step().
//
// Usage (the engine):
//   HybridAdam adam(AdamOptions().lr(1e-4).weight_decay(0.01).max_grad_norm(1.0),
//                   LossScaler(fp16_options));           // or LossScaler::disabled() for bf16/fp32
//   loss * adam.loss_scale() -> backward -> grads in the half slots
//   PlacementPlan plan = plan_placement(state_bytes, tracer_margin_bytes);  // move chunks per plan
//   StepReport r = adam.step(chunks, plan);               // r.skipped on overflow
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "patrickstar/optimizer/adam_rule.h"
#include "patrickstar/optimizer/cpu_adam.h"
#include "patrickstar/optimizer/loss_scaler.h"
#include "patrickstar/optimizer/placement.h"
#include "patrickstar/optimizer/speculative_update.h"

namespace patrickstar {

// Hyper-parameters, with torch::optim-style chained setters. decoupled = AdamW (the default, as
// DeepSpeed's "AdamW"); decoupled(false) = Adam with L2 weight decay added to the gradient.
struct AdamOptions {
#define PS_ADAM_OPTION(type, name, init) \
  AdamOptions& name(type value) {        \
    name##_ = value;                     \
    return *this;                        \
  }                                      \
  type name() const {                    \
    return name##_;                      \
  }                                      \
  type name##_ = init;
  PS_ADAM_OPTION(double, lr, 1e-3)
  PS_ADAM_OPTION(double, beta1, 0.9)
  PS_ADAM_OPTION(double, beta2, 0.999)
  PS_ADAM_OPTION(double, eps, 1e-8)
  PS_ADAM_OPTION(double, weight_decay, 0.0)
  PS_ADAM_OPTION(bool, decoupled, true)
  PS_ADAM_OPTION(double, max_grad_norm, 0.0)  // <= 0: no clipping
#undef PS_ADAM_OPTION
};

// One chunk's views (contiguous, same numel; the engine passes the used part of each payload).
// exp_avg and exp_avg_sq are both fp32, or both bf16 ("state_dtype": "bf16": the update computed
// in fp32 and the stored moments rounded once per step, adam_update_stored() of adam_rule.h).
// Mixed precision: half_param_grad (bf16/fp16) holds the gradient on entry and the new half weight
// on return; grad_fp32 is undefined. Mixed precision with a gradient space: grad_fp32 holds the
// gradient (it reaches the update in fp32, never rounded to half) and half_param_grad receives the
// new half weight. fp32: half_param_grad is undefined; master is the parameter and grad_fp32 its
// gradient.
struct AdamChunk {
  at::Tensor half_param_grad;
  at::Tensor master;
  at::Tensor grad_fp32;
  at::Tensor exp_avg;
  at::Tensor exp_avg_sq;

  // The states (master in mixed precision, exp_avg, exp_avg_sq) are not in memory: step() asks the
  // AdamStateSource for them just before it updates this chunk (a disk tier). half_param_grad (in
  // mixed precision) or master (fp32) and the gradient are given as usual.
  bool states_from_source = false;

  // The Adam step this update is (1-based, as torch::optim::Adam counts it per parameter): its
  // bias corrections. 0: the optimizer's own count of steps taken, plus one.
  int64_t step = 0;
  // The parameter group whose options (lr, betas, eps, weight decay) this update runs with
  // (HybridAdam::set_groups); every tensor of the views is of it.
  int32_t group = 0;

  // This chunk's update computed ahead (speculative_update.h), applied and undoable: step()
  // commits it when its constants are the step's own, else undoes it and updates the chunk itself
  // (on overflow it undoes it). Host chunks only, states in memory.
  SpeculativeUpdate* speculative = nullptr;

  bool mixed() const { return half_param_grad.defined(); }
  // Bytes of one element of momentum (and of variance): 4 (fp32), or 2 (bf16 states).
  int64_t moment_bytes() const {
    return exp_avg.defined() && exp_avg.scalar_type() == at::kBFloat16 ? 2 : 4;
  }
  // Bytes the update touches: master, momentum, variance (+ the gradient slot).
  int64_t state_bytes() const;
};

// Where step() gets the states of chunks marked states_from_source, in chunk order: acquire(k)
// fills chunk k's master (mixed precision), exp_avg and exp_avg_sq; release(k, updated) hands them
// back (`updated`: the update changed them and they must be kept). Every acquire is followed by its
// release before the next acquire, also when the update throws.
class AdamStateSource {
 public:
  virtual ~AdamStateSource() = default;
  virtual void acquire(size_t k, AdamChunk& chunk) = 0;
  virtual void release(size_t k, bool updated) = 0;
};

// Loss-scale removal and clipping folded into one factor. `sum_squares` is the squared norm of the
// *scaled* gradients over all chunks. clip_coef follows torch::nn::utils::clip_grad_norm_:
// max_norm / (norm + 1e-6) in float, clamped to 1.
struct GradMultiplier {
  double grad_norm = 0.0;   // global L2 norm of the unscaled gradients
  float clip_coef = 1.0f;   // 1 when not clipping
  float multiplier = 1.0f;  // clip_coef / loss_scale: what the update multiplies gradients by
};
GradMultiplier gradient_multiplier(const GradStats& total, double loss_scale, double max_grad_norm);

struct StepReport {
  bool skipped = false;     // overflow: nothing updated, half weights restored from fp32
  int64_t step = 0;         // optimizer steps taken so far (skipped ones do not count)
  double loss_scale = 1.0;  // the scale the gradients carried in this step
  double grad_norm = 0.0;   // unscaled global norm (inf/NaN when skipped)
  float clip_coef = 1.0f;
  PlacementReport placement;  // where the chunks ran (all zero when skipped)
  // Chunks whose update was computed ahead: committed as they were, or undone (and recomputed,
  // unless the step was skipped).
  int64_t speculative_committed = 0;
  int64_t speculative_undone = 0;
};

class HybridAdam {
 public:
  explicit HybridAdam(const AdamOptions& options, LossScaler loss_scaler = LossScaler::disabled());

  // One step. `plan` must have one entry per chunk; a chunk on the device must have its tensors on
  // a CUDA device (the CUDA kernel runs) or on the CPU (the emulated device: the host kernel runs
  // on that memory); a chunk on the host must be on the CPU. Throws c10::Error before touching
  // anything if views disagree in size, dtype or placement.
  // Chunks marked states_from_source get their states from `source` (which must then be given).
  StepReport step(c10::ArrayRef<AdamChunk> chunks, const PlacementPlan& plan,
                  AdamStateSource* source = nullptr);
  // Every chunk on the host.
  StepReport step(c10::ArrayRef<AdamChunk> chunks);

  // The loss must be multiplied by this before backward.
  double loss_scale() const { return loss_scaler_.scale(); }
  LossScaler& loss_scaler() { return loss_scaler_; }
  // Group 0's options (the constructor's), with decoupled and max_grad_norm, which every group
  // shares.
  const AdamOptions& options() const { return groups_.front(); }
  // Parameter groups, as torch::optim's: each has its own lr, betas, eps and weight decay, and a
  // chunk's `group` selects them. set_groups replaces every group's (decoupled and max_grad_norm
  // are kept); each is checked as the constructor checks its options, nothing changed when one is
  // refused.
  size_t group_count() const { return groups_.size(); }
  const AdamOptions& group_options(size_t group) const { return groups_.at(group); }
  void set_groups(const std::vector<AdamOptions>& groups);
  // The learning rate of every group.
  void set_lr(double lr);
  int64_t step_count() const { return step_; }
  // The constants of Adam step `step` (1-based) of group `group` as step() will make them when the
  // gradients are not clipped (clip coefficient 1) and the loss scale stays what it is now: what a
  // speculative update computes with.
  AdamStepConstants constants_without_clipping(int64_t step, int32_t group = 0) const;
  void set_step_count(int64_t step);  // for checkpoints
  // Data parallel: each process steps its own shard of the chunks. `agree` is called with this
  // shard's gradient statistics before anything is decided and must replace them with the global
  // ones (an all-reduce of the sum of squares), so every process skips, clips and scales alike.
  void set_stats_reducer(std::function<void(GradStats&)> agree) { agree_ = std::move(agree); }

 private:
  AdamStepConstants constants(int64_t step, int32_t group, float multiplier) const;

  std::vector<AdamOptions> groups_;  // at least one
  std::function<void(GradStats&)> agree_;
  LossScaler loss_scaler_;
  int64_t step_ = 0;
};

}  // namespace patrickstar
