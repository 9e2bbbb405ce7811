// The NCCL backend (CUDA builds): PyTorch's c10d::ProcessGroupNCCL over a c10d::TCPStore
// rendezvous, torchrun style (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). It brings
// PyTorch's watchdog: a collective that does not complete within the timeout
// (PATRICKSTAR_COMM_TIMEOUT_S, default 600 s) aborts the communicator and ends the process.
// Tensors are CUDA tensors on this process's device (LOCAL_RANK); every call waits for its work.
// NCCL needs one GPU per rank: two ranks on one GPU are refused by NCCL itself.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "patrickstar/comm/communicator.h"

#include "../torchrun_env.h"

namespace patrickstar {
namespace {

c10d::ReduceOp reduce_op(ReduceOp op) {
  return op == ReduceOp::kSum ? c10d::ReduceOp(c10d::ReduceOp::SUM)
                              : c10d::ReduceOp(c10d::ReduceOp::MAX);
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator() {
    const comm_detail::TorchrunRank me = comm_detail::torchrun_rank("NCCL");
    rank_ = me.rank;
    size_ = me.size;
    const int local = comm_detail::torchrun_int("LOCAL_RANK", "NCCL", 0, 1 << 20);
    TORCH_CHECK(local < c10::cuda::device_count(), "patrickstar: LOCAL_RANK ", local,
                " but this machine has ", static_cast<int>(c10::cuda::device_count()),
                " CUDA device(s): NCCL needs one GPU per rank");
    device_ = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local));
    c10::cuda::set_device(device_.index());
    // Its own prefix in the process's store: a second world communicator keys apart.
    store_ = c10::make_intrusive<c10d::PrefixStore>(
        comm_detail::torchrun_prefix("nccl"),
        comm_detail::torchrun_store(me, "NCCL", comm_detail::collective_timeout()));
    start(store_, rank_, size_);
  }
  // A sub-group (split): its ranks' process group over a store of its own prefix.
  NcclCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int size, c10::Device device)
      : rank_(rank), size_(size), device_(device) {
    start(std::move(store), rank, size);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return size_; }
  std::string_view backend() const override { return "nccl"; }
  void barrier() override { group_->barrier()->wait(); }
  // Every rank posts its (color, key) in the store and reads everyone's; the ranks of one color
  // make a process group over the store under a prefix of their own.
  std::unique_ptr<Communicator> split(int color, int key) override {
    TORCH_CHECK(color >= 0, "patrickstar::Communicator::split: color ", color, " is negative");
    const std::string round = "patrickstar/split" + std::to_string(splits_++) + "/";
    store_->set(round + std::to_string(rank_), std::to_string(color) + " " + std::to_string(key));
    std::vector<std::tuple<int, int>> members;  // (key, rank) of this color
    for (int r = 0; r < size_; ++r) {
      const std::vector<uint8_t> bytes = store_->get(round + std::to_string(r));
      int their_color = 0;
      int their_key = 0;
      TORCH_CHECK(std::sscanf(std::string(bytes.begin(), bytes.end()).c_str(), "%d %d",
                              &their_color, &their_key) == 2,
                  "patrickstar: the NCCL split's store holds no (color, key) for rank ", r);
      if (their_color == color) members.emplace_back(their_key, r);
    }
    std::sort(members.begin(), members.end());
    const auto me = std::find(members.begin(), members.end(), std::make_tuple(key, rank_));
    auto prefixed =
        c10::make_intrusive<c10d::PrefixStore>(round + "color" + std::to_string(color), store_);
    return std::make_unique<NcclCommunicator>(prefixed, static_cast<int>(me - members.begin()),
                                              static_cast<int>(members.size()), device_);
  }
  // torchrun numbers the ranks of a node consecutively: LOCAL_WORLD_SIZE of them per node.
  std::unique_ptr<Communicator> split_by_host() override {
    const int local_size = comm_detail::torchrun_int("LOCAL_WORLD_SIZE", "NCCL", 1, size_);
    TORCH_CHECK(size_ % local_size == 0, "patrickstar: LOCAL_WORLD_SIZE ", local_size,
                " does not divide WORLD_SIZE ", size_,
                ": the nodes run different numbers of ranks");
    return split(rank_ / local_size, rank_);
  }

 protected:
  c10::Device native_device() const override { return device_; }
  void do_all_gather(const at::Tensor& in, const at::Tensor& out) override {
    at::Tensor input = in;
    at::Tensor output = out;
    group_->_allgather_base(output, input)->wait();
  }
  void do_reduce_scatter_sum(const at::Tensor& in_fp32, const at::Tensor& out) override {
    at::Tensor input = in_fp32;
    at::Tensor output = out;
    c10d::ReduceScatterOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    group_->_reduce_scatter_base(output, input, options)->wait();
  }
  void do_all_reduce(const at::Tensor& buffer, ReduceOp op) override {
    std::vector<at::Tensor> tensors{buffer};
    c10d::AllreduceOptions options;
    options.reduceOp = reduce_op(op);
    group_->allreduce(tensors, options)->wait();
  }
  void do_broadcast(const at::Tensor& buffer, int root) override {
    std::vector<at::Tensor> tensors{buffer};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    group_->broadcast(tensors, options)->wait();
  }
  void do_reduce_sum(const at::Tensor& buffer, int root) override {
    std::vector<at::Tensor> tensors{buffer};
    c10d::ReduceOptions options;
    options.rootRank = root;
    options.reduceOp = c10d::ReduceOp::SUM;
    group_->reduce(tensors, options)->wait();
  }

 private:
  void start(c10::intrusive_ptr<c10d::Store> store, int rank, int size) {
    store_ = std::move(store);
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = comm_detail::collective_timeout();
    group_ = c10::make_intrusive<c10d::ProcessGroupNCCL>(store_, rank, size, options);
  }

  int rank_ = 0;
  int size_ = 1;
  int splits_ = 0;
  c10::Device device_{c10::kCUDA, 0};
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> group_;
};

}  // namespace

bool nccl_available() { return true; }

std::unique_ptr<Communicator> make_nccl_communicator() {
  return std::make_unique<NcclCommunicator>();
}

}  // namespace patrickstar
