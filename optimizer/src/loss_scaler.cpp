#include "patrickstar/optimizer/loss_scaler.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace patrickstar {

LossScaler::LossScaler(const LossScalerOptions& options) : options_(options) {
  TORCH_CHECK(options.loss_scale >= 0.0 && std::isfinite(options.loss_scale),
              "fp16.loss_scale must be 0 (dynamic) or a positive number, got ", options.loss_scale);
  TORCH_CHECK(options.initial_scale_power >= 0 && options.initial_scale_power < 128,
              "fp16.initial_scale_power must be in [0, 127], got ", options.initial_scale_power);
  TORCH_CHECK(options.loss_scale_window >= 1, "fp16.loss_scale_window must be >= 1, got ",
              options.loss_scale_window);
  TORCH_CHECK(options.hysteresis >= 1, "fp16.hysteresis must be >= 1, got ", options.hysteresis);
  TORCH_CHECK(options.min_loss_scale > 0.0, "fp16.min_loss_scale must be > 0, got ",
              options.min_loss_scale);
  state_.scale = dynamic() ? std::ldexp(1.0, options.initial_scale_power) : options.loss_scale;
  state_.hysteresis_left = options.hysteresis;
}

LossScaler LossScaler::disabled() {
  LossScalerOptions options;
  options.loss_scale = 1.0;
  return LossScaler(options);
}

void LossScaler::update(bool overflow) {
  if (!dynamic()) {
    ++state_.step;
    return;
  }
  LossScalerState next = state_;
  if (overflow) {
    if (options_.hysteresis == 1 || next.hysteresis_left == 1) {
      TORCH_CHECK(!(next.scale == options_.min_loss_scale && options_.raise_error_at_min_scale),
                  "gradient overflow at step ", next.step,
                  " with the loss scale already at "
                  "min_loss_scale = ",
                  options_.min_loss_scale,
                  "; the scale cannot be lowered further. Check the model for inf/NaN, or lower "
                  "fp16.min_loss_scale");
      next.scale = std::max(next.scale / 2.0, options_.min_loss_scale);
    } else {
      --next.hysteresis_left;
    }
    next.last_overflow_step = next.step;
  } else {
    if (options_.consecutive_hysteresis) next.hysteresis_left = options_.hysteresis;
    if ((next.step - next.last_overflow_step) % options_.loss_scale_window == 0) {
      if (!options_.consecutive_hysteresis) next.hysteresis_left = options_.hysteresis;
      next.scale *= 2.0;
    }
  }
  ++next.step;
  state_ = next;
}

void LossScaler::load_state(const LossScalerState& state) {
  check_state(state);
  state_ = state;
}

void LossScaler::check_state(const LossScalerState& state) const {
  TORCH_CHECK(state.scale > 0.0 && std::isfinite(state.scale),
              "loss scaler state: scale must be positive and finite, got ", state.scale);
  TORCH_CHECK(state.step >= 0 && state.last_overflow_step >= -1 &&
                  state.last_overflow_step < state.step + 1,
              "loss scaler state: step ", state.step, " and last_overflow_step ",
              state.last_overflow_step, " are inconsistent");
  TORCH_CHECK(state.hysteresis_left >= 1 && state.hysteresis_left <= options_.hysteresis,
              "loss scaler state: hysteresis_left ", state.hysteresis_left, " outside [1, ",
              options_.hysteresis, "]");
}

}  // namespace patrickstar
