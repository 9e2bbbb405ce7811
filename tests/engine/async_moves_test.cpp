// Asynchronous chunk moves (the default): the copy thread moves chunks while compute runs, and the
// ordering rules keep results exactly those of synchronous moves, whatever the copies' timing.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <string>
#include <vector>

#include "gpt_training.h"
#include "patrickstar/models/gpt.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar {
namespace {

using namespace test;  // NOLINT: the shared helpers of the engine tests

struct MovesRun {
  std::vector<double> losses;
  std::vector<IterationReport> reports;
  std::vector<std::pair<std::string, at::Tensor>> weights;
  bool queued = false;
};

MovesRun train(const Config& config, int steps) {
  models::Gpt model = make_model(1);
  Engine engine(model.ptr(), config);
  MovesRun run;
  run.queued = engine.chunks().copy_queue() != nullptr;
  const int micro = config.gradient_accumulation_steps;
  for (int s = 0; s < steps; ++s) {
    auto batch = batch_of_step(s);
    engine.zero_grad();
    double loss_sum = 0;
    for (int k = 0; k < micro; ++k) {
      const int64_t rows = kBatch / micro;
      at::Tensor loss;
      {
        auto active = engine.activate();
        loss = model->loss(batch.tokens.narrow(0, k * rows, rows), batch.targets.narrow(0, k * rows, rows));
      }
      engine.backward(loss);
      loss_sum += loss.item<double>();
    }
    run.reports.push_back(engine.step());
    run.losses.push_back(loss_sum / micro);
  }
  run.weights = engine.fp32_state_dict();
  return run;
}

std::string with_moves(const std::string& extra, const std::string& scheduler) {
  nlohmann::json j = nlohmann::json::parse(extra);
  j["client"]["scheduler"] = nlohmann::json::parse(scheduler);
  return j.dump();
}

// A device that forces moves every iteration; synchronous moves against asynchronous ones with
// seeded random delays before each copy (so copies finish early, late, and in between compute), fp32,
// bf16, and bf16 with gradient accumulation (a gradient space): losses and final weights identical
// bit for bit, every seed.
TEST(AsyncMoves, RandomCopyDelaysChangeNothingBitForBit) {
  constexpr int kSteps = 6;
  for (const char* extra :
       {"{}", R"({"bf16": {"enabled": true}, "client": {"device": {"capacity_bytes": 700000}}})",
        R"({"bf16": {"enabled": true}, "gradient_accumulation_steps": 2,
            "client": {"device": {"capacity_bytes": 1000000}}})"}) {
    const MovesRun sync = train(tight_config(with_moves(extra, R"({"async_moves": false})")), kSteps);
    EXPECT_FALSE(sync.queued);
    for (const IterationReport& r : sync.reports) {
      EXPECT_GT(r.h2d_bytes, 0) << extra << ": chunks move every iteration (" << r.iteration << ")";
      EXPECT_EQ(r.copy_wait_seconds, 0.0);
    }
    double waited = 0;
    for (int seed = 0; seed <= 6; ++seed) {
      const std::string scheduler =
          seed == 0 ? std::string(R"({"async_moves": true})")
                    : R"({"async_moves": true, "copy_delay_max_us": 400, "copy_delay_seed": )" +
                          std::to_string(seed) + "}";
      const MovesRun async = train(tight_config(with_moves(extra, scheduler)), kSteps);
      EXPECT_TRUE(async.queued);
      EXPECT_EQ(async.losses, sync.losses) << extra << " seed " << seed;
      ASSERT_EQ(async.weights.size(), sync.weights.size());
      for (size_t i = 0; i < sync.weights.size(); ++i) {
        EXPECT_TRUE(at::equal(async.weights[i].second, sync.weights[i].second))
            << extra << " seed " << seed << " " << sync.weights[i].first;
      }
      for (size_t i = 0; i < sync.reports.size(); ++i) {
        EXPECT_EQ(async.reports[i].h2d_bytes, sync.reports[i].h2d_bytes) << extra << " seed " << seed;
        EXPECT_EQ(async.reports[i].d2h_bytes, sync.reports[i].d2h_bytes) << extra << " seed " << seed;
        EXPECT_GE(async.reports[i].copy_wait_seconds, 0.0);
        if (seed > 0) waited += async.reports[i].copy_wait_seconds;
      }
    }
    // Delays of up to 0.4 ms before each of dozens of copies per step: compute waited somewhere.
    EXPECT_GT(waited, 0.0) << extra;
    std::printf("%s: 6 seeds of random copy delays, losses and weights bit-identical to synchronous "
                "moves; compute waited %.4f s on copies in all\n",
                extra, waited);
  }
}

// Off: no queue, every move completes where it is made.
TEST(AsyncMoves, ConfigTurnsThemOff) {
  const Config on = tight_config();
  EXPECT_TRUE(on.scheduler.async_moves);
  const Config off = tight_config(with_moves("{}", R"({"async_moves": false})"));
  models::Gpt model = make_model(1);
  Engine engine(model.ptr(), off);
  EXPECT_EQ(engine.chunks().copy_queue(), nullptr);
  EXPECT_EQ(Config::from_json(off.to_json()).scheduler.async_moves, false);
}

}  // namespace
}  // namespace patrickstar
