// ps_bench --compare-activations: the activation policies ("none", "recompute", "offload", "auto")
// trained side by side in one process, one step of each per round, the order rotating; and
// --longest-seq: the longest sequence each of "none" and "auto" trains at the --device capacity.
#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"

#include "patrickstar/models/gpt.h"
#include "patrickstar/models/llama.h"
#include "patrickstar/patrickstar.h"
#include "ps_bench_common.h"

namespace ps_bench {
namespace {

ps::Config with_policy(const ps::Config& base, const std::string& policy) {
  nlohmann::json j = base.to_json();
  j["activation_checkpointing"]["policy"] = policy;
  ps::Config config = ps::Config::from_json(j);
  config.device.capacity_bytes = base.device.capacity_bytes;
  return config;
}

std::string first_line(const std::string& text) {
  return text.substr(0, std::min(text.find('\n'), size_t{200}));
}

// Whether `policy` trains `steps` steps of `spec` at sequence length `seq`; `why` gets the error.
template <class Spec>
bool trains(const ps::Config& base, const Spec& spec, const std::string& policy, int64_t batch,
            int64_t seq, int64_t steps, uint64_t seed, std::string* why) {
  try {
    auto [model, optimizer] = build_engine(spec, with_policy(base, policy), seed);
    for (int64_t s = 0; s < steps; ++s) {
      auto data = batch_of(spec, base, batch, seq, seed + 1 + static_cast<uint64_t>(s));
      train_step(model, optimizer, data.tokens, data.targets);
    }
    finish_device_work(base);
    return true;
  } catch (const std::exception& e) {
    *why = first_line(e.what());
    return false;
  }
}

}  // namespace

template <class Spec>
int compare_activations(const ps::Config& base, Spec spec, int64_t batch, int64_t seq,
                        int64_t steps, uint64_t seed) {
  TORCH_CHECK(steps >= 5,
              "--compare-activations needs --steps >= 5 (warm-up, auto's plan and "
              "its second warm-up, and at least two steady rounds)");
  spec.checkpoint_activations = true;  // every block through patrickstar::checkpoint
  struct Mode {
    std::string policy;
    std::optional<decltype(build_engine(spec, base, seed))> engine = std::nullopt;
    std::string refused = {};
    std::vector<double> times = {}, losses = {};
    int64_t non_model_peak = 0, offloaded = 0;
  };
  std::vector<Mode> modes;
  for (const char* policy : {"none", "recompute", "offload", "auto"}) modes.push_back({policy});
  std::printf(
      "compare-activations: %s, %lld parameters, %s, batch %lld, seq %lld, %lld rounds, "
      "device %s, %d intra-op threads\n",
      spec.name.c_str(), static_cast<long long>(spec.parameter_count()),
      std::string(ps::to_string(base.precision())).c_str(), static_cast<long long>(batch),
      static_cast<long long>(seq), static_cast<long long>(steps),
      mib(static_cast<double>(base.device.capacity_bytes)).c_str(), torch::get_num_threads());
  std::fflush(stdout);
  for (Mode& m : modes) {
    try {
      m.engine.emplace(build_engine(spec, with_policy(base, m.policy), seed));
    } catch (const std::exception& e) {
      m.refused = first_line(e.what());
    }
  }
  const int64_t first_steady = 3;  // auto plans after round 1 and records again in round 2
  for (int64_t r = 0; r < steps; ++r) {
    auto data = batch_of(spec, base, batch, seq, seed + 1 + static_cast<uint64_t>(r));
    std::string line;
    for (size_t k = 0; k < modes.size(); ++k) {
      Mode& m = modes[(static_cast<size_t>(r) + k) % modes.size()];
      if (!m.engine) continue;
      auto& [model, optimizer] = *m.engine;
      try {
        const auto start = Clock::now();
        const auto [loss, report] = train_step(model, optimizer, data.tokens, data.targets);
        finish_device_work(base);
        const double t = seconds_since(start);
        m.losses.push_back(loss.template item<double>());
        if (r >= first_steady) {
          m.times.push_back(t);
          m.non_model_peak = std::max(m.non_model_peak, report.non_model_peak_bytes);
          m.offloaded = report.activation_offload_bytes;
        }
      } catch (const std::exception& e) {
        m.refused = first_line(e.what());
        m.engine.reset();
      }
    }
    for (const Mode& m : modes) {
      line += m.engine ? absl::StrCat("  ", m.policy, " loss ", m.losses.back())
                       : absl::StrCat("  ", m.policy, " refused");
    }
    std::printf("round %lld/%lld%s\n", static_cast<long long>(r + 1), static_cast<long long>(steps),
                line.c_str());
    std::fflush(stdout);
  }
  double fastest = 0;  // of the three fixed policies that trained
  for (const Mode& m : modes) {
    if (m.engine && m.policy != "auto" && (fastest == 0 || median(m.times) < fastest)) {
      fastest = median(m.times);
    }
  }
  nlohmann::json out = {{"model", spec.name},
                        {"params", spec.parameter_count()},
                        {"dtype", std::string(ps::to_string(base.precision()))},
                        {"batch", batch},
                        {"seq", seq},
                        {"rounds", steps},
                        {"device_capacity_bytes", base.device.capacity_bytes},
                        {"intra_op_threads", torch::get_num_threads()}};
  std::printf(
      "\nmedian step over %lld steady rounds; activation peak: the most non-model bytes "
      "(activations and temporaries) the device held in a steady round\n",
      static_cast<long long>(steps - first_steady));
  std::printf("%-10s %12s %16s %20s %16s\n", "policy", "step (s)", "x fastest fixed",
              "activation peak (B)", "offloaded (B)");
  for (const Mode& m : modes) {
    if (!m.engine) {
      std::printf("%-10s refused: %s\n", m.policy.c_str(), m.refused.c_str());
      out[m.policy] = {{"refused", m.refused}};
      continue;
    }
    const double step = median(m.times);
    std::printf("%-10s %12.4f %16.3f %20lld %16lld\n", m.policy.c_str(), step,
                fastest > 0 ? step / fastest : 0.0, static_cast<long long>(m.non_model_peak),
                static_cast<long long>(m.offloaded));
    out[m.policy] = {{"step_s", step},
                     {"to_fastest_fixed", fastest > 0 ? step / fastest : 0.0},
                     {"non_model_peak_bytes", m.non_model_peak},
                     {"offloaded_bytes_per_iter", m.offloaded},
                     {"losses", m.losses}};
  }
  for (Mode& m : modes) {
    if (m.policy == "auto" && m.engine) {
      const ps::ActivationPlanReport plan = m.engine->first.engine().activation_plan();
      std::printf("\n%s", plan.text().c_str());
      out["auto"]["predicted_step_s"] = plan.predicted_step_seconds;
    }
  }
  write_json_if_asked(out);
  return 0;
}

template <class Spec>
int longest_seq(const ps::Config& base, Spec spec, int64_t batch, int64_t steps, uint64_t seed) {
  spec.checkpoint_activations = true;
  std::printf("longest-seq: %s, %s, batch %lld, %lld steps per trial, device %s\n",
              spec.name.c_str(), std::string(ps::to_string(base.precision())).c_str(),
              static_cast<long long>(batch), static_cast<long long>(steps),
              mib(static_cast<double>(base.device.capacity_bytes)).c_str());
  nlohmann::json out = {{"model", spec.name},
                        {"batch", batch},
                        {"device_capacity_bytes", base.device.capacity_bytes}};
  std::vector<int64_t> longest;
  for (const char* policy : {"none", "auto"}) {
    // Doubling from 16 positions, then halving the gap between the last that trained and the
    // first that did not, down to 1/16 of it.
    int64_t good = 0, bad = spec.max_seq + 1;
    std::string why;
    for (int64_t seq = 16; seq <= spec.max_seq; seq *= 2) {
      const bool ok = trains(base, spec, policy, batch, seq, steps, seed, &why);
      std::printf("  %-5s seq %5lld: %s\n", policy, static_cast<long long>(seq),
                  ok ? "trains" : ("refused: " + why).c_str());
      std::fflush(stdout);
      if (!ok) {
        bad = seq;
        break;
      }
      good = seq;
    }
    if (good == 0) {
      longest.push_back(0);
      continue;
    }
    if (bad > spec.max_seq && good < spec.max_seq) {
      // Every doubling trained: the model's own length is the last candidate.
      if (trains(base, spec, policy, batch, spec.max_seq, steps, seed, &why)) good = spec.max_seq;
    }
    const int64_t step = std::max<int64_t>(1, (bad - good) / 16);
    while (bad <= spec.max_seq && bad - good > step) {
      const int64_t seq = good + (bad - good) / 2;
      const bool ok = trains(base, spec, policy, batch, seq, steps, seed, &why);
      std::printf("  %-5s seq %5lld: %s\n", policy, static_cast<long long>(seq),
                  ok ? "trains" : "refused");
      std::fflush(stdout);
      (ok ? good : bad) = seq;
    }
    longest.push_back(good);
    out[std::string(policy) + "_longest_seq"] = good;
  }
  const double ratio = longest[0] > 0 ? static_cast<double>(longest[1]) / longest[0] : 0.0;
  std::printf("longest seq that trains: none %lld, auto %lld (auto / none %.2f)\n",
              static_cast<long long>(longest[0]), static_cast<long long>(longest[1]), ratio);
  out["auto_to_none"] = ratio;
  write_json_if_asked(out);
  return 0;
}

template int compare_activations(const ps::Config&, ps::models::GptSpec, int64_t, int64_t, int64_t,
                                 uint64_t);
template int compare_activations(const ps::Config&, ps::models::LlamaSpec, int64_t, int64_t,
                                 int64_t, uint64_t);
template int longest_seq(const ps::Config&, ps::models::GptSpec, int64_t, int64_t, uint64_t);
template int longest_seq(const ps::Config&, ps::models::LlamaSpec, int64_t, int64_t, uint64_t);

}  // namespace ps_bench
