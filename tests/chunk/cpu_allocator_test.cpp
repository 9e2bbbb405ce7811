// Chunk payloads come from the tiers, never from LibTorch's CPU allocator: the memory tracer counts
// everything that allocator hands out as non-model data.
#include "patrickstar/chunk/chunk_store.h"

#include <ATen/ops/empty.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

#include <atomic>

namespace patrickstar {
namespace cpu_allocator_test {

// Counts allocations and forwards them to the allocator it replaces.
class CountingCpuAllocator final : public c10::Allocator {
 public:
  explicit CountingCpuAllocator(c10::Allocator* base) : base_(base) {}
  c10::DataPtr allocate(size_t n) override {
    allocations.fetch_add(1);
    return base_->allocate(n);
  }
  c10::DeleterFnPtr raw_deleter() const override { return base_->raw_deleter(); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  std::atomic<int64_t> allocations{0};

 private:
  c10::Allocator* base_;
};

TEST(ChunkPayloads, NeverComeFromTheCpuAllocator) {
  constexpr uint8_t kPriority = 100;
  c10::Allocator* original = c10::GetCPUAllocator();
  static CountingCpuAllocator counting(original);  // must outlive the process's CPU tensors
  c10::SetCPUAllocator(&counting, kPriority);
  ASSERT_EQ(c10::GetCPUAllocator(), &counting);

  // The counter sees an ordinary CPU tensor: the test can fail.
  { const at::Tensor probe = at::empty({16}); }
  EXPECT_EQ(counting.allocations.load(), 1);
  counting.allocations = 0;

  {
    HostTier host(MemoryTier::kUnlimited, HostTier::Pinning::kNever);
    EmulatedDeviceTier device(1 << 20);
    Layout layout;
    layout.add_tensor("w", {32, 32});
    layout.add_tensor("b", {32});
    layout.finalize(2048);
    ChunkStore store(std::move(layout),
                     {{ChunkKind::kParam, at::kHalf}, {ChunkKind::kMomentum, at::kFloat}}, host,
                     device);
    for (ChunkId id = 0; id < store.chunk_count(); ++id) store.allocate(id, Tier::kHost);
    store.move(0, Tier::kDevice);
    const at::Tensor w = store.view(0, ChunkKind::kParam);
    const at::Tensor flat = store.chunk_view(1);
    EXPECT_EQ(w.numel(), 1024);
    EXPECT_EQ(flat.numel(), 2048);
    store.move(0, Tier::kHost);
    store.release(1);
  }
  EXPECT_EQ(counting.allocations.load(), 0);
  c10::SetCPUAllocator(original, kPriority);
}

}  // namespace cpu_allocator_test
}  // namespace patrickstar
