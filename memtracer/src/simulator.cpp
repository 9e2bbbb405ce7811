#include "patrickstar/memtracer/simulator.h"

#include <algorithm>
#include <limits>
#include <set>
#include <string>

#include <c10/util/Exception.h>

namespace patrickstar {
namespace {

// The chunk store of the simulation: a set of resident ids and a logical clock that advances by the
// duration of each move.
class FakeMover final : public ChunkMover {
 public:
  FakeMover(const std::map<int64_t, ChunkInfo>& chunks, double bandwidth_bytes_per_us)
      : chunks_(chunks), bandwidth_bytes_per_us_(bandwidth_bytes_per_us) {
    for (const auto& [id, chunk] : chunks_) {
      if (chunk.device_only) resident_.insert(id);  // placed there before the first moment
    }
  }
  bool on_device(int64_t chunk_id) override { return resident_.count(chunk_id) != 0; }
  bool movable(int64_t) override { return true; }
  void to_device(int64_t chunk_id) override {
    TORCH_INTERNAL_ASSERT(resident_.insert(chunk_id).second, "chunk ", chunk_id,
                          " moved to the device twice");
    advance(chunk_id);
  }
  void to_host(int64_t chunk_id) override {
    TORCH_INTERNAL_ASSERT(resident_.erase(chunk_id) == 1, "chunk ", chunk_id,
                          " moved to the host but was not on the device");
    advance(chunk_id);
  }
  int64_t now_us() const { return now_us_; }
  void compute(int64_t us) { now_us_ += us; }

 private:
  void advance(int64_t chunk_id) {
    const double us = static_cast<double>(chunks_.at(chunk_id).bytes) / bandwidth_bytes_per_us_;
    now_us_ += std::max<int64_t>(1, static_cast<int64_t>(us));
  }
  const std::map<int64_t, ChunkInfo>& chunks_;
  double bandwidth_bytes_per_us_;
  std::set<int64_t> resident_;
  int64_t now_us_ = 0;
};

int64_t non_model_at(const Trace& trace, int64_t m) {
  return std::max(trace.moments[m].non_model_bytes, trace.next_non_model_bytes(m));
}

}  // namespace

SimulationResult simulate(const Trace& trace, const std::map<int64_t, ChunkInfo>& chunks,
                          const SimulationOptions& options) {
  TORCH_CHECK(trace.size() > 0, "simulate: the trace has no moment");
  TORCH_CHECK(options.iterations >= 1, "simulate: iterations must be >= 1, got ",
              options.iterations);
  TORCH_CHECK(options.bandwidth_bytes_per_us > 0, "simulate: bandwidth must be positive, got ",
              options.bandwidth_bytes_per_us);
  FakeMover mover(chunks, options.bandwidth_bytes_per_us);
  Scheduler scheduler(options.scheduler, chunks);
  scheduler.set_clock([&mover] { return mover.now_us(); });
  scheduler.set_record_timeline(true);  // the moves and moments are the simulation's output
  SimulationResult result;

  for (int64_t iteration = 0; iteration <= options.iterations; ++iteration) {
    scheduler.begin_iteration();
    for (int64_t m = 0; m < trace.size(); ++m) {
      const Moment& moment = trace.moments[m];
      // The warm-up reads the non-model bytes as the engine's probe would (the trace's figure).
      scheduler.at_moment(m, moment.kind, moment.chunk_ids, mover,
                          iteration == 0 ? non_model_at(trace, m) : 0, moment.host_chunk_ids);
      mover.compute(options.moment_compute_us);
      scheduler.after_moment(m, mover);
    }
    if (iteration == 0) {
      scheduler.set_trace(trace, &mover);
    }
    scheduler.end_iteration();
    result.iterations.push_back(scheduler.history().back());  // every one (the history is bounded)
  }

  result.steady = result.iterations.back();
  // Iteration 1 carries the move from the warm-up's placement; the mean starts after it when it
  // can.
  const size_t first = result.iterations.size() > 2 ? 2 : 1;
  for (size_t i = first; i < result.iterations.size(); ++i) {
    result.mean_h2d_bytes += static_cast<double>(result.iterations[i].h2d_bytes);
    result.mean_d2h_bytes += static_cast<double>(result.iterations[i].d2h_bytes);
  }
  result.mean_h2d_bytes /= static_cast<double>(result.iterations.size() - first);
  result.mean_d2h_bytes /= static_cast<double>(result.iterations.size() - first);
  result.moves = scheduler.moves();
  result.moments = scheduler.moment_records();
  // The warm-up did not know the non-model bytes; the simulation does.
  IterationStats& warmup = result.iterations.front();
  for (MomentRecord& record : result.moments) {
    record.label = trace.moments[record.moment].label;
    if (record.non_model_bytes < 0) {
      record.non_model_bytes = non_model_at(trace, record.moment);
      if (record.iteration == warmup.iteration) {
        warmup.peak_device_bytes =
            std::max(warmup.peak_device_bytes, record.chunk_bytes + record.non_model_bytes);
      }
    }
  }
  return result;
}

TrafficBound opt_traffic_bound(const Trace& trace, const std::map<int64_t, ChunkInfo>& chunks,
                               const SchedulerOptions& options) {
  // Same budgets (and the same validation) as the scheduler.
  Scheduler budgets(options, chunks);
  budgets.set_trace(trace);
  const int64_t moments = trace.size();

  const NextUseIndex index(trace);
  auto next_use = [&](int64_t id, int64_t m) { return index.next_use(id, m); };
  std::set<int64_t> sizes;
  for (int64_t id : index.accessed_chunks()) sizes.insert(chunks.at(id).bytes);

  TrafficBound bound;
  bound.proven = sizes.size() <= 1;
  bound.method = bound.proven
                     ? "Belady MIN, equal chunk sizes: steady-state minimum loads per iteration"
                     : "Belady by bytes with unequal chunk sizes: an estimate, not a proven bound";

  // Belady is deterministic given the resident set at the start of an iteration, so the figures
  // become periodic once an end state repeats; the bound is the mean over that period (rounded
  // down).
  // Device-only chunks are there from the start and never leave.
  std::set<int64_t> resident;
  int64_t resident_bytes = 0;
  for (const auto& [id, chunk] : chunks) {
    if (!chunk.device_only) continue;
    resident.insert(id);
    resident_bytes += chunk.bytes;
  }
  std::map<std::set<int64_t>, int64_t> seen_end_states;  // end state -> iteration
  std::vector<TrafficBound> per_iteration_figures;
  constexpr int64_t kMaxIterations = 256;
  int64_t cycle_start = -1;
  for (int64_t iteration = 0; iteration < kMaxIterations && cycle_start < 0; ++iteration) {
    TrafficBound current;
    for (int64_t m = 0; m < moments; ++m) {
      const std::vector<int64_t>& accessed = trace.moments[m].chunk_ids;
      const std::set<int64_t> pinned(accessed.begin(), accessed.end());
      for (int64_t id : trace.moments[m].host_chunk_ids) {  // a host-side optimizer's chunks
        if (resident.erase(id) == 0) continue;
        resident_bytes -= chunks.at(id).bytes;
        current.d2h_bytes += chunks.at(id).bytes;
        current.evictions += 1;
      }
      int64_t missing = 0;
      for (int64_t id : pinned) {
        if (resident.count(id) == 0) missing += chunks.at(id).bytes;
      }
      const int64_t budget = budgets.budget_bytes(m);
      while (resident_bytes + missing > budget) {
        int64_t victim = -1;
        int64_t farthest = -1;
        for (int64_t id : resident) {
          if (pinned.count(id) != 0 || chunks.at(id).device_only) continue;
          const int64_t use = next_use(id, m);
          if (use > farthest) {
            farthest = use;
            victim = id;
          }
        }
        TORCH_INTERNAL_ASSERT(victim >= 0, "opt_traffic_bound: no victim at moment ", m);
        resident.erase(victim);
        resident_bytes -= chunks.at(victim).bytes;
        current.d2h_bytes += chunks.at(victim).bytes;
        current.evictions += 1;
      }
      for (int64_t id : pinned) {
        if (resident.insert(id).second) {
          resident_bytes += chunks.at(id).bytes;
          current.h2d_bytes += chunks.at(id).bytes;
          current.loads += 1;
        }
      }
    }
    per_iteration_figures.push_back(current);
    auto [it, inserted] = seen_end_states.emplace(resident, iteration);
    if (!inserted) cycle_start = it->second + 1;
  }
  const int64_t last = static_cast<int64_t>(per_iteration_figures.size());
  if (cycle_start < 0) {
    cycle_start = last / 2;  // no repetition found: the mean of the later half
    bound.method += " (no period found within " + std::to_string(kMaxIterations) +
                    " iterations: mean of the later half)";
  }
  bound.period_iterations = last - cycle_start;
  for (int64_t i = cycle_start; i < last; ++i) {
    bound.h2d_bytes += per_iteration_figures[i].h2d_bytes;
    bound.d2h_bytes += per_iteration_figures[i].d2h_bytes;
    bound.loads += per_iteration_figures[i].loads;
    bound.evictions += per_iteration_figures[i].evictions;
  }
  bound.h2d_bytes /= bound.period_iterations;
  bound.d2h_bytes /= bound.period_iterations;
  bound.loads /= bound.period_iterations;
  bound.evictions /= bound.period_iterations;
  return bound;
}

SyntheticWorkload make_gpt_like_workload(const GptLikeOptions& options) {
  TORCH_CHECK(
      options.layers >= 1 && options.param_chunks_per_layer >= 1 && options.chunk_elems >= 1,
      "make_gpt_like_workload: layers (", options.layers, "), param_chunks_per_layer (",
      options.param_chunks_per_layer, ") and chunk_elems (", options.chunk_elems,
      ") must be positive");
  SyntheticWorkload workload;
  const int64_t fp32_bytes = 4 * options.chunk_elems;
  const int64_t param_bytes = options.mixed_precision_sizes ? 2 * options.chunk_elems : fp32_bytes;
  // Param chunk ids: 0 is the embedding's, then layer l owns 1 + l * per_layer ... .
  const int64_t param_chunks = 1 + options.layers * options.param_chunks_per_layer;
  for (int64_t id = 0; id < param_chunks; ++id) {
    workload.chunks[id] = ChunkInfo{param_bytes, /*static_on_device=*/true};
    for (int64_t k = 0; k < 3; ++k) {
      workload.chunks[param_chunks + 3 * id + k] = ChunkInfo{fp32_bytes, false};
    }
  }
  for (const auto& [id, chunk] : workload.chunks) workload.total_chunk_bytes += chunk.bytes;

  auto layer_chunks = [&](int64_t layer) {
    std::vector<int64_t> ids;
    if (layer == 0) ids.push_back(0);
    for (int64_t k = 0; k < options.param_chunks_per_layer; ++k) {
      ids.push_back(1 + layer * options.param_chunks_per_layer + k);
    }
    return ids;
  };
  std::vector<Moment>& moments = workload.trace.moments;
  for (int64_t layer = 0; layer < options.layers; ++layer) {
    // Peak over the interval before this block: the activations kept so far.
    moments.push_back(Moment{MomentKind::kPreForward, "block" + std::to_string(layer),
                             layer * options.activation_bytes_per_layer, layer_chunks(layer)});
  }
  for (int64_t layer = options.layers - 1; layer >= 0; --layer) {
    moments.push_back(Moment{MomentKind::kPreBackward, "block" + std::to_string(layer),
                             (layer + 1) * options.activation_bytes_per_layer,
                             layer_chunks(layer)});
  }
  for (int64_t id = 0; id < param_chunks; ++id) {
    moments.push_back(
        Moment{MomentKind::kStep,
               "step:" + std::to_string(id),
               id == 0 ? options.activation_bytes_per_layer : options.step_non_model_bytes,
               {id, param_chunks + 3 * id, param_chunks + 3 * id + 1, param_chunks + 3 * id + 2}});
  }
  workload.trace.tail_non_model_bytes = options.step_non_model_bytes;
  return workload;
}

}  // namespace patrickstar
