// Where the bytes are at one moment of training: chunk payloads by kind on each tier, the device's
// live non-model bytes (activations and workspaces, as the tracer's probe counts them) and each
// tier's used bytes. A tier's used bytes less its payloads are blocks that hold no chunk payload
// now (the source of a copy that has not completed, a gathered group's buffer in data parallel).
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "patrickstar/chunk/chunk_store.h"

namespace patrickstar {

struct MemoryBreakdown {
  int64_t iteration = -1;  // -1: not taken
  std::string moment;      // the moment's label ("step" for the optimizer step)
  std::array<int64_t, kChunkKindCount> device_chunk_bytes{};  // indexed by ChunkKind
  std::array<int64_t, kChunkKindCount> host_chunk_bytes{};
  int64_t device_non_model_bytes = 0;
  int64_t device_used_bytes = 0;  // the device tier's blocks
  int64_t host_used_bytes = 0;    // the host tier's blocks
  // Blocks each tier keeps for reuse (MemoryTier::reserved_bytes() - used_bytes()): memory the
  // process holds that no chunk uses now.
  int64_t device_cached_bytes = 0;
  int64_t host_cached_bytes = 0;

  int64_t device_chunk_total() const;
  int64_t host_chunk_total() const;
  // What the device holds: its tier's blocks plus the live non-model bytes.
  int64_t device_total() const { return device_used_bytes + device_non_model_bytes; }
};

// The breakdown of `store` now; `non_model_bytes` is the device's live non-model figure.
MemoryBreakdown take_memory_breakdown(const ChunkStore& store, int64_t non_model_bytes,
                                      int64_t iteration, std::string moment);

}  // namespace patrickstar
