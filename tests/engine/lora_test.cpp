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

#include "error_message.h"
#include "gpt_training.h"
#include "patrickstar/engine/gathered_parameters.h"
#include "temp_folder.h"
#include "test_device.h"

namespace patrickstar {
namespace lora_test {

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
  // The capacity goes in with the config, before use_test_device adds CUDA's allowance to it.
  Config config = test::tight_config(
      R"({"default_chunk_size": 32768, "optimizer": {"params": {"use_hybrid_adam": false}},
          "client": {"device": {"capacity_bytes": 67108864}}})");
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
      // Lean: the param chunk alone holds bytes (fp32 here: 4 per element of its capacity).
      for (const ChunkKindSpec& spec : store.kinds()) {
        const ChunkId id = store.chunk_id(spec.kind, i);
        EXPECT_EQ(store.omitted(id), spec.kind != ChunkKind::kParam) << store.describe(id);
      }
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

// Lean frozen chunks (zero_optimization "frozen_parameters": "lean", the default): a frozen base
// costs its param chunk alone; what reads or writes its weights (state dicts, GatheredParameters,
// checkpoints to and from an engine that keeps full state, the disk tier) works without the rest;
// unfreezing it is refused, and "full_state" allows it.
class LoraLean : public test::OnTestDevice {};

Config with(const std::string& base, const std::string& extra) {
  nlohmann::json j = test::tight_config(base).to_json();
  j.merge_patch(nlohmann::json::parse(extra));
  return Config::from_json(j);
}

constexpr const char* kHostAdamBf16 =
    R"({"bf16": {"enabled": true}, "optimizer": {"params": {"use_hybrid_adam": false}}})";
constexpr const char* kFullState = R"({"zero_optimization": {"frozen_parameters": "full_state"}})";

TEST_F(LoraLean, AFrozenBaseCostsItsHalfWeightsAlone) {
  models::Gpt lean_model = lora_model();
  Engine lean(lean_model.ptr(), test::tight_config(kHostAdamBf16));
  models::Gpt full_model = lora_model();
  Engine full(full_model.ptr(), with(kHostAdamBf16, kFullState));
  const ChunkStore& a = inspect(lean).chunks();
  const ChunkStore& b = inspect(full).chunks();
  ASSERT_EQ(a.chunks_per_kind(), b.chunks_per_kind());  // the same layout
  int64_t frozen_elems = 0, lean_bytes = 0, full_bytes = 0;
  for (int64_t i = 0; i < a.chunks_per_kind(); ++i) {
    bool frozen = true;
    for (TensorId id : a.layout().tensors_in_chunk(i)) {
      frozen &= !lean_model->named_parameters()[a.layout().name(id)].requires_grad();
    }
    int64_t index_lean = 0, index_full = 0;
    for (const ChunkKindSpec& spec : a.kinds()) {
      index_lean += a.chunk_bytes(a.chunk_id(spec.kind, i));
      index_full += b.chunk_bytes(b.chunk_id(spec.kind, i));
    }
    if (!frozen) {
      EXPECT_EQ(index_lean, index_full) << "a trained index keeps every kind, chunk index " << i;
      continue;
    }
    frozen_elems += a.layout().used_elems(i);
    lean_bytes += index_lean;
    full_bytes += index_full;
    EXPECT_EQ(index_lean, 2 * a.layout().chunk_capacity(i))
        << "bf16 param chunk alone, index " << i;
  }
  ASSERT_GT(frozen_elems, 0);
  std::printf("frozen base: %lld parameters, %.3f bytes each lean, %.3f with full state\n",
              static_cast<long long>(frozen_elems),
              static_cast<double>(lean_bytes) / static_cast<double>(frozen_elems),
              static_cast<double>(full_bytes) / static_cast<double>(frozen_elems));
  // bf16: 2 bytes against 2 + 4 (master) + 4 + 4 (fp32 moments), waste alike.
  EXPECT_EQ(full_bytes, 7 * lean_bytes);
  EXPECT_EQ(b.total_chunk_bytes() - a.total_chunk_bytes(), full_bytes - lean_bytes);
  // And both train alike (every Adam on the host: the same kernel for both).
  for (int s = 0; s < 3; ++s) {
    double lean_loss = 0, full_loss = 0;
    test::train_step(lean, lean_model, s, &lean_loss);
    test::train_step(full, full_model, s, &full_loss);
    EXPECT_EQ(lean_loss, full_loss) << "step " << s;
  }
}

TEST_F(LoraLean, UnfreezingALeanParameterIsRefusedUntilItIsFrozenAgain) {
  models::Gpt model = lora_model();
  Engine engine(model.ptr(), test::tight_config());
  models::Gpt reference_model = lora_model();
  Engine reference(reference_model.ptr(), test::tight_config());
  double loss = 0, expected = 0;
  test::train_step(engine, model, 0, &loss);
  test::train_step(reference, reference_model, 0, &expected);
  at::Tensor w = model->named_parameters()["blocks.0.qkv.weight"];
  ASSERT_FALSE(w.requires_grad());
  w.requires_grad_(true);
  for (int attempt = 0; attempt < 2; ++attempt) {  // refused again, nothing half-applied
    const std::string error = test::error_of([&] { test::train_step(engine, model, 1); });
    EXPECT_NE(error.find("blocks.0.qkv.weight"), std::string::npos) << error;
    EXPECT_NE(error.find("\"full_state\""), std::string::npos) << error;
  }
  w.requires_grad_(false);
  for (int s = 1; s < 4; ++s) {
    test::train_step(engine, model, s, &loss);
    test::train_step(reference, reference_model, s, &expected);
    EXPECT_EQ(loss, expected) << "step " << s;
  }
  EXPECT_EQ(engine.retrace_count(), 0);
}

// torch::optim steps a frozen parameter whose grad() a trainer assigned by hand; the engine has no
// gradient slot for it, so its step refuses instead of ignoring it, until the gradient is reset.
TEST_F(LoraLean, AGradientAssignedToAFrozenParameterIsRefusedUntilReset) {
  models::Gpt model = lora_model();
  Engine engine(model.ptr(), test::tight_config());
  models::Gpt reference_model = lora_model();
  Engine reference(reference_model.ptr(), test::tight_config());
  double loss = 0, expected = 0;
  test::train_step(engine, model, 0, &loss);
  test::train_step(reference, reference_model, 0, &expected);
  at::Tensor w = model->named_parameters()["blocks.1.fc.weight"];
  auto batch = test::on_test_device(test::batch_of_step(1));
  engine.zero_grad();
  at::Tensor out;
  {
    auto active = engine.activate();
    out = model->loss(batch.tokens, batch.targets);
  }
  engine.backward(out);
  // On the parameter's device (the GPU under PATRICKSTAR_TEST_DEVICE=cuda), as a trainer would.
  w.mutable_grad() = torch::ones(w.sizes(), torch::TensorOptions().device(test::test_device()));
  for (int attempt = 0; attempt < 2; ++attempt) {  // refused again, nothing half-applied
    const std::string error = test::error_of([&] { engine.step(); });
    EXPECT_NE(error.find("blocks.1.fc.weight"), std::string::npos) << error;
    EXPECT_NE(error.find("frozen"), std::string::npos) << error;
  }
  w.mutable_grad().reset();
  engine.step();
  test::train_step(reference, reference_model, 1);
  for (int s = 2; s < 4; ++s) {
    test::train_step(engine, model, s, &loss);
    test::train_step(reference, reference_model, s, &expected);
    EXPECT_EQ(loss, expected) << "step " << s;
  }
}

TEST_F(LoraLean, FullStateLetsAFrozenParameterTrainLater) {
  models::Gpt model = lora_model();
  Engine engine(model.ptr(), with("{}", kFullState));
  test::train_step(engine, model, 0);
  at::Tensor w = model->named_parameters()["blocks.0.qkv.weight"];
  const at::Tensor before = engine_weights(engine).at("blocks.0.qkv.weight");
  w.requires_grad_(true);
  test::train_step(engine, model, 1);
  test::train_step(engine, model, 2);
  EXPECT_FALSE(torch::equal(engine_weights(engine).at("blocks.0.qkv.weight"), before));
}

TEST_F(LoraLean, GatheredParametersAndTeardownReadAndWriteALeanWeight) {
  models::Gpt model = lora_model();
  const at::Tensor built = model->named_parameters()["blocks.0.fc.weight"].detach().clone();
  at::Tensor w = model->named_parameters()["blocks.1.proj.weight"];
  at::Tensor half_weights;
  {
    Engine engine(model.ptr(), test::tight_config(R"({"bf16": {"enabled": true}})"));
    test::train_step(engine, model, 0);
    torch::nn::Module& block = *model->named_modules()["blocks.1"];
    const at::Tensor stored = engine_weights(engine).at("blocks.1.proj.weight");
    // In bf16 a lean weight is its half weight: the fp32 value it was built with, rounded once.
    EXPECT_TRUE(torch::equal(engine_weights(engine).at("blocks.0.fc.weight"),
                             built.to(at::kBFloat16).to(at::kFloat)));
    {
      GatheredParameters scope(block);
      EXPECT_EQ(w.scalar_type(), at::kFloat);
      EXPECT_TRUE(torch::equal(w.cpu(), stored));
      torch::NoGradGuard no_grad;
      w.fill_(0.5);
    }
    EXPECT_TRUE(torch::equal(engine_weights(engine).at("blocks.1.proj.weight"),
                             torch::full_like(stored, 0.5)));
    test::train_step(engine, model, 1);  // trains on from there
    EXPECT_TRUE(torch::equal(engine_weights(engine).at("blocks.1.proj.weight"),
                             torch::full_like(stored, 0.5)));
  }
  // The engine gives the model its lean weights back, widened to fp32.
  ASSERT_EQ(w.scalar_type(), at::kFloat);
  EXPECT_TRUE(torch::equal(w, torch::full_like(w, 0.5)));
  EXPECT_TRUE(torch::equal(model->named_parameters()["blocks.0.fc.weight"],
                           built.to(at::kBFloat16).to(at::kFloat)));
}

TEST_F(LoraLean, CheckpointsGoBothWaysBetweenLeanAndFullState) {
  test::TempFolder folder("lora-lean");
  const std::map<std::string, Config> configs = {{"lean", test::tight_config(kHostAdamBf16)},
                                                 {"full_state", with(kHostAdamBf16, kFullState)}};
  for (const auto& [from, to] : {std::pair{"lean", "full_state"}, {"full_state", "lean"}}) {
    SCOPED_TRACE(std::string(from) + " -> " + to);
    const std::string path = folder.path() + "/" + from + ".pt";
    models::Gpt a_model = lora_model(1);
    Engine a(a_model.ptr(), configs.at(from));
    train_engine(a, a_model, 0, 3, 1);
    a.save_checkpoint(path);
    const std::vector<double> a_rest = train_engine(a, a_model, 3, 3, 1);
    models::Gpt b_model = lora_model(99);
    Engine b(b_model.ptr(), configs.at(to));
    b.load_checkpoint(path);
    const std::vector<double> b_rest = train_engine(b, b_model, 3, 3, 1);
    for (size_t i = 0; i < a_rest.size(); ++i) EXPECT_EQ(b_rest[i], a_rest[i]) << "step " << 3 + i;
    const Weights a_weights = engine_weights(a), b_weights = engine_weights(b);
    for (const auto& [name, w] : a_weights) {
      // A full-state engine's frozen masters keep their fp32 values; the bf16 weights are equal.
      EXPECT_TRUE(torch::equal(b_weights.at(name).to(at::kBFloat16), w.to(at::kBFloat16))) << name;
      if (b_model->named_parameters()[name].requires_grad()) {
        EXPECT_TRUE(torch::equal(b_weights.at(name), w)) << name;
      }
    }
  }
}

TEST_F(LoraLean, TheDiskTierKeepsNoFilesForALeanBaseAndTrainsAlike) {
  test::TempFolder folder("lora-lean-disk");
  models::Gpt model = lora_model();
  Engine engine(model.ptr(), with(kHostAdamBf16, R"({"zero_optimization": {"offload_optimizer":
      {"device": "nvme", "nvme_path": ")" + folder.path() +
                                                     R"("}}})"));
  models::Gpt reference_model = lora_model();
  Engine reference(reference_model.ptr(), test::tight_config(kHostAdamBf16));
  const ChunkStore& store = inspect(engine).chunks();
  int64_t trained_indices = 0;
  for (int64_t i = 0; i < store.chunks_per_kind(); ++i) {
    trained_indices += store.omitted(store.chunk_id(ChunkKind::kMomentum, i)) ? 0 : 1;
  }
  ASSERT_GT(trained_indices, 0);
  ASSERT_LT(trained_indices, store.chunks_per_kind());
  // Master, momentum and variance of the trained indices only.
  EXPECT_EQ(static_cast<int64_t>(folder.files().size()), 3 * trained_indices);
  for (int s = 0; s < 4; ++s) {
    double loss = 0, expected = 0;
    test::train_step(engine, model, s, &loss);
    test::train_step(reference, reference_model, s, &expected);
    EXPECT_EQ(loss, expected) << "step " << s;
  }
  const Weights a = engine_weights(engine), b = engine_weights(reference);
  for (const auto& [name, w] : b) EXPECT_TRUE(torch::equal(a.at(name), w)) << name;
}

}  // namespace lora_test
}  // namespace patrickstar
