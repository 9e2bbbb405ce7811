// Bad calls at the API (issue: reliability), as one table: each is a clear error, nothing is half
// applied (the weights, optimizer state and loss scale are as before, or the model is untouched),
// and the engine then trains exactly as one that never saw the call.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "error_message.h"
#include "gpt_training.h"
#include "patrickstar/engine/engine_inspect.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar {
namespace bad_calls_test {

using ::testing::HasSubstr;
using test::error_of;
using namespace test;  // NOLINT: the shared helpers of gpt_training.h

std::vector<at::Tensor> state_of(const Engine& engine) {
  std::vector<at::Tensor> out;
  const ChunkStore& store = inspect(engine).chunks();
  for (ChunkId id = 0; id < store.chunk_count(); ++id) {
    if (store.kind_of(id) != ChunkKind::kGrad) out.push_back(store.chunk_view(id).clone());
  }
  out.push_back(torch::tensor(engine.loss_scale(), at::kDouble));
  return out;
}

bool same(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i], b[i])) return false;
  }
  return true;
}

at::Tensor forward(Engine& engine, models::Gpt& model, int step) {
  auto batch = batch_of_step(step);
  auto active = engine.activate();
  return model->loss(batch.tokens, batch.targets);
}

struct Call {
  const char* what;
  std::function<void(Engine&, models::Gpt&)> call;
  const char* error;  // a part of the message
};

TEST(BadCalls, EachIsAClearErrorAndChangesNothing) {
  const std::string missing = ::testing::TempDir() + "/ps_no_such_folder/ckpt.pt";
  const std::vector<Call> calls = {
      {"backward of a loss that is not a scalar",
       [](Engine& e, models::Gpt& m) { e.backward(forward(e, m, 1).unsqueeze(0).repeat({2})); },
       "backward() takes the scalar loss"},
      {"backward of a loss that needs no gradient",
       [](Engine& e, models::Gpt& m) { e.backward(forward(e, m, 1).detach()); },
       "backward() takes the scalar loss"},
      {"backward twice after one forward",
       [](Engine& e, models::Gpt& m) {
         at::Tensor loss = forward(e, m, 1);
         e.backward(loss);
         e.backward(loss);
       },
       "backward() without a forward since the last backward"},
      {"backward without a forward", [](Engine& e, models::Gpt&) { e.backward(torch::ones({})); },
       "backward() without a forward since the last step"},
      {"step twice",
       [](Engine& e, models::Gpt& m) {
         train_step(e, m, 1);
         e.step();
       },
       "step() without a backward since the last step"},
      {"step without a backward after a forward",
       [](Engine& e, models::Gpt& m) {
         forward(e, m, 1);
         e.step();
       },
       "(call backward(loss) first)"},
      {"save_checkpoint into a missing folder",
       [&](Engine& e, models::Gpt&) { e.save_checkpoint(missing); }, "No such file or directory"},
      {"save_weights into a missing folder",
       [&](Engine& e, models::Gpt&) { e.save_weights(missing); }, "No such file or directory"},
      {"load_checkpoint of a missing file",
       [&](Engine& e, models::Gpt&) { e.load_checkpoint(missing); }, "cannot read checkpoint"},
      {"save_checkpoint in the middle of an iteration",
       [&](Engine& e, models::Gpt& m) {
         forward(e, m, 1);
         e.save_checkpoint(missing);
       },
       "in the middle of an iteration"},
      {"load_checkpoint in the middle of an iteration",
       [&](Engine& e, models::Gpt& m) {
         forward(e, m, 1);
         e.load_checkpoint(missing);
       },
       "in the middle of an iteration"},
      {"a negative learning rate", [](Engine& e, models::Gpt&) { e.set_lr(-1e-3); },
       "the learning rate must be finite and not negative"},
      {"a learning rate that is not a number", [](Engine& e, models::Gpt&) { e.set_lr(NAN); },
       "the learning rate must be finite and not negative"},
  };
  // The reference: two clean steps.
  std::vector<at::Tensor> reference_state;
  double reference_loss = 0;
  {
    models::Gpt model = make_model(1);
    Engine engine(model.ptr(), tight_config());
    train_step(engine, model, 0);
    train_step(engine, model, 1, &reference_loss);
    reference_state = state_of(engine);
  }
  for (const Call& c : calls) {
    SCOPED_TRACE(c.what);
    models::Gpt model = make_model(1);
    Engine engine(model.ptr(), tight_config());
    train_step(engine, model, 0);
    const std::vector<at::Tensor> before = state_of(engine);
    const double lr = engine.lr();
    const std::string error = error_of([&] { c.call(engine, model); });
    EXPECT_THAT(error, HasSubstr(c.error));
    if (std::string(c.what) == "step twice") {
      // The first step was a good one: the state is the reference's after it.
      EXPECT_TRUE(same(state_of(engine), reference_state));
      continue;
    }
    EXPECT_TRUE(same(state_of(engine), before)) << error;
    EXPECT_EQ(engine.lr(), lr);
    // Whatever the call left (a forward, a backward's gradients) is dropped, and training goes on
    // exactly as the reference.
    engine.zero_grad();
    double loss = 0;
    train_step(engine, model, 1, &loss);
    EXPECT_EQ(loss, reference_loss);
    EXPECT_TRUE(same(state_of(engine), reference_state));
  }
}

// A module with a parameter the engine cannot take.
struct OddImpl : torch::nn::Module {
  explicit OddImpl(at::Tensor odd) {
    fc = register_module("fc", torch::nn::Linear(4, 4));
    register_parameter("odd", std::move(odd), /*requires_grad=*/false);
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Odd);

TEST(BadCalls, ModelsTheEngineCannotTakeAreRefusedUntouched) {
  struct Model {
    const char* what;
    at::Tensor odd;
    const char* error;
  };
  const std::vector<Model> models = {
      {"an integer parameter", torch::zeros({3}, at::kLong), "parameter odd is Long"},
      {"a double parameter", torch::zeros({3}, at::kDouble), "parameter odd is Double"},
      {"a half parameter", torch::zeros({3}, at::kHalf), "parameter odd is Half"},
      {"a parameter not on the CPU", torch::zeros({3}, at::TensorOptions().device(at::kMeta)),
       "on meta"},
  };
  for (const Model& m : models) {
    SCOPED_TRACE(m.what);
    torch::manual_seed(3);
    Odd model(m.odd);
    const at::Tensor weight = model->fc->weight.detach().clone();
    const std::string error = error_of([&] { Engine engine(model.ptr(), tight_config()); });
    EXPECT_THAT(error, HasSubstr(m.error));
    EXPECT_THAT(error, HasSubstr("build the model in fp32 on the CPU"));
    EXPECT_TRUE(torch::equal(model->fc->weight, weight));
    EXPECT_EQ(model->named_parameters()["odd"].scalar_type(), m.odd.scalar_type());
  }
}

TEST(BadCalls, AFactoryThatThrowsPassesItsErrorThroughAndTheNextEngineWorks) {
  EXPECT_THROW(
      {
        try {
          initialize_engine([]() -> models::Gpt { throw std::runtime_error("no weights file"); }, 0,
                            tight_config());
        } catch (const std::runtime_error& e) {
          EXPECT_STREQ(e.what(), "no weights file");
          throw;
        }
      },
      std::runtime_error);
  auto [model, optimizer] = initialize_engine([] { return make_model(1); }, 0, tight_config());
  auto batch = batch_of_step(0);
  optimizer.zero_grad();
  at::Tensor loss = model->loss(batch.tokens, batch.targets);
  model.backward(loss);
  EXPECT_TRUE(optimizer.step().warmup);
  EXPECT_TRUE(std::isfinite(loss.item<double>()));
}

}  // namespace bad_calls_test
}  // namespace patrickstar
