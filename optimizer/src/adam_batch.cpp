// AdamBatch's table and the host reference of the batched device kernels (adam_batch.h): the same
// tiles, groups and order of additions as adam_cuda.cu, on one thread.
#include "patrickstar/optimizer/adam_batch.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cstdint>

namespace patrickstar {

namespace {

bool aligned16(const void* p) {
  return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// The elements [begin, end) of tile `tile` of `entry`.
struct TileRange {
  int64_t begin;
  int64_t end;
};
TileRange range_of(const AdamBatchEntry& entry, int64_t tile) {
  const int64_t begin = (tile - entry.first_tile) * kAdamTileElems;
  return {begin, std::min(begin + kAdamTileElems, entry.numel)};
}

constexpr int64_t kGroupsPerThread = kAdamTileElems / (kAdamGroupElems * kAdamBatchThreads);
static_assert(kGroupsPerThread * kAdamGroupElems * kAdamBatchThreads == kAdamTileElems);

// Calls visit(thread, element) for every element of the tile, in each thread's order.
template <typename Visit>
void for_each_in_tile(const TileRange& range, Visit visit) {
  for (int32_t thread = 0; thread < kAdamBatchThreads; ++thread) {
    for (int64_t k = 0; k < kGroupsPerThread; ++k) {
      const int64_t group = thread + int64_t{kAdamBatchThreads} * k;
      const int64_t first = range.begin + group * kAdamGroupElems;
      for (int64_t i = first; i < std::min(first + kAdamGroupElems, range.end); ++i) {
        visit(thread, i);
      }
    }
  }
}

// The kernels' shared-memory tree: slot t gets slot t + s for s = n/2, n/4, ..., 1.
template <size_t N>
double tree_sum(std::array<double, N>& slots) {
  for (size_t s = N / 2; s > 0; s /= 2) {
    for (size_t t = 0; t < s; ++t) slots[t] += slots[t + s];
  }
  return slots[0];
}

template <typename S>
void update_entry_on_host(const AdamBatch& batch, const AdamBatchEntry& entry) {
  const AdamStepConstants& c = batch.constants()[static_cast<size_t>(entry.constants)];
  auto* m = static_cast<S*>(entry.exp_avg);
  auto* v = static_cast<S*>(entry.exp_avg_sq);
  for (int64_t i = 0; i < entry.numel; ++i) {
    uint16_t unused = 0;
    uint16_t& half = entry.half != nullptr ? entry.half[i] : unused;
    const float grad32 = entry.grad != nullptr ? entry.grad[i] : 0.0f;
    adam_batch_update(batch.kind(), batch.bf16_half(), entry.master[i], m[i], v[i], half, grad32,
                      c);
  }
}

}  // namespace

void AdamBatch::add(const AdamBatchEntry& entry, int64_t step, int32_t group) {
  TORCH_CHECK(entry.numel >= 0, "AdamBatch: an entry has ", entry.numel, " elements");
  if (entry.numel == 0) return;
  const bool needs_half = kind_ != AdamBatchKind::kFp32;
  const bool needs_grad = kind_ != AdamBatchKind::kMixed;
  TORCH_CHECK(entry.master != nullptr && entry.exp_avg != nullptr && entry.exp_avg_sq != nullptr &&
                  (entry.half != nullptr) == needs_half && (entry.grad != nullptr) == needs_grad,
              "AdamBatch: entry ", entries_.size(), " lacks a pointer its kind needs, or has one ",
              "it does not (kind ", static_cast<int>(kind_), ")");
  TORCH_CHECK(step >= 1, "AdamBatch: entry ", entries_.size(), " at step ", step,
              "; steps count from 1");
  TORCH_CHECK(entries_.size() < static_cast<size_t>(INT32_MAX), "AdamBatch: too many entries");
  AdamBatchEntry added = entry;
  added.first_tile = tiles_;
  TORCH_CHECK(group >= 0, "AdamBatch: entry ", entries_.size(), " of group ", group);
  const std::pair<int64_t, int32_t> key{step, group};
  const auto found = std::find(keys_.begin(), keys_.end(), key);
  added.constants = static_cast<int32_t>(found - keys_.begin());
  if (found == keys_.end()) keys_.push_back(key);
  added.vector = aligned16(entry.half) && aligned16(entry.master) && aligned16(entry.grad) &&
                         aligned16(entry.exp_avg) && aligned16(entry.exp_avg_sq)
                     ? 1
                     : 0;
  entries_.push_back(added);
  tiles_ += (entry.numel + kAdamTileElems - 1) / kAdamTileElems;
  elements_ += entry.numel;
}

void run_adam_batch_on_host(const AdamBatch& batch) {
  TORCH_CHECK(batch.constants().size() == batch.keys().size(),
              "run_adam_batch_on_host: the batch's constants are not set");
  // Every element is updated once and alone: the order of tiles does not change the result.
  for (const AdamBatchEntry& entry : batch.entries()) {
    if (batch.bf16_states()) {
      update_entry_on_host<uint16_t>(batch, entry);
    } else {
      update_entry_on_host<float>(batch, entry);
    }
  }
}

double sum_squares_on_host(const AdamBatch& batch) {
  const std::vector<AdamBatchEntry>& entries = batch.entries();
  std::vector<double> partials(static_cast<size_t>(batch.tiles()), 0.0);
  for (int64_t tile = 0; tile < batch.tiles(); ++tile) {
    const AdamBatchEntry& entry = entries[static_cast<size_t>(
        adam_entry_of_tile(entries.data(), static_cast<int32_t>(entries.size()), tile))];
    std::array<double, kAdamBatchThreads> threads{};
    for_each_in_tile(range_of(entry, tile), [&](int32_t thread, int64_t i) {
      const uint16_t half = entry.half != nullptr ? entry.half[i] : 0;
      const float grad32 = entry.grad != nullptr ? entry.grad[i] : 0.0f;
      threads[static_cast<size_t>(thread)] +=
          grad_square(batch.kind(), batch.bf16_half(), half, grad32);
    });
    partials[static_cast<size_t>(tile)] = tree_sum(threads);
  }
  std::array<double, kAdamNormThreads> threads{};
  for (size_t t = 0; t < threads.size(); ++t) {
    for (size_t i = t; i < partials.size(); i += threads.size()) threads[t] += partials[i];
  }
  return tree_sum(threads);
}

}  // namespace patrickstar
