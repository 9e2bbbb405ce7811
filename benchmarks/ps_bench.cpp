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
#include <tuple>
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
#include "ps_bench_run.h"

ABSL_FLAG(std::string, model, "gpt_mini",
          "a GPT or Llama size from the model zoo (see --list-models)");
ABSL_FLAG(std::string, init_from, "",
          "start from a Hugging Face Llama checkpoint in this folder (config.json and safetensors; "
          "deferred: each tensor read into its chunk at registration); --model is ignored");
ABSL_FLAG(std::string, resume_from, "",
          "load this checkpoint (save_checkpoint's, written by any number of ranks, chunk size or "
          "state dtype) before the first step");
ABSL_FLAG(std::string, save_checkpoint, "",
          "save a checkpoint here after the last step (ps_ckpt shows, verifies and exports it)");
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
ABSL_FLAG(bool, breakdown, false,
          "time each step's forward, backward and step apart (on CUDA each ends with a device "
          "synchronization, in the engine's steps and the baseline's alike); the JSON's breakdown "
          "always has the engine's host time and host synchronizations per step");
ABSL_FLAG(std::string, moves, "", "chunk moves: async (a copy thread, or a CUDA copy stream, overlaps compute) or sync (default: the config's, else async)");
ABSL_FLAG(std::string, json, "", "write the figures to this JSON file");
ABSL_FLAG(std::string, trace, "", "write the chunk timeline (Chrome trace-event JSON) here");
ABSL_FLAG(std::string, plot, "", "write the memory timeline (SVG) here");
ABSL_FLAG(uint64_t, seed, 1234, "seed of the weights and the data");
ABSL_FLAG(bool, checkpoint_activations, false,
          "recompute each GPT block in backward (activation checkpointing)");
ABSL_FLAG(std::string, activations, "",
          "every block through patrickstar::checkpoint under this activation policy: none (kept), "
          "recompute, offload (inputs in the host tier meanwhile) or auto (planned per block after "
          "the warm-up; the plan is printed)");
ABSL_FLAG(bool, no_decay, false,
          "the LLM recipe's two AdamW groups: weight decay 0.1 (GPT-3's and Llama's) on the "
          "matrices and none on biases, norms and embeddings (optimizer.params.no_decay; the "
          "--baseline's torch::optim::AdamW gets the same groups)");
ABSL_FLAG(bool, compare_activations, false,
          "train the model under the activation policies none, recompute, offload and auto in one "
          "run, one step of each per round, the order rotating; print each one's median step as a "
          "ratio to the fastest fixed policy, its activation peak and auto's plan");
ABSL_FLAG(bool, longest_seq, false,
          "find the longest --seq that trains --steps steps at the --device capacity under "
          "\"none\" and under \"auto\" (doubling, then bisecting), and print the ratio");
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
ABSL_FLAG(bool, plan, false,
          "\"plan\": \"auto\": the engine chooses the chunk size, the step schedule and the "
          "Adam placement after the first scheduled iteration from its cost model; prints every "
          "candidate, the choice and its check against the measured step");
ABSL_FLAG(std::string, plan_profile, "",
          "the plan's rates: measured (default) or a GPU's (h100, h200)");
ABSL_FLAG(std::string, write_plan, "",
          "with --plan: write the chosen settings as a config file that pins them");
ABSL_FLAG(bool, compare_plan, false,
          "plan (\"plan\": \"auto\"), then train every candidate the plan considered pinned in "
          "its own engine beside the planning one, one step of each per round on the same data; "
          "print each one's predicted and measured median step and the plan's against the best");
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

// The flags' shape of the run, checked against `spec`.
template <class Spec>
RunShape run_shape(const Spec& spec) {
  RunShape shape;
  shape.batch = absl::GetFlag(FLAGS_batch);
  shape.seq = absl::GetFlag(FLAGS_seq) > 0 ? absl::GetFlag(FLAGS_seq)
                                           : std::min<int64_t>(spec.max_seq, 1024);
  shape.steps = absl::GetFlag(FLAGS_steps);
  shape.seed = absl::GetFlag(FLAGS_seed);
  TORCH_CHECK(shape.batch > 0 && shape.steps >= 2, "--batch must be positive and --steps at least "
              "2 (the first is the warm-up)");
  TORCH_CHECK(shape.seq <= spec.max_seq, "--seq ", shape.seq, " exceeds the ", spec.max_seq,
              " positions of ", spec.name);
  return shape;
}

// The model flags applied to `spec`.
template <class Spec>
void apply_model_flags(Spec& spec) {
  spec.checkpoint_activations =
      absl::GetFlag(FLAGS_checkpoint_activations) || !absl::GetFlag(FLAGS_activations).empty();
  const double dropout = absl::GetFlag(FLAGS_dropout);
  TORCH_CHECK(dropout >= 0.0 && dropout < 1.0, "--dropout must be a probability in [0, 1), got ",
              dropout);
  if (dropout > 0.0) spec.dropout = dropout;  // else the spec's own (a Llama config.json's)
  TORCH_CHECK(absl::GetFlag(FLAGS_lora) >= 0,
              "--lora must be 0 (no adapters) or a positive rank, got ", absl::GetFlag(FLAGS_lora));
  spec.lora_rank = absl::GetFlag(FLAGS_lora);
  spec.deferred_init = spec.deferred_init || absl::GetFlag(FLAGS_deferred_init);
}

// --check-flags: the run the flags describe, printed.
template <class Spec>
int print_checked_flags(const ps::Config& config, const Spec& spec, const RunShape& shape) {
  std::printf("ps_bench: flags accepted: %s, %lld parameters, %s, batch %lld, seq %lld, %lld steps, "
              "device %s%s\n", spec.name.c_str(), static_cast<long long>(spec.parameter_count()),
              std::string(ps::to_string(config.precision())).c_str(),
              static_cast<long long>(shape.batch), static_cast<long long>(shape.seq),
              static_cast<long long>(shape.steps),
              std::string(ps::to_string(config.device.type)).c_str(),
              config.device.capacity_bytes == ps::DeviceConfig::kAutoCapacity
                  ? " (auto capacity)"
                  : (" " + mib(static_cast<double>(config.device.capacity_bytes))).c_str());
  return 0;
}

// The other jobs (--find-max-model, --compare-*), when a flag asks for one: its exit status.
template <class Spec>
std::optional<int> other_job(const ps::Config& config, const Spec& spec, const RunShape& shape) {
  TORCH_CHECK(shape.world == 1 || !absl::GetFlag(FLAGS_find_max_model),
              "--find-max-model runs in one process (not under mpirun)");
  // The engine reports the config's unknown keys when it is built; the search builds many.
  if (absl::GetFlag(FLAGS_find_max_model)) {
    for (const std::string& w : config.warnings) std::fprintf(stderr, "config warning: %s\n", w.c_str());
  }
  const bool activations = absl::GetFlag(FLAGS_compare_activations);
  const bool longest = absl::GetFlag(FLAGS_longest_seq);
  TORCH_CHECK(shape.world == 1 || !(activations || longest),
              "--compare-activations and --longest-seq run in one process (not under mpirun)");
  if (activations) {
    return compare_activations(config, spec, shape.batch, shape.seq, shape.steps, shape.seed);
  }
  if (longest) return longest_seq(config, spec, shape.batch, shape.steps, shape.seed);
  if (absl::GetFlag(FLAGS_compare_plan)) {
    TORCH_CHECK(shape.world == 1, "--compare-plan runs in one process (not under mpirun)");
    return compare_plan(config, spec, shape.batch, shape.seq, shape.steps, shape.seed);
  }
  if constexpr (std::is_same_v<Spec, ps::models::GptSpec>) {
    const auto [batch, seq, steps, seed] = std::tuple(shape.batch, shape.seq, shape.steps, shape.seed);
    if (absl::GetFlag(FLAGS_find_max_model)) return find_max_model(config, spec, batch, seq, seed);
    const bool moves = absl::GetFlag(FLAGS_compare_moves);
    const bool delayed = absl::GetFlag(FLAGS_compare_delayed);
    const bool step = absl::GetFlag(FLAGS_compare_step);
    TORCH_CHECK(shape.world == 1 || !(moves || delayed || step),
                "--compare-moves, --compare-delayed and --compare-step run in one process (not "
                "under mpirun)");
    if (moves) return compare_moves(config, spec, batch, seq, steps, seed);
    if (delayed) return compare_delayed(config, spec, batch, seq, steps, seed);
    if (step) return compare_step(config, spec, batch, seq, steps, seed);
  } else {
    TORCH_CHECK(!absl::GetFlag(FLAGS_find_max_model) && !absl::GetFlag(FLAGS_compare_moves) &&
                    !absl::GetFlag(FLAGS_compare_delayed) && !absl::GetFlag(FLAGS_compare_step),
                "--find-max-model and the --compare-* modes train the GPT models only");
  }
  return std::nullopt;
}

// The steps: each rank trains its rows of the global batch; the global batch's loss is the mean
// of the ranks' (equal row counts).
template <class Model, class Optimizer, class Spec>
RunTotals run_steps(Model& model, Optimizer& optimizer, const Spec& spec, const ps::Config& config,
                    const RunShape& shape, ps::Communicator& comm) {
  ps::Engine& engine = model.engine();
  const ps::RegistrationReport& reg = engine.registration();
  RunTotals totals;
  const int64_t rows = shape.batch / shape.world;  // this rank's rows of the global batch
  for (int64_t s = 0; s < shape.steps; ++s) {
    auto data = batch_of(spec, config, shape.batch, shape.seq, shape.seed + 1 + static_cast<uint64_t>(s));
    const at::Tensor tokens = data.tokens.narrow(0, shape.rank * rows, rows);
    const at::Tensor targets = data.targets.narrow(0, shape.rank * rows, rows);
    const auto start = Clock::now();
    PhaseClock clock(config.device.type == ps::DeviceType::kCuda);
    const auto [loss, r] = train_step(model, optimizer, tokens, targets,
                                      absl::GetFlag(FLAGS_breakdown) ? &clock : nullptr);
    totals.add(s, shape.steps, r, engine, config, shape.world);
    if (s >= RunTotals::first_steady(shape.steps)) totals.phases += clock.phases();
    if (shape.lead && r.chunk_elems_retried > 0) print_chunk_size_retry(s + 1, r, reg);
    finish_device_work(config);
    const double t = seconds_since(start);
    totals.losses.push_back(sum_over_ranks(comm, {loss.template item<double>()})[0] / shape.world);
    if (s > 0) totals.times.push_back(t);
    if (shape.lead) print_step(s, shape, r, totals.losses.back(), t, reg.disk_bytes > 0);
  }
  totals.average(shape.steps);
  return totals;
}

// Trains `spec` (a GptSpec or a LlamaSpec) through the engine with the flags' settings.
template <class Spec>
int train(const ps::Config& config, Spec spec) {
  apply_model_flags(spec);
  RunShape shape = run_shape(spec);
  if (!absl::GetFlag(FLAGS_predict).empty()) ps::gpu_cost_model(absl::GetFlag(FLAGS_predict));  // known?
  if (absl::GetFlag(FLAGS_check_flags)) return print_checked_flags(config, spec, shape);
  std::shared_ptr<ps::Communicator> comm = ps::communicator_from_env();
  shape.world = comm->world_size();
  shape.rank = comm->rank();
  shape.lead = shape.rank == 0;
  TORCH_CHECK(shape.batch % shape.world == 0, "--batch ", shape.batch, " is the global batch: it "
              "must divide by the ", shape.world, " ranks");
  if (const std::optional<int> status = other_job(config, spec, shape)) return *status;

  if (shape.lead) {
    std::printf("ps_bench: %s, %lld parameters, %s, batch %lld, seq %lld, %lld steps, device %s %s, "
                "policy %s, %d rank(s)\n", spec.name.c_str(),
                static_cast<long long>(spec.parameter_count()),
                std::string(ps::to_string(config.precision())).c_str(),
                static_cast<long long>(shape.batch), static_cast<long long>(shape.seq),
                static_cast<long long>(shape.steps),
                std::string(ps::to_string(config.device.type)).c_str(),
                mib(static_cast<double>(config.device.capacity_bytes)).c_str(),
                ps::eviction_policy_name(config.scheduler.policy), shape.world);
    std::fflush(stdout);
  }
  auto [model, optimizer] = build_engine(spec, config, shape.seed, absl::GetFlag(FLAGS_init_from));
  ps::Engine& engine = model.engine();
  // The chunk timeline grows with every iteration: kept only for the outputs that read it.
  if (!absl::GetFlag(FLAGS_trace).empty() || !absl::GetFlag(FLAGS_plot).empty() ||
      !absl::GetFlag(FLAGS_predict).empty()) {
    engine.set_record_timeline(true);  // moves, moments, the copy thread's spans
  }
  if (shape.lead) {
    print_registration(engine.registration(), config, spec.deferred_init);
    if (shape.world == 1 && spec.lora_rank > 0) {
      print_bytes_by_training(inspect(engine).chunks(), model.module());
    }
  }
  if (const std::string from = absl::GetFlag(FLAGS_resume_from); !from.empty()) {
    engine.load_checkpoint(from);
    if (shape.lead) std::printf("resumed from checkpoint %s\n", from.c_str());
  }
  const RunTotals totals = run_steps(model, optimizer, spec, config, shape, *comm);
  if (const std::string to = absl::GetFlag(FLAGS_save_checkpoint); !to.empty()) {
    engine.save_checkpoint(to);
    if (shape.lead) std::printf("saved checkpoint %s\n", to.c_str());
  }

  std::optional<BaselineResult> baseline;
  if (absl::GetFlag(FLAGS_baseline)) {
    if (shape.lead) {
      std::printf("baseline: plain LibTorch + torch::optim::AdamW (fp32), same weights and data%s\n",
                  shape.world == 1 ? ""
                  : spec.dropout > 0
                      ? " (the ranks' rows as micro-batches from one random state, on every rank)"
                      : " (the whole global batch, on every rank)");
    }
    baseline =
        run_baseline(spec, config, shape.batch, shape.seq, shape.steps, shape.seed, shape.lead,
                     absl::GetFlag(FLAGS_init_from), shape.world, absl::GetFlag(FLAGS_breakdown));
  }

  nlohmann::json out;
  out["model"] = spec.name;
  out["architecture"] = std::is_same_v<Spec, ps::models::GptSpec> ? "gpt" : "llama";
  out["init_from"] = absl::GetFlag(FLAGS_init_from);
  out["checkpoint_activations"] = spec.checkpoint_activations;
  if (spec.checkpoint_activations) {
    const ps::ActivationPlanReport plan = engine.activation_plan();
    if (shape.lead) std::printf("\n%s", plan.text().c_str());
    std::vector<std::string> ways;
    for (const ps::ActivationCallPlan& c : plan.calls) ways.push_back(c.choice);
    out["activation_policy"] = plan.policy;
    out["activation_choices"] = ways;
    if (plan.planned) out["activation_predicted_step_s"] = plan.predicted_step_seconds;
  }
  if (const ps::PlanReport plan = engine.plan(); plan.planned) {
    out["plan"] = plan_json(plan);
    if (const std::string path = absl::GetFlag(FLAGS_write_plan); !path.empty() && shape.lead) {
      write_plan(plan, path);
    }
  } else {
    TORCH_CHECK(absl::GetFlag(FLAGS_write_plan).empty(), "--write-plan: the engine made no plan ",
                "(give --plan, and --steps of at least 2)");
  }
  out["dropout"] = spec.dropout;
  out["lora_rank"] = spec.lora_rank;
  out["deferred_init"] = spec.deferred_init;
  add_engine_figures(out, engine, config, shape, totals, megatron_flops(spec, shape.batch, shape.seq));
  if (shape.world > 1) add_per_rank_figures(out, *comm, engine, shape, totals);
  out["losses"] = totals.losses;
  if (baseline) {
    out["baseline_step_time_s"] = baseline->step_time_s;
    out["baseline_losses"] = baseline->losses;
    out["max_relative_loss_difference"] = max_relative_difference(totals.losses, baseline->losses);
    out["step_time_ratio_to_baseline"] = median(totals.times) / baseline->step_time_s;
    if (absl::GetFlag(FLAGS_breakdown)) {
      out["baseline_breakdown"] = {{"forward_s", baseline->phases.forward},
                                   {"backward_s", baseline->phases.backward},
                                   {"step_s", baseline->phases.step}};
    }
  }
  if (!shape.lead) return 0;  // rank 0 prints and writes the files
  print_and_write(out, engine, model.module(), config, shape, totals);
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
