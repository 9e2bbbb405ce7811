// Compiled only when the CUDA toolkit is found (memtracer/CMakeLists.txt). Runs only on a GPU.
#include <c10/cuda/CUDACachingAllocator.h>

#include "patrickstar/memtracer/memory_probe.h"

namespace patrickstar {
namespace {

// The aggregate pool of the caching allocator's allocated_bytes statistic.
constexpr size_t kAggregatePool = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);

// Until the process's first allocation through the caching allocator it has no statistics to read
// (reading them throws "Invalid device argument"; found by scripts/gpu-check on an H200): nothing is
// allocated then, so live and peak are 0.
bool allocator_ready() {
  return c10::cuda::CUDACachingAllocator::get()->initialized();
}

class CudaMemoryProbe final : public MemoryProbe {
 public:
  explicit CudaMemoryProbe(c10::DeviceIndex device) : device_(device) {}
  int64_t live_bytes() const override {
    if (!allocator_ready()) return 0;
    return c10::cuda::CUDACachingAllocator::getDeviceStats(device_)
        .allocated_bytes[kAggregatePool]
        .current;
  }
  int64_t peak_bytes() const override {
    if (!allocator_ready()) return 0;
    return c10::cuda::CUDACachingAllocator::getDeviceStats(device_)
        .allocated_bytes[kAggregatePool]
        .peak;
  }
  void reset_peak() override {
    if (allocator_ready()) c10::cuda::CUDACachingAllocator::resetPeakStats(device_);
  }

 private:
  c10::DeviceIndex device_;
};

}  // namespace

std::unique_ptr<MemoryProbe> make_cuda_memory_probe(c10::DeviceIndex device) {
  return std::make_unique<CudaMemoryProbe>(device);
}
bool memtracer_built_with_cuda() {
  return true;
}

}  // namespace patrickstar
