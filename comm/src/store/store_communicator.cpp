// The store backend: collectives through c10d's TCPStore (a key-value server on rank 0, part of
// LibTorch), rendezvous torchrun style (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). It needs no
// MPI and no GPU per rank: it is how tests run several ranks where Open MPI is absent (a GPU
// machine: two ranks sharing one GPU, their CUDA tensors staged through pinned host memory by
// Communicator). Slow (every byte goes through rank 0's store), exact and deterministic: every
// reduction adds the ranks' values in rank order, so every rank gets the same bits.
//
// Collective n: every rank sets its key ("<prefix><n>/<rank>") and reads every rank's (a rank
// that reads collective n's keys knows every rank finished reading n - 1's, so it deletes its own
// key of n - 1). A store read waits at most PATRICKSTAR_COMM_TIMEOUT_S (default 600 s); past it,
// or when the store's server (rank 0) is gone, the collective throws on every live rank, naming
// it: a dead rank is an error on the others, never a hang.
#include <unistd.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "patrickstar/comm/communicator.h"

#include "../torchrun_env.h"

namespace patrickstar {
namespace {

using Bytes = std::vector<uint8_t>;

Bytes bytes_of(const at::Tensor& t) {
  const auto* begin = static_cast<const uint8_t*>(t.data_ptr());
  return Bytes(begin, begin + t.nbytes());
}

template <typename T>
void add_or_max(const std::vector<Bytes>& all, const at::Tensor& out, ReduceOp op) {
  const int64_t n = out.numel();
  T* o = out.data_ptr<T>();
  for (size_t r = 0; r < all.size(); ++r) {
    const T* v = reinterpret_cast<const T*>(all[r].data());
    for (int64_t i = 0; i < n; ++i) {
      if (r == 0) {
        o[i] = v[i];
      } else {
        o[i] = op == ReduceOp::kSum ? o[i] + v[i] : std::max(o[i], v[i]);
      }
    }
  }
}

void reduce_into(const std::vector<Bytes>& all, const at::Tensor& out, ReduceOp op) {
  switch (out.scalar_type()) {
    case at::kFloat:
      return add_or_max<float>(all, out, op);
    case at::kDouble:
      return add_or_max<double>(all, out, op);
    case at::kLong:
      return add_or_max<int64_t>(all, out, op);
    default:
      TORCH_CHECK(false, "patrickstar: the store backend reduces no ", out.scalar_type());
  }
}

class StoreCommunicator final : public Communicator {
 public:
  StoreCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::string prefix)
      : store_(std::move(store)), rank_(rank), size_(size), prefix_(std::move(prefix)) {}

  int rank() const override { return rank_; }
  int world_size() const override { return size_; }
  std::string_view backend() const override { return "store"; }
  void barrier() override { exchange(Bytes{}, "barrier"); }

  std::unique_ptr<Communicator> split(int color, int key) override {
    TORCH_CHECK(color >= 0, "patrickstar::Communicator::split: color ", color, " is negative");
    const int64_t mine[2] = {color, key};
    const auto* p = reinterpret_cast<const uint8_t*>(mine);
    const std::vector<Bytes> all = exchange(Bytes(p, p + sizeof(mine)), "split");
    std::vector<std::pair<int64_t, int>> members;  // (key, rank) of this color
    for (int r = 0; r < size_; ++r) {
      int64_t theirs[2];
      std::memcpy(theirs, all[static_cast<size_t>(r)].data(), sizeof(theirs));
      if (theirs[0] == color) members.emplace_back(theirs[1], r);
    }
    std::sort(members.begin(), members.end());
    const auto me = std::find(members.begin(), members.end(), std::make_pair(int64_t{key}, rank_));
    return std::make_unique<StoreCommunicator>(
        store_, static_cast<int>(me - members.begin()), static_cast<int>(members.size()),
        prefix_ + "s" + std::to_string(serial_) + "c" + std::to_string(color) + "/");
  }
  // The ranks whose host name is this one's: colored by the first of them.
  std::unique_ptr<Communicator> split_by_host() override {
    char name[256] = {};
    gethostname(name, sizeof(name) - 1);
    const std::string host(name);
    const std::vector<Bytes> all = exchange(Bytes(host.begin(), host.end()), "split_by_host");
    int first = 0;
    while (std::string(all[static_cast<size_t>(first)].begin(),
                       all[static_cast<size_t>(first)].end()) != host) {
      ++first;
    }
    return split(first, rank_);
  }

 protected:
  void do_all_gather(const at::Tensor& in, const at::Tensor& out) override {
    const std::vector<Bytes> all = exchange(bytes_of(in), "all_gather");
    auto* o = static_cast<uint8_t*>(out.data_ptr());
    for (size_t r = 0; r < all.size(); ++r) {
      std::memcpy(o + r * static_cast<size_t>(in.nbytes()), all[r].data(), all[r].size());
    }
  }
  void do_reduce_scatter_sum(const at::Tensor& in_fp32, const at::Tensor& out) override {
    const int64_t n = out.numel();
    std::vector<Bytes> all = exchange(bytes_of(in_fp32), "reduce_scatter");
    for (Bytes& b : all) {
      b = Bytes(b.begin() + rank_ * n * 4, b.begin() + (rank_ + 1) * n * 4);  // this rank's slice
    }
    reduce_into(all, out, ReduceOp::kSum);
  }
  void do_all_reduce(const at::Tensor& buffer, ReduceOp op) override {
    reduce_into(exchange(bytes_of(buffer), "all_reduce"), buffer, op);
  }
  void do_broadcast(const at::Tensor& buffer, int root) override {
    const std::vector<Bytes> all =
        exchange(rank_ == root ? bytes_of(buffer) : Bytes{}, "broadcast");
    const Bytes& theirs = all[static_cast<size_t>(root)];
    if (rank_ != root) std::memcpy(buffer.data_ptr(), theirs.data(), theirs.size());
  }
  void do_reduce_sum(const at::Tensor& buffer, int root) override {
    const std::vector<Bytes> all = exchange(bytes_of(buffer), "reduce");
    if (rank_ == root) reduce_into(all, buffer, ReduceOp::kSum);
  }

 private:
  // Every rank's `mine` of this collective, in rank order.
  std::vector<Bytes> exchange(const Bytes& mine, const char* op) {
    const std::string round = prefix_ + std::to_string(serial_) + "/";
    std::vector<Bytes> all(static_cast<size_t>(size_));
    try {
      store_->set(round + std::to_string(rank_), mine);
      for (int r = 0; r < size_; ++r)
        all[static_cast<size_t>(r)] = store_->get(round + std::to_string(r));
      if (serial_ > 0)
        store_->deleteKey(prefix_ + std::to_string(serial_ - 1) + "/" + std::to_string(rank_));
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "patrickstar: rank ", rank_, " of ", size_, ": ", op, " (collective #",
                  serial_,
                  " of this group) failed: another rank has died or hangs (the store "
                  "backend waits PATRICKSTAR_COMM_TIMEOUT_S): ",
                  e.what());
    }
    ++serial_;
    return all;
  }

  c10::intrusive_ptr<c10d::Store> store_;
  int rank_ = 0;
  int size_ = 1;
  std::string prefix_;
  int64_t serial_ = 0;
};

}  // namespace

std::unique_ptr<Communicator> make_store_communicator() {
  const comm_detail::TorchrunRank me = comm_detail::torchrun_rank("store");
  auto store = comm_detail::torchrun_store(me, "store", comm_detail::collective_timeout());
  return std::make_unique<StoreCommunicator>(std::move(store), me.rank, me.size,
                                             comm_detail::torchrun_prefix("store") + "c");
}

}  // namespace patrickstar
