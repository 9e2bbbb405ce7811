// The zoo's Llama against Hugging Face transformers itself: tests/data/llama holds two small
// LlamaForCausalLM checkpoints written by transformers' save_pretrained (sharded fp32 with grouped-
// query attention; one bf16 file, tied head, Llama 3.1's rotary scaling) and what transformers
// computed on them (scripts/llama-reference generate): logits, loss, every gradient, and the logits
// after one torch.optim.AdamW step. The suite reads them without Python.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include "test_data.h"
#include "patrickstar/models/llama.h"
#include "patrickstar/models/llama_pretrained.h"
#include "patrickstar/patrickstar.h"
#include "safetensors_format.h"
#include "temp_folder.h"
#include "test_device.h"

namespace patrickstar {
namespace llama_test {

std::string reference_folder(const std::string& name) {
  return patrickstar::testing::test_data_dir() + "/llama/" + name;
}

// max |a - b| / max |b| (0 when b is all zeros and a equals it).
double relative_error(const at::Tensor& a, const at::Tensor& b) {
  const double scale = b.abs().max().item<double>();
  const double diff = (a.to(at::kFloat).cpu() - b).abs().max().item<double>();
  return scale > 0 ? diff / scale : diff;
}

struct Reference {
  explicit Reference(const std::string& name)
      : folder(reference_folder(name)), file(folder + "/reference.safetensors") {}
  std::string folder;
  SafetensorsCheckpoint file;
  at::Tensor ids() const { return file.read("input_ids"); }
};

// The model of a reference folder, from its config.json and checkpoint (deferred).
models::Llama load(const std::string& folder, bool materialize) {
  models::Llama model(models::llama_spec_from_pretrained(folder));
  model->initialize_from(std::make_shared<SafetensorsCheckpoint>(folder));
  if (materialize) materialize_parameters(*model);
  return model;
}

Config adamw_config(const std::string& extra = "{}") {
  // torch.optim.AdamW(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0) as the script's.
  nlohmann::json j = {
      {"optimizer",
       {{"type", "AdamW"},
        {"params", {{"lr", 1e-2}, {"betas", {0.9, 0.999}}, {"eps", 1e-8}, {"weight_decay", 0.0}}}}},
      {"default_chunk_size", 40000},
      {"client", {{"device", {{"capacity_bytes", 4 << 20}}}}}};
  j.merge_patch(nlohmann::json::parse(extra));
  Config config = Config::from_json(j);
  test::use_test_device(config);
  return config;
}

at::Tensor forward_through(Engine& engine, models::Llama& model, const at::Tensor& ids) {
  torch::NoGradGuard no_grad;
  auto active = engine.activate();
  return model->forward(ids.to(test::test_device())).to(at::kCPU);
}

class LlamaReference : public test::OnTestDevice,
                       public ::testing::WithParamInterface<std::string> {};

TEST_P(LlamaReference, PlainLibTorchGivesTransformersLogitsAndLoss) {
  // Tolerance: 1e-5 of the largest logit and of the loss. The same fp32 arithmetic (LibTorch's
  // kernels are PyTorch's; under another ATEN_CPU_CAPABILITY, in another order); a misplaced or
  // mis-rotated tensor is off by the logits' own size.
  const Reference ref(GetParam());
  models::Llama model = load(ref.folder, /*materialize=*/true);
  const at::Tensor ids = ref.ids();
  const at::Tensor logits = model->forward(ids);
  const double logit_error = relative_error(logits, ref.file.read("logits"));
  const int64_t seq = ids.size(1);
  const at::Tensor loss = model->loss(ids.narrow(1, 0, seq - 1), ids.narrow(1, 1, seq - 1));
  const double loss_error = relative_error(loss.reshape({1}), ref.file.read("loss"));
  std::printf("%s: logits within %.3g of transformers' (relative), loss within %.3g\n",
              GetParam().c_str(), logit_error, loss_error);
  EXPECT_LE(logit_error, 1e-5);
  EXPECT_LE(loss_error, 1e-5);
}

TEST_P(LlamaReference, OneEngineStepGivesTransformersGradientsAndAdamW) {
  // Tolerances: gradients within 1e-4 of each tensor's largest (fp32 sums in another order through
  // the engine's chunks); logits after one AdamW step within 1e-3 (Adam divides each gradient by
  // its own size, so a last-bit difference in a gradient near zero moves its update by up to lr).
  const Reference ref(GetParam());
  models::Llama model = load(ref.folder, /*materialize=*/false);
  Engine engine(model.ptr(), adamw_config());
  const at::Tensor ids = ref.ids().to(test::test_device());
  const int64_t seq = ids.size(1);
  at::Tensor loss;
  {
    auto active = engine.activate();
    loss = model->loss(ids.narrow(1, 0, seq - 1), ids.narrow(1, 1, seq - 1));
  }
  engine.backward(loss);
  double worst = 0;
  std::string worst_name;
  int64_t compared = 0;
  for (const auto& p : model->named_parameters()) {
    const std::string hf = models::LlamaImpl::hf_name(p.key());
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    const double e = relative_error(p.value().grad(), ref.file.read("grad." + hf));
    if (e > worst) worst = e, worst_name = hf;
    ++compared;
  }
  engine.step();
  const double after =
      relative_error(forward_through(engine, model, ids), ref.file.read("logits_after_step"));
  std::printf(
      "%s: %ld gradients within %.3g of PyTorch's (worst %s); logits after one AdamW step "
      "within %.3g\n",
      GetParam().c_str(), static_cast<long>(compared), worst, worst_name.c_str(), after);
  EXPECT_EQ(compared, static_cast<int64_t>(ref.file.names().size()) - 4);  // ids, logits x2, loss
  EXPECT_LE(worst, 1e-4) << worst_name;
  EXPECT_LE(after, 1e-3);
}

INSTANTIATE_TEST_SUITE_P(Checkpoints, LlamaReference, ::testing::Values("tiny", "tiny_tied_bf16"));

// Trains the sharded checkpoint through the engine and writes it back (save_pretrained); our reader
// gives the same values to a plain model, whose logits are the engine's. With
// PATRICKSTAR_LLAMA_OUT set, the folder goes there with patrickstar_logits.safetensors (ids and
// logits), which the ctest llama.transformers_loads_it hands to transformers
// (scripts/llama-reference check).
class LlamaPretrained : public test::OnTestDevice {};

TEST_F(LlamaPretrained, TrainsAndWritesACheckpointThatLoadsWithEqualLogits) {
  const Reference ref("tiny");
  test::TempFolder temp("llama");
  const char* out_env = std::getenv("PATRICKSTAR_LLAMA_OUT");
  const std::string out = out_env != nullptr ? out_env : temp.path();
  models::Llama model = load(ref.folder, /*materialize=*/false);
  Engine engine(model.ptr(), adamw_config());
  const at::Tensor ids = ref.ids().to(test::test_device());
  const int64_t seq = ids.size(1);
  std::vector<double> losses;
  for (int s = 0; s < 3; ++s) {
    engine.zero_grad();
    at::Tensor loss;
    {
      auto active = engine.activate();
      loss = model->loss(ids.narrow(1, 0, seq - 1), ids.narrow(1, 1, seq - 1));
    }
    engine.backward(loss);
    engine.step();
    losses.push_back(loss.item<double>());
  }
  EXPECT_LT(losses.back(), losses.front());
  SafetensorsOptions options;
  options.max_shard_bytes = 200 * 1000;  // several shards and their index
  const SafetensorsSaveReport report = models::save_pretrained(engine, *model, out, options);
  EXPECT_GT(report.files.size(), 1u);
  EXPECT_EQ(report.bytes, model->spec().parameter_count() * 4);
  const at::Tensor logits = forward_through(engine, model, ids);

  // Read back by our reader into a plain model: the engine's logits.
  models::Llama reloaded = load(out, /*materialize=*/true);
  const double diff = relative_error(reloaded->forward(ids.cpu()), logits);
  std::printf(
      "trained 3 steps (loss %.4f -> %.4f), wrote %zu shards of %ld bytes; a plain model "
      "from them gives logits within %.3g of the engine's (relative)\n",
      losses.front(), losses.back(), report.files.size(), static_cast<long>(report.bytes), diff);
  EXPECT_LE(diff, 1e-5);  // the same values; on a GPU the engine's kernels are cuBLAS's
  // config.json keeps what the source had beyond the shape (the token ids).
  std::ifstream config(out + "/config.json");
  const nlohmann::json written = nlohmann::json::parse(config);
  EXPECT_EQ(written.value("bos_token_id", -1), 1);
  EXPECT_EQ(written.value("eos_token_id", -1), 2);
  EXPECT_EQ(written.value("num_key_value_heads", -1), 2);
  // What transformers is checked against: the ids (as fp32, exact) and our logits.
  SafetensorsOptions plain;
  SafetensorsFolderWriter writer(
      out + "/expected", {{"input_ids", ids.sizes().vec()}, {"logits", logits.sizes().vec()}},
      plain);
  writer.write("input_ids", ids.cpu().to(at::kFloat));
  writer.write("logits", logits);
  writer.commit();
  std::rename((out + "/expected/model.safetensors").c_str(),
              (out + "/patrickstar_logits.safetensors").c_str());
  std::remove((out + "/expected").c_str());
}

}  // namespace llama_test
}  // namespace patrickstar
