// CudaCopyStream: the CUDA copy engine. Copies are issued at once, from the calling thread, onto a
// dedicated copy stream, each after an event recorded on the calling thread's current stream (so
// after the compute that may still write its source) and followed by an event of its own, which is
// its CopyEvent. Compute waits on the GPU (order_compute_after: the current stream waits on the
// copy's event); the host blocks only where host code needs the bytes or the memory (wait, drain:
// cudaEventSynchronize on blocking-sync events, so the thread sleeps instead of spinning a core).
// Only in builds with CUDA (PATRICKSTAR_HAVE_CUDA); compiled in CI, run only where a GPU is
// present. Usage (the engine does this for a "cuda" device):
//
//   patrickstar::CudaDeviceTier device(0, 8LL << 30);
//   patrickstar::CudaCopyStream copies(0);
//   store.set_copy_queue(&copies);          // store.move() now returns before the bytes cross
//
// Host payloads should be pinned (HostTier pins when a GPU is present): a copy from pageable memory
// is correct but not asynchronous. Compute is "the calling thread's current stream": an engine's
// compute runs on one stream (the default, or one the trainer makes current; autograd runs a
// backward on its forward's stream), since a device payload that only compute touched is reused
// by writers ordered after that stream. Errors: a CUDA call that fails while a copy is issued fails
// that event at once (no later copy is issued); an error the GPU reports later surfaces at the
// first query or wait that sees it; either way wait() and order_compute_after() throw naming the
// copy, and every later copy fails too, as in CopyQueue. Timeline:
// copies run on the GPU, so no spans are recorded (set_record_spans is accepted and records none).
// waited_seconds() counts host waits and the GPU-side ones: order_compute_after() brackets its
// stream wait with two timing events, and the time between them (the stream standing still until
// the copy completed) is added once the GPU has passed them: waited_seconds() never blocks, so a
// wait still queued on the GPU counts in a later call.
// Thread-safe.
#pragma once

#include "patrickstar/chunk/copy_queue.h"

#include <memory>

namespace patrickstar {

#ifdef PATRICKSTAR_HAVE_CUDA

class CudaCopyStream final : public CopyEngine {
 public:
  // An engine on CUDA device `device_index`, with a copy stream of its own from LibTorch's pool.
  explicit CudaCopyStream(int device_index = 0);
  // Waits for every copy (errors are warned about, not thrown) and destroys the events.
  ~CudaCopyStream() override;
  CudaCopyStream(const CudaCopyStream&) = delete;
  CudaCopyStream& operator=(const CudaCopyStream&) = delete;

  // `device` must be a CUDA tier of this engine's device.
  CopyEvent submit_copy(MemoryTier& device, void* dst, const void* src, int64_t bytes,
                        CopyDirection direction, std::string label) override;
  void wait(CopyEvent event) override;
  // The calling thread's current stream waits on the copy's event; the host does not block.
  void order_compute_after(CopyEvent event) override;
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
  struct State;  // keeps CUDA headers out of this header
  std::unique_ptr<State> state_;
};

#endif  // PATRICKSTAR_HAVE_CUDA

}  // namespace patrickstar
