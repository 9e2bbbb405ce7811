// CountingCpuAllocator: a c10 CPU allocator that forwards to the allocator it wraps and counts the
// live and peak bytes of every allocation it served. On the emulated device it measures non-model
// memory. Thread-safe (atomic counters; LibTorch allocates from many threads). The installed
// instance is the one process-wide object of this library: c10 has a single CPU allocator slot and
// it must outlive every tensor.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>

#include <c10/core/Allocator.h>

namespace patrickstar {

// Usage:
//   auto& counter = CountingCpuAllocator::install();  // once per process; later calls return it
//   const int window = counter.open_peak_window();    // a peak window of this measurement's own
//   ... run a module's forward ...
//   int64_t activations_bytes = counter.window_peak_bytes(window) - live_before;
//   counter.close_peak_window(window);
//
// Each engine's probe (CpuMemoryProbe) holds its own window, so two engines in one process (a GAN's)
// never cut each other's peaks short; the counter's own peak_bytes()/reset_peak() is one more
// window, for single users.
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

  // Peak windows: the highest live_bytes() since the window opened or its last reset, untouched by
  // reset_peak() and by other windows. Every allocation raises each window ever opened (at most
  // the largest number open at once: an atomic max each). Thread-safe; a window is read and reset
  // by its owner. open_peak_window() throws c10::Error when kMaxPeakWindows are open.
  static constexpr int kMaxPeakWindows = 64;
  int open_peak_window();
  void close_peak_window(int window);
  int64_t window_peak_bytes(int window) const;
  void reset_window_peak(int window);

 private:
  struct PeakSlot {
    std::atomic<bool> open{false};
    std::atomic<int64_t> peak{0};
  };
  static void raise(std::atomic<int64_t>& peak, int64_t live);
  PeakSlot& slot(int window);
  const PeakSlot& slot(int window) const;

  void add(int64_t bytes);
  void sub(int64_t bytes);
  static void delete_with_header(void* data);
  static void delete_with_context(void* context);

  c10::Allocator* inner_;
  c10::DeleterFnPtr inner_raw_deleter_;
  std::atomic<int64_t> live_bytes_{0};
  std::atomic<int64_t> peak_bytes_{0};
  std::atomic<int64_t> allocations_{0};
  std::array<PeakSlot, kMaxPeakWindows> slots_{};
  std::atomic<int> slots_used_{0};  // one past the highest slot ever opened
};

// A peak window of the counter's for as long as this object lives (closed on every path out).
class ScopedPeakWindow {
 public:
  explicit ScopedPeakWindow(CountingCpuAllocator& counter)
      : counter_(counter), window_(counter.open_peak_window()) {}
  ~ScopedPeakWindow() { counter_.close_peak_window(window_); }
  ScopedPeakWindow(const ScopedPeakWindow&) = delete;
  ScopedPeakWindow& operator=(const ScopedPeakWindow&) = delete;
  // Highest live bytes since the window opened or the last reset().
  int64_t peak_bytes() const { return counter_.window_peak_bytes(window_); }
  void reset() { counter_.reset_window_peak(window_); }

 private:
  CountingCpuAllocator& counter_;
  int window_;
};

}  // namespace patrickstar
