// ps_bench's shared pieces: see ps_bench_common.h.
#include "ps_bench_common.h"
#include <torch/torch.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "dashed_flags.h"
#include "gpu_prediction.h"
#include "patrickstar/chunk/cuda_device_tier.h"
#include "patrickstar/memtracer/cost_model.h"
#include "patrickstar/memtracer/export.h"
#include "patrickstar/memtracer/simulator.h"
#include "patrickstar/models/gpt.h"
#include "patrickstar/patrickstar.h"
#include "ps_bench_flags.h"

namespace ps_bench {

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

void write_json_if_asked(const nlohmann::json& out) {
  const std::string path = absl::GetFlag(FLAGS_json);
  if (path.empty()) return;
  ps::write_text_file(path, out.dump(2) + "\n");
  std::printf("wrote %s\n", path.c_str());
}

nlohmann::json run_header(const ps::models::GptSpec& spec, const ps::Config& config, int64_t batch,
                          int64_t seq) {
  nlohmann::json out;
  out["model"] = spec.name;
  out["params"] = spec.parameter_count();
  out["dtype"] = std::string(ps::to_string(config.precision()));
  out["batch"] = batch;
  out["seq"] = seq;
  out["intra_op_threads"] = torch::get_num_threads();
  return out;
}

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
  const std::string state_dtype = absl::GetFlag(FLAGS_state_dtype);
  if (!state_dtype.empty()) {
    TORCH_CHECK(state_dtype == "fp32" || state_dtype == "bf16",
                "--state-dtype: expected fp32 or bf16, got \"", state_dtype, "\"");
    j["optimizer"]["params"]["state_dtype"] = state_dtype;
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
  if (const std::string activations = absl::GetFlag(FLAGS_activations); !activations.empty()) {
    TORCH_CHECK(activations == "none" || activations == "recompute" || activations == "offload" ||
                    activations == "auto",
                "--activations: expected none, recompute, offload or auto, got \"", activations,
                "\"");
    j["activation_checkpointing"]["policy"] = activations;
  }
  if (absl::GetFlag(FLAGS_no_decay)) {
    j["optimizer"]["type"] = "AdamW";
    j["optimizer"]["params"]["weight_decay"] = 0.1;
    j["optimizer"]["params"]["no_decay"] = {"bias", "norm", "embedding"};
  }
  const bool planning = absl::GetFlag(FLAGS_plan) || absl::GetFlag(FLAGS_compare_plan);
  if (planning) j["plan"] = "auto";
  TORCH_CHECK(planning || absl::GetFlag(FLAGS_plan_profile).empty(),
              "--plan-profile: give --plan or --compare-plan (without them nothing plans)");
  TORCH_CHECK(absl::GetFlag(FLAGS_write_plan).empty() || absl::GetFlag(FLAGS_plan),
              "--write-plan: give --plan (the plan of the run it writes)");
  if (!absl::GetFlag(FLAGS_plan_profile).empty()) {
    j["plan_profile"] = absl::GetFlag(FLAGS_plan_profile);
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
void PhaseClock::lap(double PhaseSeconds::*phase) {
  if (cuda_) torch::cuda::synchronize();
  const Clock::time_point now = Clock::now();
  phases_.*phase += std::chrono::duration<double>(now - last_).count();
  last_ = now;
}

void finish_device_work(const ps::Config& config) {
  if (config.device.type == ps::DeviceType::kCuda) torch::cuda::synchronize();
}
template <class Spec>
ps::models::TokenBatch batch_of(const Spec& spec, const ps::Config& config, int64_t batch,
                                int64_t seq, uint64_t seed) {
  ps::models::GptSpec vocabulary;  // random_tokens reads the vocabulary alone
  vocabulary.vocab = spec.vocab;
  ps::models::TokenBatch data = ps::models::random_tokens(vocabulary, batch, seq, seed);
  const c10::Device device = batch_device(config);
  if (!device.is_cpu()) {
    data.tokens = data.tokens.to(device);
    data.targets = data.targets.to(device);
  }
  return data;
}

ps::models::Gpt make_model(const ps::models::GptSpec& spec, uint64_t seed,
                           const std::string& init_from) {
  TORCH_CHECK(init_from.empty(), "--init-from reads Llama checkpoints, not GPT ones");
  torch::manual_seed(seed);
  return ps::models::Gpt(spec);
}

ps::models::Llama make_model(const ps::models::LlamaSpec& spec, uint64_t seed,
                             const std::string& init_from) {
  torch::manual_seed(seed);
  ps::models::Llama model(spec);
  if (!init_from.empty()) {
    model->initialize_from(std::make_shared<ps::SafetensorsCheckpoint>(init_from));
  }
  return model;
}

double megatron_flops(const ps::models::GptSpec& spec, int64_t batch, int64_t seq) {
  const double l = static_cast<double>(spec.layers), h = static_cast<double>(spec.hidden);
  const double tokens = static_cast<double>(batch * seq);
  return 96.0 * tokens * l * h * h *
         (1.0 + static_cast<double>(seq) / (6.0 * h) +
          static_cast<double>(spec.vocab) / (16.0 * l * h));
}

double megatron_flops(const ps::models::LlamaSpec& spec, int64_t batch, int64_t seq) {
  // Per token: the layers' projections (q, o: h x h; k, v: h x kv*d; three of h x i), attention's
  // two products over the sequence (2 s h), and the head (h V); 4 passes x 2 flops each.
  const double l = static_cast<double>(spec.layers), h = static_cast<double>(spec.hidden);
  const double kv = static_cast<double>(spec.kv_heads * spec.head_dim());
  const double i = static_cast<double>(spec.intermediate), s = static_cast<double>(seq);
  const double macs =
      l * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * s * h) + h * static_cast<double>(spec.vocab);
  return 8.0 * static_cast<double>(batch * seq) * macs;
}

namespace {

// The step of `world` data-parallel ranks with dropout, in one process: rank r's rows of the batch,
// from the random state every rank starts the step with; gradients averaged as the ranks' reduce
// does. Returns the mean loss (no gradient left to take: backward ran per micro-batch).
template <class Model>
at::Tensor ranks_as_micro_batches(Model& model, const ps::models::TokenBatch& data, int world,
                                  c10::Device device) {
  at::Generator gen = device.is_cuda() ? at::globalContext().defaultGenerator(device)
                                       : at::detail::getDefaultCPUGenerator();
  at::Tensor start;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    start = gen.get_state();
  }
  const int64_t rows = data.tokens.size(0) / world;
  double total = 0;
  for (int r = 0; r < world; ++r) {
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(start);
    }
    at::Tensor loss = model->loss(data.tokens.narrow(0, r * rows, rows),
                                  data.targets.narrow(0, r * rows, rows));
    (loss / world).backward();
    total += loss.template item<double>();
  }
  return at::scalar_tensor(total / world, at::kDouble);
}

// torch::optim::AdamW's param groups as the config's (optimizer.param_groups, then no_decay, then
// the rest), by the engine's pattern rule; one group when the config has none.
std::vector<torch::optim::OptimizerParamGroup> baseline_groups(const torch::nn::Module& model,
                                                               const ps::OptimizerConfig& o) {
  auto options = [&](double lr, double b1, double b2, double eps, double wd) {
    return std::make_unique<torch::optim::AdamWOptions>(
        torch::optim::AdamWOptions(lr).betas({b1, b2}).eps(eps).weight_decay(wd));
  };
  std::vector<std::vector<std::string>> patterns;
  for (const ps::ParamGroupConfig& g : o.param_groups) patterns.push_back(g.names);
  if (!o.no_decay.empty()) patterns.push_back(o.no_decay);
  std::vector<std::vector<at::Tensor>> members(patterns.size() + 1);
  std::unordered_map<const c10::TensorImpl*, bool> seen;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      if (!seen.emplace(p.value().unsafeGetTensorImpl(), true).second) continue;
      const std::string name = item.key().empty() ? p.key() : item.key() + "." + p.key();
      size_t group = 0;
      for (size_t g = 0; g < patterns.size() && group == 0; ++g) {
        for (const std::string& pattern : patterns[g]) {
          if (ps::pattern_takes_parameter(pattern, name, item.value()->name())) group = g + 1;
        }
      }
      members[group].push_back(p.value());
    }
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(members[0], options(o.lr, o.beta1, o.beta2, o.eps, o.weight_decay));
  for (size_t g = 0; g < o.param_groups.size(); ++g) {
    const ps::ParamGroupConfig& c = o.param_groups[g];
    groups.emplace_back(members[g + 1], options(c.lr.value_or(o.lr), c.beta1.value_or(o.beta1),
                                                c.beta2.value_or(o.beta2), c.eps.value_or(o.eps),
                                                c.weight_decay.value_or(o.weight_decay)));
  }
  if (!o.no_decay.empty()) {
    groups.emplace_back(members.back(), options(o.lr, o.beta1, o.beta2, o.eps, 0.0));
  }
  return groups;
}

}  // namespace

template <class Spec>
BaselineResult run_baseline(const Spec& spec, const ps::Config& config, int64_t batch, int64_t seq,
                            int64_t steps, uint64_t seed, bool print, const std::string& init_from,
                            int world, bool breakdown) {
  auto model = make_model(spec, seed, init_from);
  ps::materialize_parameters(*model);  // --deferred-init: the values the engine's chunks get
  model->to(batch_device(config));  // plain LibTorch on the GPU with --device cuda
  const auto& o = config.optimizer;
  torch::optim::AdamW adamw(baseline_groups(*model, o), torch::optim::AdamWOptions(o.lr)
                                                            .betas({o.beta1, o.beta2})
                                                            .eps(o.eps)
                                                            .weight_decay(o.weight_decay));
  BaselineResult r;
  std::vector<double> times;
  for (int64_t s = 0; s < steps; ++s) {
    auto data = batch_of(spec, config, batch, seq, seed + 1 + static_cast<uint64_t>(s));
    const auto start = Clock::now();
    PhaseClock clock(config.device.type == ps::DeviceType::kCuda);
    adamw.zero_grad();
    at::Tensor loss = spec.dropout > 0.0 && world > 1
                          ? ranks_as_micro_batches(model, data, world, batch_device(config))
                          : model->loss(data.tokens, data.targets);
    if (breakdown) clock.lap(&PhaseSeconds::forward);
    if (loss.requires_grad()) loss.backward();
    if (breakdown) clock.lap(&PhaseSeconds::backward);
    adamw.step();
    if (breakdown) clock.lap(&PhaseSeconds::step);
    finish_device_work(config);
    const double t = seconds_since(start);
    r.losses.push_back(loss.item<double>());
    if (s > 0) times.push_back(t);
    if (s > 0) r.phases += clock.phases();
    if (print) {
      std::printf("  baseline step %lld/%lld  loss %.5f  %.3f s\n", static_cast<long long>(s + 1),
                  static_cast<long long>(steps), r.losses.back(), t);
    }
  }
  r.step_time_s = median(times);
  r.phases /= static_cast<double>(std::max<size_t>(times.size(), 1));
  return r;
}

// Model data per frozen and per trained parameter: each chunk index's bytes (its chunk of every
// kind) shared among the index's tensors by their elements (its waste with them).
void print_chunk_size_retry(int64_t step, const ps::IterationReport& report,
                            const ps::RegistrationReport& registration) {
  std::printf(
      "step %lld: \"auto\" chunk size: the warm-up's trace did not fit the device; the "
      "model moved into %lld chunks of %lld elements per kind, waste %.2f%%, %.2f "
      "model-data bytes per parameter; the next step warms up again\n",
      static_cast<long long>(step), static_cast<long long>(registration.chunks_per_kind),
      static_cast<long long>(report.chunk_elems_retried), 100.0 * registration.chunk_waste_fraction,
      registration.model_data_bytes_per_param);
}

void print_bytes_by_training(const ps::ChunkStore& store, torch::nn::Module& module) {
  std::unordered_map<std::string, bool> trained;
  for (const auto& p : module.named_parameters()) trained[p.key()] = p.value().requires_grad();
  const ps::Layout& layout = store.layout();
  double bytes[2] = {0, 0};
  int64_t count[2] = {0, 0};
  for (int64_t index = 0; index < layout.chunk_count(); ++index) {
    int64_t index_bytes = 0, used = 0;
    for (const ps::ChunkKindSpec& k : store.kinds()) {
      index_bytes += store.chunk_bytes(store.chunk_id(k.kind, index));
    }
    for (ps::TensorId id : layout.tensors_in_chunk(index)) used += layout.numel(id);
    for (ps::TensorId id : layout.tensors_in_chunk(index)) {
      const int t = trained.at(layout.name(id)) ? 1 : 0;
      count[t] += layout.numel(id);
      bytes[t] += static_cast<double>(index_bytes) * static_cast<double>(layout.numel(id)) /
                  static_cast<double>(used);
    }
  }
  auto per = [&](int t) { return count[t] > 0 ? bytes[t] / static_cast<double>(count[t]) : 0.0; };
  std::printf(
      "adapters: %lld trained parameters (%.3f%%), %lld frozen; model data %.2f bytes per "
      "trained parameter, %.2f per frozen one\n",
      static_cast<long long>(count[1]),
      100.0 * static_cast<double>(count[1]) / static_cast<double>(count[0] + count[1]),
      static_cast<long long>(count[0]), per(1), per(0));
}

// The process's index on its machine under mpirun (0 without a launcher).
int local_rank() {
  const char* text = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
  return text == nullptr ? 0 : std::atoi(text);
}


// Sums `values` over ranks (each rank fills its own slots, the others are zero).
std::vector<double> sum_over_ranks(ps::Communicator& comm, std::vector<double> values) {
  at::Tensor t = torch::tensor(values, at::kDouble);
  comm.all_reduce(t, ps::ReduceOp::kSum);
  return std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
}

template ps::models::TokenBatch batch_of(const ps::models::GptSpec&, const ps::Config&, int64_t,
                                         int64_t, uint64_t);
template ps::models::TokenBatch batch_of(const ps::models::LlamaSpec&, const ps::Config&, int64_t,
                                         int64_t, uint64_t);
template BaselineResult run_baseline(const ps::models::GptSpec&, const ps::Config&, int64_t,
                                     int64_t, int64_t, uint64_t, bool, const std::string&, int,
                                     bool);
template BaselineResult run_baseline(const ps::models::LlamaSpec&, const ps::Config&, int64_t,
                                     int64_t, int64_t, uint64_t, bool, const std::string&, int,
                                     bool);

}  // namespace ps_bench
