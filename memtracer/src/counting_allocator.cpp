#include "patrickstar/memtracer/counting_allocator.h"

#include <mutex>

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include "patrickstar/chunk/allocation_faults.h"

namespace patrickstar {
namespace {

// Allocations through a raw-capable inner allocator carry this header in front of the data: the raw
// deleter gets only the data pointer and must find the byte count and the counter from it. 64 bytes
// keeps c10's 64-byte alignment of the data.
constexpr size_t kHeaderBytes = 64;
struct Header {
  int64_t bytes;
  CountingCpuAllocator* owner;
  c10::DeleterFnPtr inner_deleter;
};
static_assert(sizeof(Header) <= kHeaderBytes);

// Allocations through an inner allocator without a raw interface keep the inner DataPtr here.
struct Context {
  c10::DataPtr inner;
  int64_t bytes;
  CountingCpuAllocator* owner;
};

// Above c10's default CPU allocator (priority 0), so SetCPUAllocator replaces it.
constexpr uint8_t kInstallPriority = 2;

std::atomic<CountingCpuAllocator*> g_installed{nullptr};

}  // namespace

CountingCpuAllocator::CountingCpuAllocator(c10::Allocator* inner)
    : inner_(inner), inner_raw_deleter_(inner != nullptr ? inner->raw_deleter() : nullptr) {
  TORCH_CHECK(inner_ != nullptr, "CountingCpuAllocator needs an allocator to wrap, got nullptr");
}

CountingCpuAllocator& CountingCpuAllocator::install() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Deliberately never deleted: c10 keeps the pointer and tensors may be freed during static
    // destruction. This is the one process-wide object of the library (c10 has one CPU slot).
    auto* counter = new CountingCpuAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(counter, kInstallPriority);
    g_installed.store(counter);
  });
  CountingCpuAllocator* counter = g_installed.load();
  TORCH_CHECK(c10::GetCPUAllocator() == counter,
              "CountingCpuAllocator::install: another CPU allocator with a priority above ",
              static_cast<int>(kInstallPriority),
              " holds c10's CPU allocator slot, so non-model memory cannot be measured on the "
              "emulated device; install the counter before that allocator");
  return *counter;
}

CountingCpuAllocator* CountingCpuAllocator::installed() {
  return g_installed.load();
}

void CountingCpuAllocator::raise(std::atomic<int64_t>& peak, int64_t live) {
  int64_t seen = peak.load(std::memory_order_relaxed);
  while (live > seen && !peak.compare_exchange_weak(seen, live, std::memory_order_relaxed)) {
  }
}

void CountingCpuAllocator::add(int64_t bytes) {
  allocations_.fetch_add(1, std::memory_order_relaxed);
  const int64_t live = live_bytes_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  raise(peak_bytes_, live);
  // Closed slots are raised too (harmless: a slot starts again at the live bytes when reopened).
  const int used = slots_used_.load(std::memory_order_acquire);
  for (int i = 0; i < used; ++i) raise(slot(i).peak, live);
}

CountingCpuAllocator::PeakSlot& CountingCpuAllocator::slot(int window) {
  TORCH_CHECK(window >= 0 && window < kMaxPeakWindows, "CountingCpuAllocator: no peak window ",
              window);
  return slots_[static_cast<size_t>(window)];
}
const CountingCpuAllocator::PeakSlot& CountingCpuAllocator::slot(int window) const {
  TORCH_CHECK(window >= 0 && window < kMaxPeakWindows, "CountingCpuAllocator: no peak window ",
              window);
  return slots_[static_cast<size_t>(window)];
}

int CountingCpuAllocator::open_peak_window() {
  for (int i = 0; i < kMaxPeakWindows; ++i) {
    bool closed = false;
    if (!slot(i).open.compare_exchange_strong(closed, true, std::memory_order_acq_rel)) continue;
    int used = slots_used_.load(std::memory_order_relaxed);
    while (used < i + 1 &&
           !slots_used_.compare_exchange_weak(used, i + 1, std::memory_order_acq_rel)) {
    }
    slot(i).peak.store(live_bytes(), std::memory_order_relaxed);
    return i;
  }
  TORCH_CHECK(false, "CountingCpuAllocator: ", kMaxPeakWindows,
              " peak windows are open (one per engine); close some first");
}

void CountingCpuAllocator::close_peak_window(int window) {
  slot(window).open.store(false, std::memory_order_release);
}

int64_t CountingCpuAllocator::window_peak_bytes(int window) const {
  return slot(window).peak.load(std::memory_order_relaxed);
}

void CountingCpuAllocator::reset_window_peak(int window) {
  slot(window).peak.store(live_bytes(), std::memory_order_relaxed);
}

void CountingCpuAllocator::sub(int64_t bytes) {
  live_bytes_.fetch_sub(bytes, std::memory_order_relaxed);
}

void CountingCpuAllocator::reset_peak() {
  peak_bytes_.store(live_bytes_.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

c10::DataPtr CountingCpuAllocator::allocate(size_t bytes) {
  const c10::Device cpu(c10::DeviceType::CPU);
  // What c10's CPU allocator does when the system refuses: an error naming the size.
  TORCH_CHECK_WITH(OutOfMemoryError, !allocation_faults::should_fail(),
                   "CPU allocator: can't allocate ", bytes, " bytes (an injected failure)");
  if (inner_raw_deleter_ != nullptr) {
    if (bytes == 0) {
      return {nullptr, nullptr, &delete_with_header, cpu};
    }
    void* base = inner_->raw_allocate(bytes + kHeaderBytes);
    auto* header = static_cast<Header*>(base);
    header->bytes = static_cast<int64_t>(bytes);
    header->owner = this;
    header->inner_deleter = inner_raw_deleter_;
    void* data = static_cast<char*>(base) + kHeaderBytes;
    add(header->bytes);
    return {data, data, &delete_with_header, cpu};
  }
  auto* context = new Context{inner_->allocate(bytes), static_cast<int64_t>(bytes), this};
  add(context->bytes);
  void* data = context->inner.get();
  return {data, context, &delete_with_context, cpu};
}

c10::DeleterFnPtr CountingCpuAllocator::raw_deleter() const {
  return inner_raw_deleter_ != nullptr ? &delete_with_header : nullptr;
}

void CountingCpuAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  default_copy_data(dest, src, count);
}

void CountingCpuAllocator::delete_with_header(void* data) {
  if (data == nullptr) {
    return;
  }
  void* base = static_cast<char*>(data) - kHeaderBytes;
  const Header header = *static_cast<Header*>(base);
  header.owner->sub(header.bytes);
  header.inner_deleter(base);
}

void CountingCpuAllocator::delete_with_context(void* context) {
  auto* owned = static_cast<Context*>(context);
  owned->owner->sub(owned->bytes);
  delete owned;  // frees the inner allocation through its own deleter
}

}  // namespace patrickstar
