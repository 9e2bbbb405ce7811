// Parameter groups under data parallel: each rank steps the chunks it owns with each tensor's group
// options. Two AdamW groups with their schedules on the ranks' rows train as torch::optim::AdamW
// with the same groups on the global batch. Run as one process (ctest's discovered tests) and under
// mpirun with 2 and 4 ranks (distributed.mpi_*_ranks).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <vector>

#include "distributed/data_parallel_helpers.h"
#include "distributed/ranks.h"
#include "engine/gpt_training.h"
#include "engine/param_groups_recipe.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar {
namespace param_groups_dp_test {

using namespace test;  // NOLINT: the shared helpers of the engine tests

constexpr int kSteps = 8;

TEST(ParamGroupsDataParallel, TwoAdamWGroupsOnTheRanksTrainAsTorchOptimAdamWOnTheGlobalBatch) {
  models::Gpt plain = make_model(1);
  auto [decay, no_decay] = split(*plain);
  torch::optim::AdamW adamw = two_group_adamw(decay, no_decay);
  std::vector<double> expected;
  for (int s = 0; s < kSteps; ++s) {
    schedule(adamw, s);
    adamw.zero_grad();
    const auto batch = batch_of_step(s);
    at::Tensor loss = plain->loss(batch.tokens, batch.targets);
    loss.backward();
    adamw.step();
    expected.push_back(loss.item<double>());
  }
  // Every rank builds its model from another seed: the engine starts all of them from rank 0's.
  auto [model, optimizer] = initialize_engine(
      [] { return make_model(1 + static_cast<uint64_t>(me()) * 17); }, 0, grouped_config("{}"));
  std::vector<double> losses;
  int64_t moved = 0;
  for (int s = 0; s < kSteps; ++s) {
    schedule(optimizer, s);
    optimizer.zero_grad();
    const auto batch = on_test_device(batch_of_step(s));
    at::Tensor loss = model->loss(my_rows(batch.tokens), my_rows(batch.targets));
    model.backward(loss);
    const IterationReport report = optimizer.step();
    if (s >= 2) moved += report.h2d_bytes;
    losses.push_back(mean_over_ranks(loss.item<double>()));
  }
  // Tolerance 1e-6 relative, every step: the ranks sum the gradients in another order than one
  // process does (fp32 rounding), and the global loss is the mean of the ranks' means.
  const double diff = max_relative_difference(losses, expected);
  EXPECT_LE(diff, 1e-6);
  EXPECT_GT(moved, 0) << "the device must be too small to hold a rank's share";
  if (me() == 0) {
    std::printf(
        "%d rank(s): two AdamW groups with their schedules, worst relative loss difference "
        "to torch::optim::AdamW on the global batch %.3g over %d steps\n",
        ranks(), diff, kSteps);
  }
}

}  // namespace param_groups_dp_test
}  // namespace patrickstar
