// Memory tiers: exact live and peak counts, the block cache, and the out-of-memory error that
// leaves nothing allocated.
#include "patrickstar/chunk/memory_tier.h"

#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>

namespace patrickstar {
namespace memory_tier_test {

using ::testing::HasSubstr;

TEST(MemoryTier, CountsLiveAndPeakBytesExactly) {
  EmulatedDeviceTier device(10000);
  EXPECT_EQ(device.kind(), Tier::kDevice);
  void* a = device.allocate(1000);
  void* b = device.allocate(3000);
  EXPECT_EQ(device.used_bytes(), 4000);
  EXPECT_EQ(device.peak_bytes(), 4000);
  EXPECT_EQ(device.allocation_count(), 2);
  device.deallocate(a);
  EXPECT_EQ(device.used_bytes(), 3000);
  EXPECT_EQ(device.peak_bytes(), 4000);
  device.reset_peak();
  EXPECT_EQ(device.peak_bytes(), 3000);
  void* c = device.allocate(500);
  EXPECT_EQ(device.peak_bytes(), 3500);
  device.deallocate(b);
  device.deallocate(c);
  EXPECT_EQ(device.used_bytes(), 0);
  EXPECT_EQ(device.allocation_count(), 0);
  EXPECT_EQ(device.peak_bytes(), 3500);
}

TEST(MemoryTier, BlocksAreAlignedAndWritable) {
  HostTier host(MemoryTier::kUnlimited, HostTier::Pinning::kNever);
  EXPECT_FALSE(host.pinned());
  for (int64_t alignment : {1, 64, 256, 4096}) {
    void* p = host.allocate(777, alignment);
    EXPECT_EQ(
        reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(std::max<int64_t>(64, alignment)),
        0u);
    std::memset(p, 0xab, 777);
    host.deallocate(p);
  }
  EXPECT_THROW(host.allocate(64, 48), c10::Error);  // not a power of two
  EXPECT_THROW(host.allocate(0), c10::Error);
}

TEST(MemoryTier, CacheReusesBlocksWithoutChangingLiveCounts) {
  EmulatedDeviceTier device(1 << 20);
  void* a = device.allocate(4096);
  device.deallocate(a);
  EXPECT_EQ(device.used_bytes(), 0);
  EXPECT_EQ(device.reserved_bytes(), 4096);
  void* b = device.allocate(4096);
  EXPECT_EQ(b, a);  // the cached block comes back
  EXPECT_EQ(device.used_bytes(), 4096);
  EXPECT_EQ(device.reserved_bytes(), 4096);
  device.deallocate(b);
  device.empty_cache();
  EXPECT_EQ(device.reserved_bytes(), 0);
}

TEST(MemoryTier, PeakReservedCountsCachedBlocksAndOutlivesResetPeak) {
  EmulatedDeviceTier device(1 << 20);
  void* a = device.allocate(4096);
  device.deallocate(a);                // 4096 cached, nothing used
  void* b = device.allocate(1000);     // another size: a new block next to the cached one
  EXPECT_EQ(device.peak_bytes(), 4096);  // used: 4096 earlier, then 1000
  EXPECT_EQ(device.peak_reserved_bytes(), 5096);
  device.reset_peak();
  EXPECT_EQ(device.peak_bytes(), 1000);
  EXPECT_EQ(device.peak_reserved_bytes(), 5096);  // the most held from the system, ever
  device.deallocate(b);
  device.empty_cache();
  EXPECT_EQ(device.reserved_bytes(), 0);
  EXPECT_EQ(device.peak_reserved_bytes(), 5096);
}

TEST(MemoryTier, CachedBlocksGiveWayToTheCapacity) {
  EmulatedDeviceTier device(10000);
  void* a = device.allocate(6000);
  device.deallocate(a);             // cached: 6000 reserved
  void* b = device.allocate(8000);  // fits the capacity once the cache is dropped
  EXPECT_EQ(device.used_bytes(), 8000);
  EXPECT_EQ(device.reserved_bytes(), 8000);
  device.deallocate(b);
}

TEST(MemoryTier, OutOfMemoryStatesTheNumbersAndLeavesNothingAllocated) {
  EmulatedDeviceTier device(10000);
  void* a = device.allocate(7000);
  try {
    device.allocate(4000);
    FAIL() << "expected an out-of-memory error";
  } catch (const c10::OutOfMemoryError& e) {
    const std::string msg = e.what();
    EXPECT_THAT(msg, HasSubstr("emulated_device"));
    EXPECT_THAT(msg, HasSubstr("capacity 10000 bytes"));
    EXPECT_THAT(msg, HasSubstr("7000 bytes in use"));
    EXPECT_THAT(msg, HasSubstr("4000 bytes requested"));
  }
  EXPECT_EQ(device.used_bytes(), 7000);
  EXPECT_EQ(device.peak_bytes(), 7000);
  EXPECT_EQ(device.allocation_count(), 1);
  EXPECT_EQ(device.reserved_bytes(), 7000);
  void* b = device.allocate(3000);  // exactly to the capacity is fine
  EXPECT_EQ(device.used_bytes(), 10000);
  device.deallocate(a);
  device.deallocate(b);
  EXPECT_EQ(device.used_bytes(), 0);
}

TEST(MemoryTier, HostCapacityIsOptional) {
  HostTier unlimited(MemoryTier::kUnlimited, HostTier::Pinning::kNever);
  EXPECT_EQ(unlimited.capacity_bytes(), MemoryTier::kUnlimited);
  HostTier small(1000, HostTier::Pinning::kNever);
  EXPECT_THROW(small.allocate(1001), c10::OutOfMemoryError);
  EXPECT_EQ(small.used_bytes(), 0);
  EXPECT_EQ(small.kind(), Tier::kHost);
}

TEST(MemoryTier, RejectsForeignAndDoublyReturnedPointers) {
  EmulatedDeviceTier device(1 << 20);
  int local = 0;
  EXPECT_THROW(device.deallocate(&local), c10::Error);
  void* a = device.allocate(128);
  device.deallocate(a);
  EXPECT_THROW(device.deallocate(a), c10::Error);
  EXPECT_EQ(device.used_bytes(), 0);
}

TEST(MemoryTier, HostPinsExactlyWhenAGpuRuns) {
  // Automatic pinning: pinned where this build has CUDA and a GPU is present, plain memory
  // elsewhere (this test runs on GPU machines too: scripts/gpu-check). kNever never pins.
#ifdef PATRICKSTAR_HAVE_CUDA
  const bool gpu = at::hasCUDA();
#else
  const bool gpu = false;
#endif
  HostTier host;
  EXPECT_EQ(host.pinned(), gpu);
  HostTier plain(MemoryTier::kUnlimited, HostTier::Pinning::kNever);
  EXPECT_FALSE(plain.pinned());
  for (HostTier* tier : {&host, &plain}) {
    void* p = tier->allocate(1 << 16);
    std::memset(p, 1, 1 << 16);
    tier->deallocate(p);
  }
}

}  // namespace memory_tier_test
}  // namespace patrickstar
