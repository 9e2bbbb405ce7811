// A plain LibTorch trainer: a small MLP classifier on synthetic data, with helpers that take the
// model as LibTorch trainers write them. ported.cpp is the same trainer after the port to
// patrickstar; `diff plain.cpp ported.cpp` is the whole change.
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

torch::Tensor loss_of(Classifier& model, const torch::Tensor& x, const torch::Tensor& labels) {
  model->train();
  return torch::cross_entropy_loss(model->forward(x), labels);
}

// One step, through the optimizer interface every LibTorch optimizer shares.
double train_step(Classifier& model, torch::optim::Optimizer& optimizer, const torch::Tensor& x,
                  const torch::Tensor& labels) {
  optimizer.zero_grad();
  auto loss = loss_of(model, x, labels);
  loss.backward();
  optimizer.step();
  return loss.item<double>();
}

double accuracy(Classifier& model, const torch::Tensor& x, const torch::Tensor& labels) {
  torch::NoGradGuard no_grad;
  model->eval();
  return model->forward(x).argmax(1).eq(labels).to(torch::kFloat).mean().item<double>();
}

int main(int argc, char** argv) {
  torch::manual_seed(0);
  Classifier model;
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  const auto x = torch::randn({256, 32});
  const auto labels = std::get<1>(x.narrow(1, 0, 4).max(1));  // learnable: argmax of 4 features
  for (int epoch = 0; epoch < 30; ++epoch) {
    const double loss = train_step(model, optimizer, x, labels);
    if (epoch % 10 == 9) {
      std::printf("epoch %d loss %.4f accuracy %.3f\n", epoch + 1, loss,
                  accuracy(model, x, labels));
    }
  }
  return 0;
}
