// Host plus device at registration: when the host budget cannot hold the model data, optimizer
// state chunks go to the device for good (docs/design.md, "Host plus device").
#include "engine_core.h"

#include <string>

#include "absl/strings/str_cat.h"

#include "engine_internal.h"

namespace patrickstar {

// The pipeline's AdamPlacement comes sized, nothing kept on the device (register_parameters).
std::string EngineCore::place_states_on_device(int64_t shortfall) {
  const int64_t n = store().chunks_per_kind();
  // Where the states could not go, say why (the caller adds it to the host budget's error).
  if (config_.offload_optimizer.nvme) {
    return "";  // the disk tier's staging figure says it all
  }
  if (!dp_.one_process()) {
    return absl::StrCat("; with ", dp_.world(), " ranks no optimizer state is placed on the device at "
                        "registration (one process only)");
  }
  if (config_.delayed_update.enabled) {
    return "; zero_optimization.delayed_param_update runs every Adam on the host, so every "
           "optimizer state stays there";
  }
  if (config_.scheduler.policy == EvictionPolicy::kStatic) {
    return "; the static policy keeps every optimizer state on the host (the opt and lru policies "
           "place what the host cannot hold on the device)";
  }
  if (!config_.optimizer.use_hybrid_adam) {
    return "; optimizer.params.use_hybrid_adam is false, so every optimizer state stays on the "
           "host (with it, what the host cannot hold goes to the device)";
  }
  // Half the device at most: the rest is the moments' chunks and activations (the warm-up's trace
  // check tells whether they fit next to these).
  const int64_t usable = engine_detail::usable_device_bytes(config_);
  const int64_t cap = usable / 2;
  // A chunk at a time, from the last index down (the backward's first), variance, momentum, then
  // the fp32 master: no more than the host lacks, rounded up to a chunk.
  int64_t placed = 0;
  for (int64_t index = n - 1; index >= 0 && placed < shortfall; --index) {
    if (storage_.host_only()[static_cast<size_t>(index)] || lean(index)) continue;  // none to place
    const std::vector<ChunkKind> kinds = state_kinds();
    for (auto kind = kinds.rbegin(); kind != kinds.rend(); ++kind) {  // variance first
      if (placed >= shortfall) continue;
      const ChunkId id = store().chunk_id(*kind, index);
      pipeline_->placement().keep_state_on_device(id, index);
      placed += store().chunk_bytes(id);
    }
  }
  // Those indices' Adam runs on the device: at the step every kind of theirs is there at once.
  int64_t step_bytes = 0;
  for (int64_t index = 0; index < n; ++index) {
    if (!pipeline_->placement().device_only(index)) continue;
    for (int k = 0; k < kChunkKindCount; ++k) {
      const auto kind = static_cast<ChunkKind>(k);
      if (store().has_kind(kind)) step_bytes += store().chunk_bytes(store().chunk_id(kind, index));
    }
  }
  std::string why;
  if (placed < shortfall) {
    why = absl::StrCat("; every optimizer state on the device (", placed,
                       " bytes) would still leave the host short");
  } else if (placed > cap) {
    why = absl::StrCat("; the host's shortfall of ", shortfall, " bytes takes ", placed,
                       " bytes of optimizer-state chunks, but at most ", cap,
                       " bytes of optimizer states on the device are allowed (half of the device's "
                       "capacity_bytes x overall_gpu_mem_ratio - reserve_bytes)");
  } else if (step_bytes > usable) {
    why = absl::StrCat("; the ", placed, " bytes of optimizer states the host lacks would go to the "
                       "device, but their chunk indices' Adam would then need ", step_bytes,
                       " bytes of chunks on the device at the step (every kind of those indices), "
                       "more than its ", usable, " usable bytes (a smaller chunk size helps)");
  }
  if (!why.empty()) {
    pipeline_->placement().clear_kept();
    return why;
  }
  metrics_.registration().device_state_bytes = placed;
  return "";
}

}  // namespace patrickstar
