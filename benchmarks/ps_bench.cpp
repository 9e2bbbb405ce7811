// ps_bench: the main job. Trains a GPT or a Llama of the model zoo (or a Llama checkpoint in
// Hugging Face's format, --init-from) through the patrickstar engine on random
// tokens (fixed seed), prints one line per step and a summary table, and writes the figures as
// JSON, the chunk timeline as a Chrome trace and the memory timeline as SVG. With --baseline it
// also trains the same model on the same data with plain LibTorch and torch::optim::AdamW in the
// same run, so speed is a ratio and the losses can be compared. See BENCHMARKS.md. Data parallel:
// under mpirun every rank trains its rows of the global --batch; rank 0 prints the steps (the
// global batch's loss), every rank's figures (model data, collective bytes against their formula,
// time in collectives) and writes the files.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include <torch/torch.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "dashed_flags.h"
#include "gpu_prediction.h"
#include "patrickstar/chunk/cuda_device_tier.h"
#include "patrickstar/engine/engine_inspect.h"
#include "patrickstar/memtracer/cost_model.h"
#include "patrickstar/memtracer/export.h"
#include "patrickstar/memtracer/simulator.h"
#include "patrickstar/models/gpt.h"
#include "patrickstar/models/llama_pretrained.h"
#include "patrickstar/patrickstar.h"
#include "ps_bench_common.h"
#include "ps_bench_flags.h"

ABSL_FLAG(std::string, model, "gpt_mini",
          "a GPT or Llama size from the model zoo (see --list-models)");
ABSL_FLAG(std::string, init_from, "",
          "start from a Hugging Face Llama checkpoint in this folder (config.json and safetensors; "
          "deferred: each tensor read into its chunk at registration); --model is ignored");
ABSL_FLAG(bool, list_models, false, "print the model zoo with parameter counts and exit");
ABSL_FLAG(int64_t, batch, 4, "sequences per step");
ABSL_FLAG(int64_t, seq, 0, "tokens per sequence (0: the model's own length, at most 1024)");
ABSL_FLAG(int64_t, steps, 6, "training steps (the first is the warm-up)");
ABSL_FLAG(std::string, dtype, "", "fp32, bf16 or fp16 (default: the config's, else fp32)");
ABSL_FLAG(std::string, state_dtype, "",
          "Adam's momentum and variance: fp32 or bf16 (optimizer.params.state_dtype; default: the "
          "config's, else fp32)");
ABSL_FLAG(int64_t, lora, 0,
          "fine-tune with low-rank adapters of this rank on the attention projections, the rest "
          "of the model frozen (0: train every parameter)");
ABSL_FLAG(bool, deferred_init, false,
          "build the model with deferred initialization: each module's fp32 weights freed as it "
          "is built, each parameter's value made at registration, in its chunk (the host never "
          "holds the whole model in fp32; the values are drawn per parameter, so they differ from "
          "a model built whole)");
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
ABSL_FLAG(double, dropout, 0.0,
          "dropout probability while training (GPT: after the embeddings, on the attention "
          "probabilities and on each residual branch, as GPT-2; Llama: on the attention "
          "probabilities, as transformers' attention_dropout); checkpointed blocks replay it");
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
ABSL_FLAG(bool, compare_delayed, false,
          "train two engines on the same data, one with the delayed parameter update "
          "(zero_optimization.delayed_param_update, warm-up 2) and one updating at its step, in "
          "alternating blocks of 4 steps, and print the median iterations as ratios: delayed / "
          "serial and delayed / max(forward + backward alone, step alone), from the serial engine "
          "(--threads 1 leaves the other core to the update's thread; memory: two engines)");
ABSL_FLAG(bool, compare_step, false,
          "train with the overlapped step and the serial step alternating, one engine, and print "
          "the median iterations as ratios: overlapped / serial and overlapped / max(forward + "
          "backward alone, step alone), both measured from the serial steps (--threads 1 leaves "
          "the other core to the optimizer thread)");
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

namespace {

using namespace ps_bench;  // NOLINT: ps_bench's own helpers

template <class Spec>
int train(const ps::Config& config, Spec spec);

int run() {
  if (absl::GetFlag(FLAGS_list_models)) {
    for (const std::string& name : ps::models::gpt_spec_names()) {
      const auto s = ps::models::gpt_spec(name);
      std::printf("%-15s layers %3lld hidden %5lld heads %3lld  %15lld parameters\n", name.c_str(),
                  static_cast<long long>(s.layers), static_cast<long long>(s.hidden),
                  static_cast<long long>(s.heads), static_cast<long long>(s.parameter_count()));
    }
    for (const std::string& name : ps::models::llama_spec_names()) {
      const auto s = ps::models::llama_spec(name);
      std::printf("%-15s layers %3lld hidden %5lld heads %3lld/%lld  %12lld parameters%s\n",
                  name.c_str(), static_cast<long long>(s.layers), static_cast<long long>(s.hidden),
                  static_cast<long long>(s.heads), static_cast<long long>(s.kv_heads),
                  static_cast<long long>(s.parameter_count()),
                  s.tie_embeddings ? " (tied head)" : "");
    }
    return 0;
  }
  TORCH_CHECK(absl::GetFlag(FLAGS_threads) >= 0, "--threads must be 0 (LibTorch's default) or "
              "positive, got ", absl::GetFlag(FLAGS_threads));
  if (absl::GetFlag(FLAGS_threads) > 0) {
    torch::set_num_threads(static_cast<int>(absl::GetFlag(FLAGS_threads)));
  }
  const ps::Config config = build_config();
  const bool llama =
      !absl::GetFlag(FLAGS_init_from).empty() || absl::GetFlag(FLAGS_model).rfind("llama", 0) == 0;
  if (llama) {
    ps::models::LlamaSpec spec =
        absl::GetFlag(FLAGS_init_from).empty()
            ? ps::models::llama_spec(absl::GetFlag(FLAGS_model))
            : ps::models::llama_spec_from_pretrained(absl::GetFlag(FLAGS_init_from));
    return train(config, spec);
  }
  return train(config, ps::models::gpt_spec(absl::GetFlag(FLAGS_model)));
}

// Trains `spec` (a GptSpec or a LlamaSpec) through the engine with the flags' settings.
template <class Spec>
int train(const ps::Config& config, Spec spec) {
  spec.checkpoint_activations = absl::GetFlag(FLAGS_checkpoint_activations);
  const double dropout = absl::GetFlag(FLAGS_dropout);
  TORCH_CHECK(dropout >= 0.0 && dropout < 1.0, "--dropout must be a probability in [0, 1), got ",
              dropout);
  if (dropout > 0.0) spec.dropout = dropout;  // else the spec's own (a Llama config.json's)
  TORCH_CHECK(absl::GetFlag(FLAGS_lora) >= 0,
              "--lora must be 0 (no adapters) or a positive rank, got ", absl::GetFlag(FLAGS_lora));
  spec.lora_rank = absl::GetFlag(FLAGS_lora);
  spec.deferred_init = spec.deferred_init || absl::GetFlag(FLAGS_deferred_init);
  const int64_t batch = absl::GetFlag(FLAGS_batch);
  const int64_t seq = absl::GetFlag(FLAGS_seq) > 0 ? absl::GetFlag(FLAGS_seq)
                                                   : std::min<int64_t>(spec.max_seq, 1024);
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
  if constexpr (std::is_same_v<Spec, ps::models::GptSpec>) {
    if (absl::GetFlag(FLAGS_find_max_model)) return find_max_model(config, spec, batch, seq, seed);
    if (absl::GetFlag(FLAGS_compare_moves)) {
      TORCH_CHECK(world == 1, "--compare-moves runs in one process (not under mpirun)");
      return compare_moves(config, spec, batch, seq, steps, seed);
    }
    if (absl::GetFlag(FLAGS_compare_delayed)) {
      TORCH_CHECK(world == 1, "--compare-delayed runs in one process (not under mpirun)");
      return compare_delayed(config, spec, batch, seq, steps, seed);
    }
    if (absl::GetFlag(FLAGS_compare_step)) {
      TORCH_CHECK(world == 1, "--compare-step runs in one process (not under mpirun)");
      return compare_step(config, spec, batch, seq, steps, seed);
    }
  } else {
    TORCH_CHECK(!absl::GetFlag(FLAGS_find_max_model) && !absl::GetFlag(FLAGS_compare_moves) &&
                    !absl::GetFlag(FLAGS_compare_delayed) && !absl::GetFlag(FLAGS_compare_step),
                "--find-max-model and the --compare-* modes train the GPT models only");
  }

  if (lead) std::printf("ps_bench: %s, %lld parameters, %s, batch %lld, seq %lld, %lld steps, device %s %s, "
              "policy %s, %d rank(s)\n", spec.name.c_str(), static_cast<long long>(spec.parameter_count()),
              std::string(ps::to_string(config.precision())).c_str(),
              static_cast<long long>(batch), static_cast<long long>(seq),
              static_cast<long long>(steps), std::string(ps::to_string(config.device.type)).c_str(),
              mib(static_cast<double>(config.device.capacity_bytes)).c_str(),
              ps::eviction_policy_name(config.scheduler.policy), world);
  std::fflush(stdout);

  auto [model, optimizer] = build_engine(spec, config, seed, absl::GetFlag(FLAGS_init_from));
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
  if (lead) {
    std::printf(
        "initialization: host peak %lld bytes (model construction %lld%s); goal %lld "
        "(model data on the host + the largest module's fp32 weights); the process's VmHWM so far "
        "%lld\n",
        static_cast<long long>(reg.host_peak_bytes_during_init),
        static_cast<long long>(reg.model_construction_peak_bytes),
        spec.deferred_init ? ", deferred" : "", static_cast<long long>(reg.init_goal_bytes),
        static_cast<long long>(proc_status_bytes("VmHWM")));
  }
  if (lead && world == 1 && spec.lora_rank > 0) {
    print_bytes_by_training(inspect(engine).chunks(), model.module());
  }
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
    const auto [loss, r] = train_step(model, optimizer, tokens, targets);
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
      // (The store is taken at each step: "auto" may have moved the model into smaller chunks.)
      const ps::ChunkStore& store = inspect(engine).chunks();
      const int64_t param_chunk = store.chunk_bytes(store.chunk_id(ps::ChunkKind::kParam, 0));
      formula_ok = formula_ok && r.gather_bytes == r.group_gathers * world * param_chunk &&
                   r.reduce_bytes == r.group_reduces * world * store.chunk_elems() * 4 &&
                   r.all_reduce_bytes ==
                       (config.precision() == ps::Precision::kFp16 ? 0 : 4) + 8;
    }
    if (const auto& h = inspect(engine).scheduler().history(); !h.empty() && !h.back().warmup) {
      device_peak = std::max(device_peak, h.back().peak_device_bytes);
    }
    if (lead && r.chunk_elems_retried > 0) print_chunk_size_retry(s + 1, r, reg);
    finish_device_work(config);
    const double t = seconds_since(start);
    // The global batch's loss: the mean of the ranks' (equal row counts).
    losses.push_back(sum_over_ranks(*comm, {loss.template item<double>()})[0] / world);
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
    if (!r.overlap_step_decision.empty()) std::printf("    %s\n", r.overlap_step_decision.c_str());
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
  std::map<int64_t, ps::ChunkInfo> chunks = inspect(engine).scheduler().chunks();
  const ps::TrafficBound bound = ps::opt_traffic_bound(inspect(engine).tracer().warmup_trace(), chunks,
                                                       inspect(engine).scheduler().options());
  const double bound_bytes = static_cast<double>(bound.h2d_bytes + bound.d2h_bytes) /
                             static_cast<double>(std::max<int64_t>(1, bound.period_iterations));
  const double step_time = median(times);
  const double params = static_cast<double>(reg.params);
  const double tokens = static_cast<double>(batch * seq);
  const double tflops_ps = 8.0 * params * tokens / step_time / 1e12;
  const double tflops_megatron = megatron_flops(spec, batch, seq) / step_time / 1e12;

  std::optional<BaselineResult> baseline;
  if (absl::GetFlag(FLAGS_baseline)) {
    if (lead) {
      std::printf("baseline: plain LibTorch + torch::optim::AdamW (fp32), same weights and data%s\n",
                  world == 1      ? ""
                  : spec.dropout > 0 ? " (the ranks' rows as micro-batches from one random state, on every rank)"
                                     : " (the whole global batch, on every rank)");
    }
    baseline =
        run_baseline(spec, config, batch, seq, steps, seed, lead, absl::GetFlag(FLAGS_init_from),
                     world);
  }

  nlohmann::json out;
  out["model"] = spec.name;
  out["architecture"] = std::is_same_v<Spec, ps::models::GptSpec> ? "gpt" : "llama";
  out["init_from"] = absl::GetFlag(FLAGS_init_from);
  out["params"] = reg.params;
  out["dtype"] = std::string(ps::to_string(config.precision()));
  out["state_dtype"] = std::string(ps::to_string(config.optimizer.state_dtype));
  out["checkpoint_activations"] = spec.checkpoint_activations;
  out["dropout"] = spec.dropout;
  out["lora_rank"] = spec.lora_rank;
  out["trainable_params"] = reg.trainable_params;
  out["batch"] = batch;
  out["seq"] = seq;
  out["steps"] = steps;
  out["chunk_elems"] = reg.chunk_elems;
  out["chunk_waste_fraction"] = reg.chunk_waste_fraction;
  out["model_data_bytes_per_param"] = reg.model_data_bytes_per_param;
  out["device_capacity_bytes"] = config.device.capacity_bytes;
  out["device_peak_bytes"] = device_peak;
  out["host_peak_bytes"] = inspect(engine).host_tier().peak_bytes();
  out["init_host_peak_bytes"] = reg.host_peak_bytes_during_init;
  out["model_construction_peak_bytes"] = reg.model_construction_peak_bytes;
  out["deferred_init"] = spec.deferred_init;
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
    {
      const ps::ChunkStore& store = inspect(engine).chunks();
      out["param_chunk_bytes"] = store.chunk_bytes(store.chunk_id(ps::ChunkKind::kParam, 0));
    }
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
    const int64_t host_reserved = inspect(engine).host_tier().peak_reserved_bytes();
    const int64_t device_reserved = inspect(engine).device_tier().peak_reserved_bytes();
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
    out["prediction"] = ps::bench::print_gpu_prediction(engine, model.module(), batch * seq, seq,
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
  write_json_if_asked(out);
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
  std::fflush(stdout);  // everything is said before the engine gives the model back
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  g_rss_at_start = proc_status_bytes("VmRSS");
  absl::SetProgramUsageMessage(
      "trains a GPT or a Llama of the model zoo (or a Llama checkpoint, --init-from) through "
      "patrickstar on random data; e.g.\n"
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
