// Private to engine/src: where the iteration's gradients are and what LibTorch code sees of them,
// beyond each parameter's own (Param::grad, Param::pending_grad in param_table.h). The engine
// writes gradients into chunks (engine_gradients.cpp), shows them as tensor.grad() and takes back
// what the trainer's code did to them (engine_grad_handles.cpp); this is the state those share.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace patrickstar::engine_detail {

struct GradientState {
  // A separate kGrad chunk list (fp32, or gradient accumulation above 1): decided when the engine
  // is built, never changed.
  bool space = false;
  // Mixed precision without a gradient space: half slots hold gradients instead of weights (from a
  // backward until the step or zero_grad() restores them).
  bool in_half_slots = false;
  bool handles_shown = false;    // some parameter's grad() is an engine handle
  bool views_shown = false;      // ... and some of them are views of chunk slots
  bool warned_consumed = false;  // the backward-after-step-without-zero_grad warning was given
  // Data parallel, mixed precision without a gradient space: the reduced fp32 gradients, per chunk
  // index this rank owns (until the step).
  std::vector<at::Tensor> reduced;
  // zero_grad() through torch::optim::Optimizer& reaches the engine through this marker: a
  // parameter of the trainer's optimizer whose gradient the engine arms; reset, replaced or zeroed
  // means zero_grad() was called.
  at::Tensor marker;
  at::Tensor marker_grad;
  int64_t marker_version = 0;
};

}  // namespace patrickstar::engine_detail
