// The moment clock and the warm-up trace. A moment is each pre-forward and pre-backward of a module
// that owns parameters, and each optimizer-step moment; the clock restarts every iteration. The
// warm-up iteration records per moment its non-model bytes (the probe's peak since the previous
// moment: measured, never estimated) and the chunks accessed; later iterations check that the same
// moments come in the same order. TraceRecorder is not thread-safe (the engine calls it from the
// training thread).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace patrickstar {

class MemoryProbe;

enum class MomentKind { kPreForward, kPreBackward, kStep };
const char* moment_kind_name(MomentKind kind);

struct Moment {
  MomentKind kind = MomentKind::kPreForward;
  std::string label;  // the module's name, or "step" / "step:<group>" for optimizer moments
  // Peak non-model bytes over the interval that ends at this moment (since the previous moment).
  int64_t non_model_bytes = 0;
  // Chunks accessed at this moment, in access order, each once.
  std::vector<int64_t> chunk_ids;
  // Chunks that must be on the host at this moment (a host-side optimizer reads their gradients
  // and writes new weights there), each once, none of them in chunk_ids.
  std::vector<int64_t> host_chunk_ids = {};
};

// One iteration's moments. tail_non_model_bytes is the peak from the last moment to the end of the
// iteration (the optimizer step's temporaries, the loss of the next batch's loading ...).
struct Trace {
  std::vector<Moment> moments;
  int64_t tail_non_model_bytes = 0;

  int64_t size() const { return static_cast<int64_t>(moments.size()); }
  // Non-model bytes of the interval after moment m: moment m+1's, or for the last moment the tail
  // and the first moment of the next iteration.
  int64_t next_non_model_bytes(int64_t m) const;
  // True when kinds, labels and accessed chunks match moment by moment (non-model bytes may
  // differ).
  bool same_moments(const Trace& other) const;
};

// When each chunk is needed next, from a trace that repeats every iteration: the accesses
// flattened into one sequence (moment by moment, within a moment in recorded order). A chunk sent
// to the host (host_chunk_ids) before its next access gains nothing by staying on the device until
// then, so it counts as never used again. Shared by the scheduler's OPT policy and the OPT bound.
class NextUseIndex {
 public:
  static constexpr int64_t kNever = INT64_MAX;
  NextUseIndex() = default;
  explicit NextUseIndex(const Trace& trace);
  // The flattened position of `chunk_id`'s first access after moment m, in this iteration's frame
  // (positions >= accesses_per_iteration() are in the next iteration), or kNever.
  int64_t next_use(int64_t chunk_id, int64_t m) const;
  // True when `chunk_id` is sent to the host (host_chunk_ids) after moment m before it is accessed
  // again: its device copy has no more use, and moving it now costs no more than moving it then.
  bool host_before_use(int64_t chunk_id, int64_t m) const;
  int64_t accesses_per_iteration() const { return accesses_per_iteration_; }
  // Chunks accessed somewhere in the trace.
  std::vector<int64_t> accessed_chunks() const;

 private:
  std::map<int64_t, std::vector<std::pair<int64_t, int64_t>>> uses_;  // (moment, position)
  std::map<int64_t, std::vector<int64_t>> host_moments_;
  int64_t accesses_per_iteration_ = 0;
  int64_t moments_ = 0;
};

// Usage (the engine):
//   TraceRecorder recorder(&probe);
//   for each iteration: recorder.begin_iteration();
//     at each moment:   int64_t m = recorder.tick(kind, label); recorder.record_access(chunk_id)
//     ... recorder.end_iteration();
//   recorder.warmup_trace()  // iteration 0, complete after its end_iteration()
class TraceRecorder {
 public:
  // probe: not owned, may be nullptr (then non-model bytes are recorded as 0); must outlive the
  // recorder.
  explicit TraceRecorder(MemoryProbe* probe);

  void begin_iteration();
  // Closes the previous moment's measurement and opens moment m (returned). From iteration 1 on,
  // throws c10::Error when the moment differs from the warm-up's moment m (the model's control flow
  // changed).
  int64_t tick(MomentKind kind, const std::string& label);
  // Records that `chunk_id` is accessed at the current moment (duplicates are ignored).
  void record_access(int64_t chunk_id);
  // Records that `chunk_id` must be on the host at the current moment (duplicates are ignored).
  void record_host(int64_t chunk_id);
  // Closes the iteration; from iteration 1 on, throws when it had fewer moments than the warm-up.
  void end_iteration();

  // Iterations begun so far minus one: 0 during the first (warm-up) iteration.
  int64_t iteration() const { return iteration_; }
  int64_t current_moment() const { return current_moment_; }  // -1 before the first tick
  // True once a warm-up iteration has ended (and until rewarm()).
  bool has_warmup_trace() const { return has_warmup_; }
  const Trace& warmup_trace() const { return warmup_; }
  // The iteration in progress (or the last finished one).
  const Trace& current_trace() const { return current_; }
  // Forgets the iteration in progress (a forward that was discarded): the next begin_iteration
  // starts the same iteration number again. A no-op outside an iteration.
  void abort_iteration();
  // Drops the warm-up trace. Between iterations, the next iteration records a new one; inside an
  // iteration, the moments recorded so far stay and the iteration in progress becomes the new
  // warm-up trace at its end_iteration (a change of control flow, detected with matches_next).
  void rewarm();
  // True when a moment (kind, label) at the next position is what the warm-up trace expects there
  // (always true without a warm-up trace); otherwise false, with the difference in *why.
  bool matches_next(MomentKind kind, const std::string& label, std::string* why) const;
  // Forgets the moments of the iteration in progress from position `moments` on (a forward whose
  // loss was dropped, or that threw): the next tick is moment `moments` again.
  void rewind_to(int64_t moments);

 private:
  int64_t take_peak();

  MemoryProbe* probe_;
  Trace warmup_;
  Trace current_;
  bool has_warmup_ = false;
  bool in_iteration_ = false;
  int64_t iteration_ = -1;
  int64_t current_moment_ = -1;
};

}  // namespace patrickstar
