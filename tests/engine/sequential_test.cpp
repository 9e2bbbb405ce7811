// torch::nn::Sequential needs no doors of its own (issue: engine): every entry runs behind one
// automatically, both as the whole model (model->forward) and as a member (patrickstar::call).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <set>
#include <string>
#include <nlohmann/json.hpp>

#include "patrickstar/engine/engine_inspect.h"
#include "patrickstar/patrickstar.h"
#include "test_device.h"

namespace patrickstar {
namespace sequential_test {

torch::nn::Sequential make_mlp() {
  torch::manual_seed(7);
  return torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(),
                               torch::nn::Linear(64, 32));
}

std::pair<at::Tensor, at::Tensor> data_of_step(int step) {
  torch::manual_seed(100 + step);
  at::Tensor x = torch::randn({8, 32});
  return {x, torch::tanh(x.flip(1))};
}

// On the test device (tests/test_device.h); the plain twins train on the CPU.
class SequentialDoors : public test::OnTestDevice {};

TEST_F(SequentialDoors, SequentialModelTrainsLikePlainLibTorch) {
  constexpr int kSteps = 10;
  std::vector<double> plain;
  {
    auto model = make_mlp();
    torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-2));
    for (int s = 0; s < kSteps; ++s) {
      auto [x, y] = data_of_step(s);
      adamw.zero_grad();
      at::Tensor loss = torch::mse_loss(model->forward(x), y);
      loss.backward();
      adamw.step();
      plain.push_back(loss.item<double>());
    }
  }
  // Two chunks (one per Linear) and a device that cannot hold both with their gradients.
  Config config = Config::from_json(
      {{"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.01}}}}},
       {"default_chunk_size", 2112},
       {"client",
        {{"device", {{"capacity_bytes", 48000}}},
         {"mem_tracer", {{"warmup_gpu_chunk_mem_ratio", 1.0}, {"overall_gpu_mem_ratio", 1.0}}}}}});
  test::use_test_device(config);
  auto [model, optimizer] = initialize_engine(make_mlp, 0, config);
  std::vector<double> losses;
  int64_t moved = 0;
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = data_of_step(s);
    optimizer.zero_grad();
    at::Tensor loss =
        torch::mse_loss(model->forward(x.to(test::test_device())), y.to(test::test_device()));
    model.backward(loss);
    const IterationReport r = optimizer.step();
    if (s > 0) moved += r.h2d_bytes;
    losses.push_back(loss.item<double>());
  }
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_NEAR(losses[s], plain[s], 1e-5 * std::abs(plain[s])) << "step " << s;
  }
  EXPECT_LT(plain.back(), plain.front());
  // Each Linear had its own moments (ReLU owns no parameter), forward and backward.
  std::multiset<std::string> labels;
  for (const Moment& m : inspect(model.engine()).tracer().warmup_trace().moments) labels.insert(m.label);
  EXPECT_EQ(labels.count("0"), 2u);
  EXPECT_EQ(labels.count("2"), 2u);
  EXPECT_EQ(labels.count("1"), 0u);
  EXPECT_GT(moved, 0) << "the device should force chunk moves";
}

// A Sequential inside a user's module: the one-line door runs its entries behind doors.
struct WithStack : torch::nn::Module {
  WithStack() {
    stack = register_module("stack", make_mlp());
  }
  at::Tensor forward(const at::Tensor& x) { return call(stack, x); }
  torch::nn::Sequential stack{nullptr};
};

TEST_F(SequentialDoors, MemberSequentialThroughCall) {
  Config config = Config::from_json({{"default_chunk_size", 2112}});
  auto [model, optimizer] = initialize_engine(
      [] { return std::make_shared<WithStack>(); }, 0, test::use_test_device(config));
  auto [x, y] = data_of_step(0);
  at::Tensor loss =
      torch::mse_loss(model->forward(x.to(test::test_device())), y.to(test::test_device()));
  model.backward(loss);
  optimizer.step();
  std::set<std::string> labels;
  for (const Moment& m : inspect(model.engine()).tracer().warmup_trace().moments) labels.insert(m.label);
  EXPECT_TRUE(labels.count("stack.0") && labels.count("stack.2")) << labels.size();
  // Without an engine it is the plain Sequential.
  auto plain = std::make_shared<WithStack>();
  EXPECT_TRUE(torch::equal(plain->forward(x), plain->stack->forward(x)));
}

}  // namespace sequential_test
}  // namespace patrickstar
