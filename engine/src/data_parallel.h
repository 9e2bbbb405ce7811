// Private to engine/src: data parallel, as the engine sees it: the communicator, this rank and the
// world, the comm groups' state (comm_groups.h), which chunk index is whose, the agreement
// collectives, the time spent in collectives, and the gathers, drops and reductions of chunk groups
// that follow the doors and the gradients (data_parallel.cpp, docs/design.md section 9).
//
// Invariants:
// - With one process there is one rank, every chunk index is its own and no collective is issued
//   (all_agree and sum return the local value; gathers, drops and reductions do nothing): callers
//   need not ask which case they are in.
// - Every collective is issued by every rank in the same order (a rank that skips one leaves the
//   others waiting until the communicator's deadline); each adds its wall time to seconds().
// - A comm group's other ranks' chunks are present exactly while the group is gathered or holds
//   gradients to reduce; the step pipeline hears of an index before a gather or a reduction reads
//   or writes it (its update made ahead is taken back first).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/full.h>

#include "patrickstar/chunk/chunk_store.h"
#include "patrickstar/chunk/layout.h"
#include "patrickstar/comm/communicator.h"
#include "patrickstar/optimizer/hybrid_adam.h"

#include "comm_groups.h"
#include "scope_timer.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace patrickstar::engine_detail {

class GradientState;     // gradient_state.h
class IterationMetrics;  // iteration_metrics.h
class IterationTracker;  // iteration_tracker.h
class ModelStorage;      // model_storage.h
class NonModelProbe;     // non_model_probe.h
class ParamTable;        // param_table.h
class StateAccess;       // step_pipeline.h

// What the gathers and reductions read and write of the engine's other components (wired once,
// before registration; the store they read is the one registration builds).
struct ShardWiring {
  ModelStorage& storage;
  ParamTable& params;
  GradientState& gradients;
  const IterationTracker& tracker;
  IterationMetrics& metrics;
  NonModelProbe& probe;                                 // built before the wiring, never replaced
  std::function<void(int64_t index)> index_used;        // the step pipeline's on_index_used
  std::function<void(int64_t bytes)> make_device_room;  // the scheduler frees this many bytes
  std::function<std::string()> describe_pinned;         // chunks pinned now, for an error
  int accumulation_steps = 1;                           // the config's
};

class DataParallel {
 public:
  // `comm`: the ranks; null is one process (a local communicator).
  explicit DataParallel(std::shared_ptr<Communicator> comm)
      : comm_(comm != nullptr ? std::move(comm) : make_local_communicator()),
        rank_(comm_->rank()),
        world_(comm_->world_size()),
        shard_(comm_),
        shard_rank_(rank_),
        shard_size_(world_) {}
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  int rank() const { return rank_; }
  int world() const { return world_; }
  bool distributed() const { return world_ > 1; }
  Communicator& comm() const { return *comm_; }
  // Hybrid sharding (docs/design.md section 9): chunks are sharded over the shard_size() ranks of
  // this one's shard group, where it is shard_rank(), and replicated over replicas() such groups
  // (1 unless hybrid). Without form_shard_groups, or with one process, the group is the world.
  // `configured`: Config::shard_group_size. A collective every rank calls once, before
  // registration; a size that cannot be is refused on every rank alike before anything is sent.
  void form_shard_groups(int configured);
  int shard_size() const { return shard_size_; }
  int shard_rank() const { return shard_rank_; }
  int replicas() const { return world_ / shard_size_; }
  // Whether this rank is its replica group's first (the one that counts its shard once).
  bool first_replica() const { return replicas_ == nullptr || replicas_->rank() == 0; }
  // Every collective this rank took part in: the world's, its shard group's, its replica group's.
  CollectiveCounters counters() const;
  // A backward is about to begin with `backwards_since_step` done since the step: refused when
  // hybrid sharding would count a gradient twice (fp32 gradients summed in place across the
  // replicas, gradient_accumulation_steps 1 and a second backward before the step).
  void check_backward(int backwards_since_step, bool gradient_space) const;
  CommGroups& groups() { return groups_; }
  const CommGroups& groups() const { return groups_; }
  // Whether this rank owns chunk index `index` of `layout` (steps it, keeps its gradients).
  bool owns(const Layout& layout, int64_t index) const {
    return layout.owner_rank(index) == shard_rank_;
  }
  // Index `index`'s comm group holds gradients still to be reduced (never with one process).
  bool reduction_pending(const Layout& layout, int64_t index) const {
    return distributed() && groups_.has_gradients(layout.comm_group(index));
  }

  // True when `local` is true on every rank (one small all-reduce).
  bool all_agree(bool local) const {
    if (!distributed()) return local;
    const ScopeTimer timer(seconds_);
    at::Tensor disagree = at::full({1}, local ? 0.0f : 1.0f, at::kFloat);
    comm_->all_reduce(disagree, ReduceOp::kMax);
    return disagree.item<float>() == 0.0f;
  }
  // Whether some other rank failed where this one did not (`failed_here` false): each rank then
  // fails with the same step undone. A collective every rank calls; false with one process.
  bool only_others_failed(bool failed_here) const {
    const bool every_rank_fine = all_agree(!failed_here);
    return !failed_here && !every_rank_fine;
  }
  // Every rank's error agreed on (a collective every rank calls, `local` "" where none): "" when
  // no rank failed, else the lowest failing rank's message as "rank r of N: <message>", the same
  // on every rank. One process: `local` as it is.
  std::string first_error(const std::string& local) const;
  // Rank 0's `local` on every rank (a collective every rank calls; one process: `local`).
  std::string rank_zeros(const std::string& local) const;
  // The sum of `local` over the ranks (one all-reduce of a double).
  double sum(double local) const {
    if (!distributed()) return local;
    const ScopeTimer timer(seconds_);
    at::Tensor sum = at::full({1}, local, at::kDouble);
    comm_->all_reduce(sum, ReduceOp::kSum);
    return sum.item<double>();
  }
  // --- what several ranks change: the engine asks these, never which case it is in ---
  // A parameter's fp32 value is its owner's: every rank reads it from the owner's chunk, broadcast
  // (master_chunk_everywhere), not from its own store, and a value rank 0 writes is broadcast
  // before each owner takes its part (GatheredParameters).
  bool values_from_owners() const { return distributed(); }
  // Each rank keeps only its share of the gradients, reduced into their owners and averaged over
  // the ranks as they land (remote gradient chunks are allocated lazily): no rank can show a whole
  // gradient as a view of a slot, change one on its own, or keep at zero one that no loss reached
  // without a gradient space (the reduced sums hold nothing for it).
  bool shards_gradients() const { return distributed(); }
  // The features that run with one process only: the disk tier, the delayed update, "auto"'s
  // retry, optimizer states placed on the device at registration; frozen parameters are packed
  // apart from trained ones with one process (with several, only where that takes fewer bytes).
  bool one_process() const { return !distributed(); }
  // `text` with several ranks (what an error adds about them), else "".
  const char* with_ranks(const char* text) const { return distributed() ? text : ""; }

  // --- chunk groups (data_parallel.cpp); none of these does anything with one process ---
  // Registration: the comm groups of the placed layout (how many tensors each holds) and, for
  // mixed precision without a gradient space, a reduced-sum slot per chunk index.
  void start_groups(const Layout& layout);
  void connect(ShardWiring wiring);
  // The comm group of the chunk index that holds parameter `id`.
  int64_t group_of(TensorId id) const;
  // Registration: every rank starts from rank 0's parameters (but deferred ones, which their
  // owners' initializers fill) and buffers.
  void broadcast_initial_state(const std::vector<std::pair<std::string, at::Tensor>>& params,
                               torch::nn::Module& model);
  // A door or a gradient needs parameters `ids`: their groups are gathered where they are not (with
  // `with_grad_chunks`, a CPU embedding's other ranks' gradient chunks start as zeros on the host).
  void ensure_gathered(const std::vector<TensorId>& ids, bool with_grad_chunks);
  // Outside a backward: the groups of `ids` every tensor of which was used since the gather, and
  // none is in use now, are dropped.
  void release_used_groups(const std::vector<TensorId>& ids);
  // A gradient of parameter `id` was written (one per autograd pass that uses it).
  void note_gradient(TensorId id);
  // The groups of `ids` whose trainable tensors all got their gradients, none in use, are reduced
  // into their owners and dropped.
  void reduce_ready_groups(const std::vector<TensorId>& ids);
  // The end of a backward: every group still holding gradients is reduced.
  void reduce_remaining_groups();
  // Other ranks' chunks present go (`discard`: also those holding gradients not yet reduced).
  void release_remote(bool discard);
  // Chunk index `index`'s fp32 weights (`master`: the kind holding them) on every rank: a broadcast
  // from its owner. A collective every rank calls.
  at::Tensor master_chunk_everywhere(const StateAccess& access, int64_t index,
                                     ChunkKind master) const;
  // Parameter `id`'s value in `chunk`, a chunk of `layout` (a copy).
  static at::Tensor value_in(const Layout& layout, const at::Tensor& chunk, TensorId id);

  // Times a collective the caller issues through comm() (ScopeTimer timer = timed()).
  ScopeTimer timed() const { return ScopeTimer(seconds_); }
  double seconds() const { return seconds_; }

 private:
  // `text` (rank `root`'s; the others pass "") on every rank: its length, then its bytes.
  std::string broadcast_text(std::string text, int root) const;
  ChunkStore& store() const;
  bool owns_index(int64_t index) const;
  bool lean(int64_t index) const;
  bool host_only(int64_t index) const;
  void gather_group(int64_t group);
  void release_group(int64_t group);
  void release_lean_groups_except(const std::vector<TensorId>& ids);
  void reduce_group(int64_t group);
  // The sum over the replica groups of this rank's reduced gradients of a chunk index (in place),
  // in the backward that completes the iteration's accumulation.
  void sum_over_replicas(const at::Tensor& reduced);

  std::shared_ptr<Communicator> comm_;
  int rank_ = 0;
  int world_ = 1;
  // The shard group (comm_ itself unless hybrid) and the replica group (null unless hybrid).
  std::shared_ptr<Communicator> shard_;
  std::unique_ptr<Communicator> replicas_;
  int shard_rank_ = 0;
  int shard_size_ = 1;
  CommGroups groups_;
  std::unique_ptr<ShardWiring> wiring_;
  mutable double seconds_ = 0;  // also spent by const collectives (fp32_state_dict)
};

// One step's agreement between the ranks: before anything changes, every rank adds its shard's
// squared gradient norm in one all-reduce (Adam's statistics reducer), so all clip and skip an fp16
// overflow alike. A rank that cannot take the step sends a large negative number instead, so every
// rank sees a negative sum and drops the iteration with it rather than waiting for it forever.
// With one process nothing is installed or sent. Lives on the stack of one step.
class StepAgreement {
 public:
  StepAgreement(const DataParallel& dp, HybridAdam& adam);
  ~StepAgreement() { release(); }
  StepAgreement(const StepAgreement&) = delete;
  StepAgreement& operator=(const StepAgreement&) = delete;
  // Adam's statistics are in: the reducer goes (the delayed update's thread may read Adam after).
  void release();
  // This rank cannot take the step (`why`): the others hear it and its message, unless the sum
  // was already agreed. Returns whether every rank drops the iteration with it (data parallel).
  bool give_up(const std::string& why);

 private:
  const DataParallel& dp_;
  HybridAdam& adam_;
  bool installed_ = false;
  bool agreed_ = false;
};

}  // namespace patrickstar::engine_detail
