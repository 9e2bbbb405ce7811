// Parameters outside the doors: an operator reading one throws our error (naming the parameter, its
// module and the door), GatheredParameters makes them real fp32 tensors for a while (values,
// re-initialization, torch::save), a penalty that trains goes behind a door, and EngineOptimizer is
// a torch::optim::Optimizer (helpers taking Optimizer&, zero_grad through the base, LR schedulers).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "error_message.h"
#include "small_net.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar {
namespace outside_doors_test {

using test::compute_loss;
using test::error_of;
using test::input_of;
using test::Net;
using test::plain_adam;
using test::seeded_net;
using test::small_device;
using test::target_of;
using test::test_device;

// On the emulated device, or on the CUDA engine with PATRICKSTAR_TEST_DEVICE=cuda (the engine's
// nets get their inputs on test_device(); the plain twins stay on the CPU). The GatheredParameters
// suite's fixture takes the library class's name in this file, so the tests spell the class
// patrickstar::GatheredParameters, as a trainer outside the namespace does.
class OutsideDoors : public test::OnTestDevice {};
class GatheredParameters : public test::OnTestDevice {};
class EngineOptimizerBase : public test::OnTestDevice {};

struct ConvNetImpl : torch::nn::Module {
  ConvNetImpl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3)));
    bn = register_module("bn", torch::nn::BatchNorm2d(4));
  }
  at::Tensor forward(const at::Tensor& x) {
    return patrickstar::call(bn, patrickstar::call(conv, x));
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
};
TORCH_MODULE(ConvNet);

// An L2 penalty as a LibTorch trainer writes it, over every parameter.
at::Tensor l2_penalty(torch::nn::Module& model) {
  at::Tensor sum = torch::zeros({});
  for (const at::Tensor& p : model.parameters()) sum = sum + p.pow(2).sum();
  return sum;
}

// The same penalty behind the model's door: under an engine the parameters are real there, and
// the penalty's gradient reaches the engine. Without an engine the door is a plain call.
at::Tensor l2_penalty_behind_the_door(torch::nn::Module& model) {
  patrickstar::ModuleScope scope(model);
  return scope.done(l2_penalty(model));
}

void expect_contains(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << "missing \"" << part << "\" in: " << text;
}

TEST_F(OutsideDoors, AModuleCalledWithoutItsDoorNamesTheParameterItsModuleAndTheDoor) {
  Net net = seeded_net();
  Engine engine(net.ptr(), small_device());
  // A Linear called directly, and a forward that forgets one door.
  std::string m = error_of([&] { net->fc1(input_of(0).to(test_device())); });
  expect_contains(m, "parameter 'fc1.");
  expect_contains(m, "module 'fc1', torch::nn::LinearImpl");
  expect_contains(m, "outside its door");
  expect_contains(m, "patrickstar::call");
  m = error_of([&] { net->forward_forgetting_a_door(input_of(0).to(test_device())); });
  expect_contains(m, "parameter 'fc2.");
  expect_contains(m, "module 'fc2', torch::nn::LinearImpl");
  // The parameters keep their shapes (LibTorch's shape checks pass; the data read is refused).
  EXPECT_EQ(net->fc1->weight.sizes(), (std::vector<int64_t>{32, 16}));
  // The engine trains on after the mistakes.
  engine.zero_grad();
  at::Tensor loss = compute_loss(net, 0);
  loss.backward();
  EXPECT_NO_THROW(engine.step());
  EXPECT_TRUE(std::isfinite(loss.item<double>()));

  torch::manual_seed(1);
  ConvNet conv_net;
  Engine conv_engine(conv_net.ptr(), small_device(R"({"bf16": {"enabled": true}})"));
  at::Tensor images = torch::randn({2, 3, 8, 8}).to(test_device(), at::kBFloat16);
  m = error_of([&] { conv_net->conv(images); });
  expect_contains(m, "parameter 'conv.");
  expect_contains(m, "torch::nn::Conv2dImpl");
  m = error_of([&] { conv_net->bn(torch::randn({2, 4, 6, 6}).to(test_device(), at::kBFloat16)); });
  expect_contains(m, "parameter 'bn.");
  expect_contains(m, "torch::nn::BatchNorm2dImpl");
  // Through the doors it runs (BatchNorm's running statistics are in the compute dtype too).
  EXPECT_EQ(conv_net->bn->running_mean.scalar_type(), at::kBFloat16);
  EXPECT_EQ(conv_net->forward(images).sizes(), (std::vector<int64_t>{2, 4, 6, 6}));
}

TEST_F(OutsideDoors, AnL2PenaltyOutsideTheDoorsIsAnErrorNotZero) {
  Net plain = seeded_net();
  const double expected = l2_penalty(*plain).item<double>();
  ASSERT_GT(expected, 1.0);
  Net net = seeded_net();
  Engine engine(net.ptr(), small_device());
  const std::string m = error_of([&] { l2_penalty(*net); });
  expect_contains(m, "outside its door");
  expect_contains(m, "GatheredParameters");
  // In a read-only scope the penalty has its value.
  patrickstar::GatheredParameters gathered(*net,
                                            patrickstar::GatheredParameters::Mode::kReadOnly);
  EXPECT_NEAR(l2_penalty(*net).item<double>(), expected, 1e-6 * expected);
}

TEST_F(OutsideDoors, APenaltyBehindTheDoorTrainsAsInLibTorch) {
  constexpr double kWeight = 1e-2;
  Net plain = seeded_net();
  torch::optim::Adam adam = plain_adam(plain->parameters());
  Net net = seeded_net();
  auto [model, optimizer] = initialize_engine([&] { return net; }, 0, small_device());
  for (int s = 0; s < 6; ++s) {
    adam.zero_grad();
    at::Tensor expected = compute_loss(plain, s) + kWeight * l2_penalty_behind_the_door(*plain);
    expected.backward();
    adam.step();
    optimizer.zero_grad();
    at::Tensor loss = compute_loss(net, s) + kWeight * l2_penalty_behind_the_door(*net);
    loss.backward();
    optimizer.step();
    EXPECT_NEAR(loss.item<double>(), expected.item<double>(), 1e-6 * expected.item<double>())
        << "step " << s;
  }
  EXPECT_EQ(model.engine().retrace_count(), 0);
}

TEST_F(GatheredParameters, GivesTheFp32MasterWeightsAndTakesThemBack) {
  for (const std::string precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    Net net = seeded_net();
    const std::string extra = precision == "bf16" ? R"({"bf16": {"enabled": true}})" : "{}";
    Engine engine(net.ptr(), small_device(extra));
    for (int s = 0; s < 3; ++s) {
      engine.zero_grad();
      at::Tensor loss = torch::mse_loss(net->forward(input_of(s).to(test_device())).to(at::kFloat),
                                        target_of(s).to(test_device()));
      loss.backward();
      engine.step();
    }
    const auto master = engine.fp32_state_dict();
    const at::ScalarType half = net->fc1->weight.scalar_type();
    {
      // The values are on the parameters' device (the GPU on CUDA), the state dict on the host.
      patrickstar::GatheredParameters gathered(*net);
      const auto params = net->named_parameters();
      for (const auto& [name, value] : master) {
        EXPECT_EQ(params[name].scalar_type(), at::kFloat) << name;
        EXPECT_TRUE(torch::equal(params[name].cpu(), value)) << name;
      }
      // A plain LibTorch archive of the model, loadable without the engine.
      std::stringstream archive;
      torch::save(net, archive);
      Net loaded;
      torch::load(loaded, archive);
      for (const auto& [name, value] : master) {
        EXPECT_TRUE(torch::equal(loaded->named_parameters()[name].cpu(), value)) << name;
      }
    }
    // Back in the engine: the half dtype again, nothing to read outside the doors.
    EXPECT_EQ(net->fc1->weight.scalar_type(), half);
    expect_contains(error_of([&] { net->fc1->weight.sum(); }), "outside its door");
    // Training goes on, on the same trace.
    engine.zero_grad();
    at::Tensor loss = torch::mse_loss(net->forward(input_of(3).to(test_device())).to(at::kFloat),
                                      target_of(3).to(test_device()));
    loss.backward();
    EXPECT_NO_THROW(engine.step());
    EXPECT_EQ(engine.retrace_count(), 0);
  }
}

TEST_F(GatheredParameters, ValuesWrittenInTheScopeAreTrainedOn) {
  auto reinit = [](torch::nn::Linear& fc) {
    torch::NoGradGuard no_grad;
    torch::manual_seed(77);
    fc->weight.copy_(torch::randn(fc->weight.sizes()) * 0.5);
    fc->bias.fill_(0.25);
  };
  Net plain = seeded_net();
  reinit(plain->fc1);
  torch::optim::Adam adam = plain_adam(plain->parameters());
  Net net = seeded_net();
  auto [model, optimizer] = initialize_engine([&] { return net; }, 0, small_device());
  {
    patrickstar::GatheredParameters gathered(*net->fc1);
    reinit(net->fc1);
  }
  for (int s = 0; s < 5; ++s) {
    adam.zero_grad();
    at::Tensor expected = compute_loss(plain, s);
    expected.backward();
    adam.step();
    optimizer.zero_grad();
    at::Tensor loss = compute_loss(net, s);
    loss.backward();
    optimizer.step();
    EXPECT_NEAR(loss.item<double>(), expected.item<double>(), 1e-6 * expected.item<double>())
        << "step " << s;
  }

  // In bf16 both copies take the values: the fp32 master and the half weights the forward reads.
  Net half_net = seeded_net();
  Engine engine(half_net.ptr(), small_device(R"({"bf16": {"enabled": true}})"));
  {
    patrickstar::GatheredParameters gathered(*half_net->fc1);
    reinit(half_net->fc1);
  }
  Net reference = seeded_net();
  reinit(reference->fc1);
  for (const auto& [name, value] : engine.fp32_state_dict()) {
    EXPECT_TRUE(torch::equal(value, reference->named_parameters()[name])) << name;
  }
  reference->to(at::kBFloat16);
  torch::NoGradGuard no_grad;
  const at::Tensor x = input_of(0).to(at::kBFloat16);
  EXPECT_TRUE(torch::allclose(half_net->forward(x.to(test_device())).to(at::kCPU, at::kFloat),
                              reference->forward(x).to(at::kFloat), 1e-2, 1e-2));
}

TEST_F(GatheredParameters, RefusesWhatItCannotDoAndChangesNothing) {
  Net net = seeded_net();
  Engine engine(net.ptr(), small_device());
  const auto before = engine.fp32_state_dict();
  auto unchanged = [&] {
    const auto now = engine.fp32_state_dict();
    for (size_t i = 0; i < before.size(); ++i) {
      EXPECT_TRUE(torch::equal(before[i].second, now[i].second)) << before[i].first;
    }
  };
  // Not a parameter of this engine.
  at::Tensor stranger = torch::zeros({3});
  expect_contains(error_of([&] { patrickstar::GatheredParameters g(engine, {stranger}); }),
                  "not a parameter of this engine's model");
  // Held by another scope.
  {
    patrickstar::GatheredParameters first(*net->fc1,
                                          patrickstar::GatheredParameters::Mode::kReadOnly);
    expect_contains(error_of([&] { patrickstar::GatheredParameters g(*net); }),
                    "another GatheredParameters");
    // A door over a held parameter.
    expect_contains(error_of([&] { net->forward(input_of(0).to(test_device())); }),
                    "held by a GatheredParameters");
  }
  // In an open door.
  {
    ModuleScope scope(*net->fc2);
    expect_contains(error_of([&] {
                      patrickstar::GatheredParameters g(
                          *net->fc2, patrickstar::GatheredParameters::Mode::kReadOnly);
                    }),
                    "open door");
    scope.done(torch::zeros({1}));
  }
  // Read-write while a forward is in progress; read-only is fine then.
  at::Tensor loss = compute_loss(net, 0);
  expect_contains(error_of([&] { patrickstar::GatheredParameters g(*net); }), "Mode::kReadOnly");
  {
    patrickstar::GatheredParameters g(*net, patrickstar::GatheredParameters::Mode::kReadOnly);
    torch::NoGradGuard no_grad;
    net->fc1->weight.zero_();  // discarded
  }
  loss.backward();
  expect_contains(error_of([&] { patrickstar::GatheredParameters g(*net); }),
                  "gradients wait for step()");
  engine.zero_grad();
  unchanged();
  // A changed shape (on the parameter's device) is not written back.
  {
    patrickstar::GatheredParameters g(*net->fc1);
    net->fc1->weight.set_data(torch::ones({2, 2}, test_device()));
    expect_contains(error_of([&] { g.end(); }), "nothing was written back");
  }
  unchanged();
  EXPECT_EQ(net->fc1->weight.sizes(), (std::vector<int64_t>{32, 16}));
  // The engine trains on.
  engine.zero_grad();
  loss = compute_loss(net, 1);
  loss.backward();
  EXPECT_NO_THROW(engine.step());
}

// A helper as LibTorch trainers write it, taking any optimizer.
double train_step(Net& model, torch::optim::Optimizer& optimizer, int step) {
  optimizer.zero_grad();
  at::Tensor loss = compute_loss(model, step);
  loss.backward();
  optimizer.step();
  return loss.item<double>();
}

TEST_F(EngineOptimizerBase, HelpersTakingTorchOptimOptimizerAndLrSchedulersTrainAsLibTorch) {
  Net plain = seeded_net();
  torch::optim::Adam adam = plain_adam(plain->parameters());
  torch::optim::StepLR plain_schedule(adam, /*step_size=*/2, /*gamma=*/0.5);
  Net net = seeded_net();
  auto [model, optimizer] = initialize_engine([&] { return net; }, 0, small_device());
  torch::optim::StepLR schedule(optimizer, /*step_size=*/2, /*gamma=*/0.5);
  EXPECT_EQ(optimizer.param_groups()[0].params().size(), net->parameters().size());
  for (int s = 0; s < 6; ++s) {
    const double expected = train_step(plain, adam, s);
    plain_schedule.step();
    const double got = train_step(net, optimizer, s);
    schedule.step();
    EXPECT_NEAR(got, expected, 1e-6 * expected) << "step " << s;
  }
  // The rate of the last step: halved at the scheduler's steps 2 and 4.
  EXPECT_DOUBLE_EQ(model.engine().lr(), 1e-2 * 0.25);
  std::stringstream archive;
  expect_contains(error_of([&] { torch::save(optimizer, archive); }), "save_checkpoint");
}

TEST_F(EngineOptimizerBase, ZeroGradThroughTheBaseDiscardsGradients) {
  // A GAN's discriminator: the generator's backward leaves gradients in it, which its next
  // zero_grad() discards; here through torch::optim::Optimizer& (LibTorch's non-virtual zero_grad).
  Net plain = seeded_net();
  torch::optim::Adam adam = plain_adam(plain->parameters());
  Net net = seeded_net();
  auto [model, engine_optimizer] = initialize_engine([&] { return net; }, 0, small_device());
  torch::optim::Optimizer& optimizer = engine_optimizer;
  for (int s = 0; s < 5; ++s) {
    for (auto [m, opt] : {std::pair<Net*, torch::optim::Optimizer*>{&plain, &adam},
                          std::pair<Net*, torch::optim::Optimizer*>{&net, &optimizer}}) {
      compute_loss(*m, 50 + s).backward();  // discarded
      opt->zero_grad();
      compute_loss(*m, s).backward();
      opt->step();
    }
    torch::NoGradGuard no_grad;
    const double expected = compute_loss(plain, 99).item<double>();
    EXPECT_NEAR(compute_loss(net, 99).item<double>(), expected, 1e-6 * expected) << "step " << s;
  }
}

TEST_F(EngineOptimizerBase, ZeroGradThroughTheBaseReachesTheEnginesBackwardAndCheckpoints) {
  // Between forward and backward, as LibTorch tutorials order it, then the engine's own backward
  // (fp16 loss scaling and accumulation use it); with activation checkpointing, whose recompute
  // opens doors inside the backward; and zero_grad(false), which zeroes the marker in place.
  for (const std::string variant : {"engine backward", "checkpoint", "set_to_none false"}) {
    SCOPED_TRACE(variant);
    Net plain = seeded_net();
    torch::optim::Adam adam = plain_adam(plain->parameters());
    Net net = seeded_net();
    auto [model, engine_optimizer] = initialize_engine([&] { return net; }, 0, small_device());
    torch::optim::Optimizer& optimizer = engine_optimizer;
    auto forward = [&](Net& m, int s) {
      if (variant != "checkpoint") return compute_loss(m, s);
      // The batch where the model's parameters are, as compute_loss puts it.
      const c10::Device device = m->fc1->weight.device();
      at::Tensor h = patrickstar::checkpoint(
          [&](const at::Tensor& x) { return torch::relu(patrickstar::call(m->fc1, x)); },
          input_of(s).to(device).requires_grad_());
      return torch::mse_loss(patrickstar::call(m->fc2, h), target_of(s).to(device));
    };
    for (int s = 0; s < 4; ++s) {
      at::Tensor expected = forward(plain, s);
      adam.zero_grad(variant != "set_to_none false");
      expected.backward();
      adam.step();
      at::Tensor loss = forward(net, s);
      optimizer.zero_grad(variant != "set_to_none false");
      if (variant == "engine backward") {
        model.backward(loss);
      } else {
        loss.backward();
      }
      optimizer.step();
      EXPECT_NEAR(loss.item<double>(), expected.item<double>(), 1e-6 * expected.item<double>())
          << "step " << s;
    }
    EXPECT_EQ(model.engine().retrace_count(), 0);
  }
}

TEST_F(GatheredParameters,
       MixedPrecisionBuffersAreFp32InTheScopeAndTheArchiveLoadsIntoAPlainModel) {
  torch::manual_seed(1);
  ConvNet net;
  // A device with room to spare: this test is about buffers, not moves, and a bf16 convolution's
  // scratch memory depends on the CPU (oneDNN on a CPU with AMX took 66512 bytes at one moment, more
  // than small_device's 65536).
  Engine engine(net.ptr(), small_device(R"({"bf16": {"enabled": true},
                                            "client": {"device": {"capacity_bytes": 4194304}}})"));
  {
    // A training forward updates the running statistics (in bf16).
    engine.zero_grad();
    at::Tensor loss =
        net->forward(torch::randn({2, 3, 8, 8}).to(test_device())).to(at::kFloat).pow(2).mean();
    loss.backward();
    engine.step();
  }
  EXPECT_EQ(net->bn->running_mean.scalar_type(), at::kBFloat16);
  std::stringstream archive;
  at::Tensor running_mean;
  {
    patrickstar::GatheredParameters gathered(*net);
    EXPECT_EQ(net->bn->running_mean.scalar_type(), at::kFloat);
    running_mean = net->bn->running_mean.clone();
    torch::save(net, archive);
  }
  EXPECT_EQ(net->bn->running_mean.scalar_type(), at::kBFloat16);
  ConvNet loaded;
  torch::load(loaded, archive);
  EXPECT_EQ(loaded->bn->running_mean.scalar_type(), at::kFloat);
  EXPECT_TRUE(torch::equal(loaded->bn->running_mean.cpu(), running_mean.cpu()));
  EXPECT_FALSE(torch::equal(running_mean, torch::zeros_like(running_mean)));
  for (const auto& [name, value] : engine.fp32_state_dict()) {
    EXPECT_TRUE(torch::equal(loaded->named_parameters()[name].cpu(), value)) << name;
  }
}

TEST_F(GatheredParameters, AStepInsideAReadWriteScopeIsRefusedAndAScopeMayOutliveItsEngine) {
  Net net = seeded_net();
  auto engine = std::make_unique<Engine>(net.ptr(), small_device());
  const auto master = engine->fp32_state_dict();
  auto scope = std::make_unique<patrickstar::GatheredParameters>(
      *engine, std::vector<at::Tensor>{net->fc1->weight});
  expect_contains(error_of([&] { engine->step(); }), "read-write GatheredParameters");
  engine.reset();  // warns; the scope's end then does nothing
  EXPECT_NO_THROW(scope.reset());
  // The model has ordinary fp32 parameters with the master weights.
  for (const auto& [name, value] : master) {
    EXPECT_TRUE(torch::equal(net->named_parameters()[name], value)) << name;
  }
}

}  // namespace outside_doors_test
}  // namespace patrickstar
