// Private to engine/src: where the model's bytes are. The host tier (pinned on CUDA), the device
// tier, the chunk store that allocates every chunk's payload from one of them, the copy engine that
// runs asynchronous moves, and the disk tier that keeps optimizer states in files. Declared in the
// order that lets them go safely (members go in reverse): the disk tier first (its I/O waited for,
// its staging freed), then the store, then the tiers it allocated from, the copy engine last (the
// store's moves may still be queued on it until the store goes).
#pragma once

#include <memory>
#include <vector>

#include "patrickstar/chunk/chunk_store.h"
#include "patrickstar/chunk/copy_queue.h"
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
