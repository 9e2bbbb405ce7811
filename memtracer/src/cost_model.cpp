#include "patrickstar/memtracer/cost_model.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <unordered_map>

namespace patrickstar {

GpuCostModel gpu_cost_model(const std::string& name) {
  if (name == "h100") {
    GpuCostModel m;
    m.name = "h100";
    m.peak_flops = 989e12;  // H100 SXM5, dense BF16 tensor core (NVIDIA H100 datasheet)
    m.compute_efficiency = 0.5;
    m.h2d_bytes_per_s = 35e9;
    m.d2h_bytes_per_s = 53e9;
    m.device_memory_bytes_per_s = 3.35e12;  // H100 SXM5 HBM3 (NVIDIA H100 datasheet)
    m.host_adam_params_per_s = 1.75e9;
    m.sources =
        "peak 989 TFLOP/s dense BF16 and memory 3.35 TB/s: NVIDIA's H100 SXM5 datasheet; "
        "compute efficiency 0.5 of peak: an assumption (large GPT matmuls reach more, small ones "
        "less); H2D 35 GB/s and D2H 53 GB/s: pinned copies measured on PCIe Gen5 as published for "
        "the H100; host Adam 1.75e9 params/s: this project's CPU Adam in mixed precision on a "
        "2-core machine (BENCHMARKS.md), a floor for a GPU host with more cores";
    return m;
  }
  TORCH_CHECK(false, "unknown GPU cost model \"", name, "\"; known: h100");
}

Prediction predict_iteration(const Trace& trace, const std::vector<MomentCost>& costs,
                             const std::vector<MoveEvent>& moves,
                             const std::map<int64_t, ChunkInfo>& chunks, const GpuCostModel& model) {
  TORCH_CHECK(static_cast<int64_t>(costs.size()) == trace.size(), "predict_iteration: ",
              costs.size(), " moment costs for a trace of ", trace.size(), " moments");
  TORCH_CHECK(model.peak_flops > 0 && model.compute_efficiency > 0 && model.h2d_bytes_per_s > 0 &&
                  model.d2h_bytes_per_s > 0 && model.device_memory_bytes_per_s > 0 &&
                  model.host_adam_params_per_s > 0,
              "predict_iteration: the cost model \"", model.name, "\" has a rate that is not positive");
  // The moves of each moment, in the order they were made.
  std::vector<std::vector<const MoveEvent*>> moves_at(static_cast<size_t>(trace.size()));
  for (const MoveEvent& move : moves) {
    TORCH_CHECK(move.moment >= 0 && move.moment < trace.size(), "predict_iteration: a move of chunk ",
                move.chunk_id, " at moment ", move.moment, ", outside the trace's ", trace.size(),
                " moments");
    TORCH_CHECK(chunks.count(move.chunk_id) == 1, "predict_iteration: chunk ", move.chunk_id,
                " is moved but not in the chunk table");
    moves_at[static_cast<size_t>(move.moment)].push_back(&move);
  }
  std::vector<double> compute_seconds(static_cast<size_t>(trace.size()));
  for (size_t m = 0; m < costs.size(); ++m) {
    compute_seconds[m] = costs[m].flops / (model.peak_flops * model.compute_efficiency) +
                         costs[m].device_bytes / model.device_memory_bytes_per_s +
                         costs[m].host_adam_params / model.host_adam_params_per_s;
  }

  Prediction p;
  for (size_t m = 0; m < costs.size(); ++m) {
    p.flops += costs[m].flops;
    p.compute_seconds += compute_seconds[m];
  }
  for (const MoveEvent& move : moves) {
    const double bytes = static_cast<double>(move.bytes);
    (move.to_device ? p.h2d_seconds : p.d2h_seconds) +=
        bytes / (move.to_device ? model.h2d_bytes_per_s : model.d2h_bytes_per_s);
  }

  std::unordered_map<int64_t, double> touched_end;  // compute end of the last moment touching it
  std::unordered_map<int64_t, double> arrived;      // completion of its last copy
  double queue_free = 0;
  double compute_free = 0;
  double previous_end = 0;
  double previous_length = -1;
  constexpr int kMaxIterations = 8;
  for (int iteration = 0; iteration < kMaxIterations; ++iteration) {
    double exposed = 0;
    const double iteration_start = compute_free;  // the host waited for the iteration before
    for (size_t m = 0; m < costs.size(); ++m) {
      for (const MoveEvent* move : moves_at[m]) {
        auto touched = touched_end.find(move->chunk_id);
        const double ready = touched == touched_end.end() ? 0 : touched->second;
        const double start = std::max({queue_free, ready, iteration_start});
        const double rate = move->to_device ? model.h2d_bytes_per_s : model.d2h_bytes_per_s;
        queue_free = start + static_cast<double>(move->bytes) / rate;
        arrived[move->chunk_id] = queue_free;
      }
      const Moment& moment = trace.moments[m];
      double inputs = 0;  // every chunk the moment reads, on the device or on the host
      for (const std::vector<int64_t>* ids : {&moment.chunk_ids, &moment.host_chunk_ids}) {
        for (int64_t c : *ids) {
          auto it = arrived.find(c);
          if (it != arrived.end()) inputs = std::max(inputs, it->second);
        }
      }
      const double start = std::max(compute_free, inputs);
      exposed += start - compute_free;
      compute_free = start + compute_seconds[m];
      for (const std::vector<int64_t>* ids : {&moment.chunk_ids, &moment.host_chunk_ids}) {
        for (int64_t c : *ids) touched_end[c] = compute_free;
      }
    }
    const double length = compute_free - previous_end;
    previous_end = compute_free;
    p.step_seconds = length;
    p.exposed_copy_seconds = exposed;
    p.iterations_replayed = iteration + 1;
    if (iteration > 0 && std::abs(length - previous_length) <= 1e-12 + 1e-9 * length) break;
    previous_length = length;
  }
  p.tflops = p.step_seconds > 0 ? p.flops / p.step_seconds / 1e12 : 0;
  return p;
}

}  // namespace patrickstar
