// Moment clock and warm-up trace: measured non-model bytes per moment, control-flow checks, and the
// same trace from one iteration of a real (small) model to the next.
#include <c10/core/CPUAllocator.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "error_message.h"
#include "patrickstar/memtracer/counting_allocator.h"
#include "patrickstar/memtracer/memory_probe.h"
#include "patrickstar/memtracer/trace.h"

namespace patrickstar {
namespace trace_test {

using ::testing::HasSubstr;

// A probe the test drives by hand: live bytes set by the test, the peak follows.
class ScriptedProbe final : public MemoryProbe {
 public:
  void set_live(int64_t bytes) {
    live_ = bytes;
    peak_ = std::max(peak_, bytes);
  }
  int64_t live_bytes() const override { return live_; }
  int64_t peak_bytes() const override { return peak_; }
  void reset_peak() override {
    peak_ = live_;
    ++resets_;
  }
  int resets_ = 0;

 private:
  int64_t live_ = 0;
  int64_t peak_ = 0;
};

using test::error_of;

// Two recorders over one counter (two engines in one process): each moment's bytes are the peak
// over its own interval, whatever the other recorder's ticks (issue 36: before, each tick reset the
// counter's one peak and cut the other's window short).
TEST(TraceRecorder, TwoRecordersOverOneCounterKeepTheirOwnPeakWindows) {
  CountingCpuAllocator counter(c10::GetDefaultCPUAllocator());
  CpuMemoryProbe probe_a(counter);
  CpuMemoryProbe probe_b(counter);
  TraceRecorder a(&probe_a);
  TraceRecorder b(&probe_b);
  a.begin_iteration();
  b.begin_iteration();
  a.tick(MomentKind::kPreForward, "a0");
  { c10::DataPtr t = counter.allocate(4000); }  // A's activations, freed
  b.tick(MomentKind::kPreForward, "b0");        // B's moment inside A's window
  { c10::DataPtr t = counter.allocate(300); }
  counter.reset_peak();  // the counter's own window: none of theirs
  a.tick(MomentKind::kPreForward, "a1");
  b.tick(MomentKind::kPreForward, "b1");
  a.end_iteration();
  b.end_iteration();
  ASSERT_TRUE(a.has_warmup_trace());
  ASSERT_TRUE(b.has_warmup_trace());
  EXPECT_EQ(a.warmup_trace().moments[1].non_model_bytes, 4000);
  EXPECT_EQ(b.warmup_trace().moments[0].non_model_bytes, 4000);
  EXPECT_EQ(b.warmup_trace().moments[1].non_model_bytes, 300);
}

TEST(TraceRecorder, NonModelBytesArePeaksBetweenMoments) {
  ScriptedProbe probe;
  TraceRecorder recorder(&probe);
  recorder.begin_iteration();
  probe.set_live(10);
  EXPECT_EQ(recorder.tick(MomentKind::kPreForward, "fc1"), 0);
  recorder.record_access(3);
  recorder.record_access(4);
  recorder.record_access(3);  // once per moment
  probe.set_live(500);        // activations of fc1 peak at 500 ...
  probe.set_live(200);        // ... and 200 stay
  EXPECT_EQ(recorder.tick(MomentKind::kPreForward, "fc2"), 1);
  recorder.record_access(5);
  probe.set_live(50);
  EXPECT_EQ(recorder.tick(MomentKind::kStep, "step"), 2);
  probe.set_live(70);
  recorder.end_iteration();
  ASSERT_TRUE(recorder.has_warmup_trace());
  const Trace& trace = recorder.warmup_trace();
  ASSERT_EQ(trace.size(), 3);
  EXPECT_EQ(trace.moments[0].non_model_bytes, 10);   // peak from begin_iteration to fc1
  EXPECT_EQ(trace.moments[1].non_model_bytes, 500);  // fc1's peak, not the 200 left
  EXPECT_EQ(trace.moments[2].non_model_bytes, 200);  // the window starts at the 200 still live
  EXPECT_EQ(trace.tail_non_model_bytes, 70);
  EXPECT_EQ(trace.moments[0].chunk_ids, (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(trace.moments[1].chunk_ids, (std::vector<int64_t>{5}));
  // After the last moment the next interval is the larger of the tail and the first moment.
  EXPECT_EQ(trace.next_non_model_bytes(1), 200);
  EXPECT_EQ(trace.next_non_model_bytes(2), 70);
}

TEST(TraceRecorder, ChangedControlFlowIsAnError) {
  TraceRecorder recorder(nullptr);
  recorder.begin_iteration();
  recorder.tick(MomentKind::kPreForward, "a");
  recorder.tick(MomentKind::kPreBackward, "a");
  recorder.end_iteration();

  recorder.begin_iteration();
  recorder.tick(MomentKind::kPreForward, "a");
  EXPECT_THAT(error_of([&] { recorder.tick(MomentKind::kPreForward, "b"); }),
              HasSubstr("control flow changed"));

  TraceRecorder short_run(nullptr);
  short_run.begin_iteration();
  short_run.tick(MomentKind::kPreForward, "a");
  short_run.tick(MomentKind::kStep, "step");
  short_run.end_iteration();
  short_run.begin_iteration();
  short_run.tick(MomentKind::kPreForward, "a");
  EXPECT_THAT(error_of([&] { short_run.end_iteration(); }), HasSubstr("had 2"));
  // rewarm() records a new trace.
  short_run.rewarm();
  short_run.begin_iteration();
  short_run.tick(MomentKind::kPreForward, "other");
  short_run.end_iteration();
  EXPECT_EQ(short_run.warmup_trace().size(), 1);
  EXPECT_EQ(short_run.warmup_trace().moments[0].label, "other");
}

TEST(TraceRecorder, MisuseIsAnError) {
  TraceRecorder recorder(nullptr);
  EXPECT_THROW(recorder.tick(MomentKind::kPreForward, "a"), c10::Error);
  recorder.begin_iteration();
  EXPECT_THROW(recorder.record_access(1), c10::Error);
  EXPECT_THAT(error_of([&] { recorder.end_iteration(); }), HasSubstr("no moment"));
}

// A real model on the CPU ("emulated device"), moments ticked as the engine will: the warm-up trace
// and the next iterations' traces match moment by moment, and the measured activations are real.
TEST(TraceRecorder, SameTraceFromOneIterationToTheNext) {
  CountingCpuAllocator& counter = CountingCpuAllocator::install();
  CpuMemoryProbe probe(counter);
  torch::manual_seed(0);
  constexpr int64_t kBatch = 64, kHidden = 128;
  torch::nn::Linear fc1(kHidden, kHidden), fc2(kHidden, kHidden), fc3(kHidden, 4);
  std::vector<torch::nn::Linear> layers = {fc1, fc2, fc3};
  torch::optim::SGD sgd({fc1->parameters()[0], fc1->parameters()[1], fc2->parameters()[0],
                         fc2->parameters()[1], fc3->parameters()[0], fc3->parameters()[1]},
                        0.01);
  const torch::Tensor input = torch::randn({kBatch, kHidden});
  const torch::Tensor target = torch::randn({kBatch, 4});

  TraceRecorder recorder(&probe);
  std::vector<Trace> traces;
  for (int iteration = 0; iteration < 3; ++iteration) {
    recorder.begin_iteration();
    torch::Tensor x = input;
    for (size_t l = 0; l < layers.size(); ++l) {
      recorder.tick(MomentKind::kPreForward, "fc" + std::to_string(l + 1));
      recorder.record_access(static_cast<int64_t>(l));
      x = layers[l]->forward(x);
      if (l + 1 < layers.size()) x = torch::relu(x);
    }
    torch::Tensor loss = torch::mse_loss(x, target);
    for (size_t l = layers.size(); l-- > 0;) {
      recorder.tick(MomentKind::kPreBackward, "fc" + std::to_string(l + 1));
      recorder.record_access(static_cast<int64_t>(l));
      if (l + 1 == layers.size()) loss.backward();  // one backward pass covers every layer
    }
    recorder.tick(MomentKind::kStep, "step");
    for (int64_t id = 0; id < 3; ++id) recorder.record_access(id);
    sgd.step();
    sgd.zero_grad();
    recorder.end_iteration();
    traces.push_back(recorder.current_trace());
  }
  ASSERT_EQ(traces[0].size(), 7);
  EXPECT_TRUE(traces[0].same_moments(recorder.warmup_trace()));
  for (int iteration = 1; iteration < 3; ++iteration) {
    EXPECT_TRUE(traces[iteration].same_moments(traces[0])) << "iteration " << iteration;
  }
  // fc1's output (kBatch x kHidden floats) and its relu were allocated before fc2's pre-forward.
  const int64_t activation_bytes = kBatch * kHidden * static_cast<int64_t>(sizeof(float));
  for (const Trace& trace : traces) {
    EXPECT_GE(trace.moments[1].non_model_bytes, 2 * activation_bytes);
    EXPECT_GE(trace.moments[2].non_model_bytes, 3 * activation_bytes);  // relu1 kept, fc2, relu2
  }
  // Steady iterations measure the same activations (iteration 0 may differ: first-use allocations).
  for (int64_t m = 0; m < traces[1].size(); ++m) {
    EXPECT_EQ(traces[1].moments[m].non_model_bytes, traces[2].moments[m].non_model_bytes)
        << "moment " << m;
  }
}

// The engine's tools for a changed order of moments: matches_next says what differs, rewarm()
// inside an iteration keeps the moments so far and makes the iteration the new trace, and
// rewind_to forgets the moments of a forward that never reached backward.
TEST(TraceRecorder, MatchesNextRewarmMidIterationAndRewind) {
  TraceRecorder recorder(nullptr);
  recorder.begin_iteration();
  recorder.tick(MomentKind::kPreForward, "a");
  recorder.tick(MomentKind::kPreBackward, "a");
  recorder.tick(MomentKind::kStep, "step");
  recorder.end_iteration();

  recorder.begin_iteration();
  std::string why;
  EXPECT_TRUE(recorder.matches_next(MomentKind::kPreForward, "a", &why));
  recorder.tick(MomentKind::kPreForward, "a");
  EXPECT_FALSE(recorder.matches_next(MomentKind::kPreForward, "b", &why));
  EXPECT_THAT(why, HasSubstr("expects pre_backward 'a' but got pre_forward 'b'"));
  // A forward that is abandoned: back to moment 0, and the trace is followed again from there.
  recorder.rewind_to(0);
  EXPECT_EQ(recorder.current_moment(), -1);
  EXPECT_TRUE(recorder.matches_next(MomentKind::kPreForward, "a", &why));
  recorder.tick(MomentKind::kPreForward, "a");
  recorder.rewarm();  // the control flow changed here
  EXPECT_TRUE(recorder.matches_next(MomentKind::kPreForward, "b", &why));
  recorder.tick(MomentKind::kPreForward, "b");
  recorder.tick(MomentKind::kStep, "step");
  recorder.end_iteration();
  ASSERT_TRUE(recorder.has_warmup_trace());
  ASSERT_EQ(recorder.warmup_trace().size(), 3);
  EXPECT_EQ(recorder.warmup_trace().moments[0].label, "a");
  EXPECT_EQ(recorder.warmup_trace().moments[1].label, "b");
  EXPECT_THAT(error_of([&] { recorder.rewind_to(0); }), HasSubstr("rewind_to"));
}

}  // namespace trace_test
}  // namespace patrickstar
