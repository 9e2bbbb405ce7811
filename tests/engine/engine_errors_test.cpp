// Misuse of the engine gets a clear error and leaves its state usable.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>

#include "error_message.h"
#include "patrickstar/models/gpt.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar {
namespace engine_errors_test {

Config small_config() {
  return Config::from_string(R"({"default_chunk_size": 40000,
      "client": {"device": {"capacity_bytes": 67108864}}})");
}

using test::error_of;

struct Fixture {
  Fixture() {
    torch::manual_seed(1);
    auto spec = models::gpt_spec("gpt_tiny");
    model = models::Gpt(spec);
    batch = models::random_tokens(spec, 2, 8, 3);
    engine = std::make_unique<Engine>(model.ptr(), small_config());
  }
  at::Tensor forward() {
    auto active = engine->activate();
    return model->loss(batch.tokens, batch.targets);
  }
  models::Gpt model{nullptr};
  models::TokenBatch batch;
  std::unique_ptr<Engine> engine;
};

TEST(EngineErrors, BackwardWithoutForward) {
  Fixture f;
  const std::string m = error_of([&] { f.engine->backward(torch::ones({}, torch::requires_grad())); });
  EXPECT_NE(m.find("backward() without a forward"), std::string::npos) << m;
}

TEST(EngineErrors, StepWithoutBackwardThenTheIterationStillWorks) {
  Fixture f;
  std::string m = error_of([&] { f.engine->step(); });
  EXPECT_NE(m.find("step() without a backward"), std::string::npos) << m;
  at::Tensor loss = f.forward();
  m = error_of([&] { f.engine->step(); });
  EXPECT_NE(m.find("step() without a backward"), std::string::npos) << m;
  f.engine->backward(loss);
  EXPECT_NO_THROW(f.engine->step());
}

TEST(EngineErrors, NonFiniteLossInFp32IsRejectedAndNothingChanges) {
  Fixture f;
  const auto before = f.engine->fp32_state_dict();
  at::Tensor loss = f.forward();
  const std::string m = error_of(
      [&] { f.engine->backward(loss * std::numeric_limits<float>::infinity()); });
  EXPECT_NE(m.find("the loss is inf in fp32"), std::string::npos) << m;
  const auto after = f.engine->fp32_state_dict();
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(torch::equal(before[i].second, after[i].second)) << before[i].first;
  }
  // The engine is ready for a fresh forward.
  loss = f.forward();
  f.engine->backward(loss);
  EXPECT_NO_THROW(f.engine->step());
}

TEST(EngineErrors, ParametersHaveNoDataOutsideADoor) {
  Fixture f;
  EXPECT_EQ(f.model->ln_f->weight.numel(), 64);  // the shape stays; the data is refused
  EXPECT_THROW(f.model->ln_f->weight.sum(), c10::Error);
  EXPECT_THROW(f.model->ln_f(torch::randn({2, 64})), c10::Error);
  EXPECT_THROW(f.model->blocks[0]->as<models::GptBlockImpl>()->fc(torch::randn({2, 64})),
               c10::Error);
}

// release_after_init frees chunks other ranks own: with one process it changes nothing.
TEST(EngineErrors, ReleaseAfterInitIsAcceptedInOneProcess) {
  torch::manual_seed(1);
  models::Gpt model(models::gpt_spec("gpt_tiny"));
  const int64_t tensors = static_cast<int64_t>(model->parameters().size());
  Engine engine(model.ptr(),
                Config::from_json({{"release_after_init", true}, {"default_chunk_size", 40000}}));
  EXPECT_EQ(engine.registration().tensors, tensors);
  EXPECT_TRUE(engine.config().release_after_init);
}

// A host budget smaller than the model data: a clear out-of-memory error before anything moves.
TEST(EngineErrors, HostBudgetTooSmallLeavesTheModelUntouched) {
  torch::manual_seed(1);
  models::Gpt model(models::gpt_spec("gpt_tiny"));
  const at::Tensor before = model->wte->weight.clone();
  bool out_of_memory = false;
  std::string m;
  try {
    Engine engine(model.ptr(),
                  Config::from_json({{"default_chunk_size", 40000},
                                     {"client", {{"device", {{"host_capacity_bytes", 1000000}}}}}}));
  } catch (const c10::OutOfMemoryError& e) {
    out_of_memory = true;
    m = e.what_without_backtrace();
  }
  EXPECT_TRUE(out_of_memory);
  EXPECT_NE(m.find("bytes of host memory but the host budget has 1000000 bytes left"),
            std::string::npos) << m;
  EXPECT_NE(m.find("nothing was registered"), std::string::npos) << m;
  EXPECT_TRUE(torch::equal(model->wte->weight, before));
  // The same model registers afterwards with enough room.
  Engine engine(model.ptr(), Config::from_json({{"default_chunk_size", 40000}}));
  EXPECT_EQ(engine.registration().params, models::gpt_spec("gpt_tiny").parameter_count());
}

TEST(EngineErrors, ModelWithoutParameters) {
  auto empty = std::make_shared<torch::nn::Module>();
  const std::string m = error_of([&] { Engine engine(empty, small_config()); });
  EXPECT_NE(m.find("has no parameters"), std::string::npos) << m;
}

TEST(EngineErrors, TensorLargerThanTheChunkNamesItAndLeavesTheModelUntouched) {
  torch::manual_seed(1);
  models::Gpt model(models::gpt_spec("gpt_tiny"));
  const at::Tensor before = model->wte->weight.detach().clone();
  const std::string m = error_of([&] {
    Engine engine(model.ptr(), Config::from_string(R"({"default_chunk_size": 1000})"));
  });
  EXPECT_NE(m.find("wte.weight"), std::string::npos) << m;
  EXPECT_NE(m.find("default_chunk_size"), std::string::npos) << m;
  EXPECT_TRUE(torch::equal(model->wte->weight, before));
}

TEST(EngineErrors, CheckpointOfAnotherModelIsRejectedAndChangesNothing) {
  const std::string path = ::testing::TempDir() + "/ps_other_model.pt";
  {
    torch::manual_seed(2);
    auto spec = models::gpt_spec("gpt_tiny");
    spec.layers = 1;
    models::Gpt other(spec);
    Engine engine(other.ptr(), small_config());
    engine.save_checkpoint(path);
  }
  Fixture f;
  const auto before = f.engine->fp32_state_dict();
  const std::string m = error_of([&] { f.engine->load_checkpoint(path); });
  EXPECT_NE(m.find("is from another model"), std::string::npos) << m;
  const auto after = f.engine->fp32_state_dict();
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(torch::equal(before[i].second, after[i].second)) << before[i].first;
  }
  std::remove(path.c_str());
  const std::string missing = error_of([&] { f.engine->load_checkpoint(path); });
  EXPECT_NE(missing.find("cannot read checkpoint"), std::string::npos) << missing;
}

TEST(EngineErrors, InitializeEngineHandlesAndTiedWeightsRegisteredOnce) {
  auto [model, optimizer] = initialize_engine(
      [] {
        torch::manual_seed(1);
        return models::Gpt(models::gpt_spec("gpt_tiny"));
      },
      0, small_config());
  const auto spec = models::gpt_spec("gpt_tiny");
  EXPECT_EQ(model.engine().registration().params, spec.parameter_count());
  auto batch = models::random_tokens(spec, 2, 8, 3);
  optimizer.zero_grad();
  at::Tensor loss = model->loss(batch.tokens, batch.targets);
  model.backward(loss);
  const IterationReport r = optimizer.step();
  EXPECT_TRUE(r.warmup);
  EXPECT_THROW(initialize_engine([] { return torch::nn::Linear(2, 2); }, 1, small_config()),
               c10::Error);
}

}  // namespace engine_errors_test
}  // namespace patrickstar
