// The GPU cost model's timeline on traces small enough to work out by hand: a demand load is
// exposed, a prefetch hides behind compute, an eviction waits for the compute that reads its
// chunk and holds up the in-order queue, the host Adam waits for its gradients, and the repeated
// iteration's length is the step time; the host Adam overlapped with backward and delayed by an
// iteration.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "error_message.h"
#include "patrickstar/memtracer/cost_model.h"

namespace patrickstar {
namespace cost_model_test {

using ::testing::HasSubstr;

// Round figures: 1e12 FLOP/s at full efficiency, 1 GB/s each way, 1e9 B/s device memory, 1e9
// params/s on the host; so 1e9 FLOPs or 1e6 bytes last 1 ms.
GpuCostModel unit_model() {
  GpuCostModel m;
  m.name = "unit";
  m.peak_flops = 1e12;
  m.compute_efficiency = 1.0;
  m.h2d_bytes_per_s = 1e9;
  m.d2h_bytes_per_s = 1e9;
  m.device_memory_bytes_per_s = 1e9;
  m.host_adam_params_per_s = 1e9;
  return m;
}

Moment forward(std::vector<int64_t> chunks) {
  Moment m;
  m.kind = MomentKind::kPreForward;
  m.label = "layer";
  m.chunk_ids = std::move(chunks);
  return m;
}

MoveEvent move(int64_t moment, int64_t chunk, int64_t bytes, bool to_device) {
  MoveEvent e;
  e.moment = moment;
  e.chunk_id = chunk;
  e.bytes = bytes;
  e.to_device = to_device;
  return e;
}

const std::map<int64_t, ChunkInfo> kChunks = {{0, {1000000}}, {1, {1000000}}, {2, {1000000}}};
constexpr double kMs = 1e-3;

TEST(CostModel, CopiesStartWithTheirIterationAndComputeWaitsForThem) {
  Trace trace;
  trace.moments = {forward({0}), forward({1})};
  const std::vector<MomentCost> costs = {{1e9, 0, 0}, {1e9, 0, 0}};  // 1 ms each
  // Chunk 1 (1.5 ms of copy) is issued when the iteration starts, so moment 1 waits 0.5 ms for
  // it; it cannot start during the iteration before, which the host waited for.
  const std::map<int64_t, ChunkInfo> chunks = {{0, {1000000}}, {1, {1500000}}};
  Prediction p = predict_iteration(trace, costs, {move(1, 1, 1500000, true)}, chunks, unit_model());
  EXPECT_NEAR(p.step_seconds, 2.5 * kMs, 1e-12);
  EXPECT_NEAR(p.exposed_copy_seconds, 0.5 * kMs, 1e-12);
  EXPECT_NEAR(p.compute_seconds, 2 * kMs, 1e-12);
  EXPECT_NEAR(p.h2d_seconds, 1.5 * kMs, 1e-12);
  EXPECT_NEAR(p.tflops, 2e9 / (2.5 * kMs) / 1e12, 1e-9);
  EXPECT_GE(p.iterations_replayed, 2);
  // Nothing moved: compute alone.
  Prediction resident = predict_iteration(trace, costs, {}, chunks, unit_model());
  EXPECT_NEAR(resident.step_seconds, 2 * kMs, 1e-12);
  EXPECT_EQ(resident.exposed_copy_seconds, 0);
}

TEST(CostModel, TheQueueIsInOrderSoALoadIssuedFirstDelaysTheOnesBehindIt) {
  Trace trace;
  trace.moments = {forward({0}), forward({1})};
  const std::vector<MomentCost> costs = {{1e9, 0, 0}, {1e9, 0, 0}};
  // Chunk 0 first: moment 0 waits 1 ms, chunk 1 arrives while it computes.
  Prediction good = predict_iteration(
      trace, costs, {move(0, 0, 1000000, true), move(0, 1, 1000000, true)}, kChunks, unit_model());
  EXPECT_NEAR(good.step_seconds, 3 * kMs, 1e-12);
  EXPECT_NEAR(good.exposed_copy_seconds, 1 * kMs, 1e-12);
  // Chunk 1 first: moment 0 waits for both copies.
  Prediction bad = predict_iteration(
      trace, costs, {move(0, 1, 1000000, true), move(0, 0, 1000000, true)}, kChunks, unit_model());
  EXPECT_NEAR(bad.step_seconds, 4 * kMs, 1e-12);
  EXPECT_NEAR(bad.exposed_copy_seconds, 2 * kMs, 1e-12);
}

TEST(CostModel, AnEvictionWaitsForTheComputeReadingItsChunkAndHoldsUpTheQueue) {
  Trace trace;
  trace.moments = {forward({0}), forward({1}), forward({2})};
  const std::vector<MomentCost> costs = {{1e9, 0, 0}, {4e9, 0, 0}, {1e9, 0, 0}};  // 1, 4, 1 ms
  // Chunk 0 comes in at the iteration's start (moment 0 waits 1 ms for it); at moment 1 it goes
  // home once moment 0's compute is done (2 ms), and chunk 2's load runs behind it (3-4 ms),
  // hidden by moment 1's 4 ms: 1 + 1 + 4 + 1 = 7 ms.
  const std::vector<MoveEvent> moves = {move(0, 0, 1000000, true), move(1, 0, 1000000, false),
                                        move(1, 2, 1000000, true)};
  Prediction p = predict_iteration(trace, costs, moves, kChunks, unit_model());
  EXPECT_NEAR(p.exposed_copy_seconds, 1 * kMs, 1e-12);
  EXPECT_NEAR(p.step_seconds, 7 * kMs, 1e-12);
  EXPECT_NEAR(p.d2h_seconds, 1 * kMs, 1e-12);
  EXPECT_NEAR(p.h2d_seconds, 2 * kMs, 1e-12);

  // With a short moment 1 (1 ms), the eviction and the load behind it (2 ms of queue after
  // moment 0's compute) are longer than it: moment 2 waits 1 ms for chunk 2.
  const std::vector<MomentCost> short_costs = {{1e9, 0, 0}, {1e9, 0, 0}, {1e9, 0, 0}};
  Prediction q = predict_iteration(trace, short_costs, moves, kChunks, unit_model());
  EXPECT_NEAR(q.exposed_copy_seconds, 2 * kMs, 1e-12);  // 1 ms at moment 0, 1 ms at moment 2
  EXPECT_NEAR(q.step_seconds, 5 * kMs, 1e-12);
}

TEST(CostModel, TheHostAdamWaitsForItsGradientsAndTheReloadWaitsForTheHostAdam) {
  Trace trace;
  Moment step;
  step.kind = MomentKind::kStep;
  step.label = "step";
  step.host_chunk_ids = {0};
  trace.moments = {forward({0}), step};
  // Moment 0 computes 1 ms; the step's host Adam updates 2e6 params (2 ms) once chunk 0's
  // gradients are home (1 ms after moment 0); chunk 0 comes back at the next iteration's moment 0
  // only after the host Adam wrote it.
  const std::vector<MomentCost> costs = {{1e9, 0, 0}, {0, 0, 2e6}};
  const std::vector<MoveEvent> moves = {move(0, 0, 1000000, true), move(1, 0, 1000000, false)};
  Prediction p = predict_iteration(trace, costs, moves, kChunks, unit_model());
  EXPECT_NEAR(p.step_seconds, 5 * kMs, 1e-12);  // load 1 + compute 1 + d2h 1 + Adam 2
  EXPECT_NEAR(p.exposed_copy_seconds, 2 * kMs, 1e-12);
  EXPECT_NEAR(p.compute_seconds, 3 * kMs, 1e-12);
}

Moment backward(std::vector<int64_t> chunks) {
  Moment m = forward(std::move(chunks));
  m.kind = MomentKind::kPreBackward;
  return m;
}

Moment step_on_host(std::vector<int64_t> host_chunks) {
  Moment m;
  m.kind = MomentKind::kStep;
  m.label = "step";
  m.host_chunk_ids = std::move(host_chunks);
  return m;
}

HostUpdate update(double params, int64_t ready_after, std::vector<int64_t> chunks) {
  HostUpdate u;
  u.params = params;
  u.ready_after = ready_after;
  u.chunk_ids = std::move(chunks);
  return u;
}

TEST(CostModel, OverlappedUpdatesRunAsTheirGradientsBecomeFinalAndTheStepWaitsForTheLast) {
  Trace trace;
  trace.moments = {forward({0}), forward({1}), backward({1}), backward({0}), step_on_host({0, 1})};
  // Forward 1 + 1 ms, backward 2 + 2 ms; the host Adam 1 ms per chunk index (2 ms in all).
  const std::vector<MomentCost> costs = {
      {1e9, 0, 0}, {1e9, 0, 0}, {2e9, 0, 0}, {2e9, 0, 0}, {0, 0, 2e6}};
  const std::vector<HostUpdate> updates = {update(1e6, 2, {1}), update(1e6, 3, {0})};
  const Prediction serial = predict_iteration(trace, costs, {}, kChunks, unit_model());
  EXPECT_NEAR(serial.step_seconds, 8 * kMs, 1e-12);  // 6 ms of compute, then 2 ms of Adam
  EXPECT_NEAR(serial.host_adam_seconds, 2 * kMs, 1e-12);
  // kSerial ignores the updates: the same as the overload without them.
  EXPECT_NEAR(
      predict_iteration(trace, costs, {}, kChunks, unit_model(), StepSchedule::kSerial, updates)
          .step_seconds,
      serial.step_seconds, 1e-15);
  // Chunk 1's update runs during the last backward moment (4 to 5 ms); chunk 0's after it (6 to
  // 7 ms), and the step waits 1 ms for it.
  const Prediction overlapped = predict_iteration(trace, costs, {}, kChunks, unit_model(),
                                                  StepSchedule::kOverlapped, updates);
  EXPECT_NEAR(overlapped.step_seconds, 7 * kMs, 1e-12);
  EXPECT_NEAR(overlapped.adam_wait_seconds, 1 * kMs, 1e-12);
  EXPECT_NEAR(overlapped.host_adam_seconds, 2 * kMs, 1e-12);
  EXPECT_NEAR(overlapped.compute_seconds, 6 * kMs, 1e-12);  // the host Adam is not the GPU's
  // Delayed: both updates run during the next iteration, which does not wait for them.
  const Prediction delayed =
      predict_iteration(trace, costs, {}, kChunks, unit_model(), StepSchedule::kDelayed, updates);
  EXPECT_NEAR(delayed.step_seconds, 6 * kMs, 1e-12);
  EXPECT_EQ(delayed.adam_wait_seconds, 0);
}

TEST(CostModel, AnOverlappedUpdateSendsItsChunkHomeAfterItsLastBackwardMoment) {
  Trace trace;
  trace.moments = {forward({0}), backward({0}), forward({1}), step_on_host({0})};
  // Chunk 0's gradients are final after moment 1; its eviction (1 ms) and update (1 ms) then run
  // beside moment 2 (2 ms). Serial: the eviction runs beside moment 2 too (the host is ahead of the
  // GPU), but the update waits for the step moment.
  const std::vector<MomentCost> costs = {{1e9, 0, 0}, {1e9, 0, 0}, {2e9, 0, 0}, {0, 0, 1e6}};
  const std::vector<MoveEvent> moves = {move(0, 0, 1000000, true), move(3, 0, 1000000, false)};
  const Prediction serial = predict_iteration(trace, costs, moves, kChunks, unit_model());
  EXPECT_NEAR(serial.step_seconds, 6 * kMs, 1e-12);  // load 1, compute 4, Adam 1
  const Prediction overlapped = predict_iteration(trace, costs, moves, kChunks, unit_model(),
                                                  StepSchedule::kOverlapped, {update(1e6, 1, {0})});
  EXPECT_NEAR(overlapped.step_seconds, 5 * kMs, 1e-12);  // load 1, compute 4: the rest hidden
  EXPECT_NEAR(overlapped.adam_wait_seconds, 0, 1e-12);
}

TEST(CostModel, ADelayedUpdateLongerThanTheIterationSetsItsPace) {
  Trace trace;
  trace.moments = {forward({0}), backward({0}), step_on_host({0})};
  // 1 + 1 ms of compute, the host Adam 10 ms: the load of iteration k waits for iteration k - 2's
  // update, so the optimizer thread, busy throughout, sets the step time.
  const std::vector<MomentCost> costs = {{1e9, 0, 0}, {1e9, 0, 0}, {0, 0, 1e7}};
  const std::vector<MoveEvent> moves = {move(0, 0, 1000000, true), move(2, 0, 1000000, false)};
  const Prediction delayed = predict_iteration(trace, costs, moves, kChunks, unit_model(),
                                               StepSchedule::kDelayed, {update(1e7, 1, {0})});
  EXPECT_NEAR(delayed.step_seconds, 10 * kMs, 1e-12);
  const Prediction serial = predict_iteration(trace, costs, moves, kChunks, unit_model());
  EXPECT_NEAR(serial.step_seconds, 14 * kMs, 1e-12);  // load 1, compute 2, eviction 1, Adam 10
  // With no move to wait for, the next step does: it lands the update in flight before handing
  // over its own (one in flight).
  const Prediction resident = predict_iteration(trace, costs, {}, kChunks, unit_model(),
                                                StepSchedule::kDelayed, {update(1e7, 1, {0})});
  EXPECT_NEAR(resident.step_seconds, 10 * kMs, 1e-12);
  EXPECT_NEAR(resident.adam_wait_seconds, 8 * kMs, 1e-12);
}

TEST(CostModel, DeviceBytesCountAtTheMemoryBandwidthAndTheH100FiguresAreStated) {
  Trace trace;
  trace.moments = {forward({0})};
  Prediction p = predict_iteration(trace, {{0, 3e6, 0}}, {}, kChunks, unit_model());
  EXPECT_NEAR(p.step_seconds, 3 * kMs, 1e-12);
  EXPECT_EQ(p.exposed_copy_seconds, 0);
  const GpuCostModel h100 = gpu_cost_model("h100");
  EXPECT_GT(h100.peak_flops, 0);
  EXPECT_THAT(h100.sources, HasSubstr("assumption"));
  EXPECT_THAT(test::error_of([] { gpu_cost_model("b200"); }), HasSubstr("known: h100"));
}

TEST(CostModel, BadInputIsRefusedWithWhatIsWrong) {
  Trace trace;
  trace.moments = {forward({0})};
  EXPECT_THAT(test::error_of([&] { predict_iteration(trace, {}, {}, kChunks, unit_model()); }),
              HasSubstr("0 moment costs for a trace of 1 moments"));
  EXPECT_THAT(test::error_of([&] {
                predict_iteration(trace, {{1, 0, 0}}, {move(3, 0, 1, true)}, kChunks, unit_model());
              }),
              HasSubstr("at moment 3, outside the trace's 1 moments"));
  EXPECT_THAT(test::error_of([&] {
                predict_iteration(trace, {{1, 0, 0}}, {move(0, 9, 1, true)}, kChunks, unit_model());
              }),
              HasSubstr("chunk 9 is moved but not in the chunk table"));
  EXPECT_THAT(test::error_of([&] {
                predict_iteration(trace, {{1, 0, 0}}, {}, kChunks, unit_model(),
                                  StepSchedule::kOverlapped, {update(1, 4, {0})});
              }),
              HasSubstr("a host update ready after moment 4, outside the trace's 1 moments"));
  GpuCostModel broken = unit_model();
  broken.h2d_bytes_per_s = 0;
  EXPECT_THAT(test::error_of([&] { predict_iteration(trace, {{1, 0, 0}}, {}, kChunks, broken); }),
              HasSubstr("not positive"));
}

}  // namespace cost_model_test
}  // namespace patrickstar
