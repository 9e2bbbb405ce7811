// ps_bench's main job, the parts that do not depend on the model's architecture: see ps_bench_run.h.
#include "ps_bench_run.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "gpu_prediction.h"
#include "patrickstar/engine/engine_inspect.h"
#include "patrickstar/memtracer/export.h"
#include "patrickstar/memtracer/simulator.h"
#include "ps_bench_common.h"
#include "ps_bench_flags.h"

namespace ps_bench {

void RunTotals::add(int64_t step, int64_t steps, const ps::IterationReport& r, ps::Engine& engine,
                    const ps::Config& config, int world) {
  if (step == 0) warmup_report = r;
  last_report = r;
  non_model_peak = std::max(non_model_peak, r.non_model_peak_bytes);
  if (step >= first_steady(steps)) {
    h2d += static_cast<double>(r.h2d_bytes);
    d2h += static_cast<double>(r.d2h_bytes);
    forced += static_cast<double>(r.adam_host_d2h_bytes);
    copy_wait += r.copy_wait_seconds;
    adam_s += r.adam_seconds;
    disk_read += static_cast<double>(r.disk_read_bytes);
    disk_written += static_cast<double>(r.disk_written_bytes);
    disk_wait += r.disk_wait_seconds;
    gathers += static_cast<double>(r.group_gathers);
    gather_bytes += static_cast<double>(r.gather_bytes);
    reduces += static_cast<double>(r.group_reduces);
    reduce_bytes += static_cast<double>(r.reduce_bytes);
    all_reduce_bytes += static_cast<double>(r.all_reduce_bytes);
    collective_s += r.collective_seconds;
    engine_host_s += r.engine_host_seconds;
    engine_entries += static_cast<double>(r.engine_entries);
    host_syncs += static_cast<double>(r.host_syncs);
    gathered_peak = std::max(gathered_peak, static_cast<double>(r.gathered_peak_bytes));
    // A group gather all-gathers world_size param chunks, a group reduce sends world_size fp32
    // gradient chunks to their owners, and the step agrees on the loss's finiteness (4 bytes,
    // not in fp16) and the squared gradient norm (8 bytes).
    // (The chunk size is read at each step, from the registration report: "auto" may have moved
    // the model into smaller chunks. Not from the chunk store: inspecting it writes in a delayed
    // update in flight, and the run would train without the delay it measures.)
    const int64_t chunk_elems = engine.registration().chunk_elems;
    const int64_t param_chunk =
        chunk_elems * (config.precision() == ps::Precision::kFp32 ? int64_t{4} : int64_t{2});
    formula_ok = formula_ok && r.gather_bytes == r.group_gathers * world * param_chunk &&
                 r.reduce_bytes == r.group_reduces * world * chunk_elems * 4 &&
                 r.all_reduce_bytes == (config.precision() == ps::Precision::kFp16 ? 0 : 4) + 8;
  }
  if (const auto& h = inspect(engine).scheduler().history(); !h.empty() && !h.back().warmup) {
    device_peak = std::max(device_peak, h.back().peak_device_bytes);
  }
}

void RunTotals::average(int64_t steps) {
  steady_iterations = static_cast<double>(steps - first_steady(steps));
  for (double* sum : {&h2d, &d2h, &forced, &copy_wait, &adam_s, &disk_read, &disk_written,
                      &disk_wait, &engine_host_s, &engine_entries, &host_syncs}) {
    *sum /= steady_iterations;
  }
  phases /= steady_iterations;
}

void print_step(int64_t step, const RunShape& shape, const ps::IterationReport& r, double loss,
                double seconds, bool disk_tier) {
  const auto n = [](int64_t v) { return static_cast<long long>(v); };
  const auto bytes = [](int64_t v) { return mib(static_cast<double>(v)); };
  if (shape.world > 1) {
    std::printf("step %lld/%lld  rank 0: gathered %lld groups (%s), reduced %lld (%s), %.3f s in "
                "collectives\n", n(step + 1), n(shape.steps), n(r.group_gathers),
                bytes(r.gather_bytes).c_str(), n(r.group_reduces), bytes(r.reduce_bytes).c_str(),
                r.collective_seconds);
  }
  const std::string warm_start = r.warm_start_h2d_bytes > 0
                                     ? " (warm start " + bytes(r.warm_start_h2d_bytes) + ")"
                                     : std::string();
  std::printf("step %lld/%lld%s  loss %.5f  %.3f s  %.2f samples/s  h2d %s%s  d2h %s  adam "
              "device/host chunks %lld/%lld%s\n",
              n(step + 1), n(shape.steps), r.warmup ? " (warm-up)" : "", loss, seconds,
              static_cast<double>(shape.batch) / seconds, bytes(r.h2d_bytes).c_str(),
              warm_start.c_str(), bytes(r.d2h_bytes).c_str(), n(r.adam.chunks_device),
              n(r.adam.chunks_host), r.skipped ? "  (overflow: skipped)" : "");
  if (!r.overlap_step_decision.empty()) std::printf("    %s\n", r.overlap_step_decision.c_str());
  if (!r.plan_decision.empty()) std::printf("    %s\n", r.plan_decision.c_str());
  if (disk_tier) {
    std::printf("    forward+backward %.3f s, step %.3f s (disk: read %s, written %s, waited %.3f s)\n",
                seconds - r.adam_seconds, r.adam_seconds, bytes(r.disk_read_bytes).c_str(),
                bytes(r.disk_written_bytes).c_str(), r.disk_wait_seconds);
  }
  std::fflush(stdout);
}

void print_registration(const ps::RegistrationReport& reg, const ps::Config& config,
                        bool deferred_init) {
  const auto n = [](int64_t v) { return static_cast<long long>(v); };
  const auto bytes = [](int64_t v) { return mib(static_cast<double>(v)); };
  std::printf("registered: %lld parameters in %lld chunks of %lld elements per kind, waste %.2f%%, "
              "%.2f model-data bytes per parameter\n",
              n(reg.params), n(reg.chunks_per_kind), n(reg.chunk_elems),
              100.0 * reg.chunk_waste_fraction, reg.model_data_bytes_per_param);
  std::printf(
      "initialization: host peak %lld bytes (model construction %lld%s); goal %lld "
      "(model data on the host + the largest module's fp32 weights); the process's VmHWM so far "
      "%lld\n",
      n(reg.host_peak_bytes_during_init), n(reg.model_construction_peak_bytes),
      deferred_init ? ", deferred" : "", n(reg.init_goal_bytes), n(proc_status_bytes("VmHWM")));
  if (reg.disk_bytes > 0) {
    std::printf("disk tier: %s of optimizer states in files under %s; the host holds %s of model "
                "data\n", bytes(reg.disk_bytes).c_str(), config.offload_optimizer.nvme_path.c_str(),
                bytes(reg.model_data_bytes - reg.disk_bytes).c_str());
  }
  if (reg.device_state_bytes > 0) {
    std::printf("host plus device: %s of optimizer states placed on the device for good (the host "
                "budget holds the other %s of model data)\n",
                bytes(reg.device_state_bytes).c_str(),
                bytes(reg.model_data_bytes - reg.device_state_bytes).c_str());
  }
}

void add_engine_figures(nlohmann::json& out, ps::Engine& engine, const ps::Config& config,
                        const RunShape& shape, const RunTotals& t, double flops) {
  const ps::RegistrationReport& reg = engine.registration();
  // The OPT lower bound of the scheduler's traffic on the same trace and budgets: the forward,
  // backward and device-side Adam accesses, and the chunks the host-side Adam needs on the host.
  std::map<int64_t, ps::ChunkInfo> chunks = inspect(engine).scheduler().chunks();
  const ps::TrafficBound bound = ps::opt_traffic_bound(inspect(engine).tracer().warmup_trace(),
                                                       chunks, inspect(engine).scheduler().options());
  const double bound_bytes = static_cast<double>(bound.h2d_bytes + bound.d2h_bytes) /
                             static_cast<double>(std::max<int64_t>(1, bound.period_iterations));
  const double step_time = median(t.times);
  out["params"] = reg.params;
  out["dtype"] = std::string(ps::to_string(config.precision()));
  out["state_dtype"] = std::string(ps::to_string(config.optimizer.state_dtype));
  out["trainable_params"] = reg.trainable_params;
  out["batch"] = shape.batch;
  out["seq"] = shape.seq;
  out["steps"] = shape.steps;
  out["chunk_elems"] = reg.chunk_elems;
  out["chunk_waste_fraction"] = reg.chunk_waste_fraction;
  out["model_data_bytes_per_param"] = reg.model_data_bytes_per_param;
  out["device_capacity_bytes"] = config.device.capacity_bytes;
  out["device_peak_bytes"] = t.device_peak;
  out["host_peak_bytes"] = inspect(engine).host_tier().peak_bytes();
  out["init_host_peak_bytes"] = reg.host_peak_bytes_during_init;
  out["model_construction_peak_bytes"] = reg.model_construction_peak_bytes;
  out["init_goal_bytes"] = reg.init_goal_bytes;  // model data + the largest module's fp32 weights
  out["h2d_bytes_per_iter"] = t.h2d;
  // The warm-up's loads: its own (forward, backward and step under the warm-up budget) and the warm
  // start that places chunks for the first scheduled iteration; its own against a steady iteration.
  const double warmup_own =
      static_cast<double>(t.warmup_report.h2d_bytes - t.warmup_report.warm_start_h2d_bytes);
  out["warmup_h2d_bytes"] = t.warmup_report.h2d_bytes;
  out["warmup_warm_start_h2d_bytes"] = t.warmup_report.warm_start_h2d_bytes;
  out["warmup_own_h2d_to_steady"] = t.h2d > 0 ? warmup_own / t.h2d : 0.0;
  out["d2h_bytes_per_iter"] = t.d2h;
  out["async_moves"] = config.scheduler.async_moves;
  out["intra_op_threads"] = torch::get_num_threads();
  out["copy_wait_s_per_iter"] = t.copy_wait;  // compute waiting for chunk copies (async moves)
  out["adam_host_d2h_bytes_per_iter"] = t.forced;
  out["adam_s_per_iter"] = t.adam_s;  // the optimizer step's wall time (steady iterations)
  // Per steady iteration: the engine's host time in its entry points (doors, hooks, gradient
  // arrival) and their count, the host synchronizations, and with --breakdown the phases.
  out["breakdown"] = {{"engine_host_s", t.engine_host_s},
                      {"engine_entries", t.engine_entries},
                      {"host_syncs", t.host_syncs}};
  if (absl::GetFlag(FLAGS_breakdown)) {
    out["breakdown"]["forward_s"] = t.phases.forward;
    out["breakdown"]["backward_s"] = t.phases.backward;
    out["breakdown"]["step_s"] = t.phases.step;
  }
  out["disk_bytes"] = reg.disk_bytes;  // optimizer states in the disk tier's files
  out["device_state_bytes"] = reg.device_state_bytes;  // optimizer states on the device for good
  out["disk_read_bytes_per_iter"] = t.disk_read;
  out["disk_written_bytes_per_iter"] = t.disk_written;
  out["disk_wait_s_per_iter"] = t.disk_wait;
  out["opt_bound_bytes_per_iter"] = bound_bytes;
  out["opt_bound_proven"] = bound.proven;
  out["traffic_to_opt_bound"] = (t.h2d + t.d2h) / std::max(1.0, bound_bytes);
  out["step_time_s"] = step_time;
  out["samples_per_s"] = static_cast<double>(shape.batch) / step_time;
  out["tflops_ps"] = 8.0 * static_cast<double>(reg.params) *
                     static_cast<double>(shape.batch * shape.seq) / step_time / 1e12;
  out["tflops_megatron"] = flops / step_time / 1e12;
  out["adam_chunks_device"] = t.last_report.adam.chunks_device;
  out["adam_chunks_host"] = t.last_report.adam.chunks_host;
  out["policy"] = ps::eviction_policy_name(config.scheduler.policy);
  out["world_size"] = shape.world;
}

void add_per_rank_figures(nlohmann::json& out, ps::Communicator& comm, ps::Engine& engine,
                          const RunShape& shape, const RunTotals& t) {
  // Every rank's figures per steady iteration, and whether its collective bytes equalled the
  // formula (RunTotals::add) at every one.
  enum { kModelData, kGathers, kGatherBytes, kReduces, kReduceBytes, kAllReduceBytes, kSeconds,
         kStepTime, kFormulaOk, kTrafficToBound, kGatheredPeak, kFields };
  std::vector<double> mine(static_cast<size_t>(shape.world * kFields), 0.0);
  double* f = mine.data() + shape.rank * kFields;
  f[kGathers] = t.gathers / t.steady_iterations;
  f[kGatherBytes] = t.gather_bytes / t.steady_iterations;
  f[kReduces] = t.reduces / t.steady_iterations;
  f[kReduceBytes] = t.reduce_bytes / t.steady_iterations;
  f[kAllReduceBytes] = t.all_reduce_bytes / t.steady_iterations;
  f[kSeconds] = t.collective_s / t.steady_iterations;
  f[kModelData] = static_cast<double>(engine.registration().model_data_bytes);
  f[kStepTime] = out["step_time_s"].get<double>();
  f[kFormulaOk] = t.formula_ok ? 1.0 : 0.0;
  f[kTrafficToBound] = out["traffic_to_opt_bound"].get<double>();
  f[kGatheredPeak] = t.gathered_peak;
  const std::vector<double> all = sum_over_ranks(comm, mine);
  nlohmann::json per_rank = nlohmann::json::array();
  bool all_ok = true;
  for (int r = 0; r < shape.world; ++r) {
    const double* g = all.data() + r * kFields;
    per_rank.push_back({{"rank", r},
                        {"model_data_bytes", static_cast<int64_t>(g[kModelData])},
                        {"group_gathers_per_iter", g[kGathers]},
                        {"gather_bytes_per_iter", g[kGatherBytes]},
                        {"group_reduces_per_iter", g[kReduces]},
                        {"reduce_bytes_per_iter", g[kReduceBytes]},
                        {"all_reduce_bytes_per_iter", g[kAllReduceBytes]},
                        {"collective_seconds_per_iter", g[kSeconds]},
                        {"step_time_s", g[kStepTime]},
                        {"traffic_to_opt_bound", g[kTrafficToBound]},
                        {"gathered_device_peak_bytes", static_cast<int64_t>(g[kGatheredPeak])},
                        {"collective_bytes_match_formula", g[kFormulaOk] == 1.0}});
    all_ok = all_ok && g[kFormulaOk] == 1.0;
  }
  // The OPT bound (rank 0's above, every rank's in per_rank) covers the chunks each rank's
  // scheduler places; the gathered groups are the doors', on the device as non-model bytes of the
  // trace, and dropped without a copy.
  const ps::ChunkStore& store = inspect(engine).chunks();
  out["param_chunk_bytes"] = store.chunk_bytes(store.chunk_id(ps::ChunkKind::kParam, 0));
  out["collective_formula"] =
      "gather_bytes = group_gathers x world_size x param_chunk_bytes; reduce_bytes = "
      "group_reduces x world_size x chunk_elems x 4; all_reduce_bytes = 4 (loss finiteness, not "
      "fp16) + 8 (squared gradient norm)";
  out["collective_bytes_match_formula"] = all_ok;
  out["per_rank"] = per_rank;
}

namespace {

// The process against what the engine accounts for. On the emulated device the device tier and
// the non-model bytes (LibTorch's CPU allocations) are host memory too; on a GPU they are not.
void print_process(nlohmann::json& out, ps::Engine& engine, const ps::Config& config,
                   int64_t non_model_peak) {
  const bool emulated = config.device.type == ps::DeviceType::kEmulated;
  const int64_t hwm = proc_status_bytes("VmHWM");
  // The tiers' reserved peaks: their blocks in use plus the blocks they keep for reuse.
  const int64_t host_reserved = inspect(engine).host_tier().peak_reserved_bytes();
  const int64_t device_reserved = inspect(engine).device_tier().peak_reserved_bytes();
  const int64_t accounted =
      g_rss_at_start + host_reserved + (emulated ? device_reserved + non_model_peak : 0);
  const double accounted_to_hwm =
      hwm > 0 ? static_cast<double>(accounted) / static_cast<double>(hwm) : 0.0;
  const auto bytes = [](int64_t v) { return mib(static_cast<double>(v)); };
  std::printf("process: high-water mark (VmHWM) %s; accounted %s = %s at start (libraries) + "
              "host tier reserved peak %s%s%s; accounted / VmHWM %.3f\n",
              bytes(hwm).c_str(), bytes(accounted).c_str(), bytes(g_rss_at_start).c_str(),
              bytes(host_reserved).c_str(), emulated ? " + device tier reserved peak " : "",
              emulated ? absl::StrCat(bytes(device_reserved), " + non-model peak ",
                                      bytes(non_model_peak))
                             .c_str()
                       : "",
              accounted_to_hwm);
  out["process_hwm_bytes"] = hwm;
  out["process_rss_at_start_bytes"] = g_rss_at_start;
  out["accounted_bytes"] = accounted;
  out["accounted_to_hwm"] = accounted_to_hwm;
  out["host_tier_reserved_peak_bytes"] = host_reserved;
  out["device_tier_reserved_peak_bytes"] = device_reserved;
}

// --trace and --plot.
void write_timelines(ps::Engine& engine, const ps::Config& config) {
  if (!absl::GetFlag(FLAGS_trace).empty()) {
    std::vector<ps::CopySpan> copies;
    if (ps::CopyEngine* queue = inspect(engine).chunks().copy_queue(); queue != nullptr) {
      queue->drain();  // the last step's prefetches complete, so every issued move has its copy
      copies = queue->spans();
    }
    ps::write_text_file(absl::GetFlag(FLAGS_trace),
                        ps::chrome_trace_json(inspect(engine).scheduler().moves(),
                                              inspect(engine).scheduler().moment_records(),
                                              config.device.capacity_bytes, copies,
                                              inspect(engine).optimizer_spans()));
    std::printf("wrote %s\n", absl::GetFlag(FLAGS_trace).c_str());
  }
  if (!absl::GetFlag(FLAGS_plot).empty()) {
    ps::write_text_file(absl::GetFlag(FLAGS_plot),
                        ps::memory_timeline_svg(inspect(engine).scheduler().moment_records(),
                                                config.device.capacity_bytes));
    std::printf("wrote %s\n", absl::GetFlag(FLAGS_plot).c_str());
  }
}

}  // namespace

void print_and_write(nlohmann::json& out, ps::Engine& engine, torch::nn::Module& module,
                     const ps::Config& config, const RunShape& shape, const RunTotals& totals) {
  std::printf("\n");
  out["memory_at_device_peak"] = print_breakdown("device peak", engine.device_peak_breakdown(),
                                                 config.device.capacity_bytes);
  out["memory_at_host_peak"] = print_breakdown("host peak", engine.host_peak_breakdown(),
                                               config.device.capacity_bytes);
  print_process(out, engine, config, totals.non_model_peak);
  if (!absl::GetFlag(FLAGS_predict).empty()) {
    out["prediction"] = ps::bench::print_gpu_prediction(
        engine, module, shape.batch * shape.seq, shape.seq, absl::GetFlag(FLAGS_predict),
        out["step_time_s"].get<double>());
  }
  std::printf("\n%-30s %s\n", "figure", "value");
  for (const auto& [key, value] : out.items()) {
    if (value.is_array() || value.is_object()) continue;  // printed above, or in the JSON file
    std::printf("%-30s %s\n", key.c_str(), value.dump().c_str());
  }
  if (out.contains("per_rank")) {
    for (const auto& r : out["per_rank"]) std::printf("rank %s\n", r.dump().c_str());
  }
  write_json_if_asked(out);
  write_timelines(engine, config);
  std::fflush(stdout);  // everything is said before the engine gives the model back
}

}  // namespace ps_bench
