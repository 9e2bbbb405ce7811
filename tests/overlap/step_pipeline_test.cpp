// The step pipeline (engine/src/step_pipeline.h) on its own, over a small chunk store, in fp32
// with the overlapped step on: a StateAccess taken while the optimizer thread updates ahead sees
// the committed weights and states, and the step commits the updates made ahead bit for bit the
// serial step. Built and run under ThreadSanitizer too (scripts/test): the training thread takes
// the access, and reads chunks, while the optimizer thread works. The comparisons read the chunks
// in this file's code (memcmp, loops), which ThreadSanitizer instruments; LibTorch's kernels it
// does not.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "patrickstar/chunk/chunk_store.h"
#include "patrickstar/chunk/memory_tier.h"
#include "patrickstar/memtracer/scheduler.h"
#include "step_pipeline.h"

namespace patrickstar::engine_detail {
namespace step_pipeline_test {

// Four chunk indices of two tensors each. The trace's forward reads index i at moment i; its
// backward reads index 3 - (m - 4) at moment m = 4 .. 7, so index i is last used at moment 7 - i:
// backward moment m hands the indices above 7 - m to the optimizer thread (index 0, last used at
// the last backward moment, updates at the step).
constexpr int64_t kIndices = 4;
constexpr int64_t kTensors = 2 * kIndices;
constexpr int64_t kFirstBackward = kIndices;
constexpr int64_t kLastBackward = 2 * kIndices - 1;
constexpr ChunkKind kStoredKinds[] = {ChunkKind::kParam, ChunkKind::kGrad, ChunkKind::kMomentum,
                                      ChunkKind::kVariance};

// Carries out the scheduler's moves on the store (the pipeline calls it only for chunks on the
// device, and every chunk here stays on the host).
class StoreMover final : public ChunkMover {
 public:
  explicit StoreMover(ChunkStore& store) : store_(store) {}
  bool on_device(int64_t id) override { return store_.tier(id) == Tier::kDevice; }
  bool movable(int64_t id) override { return store_.is_movable(id); }
  void to_device(int64_t id) override { store_.move(id, Tier::kDevice); }
  void to_host(int64_t id) override { store_.move(id, Tier::kHost); }

 private:
  ChunkStore& store_;
};

// Bit-for-bit equality, read by memcmp (which ThreadSanitizer checks).
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

// Every tensor's weight, momentum and variance, in that order: the views `access` gives (live) or
// copies of them.
std::vector<at::Tensor> values(const StateAccess& access, bool copy) {
  std::vector<at::Tensor> out;
  for (TensorId id = 0; id < kTensors; ++id) {
    for (at::Tensor t : {access.weight(id), access.state(id, ChunkKind::kMomentum),
                         access.state(id, ChunkKind::kVariance)}) {
      out.push_back(copy ? t.clone() : t);
    }
  }
  return out;
}

testing::AssertionResult same_values(const std::vector<at::Tensor>& got,
                                     const std::vector<at::Tensor>& expected) {
  static const char* const kNames[] = {"weight", "momentum", "variance"};
  for (size_t k = 0; k < expected.size(); ++k) {
    if (!same_bits(got[k], expected[k])) {
      return testing::AssertionFailure()
             << "the " << kNames[k % 3] << " of tensor " << k / 3 << " differs";
    }
  }
  return testing::AssertionSuccess();
}

// The rig: everything the pipeline reads, a chunk store with every chunk on the host and seeded
// random values, one trainable parameter with a gradient per tensor, the scheduler with the trace
// above, and the pipeline with its optimizer thread (overlap "on", fp32, placement decided: every
// Adam on the host). Two rigs of the same seed hold the same values.
struct Rig {
  Config config;
  ParamTable params;
  std::vector<at::Tensor> tensors;  // what the table's ids are keyed on, kept alive
  ModelStorage storage;
  GradientState gradients;
  IterationTracker tracker;
  std::unique_ptr<Scheduler> scheduler;
  std::unique_ptr<StoreMover> mover;
  std::unique_ptr<StepPipeline> pipeline;  // last: it goes first, its thread with it

  // `with_delayed`: the delayed update's thread too, built before the optimizer thread (as the
  // engine builds both under "plan": "auto" with zero_optimization.delayed_param_update).
  explicit Rig(uint64_t seed, bool with_delayed = false) {
    config.overlap_step.mode = OverlapMode::kOn;
    config.delayed_update.enabled = with_delayed;
    build_store(seed);
    for (TensorId id = 0; id < kTensors; ++id) {
      tensors.push_back(at::empty({0}).requires_grad_());  // trainable
      params.add(tensors.back());
    }
    params.create_entries();
    for (TensorId id = 0; id < kTensors; ++id) {
      params.fill(id, "w" + std::to_string(id), tensors[static_cast<size_t>(id)], c10::Storage(),
                  c10::Storage());
      params.note_gradient(id);
    }
    build_scheduler();
    mover = std::make_unique<StoreMover>(store());
    PipelineWiring wiring{
        .config = config,
        .params = params,
        .storage = storage,
        .gradients = gradients,
        .tracker = tracker,
        .scheduler = [this]() -> const Scheduler& { return *scheduler; },
        .mover = [this]() -> ChunkMover& { return *mover; },
        .owns = [](int64_t) { return true; },    // one process: every index is this rank's
        .group_of = [](TensorId) { return 0; },  // one param group
        .reduction_pending = [](int64_t) { return false; },
    };
    pipeline = std::make_unique<StepPipeline>(std::move(wiring));
    pipeline->placement().init(store().chunk_count(), kIndices);
    pipeline->placement().decide(std::vector<bool>(kIndices, false));
    auto host_blocks = [](int64_t numel, at::ScalarType dtype) {
      return at::empty({numel}, at::dtype(dtype));
    };
    if (with_delayed) {
      pipeline->build_thread(StepPipeline::Thread::kDelayed, 0, host_blocks, [] { return 0; });
    }
    pipeline->build_thread(
        StepPipeline::Thread::kOverlap, int64_t{1} << 30,
        [](int64_t numel, at::ScalarType dtype) { return at::empty({numel}, at::dtype(dtype)); },
        [] { return int64_t{0}; });
    pipeline->build_adam(AdamOptions().lr(1e-2).weight_decay(0.01), LossScaler::disabled(),
                         /*grad_space=*/true);
  }

  ChunkStore& store() { return *storage.store(); }

  void build_store(uint64_t seed) {
    Layout layout;
    for (TensorId id = 0; id < kTensors; ++id) {
      layout.add_tensor("w" + std::to_string(id), {64, 512});
    }
    layout.finalize(2 * 64 * 512);  // two tensors per chunk index
    std::vector<ChunkKindSpec> kinds;
    for (ChunkKind kind : kStoredKinds) kinds.push_back({kind, at::kFloat});
    storage.build(std::make_unique<HostTier>(MemoryTier::kUnlimited, HostTier::Pinning::kNever),
                  std::make_unique<EmulatedDeviceTier>(int64_t{64} << 20), std::move(layout), kinds,
                  /*copy_queue=*/nullptr, /*lean_frozen=*/false);
    torch::manual_seed(seed);
    for (ChunkId c = 0; c < store().chunk_count(); ++c) {
      store().allocate(c, Tier::kHost);
      const int64_t n = store().chunk(c).capacity_elems;
      const ChunkKind kind = store().kind_of(c);
      store().chunk_view(c).copy_(kind == ChunkKind::kParam      ? torch::randn({n})
                                  : kind == ChunkKind::kGrad     ? torch::randn({n}) * 0.1
                                  : kind == ChunkKind::kMomentum ? torch::randn({n}) * 0.01
                                                                 : torch::rand({n}) * 0.01);
    }
  }

  void build_scheduler() {
    std::map<int64_t, ChunkInfo> chunks;
    for (ChunkId c = 0; c < store().chunk_count(); ++c) {
      ChunkInfo info;
      info.bytes = store().chunk_bytes(c);
      chunks[c] = info;
    }
    SchedulerOptions options;
    options.capacity_bytes = store().device_tier().capacity_bytes();
    scheduler = std::make_unique<Scheduler>(options, std::move(chunks));
    Trace trace;
    // A moment reading index `index`'s param chunk (in backward its gradient chunk too); the
    // step's moment reads none.
    auto add = [&](MomentKind kind, int64_t index) {
      Moment moment;
      moment.kind = kind;
      moment.label = kind == MomentKind::kStep ? "step" : "layer" + std::to_string(index);
      if (kind != MomentKind::kStep) {
        moment.chunk_ids.push_back(store().chunk_id(ChunkKind::kParam, index));
      }
      if (kind == MomentKind::kPreBackward) {
        moment.chunk_ids.push_back(store().chunk_id(ChunkKind::kGrad, index));
      }
      trace.moments.push_back(std::move(moment));
    };
    for (int64_t i = 0; i < kIndices; ++i) add(MomentKind::kPreForward, i);
    for (int64_t m = kFirstBackward; m <= kLastBackward; ++m) {
      add(MomentKind::kPreBackward, kLastBackward - m);
    }
    add(MomentKind::kStep, -1);
    scheduler->set_trace(trace);
  }

  // The backward's moments up to `last`, as the engine records them; after each, the training
  // thread computes with the index that moment reads (not handed over yet) while the optimizer
  // thread updates the ones handed over.
  void backward_until(int64_t last) {
    for (int64_t m = kFirstBackward; m <= last; ++m) {
      pipeline->on_backward_moment(m, /*retraced=*/false);
      const int64_t index = kLastBackward - m;
      for (TensorId id : store().layout().tensors_in_chunk(index)) {
        const at::Tensor w = store().view(id, ChunkKind::kParam);
        const float* data = w.data_ptr<float>();
        float sum = 0;
        for (int64_t k = 0; k < w.numel(); ++k) sum += data[k];
        EXPECT_TRUE(std::isfinite(sum));
      }
    }
  }

  std::vector<at::Tensor> committed() {
    StateAccess access = pipeline->access();
    return values(access, /*copy=*/true);
  }

  // The step as the engine makes it (every Adam on the host), then the next iteration's gradients
  // and Adam step counts.
  IterationReport step(uint64_t next_seed, bool delayed = false) {
    pipeline->begin_step();
    StepInputs inputs;
    inputs.on_device.assign(kIndices, false);
    inputs.delayed = delayed;
    IterationReport report;
    pipeline->update(inputs, report);
    pipeline->after_step(report);
    // (The delayed update advanced the counts at its hand-over.)
    if (!delayed) {
      for (const Param& p : params) params.add_adam_steps(p.id, 1);
    }
    torch::manual_seed(next_seed);
    for (int64_t i = 0; i < kIndices; ++i) {
      at::Tensor grad = store().chunk_view(store().chunk_id(ChunkKind::kGrad, i));
      grad.copy_(torch::randn({grad.numel()}) * 0.1);
    }
    return report;
  }
};

TEST(StepPipeline, AnAccessTakenWhileTheThreadUpdatesAheadSeesTheCommittedValues) {
  Rig rig(1);
  const std::vector<at::Tensor> committed = rig.committed();
  for (int cycle = 0; cycle < 50; ++cycle) {
    // One to three indices go to the optimizer thread; the access is taken at once, while it
    // still updates them.
    rig.backward_until(kFirstBackward + 1 + cycle % (kIndices - 1));
    {
      StateAccess access = rig.pipeline->access();
      ASSERT_TRUE(same_values(values(access, /*copy=*/false), committed)) << "cycle " << cycle;
    }
    // The iteration goes: the next backward hands the indices over again.
    rig.pipeline->on_iteration_dropped();
  }
}

TEST(StepPipeline, TheThreadUpdatesAheadAndAnAccessUndoesItExactly) {
  Rig rig(2), serial(2);
  const std::vector<at::Tensor> committed = rig.committed();
  rig.backward_until(kLastBackward);
  rig.pipeline->on_backward_end(/*views_shown=*/true);  // waits for the thread's updates
  // The chunks hold the updates made ahead now: index 3 (tensor 7's) moved, index 0 (tensor
  // 0's), which goes at the step, did not.
  const at::Tensor w0 = rig.store().view(0, ChunkKind::kParam);
  const at::Tensor w7 = rig.store().view(kTensors - 1, ChunkKind::kParam);
  EXPECT_TRUE(same_bits(w0, committed[0]));
  EXPECT_FALSE(same_bits(w7, committed[3 * (kTensors - 1)]));
  {
    StateAccess access = rig.pipeline->access();
    EXPECT_TRUE(same_values(values(access, /*copy=*/false), committed));
  }
  // The step after it updates every index itself: the serial step's values, nothing committed.
  const IterationReport report = rig.step(20);
  const IterationReport expected = serial.step(20);
  EXPECT_EQ(report.early_updates_committed, 0);
  EXPECT_EQ(report.early_updates_cancelled, kIndices - 1);
  EXPECT_EQ(report.grad_norm, expected.grad_norm);
  EXPECT_TRUE(same_values(rig.committed(), serial.committed()));
}

TEST(StepPipeline, TheStepCommitsTheUpdatesMadeAheadBitForBitTheSerialStep) {
  Rig ahead(3), serial(3);
  for (int iteration = 0; iteration < 3; ++iteration) {
    // The step comes right after the backward, while the thread may still be updating.
    ahead.backward_until(kLastBackward);
    const IterationReport report = ahead.step(30 + iteration);
    const IterationReport expected = serial.step(30 + iteration);
    // Every index but 0 (last used at the last backward moment) was updated ahead.
    EXPECT_EQ(report.early_updates_committed, kIndices - 1) << "iteration " << iteration;
    EXPECT_EQ(report.early_updates_undone, 0);
    EXPECT_EQ(report.early_updates_cancelled, 0);
    EXPECT_GT(report.early_update_buffer_bytes, 0);
    EXPECT_EQ(expected.early_updates_committed, 0);
    EXPECT_EQ(report.grad_norm, expected.grad_norm);
    EXPECT_TRUE(same_values(ahead.committed(), serial.committed())) << "iteration " << iteration;
  }
}

TEST(StepPipeline, WithBothThreadsOneRunsAtATimeAndEachGivesTheSerialValues) {
  Rig both(4, /*with_delayed=*/true), serial(4);
  // As "plan": "auto" holds them before its plan: neither on.
  both.pipeline->set_overlap_step(false);
  both.pipeline->set_delayed_update(false);
  EXPECT_TRUE(both.pipeline->delayed_possible());
  EXPECT_TRUE(both.pipeline->overlap_possible());
  EXPECT_FALSE(both.pipeline->delayed_due(/*iteration=*/100, /*has_trace=*/true));
  // One on at a time: turning the other on is refused, and changes nothing.
  both.pipeline->set_delayed_update(true);
  EXPECT_TRUE(both.pipeline->delayed_due(100, true));
  EXPECT_THROW(both.pipeline->set_overlap_step(true), c10::Error);
  both.pipeline->set_delayed_update(false);
  both.pipeline->set_overlap_step(true);
  EXPECT_THROW(both.pipeline->set_delayed_update(true), c10::Error);
  EXPECT_FALSE(both.pipeline->delayed_update_on());
  // Without a forward reading the weights, the delayed update's values are the serial step's,
  // written in when an access lands it; then the overlapped step after it (turning the delayed
  // update off lands the update in flight: the thread never updates ahead beside it).
  both.pipeline->set_overlap_step(false);
  both.pipeline->set_delayed_update(true);
  for (int iteration = 0; iteration < 3; ++iteration) {
    const IterationReport report = both.step(40 + iteration, /*delayed=*/true);
    serial.step(40 + iteration);
    EXPECT_TRUE(report.update_delayed);
    EXPECT_TRUE(same_values(both.committed(), serial.committed())) << "iteration " << iteration;
  }
  const IterationReport handed = both.step(50, /*delayed=*/true);
  serial.step(50);
  EXPECT_TRUE(handed.update_delayed);
  both.pipeline->set_delayed_update(false);
  {
    // The chunks themselves (no access, which would land it): the weights the update made.
    std::vector<at::Tensor> chunks;
    for (TensorId id = 0; id < kTensors; ++id) {
      for (ChunkKind kind : {ChunkKind::kParam, ChunkKind::kMomentum, ChunkKind::kVariance}) {
        chunks.push_back(both.store().view(id, kind).clone());
      }
    }
    EXPECT_TRUE(same_values(chunks, serial.committed())) << "landed when turned off";
  }
  both.pipeline->set_overlap_step(true);
  for (int iteration = 0; iteration < 2; ++iteration) {
    both.backward_until(kLastBackward);
    const IterationReport report = both.step(60 + iteration);
    serial.step(60 + iteration);
    EXPECT_FALSE(report.update_delayed);
    EXPECT_EQ(report.early_updates_committed, kIndices - 1) << "iteration " << iteration;
    EXPECT_TRUE(same_values(both.committed(), serial.committed())) << "iteration " << iteration;
  }
}

}  // namespace step_pipeline_test
}  // namespace patrickstar::engine_detail
