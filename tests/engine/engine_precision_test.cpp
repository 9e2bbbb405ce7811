// Mixed precision under the engine: gradients accumulated in a gradient space reach Adam in fp32
// (never rounded to half first), and a parameter shared between a checkpointed block and the rest
// of the model (or checkpointed twice) gets every backward use's gradient, while a later recompute
// still reads its weight, not a gradient.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "patrickstar/patrickstar.h"
#include "test_device.h"

namespace patrickstar {
namespace engine_precision_test {

torch::nn::Sequential mlp() {
  torch::manual_seed(3);
  return torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::Tanh(),
                               torch::nn::Linear(32, 8));
}

at::Tensor micro_input(int k) {
  torch::manual_seed(40 + k);
  return torch::randn({4, 16});
}
at::Tensor micro_target(int k) {
  torch::manual_seed(80 + k);
  return torch::randn({4, 8});
}

// One Adam step (eps large, so the update follows the gradient's value, not only its sign).
std::vector<at::Tensor> adam_once(const std::vector<at::Tensor>& weights,
                                  const std::vector<at::Tensor>& grads) {
  std::vector<at::Tensor> params;
  for (const at::Tensor& w : weights) params.push_back(w.clone().requires_grad_(true));
  torch::optim::Adam adam(params, torch::optim::AdamOptions(1e-2).eps(0.1));
  for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[i].clone();
  adam.step();
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : params) out.push_back(p.detach());
  return out;
}

double max_difference(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>());
  }
  return worst;
}

// On the test device (tests/test_device.h); the plain references compute on the CPU.
class EnginePrecision : public test::OnTestDevice {};

TEST_F(EnginePrecision, AccumulatedBf16GradientsReachAdamInFp32) {
  // The reference: the same bf16 model in plain LibTorch, on the test device (a GPU's bf16 matmul
  // rounds its gradients otherwise than a CPU's); each micro-batch's bf16 gradients summed in fp32,
  // then one fp32 Adam step on the fp32 weights.
  const c10::Device device = test::test_device();
  torch::nn::Sequential plain = mlp();
  std::vector<at::Tensor> initial;
  for (const at::Tensor& p : plain->parameters()) initial.push_back(p.detach().clone());
  plain->to(device, at::kBFloat16);
  std::vector<at::Tensor> sum(initial.size());
  for (int k = 0; k < 2; ++k) {
    for (at::Tensor& p : plain->parameters()) p.mutable_grad().reset();
    at::Tensor out = plain->forward(micro_input(k).to(device, at::kBFloat16));
    (torch::mse_loss(out.to(at::kFloat), micro_target(k).to(device)) * 0.5).backward();
    const auto params = plain->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor g = params[i].grad().to(at::kCPU, at::kFloat);
      sum[i] = k == 0 ? g : sum[i] + g;
    }
  }
  const std::vector<at::Tensor> fp32_reference = adam_once(initial, sum);
  std::vector<at::Tensor> rounded;
  for (const at::Tensor& g : sum) rounded.push_back(g.to(at::kBFloat16).to(at::kFloat));
  const std::vector<at::Tensor> rounded_reference = adam_once(initial, rounded);

  torch::nn::Sequential model = mlp();
  Config config = Config::from_string(R"({"bf16": {"enabled": true},
      "gradient_accumulation_steps": 2, "default_chunk_size": 1024,
      "optimizer": {"type": "Adam", "params": {"lr": 0.01, "eps": 0.1}}})");
  Engine engine(model.ptr(), test::use_test_device(config));
  engine.zero_grad();
  for (int k = 0; k < 2; ++k) {
    at::Tensor out;
    {
      auto active = engine.activate();
      out = patrickstar::call(model, micro_input(k).to(test::test_device(), at::kBFloat16));
    }
    engine.backward(torch::mse_loss(out.to(at::kFloat), micro_target(k).to(test::test_device())));
  }
  engine.step();
  std::vector<at::Tensor> trained;
  for (auto& [name, w] : engine.fp32_state_dict()) trained.push_back(w);

  const double rounding = max_difference(rounded_reference, fp32_reference);
  const double ours = max_difference(trained, fp32_reference);
  std::printf("bf16 accumulation: master vs fp32-gradient reference %.3g; rounding the gradients "
              "to bf16 first would give %.3g\n", ours, rounding);
  ASSERT_GT(rounding, 0.0) << "the test needs gradients that bf16 cannot hold exactly";
  EXPECT_LT(ours, rounding / 10);
}

enum class Sharing { kPlainAndCheckpointed, kCheckpointedTwice };

struct SharedNetImpl : torch::nn::Module {
  SharedNetImpl(Sharing sharing, bool checkpointed) : sharing(sharing), checkpointed(checkpointed) {
    torch::manual_seed(11);
    in = register_module("in", torch::nn::Linear(8, 16));
    shared = register_module("shared", torch::nn::Linear(16, 16));
    out = register_module("out", torch::nn::Linear(16, 4));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = torch::tanh(patrickstar::call(in, x));
    auto block = [this](const at::Tensor& t) { return torch::tanh(patrickstar::call(shared, t)); };
    auto run = [&](const at::Tensor& t) {
      return checkpointed ? patrickstar::checkpoint(block, t) : block(t);
    };
    if (sharing == Sharing::kPlainAndCheckpointed) {
      h = block(h);  // the plain use, before the checkpointed one
      h = run(h);
    } else {
      h = run(run(h));
    }
    return patrickstar::call(out, h);
  }
  Sharing sharing;
  bool checkpointed;
  torch::nn::Linear in{nullptr}, shared{nullptr}, out{nullptr};
};

std::vector<at::Tensor> train_shared(Sharing sharing, bool checkpointed, const std::string& dtype) {
  auto model = std::make_shared<SharedNetImpl>(sharing, checkpointed);
  const std::string precision = dtype == "bf16" ? R"("bf16": {"enabled": true},)" : "";
  // eps 1: the update follows the gradient's value, so a lost or overwritten gradient shows.
  Config config = Config::from_string("{" + precision + R"("default_chunk_size": 512,
      "optimizer": {"type": "Adam", "params": {"lr": 0.1, "eps": 1.0}},
      "client": {"device": {"capacity_bytes": 65536}}})");
  Engine engine(model, test::use_test_device(config));
  const c10::Device device = test::test_device();
  for (int s = 0; s < 4; ++s) {
    engine.zero_grad();
    at::Tensor y;
    {
      auto active = engine.activate();
      at::Tensor x = micro_input(s).narrow(1, 0, 8).to(device);
      y = model->forward(dtype == "bf16" ? x.to(at::kBFloat16) : x);
    }
    engine.backward(
        torch::mse_loss(y.to(at::kFloat), micro_target(s).narrow(1, 0, 4).to(device)));
    engine.step();
  }
  std::vector<at::Tensor> weights;
  for (auto& [name, w] : engine.fp32_state_dict()) weights.push_back(w);
  return weights;
}

class SharedWithCheckpoint
    : public test::OnTestDevice,
      public ::testing::WithParamInterface<std::tuple<Sharing, std::string>> {};

TEST_P(SharedWithCheckpoint, EveryUseAccumulatesAndNoGradientIsReadAsAWeight) {
  const auto [sharing, dtype] = GetParam();
  const std::vector<at::Tensor> plain = train_shared(sharing, false, dtype);
  const std::vector<at::Tensor> checkpointed = train_shared(sharing, true, dtype);
  auto fresh = std::make_shared<SharedNetImpl>(sharing, false);
  std::vector<at::Tensor> initial;
  for (const at::Tensor& p : fresh->parameters()) initial.push_back(p.detach());
  const double moved = max_difference(plain, initial);
  const double apart = max_difference(checkpointed, plain);
  std::printf("%s: weights moved %.3g, checkpointed vs not %.3g\n", dtype.c_str(), moved, apart);
  EXPECT_GT(moved, 1e-2);
  // fp32 sums the two uses in fp32 either way; bf16 sums them in bf16 without checkpointing.
  EXPECT_LT(apart, dtype == "bf16" ? 2e-3 : 1e-6);
}

INSTANTIATE_TEST_SUITE_P(
    Models, SharedWithCheckpoint,
    ::testing::Combine(::testing::Values(Sharing::kPlainAndCheckpointed,
                                         Sharing::kCheckpointedTwice),
                       ::testing::Values(std::string("fp32"), std::string("bf16"))),
    [](const auto& info) {
      return std::string(std::get<0>(info.param) == Sharing::kPlainAndCheckpointed
                             ? "PlainAndCheckpointed_"
                             : "CheckpointedTwice_") +
             std::get<1>(info.param);
    });

}  // namespace engine_precision_test
}  // namespace patrickstar
