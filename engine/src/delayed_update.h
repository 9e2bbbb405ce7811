// Private to engine/src: the thread of the delayed parameter update (docs/design.md, "The delayed
// update"; zero_optimization.delayed_param_update). step() hands it one iteration's Adam update
// and returns; the next step() takes the result before handing over the next.
//
// What it owns: the update in flight (its views and the buffers they point into: copies of the
// gradients, and in fp32 of the weights, so that the next forward and backward may read and write
// the chunks' weights and gradients meanwhile) and the buffers kept for the next update. What it
// does not: the chunk memory the update reads and writes in place (the fp32 master in mixed
// precision, momentum, variance), which the engine keeps unmoved until the update is taken.
//
// Thread-safety: every method is called from the training thread; the update runs on a thread of
// its own between launch() and join().
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <future>
#include <utility>
#include <vector>

#include "patrickstar/optimizer/hybrid_adam.h"

namespace patrickstar::engine_detail {

struct DelayedRun {
  int64_t index = 0;  // chunk index
  int64_t begin = 0;  // elements in the chunk
  int64_t end = 0;
};

struct DelayedJob {
  std::vector<AdamChunk> runs;  // what the thread updates (HybridAdam::step, every run on the host)
  std::vector<DelayedRun> where;  // each run's place in the chunks
  std::vector<int64_t> params;    // tensors whose Adam step count the update advances
};

class DelayedUpdate {
 public:
  // `allocate` gives the buffers (host-tier memory, outside what the memory tracer measures); it
  // may throw c10::Error when the tier is full.
  using Allocate = std::function<at::Tensor(int64_t numel, at::ScalarType dtype)>;
  using Work = std::function<StepReport(const DelayedJob&)>;
  explicit DelayedUpdate(Allocate allocate) : allocate_(std::move(allocate)) {}
  ~DelayedUpdate();  // waits for the update in flight (its result is dropped)
  DelayedUpdate(const DelayedUpdate&) = delete;
  DelayedUpdate& operator=(const DelayedUpdate&) = delete;

  // Buffer `k` for the next update: the one kept from an earlier update when it has this size and
  // dtype (the update in flight may still use it: fill it only after done()).
  at::Tensor buffer(size_t k, int64_t numel, at::ScalarType dtype);
  // Starts `work(job)` on the thread, with `threads` host-Adam threads. None may be pending.
  void launch(DelayedJob job, Work work, int threads);
  // An update was launched and not taken yet.
  bool pending() const { return pending_; }
  // Waits until the thread is done with the update in flight (its result stays pending).
  void join();
  // Waits; then the update and its report (rethrows what the update threw, the update still
  // pending). The update stays pending until done(): a caller that fails to write its results
  // in can retry.
  std::pair<const DelayedJob*, StepReport> result();
  // The update in flight is taken: not pending any more, its buffers free for the next.
  void done();
  // The update in flight (valid while pending()).
  const DelayedJob& job() const { return job_; }
  int64_t buffer_bytes() const;
  // The buffers kept for the next update go back to the host tier (none pending: the update in
  // flight was taken). The next update allocates its own.
  void release_kept();
  double take_busy_seconds();    // the thread's seconds on updates taken since the last call
  double take_waited_seconds();  // the training thread's seconds in join() since the last call

 private:
  Allocate allocate_;
  std::vector<at::Tensor> kept_;
  DelayedJob job_;
  std::future<StepReport> running_;
  bool pending_ = false;
  StepReport result_;
  std::exception_ptr error_;
  double seconds_ = 0;  // written by the thread, read after join()
  double busy_seconds_ = 0;
  double waited_seconds_ = 0;
};

}  // namespace patrickstar::engine_detail
