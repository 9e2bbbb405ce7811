// LibTorch's gradient idioms under data parallel (the rows of the README's table "LibTorch idioms
// that touch gradients" that differ with several ranks), written as LibTorch's distributed MNIST
// example writes its loop: model->zero_grad() at the top, plain loss.backward(), optimizer.step().
// Run as one process (ctest's discovered tests) and under mpirun with 2 and 4 ranks.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "distributed/ranks.h"
#include "engine/small_net.h"
#include "error_message.h"
#include "patrickstar/comm/communicator.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar {
namespace idioms_data_parallel_test {

using namespace test;  // NOLINT: the shared helpers of the engine tests

at::Tensor loss_on_my_rows(Net& net, int step) {
  return torch::mse_loss(net->forward(my_rows(input_of(step))).to(at::kFloat),
                         my_rows(target_of(step)));
}

std::string config_of(const std::string& precision) {
  return precision == "bf16" ? R"({"bf16": {"enabled": true}})" : "{}";
}

TEST(DataParallelIdioms, ModelZeroGradMatchesPlainLibTorchOnTheGlobalBatch) {
  // fp32 (a gradient space, where gradients that were never reset add up across steps) and bf16.
  for (const char* precision : {"fp32", "bf16"}) {
    Net plain = seeded_net();
    torch::optim::Adam adam = plain_adam(plain->parameters());
    Net net = seeded_net();
    auto [model, optimizer] =
        initialize_engine([&] { return net; }, 0, small_device(config_of(precision)));
    for (int s = 0; s < 8; ++s) {
      plain->zero_grad();
      torch::mse_loss(plain->forward(input_of(s)), target_of(s)).backward();
      adam.step();
      net->zero_grad();
      loss_on_my_rows(net, s).backward();
      optimizer.step();
    }
    const auto expected = plain->named_parameters();
    const bool fp32 = std::string(precision) == "fp32";
    for (const auto& [name, value] : model.engine().fp32_state_dict()) {
      // fp32: the ranks sum in another order (rounding); bf16: the compute dtype's rounding.
      EXPECT_TRUE(torch::allclose(value, expected[name], fp32 ? 1e-4 : 5e-2, fp32 ? 1e-5 : 5e-3))
          << precision << " " << name << ": "
          << (value - expected[name]).abs().max().item<double>();
    }
  }
}

TEST(DataParallelIdioms, GradientsZeroedInPlaceAreSteppedWhereTheLossDoesNotReach) {
  // fc1 trained for 3 steps, then frozen for 3, with zero_grad(false): LibTorch's Adam goes on
  // moving fc1 with zero gradients. fp32 (a gradient space) does the same at the owners.
  Net plain = seeded_net();
  torch::optim::Adam adam = plain_adam(plain->parameters());
  Net net = seeded_net();
  auto [model, optimizer] = initialize_engine([&] { return net; }, 0, small_device());
  for (int s = 0; s < 6; ++s) {
    for (auto& p : plain->fc1->parameters()) p.requires_grad_(s < 3);
    for (auto& p : net->fc1->parameters()) p.requires_grad_(s < 3);
    plain->zero_grad(/*set_to_none=*/false);
    torch::mse_loss(plain->forward(input_of(s)), target_of(s)).backward();
    adam.step();
    net->zero_grad(/*set_to_none=*/false);
    loss_on_my_rows(net, s).backward();
    optimizer.step();
  }
  const auto expected = plain->named_parameters();
  for (const auto& [name, value] : model.engine().fp32_state_dict()) {
    EXPECT_TRUE(torch::allclose(value, expected[name], 1e-4, 1e-5))
        << name << ": " << (value - expected[name]).abs().max().item<double>();
  }
  // bf16 without a gradient space cannot hold such a zero gradient across ranks: refused.
  if (comm()->world_size() == 1) return;
  Net half = seeded_net();
  auto [half_model, half_optimizer] =
      initialize_engine([&] { return half; }, 0, small_device(config_of("bf16")));
  loss_on_my_rows(half, 0).backward();
  half_optimizer.step();
  for (auto& p : half->fc1->parameters()) p.requires_grad_(false);
  half->zero_grad(/*set_to_none=*/false);
  loss_on_my_rows(half, 1).backward();
  const std::string error = test::error_of([&] { half_optimizer.step(); });
  EXPECT_NE(error.find("set_to_none"), std::string::npos) << error;
}

TEST(DataParallelIdioms, ClippingThroughLibTorchIsRefused) {
  if (comm()->world_size() == 1) GTEST_SKIP() << "one process: clipping works (LibTorchIdioms)";
  Net net = seeded_net();
  auto [model, optimizer] = initialize_engine([&] { return net; }, 0, small_device());
  net->zero_grad();
  loss_on_my_rows(net, 0).backward();
  const std::string error =
      test::error_of([&] { torch::nn::utils::clip_grad_norm_(net->parameters(), 1.0); });
  EXPECT_NE(error.find("gradient_clipping"), std::string::npos) << error;
  // The gradients are untouched: the step still trains, and zero_grad() works after it.
  optimizer.step();
  net->zero_grad();
  loss_on_my_rows(net, 1).backward();
  optimizer.step();
}

TEST(DataParallelIdioms, ASubmodulesZeroGradWithGradientsIsRefused) {
  if (comm()->world_size() == 1) GTEST_SKIP() << "one process: it drops fc1's gradients";
  Net net = seeded_net();
  auto [model, optimizer] = initialize_engine([&] { return net; }, 0, small_device());
  loss_on_my_rows(net, 0).backward();
  net->fc1->zero_grad();
  const std::string error = test::error_of([&] { optimizer.step(); });
  EXPECT_NE(error.find("reset alone"), std::string::npos) << error;
  // The whole model's zero_grad() is the way on.
  net->zero_grad();
  loss_on_my_rows(net, 1).backward();
  optimizer.step();
}

}  // namespace idioms_data_parallel_test
}  // namespace patrickstar
