// Trace-driven simulator: replays an access trace (chunk sizes, accessed chunks and non-model bytes
// per moment) under a device capacity with the real Scheduler and a fake mover, and computes the
// offline OPT bound on traffic for the same trace and budgets. Answers "how much traffic at this
// budget" without running a model. Pure functions of their arguments; thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "patrickstar/memtracer/scheduler.h"
#include "patrickstar/memtracer/trace.h"

namespace patrickstar {

struct SimulationOptions {
  SchedulerOptions scheduler;
  int64_t iterations = 3;  // after the warm-up iteration
  // Logical clock of the timeline: a move of b bytes lasts b / bandwidth, a moment computes this
  // long.
  double bandwidth_bytes_per_us = 16000.0;  // 16 GB/s, a PCIe 4 x16 figure
  int64_t moment_compute_us = 100;
};

struct SimulationResult {
  std::vector<IterationStats> iterations;  // the warm-up first
  IterationStats steady;                   // the last iteration
  // Means per iteration over the iterations after the first scheduled one (which still moves the
  // warm-up's placement), or over that one when it is the only one. The schedule may be periodic
  // over several iterations, so compare these (not `steady`) with the bound.
  double mean_h2d_bytes = 0;
  double mean_d2h_bytes = 0;
  std::vector<MoveEvent> moves;
  std::vector<MomentRecord> moments;  // warm-up records carry the trace's non-model bytes too
};

// Runs one warm-up iteration (no trace: LRU at the warm-up budget, the trace's non-model bytes
// given as the live reading of each moment), installs the trace with a warm start, then
// options.iterations scheduled iterations. All chunks start on the host. Throws c10::Error as the
// Scheduler does (a moment that cannot fit).
SimulationResult simulate(const Trace& trace, const std::map<int64_t, ChunkInfo>& chunks,
                          const SimulationOptions& options);

// Offline Belady (MIN) on the trace's flattened access sequence at the per-moment budgets of the
// same options (Scheduler::budget_bytes), from an empty device, with the trace's host moments
// (host_chunk_ids: chunks every schedule must send to the host there, counted as d2h when
// resident; such a chunk counts as never used again until then), repeated until the state at the end
// of an iteration repeats; the figures are the means per iteration over that period, rounded down.
// With equal chunk sizes MIN needs the fewest loads on every prefix of the access sequence of any
// schedule at these budgets, prefetching or not (a prefetching schedule can be made lazy without
// more loads), so over a long run any schedule averages at least these loads per iteration (the
// start state shifts a finite run by at most the chunks the device holds); a chunk leaves the
// device as often as it comes in the long run, so d2h is bounded alike: `proven` is true. With
// unequal sizes Belady is a heuristic and the figures are an estimate, not a bound: `proven` is
// false.
struct TrafficBound {
  int64_t h2d_bytes = 0;
  int64_t d2h_bytes = 0;
  int64_t loads = 0;
  int64_t evictions = 0;
  int64_t period_iterations = 1;  // the length of the periodic schedule the means are taken over
  bool proven = false;
  std::string method;
};
TrafficBound opt_traffic_bound(const Trace& trace, const std::map<int64_t, ChunkInfo>& chunks,
                               const SchedulerOptions& options);

// A synthetic GPT-like training iteration for tests, benchmarks and what-if questions: an embedding
// and `layers` transformer blocks, each owning `param_chunks_per_layer` param chunks. Forward: one
// pre_forward moment per block (the embedding's chunk with the first), activations growing by
// `activation_bytes_per_layer` per block; backward: one pre_backward moment per block in reverse
// order, activations shrinking; step: one moment per param chunk touching it and its fp32 master,
// momentum and variance chunks (the step's non-model bytes are `step_non_model_bytes`). Chunk ids:
// param chunks first (static_on_device), then per param chunk its three optimizer chunks.
struct GptLikeOptions {
  int64_t layers = 12;
  int64_t param_chunks_per_layer = 2;
  int64_t chunk_elems = 1 << 20;
  // false: every chunk has 4 * chunk_elems bytes (equal sizes: the OPT bound is proven); true:
  // param chunks are half precision (2 bytes per element) and the optimizer chunks fp32 (4 bytes).
  bool mixed_precision_sizes = false;
  int64_t activation_bytes_per_layer = 8 << 20;
  int64_t step_non_model_bytes = 1 << 20;
};
struct SyntheticWorkload {
  Trace trace;
  std::map<int64_t, ChunkInfo> chunks;
  int64_t total_chunk_bytes = 0;
};
SyntheticWorkload make_gpt_like_workload(const GptLikeOptions& options);

}  // namespace patrickstar
