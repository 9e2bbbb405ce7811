// Compiled only when PATRICKSTAR_HAVE_CUDA (see chunk/CMakeLists.txt); runs on a GPU only (scripts/gpu-check).
// Pinned host blocks of exactly the size asked for (cudaHostAlloc), where LibTorch's pinned host
// allocator would round each block up to a power of two and keep it cached after it is freed.
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "pinned_host.h"

namespace patrickstar::cuda_detail {

void* pinned_host_allocate(int64_t bytes) {
  void* ptr = nullptr;
  const cudaError_t status =
      cudaHostAlloc(&ptr, static_cast<size_t>(bytes), cudaHostAllocPortable);
  if (status == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // clear it: the tier reports its own out-of-memory error
    return nullptr;
  }
  C10_CUDA_CHECK(status);
  return ptr;
}

void pinned_host_free(void* ptr) {
  // Waits for copies still reading or writing it. Warns, never throws (a destructor's path).
  C10_CUDA_CHECK_WARN(cudaFreeHost(ptr));
}

}  // namespace patrickstar::cuda_detail
