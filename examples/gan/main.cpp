// A small GAN trained the way LibTorch's DCGAN example trains one, with two engines: the
// discriminator learns from real and from fake samples (two backward calls before its step), the
// generator's loss back-propagates through the discriminator, and both models have BatchNorm.
//
// The port from plain LibTorch is what `use_engine` switches: the doors (patrickstar::call in the
// modules' forward) and initialize_engine for each model. The loop is the same code either way:
// plain loss.backward(), the models' own zero_grad() (discriminator->zero_grad(), as LibTorch's
// DCGAN example writes it) and step() through torch::optim::Optimizer&.
//
// The program trains 20 steps without the engine on 2 threads and on 1 thread, then with the engines
// on 2 threads on devices that force chunk moves, and exits non-zero when any loss or BatchNorm
// buffer differs from the plain 2-thread run by more than 1e-5 of max(|value|, 1e-3). Adam's eps is
// 1e-3 (not 1e-8): with a tiny eps, Adam's first steps turn rounding noise in near-zero gradients
// into full-size updates of either sign, and the runs of 1 and 2 threads part by 1e-1 within one
// step; with it the model is not chaotic over 20 steps.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "patrickstar/patrickstar.h"

namespace {

constexpr int64_t kNoise = 8;
constexpr int64_t kData = 16;
constexpr int64_t kHidden = 32;
constexpr int64_t kBatch = 32;
constexpr int kSteps = 20;
// Emulated devices smaller than each model's data plus its activations: chunks move every step.
// Each engine's non-model memory is everything else that is live between its moments, the other
// engine's activations included (the generator waits from its forward to its backward while the
// discriminator runs twice), as two engines sharing one GPU would see it: 27,408 bytes of the
// discriminator's at the generator's moment 2, so the generator's 36 KiB of before the engines kept
// their own peak windows is 48 KiB (44 KiB is the least that trains here; both still move chunks
// every step at 52 KiB).
constexpr int64_t kGeneratorDeviceBytes = 48 * 1024;
constexpr int64_t kDiscriminatorDeviceBytes = 46 * 1024;

struct GeneratorImpl : torch::nn::Module {
  GeneratorImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(kNoise, kHidden));
    bn = register_module("bn", torch::nn::BatchNorm1d(kHidden));
    fc2 = register_module("fc2", torch::nn::Linear(kHidden, kData));
  }
  torch::Tensor forward(torch::Tensor z) {
    auto h = torch::relu(patrickstar::call(bn, patrickstar::call(fc1, z)));
    return torch::tanh(patrickstar::call(fc2, h));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(Generator);

struct DiscriminatorImpl : torch::nn::Module {
  DiscriminatorImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(kData, kHidden));
    bn = register_module("bn", torch::nn::BatchNorm1d(kHidden));
    fc2 = register_module("fc2", torch::nn::Linear(kHidden, 1));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = torch::leaky_relu(patrickstar::call(bn, patrickstar::call(fc1, x)), 0.2);
    return patrickstar::call(fc2, h);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(Discriminator);

// "Real" data: points near a fixed curve, drawn from the step's own seed.
torch::Tensor real_batch(int step) {
  torch::manual_seed(5000 + step);
  auto t = torch::rand({kBatch, 1}) * 6.0 - 3.0;
  auto grid = torch::linspace(-1.0, 1.0, kData).unsqueeze(0);
  return torch::tanh(t * grid) + 0.05 * torch::randn({kBatch, kData});
}
torch::Tensor noise_batch(int step) {
  torch::manual_seed(9000 + step);
  return torch::randn({kBatch, kNoise});
}

struct Record {
  std::vector<double> values;  // every loss, then every BatchNorm buffer element, step by step
  int64_t g_steps_with_moves = 0;  // steps after each engine's warm-up that moved chunks
  int64_t d_steps_with_moves = 0;
  int64_t retraces = 0;
};

patrickstar::Config engine_config(int64_t device_bytes) {
  return patrickstar::Config::from_string(
      R"({"optimizer": {"type": "Adam", "params": {"lr": 0.0002, "betas": [0.5, 0.999], "eps": 0.001}},
          "default_chunk_size": 520,
          "client": {"device": {"capacity_bytes": )" +
      std::to_string(device_bytes) + "}}}");
}

void record_buffers(Record& record, torch::nn::Module& model) {
  for (const auto& buffer : model.named_buffers()) {
    if (buffer.value().scalar_type() != torch::kFloat) continue;  // num_batches_tracked
    auto flat = buffer.value().flatten();
    for (int64_t i = 0; i < flat.numel(); ++i) record.values.push_back(flat[i].item<double>());
  }
}

Record train(bool use_engine, int threads) {
  torch::set_num_threads(threads);
  torch::manual_seed(1);
  Generator generator;
  Discriminator discriminator;
  Record record;

  // The two lines of the port (and the doors in the modules). The loop below reaches either kind
  // through torch::optim::Optimizer&, as LibTorch trainers pass optimizers around.
  std::unique_ptr<torch::optim::Optimizer> g_optimizer, d_optimizer;
  if (use_engine) {
    g_optimizer = std::make_unique<patrickstar::EngineOptimizer>(
        patrickstar::initialize_engine([&] { return generator; }, 0, engine_config(kGeneratorDeviceBytes)).second);
    d_optimizer = std::make_unique<patrickstar::EngineOptimizer>(
        patrickstar::initialize_engine([&] { return discriminator; }, 0, engine_config(kDiscriminatorDeviceBytes))
            .second);
  } else {
    auto options = torch::optim::AdamOptions(2e-4).betas({0.5, 0.999}).eps(1e-3);
    g_optimizer = std::make_unique<torch::optim::Adam>(generator->parameters(), options);
    d_optimizer = std::make_unique<torch::optim::Adam>(discriminator->parameters(), options);
  }
  torch::optim::Optimizer& g_opt = *g_optimizer;
  torch::optim::Optimizer& d_opt = *d_optimizer;

  for (int s = 0; s < kSteps; ++s) {
    // The discriminator: real samples, then fakes, two backward calls before its step.
    discriminator->zero_grad();
    auto real = real_batch(s);
    auto real_loss = torch::binary_cross_entropy_with_logits(discriminator->forward(real),
                                                             torch::ones({kBatch, 1}));
    real_loss.backward();
    auto fake = generator->forward(noise_batch(s));
    auto fake_loss = torch::binary_cross_entropy_with_logits(discriminator->forward(fake.detach()),
                                                             torch::zeros({kBatch, 1}));
    fake_loss.backward();
    d_opt.step();
    // The generator: its loss back-propagates through the discriminator, whose gradients from this
    // backward are discarded by its next zero_grad().
    generator->zero_grad();
    auto g_loss = torch::binary_cross_entropy_with_logits(discriminator->forward(fake),
                                                          torch::ones({kBatch, 1}));
    g_loss.backward();
    g_opt.step();

    for (const auto& loss : {real_loss, fake_loss, g_loss}) record.values.push_back(loss.item<double>());
    record_buffers(record, *generator);
    record_buffers(record, *discriminator);
  }
  if (use_engine) {
    // What the engines did: steps after the warm-up that moved chunks, traces re-recorded.
    auto count = [&](torch::optim::Optimizer& opt, int64_t& with_moves) {
      const patrickstar::Engine& engine = dynamic_cast<patrickstar::EngineOptimizer&>(opt).engine();
      for (const patrickstar::IterationReport& report : engine.history()) {
        if (report.iteration > 0 && report.h2d_bytes + report.d2h_bytes > 0) ++with_moves;
        record.retraces = std::max(record.retraces, report.retraces);
      }
    };
    count(g_opt, record.g_steps_with_moves);
    count(d_opt, record.d_steps_with_moves);
  }
  return record;
}

double max_relative_difference(const Record& a, const Record& b) {
  if (a.values.size() != b.values.size()) return INFINITY;
  double worst = 0;
  for (size_t i = 0; i < a.values.size(); ++i) {
    const double scale = std::max(std::abs(b.values[i]), 1e-3);
    worst = std::max(worst, std::abs(a.values[i] - b.values[i]) / scale);
  }
  return worst;
}

}  // namespace

int main() {
  const Record plain = train(false, 2);
  const Record plain_one_thread = train(false, 1);
  const Record engine = train(true, 2);
  const double threads = max_relative_difference(plain_one_thread, plain);
  const double ported = max_relative_difference(engine, plain);
  std::printf("%zu values compared (losses and BatchNorm buffers, %d steps)\n", plain.values.size(),
              kSteps);
  std::printf("plain, 1 thread vs 2 threads: max relative difference %.3g\n", threads);
  std::printf("two engines vs plain:         max relative difference %.3g\n", ported);
  std::printf("steps after the warm-up that moved chunks: generator %lld, discriminator %lld, of %d; "
              "traces re-recorded: %lld\n",
              static_cast<long long>(engine.g_steps_with_moves),
              static_cast<long long>(engine.d_steps_with_moves), kSteps - 1,
              static_cast<long long>(engine.retraces));
  const bool ok = threads <= 1e-5 && ported <= 1e-5 && engine.g_steps_with_moves == kSteps - 1 &&
                  engine.d_steps_with_moves == kSteps - 1;
  std::printf("%s\n", ok ? "PASSED" : "FAILED");
  return ok ? 0 : 1;
}
