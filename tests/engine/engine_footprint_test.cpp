// What an engine holds does not grow with the run, and two engines in one process (a GAN's) each
// measure their own peaks (issue 36).
#include <gtest/gtest.h>
#include <torch/torch.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <cstdint>
#include <utility>
#include <vector>

#include "gpt_training.h"
#include "patrickstar/engine/engine_inspect.h"
#include "patrickstar/memtracer/counting_allocator.h"
#include "patrickstar/patrickstar.h"
#include "small_net.h"

namespace patrickstar {
namespace engine_footprint_test {

int64_t heap_bytes() {
#if defined(__GLIBC__) && !defined(__SANITIZE_ADDRESS__)  // ASan's heap is not glibc's
  return static_cast<int64_t>(mallinfo2().uordblks);
#else
  return 0;
#endif
}

// From iteration 100 to 2,000 the engine keeps the same number of reports and scheduler
// statistics, no timeline (none was asked for: before, 10,016 moment records by the end), the same
// tensor bytes (the counting allocator) and the process heap within 256 KiB (a catch-all for
// containers the counts above do not name).
TEST(EngineFootprint, WhatTheEngineHoldsAfterIteration100DoesNotGrow) {
  test::Net net = test::seeded_net();
  Engine engine(net.ptr(), test::small_device());
  const CountingCpuAllocator& counter = *CountingCpuAllocator::installed();
  struct Held {
    size_t reports, stats, moves, moments;
    int64_t tensor_bytes, heap_bytes;
  };
  auto held = [&] {
    return Held{engine.history().size(), inspect(engine).scheduler().history().size(),
                inspect(engine).scheduler().moves().size(), inspect(engine).scheduler().moment_records().size(),
                counter.live_bytes(), heap_bytes()};
  };
  Held at_100{}, at_2000{};
  for (int s = 0; s < 2000; ++s) {
    engine.zero_grad();
    at::Tensor loss;
    {
      auto active = engine.activate();
      loss = test::compute_loss(net, s % 3);
    }
    engine.backward(loss);
    engine.step();
    loss = at::Tensor();
    if (s == 100) at_100 = held();
    if (s == 1999) at_2000 = held();  // the same point of the iteration
  }
  EXPECT_EQ(at_100.reports, Engine::kHistoryKept);
  EXPECT_EQ(at_2000.reports, at_100.reports);
  EXPECT_EQ(at_100.stats, Scheduler::kHistoryKept);
  EXPECT_EQ(at_2000.stats, at_100.stats);
  EXPECT_EQ(at_2000.moves + at_2000.moments, 0u) << "the timeline is kept only when asked for";
  EXPECT_LE(at_2000.tensor_bytes, at_100.tensor_bytes);
  EXPECT_LT(at_2000.heap_bytes - at_100.heap_bytes, 256 << 10);
}

// Each moment's non-model bytes of one iteration, and the tail's.
std::vector<int64_t> readings_of(const Engine& engine) {
  std::vector<int64_t> out;
  for (const Moment& m : inspect(engine).tracer().current_trace().moments) out.push_back(m.non_model_bytes);
  out.push_back(inspect(engine).tracer().current_trace().tail_non_model_bytes);
  return out;
}

// A (the tiny GPT) and B (the small net) train in one process, alone one after the other and with
// B's whole step inside A's iteration (after A's backward, before its step). Each engine reads the
// same peaks both ways: B's ticks no longer reset the window A's step moment reads (before, A lost
// its embedding backward's peak there). B's step stays below A's own peak in that window, which the
// test checks, so the interleaving cannot show in A's figures.
TEST(EngineFootprint, TwoEnginesInOneProcessEachMeasureTheirOwnPeaks) {
  const int threads = torch::get_num_threads();
  torch::set_num_threads(1);  // intra-op scratch the same every run
  constexpr int kSteps = 4;
  using Readings = std::vector<std::vector<int64_t>>;
  auto run = [&](bool interleaved) {
    models::Gpt a_model = test::make_model(1);
    Engine a(a_model.ptr(), test::tight_config());
    test::Net b_net = test::seeded_net();
    Engine b(b_net.ptr(), test::small_device());
    Readings ra, rb;
    auto b_step = [&](int s) {
      b.zero_grad();
      at::Tensor loss;
      {
        auto active = b.activate();
        loss = test::compute_loss(b_net, s);
      }
      b.backward(loss);
      b.step();
      rb.push_back(readings_of(b));
    };
    for (int s = 0; s <= kSteps; ++s) {
      auto batch = test::batch_of_step(s);
      a.zero_grad();
      at::Tensor loss;
      {
        auto active = a.activate();
        loss = a_model->loss(batch.tokens, batch.targets);
      }
      a.backward(loss);
      loss = at::Tensor();  // A holds nothing extra while B runs
      if (interleaved && s >= 1) b_step(s - 1);
      a.step();
      ra.push_back(readings_of(a));
      if (!interleaved && s < kSteps) b_step(s);
    }
    return std::make_pair(ra, rb);
  };
  const auto [a_alone, b_alone] = run(false);
  const auto [a_mixed, b_mixed] = run(true);
  torch::set_num_threads(threads);
  ASSERT_EQ(b_alone.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(b_mixed.size(), b_alone.size());
  int64_t b_max = 0;
  for (const auto& r : b_alone) {
    for (int64_t v : r) b_max = std::max(b_max, v);
  }
  // A's step moment (its last) reads the window B's step ran in: the premise that B's bytes stay
  // below A's own peak there.
  ASSERT_GE(a_alone[2].size(), 2u);
  ASSERT_GT(a_alone[2][a_alone[2].size() - 2], 2 * b_max);
  for (size_t s = 0; s < a_alone.size(); ++s) {
    // Iteration 1: what B keeps from its first step lands inside A's iteration in one run only.
    if (s == 1) continue;
    EXPECT_EQ(a_mixed[s], a_alone[s]) << "A's iteration " << s;
  }
  for (size_t s = 0; s < b_alone.size(); ++s) {
    EXPECT_EQ(b_mixed[s], b_alone[s]) << "B's iteration " << s;
  }
}

}  // namespace engine_footprint_test
}  // namespace patrickstar
