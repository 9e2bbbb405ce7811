// Fine-tuning with adapters under data parallel: the frozen base in lean chunks of its own (its
// weights alone), sharded and gathered like any param chunk and never reduced. Run as one process
// (ctest's discovered tests) and under mpirun with 2 and 4 ranks (distributed.mpi_*_ranks).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "distributed/data_parallel_helpers.h"
#include "distributed/ranks.h"
#include "engine/gpt_training.h"
#include "patrickstar/engine/engine_inspect.h"
#include "patrickstar/models/gpt.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar {
namespace lora_data_parallel_test {

using namespace test;  // NOLINT: the shared helpers of the engine tests

models::Gpt lora_model(uint64_t seed) {
  models::GptSpec spec = tiny();
  spec.lora_rank = 4;
  spec.lora_alpha = 8.0;
  torch::manual_seed(seed);
  return models::Gpt(spec);
}

TEST(LoraDataParallel, LeanFrozenBaseTrainsAsInOneProcessWithoutReductionsAndResumes) {
  const int ranks = comm()->world_size();
  const int me = comm()->rank();
  // Chunks of 32,768 elements (gpt_tiny's embedding): the split into frozen and trained groups
  // takes fewer bytes than sharing chunks on 1, 2 and 4 ranks. A device of 8 MiB: on 4 ranks a
  // gathered group alone is 512 KiB.
  const Config config = tight_config(
      R"({"default_chunk_size": 32768, "client": {"device": {"capacity_bytes": 8388608}}})");
  // Every rank builds from another seed: the engine starts all of them from rank 0's weights.
  models::Gpt model = lora_model(1 + 17 * static_cast<uint64_t>(me));
  Engine engine(model.ptr(), config, comm());
  models::Gpt one_model = lora_model(1);
  Engine one(one_model.ptr(), config);  // one process on the whole batch, whatever the launcher
  std::vector<IterationReport> reports;
  const std::vector<double> losses = train_steps(engine, model, 0, 4, /*sharded=*/true, &reports);
  const std::vector<double> expected = train_steps(one, one_model, 0, 4, /*sharded=*/false);

  // Frozen indices hold their param chunk alone, and only trained groups are reduced.
  const ChunkStore& store = inspect(engine).chunks();
  int64_t lean_indices = 0, trained_groups = 0;
  for (int64_t g = 0; g < store.chunks_per_kind() / ranks; ++g) {
    bool trained = false;
    for (int64_t i = g * ranks; i < (g + 1) * ranks; ++i) {
      const bool lean = store.omitted(store.chunk_id(ChunkKind::kMomentum, i));
      lean_indices += lean ? 1 : 0;
      for (TensorId t : store.layout().tensors_in_chunk(i)) {
        const bool trains = model->named_parameters()[store.layout().name(t)].requires_grad();
        EXPECT_NE(trains, lean) << store.layout().name(t) << " in chunk index " << i;
        trained |= trains;
      }
    }
    trained_groups += trained ? 1 : 0;
  }
  EXPECT_GT(lean_indices, 0);
  EXPECT_GT(trained_groups, 0);
  // A frozen group is dropped when the backward moves on to the next one: at most the trained
  // group (its adapters span every block, so it stays until its reduction) and two lean groups
  // (a module across two of them) are gathered at once, never the whole frozen base.
  const int64_t group_bytes = ranks * store.chunk_bytes(store.chunk_id(ChunkKind::kParam, 0));
  const int64_t groups = store.chunks_per_kind() / ranks;
  for (const IterationReport& r : reports) {
    EXPECT_EQ(r.group_reduces, ranks > 1 ? trained_groups : 0);
    if (me == 0 && &r == &reports.back()) {
      std::printf(
          "%d rank(s): %lld comm groups (%lld trained); at most %lld bytes gathered at "
          "once (a group: %lld)\n",
          ranks, static_cast<long long>(groups), static_cast<long long>(trained_groups),
          static_cast<long long>(r.gathered_peak_bytes), static_cast<long long>(group_bytes));
    }
    if (ranks > 1) {
      EXPECT_LE(r.gathered_peak_bytes, (trained_groups + 2) * group_bytes);
    }
  }

  const double apart = max_relative_difference(losses, expected);
  double frozen_apart = 0, trained_apart = 0;
  const auto ours = engine.fp32_state_dict(), theirs = one.fp32_state_dict();
  ASSERT_EQ(ours.size(), theirs.size());
  for (size_t i = 0; i < ours.size(); ++i) {
    const double d =
        ((ours[i].second - theirs[i].second).norm() / theirs[i].second.norm().clamp_min(1e-12))
            .item<double>();
    double& worst =
        model->named_parameters()[ours[i].first].requires_grad() ? trained_apart : frozen_apart;
    worst = std::max(worst, d);
  }
  if (me == 0) {
    std::printf(
        "%d rank(s), %lld lean chunk indices: losses within %.3g of one process, adapters "
        "within %.3g, frozen weights within %.3g\n",
        ranks, static_cast<long long>(lean_indices), apart, trained_apart, frozen_apart);
  }
  EXPECT_LE(apart, 1e-5);
  EXPECT_LE(trained_apart, 1e-4);  // the ranks sum gradients in another order (data_parallel_test)
  EXPECT_EQ(frozen_apart, 0.0);

  // A checkpoint of every rank's shard resumes bit for bit in engines built from other weights.
  at::Tensor tag = at::full({1}, me == 0 ? static_cast<double>(::getpid()) : 0.0, at::kDouble);
  comm()->broadcast(tag, 0);
  const std::string path =
      ::testing::TempDir() + "/ps_lora_dp_" + std::to_string(tag.item<int64_t>()) + ".pt";
  engine.save_checkpoint(path);
  const std::vector<double> straight = train_steps(engine, model, 4, 7, /*sharded=*/true);
  models::Gpt other = lora_model(99 + static_cast<uint64_t>(me));
  Engine resumed(other.ptr(), config, comm());
  resumed.load_checkpoint(path);
  EXPECT_EQ(train_steps(resumed, other, 4, 7, /*sharded=*/true), straight);
  const auto a = engine.fp32_state_dict(), b = resumed.fp32_state_dict();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::equal(a[i].second, b[i].second)) << a[i].first;
  }
  comm()->barrier();
  std::remove(
      (ranks == 1 ? path : path + ".rank" + std::to_string(me) + "-of-" + std::to_string(ranks))
          .c_str());
}

// Model data per rank: with data parallel the frozen base is split off and lean where that takes
// fewer bytes than sharing chunks with full state (each group rounds up to one chunk per rank), so
// lean is never more than full state: strictly less in chunks of 32,768 elements on 1, 2 and 4
// ranks; in chunks of 40,000 on 4 ranks the split would take 800,000 bytes per rank against
// 640,000 shared, and the frozen parameters share chunks with full state.
TEST(LoraDataParallel, LeanFrozenChunksWhereverTheyTakeFewerBytesPerRank) {
  for (const int64_t chunk : {32768, 40000}) {
    const std::string size = std::to_string(chunk);
    models::Gpt lean_model = lora_model(1);
    Engine lean(lean_model.ptr(), tight_config(R"({"default_chunk_size": )" + size + "}"), comm());
    models::Gpt full_model = lora_model(1);
    Engine full(full_model.ptr(),
                tight_config(R"({"default_chunk_size": )" + size +
                             R"(, "zero_optimization": {"frozen_parameters": "full_state"}})"),
                comm());
    const ChunkStore& store = inspect(lean).chunks();
    int64_t lean_indices = 0;
    for (int64_t i = 0; i < store.chunks_per_kind(); ++i) {
      lean_indices += store.omitted(store.chunk_id(ChunkKind::kMomentum, i)) ? 1 : 0;
    }
    const int64_t lean_bytes = lean.registration().model_data_bytes;
    const int64_t full_bytes = full.registration().model_data_bytes;
    if (comm()->rank() == 0) {
      std::printf(
          "%d rank(s), chunks of %lld: model data per rank %lld bytes lean (%lld lean "
          "chunk indices), %lld with full state\n",
          comm()->world_size(), static_cast<long long>(chunk), static_cast<long long>(lean_bytes),
          static_cast<long long>(lean_indices), static_cast<long long>(full_bytes));
    }
    EXPECT_LE(lean_bytes, full_bytes) << chunk;
    EXPECT_EQ(lean_indices > 0, lean_bytes < full_bytes) << chunk;
    if (chunk == 32768) {
      EXPECT_GT(lean_indices, 0);
    }
    if (chunk == 40000 && lean.shard_group_size() == 4) {  // sharded over 4 ranks
      EXPECT_EQ(lean_indices, 0);
    }
  }
}

// Deferred initialization: each rank writes the values of the chunks it owns (nothing is
// broadcast), so with the same seed on every rank the engine starts from one process's weights.
TEST(LoraDataParallel, ADeferredBaseIsInitializedByTheRanksThatOwnItsChunks) {
  const Config config = tight_config(
      R"({"default_chunk_size": 32768, "client": {"device": {"capacity_bytes": 8388608}}})");
  auto deferred = [] {
    models::GptSpec spec = tiny();
    spec.lora_rank = 4;
    spec.lora_alpha = 8.0;
    spec.deferred_init = true;
    torch::manual_seed(1);
    return models::Gpt(spec);
  };
  models::Gpt model = deferred();
  Engine engine(model.ptr(), config, comm());
  models::Gpt one_model = deferred();
  Engine one(one_model.ptr(), config);
  const auto ours = engine.fp32_state_dict(), theirs = one.fp32_state_dict();
  ASSERT_EQ(ours.size(), theirs.size());
  for (size_t i = 0; i < ours.size(); ++i) {
    EXPECT_TRUE(torch::equal(ours[i].second, theirs[i].second)) << ours[i].first;
  }
  const double apart =
      max_relative_difference(train_steps(engine, model, 0, 3, /*sharded=*/true),
                              train_steps(one, one_model, 0, 3, /*sharded=*/false));
  if (comm()->rank() == 0) {
    std::printf("%d rank(s), deferred base: losses within %.3g of one process\n",
                comm()->world_size(), apart);
  }
  EXPECT_LE(apart, 1e-5);
}

// A gradient assigned by hand to a frozen parameter, on rank 0 only: its step refuses it, naming
// it, and every rank discards the iteration (none waits for the others forever); training goes on
// once it is reset.
TEST(LoraDataParallel, AGradientAssignedToAFrozenParameterOnOneRankStopsEveryRankAlike) {
  const Config config = tight_config(
      R"({"default_chunk_size": 32768, "client": {"device": {"capacity_bytes": 8388608}}})");
  models::Gpt model = lora_model(1);
  Engine engine(model.ptr(), config, comm());
  train_steps(engine, model, 0, 1, /*sharded=*/true);
  const auto batch = batch_of_step(1);
  engine.zero_grad();
  at::Tensor loss;
  {
    auto active = engine.activate();
    loss = model->loss(my_rows(batch.tokens), my_rows(batch.targets));
  }
  engine.backward(loss);
  at::Tensor w = model->named_parameters()["blocks.0.fc.weight"];
  const bool me = comm()->rank() == 0;
  if (me) {
    w.mutable_grad() = torch::ones(w.sizes());
  }
  std::string error = "<no error>";
  try {
    engine.step();
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  }
  if (me) {
    EXPECT_NE(error.find("blocks.0.fc.weight"), std::string::npos) << error;
    EXPECT_NE(error.find("frozen"), std::string::npos) << error;
    w.mutable_grad().reset();
  } else {
    EXPECT_NE(error.find("on rank 0 of"), std::string::npos) << error;
    EXPECT_NE(error.find("blocks.0.fc.weight"), std::string::npos) << error;
  }
  for (const double l : train_steps(engine, model, 2, 4, /*sharded=*/true))
    EXPECT_TRUE(std::isfinite(l));
}

}  // namespace lora_data_parallel_test
}  // namespace patrickstar
