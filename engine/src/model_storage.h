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

struct ModelStorage {
  ModelStorage();
  ~ModelStorage();  // engine_disk.cpp, where DiskStates is complete
  ModelStorage(const ModelStorage&) = delete;
  ModelStorage& operator=(const ModelStorage&) = delete;

  // Registration gave up: the disk tier's files, then every payload, go (the tiers stay, empty).
  void drop_chunks();

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
  // A store with no payload yet omits every chunk of a lean index but its param chunk: only the
  // param chunk holds bytes from here on.
  static void omit_lean_states(ChunkStore& fresh, bool lean_frozen) {
    const std::vector<bool> lean_index = lean_of(fresh.layout(), lean_frozen);
    for (int64_t i = 0; i < fresh.layout().chunk_count(); ++i) {
      if (!lean_index[static_cast<size_t>(i)]) continue;
      for (const ChunkKindSpec& spec : fresh.kinds()) {
        if (spec.kind != ChunkKind::kParam) fresh.omit(fresh.chunk_id(spec.kind, i));
      }
    }
  }
  // Registration, once the store is built: host_only and lean follow its layout, and the store
  // omits the lean indices' other chunks.
  void set_lean_from_layout(bool lean_frozen) {
    host_only = host_only_of(store->layout());
    lean = lean_of(store->layout(), lean_frozen);
    omit_lean_states(*store, lean_frozen);
  }
  // "auto"'s retry: `fresh` (prepared by omit_lean_states, the model's slots copied into it)
  // replaces the store, which goes with whatever it still holds; host_only and lean follow the new
  // layout, and the copy engine serves the new store. The decoding is made before anything is
  // replaced, so a failure leaves the old store and its decoding together.
  void replace_store(std::unique_ptr<ChunkStore> fresh, bool lean_frozen) {
    std::vector<bool> fresh_host_only = host_only_of(fresh->layout());
    std::vector<bool> fresh_lean = lean_of(fresh->layout(), lean_frozen);
    store = std::move(fresh);
    host_only = std::move(fresh_host_only);
    lean = std::move(fresh_lean);
    if (copy_queue != nullptr) store->set_copy_queue(copy_queue.get());
  }

  std::unique_ptr<CopyEngine> copy_queue;  // null without asynchronous moves
  std::unique_ptr<MemoryTier> host;
  std::unique_ptr<MemoryTier> device;
  std::unique_ptr<ChunkStore> store;
  std::unique_ptr<DiskStates> disk;  // null without a disk tier
  // Per chunk index: a CPU embedding's chunk (use_cpu_embedding), never on the device.
  std::vector<bool> host_only;
  // Per chunk index: frozen parameters only, in their param chunk alone (zero_optimization
  // "frozen_parameters": "lean"): the store omits its master, momentum, variance and gradient.
  std::vector<bool> lean;
};

}  // namespace patrickstar::engine_detail
