// CopyQueue: copies issued in order and run by one copy thread, each with a completion event, so
// that a chunk's bytes cross while compute goes on (the emulated device's copy engine; a CUDA tier
// would be a copy stream with CUDA events). Usage:
//
//   patrickstar::CopyQueue queue;                                  // starts the copy thread
//   CopyEvent e = queue.submit([&] { std::memcpy(dst, src, n); }, "param chunk 3 (id 3) to device");
//   ...                                                            // compute goes on meanwhile
//   queue.wait(e);   // returns once that copy (and every copy issued before it) completed
//
// Rules: copies run one at a time in the order they were submitted, so a copy that reads what an
// earlier one writes sees it complete. Completion of event e happens-before wait(e) returns (and
// before done(e) returns true), so bytes the copy wrote may be read after it without a race. A copy
// that throws fails its event: wait() throws c10::Error naming the copy's label and the cause, and
// every copy after it fails too, unrun ("an earlier copy failed: ..."), because its source may be
// what the failed copy should have written. The destructor waits for every copy (errors are not
// rethrown there). Thread-safe: any thread may submit and wait.
//
// Timeline: with set_record_spans(true) the queue keeps one CopySpan per copy it ran (on the copy
// thread, from its start to its end) and one per wait that blocked (on the waiting thread), timed
// by the clock of set_clock (microseconds; by default since the queue was built), so a trace can
// show copies and compute on separate tracks.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace patrickstar {

// A clock in microseconds since this call (steady_clock), callable from any thread: the default
// timeline clock of CopyQueue and Scheduler; the engine gives both the same one.
std::function<int64_t()> microseconds_since_now();

// The position of a copy in its queue's order (1, 2, ...); 0 is "no copy" (always complete).
using CopyEvent = int64_t;

// One interval of the timeline: a copy that ran, or a caller blocked waiting for copies.
struct CopySpan {
  CopyEvent event = 0;  // the copy; for a wait, the event waited for
  bool wait = false;    // true: a caller blocked in wait()/drain() for `event`
  std::string label;    // the copy's label (empty for a wait)
  int64_t start_us = 0;
  int64_t duration_us = 0;
};

struct CopyQueueOptions {
  // false: submit() runs the copy in the calling thread before it returns (synchronous moves).
  bool threaded = true;
  // Testing: before each copy the copy thread sleeps a pseudo-random time in [0, max_delay_us],
  // drawn from a generator seeded with delay_seed (the same seed gives the same delays).
  int64_t max_delay_us = 0;
  uint64_t delay_seed = 0;
};

class CopyQueue {
 public:
  explicit CopyQueue(CopyQueueOptions options = {});
  ~CopyQueue();
  CopyQueue(const CopyQueue&) = delete;
  CopyQueue& operator=(const CopyQueue&) = delete;

  const CopyQueueOptions& options() const { return options_; }

  // Queues `copy` after every copy submitted before; returns its event at once (threaded), or
  // after running it (not threaded; a throw is kept for wait() all the same).
  CopyEvent submit(std::function<void()> copy, std::string label);
  // Blocks until `event` completed. Throws c10::Error when that copy failed or could not run.
  void wait(CopyEvent event);
  // True when `event` completed (successfully or not); never blocks.
  bool done(CopyEvent event) const;
  // Waits for every copy submitted so far; throws the first failure among them not reported yet.
  void drain();

  // The last event submitted (0 before any).
  CopyEvent last_submitted() const;
  // Seconds callers spent blocked in wait()/drain() since construction or the last reset (the
  // copy time compute did not hide).
  double waited_seconds() const;
  void reset_waited_seconds();

  // Timeline (off by default). The clock must be callable from any thread.
  void set_clock(std::function<int64_t()> now_us);
  void set_record_spans(bool on);
  std::vector<CopySpan> spans() const;
  void clear_spans();

 private:
  struct Task {
    CopyEvent event = 0;
    std::function<void()> copy;
    std::string label;
  };
  void run_thread();
  // Runs one task (any thread); records a failure under the lock.
  void run(Task& task);
  void check_failure(CopyEvent event) const;  // lock held
  // Blocks (lock held) until every event <= `event` completed; adds the time to waited_seconds_
  // and, when recording, a wait span.
  void block_until(std::unique_lock<std::mutex>& lock, CopyEvent event);

  CopyQueueOptions options_;
  mutable std::mutex mutex_;
  std::condition_variable work_;  // the copy thread waits for tasks or stop
  mutable std::condition_variable completed_cv_;
  std::deque<Task> tasks_;
  CopyEvent submitted_ = 0;
  CopyEvent completed_ = 0;       // every event <= completed_ finished
  CopyEvent failed_ = 0;          // the first failed event (0: none)
  std::string failure_;           // its label and cause
  CopyEvent failure_reported_ = 0;  // drain(): the failure was thrown once already
  bool stop_ = false;
  double waited_seconds_ = 0;
  std::function<int64_t()> now_us_;
  bool record_spans_ = false;
  std::vector<CopySpan> spans_;
  std::mt19937_64 delays_;
  std::thread thread_;            // last: starts after everything above exists
};

}  // namespace patrickstar
