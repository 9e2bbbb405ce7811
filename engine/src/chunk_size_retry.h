// Private to engine/src: "default_chunk_size": "auto"'s retry (docs/design.md, "Chunk size"). The
// engine packs the registered tensors with the least-waste size; when the warm-up's trace does not
// fit the device with it, this picks the least-waste smaller size with which every moment of the
// warm-up fits, for the engine to move the model into after the step.
//
// Invariants:
// - Armed only where moving the model between layouts is simple (one process, no disk tier, no
//   delayed update, no states on the device for good, not the static policy): registration
//   decides, and nothing else changes it.
// - A size is chosen only when the model's move into it fits the host budget; otherwise choose()
//   throws and nothing is chosen. chosen() is 0 once the engine took it (take_chosen()).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "patrickstar/chunk/chunk_store.h"
#include "patrickstar/chunk/layout.h"
#include "patrickstar/chunk/memory_tier.h"
#include "patrickstar/memtracer/trace.h"

#include "chunk_size_choice.h"

namespace patrickstar::engine_detail {

class ChunkSizeRetry {
 public:
  // Registration, one process: the registered tensors not placed yet (every size packs from it).
  void keep_base(Layout base) { base_ = std::move(base); }
  void arm(bool armed) { armed_ = armed; }
  bool armed() const { return armed_; }
  // `base()` packed with chunks of `chunk_elems`.
  Layout layout(int64_t chunk_elems) const;
  const Layout& base() const { return base_; }

  // A warm-up moment: what it needs on the device (kept while armed).
  void note_need(int64_t moment, MomentNeed need);
  // The warm-up's needs by moment (until the engine moves the model: take_chosen).
  const std::vector<MomentNeed>& needs() const { return needs_; }
  // The warm-up's trace does not fit the device (`why`, check_trace's error) with the chunks of
  // `store`: chooses the least-waste smaller size with which every moment of `trace` fits within
  // `usable_device_bytes`; throws when there is none or the move would not fit `host`.
  void choose(const Trace& trace, const c10::Error& why, int64_t usable_device_bytes,
              const ChunkStore& store, const DeviceCosts& costs, const MemoryTier& host);
  // The bytes moving the model from `store` into chunks of `chunk_elems` needs on the host beyond
  // what it uses (one kind of the new chunks at a time), and whether `host` has them.
  int64_t move_bytes(int64_t chunk_elems, const ChunkStore& store) const;
  bool move_fits(int64_t chunk_elems, const ChunkStore& store, const MemoryTier& host) const {
    return host.capacity_bytes() == MemoryTier::kUnlimited ||
           host.used_bytes() + move_bytes(chunk_elems, store) <= host.capacity_bytes();
  }
  int64_t chosen() const { return chosen_; }
  // The step that chose failed: nothing moves.
  void drop_chosen() { chosen_ = 0; }
  // The engine moves the model: the size, and why (for its warning); the warm-up's needs go.
  int64_t take_chosen(std::string* reason);

 private:
  Layout base_;
  bool armed_ = false;
  std::vector<MomentNeed> needs_;  // the warm-up's moments as the choice sees them
  int64_t chosen_ = 0;
  std::string reason_;
};

}  // namespace patrickstar::engine_detail
