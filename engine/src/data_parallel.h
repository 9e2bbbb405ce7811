// Private to engine/src: data parallel, as the engine sees it: the communicator, this rank and the
// world, the comm groups' state (comm_groups.h), which chunk index is whose, the agreement
// collectives, and the time spent in collectives. The engine's gathers and reductions of chunk
// groups (engine_distributed.cpp) run their collectives through it.
//
// Invariants:
// - With one process there is one rank, every chunk index is its own and no collective is issued
//   (all_agree and sum return the local value): callers need not ask which case they are in.
// - Every collective is issued by every rank in the same order (a rank that skips one leaves the
//   others waiting until the communicator's deadline); each adds its wall time to seconds().
#pragma once

#include <memory>
#include <utility>

#include <ATen/core/Tensor.h>
#include <ATen/ops/full.h>

#include "patrickstar/chunk/layout.h"
#include "patrickstar/comm/communicator.h"

#include "comm_groups.h"
#include "scope_timer.h"

namespace patrickstar::engine_detail {

class DataParallel {
 public:
  // `comm`: the ranks; null is one process (a local communicator).
  explicit DataParallel(std::shared_ptr<Communicator> comm)
      : comm_(comm != nullptr ? std::move(comm) : make_local_communicator()),
        rank_(comm_->rank()),
        world_(comm_->world_size()) {}
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  int rank() const { return rank_; }
  int world() const { return world_; }
  bool distributed() const { return world_ > 1; }
  Communicator& comm() const { return *comm_; }
  CommGroups& groups() { return groups_; }
  const CommGroups& groups() const { return groups_; }
  // Whether this rank owns chunk index `index` of `layout` (steps it, keeps its gradients).
  bool owns(const Layout& layout, int64_t index) const { return layout.owner_rank(index) == rank_; }
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
  // The sum of `local` over the ranks (one all-reduce of a double).
  double sum(double local) const {
    if (!distributed()) return local;
    const ScopeTimer timer(seconds_);
    at::Tensor sum = at::full({1}, local, at::kDouble);
    comm_->all_reduce(sum, ReduceOp::kSum);
    return sum.item<double>();
  }
  // Times a collective the caller issues through comm() (ScopeTimer timer = timed()).
  ScopeTimer timed() const { return ScopeTimer(seconds_); }
  double seconds() const { return seconds_; }

 private:
  std::shared_ptr<Communicator> comm_;
  int rank_ = 0;
  int world_ = 1;
  CommGroups groups_;
  mutable double seconds_ = 0;  // also spent by const collectives (fp32_state_dict)
};

}  // namespace patrickstar::engine_detail
