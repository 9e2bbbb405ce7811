// Private to engine/src: the host copies of offloaded checkpoint inputs (patrickstar::checkpoint
// with offload; docs/design.md, "Activations").
//
// Invariants:
// - An offloaded input's bytes are charged where they are: its host copy is a block of the engine's
//   host tier (refused past the tier's capacity: the input then stays on the device), and its
//   device copies are LibTorch tensors, which the non-model probe counts.
// - The copy out is issued on the engine's copy queue (synchronous without one) after the
//   forward; the input's device tensor is held until the copy is done, and dropped when the next
//   checkpointed call's forward is done (call_forward_done; on a GPU, the newest two only once
//   their copies are done, so the host never waits for the GPU there). The last input offloaded
//   before backward never leaves: backward takes it first.
// - When a recompute begins (recompute_begins) and when an input is taken, the newest input still
//   away starts coming back (backward takes them in reverse), so its copy overlaps that recompute
//   and backward. Its host block goes back to the tier once its copy back is done; an entry the
//   graph drops untaken frees its block too.
// - With a host capacity, an input takes host-tier room only beyond what every chunk on the
//   device would need if evicted (else it stays on the device: refused_bytes).
// - Thread-safe (autograd may take inputs on its own threads); the engine closes the store before
//   its tiers and copy queue go, after which an entry still held gives its input back no more.
#pragma once

#include <cstdint>
#include <memory>

#include <ATen/core/Tensor.h>

#include "patrickstar/chunk/copy_queue.h"
#include "patrickstar/chunk/memory_tier.h"
#include "patrickstar/engine/checkpoint.h"

namespace patrickstar::engine_detail {

struct OffloadFigures {
  int64_t offloaded_bytes = 0;   // copied to the host
  int64_t prefetched_bytes = 0;  // copied back to the device
  int64_t refused_bytes = 0;     // left on the device: the host tier was full
  int64_t host_bytes = 0;        // host-tier bytes held now
  int64_t host_peak_bytes = 0;   // and at most since the last reset
};

class ActivationStore {
 public:
  // `copies`: the engine's copy queue, or nullptr (copies in the calling thread).
  ActivationStore(MemoryTier& device, MemoryTier& host, CopyEngine* copies);
  ~ActivationStore();
  ActivationStore(const ActivationStore&) = delete;
  ActivationStore& operator=(const ActivationStore&) = delete;

  // The copy of `input` (contiguous) for checkpoint call `call`, or nullptr where the host tier
  // cannot hold it.
  std::unique_ptr<OffloadedActivation> offload(int64_t call, const at::Tensor& input);
  // A checkpointed call's forward is done (any call's): the inputs copied out go from the device.
  void call_forward_done();
  // A checkpointed call's recompute begins: backward's next offloaded input starts coming back.
  void recompute_begins();
  OffloadFigures figures() const;
  // Counters and peak start again (an iteration's report).
  void reset_figures();
  // Waits for every copy and gives every host block back; entries taken later throw.
  void close();

  struct State;  // shared with the entries (activation_offload.cpp)

 private:
  std::shared_ptr<State> state_;
};

}  // namespace patrickstar::engine_detail
