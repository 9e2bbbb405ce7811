// Loss scaling for fp16 training with DeepSpeed's config semantics ("fp16" section: loss_scale,
// initial_scale_power, loss_scale_window, hysteresis, consecutive_hysteresis, min_loss_scale).
// bf16 and fp32 need no scaler: use LossScaler::disabled() (scale 1, never changes).
// Not thread-safe (one per engine, updated once per step); a plain value type.
//
// The rules, as DeepSpeed's DynamicLossScaler.update_scale (deepspeed/runtime/fp16/loss_scaler.py):
// - static (loss_scale > 0): the scale never changes; overflow steps are still skipped.
// - dynamic (loss_scale == 0): the scale starts at 2^initial_scale_power; `hysteresis_left` starts
//   at `hysteresis`.
// - on overflow: if hysteresis == 1 or hysteresis_left == 1, the scale is divided by 2 but not
// below
//   min_loss_scale (with raise_error_at_min_scale, an overflow while already at the minimum throws
//   c10::Error and changes nothing); otherwise hysteresis_left decreases by one and the scale
//   stays. Either way the overflow step number is remembered. hysteresis_left is NOT restored here:
//   once used up, every further overflow halves the scale until the next growth.
// - on a clean step: with consecutive_hysteresis, hysteresis_left is restored to `hysteresis`.
//   If (step - last_overflow_step) is a multiple of loss_scale_window, the scale doubles and (if
//   not consecutive_hysteresis) hysteresis_left is restored. The first growth thus comes after
//   loss_scale_window clean steps from the start or from the last overflow.
// - the step counter advances after every update, clean or not.
#pragma once

#include <cstdint>

namespace patrickstar {

struct LossScalerOptions {
  double loss_scale = 0.0;           // 0 = dynamic; > 0 = static scale
  int initial_scale_power = 16;      // dynamic: first scale is 2^initial_scale_power
  int64_t loss_scale_window = 1000;  // clean steps between growths
  int hysteresis = 2;                // overflows tolerated before the scale is lowered
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1.0;
  bool raise_error_at_min_scale = true;  // DeepSpeed's default
};

// What a checkpoint keeps of a scaler (the options come from the config).
struct LossScalerState {
  double scale = 1.0;
  int64_t step = 0;
  int64_t last_overflow_step = -1;
  int hysteresis_left = 1;
};

class LossScaler {
 public:
  // Throws c10::Error on nonsensical options (negative scale, window < 1, hysteresis < 1, ...).
  explicit LossScaler(const LossScalerOptions& options = {});
  // A scaler for bf16/fp32: scale 1, static.
  static LossScaler disabled();

  double scale() const { return state_.scale; }
  bool dynamic() const { return options_.loss_scale == 0.0; }
  // The factor the update multiplies gradients by to undo the scale.
  double inverse_scale() const { return 1.0 / state_.scale; }

  // Call once per step, after the overflow check. See the rules above.
  void update(bool overflow);

  const LossScalerOptions& options() const { return options_; }
  LossScalerState state() const { return state_; }
  // Throws c10::Error (and changes nothing) if the state is invalid (scale <= 0, ...).
  void load_state(const LossScalerState& state);
  // Throws c10::Error, as load_state would, when `state` cannot be this scaler's; changes nothing.
  void check_state(const LossScalerState& state) const;

 private:
  LossScalerOptions options_;
  LossScalerState state_;
};

}  // namespace patrickstar
