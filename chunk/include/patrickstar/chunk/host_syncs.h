// Host synchronizations: the points where the host thread waits for a device's queued work (a
// CUDA event or stream synchronize, a value read back from the GPU, a synchronous copy). Each such
// point calls note_host_sync(); the engine reports the count per iteration (IterationReport::
// host_syncs), which is what a training loop pays beyond launching work when nothing needs to move.
// On the emulated device the engine's own reads (the loss check, the gradient norm) count at the
// same points as on CUDA, so the count is the same there. Process-wide (two engines in one process
// each see the other's); thread-safe (relaxed atomics: a count, not an order).
#pragma once

#include <atomic>
#include <cstdint>

namespace patrickstar {

inline std::atomic<int64_t>& host_sync_counter() {
  static std::atomic<int64_t> count{0};
  return count;
}

inline void note_host_sync() {
  host_sync_counter().fetch_add(1, std::memory_order_relaxed);
}

// Synchronizations noted since the process started.
inline int64_t host_syncs() {
  return host_sync_counter().load(std::memory_order_relaxed);
}

}  // namespace patrickstar
