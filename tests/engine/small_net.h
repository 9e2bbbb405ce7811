// The small trainer the loop tests share: a two-layer MLP with its doors, its data by step, a device
// small enough to matter, and the loss helper as a LibTorch trainer writes it (taking Net&).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include "patrickstar/patrickstar.h"
#include "test_device.h"

namespace patrickstar::test {

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 4));
  }
  at::Tensor forward(const at::Tensor& x) {
    return patrickstar::call(fc2, torch::relu(patrickstar::call(fc1, x)));
  }
  // A forward that forgets fc2's door.
  at::Tensor forward_forgetting_a_door(const at::Tensor& x) {
    return fc2(torch::relu(patrickstar::call(fc1, x)));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

inline at::Tensor input_of(int step) {
  torch::manual_seed(300 + step);
  return torch::randn({8, 16});
}
inline at::Tensor target_of(int step) {
  torch::manual_seed(700 + step);
  return torch::randn({8, 4});
}

// The same initial weights every time (seed 1): the engine's model and its plain twin.
inline Net seeded_net() {
  torch::manual_seed(1);
  return Net();
}

// The plain LibTorch optimizer the engine's small_device() config stands for: Adam at lr 1e-2.
inline torch::optim::Adam plain_adam(std::vector<at::Tensor> parameters) {
  return torch::optim::Adam(std::move(parameters), torch::optim::AdamOptions(1e-2));
}

// Adam at lr 1e-2, chunks of 600 elements, a 64 KiB device (on the test device:
// tests/test_device.h); `extra` is merged in.
inline Config small_device(const std::string& extra = "{}") {
  nlohmann::json j = {{"optimizer", {{"type", "Adam"}, {"params", {{"lr", 1e-2}}}}},
                      {"default_chunk_size", 600},
                      {"client", {{"device", {{"capacity_bytes", 65536}}}}}};
  j.merge_patch(nlohmann::json::parse(extra));
  Config config = Config::from_json(j);
  use_test_device(config);
  return config;
}

// A helper as a LibTorch trainer writes it: it takes the user's own module and puts the batch
// where the module's parameters are (the GPU for the engine on CUDA, the CPU for a plain twin).
inline at::Tensor compute_loss(Net& model, int step) {
  const c10::Device device = model->fc1->weight.device();
  return torch::mse_loss(model->forward(input_of(step).to(device)), target_of(step).to(device));
}

}  // namespace patrickstar::test
