// Asynchronous chunk moves (the default): the copy thread moves chunks while compute runs, and the
// ordering rules keep results exactly those of synchronous moves, whatever the copies' timing.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>
#include <nlohmann/json.hpp>

#include "gpt_training.h"
#include "patrickstar/engine/engine_inspect.h"
#include "patrickstar/models/gpt.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar {
namespace async_moves_test {

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
  run.queued = inspect(engine).chunks().copy_queue() != nullptr;
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
  // Devices that force moves: the fp32 one of tight_config, and for bf16 (whose kernels' scratch
  // memory differs between CPUs) the measured non-model peak plus room for a few chunks.
  struct Case {
    std::string extra;
    int64_t chunk_room;  // 0: tight_config's device
  };
  for (const Case& c :
       {Case{"{}", 0}, Case{R"({"bf16": {"enabled": true}})", 240000},
        Case{R"({"bf16": {"enabled": true}, "gradient_accumulation_steps": 2})", 480000}}) {
    const std::string& extra = c.extra;
    auto config_of = [&](const std::string& scheduler) {
      const std::string json = with_moves(extra, scheduler);
      return c.chunk_room == 0 ? tight_config(json) : config_with_chunk_room(json, c.chunk_room);
    };
    const MovesRun sync = train(config_of(R"({"async_moves": false})"), kSteps);
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
      const MovesRun async = train(config_of(scheduler), kSteps);
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
                extra.c_str(), waited);
  }
}

// The timeline: with the queue recording, every move the scheduler issued is one copy on the copy
// thread, in the same order, of the same chunk, starting no earlier than it was issued (one clock
// for both); waits are spans of their own. After a steady step the chunks of the next iteration's
// first moment are already on the device (the step's compute done, the scheduler prefetched them),
// and chunks the host Adam needs left the device before the step (early offload): the step moment
// itself sends none.
TEST(AsyncMoves, TheTimelineShowsEachIssuedMoveAsOneCopyOnTheSameClock) {
  models::Gpt model = make_model(1);
  Engine engine(model.ptr(), tight_config());
  CopyEngine* queue = inspect(engine).chunks().copy_queue();
  ASSERT_NE(queue, nullptr);
  engine.set_record_timeline(true);  // the moves and the copy thread's spans
  for (int s = 0; s < 5; ++s) {
    const IterationReport report = train_step(engine, model, s);
    if (s < 2) continue;
    EXPECT_GT(report.h2d_bytes, 0) << "the device is tight: chunks move every iteration";
    const Trace& trace = inspect(engine).scheduler().trace();
    ASSERT_GT(trace.size(), 0);
    for (int64_t id : trace.moments[0].chunk_ids) {
      EXPECT_EQ(inspect(engine).chunks().tier(id), Tier::kDevice)
          << "step " << s << ": " << inspect(engine).chunks().describe(id) << " (first moment) not prefetched";
    }
    const int64_t step_moment = trace.size() - 1;
    ASSERT_EQ(trace.moments[step_moment].kind, MomentKind::kStep);
    const std::vector<int64_t>& home = trace.moments[step_moment].host_chunk_ids;
    int64_t sent_home = 0;
    for (const MoveEvent& move : inspect(engine).scheduler().moves()) {
      if (move.iteration != inspect(engine).scheduler().history().back().iteration || move.to_device) continue;
      if (std::find(home.begin(), home.end(), move.chunk_id) == home.end()) continue;
      ++sent_home;
      EXPECT_LT(move.moment, step_moment) << "step " << s << ": " << inspect(engine).chunks().describe(move.chunk_id)
                                          << " left the device at the step itself";
    }
    EXPECT_GT(sent_home, 0) << "the host Adam's chunks leave the device every iteration";
  }
  queue->drain();  // the last step's prefetches may still be copying: a span is kept at its end
  std::vector<CopySpan> copies;
  int64_t waits = 0;
  for (const CopySpan& span : queue->spans()) {
    if (span.wait) {
      ++waits;
      EXPECT_GE(span.duration_us, 0);
    } else {
      copies.push_back(span);
    }
  }
  const std::vector<MoveEvent>& moves = inspect(engine).scheduler().moves();
  const MoveCounters counters = inspect(engine).chunks().move_counters();
  EXPECT_EQ(static_cast<int64_t>(copies.size()), counters.h2d_moves + counters.d2h_moves);
  ASSERT_EQ(copies.size(), moves.size());
  for (size_t i = 0; i < moves.size(); ++i) {
    const std::string id = "(id " + std::to_string(moves[i].chunk_id) + ")";
    EXPECT_NE(copies[i].label.find(id), std::string::npos) << i << ": " << copies[i].label;
    EXPECT_NE(copies[i].label.find(moves[i].to_device ? "to the device" : "to the host"),
              std::string::npos)
        << copies[i].label;
    EXPECT_GE(copies[i].start_us, moves[i].start_us) << i << ": " << copies[i].label;
    if (i > 0) {
      EXPECT_GE(copies[i].start_us, copies[i - 1].start_us + copies[i - 1].duration_us);
    }
  }
  std::printf("%zu copies on the copy thread, %lld waits by compute, over 5 steps\n", copies.size(),
              static_cast<long long>(waits));
}

// Off: no queue, every move completes where it is made.
TEST(AsyncMoves, ConfigTurnsThemOff) {
  const Config on = tight_config();
  EXPECT_TRUE(on.scheduler.async_moves);
  const Config off = tight_config(with_moves("{}", R"({"async_moves": false})"));
  models::Gpt model = make_model(1);
  Engine engine(model.ptr(), off);
  EXPECT_EQ(inspect(engine).chunks().copy_queue(), nullptr);
  EXPECT_EQ(Config::from_json(off.to_json()).scheduler.async_moves, false);
}

}  // namespace async_moves_test
}  // namespace patrickstar
