#include "patrickstar/chunk/memory_tier.h"

#include "patrickstar/chunk/allocation_faults.h"

#include <ATen/Context.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>

#ifdef PATRICKSTAR_HAVE_CUDA
#include "cuda/pinned_host.h"
#endif

namespace patrickstar {

namespace {

int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// Plain aligned memory from the C library: never LibTorch's CPU allocator.
void* aligned_system_alloc(int64_t bytes, int64_t alignment) {
  return std::aligned_alloc(static_cast<size_t>(alignment),
                            static_cast<size_t>(round_up(bytes, alignment)));
}

}  // namespace

MemoryTier::MemoryTier(Tier kind, std::string name, int64_t capacity_bytes, bool cache_blocks)
    : kind_(kind),
      name_(std::move(name)),
      capacity_bytes_(capacity_bytes),
      cache_blocks_(cache_blocks) {
  TORCH_CHECK(kind != Tier::kNone, "a memory tier is host or device, not none");
  TORCH_CHECK(capacity_bytes > 0, "tier ", name_, ": capacity must be positive, got ",
              capacity_bytes, " bytes");
}

MemoryTier::~MemoryTier() = default;

void MemoryTier::throw_oom(int64_t bytes, const char* why) const {
  TORCH_CHECK_WITH(
      OutOfMemoryError, false, "out of memory on tier ", name_, " (", to_string(kind_), "): ", why,
      "; capacity ",
      capacity_bytes_ == kUnlimited ? std::string("unlimited") : std::to_string(capacity_bytes_),
      " bytes, ", used_bytes_, " bytes in use, ", bytes, " bytes requested");
}

void* MemoryTier::allocate(int64_t bytes, int64_t alignment) {
  TORCH_CHECK(bytes > 0, "tier ", name_, ": allocate needs a positive size, got ", bytes, " bytes");
  TORCH_CHECK(alignment > 0 && (alignment & (alignment - 1)) == 0, "tier ", name_,
              ": alignment must be a power of two, got ", alignment);
  alignment = std::max(alignment, kMinAlignment);

  std::lock_guard<std::mutex> lock(mutex_);
  if (bytes > capacity_bytes_ - used_bytes_) {
    throw_oom(bytes, "the request passes the capacity");
  }
  if (allocation_faults::should_fail()) {
    throw_oom(bytes, "the system refused the block (an injected failure)");
  }
  void* ptr = nullptr;
  const CacheKey key{bytes, alignment};
  if (auto it = cache_.find(key); it != cache_.end() && !it->second.empty()) {
    ptr = it->second.back();
    it->second.pop_back();
    cached_bytes_ -= bytes;
  } else {
    // Keep the reserve (live + cached) within the capacity: drop cached blocks of other sizes.
    if (cached_bytes_ > 0 && bytes > capacity_bytes_ - used_bytes_ - cached_bytes_) {
      empty_cache_locked();
    }
    ptr = raw_allocate(bytes, alignment);
    if (ptr == nullptr && cached_bytes_ > 0) {
      empty_cache_locked();
      ptr = raw_allocate(bytes, alignment);
    }
    if (ptr == nullptr) {
      throw_oom(bytes, "the system refused the block");
    }
  }
  try {
    live_.emplace(ptr, Block{bytes, alignment});
  } catch (...) {
    raw_deallocate(ptr, bytes, alignment);
    throw;
  }
  used_bytes_ += bytes;
  peak_bytes_ = std::max(peak_bytes_, used_bytes_);
  peak_reserved_bytes_ = std::max(peak_reserved_bytes_, used_bytes_ + cached_bytes_);
  return ptr;
}

void MemoryTier::deallocate(void* ptr) {
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(ptr);
  TORCH_CHECK(it != live_.end(), "tier ", name_, ": deallocate of ", ptr,
              ", which this tier did not hand out (or was already returned)");
  const Block block = it->second;
  live_.erase(it);
  used_bytes_ -= block.bytes;
  if (cache_blocks_) {
    cache_[CacheKey{block.bytes, block.alignment}].push_back(ptr);
    cached_bytes_ += block.bytes;
  } else {
    raw_deallocate(ptr, block.bytes, block.alignment);
  }
}

int64_t MemoryTier::used_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return used_bytes_;
}

int64_t MemoryTier::peak_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_bytes_;
}

int64_t MemoryTier::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return used_bytes_ + cached_bytes_;
}

int64_t MemoryTier::peak_reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_reserved_bytes_;
}

int64_t MemoryTier::allocation_count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(live_.size());
}

void MemoryTier::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  peak_bytes_ = used_bytes_;
}

void MemoryTier::empty_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  empty_cache_locked();
}

int64_t MemoryTier::try_empty_cache() {
  std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
  if (!lock.owns_lock()) return 0;
  const int64_t bytes = cached_bytes_;
  empty_cache_locked();
  return bytes;
}

void MemoryTier::empty_cache_locked() {
  for (auto& [key, blocks] : cache_) {
    for (void* ptr : blocks) raw_deallocate(ptr, key.first, key.second);
  }
  cache_.clear();
  cached_bytes_ = 0;
}

void MemoryTier::release_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  empty_cache_locked();
  if (!live_.empty()) {
    TORCH_WARN("tier ", name_, " destroyed with ", live_.size(), " blocks (", used_bytes_,
               " bytes) still in use; destroy every ChunkStore before its tiers");
    for (auto& [ptr, block] : live_) raw_deallocate(ptr, block.bytes, block.alignment);
    live_.clear();
    used_bytes_ = 0;
  }
}

void MemoryTier::copy(void* dst, const void* src, int64_t bytes, CopyDirection /*direction*/) {
  std::memcpy(dst, src, static_cast<size_t>(bytes));
}

void MemoryTier::fill_zero(void* ptr, int64_t bytes) {
  std::memset(ptr, 0, static_cast<size_t>(bytes));
}

// ---------------------------------------------------------------------------------------------

HostTier::HostTier(int64_t capacity_bytes, Pinning pinning)
    : MemoryTier(Tier::kHost, "host", capacity_bytes, /*cache_blocks=*/true) {
#ifdef PATRICKSTAR_HAVE_CUDA
  pinned_ = pinning == Pinning::kAuto && at::hasCUDA();
#else
  (void)pinning;
#endif
}

HostTier::~HostTier() {
  release_all();
}

void* HostTier::raw_allocate(int64_t bytes, int64_t alignment) {
#ifdef PATRICKSTAR_HAVE_CUDA
  if (pinned_) {
    // Exactly `bytes` (LibTorch's pinned host allocator would round up to a power of two, which
    // the tier's capacity would not see), page-aligned.
    void* ptr = cuda_detail::pinned_host_allocate(bytes);
    TORCH_CHECK(ptr == nullptr ||
                    reinterpret_cast<uintptr_t>(ptr) % static_cast<uintptr_t>(alignment) == 0,
                "pinned host block ", ptr, " is not aligned to ", alignment, " bytes");
    return ptr;
  }
#endif
  return aligned_system_alloc(bytes, alignment);
}

void HostTier::raw_deallocate(void* ptr, int64_t /*bytes*/, int64_t /*alignment*/) {
#ifdef PATRICKSTAR_HAVE_CUDA
  if (pinned_) {
    cuda_detail::pinned_host_free(ptr);
    return;
  }
#endif
  std::free(ptr);
}

// ---------------------------------------------------------------------------------------------

EmulatedDeviceTier::EmulatedDeviceTier(int64_t capacity_bytes)
    : MemoryTier(Tier::kDevice, "emulated_device", capacity_bytes, /*cache_blocks=*/true) {}

EmulatedDeviceTier::~EmulatedDeviceTier() {
  release_all();
}

void* EmulatedDeviceTier::raw_allocate(int64_t bytes, int64_t alignment) {
  return aligned_system_alloc(bytes, alignment);
}

void EmulatedDeviceTier::raw_deallocate(void* ptr, int64_t /*bytes*/, int64_t /*alignment*/) {
  std::free(ptr);
}

}  // namespace patrickstar
