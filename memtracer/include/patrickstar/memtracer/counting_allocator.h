// CountingCpuAllocator: a c10 CPU allocator that forwards to the allocator it wraps and counts the
// live and peak bytes of every allocation it served. On the emulated device it measures non-model
// memory. Thread-safe (atomic counters; LibTorch allocates from many threads). The installed
// instance is the one process-wide object of this library: c10 has a single CPU allocator slot and
// it must outlive every tensor.
#pragma once

#include <atomic>
#include <cstdint>

#include <c10/core/Allocator.h>

namespace patrickstar {

// Usage:
//   auto& counter = CountingCpuAllocator::install();  // once per process; later calls return the
//   same counter.reset_peak();
//   ... run a module's forward ...
//   int64_t activations_bytes = counter.peak_bytes();
//
// Memory freed that this allocator did not allocate (tensors created before install) goes through
// its own deleter and never touches the counters, so live_bytes() only counts what it counted.
class CountingCpuAllocator final : public c10::Allocator {
 public:
  // Wraps `inner` (not owned; must outlive this object). Not installed: call allocate() directly
  // (tests).
  explicit CountingCpuAllocator(c10::Allocator* inner);

  // Installs the process-wide counter over the CPU allocator current at the first call, with
  // c10::SetCPUAllocator at a priority above the default's. Idempotent; never uninstalled. Throws
  // c10::Error when another allocator of higher priority keeps the slot.
  static CountingCpuAllocator& install();
  // The installed counter, or nullptr before install().
  static CountingCpuAllocator* installed();

  c10::DataPtr allocate(size_t bytes) override;
  c10::DeleterFnPtr raw_deleter() const override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;

  // Bytes currently allocated through this allocator and not yet freed.
  int64_t live_bytes() const { return live_bytes_.load(std::memory_order_relaxed); }
  // Highest live_bytes() since construction or the last reset_peak().
  int64_t peak_bytes() const { return peak_bytes_.load(std::memory_order_relaxed); }
  // Sets the peak to the current live bytes.
  void reset_peak();
  // Number of allocations served (for tests and statistics).
  int64_t allocations() const { return allocations_.load(std::memory_order_relaxed); }

 private:
  void add(int64_t bytes);
  void sub(int64_t bytes);
  static void delete_with_header(void* data);
  static void delete_with_context(void* context);

  c10::Allocator* inner_;
  c10::DeleterFnPtr inner_raw_deleter_;
  std::atomic<int64_t> live_bytes_{0};
  std::atomic<int64_t> peak_bytes_{0};
  std::atomic<int64_t> allocations_{0};
};

}  // namespace patrickstar
