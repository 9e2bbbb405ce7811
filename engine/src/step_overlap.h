// Private to engine/src: the optimizer thread of the overlapped step (docs/design.md, "The
// overlapped step"). The training thread hands it a chunk index's host Adam update as soon as the
// index's gradients are final in backward; the thread computes it ahead (speculative_update.h:
// in place, with an undo log) while backward goes on, and the step commits or undoes it.
//
// What it owns: the thread, the queue, one record per chunk index handed over since the last step
// and the undo buffers (kept between iterations, per index, at most max_bytes in all). What it
// does not: deciding when an index may go (the engine) or the chunk views' validity (the engine
// keeps every chunk of a handed-over index unmoved and unwritten until quiesce()).
//
// Thread-safety: every method but the thread's own loop is called from the training thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "patrickstar/chunk/copy_queue.h"
#include "patrickstar/optimizer/hybrid_adam.h"

namespace patrickstar::engine_detail {

// One run of consecutive tensors of an index (as the step builds them) and its update.
struct EarlyRun {
  int64_t begin = 0;  // elements in the chunk
  int64_t end = 0;
  int64_t step = 0;  // the Adam step it was computed for
  int32_t group = 0;  // its parameter group (whose options it was computed with)
  SpeculativeUpdate update;
};

struct EarlyIndex {
  int64_t index = -1;
  std::vector<AdamChunk> inputs;  // the views the thread works on (valid until it is done)
  std::vector<EarlyRun> runs;
  int threads = 1;
  bool done = false;  // under the mutex
};

class StepOverlap {
 public:
  // `allocate` gives the undo buffers (host-tier memory: neither chunk payloads nor the non-model
  // bytes the memory tracer measures); it may throw c10::Error when the tier is full.
  using Allocate = std::function<at::Tensor(int64_t numel, at::ScalarType dtype)>;
  StepOverlap(int64_t max_bytes, Allocate allocate)
      : max_bytes_(max_bytes), allocate_(std::move(allocate)) {}
  ~StepOverlap();
  StepOverlap(const StepOverlap&) = delete;
  StepOverlap& operator=(const StepOverlap&) = delete;

  // Gives `job` (inputs and runs filled) its undo buffers, the index's own from an earlier
  // iteration where they fit. False, and nothing held for it, when they would pass max_bytes in all
  // or the tier cannot give them.
  bool prepare(EarlyIndex& job);
  // Whether an index needing `bytes` of buffers would stay within max_bytes (its own kept buffers
  // are reused).
  bool fits(int64_t index, int64_t bytes) const;
  // Hands a prepared `job` to the thread (starting it on first use).
  void submit(std::unique_ptr<EarlyIndex> job);
  bool has(int64_t index) const { return records_.count(index) > 0; }
  // After it, the thread no longer touches index `index`: its job is done (waited for, with the
  // jobs queued before it; every job handed over runs, so which updates are made ahead never
  // depends on timing).
  void quiesce(int64_t index);
  void quiesce_all();
  // Waits until the thread has done every job handed over.
  void drain();
  // The done record of `index`, or null.
  EarlyIndex* record(int64_t index);
  // Every record (done ones, after quiesce_all()).
  std::map<int64_t, std::unique_ptr<EarlyIndex>>& records() { return records_; }
  // Forgets `index`'s record, keeping its buffers for the next iteration.
  void erase(int64_t index);
  void clear();
  // Frees the buffers kept for indices not in flight (the overlap turned off).
  void release_kept();
  // Buffers held (records and kept), and the thread's busy seconds since the last call.
  int64_t buffer_bytes() const { return buffer_bytes_; }
  double take_busy_seconds();
  // The timeline: one span per job the thread ran ("adam ahead: chunk index i"), on `now_us`'s
  // clock, kept while recording is on.
  void set_clock(std::function<int64_t()> now_us) { now_us_ = std::move(now_us); }
  void set_record_spans(bool on);
  std::vector<CopySpan> spans() const;

 private:
  void run();

  int64_t max_bytes_;
  Allocate allocate_;
  int64_t buffer_bytes_ = 0;
  std::map<int64_t, std::unique_ptr<EarlyIndex>> records_;
  std::map<int64_t, std::vector<SpeculativeUpdate>> kept_;  // buffers of indices not in flight

  std::function<int64_t()> now_us_;
  mutable std::mutex mutex_;
  bool record_spans_ = false;
  std::vector<CopySpan> spans_;
  std::condition_variable work_, finished_;
  std::deque<EarlyIndex*> queue_;
  EarlyIndex* running_ = nullptr;
  bool stop_ = false;
  double busy_seconds_ = 0;
  std::thread thread_;
};

}  // namespace patrickstar::engine_detail
