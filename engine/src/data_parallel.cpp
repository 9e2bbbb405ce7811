// Data parallel across processes (docs/design.md section 9): ownership, gather on use, drop after
// use, gradient reduction into the owners (DataParallel, data_parallel.h). With one process none of
// this runs.
//
// The rules, identical on every rank because they follow the doors and the gradients (the same
// model runs the same graph everywhere), never a rank's own memory decisions:
// - Chunks are sharded over a shard group of k ranks (the world unless hybrid sharding): the rank
//   of shard rank r owns chunk index i when i % k == r, and keeps that index's payloads of every
//   kind. A comm group is k consecutive chunk indices. With hybrid sharding the world_size / k
//   shard groups are replicas of one another: the ranks of one shard rank form a replica group.
// - A door that needs a parameter whose group is not present gathers the group: one all-gather of
//   the owners' param chunks into one buffer of world_size chunks on the device (on the host for a
//   CPU embedding's group). The doors place these buffers, not the scheduler: their bytes are
//   non-model bytes to the trace (GatheredBytesProbe), so the budgets of every later iteration
//   leave room for them at the moments they are present, and dropping them costs no copy.
// - Outside a backward, a group's remote chunks are dropped when every tensor of the group was used
//   since the gather and none is in use (so a forward gathers each group once).
// - In a backward, a group is reduced when each of its trainable tensors got its gradients (one per
//   autograd pass that uses it) and none is in use: every chunk of the group is summed in fp32 into
//   its owner, then the remote chunks are dropped. The end of the backward reduces the groups left
//   (parameters unused by this loss). Gradients are averaged over ranks, as DDP does. With hybrid
//   sharding each owner's reduced sums are then summed over its replica group, once per iteration:
//   in the backward that completes the accumulation (earlier micro-batches accumulate the shard
//   group's sums at the owner).
#include "data_parallel.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gradient_state.h"
#include "iteration_metrics.h"
#include "iteration_tracker.h"
#include "model_storage.h"
#include "non_model_probe.h"
#include "param_table.h"
#include "patrickstar/engine/deferred_init.h"

namespace patrickstar::engine_detail {

void DataParallel::form_shard_groups(int configured) {
  if (!distributed()) return;  // nothing to shard: a config written for many ranks runs on one
  int k = world_;
  std::unique_ptr<Communicator> host;
  if (configured == 0) {
    // The ranks of one host, when every host runs the same number of them (at least 2).
    host = comm_->split_by_host();
    at::Tensor sizes = at::tensor(
        {static_cast<int64_t>(host->world_size()), -static_cast<int64_t>(host->world_size())},
        at::kLong);
    comm_->all_reduce(sizes, ReduceOp::kMax);
    const int64_t largest = sizes[0].item<int64_t>();
    const int64_t smallest = -sizes[1].item<int64_t>();
    if (largest == smallest && smallest >= 2 && smallest < world_) k = static_cast<int>(smallest);
  } else if (configured != kShardWholeWorld) {
    TORCH_CHECK(configured >= 2 && configured <= world_ && world_ % configured == 0,
                "patrickstar::Engine: zero_optimization.shard_group_size ", configured,
                " does not divide the ", world_,
                " ranks into groups of 2 or more (use a divisor "
                "of ",
                world_, " from 2, 0 for the ranks of one host, or \"world\")");
    k = configured;
  }
  if (k == world_) return;  // one shard group: the world
  shard_ = host != nullptr ? std::shared_ptr<Communicator>(std::move(host))
                           : std::shared_ptr<Communicator>(comm_->split(rank_ / k, rank_));
  shard_rank_ = shard_->rank();
  shard_size_ = shard_->world_size();
  TORCH_INTERNAL_ASSERT(shard_size_ == k, "patrickstar: internal: a shard group of ", shard_size_,
                        " ranks where ", k, " were formed");
  replicas_ = comm_->split(shard_rank_, rank_);
}

CollectiveCounters DataParallel::counters() const {
  CollectiveCounters all = comm_->counters();
  if (shard_ != comm_) all += shard_->counters();
  if (replicas_ != nullptr) all += replicas_->counters();
  return all;
}

void DataParallel::check_backward(int backwards_since_step, bool gradient_space) const {
  TORCH_CHECK(replicas_ == nullptr || !gradient_space || wiring_->accumulation_steps > 1 ||
                  backwards_since_step == 0,
              "patrickstar: a second backward before step() with hybrid sharding (", replicas(),
              " replicas of shard groups of ", shard_size_,
              " ranks) and fp32 "
              "gradients: set gradient_accumulation_steps to the number of backward passes per "
              "step, so that the shard groups' sums are added across the replicas once");
}

void DataParallel::connect(ShardWiring wiring) {
  wiring_ = std::make_unique<ShardWiring>(std::move(wiring));
}

ChunkStore& DataParallel::store() const {
  return *wiring_->storage.store();
}

bool DataParallel::owns_index(int64_t index) const {
  return owns(store().layout(), index);
}

bool DataParallel::lean(int64_t index) const {
  return wiring_->storage.lean()[static_cast<size_t>(index)];
}

bool DataParallel::host_only(int64_t index) const {
  return wiring_->storage.host_only()[static_cast<size_t>(index)];
}

void DataParallel::note_gradient(TensorId id) {
  if (!distributed()) return;
  wiring_->params.count_backward_gradient(id);
  groups_.on_gradient(group_of(id));
}

void DataParallel::start_groups(const Layout& layout) {
  if (!distributed()) return;
  // (Each step agrees on the gradient norm across ranks: StepAgreement installs the reducer.)
  TORCH_INTERNAL_ASSERT(layout.world_size() == shard_size_,
                        "patrickstar: internal: a layout "
                        "sharded over ",
                        layout.world_size(), " ranks, the shard group has ", shard_size_);
  std::vector<int64_t> tensors(static_cast<size_t>(layout.chunk_count() / shard_size_), 0);
  for (int64_t i = 0; i < layout.chunk_count(); ++i) {
    tensors[static_cast<size_t>(layout.comm_group(i))] +=
        static_cast<int64_t>(layout.tensors_in_chunk(i).size());
  }
  groups_.init(shard_size_, tensors);
  wiring_->gradients.size_reduced(layout.chunk_count());
}

int64_t DataParallel::group_of(TensorId id) const {
  return store().layout().comm_group(store().layout().placement(id).chunk_index);
}

void DataParallel::broadcast_initial_state(
    const std::vector<std::pair<std::string, at::Tensor>>& params, torch::nn::Module& model) {
  if (!distributed()) return;
  torch::NoGradGuard no_grad;
  const ScopeTimer timer = timed();
  auto broadcast = [&](const at::Tensor& t) {
    if (t.is_contiguous()) {
      comm_->broadcast(t, 0);
    } else {
      at::Tensor staging = t.contiguous();
      comm_->broadcast(staging, 0);
      t.copy_(staging);
    }
  };
  // A deferred parameter has no value yet: its owner's initializer gives it one at registration.
  for (const auto& item : params) {
    if (!is_deferred(item.second)) broadcast(item.second);
  }
  for (const at::Tensor& b : model.buffers(/*recurse=*/true)) {
    if (b.defined() && b.device().is_cpu() && b.numel() > 0) broadcast(b);
  }
}

void DataParallel::gather_group(int64_t group) {
  // The overlapped step: this rank's chunk of the group updated ahead (a frozen parameter read
  // again in this backward, an evaluation before the step) is undone first, so that every rank
  // receives the weights of before the step.
  wiring_->index_used(groups_.index(group, shard_rank_));
  // One all-gather in the shard group into one buffer of shard_size param chunks: slot r is shard
  // rank r's chunk. This rank's slot receives its own chunk (MPI copies it there); the others
  // become the payloads of the other ranks' chunks, freed with the last of them (release_group).
  std::vector<ChunkId> slots(static_cast<size_t>(shard_size_), -1);
  for (int r = 0; r < shard_size_; ++r) {
    if (r != shard_rank_)
      slots[static_cast<size_t>(r)] = store().chunk_id(ChunkKind::kParam, groups_.index(group, r));
  }
  const ChunkId own = store().chunk_id(ChunkKind::kParam, groups_.index(group, shard_rank_));
  const bool on_host = host_only(groups_.index(group, 0));
  const int64_t bytes = shard_size_ * store().chunk_bytes(own);
  at::Tensor buffer;
  try {
    if (!on_host) {
      // The trace's budgets leave room for the groups the doors gather; in the warm-up, or when
      // this moment's compute holds more than measured, chunks the scheduler placed make room.
      const int64_t free =
          wiring_->storage.device()->capacity_bytes() - wiring_->storage.device()->used_bytes();
      if (bytes > free) wiring_->make_device_room(bytes - free);
    }
    buffer = store().allocate_block(slots, on_host ? Tier::kHost : Tier::kDevice);
  } catch (c10::Error& e) {
    e.add_context(absl::StrCat("while gathering comm group ", group, " (", shard_size_,
                               " param chunks, ", bytes, " bytes) onto the ",
                               on_host ? "host" : "device",
                               "; chunks pinned by tensors in use: ", wiring_->describe_pinned()));
    throw;
  }
  {
    const ScopeTimer timer = timed();
    shard_->all_gather(store().chunk_view(own), buffer);
  }
  if (!on_host) {
    wiring_->probe.add_gathered(bytes);
    wiring_->metrics.note_gathered_bytes(wiring_->probe.gathered_bytes());
  }
  groups_.on_gathered(group);
  for (int64_t index : groups_.indices(group)) {
    for (TensorId t : store().layout().tensors_in_chunk(index))
      wiring_->params.set_touched(t, false);
  }
}

void DataParallel::ensure_gathered(const std::vector<TensorId>& ids, bool with_grad_chunks) {
  if (!distributed()) return;
  for (TensorId id : ids) {
    const int64_t g = group_of(id);
    if (!groups_.gathered(g)) {
      // A backward leaves a lean group (frozen: never reduced, so never dropped by a reduction)
      // behind when it needs the next one: backward visits the groups in reverse order, so the
      // frozen base is never gathered whole on the device (a group needed again is gathered
      // again).
      if (wiring_->tracker.in_backward() && lean(groups_.index(g, 0)))
        release_lean_groups_except(ids);
      gather_group(g);
    }
    const Param& p = wiring_->params[id];
    if (!p.touched) {
      wiring_->params.set_touched(id, true);
      groups_.on_used(g);
    }
    // Another rank's gradient chunk starts as zeros where the scheduler first puts it (the
    // Mover allocates it on the device); a CPU embedding's, which is never scheduled, on the host.
    const int64_t index = store().layout().placement(id).chunk_index;
    if (!with_grad_chunks || !wiring_->gradients.space() || !p.trainable || !host_only(index)) {
      continue;
    }
    const ChunkId grad = store().chunk_id(ChunkKind::kGrad, index);
    if (store().tier(grad) == Tier::kNone) store().allocate(grad, Tier::kHost);  // zeros
  }
}

void DataParallel::release_group(int64_t group) {
  const int64_t first = groups_.index(group, 0);
  if (groups_.gathered(group) && !host_only(first)) {
    wiring_->probe.add_gathered(-shard_size_ *
                                store().chunk_bytes(store().chunk_id(ChunkKind::kParam, first)));
  }
  for (int64_t index : groups_.indices(group)) {
    if (owns_index(index)) continue;
    store().release(store().chunk_id(ChunkKind::kParam, index));
    if (wiring_->gradients.space()) store().release(store().chunk_id(ChunkKind::kGrad, index));
  }
  groups_.on_released(group);
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

void DataParallel::release_lean_groups_except(const std::vector<TensorId>& ids) {
  for (int64_t g = 0; g < groups_.count(); ++g) {
    if (!groups_.gathered(g) || !lean(groups_.index(g, 0)) || groups_.has_gradients(g)) continue;
    if (std::any_of(ids.begin(), ids.end(), [&](TensorId id) { return group_of(id) == g; }))
      continue;
    if (any_in_compute(store(), wiring_->gradients.space(), groups_.indices(g))) continue;
    release_group(g);
  }
}

void DataParallel::release_used_groups(const std::vector<TensorId>& ids) {
  if (!distributed() || wiring_->tracker.in_backward()) return;
  for (TensorId id : ids) {
    const int64_t g = group_of(id);
    if (!groups_.gathered(g) || groups_.has_gradients(g) || !groups_.all_used(g)) continue;
    if (any_in_compute(store(), wiring_->gradients.space(), groups_.indices(g))) continue;
    release_group(g);
  }
}

void DataParallel::reduce_ready_groups(const std::vector<TensorId>& ids) {
  if (!distributed()) return;
  for (TensorId id : ids) {
    const int64_t g = group_of(id);
    if (!groups_.has_gradients(g)) continue;
    bool ready = !any_in_compute(store(), wiring_->gradients.space(), groups_.indices(g));
    for (int64_t index : groups_.indices(g)) {
      if (!ready) break;
      for (TensorId t : store().layout().tensors_in_chunk(index)) {
        const Param& p = wiring_->params[t];
        if (p.trainable && (p.segments == 0 || p.grads_this_backward < p.segments)) {
          ready = false;
          break;
        }
      }
    }
    if (ready) reduce_group(g);
  }
}

void DataParallel::reduce_group(int64_t group) {
  torch::NoGradGuard no_grad;
  // The overlapped step: this rank's index of the group updated ahead before this reduction (its
  // gradients came in an earlier backward of the iteration, none in this one) is undone first: the
  // reduction writes what the update reads.
  wiring_->index_used(groups_.index(group, shard_rank_));
  {
    const ScopeTimer timer = timed();
    for (int owner = 0; owner < shard_size_; ++owner) {
      const int64_t index = groups_.index(group, owner);
      if (wiring_->gradients.space()) {
        // fp32 gradients (already divided by world_size): the owner's chunk, holding what earlier
        // micro-batches reduced, receives the sum in place.
        const ChunkId c = store().chunk_id(ChunkKind::kGrad, index);
        if (store().tier(c) == Tier::kNone) store().allocate(c, Tier::kHost);  // nothing here
        shard_->reduce_sum(store().chunk_view(c), owner);
        if (owner == shard_rank_) sum_over_replicas(store().chunk_view(c));
        continue;
      }
      // Mixed precision without a gradient space: the half slots hold the gradients. They are
      // summed in fp32 (MPI has no bf16); the owner keeps the fp32 sum for Adam and its half slot
      // gets the weight back from the master (a later gather reads weights).
      at::Tensor sum =
          store().chunk_view(store().chunk_id(ChunkKind::kParam, index)).to(at::kFloat);
      for (TensorId t : store().layout().tensors_in_chunk(index)) {
        if (wiring_->params[t].has_grad) continue;  // a weight, not a gradient
        const TensorPlacement& where = store().layout().placement(t);
        sum.narrow(0, where.offset_elems, where.numel).zero_();
      }
      sum.mul_(1.0 / world_);
      shard_->reduce_sum(sum, owner);
      if (!owns_index(index)) continue;
      sum_over_replicas(sum);
      at::Tensor& kept = wiring_->gradients.reduced(index);
      kept = kept.defined() ? kept.add_(sum) : sum;
      for (TensorId t : store().layout().tensors_in_chunk(index)) {
        if (wiring_->params[t].has_grad) {
          store().view(t, ChunkKind::kParam).copy_(store().view(t, ChunkKind::kParamFp32));
        }
      }
    }
  }
  groups_.on_reduced();
  release_group(group);
}

void DataParallel::sum_over_replicas(const at::Tensor& reduced) {
  if (replicas_ == nullptr) return;
  // Earlier micro-batches of the iteration leave the shard group's sums at the owner; the backward
  // completing the accumulation adds them over the replicas, once (check_backward refuses a second
  // backward where this would count a sum twice).
  const int accumulation = wiring_->accumulation_steps;
  if (accumulation > 1 && wiring_->tracker.backwards_since_step() + 1 != accumulation) return;
  replicas_->all_reduce(reduced, ReduceOp::kSum);
}

void DataParallel::reduce_remaining_groups() {
  if (!distributed()) return;
  for (int64_t g = 0; g < groups_.count(); ++g) {
    if (groups_.has_gradients(g)) reduce_group(g);
  }
}

void DataParallel::release_remote(bool discard) {
  if (!distributed()) return;
  for (int64_t g = 0; g < groups_.count(); ++g) {
    if (!discard && groups_.has_gradients(g)) continue;
    if (any_in_compute(store(), wiring_->gradients.space(), groups_.indices(g))) continue;
    bool present = groups_.gathered(g);
    for (int64_t index : groups_.indices(g)) {
      if (present) break;
      present = !owns_index(index) && wiring_->gradients.space() &&
                store().tier(store().chunk_id(ChunkKind::kGrad, index)) != Tier::kNone;
    }
    if (present) release_group(g);
  }
}

at::Tensor DataParallel::master_chunk_everywhere(const StateAccess& /*access*/, int64_t index,
                                                 ChunkKind master_kind) const {
  // A lean index's weights are its param chunk (widened from the half weights in mixed precision).
  const ChunkKind master = lean(index) ? ChunkKind::kParam : master_kind;
  // On the host wherever the chunk is (a GPU's chunk is copied down), so every rank returns
  // host tensors.
  at::Tensor buffer =
      owns_index(index)
          ? store()
                .chunk_view(store().chunk_id(master, index))
                .to(at::kCPU, at::kFloat, /*non_blocking=*/false, /*copy=*/true)
          : at::empty({store().chunk(store().chunk_id(master, index)).capacity_elems}, at::kFloat);
  shard_->broadcast(buffer, static_cast<int>(index % shard_size_));
  return buffer;
}

at::Tensor DataParallel::value_in(const Layout& layout, const at::Tensor& chunk, TensorId id) {
  const TensorPlacement& where = layout.placement(id);
  return chunk.narrow(0, where.offset_elems, where.numel).view(layout.sizes(id)).clone();
}

std::string DataParallel::first_error(const std::string& local) const {
  if (!distributed()) return local;
  const ScopeTimer timer(seconds_);
  // Tensors over this frame's memory: the agreement allocates nothing a failing allocator could
  // refuse on one rank only.
  int64_t who = local.empty() ? 0 : world_ - rank_;
  comm_->all_reduce(at::from_blob(&who, {1}, at::kLong), ReduceOp::kMax);
  if (who == 0) return {};
  const int root = world_ - static_cast<int>(who);
  std::string text = broadcast_text(rank_ == root ? local.substr(0, 8192) : std::string(), root);
  const std::string prefix = "patrickstar: ";
  if (text.compare(0, prefix.size(), prefix) == 0) text.erase(0, prefix.size());
  return "rank " + std::to_string(root) + " of " + std::to_string(world_) + ": " + text;
}

std::string DataParallel::rank_zeros(const std::string& local) const {
  if (!distributed()) return local;
  const ScopeTimer timer(seconds_);
  return broadcast_text(rank_ == 0 ? local : std::string(), 0);
}

std::string DataParallel::broadcast_text(std::string text, int root) const {
  int64_t length = static_cast<int64_t>(text.size());
  comm_->broadcast(at::from_blob(&length, {1}, at::kLong), root);
  text.resize(static_cast<size_t>(length) + 1);  // + 1: a tensor of one byte when it is empty
  comm_->broadcast(at::from_blob(text.data(), {length + 1}, at::kByte), root);
  text.resize(static_cast<size_t>(length));
  return text;
}

StepAgreement::StepAgreement(const DataParallel& dp, HybridAdam& adam) : dp_(dp), adam_(adam) {
  if (!dp_.distributed()) return;
  // With hybrid sharding every shard is held by each replica group: the first replica's count.
  const bool counts = dp_.first_replica();
  adam_.set_stats_reducer([this, counts](GradStats& stats) {
    const double global = dp_.sum(counts || stats.sum_squares < 0 ? stats.sum_squares : 0.0);
    agreed_ = true;
    // A rank that gave up sent -1e300: the sum is negative, or not finite beside another rank's
    // overflow. Every rank sees the same sum, so all ask for the message here alike (give_up's
    // rank sends it); an overflow alone gets none and is skipped as before.
    if (!(std::isfinite(global) && global >= 0)) {
      const std::string agreed = dp_.first_error("");
      TORCH_CHECK(agreed.empty() && !(global < 0), "patrickstar: ",
                  agreed.empty() ? std::string("another rank could not take this step")
                                 : "could not take this step on " + agreed,
                  "; every rank discards the iteration");
    }
    stats.sum_squares = global;
  });
  installed_ = true;
}

void StepAgreement::release() {
  if (!installed_) return;
  adam_.set_stats_reducer(nullptr);
  installed_ = false;
}

bool StepAgreement::give_up(const std::string& why) {
  release();
  if (!dp_.distributed()) return false;
  if (!agreed_) {
    dp_.sum(-1e300);
    dp_.first_error(why.empty() ? std::string("(no message)") : why);
    agreed_ = true;
  }
  return true;
}

}  // namespace patrickstar::engine_detail
