// Private to engine/src: where the iteration's gradients are and what LibTorch code sees of them,
// beyond each parameter's own (Param::grad, Param::pending_grad in param_table.h). The engine
// writes gradients into chunks (engine_gradients.cpp), shows them as tensor.grad() and takes back
// what the trainer's code did to them (engine_grad_handles.cpp); this is the state those share.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>

namespace patrickstar::engine_detail {

// Invariants: whether a gradient space exists is decided once, before registration; the marker's
// gradient is the one the engine armed until the trainer's zero_grad() resets, replaces or zeroes
// it; `reduced` holds at most one tensor per chunk index, each dropped by the step or zero_grad().
class GradientState {
 public:
  // A separate kGrad chunk list (fp32, or gradient accumulation above 1): decided when the engine
  // is built (before registration), never changed.
  void decide_space(bool space) { space_ = space; }
  bool space() const { return space_; }

  // Mixed precision without a gradient space: half slots hold gradients instead of weights (from a
  // backward until the step or zero_grad() restores them).
  bool in_half_slots() const { return in_half_slots_; }
  void set_in_half_slots(bool in_half_slots) { in_half_slots_ = in_half_slots; }

  // What the trainer's code sees as grad(): some parameter's is an engine handle (`views` true:
  // some of them are views of chunk slots); cleared when the engine takes them back.
  void note_handles_shown(bool views) {
    handles_shown_ = true;
    views_shown_ = views_shown_ || views;
  }
  void clear_shown() { handles_shown_ = views_shown_ = false; }
  bool handles_shown() const { return handles_shown_; }
  bool views_shown() const { return views_shown_; }
  // True the first time only: the backward-after-step-without-zero_grad warning is given once.
  bool first_consumed_warning() { return !std::exchange(warned_consumed_, true); }

  // Data parallel, mixed precision without a gradient space: the reduced fp32 gradients, per chunk
  // index this rank owns (until the step).
  void size_reduced(int64_t chunk_indices) { reduced_.resize(static_cast<size_t>(chunk_indices)); }
  at::Tensor& reduced(int64_t index) { return reduced_.at(static_cast<size_t>(index)); }
  const at::Tensor& reduced(int64_t index) const { return reduced_.at(static_cast<size_t>(index)); }
  void drop_reduced() {
    for (at::Tensor& sum : reduced_) sum.reset();
  }

  // zero_grad() through torch::optim::Optimizer& reaches the engine through this marker: a
  // parameter of the trainer's optimizer whose gradient the engine arms; reset, replaced or zeroed
  // means zero_grad() was called.
  void create_marker() {
    marker_ = at::zeros({1}).requires_grad_();
    marker_grad_ = at::zeros({1});
    arm_marker();
  }
  void arm_marker() {
    marker_grad_.zero_();
    marker_.mutable_grad() = marker_grad_;
    marker_version_ = marker_grad_._version();
  }
  // Whether the trainer's code reset, replaced or zeroed the marker's gradient since it was armed.
  bool marker_touched() const {
    const at::Tensor& grad = marker_.grad();
    return !grad.defined() || !grad.is_same(marker_grad_) || grad._version() != marker_version_;
  }
  // The marker's gradient was reset (set_to_none, the default) rather than zeroed in place.
  bool marker_reset() const { return !marker_.grad().defined(); }
  const at::Tensor& marker() const { return marker_; }

 private:
  bool space_ = false;
  bool in_half_slots_ = false;
  bool handles_shown_ = false;
  bool views_shown_ = false;
  bool warned_consumed_ = false;
  std::vector<at::Tensor> reduced_;
  at::Tensor marker_;
  at::Tensor marker_grad_;
  int64_t marker_version_ = 0;
};

}  // namespace patrickstar::engine_detail
