#include "gpu_prediction.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "patrickstar/engine/engine_inspect.h"

namespace patrickstar::bench {

std::vector<MomentCost> moment_costs(const Engine& engine, torch::nn::Module& model, int64_t tokens) {
  const Trace& trace = inspect(engine).scheduler().trace();
  TORCH_CHECK(trace.size() > 0, "--predict: the engine has no trace yet (train a step first)");
  std::map<std::string, double> own_params;  // by the label the engine gives the module's moments
  std::set<std::string> embeddings;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    double own = 0;
    for (const at::Tensor& t : item.value()->parameters(/*recurse=*/false)) {
      own += static_cast<double>(t.numel());
    }
    const std::string label = item.key().empty() ? "<root>" : item.key();
    own_params[label] = own;
    if (dynamic_cast<const torch::nn::EmbeddingImpl*>(item.value().get()) != nullptr) {
      embeddings.insert(label);
    }
  }
  // An embedding's lookup (its first forward moment) and the lookup's gradient (its last backward
  // moment) do no matmul; another use of its weight (a tied output layer) computes like a linear.
  std::set<size_t> lookups;
  std::set<std::string> seen_forward;
  std::map<std::string, size_t> last_backward;
  for (size_t i = 0; i < trace.moments.size(); ++i) {
    const Moment& m = trace.moments[i];
    if (embeddings.count(m.label) == 0) continue;
    if (m.kind == MomentKind::kPreForward && seen_forward.insert(m.label).second) lookups.insert(i);
    if (m.kind == MomentKind::kPreBackward) last_backward[m.label] = i;
  }
  for (const auto& [label, i] : last_backward) lookups.insert(i);
  const ChunkStore& store = inspect(engine).chunks();
  const double t = static_cast<double>(tokens);
  std::vector<MomentCost> costs;
  costs.reserve(static_cast<size_t>(trace.size()));
  for (size_t i = 0; i < trace.moments.size(); ++i) {
    const Moment& m = trace.moments[i];
    MomentCost c;
    auto own = own_params.find(m.label);
    const double n = own == own_params.end() || lookups.count(i) ? 0 : own->second;
    switch (m.kind) {
      case MomentKind::kPreForward:
        c.flops = 2 * n * t;
        break;
      case MomentKind::kPreBackward:
        c.flops = 4 * n * t;
        break;
      case MomentKind::kStep:
        for (int64_t id : m.chunk_ids) c.device_bytes += 2.0 * static_cast<double>(store.chunk_bytes(id));
        for (int64_t id : m.host_chunk_ids) {
          if (store.kind_of(id) == ChunkKind::kParam) {
            c.host_adam_params += static_cast<double>(store.chunk(id).capacity_elems);
          }
        }
        break;
    }
    costs.push_back(c);
  }
  return costs;
}

std::vector<HostUpdate> host_updates(const Engine& engine) {
  const Trace& trace = inspect(engine).scheduler().trace();
  const ChunkStore& store = inspect(engine).chunks();
  int64_t step = -1;  // the last step moment
  for (int64_t m = 0; m < trace.size(); ++m) {
    if (trace.moments[static_cast<size_t>(m)].kind == MomentKind::kStep) step = m;
  }
  if (step < 0) return {};
  // One update per chunk index whose Adam runs on the host, with the chunks it reads there.
  std::map<int64_t, HostUpdate> by_index;
  for (int64_t id : trace.moments[static_cast<size_t>(step)].host_chunk_ids) {
    HostUpdate& u = by_index[store.index_of(id)];
    u.chunk_ids.push_back(id);
    if (store.kind_of(id) == ChunkKind::kParam) {
      u.params += static_cast<double>(store.chunk(id).capacity_elems);
    }
  }
  std::vector<HostUpdate> updates;
  for (auto& [index, u] : by_index) {
    // Its gradients are final after the last moment before the step that reads its weights or
    // writes its gradients.
    std::set<int64_t> own = {store.chunk_id(ChunkKind::kParam, index)};
    if (store.has_kind(ChunkKind::kGrad)) own.insert(store.chunk_id(ChunkKind::kGrad, index));
    u.ready_after = std::max<int64_t>(0, step - 1);
    for (int64_t m = step - 1; m >= 0; --m) {
      const Moment& moment = trace.moments[static_cast<size_t>(m)];
      auto touches = [&](const std::vector<int64_t>& ids) {
        return std::any_of(ids.begin(), ids.end(), [&](int64_t c) { return own.count(c) > 0; });
      };
      if (touches(moment.chunk_ids) || touches(moment.host_chunk_ids)) {
        u.ready_after = m;
        break;
      }
    }
    updates.push_back(std::move(u));
  }
  return updates;
}

namespace {
struct Schedules {
  Prediction serial, overlapped, delayed;
  double gpu_alone_seconds = 0;  // the serial iteration with a free host Adam
  // max(GPU iteration without the host Adam, host Adam alone): no schedule beats it.
  double bound_seconds() const { return std::max(gpu_alone_seconds, serial.host_adam_seconds); }
};
Schedules predict_schedules(const Scheduler& scheduler, const std::vector<MomentCost>& costs,
                            const std::vector<MoveEvent>& moves,
                            const std::vector<HostUpdate>& updates, const GpuCostModel& model) {
  auto run = [&](StepSchedule schedule) {
    return predict_iteration(scheduler.trace(), costs, moves, scheduler.chunks(), model, schedule,
                             updates);
  };
  std::vector<MomentCost> no_host = costs;
  for (MomentCost& c : no_host) c.host_adam_params = 0;
  const double gpu_alone =
      predict_iteration(scheduler.trace(), no_host, moves, scheduler.chunks(), model).step_seconds;
  return {run(StepSchedule::kSerial), run(StepSchedule::kOverlapped), run(StepSchedule::kDelayed),
          gpu_alone};
}

void print_schedules(const char* what, const Schedules& s) {
  const double ms = 1e3;
  std::printf(
      "  %s: serial %.3f ms, overlapped %.3f ms (%.2fx serial; the step waited %.3f ms "
      "for the optimizer thread), delayed %.3f ms (%.2fx serial); bound max(GPU "
      "iteration without the host Adam, host Adam) %.3f ms\n",
      what, s.serial.step_seconds * ms, s.overlapped.step_seconds * ms,
      s.overlapped.step_seconds / s.serial.step_seconds, s.overlapped.adam_wait_seconds * ms,
      s.delayed.step_seconds * ms, s.delayed.step_seconds / s.serial.step_seconds,
      s.bound_seconds() * ms);
}

nlohmann::json schedules_json(const Schedules& s) {
  return {{"serial_step_s", s.serial.step_seconds},
          {"overlapped_step_s", s.overlapped.step_seconds},
          {"overlapped_adam_wait_s", s.overlapped.adam_wait_seconds},
          {"delayed_step_s", s.delayed.step_seconds}};
}
}  // namespace

nlohmann::json print_gpu_prediction(const Engine& engine, torch::nn::Module& model, int64_t tokens,
                                    int64_t seq, const std::string& gpu,
                                    double measured_step_seconds) {
  const GpuCostModel cost_model = gpu_cost_model(gpu);
  const Scheduler& scheduler = inspect(engine).scheduler();
  TORCH_CHECK(!scheduler.history().empty(), "--predict: no iteration was scheduled");
  const int64_t last = scheduler.history().back().iteration;
  std::vector<MoveEvent> moves;
  for (const MoveEvent& e : scheduler.moves()) {
    if (e.iteration == last) moves.push_back(e);
  }
  const std::vector<MomentCost> costs = moment_costs(engine, model, tokens);
  const std::vector<HostUpdate> updates = host_updates(engine);
  const Schedules schedules = predict_schedules(scheduler, costs, moves, updates, cost_model);
  const Prediction& p = schedules.serial;
  const double ms = 1e3;
  std::printf("\npredicted on %s for the last iteration's trace and moves (%zu moves): step %.3f ms "
              "(measured here: %.3f ms), compute %.3f ms, copy queue %.3f ms H2D + %.3f ms D2H, "
              "compute waiting for copies %.3f ms, %.1f TFLOPs (%.4g FLOPs per iteration)\n",
              cost_model.name.c_str(), moves.size(), p.step_seconds * ms,
              measured_step_seconds * ms, p.compute_seconds * ms, p.h2d_seconds * ms,
              p.d2h_seconds * ms, p.exposed_copy_seconds * ms, p.tflops, p.flops);
  std::printf("  assumptions: %.0f TFLOP/s peak at %.2f of it, H2D %.0f GB/s, D2H %.0f GB/s, device "
              "memory %.0f GB/s, host Adam %.3g params/s (%s); compute: 2 FLOPs per parameter per "
              "token forward and 4 backward at the moments of the modules owning them, embedding "
              "lookups none (attention scores and other work without parameters not counted), device Adam reads and "
              "writes its chunks once; one in-order copy queue, the host ahead of the GPU within an "
              "iteration and waiting for it between iterations\n",
              cost_model.peak_flops / 1e12, cost_model.compute_efficiency,
              cost_model.h2d_bytes_per_s / 1e9, cost_model.d2h_bytes_per_s / 1e9,
              cost_model.device_memory_bytes_per_s / 1e9, cost_model.host_adam_params_per_s,
              cost_model.sources.c_str());
  // Where the host Adam runs (memtracer/cost_model.h, StepSchedule): the engine today (serial),
  // each index's update as its gradients become final (overlapped), or during the next iteration
  // (delayed). The bound: the GPU's iteration with a free host Adam, or the host Adam alone.
  std::printf(
      "  the step's host Adam (%zu chunk ind%s, %.3f ms at the assumed rate) serial, "
      "overlapped with backward (an optimizer thread; each index's update once its "
      "gradients are final, its chunks sent home then) and delayed by one iteration "
      "(ZeRO-Offload's delayed parameter update; weights one update old, a second host "
      "gradient buffer):\n",
      updates.size(), updates.size() == 1 ? "ex" : "ices", p.host_adam_seconds * ms);
  const std::string this_batch = seq > 0 && tokens % seq == 0
                                     ? absl::StrCat("batch ", tokens / seq, " x ", seq)
                                     : absl::StrCat(tokens, " tokens");
  print_schedules(this_batch.c_str(), schedules);
  nlohmann::json out = {{"gpu", cost_model.name},
                        {"step_s", p.step_seconds},
                        {"compute_s", p.compute_seconds},
                        {"h2d_s", p.h2d_seconds},
                        {"d2h_s", p.d2h_seconds},
                        {"exposed_copy_s", p.exposed_copy_seconds},
                        {"flops_per_iteration", p.flops},
                        {"tflops", p.tflops},
                        {"moves", moves.size()},
                        {"host_adam_s", p.host_adam_seconds},
                        {"gpu_alone_s", schedules.gpu_alone_seconds},
                        {"schedules", schedules_json(schedules)},
                        {"assumptions", cost_model.sources}};
  // The batch at which the GPU's compute matches the host Adam: compute grows with the tokens,
  // the host Adam does not. Predicted with this run's moves (a larger batch's activations would
  // need device memory this trace does not show: an approximation).
  double gpu_compute = 0;
  for (size_t m = 0; m < costs.size(); ++m) {
    gpu_compute += costs[m].flops / (cost_model.peak_flops * cost_model.compute_efficiency);
  }
  if (gpu_compute > 0 && p.host_adam_seconds > gpu_compute && seq > 0) {
    const double per_token = gpu_compute / static_cast<double>(tokens);
    const int64_t batch =
        static_cast<int64_t>(std::ceil(p.host_adam_seconds / per_token / static_cast<double>(seq)));
    const std::vector<MomentCost> matched_costs = moment_costs(engine, model, batch * seq);
    const Schedules matched =
        predict_schedules(scheduler, matched_costs, moves, updates, cost_model);
    print_schedules(
        absl::StrCat("batch ", batch, " x ", seq, " (GPU compute = host Adam; this run's moves)")
            .c_str(),
        matched);
    nlohmann::json m = schedules_json(matched);
    m["batch"] = batch;
    m["seq"] = seq;
    m["gpu_alone_s"] = matched.gpu_alone_seconds;
    out["matched_batch"] = m;
  }
  return out;
}

}  // namespace patrickstar::bench
