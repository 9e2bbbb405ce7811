// The NCCL backend (CUDA builds): PyTorch's c10d::ProcessGroupNCCL over a c10d::TCPStore
// rendezvous, torchrun style (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). It brings
// PyTorch's watchdog: a collective that does not complete within the timeout
// (PATRICKSTAR_COMM_TIMEOUT_S, default 600 s) aborts the communicator and ends the process.
// Tensors are CUDA tensors on this process's device (LOCAL_RANK); every call waits for its work.
// NCCL needs one GPU per rank: two ranks on one GPU are refused by NCCL itself.
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "patrickstar/comm/communicator.h"

namespace patrickstar {
namespace {

std::string env(const char* name) {
  const char* value = std::getenv(name);
  TORCH_CHECK(value != nullptr && *value != '\0', "patrickstar: the NCCL backend needs ", name,
              " (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT)");
  return value;
}

int env_int(const char* name, int64_t low, int64_t high) {
  const std::string text = env(name);
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  TORCH_CHECK(end != text.c_str() && *end == '\0' && value >= low && value <= high, "patrickstar: ",
              name, "=\"", text, "\" is not an integer in [", low, ", ", high, "]");
  return static_cast<int>(value);
}

std::chrono::milliseconds timeout_from_env() {
  const char* text = std::getenv("PATRICKSTAR_COMM_TIMEOUT_S");
  double seconds = 600.0;
  if (text != nullptr && *text != '\0') {
    char* end = nullptr;
    seconds = std::strtod(text, &end);
    TORCH_CHECK(end != text && *end == '\0' && seconds > 0 && seconds < 1e9,
                "patrickstar: PATRICKSTAR_COMM_TIMEOUT_S=\"", text,
                "\" is not a positive number of seconds (NCCL needs a limit)");
  }
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

c10d::ReduceOp reduce_op(ReduceOp op) {
  return op == ReduceOp::kSum ? c10d::ReduceOp(c10d::ReduceOp::SUM)
                              : c10d::ReduceOp(c10d::ReduceOp::MAX);
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator() {
    rank_ = env_int("RANK", 0, 1 << 20);
    size_ = env_int("WORLD_SIZE", 1, 1 << 20);
    TORCH_CHECK(rank_ < size_, "patrickstar: RANK ", rank_, " is not below WORLD_SIZE ", size_);
    const int local = env_int("LOCAL_RANK", 0, 1 << 20);
    TORCH_CHECK(local < c10::cuda::device_count(), "patrickstar: LOCAL_RANK ", local,
                " but this machine has ", static_cast<int>(c10::cuda::device_count()),
                " CUDA device(s): NCCL needs one GPU per rank");
    device_ = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local));
    c10::cuda::set_device(device_.index());
    const std::chrono::milliseconds timeout = timeout_from_env();
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<std::uint16_t>(env_int("MASTER_PORT", 1, 65535));
    store_options.isServer = rank_ == 0;
    store_options.numWorkers = static_cast<std::size_t>(size_);
    store_options.waitWorkers = true;
    store_options.timeout = timeout;
    store_ = c10::make_intrusive<c10d::TCPStore>(env("MASTER_ADDR"), store_options);
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    group_ = c10::make_intrusive<c10d::ProcessGroupNCCL>(store_, rank_, size_, options);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return size_; }
  std::string_view backend() const override { return "nccl"; }
  void barrier() override { group_->barrier()->wait(); }

 protected:
  c10::DeviceType device_type() const override { return c10::kCUDA; }
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
  int rank_ = 0;
  int size_ = 1;
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
