#include "engine_core.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include <ATen/ops/full.h>
#include <c10/util/Exception.h>

#include "disk_states.h"
#include "engine_internal.h"

namespace patrickstar {
using namespace engine_detail;  // NOLINT: this folder's private helpers

PipelineWiring EngineCore::pipeline_wiring() {
  return PipelineWiring{
      config_,
      params_,
      storage_,
      gradients_,
      tracker_,
      [this]() -> const Scheduler& { return *scheduler_; },
      [this]() -> ChunkMover& { return *mover_; },
      dp_.shards_gradients(),
      mixed(),
      [this](int64_t index) { return owns(index); },
      [this](TensorId id) { return groups_.group_of(id); },
      [this](int64_t index) { return dp_.reduction_pending(store().layout(), index); }};
}

void EngineCore::decide_adam_placement() {
  PlacementFigures f;
  f.peak_non_model = probe_->peak_bytes();
  for (const Moment& m : recorder_->current_trace().moments) {
    f.peak_non_model = std::max(f.peak_non_model, m.non_model_bytes);
  }
  // At the step, as the scheduler counts it (step_non_model_of): the interval since the last
  // moment (what the step moment records), the next one (the first moment's, as this iteration's
  // was), and the step's own temporaries as the last whole trace measured them (report_iteration).
  f.step_non_model = std::max(probe_->peak_bytes(), pipeline_->placement().noted_step_non_model());
  if (!recorder_->current_trace().moments.empty()) {
    f.step_non_model =
        std::max(f.step_non_model, recorder_->current_trace().moments.front().non_model_bytes);
  }
  f.usable_device_bytes = usable_device_bytes(config_);
  f.device_state_bytes = metrics_.registration().device_state_bytes;
  pipeline_->decide_placement(f);
  plan_.note_placement_peak(f.peak_non_model);  // (the plan places other chunk sizes alike)
}

std::vector<int64_t> EngineCore::adam_side_chunks(int64_t index, bool device) const {
  auto id_of = [&](ChunkKind kind) { return store().chunk_id(kind, index); };
  std::vector<int64_t> ids;
  if (device) {
    ids.push_back(id_of(ChunkKind::kParam));
    if (mixed()) ids.push_back(id_of(ChunkKind::kParamFp32));
    ids.push_back(id_of(ChunkKind::kMomentum));
    ids.push_back(id_of(ChunkKind::kVariance));
    if (gradients_.space()) ids.push_back(id_of(ChunkKind::kGrad));
    return ids;
  }
  for (ChunkKind kind : kAdamKinds) {
    if (store().has_kind(kind)) ids.push_back(id_of(kind));
  }
  return ids;
}

EngineCore::StepMoment EngineCore::step_moment() {
  const int64_t n = store().chunks_per_kind();

  // The step moment: chunks whose Adam runs on the device are accessed there. The warm-up runs
  // every update on the host (its chunk budget is the conservative one) but records the steady
  // state's accesses, so that from the next iteration on the schedule knows when the optimizer
  // states are used.
  // The step moment first: when it is the first moment that differs from the trace, the rest of
  // the step (budget, placement, the trace check) is the warm-up's.
  close_moment();
  follow_trace(MomentKind::kStep, "step");
  // (Chunk indices whose states the host could not hold update on the device in the warm-up too.)
  const bool warmup = !scheduler_->has_trace();
  const AdamPlacement& placement = pipeline_->placement();
  const std::vector<bool> on_device = placement.for_step(warmup);
  // Chunk indices with nothing to update (every tensor frozen, or without a gradient, kept-at-zero
  // ones counted as the loop below steps them) need none of their chunks at the step: they stay
  // where they are (frozen parameters have chunks of their own: the registration's layout groups).
  std::vector<bool> updates(static_cast<size_t>(n), false);
  for (const Param& p : params_) {
    if (p.has_grad || p.grad.defined) {
      updates[static_cast<size_t>(store().layout().placement(p.id).chunk_index)] = true;
    }
  }
  auto device_side_chunks = [&](const std::vector<bool>& device_side) {
    std::vector<int64_t> ids;
    for (int64_t i = 0; i < n; ++i) {
      if (!device_side[i] || !owns(i) || !updates[i]) continue;
      for (int64_t c : adam_side_chunks(i, /*device=*/true)) ids.push_back(c);
    }
    return ids;
  };
  const std::vector<int64_t> device_chunks = device_side_chunks(placement.on_device());
  // The rest update on the host: their gradients, weights and states go there. The states are
  // there already unless this index's Adam ran on the device before a retrace (the warm-up that
  // follows updates everything on the host). The trace records the steady state's host chunks, so
  // the schedule and the OPT bound know these chunks leave the device at the step.
  auto host_chunks = [&](const std::vector<bool>& device_side) {
    std::vector<int64_t> ids;
    for (int64_t i = 0; i < n; ++i) {
      if (device_side[i] || !owns(i) || !updates[i]) continue;
      for (int64_t c : adam_side_chunks(i, /*device=*/false)) ids.push_back(c);
    }
    return ids;
  };
  const std::vector<int64_t> to_host = host_chunks(on_device);
  int64_t adam_host_d2h_bytes = 0;
  for (int64_t c : to_host) {
    if (store().tier(c) == Tier::kDevice) adam_host_d2h_bytes += store().chunk_bytes(c);
  }
  const int64_t m = recorder_->tick(MomentKind::kStep, "step");
  note_plan_moment(m);
  for (int64_t c : device_chunks) recorder_->record_access(c);
  for (int64_t c : host_chunks(placement.on_device())) recorder_->record_host(c);
  scheduler_->at_moment(m, MomentKind::kStep, device_side_chunks(on_device), *mover_,
                        probe_->live_bytes(), to_host);
  note_memory("step");
  return {m, warmup, on_device, std::move(updates), adam_host_d2h_bytes};
}

void EngineCore::step_kept_zero_gradients() {
  // LibTorch's Adam steps every parameter whose grad() is defined: one that a zero_grad(false) left
  // at zeros and that this iteration's loss did not reach is stepped with a zero gradient (a
  // gradient space holds those zeros already, at the owner with data parallel; a half slot takes
  // them now, the step writes the new weight over them). Data parallel without a gradient space
  // refuses: the reduced sums hold nothing for such a parameter.
  for (const Param& p : params_) {
    if (!p.grad.defined || p.has_grad) continue;
    if (!gradients_.space()) {
      TORCH_CHECK(!dp_.shards_gradients(), "patrickstar: parameter ", p.name,
                  " has a gradient kept at zero "
                  "by zero_grad(set_to_none=false) but this loss did not reach it; LibTorch's "
                  "Adam would update it with a zero gradient, which data parallel in ",
                  to_string(config_.precision()),
                  " without a gradient space cannot do. Use "
                  "zero_grad() (set_to_none, LibTorch's default) or gradient_accumulation_steps > "
                  "1");
      store().view(p.id, ChunkKind::kParam).zero_();
    }
    params_.keep_zero_gradient(p.id);
  }
}

void EngineCore::check_adam_tiers(const StepMoment& at) const {
  const int64_t n = store().chunks_per_kind();
  // What an update reads is in the tier where it runs. On a GPU a chunk left in the other tier
  // fails the kernel's device check; on the emulated device both tiers are CPU memory and it would
  // run unnoticed, so the engine checks it itself.
  for (int64_t i = 0; i < n; ++i) {
    if (!owns(i) || !at.updates[i]) continue;
    const Tier want = at.on_device[i] ? Tier::kDevice : Tier::kHost;
    const bool states_on_disk = storage_.disk() != nullptr && storage_.disk()->on_disk(i);
    for (ChunkKind kind : kAdamKinds) {
      if (!store().has_kind(kind)) continue;
      if (states_on_disk && pipeline_->is_state_kind(kind)) continue;
      const ChunkId id = store().chunk_id(kind, i);
      const Tier tier = store().tier(id);
      TORCH_CHECK(tier == Tier::kNone || tier == want, "patrickstar: internal: chunk ", id, " (",
                  to_string(kind), " of index ", i, ") is in the ", to_string(tier),
                  " tier but its Adam runs on the ", to_string(want), " tier");
    }
  }
}

void EngineCore::check_warmup_trace() {
  // The trace this iteration recorded must fit the device before any weight changes: the tail
  // so far stands for the step's own temporaries (set_trace checks the measured one after).
  Trace planned = recorder_->current_trace();
  planned.tail_non_model_bytes = probe_->peak_bytes();
  try {
    scheduler_->check_trace(planned);
  } catch (const c10::Error& e) {
    // "auto": the step goes on, and the model moves into smaller chunks after it (or this
    // throws: no smaller size fits).
    if (!retry_.armed()) throw;
    choose_retry_chunk_size(planned, e);
  }
}

IterationReport EngineCore::run_adam() {
  torch::NoGradGuard no_grad;
  const StepMoment at = step_moment();
  step_kept_zero_gradients();
  // The delayed update in flight (the last step's) writes its weights in first; its report is
  // this step's. Past the warm-up, this step's update is handed over in its turn.
  pipeline_->begin_step();
  check_adam_tiers(at);
  if (at.warmup) check_warmup_trace();
  IterationReport report;
  report.adam_host_d2h_bytes = at.adam_host_d2h_bytes;
  StepInputs inputs;
  inputs.on_device = at.on_device;
  inputs.delayed =
      !at.warmup && pipeline_->delayed_due(tracker_.iteration(), scheduler_->has_trace());
  inputs.staged = [this] { note_memory("step (disk tier: states staged)"); };
  pipeline_->update(inputs, report);
  // The step's compute is done: the scheduler may load what the next iteration's first moments
  // need (with asynchronous moves, while the trainer prepares the next batch).
  if (!at.warmup && scheduler_->has_trace()) scheduler_->after_moment(at.moment, *mover_);
  return report;
}

void EngineCore::set_overlap_step(bool on) {
  std::lock_guard<engine_detail::EntryGate> lock(entry_gate_);
  pipeline_->set_overlap_step(on);
}

IterationReport EngineCore::step() {
  plan_.begin_turn();
  try {
    return take_step();
  } catch (...) {
    plan_missed_turn();
    throw;
  }
}

IterationReport EngineCore::take_step() {
  check_step_allowed();
  // A forward in progress whose backward never came (a validation forward left in grad mode) is
  // not part of the step.
  if (tracker_.phase() == Phase::kForward && doors_.none_open()) abandon_forward();
  // Data parallel: copies of other ranks' chunks (an evaluation forward's group that was not fully
  // used) would be stale after the step: they go, and the next door gathers the new weights.
  dp_.release_remote(/*discard=*/false);
  // Data parallel: the ranks agree on the gradients' norm before anything changes, and a rank that
  // cannot take the step takes every rank's iteration with it (StepAgreement; one process: the
  // iteration goes only when the update itself failed).
  StepAgreement agreement(dp_, pipeline_->adam());
  auto give_up = [&](bool dropping_always, const std::string& why) {
    if (agreement.give_up(why) || dropping_always) drop_iteration();
  };
  refuse_undelivered_gradients([&](const std::string& why) { give_up(false, why); });
  // Before the step decides anything (the Adam placement, the next pause): what this iteration's
  // backward could do.
  const bool overlap_applied = pipeline_->overlap_applies(tracker_.retraced());
  const bool early_allowed = pipeline_->early_updates_may_start(tracker_.retraced());
  IterationReport report = update_timed(agreement, [&](const std::string& why) {
    pipeline_->step_failed();  // "auto"'s trial: the next iteration is not timed
    retry_.drop_chosen();
    give_up(/*dropping_always=*/true, why);
  });
  settle_parameters(report);
  const bool warmup = tracker_.iteration() == 0 || !scheduler_->has_trace();
  report_iteration(report, warmup);
  report.early_updates_allowed = early_allowed;
  pipeline_->end_trial_iteration(overlap_applied, report);
  plan_after_step(report);
  metrics_.keep(report);
  // (After the report: its traffic and peaks are the old chunks'.)
  if (report.chunk_elems_retried > 0) move_to_chunk_size(report.chunk_elems_retried);

  tracker_.on(PhaseEvent::kStepDone);
  show_gradients(GradientsShown::kAfterStep);
  const engine_detail::EntryCosts costs = entry_gate_.take();
  report.engine_host_seconds = costs.host_seconds;
  report.engine_entries = costs.entries;
  report.host_syncs = costs.host_syncs;
  return report;
}

void EngineCore::check_step_allowed() {
  recover_from_a_dead_backward("step()");
  zero_grad_if_marker_reset();
  const int64_t held = params_.gathered(/*for_write=*/true);
  TORCH_CHECK(held == 0,
              "patrickstar: step() while a read-write GatheredParameters "
              "scope holds ",
              held, " parameter", held == 1 ? "" : "s",
              ": its end would write its values over the step's update; end the scope first");
  TORCH_CHECK(tracker_.backwards_since_step() > 0,
              "patrickstar: step() without a backward since the last step or zero_grad()",
              tracker_.phase() == Phase::kForward ? " (call backward(loss) first)" : "");
  // With gradient_accumulation_steps 1, several backward passes add up before a step, as in
  // LibTorch; above 1, the step comes after exactly that many.
  TORCH_CHECK(config_.gradient_accumulation_steps == 1 ||
                  tracker_.backwards_since_step() == config_.gradient_accumulation_steps,
              "patrickstar: step() after ", tracker_.backwards_since_step(), " backward pass",
              tracker_.backwards_since_step() == 1 ? "" : "es", " but gradient_accumulation_steps is ",
              config_.gradient_accumulation_steps);
}

void EngineCore::refuse_undelivered_gradients(
    const std::function<void(const std::string&)>& discard) {
  // A gradient assigned by hand where the engine shows none (a frozen parameter, one no loss
  // reached since the last zero_grad, one unfrozen within the iteration): torch::optim would step
  // the parameter with it, the engine has no gradient slot to take it from. Refused before
  // anything changes (one process: until it is reset; data parallel: every rank discards the
  // iteration, as for any rank that cannot take the step).
  for (const Param& p : params_) {
    if (p.grad.tensor.defined() || !p.tensor.grad().defined()) continue;
    const char* why = !p.tensor.requires_grad() ? "it is frozen (requires_grad false)"
                      : p.trainable             ? "no loss reached it since the last zero_grad()"
                                    : "it was unfrozen after this iteration began; a change of "
                                      "requires_grad takes effect at the next iteration";
    const std::string error =
        c10::str("patrickstar: parameter ", p.name,
                 " has a gradient the engine did not give it (assigned to its grad() where the "
                 "engine shows none: ",
                 why,
                 "); torch::optim would step it with that gradient, the engine would ignore it. "
                 "Give it a gradient through a loss",
                 p.tensor.requires_grad() ? ""
                                          : " (unfrozen, which a parameter frozen at registration "
                                            "may only be with \"frozen_parameters\": "
                                            "\"full_state\")",
                 ", or reset it (p.mutable_grad().reset())",
                 dp_.with_ranks("; every rank discards the iteration"));
    discard(error);
    TORCH_CHECK(false, error);
  }
}

IterationReport EngineCore::update_timed(
    StepAgreement& agreement, const std::function<void(const std::string&)>& step_failed) {
  IterationReport report;
  const int64_t disk_read_before =
      storage_.disk() != nullptr ? storage_.disk()->files().bytes_read() : 0;
  const int64_t disk_written_before =
      storage_.disk() != nullptr ? storage_.disk()->files().bytes_written() : 0;
  const double disk_wait_before =
      storage_.disk() != nullptr ? storage_.disk()->waited_seconds() : 0;
  try {
    const auto adam_start = std::chrono::steady_clock::now();
    if (!pipeline_->placement().decided()) decide_adam_placement();
    report = run_adam();
    report.adam_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - adam_start).count();
    if (storage_.disk() != nullptr) {
      report.disk_read_bytes = storage_.disk()->files().bytes_read() - disk_read_before;
      report.disk_written_bytes = storage_.disk()->files().bytes_written() - disk_written_before;
      report.disk_wait_seconds = storage_.disk()->waited_seconds() - disk_wait_before;
    }
    agreement.release();  // before the delayed update's thread may read Adam
    pipeline_->after_step(report);
  } catch (c10::Error& e) {
    // Nothing was updated (a trace that does not fit is rejected before Adam runs).
    step_failed(e.what_without_backtrace());
    e.add_context("patrickstar: the step was not taken; the iteration's gradients were discarded "
                  "(weights and optimizer state unchanged) and the next forward starts a new one");
    throw;
  } catch (const std::exception& e) {
    step_failed(e.what());
    throw;
  } catch (...) {
    step_failed("an exception that is not a std::exception");
    throw;
  }
  return report;
}

void EngineCore::settle_parameters(const IterationReport& report) {
  for (const Param& p : params_) {
    if (store().state(p.id, ChunkKind::kParam) == TensorState::kHoldAfterBwd) {
      store().set_state(p.id, ChunkKind::kParam, TensorState::kHold);
    }
    if (gradients_.space() && store().state(p.id, ChunkKind::kGrad) == TensorState::kHoldAfterBwd) {
      store().set_state(p.id, ChunkKind::kGrad, TensorState::kHold);
    }
    // (The delayed update counts its steps at hand-over; in mixed precision without a gradient
    // space the half slot holds the new weight now.)
    params_.after_update(p.id, /*counted=*/!report.skipped && !report.update_delayed,
                         /*consumed=*/!gradients_.space());
  }
  gradients_.drop_reduced();
  gradients_.set_in_half_slots(false);
}

void EngineCore::report_iteration(IterationReport& report, bool warmup) {
  recorder_->end_iteration();
  if (report_activations(report, /*may_plan=*/retry_.chosen() == 0)) {
    // "auto" planned the activations: the next iteration records the trace under the plan.
    record_trace_again();
  } else if (warmup && retry_.chosen() == 0) {
    // (With its tail now: what the next placement decides with.)
    pipeline_->placement().note_step_non_model(step_non_model_of(recorder_->warmup_trace()));
    try {
      scheduler_->set_trace(recorder_->warmup_trace(), mover_.get());
    } catch (const c10::Error& e) {
      // Only the step's own temporaries (measured after the check above) can get here. The step
      // is done; the next iteration records again, and its step decides the placement again
      // with them.
      TORCH_WARN("patrickstar: the trace of iteration ", tracker_.iteration(),
                 " does not fit the device, so the next iteration records a new one: ",
                 e.what_without_backtrace());
      pipeline_->on_retrace();
      recorder_->rewarm();
    }
  }
  const IterationStats& stats = scheduler_->current_stats();
  report.evictions = stats.evictions;
  report.prefetches = stats.prefetches;
  report.warm_start_h2d_bytes = stats.warm_start_h2d_bytes;
  scheduler_->end_iteration();
  report.chunk_elems_retried = retry_.chosen();

  report.iteration = tracker_.iteration();
  report.warmup = warmup;
  report.retraced = tracker_.retraced();
  report.retraces = tracker_.retraces();
  report.device_chunk_peak_bytes = storage_.device()->peak_bytes();
  metrics_.fill_traffic(report, running_totals());
  for (const Moment& m : recorder_->current_trace().moments) {
    report.non_model_peak_bytes = std::max(report.non_model_peak_bytes, m.non_model_bytes);
  }
  report.non_model_peak_bytes =
      std::max(report.non_model_peak_bytes, recorder_->current_trace().tail_non_model_bytes);
}

void EngineCore::set_record_timeline(bool on) {
  std::lock_guard<engine_detail::EntryGate> lock(entry_gate_);
  scheduler_->set_record_timeline(on);
  pipeline_->set_record_spans(on);
  if (storage_.copy_queue() != nullptr) storage_.copy_queue()->set_record_spans(on);
}

}  // namespace patrickstar
