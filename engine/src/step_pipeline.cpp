// The step pipeline (step_pipeline.h): its construction, the access it hands out, the events the
// engine tells it, and the step's update. The overlapped step's and the delayed update's own parts
// are in step_pipeline_overlap.cpp and step_pipeline_delayed.cpp.
#include "step_pipeline.h"

#include <cmath>
#include <utility>

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "patrickstar/optimizer/placement.h"

#include "disk_states.h"

namespace patrickstar::engine_detail {

StepPipeline::StepPipeline(PipelineWiring wiring)
    : wiring_(std::move(wiring)),
      mixed_(wiring_.mixed),
      adam_site_(config_adam_site(wiring_.config)) {}

std::vector<bool> streamed_placement(const std::vector<int64_t>& device_side_bytes,
                                     std::vector<bool> on_device,
                                     const std::vector<bool>& candidate, int64_t budget) {
  TORCH_CHECK(device_side_bytes.size() == on_device.size() && candidate.size() == on_device.size(),
              "streamed_placement: ", device_side_bytes.size(), " sizes, ", on_device.size(),
              " placements and ", candidate.size(), " candidates");
  int64_t left = budget;
  for (size_t i = 0; i < on_device.size(); ++i) {
    if (on_device[i]) left -= device_side_bytes[i];
  }
  for (size_t i = 0; i < on_device.size(); ++i) {
    if (on_device[i] || !candidate[i] || device_side_bytes[i] > left) continue;
    on_device[i] = true;
    left -= device_side_bytes[i];
  }
  return on_device;
}

StepPipeline::~StepPipeline() = default;

void StepPipeline::build_thread(Thread thread, int64_t overlap_max_bytes,
                                std::function<at::Tensor(int64_t, at::ScalarType)> host_blocks,
                                std::function<int64_t()> clock) {
  if (thread == Thread::kDelayed) {
    delayed_ = std::make_unique<DelayedUpdate>(std::move(host_blocks));
    delayed_on_ = true;
  } else if (thread == Thread::kOverlap) {
    overlap_.thread = std::make_unique<StepOverlap>(overlap_max_bytes, std::move(host_blocks));
    overlap_.thread->set_clock(std::move(clock));
    // (Built beside the delayed update only under "plan": "auto": off while that is on.)
    overlap_.on = wiring_.config.overlap_step.mode != OverlapMode::kOff && !delayed_on_;
    overlap_.automatic = wiring_.config.overlap_step.mode == OverlapMode::kAuto && !delayed_on_;
  }
}

void StepPipeline::build_adam(const AdamOptions& options, LossScaler scaler, bool grad_space) {
  grad_space_ = grad_space;
  adam_ = std::make_unique<HybridAdam>(options, std::move(scaler));
}

void StepPipeline::stop_threads() {
  overlap_.thread.reset();  // the optimizer thread stops
  delayed_.reset();
}

// --- access ---

StateAccess StepPipeline::access(bool even_mid_iteration) {
  cancel_early_updates();  // the states as they were before the backward
  land_delayed_update(even_mid_iteration);  // with the delayed update in flight written in
  return StateAccess(this);
}

StateAccess::~StateAccess() {
  if (pipeline_ == nullptr) return;
  try {
    pipeline_->finish_state_views();
  } catch (const std::exception& e) {
    // Only reached where a pass of views was cut short by another error (the normal path calls
    // finish_views() and gets its error).
    TORCH_WARN("patrickstar: writing back the disk tier's staged optimizer states failed: ",
               e.what());
  }
}

at::Tensor StateAccess::state(TensorId id, ChunkKind kind, bool write) const {
  return pipeline_->state_view(id, kind, write);
}

at::Tensor StateAccess::weight(TensorId id, bool write) const {
  return pipeline_->weight_view(id, write);
}

void StateAccess::finish_views() const { pipeline_->finish_state_views(); }

at::Tensor StepPipeline::state_view(TensorId id, ChunkKind kind, bool write) const {
  if (wiring_.storage.disk() == nullptr) return store().view(id, kind);
  return wiring_.storage.disk()->view(id, kind, write);
}

at::Tensor StepPipeline::weight_view(TensorId id, bool write) const {
  return lean(store().layout().placement(id).chunk_index) ? store().view(id, ChunkKind::kParam)
                                                          : state_view(id, master_kind(), write);
}

void StepPipeline::finish_state_views() const {
  if (wiring_.storage.disk() != nullptr) wiring_.storage.disk()->finish_views();
}

// --- events ---

void StepPipeline::on_index_used(int64_t index) { cancel_early_update(index); }

void StepPipeline::on_gradients_change() { cancel_early_updates(); }

void StepPipeline::on_evaluation_reads(const std::vector<int64_t>& indices) {
  // In fp32 the parameter is the master the optimizer thread updates in place.
  for (int64_t i : indices) cancel_early_update(i);
  land_delayed_update(/*even_mid_iteration=*/false);
}

void StepPipeline::on_retrace() {
  cancel_early_updates();  // the placement they assumed is forgotten
  overlap_.last_use_known = false;
  placement_.forget();
}

void StepPipeline::on_iteration_dropped() {
  cancel_early_updates();  // weights and optimizer state as before the iteration
  overlap_.last_use_known = false;
  overlap_.verify = false;
  overlap_.cancelled = 0;  // the next iteration's report counts its own
  if (overlap_.thread != nullptr) overlap_.thread->take_busy_seconds();
}

void StepPipeline::on_new_layout(int64_t chunks, int64_t indices) {
  placement_.init(chunks, indices);
  overlap_.last_use_known = false;
}

void StepPipeline::on_backward_end(bool views_shown) {
  if (overlap_.thread == nullptr || !views_shown) return;
  // The trainer may write the gradients through the views once the backward returns (clipping):
  // the optimizer thread finishes what it was given first (all of it: which updates are made
  // ahead does not depend on timing), so it reads no gradient the trainer writes. In-place edits
  // through .data() leave no version, so the step compares fingerprints.
  overlap_.thread->drain();
  overlap_.verify = true;
}

void StepPipeline::before_chunk_move(ChunkId id) {
  // A move waits for the delayed update in flight where it reads or writes the chunk (the
  // states), and for the optimizer thread where it updates the chunk's index ahead.
  if (delayed_ != nullptr && delayed_->pending() && is_state_kind(store().kind_of(id))) {
    delayed_->join();
  }
  if (overlap_.thread != nullptr) overlap_.thread->quiesce(store().index_of(id));
}

// --- the step ---

int64_t StepPipeline::state_bytes(int64_t index) const {
  int64_t bytes = 0;
  for (ChunkKind kind : state_kinds(mixed_))
    bytes += store().chunk_bytes(store().chunk_id(kind, index));
  return bytes;
}

bool StepPipeline::index_trains(int64_t index) const {
  for (TensorId t : store().layout().tensors_in_chunk(index)) {
    if (wiring_.params[t].trainable) return true;
  }
  return false;
}

std::vector<bool> StepPipeline::placement_for(AdamSite site, const PlacementFigures& f) const {
  const Config& config = wiring_.config;
  const int64_t n = store().chunks_per_kind();
  auto resident = [&](ChunkKind kind, int64_t i) {
    return store().chunk_bytes(store().chunk_id(kind, i));
  };
  // CPU embeddings update on the host: the plan covers the other chunk indices.
  std::vector<int64_t> candidates;
  std::vector<int64_t> candidate_bytes;  // their optimizer states', per candidate
  int64_t resident_model_bytes = 0;      // chunks the forward and backward need on the device
  // Per index, what its Adam reads on the device (param, gradient, states: the streamed budget's
  // share), and whether it may update there.
  std::vector<int64_t> device_side(static_cast<size_t>(n), 0);
  std::vector<bool> may(static_cast<size_t>(n), false);
  for (int64_t i = 0; i < n; ++i) {
    // Data parallel: this rank's chunks only.
    if (wiring_.storage.host_only()[i] || !wiring_.owns(i)) continue;
    if (!index_trains(i)) {  // nothing to update: the forward and backward read its weights only
      resident_model_bytes += resident(ChunkKind::kParam, i);
      // (States kept on the device for good stay there at the step too.)
      if (placement_.device_only(i)) device_side[static_cast<size_t>(i)] = state_bytes(i);
      continue;
    }
    int64_t model = resident(ChunkKind::kParam, i);
    if (grad_space_) model += resident(ChunkKind::kGrad, i);
    device_side[static_cast<size_t>(i)] = model + state_bytes(i);
    resident_model_bytes += model;
    if (placement_.device_only(i)) {  // its Adam runs on the device whatever the margin
      TORCH_CHECK(!delayed_on_,
                  "patrickstar: zero_optimization.delayed_param_update runs "
                  "every Adam on the host, but the host budget could not hold the optimizer states "
                  "of chunk index ",
                  i,
                  ", which live on the device; give the host more memory or "
                  "turn the delayed update off");
      continue;
    }
    may[static_cast<size_t>(i)] = true;
    candidates.push_back(i);
    candidate_bytes.push_back(state_bytes(i));
  }
  // The margin: what the device keeps free even at the peak of activations with every parameter
  // chunk resident. Optimizer states placed there never need to move.
  // (States placed on the device at registration stay there: their bytes are not spare.)
  const int64_t margin =
      adam_margin_bytes(f.usable_device_bytes, f.peak_non_model, resident_model_bytes,
                        f.device_state_bytes, config.mem_tracer.margin_use_ratio);
  // (The delayed update runs every Adam on its host thread.)
  const bool hybrid = config.optimizer.use_hybrid_adam && site != AdamSite::kHost &&
                      config.scheduler.policy != EvictionPolicy::kStatic && !delayed_on_;
  const PlacementPlan plan =
      hybrid ? plan_placement(candidate_bytes, margin) : all_on_host(candidate_bytes);
  std::vector<bool> on_device(static_cast<size_t>(n), false);
  for (size_t k = 0; k < candidates.size(); ++k) on_device[candidates[k]] = plan.on_device[k];
  for (int64_t i = 0; i < n; ++i) {
    if (placement_.device_only(i)) on_device[static_cast<size_t>(i)] = true;
  }
  if (hybrid && site == AdamSite::kStreamed) {
    on_device = streamed_placement(device_side, std::move(on_device), may,
                                   streamed_budget_bytes(f.usable_device_bytes, f.step_non_model,
                                                         config.mem_tracer.margin_use_ratio));
  }
  return on_device;
}

void StepPipeline::decide_placement(const PlacementFigures& figures) {
  const int64_t n = store().chunks_per_kind();
  placement_.decide(placement_for(adam_site_, figures));  // with the device-only indices
  // The disk tier keeps the states of the indices still on disk; those of the device Adam come home
  // for good (host first, then the scheduler takes them to the device at the step). An index home
  // from an earlier placement stays in memory even where this one runs its Adam on the host.
  if (wiring_.storage.disk() != nullptr) {
    for (int64_t i = 0; i < n; ++i) {
      if (placement_.on_device()[static_cast<size_t>(i)]) wiring_.storage.disk()->bring_home(i);
    }
  }
}

void StepPipeline::begin_step() {
  // The delayed update in flight (the last step's) writes its weights in first; its report is
  // this step's.
  land_delayed_update(/*even_mid_iteration=*/false);
}

void StepPipeline::land_delayed_now() {
  if (delayed_ == nullptr) return;
  land_delayed_update(/*even_mid_iteration=*/true);
  delayed_->release_kept();
}

bool StepPipeline::delayed_due(int64_t iteration, bool has_trace) const {
  return delayed_on_ && iteration >= wiring_.config.delayed_update.warmup_steps && has_trace;
}

void StepPipeline::update(const StepInputs& inputs, IterationReport& report) {
  const int64_t n = store().chunks_per_kind();
  DiskStates* disk = wiring_.storage.disk();
  // Views: one AdamChunk per run of consecutive tensors that received a gradient.
  std::vector<AdamChunk> runs;
  std::vector<RunAt> where;        // each run's index and span
  std::vector<DiskRun> disk_runs;  // with a disk tier, one per run
  PlacementPlan plan;
  for (int64_t i = 0; i < n; ++i) {
    if (!wiring_.owns(i)) continue;  // data parallel: another rank steps it
    // States in the disk tier come to the update through the source below.
    const bool from_disk = disk != nullptr && disk->on_disk(i);
    for (const RunSpan& span : run_spans(i)) {
      if (disk != nullptr) disk_runs.push_back({i, span.begin, span.end, from_disk, mixed_});
      runs.push_back(adam_views(i, span, from_disk));
      where.push_back({i, span});
      plan.on_device.push_back(inputs.on_device[i]);
    }
  }
  // The overlapped step: runs updated ahead in backward carry their updates.
  attach_early_updates(runs, where, inputs.on_device);
  StepReport step;
  if (disk != nullptr) {
    // Every file is there before any state changes (a missing one fails the step, not half of it).
    disk->check_files();
    // The host's peak with a disk tier is here: the staged states are in the breakdown.
    DiskAdamSource source(*disk, store(), std::move(disk_runs), inputs.staged);
    step = adam_->step(runs, plan, &source);
    source.finish();  // every write behind done: the files hold the new states
  } else if (inputs.delayed) {
    hand_over_delayed_update(runs, where);
    step = delayed_taken_.value_or(StepReport());
  } else {
    step = adam_->step(runs, plan);
  }
  delayed_taken_.reset();
  if (delayed_ != nullptr) {
    report.update_delayed = inputs.delayed;
    report.optimizer_thread_seconds = delayed_->take_busy_seconds();
    report.delayed_update_wait_seconds = delayed_->take_waited_seconds();
    report.delayed_update_buffer_bytes = delayed_->buffer_bytes();
  }
  report.skipped = step.skipped;
  report.early_updates_committed = step.speculative_committed;
  report.early_updates_undone = step.speculative_undone;
  // A step that clipped or skipped would have undone what the next backward updates ahead: the
  // next one is serial, and the overlap resumes after a step that did neither.
  overlap_.paused = step.skipped || step.clip_coef < 1.0f;
  report.loss_scale = step.loss_scale;
  report.grad_norm = step.grad_norm;
  for (int64_t i = 0; i < n; ++i) {
    if (!wiring_.owns(i) || lean(i)) continue;  // a lean index has no optimizer state
    const int64_t bytes = state_bytes(i);
    if (inputs.on_device[i]) {
      ++report.adam.chunks_device;
      report.adam.bytes_device += bytes;
    } else {
      ++report.adam.chunks_host;
      report.adam.bytes_host += bytes;
    }
  }
}

void StepPipeline::after_step(IterationReport& report) {
  if (overlap_.thread != nullptr) {
    overlap_.thread->clear();  // every update ahead was committed or undone by the step
    report.early_updates_cancelled = overlap_.cancelled;
    report.optimizer_thread_seconds += overlap_.thread->take_busy_seconds();
    report.early_update_buffer_bytes = overlap_.thread->buffer_bytes();
  }
  overlap_.cancelled = 0;
  overlap_.last_use_known = false;  // the next backward looks at every index again
  overlap_.verify = false;
}

void StepPipeline::step_failed() { overlap_.last_step_end.reset(); }

// --- settings ---

void StepPipeline::set_group_options(const std::vector<AdamOptions>& groups) {
  if (delayed_ != nullptr) delayed_->join();  // the update in flight reads the options
  adam_->set_groups(groups);
}

void StepPipeline::set_overlap_step(bool on) {
  if (on) {
    TORCH_CHECK(overlap_.thread != nullptr,
                "patrickstar: set_overlap_step(true): the overlapped step runs without a disk "
                "tier or the delayed update; here (",
                delayed_ != nullptr ? "zero_optimization.delayed_param_update" : "a disk tier",
                ") ",
                delayed_ != nullptr ? "updates run during the next iteration"
                                    : "every update runs at the step");
    TORCH_CHECK(!delayed_on_,
                "patrickstar: set_overlap_step(true) while the delayed update is on: turn it off "
                "first (set_delayed_update(false))");
  } else if (overlap_.thread != nullptr) {
    cancel_early_updates();
    overlap_.thread->release_kept();  // its undo buffers go back to the host tier
  }
  overlap_.on = on;
  overlap_.automatic = false;
}

void StepPipeline::set_delayed_update(bool on) {
  TORCH_CHECK(!on || delayed_ != nullptr,
              "patrickstar: set_delayed_update(true): zero_optimization.delayed_param_update is "
              "off, so the engine has no delayed update's thread");
  TORCH_CHECK(!on || !overlap_.on,
              "patrickstar: set_delayed_update(true) while the overlapped step is on: turn it off "
              "first (set_overlap_step(false))");
  // Off: the update in flight lands now (between iterations: the next forward reads its weights),
  // so that the overlapped step, if it comes next, never updates ahead beside it.
  if (!on) land_delayed_now();
  delayed_on_ = on;
}

void StepPipeline::restore_overlap_mode() {
  if (delayed_ != nullptr) {  // the config's delayed update: no overlapped step beside it
    set_overlap_step(false);
    delayed_on_ = true;
    return;
  }
  if (overlap_.thread == nullptr) return;
  const OverlapMode mode = wiring_.config.overlap_step.mode;
  set_overlap_step(mode != OverlapMode::kOff);
  overlap_.automatic = mode == OverlapMode::kAuto;
  overlap_.trial = OverlapTrial();
  overlap_.last_step_end.reset();
}

void StepPipeline::set_record_spans(bool on) {
  if (overlap_.thread != nullptr) overlap_.thread->set_record_spans(on);
}

std::vector<CopySpan> StepPipeline::optimizer_spans() const {
  return overlap_.thread != nullptr ? overlap_.thread->spans() : std::vector<CopySpan>{};
}

}  // namespace patrickstar::engine_detail
