// A plain LibTorch trainer: a small MLP classifier on synthetic data. ported.cpp is the same trainer
// after the port to patrickstar; `diff plain.cpp ported.cpp` is the whole change.
#include <cstdio>

#include <torch/torch.h>

struct ClassifierImpl : torch::nn::Module {
  ClassifierImpl()
      : fc1(register_module("fc1", torch::nn::Linear(32, 128))),
        fc2(register_module("fc2", torch::nn::Linear(128, 128))),
        head(register_module("head", torch::nn::Linear(128, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::gelu(fc1(x));
    h = torch::gelu(fc2(h));
    return head(h);
  }
  torch::nn::Linear fc1, fc2, head;
};
TORCH_MODULE(Classifier);

int main(int argc, char** argv) {
  torch::manual_seed(0);
  Classifier model;
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  const auto x = torch::randn({256, 32});
  const auto labels = std::get<1>(x.narrow(1, 0, 4).max(1));  // learnable: argmax of 4 features
  for (int epoch = 0; epoch < 30; ++epoch) {
    optimizer.zero_grad();
    auto loss = torch::cross_entropy_loss(model->forward(x), labels);
    loss.backward();
    optimizer.step();
    if (epoch % 10 == 9) std::printf("epoch %d loss %.4f\n", epoch + 1, loss.item<double>());
  }
  return 0;
}
