// Layout: where every registered tensor lives inside the chunks, the same for every chunk kind.
// Not thread-safe; once finalized it is read-only and may be read from any thread. Owns its data.
//
// The policy, in plain words:
// - Tensors are registered once, in a fixed order (the order the engine meets the parameters).
//   Registration only records name and shape; nothing is placed until finalize().
// - Chunks have room for `chunk_elems` elements (a cut last chunk, below, for fewer). Tensors are
//   placed in registration order, first-fit: each tensor goes to the lowest-numbered chunk that
//   still has room for all of it, at the end of what that chunk already holds. A new chunk opens
//   only when no open chunk has room. Small tensors registered late therefore fill holes left at
//   the end of earlier chunks.
// - A tensor never spans two chunks, so its view is one contiguous slice of one payload. A tensor
//   larger than a chunk is an error that names it and the smallest chunk size that would work.
// - Offsets are in elements and unaligned: tensors are packed back to back (payloads themselves
//   are at least 64-byte aligned).
// - With one process (world_size 1) the last chunk of each group is cut to what it holds, rounded
//   up to kTailRoundElems: first-fit leaves earlier chunks holes smaller than the tensors that
//   follow, but the last chunk's empty tail is on average half a chunk. Every other chunk (and
//   every chunk of a sharded layout, whose collectives move equal slots) holds `chunk_elems`.
// - Waste is every element of every chunk's capacity that holds no tensor:
//   sum(chunk_capacity) - sum(numel). It is paid once per chunk kind, in that kind's dtype.
// - finalize_search() packs the same way for each candidate size min, min+step, ..., max and keeps
//   the one that wastes the fewest elements (the smallest such size on a tie), as ColossalAI's
//   Gemini searches its chunk size. The search packs each group on its own and cuts the last
//   chunks, as placement does, so its waste is the layout's.
// - With world_size > 1 the chunk count is rounded up to a multiple of world_size (empty chunks,
//   counted as waste): chunk i belongs to comm group i / world_size and is owned by rank
//   i % world_size. Each tensor group (add_tensor's `group`) is rounded up on its own, so a comm
//   group never mixes two tensor groups (CPU-embedding chunks and device chunks).
// - The placement search keeps the free room of every chunk in a max segment tree, so placing n
//   tensors costs O(n log n) whatever the number of chunks.
//
// Usage:
//   patrickstar::Layout layout;
//   auto w = layout.add_tensor("fc1.weight", {1024, 512});
//   layout.finalize(/*chunk_elems=*/1 << 20);          // or finalize_search(min, max, step)
//   const auto& p = layout.placement(w);               // p.chunk_index, p.offset_elems, p.numel
#pragma once

#include "patrickstar/chunk/types.h"

#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace patrickstar {

struct TensorPlacement {
  int64_t chunk_index = -1;  // index within every kind's chunk list
  int64_t offset_elems = 0;  // first element inside the chunk
  int64_t numel = 0;
};

// Result of packing a list of tensor sizes into chunks of one size.
struct PackingResult {
  int64_t chunk_elems = 0;
  int64_t chunk_count = 0;
  int64_t waste_elems = 0;  // sum of the chunks' capacities - sum of numels
};

class Layout {
 public:
  explicit Layout(int64_t world_size = 1);

  // Registers a tensor of this shape; returns its id (0, 1, 2, ... in registration order).
  // Tensors of different `group`s never share a chunk: each group is packed on its own (first-fit
  // in registration order), groups in increasing order, so a group's chunks are consecutive (the
  // engine keeps group 1, CPU embeddings, on the host). Throws c10::Error after finalize() or for
  // a negative size or group.
  TensorId add_tensor(std::string_view name, c10::IntArrayRef sizes, int group = 0);
  // The group of the tensors in chunk `chunk_index` (an empty chunk: the group it pads).
  int chunk_group(int64_t chunk_index) const;

  // Places every tensor in chunks of `chunk_elems` elements. Throws c10::Error naming the tensor,
  // its size and the smallest chunk size that would work when a tensor does not fit.
  void finalize(int64_t chunk_elems);
  // Chooses the chunk size in {min_elems, min_elems + step_elems, ..., <= max_elems} with the
  // least waste, then places the tensors with it. Throws c10::Error when no candidate holds the
  // largest tensor.
  void finalize_search(int64_t min_elems, int64_t max_elems, int64_t step_elems);

  // First-fit packing of `numels` (in order; `groups[i]` is numels[i]'s group, empty: all in
  // group 0) into chunks of `chunk_elems`, without placing anything, as finalize() would place
  // them. `chunk_elems` must be >= every numel.
  static PackingResult pack(std::span<const int64_t> numels, int64_t chunk_elems,
                            int64_t world_size = 1, std::span<const int> groups = {});
  // The search finalize_search() runs.
  static PackingResult search_chunk_size(std::span<const int64_t> numels, int64_t min_elems,
                                         int64_t max_elems, int64_t step_elems,
                                         int64_t world_size = 1,
                                         std::span<const int> groups = {});
  // A group's last chunk is cut to a multiple of this many elements (with one process).
  static constexpr int64_t kTailRoundElems = 1024;
  // The capacity of a last chunk holding `used_elems`: at most chunk_elems.
  static int64_t tail_capacity(int64_t used_elems, int64_t chunk_elems);

  bool finalized() const { return chunk_elems_ > 0; }
  int64_t world_size() const { return world_size_; }
  int64_t tensor_count() const { return static_cast<int64_t>(numels_.size()); }
  int64_t total_numel() const { return total_numel_; }
  int64_t max_numel() const { return max_numel_; }

  // Registration data (valid before and after finalize()).
  const std::string& name(TensorId id) const;
  c10::IntArrayRef sizes(TensorId id) const;
  int64_t numel(TensorId id) const;

  // Placement (only after finalize()).
  int64_t chunk_elems() const { return chunk_elems_; }
  int64_t chunk_count() const { return chunk_count_; }
  // Elements chunk `chunk_index` holds room for: chunk_elems(), or less for a group's last chunk
  // with one process (see above). Every kind's chunk of this index has this many elements.
  int64_t chunk_capacity(int64_t chunk_index) const;
  const TensorPlacement& placement(TensorId id) const;
  // Tensors of a chunk, in increasing offset.
  std::span<const TensorId> tensors_in_chunk(int64_t chunk_index) const;
  int64_t used_elems(int64_t chunk_index) const;

  int64_t waste_elems() const;
  int64_t waste_bytes(at::ScalarType dtype) const {
    return waste_elems() * chunk_element_bytes(dtype);
  }
  // Waste as a fraction of all chunk capacity (0 when there are no chunks).
  double waste_fraction() const;
  // One line: tensors, chunk size and count, waste in elements, bytes (for `dtype`) and percent.
  std::string summary(at::ScalarType dtype = at::kHalf) const;

  // Multi-GPU bookkeeping (no collectives here).
  int64_t comm_group(int64_t chunk_index) const { return chunk_index / world_size_; }
  int64_t owner_rank(int64_t chunk_index) const { return chunk_index % world_size_; }

 private:
  void check_tensor(TensorId id) const;
  void check_chunk(int64_t chunk_index) const;
  void place(int64_t chunk_elems);

  int64_t world_size_;
  std::vector<std::string> names_;
  std::vector<int64_t> numels_;
  std::vector<int> groups_;
  std::vector<int> chunk_groups_;
  std::vector<int64_t> size_offsets_;  // sizes of tensor i: sizes_[size_offsets_[i], [i+1])
  std::vector<int64_t> sizes_;
  int64_t total_numel_ = 0;
  int64_t max_numel_ = 0;
  TensorId max_tensor_ = -1;

  int64_t chunk_elems_ = 0;
  int64_t chunk_count_ = 0;
  std::vector<TensorPlacement> placements_;
  std::vector<int64_t> chunk_used_elems_;
  std::vector<int64_t> chunk_capacity_;
  int64_t capacity_total_ = 0;
  std::vector<int64_t>
      chunk_tensor_offsets_;  // CSR: tensors of chunk c in chunk_tensors_[o[c], o[c+1])
  std::vector<TensorId> chunk_tensors_;
};

}  // namespace patrickstar
