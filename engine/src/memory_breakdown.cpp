#include "patrickstar/engine/memory_breakdown.h"

#include <numeric>
#include <utility>

namespace patrickstar {

int64_t MemoryBreakdown::device_chunk_total() const {
  return std::accumulate(device_chunk_bytes.begin(), device_chunk_bytes.end(), int64_t{0});
}

int64_t MemoryBreakdown::host_chunk_total() const {
  return std::accumulate(host_chunk_bytes.begin(), host_chunk_bytes.end(), int64_t{0});
}

MemoryBreakdown take_memory_breakdown(const ChunkStore& store, int64_t non_model_bytes,
                                      int64_t iteration, std::string moment) {
  MemoryBreakdown b;
  b.iteration = iteration;
  b.moment = std::move(moment);
  for (ChunkId id = 0; id < store.chunk_count(); ++id) {
    const auto kind = static_cast<size_t>(store.kind_of(id));
    if (store.tier(id) == Tier::kDevice) b.device_chunk_bytes[kind] += store.chunk_bytes(id);
    if (store.tier(id) == Tier::kHost) b.host_chunk_bytes[kind] += store.chunk_bytes(id);
  }
  b.device_non_model_bytes = non_model_bytes;
  b.device_used_bytes = store.device_tier().used_bytes();
  b.host_used_bytes = store.host_tier().used_bytes();
  b.device_cached_bytes = store.device_tier().reserved_bytes() - b.device_used_bytes;
  b.host_cached_bytes = store.host_tier().reserved_bytes() - b.host_used_bytes;
  return b;
}

}  // namespace patrickstar
