// EngineOptimizer reads its param group's options at every step, as torch::optim's Adam and AdamW
// do: a trainer that changes betas, eps or weight decay between steps gets LibTorch's result, and
// an option the engine cannot follow refuses the step naming it, nothing changed.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "gpt_training.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar {
namespace adam_options_test {

using namespace test;  // NOLINT: the shared helpers of gpt_training.h

constexpr int kSteps = 8;

// What the trainer does to its optimizer's first group before step s (both loops alike).
void change_options(torch::optim::Optimizer& optimizer, int s) {
  auto& options = static_cast<torch::optim::AdamWOptions&>(optimizer.param_groups()[0].options());
  if (s == 3) options.betas({0.8, 0.9}).eps(1e-6).weight_decay(0.1);
  if (s == 6) options.weight_decay(0.0).betas({0.85, 0.97});
}

std::vector<double> train_engine(const Config& config) {
  auto [model, optimizer] = initialize_engine([] { return make_model(1); }, 0, config);
  std::vector<double> losses;
  for (int s = 0; s < kSteps; ++s) {
    auto batch = on_test_device(batch_of_step(s));
    change_options(optimizer, s);
    optimizer.zero_grad();
    at::Tensor loss = model->loss(batch.tokens, batch.targets);
    model.backward(loss);
    optimizer.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

TEST(AdamOptions, BetasEpsAndWeightDecayChangedBetweenStepsGiveLibTorchsResult) {
  // Tolerance 1e-5 relative, as the engine's other fp32 equivalence tests (its Adam and
  // torch::optim's round differently); a missed change would differ by far more from step 4 on.
  const std::vector<double> plain = train_plain(kSteps, make_model(1), change_options);
  for (const std::string extra : {"{}", R"({"zero_optimization": {"overlap_step": true}})"}) {
    const std::vector<double> engine = train_engine(tight_config(extra));
    const double diff = max_relative_difference(engine, plain);
    EXPECT_LE(diff, 1e-5) << extra;
    std::cout << extra << ": options changed at steps 3 and 6, worst relative loss difference "
              << diff << " over " << kSteps << " steps\n";
  }
  // The same loop with the options left alone parts from it: the test sees the changes.
  auto [model, optimizer] = initialize_engine([] { return make_model(1); }, 0, tight_config());
  double last = 0;
  for (int s = 0; s < kSteps; ++s) {
    auto batch = on_test_device(batch_of_step(s));
    optimizer.zero_grad();
    at::Tensor loss = model->loss(batch.tokens, batch.targets);
    model.backward(loss);
    optimizer.step();
    last = loss.item<double>();
  }
  EXPECT_GT(std::abs(last - plain.back()) / std::abs(plain.back()), 1e-4);
}

TEST(AdamOptions, AnOptionTheEngineCannotFollowRefusesTheStepNamingItAndChangesNothing) {
  auto [model, optimizer] = initialize_engine([] { return make_model(1); }, 0, tight_config());
  auto& options = static_cast<torch::optim::AdamWOptions&>(optimizer.param_groups()[0].options());
  struct Case {
    std::string name;
    std::function<void()> set, reset;
  };
  const std::vector<Case> cases = {
      {"amsgrad", [&] { options.amsgrad(true); }, [&] { options.amsgrad(false); }},
      {"beta1",
       [&] {
         options.betas({1.0, 0.95});
       },
       [&] {
         options.betas({0.9, 0.95});
       }},
      {"eps", [&] { options.eps(-1e-8); }, [&] { options.eps(1e-8); }},
      {"weight_decay", [&] { options.weight_decay(-0.1); }, [&] { options.weight_decay(0.01); }},
      {"lr", [&] { options.set_lr(-1e-3); }, [&] { options.set_lr(3e-3); }},
  };
  auto batch = on_test_device(batch_of_step(0));
  for (const Case& c : cases) {
    optimizer.zero_grad();
    model.backward(model->loss(batch.tokens, batch.targets));
    const std::vector<std::pair<std::string, at::Tensor>> before = model.engine().fp32_state_dict();
    c.set();
    try {
      optimizer.step();
      ADD_FAILURE() << c.name << ": the step was taken";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(c.name), std::string::npos) << e.what();
    }
    const AdamHyperparameters now = model.engine().adam_hyperparameters();
    EXPECT_EQ(now.beta1, 0.9);
    EXPECT_EQ(now.eps, 1e-8);
    EXPECT_EQ(now.weight_decay, 0.01);
    EXPECT_EQ(model.engine().lr(), 3e-3);
    const auto after = model.engine().fp32_state_dict();
    for (size_t i = 0; i < before.size(); ++i) {
      EXPECT_TRUE(torch::equal(before[i].second, after[i].second))
          << c.name << ": " << after[i].first;
    }
    c.reset();
    optimizer.step();  // the gradients are still there: the step goes on
  }
  // bf16 optimizer states cannot follow a beta2 of 0.999 (as the config refuses it).
  auto [model16, optimizer16] =
      initialize_engine([] { return make_model(1); }, 0,
                        tight_config(R"({"optimizer": {"params": {"state_dtype": "bf16"}}})"));
  static_cast<torch::optim::AdamWOptions&>(optimizer16.param_groups()[0].options())
      .betas({0.9, 0.999});
  optimizer16.zero_grad();
  model16.backward(model16->loss(batch.tokens, batch.targets));
  try {
    optimizer16.step();
    ADD_FAILURE() << "bf16 states took beta2 0.999";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("beta2"), std::string::npos) << e.what();
  }
  EXPECT_EQ(model16.engine().adam_hyperparameters().beta2, 0.95);
}

}  // namespace adam_options_test
}  // namespace patrickstar
