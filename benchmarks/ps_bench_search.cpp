// ps_bench --find-max-model: the largest GPT each policy trains within the budgets.
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
#include "patrickstar/engine/engine_inspect.h"
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
// --find-max-model: for each policy, the most layers of a GPT at a fixed hidden size that complete
// a few training steps within the device and host budgets. Layers grow by doubling until a trial
// fails, then bisect (a model that fails is assumed to fail with more layers too).
struct Trial {
  bool ok = false;
  std::string error;  // the first line of the failure
  int64_t params = 0;
  int64_t model_data_bytes = 0;
  int64_t device_state_bytes = 0;  // optimizer states placed on the device at registration
  int64_t device_peak_bytes = 0;
  int64_t host_peak_bytes = 0;
  double seconds = 0;
};

Trial run_trial(const ps::models::GptSpec& spec, const ps::Config& config, int64_t batch,
                int64_t seq, int64_t steps, uint64_t seed) {
  Trial trial;
  const auto start = Clock::now();
  try {
    auto [model, optimizer] = build_engine(spec, config, seed);
    ps::Engine& engine = model.engine();
    for (int64_t s = 0; s < steps; ++s) {
      auto data = batch_of(spec, config, batch, seq, seed + 1 + static_cast<uint64_t>(s));
      const at::Tensor loss = train_step(model, optimizer, data.tokens, data.targets).loss;
      TORCH_CHECK(std::isfinite(loss.item<double>()), "the loss is not finite");
      trial.device_peak_bytes = std::max(trial.device_peak_bytes,  // the history is bounded
                                         inspect(engine).scheduler().history().back().peak_device_bytes);
    }
    trial.ok = true;
    trial.params = engine.registration().params;
    trial.model_data_bytes = engine.registration().model_data_bytes;
    trial.device_state_bytes = engine.registration().device_state_bytes;
    trial.host_peak_bytes = inspect(engine).host_tier().peak_bytes();
  } catch (const c10::Error& e) {
    trial.error = e.what_without_backtrace();
    trial.error = trial.error.substr(0, trial.error.find('\n'));
  }
  trial.seconds = seconds_since(start);
  return trial;
}

namespace {

// The most layers one policy trains, and the first failing trial's error ("" when --max-layers
// stopped the search).
struct Best {
  std::string policy;
  int64_t layers = 0;
  Trial trial;
  std::string stop;
};

// The limit that stopped a policy, in a word or two, from its first failing trial's error.
std::string limit_of(const std::string& error) {
  if (error.empty()) return "--max-layers";
  auto has = [&](const char* s) { return error.find(s) != std::string::npos; };
  if (has("bytes of host memory")) return "host memory";
  if (has("static_on_device")) return "device: every half weight";
  if (has("activations and temporaries")) return "device: activations";
  if (has("chunk budget") || has("more chunk bytes")) return "device: a moment's chunks";
  if (has("disk") || has("No space")) return "disk";
  if (has("out of memory") || has("OutOfMemory")) return "memory (a tier refused)";
  return "other (see the JSON)";
}

// `policy`'s most layers of `shape` (up to max_layers): layer counts doubled until a trial fails,
// then bisected between the last that trained and the first that failed.
Best search_policy(const std::string& policy, const ps::Config& base_config,
                   const ps::models::GptSpec& shape, const std::string& base_name, int64_t batch,
                   int64_t seq, int64_t steps, uint64_t seed, int64_t max_layers) {
  nlohmann::json j = base_config.to_json();
  j["client"]["scheduler"]["policy"] = policy;
  j["client"]["mem_tracer"]["with_static_partition"] = policy == "static";
  ps::Config config = ps::Config::from_json(j);
  config.warnings.clear();  // reported once by main, not by every trial's engine
  auto attempt = [&](int64_t layers) {
    ps::models::GptSpec spec = shape;
    spec.layers = layers;
    spec.name = absl::StrCat(base_name, "-h", shape.hidden, "-L", layers);
    std::printf("  %-7s layers %5lld  %12lld params ... ", policy.c_str(),
                static_cast<long long>(layers), static_cast<long long>(spec.parameter_count()));
    std::fflush(stdout);
    Trial t = run_trial(spec, config, batch, seq, steps, seed);
    if (t.ok) {
      std::printf("ok (%.1f s)\n", t.seconds);
    } else {
      std::printf("fails (%.1f s): %s\n", t.seconds, t.error.c_str());
    }
    std::fflush(stdout);
    return t;
  };
  Best b{policy, 0, {}, {}};
  int64_t bad = max_layers + 1;  // smallest layer count known to fail
  for (int64_t layers = 1;; layers = std::min(layers * 2, max_layers)) {
    Trial t = attempt(layers);
    if (!t.ok) {
      bad = layers;
      b.stop = t.error;
      break;
    }
    b.layers = layers;
    b.trial = t;
    if (layers == max_layers) break;
  }
  while (b.layers > 0 && bad - b.layers > 1) {
    const int64_t mid = b.layers + (bad - b.layers) / 2;
    Trial t = attempt(mid);
    if (t.ok) {
      b.layers = mid;
      b.trial = t;
    } else {
      bad = mid;
      b.stop = t.error;
    }
  }
  return b;
}

// The table, and its rows as JSON.
nlohmann::json print_results(const std::vector<Best>& best) {
  nlohmann::json results = nlohmann::json::array();
  std::printf("\n%-8s %8s %14s %16s %16s %16s %16s  %s\n", "policy", "layers", "params",
              "model data", "states on dev.", "device peak", "host peak", "limit (one more layer)");
  for (const Best& b : best) {
    std::printf("%-8s %8lld %14lld %16s %16s %16s %16s  %s\n", b.policy.c_str(),
                static_cast<long long>(b.layers), static_cast<long long>(b.trial.params),
                mib(static_cast<double>(b.trial.model_data_bytes)).c_str(),
                mib(static_cast<double>(b.trial.device_state_bytes)).c_str(),
                mib(static_cast<double>(b.trial.device_peak_bytes)).c_str(),
                mib(static_cast<double>(b.trial.host_peak_bytes)).c_str(), limit_of(b.stop).c_str());
    results.push_back({{"policy", b.policy},
                       {"max_layers", b.layers},
                       {"params", b.trial.params},
                       {"limit", limit_of(b.stop)},
                       {"limit_error", b.stop},
                       {"device_state_bytes", b.trial.device_state_bytes},
                       {"model_data_bytes", b.trial.model_data_bytes},
                       {"device_peak_bytes", b.trial.device_peak_bytes},
                       {"host_peak_bytes", b.trial.host_peak_bytes}});
  }
  return results;
}

}  // namespace

int find_max_model(const ps::Config& base_config, const ps::models::GptSpec& base, int64_t batch,
                   int64_t seq, uint64_t seed) {
  TORCH_CHECK(base_config.device.host_capacity_bytes > 0,
              "--find-max-model needs a host budget (--host-memory, e.g. 512MiB): without one the "
              "engine's host side never runs out");
  const int64_t steps = absl::GetFlag(FLAGS_search_steps);
  const int64_t max_layers = absl::GetFlag(FLAGS_max_layers);
  TORCH_CHECK(steps >= 2, "--search-steps must be at least 2 (the warm-up and a scheduled step)");
  TORCH_CHECK(max_layers >= 1, "--max-layers must be positive");
  ps::models::GptSpec shape = base;
  if (absl::GetFlag(FLAGS_hidden) > 0) shape.hidden = absl::GetFlag(FLAGS_hidden);
  TORCH_CHECK(shape.hidden % shape.heads == 0, "--hidden ", shape.hidden,
              " is not a multiple of the ", shape.heads, " heads of ", base.name);
  std::vector<std::string> policies;
  for (const std::string& p : std::vector<std::string>(
           absl::StrSplit(absl::GetFlag(FLAGS_search_policies), ','))) {
    ps::parse_eviction_policy(p);  // a clear error for a typo, before any trial
    policies.push_back(p);
  }
  std::printf("find-max-model: GPT hidden %lld, heads %lld, vocab %lld, %s%s, batch %lld, seq "
              "%lld, device %s, host %s, %lld steps per trial\n",
              static_cast<long long>(shape.hidden), static_cast<long long>(shape.heads),
              static_cast<long long>(shape.vocab),
              std::string(ps::to_string(base_config.precision())).c_str(),
              shape.checkpoint_activations ? ", activation checkpointing" : "",
              static_cast<long long>(batch), static_cast<long long>(seq),
              mib(static_cast<double>(base_config.device.capacity_bytes)).c_str(),
              mib(static_cast<double>(base_config.device.host_capacity_bytes)).c_str(),
              static_cast<long long>(steps));
  std::fflush(stdout);

  std::vector<Best> best;
  for (const std::string& policy : policies) {
    best.push_back(search_policy(policy, base_config, shape, base.name, batch, seq, steps, seed,
                                 max_layers));
  }
  nlohmann::json out;
  out["hidden"] = shape.hidden;
  out["checkpoint_activations"] = shape.checkpoint_activations;
  out["heads"] = shape.heads;
  out["vocab"] = shape.vocab;
  out["dtype"] = std::string(ps::to_string(base_config.precision()));
  out["batch"] = batch;
  out["seq"] = seq;
  out["device_capacity_bytes"] = base_config.device.capacity_bytes;
  out["host_capacity_bytes"] = base_config.device.host_capacity_bytes;
  out["search_steps"] = steps;
  out["results"] = print_results(best);
  auto params_of = [&](const std::string& policy) -> int64_t {
    for (const Best& b : best) {
      if (b.policy == policy) return b.trial.params;
    }
    return 0;
  };
  if (params_of("opt") > 0 && params_of("static") > 0) {
    const double ratio = static_cast<double>(params_of("opt")) /
                         static_cast<double>(params_of("static"));
    out["opt_to_static_params"] = ratio;
    std::printf("largest model under opt / under static: %.2fx the parameters\n", ratio);
  }
  if (!absl::GetFlag(FLAGS_json).empty()) {
    ps::write_text_file(absl::GetFlag(FLAGS_json), out.dump(2) + "\n");
    std::printf("wrote %s\n", absl::GetFlag(FLAGS_json).c_str());
  }
  return 0;
}

}  // namespace ps_bench
