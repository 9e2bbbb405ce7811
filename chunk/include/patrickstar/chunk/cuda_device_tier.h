// The CUDA device tier: payloads from cudaMalloc (outside LibTorch's caching allocator, retried
// once after emptying its cache), kept for reuse when freed (cudaFree would wait for the whole
// device) and given back when LibTorch's allocator runs short (a free-memory callback registered
// with it); synchronous copies (copy(), used without a copy engine) on a dedicated copy stream
// ordered after the current stream's work with events. Asynchronous moves go through a
// CudaCopyStream (cuda_copy_stream.h). Only in builds with CUDA (PATRICKSTAR_HAVE_CUDA defined);
// compiled in CI, run only where a GPU is present. Thread-safe like every MemoryTier; owns its
// stream handle and events.
//
// Note for the memory tracer: the caching allocator's allocated_bytes statistic does not include
// these payloads, so on CUDA it is the non-model memory as it stands.
#pragma once

#include "patrickstar/chunk/memory_tier.h"

#include <algorithm>
#include <cstdint>
#include <memory>

namespace patrickstar {

// What a CUDA device has for this process: the driver's free bytes plus the free cache of
// LibTorch's caching allocator, its reserved bytes less those its tensors use (the cached blocks
// go back when a payload needs them; the used ones do not). The arithmetic of
// CudaDeviceTier::available_memory_bytes, here so that builds without a GPU test it.
inline int64_t cuda_available_bytes(int64_t driver_free_bytes, int64_t reserved_bytes,
                                    int64_t allocated_bytes) {
  return driver_free_bytes + std::max<int64_t>(0, reserved_bytes - allocated_bytes);
}

#ifdef PATRICKSTAR_HAVE_CUDA

class CudaDeviceTier final : public MemoryTier {
 public:
  // A tier on CUDA device `device_index`; the capacity bounds the payload bytes it hands out.
  explicit CudaDeviceTier(int device_index = 0, int64_t capacity_bytes = kUnlimited);
  ~CudaDeviceTier() override;

  c10::Device device() const override;
  // The memory of CUDA device `device_index` (cudaMemGetInfo's total), for checks against a
  // configured capacity.
  static int64_t total_memory_bytes(int device_index);
  // What CUDA device `device_index` has for this process now (cuda_available_bytes of the
  // driver's free memory and LibTorch's allocator statistics there). The engine's capacity when
  // the config says "auto".
  static int64_t available_memory_bytes(int device_index);
  // Gives the cached payloads of every live CUDA tier back to the device (tiers busy on another
  // thread keep theirs); returns the bytes given back. LibTorch's allocator calls this when short.
  static int64_t release_cached_payloads();
  // Waits for the current stream's queued work (an event), copies on the copy stream, makes the
  // current stream wait for the copy and returns once the copy is complete (so the caller may
  // free the source).
  void copy(void* dst, const void* src, int64_t bytes, CopyDirection direction) override;
  void fill_zero(void* ptr, int64_t bytes) override;

 protected:
  void* raw_allocate(int64_t bytes, int64_t alignment) override;
  void raw_deallocate(void* ptr, int64_t bytes, int64_t alignment) override;

 private:
  struct CopyStream;  // keeps CUDA headers out of this header
  int device_index_;
  std::unique_ptr<CopyStream> copy_stream_;
};

#endif  // PATRICKSTAR_HAVE_CUDA

}  // namespace patrickstar
