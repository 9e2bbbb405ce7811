// CountingCpuAllocator: counts what it allocates, frees only what it counted, thread-safe counters.
#include <memory>
#include <thread>
#include <vector>

#include <ATen/Context.h>
#include <ATen/ops/empty.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

#include "patrickstar/memtracer/counting_allocator.h"
#include "patrickstar/memtracer/memory_probe.h"

namespace patrickstar {
namespace counting_allocator_test {

constexpr int64_t kMiB = 1 << 20;

TEST(CountingAllocator, InstalledCounterSeesAtEmpty) {
  CountingCpuAllocator& counter = CountingCpuAllocator::install();
  EXPECT_EQ(&counter, &CountingCpuAllocator::install());  // idempotent
  EXPECT_EQ(CountingCpuAllocator::installed(), &counter);
  EXPECT_EQ(c10::GetCPUAllocator(), &counter);
  const int64_t before = counter.live_bytes();
  counter.reset_peak();
  {
    at::Tensor t = at::empty({kMiB}, at::TensorOptions().dtype(at::kByte));
    EXPECT_GE(counter.live_bytes() - before, kMiB);
    EXPECT_GE(counter.peak_bytes() - before, kMiB);
  }
  EXPECT_EQ(counter.live_bytes(), before);
  EXPECT_GE(counter.peak_bytes() - before, kMiB);  // the peak remembers
  counter.reset_peak();
  EXPECT_EQ(counter.peak_bytes(), counter.live_bytes());
}

TEST(CountingAllocator, ProbeReadsTheCounter) {
  CountingCpuAllocator& counter = CountingCpuAllocator::install();
  CpuMemoryProbe probe(counter);
  probe.reset_peak();
  const int64_t before = probe.live_bytes();
  {
    at::Tensor a = at::empty({2 * kMiB}, at::TensorOptions().dtype(at::kByte));
    at::Tensor b = at::empty({kMiB}, at::TensorOptions().dtype(at::kByte));
  }
  EXPECT_EQ(probe.live_bytes(), before);
  EXPECT_GE(probe.peak_bytes() - before, 3 * kMiB);
}

// Each window is the highest live bytes over its own interval: another window's reset and the
// counter's reset_peak() do not cut it short (two engines in one process, issue 36).
TEST(CountingAllocator, PeakWindowsAreIndependent) {
  CountingCpuAllocator counter(c10::GetDefaultCPUAllocator());
  ScopedPeakWindow a(counter);
  { c10::DataPtr t = counter.allocate(1000); }
  ScopedPeakWindow b(counter);
  EXPECT_EQ(a.peak_bytes(), 1000);
  EXPECT_EQ(b.peak_bytes(), 0);
  { c10::DataPtr t = counter.allocate(200); }
  b.reset();
  counter.reset_peak();
  EXPECT_EQ(a.peak_bytes(), 1000);
  EXPECT_EQ(b.peak_bytes(), 0);
  EXPECT_EQ(counter.peak_bytes(), 0);
  a.reset();
  { c10::DataPtr t = counter.allocate(50); }
  EXPECT_EQ(a.peak_bytes(), 50);
  EXPECT_EQ(b.peak_bytes(), 50);
  // Two probes over one counter: one's reset leaves the other's peak.
  CpuMemoryProbe p(counter);
  CpuMemoryProbe q(counter);
  { c10::DataPtr t = counter.allocate(700); }
  q.reset_peak();
  EXPECT_EQ(p.peak_bytes(), 700);
  EXPECT_EQ(q.peak_bytes(), 0);
}

TEST(CountingAllocator, PeakWindowsAreReusedAndBounded) {
  CountingCpuAllocator counter(c10::GetDefaultCPUAllocator());
  for (int i = 0; i < 3 * CountingCpuAllocator::kMaxPeakWindows; ++i) {
    ScopedPeakWindow w(counter);  // closed at once: the slot is reused
  }
  std::vector<std::unique_ptr<ScopedPeakWindow>> open;
  for (int i = 0; i < CountingCpuAllocator::kMaxPeakWindows; ++i) {
    open.push_back(std::make_unique<ScopedPeakWindow>(counter));
  }
  EXPECT_THROW(counter.open_peak_window(), c10::Error);
  open.pop_back();
  { c10::DataPtr t = counter.allocate(300); }
  ScopedPeakWindow reopened(counter);  // starts at the live bytes, not at the slot's old peak
  EXPECT_EQ(reopened.peak_bytes(), 0);
  EXPECT_EQ(open.front()->peak_bytes(), 300);
}

TEST(CountingAllocator, PeakWindowsOnManyThreads) {
  CountingCpuAllocator counter(c10::GetDefaultCPUAllocator());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&counter, t] {
      ScopedPeakWindow w(counter);
      for (int i = 0; i < 2000; ++i) {
        w.reset();
        c10::DataPtr p = counter.allocate(static_cast<size_t>(64 + t));
        EXPECT_GE(w.peak_bytes(), 64 + t);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(counter.live_bytes(), 0);
}

TEST(CountingAllocator, RawInterfaceCountsAndFrees) {
  CountingCpuAllocator counter(c10::GetDefaultCPUAllocator());
  ASSERT_NE(counter.raw_deleter(), nullptr);
  void* p = counter.raw_allocate(1000);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);  // c10's alignment is kept
  EXPECT_EQ(counter.live_bytes(), 1000);
  counter.raw_deallocate(p);
  EXPECT_EQ(counter.live_bytes(), 0);
  EXPECT_EQ(counter.peak_bytes(), 1000);
  EXPECT_EQ(counter.allocations(), 1);
  {
    c10::DataPtr empty = counter.allocate(0);  // zero bytes: nothing counted, deleter accepts null
    EXPECT_EQ(counter.live_bytes(), 0);
  }
}

TEST(CountingAllocator, ForeignAllocationsDoNotTouchTheCounters) {
  CountingCpuAllocator counter(c10::GetDefaultCPUAllocator());
  c10::DataPtr foreign = c10::GetDefaultCPUAllocator()->allocate(4096);  // "before install"
  c10::DataPtr ours = counter.allocate(512);
  EXPECT_EQ(counter.live_bytes(), 512);
  foreign.clear();
  EXPECT_EQ(counter.live_bytes(), 512);
  ours.clear();
  EXPECT_EQ(counter.live_bytes(), 0);
}

// An inner allocator without a raw interface: the counter keeps the inner DataPtr in a context.
struct NoRawAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = c10::GetDefaultCPUAllocator()->allocate(n);
    void* data = inner.get();
    auto* holder = new c10::DataPtr(std::move(inner));
    return {data, holder, [](void* ctx) { delete static_cast<c10::DataPtr*>(ctx); },
            c10::Device(c10::DeviceType::CPU)};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

TEST(CountingAllocator, InnerWithoutRawInterface) {
  NoRawAllocator inner;
  CountingCpuAllocator counter(&inner);
  EXPECT_EQ(counter.raw_deleter(), nullptr);
  c10::DataPtr a = counter.allocate(300);
  ASSERT_NE(a.get(), nullptr);
  static_cast<char*>(a.get())[299] = 7;  // the whole span is usable
  c10::DataPtr b = counter.clone(a.get(), 300);
  EXPECT_EQ(static_cast<char*>(b.get())[299], 7);
  EXPECT_EQ(counter.live_bytes(), 600);
  a.clear();
  b.clear();
  EXPECT_EQ(counter.live_bytes(), 0);
  EXPECT_EQ(counter.peak_bytes(), 600);
}

TEST(CountingAllocator, ThreadSafeCounters) {
  CountingCpuAllocator counter(c10::GetDefaultCPUAllocator());
  constexpr int kThreads = 4;
  constexpr int kRounds = 2000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&counter, t] {
      for (int i = 0; i < kRounds; ++i) {
        c10::DataPtr p = counter.allocate(static_cast<size_t>(64 + t));
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(counter.live_bytes(), 0);
  EXPECT_EQ(counter.allocations(), kThreads * kRounds);
  EXPECT_GE(counter.peak_bytes(), 64);
  EXPECT_LE(counter.peak_bytes(), 64 + 65 + 66 + 67);  // at most one live allocation per thread
}

// Without CUDA the probe is refused; with CUDA and a GPU it reads the caching allocator: a tensor
// allocated there shows in live and peak bytes, and a reset brings the peak back to the live bytes.
TEST(CountingAllocator, CudaProbeMatchesTheBuild) {
  if (!memtracer_built_with_cuda()) {
    EXPECT_THROW(make_cuda_memory_probe(0), c10::Error);
    return;
  }
  if (!at::hasCUDA()) GTEST_SKIP() << "built with CUDA but no GPU here";
  const auto probe = make_cuda_memory_probe(0);
  const int64_t before = probe->live_bytes();
  {
    const at::Tensor t = at::empty({1 << 20}, at::TensorOptions(at::kCUDA).dtype(at::kByte));
    EXPECT_GE(probe->live_bytes(), before + (1 << 20));
  }
  EXPECT_EQ(probe->live_bytes(), before);
  EXPECT_GE(probe->peak_bytes(), before + (1 << 20));
  probe->reset_peak();
  EXPECT_EQ(probe->peak_bytes(), probe->live_bytes());
}

}  // namespace counting_allocator_test
}  // namespace patrickstar
