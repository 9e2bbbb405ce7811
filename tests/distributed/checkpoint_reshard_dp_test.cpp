// Checkpoints across numbers of ranks (format 4): gpt_tiny trained on N ranks and saved resumes on
// M ranks. The first N and the first M ranks of the job form the two runs (Communicator::split), so
// one mpirun covers every pair its ranks allow: at 2 ranks (1, 2) and (2, 1), at 4 also (2, 4),
// (4, 2) and (4, 1), for gpt_tiny and llama_tiny. Checked: the resumed engine holds bit for bit the
// weights the writing run had, and trains on as a run on M ranks that never stopped.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include "checkpoint_tensors.h"
#include "data_parallel_helpers.h"
#include "patrickstar/memtracer/counting_allocator.h"
#include "patrickstar/models/llama.h"

namespace patrickstar {
namespace checkpoint_reshard_dp_test {

using namespace test;  // NOLINT: the shared helpers of the data parallel tests

// The job's first `n` ranks as a group of their own (null on the others). A collective of the job.
std::shared_ptr<Communicator> first_ranks(int n) {
  std::unique_ptr<Communicator> group = comm()->split(me() < n ? 0 : 1, me());
  if (me() >= n) return nullptr;
  return std::shared_ptr<Communicator>(std::move(group));
}

double mean_over(Communicator& group, double value) {
  at::Tensor t = at::full({1}, value, at::kDouble);
  group.all_reduce(t, ReduceOp::kSum);
  return t.item<double>() / group.world_size();
}

// Steps [from, to) of the GPT batches, each rank of `group` on its rows of the global batch (the
// zoo's GPT or Llama: tiny's vocabularies are the same).
template <typename Model>
std::vector<double> steps(Engine& engine, Model& model, Communicator& group, int from, int to) {
  std::vector<double> losses;
  for (int s = from; s < to; ++s) {
    const auto batch = on_test_device(batch_of_step(s));
    const int64_t rows = batch.tokens.size(0) / group.world_size();
    engine.zero_grad();
    at::Tensor loss;
    {
      auto active = engine.activate();
      loss = model->loss(batch.tokens.narrow(0, group.rank() * rows, rows),
                         batch.targets.narrow(0, group.rank() * rows, rows));
    }
    engine.backward(loss);
    engine.step();
    losses.push_back(mean_over(group, loss.item<double>()));
  }
  return losses;
}

template <typename Model>
void resume_on_other_ranks(const std::function<Model(uint64_t)>& make, const char* name) {
  constexpr int kSaveAt = 3, kSteps = 6;
  const std::string path = shared_path("ps_reshard_");
  const std::vector<std::pair<int, int>> pairs = {{1, 2}, {2, 1}, {2, 4}, {4, 2}, {4, 1}};
  for (const auto& [n, m] : pairs) {
    if (std::max(n, m) > ranks() || (n == 1 && m == 1)) continue;
    SCOPED_TRACE(std::string(name) + ": " + std::to_string(n) + " ranks -> " + std::to_string(m));
    const Config config = tight_config();
    // Rank 0 is in both runs: it keeps the writing run's weights to compare.
    std::vector<std::pair<std::string, at::Tensor>> at_save;
    if (auto writers = first_ranks(n)) {
      Model model = make(1);
      Engine engine(model.ptr(), config, writers);
      steps(engine, model, *writers, 0, kSaveAt);
      engine.save_checkpoint(path);
      at_save = engine.fp32_state_dict();
    }
    comm()->barrier();
    if (auto readers = first_ranks(m)) {
      Model model = make(99);  // other weights: the checkpoint replaces them
      Engine resumed(model.ptr(), config, readers);
      resumed.load_checkpoint(path);
      const auto loaded = resumed.fp32_state_dict();
      if (me() == 0) {
        ASSERT_EQ(loaded.size(), at_save.size());
        for (size_t i = 0; i < loaded.size(); ++i) {
          EXPECT_TRUE(torch::equal(loaded[i].second, at_save[i].second)) << loaded[i].first;
        }
      }
      const std::vector<double> got = steps(resumed, model, *readers, kSaveAt, kSteps);
      const auto weights = resumed.fp32_state_dict();

      Model straight_model = make(1);
      Engine straight(straight_model.ptr(), config, readers);
      std::vector<double> expected = steps(straight, straight_model, *readers, 0, kSteps);
      expected.erase(expected.begin(), expected.begin() + kSaveAt);
      EngineRun resumed_run, straight_run;
      resumed_run.weights = weights;
      straight_run.weights = straight.fp32_state_dict();
      // (weight_difference leaves out the keys' third of qkv.bias, whose gradient is rounding
      // noise that Adam turns into full steps of either sign.)
      const double worst = weight_difference(resumed_run, straight_run);
      const double losses_apart = max_relative_difference(got, expected);
      if (me() == 0) {
        std::printf(
            "%s saved on %d ranks, resumed on %d: losses within %.3g, final weights "
            "within %.3g (relative) of %d ranks that never stopped\n",
            name, n, m, losses_apart, worst, m);
      }
      // The load is exact (above); the runs differ only in the first kSaveAt steps' gradient
      // sums, added in another order on N ranks than on M. Adam's division by sqrt(v) turns that
      // rounding into visible steps where gradients are tiny: the bound of plain data parallel
      // against one process (DataParallel.Fp32GptMatchesPlainLibTorchOnTheGlobalBatch).
      EXPECT_LE(losses_apart, 1e-6);
      EXPECT_LE(worst, 1e-4);
    }
    comm()->barrier();
  }
}

TEST(CheckpointReshardDp, ResumesOnAnotherNumberOfRanks) {
  resume_on_other_ranks<models::Gpt>([](uint64_t seed) { return make_model(seed); }, "gpt_tiny");
  resume_on_other_ranks<models::Llama>(
      [](uint64_t seed) {
        torch::manual_seed(seed);
        return models::Llama(models::llama_spec("llama_tiny"));
      },
      "llama_tiny");
}

// On 2 ranks, into another chunk size and bf16 states: the resumed engine saves again exactly the
// weights it loaded and the moments rounded as bf16 states round them.
TEST(CheckpointReshardDp, TwoRanksTakeAnotherChunkSizeAndBf16States) {
  if (ranks() < 2) GTEST_SKIP() << "one process";
  const std::string first = shared_path("ps_reshard_a_"), again = shared_path("ps_reshard_b_");
  if (auto pair = first_ranks(2)) {
    models::Gpt model = make_model(1);
    Engine writer(model.ptr(), tight_config(), pair);
    steps(writer, model, *pair, 0, 3);
    // Each rank's host memory beyond its chunks while it saves: at most one chunk (it streams its
    // tensors one at a time).
    CountingCpuAllocator& counter = CountingCpuAllocator::install();
    const int window = counter.open_peak_window();
    const int64_t live = counter.live_bytes();
    writer.save_checkpoint(first);
    const int64_t save_peak = counter.window_peak_bytes(window) - live;
    counter.close_peak_window(window);
    const int64_t chunk_bytes = inspect(writer).chunks().chunk_elems() * 4;
    std::printf("rank %d of 2: host bytes beyond the chunks while saving its share: %lld (a chunk: "
                "%lld)\n",
                pair->rank(), static_cast<long long>(save_peak), static_cast<long long>(chunk_bytes));
    EXPECT_LE(save_peak, chunk_bytes);
    models::Gpt other = make_model(99);
    Engine resumed(other.ptr(), tight_config(R"({"default_chunk_size": 32768,
                                    "optimizer": {"params": {"state_dtype": "bf16"}}})"),
                   pair);
    resumed.load_checkpoint(first);
    resumed.save_checkpoint(again);
    pair->barrier();
    const SavedTensors a(first), b(again);
    ASSERT_EQ(a.names(), b.names());
    int64_t rounded = 0;
    for (const std::string& t : a.names()) {
      EXPECT_TRUE(torch::equal(a.tensor(t, "master"), b.tensor(t, "master"))) << t;
      for (const char* moment : {"exp_avg", "exp_avg_sq"}) {
        const at::Tensor m = a.tensor(t, moment);
        EXPECT_TRUE(torch::equal(m.to(at::kBFloat16).to(at::kFloat), b.tensor(t, moment))) << t;
        rounded += (m != b.tensor(t, moment)).sum().item<int64_t>();
      }
    }
    EXPECT_GT(rounded, 0) << "fp32 moments must have needed rounding";
    for (double loss : steps(resumed, other, *pair, 3, 5)) EXPECT_TRUE(std::isfinite(loss));
  }
  comm()->barrier();
}

}  // namespace checkpoint_reshard_dp_test
}  // namespace patrickstar
