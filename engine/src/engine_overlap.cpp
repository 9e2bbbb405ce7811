// The overlapped step's engine side (docs/design.md, "The overlapped step"): when a chunk index's
// host Adam may start in backward, handing it to the optimizer thread (step_overlap.h), and taking
// it back where the trainer or the engine is about to change what it read.
#include "engine_core.h"

#include <algorithm>
#include <thread>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "engine_internal.h"
#include "step_overlap.h"

namespace patrickstar {
using namespace engine_detail;  // NOLINT: this folder's private helpers

std::vector<EngineCore::RunSpan> EngineCore::run_spans(int64_t i) const {
  std::vector<RunSpan> spans;
  const Layout& layout = store().layout();
  const auto tensors = layout.tensors_in_chunk(i);
  size_t k = 0;
  while (k < tensors.size()) {
    if (!params_[tensors[k]].has_grad) {
      ++k;
      continue;
    }
    RunSpan span;
    span.begin = layout.placement(tensors[k]).offset_elems;
    span.end = span.begin;
    // A run's tensors are at one Adam step (torch::optim::Adam counts per parameter).
    const int64_t adam_steps = params_[tensors[k]].adam_steps;
    while (k < tensors.size() && params_[tensors[k]].has_grad &&
           params_[tensors[k]].adam_steps == adam_steps &&
           layout.placement(tensors[k]).offset_elems == span.end) {
      span.end += layout.numel(tensors[k]);
      ++k;
    }
    span.step = adam_steps + 1;
    // In pieces of at most kAdamRunElems: the overlapped step's unit (its undo buffers, one piece
    // at a time within their bound), the same in the serial step so that both sum the gradients'
    // statistics piece by piece alike.
    for (int64_t begin = span.begin; begin < span.end; begin += kAdamRunElems) {
      spans.push_back({begin, std::min(span.end, begin + kAdamRunElems), span.step});
    }
  }
  return spans;
}

AdamChunk EngineCore::adam_views(int64_t i, const RunSpan& span, bool states_from_disk) const {
  auto slice = [&](ChunkKind kind) {
    return store()
        .chunk_view(store().chunk_id(kind, i))
        .narrow(0, span.begin, span.end - span.begin);
  };
  AdamChunk run;
  run.step = span.step;
  run.states_from_source = states_from_disk;  // a disk tier's states come through its source
  if (!states_from_disk) {
    run.exp_avg = slice(ChunkKind::kMomentum);
    run.exp_avg_sq = slice(ChunkKind::kVariance);
  }
  if (!mixed_) {
    run.master = slice(ChunkKind::kParam);
    run.grad_fp32 = slice(ChunkKind::kGrad);
    return run;
  }
  run.half_param_grad = slice(ChunkKind::kParam);
  if (!states_from_disk) run.master = slice(ChunkKind::kParamFp32);
  // With a gradient space the accumulated fp32 gradient feeds Adam as it is; the half slot keeps
  // the weight and receives the new one. Data parallel without a gradient space: the fp32 sum the
  // reduction gave this owner, likewise.
  if (grad_space_) {
    run.grad_fp32 = slice(ChunkKind::kGrad);
  } else if (distributed()) {
    const at::Tensor& sum = gradients_.reduced[static_cast<size_t>(i)];
    TORCH_CHECK(sum.defined(), "patrickstar: internal: chunk ", i,
                " has gradients but was never reduced");
    run.grad_fp32 = sum.narrow(0, span.begin, span.end - span.begin);
  }
  return run;
}

void EngineCore::start_early_updates(int64_t moment) {
  // States in memory, a steady state whose trace says when each index is done, and the backward
  // the step follows.
  if (!early_updates_may_start()) return;
  if (config_.gradient_accumulation_steps > 1 &&
      tracker_.backwards_since_step() + 1 != config_.gradient_accumulation_steps) {
    return;
  }
  const int64_t n = store().chunks_per_kind();
  if (!early_last_use_known_) {
    // The last moment before the step at which the trace accesses each index's chunks.
    early_last_use_.assign(static_cast<size_t>(n), -1);
    const Trace& trace = scheduler_->trace();
    for (int64_t m = 0; m < trace.size(); ++m) {
      const Moment& moment_m = trace.moments[static_cast<size_t>(m)];
      if (moment_m.kind == MomentKind::kStep) continue;
      for (int64_t c : moment_m.chunk_ids) early_last_use_[store().index_of(c)] = m;
    }
    early_tried_.assign(static_cast<size_t>(n), false);
    early_last_use_known_ = true;
  }
  for (int64_t i = 0; i < n; ++i) {
    const auto k = static_cast<size_t>(i);
    if (early_tried_[k] || early_last_use_[k] < 0 || early_last_use_[k] >= moment) continue;
    // Data parallel: an owner's gradients are final once its comm group is reduced (a group whose
    // gradients of this backward still wait for the others' indices is looked at again later; one
    // reduced only at the end of backward undoes what went ahead: reduce_group).
    if (distributed() && groups_.has_gradients(store().layout().comm_group(i))) continue;
    early_tried_[k] = true;
    start_early_update(i);
  }
}

bool EngineCore::auto_overlap_may_run() const {
  // On the emulated device, where every core computes the thread would take compute's cores.
  return config_.device.type == DeviceType::kCuda ||
         static_cast<int>(std::thread::hardware_concurrency()) > at::get_num_threads();
}

bool EngineCore::overlap_applies() const {
  return overlap_ != nullptr && overlap_on_ && !early_paused_ && storage_.disk == nullptr &&
         scheduler_->has_trace() && adam_placement_.decided() && !retraced_this_iteration_ &&
         (!overlap_auto_ || auto_overlap_may_run());
}

bool EngineCore::early_updates_may_start() const {
  return overlap_applies() && (!overlap_auto_ || overlap_trial_.overlap_now());
}

void EngineCore::end_overlap_trial_iteration(bool measurable, IterationReport& report) {
  const auto now = std::chrono::steady_clock::now();
  const std::optional<std::chrono::steady_clock::time_point> start = last_step_end_;
  last_step_end_ = now;
  if (!overlap_auto_ || overlap_ == nullptr || !start.has_value()) return;
  // An iteration that clipped or skipped says nothing about the ways (its updates ahead were
  // undone, and the next backward is serial).
  // Nor does one retraced at its step (the trace's moments ended early: the step was a warm-up).
  const bool counted = measurable && !report.skipped && !report.retraced && !early_paused_;
  report.overlap_step_decision =
      overlap_trial_.end_iteration(counted, std::chrono::duration<double>(now - *start).count());
  if (overlap_trial_.decided() && !overlap_trial_.overlap_now()) {
    overlap_->release_kept();  // serial for good: the undo buffers go back to the host tier
  }
}

void EngineCore::start_early_update(int64_t i) {
  if (!owns(i) || storage_.host_only[i] || adam_placement_.on_device()[static_cast<size_t>(i)]) {
    return;
  }
  for (TensorId t : store().layout().tensors_in_chunk(i)) {
    // A gradient still to be written at the end of backward (checkpointed and used elsewhere).
    if (params_[t].pending_grad.defined() || params_[t].segments > 1) return;
  }
  const std::vector<RunSpan> spans = run_spans(i);
  if (spans.empty()) return;
  std::vector<ChunkId> chunks;
  for (ChunkKind kind : kAdamKinds) {
    if (!store().has_kind(kind)) continue;
    const ChunkId c = store().chunk_id(kind, i);
    if (store().tier(c) == Tier::kNone) return;
    if (store().tier(c) == Tier::kDevice && !store().is_movable(c)) return;
    chunks.push_back(c);
  }
  auto job = std::make_unique<EarlyIndex>();
  job->index = i;
  job->threads = optimizer_thread_kernels();
  // The runs whose undo buffers fit the bound, in order (the rest update at the step).
  std::vector<RunSpan> ahead;
  int64_t bytes = 0;
  for (const RunSpan& span : spans) {
    const int64_t moment_bytes = chunk_element_bytes(store().dtype(ChunkKind::kMomentum));
    const int64_t run_bytes = (span.end - span.begin) * (4 + 2 * moment_bytes + (mixed_ ? 2 : 0));
    if (!overlap_->fits(i, bytes + run_bytes)) break;
    bytes += run_bytes;
    ahead.push_back(span);
    EarlyRun run;
    run.begin = span.begin;
    run.end = span.end;
    run.step = span.step;
    run.update.constants = adam_->constants_without_clipping(span.step);
    job->runs.push_back(std::move(run));
  }
  if (ahead.empty()) return;
  // Its chunks go to the host now, where the step would take them.
  for (ChunkId c : chunks) {
    if (store().tier(c) == Tier::kDevice) mover_->to_host(c);
  }
  for (ChunkId c : chunks) store().wait_ready(c);
  for (const RunSpan& span : ahead) job->inputs.push_back(adam_views(i, span, false));
  if (overlap_->prepare(*job)) overlap_->submit(std::move(job));
}

int EngineCore::optimizer_thread_kernels() const {
  const int compute = at::get_num_threads();
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  return config_.device.type == DeviceType::kCuda ? compute : std::max(1, cores - compute);
}

void EngineCore::set_overlap_step(bool on) {
  std::lock_guard<std::recursive_mutex> lock(entry_mutex_);
  if (on) {
    TORCH_CHECK(overlap_ != nullptr,
                "patrickstar: set_overlap_step(true): the overlapped step runs without a disk "
                "tier or the delayed update; here (",
                delayed_ != nullptr ? "zero_optimization.delayed_param_update" : "a disk tier",
                ") ",
                delayed_ != nullptr ? "updates run during the next iteration"
                                    : "every update runs at the step");
  } else if (overlap_ != nullptr) {
    cancel_early_updates();
    overlap_->release_kept();  // its undo buffers go back to the host tier
  }
  overlap_on_ = on;
  overlap_auto_ = false;
}

void EngineCore::undo_early_update(EarlyIndex& job) const {
  torch::NoGradGuard no_grad;
  for (EarlyRun& run : job.runs) {
    if (run.update.state != SpeculativeUpdate::State::kApplied) continue;
    undo(adam_views(job.index, {run.begin, run.end, run.step}, false), run.update);
  }
}

void EngineCore::cancel_early_update(int64_t i) const {
  if (overlap_ == nullptr || !overlap_->has(i)) return;
  overlap_->quiesce(i);
  if (EarlyIndex* job = overlap_->record(i)) undo_early_update(*job);
  overlap_->erase(i);
  ++early_cancelled_;
}

void EngineCore::cancel_early_updates() const {
  if (overlap_ == nullptr) return;
  overlap_->quiesce_all();
  std::vector<int64_t> indices;
  for (const auto& [index, job] : overlap_->records()) indices.push_back(index);
  for (int64_t i : indices) cancel_early_update(i);
}

void EngineCore::attach_early_updates(std::vector<AdamChunk>& runs, const std::vector<RunAt>& where,
                                      const std::vector<bool>& on_device) {
  if (overlap_ == nullptr) return;
  overlap_->quiesce_all();
  std::vector<int64_t> indices;
  for (const auto& [index, job] : overlap_->records()) indices.push_back(index);
  for (int64_t i : indices) {
    EarlyIndex* job = overlap_->record(i);
    if (job == nullptr) continue;
    // Each run updated ahead must be one of the step's runs of this index, its gradient unchanged.
    std::vector<size_t> mine;
    bool same = !on_device[static_cast<size_t>(i)];
    for (const EarlyRun& r : job->runs) {
      if (!same) break;
      size_t k = 0;
      while (k < where.size() && !(where[k].index == i && where[k].span.begin == r.begin)) ++k;
      same = k < where.size() && where[k].span.end == r.end && where[k].span.step == r.step &&
             !runs[k].states_from_source;
      // The trainer could write the gradients through views since: the ones read, unchanged.
      if (same && early_verify_ && r.update.state == SpeculativeUpdate::State::kApplied) {
        const AdamChunk& now = runs[k];
        same =
            gradient_fingerprint(now.grad_fp32.defined() ? now.grad_fp32 : now.half_param_grad) ==
            r.update.grad_fingerprint;
      }
      mine.push_back(k);
    }
    if (!same) {
      cancel_early_update(i);
      continue;
    }
    for (size_t j = 0; j < mine.size(); ++j) {
      if (job->runs[j].update.state == SpeculativeUpdate::State::kApplied) {
        runs[mine[j]].speculative = &job->runs[j].update;
      }
    }
  }
}

}  // namespace patrickstar
