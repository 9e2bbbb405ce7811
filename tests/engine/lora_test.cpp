// Fine-tuning with low-rank adapters: the zoo's gpt_tiny with LoraAdapters on its attention
// projections and everything else frozen (GptSpec::lora_rank), through the engine on a device that
// holds part of the model data, against plain LibTorch with AdamW over the trainable parameters.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <unistd.h>

#include "gpt_training.h"
#include "test_device.h"

namespace patrickstar {
namespace {

constexpr int kSteps = 6;

models::Gpt lora_model(uint64_t seed = 1) {
  models::GptSpec spec = test::tiny();
  spec.lora_rank = 4;
  spec.lora_alpha = 8.0;
  torch::manual_seed(seed);
  return models::Gpt(spec);
}

// Steps first .. first + count - 1 through `engine`, each batch in `accumulation` micro-batches
// (the step's loss is their mean). Returns the losses.
std::vector<double> train_engine(Engine& engine, models::Gpt& model, int first, int count,
                                 int accumulation) {
  std::vector<double> losses;
  for (int s = first; s < first + count; ++s) {
    const auto batch = test::on_test_device(test::batch_of_step(s));
    const int64_t rows = test::kBatch / accumulation;
    engine.zero_grad();
    double loss = 0;
    for (int k = 0; k < accumulation; ++k) {
      at::Tensor out;
      {
        auto active = engine.activate();
        out = model->loss(batch.tokens.narrow(0, k * rows, rows),
                          batch.targets.narrow(0, k * rows, rows));
      }
      engine.backward(out);
      loss += out.item<double>() / accumulation;
    }
    engine.step();
    losses.push_back(loss);
  }
  return losses;
}

using Weights = std::map<std::string, at::Tensor>;

Weights weights_of(torch::nn::Module& model) {
  Weights w;
  for (const auto& p : model.named_parameters()) w[p.key()] = p.value().detach().clone();
  return w;
}

// Plain LibTorch: AdamW (tight_config's hyperparameters) over the parameters that train.
std::vector<double> train_plain(Weights* trained) {
  models::Gpt model = lora_model();
  std::vector<at::Tensor> trainable;
  for (const at::Tensor& p : model->parameters()) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  torch::optim::AdamW adamw(
      trainable, torch::optim::AdamWOptions(3e-3).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.01));
  std::vector<double> losses;
  for (int s = 0; s < kSteps; ++s) {
    auto batch = test::batch_of_step(s);
    adamw.zero_grad();
    at::Tensor loss = model->loss(batch.tokens, batch.targets);
    loss.backward();
    adamw.step();
    losses.push_back(loss.item<double>());
  }
  *trained = weights_of(*model);
  return losses;
}

Weights engine_weights(const Engine& engine) {
  Weights w;
  for (auto& [name, value] : engine.fp32_state_dict()) w[name] = value;
  return w;
}

class Lora : public test::OnTestDevice,
             public ::testing::WithParamInterface<std::tuple<std::string, int>> {};

TEST_P(Lora, FrozenBaseStaysAndAdaptersTrainAsInLibTorch) {
  const auto [precision, accumulation] = GetParam();
  Weights expected;
  const std::vector<double> expected_losses = train_plain(&expected);
  const Weights initial = weights_of(*lora_model());

  models::Gpt model = lora_model();
  std::string extra = "{\"gradient_accumulation_steps\": " + std::to_string(accumulation);
  // fp16 from a loss scale of 2^8: at DeepSpeed's 2^16 the first steps overflow and are skipped,
  // and the run would take fewer updates than the reference.
  if (precision == "bf16") extra += R"(, "bf16": {"enabled": true})";
  if (precision == "fp16") extra += R"(, "fp16": {"enabled": true, "initial_scale_power": 8})";
  Engine engine(model.ptr(), test::tight_config(extra + "}"));
  const std::vector<double> losses = train_engine(engine, model, 0, kSteps, accumulation);
  const Weights trained = engine_weights(engine);
  const at::ScalarType half = precision == "bf16"   ? at::kBFloat16
                              : precision == "fp16" ? at::kHalf
                                                    : at::kFloat;
  double adapters_apart = 0, adapters_moved = 0, frozen_changed = 0;
  // The adapters' updates, the engine's and the reference's, flattened: their cosine.
  std::vector<at::Tensor> ours_delta, their_delta;
  int64_t frozen = 0, adapters = 0;
  for (const auto& p : model->named_parameters()) {
    const std::string& name = p.key();
    const at::Tensor& mine = trained.at(name);
    if (p.value().requires_grad()) {
      adapters += mine.numel();
      const double scale = std::max(expected.at(name).abs().max().item<double>(), 1e-3);
      adapters_apart =
          std::max(adapters_apart, (mine - expected.at(name)).abs().max().item<double>() / scale);
      adapters_moved = std::max(adapters_moved,
                                (expected.at(name) - initial.at(name)).abs().max().item<double>());
      ours_delta.push_back((mine - initial.at(name)).flatten());
      their_delta.push_back((expected.at(name) - initial.at(name)).flatten());
    } else {
      // A frozen weight never changes (in mixed precision: as the compute dtype holds it).
      frozen += mine.numel();
      frozen_changed = std::max(
          frozen_changed, (mine.to(half).to(at::kFloat) - initial.at(name).to(half).to(at::kFloat))
                              .abs()
                              .max()
                              .item<double>());
    }
  }
  const double losses_apart = test::max_relative_difference(losses, expected_losses);
  const at::Tensor a = at::cat(ours_delta), b = at::cat(their_delta);
  const double cosine = (a * b).sum().item<double>() / (a.norm() * b.norm()).item<double>();
  std::printf(
      "%s, %d micro-batch(es): %lld adapter and %lld frozen parameters; losses %.3g apart, "
      "adapters %.3g apart (they moved by up to %.3g; cosine of the updates %.4f), frozen weights "
      "changed by %.3g\n",
      precision.c_str(), accumulation, static_cast<long long>(adapters),
      static_cast<long long>(frozen), losses_apart, adapters_apart, adapters_moved, cosine,
      frozen_changed);
  EXPECT_EQ(adapters, 2 * 6 * 64 * 4);  // layers * 6 * hidden * rank
  EXPECT_EQ(frozen_changed, 0.0);
  EXPECT_GT(adapters_moved, 1e-3);
  EXPECT_EQ(engine.retrace_count(), 0);
  if (precision == "fp32") {
    EXPECT_LT(losses_apart, 1e-5);
    EXPECT_LT(adapters_apart, 1e-3);
  } else {
    // Half-precision compute against the fp32 reference: the losses as close as the compute dtype
    // allows, and the adapters' updates in the same direction (element by element they differ by
    // up to a third of their size: Adam's first steps turn rounding in near-zero gradients into
    // full-size updates).
    EXPECT_LT(losses_apart, 2e-2);
    EXPECT_GT(cosine, 0.99);
  }
}

INSTANTIATE_TEST_SUITE_P(Precisions, Lora,
                         ::testing::Combine(::testing::Values("fp32", "bf16", "fp16"),
                                            ::testing::Values(1, 2)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_accumulation_" +
                                  std::to_string(std::get<1>(info.param));
                         });

// Frozen parameters have chunks of their own, and a step moves none of them: on a device that holds
// every param chunk, with the Adam on the host, an iteration moves only the chunks holding adapters
// (their weights and gradients to the host Adam and back); the frozen base stays on the device.
class LoraChunks : public test::OnTestDevice {};

TEST_F(LoraChunks, FrozenParametersHaveTheirOwnChunksAndTheStepMovesNoneOfThem) {
  models::Gpt model = lora_model();
  Config config = test::tight_config(
      R"({"default_chunk_size": 32768, "optimizer": {"params": {"use_hybrid_adam": false}}})");
  config.device.capacity_bytes = int64_t{64} << 20;
  Engine engine(model.ptr(), config);
  const ChunkStore& store = inspect(engine).chunks();
  const Layout& layout = store.layout();
  std::vector<bool> trained_index(static_cast<size_t>(layout.chunk_count()), false);
  int64_t frozen_indices = 0, trained_bytes = 0;
  for (int64_t i = 0; i < layout.chunk_count(); ++i) {
    int trained = 0, frozen = 0;
    for (TensorId id : layout.tensors_in_chunk(i)) {
      (model->named_parameters()[layout.name(id)].requires_grad() ? trained : frozen) += 1;
    }
    EXPECT_TRUE(trained == 0 || frozen == 0) << "chunk index " << i << " mixes " << trained
                                             << " trained and " << frozen << " frozen tensors";
    trained_index[static_cast<size_t>(i)] = trained > 0;
    if (trained > 0) {
      for (ChunkKind kind : {ChunkKind::kParam, ChunkKind::kGrad}) {
        trained_bytes += store.chunk_bytes(store.chunk_id(kind, i));
      }
    } else {
      ++frozen_indices;
    }
  }
  ASSERT_GT(frozen_indices, 0);
  ASSERT_GT(trained_bytes, 0);
  for (int s = 0; s < 5; ++s) {
    const IterationReport report = test::train_step(engine, model, s);
    if (s < 2) continue;  // the warm-up, and the first scheduled iteration settling in
    std::printf(
        "iteration %d: %lld bytes to the host, %lld back; the adapters' param and grad "
        "chunks: %lld bytes\n",
        s, static_cast<long long>(report.d2h_bytes), static_cast<long long>(report.h2d_bytes),
        static_cast<long long>(trained_bytes));
    EXPECT_GT(report.d2h_bytes, 0) << "the host Adam reads the adapters' gradients there";
    EXPECT_LE(report.d2h_bytes, trained_bytes) << "iteration " << s;
    EXPECT_LE(report.h2d_bytes, trained_bytes) << "iteration " << s;
  }
  for (int64_t i = 0; i < layout.chunk_count(); ++i) {
    if (trained_index[static_cast<size_t>(i)]) continue;
    EXPECT_EQ(store.tier(store.chunk_id(ChunkKind::kParam, i)), Tier::kDevice)
        << "frozen chunk index " << i;
  }
}

// A checkpoint holds the frozen base and the adapters with their optimizer state: an engine built
// from other weights (frozen ones included) and loaded from it continues bit for bit.
class LoraCheckpoint : public test::OnTestDevice {};

TEST_F(LoraCheckpoint, ResumedRunEqualsTheUninterruptedOneBitForBit) {
  const std::string path = ::testing::TempDir() + "/ps_lora_" + std::to_string(::getpid()) + ".pt";
  const Config config = test::tight_config(R"({"bf16": {"enabled": true}})");
  models::Gpt a_model = lora_model(1);
  Engine a(a_model.ptr(), config);
  train_engine(a, a_model, 0, 3, 1);
  a.save_checkpoint(path);
  const std::vector<double> a_rest = train_engine(a, a_model, 3, 3, 1);

  models::Gpt b_model = lora_model(99);
  Engine b(b_model.ptr(), config);
  b.load_checkpoint(path);
  const std::vector<double> b_rest = train_engine(b, b_model, 3, 3, 1);
  for (size_t i = 0; i < a_rest.size(); ++i) EXPECT_EQ(b_rest[i], a_rest[i]) << "step " << 3 + i;
  const Weights a_weights = engine_weights(a), b_weights = engine_weights(b);
  for (const auto& [name, w] : a_weights) {
    EXPECT_TRUE(torch::equal(b_weights.at(name), w)) << name;
  }
  std::remove(path.c_str());
}

}  // namespace
}  // namespace patrickstar
