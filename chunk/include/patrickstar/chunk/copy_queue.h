// Copy engines: the chunk store's asynchronous moves. A CopyEngine issues copies in order, each with
// a completion event; compute is ordered after the event of the chunk it needs, and a payload a copy
// reads or writes goes back to its tier only after that event. Two engines:
//   - CopyQueue (this header): a copy thread that runs each copy on the host (the emulated device,
//     where compute runs on the host too), so the ordering rules run in every test here;
//   - CudaCopyStream (cuda_copy_stream.h, CUDA builds): a CUDA copy stream with CUDA events, where
//     compute waits on the GPU (a stream waits on an event), not on the host.
//
// CopyQueue usage:
//
//   patrickstar::CopyQueue queue;                                  // starts the copy thread
//   CopyEvent e = queue.submit([&] { std::memcpy(dst, src, n); }, "param chunk 3 (id 3) to device");
//   ...                                                            // compute goes on meanwhile
//   queue.wait(e);   // returns once that copy (and every copy issued before it) completed
//
// Rules (every engine): copies run one at a time in the order they were submitted, so a copy that
// reads what an earlier one writes sees it complete. Completion of event e happens-before wait(e)
// returns (and before done(e) returns true), so bytes the copy wrote may be read after it without
// a race. A copy that throws fails its event: wait() throws c10::Error naming the copy's label and
// the cause, and every copy after it fails too ("an earlier copy failed: ..."), because its source
// may be what the failed copy should have written (CopyQueue does not run them; a CUDA stream may
// have run those issued before the failure was known). The destructor waits for every copy (errors
// are not rethrown there). Thread-safe: any thread may submit and wait.
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

class MemoryTier;                     // memory_tier.h
enum class CopyDirection : uint8_t;   // memory_tier.h

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

// What the chunk store asks of a copy engine. Events of one engine are ordered: every event <= e
// completed once e did. "Compute" is the work the calling thread issues: operators on the host
// (emulated device), kernels on the thread's current CUDA stream (CUDA).
class CopyEngine {
 public:
  virtual ~CopyEngine() = default;

  // Queues a copy of `bytes` from `src` to `dst` between a host payload and a payload of `device`
  // (the device tier), after every copy submitted before and after the compute the calling thread
  // issued so far (which may still write `src`); returns its event.
  virtual CopyEvent submit_copy(MemoryTier& device, void* dst, const void* src, int64_t bytes,
                                CopyDirection direction, std::string label) = 0;
  // Blocks the calling thread until `event` completed (host code may then read what it wrote, and
  // free what it read). Throws c10::Error when that copy failed or could not run.
  virtual void wait(CopyEvent event) = 0;
  // Orders the compute the calling thread issues from now on after `event`, throwing like wait()
  // for a failure already known. Where compute runs on the host this is wait(); on CUDA the
  // current stream waits on the event on the GPU and the host goes on.
  virtual void order_compute_after(CopyEvent event) { wait(event); }
  // True when `event` completed (successfully or not); never blocks.
  virtual bool done(CopyEvent event) const = 0;
  // Waits for every copy submitted so far; throws the first failure among them not reported yet.
  virtual void drain() = 0;

  // The last event submitted (0 before any).
  virtual CopyEvent last_submitted() const = 0;
  // Seconds compute spent waiting for copies since construction or the last reset (the copy time
  // compute did not hide): callers blocked on the host in wait()/drain(), and where compute waits
  // on the GPU (CUDA), the time its stream stood at order_compute_after()'s waits, each counted
  // once the GPU has passed it (the call never blocks on the GPU).
  virtual double waited_seconds() const = 0;
  virtual void reset_waited_seconds() = 0;

  // Timeline (off by default). The clock must be callable from any thread. An engine that cannot
  // time its copies on the host (CUDA) records no spans.
  virtual void set_clock(std::function<int64_t()> now_us) = 0;
  virtual void set_record_spans(bool on) = 0;
  virtual std::vector<CopySpan> spans() const = 0;
  virtual void clear_spans() = 0;
};

class CopyQueue final : public CopyEngine {
 public:
  explicit CopyQueue(CopyQueueOptions options = {});
  ~CopyQueue() override;
  CopyQueue(const CopyQueue&) = delete;
  CopyQueue& operator=(const CopyQueue&) = delete;

  const CopyQueueOptions& options() const { return options_; }

  // Queues `copy` after every copy submitted before; returns its event at once (threaded), or
  // after running it (not threaded; a throw is kept for wait() all the same).
  CopyEvent submit(std::function<void()> copy, std::string label);
  // submit() of device.copy(): the copy thread runs the copy on the host, so `device` must be a
  // tier whose memory the host reads (the emulated device); throws c10::Error for a CUDA tier.
  CopyEvent submit_copy(MemoryTier& device, void* dst, const void* src, int64_t bytes,
                        CopyDirection direction, std::string label) override;
  void wait(CopyEvent event) override;
  bool done(CopyEvent event) const override;
  void drain() override;

  CopyEvent last_submitted() const override;
  double waited_seconds() const override;
  void reset_waited_seconds() override;

  void set_clock(std::function<int64_t()> now_us) override;
  void set_record_spans(bool on) override;
  std::vector<CopySpan> spans() const override;
  void clear_spans() override;

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
