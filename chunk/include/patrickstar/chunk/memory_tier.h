// Memory tiers: where chunk payloads live (host, or a device: CUDA or the emulated device).
// A tier hands out raw aligned blocks, never through LibTorch's CPU allocator (the memory tracer
// counts everything that goes through that one as non-model data), and keeps exact byte counts.
// Every method is thread-safe. A tier owns its blocks; callers return them with deallocate() and
// must destroy every user (ChunkStore) before the tier. Usage:
//
//   patrickstar::HostTier host;                                  // unlimited, pinned if CUDA runs
//   patrickstar::EmulatedDeviceTier device(8LL << 30);           // an 8 GiB "GPU" made of CPU
//   memory void* p = device.allocate(1 << 20);                          // throws
//   c10::OutOfMemoryError device.deallocate(p);
#pragma once

#include "patrickstar/chunk/types.h"

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace patrickstar {

enum class CopyDirection : uint8_t { kHostToDevice, kDeviceToHost };

// Base of every tier: accounting, capacity, the out-of-memory error and an exact-size block cache.
// Subclasses provide raw memory (raw_allocate / raw_deallocate) and copies.
//
// Accounting: used_bytes() counts the bytes callers asked for and have not returned;
// reserved_bytes() adds the blocks kept in the cache for reuse (chunks have few distinct sizes,
// so a freed payload is handed to the next request of the same size without touching the OS).
// The capacity bounds used_bytes; cached blocks are dropped first when the reserve would pass it.
class MemoryTier {
 public:
  static constexpr int64_t kUnlimited = std::numeric_limits<int64_t>::max();
  static constexpr int64_t kMinAlignment = 64;

  virtual ~MemoryTier();
  MemoryTier(const MemoryTier&) = delete;
  MemoryTier& operator=(const MemoryTier&) = delete;

  Tier kind() const { return kind_; }
  const std::string& name() const { return name_; }
  // The device that tensors viewing this tier's memory live on (CPU for host and emulated tiers).
  virtual c10::Device device() const = 0;

  // A block of `bytes` (> 0) aligned to max(alignment, 64) (a power of two). Contents are
  // unspecified. Throws c10::OutOfMemoryError naming the tier, its capacity, the bytes in use and
  // the bytes requested when the block would pass the capacity (or the system refuses); then no
  // count changes and nothing stays allocated.
  void* allocate(int64_t bytes, int64_t alignment = kMinAlignment);
  // Returns a block from allocate(); throws c10::Error for a pointer this tier did not hand out.
  void deallocate(void* ptr);

  int64_t capacity_bytes() const { return capacity_bytes_; }
  int64_t used_bytes() const;
  int64_t peak_bytes() const;        // highest used_bytes() since construction or reset_peak()
  int64_t reserved_bytes() const;    // used + cached
  // Highest reserved_bytes() since construction (reset_peak() leaves it): the most memory the
  // tier has held from the system at once.
  int64_t peak_reserved_bytes() const;
  int64_t allocation_count() const;  // live blocks
  void reset_peak();
  // Gives every cached block back to the system.
  void empty_cache();

  // Copies `bytes` between this tier's memory and the other tier's memory. Returns when the data
  // has arrived (a CUDA tier copies on its own stream, ordered after the current stream's work).
  virtual void copy(void* dst, const void* src, int64_t bytes, CopyDirection direction);
  // Zero-fills `bytes` at `ptr` (memory of this tier).
  virtual void fill_zero(void* ptr, int64_t bytes);

 protected:
  MemoryTier(Tier kind, std::string name, int64_t capacity_bytes, bool cache_blocks);

  // Raw memory of at least `bytes`, aligned to `alignment`; nullptr when the system refuses.
  virtual void* raw_allocate(int64_t bytes, int64_t alignment) = 0;
  virtual void raw_deallocate(void* ptr, int64_t bytes, int64_t alignment) = 0;
  // Every subclass destructor calls this: frees the cache and any block still handed out (with a
  // warning, since some user outlived its tier).
  void release_all();
  // empty_cache() unless another thread holds the tier at that moment (then nothing); returns the
  // bytes given back. For callbacks that may run while the tier's own thread waits on them.
  int64_t try_empty_cache();

 private:
  struct Block {
    int64_t bytes;
    int64_t alignment;
  };
  using CacheKey = std::pair<int64_t, int64_t>;  // bytes, alignment

  void empty_cache_locked();
  [[noreturn]] void throw_oom(int64_t bytes, const char* why) const;

  const Tier kind_;
  const std::string name_;
  const int64_t capacity_bytes_;
  const bool cache_blocks_;

  mutable std::mutex mutex_;
  std::unordered_map<void*, Block> live_;
  std::map<CacheKey, std::vector<void*>> cache_;
  int64_t used_bytes_ = 0;
  int64_t cached_bytes_ = 0;
  int64_t peak_bytes_ = 0;
  int64_t peak_reserved_bytes_ = 0;
};

// Host memory: pinned (cudaHostAlloc, exactly the size asked for, back to the system when freed)
// when this build has CUDA and a GPU is present (and pinning is not switched off), plain aligned
// memory otherwise.
class HostTier final : public MemoryTier {
 public:
  enum class Pinning : uint8_t { kAuto, kNever };

  explicit HostTier(int64_t capacity_bytes = kUnlimited, Pinning pinning = Pinning::kAuto);
  ~HostTier() override;

  c10::Device device() const override { return c10::Device(c10::kCPU); }
  bool pinned() const { return pinned_; }

 protected:
  void* raw_allocate(int64_t bytes, int64_t alignment) override;
  void raw_deallocate(void* ptr, int64_t bytes, int64_t alignment) override;

 private:
  bool pinned_ = false;
};

// The emulated device: CPU memory with a hard capacity, standing in for a GPU. Copies are memcpy.
class EmulatedDeviceTier final : public MemoryTier {
 public:
  explicit EmulatedDeviceTier(int64_t capacity_bytes);
  ~EmulatedDeviceTier() override;

  c10::Device device() const override { return c10::Device(c10::kCPU); }

 protected:
  void* raw_allocate(int64_t bytes, int64_t alignment) override;
  void raw_deallocate(void* ptr, int64_t bytes, int64_t alignment) override;
};

}  // namespace patrickstar
