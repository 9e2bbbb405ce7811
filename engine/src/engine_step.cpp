#include "engine_core.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include <ATen/ops/full.h>
#include <c10/util/Exception.h>

#include "patrickstar/optimizer/placement.h"

#include "disk_states.h"
#include "engine_internal.h"

namespace patrickstar {
using namespace engine_detail;  // NOLINT: this folder's private helpers

void EngineCore::decide_adam_placement() {
  const int64_t n = store().chunks_per_kind();
  // CPU embeddings update on the host: the plan covers the other chunk indices.
  std::vector<int64_t> candidates;
  std::vector<int64_t> candidate_bytes;  // their optimizer states', per candidate
  int64_t resident_model_bytes = 0;  // chunks the forward and backward need on the device
  for (int64_t i = 0; i < n; ++i) {
    if (storage_.host_only[i] || !owns(i)) continue;  // data parallel: this rank's chunks only
    if (!index_trains(i)) {  // nothing to update: the forward and backward read its weights only
      resident_model_bytes += store().chunk_bytes(store().chunk_id(ChunkKind::kParam, i));
      continue;
    }
    if (adam_placement_.device_only(i)) {  // its Adam runs on the device whatever the margin
      TORCH_CHECK(delayed_ == nullptr,
                  "patrickstar: zero_optimization.delayed_param_update runs "
                  "every Adam on the host, but the host budget could not hold the optimizer states "
                  "of chunk index ",
                  i,
                  ", which live on the device; give the host more memory or "
                  "turn the delayed update off");
      resident_model_bytes += store().chunk_bytes(store().chunk_id(ChunkKind::kParam, i));
      if (grad_space_)
        resident_model_bytes += store().chunk_bytes(store().chunk_id(ChunkKind::kGrad, i));
      continue;
    }
    candidates.push_back(i);
    candidate_bytes.push_back(state_bytes(i));
    resident_model_bytes += store().chunk_bytes(store().chunk_id(ChunkKind::kParam, i));
    if (grad_space_)
      resident_model_bytes += store().chunk_bytes(store().chunk_id(ChunkKind::kGrad, i));
  }
  int64_t peak_non_model = probe_->peak_bytes();
  for (const Moment& m : recorder_->current_trace().moments) {
    peak_non_model = std::max(peak_non_model, m.non_model_bytes);
  }
  // The margin: what the device keeps free even at the peak of activations with every parameter
  // chunk resident. Optimizer states placed there never need to move.
  // (States placed on the device at registration stay there: their bytes are not spare.)
  const int64_t margin = static_cast<int64_t>(
      static_cast<double>(usable_device_bytes(config_) - peak_non_model - resident_model_bytes -
                          metrics_.registration().device_state_bytes) *
      config_.mem_tracer.margin_use_ratio);
  // (The delayed update runs every Adam on its host thread.)
  const bool hybrid = config_.optimizer.use_hybrid_adam &&
                      config_.scheduler.policy != EvictionPolicy::kStatic && delayed_ == nullptr;
  const PlacementPlan plan =
      hybrid ? plan_placement(candidate_bytes, margin) : all_on_host(candidate_bytes);
  std::vector<bool> on_device(static_cast<size_t>(n), false);
  for (size_t k = 0; k < candidates.size(); ++k) on_device[candidates[k]] = plan.on_device[k];
  adam_placement_.decide(std::move(on_device));  // with the device-only indices
  // The disk tier keeps the states of the indices still on disk; those of the device Adam come home
  // for good (host first, then the scheduler takes them to the device at the step). An index home
  // from an earlier placement stays in memory even where this one runs its Adam on the host.
  if (storage_.disk != nullptr) {
    for (int64_t i = 0; i < n; ++i) {
      if (adam_placement_.on_device()[static_cast<size_t>(i)]) storage_.disk->bring_home(i);
    }
  }
}

IterationReport EngineCore::run_adam() {
  torch::NoGradGuard no_grad;
  const int64_t n = store().chunks_per_kind();
  auto id_of = [&](ChunkKind kind, int64_t i) { return store().chunk_id(kind, i); };

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
  const std::vector<bool> on_device = adam_placement_.for_step(warmup);
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
      ids.push_back(id_of(ChunkKind::kParam, i));
      if (mixed_) ids.push_back(id_of(ChunkKind::kParamFp32, i));
      ids.push_back(id_of(ChunkKind::kMomentum, i));
      ids.push_back(id_of(ChunkKind::kVariance, i));
      if (grad_space_) ids.push_back(id_of(ChunkKind::kGrad, i));
    }
    return ids;
  };
  const std::vector<int64_t> device_chunks = device_side_chunks(adam_placement_.on_device());
  // The rest update on the host: their gradients, weights and states go there. The states are
  // there already unless this index's Adam ran on the device before a retrace (the warm-up that
  // follows updates everything on the host). The trace records the steady state's host chunks, so
  // the schedule and the OPT bound know these chunks leave the device at the step.
  auto host_chunks = [&](const std::vector<bool>& device_side) {
    std::vector<int64_t> ids;
    for (int64_t i = 0; i < n; ++i) {
      if (device_side[i] || !owns(i) || !updates[i]) continue;
      for (ChunkKind kind : kAdamKinds) {
        if (store().has_kind(kind)) ids.push_back(id_of(kind, i));
      }
    }
    return ids;
  };
  const std::vector<int64_t> to_host = host_chunks(on_device);
  int64_t adam_host_d2h_bytes = 0;
  for (int64_t c : to_host) {
    if (store().tier(c) == Tier::kDevice) adam_host_d2h_bytes += store().chunk_bytes(c);
  }
  const int64_t m = recorder_->tick(MomentKind::kStep, "step");
  for (int64_t c : device_chunks) recorder_->record_access(c);
  for (int64_t c : host_chunks(adam_placement_.on_device())) recorder_->record_host(c);
  scheduler_->at_moment(m, MomentKind::kStep, device_side_chunks(on_device), *mover_,
                        probe_->live_bytes(), to_host);
  note_memory("step");

  // LibTorch's Adam steps every parameter whose grad() is defined: one that a zero_grad(false) left
  // at zeros and that this iteration's loss did not reach is stepped with a zero gradient (a
  // gradient space holds those zeros already, at the owner with data parallel; a half slot takes
  // them now, the step writes the new weight over them). Data parallel without a gradient space
  // refuses: the reduced sums hold nothing for such a parameter.
  for (Param& p : params_) {
    if (!p.grad.defined || p.has_grad) continue;
    if (!grad_space_) {
      TORCH_CHECK(!distributed(), "patrickstar: parameter ", p.name, " has a gradient kept at zero "
                  "by zero_grad(set_to_none=false) but this loss did not reach it; LibTorch's "
                  "Adam would update it with a zero gradient, which data parallel in ",
                  to_string(config_.precision()), " without a gradient space cannot do. Use "
                  "zero_grad() (set_to_none, LibTorch's default) or gradient_accumulation_steps > "
                  "1");
      store().view(p.id, ChunkKind::kParam).zero_();
    }
    p.has_grad = true;
  }
  // The delayed update in flight (the last step's) writes its weights in first; its report is
  // this step's. Past the warm-up, this step's update is handed over in its turn.
  land_delayed_update();
  const bool delayed_now = !warmup && delayed_due();
  // Views: one AdamChunk per run of consecutive tensors that received a gradient.
  std::vector<AdamChunk> runs;
  std::vector<RunAt> where;        // each run's index and span
  std::vector<DiskRun> disk_runs;  // with a disk tier, one per run
  PlacementPlan plan;
  for (int64_t i = 0; i < n; ++i) {
    if (!owns(i)) continue;  // data parallel: another rank steps it
    // States in the disk tier come to the update through the source below.
    const bool from_disk = storage_.disk != nullptr && storage_.disk->on_disk(i);
    for (const RunSpan& span : run_spans(i)) {
      if (storage_.disk != nullptr)
        disk_runs.push_back({i, span.begin, span.end, from_disk, mixed_});
      runs.push_back(adam_views(i, span, from_disk));
      where.push_back({i, span});
      plan.on_device.push_back(on_device[i]);
    }
  }
  // The overlapped step: runs updated ahead in backward carry their updates.
  attach_early_updates(runs, where, on_device);
  // What an update reads is in the tier where it runs. On a GPU a chunk left in the other tier
  // fails the kernel's device check; on the emulated device both tiers are CPU memory and it would
  // run unnoticed, so the engine checks it itself.
  for (int64_t i = 0; i < n; ++i) {
    if (!owns(i) || !updates[i]) continue;
    const Tier want = on_device[i] ? Tier::kDevice : Tier::kHost;
    const bool states_on_disk = storage_.disk != nullptr && storage_.disk->on_disk(i);
    for (ChunkKind kind : kAdamKinds) {
      if (!store().has_kind(kind)) continue;
      if (states_on_disk && is_state_kind(kind)) continue;
      const ChunkId id = id_of(kind, i);
      const Tier tier = store().tier(id);
      TORCH_CHECK(tier == Tier::kNone || tier == want, "patrickstar: internal: chunk ", id, " (",
                  to_string(kind), " of index ", i, ") is in the ", to_string(tier),
                  " tier but its Adam runs on the ", to_string(want), " tier");
    }
  }
  if (warmup) {
    // The trace this iteration recorded must fit the device before any weight changes: the tail
    // so far stands for the step's own temporaries (set_trace checks the measured one after).
    Trace planned = recorder_->current_trace();
    planned.tail_non_model_bytes = probe_->peak_bytes();
    try {
      scheduler_->check_trace(planned);
    } catch (const c10::Error& e) {
      // "auto": the step goes on, and the model moves into smaller chunks after it (or this
      // throws: no smaller size fits).
      if (!chunk_retry_armed_) throw;
      choose_retry_chunk_size(planned, e);
    }
  }
  IterationReport report;
  report.adam_host_d2h_bytes = adam_host_d2h_bytes;
  StepReport step;
  if (storage_.disk != nullptr) {
    // Every file is there before any state changes (a missing one fails the step, not half of it).
    storage_.disk->check_files();
    // The host's peak with a disk tier is here: the staged states are in the breakdown.
    DiskAdamSource source(*storage_.disk, store(), std::move(disk_runs),
                          [this] { note_memory("step (disk tier: states staged)"); });
    step = adam_->step(runs, plan, &source);
    source.finish();  // every write behind done: the files hold the new states
  } else if (delayed_now) {
    hand_over_delayed_update(runs, where);
    step = delayed_taken_.value_or(StepReport());
  } else {
    step = adam_->step(runs, plan);
  }
  delayed_taken_.reset();
  if (delayed_ != nullptr) {
    report.update_delayed = delayed_now;
    report.optimizer_thread_seconds = delayed_->take_busy_seconds();
    report.delayed_update_wait_seconds = delayed_->take_waited_seconds();
    report.delayed_update_buffer_bytes = delayed_->buffer_bytes();
  }
  // The step's compute is done: the scheduler may load what the next iteration's first moments
  // need (with asynchronous moves, while the trainer prepares the next batch).
  if (!warmup && scheduler_->has_trace()) scheduler_->after_moment(m, *mover_);
  report.skipped = step.skipped;
  report.early_updates_committed = step.speculative_committed;
  report.early_updates_undone = step.speculative_undone;
  // A step that clipped or skipped would have undone what the next backward updates ahead: the
  // next one is serial, and the overlap resumes after a step that did neither.
  early_paused_ = step.skipped || step.clip_coef < 1.0f;
  report.loss_scale = step.loss_scale;
  report.grad_norm = step.grad_norm;
  for (int64_t i = 0; i < n; ++i) {
    if (!owns(i) || lean(i)) continue;  // a lean index has no optimizer state
    const int64_t bytes = state_bytes(i);
    if (on_device[i]) {
      ++report.adam.chunks_device;
      report.adam.bytes_device += bytes;
    } else {
      ++report.adam.chunks_host;
      report.adam.bytes_host += bytes;
    }
  }
  return report;
}

void EngineCore::set_lr(double lr) {
  TORCH_CHECK(lr >= 0 && std::isfinite(lr), "patrickstar: set_lr(", lr,
              "): the learning rate must be finite and not negative");
  if (delayed_ != nullptr) delayed_->join();  // the update in flight reads the options
  adam_->set_lr(lr);
}

double EngineCore::lr() const { return adam_->options().lr(); }

IterationReport EngineCore::step() {
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
  // A forward in progress whose backward never came (a validation forward left in grad mode) is
  // not part of the step.
  if (tracker_.phase() == Phase::kForward && doors_.none_open()) abandon_forward();
  // Data parallel: copies of other ranks' chunks (an evaluation forward's group that was not fully
  // used) would be stale after the step: they go, and the next door gathers the new weights.
  release_remote(/*discard=*/false);
  // Data parallel: before anything changes, every rank adds its shard's squared gradient norm in
  // one all-reduce (so all clip and skip an fp16 overflow alike). A rank that cannot take the step
  // (its trace does not fit its device, say) sends a large negative number instead, so every rank
  // sees a negative sum and drops the iteration with it, instead of waiting for it forever.
  bool agreed = false;
  auto agree = [&](double sum_squares) {
    at::Tensor sum = at::full({1}, sum_squares, at::kDouble);
    {
      ScopeTimer timer(collective_seconds_);
      comm_->all_reduce(sum, ReduceOp::kSum);
    }
    agreed = true;
    return sum.item<double>();
  };
  if (distributed()) {
    adam_->set_stats_reducer([&](GradStats& stats) {
      const double global = agree(stats.sum_squares);
      TORCH_CHECK(!(global < 0), "patrickstar: another rank could not take this step (its error "
                  "is reported there); every rank discards the iteration");
      stats.sum_squares = global;
    });
  }
  auto tell_the_others = [&] {
    if (distributed() && !agreed) agree(-1e300);
  };
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
    if (distributed()) {
      adam_->set_stats_reducer(nullptr);
      tell_the_others();
      drop_iteration();
    }
    TORCH_CHECK(false, "patrickstar: parameter ", p.name,
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
                distributed() ? "; every rank discards the iteration" : "");
  }
  IterationReport report;
  // Before the step decides anything (the Adam placement, the next pause): what this iteration's
  // backward could do.
  const bool overlap_applied = overlap_applies();
  const bool early_allowed = early_updates_may_start();
  const int64_t disk_read_before =
      storage_.disk != nullptr ? storage_.disk->files().bytes_read() : 0;
  const int64_t disk_written_before =
      storage_.disk != nullptr ? storage_.disk->files().bytes_written() : 0;
  const double disk_wait_before = storage_.disk != nullptr ? storage_.disk->waited_seconds() : 0;
  try {
    const auto adam_start = std::chrono::steady_clock::now();
    if (!adam_placement_.decided()) decide_adam_placement();
    report = run_adam();
    report.adam_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - adam_start).count();
    if (storage_.disk != nullptr) {
      report.disk_read_bytes = storage_.disk->files().bytes_read() - disk_read_before;
      report.disk_written_bytes = storage_.disk->files().bytes_written() - disk_written_before;
      report.disk_wait_seconds = storage_.disk->waited_seconds() - disk_wait_before;
    }
    // (Only data parallel sets one; the delayed update's thread may be reading it otherwise.)
    if (distributed()) adam_->set_stats_reducer(nullptr);
    if (overlap_ != nullptr) {
      overlap_->clear();  // every update ahead was committed or undone by the step
      report.early_updates_cancelled = early_cancelled_;
      report.optimizer_thread_seconds = overlap_->take_busy_seconds();
      report.early_update_buffer_bytes = overlap_->buffer_bytes();
    }
    early_cancelled_ = 0;
    early_last_use_known_ = false;  // the next backward looks at every index again
    early_verify_ = false;
  } catch (c10::Error& e) {
    if (distributed()) adam_->set_stats_reducer(nullptr);
    last_step_end_.reset();  // "auto"'s trial: the next iteration is not timed
    retry_chunk_elems_ = 0;
    tell_the_others();
    // Nothing was updated (a trace that does not fit is rejected before Adam runs).
    drop_iteration();
    e.add_context("patrickstar: the step was not taken; the iteration's gradients were discarded "
                  "(weights and optimizer state unchanged) and the next forward starts a new one");
    throw;
  } catch (...) {
    if (distributed()) adam_->set_stats_reducer(nullptr);
    last_step_end_.reset();
    retry_chunk_elems_ = 0;
    tell_the_others();
    drop_iteration();
    throw;
  }

  for (Param& p : params_) {
    if (store().state(p.id, ChunkKind::kParam) == TensorState::kHoldAfterBwd) {
      store().set_state(p.id, ChunkKind::kParam, TensorState::kHold);
    }
    if (grad_space_ && store().state(p.id, ChunkKind::kGrad) == TensorState::kHoldAfterBwd) {
      store().set_state(p.id, ChunkKind::kGrad, TensorState::kHold);
    }
    if (p.has_grad) {
      if (!report.skipped && !report.update_delayed) ++p.adam_steps;  // (delayed: at hand-over)
      p.grad.consumed = !grad_space_;  // the half slot holds the new weight now
    }
    p.has_grad = false;
  }
  for (at::Tensor& sum : gradients_.reduced) sum.reset();
  gradients_.in_half_slots = false;
  recorder_->end_iteration();
  const bool warmup = iteration_ == 0 || !scheduler_->has_trace();
  if (warmup && retry_chunk_elems_ == 0) {
    try {
      scheduler_->set_trace(recorder_->warmup_trace(), mover_.get());
    } catch (const c10::Error& e) {
      // Only the step's own temporaries (measured after the check above) can get here. The step
      // is done; the next iteration records again.
      TORCH_WARN("patrickstar: the trace of iteration ", iteration_,
                 " does not fit the device, so the next iteration records a new one: ",
                 e.what_without_backtrace());
      recorder_->rewarm();
    }
  }
  const IterationStats& stats = scheduler_->current_stats();
  report.evictions = stats.evictions;
  report.prefetches = stats.prefetches;
  report.warm_start_h2d_bytes = stats.warm_start_h2d_bytes;
  scheduler_->end_iteration();
  report.chunk_elems_retried = retry_chunk_elems_;
  retry_chunk_elems_ = 0;

  report.iteration = iteration_;
  report.warmup = warmup;
  report.retraced = retraced_this_iteration_;
  report.retraces = retraces_;
  report.device_chunk_peak_bytes = storage_.device->peak_bytes();
  metrics_.fill_traffic(report, running_totals());
  for (const Moment& m : recorder_->current_trace().moments) {
    report.non_model_peak_bytes = std::max(report.non_model_peak_bytes, m.non_model_bytes);
  }
  report.non_model_peak_bytes =
      std::max(report.non_model_peak_bytes, recorder_->current_trace().tail_non_model_bytes);
  report.early_updates_allowed = early_allowed;
  end_overlap_trial_iteration(overlap_applied, report);
  metrics_.keep(report);
  // (After the report: its traffic and peaks are the old chunks'.)
  if (report.chunk_elems_retried > 0) move_to_chunk_size(report.chunk_elems_retried);

  ++iteration_;
  tracker_.on(PhaseEvent::kStepDone);
  show_gradients(GradientsShown::kAfterStep);
  return report;
}

void EngineCore::set_record_timeline(bool on) {
  std::lock_guard<std::recursive_mutex> lock(entry_mutex_);
  scheduler_->set_record_timeline(on);
  if (overlap_ != nullptr) overlap_->set_record_spans(on);
  if (storage_.copy_queue != nullptr) storage_.copy_queue->set_record_spans(on);
}

}  // namespace patrickstar
