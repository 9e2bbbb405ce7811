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
  if (name == "h200") {
    GpuCostModel m = gpu_cost_model("h100");
    m.name = "h200";
    m.device_memory_bytes_per_s = 4.8e12;  // H200 SXM HBM3e (NVIDIA H200 datasheet)
    m.h2d_bytes_per_s = 54.2e9;
    m.d2h_bytes_per_s = 54.6e9;
    m.sources =
        "peak 989 TFLOP/s dense BF16 and memory 4.8 TB/s: NVIDIA's H200 SXM datasheet; compute "
        "efficiency 0.5 of peak: an assumption; H2D 54.2 GB/s and D2H 54.6 GB/s: pinned copies "
        "this project measured on an H200 (docs/gpu-runs/2026-11-26-h200.md); host Adam 1.75e9 "
        "params/s: this project's CPU Adam in mixed precision on a 2-core machine (BENCHMARKS.md), "
        "a floor for a GPU host with more cores";
    return m;
  }
  TORCH_CHECK(false, "unknown GPU cost model \"", name, "\"; known: h100, h200");
}

namespace {

// Throws c10::Error for costs of the wrong length, a model with a rate that is not positive, or
// (overlapped, delayed) an update ready after a moment outside the trace or with a negative count
// of parameters.
void check_inputs(const Trace& trace, const std::vector<MomentCost>& costs,
                  const GpuCostModel& model, bool serial, const std::vector<HostUpdate>& updates) {
  TORCH_CHECK(static_cast<int64_t>(costs.size()) == trace.size(), "predict_iteration: ",
              costs.size(), " moment costs for a trace of ", trace.size(), " moments");
  TORCH_CHECK(model.peak_flops > 0 && model.compute_efficiency > 0 && model.h2d_bytes_per_s > 0 &&
                  model.d2h_bytes_per_s > 0 && model.device_memory_bytes_per_s > 0 &&
                  model.host_adam_params_per_s > 0,
              "predict_iteration: the cost model \"", model.name, "\" has a rate that is not positive");
  if (!serial) {
    for (const HostUpdate& u : updates) {
      TORCH_CHECK(u.ready_after >= 0 && u.ready_after < trace.size(),
                  "predict_iteration: a host update ready after moment ", u.ready_after,
                  ", outside the trace's ", trace.size(), " moments");
      TORCH_CHECK(u.params >= 0, "predict_iteration: a host update of ", u.params, " parameters");
    }
  }
}

// The step moment (the last): overlapped updates end before it, delayed ones start after it.
size_t find_step_moment(const Trace& trace, size_t n) {
  size_t step_moment = n == 0 ? 0 : n - 1;
  for (size_t m = 0; m < n; ++m) {
    if (trace.moments[m].kind == MomentKind::kStep) step_moment = m;
  }
  return step_moment;
}

// What the copy queue and the optimizer thread are given around each moment.
struct MomentEvents {
  std::vector<std::vector<const MoveEvent*>> moves_at;        // issued before the moment's compute
  std::vector<std::vector<const MoveEvent*>> moves_after;     // (overlapped) issued right after it
  std::vector<std::vector<const HostUpdate*>> updates_after;  // starting after it
};

// Places each move and update at its moment; throws c10::Error for a move at a moment outside the
// trace or of a chunk missing from `chunks`.
MomentEvents place_events(const Trace& trace, const std::vector<MoveEvent>& moves,
                          const std::map<int64_t, ChunkInfo>& chunks, StepSchedule schedule,
                          const std::vector<HostUpdate>& updates, size_t step_moment, size_t n) {
  const bool serial = schedule == StepSchedule::kSerial;
  // Overlapped: an update's chunks leave the device once its gradients are final, not at the step.
  std::unordered_map<int64_t, size_t> evicted_early;  // chunk -> the moment it leaves after
  if (schedule == StepSchedule::kOverlapped) {
    for (const HostUpdate& u : updates) {
      if (static_cast<size_t>(u.ready_after) >= step_moment) continue;
      for (int64_t c : u.chunk_ids) evicted_early[c] = static_cast<size_t>(u.ready_after);
    }
  }
  // The moves issued before each moment's compute, and (overlapped) right after it.
  MomentEvents events;
  events.moves_at.resize(n);
  events.moves_after.resize(n);
  for (const MoveEvent& move : moves) {
    TORCH_CHECK(move.moment >= 0 && move.moment < trace.size(), "predict_iteration: a move of chunk ",
                move.chunk_id, " at moment ", move.moment, ", outside the trace's ", trace.size(),
                " moments");
    TORCH_CHECK(chunks.count(move.chunk_id) == 1, "predict_iteration: chunk ", move.chunk_id,
                " is moved but not in the chunk table");
    auto early = evicted_early.find(move.chunk_id);
    if (!move.to_device && static_cast<size_t>(move.moment) == step_moment &&
        early != evicted_early.end()) {
      events.moves_after[early->second].push_back(&move);
    } else {
      events.moves_at[static_cast<size_t>(move.moment)].push_back(&move);
    }
  }
  // The updates that start after each moment (overlapped: their gradients final; delayed: the
  // step moment, all of them).
  events.updates_after.resize(n);
  if (!serial) {
    for (const HostUpdate& u : updates) {
      const size_t ready = static_cast<size_t>(u.ready_after);
      const size_t after =
          schedule == StepSchedule::kDelayed ? std::max(ready, step_moment) : ready;
      events.updates_after[after].push_back(&u);
    }
  }
  return events;
}

// Each moment's length on the compute stream (serial: with the host Adam).
std::vector<double> moment_seconds(const std::vector<MomentCost>& costs, const GpuCostModel& model,
                                   bool serial) {
  const size_t n = costs.size();
  std::vector<double> compute_seconds(n);
  for (size_t m = 0; m < n; ++m) {
    compute_seconds[m] = costs[m].flops / (model.peak_flops * model.compute_efficiency) +
                         costs[m].device_bytes / model.device_memory_bytes_per_s +
                         (serial ? costs[m].host_adam_params / model.host_adam_params_per_s : 0);
  }
  return compute_seconds;
}

// The iteration's work summed, whatever overlaps it: FLOPs, compute, host Adam and copies.
void add_totals(Prediction& p, const std::vector<MomentCost>& costs,
                const std::vector<double>& compute_seconds, const std::vector<MoveEvent>& moves,
                const GpuCostModel& model, bool serial, const std::vector<HostUpdate>& updates) {
  for (size_t m = 0; m < costs.size(); ++m) {
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
}

// What the compute waited for in one iteration.
struct IterationWaits {
  double exposed = 0;    // for copies
  double adam_wait = 0;  // (overlapped) for the optimizer thread
};

// The timeline: the compute stream, the copy queue and the optimizer thread, replayed one
// iteration at a time; the clocks and the chunks' times carry over from one iteration to the next.
class Replay {
 public:
  Replay(const Trace& trace, const GpuCostModel& model, StepSchedule schedule, size_t step_moment,
         const std::vector<double>& compute_seconds, const MomentEvents& events)
      : trace_(trace),
        model_(model),
        schedule_(schedule),
        step_moment_(step_moment),
        compute_seconds_(compute_seconds),
        events_(events) {}

  // One iteration: each moment's moves, compute and host updates in turn.
  IterationWaits run(int iteration) {
    IterationWaits waits;
    const double iteration_start = compute_free_;  // the host waited for the iteration before
    for (size_t m = 0; m < compute_seconds_.size(); ++m) {
      for (const MoveEvent* move : events_.moves_at[m]) issue(move, iteration, iteration_start);
      compute(m, waits);
      for (const MoveEvent* move : events_.moves_after[m]) issue(move, iteration, iteration_start);
      start_updates(m, iteration);
    }
    if (schedule_ == StepSchedule::kOverlapped && optimizer_free_ > compute_free_) {
      waits.adam_wait += optimizer_free_ - compute_free_;  // no step moment after the last update
      compute_free_ = optimizer_free_;
    }
    return waits;
  }

  double compute_free() const { return compute_free_; }

 private:
  // One copy on the queue, once the queue is free, the chunk's values are final and the iteration
  // has started.
  void issue(const MoveEvent* move, int iteration, double iteration_start) {
    auto touched = touched_end_.find(move->chunk_id);
    double ready = touched == touched_end_.end() ? 0 : touched->second;
    if (schedule_ == StepSchedule::kDelayed && move->to_device) {
      auto ends = updated_end_.find(move->chunk_id);
      if (ends != updated_end_.end()) {
        auto it = ends->second.find(iteration - 2);
        if (it != ends->second.end()) ready = std::max(ready, it->second);
      }
    }
    const double start = std::max({queue_free_, ready, iteration_start});
    const double rate = move->to_device ? model_.h2d_bytes_per_s : model_.d2h_bytes_per_s;
    queue_free_ = start + static_cast<double>(move->bytes) / rate;
    arrived_[move->chunk_id] = queue_free_;
  }

  // Moment m's compute, once the compute before it is done and its chunks have arrived.
  void compute(size_t m, IterationWaits& waits) {
    const Moment& moment = trace_.moments[m];
    double inputs = 0;  // every chunk the moment reads, on the device or on the host
    for (const std::vector<int64_t>* ids : {&moment.chunk_ids, &moment.host_chunk_ids}) {
      for (int64_t c : *ids) {
        auto it = arrived_.find(c);
        if (it != arrived_.end()) inputs = std::max(inputs, it->second);
      }
    }
    double start = std::max(compute_free_, inputs);
    waits.exposed += start - compute_free_;
    // Overlapped: the step waits for this iteration's last host update; delayed: for the last
    // iteration's (one update in flight: the step lands it before it hands over its own).
    if (schedule_ != StepSchedule::kSerial && m == step_moment_ && optimizer_free_ > start) {
      waits.adam_wait += optimizer_free_ - start;
      start = optimizer_free_;
    }
    compute_free_ = start + compute_seconds_[m];
    for (const std::vector<int64_t>* ids : {&moment.chunk_ids, &moment.host_chunk_ids}) {
      for (int64_t c : *ids) {
        // A delayed update's chunks are the optimizer thread's until it is done with them.
        if (schedule_ == StepSchedule::kDelayed && m == step_moment_ &&
            ids == &moment.host_chunk_ids) {
          continue;
        }
        touched_end_[c] = compute_free_;
      }
    }
  }

  // The host updates that start after moment m, on the optimizer thread in turn.
  void start_updates(size_t m, int iteration) {
    for (const HostUpdate* u : events_.updates_after[m]) {
      double ready = std::max(optimizer_free_, compute_free_);
      for (int64_t c : u->chunk_ids) {
        auto it = arrived_.find(c);
        if (it != arrived_.end()) ready = std::max(ready, it->second);
      }
      optimizer_free_ = ready + u->params / model_.host_adam_params_per_s;
      for (int64_t c : u->chunk_ids) {
        if (schedule_ == StepSchedule::kDelayed) {
          updated_end_[c][iteration] = optimizer_free_;
        } else {
          touched_end_[c] = optimizer_free_;
        }
      }
    }
  }

  const Trace& trace_;
  const GpuCostModel& model_;
  const StepSchedule schedule_;
  const size_t step_moment_;
  const std::vector<double>& compute_seconds_;
  const MomentEvents& events_;
  // Per chunk: the end of the last compute or update touching it, the completion of its last copy.
  std::unordered_map<int64_t, double> touched_end_;
  std::unordered_map<int64_t, double> arrived_;
  // Delayed: per chunk, the end of each iteration's update of it (a load in iteration k waits for
  // iteration k - 2's).
  std::unordered_map<int64_t, std::map<int, double>> updated_end_;
  double queue_free_ = 0;
  double compute_free_ = 0;
  double optimizer_free_ = 0;  // the optimizer thread (overlapped, delayed)
};

}  // namespace

Prediction predict_iteration(const Trace& trace, const std::vector<MomentCost>& costs,
                             const std::vector<MoveEvent>& moves,
                             const std::map<int64_t, ChunkInfo>& chunks, const GpuCostModel& model) {
  return predict_iteration(trace, costs, moves, chunks, model, StepSchedule::kSerial, {});
}

Prediction predict_iteration(const Trace& trace, const std::vector<MomentCost>& costs,
                             const std::vector<MoveEvent>& moves,
                             const std::map<int64_t, ChunkInfo>& chunks, const GpuCostModel& model,
                             StepSchedule schedule, const std::vector<HostUpdate>& updates) {
  const bool serial = schedule == StepSchedule::kSerial;
  check_inputs(trace, costs, model, serial, updates);
  const size_t n = costs.size();
  const size_t step_moment = find_step_moment(trace, n);
  const MomentEvents events = place_events(trace, moves, chunks, schedule, updates, step_moment, n);
  const std::vector<double> compute_seconds = moment_seconds(costs, model, serial);

  Prediction p;
  add_totals(p, costs, compute_seconds, moves, model, serial, updates);

  Replay replay(trace, model, schedule, step_moment, compute_seconds, events);
  double previous_end = 0;
  double previous_length = -1;
  constexpr int kMaxIterations = 16;
  for (int iteration = 0; iteration < kMaxIterations; ++iteration) {
    const IterationWaits waits = replay.run(iteration);
    const double length = replay.compute_free() - previous_end;
    previous_end = replay.compute_free();
    p.step_seconds = length;
    p.exposed_copy_seconds = waits.exposed;
    p.adam_wait_seconds = waits.adam_wait;
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
