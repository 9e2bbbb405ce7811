// ps_bench: the main job. Trains a GPT of the model zoo through the patrickstar engine on random
// tokens (fixed seed), prints one line per step and a summary table, and writes the figures as JSON,
// the chunk timeline as a Chrome trace and the memory timeline as SVG. With --baseline it also
// trains the same model on the same data with plain LibTorch and torch::optim::AdamW in the same
// run, so speed is a ratio and the losses can be compared. See BENCHMARKS.md.
// Data parallel: under mpirun every rank trains its rows of the global --batch; rank 0 prints the
// steps (the global batch's loss), every rank's figures (model data, collective bytes against
// their formula, time in collectives) and writes the files.
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

ABSL_FLAG(std::string, model, "gpt_mini", "GPT size from the model zoo (see --list-models)");
ABSL_FLAG(bool, list_models, false, "print the model zoo with parameter counts and exit");
ABSL_FLAG(int64_t, batch, 4, "sequences per step");
ABSL_FLAG(int64_t, seq, 0, "tokens per sequence (0: the model's own length)");
ABSL_FLAG(int64_t, steps, 6, "training steps (the first is the warm-up)");
ABSL_FLAG(std::string, dtype, "", "fp32, bf16 or fp16 (default: the config's, else fp32)");
ABSL_FLAG(std::string, device, "",
          "emulated:<bytes> (e.g. emulated:64MiB), cuda, or cuda:<bytes> (a cap below the GPU's "
          "memory; cuda alone: the config's capacity_bytes, by default what GPU 0 has free)");
ABSL_FLAG(std::string, host_memory, "", "host capacity for chunks, e.g. 8GiB (default unlimited)");
ABSL_FLAG(std::string, offload_nvme, "",
          "a folder for the disk tier: the host Adam's optimizer states live in files there "
          "(zero_optimization.offload_optimizer \"nvme\")");
ABSL_FLAG(std::string, policy, "", "chunk eviction policy: opt, lru or static");
ABSL_FLAG(std::string, chunk_size, "", "elements per chunk, or auto");
ABSL_FLAG(std::string, config, "", "a patrickstar JSON config; the flags above override it");
ABSL_FLAG(bool, baseline, false, "also train with plain LibTorch + torch::optim::AdamW");
ABSL_FLAG(std::string, moves, "", "chunk moves: async (a copy thread, or a CUDA copy stream, overlaps compute) or sync (default: the config's, else async)");
ABSL_FLAG(std::string, json, "", "write the figures to this JSON file");
ABSL_FLAG(std::string, trace, "", "write the chunk timeline (Chrome trace-event JSON) here");
ABSL_FLAG(std::string, plot, "", "write the memory timeline (SVG) here");
ABSL_FLAG(uint64_t, seed, 1234, "seed of the weights and the data");
ABSL_FLAG(bool, checkpoint_activations, false,
          "recompute each GPT block in backward (activation checkpointing)");
ABSL_FLAG(bool, find_max_model, false,
          "search, for each of --search-policies, the most layers (at --hidden) that complete "
          "--search-steps training steps within --device and --host-memory");
ABSL_FLAG(int64_t, hidden, 0, "--find-max-model: hidden size (0: the model's)");
ABSL_FLAG(int64_t, max_layers, 4096, "--find-max-model: the most layers tried");
ABSL_FLAG(std::string, search_policies, "opt,static", "--find-max-model: policies to compare");
ABSL_FLAG(int64_t, search_steps, 3, "--find-max-model: steps a trial must complete (warm-up included)");
ABSL_FLAG(bool, compare_moves, false,
          "train the model three ways in one run, one step of each per round: everything "
          "resident, and --device with synchronous and with asynchronous moves; print the median "
          "step times as ratios to the resident run and the copy time compute waited for (on "
          "CUDA the three share GPU 0: --device cuda:<bytes> at most a third of its free memory)");
ABSL_FLAG(std::string, predict, "",
          "also predict the step time on a GPU (h100) from the iteration this run recorded: "
          "memtracer's cost model, its assumptions printed beside the figures");
ABSL_FLAG(bool, check_flags, false,
          "check the flags against the model zoo and the config (a model's positions, --predict's "
          "GPU, the device's form) without building anything, print the run they describe, exit "
          "(scripts/gpu-check --dry-run checks its GPU command lines so)");
ABSL_FLAG(int64_t, threads, 0,
          "LibTorch intra-op threads (0: LibTorch's default); e.g. one fewer than the cores "
          "leaves a core to the emulated device's copy thread, as a GPU's copy engine is its own");

namespace ps = patrickstar;
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double mean(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x;
  return v.empty() ? 0 : sum / static_cast<double>(v.size());
}

// The largest |a[i] - b[i]| / |b[i]| over the steps both ran.
double max_relative_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    worst = std::max(worst, std::abs(a[i] - b[i]) / std::max(1e-12, std::abs(b[i])));
  }
  return worst;
}

std::string mib(double bytes) { return absl::StrFormat("%.2f MiB", bytes / (1024.0 * 1024.0)); }

// A line of /proc/self/status in bytes ("VmHWM", "VmRSS"); -1 where there is none.
int64_t proc_status_bytes(const std::string& key) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(key + ":", 0) == 0) return std::atoll(line.c_str() + key.size() + 1) * 1024;
  }
  return -1;
}

// The process's resident bytes when main began: LibTorch's and the other libraries' own share.
int64_t g_rss_at_start = -1;

// Where the bytes were at a peak (Engine::device_peak_breakdown / host_peak_breakdown), printed
// as a table and returned for the JSON.
nlohmann::json print_breakdown(const char* title, const ps::MemoryBreakdown& b,
                               int64_t device_capacity) {
  nlohmann::json j = {{"iteration", b.iteration}, {"moment", b.moment}};
  std::printf("memory at the %s (iteration %lld, moment \"%s\"):\n", title,
              static_cast<long long>(b.iteration), b.moment.c_str());
  std::printf("  %-46s %14s %14s\n", "", "device", "host");
  for (int k = 0; k < ps::kChunkKindCount; ++k) {
    const int64_t d = b.device_chunk_bytes[static_cast<size_t>(k)];
    const int64_t h = b.host_chunk_bytes[static_cast<size_t>(k)];
    if (d == 0 && h == 0) continue;
    const std::string kind(ps::to_string(static_cast<ps::ChunkKind>(k)));
    std::printf("  %-46s %14s %14s\n", (kind + " chunks").c_str(), mib(static_cast<double>(d)).c_str(),
                mib(static_cast<double>(h)).c_str());
    j["chunks"][kind] = {{"device_bytes", d}, {"host_bytes", h}};
  }
  const int64_t device_other = b.device_used_bytes - b.device_chunk_total();
  const int64_t host_other = b.host_used_bytes - b.host_chunk_total();
  std::printf("  %-46s %14s %14s\n", "other tier blocks (copies in flight, gathers)",
              mib(static_cast<double>(device_other)).c_str(),
              mib(static_cast<double>(host_other)).c_str());
  std::printf("  %-46s %14s %14s\n", "cached tier blocks (kept for reuse)",
              mib(static_cast<double>(b.device_cached_bytes)).c_str(),
              mib(static_cast<double>(b.host_cached_bytes)).c_str());
  std::printf("  %-46s %14s\n", "non-model (the tracer's probe)",
              mib(static_cast<double>(b.device_non_model_bytes)).c_str());
  std::printf("  %-46s %14s %14s  (device capacity %s)\n", "total",
              mib(static_cast<double>(b.device_total() + b.device_cached_bytes)).c_str(),
              mib(static_cast<double>(b.host_used_bytes + b.host_cached_bytes)).c_str(),
              mib(static_cast<double>(device_capacity)).c_str());
  j["device_other_block_bytes"] = device_other;
  j["host_other_block_bytes"] = host_other;
  j["device_cached_block_bytes"] = b.device_cached_bytes;
  j["host_cached_block_bytes"] = b.host_cached_bytes;
  j["device_non_model_bytes"] = b.device_non_model_bytes;
  j["device_total_bytes"] = b.device_total();
  j["host_used_bytes"] = b.host_used_bytes;
  return j;
}

ps::Config build_config() {
  ps::Config base;
  if (!absl::GetFlag(FLAGS_config).empty()) base = ps::Config::from_file(absl::GetFlag(FLAGS_config));
  nlohmann::json j = base.to_json();
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  if (!dtype.empty()) {
    TORCH_CHECK(dtype == "fp32" || dtype == "bf16" || dtype == "fp16",
                "--dtype: expected fp32, bf16 or fp16, got \"", dtype, "\"");
    j["fp16"]["enabled"] = dtype == "fp16";
    j["bf16"]["enabled"] = dtype == "bf16";
  }
  const std::string device = absl::GetFlag(FLAGS_device);
  if (!device.empty()) {
    if (device == "cuda" || device.rfind("cuda:", 0) == 0) {
      // cuda:<bytes> caps the device memory patrickstar plans with below the GPU's own.
      j["client"]["device"]["type"] = "cuda";
      if (device != "cuda") {
        j["client"]["device"]["capacity_bytes"] = ps::parse_byte_size(device.substr(5), "--device");
      }
    } else {
      TORCH_CHECK(device.rfind("emulated:", 0) == 0,
                  "--device: expected emulated:<bytes> (e.g. emulated:64MiB), cuda or "
                  "cuda:<bytes>, got \"", device, "\"");
      j["client"]["device"]["type"] = "emulated";
      j["client"]["device"]["capacity_bytes"] = ps::parse_byte_size(device.substr(9), "--device");
    }
  }
  if (!absl::GetFlag(FLAGS_host_memory).empty()) {
    j["client"]["device"]["host_capacity_bytes"] =
        ps::parse_byte_size(absl::GetFlag(FLAGS_host_memory), "--host-memory");
  }
  if (!absl::GetFlag(FLAGS_offload_nvme).empty()) {
    j["zero_optimization"]["offload_optimizer"] = {{"device", "nvme"},
                                                   {"nvme_path", absl::GetFlag(FLAGS_offload_nvme)}};
  }
  if (!absl::GetFlag(FLAGS_moves).empty()) {
    const std::string moves = absl::GetFlag(FLAGS_moves);
    TORCH_CHECK(moves == "async" || moves == "sync", "--moves: expected async or sync, got '", moves, "'");
    j["client"]["scheduler"]["async_moves"] = moves == "async";
  }
  if (!absl::GetFlag(FLAGS_policy).empty()) {
    j["client"]["scheduler"]["policy"] = absl::GetFlag(FLAGS_policy);
    j["client"]["mem_tracer"]["with_static_partition"] = absl::GetFlag(FLAGS_policy) == "static";
  }
  const std::string chunk = absl::GetFlag(FLAGS_chunk_size);
  if (!chunk.empty()) {
    if (chunk == "auto") {
      j["default_chunk_size"] = "auto";
    } else {
      j["default_chunk_size"] = ps::parse_byte_size(chunk, "--chunk-size");
    }
  }
  ps::Config merged = ps::Config::from_json(j);
  merged.warnings = base.warnings;  // the document's unknown keys (to_json() drops them)
  // "auto" (the default) made concrete, so every engine of the run gets the same capacity and the
  // figures name it. --check-flags builds nothing and needs no GPU: it leaves "auto" as it is.
  if (!absl::GetFlag(FLAGS_check_flags)) {
    merged.device.capacity_bytes = ps::resolved_device_capacity(merged);
  }
  return merged;
}

// Step s's batch, where the trainer puts it: on the GPU with --device cuda (inputs are the
// trainer's to move, as in LibTorch; a CPU embedding's door takes its token ids back to the host).
c10::Device batch_device(const ps::Config& config) {
  return config.device.type == ps::DeviceType::kCuda ? c10::Device(c10::kCUDA, 0)
                                                     : c10::Device(c10::kCPU);
}
// A step's time includes its GPU work: kernels are asynchronous on CUDA.
void finish_device_work(const ps::Config& config) {
  if (config.device.type == ps::DeviceType::kCuda) torch::cuda::synchronize();
}
ps::models::TokenBatch batch_of(const ps::models::GptSpec& spec, const ps::Config& config,
                                int64_t batch, int64_t seq, uint64_t seed) {
  ps::models::TokenBatch data = ps::models::random_tokens(spec, batch, seq, seed);
  const c10::Device device = batch_device(config);
  if (!device.is_cpu()) {
    data.tokens = data.tokens.to(device);
    data.targets = data.targets.to(device);
  }
  return data;
}

struct BaselineResult {
  std::vector<double> losses;
  double step_time_s = 0;
};

BaselineResult run_baseline(const ps::models::GptSpec& spec, const ps::Config& config,
                            int64_t batch, int64_t seq, int64_t steps, uint64_t seed, bool print) {
  torch::manual_seed(seed);
  ps::models::Gpt model(spec);
  model->to(batch_device(config));  // plain LibTorch on the GPU with --device cuda
  const auto& o = config.optimizer;
  torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(o.lr)
                                                     .betas({o.beta1, o.beta2})
                                                     .eps(o.eps)
                                                     .weight_decay(o.weight_decay));
  BaselineResult r;
  std::vector<double> times;
  for (int64_t s = 0; s < steps; ++s) {
    auto data = batch_of(spec, config, batch, seq, seed + 1 + static_cast<uint64_t>(s));
    const auto start = Clock::now();
    adamw.zero_grad();
    at::Tensor loss = model->loss(data.tokens, data.targets);
    loss.backward();
    adamw.step();
    finish_device_work(config);
    const double t = seconds_since(start);
    r.losses.push_back(loss.item<double>());
    if (s > 0) times.push_back(t);
    if (print) {
      std::printf("  baseline step %lld/%lld  loss %.5f  %.3f s\n", static_cast<long long>(s + 1),
                  static_cast<long long>(steps), r.losses.back(), t);
    }
  }
  r.step_time_s = median(times);
  return r;
}

// The process's index on its machine under mpirun (0 without a launcher).
int local_rank() {
  const char* text = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
  return text == nullptr ? 0 : std::atoi(text);
}

// The model built from `seed` (the baseline builds the same weights) and registered per `config`.
auto build_engine(const ps::models::GptSpec& spec, const ps::Config& config, uint64_t seed) {
  return ps::initialize_engine(
      [&] {
        torch::manual_seed(seed);
        return ps::models::Gpt(spec);
      },
      local_rank(), config);
}

// Sums `values` over ranks (each rank fills its own slots, the others are zero).
std::vector<double> sum_over_ranks(ps::Communicator& comm, std::vector<double> values) {
  at::Tensor t = torch::tensor(values, at::kDouble);
  comm.all_reduce(t, ps::ReduceOp::kSum);
  return std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
}

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
      optimizer.zero_grad();
      at::Tensor loss = model->loss(data.tokens, data.targets);
      model.backward(loss);
      optimizer.step();
      TORCH_CHECK(std::isfinite(loss.item<double>()), "the loss is not finite");
      trial.device_peak_bytes = std::max(trial.device_peak_bytes,  // the history is bounded
                                         engine.scheduler().history().back().peak_device_bytes);
    }
    trial.ok = true;
    trial.params = engine.registration().params;
    trial.model_data_bytes = engine.registration().model_data_bytes;
    trial.device_state_bytes = engine.registration().device_state_bytes;
    trial.host_peak_bytes = engine.host_tier().peak_bytes();
  } catch (const c10::Error& e) {
    trial.error = e.what_without_backtrace();
    trial.error = trial.error.substr(0, trial.error.find('\n'));
  }
  trial.seconds = seconds_since(start);
  return trial;
}

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

  nlohmann::json results = nlohmann::json::array();
  struct Best {
    std::string policy;
    int64_t layers = 0;
    Trial trial;
    std::string stop;  // the first failing trial's error ("" when --max-layers stopped the search)
  };
  // The limit that stopped a policy, in a word or two, from its first failing trial's error.
  auto limit_of = [](const std::string& error) -> std::string {
    if (error.empty()) return "--max-layers";
    auto has = [&](const char* s) { return error.find(s) != std::string::npos; };
    if (has("bytes of host memory")) return "host memory";
    if (has("static_on_device")) return "device: every half weight";
    if (has("activations and temporaries")) return "device: activations";
    if (has("chunk budget") || has("more chunk bytes")) return "device: a moment's chunks";
    if (has("disk") || has("No space")) return "disk";
    if (has("out of memory") || has("OutOfMemory")) return "memory (a tier refused)";
    return "other (see the JSON)";
  };
  std::vector<Best> best;
  for (const std::string& policy : policies) {
    nlohmann::json j = base_config.to_json();
    j["client"]["scheduler"]["policy"] = policy;
    j["client"]["mem_tracer"]["with_static_partition"] = policy == "static";
    ps::Config config = ps::Config::from_json(j);
    config.warnings.clear();  // reported once by main, not by every trial's engine
    auto attempt = [&](int64_t layers) {
      ps::models::GptSpec spec = shape;
      spec.layers = layers;
      spec.name = absl::StrCat(base.name, "-h", shape.hidden, "-L", layers);
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
    best.push_back(b);
  }

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
  out["results"] = results;
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
      optimizer.zero_grad();
      at::Tensor loss = model->loss(data.tokens, data.targets);
      model.backward(loss);
      const ps::IterationReport report = optimizer.step();
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
  nlohmann::json out;
  out["model"] = spec.name;
  out["params"] = spec.parameter_count();
  out["dtype"] = std::string(ps::to_string(base.precision()));
  out["batch"] = batch;
  out["seq"] = seq;
  out["rounds"] = steps;
  out["steady_rounds"] = rounds;
  out["device_capacity_bytes"] = base.device.capacity_bytes;
  out["intra_op_threads"] = torch::get_num_threads();
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
  if (!absl::GetFlag(FLAGS_json).empty()) {
    ps::write_text_file(absl::GetFlag(FLAGS_json), out.dump(2) + "\n");
    std::printf("wrote %s\n", absl::GetFlag(FLAGS_json).c_str());
  }
  TORCH_CHECK(modes[2].losses == modes[1].losses,
              "compare-moves: asynchronous moves changed the losses");
  return 0;
}

int run() {
  if (absl::GetFlag(FLAGS_list_models)) {
    for (const std::string& name : ps::models::gpt_spec_names()) {
      const auto s = ps::models::gpt_spec(name);
      std::printf("%-15s layers %3lld hidden %5lld heads %3lld  %15lld parameters\n", name.c_str(),
                  static_cast<long long>(s.layers), static_cast<long long>(s.hidden),
                  static_cast<long long>(s.heads), static_cast<long long>(s.parameter_count()));
    }
    return 0;
  }
  TORCH_CHECK(absl::GetFlag(FLAGS_threads) >= 0, "--threads must be 0 (LibTorch's default) or "
              "positive, got ", absl::GetFlag(FLAGS_threads));
  if (absl::GetFlag(FLAGS_threads) > 0) {
    torch::set_num_threads(static_cast<int>(absl::GetFlag(FLAGS_threads)));
  }
  const ps::Config config = build_config();
  auto spec = ps::models::gpt_spec(absl::GetFlag(FLAGS_model));
  spec.checkpoint_activations = absl::GetFlag(FLAGS_checkpoint_activations);
  const int64_t batch = absl::GetFlag(FLAGS_batch);
  const int64_t seq = absl::GetFlag(FLAGS_seq) > 0 ? absl::GetFlag(FLAGS_seq) : spec.max_seq;
  const int64_t steps = absl::GetFlag(FLAGS_steps);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  TORCH_CHECK(batch > 0 && steps >= 2, "--batch must be positive and --steps at least 2 (the first "
              "is the warm-up)");
  TORCH_CHECK(seq <= spec.max_seq, "--seq ", seq, " exceeds the ", spec.max_seq, " positions of ",
              spec.name);

  if (!absl::GetFlag(FLAGS_predict).empty()) ps::gpu_cost_model(absl::GetFlag(FLAGS_predict));  // known?
  if (absl::GetFlag(FLAGS_check_flags)) {
    std::printf("ps_bench: flags accepted: %s, %lld parameters, %s, batch %lld, seq %lld, %lld steps, "
                "device %s%s\n", spec.name.c_str(), static_cast<long long>(spec.parameter_count()),
                std::string(ps::to_string(config.precision())).c_str(), static_cast<long long>(batch),
                static_cast<long long>(seq), static_cast<long long>(steps),
                std::string(ps::to_string(config.device.type)).c_str(),
                config.device.capacity_bytes == ps::DeviceConfig::kAutoCapacity
                    ? " (auto capacity)"
                    : (" " + mib(static_cast<double>(config.device.capacity_bytes))).c_str());
    return 0;
  }
  std::shared_ptr<ps::Communicator> comm = ps::communicator_from_env();
  const int world = comm->world_size();
  const int rank = comm->rank();
  const bool lead = rank == 0;  // prints and writes the files
  TORCH_CHECK(world == 1 || !absl::GetFlag(FLAGS_find_max_model),
              "--find-max-model runs in one process (not under mpirun)");
  TORCH_CHECK(batch % world == 0, "--batch ", batch, " is the global batch: it must divide by the ",
              world, " ranks");
  // The engine reports the config's unknown keys when it is built; the search builds many.
  if (absl::GetFlag(FLAGS_find_max_model)) {
    for (const std::string& w : config.warnings) std::fprintf(stderr, "config warning: %s\n", w.c_str());
  }
  if (absl::GetFlag(FLAGS_find_max_model)) return find_max_model(config, spec, batch, seq, seed);
  if (absl::GetFlag(FLAGS_compare_moves)) {
    TORCH_CHECK(world == 1, "--compare-moves runs in one process (not under mpirun)");
    return compare_moves(config, spec, batch, seq, steps, seed);
  }

  if (lead) std::printf("ps_bench: %s, %lld parameters, %s, batch %lld, seq %lld, %lld steps, device %s %s, "
              "policy %s, %d rank(s)\n", spec.name.c_str(), static_cast<long long>(spec.parameter_count()),
              std::string(ps::to_string(config.precision())).c_str(),
              static_cast<long long>(batch), static_cast<long long>(seq),
              static_cast<long long>(steps), std::string(ps::to_string(config.device.type)).c_str(),
              mib(static_cast<double>(config.device.capacity_bytes)).c_str(),
              ps::eviction_policy_name(config.scheduler.policy), world);
  std::fflush(stdout);

  auto [model, optimizer] = build_engine(spec, config, seed);
  ps::Engine& engine = model.engine();
  // The chunk timeline grows with every iteration: kept only for the outputs that read it.
  if (!absl::GetFlag(FLAGS_trace).empty() || !absl::GetFlag(FLAGS_plot).empty() ||
      !absl::GetFlag(FLAGS_predict).empty()) {
    engine.set_record_timeline(true);  // moves, moments, the copy thread's spans
  }
  const auto& reg = engine.registration();
  if (lead) std::printf("registered: %lld parameters in %lld chunks of %lld elements per kind, waste %.2f%%, "
              "%.2f model-data bytes per parameter\n",
              static_cast<long long>(reg.params), static_cast<long long>(reg.chunks_per_kind),
              static_cast<long long>(reg.chunk_elems), 100.0 * reg.chunk_waste_fraction,
              reg.model_data_bytes_per_param);
  if (lead && reg.disk_bytes > 0) {
    std::printf("disk tier: %s of optimizer states in files under %s; the host holds %s of model "
                "data\n", mib(static_cast<double>(reg.disk_bytes)).c_str(),
                config.offload_optimizer.nvme_path.c_str(),
                mib(static_cast<double>(reg.model_data_bytes - reg.disk_bytes)).c_str());
  }
  if (lead && reg.device_state_bytes > 0) {
    std::printf("host plus device: %s of optimizer states placed on the device for good (the host "
                "budget holds the other %s of model data)\n",
                mib(static_cast<double>(reg.device_state_bytes)).c_str(),
                mib(static_cast<double>(reg.model_data_bytes - reg.device_state_bytes)).c_str());
  }

  std::vector<double> losses, times;
  // What the figures need of the step reports, summed as the steps go (nothing kept per step but
  // the losses and times: a long run holds no more than a short one). The steady iterations come
  // after the warm-up and after the first scheduled iteration, which still moves the warm-up's
  // placement into the schedule's (when there are enough steps).
  const int64_t first_steady = steps > 2 ? 2 : 1;
  const ps::ChunkStore& store = engine.chunks();
  const int64_t param_chunk = store.chunk_bytes(store.chunk_id(ps::ChunkKind::kParam, 0));
  ps::IterationReport warmup_report, last_report;
  double h2d = 0, d2h = 0, forced = 0, copy_wait = 0;
  double adam_s = 0, disk_read = 0, disk_written = 0, disk_wait = 0;
  double gathers = 0, gather_bytes = 0, reduces = 0, reduce_bytes = 0, all_reduce_bytes = 0;
  double collective_s = 0, gathered_peak = 0;
  bool formula_ok = true;  // data parallel: every steady iteration's collective bytes
  int64_t non_model_peak = 0;  // over every iteration
  int64_t device_peak = 0;  // over the steady iterations (the scheduler keeps only the last ones)
  const int64_t rows = batch / world;  // this rank's rows of the global batch
  for (int64_t s = 0; s < steps; ++s) {
    auto data = batch_of(spec, config, batch, seq, seed + 1 + static_cast<uint64_t>(s));
    const at::Tensor tokens = data.tokens.narrow(0, rank * rows, rows);
    const at::Tensor targets = data.targets.narrow(0, rank * rows, rows);
    const auto start = Clock::now();
    optimizer.zero_grad();
    at::Tensor loss = model->loss(tokens, targets);
    model.backward(loss);
    const ps::IterationReport r = optimizer.step();
    if (s == 0) warmup_report = r;
    last_report = r;
    non_model_peak = std::max(non_model_peak, r.non_model_peak_bytes);
    if (s >= first_steady) {
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
      gathered_peak = std::max(gathered_peak, static_cast<double>(r.gathered_peak_bytes));
      // A group gather all-gathers world_size param chunks, a group reduce sends world_size fp32
      // gradient chunks to their owners, and the step agrees on the loss's finiteness (4 bytes,
      // not in fp16) and the squared gradient norm (8 bytes).
      formula_ok = formula_ok && r.gather_bytes == r.group_gathers * world * param_chunk &&
                   r.reduce_bytes == r.group_reduces * world * store.chunk_elems() * 4 &&
                   r.all_reduce_bytes ==
                       (config.precision() == ps::Precision::kFp16 ? 0 : 4) + 8;
    }
    if (const auto& st = engine.scheduler().history().back(); !st.warmup) {
      device_peak = std::max(device_peak, st.peak_device_bytes);
    }
    finish_device_work(config);
    const double t = seconds_since(start);
    // The global batch's loss: the mean of the ranks' (equal row counts).
    losses.push_back(sum_over_ranks(*comm, {loss.item<double>()})[0] / world);
    if (s > 0) times.push_back(t);
    if (!lead) continue;
    if (world > 1) {
      std::printf("step %lld/%lld  rank 0: gathered %lld groups (%s), reduced %lld (%s), %.3f s in "
                  "collectives\n", static_cast<long long>(s + 1), static_cast<long long>(steps),
                  static_cast<long long>(r.group_gathers), mib(static_cast<double>(r.gather_bytes)).c_str(),
                  static_cast<long long>(r.group_reduces), mib(static_cast<double>(r.reduce_bytes)).c_str(),
                  r.collective_seconds);
    }
    const std::string warm_start =
        r.warm_start_h2d_bytes > 0
            ? " (warm start " + mib(static_cast<double>(r.warm_start_h2d_bytes)) + ")"
            : std::string();
    std::printf("step %lld/%lld%s  loss %.5f  %.3f s  %.2f samples/s  h2d %s%s  d2h %s  adam "
                "device/host chunks %lld/%lld%s\n",
                static_cast<long long>(s + 1), static_cast<long long>(steps),
                r.warmup ? " (warm-up)" : "", losses.back(), t, static_cast<double>(batch) / t,
                mib(static_cast<double>(r.h2d_bytes)).c_str(), warm_start.c_str(),
                mib(static_cast<double>(r.d2h_bytes)).c_str(),
                static_cast<long long>(r.adam.chunks_device),
                static_cast<long long>(r.adam.chunks_host), r.skipped ? "  (overflow: skipped)" : "");
    if (reg.disk_bytes > 0) {
      std::printf("    forward+backward %.3f s, step %.3f s (disk: read %s, written %s, waited %.3f s)\n",
                  t - r.adam_seconds, r.adam_seconds, mib(static_cast<double>(r.disk_read_bytes)).c_str(),
                  mib(static_cast<double>(r.disk_written_bytes)).c_str(), r.disk_wait_seconds);
    }
    std::fflush(stdout);
  }

  // Traffic per steady iteration.
  const double after = static_cast<double>(steps - first_steady);
  h2d /= after;
  d2h /= after;
  forced /= after;
  copy_wait /= after;
  adam_s /= after;
  disk_read /= after;
  disk_written /= after;
  disk_wait /= after;
  // The OPT lower bound of the scheduler's traffic on the same trace and budgets: the forward,
  // backward and device-side Adam accesses, and the chunks the host-side Adam needs on the host.
  std::map<int64_t, ps::ChunkInfo> chunks = engine.scheduler().chunks();
  const ps::TrafficBound bound = ps::opt_traffic_bound(engine.tracer().warmup_trace(), chunks,
                                                       engine.scheduler().options());
  const double bound_bytes = static_cast<double>(bound.h2d_bytes + bound.d2h_bytes) /
                             static_cast<double>(std::max<int64_t>(1, bound.period_iterations));
  const double step_time = median(times);
  const double params = static_cast<double>(reg.params);
  const double tokens = static_cast<double>(batch * seq);
  const double tflops_ps = 8.0 * params * tokens / step_time / 1e12;
  const double l = static_cast<double>(spec.layers), h = static_cast<double>(spec.hidden);
  const double tflops_megatron = 96.0 * tokens * l * h * h *
                                 (1.0 + static_cast<double>(seq) / (6.0 * h) +
                                  static_cast<double>(spec.vocab) / (16.0 * l * h)) /
                                 step_time / 1e12;

  std::optional<BaselineResult> baseline;
  if (absl::GetFlag(FLAGS_baseline)) {
    if (lead) {
      std::printf("baseline: plain LibTorch + torch::optim::AdamW (fp32), same weights and data%s\n",
                  world > 1 ? " (the whole global batch, on every rank)" : "");
    }
    baseline = run_baseline(spec, config, batch, seq, steps, seed, lead);
  }

  nlohmann::json out;
  out["model"] = spec.name;
  out["params"] = reg.params;
  out["dtype"] = std::string(ps::to_string(config.precision()));
  out["checkpoint_activations"] = spec.checkpoint_activations;
  out["batch"] = batch;
  out["seq"] = seq;
  out["steps"] = steps;
  out["chunk_elems"] = reg.chunk_elems;
  out["chunk_waste_fraction"] = reg.chunk_waste_fraction;
  out["model_data_bytes_per_param"] = reg.model_data_bytes_per_param;
  out["device_capacity_bytes"] = config.device.capacity_bytes;
  out["device_peak_bytes"] = device_peak;
  out["host_peak_bytes"] = engine.host_tier().peak_bytes();
  out["init_host_peak_bytes"] = reg.host_peak_bytes_during_init;
  out["init_goal_bytes"] = reg.init_goal_bytes;  // model data + the largest module's fp32 weights
  out["h2d_bytes_per_iter"] = h2d;
  // The warm-up's loads: its own (forward, backward and step under the warm-up budget) and the warm
  // start that places chunks for the first scheduled iteration; its own against a steady iteration.
  const double warmup_own =
      static_cast<double>(warmup_report.h2d_bytes - warmup_report.warm_start_h2d_bytes);
  out["warmup_h2d_bytes"] = warmup_report.h2d_bytes;
  out["warmup_warm_start_h2d_bytes"] = warmup_report.warm_start_h2d_bytes;
  out["warmup_own_h2d_to_steady"] = h2d > 0 ? warmup_own / h2d : 0.0;
  out["d2h_bytes_per_iter"] = d2h;
  out["async_moves"] = config.scheduler.async_moves;
  out["intra_op_threads"] = torch::get_num_threads();
  out["copy_wait_s_per_iter"] = copy_wait;  // compute waiting for chunk copies (async moves)
  out["adam_host_d2h_bytes_per_iter"] = forced;
  out["adam_s_per_iter"] = adam_s;  // the optimizer step's wall time (steady iterations)
  out["disk_bytes"] = reg.disk_bytes;  // optimizer states in the disk tier's files
  out["device_state_bytes"] = reg.device_state_bytes;  // optimizer states on the device for good
  out["disk_read_bytes_per_iter"] = disk_read;
  out["disk_written_bytes_per_iter"] = disk_written;
  out["disk_wait_s_per_iter"] = disk_wait;
  out["opt_bound_bytes_per_iter"] = bound_bytes;
  out["opt_bound_proven"] = bound.proven;
  out["traffic_to_opt_bound"] = (h2d + d2h) / std::max(1.0, bound_bytes);
  out["step_time_s"] = step_time;
  out["samples_per_s"] = static_cast<double>(batch) / step_time;
  out["tflops_ps"] = tflops_ps;
  out["tflops_megatron"] = tflops_megatron;
  out["adam_chunks_device"] = last_report.adam.chunks_device;
  out["adam_chunks_host"] = last_report.adam.chunks_host;
  out["policy"] = ps::eviction_policy_name(config.scheduler.policy);
  out["world_size"] = world;
  if (world > 1) {
    // Every rank's figures per steady iteration, and whether its collective bytes equalled the
    // formula (above) at every one.
    enum { kModelData, kGathers, kGatherBytes, kReduces, kReduceBytes, kAllReduceBytes, kSeconds,
           kStepTime, kFormulaOk, kTrafficToBound, kGatheredPeak, kFields };
    std::vector<double> mine(static_cast<size_t>(world * kFields), 0.0);
    double* f = mine.data() + rank * kFields;
    f[kGathers] = gathers;
    f[kGatherBytes] = gather_bytes;
    f[kReduces] = reduces;
    f[kReduceBytes] = reduce_bytes;
    f[kAllReduceBytes] = all_reduce_bytes;
    f[kSeconds] = collective_s;
    for (int k : {kGathers, kGatherBytes, kReduces, kReduceBytes, kAllReduceBytes, kSeconds}) {
      f[k] /= after;
    }
    f[kModelData] = static_cast<double>(reg.model_data_bytes);
    f[kStepTime] = step_time;
    f[kFormulaOk] = formula_ok ? 1.0 : 0.0;
    f[kTrafficToBound] = (h2d + d2h) / std::max(1.0, bound_bytes);
    f[kGatheredPeak] = gathered_peak;
    const std::vector<double> all = sum_over_ranks(*comm, mine);
    nlohmann::json per_rank = nlohmann::json::array();
    bool all_ok = true;
    for (int r = 0; r < world; ++r) {
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
    out["param_chunk_bytes"] = param_chunk;
    out["collective_formula"] =
        "gather_bytes = group_gathers x world_size x param_chunk_bytes; reduce_bytes = "
        "group_reduces x world_size x chunk_elems x 4; all_reduce_bytes = 4 (loss finiteness, not "
        "fp16) + 8 (squared gradient norm)";
    out["collective_bytes_match_formula"] = all_ok;
    out["per_rank"] = per_rank;
  }
  out["losses"] = losses;
  if (baseline) {
    out["baseline_step_time_s"] = baseline->step_time_s;
    out["baseline_losses"] = baseline->losses;
    out["max_relative_loss_difference"] = max_relative_difference(losses, baseline->losses);
    out["step_time_ratio_to_baseline"] = step_time / baseline->step_time_s;
  }

  if (!lead) return 0;  // rank 0 prints and writes the files
  std::printf("\n");
  out["memory_at_device_peak"] = print_breakdown("device peak", engine.device_peak_breakdown(),
                                                 config.device.capacity_bytes);
  out["memory_at_host_peak"] = print_breakdown("host peak", engine.host_peak_breakdown(),
                                               config.device.capacity_bytes);
  // The process against what the engine accounts for. On the emulated device the device tier and
  // the non-model bytes (LibTorch's CPU allocations) are host memory too; on a GPU they are not.
  {
    const bool emulated = config.device.type == ps::DeviceType::kEmulated;
    const int64_t hwm = proc_status_bytes("VmHWM");
    // The tiers' reserved peaks: their blocks in use plus the blocks they keep for reuse.
    const int64_t host_reserved = engine.host_tier().peak_reserved_bytes();
    const int64_t device_reserved = engine.device_tier().peak_reserved_bytes();
    const int64_t accounted =
        g_rss_at_start + host_reserved + (emulated ? device_reserved + non_model_peak : 0);
    const double accounted_to_hwm =
        hwm > 0 ? static_cast<double>(accounted) / static_cast<double>(hwm) : 0.0;
    std::printf("process: high-water mark (VmHWM) %s; accounted %s = %s at start (libraries) + "
                "host tier reserved peak %s%s%s; accounted / VmHWM %.3f\n",
                mib(static_cast<double>(hwm)).c_str(), mib(static_cast<double>(accounted)).c_str(),
                mib(static_cast<double>(g_rss_at_start)).c_str(),
                mib(static_cast<double>(host_reserved)).c_str(),
                emulated ? " + device tier reserved peak " : "",
                emulated ? absl::StrCat(mib(static_cast<double>(device_reserved)),
                                        " + non-model peak ",
                                        mib(static_cast<double>(non_model_peak)))
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
  if (!absl::GetFlag(FLAGS_predict).empty()) {
    out["prediction"] = ps::bench::print_gpu_prediction(engine, model.module(), batch * seq,
                                                        absl::GetFlag(FLAGS_predict), step_time);
  }
  std::printf("\n%-30s %s\n", "figure", "value");
  for (const auto& [key, value] : out.items()) {
    if (value.is_array() || value.is_object()) continue;  // printed above, or in the JSON file
    std::printf("%-30s %s\n", key.c_str(), value.dump().c_str());
  }
  if (out.contains("per_rank")) {
    for (const auto& r : out["per_rank"]) std::printf("rank %s\n", r.dump().c_str());
  }
  if (!absl::GetFlag(FLAGS_json).empty()) {
    ps::write_text_file(absl::GetFlag(FLAGS_json), out.dump(2) + "\n");
    std::printf("wrote %s\n", absl::GetFlag(FLAGS_json).c_str());
  }
  if (!absl::GetFlag(FLAGS_trace).empty()) {
    std::vector<ps::CopySpan> copies;
    if (ps::CopyEngine* queue = engine.chunks().copy_queue(); queue != nullptr) {
      queue->drain();  // the last step's prefetches complete, so every issued move has its copy
      copies = queue->spans();
    }
    ps::write_text_file(absl::GetFlag(FLAGS_trace),
                        ps::chrome_trace_json(engine.scheduler().moves(),
                                              engine.scheduler().moment_records(),
                                              config.device.capacity_bytes, copies));
    std::printf("wrote %s\n", absl::GetFlag(FLAGS_trace).c_str());
  }
  if (!absl::GetFlag(FLAGS_plot).empty()) {
    ps::write_text_file(absl::GetFlag(FLAGS_plot),
                        ps::memory_timeline_svg(engine.scheduler().moment_records(),
                                                config.device.capacity_bytes));
    std::printf("wrote %s\n", absl::GetFlag(FLAGS_plot).c_str());
  }
  std::fflush(stdout);  // everything is said before the engine gives the model back
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  g_rss_at_start = proc_status_bytes("VmRSS");
  absl::SetProgramUsageMessage(
      "trains a GPT of the model zoo through patrickstar on random data; e.g.\n"
      "  ps_bench --model gpt_mini --device emulated:24MiB --steps 6 --baseline --json out.json");
  std::vector<std::string> args;
  std::vector<char*> pointers = patrickstar::dashed_flags(argc, argv, args);
  absl::ParseCommandLine(static_cast<int>(pointers.size()), pointers.data());
  try {
    return run();
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "ps_bench: %s\n", e.what_without_backtrace());
    return 1;
  }
}
