#include "patrickstar/chunk/layout.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <sstream>

namespace patrickstar {

namespace {

// First-fit over chunks of equal size: a max segment tree of the free room of every chunk, so the
// lowest-numbered chunk with room for `numel` is found in O(log chunks). Chunks not yet opened have
// full room and come after every open one, so "open a new chunk" is the same query.
class FirstFitTree {
 public:
  FirstFitTree(int64_t max_chunks, int64_t chunk_elems) : chunk_elems_(chunk_elems) {
    while (leaves_ < max_chunks) leaves_ *= 2;
    room_.assign(static_cast<size_t>(2 * leaves_), chunk_elems);
  }

  // Places `numel` (<= chunk_elems) and returns {chunk index, offset in elements}.
  std::pair<int64_t, int64_t> place(int64_t numel) {
    int64_t node = 1;
    while (node < leaves_) {
      node = room_[static_cast<size_t>(2 * node)] >= numel ? 2 * node : 2 * node + 1;
    }
    const int64_t chunk = node - leaves_;
    const int64_t offset = chunk_elems_ - room_[static_cast<size_t>(node)];
    room_[static_cast<size_t>(node)] -= numel;
    for (node /= 2; node >= 1; node /= 2) {
      room_[static_cast<size_t>(node)] =
          std::max(room_[static_cast<size_t>(2 * node)], room_[static_cast<size_t>(2 * node + 1)]);
    }
    chunk_count_ = std::max(chunk_count_, chunk + 1);
    return {chunk, offset};
  }

  int64_t chunk_count() const { return chunk_count_; }
  // Elements placed in chunk `chunk` so far (0 for a chunk not opened).
  int64_t used(int64_t chunk) const {
    return chunk_elems_ - room_[static_cast<size_t>(leaves_ + chunk)];
  }

 private:
  int64_t chunk_elems_;
  int64_t leaves_ = 1;
  int64_t chunk_count_ = 0;
  std::vector<int64_t> room_;
};

int64_t round_up_to(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

std::string shape_string(c10::IntArrayRef sizes) {
  std::ostringstream out;
  out << sizes;
  return out.str();
}

// One tensor group packed first-fit: its chunk count (rounded up to world_size, so no comm group
// mixes two groups), the capacity of its last chunk (cut to what it holds with one process) and
// of all its chunks, and the elements it holds.
struct GroupPacking {
  int64_t chunk_count = 0;
  int64_t last_capacity = 0;
  int64_t capacity = 0;
  int64_t used = 0;
};

// First fit of the tensors of `group` (every tensor when `groups` is empty), in order, into chunks
// of `chunk_elems`; on_place(i, chunk, offset) sees where numels[i] goes. pack() and place() both
// run it, so the search's waste is the placement's.
template <typename OnPlace>
GroupPacking pack_group(std::span<const int64_t> numels, std::span<const int> groups, int group,
                        int64_t chunk_elems, int64_t world_size, OnPlace&& on_place) {
  FirstFitTree tree(std::max<int64_t>(1, static_cast<int64_t>(numels.size())), chunk_elems);
  GroupPacking g;
  for (size_t i = 0; i < numels.size(); ++i) {
    if (!groups.empty() && groups[i] != group) continue;
    const int64_t n = numels[i];
    TORCH_CHECK(n <= chunk_elems, "Layout::pack: a tensor of ", n,
                " elements does not fit a chunk of ", chunk_elems);
    const auto [chunk, offset] = tree.place(n);
    on_place(i, chunk, offset);
    g.used += n;
  }
  g.chunk_count = round_up_to(tree.chunk_count(), world_size);
  g.last_capacity = chunk_elems;
  if (world_size == 1 && g.chunk_count > 0) {
    // Sharded chunks keep one size (a collective moves equal slots); one process cuts the last.
    g.last_capacity = Layout::tail_capacity(tree.used(g.chunk_count - 1), chunk_elems);
  }
  g.capacity = g.chunk_count * chunk_elems;
  if (g.chunk_count > 0) g.capacity += g.last_capacity - chunk_elems;
  return g;
}

}  // namespace

Layout::Layout(int64_t world_size) : world_size_(world_size) {
  TORCH_CHECK(world_size >= 1, "Layout: world_size must be >= 1, got ", world_size);
  size_offsets_.push_back(0);
}

TensorId Layout::add_tensor(std::string_view name, c10::IntArrayRef sizes, int group) {
  TORCH_CHECK(!finalized(), "Layout: cannot add tensor '", name,
              "' after finalize(); register every tensor first");
  TORCH_CHECK(group >= 0, "Layout: tensor '", name, "' has a negative group ", group);
  int64_t numel = 1;
  for (int64_t s : sizes) {
    TORCH_CHECK(s >= 0, "Layout: tensor '", name, "' has a negative size in ", sizes);
    TORCH_CHECK(s == 0 || numel <= std::numeric_limits<int64_t>::max() / s, "Layout: tensor '",
                name, "' of shape ", sizes, " has too many elements");
    numel *= s;
  }
  const TensorId id = tensor_count();
  names_.emplace_back(name);
  numels_.push_back(numel);
  groups_.push_back(group);
  sizes_.insert(sizes_.end(), sizes.begin(), sizes.end());
  size_offsets_.push_back(static_cast<int64_t>(sizes_.size()));
  total_numel_ += numel;
  if (max_tensor_ < 0 || numel > max_numel_) {
    max_numel_ = numel;
    max_tensor_ = id;
  }
  return id;
}

int64_t Layout::tail_capacity(int64_t used_elems, int64_t chunk_elems) {
  return std::min(chunk_elems, round_up_to(std::max<int64_t>(1, used_elems), kTailRoundElems));
}

PackingResult Layout::pack(std::span<const int64_t> numels, int64_t chunk_elems,
                           int64_t world_size, std::span<const int> groups) {
  TORCH_CHECK(chunk_elems > 0, "Layout: chunk size must be positive, got ", chunk_elems);
  TORCH_CHECK(world_size >= 1, "Layout: world_size must be >= 1, got ", world_size);
  TORCH_CHECK(groups.empty() || groups.size() == numels.size(), "Layout::pack: ", groups.size(),
              " groups for ", numels.size(), " tensors");
  int last_group = 0;
  for (int g : groups) {
    TORCH_CHECK(g >= 0, "Layout::pack: negative group ", g);
    last_group = std::max(last_group, g);
  }
  PackingResult result;
  result.chunk_elems = chunk_elems;
  for (int group = 0; group <= last_group; ++group) {
    const GroupPacking g = pack_group(numels, groups, group, chunk_elems, world_size,
                                      [](size_t, int64_t, int64_t) {});
    result.chunk_count += g.chunk_count;
    result.waste_elems += g.capacity - g.used;
  }
  return result;
}

PackingResult Layout::search_chunk_size(std::span<const int64_t> numels, int64_t min_elems,
                                        int64_t max_elems, int64_t step_elems, int64_t world_size,
                                        std::span<const int> groups) {
  TORCH_CHECK(min_elems > 0 && max_elems >= min_elems && step_elems > 0,
              "Layout: chunk size search needs 0 < min_elems <= max_elems and step_elems > 0, got "
              "min ",
              min_elems, ", max ", max_elems, ", step ", step_elems);
  int64_t largest = 0;
  for (int64_t n : numels) largest = std::max(largest, n);
  int64_t first = min_elems;
  if (first < largest) first += round_up_to(largest - first, step_elems);
  TORCH_CHECK(first <= max_elems, "Layout: no chunk size in [", min_elems, ", ", max_elems,
              "] (step ", step_elems, ") holds the largest tensor of ", largest,
              " elements; raise the search maximum to at least ", first);
  int64_t total = 0;
  for (int64_t n : numels) total += n;
  PackingResult best;
  for (int64_t size = first; size <= max_elems; size += step_elems) {
    // Sharded chunks are all full: no packing needs fewer than ceil(total / size) of them (groups
    // only add chunks), so when even that bound cannot beat the best so far (ties keep the smaller
    // size), skip the packing. One process cuts its last chunks: there the bound is 0.
    const int64_t min_chunks =
        round_up_to(std::max<int64_t>(1, (total + size - 1) / size), world_size);
    const int64_t bound = world_size > 1 ? min_chunks * size - total : 0;
    const bool may_win = best.chunk_elems == 0 || bound < best.waste_elems;
    if (may_win) {
      const PackingResult r = pack(numels, size, world_size, groups);
      if (best.chunk_elems == 0 || r.waste_elems < best.waste_elems) best = r;
    }
    if (size > max_elems - step_elems) break;  // no overflow past max_elems
  }
  return best;
}

void Layout::finalize(int64_t chunk_elems) {
  TORCH_CHECK(!finalized(), "Layout: finalize() called twice");
  TORCH_CHECK(chunk_elems > 0, "Layout: chunk size must be positive, got ", chunk_elems);
  if (max_numel_ > chunk_elems) {
    // Name the first tensor that does not fit; the smallest working size is the largest tensor.
    TensorId first_too_big = 0;
    while (numels_[static_cast<size_t>(first_too_big)] <= chunk_elems) ++first_too_big;
    TORCH_CHECK(false, "Layout: tensor '", names_[static_cast<size_t>(first_too_big)], "' (id ",
                first_too_big, ", shape ", shape_string(sizes(first_too_big)), ") has ",
                numels_[static_cast<size_t>(first_too_big)], " elements but a chunk holds ",
                chunk_elems, "; the smallest chunk size that holds every tensor is ", max_numel_,
                " elements (tensor '", names_[static_cast<size_t>(max_tensor_)],
                "'): raise default_chunk_size to at least that, or search the chunk size");
  }
  place(chunk_elems);
}

void Layout::finalize_search(int64_t min_elems, int64_t max_elems, int64_t step_elems) {
  TORCH_CHECK(!finalized(), "Layout: finalize_search() called after finalize");
  if (max_numel_ > max_elems) {
    TORCH_CHECK(false, "Layout: tensor '", names_[static_cast<size_t>(max_tensor_)], "' (id ",
                max_tensor_, ", shape ", shape_string(sizes(max_tensor_)), ") has ", max_numel_,
                " elements, more than the largest searched chunk size ", max_elems,
                "; raise the search maximum to at least ", max_numel_);
  }
  const PackingResult best =
      search_chunk_size(numels_, min_elems, max_elems, step_elems, world_size_, groups_);
  place(best.chunk_elems);
}

void Layout::place(int64_t chunk_elems) {
  const int64_t n = tensor_count();
  placements_.resize(static_cast<size_t>(n));
  chunk_groups_.clear();
  const int last_group = n == 0 ? 0 : *std::max_element(groups_.begin(), groups_.end());
  chunk_capacity_.clear();
  capacity_total_ = 0;
  int64_t first_chunk = 0;  // of the group being packed
  for (int group = 0; group <= last_group; ++group) {
    const GroupPacking g =
        pack_group(numels_, groups_, group, chunk_elems, world_size_,
                   [&](size_t i, int64_t chunk, int64_t offset) {
                     placements_[i] = TensorPlacement{first_chunk + chunk, offset, numels_[i]};
                   });
    first_chunk += g.chunk_count;
    chunk_groups_.resize(static_cast<size_t>(first_chunk), group);
    chunk_capacity_.resize(static_cast<size_t>(first_chunk), chunk_elems);
    if (g.chunk_count > 0) chunk_capacity_.back() = g.last_capacity;
    capacity_total_ += g.capacity;
  }
  chunk_elems_ = chunk_elems;
  chunk_count_ = first_chunk;  // every group's count is a multiple of world_size

  // Per-chunk tensor lists (CSR). Within a chunk, registration order is offset order.
  chunk_used_elems_.assign(static_cast<size_t>(chunk_count_), 0);
  chunk_tensor_offsets_.assign(static_cast<size_t>(chunk_count_ + 1), 0);
  for (const TensorPlacement& p : placements_) {
    chunk_used_elems_[static_cast<size_t>(p.chunk_index)] += p.numel;
    ++chunk_tensor_offsets_[static_cast<size_t>(p.chunk_index + 1)];
  }
  for (int64_t c = 0; c < chunk_count_; ++c) {
    chunk_tensor_offsets_[static_cast<size_t>(c + 1)] +=
        chunk_tensor_offsets_[static_cast<size_t>(c)];
  }
  chunk_tensors_.resize(static_cast<size_t>(n));
  std::vector<int64_t> next(chunk_tensor_offsets_.begin(), chunk_tensor_offsets_.end() - 1);
  for (TensorId id = 0; id < n; ++id) {
    const int64_t c = placements_[static_cast<size_t>(id)].chunk_index;
    chunk_tensors_[static_cast<size_t>(next[static_cast<size_t>(c)]++)] = id;
  }
}

int64_t Layout::chunk_capacity(int64_t chunk_index) const {
  check_chunk(chunk_index);
  return chunk_capacity_[static_cast<size_t>(chunk_index)];
}

int Layout::chunk_group(int64_t chunk_index) const {
  check_chunk(chunk_index);
  return chunk_groups_[static_cast<size_t>(chunk_index)];
}

void Layout::check_tensor(TensorId id) const {
  TORCH_CHECK(id >= 0 && id < tensor_count(), "Layout: tensor id ", id, " out of range [0, ",
              tensor_count(), ")");
}

void Layout::check_chunk(int64_t chunk_index) const {
  TORCH_CHECK(finalized(), "Layout: not finalized yet; call finalize() or finalize_search()");
  TORCH_CHECK(chunk_index >= 0 && chunk_index < chunk_count_, "Layout: chunk index ", chunk_index,
              " out of range [0, ", chunk_count_, ")");
}

const std::string& Layout::name(TensorId id) const {
  check_tensor(id);
  return names_[static_cast<size_t>(id)];
}

c10::IntArrayRef Layout::sizes(TensorId id) const {
  check_tensor(id);
  const auto begin = size_offsets_[static_cast<size_t>(id)];
  const auto end = size_offsets_[static_cast<size_t>(id + 1)];
  return c10::IntArrayRef(sizes_.data() + begin, static_cast<size_t>(end - begin));
}

int64_t Layout::numel(TensorId id) const {
  check_tensor(id);
  return numels_[static_cast<size_t>(id)];
}

const TensorPlacement& Layout::placement(TensorId id) const {
  check_tensor(id);
  TORCH_CHECK(finalized(), "Layout: placement of tensor '", names_[static_cast<size_t>(id)],
              "' asked before finalize()");
  return placements_[static_cast<size_t>(id)];
}

std::span<const TensorId> Layout::tensors_in_chunk(int64_t chunk_index) const {
  check_chunk(chunk_index);
  const auto begin = chunk_tensor_offsets_[static_cast<size_t>(chunk_index)];
  const auto end = chunk_tensor_offsets_[static_cast<size_t>(chunk_index + 1)];
  return std::span<const TensorId>(chunk_tensors_.data() + begin, static_cast<size_t>(end - begin));
}

int64_t Layout::used_elems(int64_t chunk_index) const {
  check_chunk(chunk_index);
  return chunk_used_elems_[static_cast<size_t>(chunk_index)];
}

int64_t Layout::waste_elems() const {
  TORCH_CHECK(finalized(), "Layout: waste asked before finalize()");
  return capacity_total_ - total_numel_;
}

double Layout::waste_fraction() const {
  return capacity_total_ == 0
             ? 0.0
             : static_cast<double>(waste_elems()) / static_cast<double>(capacity_total_);
}

std::string Layout::summary(at::ScalarType dtype) const {
  std::ostringstream out;
  out << tensor_count() << " tensors, " << total_numel_ << " elements";
  if (!finalized()) {
    out << " (not placed yet)";
    return out.str();
  }
  out << " in " << chunk_count_ << " chunks of " << chunk_elems_ << " elements";
  if (chunk_count_ > 0 && capacity_total_ != chunk_count_ * chunk_elems_) {
    out << " (" << capacity_total_ << " in all: last chunks cut to what they hold)";
  }
  out << "; waste "
      << waste_elems() << " elements = " << waste_bytes(dtype) << " bytes as " << dtype << " ("
      << waste_fraction() * 100.0 << "%)";
  return out.str();
}

}  // namespace patrickstar
