// The smallest patrickstar trainer: a two-layer MLP on random data, through initialize_engine.
// Usage: minimal_example config.json
#include <cstdio>

#include <patrickstar/patrickstar.h>
#include <torch/torch.h>

struct NetImpl : torch::nn::Module {
  NetImpl() : fc1(register_module("fc1", torch::nn::Linear(64, 256))),
              fc2(register_module("fc2", torch::nn::Linear(256, 8))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return patrickstar::call(fc2, torch::relu(patrickstar::call(fc1, x)));  // the doors
  }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Net);

int main(int argc, char** argv) {
  const auto config = patrickstar::Config::from_file(argc > 1 ? argv[1] : "config.json");
  auto [model, optimizer] = patrickstar::initialize_engine([] { return Net(); }, 0, config);
  torch::manual_seed(0);
  const auto x = torch::randn({32, 64}), y = torch::randn({32, 8});
  double first = 0, last = 0;
  for (int step = 0; step < 50; ++step) {
    optimizer.zero_grad();
    auto loss = torch::mse_loss(model->forward(x), y);
    model.backward(loss);
    optimizer.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  std::printf("loss %.4f -> %.4f\n", first, last);
  return last < first ? 0 : 1;
}
