// Private to the engine: the gate of its entry points that autograd and the doors call (the doors,
// the backward hooks, gradient arrival, a backward's start and end). It serializes them (a
// recursive mutex: on CUDA autograd runs a backward's CPU work and GPU work on different threads,
// and a checkpoint's recompute opens doors from inside a backward hook's work), and it measures
// what they cost the host: the wall time of each outermost entry (nested ones are inside it) and
// the number of entries, taken per iteration with the host synchronizations noted meanwhile
// (chunk/host_syncs.h). BasicLockable: std::lock_guard<EntryGate> holds it. Thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>

#include "patrickstar/chunk/host_syncs.h"

namespace patrickstar::engine_detail {

// What the entries cost since the last take().
struct EntryCosts {
  double host_seconds = 0;  // wall time inside the outermost entries
  int64_t entries = 0;      // outermost entries
  int64_t host_syncs = 0;   // host synchronizations noted anywhere in the process
};

class EntryGate {
 public:
  void lock() {
    mutex_.lock();
    if (depth_++ == 0) entered_ = std::chrono::steady_clock::now();
  }
  void unlock() {
    if (--depth_ == 0) {
      seconds_ +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - entered_).count();
      ++entries_;
    }
    mutex_.unlock();
  }
  // The costs since the last take (or the gate's construction), and a new count from here.
  EntryCosts take() {
    std::lock_guard<std::recursive_mutex> held(mutex_);
    const int64_t syncs = host_syncs();
    EntryCosts costs{seconds_, entries_, syncs - syncs_mark_};
    seconds_ = 0;
    entries_ = 0;
    syncs_mark_ = syncs;
    return costs;
  }

 private:
  std::recursive_mutex mutex_;
  int depth_ = 0;  // entries held by the thread holding the mutex
  std::chrono::steady_clock::time_point entered_;
  double seconds_ = 0;
  int64_t entries_ = 0;
  int64_t syncs_mark_ = host_syncs();
};

}  // namespace patrickstar::engine_detail
