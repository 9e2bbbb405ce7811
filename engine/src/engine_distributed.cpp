// Data parallel across processes (docs/design.md section 9): ownership, gather on use, drop after
// use, gradient reduction into the owners. With one process none of this runs.
//
// The rules, identical on every rank because they follow the doors and the gradients (the same
// model runs the same graph everywhere), never a rank's own memory decisions:
// - Rank r owns chunk index i when i % world_size == r, and keeps that index's payloads of every
//   kind. A comm group is world_size consecutive chunk indices.
// - A door that needs a parameter whose group is not present gathers the group: one all-gather of
//   the owners' param chunks into one buffer of world_size chunks on the device (on the host for a
//   CPU embedding's group). The doors place these buffers, not the scheduler: their bytes are
//   non-model bytes to the trace (GatheredBytesProbe), so the budgets of every later iteration leave
//   room for them at the moments they are present, and dropping them costs no copy.
// - Outside a backward, a group's remote chunks are dropped when every tensor of the group was used
//   since the gather and none is in use (so a forward gathers each group once).
// - In a backward, a group is reduced when each of its trainable tensors got its gradients (one per
//   autograd pass that uses it) and none is in use: every chunk of the group is summed in fp32 into
//   its owner, then the remote chunks are dropped. The end of the backward reduces the groups left
//   (parameters unused by this loss). Gradients are averaged over ranks, as DDP does.
#include "engine_core.h"

#include "patrickstar/engine/deferred_init.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine_internal.h"

namespace patrickstar {
using namespace engine_detail;  // NOLINT: this folder's private helpers


int64_t EngineCore::comm_group_of(TensorId id) const {
  return store().layout().comm_group(store().layout().placement(id).chunk_index);
}

void EngineCore::broadcast_initial_state(
    const std::vector<std::pair<std::string, at::Tensor>>& params) {
  torch::NoGradGuard no_grad;
  const ScopeTimer timer = dp_.timed();
  auto broadcast = [&](const at::Tensor& t) {
    if (t.is_contiguous()) {
      dp_.comm().broadcast(t, 0);
    } else {
      at::Tensor staging = t.contiguous();
      dp_.comm().broadcast(staging, 0);
      t.copy_(staging);
    }
  };
  // A deferred parameter has no value yet: its owner's initializer gives it one at registration.
  for (const auto& item : params) {
    if (!is_deferred(item.second)) broadcast(item.second);
  }
  for (const at::Tensor& b : model_->buffers(/*recurse=*/true)) {
    if (b.defined() && b.device().is_cpu() && b.numel() > 0) broadcast(b);
  }
}

void EngineCore::gather_group(int64_t group) {
  // The overlapped step: this rank's chunk of the group updated ahead (a frozen parameter read
  // again in this backward, an evaluation before the step) is undone first, so that every rank
  // receives the weights of before the step.
  pipeline_->on_index_used(dp_.groups().index(group, dp_.rank()));
  // One all-gather into one buffer of world_size param chunks: slot r is rank r's chunk. This
  // rank's slot receives its own chunk (MPI copies it there); the others become the payloads of
  // the other ranks' chunks, freed with the last of them (release_group).
  std::vector<ChunkId> slots(static_cast<size_t>(dp_.world()), -1);
  for (int r = 0; r < dp_.world(); ++r) {
    if (r != dp_.rank())
      slots[static_cast<size_t>(r)] = store().chunk_id(ChunkKind::kParam, dp_.groups().index(group, r));
  }
  const ChunkId own = store().chunk_id(ChunkKind::kParam, dp_.groups().index(group, dp_.rank()));
  const bool on_host = storage_.host_only[static_cast<size_t>(dp_.groups().index(group, 0))];
  const int64_t bytes = dp_.world() * store().chunk_bytes(own);
  at::Tensor buffer;
  try {
    if (!on_host) {
      // The trace's budgets leave room for the groups the doors gather; in the warm-up, or when
      // this moment's compute holds more than measured, chunks the scheduler placed make room.
      const int64_t free = storage_.device->capacity_bytes() - storage_.device->used_bytes();
      if (bytes > free) scheduler_->make_room(bytes - free, *mover_);
    }
    buffer = store().allocate_block(slots, on_host ? Tier::kHost : Tier::kDevice);
  } catch (c10::Error& e) {
    e.add_context(absl::StrCat("while gathering comm group ", group, " (", dp_.world(),
                               " param chunks, ", bytes, " bytes) onto the ",
                               on_host ? "host" : "device", "; chunks pinned by tensors in use: ",
                               describe_pinned()));
    throw;
  }
  {
    const ScopeTimer timer = dp_.timed();
    dp_.comm().all_gather(store().chunk_view(own), buffer);
  }
  if (!on_host) {
    probe_->add_gathered(bytes);
    metrics_.note_gathered_bytes(probe_->gathered_bytes());
  }
  dp_.groups().on_gathered(group);
  for (int64_t index : dp_.groups().indices(group)) {
    for (TensorId t : store().layout().tensors_in_chunk(index)) params_[t].touched = false;
  }
}

void EngineCore::ensure_gathered(const std::vector<TensorId>& ids, bool with_grad_chunks) {
  if (!distributed()) return;
  for (TensorId id : ids) {
    const int64_t g = comm_group_of(id);
    if (!dp_.groups().gathered(g)) {
      // A backward leaves a lean group (frozen: never reduced, so never dropped by a reduction)
      // behind when it needs the next one: backward visits the groups in reverse order, so the
      // frozen base is never gathered whole on the device (a group needed again is gathered
      // again).
      if (tracker_.in_backward() && lean(dp_.groups().index(g, 0))) release_lean_groups_except(ids);
      gather_group(g);
    }
    Param& p = params_[id];
    if (!p.touched) {
      p.touched = true;
      dp_.groups().on_used(g);
    }
    // Another rank's gradient chunk starts as zeros where the scheduler first puts it (the
    // Mover allocates it on the device); a CPU embedding's, which is never scheduled, on the host.
    const int64_t index = store().layout().placement(id).chunk_index;
    if (!with_grad_chunks || !gradients_.space || !p.trainable ||
        !storage_.host_only[static_cast<size_t>(index)]) {
      continue;
    }
    const ChunkId grad = store().chunk_id(ChunkKind::kGrad, index);
    if (store().tier(grad) == Tier::kNone) store().allocate(grad, Tier::kHost);  // zeros
  }
}

void EngineCore::release_group(int64_t group) {
  const int64_t first = dp_.groups().index(group, 0);
  if (dp_.groups().gathered(group) && !storage_.host_only[static_cast<size_t>(first)]) {
    probe_->add_gathered(-dp_.world() * store().chunk_bytes(store().chunk_id(ChunkKind::kParam, first)));
  }
  for (int64_t index : dp_.groups().indices(group)) {
    if (owns(index)) continue;
    store().release(store().chunk_id(ChunkKind::kParam, index));
    if (gradients_.space) store().release(store().chunk_id(ChunkKind::kGrad, index));
  }
  dp_.groups().on_released(group);
}

namespace {
template <class Indices>
bool any_in_compute(const ChunkStore& store, bool grad_space, Indices indices) {
  for (int64_t index : indices) {
    if (!store.is_movable(store.chunk_id(ChunkKind::kParam, index))) return true;
    if (grad_space && !store.is_movable(store.chunk_id(ChunkKind::kGrad, index))) return true;
  }
  return false;
}
}  // namespace

void EngineCore::release_lean_groups_except(const std::vector<TensorId>& ids) {
  for (int64_t g = 0; g < dp_.groups().count(); ++g) {
    if (!dp_.groups().gathered(g) || !lean(dp_.groups().index(g, 0)) || dp_.groups().has_gradients(g)) continue;
    if (std::any_of(ids.begin(), ids.end(), [&](TensorId id) { return comm_group_of(id) == g; }))
      continue;
    if (any_in_compute(store(), gradients_.space, dp_.groups().indices(g))) continue;
    release_group(g);
  }
}

void EngineCore::release_used_groups(const std::vector<TensorId>& ids) {
  if (!distributed() || tracker_.in_backward()) return;
  for (TensorId id : ids) {
    const int64_t g = comm_group_of(id);
    if (!dp_.groups().gathered(g) || dp_.groups().has_gradients(g) || !dp_.groups().all_used(g)) continue;
    if (any_in_compute(store(), gradients_.space, dp_.groups().indices(g))) continue;
    release_group(g);
  }
}

void EngineCore::reduce_ready_groups(const std::vector<TensorId>& ids) {
  if (!distributed()) return;
  for (TensorId id : ids) {
    const int64_t g = comm_group_of(id);
    if (!dp_.groups().has_gradients(g)) continue;
    bool ready = !any_in_compute(store(), gradients_.space, dp_.groups().indices(g));
    for (int64_t index : dp_.groups().indices(g)) {
      if (!ready) break;
      for (TensorId t : store().layout().tensors_in_chunk(index)) {
        const Param& p = params_[t];
        if (p.trainable && (p.segments == 0 || p.grads_this_backward < p.segments)) {
          ready = false;
          break;
        }
      }
    }
    if (ready) reduce_group(g);
  }
}

void EngineCore::reduce_group(int64_t group) {
  torch::NoGradGuard no_grad;
  // The overlapped step: this rank's index of the group updated ahead before this reduction (its
  // gradients came in an earlier backward of the iteration, none in this one) is undone first: the
  // reduction writes what the update reads.
  pipeline_->on_index_used(dp_.groups().index(group, dp_.rank()));
  {
    const ScopeTimer timer = dp_.timed();
    for (int owner = 0; owner < dp_.world(); ++owner) {
      const int64_t index = dp_.groups().index(group, owner);
      if (gradients_.space) {
        // fp32 gradients (already divided by world_size): the owner's chunk, holding what earlier
        // micro-batches reduced, receives the sum in place.
        const ChunkId c = store().chunk_id(ChunkKind::kGrad, index);
        if (store().tier(c) == Tier::kNone) store().allocate(c, Tier::kHost);  // nothing here
        dp_.comm().reduce_sum(store().chunk_view(c), owner);
        continue;
      }
      // Mixed precision without a gradient space: the half slots hold the gradients. They are
      // summed in fp32 (MPI has no bf16); the owner keeps the fp32 sum for Adam and its half slot
      // gets the weight back from the master (a later gather reads weights).
      at::Tensor sum =
          store().chunk_view(store().chunk_id(ChunkKind::kParam, index)).to(at::kFloat);
      for (TensorId t : store().layout().tensors_in_chunk(index)) {
        if (params_[t].has_grad) continue;  // a weight, not a gradient
        const TensorPlacement& where = store().layout().placement(t);
        sum.narrow(0, where.offset_elems, where.numel).zero_();
      }
      sum.mul_(1.0 / dp_.world());
      dp_.comm().reduce_sum(sum, owner);
      if (!owns(index)) continue;
      at::Tensor& kept = gradients_.reduced[static_cast<size_t>(index)];
      kept = kept.defined() ? kept.add_(sum) : sum;
      for (TensorId t : store().layout().tensors_in_chunk(index)) {
        if (params_[t].has_grad) {
          store().view(t, ChunkKind::kParam).copy_(store().view(t, ChunkKind::kParamFp32));
        }
      }
    }
  }
  dp_.groups().on_reduced();
  release_group(group);
}

void EngineCore::reduce_remaining_groups() {
  if (!distributed()) return;
  for (int64_t g = 0; g < dp_.groups().count(); ++g) {
    if (dp_.groups().has_gradients(g)) reduce_group(g);
  }
}

void EngineCore::release_remote(bool discard) {
  if (!distributed()) return;
  for (int64_t g = 0; g < dp_.groups().count(); ++g) {
    if (!discard && dp_.groups().has_gradients(g)) continue;
    if (any_in_compute(store(), gradients_.space, dp_.groups().indices(g))) continue;
    bool present = dp_.groups().gathered(g);
    for (int64_t index : dp_.groups().indices(g)) {
      if (present) break;
      present = !owns(index) && gradients_.space &&
                store().tier(store().chunk_id(ChunkKind::kGrad, index)) != Tier::kNone;
    }
    if (present) release_group(g);
  }
}

at::Tensor EngineCore::master_chunk_everywhere(const StateAccess& /*access*/,
                                                int64_t index) const {
  // A lean index's weights are its param chunk (widened from the half weights in mixed precision).
  const ChunkKind master = lean(index) ? ChunkKind::kParam : master_kind();
  at::Tensor buffer =
      owns(index)
          ? store()
                .chunk_view(store().chunk_id(master, index))
                .to(at::kFloat, /*non_blocking=*/false, /*copy=*/true)
          : at::empty({store().chunk(store().chunk_id(master, index)).capacity_elems}, at::kFloat);
  dp_.comm().broadcast(buffer, static_cast<int>(index % dp_.world()));
  return buffer;
}

at::Tensor EngineCore::value_in(const at::Tensor& chunk, TensorId id) const {
  const TensorPlacement& where = store().layout().placement(id);
  return chunk.narrow(0, where.offset_elems, where.numel).view(store().layout().sizes(id)).clone();
}

}  // namespace patrickstar
