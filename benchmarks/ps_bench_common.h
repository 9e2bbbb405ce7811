// ps_bench's shared pieces (benchmarks/ps_bench*.cpp): timing and statistics, the process's memory
// figures, the config from the flags, batches on the configured device, the plain LibTorch baseline,
// the engine built from a seed, and sums over data-parallel ranks.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "patrickstar/models/gpt.h"
#include "patrickstar/models/llama_pretrained.h"
#include "patrickstar/patrickstar.h"

namespace ps = patrickstar;

namespace ps_bench {

using Clock = std::chrono::steady_clock;

// The process's resident bytes when main() began (the figures' accounting starts from it).
extern int64_t g_rss_at_start;

// --breakdown: one step's phases, each ended by a device synchronization on CUDA (it waits for
// the phase's kernels; the synchronizations add to the step, for the engine and the baseline
// alike). Sums over the steady steps until divided.
struct PhaseSeconds {
  double forward = 0, backward = 0, step = 0;
  PhaseSeconds& operator+=(const PhaseSeconds& o) {
    forward += o.forward, backward += o.backward, step += o.step;
    return *this;
  }
  PhaseSeconds& operator/=(double n) {
    forward /= n, backward /= n, step /= n;
    return *this;
  }
};

struct BaselineResult {
  std::vector<double> losses;
  double step_time_s = 0;
  PhaseSeconds phases;  // --breakdown: per steady step
};

double seconds_since(Clock::time_point start);
double median(std::vector<double> v);
double mean(const std::vector<double>& v);
double max_relative_difference(const std::vector<double>& a, const std::vector<double>& b);
std::string mib(double bytes);  // "12.34 MiB"
// The figures every comparison's JSON starts with: model, params, dtype, batch, seq, intra-op
// threads.
// Writes `out` to the file --json names (if any) and says so.
void write_json_if_asked(const nlohmann::json& out);
nlohmann::json run_header(const ps::models::GptSpec& spec, const ps::Config& config, int64_t batch,
                          int64_t seq);
// A line of /proc/self/status in bytes ("VmHWM", "VmRSS"); -1 where there is none.
int64_t proc_status_bytes(const std::string& key);
nlohmann::json print_breakdown(const char* title, const ps::MemoryBreakdown& b,
                               int64_t device_capacity);
ps::Config build_config();
c10::Device batch_device(const ps::Config& config);
void finish_device_work(const ps::Config& config);
// Random token ids of the model's vocabulary from `seed` (the same for both architectures' specs).
template <class Spec>
ps::models::TokenBatch batch_of(const Spec& spec, const ps::Config& config, int64_t batch,
                                int64_t seq, uint64_t seed);
// Plain LibTorch + torch::optim::AdamW on the engine's initial weights (`init_from`: a Llama
// checkpoint's) and data. With dropout and `world` > 1 ranks, each step runs the ranks' rows as
// `world` micro-batches, each from the random state the step started at (every rank's generator
// was seeded alike and draws the same shapes), their gradients averaged: data parallel's masks.
template <class Spec>
BaselineResult run_baseline(const Spec& spec, const ps::Config& config, int64_t batch, int64_t seq,
                            int64_t steps, uint64_t seed, bool print,
                            const std::string& init_from = "", int world = 1,
                            bool breakdown = false);
int local_rank();
std::vector<double> sum_over_ranks(ps::Communicator& comm, std::vector<double> values);
// The model of `spec` built from `seed` (the baseline builds the same weights); a Llama from the
// checkpoint in `init_from` when given (its values are read at registration).
ps::models::Gpt make_model(const ps::models::GptSpec& spec, uint64_t seed,
                           const std::string& init_from);
ps::models::Llama make_model(const ps::models::LlamaSpec& spec, uint64_t seed,
                             const std::string& init_from);
// Megatron-LM's count of a step's floating-point operations (activation recomputation included:
// 4 passes of 2 flops per multiply-add) for each architecture.
double megatron_flops(const ps::models::GptSpec& spec, int64_t batch, int64_t seq);
double megatron_flops(const ps::models::LlamaSpec& spec, int64_t batch, int64_t seq);
// Model data per frozen and per trained parameter (--lora).
void print_bytes_by_training(const ps::ChunkStore& store, torch::nn::Module& module);
// Step `step`'s warm-up moved the model into smaller chunks ("auto", IterationReport::
// chunk_elems_retried): the line that says so, with the new layout's figures.
void print_chunk_size_retry(int64_t step, const ps::IterationReport& report,
                            const ps::RegistrationReport& registration);

// The model built from `seed` and registered per `config`.
template <class Spec>
auto build_engine(const Spec& spec, const ps::Config& config, uint64_t seed,
                  const std::string& init_from = "") {
  return ps::initialize_engine([&] { return make_model(spec, seed, init_from); }, local_rank(),
                               config);
}

// One training step through the engine, written as a LibTorch loop writes it (every mode trains
// through this): the loss and the step's report.
struct StepResult {
  at::Tensor loss;
  ps::IterationReport report;
};

// Laps between a step's phases, kept in phases(); on CUDA each lap first waits for the device
// (--breakdown).
class PhaseClock {
 public:
  explicit PhaseClock(bool cuda) : cuda_(cuda) {}
  // The time since the last lap (or the clock's start), added to `phase`.
  void lap(double PhaseSeconds::*phase);
  const PhaseSeconds& phases() const { return phases_; }

 private:
  bool cuda_;
  Clock::time_point last_ = Clock::now();
  PhaseSeconds phases_;
};

template <class Model, class Optimizer>
StepResult train_step(Model& model, Optimizer& optimizer, const at::Tensor& tokens,
                      const at::Tensor& targets, PhaseClock* clock = nullptr) {
  optimizer.zero_grad();
  at::Tensor loss = model->loss(tokens, targets);
  if (clock != nullptr) clock->lap(&PhaseSeconds::forward);
  model.backward(loss);
  if (clock != nullptr) clock->lap(&PhaseSeconds::backward);
  ps::IterationReport report = optimizer.step();
  if (clock != nullptr) clock->lap(&PhaseSeconds::step);
  return StepResult{loss, std::move(report)};
}

// --find-max-model (ps_bench_search.cpp), --compare-moves (ps_bench_compare.cpp).
int find_max_model(const ps::Config& base_config, const ps::models::GptSpec& base, int64_t batch,
                   int64_t seq, uint64_t seed);
int compare_moves(const ps::Config& base, const ps::models::GptSpec& spec, int64_t batch,
                  int64_t seq, int64_t steps, uint64_t seed);
// --compare-step (ps_bench_overlap.cpp).
int compare_step(const ps::Config& base, const ps::models::GptSpec& spec, int64_t batch,
                 int64_t seq, int64_t steps, uint64_t seed);
// --compare-activations and --longest-seq (ps_bench_activations.cpp; GptSpec and LlamaSpec).
template <class Spec>
int compare_activations(const ps::Config& base, Spec spec, int64_t batch, int64_t seq,
                        int64_t steps, uint64_t seed);
template <class Spec>
int longest_seq(const ps::Config& base, Spec spec, int64_t batch, int64_t steps, uint64_t seed);
// --compare-plan, and the plan in the JSON and in a file (--write-plan) (ps_bench_plan.cpp; GptSpec
// and LlamaSpec).
template <class Spec>
int compare_plan(const ps::Config& base, Spec spec, int64_t batch, int64_t seq, int64_t steps,
                 uint64_t seed);
nlohmann::json plan_json(const ps::PlanReport& plan);
void write_plan(const ps::PlanReport& plan, const std::string& path);
// --compare-delayed (ps_bench_delayed.cpp).
int compare_delayed(const ps::Config& base, const ps::models::GptSpec& spec, int64_t batch,
                    int64_t seq, int64_t steps, uint64_t seed);

}  // namespace ps_bench
