// The NCCL backend on a GPU, a world of one rank (the GPU machines have one GPU, and NCCL takes one
// GPU per rank): every collective and a split run through ProcessGroupNCCL on CUDA tensors, and
// CPU tensors go through the backend's staging. Run by scripts/gpu-check (data_parallel_gpu) with
// PATRICKSTAR_TEST_NCCL=1; skipped, with the reason, elsewhere.
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "patrickstar/comm/communicator.h"

namespace patrickstar {
namespace nccl_communicator_test {

TEST(NcclCommunicator, AWorldOfOneRunsEveryCollectiveOnTheGpu) {
  const char* asked = std::getenv("PATRICKSTAR_TEST_NCCL");
  if (asked == nullptr || std::string(asked) != "1") {
    GTEST_SKIP() << "PATRICKSTAR_TEST_NCCL=1 runs it (scripts/gpu-check does, on a GPU)";
  }
  ASSERT_TRUE(nccl_available()) << "PATRICKSTAR_TEST_NCCL=1, but this build has no NCCL backend";
  ASSERT_TRUE(torch::cuda::is_available()) << "PATRICKSTAR_TEST_NCCL=1, but no GPU is seen";
  // torchrun's variables for one rank, where no launcher set them.
  setenv("RANK", "0", 0);
  setenv("WORLD_SIZE", "1", 0);
  setenv("LOCAL_RANK", "0", 0);
  setenv("LOCAL_WORLD_SIZE", "1", 0);
  setenv("MASTER_ADDR", "127.0.0.1", 0);
  setenv("MASTER_PORT", "29531", 0);
  const std::unique_ptr<Communicator> comm = make_nccl_communicator();
  ASSERT_EQ(comm->world_size(), 1);
  EXPECT_EQ(comm->backend(), "nccl");
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const at::Tensor values = torch::randn({1000}, cuda);
  at::Tensor gathered = torch::zeros({1000}, cuda);
  comm->all_gather(values, gathered);
  EXPECT_TRUE(torch::equal(gathered, values));
  at::Tensor shard = torch::zeros({1000}, cuda);
  comm->reduce_scatter_sum(values.to(at::kBFloat16), shard);
  EXPECT_TRUE(torch::equal(shard, values.to(at::kBFloat16).to(at::kFloat)));
  at::Tensor buffer = values.clone();
  comm->all_reduce(buffer, ReduceOp::kSum);
  comm->all_reduce(buffer, ReduceOp::kMax);
  comm->broadcast(buffer, 0);
  comm->reduce_sum(buffer, 0);
  EXPECT_TRUE(torch::equal(buffer, values));
  // A CPU tensor goes through device memory and comes back.
  at::Tensor on_host = torch::arange(10, at::kDouble);
  comm->all_reduce(on_host, ReduceOp::kSum);
  EXPECT_TRUE(torch::equal(on_host, torch::arange(10, at::kDouble)));
  const std::unique_ptr<Communicator> part = comm->split(0, 0);
  EXPECT_EQ(part->world_size(), 1);
  at::Tensor one = torch::ones({4}, cuda);
  part->all_reduce(one, ReduceOp::kSum);
  EXPECT_TRUE(torch::equal(one.cpu(), torch::ones({4})));
  const std::unique_ptr<Communicator> host = comm->split_by_host();
  EXPECT_EQ(host->world_size(), 1);
  EXPECT_EQ(comm->counters().all_gather_calls, 1);
  EXPECT_EQ(comm->counters().reduce_scatter_bytes, 1000 * 4);
}

}  // namespace nccl_communicator_test
}  // namespace patrickstar
