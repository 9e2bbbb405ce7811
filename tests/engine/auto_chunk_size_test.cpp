// "default_chunk_size": "auto" (issue 40) chooses the least-waste chunk size among those with which
// the model trains on the configured device. A model whose least-waste chunk holds two of its
// weights, on a device that cannot keep that chunk and its gradient chunk next to the activations
// within the planning share (overall_gpu_mem_ratio 0.8): the warm-up's trace does not fit, the
// step goes on, the model moves into smaller chunks after it, and training goes on exactly as
// plain LibTorch's. An explicit size keeps today's behaviour: the same device refuses it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "chunk_size_choice.h"
#include "error_message.h"
#include "patrickstar/engine/engine_inspect.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar {
namespace auto_chunk_size_test {

// Four bias-free layers whose weights (46,080, 46,080, 65,536 and 39,424 elements) pack with
// little waste only when a chunk holds both of the first two (about 1.6x the largest weight): the
// least-waste size makes a's and b's moments need that whole chunk.
struct TowerImpl : torch::nn::Module {
  TowerImpl() {
    auto linear = [](int64_t in, int64_t out) {
      return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
    };
    a = register_module("a", linear(256, 180));
    b = register_module("b", linear(180, 256));
    c = register_module("c", linear(256, 256));
    d = register_module("d", linear(256, 154));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = torch::relu(patrickstar::call(a, x));
    h = torch::relu(patrickstar::call(b, h));
    h = torch::relu(patrickstar::call(c, h));
    return patrickstar::call(d, h);
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr}, d{nullptr};
};
TORCH_MODULE(Tower);

Tower seeded_tower() {
  torch::manual_seed(1);
  return Tower();
}

// Two rows a batch: the activations are small next to the chunks.
at::Tensor input_of(int step) {
  torch::manual_seed(300 + step);
  return torch::randn({2, 256});
}
at::Tensor target_of(int step) {
  torch::manual_seed(700 + step);
  return torch::randn({2, 154});
}

Config tower_config(const nlohmann::json& chunk_size, int64_t capacity) {
  nlohmann::json j = {{"optimizer", {{"type", "Adam"}, {"params", {{"lr", 1e-2}}}}},
                      {"default_chunk_size", chunk_size},
                      {"client", {{"device", {{"capacity_bytes", capacity}}}}}};
  return Config::from_json(j);
}

IterationReport engine_step(Engine& engine, Tower& model, int step, double* loss) {
  engine.zero_grad();
  at::Tensor out;
  {
    auto active = engine.activate();
    out = torch::mse_loss(model->forward(input_of(step)), target_of(step));
  }
  engine.backward(out);
  IterationReport report = engine.step();
  *loss = out.item<double>();
  return report;
}

constexpr int kSteps = 6;

TEST(AutoChunkSize, AWarmUpThatDoesNotFitMovesIntoSmallerChunksAndTrainsAsLibTorch) {
  // A device that holds everything: the least-waste size, the chunk a.weight is in, and the
  // activations' peak over the warm-up (measured: it differs between CPUs' kernels).
  // It trains there too: its weights after kSteps are what the moved model must reach, bit for bit
  // (the same kernels over other chunks).
  int64_t least_waste = 0, a_chunk_elems = 0, peak = 0;
  std::vector<std::pair<std::string, at::Tensor>> unmoved;
  {
    Tower model = seeded_tower();
    Engine engine(model.ptr(), tower_config("auto", int64_t{1} << 30));
    double loss = 0;
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_EQ(engine_step(engine, model, s, &loss).chunk_elems_retried, 0);
    }
    unmoved = engine.fp32_state_dict();
    const ChunkStore& store = inspect(engine).chunks();
    least_waste = store.chunk_elems();
    const Layout& layout = store.layout();
    a_chunk_elems = layout.chunk_capacity(layout.placement(0).chunk_index);
    const Trace& trace = inspect(engine).tracer().warmup_trace();
    peak = trace.tail_non_model_bytes;
    for (const Moment& moment : trace.moments) peak = std::max(peak, moment.non_model_bytes);
  }
  // The chunk holds a's and b's weights and more than the largest weight alone (65,536).
  ASSERT_GT(a_chunk_elems, 46080 + 46080 - 1);
  // a's backward brings its fp32 param chunk and its fp32 gradient chunk. The device: 0.8 of it
  // less the activations' peak leaves 95% of that for chunks (the least waste cannot fit, a chunk
  // of a's and b's weights alone can), and the whole device less the peak still holds it (so the
  // warm-up itself gets through).
  const int64_t need = 8 * a_chunk_elems;
  const int64_t capacity = static_cast<int64_t>((need - need / 20 + peak) / 0.8) + 1;
  ASSERT_GE(capacity - peak, need);
  std::printf(
      "least-waste chunk size %lld (a's chunk %lld elements, %lld bytes with its gradient "
      "chunk), activations' peak %lld bytes, device %lld bytes\n",
      static_cast<long long>(least_waste), static_cast<long long>(a_chunk_elems),
      static_cast<long long>(need), static_cast<long long>(peak), static_cast<long long>(capacity));

  // Plain LibTorch.
  std::vector<double> plain_losses;
  {
    Tower plain = seeded_tower();
    torch::optim::Adam adam(plain->parameters(), torch::optim::AdamOptions(1e-2));
    for (int s = 0; s < kSteps; ++s) {
      adam.zero_grad();
      at::Tensor loss = torch::mse_loss(plain->forward(input_of(s)), target_of(s));
      loss.backward();
      adam.step();
      plain_losses.push_back(loss.item<double>());
    }
  }

  // "auto" on that device.
  Tower model = seeded_tower();
  Engine engine(model.ptr(), tower_config("auto", capacity));
  EXPECT_EQ(engine.registration().chunk_elems, least_waste);
  std::vector<double> losses;
  std::vector<IterationReport> reports;
  for (int s = 0; s < kSteps; ++s) {
    double loss = 0;
    reports.push_back(engine_step(engine, model, s, &loss));
    losses.push_back(loss);
  }
  const int64_t moved_to = reports[0].chunk_elems_retried;
  std::printf("auto: the warm-up moved the model into chunks of %lld elements; losses",
              static_cast<long long>(moved_to));
  for (size_t s = 0; s < losses.size(); ++s) {
    std::printf(" %.6f (plain %.6f)", losses[s], plain_losses[s]);
  }
  std::printf("\n");
  EXPECT_GT(moved_to, 0);
  EXPECT_LT(moved_to, least_waste);
  EXPECT_EQ(engine.registration().chunk_elems, moved_to);
  EXPECT_EQ(engine.registration().chunk_size_retries, 1);
  EXPECT_EQ(inspect(engine).chunks().chunk_elems(), moved_to);
  // The warm-up's own report is the old chunks': what they moved, and the activations it measured.
  EXPECT_GT(reports[0].h2d_bytes, 0);
  EXPECT_GE(reports[0].non_model_peak_bytes, peak / 2);
  // The next iteration warms up over the new chunks; its trace fits, and the steady ones follow.
  EXPECT_TRUE(reports[1].warmup);
  for (int s = 1; s < kSteps; ++s) EXPECT_EQ(reports[s].chunk_elems_retried, 0) << s;
  EXPECT_FALSE(reports[2].warmup);
  EXPECT_TRUE(inspect(engine).scheduler().has_trace());
  // Weights and Adam's states came through the move: the losses are LibTorch's.
  ASSERT_EQ(losses.size(), plain_losses.size());
  for (size_t s = 0; s < losses.size(); ++s) {
    EXPECT_NEAR(losses[s], plain_losses[s], 1e-5 * std::abs(plain_losses[s])) << "step " << s;
  }
  // The weights: bit for bit those of the engine that never moved (nothing of the weights or of
  // Adam's states was lost or reordered by the move), and within Adam's rounding of LibTorch's
  // (its per-element normalization turns a gradient's last-bit difference into up to lr; a lost
  // or repeated update would be lr = 1e-2 everywhere).
  const auto moved = engine.fp32_state_dict();
  ASSERT_EQ(moved.size(), unmoved.size());
  for (size_t k = 0; k < moved.size(); ++k) {
    EXPECT_EQ(moved[k].first, unmoved[k].first);
    EXPECT_TRUE(torch::equal(moved[k].second, unmoved[k].second)) << moved[k].first;
  }
  Tower plain = seeded_tower();
  {
    torch::optim::Adam adam(plain->parameters(), torch::optim::AdamOptions(1e-2));
    for (int s = 0; s < kSteps; ++s) {
      adam.zero_grad();
      torch::mse_loss(plain->forward(input_of(s)), target_of(s)).backward();
      adam.step();
    }
  }
  for (const auto& [name, value] : moved) {
    const at::Tensor expected = plain->named_parameters()[name];
    const double diff = (value - expected).abs().max().item<double>();
    const double mean = (value - expected).abs().mean().item<double>();
    std::printf("%s against LibTorch: largest difference %.3g, mean %.3g\n", name.c_str(), diff,
                mean);
    EXPECT_LE(diff, 1e-3) << name;
    EXPECT_LE(mean, 1e-6) << name;
  }

  // An explicit size keeps today's behaviour: the least-waste size, given, is refused at the
  // warm-up's step on the same device, and the weights stay as they were.
  Tower fixed_model = seeded_tower();
  Engine fixed(fixed_model.ptr(), tower_config(least_waste, capacity));
  double loss = 0;
  const std::string message = test::error_of([&] { engine_step(fixed, fixed_model, 0, &loss); });
  EXPECT_NE(message.find("use a smaller chunk size"), std::string::npos) << message;
  EXPECT_EQ(fixed.registration().chunk_elems, least_waste);
}

// The choice itself: least waste among the sizes whose every moment fits, the smaller on a tie;
// none when even the smallest does not fit, with the moment that needs the most above its budget.
TEST(AutoChunkSize, ChoosesTheLeastWasteSizeWhoseMomentsFit) {
  using engine_detail::MomentNeed;
  Layout base;
  for (const int64_t numel : {46080, 46080, 65536, 39424}) {
    base.add_tensor("t" + std::to_string(base.tensor_count()), {numel});
  }
  const engine_detail::SizeGrid grid = engine_detail::auto_size_grid(base.max_numel());
  EXPECT_EQ(grid.min_elems, 65536);
  EXPECT_EQ(grid.max_elems, 131072);
  engine_detail::DeviceCosts costs;
  costs.param_elem_bytes = 4;
  costs.grad_elem_bytes = 4;
  costs.trainable = {true, true, true, true};
  // What registration's search takes: the least waste of the grid.
  Layout searched = base;
  searched.finalize_search(grid.min_elems, grid.max_elems, grid.step_elems);
  const int64_t least_waste = searched.chunk_elems();
  const int64_t t0_chunk = searched.chunk_capacity(searched.placement(0).chunk_index);
  auto moments = [&](int64_t budget) {
    std::vector<MomentNeed> needs;
    for (TensorId id = 0; id < 4; ++id) {
      needs.push_back({"pre_backward 't" + std::to_string(id) + "'",
                       "t" + std::to_string(id),
                       {id},
                       /*with_grads=*/true,
                       budget});
    }
    return needs;
  };
  // Room for the least-waste size: a size below it is asked for, so it is not a candidate.
  engine_detail::SizeChoice choice =
      engine_detail::choose_chunk_size(base, grid, least_waste, moments(8 * t0_chunk), costs);
  ASSERT_GT(choice.chunk_elems, 0);
  EXPECT_LT(choice.chunk_elems, least_waste);
  // Every size the choice passed over for less waste needs more than the budget somewhere, and
  // the chosen one needs no more than it anywhere.
  Layout chosen = base;
  chosen.finalize(choice.chunk_elems);
  for (const MomentNeed& need : moments(0)) {
    EXPECT_LE(engine_detail::moment_chunk_bytes(chosen, need, costs), 8 * t0_chunk) << need.label;
  }
  for (int64_t size = grid.min_elems; size < least_waste; size += grid.step_elems) {
    Layout other = base;
    other.finalize(size);
    if (other.waste_elems() > chosen.waste_elems() ||
        (other.waste_elems() == chosen.waste_elems() && size >= choice.chunk_elems)) {
      continue;
    }
    int64_t most = 0;
    for (const MomentNeed& need : moments(0)) {
      most = std::max(most, engine_detail::moment_chunk_bytes(other, need, costs));
    }
    EXPECT_GT(most, 8 * t0_chunk) << "size " << size << " wastes less and fits";
  }
  // A budget below the largest tensor's own chunk and gradient: nothing fits.
  choice = engine_detail::choose_chunk_size(base, grid, least_waste, moments(8 * 65536 - 1), costs);
  EXPECT_EQ(choice.chunk_elems, 0);
  EXPECT_NE(choice.tightest.find("the smallest size, 65536 elements"), std::string::npos)
      << choice.tightest;
}

}  // namespace auto_chunk_size_test
}  // namespace patrickstar
