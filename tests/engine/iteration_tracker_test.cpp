// The iteration's phase (engine/src/iteration_tracker.h): one enum, one transition function. The
// engine's behaviour around these transitions is tested through LibTorch loops elsewhere
// (libtorch_idioms_test, engine_recovery_test); these pin the table itself.
#include <gtest/gtest.h>

#include <c10/util/Exception.h>

#include "iteration_tracker.h"

namespace iteration_tracker_test {

using patrickstar::engine_detail::IterationTracker;
using patrickstar::engine_detail::Phase;
using patrickstar::engine_detail::PhaseEvent;

TEST(IterationTracker, AForwardBackwardStepComesBackToIdle) {
  IterationTracker t;
  EXPECT_FALSE(t.in_iteration());
  EXPECT_EQ(t.on(PhaseEvent::kForwardBegins, 0), Phase::kIdle);
  EXPECT_EQ(t.phase(), Phase::kForward);
  t.note_hooks_in_forward();
  EXPECT_TRUE(t.hooks_in_forward());
  t.on(PhaseEvent::kBackwardBegins);
  EXPECT_TRUE(t.in_backward());
  t.on(PhaseEvent::kBackwardEnds);
  EXPECT_EQ(t.phase(), Phase::kBackwardDone);
  EXPECT_EQ(t.backwards_since_step(), 1);
  EXPECT_FALSE(t.hooks_in_forward());
  t.on(PhaseEvent::kStepDone);
  EXPECT_EQ(t.phase(), Phase::kIdle);
  EXPECT_EQ(t.backwards_since_step(), 0);
}

TEST(IterationTracker, AnAbandonedForwardKeepsWhatCameBeforeIt) {
  IterationTracker t;
  t.on(PhaseEvent::kForwardBegins, 0);
  t.on(PhaseEvent::kForwardAbandoned);
  EXPECT_EQ(t.phase(), Phase::kStarted);  // the iteration began; its moments so far are kept
  EXPECT_TRUE(t.between_iterations());
  t.on(PhaseEvent::kForwardBegins, 0);
  t.on(PhaseEvent::kBackwardBegins);
  t.on(PhaseEvent::kBackwardEnds);
  // A second forward (accumulation) starts at moment 7 and is abandoned: the backward stays done.
  t.on(PhaseEvent::kForwardBegins, 7);
  EXPECT_EQ(t.forward_start_moment(), 7);
  t.on(PhaseEvent::kForwardAbandoned);
  EXPECT_EQ(t.phase(), Phase::kBackwardDone);
  EXPECT_EQ(t.backwards_since_step(), 1);
  EXPECT_FALSE(t.between_iterations());
}

TEST(IterationTracker, ARecomputeInBackwardStaysInTheBackward) {
  IterationTracker t;
  t.on(PhaseEvent::kForwardBegins, 3);
  t.on(PhaseEvent::kBackwardBegins);
  t.on(PhaseEvent::kForwardBegins, 12);  // a checkpoint's recompute opens doors
  EXPECT_EQ(t.phase(), Phase::kBackward);
  EXPECT_EQ(t.forward_start_moment(), 3);
  t.note_hooks_in_forward();
  EXPECT_FALSE(t.hooks_in_forward());  // a recompute's graph is not a forward's
}

TEST(IterationTracker, DiscardedGradientsReachNoStep) {
  IterationTracker t;
  t.on(PhaseEvent::kForwardBegins, 0);
  t.on(PhaseEvent::kBackwardBegins);
  t.on(PhaseEvent::kBackwardEnds);
  EXPECT_EQ(t.on(PhaseEvent::kGradientsDiscarded), Phase::kBackwardDone);
  EXPECT_EQ(t.phase(), Phase::kStarted);
  EXPECT_EQ(t.backwards_since_step(), 0);
  // zero_grad() between a forward and its backward leaves the forward in progress.
  t.on(PhaseEvent::kForwardBegins, 0);
  t.on(PhaseEvent::kGradientsDiscarded);
  EXPECT_EQ(t.phase(), Phase::kForward);
}

TEST(IterationTracker, ADroppedIterationForgetsEverything) {
  IterationTracker t;
  t.on(PhaseEvent::kForwardBegins, 5);
  t.note_hooks_in_forward();
  t.on(PhaseEvent::kBackwardBegins);
  t.on(PhaseEvent::kIterationDropped);
  EXPECT_EQ(t.phase(), Phase::kIdle);
  EXPECT_EQ(t.forward_start_moment(), 0);
  EXPECT_FALSE(t.hooks_in_forward());
  EXPECT_EQ(t.backwards_since_step(), 0);
}

TEST(IterationTracker, AbandoningAForwardThatIsNotInProgressIsAnInternalError) {
  IterationTracker t;
  EXPECT_THROW(t.on(PhaseEvent::kForwardAbandoned), c10::Error);
  EXPECT_EQ(t.phase(), Phase::kIdle);
}

}  // namespace iteration_tracker_test
