// ps_bench --compare-step: the overlapped step against the serial step, interleaved in one run.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "absl/flags/flag.h"
#include "patrickstar/memtracer/export.h"
#include "ps_bench_common.h"
#include "ps_bench_flags.h"

namespace ps_bench {
// One engine, its steps alternating between the overlapped step and the serial step
// (Engine::set_overlap_step), on the same data stream. From the serial steps: the step alone (its
// adam_seconds) and forward + backward alone (the rest of the iteration); the bound an overlap can
// reach is the larger of the two. Medians over the steady steps (after the warm-up and the first
// scheduled step). With --threads 1 compute keeps one core and the optimizer thread gets the
// other, as a GPU would split the work.
int compare_step(const ps::Config& base, const ps::models::GptSpec& spec, int64_t batch,
                 int64_t seq, int64_t steps, uint64_t seed) {
  TORCH_CHECK(steps >= 6,
              "--compare-step needs --steps >= 6 (warm-up, first scheduled step, and "
              "at least two steady steps of each kind)");
  TORCH_CHECK(base.overlap_step.mode != ps::OverlapMode::kOff,
              "--compare-step compares the "
              "overlapped step with the serial one: leave zero_optimization.overlap_step on in the "
              "config");
  std::printf(
      "compare-step: %s, %lld parameters, %s, batch %lld, seq %lld, %lld steps, device %s, "
      "%d intra-op threads (the optimizer thread takes the cores left, at least one)\n",
      spec.name.c_str(), static_cast<long long>(spec.parameter_count()),
      std::string(ps::to_string(base.precision())).c_str(), static_cast<long long>(batch),
      static_cast<long long>(seq), static_cast<long long>(steps),
      mib(static_cast<double>(base.device.capacity_bytes)).c_str(), torch::get_num_threads());
  std::fflush(stdout);
  auto [model, optimizer] = build_engine(spec, base, seed);
  ps::Engine& engine = model.engine();
  std::vector<double> overlapped, serial, serial_step, serial_rest, thread_busy, hidden_share;
  int64_t committed = 0, undone = 0, cancelled = 0, buffer_bytes = 0;
  const int64_t first_steady = 2;
  for (int64_t s = 0; s < steps; ++s) {
    const bool overlap = s % 2 == 0;
    engine.set_overlap_step(overlap);
    auto data = batch_of(spec, base, batch, seq, seed + 1 + static_cast<uint64_t>(s));
    const auto start = Clock::now();
    const auto [loss, report] = train_step(model, optimizer, data.tokens, data.targets);
    finish_device_work(base);
    const double t = seconds_since(start);
    std::printf(
        "step %lld/%lld %-10s loss %.5f  %.3f s (step %.3f s, optimizer thread %.3f s, "
        "%lld runs committed, %lld undone, %lld taken back)\n",
        static_cast<long long>(s + 1), static_cast<long long>(steps),
        overlap ? "overlapped" : "serial", loss.item<double>(), t, report.adam_seconds,
        report.optimizer_thread_seconds, static_cast<long long>(report.early_updates_committed),
        static_cast<long long>(report.early_updates_undone),
        static_cast<long long>(report.early_updates_cancelled));
    std::fflush(stdout);
    if (s < first_steady) continue;
    if (overlap) {
      overlapped.push_back(t);
      thread_busy.push_back(report.optimizer_thread_seconds);
      committed += report.early_updates_committed;
      undone += report.early_updates_undone;
      cancelled += report.early_updates_cancelled;
      buffer_bytes = std::max(buffer_bytes, report.early_update_buffer_bytes);
    } else {
      serial.push_back(t);
      serial_step.push_back(report.adam_seconds);
      serial_rest.push_back(t - report.adam_seconds);
    }
  }
  const double o = median(overlapped), sr = median(serial), st = median(serial_step),
               fb = median(serial_rest);
  const double bound = std::max(fb, st);
  std::printf("\nmedians over %zu overlapped and %zu serial steady steps\n", overlapped.size(),
              serial.size());
  std::printf("  serial iteration        %.4f s  (forward + backward %.4f s, step %.4f s)\n", sr,
              fb, st);
  std::printf("  overlapped iteration    %.4f s  (optimizer thread busy %.4f s)\n", o,
              median(thread_busy));
  std::printf("  bound max(F+B, step)    %.4f s\n", bound);
  std::printf("  overlapped / serial     %.3f\n  overlapped / bound      %.3f\n", o / sr,
              o / bound);
  std::printf("  runs committed %lld, undone %lld, indices taken back %lld; undo buffers %s\n",
              static_cast<long long>(committed), static_cast<long long>(undone),
              static_cast<long long>(cancelled), mib(static_cast<double>(buffer_bytes)).c_str());
  nlohmann::json out = run_header(spec, base, batch, seq);
  out["steps"] = steps;
  out["serial_s"] = sr;
  out["serial_forward_backward_s"] = fb;
  out["serial_step_s"] = st;
  out["overlapped_s"] = o;
  out["optimizer_thread_s"] = median(thread_busy);
  out["bound_s"] = bound;
  out["overlapped_to_serial"] = o / sr;
  out["overlapped_to_bound"] = o / bound;
  out["runs_committed"] = committed;
  out["runs_undone"] = undone;
  out["indices_taken_back"] = cancelled;
  out["undo_buffer_bytes"] = buffer_bytes;
  write_json_if_asked(out);
  return 0;
}

}  // namespace ps_bench
