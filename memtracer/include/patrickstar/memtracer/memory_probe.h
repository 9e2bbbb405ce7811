// MemoryProbe: reads non-model memory on the compute device (live and peak bytes since the last
// reset). Implementations: CpuMemoryProbe over the CountingCpuAllocator (emulated device) and a
// CUDA probe over the caching allocator's statistics. Not thread-safe to reset concurrently;
// reading is safe.
#pragma once

#include <cstdint>
#include <memory>

#include <c10/core/Device.h>

namespace patrickstar {

class CountingCpuAllocator;

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

// Emulated device: counts what the CountingCpuAllocator served (not owned; must outlive the probe).
class CpuMemoryProbe final : public MemoryProbe {
 public:
  explicit CpuMemoryProbe(CountingCpuAllocator& counter) : counter_(counter) {}
  int64_t live_bytes() const override;
  int64_t peak_bytes() const override;
  void reset_peak() override;

 private:
  CountingCpuAllocator& counter_;
};

// CUDA: the caching allocator's allocated_bytes (aggregate pool) of `device`. Chunk payloads
// allocated through the caching allocator are counted there too: the engine subtracts its own chunk
// bytes. Throws c10::Error when the library was built without CUDA.
std::unique_ptr<MemoryProbe> make_cuda_memory_probe(c10::DeviceIndex device);

// True when make_cuda_memory_probe is available in this build.
bool memtracer_built_with_cuda();

}  // namespace patrickstar
