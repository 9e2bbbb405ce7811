// ps_bench --compare-moves: resident, synchronous and asynchronous moves, interleaved.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <vector>
#include <torch/torch.h>
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "patrickstar/chunk/cuda_device_tier.h"
#include "patrickstar/memtracer/export.h"
#include "patrickstar/memtracer/simulator.h"
#include "dashed_flags.h"
#include "gpu_prediction.h"
#include "patrickstar/memtracer/cost_model.h"
#include "patrickstar/models/gpt.h"
#include "patrickstar/patrickstar.h"
#include "ps_bench_common.h"
#include "ps_bench_flags.h"

namespace ps_bench {
// --compare-moves: the same model trained three ways in one process, one step of each per round
// (the order rotating), on the same data: everything resident (a device that holds the whole
// model), and --device with synchronous and with asynchronous moves. Medians over the steady
// rounds (after the warm-up and the first scheduled step), as ratios to the resident run.
int compare_moves(const ps::Config& base, const ps::models::GptSpec& spec, int64_t batch,
                  int64_t seq, int64_t steps, uint64_t seed) {
  TORCH_CHECK(steps >= 4, "--compare-moves needs --steps >= 4 (warm-up, first scheduled step, and "
              "at least two steady rounds)");
  struct Mode {
    std::string name;
    ps::Config config;
    std::vector<double> times, waits, losses;
    double h2d = 0, d2h = 0;
  };
  std::vector<Mode> modes(3);
  modes[0].name = "resident";
  modes[1].name = "sync";
  modes[2].name = "async";
  for (Mode& m : modes) {
    nlohmann::json j = base.to_json();
    j["client"]["scheduler"]["async_moves"] = m.name != "sync";
    if (m.name == "resident") {
      // Holds any model here. On a GPU the three engines share its memory: the resident one gets
      // what the other two leave of what GPU 0 has free.
      int64_t resident = int64_t{64} << 30;
#ifdef PATRICKSTAR_HAVE_CUDA
      if (base.device.type == ps::DeviceType::kCuda) {
        const int64_t cap = base.device.capacity_bytes;
        const int64_t available = ps::CudaDeviceTier::available_memory_bytes(0);
        TORCH_CHECK(cap <= available / 3, "--compare-moves on CUDA builds three engines side by "
                    "side on GPU 0 (resident, sync, async): give --device cuda:<bytes> with at "
                    "most a third of the ", available, " bytes GPU 0 has free (got ", cap,
                    " bytes, \"auto\" being all of it)");
        resident = available - 2 * cap;
      }
#endif
      j["client"]["device"]["capacity_bytes"] = resident;
    }
    m.config = ps::Config::from_json(j);
  }
  std::printf("compare-moves: %s, %lld parameters, %s, batch %lld, seq %lld, %lld rounds, device "
              "%s (resident: %s), %d intra-op threads\n",
              spec.name.c_str(), static_cast<long long>(spec.parameter_count()),
              std::string(ps::to_string(base.precision())).c_str(), static_cast<long long>(batch),
              static_cast<long long>(seq), static_cast<long long>(steps),
              mib(static_cast<double>(base.device.capacity_bytes)).c_str(),
              mib(static_cast<double>(modes[0].config.device.capacity_bytes)).c_str(),
              torch::get_num_threads());
  std::fflush(stdout);
  // Three engines side by side (each registers its own copy of the model).
  std::vector<decltype(build_engine(spec, base, seed))> engines;
  for (const Mode& m : modes) engines.push_back(build_engine(spec, m.config, seed));
  const size_t first_steady = 2;
  for (int64_t r = 0; r < steps; ++r) {
    auto data = batch_of(spec, base, batch, seq, seed + 1 + static_cast<uint64_t>(r));
    std::string line;
    for (size_t k = 0; k < modes.size(); ++k) {
      const size_t i = (static_cast<size_t>(r) + k) % modes.size();
      auto& [model, optimizer] = engines[i];
      const auto start = Clock::now();
      const auto [loss, report] = train_step(model, optimizer, data.tokens, data.targets);
      finish_device_work(base);
      const double t = seconds_since(start);
      Mode& m = modes[i];
      m.losses.push_back(loss.item<double>());
      if (static_cast<size_t>(r) >= first_steady) {
        m.times.push_back(t);
        m.waits.push_back(report.copy_wait_seconds);
        m.h2d += static_cast<double>(report.h2d_bytes);
        m.d2h += static_cast<double>(report.d2h_bytes);
      }
    }
    for (const Mode& m : modes) {
      absl::StrAppendFormat(&line, "  %s loss %.5f", m.name, m.losses.back());
    }
    std::printf("round %lld/%lld%s\n", static_cast<long long>(r + 1), static_cast<long long>(steps),
                line.c_str());
    std::fflush(stdout);
  }
  const double rounds = static_cast<double>(steps) - static_cast<double>(first_steady);
  nlohmann::json out = run_header(spec, base, batch, seq);
  out["rounds"] = steps;
  out["steady_rounds"] = rounds;
  out["device_capacity_bytes"] = base.device.capacity_bytes;
  const double resident = median(modes[0].times);
  for (const Mode& m : modes) {
    const double step = median(m.times);
    out[m.name + "_step_s"] = step;
    out[m.name + "_to_resident"] = step / resident;
    out[m.name + "_copy_wait_s_per_iter"] = mean(m.waits);
    out[m.name + "_h2d_bytes_per_iter"] = m.h2d / rounds;
    out[m.name + "_d2h_bytes_per_iter"] = m.d2h / rounds;
  }
  // Asynchronous moves change when bytes cross, never what is computed.
  out["async_losses_equal_sync"] = modes[2].losses == modes[1].losses;
  const double worst = max_relative_difference(modes[1].losses, modes[0].losses);
  out["moved_vs_resident_max_relative_loss_difference"] = worst;
  std::printf("\nmedian step times; copy wait: the mean time compute waited for copies\n");
  std::printf("%-8s %12s %12s %14s %14s %14s\n", "moves", "step (s)", "x resident",
              "copy wait (s)", "h2d/iter", "d2h/iter");
  for (const Mode& m : modes) {
    std::printf("%-8s %12.5f %12.3f %14.5f %14s %14s\n", m.name.c_str(), median(m.times),
                median(m.times) / resident, mean(m.waits), mib(m.h2d / rounds).c_str(),
                mib(m.d2h / rounds).c_str());
  }
  std::printf("async losses equal sync bit for bit: %s; moved vs resident losses: max relative "
              "difference %.3g\n",
              modes[2].losses == modes[1].losses ? "yes" : "NO", worst);
  write_json_if_asked(out);
  TORCH_CHECK(modes[2].losses == modes[1].losses,
              "compare-moves: asynchronous moves changed the losses");
  return 0;
}

}  // namespace ps_bench
