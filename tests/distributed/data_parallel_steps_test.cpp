// Data parallel through the engine, its steps and collectives (docs/design.md section 9): the bytes
// each iteration moves, GatheredParameters across ranks, checkpoints, clipping by the global norm,
// a step one rank cannot take, an fp16 overflow on one rank and a rank that dies. Run as one
// process and under mpirun like data_parallel_test.cpp (every test on every rank).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "distributed/data_parallel_helpers.h"
#include "distributed/ranks.h"
#include "engine/gpt_training.h"
#include "engine/small_net.h"
#include "patrickstar/engine/engine_inspect.h"
#include "patrickstar/memtracer/simulator.h"
#include "patrickstar/models/gpt.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar {
namespace data_parallel_steps_test {

using namespace test;  // NOLINT: the shared helpers of the engine tests

// One step of the two-layer MLP on this rank's rows of step s's batch.
IterationReport mlp_step(Engine& engine, Net& model, int s) {
  engine.zero_grad();
  at::Tensor loss;
  {
    auto active = engine.activate();
    // Where the engine put the parameters (the GPU under PATRICKSTAR_TEST_DEVICE=cuda).
    const c10::Device device = model->fc1->weight.device();
    loss = torch::mse_loss(model->forward(my_rows(input_of(s)).to(device)).to(at::kFloat),
                           my_rows(target_of(s)).to(device));
  }
  engine.backward(loss);
  return engine.step();
}

// The two-layer MLP: each comm group is gathered for the forward, dropped after it, gathered again
// for the backward and reduced once. With k the shard group's size (N unless hybrid sharding), per
// iteration: gather bytes 2 x k x param chunk bytes x groups; reduce bytes k x chunk_elems x 4 x
// groups; all-reduce 4 (the loss's finiteness) + 8 (the squared norm, fp64), and with hybrid
// sharding each owned chunk's sums over the replicas (chunk_elems x 4 x groups). One process: no
// collective at all.
TEST(DataParallel, CollectiveBytesPerIterationEqualTheFormula) {
  for (const char* extra : {"{}", R"({"bf16": {"enabled": true}})"}) {
    torch::manual_seed(5);
    Net model;
    auto engine = std::make_shared<Engine>(model.ptr(), small_device(extra), comm());
    const ChunkStore& store = inspect(*engine).chunks();
    const int k = engine->shard_group_size();  // ranks() unless hybrid sharding
    const int64_t groups = store.chunks_per_kind() / k;
    const int64_t param_chunk = store.chunk_bytes(store.chunk_id(ChunkKind::kParam, 0));
    for (int s = 0; s < 3; ++s) {
      const IterationReport r = mlp_step(*engine, model, s);
      if (ranks() == 1) {
        EXPECT_EQ(r.group_gathers + r.group_reduces + r.gather_bytes + r.reduce_bytes +
                      r.all_reduce_bytes,
                  0);
        continue;
      }
      EXPECT_EQ(r.group_gathers, 2 * groups) << extra << " step " << s;
      EXPECT_EQ(r.group_reduces, groups) << extra << " step " << s;
      EXPECT_EQ(r.gather_bytes, 2 * groups * k * param_chunk) << extra << " step " << s;
      EXPECT_EQ(r.reduce_bytes, groups * k * store.chunk_elems() * 4) << extra << " step " << s;
      EXPECT_EQ(r.all_reduce_bytes,
                all_reduce_bytes_per_iteration(k, store.chunks_per_kind(), store.chunk_elems()))
          << extra << " step " << s;
      if (me() == 0 && s == 0) {
        std::printf(
            "%s, %d ranks in shard groups of %d: per iteration gather %lld bytes, "
            "reduce %lld, all-reduce %lld (formulas: 2 x %lld groups x %d x %lld; "
            "%lld x %d x %lld x 4; 12 + replicas' sums)\n",
            extra, ranks(), k, static_cast<long long>(r.gather_bytes),
            static_cast<long long>(r.reduce_bytes), static_cast<long long>(r.all_reduce_bytes),
            static_cast<long long>(groups), k, static_cast<long long>(param_chunk),
            static_cast<long long>(groups), k, static_cast<long long>(store.chunk_elems()));
      }
      EXPECT_GE(r.collective_seconds, 0.0);
    }
  }
}

// GatheredParameters with N ranks: a read-only scope shows every rank every parameter, equal to
// the consolidated fp32 weights; a read-write scope writes rank 0's values everywhere (each rank
// writes its own rank number), each owner keeping its share, and the next forward on every rank
// computes with them: the same output as plain LibTorch with those weights.
TEST(DataParallel, GatheredParametersReadEveryRanksWeightsAndWriteRankZeros) {
  for (const char* extra : {"{}", R"({"bf16": {"enabled": true}})"}) {
    torch::manual_seed(5);
    Net model;
    auto engine = std::make_shared<Engine>(model.ptr(), small_device(extra), comm());
    for (int s = 0; s < 2; ++s) mlp_step(*engine, model, s);
    const auto before = engine->fp32_state_dict();
    {
      GatheredParameters read(*model, GatheredParameters::Mode::kReadOnly);
      const auto named = model->named_parameters();
      ASSERT_EQ(named.size(), before.size());
      for (size_t i = 0; i < before.size(); ++i) {
        EXPECT_EQ(named[i].key(), before[i].first);
        EXPECT_TRUE(at::equal(named[i].value(), before[i].second)) << extra << " " << before[i].first;
      }
    }
    {
      GatheredParameters write(*model);
      torch::NoGradGuard no_grad;
      model->fc1->weight.fill_(0.01 * (me() + 1));
    }
    const auto after = engine->fp32_state_dict();
    Net plain;
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < after.size(); ++i) {
        if (after[i].first == "fc1.weight") {
          EXPECT_TRUE(at::all(after[i].second == 0.01f).item<bool>()) << extra << ": rank 0's values";
        } else {
          EXPECT_TRUE(at::equal(after[i].second, before[i].second)) << extra << " " << after[i].first;
        }
        plain->named_parameters()[after[i].first].copy_(after[i].second);
      }
    }
    at::Tensor out;
    {
      torch::NoGradGuard no_grad;
      auto active = engine->activate();
      out = model->forward(input_of(7)).to(at::kFloat);
    }
    const at::Tensor expected = plain->forward(input_of(7));
    const double tolerance = std::string(extra) == "{}" ? 1e-6 : 2e-2;
    EXPECT_LE(((out - expected).norm() / expected.norm()).item<double>(), tolerance) << extra;
  }
}

// Each rank saves the tensors it owns (format 4); new engines over the same number of ranks resume
// from it and continue exactly as the run that did not stop. save_weights writes one consolidated
// fp32 archive from rank 0 that plain LibTorch loads.
TEST(DataParallel, SaveAndResumeWithTheSameRanksContinuesIdentically) {
  const std::string dir = ::testing::TempDir();
  // The same path on every rank (rank 0's pid), so each rank's shard sits beside the others.
  at::Tensor tag = at::full({1}, me() == 0 ? static_cast<double>(::getpid()) : 0.0, at::kDouble);
  comm()->broadcast(tag, 0);
  const std::string path = dir + "/ps_dp_ckpt_" + std::to_string(tag.item<int64_t>()) + ".pt";
  const std::string weights = dir + "/ps_dp_weights_" + std::to_string(tag.item<int64_t>()) + ".pt";
  for (const char* extra : {"{}", R"({"bf16": {"enabled": true}})"}) {
    const Config config = tight_config(extra);
    auto run_steps = [](Engine& engine, models::Gpt& model, int from, int to) {
      return train_steps(engine, model, from, to, /*sharded=*/true);
    };
    models::Gpt first = make_model(1);
    Engine straight(first.ptr(), config, comm());
    run_steps(straight, first, 0, 4);
    straight.save_checkpoint(path);
    const std::vector<double> expected = run_steps(straight, first, 4, 8);

    models::Gpt second = make_model(99);  // other weights: the checkpoint replaces them
    Engine resumed(second.ptr(), config, comm());
    resumed.load_checkpoint(path);
    const std::vector<double> got = run_steps(resumed, second, 4, 8);
    EXPECT_EQ(got, expected) << extra;  // bit-exact
    const auto a = straight.fp32_state_dict();
    const auto b = resumed.fp32_state_dict();
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i].second, b[i].second)) << a[i].first;

    straight.save_weights(weights);
    comm()->barrier();
    models::Gpt plain = make_model(7);
    torch::load(plain, weights);
    const auto named = plain->named_parameters();
    for (const auto& [name, value] : a) EXPECT_TRUE(torch::equal(named[name], value)) << name;
    comm()->barrier();  // every rank has read rank 0's archive before the next case rewrites it
  }
  if (ranks() > 1) {
    // Another number of ranks (one process here): the checkpoint loads, each tensor from the file
    // of the rank that wrote it.
    models::Gpt other = make_model(1);
    Engine single(other.ptr(), tight_config(R"({"bf16": {"enabled": true}})"));
    single.load_checkpoint(path);
    const auto loaded = single.fp32_state_dict();
    models::Gpt again = make_model(5);
    Engine same_ranks(again.ptr(), tight_config(R"({"bf16": {"enabled": true}})"), comm());
    same_ranks.load_checkpoint(path);
    const auto expected = same_ranks.fp32_state_dict();
    for (size_t i = 0; i < loaded.size(); ++i) {
      EXPECT_TRUE(torch::equal(loaded[i].second, expected[i].second)) << loaded[i].first;
    }
  }
  comm()->barrier();
}

// Clipping: every rank clips with the global norm, the one a single process computes.
TEST(DataParallel, ClippingUsesTheGlobalNormOnEveryRank) {
  const Config config = tight_config(R"({"gradient_clipping": 0.05})");
  const EngineRun one = train_gpt(config, 3, /*sharded=*/false);
  const EngineRun run = train_gpt(config, 3);
  for (size_t s = 0; s < 3; ++s) {
    const double norm = one.reports[s].grad_norm;
    const double mine = run.reports[s].grad_norm;
    EXPECT_NEAR(mine, norm, 1e-5 * norm) << "step " << s;
    EXPECT_GT(norm, 0.05) << "the test must clip";
    EXPECT_EQ(max_over_ranks(mine), mine) << "every rank has the same norm";
  }
}

// One rank cannot take a step (a 4 MiB temporary in its forward, on a 64 KiB device: its step's
// trace check rejects the iteration): every rank discards the iteration instead of waiting for it,
// weights stay as they were everywhere, and training goes on as a run without the failure.
TEST(DataParallel, AStepOneRankCannotTakeIsDiscardedOnEveryRank) {
  auto losses_of = [&](bool fail_first) {
    torch::manual_seed(5);
    Net model;
    auto engine = std::make_shared<Engine>(model.ptr(), small_device(), comm());
    std::vector<double> losses;
    for (int s = 0; s < (fail_first ? 4 : 3); ++s) {
      const bool fail = fail_first && s == 0;
      const int data = fail_first ? std::max(0, s - 1) : s;
      engine->zero_grad();
      at::Tensor loss;
      {
        auto active = engine->activate();
        at::Tensor h = patrickstar::call(model->fc1, my_rows(input_of(data)));
        if (fail && me() == ranks() - 1) {
          at::Tensor big = torch::ones({1 << 20});
          h = h + big.sum() * 0;
        }
        h = patrickstar::call(model->fc2, torch::relu(h));
        loss = torch::mse_loss(h, my_rows(target_of(data)));
      }
      engine->backward(loss);
      if (!fail) {
        engine->step();
        losses.push_back(mean_over_ranks(loss.item<double>()));
        continue;
      }
      const auto before = engine->fp32_state_dict();
      std::string error = "<no error>";
      try {
        engine->step();
      } catch (const c10::Error& e) {
        error = e.what_without_backtrace();
      }
      const bool failing_rank = me() == ranks() - 1;
      // Every rank names the failing rank and its error.
      EXPECT_NE(error.find("non-model data"), std::string::npos) << error;
      if (!failing_rank) {
        EXPECT_NE(error.find("could not take this step on rank " + std::to_string(ranks() - 1) +
                             " of " + std::to_string(ranks())),
                  std::string::npos)
            << error;
      }
      EXPECT_NE(error.find("the step was not taken"), std::string::npos) << error;
      const auto after = engine->fp32_state_dict();
      for (size_t i = 0; i < before.size(); ++i) {
        EXPECT_TRUE(torch::equal(before[i].second, after[i].second)) << before[i].first;
      }
    }
    return losses;
  };
  const std::vector<double> clean = losses_of(false);
  const std::vector<double> recovered = losses_of(true);
  EXPECT_EQ(recovered, clean);
}

// fp16: one rank's gradients overflow; every rank skips the step and lowers the scale alike.
TEST(DataParallel, Fp16OverflowOnOneRankSkipsTheStepOnEveryRank) {
  torch::manual_seed(5);
  Net model;
  auto engine = std::make_shared<Engine>(
      model.ptr(), small_device(R"({"fp16": {"enabled": true, "initial_scale_power": 8}})"), comm());
  for (int s = 0; s < 3; ++s) {
    const auto before = engine->fp32_state_dict();
    engine->zero_grad();
    at::Tensor loss;
    {
      auto active = engine->activate();
      // Where the engine put the parameters (the GPU under PATRICKSTAR_TEST_DEVICE=cuda).
      const c10::Device device = model->fc1->weight.device();
      loss = torch::mse_loss(model->forward(my_rows(input_of(s)).to(device)).to(at::kFloat),
                             my_rows(target_of(s)).to(device));
    }
    const bool overflow_here = s == 1 && me() == ranks() - 1;
    engine->backward(overflow_here ? loss * 1e30 : loss);
    const IterationReport r = engine->step();
    EXPECT_EQ(r.skipped, s == 1) << "step " << s;
    const auto after = engine->fp32_state_dict();
    for (size_t i = 0; i < before.size(); ++i) {
      EXPECT_EQ(torch::equal(before[i].second, after[i].second), s == 1) << before[i].first;
    }
  }
}

}  // namespace data_parallel_steps_test
}  // namespace patrickstar

namespace patrickstar {
namespace data_parallel_steps_test {

// A rank dies (PS_DEAD_RANK=kill: SIGKILL) or hangs (PS_DEAD_RANK=hang) between the forward and the
// backward of step 2; the others wait for it in the gradient reduction. Run by the ctest
// distributed.dead_rank_killed / distributed.dead_rank_hung (tests/distributed/check_dead_rank.cmake),
// which check that the job ends, with which message, and how fast.
TEST(DataParallel, DeadRankEndsTheJob) {
  const char* mode = std::getenv("PS_DEAD_RANK");
  if (mode == nullptr || ranks() == 1) {
    GTEST_SKIP() << "run under mpirun by distributed.dead_rank_killed and distributed.dead_rank_hung";
  }
  torch::manual_seed(5);
  Net model;
  auto engine = std::make_shared<Engine>(model.ptr(), small_device(), comm());
  for (int s = 0; s < 4; ++s) {
    engine->zero_grad();
    at::Tensor loss;
    {
      auto active = engine->activate();
      loss = torch::mse_loss(model->forward(my_rows(input_of(s))), my_rows(target_of(s)));
    }
    if (s == 2 && me() == ranks() - 1) {
      std::fprintf(stderr, "rank %d: %s now\n", me(), mode);
      std::fflush(stderr);
      if (std::string(mode) == "kill") std::raise(SIGKILL);
      std::this_thread::sleep_for(std::chrono::hours(1));
    }
    engine->backward(loss);
    engine->step();
  }
  ADD_FAILURE() << "the job went on past a dead rank";
}

}  // namespace data_parallel_steps_test
}  // namespace patrickstar
