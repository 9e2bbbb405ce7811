// The LibTorch idioms that touch gradients, written as LibTorch's own examples write them, against
// plain LibTorch: Module::zero_grad() (the model's or a submodule's, set_to_none either way),
// reading p.grad() after backward, clip_grad_norm_ / clip_grad_value_ over model->parameters(),
// assigning a gradient, gradual unfreezing (Adam's step per parameter, also through a checkpoint),
// and a second LibTorch optimizer over the model's parameters (refused). One row each of the
// README's table "LibTorch idioms that touch gradients".
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "error_message.h"
#include "patrickstar/patrickstar.h"
#include "small_net.h"
#include "temp_folder.h"

namespace patrickstar {
namespace libtorch_idioms_test {

using test::input_of;
using test::Net;
using test::plain_adam;
using test::seeded_net;
using test::small_device;
using test::target_of;

// The loss as a mixed-precision trainer writes it: the output back in fp32 for the loss.
at::Tensor loss_of(Net& model, int step) {
  return torch::mse_loss(model->forward(input_of(step)).to(at::kFloat), target_of(step));
}

enum class Zero { kOptimizer, kModelToNone, kModelToZeros, kModelAfterForward };

std::string config_of(const std::string& precision, int accumulation) {
  std::string j = "{\"gradient_accumulation_steps\": " + std::to_string(accumulation);
  if (precision == "bf16") j += ", \"bf16\": {\"enabled\": true}";
  return j + "}";
}

// `steps` iterations of the MNIST example's loop (zero_grad at the top, two backward passes per
// step when accumulating) through an engine; the losses.
std::vector<double> engine_losses(const std::string& precision, int accumulation, Zero zero,
                                  int steps) {
  Net net = seeded_net();
  auto [model, optimizer] =
      initialize_engine([&] { return net; }, 0, small_device(config_of(precision, accumulation)));
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    if (zero == Zero::kOptimizer) optimizer.zero_grad();
    if (zero == Zero::kModelToNone) net->zero_grad();
    if (zero == Zero::kModelToZeros) net->zero_grad(/*set_to_none=*/false);
    for (int k = 0; k < accumulation; ++k) {
      at::Tensor loss = loss_of(net, s * accumulation + k);
      // Between the forward and the backward, as a GAN's generator step does.
      if (zero == Zero::kModelAfterForward && k == 0) net->zero_grad();
      model.backward(loss);
      losses.push_back(loss.item<double>());
    }
    optimizer.step();
  }
  return losses;
}

// The same loop in plain LibTorch (fp32), the loss divided by the accumulation as the engine's
// backward does.
std::vector<double> plain_losses(int accumulation, int steps) {
  Net plain = seeded_net();
  torch::optim::Adam adam = plain_adam(plain->parameters());
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    plain->zero_grad();
    for (int k = 0; k < accumulation; ++k) {
      at::Tensor loss = loss_of(plain, s * accumulation + k);
      (loss / accumulation).backward();
      losses.push_back(loss.item<double>());
    }
    adam.step();
  }
  return losses;
}

TEST(LibTorchIdioms, ModuleZeroGradReachesTheEngine) {
  // fp32 keeps a gradient space: before the fix the model's zero_grad() never reached it and the
  // gradients of every step added up.
  for (int accumulation : {1, 2}) {
    const std::vector<double> expected = plain_losses(accumulation, 8);
    for (Zero zero : {Zero::kModelToNone, Zero::kModelToZeros, Zero::kModelAfterForward}) {
      const std::vector<double> got = engine_losses("fp32", accumulation, zero, 8);
      ASSERT_EQ(got.size(), expected.size());
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_NEAR(got[i], expected[i], 1e-5 * expected[i])
            << "accumulation " << accumulation << ", zero_grad kind " << static_cast<int>(zero)
            << ", loss " << i;
      }
    }
  }
}

TEST(LibTorchIdioms, ModuleZeroGradInBf16IsTheOptimizersZeroGrad) {
  // bf16 with and without a gradient space: the model's zero_grad() trains bit for bit as the
  // optimizer's, and both stay near plain fp32 LibTorch.
  for (int accumulation : {1, 2}) {
    const std::vector<double> reference = engine_losses("bf16", accumulation, Zero::kOptimizer, 6);
    const std::vector<double> plain = plain_losses(accumulation, 6);
    for (Zero zero : {Zero::kModelToNone, Zero::kModelToZeros}) {
      const std::vector<double> got = engine_losses("bf16", accumulation, zero, 6);
      ASSERT_EQ(got.size(), reference.size());
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(got[i], reference[i]) << "accumulation " << accumulation << ", loss " << i;
        EXPECT_NEAR(got[i], plain[i], 0.05 * plain[i]) << "accumulation " << accumulation;
      }
    }
  }
}

// Weights by name after `steps` steps of `train` on a plain model and on its port.
void expect_same_weights(Engine& engine, Net& plain, double rtol, double atol) {
  const auto params = plain->named_parameters();
  for (const auto& [name, value] : engine.fp32_state_dict()) {
    EXPECT_TRUE(torch::allclose(value, params[name], rtol, atol))
        << name << ": " << (value - params[name]).abs().max().item<double>();
  }
}

TEST(LibTorchIdioms, ASubmodulesZeroGradDropsOnlyItsGradients) {
  // After backward, fc1's gradients are reset: Adam skips fc1 (LibTorch skips undefined
  // gradients) and steps fc2.
  for (bool set_to_none : {true, false}) {
    Net plain = seeded_net();
    torch::optim::Adam adam = plain_adam(plain->parameters());
    Net net = seeded_net();
    auto [model, optimizer] = initialize_engine([&] { return net; }, 0, small_device());
    for (int s = 0; s < 4; ++s) {
      adam.zero_grad();
      optimizer.zero_grad();
      loss_of(plain, s).backward();
      loss_of(net, s).backward();
      if (s == 1) {
        plain->fc1->zero_grad(set_to_none);
        net->fc1->zero_grad(set_to_none);
      }
      adam.step();
      optimizer.step();
    }
    expect_same_weights(model.engine(), plain, 1e-5, 1e-6);
  }
}

// fc1 trained for 3 steps, then frozen for 3, gradients zeroed with zero_grad(false) at the top
// of each step (through the model or the optimizer); the fp32 weights after.
std::vector<at::Tensor> zeroed_in_place_run(const std::string& precision, bool through_model) {
  Net net = seeded_net();
  auto [model, optimizer] =
      initialize_engine([&] { return net; }, 0, small_device(config_of(precision, 1)));
  for (int s = 0; s < 6; ++s) {
    for (auto& p : net->fc1->parameters()) p.requires_grad_(s < 3);
    if (through_model) {
      net->zero_grad(/*set_to_none=*/false);
    } else {
      optimizer.zero_grad(/*set_to_none=*/false);
    }
    loss_of(net, s).backward();
    optimizer.step();
  }
  std::vector<at::Tensor> weights;
  for (const auto& [name, value] : model.engine().fp32_state_dict()) weights.push_back(value);
  return weights;
}

TEST(LibTorchIdioms, GradientsZeroedInPlaceAreSteppedWhereTheLossDoesNotReach) {
  // zero_grad(false) keeps the gradients defined at zero: LibTorch's Adam goes on moving fc1 (its
  // momentum) while fc1 is frozen.
  Net plain = seeded_net();
  torch::optim::Adam adam = plain_adam(plain->parameters());
  for (int s = 0; s < 6; ++s) {
    for (auto& p : plain->fc1->parameters()) p.requires_grad_(s < 3);
    plain->zero_grad(/*set_to_none=*/false);
    loss_of(plain, s).backward();
    adam.step();
  }
  const auto expected = plain->parameters();  // fc1.weight, fc1.bias, fc2.weight, fc2.bias
  for (bool through_model : {true, false}) {
    const std::vector<at::Tensor> got = zeroed_in_place_run("fp32", through_model);
    ASSERT_EQ(got.size(), expected.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(torch::allclose(got[i], expected[i], 1e-5, 1e-6))
          << "through the model " << through_model << ", parameter " << i << ": "
          << (got[i] - expected[i]).abs().max().item<double>();
    }
  }
  // bf16 without a gradient space: the two ways agree bit for bit.
  const std::vector<at::Tensor> by_model = zeroed_in_place_run("bf16", true);
  const std::vector<at::Tensor> by_optimizer = zeroed_in_place_run("bf16", false);
  for (size_t i = 0; i < by_model.size(); ++i) {
    EXPECT_TRUE(torch::equal(by_model[i], by_optimizer[i])) << "parameter " << i;
  }
}

TEST(LibTorchIdioms, GradientsReadAfterBackwardAreTheEngines) {
  for (const char* precision : {"fp32", "bf16"}) {
    Net plain = seeded_net();
    Net net = seeded_net();
    auto [model, optimizer] =
        initialize_engine([&] { return net; }, 0, small_device(config_of(precision, 1)));
    loss_of(plain, 0).backward();
    loss_of(net, 0).backward();
    const auto expected = plain->named_parameters();
    for (const auto& item : net->named_parameters()) {
      ASSERT_TRUE(item.value().grad().defined()) << item.key();
      const at::Tensor got = item.value().grad().to(at::kFloat);
      const at::Tensor want = expected[item.key()].grad();
      // bf16: the gradient of a bf16 forward, rounded to bf16 (8 bits of mantissa).
      const double tolerance = std::string(precision) == "fp32" ? 1e-6 : 3e-2;
      EXPECT_LE((got - want).abs().max().item<double>(),
                tolerance * want.abs().max().item<double>())
          << precision << " " << item.key();
      // Per-layer norms for logging, as trainers write them.
      EXPECT_NEAR(item.value().grad().norm().item<double>(), want.norm().item<double>(),
                  tolerance * 4 * want.norm().item<double>() + 1e-7);
    }
    const at::Tensor kept = net->fc1->weight.grad();
    optimizer.step();
    // A view kept past the next call into the engine refuses to be read.
    const std::string error = test::error_of([&] { (void)kept.sum().item<double>(); });
    EXPECT_NE(error.find("the gradient of parameter fc1.weight cannot be read here"),
              std::string::npos)
        << error;
  }
}

TEST(LibTorchIdioms, AfterAStepGradientsReadAsLibTorchsOrRefuse) {
  // fp32 (a gradient space): after the step p.grad() still holds the gradient the step used, as
  // in LibTorch. bf16 without a gradient space: the step overwrote it, and a read says so.
  Net plain = seeded_net();
  torch::optim::Adam adam = plain_adam(plain->parameters());
  Net net = seeded_net();
  auto [model, optimizer] = initialize_engine([&] { return net; }, 0, small_device());
  loss_of(plain, 0).backward();
  loss_of(net, 0).backward();
  adam.step();
  optimizer.step();
  EXPECT_TRUE(torch::allclose(net->fc2->weight.grad(), plain->fc2->weight.grad(), 1e-6, 1e-8));

  Net half = seeded_net();
  auto [half_model, half_optimizer] =
      initialize_engine([&] { return half; }, 0, small_device(config_of("bf16", 1)));
  loss_of(half, 0).backward();
  half_optimizer.step();
  // Still defined (Module::zero_grad() must find it) but a marker without data: reading a value
  // throws, never gives numbers that are not the gradient.
  ASSERT_TRUE(half->fc2->weight.grad().defined());
  EXPECT_TRUE(half->fc2->weight.grad().is_meta());
  EXPECT_NE(test::error_of([&] { (void)half->fc2->weight.grad().sum().item<double>(); }),
            "<no error>");
  EXPECT_NE(test::error_of([&] {
              (void)(half->fc2->weight.grad() + torch::ones({4, 32}));
            }),
            "<no error>");
  const std::string error = test::error_of([&] { (void)half->fc2->weight.grad().to(at::kCPU); });
  EXPECT_NE(error, "<no error>");
}

TEST(LibTorchIdioms, ClippingThroughLibTorchClipsTheEnginesGradients) {
  for (bool by_norm : {true, false}) {
    Net plain = seeded_net();
    torch::optim::Adam adam = plain_adam(plain->parameters());
    Net net = seeded_net();
    auto [model, optimizer] = initialize_engine([&] { return net; }, 0, small_device());
    for (int s = 0; s < 6; ++s) {
      adam.zero_grad();
      net->zero_grad();
      loss_of(plain, s).backward();
      loss_of(net, s).backward();
      if (by_norm) {
        const double a = torch::nn::utils::clip_grad_norm_(plain->parameters(), 0.05);
        const double b = torch::nn::utils::clip_grad_norm_(net->parameters(), 0.05);
        EXPECT_NEAR(a, b, 1e-5 * a) << "step " << s;
        EXPECT_GT(a, 0.05) << "the test must clip";
      } else {
        torch::nn::utils::clip_grad_value_(plain->parameters(), 0.01);
        torch::nn::utils::clip_grad_value_(net->parameters(), 0.01);
      }
      adam.step();
      optimizer.step();
    }
    expect_same_weights(model.engine(), plain, 1e-5, 1e-6);
  }
}

TEST(LibTorchIdioms, AnAssignedGradientIsTheOneTheStepUses) {
  Net plain = seeded_net();
  torch::optim::Adam adam = plain_adam(plain->parameters());
  Net net = seeded_net();
  auto [model, optimizer] = initialize_engine([&] { return net; }, 0, small_device());
  loss_of(plain, 0).backward();
  loss_of(net, 0).backward();
  plain->fc1->bias.mutable_grad() = torch::full({32}, 0.5);
  net->fc1->bias.mutable_grad() = torch::full({32}, 0.5);
  adam.step();
  optimizer.step();
  expect_same_weights(model.engine(), plain, 1e-6, 1e-7);
}

TEST(LibTorchIdioms, GradualUnfreezingCountsAdamStepsPerParameter) {
  // fc1 frozen for 3 steps, then trained: its first update has Adam's bias correction of step 1.
  // Halfway, a checkpoint saves and a new engine resumes from it.
  test::TempFolder folder("unfreeze");
  const std::string path = folder.path() + "/ckpt.pt";
  Net plain = seeded_net();
  torch::optim::Adam adam = plain_adam(plain->parameters());
  for (int s = 0; s < 8; ++s) {
    for (auto& p : plain->fc1->parameters()) p.requires_grad_(s >= 3);
    adam.zero_grad();
    loss_of(plain, s).backward();
    adam.step();
  }
  Net net = seeded_net();
  {
    auto [model, optimizer] = initialize_engine([&] { return net; }, 0, small_device());
    for (int s = 0; s < 5; ++s) {
      for (auto& p : net->fc1->parameters()) p.requires_grad_(s >= 3);
      optimizer.zero_grad();
      loss_of(net, s).backward();
      optimizer.step();
    }
    model.engine().save_checkpoint(path);
  }
  Net resumed = seeded_net();
  auto [model, optimizer] = initialize_engine([&] { return resumed; }, 0, small_device());
  model.engine().load_checkpoint(path);
  for (int s = 5; s < 8; ++s) {
    optimizer.zero_grad();
    loss_of(resumed, s).backward();
    optimizer.step();
  }
  expect_same_weights(model.engine(), plain, 1e-5, 1e-6);
}

TEST(LibTorchIdioms, ASecondLibTorchOptimizerOverTheParametersIsRefused) {
  Net net = seeded_net();
  auto [model, optimizer] = initialize_engine([&] { return net; }, 0, small_device());
  torch::optim::SGD sgd(net->fc2->parameters(), torch::optim::SGDOptions(0.1));
  loss_of(net, 0).backward();
  const std::string error = test::error_of([&] { sgd.step(); });
  EXPECT_NE(error.find("fc2"), std::string::npos) << error;
}

}  // namespace libtorch_idioms_test
}  // namespace patrickstar
