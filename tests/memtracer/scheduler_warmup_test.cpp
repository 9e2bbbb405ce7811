// The scheduler's warm-up (the first iteration, and a retrace's): its budget from the warm-up
// ratio and the live reading, the static policy's, the trace check and drop_trace, its errors, the
// chunks it keeps, and chunks that never leave the device.
#include <set>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "error_message.h"
#include "scheduler_test_util.h"

namespace patrickstar {
namespace scheduler_warmup_test {

using ::testing::HasSubstr;
using test::error_of;
using namespace scheduler_testing;  // NOLINT: the scheduler tests' shared helpers

// During the warm-up the budget is the warm-up ratio's, capped by the live non-model reading.
TEST(Scheduler, WarmupBudgetFollowsTheRatioAndTheLiveReading) {
  SchedulerOptions options;
  options.capacity_bytes = 1000;
  options.warmup_ratio = 0.5;
  options.reserve_bytes = 50;
  Scheduler scheduler(options, equal_chunks(3, 100));
  PinnedMover mover;
  scheduler.begin_iteration();
  scheduler.at_moment(0, MomentKind::kPreForward, {1}, mover, 100);  // ratio: 500 - 50
  scheduler.at_moment(1, MomentKind::kPreForward, {1}, mover, 700);  // live: 1000 - 700 - 50
  EXPECT_EQ(scheduler.current_stats().budget_bytes, (std::vector<int64_t>{450, 250}));
  EXPECT_THAT(error_of([&] {
                scheduler.at_moment(2, MomentKind::kPreForward, {1, 2}, mover, 850);
              }),
              HasSubstr("chunk budget is 100"));
}

// "auto" chunk size (SchedulerOptions::warmup_overdraft): a warm-up moment whose chunks need more
// than its budget goes on where the device itself has room (its capacity less the live reading and
// the reserve) and is counted; past that room it is refused as before. Without the option, the
// same moment is refused. replace_chunks then starts a warm-up over a new chunk table and keeps
// the history.
TEST(Scheduler, WarmupOverdraftGoesOnWithinTheDeviceAndIsCounted) {
  SchedulerOptions options;
  options.capacity_bytes = 1000;
  options.overall_ratio = 0.8;
  options.reserve_bytes = 50;
  const auto moment = [](Scheduler& scheduler, PinnedMover& mover, int64_t live) {
    scheduler.begin_iteration();
    scheduler.at_moment(0, MomentKind::kPreBackward, {1, 2}, mover, live);
  };
  {
    Scheduler refusing(options, equal_chunks(3, 200));
    PinnedMover mover;
    // 400 bytes of chunks, budget 800 - 400 - 50 = 350.
    EXPECT_THAT(error_of([&] { moment(refusing, mover, 400); }), HasSubstr("chunk budget is 350"));
  }
  options.warmup_overdraft = true;
  Scheduler scheduler(options, equal_chunks(3, 200));
  PinnedMover mover;
  moment(scheduler, mover, 400);  // room: 1000 - 400 - 50 = 550
  EXPECT_EQ(scheduler.current_stats().overdrafts, 1);
  EXPECT_EQ(scheduler.current_stats().budget_bytes, (std::vector<int64_t>{550}));
  EXPECT_EQ(mover.resident, (std::set<int64_t>{1, 2}));
  scheduler.end_iteration();
  // Past the device's own room: refused.
  EXPECT_THAT(error_of([&] { moment(scheduler, mover, 600); }), HasSubstr("chunk budget is"));
  scheduler.abort_iteration();
  // A new table: nothing resident, no trace, a warm-up again; the finished iteration is kept.
  scheduler.replace_chunks(equal_chunks(6, 100));
  EXPECT_FALSE(scheduler.has_trace());
  EXPECT_EQ(scheduler.history().size(), 1u);
  EXPECT_EQ(scheduler.history().back().overdrafts, 1);
  PinnedMover fresh;
  moment(scheduler, fresh, 400);
  EXPECT_EQ(scheduler.current_stats().overdrafts, 0);
  EXPECT_EQ(fresh.resident, (std::set<int64_t>{1, 2}));
}

// kStatic keeps every chunk it loads, so during the warm-up it takes the whole device next to the
// live non-model bytes rather than the warm-up ratio's share.
TEST(Scheduler, StaticWarmupBudgetIsTheWholeDevice) {
  SchedulerOptions options;
  options.capacity_bytes = 1000;
  options.warmup_ratio = 0.1;
  options.reserve_bytes = 50;
  options.policy = EvictionPolicy::kStatic;
  Scheduler scheduler(options, equal_chunks(3, 100));
  PinnedMover mover;
  scheduler.begin_iteration();
  scheduler.at_moment(0, MomentKind::kPreForward, {1}, mover, 100);  // 1000 - 100 - 50
  scheduler.at_moment(1, MomentKind::kPreForward, {2}, mover, 600);  // 1000 - 600 - 50
  EXPECT_EQ(scheduler.current_stats().budget_bytes, (std::vector<int64_t>{850, 350}));
  EXPECT_EQ(mover.resident, (std::set<int64_t>{1, 2}));
}

// check_trace is set_trace's validation alone; drop_trace turns the rest of an iteration into a
// warm-up (the warm-up budget, no trace moments required), and set_trace installs the new trace.
TEST(Scheduler, CheckTraceChangesNothingAndDropTraceSchedulesAsAWarmup) {
  SchedulerOptions options;
  options.capacity_bytes = 1000;
  options.warmup_ratio = 0.2;
  Scheduler scheduler(options, equal_chunks(3, 100));
  const Trace fits = make_trace({{0}, {1}, {2}}, {100, 100, 100});
  const Trace too_big = make_trace({{0}, {1}, {2}}, {100, 2000, 100});
  EXPECT_THAT(error_of([&] { scheduler.check_trace(too_big); }), HasSubstr("non-model data"));
  EXPECT_FALSE(scheduler.has_trace());
  EXPECT_NO_THROW(scheduler.check_trace(fits));
  EXPECT_FALSE(scheduler.has_trace()) << "check_trace installed the trace";
  PinnedMover mover;
  scheduler.begin_iteration();
  scheduler.set_trace(fits, &mover);
  scheduler.end_iteration();
  scheduler.begin_iteration();
  scheduler.at_moment(0, MomentKind::kPreForward, {0}, mover);
  EXPECT_EQ(scheduler.current_stats().budget_bytes.back(), 900);  // the trace's budget
  scheduler.drop_trace();
  EXPECT_FALSE(scheduler.has_trace());
  EXPECT_TRUE(scheduler.current_stats().warmup);
  // Moment 7 is outside the old trace: fine now, with the warm-up budget (0.2 x 1000).
  scheduler.at_moment(7, MomentKind::kPreForward, {1}, mover, 0);
  EXPECT_EQ(scheduler.current_stats().budget_bytes.back(), 200);
  scheduler.set_trace(make_trace({{0}, {1}}), &mover);
  scheduler.end_iteration();
  EXPECT_TRUE(scheduler.has_trace());
  EXPECT_EQ(scheduler.trace().size(), 2);
}

// A warm-up moment that cannot make room says which warm-up ratio would.
TEST(Scheduler, WarmupErrorNamesTheRatioThatFits) {
  SchedulerOptions options;
  options.capacity_bytes = 1000;
  options.warmup_ratio = 0.1;
  Scheduler scheduler(options, equal_chunks(3, 100));
  PinnedMover mover;  // chunk 0 stays in COMPUTE
  scheduler.begin_iteration();
  scheduler.at_moment(0, MomentKind::kPreForward, {0}, mover, 0);
  // 700 bytes of activations: no room for more than the moment's own chunks (200 bytes), but
  // chunk 0 cannot leave.
  const std::string error =
      error_of([&] { scheduler.at_moment(1, MomentKind::kPreForward, {1, 2}, mover, 700); });
  // Chunks 0 (pinned), 1 and 2 need 300 of 1000 bytes: a ratio of 0.3.
  EXPECT_THAT(error, HasSubstr("set client.mem_tracer.warmup_gpu_chunk_mem_ratio to 0.3 or more"));
}

// A block whose parameters straddle two chunks makes neighbouring warm-up moments alternate between
// them, and a chunk of small shared parameters comes back in between. The warm-up budget keeps the
// three chunks used most recently next to the moment's own, so with a ratio that gives one chunk
// the three stay on the device: each is loaded once.
TEST(Scheduler, WarmupKeepsTheChunksUsedLast) {
  SchedulerOptions options;
  options.capacity_bytes = 1000;
  options.warmup_ratio = 0.1;  // one chunk of 100 bytes
  Scheduler scheduler(options, equal_chunks(6, 100));
  PinnedMover mover;
  scheduler.begin_iteration();
  const std::vector<std::vector<int64_t>> moments = {{1}, {2}, {1}, {1}, {3}, {2}, {1}, {3}};
  for (size_t m = 0; m < moments.size(); ++m) {
    scheduler.at_moment(static_cast<int64_t>(m), MomentKind::kPreForward, moments[m], mover, 0);
  }
  EXPECT_EQ(scheduler.current_stats().loads, 3);  // 1, 2, 3 once each
  EXPECT_EQ(scheduler.current_stats().evictions, 0);
  EXPECT_EQ(scheduler.current_stats().budget_bytes,
            (std::vector<int64_t>{100, 200, 200, 200, 300, 300, 300, 300}));
  // 4 joins them (three others are kept); 5 takes the place of the one used longest ago, 2.
  scheduler.at_moment(8, MomentKind::kPreForward, {4}, mover, 0);
  scheduler.at_moment(9, MomentKind::kPreForward, {5}, mover, 0);
  EXPECT_EQ(scheduler.current_stats().budget_bytes.back(), 400);
  EXPECT_EQ(scheduler.current_stats().evictions, 1);
  EXPECT_EQ(mover.resident, (std::set<int64_t>{1, 3, 4, 5}));
}

// The chunks kept from before give way to the live non-model bytes, with room set aside for the
// largest rise of the reading from one moment to the next so far; the moment's own chunks do not.
TEST(Scheduler, WarmupWindowLeavesRoomForTheNonModelGrowth) {
  SchedulerOptions options;
  options.capacity_bytes = 1000;
  options.warmup_ratio = 0.1;
  Scheduler scheduler(options, equal_chunks(4, 100));
  PinnedMover mover;
  scheduler.begin_iteration();
  scheduler.at_moment(0, MomentKind::kPreForward, {1}, mover, 0);
  scheduler.at_moment(1, MomentKind::kPreForward, {2}, mover, 100);  // rise 100: 900 - 100 left
  scheduler.at_moment(2, MomentKind::kPreForward, {3}, mover, 600);  // rise 500: 400 - 500 left
  EXPECT_EQ(scheduler.current_stats().budget_bytes, (std::vector<int64_t>{100, 200, 100}));
  EXPECT_EQ(mover.resident, (std::set<int64_t>{3}));
  // The rise stays the largest seen: with 100 bytes of non-model data, 900 - 500 is left, enough
  // for the window (2, 3 and 1).
  scheduler.at_moment(3, MomentKind::kPreForward, {2}, mover, 100);
  scheduler.at_moment(4, MomentKind::kPreForward, {1}, mover, 100);
  EXPECT_EQ(scheduler.current_stats().budget_bytes.back(), 300);
  EXPECT_EQ(mover.resident, (std::set<int64_t>{1, 2, 3}));
}

// Chunks that never leave the device (optimizer states placed there at registration because the
// host could not hold them): never evicted, whatever the policy's choice, and their bytes count
// against every moment's budget, in the warm-up too.
class SetMover final : public ChunkMover {
 public:
  bool on_device(int64_t id) override { return resident.count(id) != 0; }
  bool movable(int64_t) override { return true; }
  void to_device(int64_t id) override { resident.insert(id); }
  void to_host(int64_t id) override { resident.erase(id); }
  std::set<int64_t> resident;
};

TEST(Scheduler, DeviceOnlyChunksNeverLeaveAndShrinkTheBudget) {
  std::map<int64_t, ChunkInfo> chunks = equal_chunks(4, 100);
  chunks[3].device_only = true;  // never accessed: Belady and LRU would evict it first
  for (EvictionPolicy policy : {EvictionPolicy::kOpt, EvictionPolicy::kLru}) {
    SCOPED_TRACE(eviction_policy_name(policy));
    SchedulerOptions options;
    options.capacity_bytes = 300;
    options.warmup_ratio = 0.1;  // a 30-byte share: the floor must make room for chunk 3 as well
    options.policy = policy;
    Scheduler scheduler(options, chunks);
    scheduler.set_record_timeline(true);  // the moves are read below
    SetMover mover;
    mover.resident.insert(3);
    const Trace trace = make_trace({{0}, {1}, {2}});
    for (int iteration = 0; iteration < 3; ++iteration) {
      scheduler.begin_iteration();
      for (int64_t m = 0; m < 3; ++m) {
        scheduler.at_moment(m, MomentKind::kPreForward, trace.moments[m].chunk_ids, mover);
        scheduler.after_moment(m, mover);
        EXPECT_EQ(mover.resident.count(3), 1u) << "iteration " << iteration << " moment " << m;
        EXPECT_LE(mover.resident.size(), 3u);
      }
      if (iteration == 0) scheduler.set_trace(trace, &mover);
      scheduler.end_iteration();
    }
    EXPECT_GT(scheduler.history().back().evictions, 0) << "0, 1 and 2 share two slots";
    for (const MoveEvent& move : scheduler.moves()) EXPECT_NE(move.chunk_id, 3);
  }
  // A moment whose chunks fit the device only without the device-only chunk: the trace is refused.
  SchedulerOptions options;
  options.capacity_bytes = 250;
  Scheduler scheduler(options, chunks);
  const std::string error = error_of([&] { scheduler.check_trace(make_trace({{0, 1}})); });
  EXPECT_THAT(error, HasSubstr("100 bytes of chunks that never leave the device"));
}

}  // namespace scheduler_warmup_test
}  // namespace patrickstar
