// Tensor states of the chunk store and their explicit transition table (docs/design.md sections 2
// and 4). Pure functions over an enum: thread-safe. The per-tensor state itself is kept by
// ChunkStore.
//
// Legal transitions (everything else, self-transitions included, is an error):
//   FREE             -> HOLD                                  (the chunk got a payload)
//   HOLD             -> COMPUTE, FREE
//   COMPUTE          -> HOLD, HOLD_AFTER_FWD, HOLD_AFTER_BWD  (leaving an operator)
//   HOLD_AFTER_FWD   -> COMPUTE, HOLD, FREE                   (backward access; eval; ZeRO-3 drop)
//   HOLD_AFTER_BWD   -> COMPUTE, HOLD, READY_FOR_REDUCE, FREE (accumulation; step; reduce; drop)
//   READY_FOR_REDUCE -> HOLD, FREE                            (reduced / stepped; dropped)
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

namespace patrickstar {

enum class TensorState : uint8_t {
  kFree,            // data not needed; its chunk may be released
  kCompute,         // in use by an operator: its chunk never moves and is never released
  kHold,            // data needed later, chunk may move
  kHoldAfterFwd,    // used by the forward pass, waiting for backward
  kHoldAfterBwd,    // gradient final (written over the param slot)
  kReadyForReduce,  // every tensor of the chunk is done: the chunk can be reduced
};
inline constexpr int kTensorStateCount = 6;

// "FREE", "COMPUTE", "HOLD", "HOLD_AFTER_FWD", "HOLD_AFTER_BWD", "READY_FOR_REDUCE".
std::string_view to_string(TensorState state);

// True when `from -> to` is in the table above.
bool is_legal_transition(TensorState from, TensorState to);

// Number of tensors of one chunk in each state, indexed by static_cast<int>(TensorState).
struct ChunkStateCounts {
  std::array<int64_t, kTensorStateCount> counts{};

  int64_t operator[](TensorState state) const { return counts[static_cast<int>(state)]; }
  int64_t total() const;
  // True when every tensor of the chunk is in `state` (also true for a chunk without tensors).
  bool all(TensorState state) const { return (*this)[state] == total(); }
};

}  // namespace patrickstar
