// MemoryProbe: reads non-model memory on the compute device (live and peak bytes since the last
// reset). Implementations: CpuMemoryProbe over the CountingCpuAllocator (emulated device) and a
// CUDA probe over the caching allocator's statistics. Not thread-safe to reset concurrently;
// reading is safe.
#pragma once

#include <cstdint>
#include <memory>

#include <c10/core/Device.h>

#include "patrickstar/memtracer/counting_allocator.h"

namespace patrickstar {

class MemoryProbe {
 public:
  virtual ~MemoryProbe() = default;
  // Bytes allocated now.
  virtual int64_t live_bytes() const = 0;
  // Highest live bytes since the last reset_peak().
  virtual int64_t peak_bytes() const = 0;
  // Starts a new peak window at the current live bytes.
  virtual void reset_peak() = 0;
};

// Emulated device: counts what the CountingCpuAllocator served (not owned; must outlive the probe),
// less a floor: bytes that are host memory, not device memory (what the trainer held before the
// engine's first forward: its dataset, its own state). Readings never go below 0. Each probe has a
// peak window of its own (two engines in one process never reset each other's peaks). On CUDA the
// probe reads the caching allocator's peak, which everything on that device shares.
class CpuMemoryProbe final : public MemoryProbe {
 public:
  explicit CpuMemoryProbe(CountingCpuAllocator& counter) : counter_(counter), window_(counter) {}
  int64_t live_bytes() const override;
  int64_t peak_bytes() const override;
  void reset_peak() override;
  // Bytes of the counter's live total that are not charged to the device from now on.
  void set_floor_bytes(int64_t bytes);
  int64_t floor_bytes() const { return floor_bytes_; }

 private:
  CountingCpuAllocator& counter_;
  ScopedPeakWindow window_;
  int64_t floor_bytes_ = 0;
};

// CUDA: the caching allocator's allocated_bytes (aggregate pool) of `device`: non-model memory,
// since the CUDA device tier allocates chunk payloads outside that allocator (cudaMalloc). Throws
// c10::Error when the library was built without CUDA.
std::unique_ptr<MemoryProbe> make_cuda_memory_probe(c10::DeviceIndex device);

// True when make_cuda_memory_probe is available in this build.
bool memtracer_built_with_cuda();

}  // namespace patrickstar
