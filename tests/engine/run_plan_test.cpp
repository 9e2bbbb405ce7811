// The plan's choice on hand-made traces ("plan": "auto"; engine/src/run_plan.h): every candidate
// predicted with the cost model, the fastest that fits chosen, a candidate that does not fit never
// chosen, the overlap worth nothing where compute takes every core, the delayed update a candidate
// only where allowed, the streamed placement where it places more, and the self-check that
// corrects the profile once.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "run_plan.h"
#include "step_pipeline.h"

namespace patrickstar::engine_detail {
namespace run_plan_test {

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int kIndices = 4;

// Four chunk indices (param chunk k, momentum 4 + 2k, variance 5 + 2k, 1 MiB each): a forward
// moment per index (1 ms), a backward moment per index in reverse (3 ms), and the step, where
// indices 0 and 1 update on the device (the margin's placement) and 2 and 3 on the host.
PlanInputs four_indices(int64_t capacity) {
  PlanInputs in;
  PlanLayout l;
  l.chunk_elems = kMiB / 4;
  for (int k = 0; k < kIndices; ++k) {
    Moment m;
    m.kind = MomentKind::kPreForward;
    m.label = "block" + std::to_string(k);
    m.chunk_ids = {k};
    m.non_model_bytes = kMiB / 4;
    l.trace.moments.push_back(m);
    in.compute_seconds.push_back(1e-3);
  }
  for (int k = kIndices - 1; k >= 0; --k) {
    Moment m;
    m.kind = MomentKind::kPreBackward;
    m.label = "block" + std::to_string(k);
    m.chunk_ids = {k};
    m.non_model_bytes = kMiB / 4;
    l.trace.moments.push_back(m);
    in.compute_seconds.push_back(3e-3);
  }
  Moment step;
  step.kind = MomentKind::kStep;
  step.label = "step";
  for (int k = 0; k < kIndices; ++k) {
    PlanIndex x;
    x.params = static_cast<double>(kMiB / 4);
    x.device_side = {k, 4 + 2 * k, 5 + 2 * k};
    x.host_side = x.device_side;
    x.device_adam_bytes = 3 * kMiB;
    x.undo_bytes = 3 * kMiB;
    x.own = {k};
    x.on_device = k < 2;
    auto& ids = x.on_device ? step.chunk_ids : step.host_chunk_ids;
    ids.insert(ids.end(), x.device_side.begin(), x.device_side.end());
    l.indices.push_back(x);
  }
  l.trace.moments.push_back(step);
  in.compute_seconds.push_back(0.5e-3);
  for (int64_t id = 0; id < 3 * kIndices; ++id) l.chunks[id] = ChunkInfo{kMiB};
  find_ready_moments(l);
  for (int k = 0; k < kIndices; ++k) {
    EXPECT_EQ(l.indices[static_cast<size_t>(k)].ready_after, kIndices + (kIndices - 1 - k))
        << "index " << k << ": its backward moment";
  }
  in.layouts.push_back(l);
  in.scheduler.capacity_bytes = capacity;
  in.scheduler.overall_ratio = 1.0;
  in.scheduler.warmup_ratio = 0.9;
  in.overlap_possible = true;
  return in;
}

PlanProfile profile(double beside) {
  PlanProfile p;
  p.name = "test";
  p.h2d_bytes_per_s = p.d2h_bytes_per_s = 10e9;
  p.host_adam_params_per_s = p.device_adam_params_per_s = 1e8;  // 2.6 ms per index
  p.beside_compute = beside;
  return p;
}

const PlanCandidateReport* find(const PlanEvaluation& e, const std::string& schedule,
                                const std::string& adam) {
  for (const PlanCandidateReport& c : e.candidates) {
    if (c.schedule == schedule && c.adam == adam) return &c;
  }
  return nullptr;
}

TEST(RunPlan, EveryCandidateIsPredictedAndTheFastestThatFitsIsChosen) {
  const PlanEvaluation e = evaluate_plan(four_indices(64 * kMiB), profile(1));
  ASSERT_EQ(e.candidates.size(), 4u);
  double best = 1e9;
  for (const PlanCandidateReport& c : e.candidates) {
    ASSERT_TRUE(c.fits) << c.name << ": " << c.why_not;
    EXPECT_GT(c.predicted_step_seconds, 0) << c.name;
    best = std::min(best, c.predicted_step_seconds);
  }
  ASSERT_GE(e.chosen, 0);
  EXPECT_LE(e.candidates[e.chosen].predicted_step_seconds, best * 1.01);
  // Compute alone is 16.5 ms; the serial step adds four updates of 2.6 ms.
  const PlanCandidateReport* serial = find(e, "serial", "margin");
  ASSERT_NE(serial, nullptr);
  EXPECT_NEAR(serial->predicted_step_seconds, 16.5e-3 + 4 * 2.62144e-3, 0.5e-3);
  EXPECT_EQ(serial->adam_device_indices, 2);
  // The overlapped step hides the host's updates behind the last backward moments.
  const PlanCandidateReport* overlapped = find(e, "overlapped", "margin");
  ASSERT_NE(overlapped, nullptr);
  EXPECT_LT(overlapped->predicted_step_seconds, serial->predicted_step_seconds - 2e-3);
  EXPECT_EQ(e.candidates[e.chosen].schedule, "overlapped");
  // Every Adam on the host sends the margin's two indices home at the step and back.
  const PlanCandidateReport* host = find(e, "serial", "host");
  ASSERT_NE(host, nullptr);
  EXPECT_EQ(host->adam_device_indices, 0);
  EXPECT_GT(host->d2h_bytes, serial->d2h_bytes);
}

TEST(RunPlan, WhereComputeTakesEveryCoreTheOverlapGainsNothingAndSerialStays) {
  const PlanEvaluation e = evaluate_plan(four_indices(64 * kMiB), profile(0));
  const PlanCandidateReport* serial = find(e, "serial", "margin");
  const PlanCandidateReport* overlapped = find(e, "overlapped", "margin");
  ASSERT_NE(serial, nullptr);
  ASSERT_NE(overlapped, nullptr);
  EXPECT_GE(overlapped->predicted_step_seconds, serial->predicted_step_seconds);
  ASSERT_GE(e.chosen, 0);
  EXPECT_EQ(e.candidates[e.chosen].schedule, "serial") << e.why;
}

TEST(RunPlan, ACandidateThatDoesNotFitIsNeverChosen) {
  // 4 MiB: a forward or backward moment needs one chunk, the margin's step six.
  const PlanEvaluation e = evaluate_plan(four_indices(4 * kMiB), profile(1));
  const PlanCandidateReport* margin = find(e, "serial", "margin");
  ASSERT_NE(margin, nullptr);
  EXPECT_FALSE(margin->fits);
  EXPECT_FALSE(margin->why_not.empty());
  ASSERT_GE(e.chosen, 0) << e.why;
  EXPECT_TRUE(e.candidates[e.chosen].fits);
  EXPECT_EQ(e.candidates[e.chosen].adam, "host");
  // Nothing fits a device smaller than a chunk and its moment's activations.
  const PlanEvaluation none = evaluate_plan(four_indices(kMiB), profile(1));
  EXPECT_EQ(none.chosen, -1);
  EXPECT_EQ(none.why, "no candidate fits the device");
}

// An activation alternative (run_plan.h, PlanLayout::activations): one more moment (a recompute of
// block 3 before its backward, 2 ms) and `extra` seconds of copies not hidden, but room for every
// index's Adam on the device (100x the host's rate here).
PlanInputs with_alternative(double extra) {
  PlanInputs in = four_indices(64 * kMiB);
  in.overlap_possible = false;
  PlanLayout alt = in.layouts[0];
  alt.activations = "recompute";
  Moment recompute = alt.trace.moments[3];
  recompute.label = "block3 recompute";
  alt.trace.moments.insert(alt.trace.moments.begin() + 4, recompute);
  alt.compute_seconds = in.compute_seconds;
  alt.compute_seconds.insert(alt.compute_seconds.begin() + 4, 2e-3);
  alt.extra_seconds = extra;
  for (PlanIndex& x : alt.indices) x.on_device = true;
  find_ready_moments(alt);
  in.layouts.push_back(alt);
  return in;
}

TEST(RunPlan, AnActivationAlternativeIsPredictedOnItsOwnTraceComputeAndCopiesAndPinnedByItsConfig) {
  PlanProfile fast_device = profile(1);
  fast_device.device_adam_params_per_s = 1e10;
  const PlanEvaluation e = evaluate_plan(with_alternative(1.5e-3), fast_device);
  // Serial and host for each: the engine's activations, then the alternative.
  ASSERT_EQ(e.candidates.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(e.candidates[i].activations, i < 2 ? "" : "recompute") << e.candidates[i].name;
  }
  const PlanCandidateReport& own = e.candidates[0];
  const PlanCandidateReport& alt = e.candidates[2];
  EXPECT_NE(alt.name.find(", activations recompute"), std::string::npos) << alt.name;
  EXPECT_EQ(own.adam_device_indices, 2);
  EXPECT_EQ(alt.adam_device_indices, 4);
  // 16.5 ms of compute, the recompute's 2 ms, 1.5 ms of copies and four device updates of 26 us;
  // the engine's own: two host updates of 2.6 ms.
  EXPECT_NEAR(alt.predicted_step_seconds, 16.5e-3 + 2e-3 + 1.5e-3 + 4 * 2.62e-5, 0.2e-3);
  EXPECT_NEAR(own.predicted_step_seconds, 16.5e-3 + 2 * 2.62144e-3 + 2 * 2.62e-5, 0.2e-3);
  ASSERT_EQ(e.chosen, 2) << e.why;
  PlanReport report;
  report.planned = true;
  report.candidates = e.candidates;
  report.chosen = e.chosen;
  // (A whole-model way is its policy word; no calls pinned.)
  const nlohmann::json pins = nlohmann::json::parse(report.config_json());
  EXPECT_EQ(pins.at("activation_checkpointing"),
            (nlohmann::json{{"policy", "recompute"}, {"calls", nlohmann::json::array()}}))
      << report.config_json();
  // Its copies weigh: with 4 ms of them the engine's own activations are faster, and their
  // config leaves the activation policy as it is.
  const PlanEvaluation slower = evaluate_plan(with_alternative(4e-3), fast_device);
  ASSERT_EQ(slower.chosen, 0) << slower.why;
  report.candidates = slower.candidates;
  report.chosen = slower.chosen;
  EXPECT_EQ(report.config_json().find("activation_checkpointing"), std::string::npos)
      << report.config_json();
  // Where "auto" planned the calls, a candidate carries each call's way and its config pins them;
  // a per-call mix is named by how many calls run each way.
  PlanInputs named = with_alternative(4e-3);
  named.layouts[0].activation_calls = {"keep", "offload", "keep"};
  named.layouts[1].activations = "per call";
  named.layouts[1].activation_calls = {"recompute", "offload", "recompute"};
  const PlanEvaluation calls = evaluate_plan(named, fast_device);
  report.candidates = calls.candidates;
  report.chosen = 0;
  EXPECT_EQ(calls.candidates[0].activation_calls, named.layouts[0].activation_calls);
  EXPECT_EQ(nlohmann::json::parse(report.config_json()).at("activation_checkpointing"),
            (nlohmann::json{{"policy", "auto"}, {"calls", {"keep", "offload", "keep"}}}));
  report.chosen = 2;
  EXPECT_NE(calls.candidates[2].name.find(", activations per call (2 recompute, 1 offload)"),
            std::string::npos)
      << calls.candidates[2].name;
  EXPECT_EQ(nlohmann::json::parse(report.config_json()).at("activation_checkpointing"),
            (nlohmann::json{{"policy", "auto"}, {"calls", {"recompute", "offload", "recompute"}}}));
  // Its compute is its own: measured moments of another trace are refused.
  PlanInputs mismatched = with_alternative(0);
  mismatched.layouts[1].compute_seconds.pop_back();
  EXPECT_THROW(evaluate_plan(mismatched, fast_device), c10::Error);
}

TEST(RunPlan, EveryChunkSizeIsACandidateAndTheEnginesOwnWinsATie) {
  PlanInputs in = four_indices(64 * kMiB);
  PlanLayout other = in.layouts[0];
  other.chunk_elems = kMiB / 8;  // the same trace: the same predictions
  in.layouts.push_back(other);
  const PlanEvaluation tie = evaluate_plan(in, profile(1));
  ASSERT_EQ(tie.candidates.size(), 8u);
  for (size_t i = 0; i < 8; ++i) {
    EXPECT_EQ(tie.candidates[i].chunk_elems, i < 4 ? kMiB / 4 : kMiB / 8);
    EXPECT_NEAR(tie.candidates[i].predicted_step_seconds,
                tie.candidates[i % 4].predicted_step_seconds, 1e-12);
  }
  ASSERT_GE(tie.chosen, 0);
  EXPECT_EQ(tie.candidates[tie.chosen].chunk_elems, kMiB / 4);
  // Where the margin's step does not fit, the chosen candidate's config pins its size.
  in.scheduler.capacity_bytes = 4 * kMiB + kMiB / 2;
  const PlanEvaluation e = evaluate_plan(in, profile(1));
  ASSERT_GE(e.chosen, 0) << e.why;
  PlanReport report;
  report.planned = true;
  report.candidates = e.candidates;
  report.chosen = e.chosen;
  const std::string pinned = report.config_json();
  EXPECT_NE(pinned.find("\"default_chunk_size\": " +
                        std::to_string(e.candidates[e.chosen].chunk_elems)),
            std::string::npos)
      << pinned;
}

TEST(RunPlan, TheDelayedUpdateIsACandidateOnlyWhereAllowedAndHidesTheHostAdamWithAFreeCore) {
  PlanInputs in = four_indices(64 * kMiB);
  const PlanEvaluation exact = evaluate_plan(in, profile(1));
  for (const PlanCandidateReport& c : exact.candidates) EXPECT_NE(c.schedule, "delayed") << c.name;
  in.delayed_possible = true;
  in.delayed_bytes_per_param = 12;  // fp32
  const PlanEvaluation e = evaluate_plan(in, profile(1));
  ASSERT_EQ(e.candidates.size(), 5u);
  const PlanCandidateReport* delayed = find(e, "delayed", "host");
  ASSERT_NE(delayed, nullptr);
  ASSERT_TRUE(delayed->fits) << delayed->why_not;
  EXPECT_EQ(delayed->adam_device_indices, 0);
  EXPECT_EQ(&e.candidates.back(), delayed);  // last in the order of preference
  // Compute is 16.5 ms, the four host updates 10.5 ms on the thread during the next iteration; the
  // step moment copies 12 bytes per parameter (1.26 ms at 10 GB/s), and every param chunk goes
  // home for the step and comes back (1 MiB, 0.1 ms a copy: at most all eight exposed).
  const double copies = 4 * (kMiB / 4) * 12.0 / 10e9;
  EXPECT_EQ(delayed->h2d_bytes, 4 * kMiB);
  EXPECT_EQ(delayed->d2h_bytes, 4 * kMiB);
  EXPECT_GT(delayed->predicted_step_seconds, 16.5e-3 + copies - 1e-9);
  EXPECT_LT(delayed->predicted_step_seconds, 16.5e-3 + copies + 8 * 0.105e-3);
  EXPECT_NEAR(delayed->host_adam_seconds, 4 * 2.62144e-3, 1e-6);
  const PlanCandidateReport* overlapped = find(e, "overlapped", "margin");
  ASSERT_NE(overlapped, nullptr);
  EXPECT_LT(delayed->predicted_step_seconds, overlapped->predicted_step_seconds * 0.99);
  ASSERT_GE(e.chosen, 0);
  EXPECT_EQ(e.candidates[e.chosen].schedule, "delayed") << e.why;
  PlanReport report;
  report.planned = true;
  report.candidates = e.candidates;
  report.chosen = e.chosen;
  EXPECT_NE(report.config_json().find("\"delayed_param_update\": true"), std::string::npos)
      << report.config_json();
  // Where compute takes every core the thread's work adds to the step: the serial step stays.
  const PlanEvaluation busy = evaluate_plan(in, profile(0));
  const PlanCandidateReport* busy_delayed = find(busy, "delayed", "host");
  ASSERT_NE(busy_delayed, nullptr);
  EXPECT_GT(busy_delayed->predicted_step_seconds, 16.5e-3 + copies + 4 * 2.6e-3);
  ASSERT_GE(busy.chosen, 0);
  EXPECT_EQ(busy.candidates[busy.chosen].schedule, "serial") << busy.why;
  // An update slower than the iteration sets the pace: the next step waits for it.
  PlanProfile slow = profile(1);
  slow.host_adam_params_per_s = slow.device_adam_params_per_s = 2e7;  // 52 ms in all
  const PlanEvaluation slow_plan = evaluate_plan(in, slow);
  const PlanCandidateReport* paced = find(slow_plan, "delayed", "host");
  ASSERT_NE(paced, nullptr);
  EXPECT_GT(paced->predicted_step_seconds, 4 * (kMiB / 4) / 2e7);
  // Not where an index's states live on the device for good (its Adam runs there in every plan).
  in.layouts[0].indices[0].device_only = true;
  const PlanEvaluation pinned = evaluate_plan(in, profile(1));
  for (const PlanCandidateReport& c : pinned.candidates) EXPECT_NE(c.schedule, "delayed") << c.name;
}

TEST(RunPlan, TheStreamedPlacementIsACandidateWhereItPlacesMoreAndWinsWhereTheHostAdamIsSlow) {
  PlanInputs in = four_indices(64 * kMiB);
  in.streamed_possible = true;
  for (PlanIndex& x : in.layouts[0].indices) x.streamed = x.on_device;
  EXPECT_EQ(find(evaluate_plan(in, profile(1)), "serial", "streamed"), nullptr)
      << "the same placement as the margin's";
  // The step's room holds every index's device side.
  for (PlanIndex& x : in.layouts[0].indices) x.streamed = true;
  in.streamed_possible = false;
  EXPECT_EQ(find(evaluate_plan(in, profile(1)), "serial", "streamed"), nullptr)
      << "not possible (a disk tier, no hybrid Adam)";
  in.streamed_possible = true;
  const PlanEvaluation same = evaluate_plan(in, profile(1));
  ASSERT_EQ(same.candidates.size(), 5u);
  const PlanCandidateReport* streamed = find(same, "serial", "streamed");
  const PlanCandidateReport* margin = find(same, "serial", "margin");
  ASSERT_NE(streamed, nullptr);
  ASSERT_NE(margin, nullptr);
  EXPECT_EQ(find(same, "overlapped", "streamed"), nullptr) << "no host Adam for the thread";
  ASSERT_TRUE(streamed->fits) << streamed->why_not;
  EXPECT_EQ(streamed->adam_device_indices, 4);
  EXPECT_EQ(streamed->host_adam_seconds, 0);
  // The device holds everything: the margin's host indices 2 and 3 send their param chunks home
  // for the step and fetch them back; streamed, nothing moves.
  EXPECT_EQ(margin->d2h_bytes, 2 * kMiB);
  EXPECT_EQ(streamed->d2h_bytes, 0);
  EXPECT_EQ(streamed->h2d_bytes, 0);
  // The same Adam on either side (the emulated device): the same step less the host copies, and
  // the overlapped step, which hides the host's share behind backward, is chosen.
  EXPECT_LT(streamed->predicted_step_seconds, margin->predicted_step_seconds);
  ASSERT_GE(same.chosen, 0);
  EXPECT_EQ(same.candidates[same.chosen].schedule, "overlapped") << same.why;
  // A device Adam a hundred times the host's (a GPU): the streamed placement, pinned by its keys.
  PlanProfile gpu = profile(1);
  gpu.device_adam_params_per_s = 1e10;
  const PlanEvaluation fast = evaluate_plan(in, gpu);
  ASSERT_GE(fast.chosen, 0);
  EXPECT_EQ(fast.candidates[fast.chosen].adam, "streamed") << fast.why;
  PlanReport report;
  report.planned = true;
  report.candidates = fast.candidates;
  report.chosen = fast.chosen;
  const Config pinned = Config::from_string(report.config_json());
  EXPECT_TRUE(pinned.optimizer.use_hybrid_adam);
  EXPECT_TRUE(pinned.optimizer.stream_states);
  report.chosen = 0;  // the margin's
  EXPECT_FALSE(Config::from_string(report.config_json()).optimizer.stream_states);
  // A device with room for the margin's step (six chunks) but not for twelve: the streamed
  // candidate does not fit and is never chosen.
  in.scheduler.capacity_bytes = 8 * kMiB;
  const PlanEvaluation tight = evaluate_plan(in, gpu);
  const PlanCandidateReport* refused = find(tight, "serial", "streamed");
  ASSERT_NE(refused, nullptr);
  EXPECT_FALSE(refused->fits);
  ASSERT_GE(tight.chosen, 0);
  EXPECT_NE(tight.candidates[tight.chosen].adam, "streamed");
  // Room for one more index at the step (nine chunks of twelve): its states come in for the step
  // and leave for the next forward's chunks, and the last index's Adam stays on the host.
  in.scheduler.capacity_bytes = 10 * kMiB;
  for (int k = 0; k < kIndices; ++k) in.layouts[0].indices[static_cast<size_t>(k)].streamed = k < 3;
  const PlanEvaluation one_more = evaluate_plan(in, gpu);
  const PlanCandidateReport* partial = find(one_more, "serial", "streamed");
  ASSERT_NE(partial, nullptr);
  ASSERT_TRUE(partial->fits) << partial->why_not;
  EXPECT_EQ(partial->adam_device_indices, 3);
  EXPECT_NEAR(partial->host_adam_seconds, 2.62144e-3, 1e-6);
  EXPECT_GT(partial->h2d_bytes, 0);
  EXPECT_NE(find(one_more, "overlapped", "streamed"), nullptr) << "index 3 on the host";
}

TEST(RunPlan, AnIndexTheStepDoesNotUpdateStaysOutOfEveryCandidatesStep) {
  // Index 3 got no gradient in the measured iteration: the step moment shows neither of its sides.
  PlanInputs in = four_indices(64 * kMiB);
  in.streamed_possible = true;
  Moment& step = in.layouts[0].trace.moments.back();
  std::erase_if(step.host_chunk_ids, [](int64_t c) { return c == 3 || c == 10 || c == 11; });
  for (PlanIndex& x : in.layouts[0].indices) x.streamed = true;
  PlanInputs all = four_indices(64 * kMiB);
  all.streamed_possible = true;
  for (PlanIndex& x : all.layouts[0].indices) x.streamed = true;
  const PlanEvaluation with = evaluate_plan(all, profile(1));
  const PlanEvaluation without = evaluate_plan(in, profile(1));
  // The margin's trace is the one measured: its param chunk stays where it is (no d2h for it).
  const PlanCandidateReport* margin = find(without, "serial", "margin");
  ASSERT_NE(margin, nullptr);
  EXPECT_EQ(margin->d2h_bytes, find(with, "serial", "margin")->d2h_bytes - kMiB);
  // Every Adam on the host sends indices 0 to 2 home, not 3; streamed, nothing moves, and index
  // 3's momentum and variance never come to the device.
  EXPECT_EQ(find(without, "serial", "host")->d2h_bytes, 3 * kMiB);
  const PlanCandidateReport* streamed = find(without, "serial", "streamed");
  ASSERT_NE(streamed, nullptr);
  EXPECT_EQ(streamed->d2h_bytes, 0);
  EXPECT_EQ(streamed->device_peak_bytes,
            find(with, "serial", "streamed")->device_peak_bytes - 2 * kMiB);
}

TEST(RunPlan, TheStreamedPlacementFillsTheStepsRoomFirstFitAfterWhatIsThere) {
  // Sides of 3, 3, 3 and 2 (a cut last chunk); index 0 on the device already (3): a budget of 8
  // leaves 5, which takes index 1 (3) and then only the last (2).
  const std::vector<bool> placed =
      streamed_placement({3, 3, 3, 2}, {true, false, false, false}, {true, true, true, true}, 8);
  EXPECT_EQ(placed, (std::vector<bool>{true, true, false, true}));
  // What may not stream (device-only indices, frozen ones) never does, and what is there counts
  // even when over the budget.
  EXPECT_EQ(
      streamed_placement({3, 3, 3, 2}, {false, false, false, false}, {false, true, false, true}, 4),
      (std::vector<bool>{false, true, false, false}));
  EXPECT_EQ(streamed_placement({5, 3}, {true, false}, {true, true}, 4),
            (std::vector<bool>{true, false}));
  EXPECT_THROW(streamed_placement({1}, {true, false}, {true, true}, 4), c10::Error);
}

TEST(RunPlan, WithoutAnOptimizerThreadOrAMarginTheCandidatesShrink) {
  PlanInputs in = four_indices(64 * kMiB);
  in.overlap_possible = false;
  EXPECT_EQ(evaluate_plan(in, profile(1)).candidates.size(), 2u);
  in.host_placement_possible = false;
  const PlanEvaluation one = evaluate_plan(in, profile(1));
  ASSERT_EQ(one.candidates.size(), 1u);
  EXPECT_EQ(one.chosen, 0);
  in.compute_seconds.pop_back();
  EXPECT_THROW(evaluate_plan(in, profile(1)), c10::Error);
}

TEST(RunPlanner, TheMeasuredComputeIsEachMomentLessItsCopyWaitsAndTheStepsAdam) {
  PlanConfig config;
  config.mode = PlanMode::kAuto;
  RunPlanner planner(config);
  planner.begin_measuring();
  planner.note_moment(0, {10.5, 0.0, 0});
  planner.note_moment(1, {11.0, 0.1, 0});
  planner.note_moment(1, {11.5, 0.1, 0});  // a forward rewound: moment 1 again
  planner.note_moment(2, {12.0, 0.2, 0});
  const std::vector<double> c = planner.end_measuring(3, 2, {13.0, 0.2, 1000}, 0.25, 0, false);
  ASSERT_EQ(c.size(), 3u);
  EXPECT_NEAR(c[0], 1.0 - 0.1, 1e-9);
  EXPECT_NEAR(c[1], 0.5 - 0.1, 1e-9);
  EXPECT_NEAR(c[2], 1.0 - 0.25, 1e-9);
  EXPECT_FALSE(planner.measuring());
  // Synchronous moves: their bytes at the copy rate are not compute either.
  planner.begin_measuring();
  planner.note_moment(0, {0.0, 0.0, 0});
  EXPECT_NEAR(planner.end_measuring(1, -1, {1.0, 0.0, 500}, 0, 1000, true)[0], 0.5, 1e-9);
  // A moment skipped, or fewer moments than the trace: nothing measured.
  planner.begin_measuring();
  planner.note_moment(1, {0.0, 0.0, 0});
  EXPECT_TRUE(planner.end_measuring(2, -1, {1.0, 0.0, 0}, 0, 0, false).empty());
}

TEST(RunPlanner, AStepWithinTheToleranceKeepsThePlan) {
  PlanConfig config;
  config.mode = PlanMode::kAuto;
  config.check_iterations = 3;
  RunPlanner planner(config);
  const PlanCandidateReport chosen = *planner.plan(four_indices(64 * kMiB), profile(1));
  EXPECT_TRUE(planner.planned());
  EXPECT_FALSE(planner.end_iteration(true, chosen.predicted_step_seconds * 1.1));
  EXPECT_FALSE(planner.end_iteration(false, 1.0)) << "not counted";
  EXPECT_FALSE(planner.end_iteration(true, chosen.predicted_step_seconds * 1.2));
  EXPECT_FALSE(planner.report().checked);
  EXPECT_FALSE(planner.end_iteration(true, chosen.predicted_step_seconds * 1.15));
  EXPECT_TRUE(planner.report().checked);
  EXPECT_NEAR(planner.report().measured_step_seconds, chosen.predicted_step_seconds * 1.15, 1e-12);
  EXPECT_NE(planner.report().check.find("the plan stands"), std::string::npos)
      << planner.report().check;
  EXPECT_FALSE(planner.end_iteration(true, 100.0)) << "checked once";
  EXPECT_NE(planner.report().text().find("check: "), std::string::npos);
}

TEST(RunPlanner, AStepPastTheToleranceCorrectsTheProfileAndPlansOnceMore) {
  PlanConfig config;
  config.mode = PlanMode::kAuto;
  config.check_iterations = 2;
  RunPlanner planner(config);
  const PlanCandidateReport first = *planner.plan(four_indices(64 * kMiB), profile(1));
  ASSERT_EQ(first.schedule, "overlapped");
  // The overlap hid nothing here (compute took the cores): the step is the serial one's.
  const double serial = planner.report().candidates[0].predicted_step_seconds;
  ASSERT_GT(serial, first.predicted_step_seconds * 1.25);
  EXPECT_FALSE(planner.end_iteration(true, serial));
  EXPECT_TRUE(planner.end_iteration(true, serial));
  EXPECT_NE(planner.report().check.find("planned again"), std::string::npos)
      << planner.report().check;
  EXPECT_LT(planner.profile().beside_compute, 1.0);
  const PlanCandidateReport second = *planner.plan(planner.inputs(), planner.profile());
  EXPECT_TRUE(planner.report().replanned);
  // The corrected profile predicts what the first choice measured, and the plan takes the fastest
  // under it: another candidate.
  for (const PlanCandidateReport& c : planner.report().candidates) {
    if (c.name == first.name) {
      EXPECT_NEAR(c.predicted_step_seconds, serial, serial * 1e-6);
    }
  }
  EXPECT_NE(second.name, first.name) << planner.report().text();
  EXPECT_LT(second.predicted_step_seconds, serial);
  // Once only: a second check past the tolerance keeps the plan.
  EXPECT_FALSE(planner.end_iteration(true, 3 * serial));
  EXPECT_FALSE(planner.end_iteration(true, 3 * serial));
  EXPECT_NE(planner.report().check.find("the plan stays"), std::string::npos)
      << planner.report().check;
  EXPECT_FALSE(planner.end_iteration(true, 3 * serial));
}

TEST(RunPlanner, TheCheckOfAnActivationAlternativeCorrectsItsOwnCompute) {
  PlanConfig config;
  config.mode = PlanMode::kAuto;
  config.check_iterations = 2;
  RunPlanner planner(config);
  PlanProfile fast_device = profile(1);
  fast_device.device_adam_params_per_s = 1e10;
  const PlanCandidateReport first = *planner.plan(with_alternative(1.5e-3), fast_device);
  ASSERT_EQ(first.activations, "recompute");
  // It measures 40% shorter: the compute it was predicted with (its recompute's 2 ms included)
  // scales, so that the corrected profile predicts what it measured.
  const double measured = 0.6 * first.predicted_step_seconds;
  EXPECT_FALSE(planner.end_iteration(true, measured));
  ASSERT_TRUE(planner.end_iteration(true, measured));
  planner.plan(planner.inputs(), planner.profile());
  for (const PlanCandidateReport& c : planner.report().candidates) {
    if (c.name == first.name) {
      EXPECT_NEAR(c.predicted_step_seconds, measured, measured * 1e-6);
    }
  }
}

TEST(RunPlanner, PlansNothingWhereNoCandidateFits) {
  PlanConfig config;
  config.mode = PlanMode::kAuto;
  RunPlanner planner(config);
  EXPECT_EQ(planner.plan(four_indices(kMiB), profile(1)), nullptr);
  EXPECT_TRUE(planner.planned());
  EXPECT_EQ(planner.report().chosen, -1);
  EXPECT_NE(planner.report().text().find("no plan: no candidate fits the device"),
            std::string::npos)
      << planner.report().text();
  EXPECT_FALSE(planner.end_iteration(true, 1.0));
  EXPECT_THROW(named_plan_profile("a100"), c10::Error);
  EXPECT_GT(named_plan_profile("h200").h2d_bytes_per_s, 0);
}

}  // namespace run_plan_test
}  // namespace patrickstar::engine_detail
