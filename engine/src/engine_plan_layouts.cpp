// "plan": "auto" over chunk sizes (run_plan.h): the sizes "default_chunk_size": "auto" lets the
// plan consider, and the trace each would run, made from the warm-up's per-moment tensors (what
// the chunk-size retry keeps) and the measured trace's non-model bytes.
#include "engine_core.h"

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include "patrickstar/optimizer/placement.h"

#include "engine_internal.h"

namespace patrickstar {
using namespace engine_detail;  // NOLINT: this folder's private helpers

std::vector<int64_t> EngineCore::plan_chunk_sizes() const {
  // Where the retry may move the model ("auto", one process, no disk tier, no states on the device
  // for good). Every index of every other size must have the same kinds: no frozen parameters'
  // lean chunks, no CPU embedding's.
  if (!retry_.armed() || !config_.chunk_size_auto || retry_.needs().empty()) return {};
  for (const Param& p : params_) {
    if (!p.trainable) return {};
  }
  for (bool host_only : storage_.host_only()) {
    if (host_only) return {};
  }
  const Layout& base = retry_.base();
  const SizeGrid grid = auto_size_grid(base.max_numel());
  const int64_t current = store().chunk_elems();
  std::vector<int64_t> sizes;
  // The least waste below the engine's size (no moment's budget is the question here: the
  // scheduler's replay says what fits), then the grid's smallest (the finest moves).
  const SizeChoice between = choose_chunk_size(base, grid, current, {}, DeviceCosts{});
  if (between.chunk_elems > 0) sizes.push_back(between.chunk_elems);
  if (grid.min_elems < current && grid.min_elems != between.chunk_elems) {
    sizes.push_back(grid.min_elems);
  }
  // Only sizes the model can move into within the host budget (as the retry checks).
  std::erase_if(sizes,
                [&](int64_t size) { return !retry_.move_fits(size, store(), *storage_.host()); });
  return sizes;
}

namespace {

// The warm-up's needs (what each door moment brings to the device: its module's tensors, with
// their gradient chunks in backward) by module and kind, for the moments another trace has at
// other indices. A key two needs share with other tensors (two modules of one label) is absent.
class NeedsByDoor {
 public:
  explicit NeedsByDoor(const std::vector<MomentNeed>& needs) : needs_(needs) {
    for (const MomentNeed& need : needs) {
      auto [at, added] = by_door_.try_emplace({need.module, need.with_grads}, &need);
      if (!added && at->second != nullptr && at->second->tensors != need.tensors) {
        at->second = nullptr;
      }
    }
  }
  // Door moment `m` of a trace: the warm-up's moment `m` where it is the same door (the warm-up's
  // own trace), else the warm-up's moment of the same module and kind (a recompute the running
  // ways skip, or one an activation alternative adds: the first warm-up offloads every call, so
  // it ran every recompute, and a recompute brings what its forward does); null where none.
  const MomentNeed* at(int64_t m, const Moment& moment) const {
    const bool backward = moment.kind == MomentKind::kPreBackward;
    if (m < static_cast<int64_t>(needs_.size())) {
      const MomentNeed& own = needs_[static_cast<size_t>(m)];
      if (own.module == moment.label && own.with_grads == backward) return &own;
    }
    const auto found = by_door_.find({moment.label, backward});
    return found == by_door_.end() ? nullptr : found->second;
  }

 private:
  const std::vector<MomentNeed>& needs_;
  std::map<std::pair<std::string, bool>, const MomentNeed*> by_door_;
};

}  // namespace

std::optional<PlanLayout> EngineCore::plan_layout_of(int64_t chunk_elems, const Trace& trace,
                                                     int64_t peak_non_model) const {
  const Layout layout = retry_.layout(chunk_elems);
  const int64_t n = layout.chunk_count();
  const std::vector<ChunkKindSpec>& kinds = store().kinds();
  auto slot = [&](ChunkKind kind) -> int64_t {
    for (size_t k = 0; k < kinds.size(); ++k) {
      if (kinds[k].kind == kind) return static_cast<int64_t>(k);
    }
    return -1;
  };
  auto id = [&](ChunkKind kind, int64_t index) { return slot(kind) * n + index; };
  // (A group's last chunk is cut to what it holds.)
  auto bytes = [&](ChunkKind kind, int64_t index) {
    return layout.chunk_capacity(index) *
           chunk_element_bytes(kinds[static_cast<size_t>(slot(kind))].dtype);
  };
  PlanLayout out;
  out.chunk_elems = chunk_elems;
  for (size_t k = 0; k < kinds.size(); ++k) {
    for (int64_t i = 0; i < n; ++i) {
      out.chunks[static_cast<int64_t>(k) * n + i] = ChunkInfo{bytes(kinds[k].kind, i)};
    }
  }
  const bool grads = gradients_.space();
  // Every door moment accesses its tensors' chunks of this size; the step moment comes after.
  const NeedsByDoor needs(retry_.needs());
  out.trace.tail_non_model_bytes = trace.tail_non_model_bytes;
  int64_t step = -1;
  for (int64_t m = 0; m < trace.size(); ++m) {
    const Moment& from = trace.moments[static_cast<size_t>(m)];
    Moment to;
    to.kind = from.kind;
    to.label = from.label;
    to.non_model_bytes = from.non_model_bytes;
    if (from.kind == MomentKind::kStep) {
      step = m;
    } else {
      const MomentNeed* found = needs.at(m, from);
      if (found == nullptr) return std::nullopt;
      const MomentNeed& need = *found;
      auto add = [&](int64_t c) {
        if (std::find(to.chunk_ids.begin(), to.chunk_ids.end(), c) == to.chunk_ids.end()) {
          to.chunk_ids.push_back(c);
        }
      };
      for (TensorId t : need.tensors) add(id(ChunkKind::kParam, layout.placement(t).chunk_index));
      if (need.with_grads && grads) {
        for (TensorId t : need.tensors) add(id(ChunkKind::kGrad, layout.placement(t).chunk_index));
      }
    }
    out.trace.moments.push_back(std::move(to));
  }
  if (step < 0) return std::nullopt;
  // The margin's placement for this size, as StepPipeline::decide_placement makes it: what the
  // device keeps free at the peak of non-model bytes (the one the engine's was decided with, or an
  // activation alternative's) with every param (and gradient) chunk there.
  std::vector<int64_t> state(static_cast<size_t>(n), 0);        // per index: its states' bytes
  std::vector<int64_t> device_side(static_cast<size_t>(n), 0);  // and with its param and gradient
  int64_t resident = 0;
  for (int64_t i = 0; i < n; ++i) {
    for (ChunkKind kind : state_kinds()) state[static_cast<size_t>(i)] += bytes(kind, i);
    const int64_t model = bytes(ChunkKind::kParam, i) + (grads ? bytes(ChunkKind::kGrad, i) : 0);
    device_side[static_cast<size_t>(i)] = state[static_cast<size_t>(i)] + model;
    resident += model;
  }
  const int64_t margin =
      adam_margin_bytes(usable_device_bytes(config_), peak_non_model, resident,
                        /*device_state_bytes=*/0, config_.mem_tracer.margin_use_ratio);
  const bool hybrid = config_.optimizer.use_hybrid_adam;
  const PlacementPlan placed = hybrid ? plan_placement(state, margin) : all_on_host(state);
  // The streamed placement: the margin's, and what the step's free device memory holds of the
  // rest with their params and gradients.
  const std::vector<bool> streamed =
      hybrid ? streamed_placement(
                   device_side, placed.on_device, std::vector<bool>(static_cast<size_t>(n), true),
                   streamed_budget_bytes(usable_device_bytes(config_), step_non_model_of(trace),
                                         config_.mem_tracer.margin_use_ratio))
             : placed.on_device;
  Moment& at_step = out.trace.moments[static_cast<size_t>(step)];
  for (int64_t i = 0; i < n; ++i) {
    PlanIndex x;
    x.params = static_cast<double>(layout.chunk_capacity(i));
    x.device_side = {id(ChunkKind::kParam, i)};
    if (mixed()) x.device_side.push_back(id(ChunkKind::kParamFp32, i));
    x.device_side.push_back(id(ChunkKind::kMomentum, i));
    x.device_side.push_back(id(ChunkKind::kVariance, i));
    for (int64_t c : x.device_side) x.undo_bytes += out.chunks[c].bytes;
    if (grads) x.device_side.push_back(id(ChunkKind::kGrad, i));
    for (int64_t c : x.device_side) x.device_adam_bytes += out.chunks[c].bytes;
    for (ChunkKind kind : kAdamKinds) {
      if (slot(kind) >= 0) x.host_side.push_back(id(kind, i));
    }
    x.on_device = placed.on_device[static_cast<size_t>(i)];
    x.streamed = streamed[static_cast<size_t>(i)];
    x.own = {id(ChunkKind::kParam, i)};
    if (grads) x.own.push_back(id(ChunkKind::kGrad, i));
    std::vector<int64_t>& where = x.on_device ? at_step.chunk_ids : at_step.host_chunk_ids;
    const std::vector<int64_t>& ids = x.on_device ? x.device_side : x.host_side;
    where.insert(where.end(), ids.begin(), ids.end());
    out.indices.push_back(std::move(x));
  }
  // The delayed update's copies beside this size's chunks (at registration they fit the engine's
  // own size).
  if (pipeline_->delayed_possible() &&
      storage_.host()->capacity_bytes() != MemoryTier::kUnlimited) {
    int64_t total = 0;
    for (const auto& [c, info] : out.chunks) total += info.bytes;
    out.delayed_fits = total + delayed_copy_bytes() <= storage_.host()->capacity_bytes();
  }
  find_ready_moments(out);
  return out;
}

}  // namespace patrickstar
