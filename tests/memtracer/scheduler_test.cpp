// Scheduler and simulator: hand-computed OPT answers, OPT never above LRU on random traces, the
// budget never exceeded, zero traffic when everything fits, the static policy, clear errors.
#include <random>
#include <set>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "error_message.h"
#include "scheduler_test_util.h"

namespace patrickstar {
namespace scheduler_test {

using ::testing::HasSubstr;
using namespace scheduler_testing;  // NOLINT: the scheduler tests' shared helpers
using test::error_of;

// Three chunks of 100 bytes used in a loop 0 1 2 0 1 2 with room for two.
// OPT (hand run of Belady, the iteration wrapping into the next): resident {a, b}, c misses and
// evicts whichever of a, b comes back last; the next access hits; the one after misses again. So
// every second access misses: 3 loads (and 3 evictions) per iteration of 6 accesses. LRU: the least
// recently used chunk is always the next one needed: all 6 accesses miss.
TEST(Scheduler, HandComputedLoop) {
  const Trace trace = make_trace({{0}, {1}, {2}, {0}, {1}, {2}});
  const auto chunks = equal_chunks(3, 100);
  const SimulationResult opt = simulate(trace, chunks, sim_options(200, EvictionPolicy::kOpt, 0));
  EXPECT_EQ(opt.steady.loads, 3);
  EXPECT_EQ(opt.steady.h2d_bytes, 300);
  EXPECT_EQ(opt.steady.d2h_bytes, 300);
  const SimulationResult lru = simulate(trace, chunks, sim_options(200, EvictionPolicy::kLru, 0));
  EXPECT_EQ(lru.steady.loads, 6);
  EXPECT_EQ(lru.steady.h2d_bytes, 600);
  const TrafficBound bound =
      opt_traffic_bound(trace, chunks, sim_options(200, EvictionPolicy::kOpt, 0).scheduler);
  EXPECT_TRUE(bound.proven);
  EXPECT_EQ(bound.loads, 3);
  EXPECT_EQ(bound.h2d_bytes, 300);
  EXPECT_EQ(bound.d2h_bytes, 300);
}

// Non-model bytes shape the budget. Chunks 0, 1, 2 of 100 bytes, capacity 400.
//   m0 accesses {0, 1}, non-model 0
//   m1 accesses {2},    non-model 200
//   m2 accesses {0},    non-model 0
// Budgets: m0: 400 - max(0, 200) = 200; m1: 400 - max(200, 0) = 200; m2: 400 - max(0, 0) = 400.
// Demand paging (no prefetch): at m1 one of {0, 1} must leave; 0 is needed at m2, 1 only at the
// next m0, so OPT evicts 1 at m1. At the next m0, {0, 1} fill the budget of 200: chunk 2 leaves,
// 1 comes back. Two loads and two evictions per iteration, and no schedule does better: 2 must be
// away at m0 and back at m1, and one of {0, 1} away at m1 and back at m0.
// Prefetch after compute (depth 2): after m0's compute, chunk 2 (needed at m1) comes early and
// evicts 1 (next use: the next m0, later than 0's at m2), so that eviction moves to m0. After m1's
// compute, chunk 1 (needed at the next m0, whose budget of 200 is the tightest of the window)
// evicts 2, next used at the next m1. Still two loads per iteration, both prefetched and used.
TEST(Scheduler, HandComputedBudgetsFromNonModelBytes) {
  const Trace trace = make_trace({{0, 1}, {2}, {0}}, {0, 200, 0});
  const auto chunks = equal_chunks(3, 100);
  for (int64_t depth : {0, 2}) {
    const SimulationResult result =
        simulate(trace, chunks, sim_options(400, EvictionPolicy::kOpt, depth));
    EXPECT_EQ(result.steady.budget_bytes, (std::vector<int64_t>{200, 200, 400}));
    EXPECT_EQ(result.steady.loads, 2) << "prefetch depth " << depth;
    EXPECT_EQ(result.steady.evictions, 2) << "prefetch depth " << depth;
    EXPECT_EQ(result.steady.prefetches_used, depth == 0 ? 0 : 2);
    std::vector<std::pair<int64_t, int64_t>> evictions;  // (moment, chunk) in the last iteration
    for (const MoveEvent& move : result.moves) {
      if (move.iteration == 3 && !move.to_device)
        evictions.emplace_back(move.moment, move.chunk_id);
    }
    if (depth == 0) {
      EXPECT_EQ(evictions, (std::vector<std::pair<int64_t, int64_t>>{{0, 2}, {1, 1}}));
    } else {
      EXPECT_EQ(evictions, (std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {1, 2}}));
    }
    // The device never holds more than the capacity: chunks + non-model.
    for (const MomentRecord& record : result.moments) {
      if (record.iteration == 0) continue;
      EXPECT_LE(record.chunk_bytes, record.budget_bytes);
      EXPECT_LE(record.chunk_bytes + record.non_model_bytes, 400);
    }
  }
  const TrafficBound bound =
      opt_traffic_bound(trace, chunks, sim_options(400, EvictionPolicy::kOpt, 0).scheduler);
  EXPECT_EQ(bound.loads, 2);
}

Trace random_trace(std::mt19937& rng, int64_t chunk_count, int64_t max_non_model) {
  std::uniform_int_distribution<int64_t> moments_dist(4, 16), per_moment(1, 3),
      chunk_dist(0, chunk_count - 1), non_model_dist(0, max_non_model);
  Trace trace;
  const int64_t moments = moments_dist(rng);
  for (int64_t m = 0; m < moments; ++m) {
    Moment moment{MomentKind::kPreForward, "m" + std::to_string(m), non_model_dist(rng), {}};
    const int64_t n = per_moment(rng);
    while (static_cast<int64_t>(moment.chunk_ids.size()) < n) {
      const int64_t id = chunk_dist(rng);
      if (std::find(moment.chunk_ids.begin(), moment.chunk_ids.end(), id) ==
          moment.chunk_ids.end()) {
        moment.chunk_ids.push_back(id);
      }
    }
    trace.moments.push_back(moment);
  }
  trace.tail_non_model_bytes = non_model_dist(rng);
  return trace;
}

// Belady is optimal for equal-size chunks: from the same state after the warm-up (both policies
// warm up with LRU and warm-start alike), OPT never loads more than LRU over the same iterations,
// and never fewer than the offline bound per steady iteration.
TEST(Scheduler, OptNeverAboveLruOnRandomTraces) {
  int64_t opt_better = 0;
  for (uint32_t seed = 0; seed < 250; ++seed) {
    std::mt19937 rng(seed);
    const int64_t chunk_count = std::uniform_int_distribution<int64_t>(3, 10)(rng);
    const Trace trace = random_trace(rng, chunk_count, 150);
    const auto chunks = equal_chunks(chunk_count, 100);
    // Room for the 3 chunks a moment may need beside the largest non-model figure, and some more.
    const int64_t capacity = 300 + 150 + std::uniform_int_distribution<int64_t>(0, 500)(rng);
    const auto opt = simulate(trace, chunks, sim_options(capacity, EvictionPolicy::kOpt, 0, 4));
    const auto lru = simulate(trace, chunks, sim_options(capacity, EvictionPolicy::kLru, 0, 4));
    int64_t opt_h2d = 0, lru_h2d = 0;
    for (size_t i = 1; i < opt.iterations.size(); ++i) {
      opt_h2d += opt.iterations[i].h2d_bytes;
      lru_h2d += lru.iterations[i].h2d_bytes;
    }
    ASSERT_LE(opt_h2d, lru_h2d) << "seed " << seed << ", capacity " << capacity;
    opt_better += opt_h2d < lru_h2d ? 1 : 0;
    const TrafficBound bound =
        opt_traffic_bound(trace, chunks, sim_options(capacity, EvictionPolicy::kOpt, 0).scheduler);
    // Long-run means: the scheduler's start state differs from the bound's empty device by at most
    // the chunks the device holds (here < 10 chunks of 100 bytes).
    const int64_t slack_bytes = 10 * 100;
    const auto long_opt =
        simulate(trace, chunks, sim_options(capacity, EvictionPolicy::kOpt, 0, 12));
    ASSERT_GE(long_opt.mean_h2d_bytes * 11 + slack_bytes, static_cast<double>(bound.h2d_bytes) * 11)
        << "seed " << seed;
    const auto prefetching =
        simulate(trace, chunks, sim_options(capacity, EvictionPolicy::kOpt, 2, 12));
    ASSERT_GE(prefetching.mean_h2d_bytes * 11 + slack_bytes,
              static_cast<double>(bound.h2d_bytes) * 11)
        << "seed " << seed;
  }
  EXPECT_GT(opt_better, 25);  // the property is not vacuous: OPT often strictly wins
}

// Unequal sizes and every policy: after the warm-up the chunks never exceed a moment's budget and,
// with the measured non-model bytes, never the capacity.
TEST(Scheduler, BudgetNeverExceededOnRandomTraces) {
  for (uint32_t seed = 0; seed < 200; ++seed) {
    std::mt19937 rng(1000 + seed);
    const int64_t chunk_count = std::uniform_int_distribution<int64_t>(3, 10)(rng);
    const Trace trace = random_trace(rng, chunk_count, 300);
    std::map<int64_t, ChunkInfo> chunks;
    for (int64_t id = 0; id < chunk_count; ++id) {
      chunks[id] = ChunkInfo{std::uniform_int_distribution<int64_t>(50, 150)(rng), id % 2 == 0};
    }
    const int64_t capacity = 3 * 150 + 300 + std::uniform_int_distribution<int64_t>(0, 400)(rng);
    for (EvictionPolicy policy : {EvictionPolicy::kOpt, EvictionPolicy::kLru}) {
      for (int64_t depth : {0, 1, 3}) {
        SimulationOptions options = sim_options(capacity, policy, depth);
        options.scheduler.prefetch_after_compute = seed % 2 == 0;
        const auto result = simulate(trace, chunks, options);
        for (const MomentRecord& record : result.moments) {
          if (record.iteration == 0) continue;  // the warm-up budget is a ratio, not a measurement
          ASSERT_LE(record.chunk_bytes, record.budget_bytes)
              << "seed " << seed << " moment " << record.moment;
          ASSERT_LE(record.chunk_bytes + record.non_model_bytes, capacity)
              << "seed " << seed << " moment " << record.moment;
        }
        for (size_t i = 1; i < result.iterations.size(); ++i) {
          ASSERT_LE(result.iterations[i].peak_device_bytes, capacity);
        }
      }
    }
  }
}

TEST(Scheduler, NoTrafficAfterWarmupWhenEverythingFits) {
  GptLikeOptions gpt;
  gpt.layers = 4;
  gpt.chunk_elems = 1024;
  gpt.activation_bytes_per_layer = 8192;
  gpt.step_non_model_bytes = 1024;
  const SyntheticWorkload workload = make_gpt_like_workload(gpt);
  const int64_t capacity = workload.total_chunk_bytes + 4 * 8192 + 8192;
  for (EvictionPolicy policy : {EvictionPolicy::kOpt, EvictionPolicy::kLru}) {
    SimulationOptions options = sim_options(capacity, policy, 2);
    options.scheduler.warmup_ratio = 0.3;  // the warm-up evicts ...
    const auto result = simulate(workload.trace, workload.chunks, options);
    EXPECT_GT(result.iterations[0].evictions, 0);
    for (size_t i = 1; i < result.iterations.size(); ++i) {  // ... and afterwards nothing moves
      EXPECT_EQ(result.iterations[i].h2d_bytes, 0) << eviction_policy_name(policy);
      EXPECT_EQ(result.iterations[i].d2h_bytes, 0) << eviction_policy_name(policy);
    }
  }
}

// Static (ZeRO-Offload-like): param chunks stay on the device through forward and backward; at the
// step they go to the host for the host Adam and come back at the next forward: per iteration
// exactly the param bytes each way, the optimizer chunks never on the device.
TEST(Scheduler, StaticPolicyMovesOnlyParamsAtTheStep) {
  GptLikeOptions gpt;
  gpt.layers = 3;
  gpt.param_chunks_per_layer = 1;
  gpt.chunk_elems = 1000;
  gpt.mixed_precision_sizes = true;
  const SyntheticWorkload workload = make_gpt_like_workload(gpt);
  int64_t param_bytes = 0;
  for (const auto& [id, chunk] : workload.chunks) {
    if (chunk.static_on_device) param_bytes += chunk.bytes;
  }
  EXPECT_EQ(param_bytes, 4 * 2000);
  const auto result =
      simulate(workload.trace, workload.chunks, sim_options(1 << 30, EvictionPolicy::kStatic, 2));
  for (size_t i = 1; i < result.iterations.size(); ++i) {
    EXPECT_EQ(result.iterations[i].h2d_bytes, param_bytes);
    EXPECT_EQ(result.iterations[i].d2h_bytes, param_bytes);
  }
  for (const MoveEvent& move : result.moves) {
    EXPECT_TRUE(workload.chunks.at(move.chunk_id).static_on_device) << "chunk " << move.chunk_id;
  }
}


TEST(Scheduler, NeverEvictsAChunkThatMayNotMove) {
  SchedulerOptions options;
  options.capacity_bytes = 200;
  options.warmup_ratio = 1.0;
  Scheduler scheduler(options, equal_chunks(3, 100));
  PinnedMover mover;
  scheduler.begin_iteration();
  scheduler.at_moment(0, MomentKind::kPreForward, {0}, mover);
  scheduler.at_moment(1, MomentKind::kPreForward, {1}, mover);
  scheduler.at_moment(2, MomentKind::kPreForward, {2}, mover);  // evicts 1, not 0
  EXPECT_EQ(mover.resident, (std::set<int64_t>{0, 2}));
  EXPECT_EQ(scheduler.current_stats().evictions, 1);
}

// Room for memory the scheduler does not place (a gathered comm group): at least the bytes asked
// are evicted, least recently used first in the warm-up, never a chunk that may not move; when the
// movable chunks are not enough nothing moves.
TEST(Scheduler, MakeRoomEvictsMovableChunksOrNothing) {
  SchedulerOptions options;
  options.capacity_bytes = 400;
  options.warmup_ratio = 1.0;
  Scheduler scheduler(options, equal_chunks(4, 100));
  PinnedMover mover;
  scheduler.begin_iteration();
  scheduler.at_moment(0, MomentKind::kPreForward, {0, 1}, mover);
  scheduler.at_moment(1, MomentKind::kPreForward, {2, 3}, mover);
  EXPECT_TRUE(scheduler.make_room(0, mover));
  EXPECT_EQ(mover.resident.size(), 4u);
  EXPECT_TRUE(scheduler.make_room(150, mover));  // 1 is the least recent of the movable ones
  EXPECT_EQ(mover.resident, (std::set<int64_t>{0, 3}));
  EXPECT_EQ(scheduler.current_stats().evictions, 2);
  EXPECT_FALSE(scheduler.make_room(200, mover));  // only chunk 3 may go
  EXPECT_EQ(mover.resident, (std::set<int64_t>{0, 3}));
  EXPECT_TRUE(scheduler.make_room(100, mover));
  EXPECT_EQ(mover.resident, (std::set<int64_t>{0}));
}


// A host-side optimizer's chunks must leave the device at the step. Chunks 0, 1, 2 of 100 bytes,
// capacity 300 (all fit): m0 {0}, m1 {1}, m2 {2}, m3 (step) accesses {2} and needs 0 and 1 on the
// host. Without the host moment nothing moves after the warm-up; with it, 0 and 1 go out at m3 and
// come back at m0 and m1 of the next iteration: 200 bytes each way per iteration, which is also the
// least any schedule can do (the bound).
TEST(Scheduler, HostMomentsSendChunksHomeAndCountInTheBound) {
  Trace trace = make_trace({{0}, {1}, {2}, {2}});
  trace.moments[3].kind = MomentKind::kStep;
  const auto chunks = equal_chunks(3, 100);
  for (int64_t depth : {0, 2}) {
    for (EvictionPolicy policy : {EvictionPolicy::kOpt, EvictionPolicy::kLru}) {
      const auto options = sim_options(300, policy, depth);
      EXPECT_EQ(simulate(trace, chunks, options).steady.h2d_bytes, 0);
      Trace with_host = trace;
      with_host.moments[3].host_chunk_ids = {0, 1};
      const SimulationResult result = simulate(with_host, chunks, options);
      EXPECT_EQ(result.mean_h2d_bytes, 200) << eviction_policy_name(policy) << " depth " << depth;
      EXPECT_EQ(result.mean_d2h_bytes, 200) << eviction_policy_name(policy) << " depth " << depth;
      const TrafficBound bound = opt_traffic_bound(with_host, chunks, options.scheduler);
      EXPECT_TRUE(bound.proven);
      EXPECT_EQ(bound.h2d_bytes, 200);
      EXPECT_EQ(bound.d2h_bytes, 200);
    }
  }
}

// Early offload: with the trace above (0 and 1 go home at the step m3), each leaves the device right
// after the moment that last uses it (0 after m0, 1 after m1), not at m3; prefetch depth and policy
// change nothing of that, and the bytes moved stay those of the bound. Chunk 2, used at the step, is
// never moved. The static policy keeps its own rule (home at the step).
TEST(Scheduler, ChunksGoingHomeLeaveRightAfterTheirLastUse) {
  Trace trace = make_trace({{0}, {1}, {2}, {2}});
  trace.moments[3].kind = MomentKind::kStep;
  trace.moments[3].host_chunk_ids = {0, 1};
  const auto chunks = equal_chunks(3, 100);
  for (int64_t depth : {0, 2, 4}) {
    for (EvictionPolicy policy : {EvictionPolicy::kOpt, EvictionPolicy::kLru}) {
      const auto options = sim_options(300, policy, depth);
      const SimulationResult result = simulate(trace, chunks, options);
      std::vector<std::pair<int64_t, int64_t>> evictions;  // (moment, chunk), last iteration
      for (const MoveEvent& move : result.moves) {
        if (move.iteration == options.iterations && !move.to_device) {
          evictions.emplace_back(move.moment, move.chunk_id);
        }
      }
      EXPECT_EQ(evictions, (std::vector<std::pair<int64_t, int64_t>>{{0, 0}, {1, 1}}))
          << eviction_policy_name(policy) << " depth " << depth;
      EXPECT_EQ(result.mean_d2h_bytes, 200);
      EXPECT_EQ(result.mean_h2d_bytes, 200);
    }
  }
  const SimulationResult static_run =
      simulate(trace, chunks, sim_options(300, EvictionPolicy::kStatic, 2));
  for (const MoveEvent& move : static_run.moves) {
    if (move.iteration == 3 && !move.to_device) {
      EXPECT_EQ(move.moment, 3);
    }
  }
}

// host_before_use: the chunk's next event after moment m is its trip home, not an access.
TEST(NextUseIndex, HostBeforeUseIsTheTripHomeComingFirst) {
  Trace trace = make_trace({{0}, {1}, {0, 2}, {2}});
  trace.moments[3].host_chunk_ids = {0, 1};
  const NextUseIndex index(trace);
  EXPECT_FALSE(index.host_before_use(0, 0));  // used again at m2
  EXPECT_TRUE(index.host_before_use(0, 2));   // home at m3, then needed at the next m0
  EXPECT_TRUE(index.host_before_use(1, 1));
  EXPECT_TRUE(index.host_before_use(1, 2));
  EXPECT_FALSE(index.host_before_use(1, 3));  // after m3 the next event is the next m1's access
  EXPECT_FALSE(index.host_before_use(2, 0));  // never sent home
  EXPECT_FALSE(index.host_before_use(7, 0));  // unknown chunk
}

// Next uses: positions in the flattened access sequence (0: m0's chunk 0, 1: m1's chunk 1, 2: m2's
// chunk 2, 3: m3's chunk 2; 4 per iteration); a chunk sent home before its next access is "never".
TEST(NextUseIndex, HostMomentsEndAChunksUsefulStay) {
  Trace trace = make_trace({{0}, {1}, {2}, {2}});
  trace.moments[3].host_chunk_ids = {0};
  const NextUseIndex index(trace);
  EXPECT_EQ(index.accesses_per_iteration(), 4);
  EXPECT_EQ(index.next_use(2, 0), 2);
  EXPECT_EQ(index.next_use(2, 3), 2 + 4);  // wraps into the next iteration
  EXPECT_EQ(index.next_use(1, 1), 1 + 4);  // no host moment for chunk 1
  EXPECT_EQ(index.next_use(0, 0), NextUseIndex::kNever);  // home at m3 before m0 comes again
  EXPECT_EQ(index.next_use(0, 3), 0 + 4);  // after m3 it is needed next at m0
  EXPECT_EQ(index.next_use(7, 0), NextUseIndex::kNever);  // never accessed
}

TEST(Scheduler, RejectsATraceThatAccessesAChunkItSendsHome) {
  Trace trace = make_trace({{0}, {1}});
  trace.moments[1].host_chunk_ids = {1};
  SchedulerOptions options;
  options.capacity_bytes = 1000;
  Scheduler scheduler(options, equal_chunks(2, 100));
  EXPECT_THAT(error_of([&] { scheduler.set_trace(trace); }),
              HasSubstr("both accesses chunk 1 and sends it to the host"));
}

TEST(Scheduler, ErrorsNameTheMomentAndTheBytes) {
  const auto chunks = equal_chunks(3, 100);
  SchedulerOptions options;
  options.capacity_bytes = 1000;
  {
    Scheduler scheduler(options, chunks);
    Trace trace = make_trace({{0}, {1}}, {100, 1200});
    trace.moments[1].label = "block7";
    const std::string message = error_of([&] { scheduler.set_trace(trace); });
    EXPECT_THAT(message, HasSubstr("block7"));
    EXPECT_THAT(message, HasSubstr("1200"));
    EXPECT_THAT(message, HasSubstr("activation checkpointing"));
    EXPECT_FALSE(scheduler.has_trace());  // nothing half-applied
  }
  {
    Scheduler scheduler(options, chunks);
    const std::string message = error_of([&] {
      scheduler.set_trace(make_trace({{0, 1, 2}}, {800}));
    });
    EXPECT_THAT(message, HasSubstr("300 bytes"));
    EXPECT_THAT(message, HasSubstr("budget is 200"));
  }
  {
    Scheduler scheduler(options, chunks);
    EXPECT_THAT(error_of([&] { scheduler.set_trace(make_trace({{9}})); }),
                HasSubstr("chunk 9 is unknown"));
  }
  EXPECT_THROW(parse_eviction_policy("fifo"), c10::Error);
  EXPECT_EQ(parse_eviction_policy("static"), EvictionPolicy::kStatic);
}

// The GPT-like workload at a device that holds about half of the model: OPT with prefetch stays
// within 2% of the offline bound (the target), and LRU is worse.
TEST(Scheduler, GptLikeOptNearTheBound) {
  GptLikeOptions gpt;
  gpt.layers = 8;
  gpt.chunk_elems = 1 << 10;
  gpt.activation_bytes_per_layer = 4 << 10;
  gpt.step_non_model_bytes = 1 << 10;
  const SyntheticWorkload workload = make_gpt_like_workload(gpt);
  const int64_t capacity = workload.total_chunk_bytes / 2;
  const auto options = sim_options(capacity, EvictionPolicy::kOpt, 2);
  const TrafficBound bound = opt_traffic_bound(workload.trace, workload.chunks, options.scheduler);
  ASSERT_TRUE(bound.proven);
  ASSERT_GT(bound.h2d_bytes, 0);
  const auto opt = simulate(workload.trace, workload.chunks, options);
  const auto lru =
      simulate(workload.trace, workload.chunks, sim_options(capacity, EvictionPolicy::kLru, 2));
  const double bound_bytes = static_cast<double>(bound.h2d_bytes + bound.d2h_bytes);
  EXPECT_LE(opt.mean_h2d_bytes + opt.mean_d2h_bytes, 1.02 * bound_bytes);
  EXPECT_GT(lru.mean_h2d_bytes, opt.mean_h2d_bytes);
  // Prefetching after each moment's compute, every steady load is a prefetch, and each is used.
  EXPECT_GT(opt.steady.loads, 0);
  EXPECT_EQ(opt.steady.prefetches, opt.steady.loads);
  EXPECT_EQ(opt.steady.prefetches_used, opt.steady.prefetches);
  // Prefetching inside at_moment (no after-compute call) never beats demand paging here, but it
  // must stay correct: the budget holds and traffic is not below the bound.
  SimulationOptions at_moment_options = options;
  at_moment_options.scheduler.prefetch_after_compute = false;
  const auto inline_prefetch = simulate(workload.trace, workload.chunks, at_moment_options);
  EXPECT_GE(inline_prefetch.mean_h2d_bytes, static_cast<double>(bound.h2d_bytes));
  for (const MomentRecord& record : inline_prefetch.moments) {
    EXPECT_LE(record.chunk_bytes, record.budget_bytes);
  }
}

}  // namespace scheduler_test
}  // namespace patrickstar
