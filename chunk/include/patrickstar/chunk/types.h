// Vocabulary types of the chunk store: chunk kinds, tiers and the ids that name tensors and chunks.
// Plain value types and pure functions: thread-safe, nothing owned. See docs/design.md section 2.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string_view>

namespace patrickstar {

// Index of a registered tensor in its Layout, in registration order (0, 1, 2, ...).
using TensorId = int64_t;
// Flat id of a chunk over every kind a ChunkStore holds; see ChunkStore::chunk_id(kind, index).
using ChunkId = int64_t;

// What a chunk list holds. Every kind shares one Layout (tensor -> chunk index, offset, numel).
enum class ChunkKind : uint8_t {
  kParam,      // half (or fp32) parameters; the gradient later overwrites them in place
  kParamFp32,  // fp32 master parameters
  kMomentum,   // Adam first moment (fp32)
  kVariance,   // Adam second moment (fp32)
  kGrad,       // separate gradient space (fp32 mode, gradient accumulation)
};
inline constexpr int kChunkKindCount = 5;

// Where a chunk payload lives.
enum class Tier : uint8_t {
  kNone,    // released: no payload
  kHost,    // host memory (pinned when CUDA is available)
  kDevice,  // CUDA memory, or the emulated device (CPU memory with a hard capacity)
};

std::string_view to_string(ChunkKind kind);
std::string_view to_string(Tier tier);

// Bytes per element of a chunk dtype; throws c10::Error unless dtype is Half, BFloat16 or Float.
int64_t chunk_element_bytes(at::ScalarType dtype);

}  // namespace patrickstar
