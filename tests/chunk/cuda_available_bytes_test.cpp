// cuda_available_bytes: the arithmetic of CudaDeviceTier::available_memory_bytes (the engine's
// "auto" capacity on CUDA), which needs no GPU.
#include "patrickstar/chunk/cuda_device_tier.h"

#include <gtest/gtest.h>

namespace patrickstar {
namespace cuda_available_bytes_test {

TEST(CudaAvailableBytes, DriverFreePlusTheCachingAllocatorsUnusedBlocks) {
  constexpr int64_t kGiB = int64_t{1} << 30;
  // LibTorch holds 10 GiB, its tensors use 7: 3 GiB of free cache come back to a payload.
  EXPECT_EQ(cuda_available_bytes(20 * kGiB, 10 * kGiB, 7 * kGiB), 23 * kGiB);
  // All of its blocks in use: only the driver's free memory.
  EXPECT_EQ(cuda_available_bytes(20 * kGiB, 10 * kGiB, 10 * kGiB), 20 * kGiB);
  // Before LibTorch's CUDA side started (nothing reserved).
  EXPECT_EQ(cuda_available_bytes(20 * kGiB, 0, 0), 20 * kGiB);
  // Statistics read apart may disagree for a moment: never less than the driver's free memory.
  EXPECT_EQ(cuda_available_bytes(20 * kGiB, 1 * kGiB, 2 * kGiB), 20 * kGiB);
}

}  // namespace cuda_available_bytes_test
}  // namespace patrickstar
