// The engine in a trainer's own loop: doors find their engine from the module (the user's holder,
// helpers taking Net&, a plain module of the same class), plain loss.backward(), several backward
// calls before a step, views of parameters that outlive their door, mixed-precision inputs,
// requires_grad changed after registration, and the model handed back when the engine goes.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "error_message.h"
#include "small_net.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar {
namespace engine_loop_test {

using test::compute_loss;
using test::input_of;
using test::Net;
using test::plain_adam;
using test::seeded_net;
using test::small_device;
using test::target_of;

// On the emulated device, or on the CUDA engine with PATRICKSTAR_TEST_DEVICE=cuda (the engine's
// nets get their batches on test::test_device(); the plain twins stay on the CPU).
class EngineLoop : public test::OnTestDevice {};
using test::test_device;

double evaluate(Net& model) {
  torch::NoGradGuard no_grad;
  model->eval();
  const double loss = compute_loss(model, 99).item<double>();
  model->train();
  return loss;
}

TEST_F(EngineLoop, HelpersTakeTheUsersNetAndPlainBackwardDrivesTheEngine) {
  // The plain trainer.
  Net plain = seeded_net();
  torch::optim::Adam adam = plain_adam(plain->parameters());
  std::vector<double> expected, expected_eval;
  for (int s = 0; s < 8; ++s) {
    adam.zero_grad();
    at::Tensor loss = compute_loss(plain, s);
    loss.backward();
    adam.step();
    expected.push_back(loss.item<double>());
    expected_eval.push_back(evaluate(plain));
  }
  // Its port: the doors (in NetImpl) and initialize_engine; the loop and the helpers unchanged.
  Net net = seeded_net();
  auto [engine_model, optimizer] = initialize_engine([&] { return net; }, 0, small_device());
  for (int s = 0; s < 8; ++s) {
    optimizer.zero_grad();
    at::Tensor loss = compute_loss(net, s);
    loss.backward();
    const IterationReport report = optimizer.step();
    EXPECT_NEAR(loss.item<double>(), expected[s], 1e-6 * expected[s]) << "step " << s;
    EXPECT_NEAR(evaluate(net), expected_eval[s], 1e-6 * expected_eval[s]) << "step " << s;
    if (s > 0) {
      EXPECT_FALSE(report.retraced);
    }
  }
  EXPECT_EQ(engine_model.engine().retrace_count(), 0);
}

TEST_F(EngineLoop, SeveralBackwardCallsBeforeAStepAccumulate) {
  // fp32 keeps a gradient space: two backward passes add up before the step, as in LibTorch.
  Net plain = seeded_net();
  torch::optim::Adam adam = plain_adam(plain->parameters());
  Net net = seeded_net();
  auto [model, optimizer] = initialize_engine([&] { return net; }, 0, small_device());
  for (int s = 0; s < 5; ++s) {
    adam.zero_grad();
    optimizer.zero_grad();
    for (int k = 0; k < 2; ++k) {
      compute_loss(plain, 2 * s + k).backward();
      compute_loss(net, 2 * s + k).backward();
    }
    adam.step();
    optimizer.step();
  }
  const auto state = model.engine().fp32_state_dict();
  const auto params = plain->named_parameters();
  for (const auto& [name, value] : state) {
    EXPECT_TRUE(torch::allclose(value, params[name], 1e-5, 1e-6)) << name;
  }
}

// A frozen teacher of the same class, built without the engine, runs inside the student's forward
// through its own doors: those doors are plain calls.
struct StudentImpl : torch::nn::Module {
  explicit StudentImpl(Net teacher) : teacher(std::move(teacher)) {
    fc = register_module("fc", torch::nn::Linear(16, 4));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor hint;
    {
      torch::NoGradGuard no_grad;
      hint = teacher->forward(x.to(at::kCPU)).to(x.device());  // the teacher stays on the CPU
    }
    return patrickstar::call(fc, x) + hint;
  }
  Net teacher;  // not a registered submodule
  torch::nn::Linear fc{nullptr};
};

TEST_F(EngineLoop, APlainModuleOfTheSameClassIsAPlainCall) {
  torch::manual_seed(2);
  Net teacher;  // stays a plain LibTorch module
  torch::manual_seed(3);
  auto student = std::make_shared<StudentImpl>(teacher);
  torch::manual_seed(3);
  auto reference = std::make_shared<StudentImpl>(teacher);
  torch::optim::Adam adam(reference->fc->parameters(), torch::optim::AdamOptions(1e-2));
  Engine engine(student, small_device());
  EXPECT_EQ(engine.registration().tensors, 2) << "only the student's own parameters";
  for (int s = 0; s < 4; ++s) {
    engine.zero_grad();
    at::Tensor loss = torch::mse_loss(student->forward(input_of(s).to(test_device())),
                                      target_of(s).to(test_device()));
    loss.backward();
    engine.step();
    adam.zero_grad();
    at::Tensor expected = torch::mse_loss(reference->forward(input_of(s)), target_of(s));
    expected.backward();
    adam.step();
    EXPECT_NEAR(loss.item<double>(), expected.item<double>(), 1e-6 * expected.item<double>());
  }
}

// Outputs that alias a parameter: a view of it, and the parameter itself.
struct PositionsImpl : torch::nn::Module {
  PositionsImpl() {
    pos = register_parameter("pos", torch::randn({32, 16}) * 0.1);
    cls = register_parameter("cls", torch::randn({16}) * 0.1);
  }
  at::Tensor forward(int64_t batch, int64_t seq) {
    ModuleScope scope(*this);
    return scope.done(pos.narrow(0, 0, seq).unsqueeze(0).expand({batch, seq, 16}));
  }
  at::Tensor token() {
    ModuleScope scope(*this);
    return scope.done(cls);
  }
  at::Tensor pos, cls;
};
struct TaggerImpl : torch::nn::Module {
  TaggerImpl() {
    positions = register_module("positions", std::make_shared<PositionsImpl>());
    head = register_module("head", torch::nn::Linear(16, 4));
  }
  at::Tensor forward(const at::Tensor& x) {  // x: [batch, seq, 16]
    at::Tensor p = positions->forward(x.size(0), x.size(1));  // used after its door closed
    at::Tensor c = positions->token();
    return patrickstar::call(head, x + p + c);
  }
  std::shared_ptr<PositionsImpl> positions;
  torch::nn::Linear head{nullptr};
};

TEST_F(EngineLoop, OutputsThatAliasAParameterStayValidAfterTheDoorCloses) {
  auto batch = [](int s) {
    torch::manual_seed(40 + s);
    return torch::randn({2, 8, 16});
  };
  torch::manual_seed(5);
  auto plain = std::make_shared<TaggerImpl>();
  torch::optim::Adam adam = plain_adam(plain->parameters());
  torch::manual_seed(5);
  auto model = std::make_shared<TaggerImpl>();
  Engine engine(model, small_device());
  for (int s = 0; s < 5; ++s) {
    engine.zero_grad();
    at::Tensor loss = model->forward(batch(s).to(test_device())).pow(2).mean();
    loss.backward();
    engine.step();
    adam.zero_grad();
    at::Tensor expected = plain->forward(batch(s)).pow(2).mean();
    expected.backward();
    adam.step();
    EXPECT_NEAR(loss.item<double>(), expected.item<double>(), 1e-6 * expected.item<double>());
  }
}

TEST_F(EngineLoop, DestroyingTheEngineGivesTheModelBackWithItsFp32Weights) {
  Net net = seeded_net();
  std::vector<std::pair<std::string, at::Tensor>> weights;
  {
    Engine engine(net.ptr(), small_device(R"({"bf16": {"enabled": true}})"));
    for (int s = 0; s < 3; ++s) {
      engine.zero_grad();
      at::Tensor loss =
          torch::mse_loss(net->forward(input_of(s).to(test_device(), at::kBFloat16)).to(at::kFloat),
                          target_of(s).to(test_device()));
      loss.backward();
      engine.step();
    }
    weights = engine.fp32_state_dict();
  }
  const auto params = net->named_parameters();
  for (const auto& [name, value] : weights) {
    EXPECT_EQ(params[name].scalar_type(), at::kFloat) << name;
    EXPECT_TRUE(torch::equal(params[name], value)) << name;
  }
  // Plain LibTorch trains the model on.
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  at::Tensor loss = compute_loss(net, 0);
  loss.backward();
  sgd.step();
  EXPECT_TRUE(std::isfinite(loss.item<double>()));
  EXPECT_FALSE(torch::equal(net->named_parameters()["fc1.weight"], weights[0].second));
}

TEST_F(EngineLoop, FloatInputsAreCastToTheComputeDtype) {
  for (const std::string precision : {"bf16", "fp16"}) {
    Net plain = seeded_net();
    Net net = seeded_net();
    const std::string extra = "{\"" + precision + "\": {\"enabled\": true}}";
    auto [model, optimizer] = initialize_engine([&] { return net; }, 0, small_device(extra));
    optimizer.zero_grad();
    at::Tensor out = net->forward(input_of(0).to(test_device()));  // float32, as a plain trainer
    EXPECT_EQ(out.scalar_type(), precision == "bf16" ? at::kBFloat16 : at::kHalf);
    at::Tensor expected = plain->forward(input_of(0));
    EXPECT_TRUE(torch::allclose(out.to(at::kCPU, at::kFloat), expected, 5e-2, 5e-2)) << precision;
    // Integer inputs are left alone (an embedding's indices).
    torch::nn::Embedding table(10, 4);
    auto [emb, emb_optimizer] = initialize_engine([&] { return table; }, 0, small_device(extra));
    EXPECT_EQ(patrickstar::call(table, torch::tensor({1, 2, 3}).to(test_device())).scalar_type(),
              precision == "bf16" ? at::kBFloat16 : at::kHalf);
  }
}

TEST_F(EngineLoop, RequiresGradChangedAfterRegistrationTakesEffectAtTheNextIteration) {
  Net net = seeded_net();
  net->fc2->weight.requires_grad_(false);  // frozen at registration, with state to unfreeze later
  auto [model, optimizer] = initialize_engine(
      [&] { return net; }, 0,
      small_device(R"({"zero_optimization": {"frozen_parameters": "full_state"}})"));
  auto fc2_weight = [&] {
    for (auto& [name, w] : model.engine().fp32_state_dict()) {
      if (name == "fc2.weight") return w;
    }
    return at::Tensor();
  };
  auto train = [&](int s) {
    optimizer.zero_grad();
    compute_loss(net, s).backward();
    optimizer.step();
  };
  const at::Tensor frozen = fc2_weight();
  train(0);
  train(1);
  EXPECT_TRUE(torch::equal(fc2_weight(), frozen)) << "a frozen parameter moved";
  net->fc2->weight.requires_grad_(true);  // unfrozen: trains from the next iteration on
  train(2);
  train(3);
  EXPECT_FALSE(torch::equal(fc2_weight(), frozen)) << "the unfrozen parameter never trained";
}

TEST_F(EngineLoop, FrozenFirstLayerKeepsTheTraceAndTrainsAsLibTorch) {
  // Fine-tuning's shape: the first module is frozen and its input needs no gradient, so its door's
  // output is outside every graph. The forward goes on at the next door (it is not a dropped one):
  // the trace is followed from the second iteration on and the rest trains as in LibTorch.
  Net plain = seeded_net();
  plain->fc1->weight.requires_grad_(false);
  plain->fc1->bias.requires_grad_(false);
  torch::optim::Adam adam = plain_adam(plain->fc2->parameters());
  Net net = seeded_net();
  net->fc1->weight.requires_grad_(false);
  net->fc1->bias.requires_grad_(false);
  auto [model, optimizer] = initialize_engine([&] { return net; }, 0, small_device());
  for (int s = 0; s < 5; ++s) {
    adam.zero_grad();
    at::Tensor expected = compute_loss(plain, s);
    expected.backward();
    adam.step();
    optimizer.zero_grad();
    at::Tensor loss = compute_loss(net, s);
    loss.backward();
    const IterationReport report = optimizer.step();
    EXPECT_NEAR(loss.item<double>(), expected.item<double>(), 1e-6 * expected.item<double>())
        << "step " << s;
    if (s > 0) {
      EXPECT_FALSE(report.retraced) << "step " << s;
    }
  }
  EXPECT_EQ(model.engine().retrace_count(), 0);
}

TEST_F(EngineLoop, EvalModeWithoutNoGradGuardBetweenStepsLeavesTheTrace) {
  // An accuracy helper that switches the model to eval() but forgets torch::NoGradGuard: its
  // forward runs in grad mode, and its output is dropped without a backward.
  auto accuracy_without_no_grad = [](Net& model) {
    model->eval();
    const double value = compute_loss(model, 99).item<double>();
    model->train();
    return value;
  };
  Net plain = seeded_net();
  torch::optim::Adam adam = plain_adam(plain->parameters());
  Net net = seeded_net();
  auto [model, optimizer] = initialize_engine([&] { return net; }, 0, small_device());
  for (int s = 0; s < 6; ++s) {
    adam.zero_grad();
    at::Tensor expected = compute_loss(plain, s);
    expected.backward();
    adam.step();
    const double expected_eval = accuracy_without_no_grad(plain);
    optimizer.zero_grad();
    at::Tensor loss = compute_loss(net, s);
    loss.backward();
    const IterationReport report = optimizer.step();
    EXPECT_NEAR(loss.item<double>(), expected.item<double>(), 1e-6 * expected.item<double>())
        << "step " << s;
    EXPECT_NEAR(accuracy_without_no_grad(net), expected_eval, 1e-6 * expected_eval) << "step " << s;
    if (s > 0) {
      EXPECT_FALSE(report.retraced) << "step " << s;
    }
  }
  EXPECT_EQ(model.engine().retrace_count(), 0);
}

}  // namespace engine_loop_test
}  // namespace patrickstar
