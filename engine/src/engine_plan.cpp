// "plan": "auto" (run_plan.h; docs/design.md, "The plan"): what the engine hands its RunPlanner
// and what it does with the choice.
#include "engine_core.h"

#include <algorithm>
#include <chrono>
#include <optional>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "patrickstar/memtracer/cost_model.h"

#include "engine_internal.h"
#include "scope_timer.h"

namespace patrickstar {
using namespace engine_detail;  // NOLINT: this folder's private helpers

void EngineCore::check_plan_config() const {
  if (dp_.distributed()) {
    // The ranks plan together (after the same iteration, on rank 0's activations): alike on every
    // rank, or refused on every rank alike, before registration.
    const bool on = config_.plan.mode == PlanMode::kAuto;
    const bool everywhere = dp_.all_agree(on);
    const bool nowhere = dp_.all_agree(!on);
    TORCH_CHECK(everywhere || nowhere,
                "patrickstar::Engine: \"plan\" is \"auto\" on some ranks and \"off\" on others; "
                "the ranks plan together, so set it alike on every rank");
  }
  // (The streamed placement is the plan's candidate, and a setting of its own.)
  TORCH_CHECK(!config_.optimizer.stream_states || dp_.one_process(),
              "patrickstar::Engine: optimizer.params.stream_states streams one process's states "
              "for now; with ",
              dp_.world(), " ranks leave it false");
  if (config_.plan.mode != PlanMode::kAuto) {
    const PlanConfig defaults;
    if (config_.plan.profile != defaults.profile ||
        config_.plan.check_iterations != defaults.check_iterations ||
        config_.plan.tolerance != defaults.tolerance) {
      TORCH_WARN(
          "patrickstar: plan_profile, plan_check_iterations and plan_tolerance have no "
          "effect without \"plan\": \"auto\"");
    }
    return;
  }
  TORCH_CHECK(config_.scheduler.policy != EvictionPolicy::kStatic,
              "patrickstar::Engine: \"plan\": \"auto\" with the static policy: every param chunk "
              "stays on the device and every Adam runs on the host, so there is nothing to plan; "
              "use the \"opt\" or \"lru\" policy, or \"plan\": \"off\"");
  if (config_.plan.profile != "measured") (void)named_plan_profile(config_.plan.profile);
  if (config_.overlap_step.mode == OverlapMode::kOn) {
    TORCH_WARN(
        "patrickstar: \"plan\": \"auto\" chooses between the serial and the overlapped "
        "step (and the delayed update, where the config allows it); "
        "zero_optimization.overlap_step true makes the overlapped one a candidate, not "
        "the setting (false leaves it out)");
  }
}

RunPlanner::Mark EngineCore::plan_mark() const {
  const RunningTotals t = running_totals();
  return {std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(),
          t.copy_wait_seconds, t.moves.h2d_bytes + t.moves.d2h_bytes};
}

PlanInputs EngineCore::plan_inputs(std::vector<double> compute) const {
  PlanInputs in;
  in.scheduler = scheduler_->options();
  in.compute_seconds = std::move(compute);
  in.overlap_possible =
      pipeline_->overlap_possible() && config_.overlap_step.mode != OverlapMode::kOff;
  in.host_placement_possible = config_.optimizer.use_hybrid_adam;
  // (The disk tier keeps the states of the host's share on disk: none stream.)
  // (Data parallel: states stream in one process only.)
  in.streamed_possible =
      config_.optimizer.use_hybrid_adam && storage_.disk() == nullptr && dp_.one_process();
  // The delayed update (allowed by the config), per parameter: fp32 copies the gradient and the
  // weight at the hand-over and writes the weight back at the landing (4 + 4 + 4 bytes); mixed
  // precision copies the gradient (fp32 with a gradient space: 4; else the half slot's 2, whose
  // half weight is then rounded back, 2) and writes the half weight at the landing (2).
  in.delayed_possible = pipeline_->delayed_possible();
  in.delayed_bytes_per_param = mixed() ? 6 : 12;
  in.async_moves = config_.scheduler.async_moves;
  in.layouts.push_back(plan_layout_now(scheduler_->trace(), plan_.placement_peak()));
  // (The offloads' copy waits are out of the measured compute: the model's exposed ones go back.)
  in.layouts[0].extra_seconds = activations_->planner.unmeasured_exposed_seconds();
  const std::vector<int64_t> sizes = plan_chunk_sizes();
  for (int64_t size : sizes) {
    if (std::optional<PlanLayout> other =
            plan_layout_of(size, in.layouts[0].trace, plan_.placement_peak())) {
      other->extra_seconds = in.layouts[0].extra_seconds;  // (the same activations' copies)
      in.layouts.push_back(std::move(*other));
    }
  }
  // (Every size runs the activations the engine runs: what a pinned config names.)
  const std::vector<std::string> calls = running_activation_calls();
  for (PlanLayout& layout : in.layouts) layout.activation_calls = calls;
  for (PlanLayout& other : plan_activation_layouts(in.compute_seconds, sizes)) {
    in.layouts.push_back(std::move(other));
  }
  return in;
}

PlanLayout EngineCore::plan_layout_now(Trace trace, int64_t peak_non_model) const {
  PlanLayout layout;
  layout.chunk_elems = store().chunk_elems();
  layout.trace = std::move(trace);
  layout.chunks = scheduler_->chunks();
  const AdamPlacement& placement = pipeline_->placement();
  // The margin's and the streamed placement from the figures the engine's was decided with (and
  // the step's non-model bytes this trace measured), whichever one the engine runs.
  PlacementFigures figures;
  figures.peak_non_model = peak_non_model;
  figures.step_non_model = step_non_model_of(layout.trace);
  figures.usable_device_bytes = usable_device_bytes(config_);
  figures.device_state_bytes = metrics_.registration().device_state_bytes;
  const std::vector<bool> margin = pipeline_->placement_for(AdamSite::kMargin, figures);
  const std::vector<bool> streamed = pipeline_->placement_for(AdamSite::kStreamed, figures);
  for (int64_t i = 0; i < store().chunks_per_kind(); ++i) {
    if (!owns(i) || storage_.host_only()[static_cast<size_t>(i)] || !pipeline_->index_trains(i)) {
      continue;
    }
    PlanIndex x;
    const int64_t param = store().chunk_id(ChunkKind::kParam, i);
    x.params = static_cast<double>(store().chunk(param).capacity_elems);
    x.device_side = adam_side_chunks(i, /*device=*/true);
    x.host_side = adam_side_chunks(i, /*device=*/false);
    for (int64_t c : x.device_side) {
      x.device_adam_bytes += store().chunk_bytes(c);
      if (store().kind_of(c) != ChunkKind::kGrad) x.undo_bytes += store().chunk_bytes(c);
    }
    x.on_device = margin[static_cast<size_t>(i)];
    x.streamed = streamed[static_cast<size_t>(i)];
    x.ran_on_device = placement.decided() && placement.on_device()[static_cast<size_t>(i)];
    x.device_only = placement.device_only(i);
    x.own = {param};
    if (store().has_kind(ChunkKind::kGrad)) x.own.push_back(store().chunk_id(ChunkKind::kGrad, i));
    layout.indices.push_back(std::move(x));
  }
  find_ready_moments(layout);
  return layout;
}

PlanProfile EngineCore::plan_profile(const PlanInputs& in, double adam_seconds,
                                     double copy_bytes_per_s) const {
  const bool cuda = config_.device.type == DeviceType::kCuda;
  PlanProfile p;
  if (config_.plan.profile != "measured") {
    p = named_plan_profile(config_.plan.profile);
  } else {
    p.name = "measured";
    double updated = 0;  // parameters the measured step updated, and of them on the host
    double on_host = 0;
    for (const PlanIndex& x : in.layouts.front().indices) {
      updated += x.params;
      if (!x.ran_on_device && !x.device_only) on_host += x.params;
    }
    const GpuCostModel h100 = gpu_cost_model("h100");
    // The emulated device runs the host kernel on its memory: one rate for both sides. On a GPU
    // the device Adam runs on its stream, so the step's host time is the host Adam's.
    const double counted = cuda ? on_host : updated;
    const bool rate_measured = counted > 0 && adam_seconds > 0;
    p.host_adam_params_per_s = rate_measured ? counted / adam_seconds : h100.host_adam_params_per_s;
    if (cuda) {
      p.device_memory_bytes_per_s = gpu_cost_model("h200").device_memory_bytes_per_s;
    } else {
      p.device_adam_params_per_s = p.host_adam_params_per_s;
    }
    p.h2d_bytes_per_s = p.d2h_bytes_per_s = copy_bytes_per_s > 0 ? copy_bytes_per_s : 10e9;
    p.sources = absl::StrCat(
        copy_bytes_per_s > 0 ? "copies: the best of 3 host-to-device copies of a chunk, the same "
                               "rate assumed back"
                             : "copies: 10 GB/s assumed (the host tier could not spare a block)",
        "; Adam: ",
        rate_measured ? "the measured step's parameters over its Adam time"
                      : "the h100 model's host rate (the measured step updated none on the host)",
        cuda ? "; the device Adam reads and writes its chunks once at the h200's memory bandwidth"
             : "; the device Adam is the host kernel on the device's memory",
        "; compute: each moment of the measured iteration, less its copy waits");
  }
  // On the emulated device the copy thread and the optimizer thread run beside compute only where
  // LibTorch's compute threads leave a core free (a named profile is a GPU's: beside, always).
  if (config_.plan.profile == "measured") {
    p.beside_compute = cuda || StepPipeline::host_cores() > at::get_num_threads() ? 1 : 0;
  }
  return p;
}

void EngineCore::apply_plan(const PlanCandidateReport& chosen) {
  const bool overlap = pipeline_->overlap_possible();
  const AdamSite site = chosen.adam == "host"       ? AdamSite::kHost
                        : chosen.adam == "streamed" ? AdamSite::kStreamed
                                                    : AdamSite::kMargin;
  const bool resize = chosen.chunk_elems != store().chunk_elems();
  if (resize) {
    // The model moves first (the size passed the host budget's check, as the retry's does); the
    // optimizer thread's kept buffers are the old chunks' size: given back before.
    if (overlap) pipeline_->set_overlap_step(false);
    if (scheduler_->has_trace()) scheduler_->drop_trace();
    move_to_chunk_size(chosen.chunk_elems, /*retried=*/false);
  }
  const bool activations = run_plan_activations(chosen);
  if (site != pipeline_->adam_site() || resize || activations) {
    pipeline_->set_adam_site(site);
    // The step moment's accesses (and with a new size every moment's, with other activations
    // their non-model bytes) change: the next iteration records the trace again (a warm-up), and
    // the step after it decides the placement with the plan's.
    record_trace_again();
  }
  // One optimizer thread on at a time: the one going off first.
  const bool delayed = pipeline_->delayed_possible();
  if (overlap && chosen.schedule != "overlapped") pipeline_->set_overlap_step(false);
  if (delayed && chosen.schedule != "delayed") pipeline_->set_delayed_update(false);
  if (overlap && chosen.schedule == "overlapped") pipeline_->set_overlap_step(true);
  if (delayed && chosen.schedule == "delayed") pipeline_->set_delayed_update(true);
}

void EngineCore::record_trace_again() {
  pipeline_->on_retrace();
  recorder_->rewarm();
  if (scheduler_->has_trace()) scheduler_->drop_trace();
}

void EngineCore::keep_config_schedule() {
  pipeline_->restore_overlap_mode();  // with the delayed update allowed: it alone, on
  const AdamSite config_site = config_adam_site(config_);
  const bool site_changed = pipeline_->adam_site() != config_site;
  pipeline_->set_adam_site(config_site);
  const bool activations = run_plan_activations({});  // the activation plan's own
  if (pipeline_->delayed_possible() || site_changed || activations) {
    // The delayed update runs its Adam on the host: the placement, decided with it off, is decided
    // again (the next iteration records the trace again, as after a plan that moves Adam).
    record_trace_again();
  }
}

void EngineCore::apply_plan_candidate(int candidate) {
  std::lock_guard<engine_detail::EntryGate> lock(entry_gate_);
  PlanReport& report = plan_.report();
  if (candidate == -1 && report.planned) {
    report.chosen = -1;
    report.predicted_step_seconds = 0;
    keep_config_schedule();
    return;
  }
  TORCH_CHECK(
      report.planned && candidate >= 0 && candidate < static_cast<int>(report.candidates.size()),
      "apply_plan_candidate: no candidate ", candidate, " in the plan");
  report.chosen = candidate;
  report.predicted_step_seconds =
      report.candidates[static_cast<size_t>(candidate)].predicted_step_seconds;
  apply_plan(report.candidates[static_cast<size_t>(candidate)]);
}

std::optional<Trace> EngineCore::plan_trace_of(int64_t chunk_elems) const {
  if (!scheduler_->has_trace()) return std::nullopt;
  std::optional<PlanLayout> layout =
      plan_layout_of(chunk_elems, scheduler_->trace(), plan_.placement_peak());
  if (!layout) return std::nullopt;
  return std::move(layout->trace);
}

std::optional<Trace> EngineCore::plan_candidate_trace(int candidate) const {
  const PlanReport& report = plan_.report();
  if (!report.planned || candidate < 0 || candidate >= static_cast<int>(report.candidates.size())) {
    return std::nullopt;
  }
  const PlanLayout* layout =
      layout_of(plan_.inputs(), report.candidates[static_cast<size_t>(candidate)]);
  if (layout == nullptr) return std::nullopt;
  return layout->trace;
}

void EngineCore::plan_after_step(IterationReport& report) {
  if (!plan_.enabled()) return;
  const RunPlanner::Mark now = plan_mark();
  const bool usable = !report.skipped && !report.retraced && !report.warmup &&
                      report.chunk_elems_retried == 0 && scheduler_->has_trace();
  if (!plan_.planned()) {
    std::vector<double> compute;
    double bandwidth = 0;
    double adam_seconds = 0;
    if (plan_.measuring() && usable) {
      const Trace& trace = scheduler_->trace();
      const int64_t step = step_moment_of(trace);
      int64_t largest = 0;
      for (const auto& [id, info] : scheduler_->chunks()) largest = std::max(largest, info.bytes);
      bandwidth = measure_copy_bandwidth(
          *storage_.device(), *storage_.host(), storage_.device()->device(),
          std::clamp<int64_t>(largest, int64_t{1} << 20, int64_t{64} << 20));
      // The update's own time: its copy waits (Adam's chunks moved home) are copies.
      adam_seconds = std::max(0.0, report.adam_seconds - plan_.copy_wait_since(step, now));
      compute = plan_.end_measuring(trace.size(), step, now, adam_seconds, bandwidth,
                                    !config_.scheduler.async_moves);
    } else if (plan_.measuring()) {
      plan_.end_measuring(-1, -1, now, 0, 0, false);  // measures nothing: the next one does
    }
    // Data parallel: every rank plans after the same iteration, or none does (one small
    // all-reduce per step() until the plan: here, or in plan_missed_turn where the step threw).
    plan_.take_turn();
    if (dp_.all_agree(!compute.empty())) {
      plan_now(std::move(compute), adam_seconds, bandwidth, report);
      return;
    }
  }
  if (!plan_.planned()) {
    // The iteration after one the scheduler ran is measured (after the warm-up, after a retrace).
    if (scheduler_->has_trace() && report.chunk_elems_retried == 0) plan_.begin_measuring();
    return;
  }
  if (report.chunk_elems_retried > 0 && plan_.checks() < 2) {
    plan_.stop_checking(absl::StrCat(
        "the warm-up with the plan's chunk size did not fit the device, and \"auto\" moved the "
        "model into chunks of ",
        report.chunk_elems_retried, " elements: the plan is not checked"));
    report.plan_decision = absl::StrCat("plan check: ", plan_.report().check);
    return;
  }
  check_plan(report, now);
}

void EngineCore::plan_missed_turn() {
  if (!dp_.distributed() || !plan_.enabled() || plan_.planned() || !plan_.take_turn()) return;
  if (plan_.measuring()) plan_.end_measuring(-1, -1, RunPlanner::Mark{}, 0, 0, false);
  // (Where another rank waits in some other collective instead, this one may never return: the
  // step's failure is said first. A rank fails alone before its turn only where the trainer's
  // calls differ by rank before the step's own agreement: step()'s preconditions.)
  TORCH_WARN("patrickstar: the step failed on rank ", dp_.rank(),
             "; it takes its part in the plan's agreement before the error reaches the trainer");
  try {
    (void)dp_.all_agree(false);
  } catch (...) {  // NOLINT(bugprone-empty-catch): the step's own error is the one thrown
  }
}

void EngineCore::plan_now(std::vector<double> compute, double adam_seconds, double bandwidth,
                          IterationReport& report) {
  const PlanCandidateReport* chosen = nullptr;
  double planning = 0;
  {
    const ScopeTimer timer(planning);
    // Data parallel: the collectives come in the same order on every rank, whatever fails where.
    std::string error;
    PlanInputs in;
    PlanProfile profile;
    std::string mix;  // the per-call search's mix (rank 0's, with data parallel)
    auto guarded = [&error](const auto& work) {
      if (!error.empty()) return;
      try {
        work();
      } catch (const c10::Error& e) {
        error = e.what_without_backtrace();
      } catch (const std::exception& e) {
        error = e.what();
      } catch (...) {
        error = "an exception that is not a std::exception";
      }
    };
    guarded([&] {
      in = plan_inputs(std::move(compute));
      profile = plan_profile(in, adam_seconds, bandwidth);
      if (dp_.rank() == 0) mix = search_activation_calls(in, profile);
    });
    if (dp_.distributed()) mix = dp_.rank_zeros(mix);
    guarded([&] {
      if (dp_.rank() != 0) add_activation_mix(in, mix);
      chosen = plan_.plan(in, profile);
    });
    if (!error.empty()) plan_.give_up(error);  // the step is done; training goes on
    chosen = agree_on_activations(chosen);
  }
  plan_.report().planning_seconds = planning;
  report.plan_decision = plan_.report().text();
  if (chosen != nullptr) {
    apply_plan(*chosen);
  } else {
    keep_config_schedule();  // the config's settings, as the report says
    TORCH_WARN("patrickstar: ", report.plan_decision);
  }
}

const PlanCandidateReport* EngineCore::agree_on_activations(const PlanCandidateReport* chosen) {
  if (!dp_.distributed()) return chosen;
  // Every rank runs rank 0's activations (a recompute's doors gather on every rank); each chooses
  // its own schedule and Adam placement with them, for the indices it steps (rank 0: its own).
  const std::string key = dp_.rank_zeros(chosen != nullptr ? activation_key(*chosen) : "");
  const PlanCandidateReport* mine = nullptr;
  std::string local;  // why this rank cannot follow ("": it can)
  if (key.empty() || plan_.report().candidates.empty()) {
    local = absl::StrCat("no plan (", plan_.report().why, ")");
  } else {
    mine = plan_.choose_within(
        key, absl::StrCat("data parallel over ", dp_.world(), " ranks, with rank 0's activations"));
    if (mine == nullptr) local = "no candidate with rank 0's chunk size and activations fits";
  }
  const std::string failed = dp_.first_error(local);
  if (failed.empty()) return mine;
  plan_.give_up(absl::StrCat("data parallel: ", failed, "; on every rank"));
  return nullptr;
}

void EngineCore::check_plan(IterationReport& report, const RunPlanner::Mark& now) {
  const int checks = plan_.checks();
  // An iteration under a delayed plan counts once its step hands its update over and the step
  // before did too (an update in flight ran beside it and was landed: the steady state).
  const PlanReport& plan = plan_.report();
  const bool delayed_plan =
      plan.chosen >= 0 && plan.candidates[static_cast<size_t>(plan.chosen)].schedule == "delayed";
  const bool counted = !report.skipped && !report.retraced && !report.warmup &&
                       (!delayed_plan || plan_.steady_hand_over(report.update_delayed));
  if (!plan_.end_iteration(counted, now.time - plan_.iteration_start().time)) {
    if (plan_.checks() != checks) {
      report.plan_decision = absl::StrCat("plan check: ", plan_.report().check);
    }
    return;
  }
  const std::string check = plan_.report().check;
  const PlanCandidateReport* chosen = nullptr;
  double planning = 0;
  try {
    const ScopeTimer timer(planning);
    // (The inputs planned once already: the same candidates fit.)
    const std::string key =
        dp_.distributed()
            ? activation_key(plan_.report().candidates[static_cast<size_t>(plan_.report().chosen)])
            : std::string();
    chosen = plan_.plan(plan_.inputs(), plan_.profile());
    if (dp_.distributed()) {
      // Each rank checks its own step and plans again alone: with the activations every rank runs
      // (the same candidate still fits).
      chosen = plan_.choose_within(key, absl::StrCat("data parallel over ", dp_.world(),
                                                     " ranks, with the activations they run"));
    }
  } catch (const c10::Error& e) {
    plan_.give_up(e.what_without_backtrace());
  }
  plan_.report().planning_seconds = planning;
  plan_.report().check = check;
  report.plan_decision = plan_.report().text();
  if (chosen != nullptr) apply_plan(*chosen);
}

}  // namespace patrickstar
