// The memtracer pieces together on a real (small) model on the test device
// (tests/test_device_switch.h): the probe measures activations (on the emulated device the counting
// allocator, on CUDA the caching allocator's statistics), the recorder builds the warm-up trace,
// the scheduler places chunks (sizes given, moves tracked by a mover), and from iteration 1 on, at
// every moment, the chunk bytes resident over an interval plus the non-model peak measured over it
// stay within the capacity.
#include <memory>
#include <set>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "patrickstar/memtracer/counting_allocator.h"
#include "patrickstar/memtracer/memory_probe.h"
#include "patrickstar/memtracer/scheduler.h"
#include "patrickstar/memtracer/trace.h"
#include "test_device_switch.h"

namespace patrickstar {
namespace traced_model_test {

class TrackingMover final : public ChunkMover {
 public:
  explicit TrackingMover(const std::map<int64_t, ChunkInfo>& chunks) : chunks_(chunks) {}
  bool on_device(int64_t id) override { return resident_.count(id) != 0; }
  bool movable(int64_t) override { return true; }
  void to_device(int64_t id) override {
    resident_.insert(id);
    bytes_ += chunks_.at(id).bytes;
  }
  void to_host(int64_t id) override {
    resident_.erase(id);
    bytes_ -= chunks_.at(id).bytes;
  }
  int64_t bytes() const { return bytes_; }

 private:
  const std::map<int64_t, ChunkInfo>& chunks_;
  std::set<int64_t> resident_;
  int64_t bytes_ = 0;
};

struct Mlp {
  explicit Mlp(c10::Device device) {
    torch::manual_seed(0);
    for (int i = 0; i < 4; ++i) layers.emplace_back(kHidden, kHidden);
    for (auto& layer : layers) {
      layer->to(device);
      for (auto& p : layer->parameters()) params.push_back(p);
    }
  }
  static constexpr int64_t kBatch = 256, kHidden = 256;
  std::vector<torch::nn::Linear> layers;
  std::vector<torch::Tensor> params;
};

// One training iteration; `at` is called at each moment with its kind, label and chunk ids, and
// `after` once the moment's compute is done. Layer l owns chunk l.
template <typename At, typename After>
void train_iteration(Mlp& mlp, torch::optim::SGD& sgd, const torch::Tensor& input,
                     const torch::Tensor& target, At at, After after) {
  const int64_t layers = static_cast<int64_t>(mlp.layers.size());
  torch::Tensor x = input;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t m =
        at(MomentKind::kPreForward, "fc" + std::to_string(l), std::vector<int64_t>{l});
    x = torch::relu(mlp.layers[l]->forward(x));
    after(m);
  }
  torch::Tensor loss = torch::mse_loss(x, target);
  for (int64_t l = layers; l-- > 0;) {
    const int64_t m =
        at(MomentKind::kPreBackward, "fc" + std::to_string(l), std::vector<int64_t>{l});
    if (l + 1 == layers) loss.backward();
    after(m);
  }
  // The step ticks one moment per chunk it updates, as the engine does (a chunk group at a time).
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t m = at(MomentKind::kStep, "step:" + std::to_string(l), std::vector<int64_t>{l});
    if (l == 0) {
      sgd.step();
      sgd.zero_grad();
    }
    after(m);
  }
}

// The probe of the test device: what the engine would measure there.
std::unique_ptr<MemoryProbe> test_device_probe() {
  if (test::on_cuda()) return make_cuda_memory_probe(0);
  return std::make_unique<CpuMemoryProbe>(CountingCpuAllocator::install());
}

class TracedModel : public test::OnTestDevice {};

TEST_F(TracedModel, ChunksPlusMeasuredNonModelStayWithinCapacity) {
  const std::unique_ptr<MemoryProbe> measure = test_device_probe();
  MemoryProbe& probe = *measure;
  const c10::Device device = test::test_device();
  Mlp mlp(device);
  torch::optim::SGD sgd(mlp.params, 0.01);
  const torch::Tensor input = torch::randn({Mlp::kBatch, Mlp::kHidden}).to(device);
  const torch::Tensor target = torch::randn({Mlp::kBatch, Mlp::kHidden}).to(device);

  // Calibration: how much do activations take? (The capacity below is set from it.)
  TraceRecorder calibration(&probe);
  calibration.begin_iteration();
  train_iteration(
      mlp, sgd, input, target,
      [&](MomentKind kind, const std::string& label, const std::vector<int64_t>&) {
        return calibration.tick(kind, label);
      },
      [](int64_t) {});
  calibration.end_iteration();
  int64_t max_non_model = calibration.warmup_trace().tail_non_model_bytes;
  for (const Moment& moment : calibration.warmup_trace().moments) {
    max_non_model = std::max(max_non_model, moment.non_model_bytes);
  }
  ASSERT_GT(max_non_model, 4 * Mlp::kBatch * Mlp::kHidden * 4);  // several activations measured

  // 4 chunks of a quarter of the activations' peak each; the device holds the activations' peak
  // (plus 10% margin for iteration-to-iteration noise) and two chunks: chunks must move.
  const int64_t chunk_bytes = max_non_model / 4;
  std::map<int64_t, ChunkInfo> chunks;
  for (int64_t id = 0; id < 4; ++id) chunks[id] = ChunkInfo{chunk_bytes, false};
  SchedulerOptions options;
  options.reserve_bytes = max_non_model / 10;
  options.capacity_bytes = max_non_model + options.reserve_bytes + 2 * chunk_bytes;
  options.warmup_ratio = 0.5;
  Scheduler scheduler(options, chunks);
  TrackingMover mover(chunks);
  TraceRecorder recorder(&probe);

  int64_t checked = 0;
  int64_t max_used_bytes = 0;
  for (int iteration = 0; iteration < 4; ++iteration) {
    recorder.begin_iteration();
    scheduler.begin_iteration();
    int64_t chunk_bytes_before = mover.bytes();  // resident through the interval that just ended
    train_iteration(
        mlp, sgd, input, target,
        [&](MomentKind kind, const std::string& label, const std::vector<int64_t>& ids) {
          const int64_t m = recorder.tick(kind, label);
          for (int64_t id : ids) recorder.record_access(id);
          if (iteration > 0) {
            const int64_t measured = recorder.current_trace().moments[m].non_model_bytes;
            EXPECT_LE(chunk_bytes_before + measured, options.capacity_bytes)
                << "iteration " << iteration << ", interval before moment " << m;
            ++checked;
            max_used_bytes = std::max(max_used_bytes, chunk_bytes_before + measured);
          }
          scheduler.at_moment(m, kind, ids, mover, probe.live_bytes());
          chunk_bytes_before = mover.bytes();
          return m;
        },
        [&](int64_t m) {
          scheduler.after_moment(m, mover);
          chunk_bytes_before = mover.bytes();
        });
    recorder.end_iteration();
    if (iteration == 0) scheduler.set_trace(recorder.warmup_trace(), &mover);
    scheduler.end_iteration();
  }
  EXPECT_EQ(checked, 3 * 12);
  // Not vacuous: at its fullest the device is within a chunk of the capacity minus the reserve.
  EXPECT_GT(max_used_bytes, options.capacity_bytes - options.reserve_bytes - chunk_bytes)
      << "max used " << max_used_bytes << " of " << options.capacity_bytes;
  // The schedule really moved chunks, and the trace kept its shape.
  int64_t moved = 0;
  for (size_t i = 1; i < scheduler.history().size(); ++i) moved += scheduler.history()[i].h2d_bytes;
  EXPECT_GT(moved, 0);
  EXPECT_TRUE(recorder.current_trace().same_moments(recorder.warmup_trace()));
}

}  // namespace traced_model_test
}  // namespace patrickstar
