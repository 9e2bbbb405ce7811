// Built against the installed package, as a user's own trainer is: prints the build line, then
// trains the model zoo's smallest GPT for two steps through the engine and builds the smallest
// Llama, through the public headers only (patrickstar::patrickstar and patrickstar::models), to prove
// the include paths and the link line are complete.
#include <cmath>
#include <iostream>

#include <patrickstar/models/gpt.h>
#include <patrickstar/models/llama.h>
#include <patrickstar/patrickstar.h>

int main() {
  std::cout << patrickstar::build_info() << "\n";
  namespace models = patrickstar::models;
  const models::GptSpec spec = models::gpt_spec("gpt_tiny");
  patrickstar::Config config = patrickstar::Config::from_string(
      R"({"optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
          "client": {"device": {"capacity_bytes": 16777216}}})");
  auto [model, optimizer] =
      patrickstar::initialize_engine([&] { return models::Gpt(spec); }, 0, config);
  double loss_value = 0;
  for (int step = 0; step < 2; ++step) {
    const models::TokenBatch batch = models::random_tokens(spec, 2, 16, 7);
    optimizer.zero_grad();
    at::Tensor loss = model->loss(batch.tokens, batch.targets);
    loss.backward();
    optimizer.step();
    loss_value = loss.item<double>();
  }
  const models::Llama llama(models::llama_spec("llama_tiny"));
  std::cout << "models: gpt_tiny (" << spec.parameter_count() << " parameters) trained 2 steps, loss "
            << loss_value << "; llama_tiny has " << llama->spec().parameter_count()
            << " parameters\n";
  return std::isfinite(loss_value) ? 0 : 1;
}
