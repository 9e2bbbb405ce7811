#include "gpu_prediction.h"

#include <cstdio>
#include <map>
#include "patrickstar/engine/engine_inspect.h"
#include <set>

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

nlohmann::json print_gpu_prediction(const Engine& engine, torch::nn::Module& model, int64_t tokens,
                                    const std::string& gpu, double measured_step_seconds) {
  const GpuCostModel cost_model = gpu_cost_model(gpu);
  const Scheduler& scheduler = inspect(engine).scheduler();
  TORCH_CHECK(!scheduler.history().empty(), "--predict: no iteration was scheduled");
  const int64_t last = scheduler.history().back().iteration;
  std::vector<MoveEvent> moves;
  for (const MoveEvent& e : scheduler.moves()) {
    if (e.iteration == last) moves.push_back(e);
  }
  const std::vector<MomentCost> costs = moment_costs(engine, model, tokens);
  const Prediction p = predict_iteration(scheduler.trace(), costs, moves, scheduler.chunks(), cost_model);
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
  return {{"gpu", cost_model.name},
          {"step_s", p.step_seconds},
          {"compute_s", p.compute_seconds},
          {"h2d_s", p.h2d_seconds},
          {"d2h_s", p.d2h_seconds},
          {"exposed_copy_s", p.exposed_copy_seconds},
          {"flops_per_iteration", p.flops},
          {"tflops", p.tflops},
          {"moves", moves.size()},
          {"assumptions", cost_model.sources}};
}

}  // namespace patrickstar::bench
