// ps_bench's main job in parts: the run's shape, what its steps reported (summed over the steady
// iterations as the steps go), the line printed per step, and the figures (printed, JSON) made from
// them at the end. ps_bench.cpp trains; ps_bench_report.cpp holds these. Not thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "patrickstar/patrickstar.h"
#include "ps_bench_common.h"

namespace ps = patrickstar;

namespace ps_bench {

// The flags' shape of a run and this process's place in it.
struct RunShape {
  int64_t batch = 0;  // the global batch; each rank trains batch / world rows
  int64_t seq = 0;
  int64_t steps = 0;
  uint64_t seed = 0;
  int world = 1;
  int rank = 0;
  bool lead = true;  // rank 0: prints and writes the files
};

// What the steps reported. The losses (the global batch's) and the times are per step; the rest is
// summed over the steady iterations, which come after the warm-up and after the first scheduled
// iteration (it still moves the warm-up's placement into the schedule's) when there are enough
// steps, and divided by their number at the end (average()): a long run holds no more than a
// short one.
struct RunTotals {
  std::vector<double> losses, times;  // times: every step after the warm-up
  ps::IterationReport warmup_report, last_report;
  double h2d = 0, d2h = 0, forced = 0, copy_wait = 0;  // per steady iteration after average()
  double adam_s = 0, disk_read = 0, disk_written = 0, disk_wait = 0;
  // Data parallel, summed (per_rank_figures divides them).
  double gathers = 0, gather_bytes = 0, reduces = 0, reduce_bytes = 0, all_reduce_bytes = 0;
  double collective_s = 0, gathered_peak = 0;
  // The engine's host time in its entry points, their count and the host synchronizations
  // (IterationReport), and with --breakdown the phases' times: per steady iteration.
  double engine_host_s = 0, engine_entries = 0, host_syncs = 0;
  PhaseSeconds phases;
  bool formula_ok = true;      // every steady iteration's collective bytes equalled the formula
  int64_t non_model_peak = 0;  // over every iteration
  int64_t device_peak = 0;     // over the steady iterations
  double steady_iterations = 1;

  // The first steady step of a run of `steps`.
  static int64_t first_steady(int64_t steps) { return steps > 2 ? 2 : 1; }
  // Adds step `step`'s report; `engine` gives the chunk sizes of the collective formula and the
  // scheduler's peak of the iteration.
  void add(int64_t step, int64_t steps, const ps::IterationReport& r, ps::Engine& engine,
           const ps::Config& config, int world);
  // The traffic and times per steady iteration.
  void average(int64_t steps);
};

// The lines of one step (rank 0): loss, time, traffic, Adam's placement; with data parallel the
// collectives, with a disk tier its traffic.
void print_step(int64_t step, const RunShape& shape, const ps::IterationReport& r, double loss,
                double seconds, bool disk_tier);
// The registration's lines: chunks, the initialization peak, where the optimizer states went.
void print_registration(const ps::RegistrationReport& reg, const ps::Config& config,
                        bool deferred_init);
// The engine's figures of the run (traffic, OPT bound, memory, Adam, speed) into `out`; `flops` is
// the Megatron count of one step.
void add_engine_figures(nlohmann::json& out, ps::Engine& engine, const ps::Config& config,
                        const RunShape& shape, const RunTotals& totals, double flops);
// Data parallel: every rank's figures per steady iteration (a collective: every rank calls it).
void add_per_rank_figures(nlohmann::json& out, ps::Communicator& comm, ps::Engine& engine,
                          const RunShape& shape, const RunTotals& totals);
// Rank 0's report: the memory breakdowns, the process line, the GPU prediction (--predict), the
// table of figures, then the JSON (--json), the chunk timeline (--trace) and the memory plot
// (--plot).
void print_and_write(nlohmann::json& out, ps::Engine& engine, torch::nn::Module& module,
                     const ps::Config& config, const RunShape& shape, const RunTotals& totals);

}  // namespace ps_bench
