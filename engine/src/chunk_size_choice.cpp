#include "chunk_size_choice.h"

#include <algorithm>
#include <utility>

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"

namespace patrickstar::engine_detail {

int64_t moment_chunk_bytes(const Layout& layout, const MomentNeed& need, const DeviceCosts& costs) {
  // (index, is_grad) pairs, each counted once.
  std::vector<std::pair<int64_t, bool>> chunks;
  auto add = [&](int64_t index, bool grad) {
    const std::pair<int64_t, bool> key{index, grad};
    if (std::find(chunks.begin(), chunks.end(), key) == chunks.end()) chunks.push_back(key);
  };
  for (TensorId id : need.tensors) {
    const int64_t index = layout.placement(id).chunk_index;
    if ((layout.chunk_group(index) & 1) != 0) continue;  // a CPU embedding's: on the host
    add(index, false);
    if (need.with_grads && costs.grad_elem_bytes > 0 && costs.trainable[static_cast<size_t>(id)]) {
      add(index, true);
    }
  }
  int64_t bytes = 0;
  for (const auto& [index, grad] : chunks) {
    bytes += layout.chunk_capacity(index) * (grad ? costs.grad_elem_bytes : costs.param_elem_bytes);
  }
  return bytes;
}

SizeGrid auto_size_grid(int64_t max_numel) {
  SizeGrid grid;
  grid.min_elems = std::max<int64_t>(1024, (max_numel + 1023) / 1024 * 1024);
  grid.max_elems = 2 * grid.min_elems;
  grid.step_elems = std::max<int64_t>(1024, (grid.max_elems - grid.min_elems) / 256 / 1024 * 1024);
  return grid;
}

SizeChoice choose_chunk_size(const Layout& base, const SizeGrid& grid, int64_t below_elems,
                             const std::vector<MomentNeed>& moments, const DeviceCosts& costs) {
  TORCH_INTERNAL_ASSERT(!base.finalized(), "choose_chunk_size: the base layout is finalized");
  // Every size of the grid below the limit, least waste first.
  std::vector<std::pair<int64_t, int64_t>> by_waste;  // (waste, size)
  for (int64_t size = grid.min_elems; size <= grid.max_elems && size < below_elems;
       size += grid.step_elems) {
    if (size < base.max_numel()) continue;
    Layout layout = base;
    layout.finalize(size);
    by_waste.emplace_back(layout.waste_elems(), size);
  }
  std::sort(by_waste.begin(), by_waste.end());
  SizeChoice choice;
  int64_t smallest = 0;
  for (const auto& [waste, size] : by_waste) {
    Layout layout = base;
    layout.finalize(size);
    bool fits = true;
    for (const MomentNeed& need : moments) {
      if (moment_chunk_bytes(layout, need, costs) > need.budget_bytes) {
        fits = false;
        break;
      }
    }
    if (fits) {
      choice.chunk_elems = size;
      choice.waste_elems = waste;
      return choice;
    }
    smallest = smallest == 0 ? size : std::min(smallest, size);
  }
  if (smallest > 0) {
    Layout layout = base;
    layout.finalize(smallest);
    int64_t worst_over = -1;
    for (const MomentNeed& need : moments) {
      const int64_t bytes = moment_chunk_bytes(layout, need, costs);
      if (bytes - need.budget_bytes > worst_over) {
        worst_over = bytes - need.budget_bytes;
        choice.tightest = absl::StrCat("at ", need.label, " the chunks of the smallest size, ",
                                       smallest, " elements, need ", bytes,
                                       " bytes but the chunk budget was ", need.budget_bytes);
      }
    }
  } else {
    choice.tightest =
        absl::StrCat("no chunk size between the largest tensor's ", base.max_numel(),
                     " elements and ", below_elems, " is smaller than the one that did not fit");
  }
  return choice;
}

}  // namespace patrickstar::engine_detail
