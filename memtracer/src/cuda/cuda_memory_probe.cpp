// Compiled only when the CUDA toolkit is found (memtracer/CMakeLists.txt). Runs only on a GPU.
#include <c10/cuda/CUDACachingAllocator.h>

#include "patrickstar/memtracer/memory_probe.h"

namespace patrickstar {
namespace {

// The aggregate pool of the caching allocator's allocated_bytes statistic.
constexpr size_t kAggregatePool = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);

class CudaMemoryProbe final : public MemoryProbe {
 public:
  explicit CudaMemoryProbe(c10::DeviceIndex device) : device_(device) {}
  int64_t live_bytes() const override {
    return c10::cuda::CUDACachingAllocator::getDeviceStats(device_)
        .allocated_bytes[kAggregatePool]
        .current;
  }
  int64_t peak_bytes() const override {
    return c10::cuda::CUDACachingAllocator::getDeviceStats(device_)
        .allocated_bytes[kAggregatePool]
        .peak;
  }
  void reset_peak() override { c10::cuda::CUDACachingAllocator::resetPeakStats(device_); }

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
