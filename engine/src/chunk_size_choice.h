// Private to engine/src: the chunk size "auto" keeps once the warm-up has measured the model. The
// registration's search picks the size with the least waste; it cannot know what the model's
// activations leave of the device, nor which modules the doors open over. The warm-up measures
// both: each moment's non-model bytes and the tensors whose chunks it brought to the device. When
// one of its moments needed more than the chunk budget, choose_chunk_size() looks among the
// smaller sizes for the one with the least waste whose every moment fits the budget that moment
// had, by packing each size and adding up the chunks each moment would bring (docs/design.md,
// "Chunk size").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "patrickstar/chunk/layout.h"

namespace patrickstar::engine_detail {

// One moment of the warm-up as the choice sees it.
struct MomentNeed {
  std::string label;              // "pre_backward 'wte'" (for messages)
  std::string module;             // the module's label, as the trace's moment has it
  std::vector<TensorId> tensors;  // whose param chunks it brings to the device
  bool with_grads = false;        // and their gradient chunks (trainable tensors only)
  int64_t budget_bytes = 0;       // chunk bytes the device had for it next to the non-model bytes
};

// What a chunk index costs on the device, per element: the param kind (half or fp32) and, with a
// gradient space, the gradient kind (0 without). Layout groups with bit 0 set (a CPU embedding's)
// never come to the device; `trainable` says, per tensor, which ones bring a gradient chunk.
struct DeviceCosts {
  int64_t param_elem_bytes = 0;
  int64_t grad_elem_bytes = 0;
  std::vector<bool> trainable;
};

// The device bytes of the chunks `need` brings under `layout` (finalized): each chunk index its
// tensors are in counts once per kind.
int64_t moment_chunk_bytes(const Layout& layout, const MomentNeed& need, const DeviceCosts& costs);

// The sizes "auto" searches for a model whose largest tensor has `max_numel` elements: from that
// (rounded up to 1024) to twice it, in about 256 steps of a multiple of 1024 (least waste among
// sizes that keep the chunks many).
struct SizeGrid {
  int64_t min_elems = 0;
  int64_t max_elems = 0;
  int64_t step_elems = 0;
};
SizeGrid auto_size_grid(int64_t max_numel);

struct SizeChoice {
  int64_t chunk_elems = 0;  // 0: no size below the limit fits every moment
  int64_t waste_elems = 0;
  // When none fits: the moment that needs the most above its budget at the smallest size.
  std::string tightest;
};

// Among the grid's sizes below `below_elems`, the one with the least waste (the smaller on a tie)
// whose every moment's chunks fit its budget. `base` holds the registered tensors, not finalized.
SizeChoice choose_chunk_size(const Layout& base, const SizeGrid& grid, int64_t below_elems,
                             const std::vector<MomentNeed>& moments, const DeviceCosts& costs);

}  // namespace patrickstar::engine_detail
