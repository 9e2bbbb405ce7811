// The activation plan's whole-model alternatives for the run plan (engine/src/activation_plan.h,
// ActivationPlanner::alternatives) on a hand-made warm-up of two named checkpoint calls: each
// alternative is the trace the engine runs, edited by the activation model (a recompute it adds
// comes from the warm-up, one it drops is gone, the non-model bytes move by the model's change),
// its compute is the measured one moved with it, and a running trace that is not the model's
// gets none.
#include <gtest/gtest.h>

#include <iterator>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "activation_plan.h"

namespace patrickstar::engine_detail {
namespace activation_alternatives_test {

constexpr int64_t kInput = 1000;             // each call's input
constexpr int64_t kKept[] = {3000, 4000};    // each call's activations when kept
constexpr double kForward[] = {1e-3, 2e-3};  // each call's forward

Moment moment(MomentKind kind, const std::string& label, int64_t chunk, int64_t bytes) {
  Moment m;
  m.kind = kind;
  m.label = label;
  m.chunk_ids = {chunk};
  m.non_model_bytes = bytes;
  return m;
}

// The warm-up (every call offloaded, as "auto" measures): 0 block0, 1 its inside (call 0's
// forward), 2 block1, 3 its inside (call 1's forward), 4 block1's backward, 5 its recompute,
// 6 block0's backward, 7 its recompute, 8 the step.
// (Every moment holds more non-model bytes than any edit takes away: none is clamped at 0.)
Trace warmup_trace() {
  Trace t;
  t.moments = {moment(MomentKind::kPreForward, "b0", 0, 10100),
               moment(MomentKind::kPreForward, "b0.in", 0, 10200),
               moment(MomentKind::kPreForward, "b1", 1, 10300),
               moment(MomentKind::kPreForward, "b1.in", 1, 10400),
               moment(MomentKind::kPreBackward, "b1", 1, 10500),
               moment(MomentKind::kPreForward, "b1.in", 1, 10600),
               moment(MomentKind::kPreBackward, "b0", 0, 10700),
               moment(MomentKind::kPreForward, "b0.in", 0, 10800),
               moment(MomentKind::kStep, "step", 0, 10050)};
  return t;
}

struct Planned {
  Planned() = default;
  explicit Planned(std::vector<std::string> calls)
      : planner(ActivationConfig{.policy = ActivationPolicy::kAuto, .calls = std::move(calls)}) {}
  ActivationPlanner planner{ActivationPolicy::kAuto};
  Trace warmup = warmup_trace();
  std::map<int64_t, ChunkInfo> chunks = {{0, ChunkInfo{10000}}, {1, ChunkInfo{10000}}};
  Scheduler scheduler{SchedulerOptions{.capacity_bytes = 1 << 30}, chunks};
};

// The copies: 1000 B at 100 kB/s take 10 ms, 8 ms longer than call 1's forward.
constexpr double kBandwidth = 1e5;

// "auto" measured and planned on the warm-up, then set to `choices` (the plan the engine runs;
// empty: its own); `call0_option`: call 0's own {.offload = ...}.
void plan(Planned& p, const std::vector<uint8_t>& choices,
          std::optional<bool> call0_option = std::nullopt) {
  ActivationPlanner& a = p.planner;
  for (int64_t call = 0; call < 2; ++call) {
    a.plan(/*named=*/true, call == 0 ? call0_option : std::nullopt, /*moment=*/2 * call);
    a.forward_done(call, kInput, kForward[call], 2 * call + 1);
  }
  for (int64_t call = 1; call >= 0; --call) {
    const int64_t begin = call == 1 ? 4 : 6;
    a.recompute_begins(call, begin, 10000);
    a.recompute_done(call, kForward[call], begin + 1, 10000 + kKept[call]);
  }
  ASSERT_TRUE(a.wants_plan());
  ActivationPlanner::PlanInputs in;
  in.trace = &p.warmup;
  in.chunks = p.chunks;
  in.scheduler = &p.scheduler;
  in.copy_bytes_per_s = kBandwidth;
  in.copies_overlap = true;
  in.warmup_seconds = 0.02;
  a.make_plan(in);
  if (!choices.empty()) a.set_choices(choices);
}

constexpr auto kKeep = static_cast<uint8_t>(ActivationChoice::kKeep);
constexpr auto kRecompute = static_cast<uint8_t>(ActivationChoice::kRecompute);

// The trace recorded under "call 0 kept, call 1 recomputed": the warm-up without call 0's
// recompute (moment 7).
Trace running_trace() {
  Trace t = warmup_trace();
  t.moments.erase(t.moments.begin() + 7);
  return t;
}

const ActivationPlanner::Alternative* find(const std::vector<ActivationPlanner::Alternative>& all,
                                           ActivationChoice every) {
  for (const ActivationPlanner::Alternative& a : all) {
    if (a.every == every) return &a;
  }
  return nullptr;
}

TEST(ActivationAlternatives, EachIsTheRunningTraceEditedByTheModel) {
  Planned p;
  plan(p, {kKeep, kRecompute});
  const Trace running = running_trace();
  std::string why;
  const std::vector<ActivationPlanner::Alternative> all = p.planner.alternatives(running, &why);
  ASSERT_EQ(all.size(), 3u) << why;
  EXPECT_EQ(p.planner.unmeasured_exposed_seconds(), 0) << "no offload runs";

  // Every call recomputed: call 0's recompute comes back (the warm-up's moment, its forward's
  // time); its activations no longer stay from its forward to its backward (moments 1 to 6).
  const ActivationPlanner::Alternative* recompute = find(all, ActivationChoice::kRecompute);
  ASSERT_NE(recompute, nullptr);
  EXPECT_EQ(recompute->moment_of, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, -1, 7}));
  ASSERT_EQ(recompute->trace.size(), 9);
  EXPECT_EQ(recompute->trace.moments[7].label, "b0.in");
  EXPECT_EQ(recompute->trace.moments[7].chunk_ids, std::vector<int64_t>{0});
  EXPECT_DOUBLE_EQ(recompute->recompute_seconds[7], kForward[0]);
  EXPECT_EQ(recompute->trace.moments[0].non_model_bytes, running.moments[0].non_model_bytes);
  for (int m = 1; m <= 6; ++m) {
    EXPECT_EQ(recompute->trace.moments[m].non_model_bytes,
              running.moments[m].non_model_bytes - kKept[0])
        << "moment " << m;
  }
  EXPECT_EQ(recompute->trace.moments[8].non_model_bytes, running.moments[7].non_model_bytes);
  EXPECT_EQ(recompute->exposed_delta, 0);
  EXPECT_EQ(recompute->recompute_saved, 0);

  // Every call kept: call 1's recompute (moment 5) is gone, its forward no longer recomputed.
  const ActivationPlanner::Alternative* keep = find(all, ActivationChoice::kKeep);
  ASSERT_NE(keep, nullptr);
  EXPECT_EQ(keep->moment_of, (std::vector<int64_t>{0, 1, 2, 3, 4, 6, 7}));
  EXPECT_DOUBLE_EQ(keep->recompute_saved, kForward[1]);
  for (int k : {3, 4}) {  // call 1's activations from its forward to its backward
    EXPECT_EQ(keep->trace.moments[k].non_model_bytes, running.moments[k].non_model_bytes + kKept[1])
        << "moment " << k;
  }

  // Offloaded: call 0's input leaves after call 1's forward and comes back at call 1's recompute;
  // its two copies are 8 ms longer each than call 1's forward, which hides them.
  const ActivationPlanner::Alternative* offload = find(all, ActivationChoice::kOffload);
  ASSERT_NE(offload, nullptr);
  EXPECT_EQ(offload->trace.moments[3].non_model_bytes,
            running.moments[3].non_model_bytes - kKept[0]);
  EXPECT_EQ(offload->trace.moments[4].non_model_bytes,
            running.moments[4].non_model_bytes - kKept[0] - kInput);
  EXPECT_NEAR(offload->exposed_delta, 2 * (kInput / kBandwidth - kForward[1]), 1e-12);
}

TEST(ActivationAlternatives, ACallsOwnOptionRunsInEveryAlternative) {
  Planned p;
  // Call 0 offloads by its own option: "every call recomputed" runs as the plan does.
  plan(p, {kRecompute, kRecompute}, /*call0_option=*/true);
  std::string why;
  const std::vector<ActivationPlanner::Alternative> all =
      p.planner.alternatives(warmup_trace(), &why);
  ASSERT_EQ(all.size(), 2u) << why;
  EXPECT_EQ(find(all, ActivationChoice::kRecompute), nullptr);
  // Every call kept: call 1 is, call 0 still offloads its input, which then stays away until
  // call 0's own recompute (moment 6, the alternative's 5) rather than call 1's.
  const ActivationPlanner::Alternative* keep = find(all, ActivationChoice::kKeep);
  ASSERT_NE(keep, nullptr);
  EXPECT_EQ(keep->moment_of, (std::vector<int64_t>{0, 1, 2, 3, 4, 6, 7, 8}));
  const Trace running = warmup_trace();
  EXPECT_EQ(keep->trace.moments[3].non_model_bytes, running.moments[3].non_model_bytes + kKept[1]);
  EXPECT_EQ(keep->trace.moments[4].non_model_bytes, running.moments[4].non_model_bytes + kKept[1]);
  EXPECT_EQ(keep->trace.moments[5].non_model_bytes, running.moments[6].non_model_bytes - kInput);
  // Its input's copies are not hidden behind call 1's forward, and the measured compute leaves
  // their waits out (a copy queue): the running choices' 16 ms go back into the prediction.
  EXPECT_NEAR(p.planner.unmeasured_exposed_seconds(), 2 * (kInput / kBandwidth - kForward[1]),
              1e-12);
  EXPECT_NEAR(keep->exposed_delta, 2 * (kInput / kBandwidth - kForward[1]), 1e-12);
  // "Every call recomputed" runs as the plan does: nothing changes; "every call kept" keeps call 1.
  EXPECT_FALSE(p.planner.run_alternative(ActivationChoice::kRecompute));
  EXPECT_TRUE(p.planner.runs_own_plan());
  EXPECT_TRUE(p.planner.run_alternative(ActivationChoice::kKeep));
  p.planner.restart();
  EXPECT_EQ(p.planner.plan(true, true, 0).choice, ActivationChoice::kOffload);
  EXPECT_EQ(p.planner.plan(true, std::nullopt, 2).choice, ActivationChoice::kKeep);
}

TEST(ActivationAlternatives, TheirComputeIsTheMeasuredOneMovedWithTheirMoments) {
  Planned p;
  plan(p, {kKeep, kRecompute});
  const Trace running = running_trace();
  const std::vector<ActivationPlanner::Alternative> all = p.planner.alternatives(running, nullptr);
  const std::vector<double> measured = {1e-3, 2e-3, 3e-3, 4e-3, 5e-3, 6e-3, 7e-3, 0.5e-3};
  // Recomputed: call 0's recompute adds its forward.
  const std::vector<double> recompute =
      alternative_compute(*find(all, ActivationChoice::kRecompute), measured);
  EXPECT_EQ(recompute,
            (std::vector<double>{1e-3, 2e-3, 3e-3, 4e-3, 5e-3, 6e-3, 7e-3, kForward[0], 0.5e-3}));
  // Kept: call 1's recompute moment (6 ms measured) goes; what it measured beyond the recompute
  // (6 - 2 ms: the block's backward) stays on the moment before.
  const std::vector<double> keep =
      alternative_compute(*find(all, ActivationChoice::kKeep), measured);
  ASSERT_EQ(keep.size(), 7u);
  EXPECT_NEAR(keep[4], 5e-3 + 6e-3 - kForward[1], 1e-12);
  EXPECT_EQ(keep[5], 7e-3);
  double total = 0;
  for (double s : keep) total += s;
  double measured_total = 0;
  for (double s : measured) measured_total += s;
  EXPECT_NEAR(total, measured_total - kForward[1], 1e-12);
}

TEST(ActivationAlternatives, NoneWhereTheRunningTraceIsNotTheModelsOrTheChoiceIsTheUsers) {
  Planned p;
  plan(p, {kKeep, kRecompute});
  // The running trace with call 0's recompute: not what "call 0 kept" records.
  std::string why;
  EXPECT_TRUE(p.planner.alternatives(warmup_trace(), &why).empty());
  EXPECT_NE(why.find("is not the activation plan's"), std::string::npos) << why;
  // The plan's own choice is not an alternative of itself.
  Planned kept;
  plan(kept, {kKeep, kKeep});
  Trace all_kept = warmup_trace();
  all_kept.moments.erase(all_kept.moments.begin() + 7);
  all_kept.moments.erase(all_kept.moments.begin() + 5);
  const std::vector<ActivationPlanner::Alternative> others =
      kept.planner.alternatives(all_kept, &why);
  ASSERT_EQ(others.size(), 2u) << why;
  EXPECT_EQ(find(others, ActivationChoice::kKeep), nullptr);
  // A fixed policy offers none.
  ActivationPlanner fixed(ActivationPolicy::kRecompute);
  EXPECT_TRUE(fixed.alternatives(running_trace(), &why).empty());
}

TEST(ActivationAlternatives, RunningOneAndBackChangesTheCallsWays) {
  Planned p;
  plan(p, {kKeep, kRecompute});
  EXPECT_TRUE(p.planner.run_alternative(ActivationChoice::kOffload));
  EXPECT_FALSE(p.planner.runs_own_plan());
  EXPECT_EQ(p.planner.report().run_plan_instead, "every call: offload");
  p.planner.restart();
  EXPECT_EQ(p.planner.plan(true, std::nullopt, 0).choice, ActivationChoice::kOffload);
  EXPECT_EQ(p.planner.plan(true, std::nullopt, 2).choice, ActivationChoice::kOffload);
  EXPECT_FALSE(p.planner.run_alternative(ActivationChoice::kOffload)) << "no change";
  EXPECT_TRUE(p.planner.run_alternative(std::nullopt));
  EXPECT_TRUE(p.planner.runs_own_plan());
  EXPECT_EQ(p.planner.report().run_plan_instead, "");
  p.planner.restart();
  EXPECT_EQ(p.planner.plan(true, std::nullopt, 0).choice, ActivationChoice::kKeep);
  EXPECT_EQ(p.planner.plan(true, std::nullopt, 2).choice, ActivationChoice::kRecompute);
}

constexpr auto kOffload = static_cast<uint8_t>(ActivationChoice::kOffload);
constexpr ActivationChoice kWays[] = {ActivationChoice::kKeep, ActivationChoice::kRecompute,
                                      ActivationChoice::kOffload};

TEST(ActivationAlternatives, AMixOfWaysIsEachCallsOwnEdit) {
  Planned p;
  plan(p, {kKeep, kRecompute});
  const Trace running = running_trace();
  std::string why;
  // Call 0 recomputed, call 1 kept: call 0's recompute comes back (the warm-up's moment 7, between
  // the running trace's 6 and 7), call 1's (5) is gone.
  const std::optional<ActivationPlanner::Alternative> mix =
      p.planner.alternative(running, {ActivationChoice::kRecompute, ActivationChoice::kKeep}, &why);
  ASSERT_TRUE(mix.has_value()) << why;
  EXPECT_FALSE(mix->every.has_value());
  EXPECT_EQ(mix->choices,
            (std::vector<ActivationChoice>{ActivationChoice::kRecompute, ActivationChoice::kKeep}));
  EXPECT_EQ(mix->moment_of, (std::vector<int64_t>{0, 1, 2, 3, 4, 6, -1, 7}));
  EXPECT_DOUBLE_EQ(mix->recompute_seconds[6], kForward[0]);
  EXPECT_DOUBLE_EQ(mix->recompute_saved, kForward[1]);
  // Call 0's activations leave moments 1 to 6; call 1's stay over moments 3 and 4.
  const std::vector<int64_t> change = {
      0, -kKept[0], -kKept[0], kKept[1] - kKept[0], kKept[1] - kKept[0], -kKept[0], 0, 0};
  ASSERT_EQ(mix->trace.size(), 8);
  for (size_t k = 0; k < change.size(); ++k) {
    const int64_t m = mix->moment_of[k];
    const int64_t before =
        m >= 0 ? running.moments[m].non_model_bytes : warmup_trace().moments[7].non_model_bytes;
    EXPECT_EQ(mix->trace.moments[k].non_model_bytes, before + change[k]) << "moment " << k;
  }
  EXPECT_EQ(mix->peak_delta, kKept[1] - kKept[0]);
  // A whole-model way asked for as a mix is alternatives()'s own edit.
  const std::vector<ActivationPlanner::Alternative> all = p.planner.alternatives(running, nullptr);
  const std::optional<ActivationPlanner::Alternative> every = p.planner.alternative(
      running, {ActivationChoice::kOffload, ActivationChoice::kOffload}, nullptr);
  ASSERT_TRUE(every.has_value());
  const ActivationPlanner::Alternative* offload = find(all, ActivationChoice::kOffload);
  ASSERT_NE(offload, nullptr);
  EXPECT_EQ(every->moment_of, offload->moment_of);
  for (int64_t k = 0; k < every->trace.size(); ++k) {
    EXPECT_EQ(every->trace.moments[k].non_model_bytes, offload->trace.moments[k].non_model_bytes);
  }
  EXPECT_DOUBLE_EQ(every->exposed_delta, offload->exposed_delta);
  // The ways the calls run now are no alternative, nor a list of another length.
  EXPECT_FALSE(p.planner.alternative(
      running, {ActivationChoice::kKeep, ActivationChoice::kRecompute}, &why));
  EXPECT_EQ(why, "the calls run these ways now");
  EXPECT_FALSE(p.planner.alternative(running, {ActivationChoice::kKeep}, &why));
  EXPECT_EQ(why, "1 ways for 2 checkpoint calls");
}

TEST(ActivationAlternatives, RunningAMixNamesItsWaysAndACallsOwnOptionStays) {
  Planned p;
  plan(p, {kRecompute, kRecompute}, /*call0_option=*/true);
  // Call 0 offloads by its own option: its one way.
  const std::vector<std::vector<ActivationChoice>> ways = p.planner.call_ways();
  ASSERT_EQ(ways.size(), 2u);
  EXPECT_EQ(ways[0], std::vector<ActivationChoice>{ActivationChoice::kOffload});
  EXPECT_EQ(ways[1].size(), 3u);
  EXPECT_TRUE(p.planner.run_choices({ActivationChoice::kKeep, ActivationChoice::kKeep}));
  EXPECT_EQ(p.planner.report().run_plan_instead, "per call: offload, keep");
  EXPECT_EQ(p.planner.running_choices(),
            (std::vector<ActivationChoice>{ActivationChoice::kOffload, ActivationChoice::kKeep}));
  p.planner.restart();
  EXPECT_EQ(p.planner.plan(true, true, 0).choice, ActivationChoice::kOffload);
  EXPECT_EQ(p.planner.plan(true, std::nullopt, 2).choice, ActivationChoice::kKeep);
  EXPECT_FALSE(p.planner.run_choices({ActivationChoice::kKeep})) << "another length";
  // Back to the plan's own ways: no other runs.
  EXPECT_TRUE(p.planner.run_choices({ActivationChoice::kOffload, ActivationChoice::kRecompute}));
  EXPECT_EQ(p.planner.report().run_plan_instead, "");
  EXPECT_TRUE(p.planner.runs_own_plan());
}

TEST(ActivationAlternatives, PinnedCallsAreThePlanAndAnotherNumberOfThemIsChosenAgain) {
  Planned pinned({"offload", "keep"});
  plan(pinned, {});
  EXPECT_EQ(pinned.planner.choices(), (std::vector<uint8_t>{kOffload, kKeep}));
  const ActivationPlanReport report = pinned.planner.report();
  ASSERT_FALSE(report.candidates.empty());
  EXPECT_EQ(report.candidates.front().name, "pinned (calls)");
  EXPECT_TRUE(report.candidates.front().fits);
  for (const ActivationCandidate& c : report.candidates) {
    EXPECT_EQ(c.name.find("every call"), std::string::npos) << "searched: " << c.name;
  }
  // Three ways for two calls: the plan searches, as without them.
  Planned three({"keep", "keep", "keep"});
  plan(three, {});
  bool searched = false;
  for (const ActivationCandidate& c : three.planner.report().candidates) {
    EXPECT_NE(c.name, "pinned (calls)");
    searched = searched || c.name.find("every call") != std::string::npos;
  }
  EXPECT_TRUE(searched);
  // The same search unpinned chooses the same.
  Planned free;
  plan(free, {});
  EXPECT_EQ(three.planner.choices(), free.planner.choices());
}

// A made-up step per call and way (the sum over calls), where no two calls may keep. From every
// call recomputed, the search keeps the first call whose keeping shortens the step, and offloads
// call 2: a step no one change shortens (keeping call 1 instead of call 0 would save 0.5 more,
// which takes two changes at once: the search does not look that far).
TEST(SearchWays, ChangesOneCallAtATimeWhileTheStepGetsShorter) {
  const double cost[3][3] = {{1.0, 3.0, 2.5},  // keep, recompute, offload
                             {0.5, 3.0, 3.5},
                             {1.5, 2.0, 1.0}};
  int asked = 0;
  auto step = [&](const std::vector<ActivationChoice>& c) {
    ++asked;
    double s = 0;
    int kept = 0;
    for (size_t i = 0; i < c.size(); ++i) {
      s += cost[i][static_cast<int>(c[i])];
      kept += c[i] == ActivationChoice::kKeep ? 1 : 0;
    }
    return kept > 1 ? std::numeric_limits<double>::infinity() : s;
  };
  const std::vector<std::vector<ActivationChoice>> every(3, {std::begin(kWays), std::end(kWays)});
  const WaysFound found =
      search_ways(std::vector<ActivationChoice>(3, ActivationChoice::kRecompute), every, step);
  EXPECT_EQ(found.best,
            (std::vector<ActivationChoice>{ActivationChoice::kKeep, ActivationChoice::kRecompute,
                                           ActivationChoice::kOffload}));
  EXPECT_DOUBLE_EQ(found.seconds, 5.0);
  // The start; then call 0's three ways (keep taken at once), two for each other call; a second
  // pass of two per call that changes nothing.
  EXPECT_EQ(found.weighed, asked);
  EXPECT_EQ(found.weighed, 1 + 7 + 6);
  for (size_t i = 0; i < 3; ++i) {
    for (ActivationChoice way : kWays) {
      std::vector<ActivationChoice> one = found.best;
      one[i] = way;
      EXPECT_GE(step(one), found.seconds) << "call " << i;
    }
  }
  // A call's one way is never changed; a start that does not fit is not searched.
  const std::vector<std::vector<ActivationChoice>> forced = {
      {ActivationChoice::kRecompute}, every[1], every[2]};
  EXPECT_EQ(
      search_ways(std::vector<ActivationChoice>(3, ActivationChoice::kRecompute), forced, step)
          .best,
      (std::vector<ActivationChoice>{ActivationChoice::kRecompute, ActivationChoice::kKeep,
                                     ActivationChoice::kOffload}));
  asked = 0;
  const WaysFound none =
      search_ways(std::vector<ActivationChoice>(3, ActivationChoice::kKeep), every, step);
  EXPECT_EQ(none.weighed, 1);
  EXPECT_EQ(asked, 1);
}

}  // namespace activation_alternatives_test
}  // namespace patrickstar::engine_detail
