// memtracer: traffic per iteration of OPT (with prefetch), LRU and static against the offline OPT
// bound on a synthetic GPT-like trace (counters are exact byte figures, not timings), and the host
// cost of the scheduler's decisions (time per simulated iteration).
#include <benchmark/benchmark.h>

#include "patrickstar/memtracer/simulator.h"

namespace patrickstar {
namespace {

// 24 blocks of 2 chunks of 1 Mi elements, activations 8 MiB per block: a GPT-like shape.
SyntheticWorkload gpt_workload() {
  GptLikeOptions gpt;
  gpt.layers = 24;
  gpt.param_chunks_per_layer = 2;
  gpt.chunk_elems = 1 << 20;
  gpt.activation_bytes_per_layer = 8 << 20;
  gpt.step_non_model_bytes = 1 << 20;
  return make_gpt_like_workload(gpt);
}

// Arguments: policy (0 opt, 1 lru, 2 static), capacity in percent of all chunk bytes (150: chunks
// and activations fit, so OPT and LRU move nothing after the warm-up). The bound is for schedules
// that run every access on the device; static runs the step on the host, so it moves fewer bytes
// than that bound at small capacities (it pays in host Adam time instead, which is not modelled).
void BM_SimulateGptLike(benchmark::State& state) {
  static const SyntheticWorkload workload = gpt_workload();
  const auto policy = static_cast<EvictionPolicy>(state.range(0));
  SimulationOptions options;
  options.scheduler.capacity_bytes = workload.total_chunk_bytes * state.range(1) / 100;
  options.scheduler.policy = policy;
  options.scheduler.prefetch_depth = 2;
  options.scheduler.warmup_ratio = 0.8;
  options.iterations = 4;
  SimulationResult result;
  for (auto _ : state) {
    result = simulate(workload.trace, workload.chunks, options);
    benchmark::DoNotOptimize(result.steady.h2d_bytes);
  }
  const TrafficBound bound = opt_traffic_bound(workload.trace, workload.chunks, options.scheduler);
  const double traffic = result.mean_h2d_bytes + result.mean_d2h_bytes;
  const double bound_traffic = static_cast<double>(bound.h2d_bytes + bound.d2h_bytes);
  state.SetLabel(std::string(eviction_policy_name(policy)) + (bound.proven ? "" : " (estimate)"));
  state.counters["traffic_MiB_per_iter"] = traffic / (1 << 20);
  state.counters["opt_bound_MiB_per_iter"] = bound_traffic / (1 << 20);
  state.counters["traffic_over_bound"] = bound_traffic > 0 ? traffic / bound_traffic : 0.0;
  state.counters["prefetched_share"] = result.steady.loads > 0
                                           ? static_cast<double>(result.steady.prefetches_used) /
                                                 static_cast<double>(result.steady.loads)
                                           : 0.0;
  state.counters["peak_device_over_capacity"] =
      static_cast<double>(result.steady.peak_device_bytes) /
      static_cast<double>(options.scheduler.capacity_bytes);
  state.counters["moments_per_iter"] = static_cast<double>(workload.trace.size());
}
BENCHMARK(BM_SimulateGptLike)
    ->ArgsProduct({{0, 1, 2}, {50, 70, 150}})
    ->Unit(benchmark::kMillisecond);

// The offline bound alone (Belady over the periodic trace).
void BM_OptTrafficBound(benchmark::State& state) {
  static const SyntheticWorkload workload = gpt_workload();
  SchedulerOptions options;
  options.capacity_bytes = workload.total_chunk_bytes / 2;
  for (auto _ : state) {
    benchmark::DoNotOptimize(opt_traffic_bound(workload.trace, workload.chunks, options));
  }
}
BENCHMARK(BM_OptTrafficBound)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace patrickstar
