// "default_chunk_size": "auto"'s retry (chunk_size_retry.h).
#include "chunk_size_retry.h"

#include <algorithm>
#include <utility>

namespace patrickstar::engine_detail {

Layout ChunkSizeRetry::layout(int64_t chunk_elems) const {
  Layout layout = base_;
  layout.finalize(chunk_elems);
  return layout;
}

int64_t ChunkSizeRetry::move_bytes(int64_t chunk_elems, const ChunkStore& store) const {
  const Layout moved = layout(chunk_elems);
  int64_t largest_kind = 0;
  for (const ChunkKindSpec& spec : store.kinds()) {
    largest_kind = std::max(largest_kind, (moved.total_numel() + moved.waste_elems()) *
                                              chunk_element_bytes(spec.dtype));
  }
  return largest_kind;
}

void ChunkSizeRetry::note_need(int64_t moment, MomentNeed need) {
  if (!armed_) return;
  if (static_cast<size_t>(moment) >= needs_.size()) needs_.resize(static_cast<size_t>(moment) + 1);
  needs_[static_cast<size_t>(moment)] = std::move(need);
}

int64_t ChunkSizeRetry::take_chosen(std::string* reason) {
  const int64_t chosen = chosen_;
  if (reason != nullptr) *reason = std::move(reason_);
  chosen_ = 0;
  reason_.clear();
  needs_.clear();
  return chosen;
}

void ChunkSizeRetry::choose(const Trace& trace, const c10::Error& why, int64_t usable_device_bytes,
                            const ChunkStore& store, const DeviceCosts& costs,
                            const MemoryTier& host) {
  chosen_ = 0;
  TORCH_INTERNAL_ASSERT(armed_, "choose_retry_chunk_size without the retry armed");
  // Every door moment of this warm-up with the budget the trace gives it: the device's usable
  // bytes less the larger of its interval's non-model peak and the next one's, as check_trace
  // counts them. Step moments bring no chunk to the device in a warm-up (every Adam runs on the
  // host there).
  std::vector<MomentNeed> needs;
  for (int64_t m = 0; m < trace.size() && m < static_cast<int64_t>(needs_.size()); ++m) {
    const Moment& moment = trace.moments[static_cast<size_t>(m)];
    MomentNeed need = needs_[static_cast<size_t>(m)];
    // (An entry of a forward that was forgotten, whose index a later moment took: not this one.)
    if (moment.kind == MomentKind::kStep || need.module != moment.label) continue;
    need.budget_bytes =
        usable_device_bytes - std::max(moment.non_model_bytes, trace.next_non_model_bytes(m));
    needs.push_back(std::move(need));
  }
  const SizeChoice choice = choose_chunk_size(base_, auto_size_grid(base_.max_numel()),
                                              store.chunk_elems(), needs, costs);
  const std::string reason = why.what_without_backtrace();
  TORCH_CHECK(choice.chunk_elems > 0,
              "patrickstar: \"default_chunk_size\": \"auto\" chose chunks of ", store.chunk_elems(),
              " elements (the least waste) and the warm-up's trace does "
              "not fit the device: ",
              reason, "; and no smaller chunk size fits every moment: ", choice.tightest, " bytes");
  // The move allocates one chunk kind next to the model data at a time: it must fit the host.
  if (host.capacity_bytes() != MemoryTier::kUnlimited) {
    const int64_t largest_kind = move_bytes(choice.chunk_elems, store);
    TORCH_CHECK(
        move_fits(choice.chunk_elems, store, host),
        "patrickstar: \"default_chunk_size\": \"auto\" chose chunks of ", store.chunk_elems(),
        " elements and the warm-up's trace does not fit the "
        "device: ",
        reason, "; chunks of ", choice.chunk_elems,
        " elements would fit, but moving the model into them needs ", largest_kind,
        " bytes of host memory beyond the ", host.used_bytes(),
        " in use and the host "
        "budget is ",
        host.capacity_bytes(), " bytes: set \"default_chunk_size\" to ", choice.chunk_elems);
  }
  chosen_ = choice.chunk_elems;
  reason_ = reason;
}

}  // namespace patrickstar::engine_detail
