// Private to engine/src: where the model's bytes are. The host tier (pinned on CUDA), the device
// tier, the chunk store that allocates every chunk's payload from one of them, the copy engine that
// runs asynchronous moves, and the disk tier that keeps optimizer states in files. Declared in the
// order that lets them go safely (members go in reverse): the disk tier first (its I/O waited for,
// its staging freed), then the store, then the tiers it allocated from, the copy engine last (the
// store's moves may still be queued on it until the store goes).
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "patrickstar/chunk/chunk_store.h"
#include "patrickstar/chunk/copy_queue.h"
#include "patrickstar/chunk/layout.h"
#include "patrickstar/chunk/memory_tier.h"

namespace patrickstar::engine_detail {

class DiskStates;  // disk_states.h

// Invariants: the store, once built, allocates from these tiers only, and host_only() and lean()
// always decode the store's current layout (build and replace_store set the three together); the
// fields change only through the operations below.
class ModelStorage {
 public:
  ModelStorage();
  ~ModelStorage();  // engine_disk.cpp, where DiskStates is complete
  ModelStorage(const ModelStorage&) = delete;
  ModelStorage& operator=(const ModelStorage&) = delete;

  // Registration's allocation: the tiers, a store over `layout` (no payload allocated yet) and the
  // copy engine for asynchronous moves (null: none), the layout's groups decoded. Nothing is kept
  // unless all of it was built.
  void build(std::unique_ptr<MemoryTier> host, std::unique_ptr<MemoryTier> device, Layout layout,
             std::vector<ChunkKindSpec> kinds, std::unique_ptr<CopyEngine> copy_queue,
             bool lean_frozen) {
    auto fresh = std::make_unique<ChunkStore>(std::move(layout), std::move(kinds), *host, *device);
    if (copy_queue != nullptr) fresh->set_copy_queue(copy_queue.get());
    omit_lean_states(*fresh, lean_frozen);
    std::vector<bool> fresh_host_only = host_only_of(fresh->layout());
    std::vector<bool> fresh_lean = lean_of(fresh->layout(), lean_frozen);
    copy_queue_ = std::move(copy_queue);
    host_ = std::move(host);
    device_ = std::move(device);
    store_ = std::move(fresh);
    host_only_ = std::move(fresh_host_only);
    lean_ = std::move(fresh_lean);
  }
  // The disk tier over the built store (zero_optimization.offload_optimizer "nvme").
  void attach_disk(std::unique_ptr<DiskStates> disk);  // engine_disk.cpp
  // Registration gave up: the disk tier's files, then every payload, go (the tiers stay, empty).
  void drop_chunks();
  // "auto"'s retry: the store moves to `fresh` (over the same tiers), with its decoded groups.
  void replace_store(std::unique_ptr<ChunkStore> fresh, bool lean_frozen) {
    std::vector<bool> fresh_host_only = host_only_of(fresh->layout());
    std::vector<bool> fresh_lean = lean_of(fresh->layout(), lean_frozen);
    store_ = std::move(fresh);
    host_only_ = std::move(fresh_host_only);
    lean_ = std::move(fresh_lean);
    if (copy_queue_ != nullptr) store_->set_copy_queue(copy_queue_.get());
  }

  // A layout's groups, decoded per chunk index (registration and "auto"'s retry both use these, so
  // the decoding exists once): bit 0, a CPU embedding's; bit 1, frozen at registration, which is
  // lean when the config keeps no optimizer state for frozen parameters (`lean_frozen`).
  static std::vector<bool> host_only_of(const Layout& layout) {
    std::vector<bool> result(static_cast<size_t>(layout.chunk_count()), false);
    for (int64_t i = 0; i < layout.chunk_count(); ++i) {
      result[static_cast<size_t>(i)] = (layout.chunk_group(i) & 1) != 0;
    }
    return result;
  }
  static std::vector<bool> lean_of(const Layout& layout, bool lean_frozen) {
    std::vector<bool> result(static_cast<size_t>(layout.chunk_count()), false);
    for (int64_t i = 0; i < layout.chunk_count(); ++i) {
      result[static_cast<size_t>(i)] = (layout.chunk_group(i) & 2) != 0 && lean_frozen;
    }
    return result;
  }
  // A lean index's store holds its param chunk alone: the other kinds' chunks are omitted.
  static void omit_lean_states(ChunkStore& fresh, bool lean_frozen) {
    const std::vector<bool> lean_index = lean_of(fresh.layout(), lean_frozen);
    for (int64_t i = 0; i < fresh.layout().chunk_count(); ++i) {
      if (!lean_index[static_cast<size_t>(i)]) continue;
      for (const ChunkKindSpec& spec : fresh.kinds()) {
        if (spec.kind != ChunkKind::kParam) fresh.omit(fresh.chunk_id(spec.kind, i));
      }
    }
  }

  ChunkStore* store() const { return store_.get(); }  // null before registration built it
  MemoryTier* host() const { return host_.get(); }
  MemoryTier* device() const { return device_.get(); }
  DiskStates* disk() const { return disk_.get(); }              // null without a disk tier
  CopyEngine* copy_queue() const { return copy_queue_.get(); }  // null without asynchronous moves
  // Per chunk index: a CPU embedding's chunk (use_cpu_embedding), never on the device.
  const std::vector<bool>& host_only() const { return host_only_; }
  // Per chunk index: frozen parameters only, in their param chunk alone (zero_optimization
  // "frozen_parameters": "lean"): the store omits its master, momentum, variance and gradient.
  const std::vector<bool>& lean() const { return lean_; }

 private:
  std::unique_ptr<CopyEngine> copy_queue_;
  std::unique_ptr<MemoryTier> host_;
  std::unique_ptr<MemoryTier> device_;
  std::unique_ptr<ChunkStore> store_;
  std::unique_ptr<DiskStates> disk_;
  std::vector<bool> host_only_;
  std::vector<bool> lean_;
};

}  // namespace patrickstar::engine_detail
