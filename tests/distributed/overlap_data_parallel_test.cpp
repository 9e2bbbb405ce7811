// The overlapped step under data parallel (docs/design.md, "The overlapped step"): an owner's chunk
// index updates ahead on the optimizer thread once its comm group is reduced, and the step commits
// or undoes it with the global decisions (the norm and the fp16 overflow every rank agrees on). As
// with one process, training must be bit for bit the serial step's: on every rank, every chunk it
// owns (weights, fp32 masters, momentum, variance) and every loss equal to a run with the overlap
// off. Run as one process (ctest's discovered tests) and under mpirun with 2 and 4 ranks.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "distributed/ranks.h"
#include "engine/gpt_training.h"
#include "patrickstar/engine/engine_inspect.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar {
namespace overlap_data_parallel_test {

using namespace test;  // NOLINT: the shared helpers of the engine tests

int64_t sum_over_ranks(int64_t value) {
  at::Tensor t = at::full({1}, static_cast<double>(value), at::kDouble);
  comm()->all_reduce(t, ReduceOp::kSum);
  return static_cast<int64_t>(t.item<double>());
}

struct RankRun {
  std::vector<double> losses;      // this rank's
  std::vector<at::Tensor> chunks;  // every chunk this rank owns but the gradient space, at the end
  int64_t committed = 0;           // summed over the steps (this rank)
  int64_t undone = 0;
  int64_t skipped = 0;
};

RankRun train(const std::string& extra, bool overlap, int steps) {
  nlohmann::json j = nlohmann::json::parse(extra);
  j["zero_optimization"]["overlap_step"] = overlap;
  // Smaller chunks than tight_config's: several comm groups at 4 ranks too, so that groups are
  // reduced (and updated ahead) before the end of backward.
  j["default_chunk_size"] = 32768;  // the embedding's size
  const Config config = tight_config(j.dump());
  models::Gpt model = make_model(1);
  Engine engine(model.ptr(), config, comm());
  const int micro = config.gradient_accumulation_steps;
  RankRun run;
  for (int s = 0; s < steps; ++s) {
    engine.zero_grad();
    double loss = 0;
    for (int k = 0; k < micro; ++k) {  // each micro-batch a global batch, split over the ranks
      const models::TokenBatch batch = batch_of_step(s * micro + k);
      at::Tensor out;
      {
        auto active = engine.activate();
        out = model->loss(my_rows(batch.tokens), my_rows(batch.targets));
      }
      engine.backward(out);
      loss += out.item<double>();
    }
    const IterationReport report = engine.step();
    run.losses.push_back(loss);
    run.committed += report.early_updates_committed;
    run.undone += report.early_updates_undone + report.early_updates_cancelled;
    run.skipped += report.skipped ? 1 : 0;
  }
  const ChunkStore& store = inspect(engine).chunks();
  for (ChunkId id = 0; id < store.chunk_count(); ++id) {
    if (store.kind_of(id) == ChunkKind::kGrad ||
        store.index_of(id) % comm()->world_size() != comm()->rank()) {
      continue;
    }
    run.chunks.push_back(store.chunk_view(id).cpu().clone());
  }
  return run;
}

struct Case {
  std::string name;
  std::string extra;    // merged into tight_config
  bool commits = true;  // some updates made ahead are committed (on some rank)
  bool undoes = false;  // some are undone (on some rank)
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.name;
}

class OverlapDataParallel : public ::testing::TestWithParam<Case> {};

TEST_P(OverlapDataParallel, TrainsBitForBitAsTheSerialStepOnEveryRank) {
  const Case& c = GetParam();
  constexpr int kSteps = 8;
  const RankRun serial = train(c.extra, false, kSteps);
  const RankRun overlapped = train(c.extra, true, kSteps);
  ASSERT_EQ(overlapped.losses.size(), serial.losses.size());
  for (size_t s = 0; s < serial.losses.size(); ++s) {
    EXPECT_EQ(overlapped.losses[s], serial.losses[s])
        << "rank " << comm()->rank() << ", step " << s;
  }
  ASSERT_EQ(overlapped.chunks.size(), serial.chunks.size());
  ASSERT_FALSE(serial.chunks.empty());
  for (size_t k = 0; k < serial.chunks.size(); ++k) {
    EXPECT_TRUE(torch::equal(overlapped.chunks[k], serial.chunks[k]))
        << "rank " << comm()->rank() << ", owned chunk " << k;
  }
  EXPECT_EQ(serial.committed + serial.undone, 0) << "the serial run overlapped";
  EXPECT_EQ(overlapped.skipped, serial.skipped);
  const int64_t committed = sum_over_ranks(overlapped.committed);
  const int64_t undone = sum_over_ranks(overlapped.undone);
  if (comm()->rank() == 0) {
    std::printf("%s, %d rank(s): %lld runs committed, %lld undone or taken back, %lld skipped\n",
                c.name.c_str(), comm()->world_size(), static_cast<long long>(committed),
                static_cast<long long>(undone), static_cast<long long>(overlapped.skipped));
  }
  if (c.commits) {
    EXPECT_GT(committed, 0);
  } else {
    EXPECT_EQ(committed, 0);
  }
  if (c.undoes) {
    EXPECT_GT(undone, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Configurations, OverlapDataParallel,
    ::testing::Values(
        Case{"fp32", "{}"},
        // The owner's fp32 sum of the half-slot gradients feeds the update made ahead.
        Case{"bf16", R"({"bf16": {"enabled": true}})"},
        // A gradient space: each micro-batch reduces into the owner's chunk; the last one's
        // reduction makes the index final.
        Case{"bf16_accumulation",
             R"({"bf16": {"enabled": true}, "gradient_accumulation_steps": 2})"},
        Case{"fp32_clipping_inactive", R"({"gradient_clipping": 1e6})"},
        // The global norm clips every step: every step runs serially.
        Case{"fp32_clipping_active", R"({"gradient_clipping": 1e-3})", /*commits=*/false},
        // The scale doubles every two steps until the gradients overflow (skipped on every rank,
        // updates made ahead undone), then halves.
        Case{"fp16_overflows",
             R"({"fp16": {"enabled": true, "initial_scale_power": 20, "hysteresis": 1,
                          "loss_scale_window": 2}})",
             /*commits=*/true, /*undoes=*/true}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

}  // namespace overlap_data_parallel_test
}  // namespace patrickstar
