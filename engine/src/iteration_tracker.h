// Private to engine/src: where the engine is in an iteration. One enum, changed only by
// IterationTracker::on(), with what belongs to the phase (the forward's first moment, whether its
// graph holds backward hooks, the backward passes since the last step). The engine reads the phase
// and decides what to do with chunks, gradients and the trace; the tracker only keeps the state.
//
//   kIdle --forward--> kForward --backward begins--> kBackward --ends--> kBackwardDone --step--> kIdle
//              kStarted: an iteration whose forward was forgotten (or whose gradients were
//              discarded), its earlier moments kept; a forward, a backward or a step go on from it.
#pragma once

#include <cstdint>

#include <c10/util/Exception.h>

namespace patrickstar::engine_detail {

enum class Phase {
  kIdle,          // no iteration since the last step (or a dropped iteration): nothing recorded
  kStarted,       // an iteration began, no forward or backward in progress, no backward done
  kForward,       // a training forward in progress (doors open, or its graph waits for backward)
  kBackward,      // a backward in progress (a checkpoint's recompute opens doors in it)
  kBackwardDone,  // one or more backward passes done since the last step; no forward in progress
};

enum class PhaseEvent {
  kForwardBegins,        // a training door opens (in a backward: a recompute, the phase stays)
  kForwardAbandoned,     // the forward in progress will never reach backward
  kBackwardBegins,       // the engine's backward() or the first hook of a plain loss.backward()
  kBackwardEnds,         // the end of that pass
  kGradientsDiscarded,   // zero_grad(): the backward passes so far reach no step
  kStepDone,             // step() finished the iteration
  kIterationDropped,     // a failure dropped the iteration (gradients and moments)
};

class IterationTracker {
 public:
  Phase phase() const { return phase_; }
  bool in_iteration() const { return phase_ != Phase::kIdle; }
  bool in_backward() const { return phase_ == Phase::kBackward; }
  // No forward or backward in progress and no gradient waiting for a step.
  bool between_iterations() const { return phase_ == Phase::kIdle || phase_ == Phase::kStarted; }
  int backwards_since_step() const { return backwards_since_step_; }
  // The moments of the iteration before the forward in progress (where a forgotten forward
  // rewinds the trace to).
  int64_t forward_start_moment() const { return forward_start_moment_; }
  // The forward in progress put pre-backward nodes in a graph (a door closed with hooked outputs).
  bool hooks_in_forward() const { return hooks_in_forward_; }
  // Steps taken (the number of the iteration in progress), retraces since the engine was built,
  // and whether this iteration's trace diverged and was re-recorded.
  int64_t iteration() const { return iteration_; }
  int64_t retraces() const { return retraces_; }
  bool retraced() const { return retraced_; }
  void note_retrace() {
    ++retraces_;
    retraced_ = true;
  }
  void clear_retraced() { retraced_ = false; }
  // The last moment recorded, until its compute is over (close_moment); -1: none.
  int64_t open_moment() const { return open_moment_; }
  void set_open_moment(int64_t moment) { open_moment_ = moment; }
  void note_hooks_in_forward() {
    if (phase_ == Phase::kForward) hooks_in_forward_ = true;
  }

  // The one transition function. `moments_so_far`: the trace's length (kForwardBegins only).
  // Returns the phase before the event.
  Phase on(PhaseEvent event, int64_t moments_so_far = 0) {
    const Phase before = phase_;
    switch (event) {
      case PhaseEvent::kForwardBegins:
        if (phase_ == Phase::kForward || phase_ == Phase::kBackward) break;
        forward_start_moment_ = moments_so_far;
        hooks_in_forward_ = false;
        phase_ = Phase::kForward;
        break;
      case PhaseEvent::kForwardAbandoned:
        TORCH_INTERNAL_ASSERT(phase_ == Phase::kForward, "patrickstar: internal: a forward "
                              "abandoned in phase ", static_cast<int>(phase_));
        hooks_in_forward_ = false;
        phase_ = backwards_since_step_ > 0 ? Phase::kBackwardDone : Phase::kStarted;
        break;
      case PhaseEvent::kBackwardBegins:
        phase_ = Phase::kBackward;
        break;
      case PhaseEvent::kBackwardEnds:
        hooks_in_forward_ = false;
        ++backwards_since_step_;
        phase_ = Phase::kBackwardDone;
        break;
      case PhaseEvent::kGradientsDiscarded:
        backwards_since_step_ = 0;
        if (phase_ == Phase::kBackwardDone) phase_ = Phase::kStarted;
        break;
      case PhaseEvent::kStepDone:
        ++iteration_;
        [[fallthrough]];
      case PhaseEvent::kIterationDropped:
        backwards_since_step_ = 0;
        hooks_in_forward_ = false;
        forward_start_moment_ = 0;
        phase_ = Phase::kIdle;
        break;
    }
    return before;
  }

 private:
  Phase phase_ = Phase::kIdle;
  int backwards_since_step_ = 0;
  int64_t forward_start_moment_ = 0;
  bool hooks_in_forward_ = false;
  int64_t iteration_ = 0;
  int64_t retraces_ = 0;
  bool retraced_ = false;
  int64_t open_moment_ = -1;
};

}  // namespace patrickstar::engine_detail
