// Deferred initialization (patrickstar/engine/deferred_init.h, GptSpec::deferred_init): a model
// whose parameters get their values in their chunks at registration, never all in fp32 at once,
// trained through the engine against plain LibTorch on the same values (materialize_parameters).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "error_message.h"
#include "gpt_training.h"
#include "patrickstar/engine/deferred_init.h"
#include "patrickstar/memtracer/counting_allocator.h"
#include "temp_folder.h"
#include "test_device.h"

namespace patrickstar {
namespace deferred_init_test {

models::GptSpec deferred_spec(int64_t layers = 2, int64_t lora_rank = 0) {
  models::GptSpec spec = test::tiny();
  spec.layers = layers;
  spec.deferred_init = true;
  spec.lora_rank = lora_rank;
  return spec;
}

models::Gpt deferred_model(uint64_t seed = 1, int64_t layers = 2, int64_t lora_rank = 0) {
  torch::manual_seed(seed);
  return models::Gpt(deferred_spec(layers, lora_rank));
}

std::map<std::string, at::Tensor> values_of(torch::nn::Module& model) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : model.named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

TEST(DeferredInit, AZooModelHoldsNoWeightsUntilMaterializedAndItsValuesFollowTheNames) {
  models::Gpt model = deferred_model(1, 2, /*lora_rank=*/2);
  int64_t deferred = 0, adapters = 0;
  for (const auto& p : model->named_parameters()) {
    const bool adapter = p.key().find("_lora.") != std::string::npos;
    EXPECT_EQ(is_deferred(p.value()), !adapter) << p.key();  // the adapters keep their data
    deferred += is_deferred(p.value()) ? 1 : 0;
    adapters += adapter ? 1 : 0;
  }
  ASSERT_GT(adapters, 0);
  const std::string read = test::error_of([&] { (void)model->wte->weight.sum(); });
  EXPECT_NE(read.find("deferred"), std::string::npos) << read;
  EXPECT_NE(read.find("materialize_parameters"), std::string::npos) << read;

  EXPECT_EQ(materialize_parameters(*model), deferred);
  EXPECT_EQ(materialize_parameters(*model), 0);  // nothing left to do
  const auto a = values_of(*model);
  for (const auto& [name, v] : a) ASSERT_TRUE(torch::isfinite(v).all().item<bool>()) << name;
  EXPECT_TRUE(torch::equal(a.at("ln_f.weight"), torch::ones({test::tiny().hidden})));
  EXPECT_TRUE(torch::equal(a.at("blocks.0.qkv.bias"), torch::zeros({3 * test::tiny().hidden})));
  EXPECT_FALSE(torch::equal(a.at("blocks.0.fc.weight").flatten().narrow(0, 0, 256),
                            a.at("blocks.1.fc.weight").flatten().narrow(0, 0, 256)));
  // A parameter's value depends on its name and the seed, not on what else the model has.
  models::Gpt longer = deferred_model(1, 3, 2);
  materialize_parameters(*longer);
  const auto b = values_of(*longer);
  EXPECT_TRUE(torch::equal(a.at("blocks.1.fc.weight"), b.at("blocks.1.fc.weight")));
  EXPECT_TRUE(torch::equal(a.at("wte.weight"), b.at("wte.weight")));
  models::Gpt other_seed = deferred_model(2, 2, 2);
  materialize_parameters(*other_seed);
  EXPECT_FALSE(torch::equal(a.at("wte.weight"), values_of(*other_seed).at("wte.weight")));
}

TEST(DeferredInit, TheEngineTrainsAsPlainLibTorchOnTheMaterializedValues) {
  constexpr int kSteps = 5;
  // The reference: the same spec and seed, materialized, AdamW as tight_config's.
  models::Gpt plain = deferred_model();
  ASSERT_GT(materialize_parameters(*plain), 0);
  const auto initial = values_of(*plain);
  torch::optim::AdamW adamw(
      plain->parameters(),
      torch::optim::AdamWOptions(3e-3).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.01));
  std::vector<double> expected;
  for (int s = 0; s < kSteps; ++s) {
    auto batch = test::batch_of_step(s);
    adamw.zero_grad();
    at::Tensor loss = plain->loss(batch.tokens, batch.targets);
    loss.backward();
    adamw.step();
    expected.push_back(loss.item<double>());
  }
  models::Gpt model = deferred_model();
  Engine engine(model.ptr(), test::tight_config());
  // Registration wrote each parameter's value into its chunk: the initializer's, exactly.
  for (const auto& [name, value] : engine.fp32_state_dict()) {
    EXPECT_TRUE(torch::equal(value, initial.at(name))) << name;
  }
  std::vector<double> losses;
  for (int s = 0; s < kSteps; ++s) {
    double loss = 0;
    test::train_step(engine, model, s, &loss);
    losses.push_back(loss);
  }
  const double diff = test::max_relative_difference(losses, expected);
  std::printf(
      "deferred gpt_tiny: engine against plain LibTorch, max relative loss difference %.3g\n",
      diff);
  EXPECT_LE(diff, 1e-5);
  EXPECT_LT(expected.back(), expected.front()) << "the reference must actually train";
}

TEST(DeferredInit, ALeanFineTuneNeverHoldsTheModelInFp32) {
  // gpt_mini with adapters in bf16: a lean frozen base costs 2 bytes per parameter, half of the
  // fp32 model that a model built whole holds first.
  models::GptSpec spec = models::gpt_spec("gpt_mini");
  spec.lora_rank = 4;
  const Config config =
      Config::from_json({{"default_chunk_size", "auto"}, {"bf16", {{"enabled", true}}}});
  const int64_t fp32_model = 4 * spec.parameter_count();
  for (const bool deferred : {false, true}) {
    SCOPED_TRACE(deferred ? "deferred" : "built whole");
    spec.deferred_init = deferred;
    auto [model, optimizer] = initialize_engine(
        [&] {
          torch::manual_seed(1);
          return models::Gpt(spec);
        },
        0, config);
    const RegistrationReport& r = model.engine().registration();
    std::printf(
        "%s: construction peak %lld, init host peak %lld, goal %lld, fp32 model %lld bytes\n",
        deferred ? "deferred" : "whole", static_cast<long long>(r.model_construction_peak_bytes),
        static_cast<long long>(r.host_peak_bytes_during_init),
        static_cast<long long>(r.init_goal_bytes), static_cast<long long>(fp32_model));
    ASSERT_LT(r.init_goal_bytes, fp32_model);  // what makes the difference
    if (deferred) {
      // Construction holds about one module at a time (the largest: wte, vocab x hidden).
      EXPECT_LE(r.model_construction_peak_bytes, 2 * r.largest_module_param_bytes);
      EXPECT_LE(r.host_peak_bytes_during_init, r.init_goal_bytes);
    } else {
      EXPECT_GE(r.model_construction_peak_bytes, fp32_model);
      EXPECT_GT(r.host_peak_bytes_during_init, r.init_goal_bytes);
    }
    // It trains.
    const auto batch = models::random_tokens(spec, 2, 16, 7);
    optimizer.zero_grad();
    at::Tensor loss = model->loss(batch.tokens, batch.targets);
    model.backward(loss);
    optimizer.step();
    EXPECT_TRUE(std::isfinite(loss.item<double>()));
  }
}

TEST(DeferredInit, TheDiskTierWithBf16StatesTrainsAsWithout) {
  test::TempFolder folder("deferred-disk");
  const std::string bf16 =
      R"({"bf16": {"enabled": true}, "optimizer": {"params": {"state_dtype": "bf16"}}})";
  nlohmann::json disk = test::tight_config(bf16).to_json();
  disk.merge_patch({{"zero_optimization",
                     {{"offload_optimizer", {{"device", "nvme"}, {"nvme_path", folder.path()}}}}}});
  models::Gpt model = deferred_model();
  Engine engine(model.ptr(), Config::from_json(disk));
  models::Gpt reference_model = deferred_model();
  Engine reference(reference_model.ptr(), test::tight_config(bf16));
  EXPECT_GT(engine.registration().disk_bytes, 0);
  for (int s = 0; s < 4; ++s) {
    double loss = 0, expected = 0;
    test::train_step(engine, model, s, &loss);
    test::train_step(reference, reference_model, s, &expected);
    EXPECT_EQ(loss, expected) << "step " << s;
  }
}

// Destroying the engine gives the model fp32 weights, the whole model in fp32, which is more than
// a lean base's model data; when the engine holds the last reference to the model (the handles
// went first) nobody can read them, and it gives none.
TEST(DeferredInit, AnEngineHoldingTheLastReferenceToItsModelGivesNoValuesBack) {
  models::GptSpec spec = models::gpt_spec("gpt_mini");
  spec.lora_rank = 4;
  spec.deferred_init = true;
  const Config config =
      Config::from_json({{"default_chunk_size", "auto"}, {"bf16", {{"enabled", true}}}});
  CountingCpuAllocator& counter = CountingCpuAllocator::install();
  int64_t given[2] = {0, 0};  // the peak of the handles' destruction, kept / not kept
  at::Tensor orphan;          // a parameter kept without its model
  for (const bool keep : {true, false}) {
    std::shared_ptr<models::GptImpl> kept;
    ScopedPeakWindow window(counter);
    int64_t live = 0;
    {
      auto [model, optimizer] = initialize_engine(
          [&] {
            torch::manual_seed(1);
            return models::Gpt(spec);
          },
          0, config);
      const auto batch = models::random_tokens(spec, 2, 16, 7);
      optimizer.zero_grad();
      model.backward(model->loss(batch.tokens, batch.targets));
      optimizer.step();
      if (keep) kept = model.module_ptr();
      if (!keep) orphan = model.module().ln_f->weight;
      live = counter.live_bytes();
      window.reset();
    }
    given[keep ? 0 : 1] = window.peak_bytes() - live;
    if (keep) {
      ASSERT_FALSE(is_deferred(kept->wte->weight));
      EXPECT_EQ(kept->wte->weight.scalar_type(), at::kFloat);
      EXPECT_TRUE(torch::isfinite(kept->wte->weight).all().item<bool>());
    }
  }
  std::printf(
      "destroying the handles: %lld bytes allocated at most with the model kept, %lld "
      "without\n",
      static_cast<long long>(given[0]), static_cast<long long>(given[1]));
  // Kept: at least the largest parameter in fp32 (wte), at once. Not kept: nothing of the kind.
  EXPECT_GE(given[0], 4 * spec.vocab * spec.hidden);
  EXPECT_LT(given[1], 4 * spec.hidden * spec.hidden);
  // A parameter kept without its model says why it has no value.
  const std::string read = test::error_of([&] { (void)orphan.sum(); });
  EXPECT_NE(read.find("ln_f.weight"), std::string::npos) << read;
  EXPECT_NE(read.find("last reference"), std::string::npos) << read;
}

// A deferred parameter nobody can initialize, or whose initializer throws: refused, naming it,
// with nothing registered.
constexpr const char* kAuto = R"({"default_chunk_size": "auto"})";

struct Refusing : torch::nn::Module, ParameterInitializer {
  Refusing() {
    inner = register_module("inner", torch::nn::Linear(4, 3));
    defer_parameters(*inner);
  }
  void initialize_parameter(const std::string& name, at::Tensor& value) const override {
    TORCH_CHECK(!refuse || name != "inner.bias", "no value for ", name);
    value.fill_(0.5);
  }
  torch::nn::Linear inner{nullptr};
  bool refuse = true;
};

TEST(DeferredInit, AParameterWithoutAValueIsRefusedNamingItAndNothingStaysRegistered) {
  auto plain = std::make_shared<torch::nn::SequentialImpl>(torch::nn::Linear(4, 3));
  defer_parameters(*plain);
  const std::string none = test::error_of([&] { Engine engine(plain, test::tight_config(kAuto)); });
  EXPECT_NE(none.find("0.weight"), std::string::npos) << none;
  EXPECT_NE(none.find("ParameterInitializer"), std::string::npos) << none;
  for (const at::Tensor& p : plain->parameters()) EXPECT_TRUE(is_deferred(p));
  EXPECT_NE(test::error_of([&] { materialize_parameters(*plain); }).find("0.weight"),
            std::string::npos);

  auto refusing = std::make_shared<Refusing>();
  const std::string thrown =
      test::error_of([&] { Engine engine(refusing, test::tight_config(kAuto)); });
  EXPECT_NE(thrown.find("no value for inner.bias"), std::string::npos) << thrown;
  // Deferred as before (its weight had moved into a chunk): nothing in fp32 on the host.
  EXPECT_TRUE(is_deferred(refusing->inner->weight));
  EXPECT_TRUE(is_deferred(refusing->inner->bias));
  // The model can go to another engine, and its values are the initializer's there.
  refusing->refuse = false;
  Engine engine(refusing, test::tight_config(kAuto));
  for (const auto& [name, value] : engine.fp32_state_dict()) {
    EXPECT_TRUE(torch::equal(value, torch::full_like(value, 0.5))) << name;
  }

  torch::nn::Linear doubled(2, 2);
  doubled->to(at::kDouble);
  const std::string wrong = test::error_of([&] { defer_parameters(*doubled); });
  EXPECT_NE(wrong.find("only fp32"), std::string::npos) << wrong;
  for (const at::Tensor& p : doubled->parameters()) EXPECT_FALSE(is_deferred(p));
}

}  // namespace deferred_init_test
}  // namespace patrickstar
