#include "patrickstar/memtracer/memory_probe.h"

#include <algorithm>

#include <c10/util/Exception.h>

#include "patrickstar/memtracer/counting_allocator.h"

namespace patrickstar {

int64_t CpuMemoryProbe::live_bytes() const {
  return std::max<int64_t>(0, counter_.live_bytes() - floor_bytes_);
}
int64_t CpuMemoryProbe::peak_bytes() const {
  return std::max<int64_t>(0, window_.peak_bytes() - floor_bytes_);
}
void CpuMemoryProbe::set_floor_bytes(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "CpuMemoryProbe::set_floor_bytes: ", bytes, " is negative");
  floor_bytes_ = bytes;
}
void CpuMemoryProbe::reset_peak() {
  window_.reset();
}

#ifndef PATRICKSTAR_MEMTRACER_CUDA
std::unique_ptr<MemoryProbe> make_cuda_memory_probe(c10::DeviceIndex device) {
  TORCH_CHECK(false, "make_cuda_memory_probe(", static_cast<int>(device),
              "): patrickstar was built without CUDA; use CpuMemoryProbe on the emulated device");
}
bool memtracer_built_with_cuda() {
  return false;
}
#endif

}  // namespace patrickstar
