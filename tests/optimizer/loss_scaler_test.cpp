// LossScaler against DeepSpeed's DynamicLossScaler semantics: growth after the window, hysteresis,
// consecutive hysteresis, the minimum, static scales, checkpoint state.
#include <gtest/gtest.h>

#include <c10/util/Exception.h>

#include <cmath>
#include <random>

#include "patrickstar/optimizer/loss_scaler.h"

namespace patrickstar {
namespace loss_scaler_test {

LossScalerOptions dynamic_options(int power, int64_t window, int hysteresis, double min_scale) {
  LossScalerOptions o;
  o.loss_scale = 0;
  o.initial_scale_power = power;
  o.loss_scale_window = window;
  o.hysteresis = hysteresis;
  o.min_loss_scale = min_scale;
  return o;
}

TEST(LossScaler, StartsAtTwoToThePowerAndGrowsAfterWindow) {
  LossScaler scaler(dynamic_options(10, 3, 2, 1));
  EXPECT_TRUE(scaler.dynamic());
  EXPECT_EQ(scaler.scale(), 1024.0);
  scaler.update(false);
  scaler.update(false);
  EXPECT_EQ(scaler.scale(), 1024.0);  // two clean steps: window of 3 not complete
  scaler.update(false);
  EXPECT_EQ(scaler.scale(), 2048.0);  // third clean step doubles
  for (int i = 0; i < 3; ++i) scaler.update(false);
  EXPECT_EQ(scaler.scale(), 4096.0);  // and again after the next window
  EXPECT_DOUBLE_EQ(scaler.inverse_scale(), 1.0 / 4096.0);
}

TEST(LossScaler, HysteresisDelaysTheDecreaseAndIsRestoredOnlyOnGrowth) {
  LossScaler scaler(dynamic_options(10, 4, 2, 1));
  scaler.update(true);  // first overflow: absorbed by hysteresis
  EXPECT_EQ(scaler.scale(), 1024.0);
  EXPECT_EQ(scaler.state().hysteresis_left, 1);
  scaler.update(false);  // a clean step does not restore it (consecutive_hysteresis off)
  EXPECT_EQ(scaler.state().hysteresis_left, 1);
  scaler.update(true);  // budget used up: halve
  EXPECT_EQ(scaler.scale(), 512.0);
  scaler.update(true);  // still used up: halve again, no reset on a decrease
  EXPECT_EQ(scaler.scale(), 256.0);
  for (int i = 0; i < 3; ++i) scaler.update(false);
  EXPECT_EQ(scaler.scale(), 256.0);
  scaler.update(false);  // 4 clean steps since the last overflow: grow and restore hysteresis
  EXPECT_EQ(scaler.scale(), 512.0);
  EXPECT_EQ(scaler.state().hysteresis_left, 2);
  scaler.update(true);  // absorbed again
  EXPECT_EQ(scaler.scale(), 512.0);
}

TEST(LossScaler, ConsecutiveHysteresisRestoresOnEveryCleanStep) {
  LossScalerOptions o = dynamic_options(10, 100, 2, 1);
  o.consecutive_hysteresis = true;
  LossScaler scaler(o);
  scaler.update(true);
  scaler.update(false);  // restores the budget
  scaler.update(true);
  EXPECT_EQ(scaler.scale(), 1024.0);  // never two overflows in a row: never lowered
  scaler.update(true);
  EXPECT_EQ(scaler.scale(), 512.0);
}

TEST(LossScaler, RespectsTheMinimum) {
  LossScalerOptions o = dynamic_options(3, 1000, 1, 4.0);
  o.raise_error_at_min_scale = false;
  LossScaler scaler(o);
  scaler.update(true);
  EXPECT_EQ(scaler.scale(), 4.0);
  scaler.update(true);
  EXPECT_EQ(scaler.scale(), 4.0);

  o.raise_error_at_min_scale = true;  // DeepSpeed's default: an overflow at the minimum is fatal
  LossScaler strict(o);
  strict.update(true);
  ASSERT_EQ(strict.scale(), 4.0);
  const LossScalerState before = strict.state();
  EXPECT_THROW(strict.update(true), c10::Error);
  EXPECT_EQ(strict.state().scale, before.scale);  // nothing changed
  EXPECT_EQ(strict.state().step, before.step);
}

TEST(LossScaler, StaticScaleNeverChanges) {
  LossScalerOptions o;
  o.loss_scale = 128;
  LossScaler scaler(o);
  EXPECT_FALSE(scaler.dynamic());
  for (int i = 0; i < 5; ++i) scaler.update(i % 2 == 0);
  EXPECT_EQ(scaler.scale(), 128.0);
  EXPECT_EQ(LossScaler::disabled().scale(), 1.0);
}

TEST(LossScaler, RejectsBadOptionsAndState) {
  EXPECT_THROW(LossScaler(dynamic_options(10, 0, 2, 1)), c10::Error);
  EXPECT_THROW(LossScaler(dynamic_options(10, 10, 0, 1)), c10::Error);
  EXPECT_THROW(LossScaler(dynamic_options(10, 10, 2, 0)), c10::Error);
  LossScalerOptions negative;
  negative.loss_scale = -1;
  EXPECT_THROW(LossScaler{negative}, c10::Error);
  LossScaler scaler(dynamic_options(10, 10, 2, 1));
  LossScalerState bad = scaler.state();
  bad.scale = 0;
  EXPECT_THROW(scaler.load_state(bad), c10::Error);
  EXPECT_EQ(scaler.scale(), 1024.0);
}

// Transcription of DeepSpeed's update_scale (loss_scaler.py) written as the Python reads, used as
// an oracle on random overflow sequences; and a checkpoint round trip mid-sequence.
struct DeepSpeedOracle {
  double cur_scale;
  int64_t cur_iter = 0;
  int64_t last_overflow_iter = -1;
  int64_t scale_window;
  double min_scale;
  int delayed_shift;
  int cur_hysteresis;
  bool consecutive_hysteresis;
  void update_scale(bool overflow) {
    if (overflow) {
      if (delayed_shift == 1 || cur_hysteresis == 1) {
        cur_scale = std::max(cur_scale / 2.0, min_scale);
      } else {
        cur_hysteresis -= 1;
      }
      last_overflow_iter = cur_iter;
    } else {
      if (consecutive_hysteresis) cur_hysteresis = delayed_shift;
      if ((cur_iter - last_overflow_iter) % scale_window == 0) {
        if (!consecutive_hysteresis) cur_hysteresis = delayed_shift;
        cur_scale *= 2.0;
      }
    }
    cur_iter += 1;
  }
};

TEST(LossScaler, MatchesDeepSpeedOnRandomSequences) {
  std::mt19937 rng(42);
  for (int trial = 0; trial < 40; ++trial) {
    LossScalerOptions o = dynamic_options(static_cast<int>(rng() % 20), 1 + rng() % 7,
                                          1 + static_cast<int>(rng() % 4), 1.0 + rng() % 3);
    o.consecutive_hysteresis = trial % 2 == 1;
    o.raise_error_at_min_scale = false;
    LossScaler scaler(o);
    DeepSpeedOracle oracle{std::ldexp(1.0, o.initial_scale_power),
                           0,
                           -1,
                           o.loss_scale_window,
                           o.min_loss_scale,
                           o.hysteresis,
                           o.hysteresis,
                           o.consecutive_hysteresis};
    std::bernoulli_distribution overflow(0.3);
    for (int step = 0; step < 200; ++step) {
      const bool of = overflow(rng);
      scaler.update(of);
      oracle.update_scale(of);
      ASSERT_EQ(scaler.scale(), oracle.cur_scale) << "trial " << trial << " step " << step;
      ASSERT_EQ(scaler.state().hysteresis_left, oracle.cur_hysteresis);
      if (step == 100) {  // checkpoint round trip
        LossScaler restored(o);
        restored.load_state(scaler.state());
        scaler = restored;
      }
    }
  }
}

}  // namespace loss_scaler_test
}  // namespace patrickstar
