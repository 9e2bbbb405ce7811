// The hook spike (docs/design.md section 6), kept as a test: parameters whose data lives in a flat
// buffer ("a chunk") that moves between a module's forward and its backward must train exactly like
// plain LibTorch. Also pins down the LibTorch behaviour the engine's design rests on.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <c10/core/StorageImpl.h>

#include "patrickstar/engine/autograd_hooks.h"

namespace patrickstar {
namespace autograd_hooks_test {

// Points `param`'s own storage at `data` (non-owning) without changing the tensor or its storage
// object, so every view autograd saved of `param` follows. nullptr releases it.
void repoint(const at::Tensor& param, void* data) {
  c10::StorageImpl* storage = param.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(c10::DataPtr(data, param.device()));
}

struct Mlp {
  std::vector<torch::nn::Linear> layers;
  explicit Mlp(int seed) {
    torch::manual_seed(seed);
    layers = {torch::nn::Linear(6, 12), torch::nn::Linear(12, 12), torch::nn::Linear(12, 5)};
  }
  std::vector<at::Tensor> params() const {
    std::vector<at::Tensor> out;
    for (const auto& l : layers)
      for (const auto& p : l->parameters()) out.push_back(p);
    return out;
  }
};

// A flat buffer holding every parameter of an Mlp, with a movable location: move() copies the data
// to a fresh buffer and poisons the old one with NaN, as if the chunk went to the host and back.
struct FlatChunk {
  std::vector<at::Tensor> params;
  std::vector<int64_t> offsets;
  at::Tensor data;  // the "payload"
  at::Tensor grad;  // where gradients are captured
  std::vector<at::Tensor> old_payloads;

  explicit FlatChunk(std::vector<at::Tensor> ps) : params(std::move(ps)) {
    int64_t total = 0;
    for (const auto& p : params) {
      offsets.push_back(total);
      total += p.numel();
    }
    data = torch::empty({total});
    grad = torch::zeros({total});
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      data.narrow(0, offsets[i], params[i].numel()).copy_(params[i].reshape(-1));
      // Give the parameter its own storage object of the right size, pointing into the chunk.
      params[i].set_data(torch::empty_like(params[i]));
      repoint(params[i], slot(i).data_ptr());
    }
  }
  at::Tensor slot(size_t i) const { return data.narrow(0, offsets[i], params[i].numel()); }
  at::Tensor grad_slot(size_t i) const { return grad.narrow(0, offsets[i], params[i].numel()); }
  void access(size_t i) { repoint(params[i], slot(i).data_ptr()); }
  void release(size_t i) { repoint(params[i], nullptr); }
  void move() {
    at::Tensor moved = data.clone();
    data.fill_(std::numeric_limits<float>::quiet_NaN());
    old_payloads.push_back(data);
    data = moved;
  }
};

TEST(AutogradHooks, ChunkedParametersTrainLikePlainLibTorch) {
  Mlp plain(7), chunked(7);
  torch::optim::SGD sgd(plain.params(), torch::optim::SGDOptions(0.1));
  FlatChunk chunk(chunked.params());
  const size_t nparams = chunk.params.size();

  HookTable table;
  int pre_backward_calls = 0, post_grad_calls = 0, end_calls = 0;
  bool end_queued = false;
  // Parameters of layer l are chunk slots 2l (weight) and 2l+1 (bias).
  for (size_t l = 0; l < chunked.layers.size(); ++l) {
    table.add([&, l] {
      ++pre_backward_calls;
      chunk.access(2 * l);
      chunk.access(2 * l + 1);
    });
  }
  for (size_t i = 0; i < nparams; ++i) {
    set_post_accumulate_grad_hook(chunk.params[i], [&, i](const at::Tensor& p) {
      ++post_grad_calls;
      if (!end_queued) {
        end_queued = true;
        queue_end_of_backward([&] { ++end_calls; });
      }
      torch::NoGradGuard no_grad;
      chunk.grad_slot(i).copy_(p.grad().reshape(-1));
      p.mutable_grad().reset();
      chunk.release(i);
    });
  }

  torch::manual_seed(11);
  for (int step = 0; step < 6; ++step) {
    at::Tensor x = torch::randn({4, 6}), target = torch::randn({4, 5});

    sgd.zero_grad();
    at::Tensor h = x;
    for (size_t l = 0; l < plain.layers.size(); ++l) {
      h = plain.layers[l](h);
      if (l + 1 < plain.layers.size()) h = torch::gelu(h);
    }
    at::Tensor plain_loss = torch::mse_loss(h, target);
    plain_loss.backward();
    sgd.step();

    end_queued = false;
    chunk.grad.zero_();
    h = x;
    for (size_t l = 0; l < chunked.layers.size(); ++l) {
      chunk.access(2 * l);
      chunk.access(2 * l + 1);
      h = chunked.layers[l](h);
      chunk.release(2 * l);
      chunk.release(2 * l + 1);
      h = with_pre_backward(h, table, static_cast<int64_t>(l));
      if (l + 1 < chunked.layers.size()) h = torch::gelu(h);
    }
    at::Tensor loss = torch::mse_loss(h, target);
    chunk.move();  // the payload changes address between forward and backward
    loss.backward();
    {
      torch::NoGradGuard no_grad;
      chunk.data.sub_(chunk.grad, 0.1);
    }

    EXPECT_EQ(loss.item<float>(), plain_loss.item<float>()) << "step " << step;
    EXPECT_EQ(end_calls, step + 1);
  }
  EXPECT_EQ(pre_backward_calls, 6 * 3);
  EXPECT_EQ(post_grad_calls, 6 * static_cast<int>(nparams));
  auto reference = plain.params();
  for (size_t i = 0; i < nparams; ++i) {
    EXPECT_TRUE(torch::equal(chunk.slot(i), reference[i].detach().reshape(-1))) << "param " << i;
  }
}

// Why the engine re-points a parameter's storage instead of calling set_data: autograd saves views of
// a weight (linear saves weight.t()), and a view keeps the storage the weight had during forward.
TEST(AutogradHooks, SetDataDoesNotReachViewsSavedInForward) {
  torch::manual_seed(3);
  torch::nn::Linear layer(3, 2);
  at::Tensor x = torch::randn({2, 3}, torch::requires_grad());
  at::Tensor w_value = layer->weight.detach().clone();
  at::Tensor y = layer(x).sum();
  {
    torch::NoGradGuard no_grad;
    layer->weight.set_data(torch::zeros_like(w_value));  // the weight "moves": new storage
  }
  y.backward();
  // The input gradient still used the old values: the saved view kept the old storage alive.
  EXPECT_TRUE(torch::allclose(x.grad(), w_value.sum(0).expand({2, 3})));
}

TEST(AutogradHooks, TiedParameterHookFiresOncePerBackwardWithTheSummedGradient) {
  at::Tensor w = torch::randn({4, 4}, torch::requires_grad());
  int calls = 0;
  at::Tensor seen;
  set_post_accumulate_grad_hook(w, [&](const at::Tensor& p) {
    ++calls;
    seen = p.grad().clone();
  });
  at::Tensor x = torch::randn({2, 4});
  at::Tensor loss = torch::matmul(torch::matmul(x, w), w).sum();
  loss.backward();
  EXPECT_EQ(calls, 1);
  at::Tensor w2 = w.detach().clone().requires_grad_(true);
  torch::matmul(torch::matmul(x, w2), w2).sum().backward();
  EXPECT_TRUE(torch::allclose(seen, w2.grad()));
  clear_post_accumulate_grad_hook(w);
}

TEST(AutogradHooks, PreBackwardRunsBeforeTheProducersBackwardAndSkipsNonGradOutputs) {
  std::vector<std::string> order;
  HookTable table;
  const int64_t id = table.add([&] { order.push_back("pre-backward"); });
  at::Tensor a = torch::randn({3}, torch::requires_grad());
  at::Tensor b = a * 2;
  b.register_hook([&](const at::Tensor& g) {
    order.push_back("grad of b");
    return g;
  });
  at::Tensor no_grad = torch::ones({3});
  auto outs = with_pre_backward({b, no_grad}, table, id);
  EXPECT_TRUE(outs[1].is_same(no_grad));
  EXPECT_TRUE(torch::equal(outs[0], b));
  (outs[0] * 3).sum().backward();
  ASSERT_EQ(order.size(), 2u);
  EXPECT_EQ(order[0], "pre-backward");
  EXPECT_TRUE(torch::allclose(a.grad(), torch::full({3}, 6.0)));
}

TEST(AutogradHooks, ErrorsAreClear) {
  HookTable table;
  EXPECT_THROW(table.call(0), c10::Error);
  EXPECT_THROW(queue_end_of_backward([] {}), c10::Error);
  EXPECT_THROW(set_post_accumulate_grad_hook(torch::ones({2}), [](const at::Tensor&) {}),
               c10::Error);
}

}  // namespace autograd_hooks_test
}  // namespace patrickstar
