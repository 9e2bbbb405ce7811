// The collectives, run as one process (ctest's discovered tests: the local backend) and under
// mpirun with 2 and 4 ranks (comm.mpi_2_ranks, comm.mpi_4_ranks: every test on every rank). Each
// rank's data is derived from its rank, so every rank can compute what every other rank sent.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <functional>
#include <memory>
#include <string>

#include "patrickstar/comm/communicator.h"

namespace patrickstar {
namespace communicator_test {

Communicator& comm() {
  static std::unique_ptr<Communicator> instance = communicator_from_env();
  return *instance;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "<no error>";
}

// What rank `r` contributes: n values, distinct per rank and position.
at::Tensor values_of(int r, int64_t n, at::ScalarType dtype) {
  torch::manual_seed(1000 + r);
  return (torch::randn({n}) * 4).to(dtype);
}

// Ranks under torchrun (WORLD_SIZE > 1 with MASTER_ADDR): the named backend, else NCCL or store.
bool under_torchrun() {
  const char* world = std::getenv("WORLD_SIZE");
  return std::getenv("OMPI_COMM_WORLD_SIZE") == nullptr && world != nullptr &&
         std::string(world) != "1" && std::getenv("MASTER_ADDR") != nullptr;
}

TEST(Communicator, EnvironmentPicksTheBackend) {
  // One process under a launcher needs no MPI (mpirun -np 1): the local backend.
  const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
  const bool launched = size != nullptr && std::string(size) != "1";
  if (under_torchrun()) {
    const char* named = std::getenv("PATRICKSTAR_COMM_BACKEND");
    EXPECT_EQ(comm().backend(), named != nullptr
                                    ? std::string(named)
                                    : std::string(nccl_available() ? "nccl" : "store"));
    EXPECT_EQ(comm().world_size(), std::stoi(std::getenv("WORLD_SIZE")));
    EXPECT_EQ(comm().rank(), std::stoi(std::getenv("RANK")));
  } else {
    EXPECT_EQ(comm().backend(), launched ? "mpi" : "local");
  }
  if (launched) {
    EXPECT_EQ(comm().world_size(), std::stoi(std::getenv("OMPI_COMM_WORLD_SIZE")));
  }
  EXPECT_GE(comm().rank(), 0);
  EXPECT_LT(comm().rank(), comm().world_size());
}

TEST(Communicator, AllGatherPutsEveryRanksChunkInRankOrder) {
  const int n_ranks = comm().world_size();
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf, at::kChar}) {
    for (int64_t n : {1, 1000, 65537}) {
      const at::Tensor in = values_of(comm().rank(), n, dtype);
      at::Tensor out = torch::full({n_ranks * n}, 7, at::TensorOptions().dtype(dtype));
      comm().all_gather(in, out);
      for (int r = 0; r < n_ranks; ++r) {
        EXPECT_TRUE(torch::equal(out.narrow(0, r * n, n), values_of(r, n, dtype)))
            << dtype << " n=" << n << " rank " << r;
      }
    }
  }
}

TEST(Communicator, AllGatherInPlaceFromThisRanksSliceOfTheGroupBuffer) {
  // ZeRO's pattern: this rank's chunk already sits in its slot of the group buffer.
  const int n_ranks = comm().world_size();
  const int me = comm().rank();
  const int64_t n = 777;
  at::Tensor group = torch::zeros({n_ranks * n}, at::kBFloat16);
  group.narrow(0, me * n, n).copy_(values_of(me, n, at::kBFloat16));
  comm().all_gather(group.narrow(0, me * n, n), group);
  for (int r = 0; r < n_ranks; ++r) {
    EXPECT_TRUE(torch::equal(group.narrow(0, r * n, n), values_of(r, n, at::kBFloat16))) << r;
  }
  // Any other overlap is refused before anything is sent.
  if (n_ranks > 1) {
    const int other = (me + 1) % n_ranks;
    EXPECT_NE(error_of([&] { comm().all_gather(group.narrow(0, other * n, n), group); })
                  .find("overlaps the output"),
              std::string::npos);
  }
  at::Tensor flat = torch::zeros({n_ranks * 8});
  EXPECT_NE(error_of([&] { comm().reduce_scatter_sum(flat, flat.narrow(0, 0, 8)); })
                .find("overlaps the input"),
            std::string::npos);
}

TEST(Communicator, ReduceScatterSumsInFp32AndGivesEachRankItsShard) {
  const int n_ranks = comm().world_size();
  const int me = comm().rank();
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const int64_t n = 4099;
    const at::Tensor in = values_of(me, n_ranks * n, dtype);
    at::Tensor out = torch::zeros({n});
    comm().reduce_scatter_sum(in, out);
    // The sum in fp32 of every rank's slice `me`, whatever order MPI adds them in: within a few
    // fp32 roundings of n_ranks terms.
    at::Tensor expected = torch::zeros({n}, at::kDouble);
    for (int r = 0; r < n_ranks; ++r) {
      expected += values_of(r, n_ranks * n, dtype).narrow(0, me * n, n).to(at::kDouble);
    }
    const double error = (out.to(at::kDouble) - expected).abs().max().item<double>();
    const double scale = expected.abs().max().item<double>();
    EXPECT_LE(error, 4 * n_ranks * 6e-8 * scale) << dtype;
    EXPECT_EQ(out.scalar_type(), at::kFloat);
  }
  // Integer-valued fp32: exact whatever the order.
  const at::Tensor ones = torch::full({n_ranks * 16}, static_cast<float>(me + 1));
  at::Tensor out = torch::zeros({16});
  comm().reduce_scatter_sum(ones, out);
  EXPECT_TRUE(torch::equal(out, torch::full({16}, n_ranks * (n_ranks + 1) / 2.0f)));
}

TEST(Communicator, AllReduceSumAndMaxAndBroadcast) {
  const int n_ranks = comm().world_size();
  const int me = comm().rank();
  at::Tensor sum = torch::tensor({1.0, static_cast<double>(me)}, at::kDouble);
  comm().all_reduce(sum, ReduceOp::kSum);
  EXPECT_EQ(sum[0].item<double>(), n_ranks);
  EXPECT_EQ(sum[1].item<double>(), n_ranks * (n_ranks - 1) / 2.0);
  at::Tensor flag = torch::tensor({me == n_ranks - 1 ? 1.0f : 0.0f, static_cast<float>(-me)});
  comm().all_reduce(flag, ReduceOp::kMax);
  EXPECT_EQ(flag[0].item<float>(), 1.0f);
  EXPECT_EQ(flag[1].item<float>(), 0.0f);
  at::Tensor count = torch::tensor({static_cast<int64_t>(me) * 10}, at::kLong);
  comm().all_reduce(count, ReduceOp::kSum);
  EXPECT_EQ(count.item<int64_t>(), 10 * n_ranks * (n_ranks - 1) / 2);

  const int root = n_ranks - 1;
  at::Tensor buffer = me == root ? values_of(root, 300, at::kBFloat16) : torch::zeros({300}, at::kBFloat16);
  comm().broadcast(buffer, root);
  EXPECT_TRUE(torch::equal(buffer, values_of(root, 300, at::kBFloat16)));
  comm().barrier();
}

TEST(Communicator, ReduceSumGivesTheRootTheSumAndLeavesTheOthersInputs) {
  const int n_ranks = comm().world_size();
  const int me = comm().rank();
  for (int root = 0; root < n_ranks; ++root) {
    at::Tensor buffer = values_of(me, 257, at::kFloat);
    const at::Tensor mine = buffer.clone();
    comm().reduce_sum(buffer, root);
    if (me == root) {
      at::Tensor expected = torch::zeros({257});
      for (int r = 0; r < n_ranks; ++r) expected += values_of(r, 257, at::kFloat);
      EXPECT_TRUE(torch::allclose(buffer, expected, 1e-6, 1e-6)) << "root " << root;
    } else {
      EXPECT_TRUE(torch::equal(buffer, mine)) << "root " << root;
    }
  }
  EXPECT_NE(error_of([] { comm().reduce_sum(torch::zeros({4}, at::kBFloat16), 0); }).find("fp32 or fp64"),
            std::string::npos);
  EXPECT_NE(error_of([&] { comm().reduce_sum(torch::zeros({4}), n_ranks); }).find("not a rank"),
            std::string::npos);
}

TEST(Communicator, CountersFollowTheFormulas) {
  const int n_ranks = comm().world_size();
  const CollectiveCounters before = comm().counters();
  at::Tensor in = torch::zeros({100}, at::kBFloat16);
  at::Tensor gathered = torch::zeros({n_ranks * 100}, at::kBFloat16);
  comm().all_gather(in, gathered);
  at::Tensor shard = torch::zeros({100});
  comm().reduce_scatter_sum(gathered, shard);
  at::Tensor two = torch::zeros({2}, at::kDouble);
  comm().all_reduce(two, ReduceOp::kSum);
  const CollectiveCounters& c = comm().counters();
  EXPECT_EQ(c.all_gather_calls - before.all_gather_calls, 1);
  EXPECT_EQ(c.all_gather_bytes - before.all_gather_bytes, n_ranks * 100 * 2);
  EXPECT_EQ(c.reduce_scatter_calls - before.reduce_scatter_calls, 1);
  EXPECT_EQ(c.reduce_scatter_bytes - before.reduce_scatter_bytes, n_ranks * 100 * 4);  // fp32 staged
  EXPECT_EQ(c.all_reduce_bytes - before.all_reduce_bytes, 16);
  comm().reduce_sum(shard, 0);
  EXPECT_EQ(comm().counters().reduce_calls - before.reduce_calls, 1);
  EXPECT_EQ(comm().counters().reduce_bytes - before.reduce_bytes, 100 * 4);
}

TEST(Communicator, BadArgumentsAreRefusedBeforeAnythingIsSent) {
  const int n_ranks = comm().world_size();
  at::Tensor in = torch::zeros({10});
  EXPECT_NE(error_of([&] { comm().all_gather(in, torch::zeros({n_ranks * 10 + 1})); })
                .find("must hold world_size"),
            std::string::npos);
  EXPECT_NE(error_of([&] { comm().all_gather(in, torch::zeros({n_ranks * 10}, at::kDouble)); })
                .find("must hold world_size"),
            std::string::npos);
  EXPECT_NE(error_of([&] { comm().reduce_scatter_sum(torch::zeros({n_ranks * 10}, at::kInt), in); })
                .find("takes fp32, bf16 or fp16"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              comm().all_gather(torch::zeros({4, 4}).t(), torch::zeros({n_ranks * 16}));
            }).find("contiguous CPU or CUDA tensor"),
            std::string::npos);
  EXPECT_NE(error_of([&] { comm().broadcast(in, n_ranks); }).find("is not a rank"), std::string::npos);
  EXPECT_NE(error_of([&] { comm().all_reduce(torch::zeros({2}, at::kBFloat16), ReduceOp::kSum); })
                .find("fp32, fp64 or int64"),
            std::string::npos);
  // The group is still in step after the refusals.
  at::Tensor one = torch::ones({1});
  comm().all_reduce(one, ReduceOp::kSum);
  EXPECT_EQ(one.item<float>(), n_ranks);
}

// Sub-groups: the ranks of one color, ranked by key (here the reverse of their rank), with counters
// of their own; the host's ranks as the launcher placed them. Collectives in a sub-group reach its
// ranks only.
TEST(Communicator, SplitGroupsTheRanksOfAColorRankedByKey) {
  const int n_ranks = comm().world_size();
  const int me = comm().rank();
  const std::unique_ptr<Communicator> parity = comm().split(me % 2, n_ranks - me);
  const int same_parity = (n_ranks - me % 2 + 1) / 2;  // ranks r < n_ranks with r % 2 == me % 2
  EXPECT_EQ(parity->world_size(), same_parity);
  // Keys descending with the rank: the highest rank of the color is rank 0 of the group.
  EXPECT_EQ(parity->rank(), same_parity - 1 - me / 2);
  EXPECT_EQ(parity->backend(), comm().backend());
  EXPECT_EQ(parity->counters().all_reduce_calls, 0);
  at::Tensor sum = torch::full({1}, static_cast<double>(me), at::kDouble);
  parity->all_reduce(sum, ReduceOp::kSum);
  double expected = 0;
  for (int r = me % 2; r < n_ranks; r += 2) expected += r;
  EXPECT_EQ(sum.item<double>(), expected);
  EXPECT_EQ(parity->counters().all_reduce_calls, 1);
  // A gather in the group: its ranks' chunks in the group's rank order.
  at::Tensor out = torch::zeros({parity->world_size() * 3});
  parity->all_gather(torch::full({3}, static_cast<float>(me)), out);
  for (int g = 0; g < parity->world_size(); ++g) {
    const int world_rank = me % 2 + 2 * (same_parity - 1 - g);
    EXPECT_EQ(out[g * 3].item<float>(), world_rank) << "group rank " << g;
  }
  const std::unique_ptr<Communicator> host = comm().split_by_host();
  const char* local =
      std::getenv(under_torchrun() ? "LOCAL_WORLD_SIZE" : "OMPI_COMM_WORLD_LOCAL_SIZE");
  EXPECT_EQ(host->world_size(), local != nullptr ? std::atoi(local) : 1);
  EXPECT_NE(error_of([] { comm().split(-1, 0); }).find("color -1 is negative"), std::string::npos);
  // The world is still in step.
  at::Tensor one = torch::ones({1});
  comm().all_reduce(one, ReduceOp::kSum);
  EXPECT_EQ(one.item<float>(), n_ranks);
}

}  // namespace communicator_test
}  // namespace patrickstar
