// The call / ModuleScope doors, driven by a recording handler, and the GPT model zoo that uses them.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "patrickstar/engine/module_hooks.h"
#include "patrickstar/models/gpt.h"

namespace patrickstar {
namespace module_hooks_test {

class RecordingHandler : public ModuleHookHandler {
 public:
  int64_t pre_forward(torch::nn::Module& module) override {
    events.push_back("pre " + module.name());
    modules.push_back(&module);
    return static_cast<int64_t>(modules.size()) - 1;
  }
  std::vector<at::Tensor> post_forward(int64_t token, std::vector<at::Tensor> outputs) override {
    events.push_back("post " + modules.at(static_cast<size_t>(token))->name() + " outputs=" +
                     std::to_string(outputs.size()));
    for (auto& t : outputs) t = t * 1;  // a visible change: the door must return what we return
    return outputs;
  }
  std::vector<std::string> events;
  std::vector<torch::nn::Module*> modules;
};

TEST(ModuleHooks, CallIsAPlainCallWithoutAnEngine) {
  torch::nn::Linear fc(3, 2);
  at::Tensor x = torch::randn({4, 3});
  EXPECT_EQ(active_module_hook_handler(), nullptr);
  EXPECT_TRUE(torch::equal(call(fc, x), fc(x)));
}

TEST(ModuleHooks, CallRunsTheHandlerAroundTheForwardAndReturnsItsOutputs) {
  torch::nn::Linear fc(3, 2);
  RecordingHandler handler;
  at::Tensor y;
  {
    ActiveHandlerGuard guard(&handler);
    EXPECT_EQ(active_module_hook_handler(), &handler);
    y = call(fc, torch::randn({4, 3}));
  }
  EXPECT_EQ(active_module_hook_handler(), nullptr);
  ASSERT_EQ(handler.events.size(), 2u);
  EXPECT_EQ(handler.events[0], "pre torch::nn::LinearImpl");
  EXPECT_EQ(handler.events[1], "post torch::nn::LinearImpl outputs=1");
  EXPECT_FALSE(y.is_leaf());
}

TEST(ModuleHooks, AScopeWhoseForwardThrowsStillReleases) {
  torch::nn::Linear fc(3, 2);
  RecordingHandler handler;
  ActiveHandlerGuard guard(&handler);
  EXPECT_THROW(call(fc, torch::randn({4, 5})), c10::Error);  // wrong input width
  ASSERT_EQ(handler.events.size(), 2u);
  EXPECT_EQ(handler.events[1], "post torch::nn::LinearImpl outputs=0");
}

TEST(GptModel, ParameterCountFormulaMatchesTheModule) {
  for (const std::string name : {"gpt_tiny", "gpt_mini"}) {
    const auto spec = models::gpt_spec(name);
    models::Gpt model(spec);
    int64_t numel = 0;
    for (const auto& p : model->parameters()) numel += p.numel();
    EXPECT_EQ(numel, spec.parameter_count()) << name;
  }
  // The published size class of the big ones: GPT3_10B has ~10 billion parameters.
  EXPECT_NEAR(models::gpt_spec("GPT3_10B").parameter_count() / 1e9, 10.3, 0.2);
  EXPECT_THROW(models::gpt_spec("GPT5"), c10::Error);
}

TEST(GptModel, EveryParameterOwningModuleGoesThroughADoor) {
  const auto spec = models::gpt_spec("gpt_tiny");
  models::Gpt model(spec);
  auto batch = models::random_tokens(spec, 2, 8, 1);
  RecordingHandler handler;
  at::Tensor loss;
  {
    ActiveHandlerGuard guard(&handler);
    loss = model->loss(batch.tokens, batch.targets);
  }
  // wte, wpe, 6 per block, ln_f and the tied head (wte again).
  EXPECT_EQ(handler.modules.size(), static_cast<size_t>(2 + 6 * spec.layers + 2));
  std::set<torch::nn::Module*> seen(handler.modules.begin(), handler.modules.end());
  for (const auto& child : model->modules(/*include_self=*/false)) {
    if (!child->parameters(/*recurse=*/false).empty()) {
      EXPECT_TRUE(seen.count(child.get())) << child->name() << " owns parameters but had no door";
    }
  }
  EXPECT_NEAR(loss.item<double>(), std::log(static_cast<double>(spec.vocab)), 0.5)
      << "an untrained model predicts about uniformly";
}

TEST(GptModel, RandomTokensAreSeededAndShifted) {
  const auto spec = models::gpt_spec("gpt_tiny");
  auto a = models::random_tokens(spec, 3, 16, 42), b = models::random_tokens(spec, 3, 16, 42);
  EXPECT_TRUE(torch::equal(a.tokens, b.tokens));
  EXPECT_TRUE(torch::equal(a.tokens.narrow(1, 1, 15), a.targets.narrow(1, 0, 15)));
  EXPECT_LT(a.tokens.max().item<int64_t>(), spec.vocab);
}

}  // namespace module_hooks_test
}  // namespace patrickstar
