// ps_bench --compare-delayed: the delayed parameter update against updating at the step, two
// engines on the same data in one run.
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
// Two engines of the same model and data stream: "serial" updates at its step, "delayed" hands its
// update to its thread (warm-up 2 steps). They train in alternating blocks of kBlock steps, so
// that the delayed engine's thread runs during its own engine's forward and backward, as in
// training: at a block's end the update in flight is waited for untimed (set_lr waits, writes
// nothing) before the other engine runs. So a block's first delayed step found its predecessor done
// for free: it is left out, with the warm-up, the first scheduled steps and each engine's first
// block. From the serial steps: the step alone (adam_seconds) and forward + backward alone; the
// bound is the larger. Medians.
int compare_delayed(const ps::Config& base, const ps::models::GptSpec& spec, int64_t batch,
                    int64_t seq, int64_t steps, uint64_t seed) {
  constexpr int64_t kBlock = 4;
  TORCH_CHECK(steps >= 3 * kBlock, "--compare-delayed needs --steps >= ", 3 * kBlock,
              " (blocks of ", kBlock, " steps per engine; the first block is the warm-up)");
  ps::Config serial_config = base;
  serial_config.delayed_update.enabled = false;
  serial_config.overlap_step.mode = ps::OverlapMode::kOff;
  ps::Config delayed_config = serial_config;
  delayed_config.delayed_update.enabled = true;
  delayed_config.delayed_update.warmup_steps = 2;
  std::printf(
      "compare-delayed: %s, %lld parameters, %s, batch %lld, seq %lld, %lld steps per "
      "engine, device %s each, %d intra-op threads (the update's thread takes the cores "
      "left, at least one)\n",
      spec.name.c_str(), static_cast<long long>(spec.parameter_count()),
      std::string(ps::to_string(base.precision())).c_str(), static_cast<long long>(batch),
      static_cast<long long>(seq), static_cast<long long>(steps),
      mib(static_cast<double>(base.device.capacity_bytes)).c_str(), torch::get_num_threads());
  std::fflush(stdout);
  auto [serial_model, serial_optimizer] = build_engine(spec, serial_config, seed);
  auto [delayed_model, delayed_optimizer] = build_engine(spec, delayed_config, seed);
  std::vector<double> serial, serial_step, serial_rest, delayed, waited, thread_busy;
  int64_t buffer_bytes = 0;
  for (int64_t block = 0; block * kBlock < steps; ++block) {
    for (const bool is_delayed : {false, true}) {
      for (int64_t k = 0; k < kBlock && block * kBlock + k < steps; ++k) {
        const int64_t s = block * kBlock + k;
        auto data = batch_of(spec, base, batch, seq, seed + 1 + static_cast<uint64_t>(s));
        const auto start = Clock::now();
        const auto [loss, report] =
            is_delayed ? train_step(delayed_model, delayed_optimizer, data.tokens, data.targets)
                       : train_step(serial_model, serial_optimizer, data.tokens, data.targets);
        finish_device_work(base);
        const double t = seconds_since(start);
        std::printf(
            "step %lld/%lld %-8s loss %.5f  %.3f s (step %.3f s, waited for the update "
            "%.3f s, its thread %.3f s)\n",
            static_cast<long long>(s + 1), static_cast<long long>(steps),
            is_delayed ? "delayed" : "serial", loss.item<double>(), t, report.adam_seconds,
            report.delayed_update_wait_seconds, report.optimizer_thread_seconds);
        std::fflush(stdout);
        if (block == 0) continue;
        if (!is_delayed) {
          serial.push_back(t);
          serial_step.push_back(report.adam_seconds);
          serial_rest.push_back(t - report.adam_seconds);
        } else if (k > 0 && report.update_delayed) {
          delayed.push_back(t);
          waited.push_back(report.delayed_update_wait_seconds);
          thread_busy.push_back(report.optimizer_thread_seconds);
          buffer_bytes = std::max(buffer_bytes, report.delayed_update_buffer_bytes);
        }
      }
      // The update in flight finishes before the other engine runs (untimed; nothing written).
      if (is_delayed) delayed_model.engine().set_lr(delayed_model.engine().lr());
    }
  }
  TORCH_CHECK(!delayed.empty() && !serial.empty(), "--compare-delayed: no steady steps measured");
  const double d = median(delayed), sr = median(serial), st = median(serial_step),
               fb = median(serial_rest);
  const double bound = std::max(fb, st);
  std::printf("\nmedians over %zu delayed and %zu serial steady steps\n", delayed.size(),
              serial.size());
  std::printf("  serial iteration        %.4f s  (forward + backward %.4f s, step %.4f s)\n", sr,
              fb, st);
  std::printf(
      "  delayed iteration       %.4f s  (waited for the update %.4f s, its thread busy "
      "%.4f s)\n",
      d, median(waited), median(thread_busy));
  std::printf("  bound max(F+B, step)    %.4f s\n", bound);
  std::printf("  delayed / serial        %.3f\n  delayed / bound         %.3f\n", d / sr,
              d / bound);
  std::printf("  the update's copies     %s\n", mib(static_cast<double>(buffer_bytes)).c_str());
  nlohmann::json out = run_header(spec, base, batch, seq);
  out["steps"] = steps;
  out["serial_s"] = sr;
  out["serial_forward_backward_s"] = fb;
  out["serial_step_s"] = st;
  out["delayed_s"] = d;
  out["delayed_wait_s"] = median(waited);
  out["optimizer_thread_s"] = median(thread_busy);
  out["bound_s"] = bound;
  out["delayed_to_serial"] = d / sr;
  out["delayed_to_bound"] = d / bound;
  out["delayed_buffer_bytes"] = buffer_bytes;
  write_json_if_asked(out);
  return 0;
}

}  // namespace ps_bench
