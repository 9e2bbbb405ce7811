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
  return predict_iteration(trace, costs, moves, chunks, model, StepSchedule::kSerial, {});
}

Prediction predict_iteration(const Trace& trace, const std::vector<MomentCost>& costs,
                             const std::vector<MoveEvent>& moves,
                             const std::map<int64_t, ChunkInfo>& chunks, const GpuCostModel& model,
                             StepSchedule schedule, const std::vector<HostUpdate>& updates) {
  TORCH_CHECK(static_cast<int64_t>(costs.size()) == trace.size(), "predict_iteration: ",
              costs.size(), " moment costs for a trace of ", trace.size(), " moments");
  TORCH_CHECK(model.peak_flops > 0 && model.compute_efficiency > 0 && model.h2d_bytes_per_s > 0 &&
                  model.d2h_bytes_per_s > 0 && model.device_memory_bytes_per_s > 0 &&
                  model.host_adam_params_per_s > 0,
              "predict_iteration: the cost model \"", model.name, "\" has a rate that is not positive");
  const bool serial = schedule == StepSchedule::kSerial;
  const size_t n = costs.size();
  if (!serial) {
    for (const HostUpdate& u : updates) {
      TORCH_CHECK(u.ready_after >= 0 && u.ready_after < trace.size(),
                  "predict_iteration: a host update ready after moment ", u.ready_after,
                  ", outside the trace's ", trace.size(), " moments");
      TORCH_CHECK(u.params >= 0, "predict_iteration: a host update of ", u.params, " parameters");
    }
  }
  // The step moment (the last): overlapped updates end before it, delayed ones start after it.
  size_t step_moment = n == 0 ? 0 : n - 1;
  for (size_t m = 0; m < n; ++m) {
    if (trace.moments[m].kind == MomentKind::kStep) step_moment = m;
  }
  // Overlapped: an update's chunks leave the device once its gradients are final, not at the step.
  std::unordered_map<int64_t, size_t> evicted_early;  // chunk -> the moment it leaves after
  if (schedule == StepSchedule::kOverlapped) {
    for (const HostUpdate& u : updates) {
      if (static_cast<size_t>(u.ready_after) >= step_moment) continue;
      for (int64_t c : u.chunk_ids) evicted_early[c] = static_cast<size_t>(u.ready_after);
    }
  }
  // The moves issued before each moment's compute, and (overlapped) right after it.
  std::vector<std::vector<const MoveEvent*>> moves_at(n);
  std::vector<std::vector<const MoveEvent*>> moves_after(n);
  for (const MoveEvent& move : moves) {
    TORCH_CHECK(move.moment >= 0 && move.moment < trace.size(), "predict_iteration: a move of chunk ",
                move.chunk_id, " at moment ", move.moment, ", outside the trace's ", trace.size(),
                " moments");
    TORCH_CHECK(chunks.count(move.chunk_id) == 1, "predict_iteration: chunk ", move.chunk_id,
                " is moved but not in the chunk table");
    auto early = evicted_early.find(move.chunk_id);
    if (!move.to_device && static_cast<size_t>(move.moment) == step_moment &&
        early != evicted_early.end()) {
      moves_after[early->second].push_back(&move);
    } else {
      moves_at[static_cast<size_t>(move.moment)].push_back(&move);
    }
  }
  // The updates that start after each moment (overlapped: their gradients final; delayed: the
  // step moment, all of them).
  std::vector<std::vector<const HostUpdate*>> updates_after(n);
  if (!serial) {
    for (const HostUpdate& u : updates) {
      const size_t ready = static_cast<size_t>(u.ready_after);
      updates_after[schedule == StepSchedule::kDelayed ? std::max(ready, step_moment) : ready]
          .push_back(&u);
    }
  }
  std::vector<double> compute_seconds(n);
  for (size_t m = 0; m < n; ++m) {
    compute_seconds[m] = costs[m].flops / (model.peak_flops * model.compute_efficiency) +
                         costs[m].device_bytes / model.device_memory_bytes_per_s +
                         (serial ? costs[m].host_adam_params / model.host_adam_params_per_s : 0);
  }

  Prediction p;
  for (size_t m = 0; m < n; ++m) {
    p.flops += costs[m].flops;
    p.compute_seconds += compute_seconds[m];
    if (serial) p.host_adam_seconds += costs[m].host_adam_params / model.host_adam_params_per_s;
  }
  if (!serial) {
    for (const HostUpdate& u : updates)
      p.host_adam_seconds += u.params / model.host_adam_params_per_s;
  }
  for (const MoveEvent& move : moves) {
    const double bytes = static_cast<double>(move.bytes);
    (move.to_device ? p.h2d_seconds : p.d2h_seconds) +=
        bytes / (move.to_device ? model.h2d_bytes_per_s : model.d2h_bytes_per_s);
  }

  std::unordered_map<int64_t, double> touched_end;  // end of the last compute or update touching it
  std::unordered_map<int64_t, double> arrived;      // completion of its last copy
  // Delayed: per chunk, the end of each iteration's update of it (a load in iteration k waits for
  // iteration k - 2's).
  std::unordered_map<int64_t, std::map<int, double>> updated_end;
  double queue_free = 0;
  double compute_free = 0;
  double optimizer_free = 0;  // the optimizer thread (overlapped, delayed)
  double previous_end = 0;
  double previous_length = -1;
  constexpr int kMaxIterations = 16;
  for (int iteration = 0; iteration < kMaxIterations; ++iteration) {
    double exposed = 0;
    double adam_wait = 0;
    const double iteration_start = compute_free;  // the host waited for the iteration before
    auto issue = [&](const MoveEvent* move) {
      auto touched = touched_end.find(move->chunk_id);
      double ready = touched == touched_end.end() ? 0 : touched->second;
      if (schedule == StepSchedule::kDelayed && move->to_device) {
        auto ends = updated_end.find(move->chunk_id);
        if (ends != updated_end.end()) {
          auto it = ends->second.find(iteration - 2);
          if (it != ends->second.end()) ready = std::max(ready, it->second);
        }
      }
      const double start = std::max({queue_free, ready, iteration_start});
      const double rate = move->to_device ? model.h2d_bytes_per_s : model.d2h_bytes_per_s;
      queue_free = start + static_cast<double>(move->bytes) / rate;
      arrived[move->chunk_id] = queue_free;
    };
    for (size_t m = 0; m < n; ++m) {
      for (const MoveEvent* move : moves_at[m]) issue(move);
      const Moment& moment = trace.moments[m];
      double inputs = 0;  // every chunk the moment reads, on the device or on the host
      for (const std::vector<int64_t>* ids : {&moment.chunk_ids, &moment.host_chunk_ids}) {
        for (int64_t c : *ids) {
          auto it = arrived.find(c);
          if (it != arrived.end()) inputs = std::max(inputs, it->second);
        }
      }
      double start = std::max(compute_free, inputs);
      exposed += start - compute_free;
      if (schedule == StepSchedule::kOverlapped && m == step_moment && optimizer_free > start) {
        adam_wait += optimizer_free - start;  // the step waits for the last host update
        start = optimizer_free;
      }
      compute_free = start + compute_seconds[m];
      for (const std::vector<int64_t>* ids : {&moment.chunk_ids, &moment.host_chunk_ids}) {
        for (int64_t c : *ids) {
          // A delayed update's chunks are the optimizer thread's until it is done with them.
          if (schedule == StepSchedule::kDelayed && m == step_moment &&
              ids == &moment.host_chunk_ids) {
            continue;
          }
          touched_end[c] = compute_free;
        }
      }
      for (const MoveEvent* move : moves_after[m]) issue(move);
      for (const HostUpdate* u : updates_after[m]) {
        double ready = std::max(optimizer_free, compute_free);
        for (int64_t c : u->chunk_ids) {
          auto it = arrived.find(c);
          if (it != arrived.end()) ready = std::max(ready, it->second);
        }
        optimizer_free = ready + u->params / model.host_adam_params_per_s;
        for (int64_t c : u->chunk_ids) {
          if (schedule == StepSchedule::kDelayed) {
            updated_end[c][iteration] = optimizer_free;
          } else {
            touched_end[c] = optimizer_free;
          }
        }
      }
    }
    if (schedule == StepSchedule::kOverlapped && optimizer_free > compute_free) {
      adam_wait += optimizer_free - compute_free;  // no step moment after the last update
      compute_free = optimizer_free;
    }
    const double length = compute_free - previous_end;
    previous_end = compute_free;
    p.step_seconds = length;
    p.exposed_copy_seconds = exposed;
    p.adam_wait_seconds = adam_wait;
    p.iterations_replayed = iteration + 1;
    // Delayed: iteration t's update first holds up a load in iteration t + 2.
    const int settled_from = schedule == StepSchedule::kDelayed ? 3 : 1;
    if (iteration >= settled_from && std::abs(length - previous_length) <= 1e-12 + 1e-9 * length) {
      break;
    }
    previous_length = length;
  }
  p.tflops = p.step_seconds > 0 ? p.flops / p.step_seconds / 1e12 : 0;
  return p;
}

}  // namespace patrickstar
