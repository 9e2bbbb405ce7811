// The step pipeline's overlapped step (docs/design.md, "The overlapped step"): when a chunk index's
// host Adam may start in backward, handing it to the optimizer thread (step_overlap.h), and taking
// it back where the trainer or the engine is about to change what it read; and the runs and views
// every update is made of.
#include "step_pipeline.h"

#include <algorithm>
#include <thread>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

namespace patrickstar::engine_detail {

std::vector<StepPipeline::RunSpan> StepPipeline::run_spans(int64_t i) const {
  std::vector<RunSpan> spans;
  const Layout& layout = store().layout();
  const auto tensors = layout.tensors_in_chunk(i);
  size_t k = 0;
  while (k < tensors.size()) {
    if (!wiring_.params[tensors[k]].has_grad) {
      ++k;
      continue;
    }
    RunSpan span;
    span.begin = layout.placement(tensors[k]).offset_elems;
    span.end = span.begin;
    // A run's tensors are at one Adam step (torch::optim::Adam counts per parameter) and of one
    // parameter group (its options): a chunk whose tensors share both is one run.
    const int64_t adam_steps = wiring_.params[tensors[k]].adam_steps;
    const int32_t group = wiring_.group_of(tensors[k]);
    while (k < tensors.size() && wiring_.params[tensors[k]].has_grad &&
           wiring_.params[tensors[k]].adam_steps == adam_steps &&
           wiring_.group_of(tensors[k]) == group &&
           layout.placement(tensors[k]).offset_elems == span.end) {
      span.end += layout.numel(tensors[k]);
      ++k;
    }
    span.step = adam_steps + 1;
    span.group = group;
    // In pieces of at most kAdamRunElems: the overlapped step's unit (its undo buffers, one piece
    // at a time within their bound), the same in the serial step so that both sum the gradients'
    // statistics piece by piece alike.
    for (int64_t begin = span.begin; begin < span.end; begin += kAdamRunElems) {
      spans.push_back({begin, std::min(span.end, begin + kAdamRunElems), span.step, span.group});
    }
  }
  return spans;
}

AdamChunk StepPipeline::adam_views(int64_t i, const RunSpan& span, bool states_from_disk) const {
  auto slice = [&](ChunkKind kind) {
    return store()
        .chunk_view(store().chunk_id(kind, i))
        .narrow(0, span.begin, span.end - span.begin);
  };
  AdamChunk run;
  run.step = span.step;
  run.group = span.group;
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
  } else if (wiring_.shards_gradients) {
    const at::Tensor& sum = wiring_.gradients.reduced(i);
    TORCH_CHECK(sum.defined(), "patrickstar: internal: chunk ", i,
                " has gradients but was never reduced");
    run.grad_fp32 = sum.narrow(0, span.begin, span.end - span.begin);
  }
  return run;
}

void StepPipeline::on_backward_moment(int64_t moment, bool retraced) {
  // States in memory, a steady state whose trace says when each index is done, and the backward
  // the step follows.
  if (!early_updates_may_start(retraced)) return;
  if (wiring_.config.gradient_accumulation_steps > 1 &&
      wiring_.tracker.backwards_since_step() + 1 != wiring_.config.gradient_accumulation_steps) {
    return;
  }
  const int64_t n = store().chunks_per_kind();
  if (!overlap_.last_use_known) {
    // The last moment before the step at which the trace accesses each index's chunks.
    overlap_.last_use.assign(static_cast<size_t>(n), -1);
    const Trace& trace = wiring_.scheduler().trace();
    for (int64_t m = 0; m < trace.size(); ++m) {
      const Moment& moment_m = trace.moments[static_cast<size_t>(m)];
      if (moment_m.kind == MomentKind::kStep) continue;
      for (int64_t c : moment_m.chunk_ids) overlap_.last_use[store().index_of(c)] = m;
    }
    overlap_.tried.assign(static_cast<size_t>(n), false);
    overlap_.last_use_known = true;
  }
  for (int64_t i = 0; i < n; ++i) {
    const auto k = static_cast<size_t>(i);
    if (overlap_.tried[k] || overlap_.last_use[k] < 0 || overlap_.last_use[k] >= moment) continue;
    // Data parallel: an owner's gradients are final once its comm group is reduced (a group whose
    // gradients of this backward still wait for the others' indices is looked at again later; one
    // reduced only at the end of backward undoes what went ahead: reduce_group).
    if (wiring_.reduction_pending(i)) continue;
    overlap_.tried[k] = true;
    start_early_update(i);
  }
}

// The host's logical cores, read once: std::thread::hardware_concurrency() reads /sys on every call
// (2.6 us on the 2-core Xeon), and a backward asks at each of its doors.
int StepPipeline::host_cores() {
  static const int cores = static_cast<int>(std::thread::hardware_concurrency());
  return cores;
}

bool StepPipeline::auto_overlap_may_run() const {
  // On the emulated device, where every core computes the thread would take compute's cores.
  return wiring_.config.device.type == DeviceType::kCuda || host_cores() > at::get_num_threads();
}

bool StepPipeline::overlap_applies(bool retraced) const {
  return overlap_.thread != nullptr && overlap_.on && !overlap_.paused &&
         wiring_.storage.disk() == nullptr && wiring_.scheduler().has_trace() &&
         placement_.decided() && !retraced && (!overlap_.automatic || auto_overlap_may_run());
}

bool StepPipeline::early_updates_may_start(bool retraced) const {
  return overlap_applies(retraced) && (!overlap_.automatic || overlap_.trial.overlap_now());
}

void StepPipeline::end_trial_iteration(bool measurable, IterationReport& report) {
  const auto now = std::chrono::steady_clock::now();
  const std::optional<std::chrono::steady_clock::time_point> start = overlap_.last_step_end;
  overlap_.last_step_end = now;
  if (!overlap_.automatic || overlap_.thread == nullptr || !start.has_value()) return;
  // An iteration that clipped or skipped says nothing about the ways (its updates ahead were
  // undone, and the next backward is serial).
  // Nor does one retraced at its step (the trace's moments ended early: the step was a warm-up).
  const bool counted = measurable && !report.skipped && !report.retraced && !overlap_.paused;
  report.overlap_step_decision =
      overlap_.trial.end_iteration(counted, std::chrono::duration<double>(now - *start).count());
  if (overlap_.trial.decided() && !overlap_.trial.overlap_now()) {
    overlap_.thread->release_kept();  // serial for good: the undo buffers go back to the host tier
  }
}

void StepPipeline::start_early_update(int64_t i) {
  if (!wiring_.owns(i) || wiring_.storage.host_only()[i] ||
      placement_.on_device()[static_cast<size_t>(i)]) {
    return;
  }
  for (TensorId t : store().layout().tensors_in_chunk(i)) {
    // A gradient still to be written at the end of backward (checkpointed and used elsewhere).
    if (wiring_.params[t].pending_grad.defined() || wiring_.params[t].segments > 1) return;
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
    if (!overlap_.thread->fits(i, bytes + run_bytes)) break;
    bytes += run_bytes;
    ahead.push_back(span);
    EarlyRun run;
    run.begin = span.begin;
    run.end = span.end;
    run.step = span.step;
    run.group = span.group;
    run.update.constants = adam_->constants_without_clipping(span.step, span.group);
    job->runs.push_back(std::move(run));
  }
  if (ahead.empty()) return;
  // Its chunks go to the host now, where the step would take them.
  for (ChunkId c : chunks) {
    if (store().tier(c) == Tier::kDevice) wiring_.mover().to_host(c);
  }
  for (ChunkId c : chunks) store().wait_ready(c);
  for (const RunSpan& span : ahead) job->inputs.push_back(adam_views(i, span, false));
  if (overlap_.thread->prepare(*job)) overlap_.thread->submit(std::move(job));
}

int StepPipeline::optimizer_thread_kernels() const {
  const int compute = at::get_num_threads();
  const int cores = host_cores();
  // On CUDA the host Adam runs during backward beside two busy host threads: autograd's device
  // thread (it launches backward's kernels and runs the engine's hooks: starved, the GPU idles) and
  // the training thread (chunk copies are issued and waited for there and on the hooks' thread).
  // It takes the cores they leave, at most compute's. On the emulated device compute is the
  // backward itself: the thread takes the cores compute leaves.
  if (wiring_.config.device.type == DeviceType::kCuda) {
    return std::max(1, std::min(compute, cores - kCudaBusyHostThreads));
  }
  return std::max(1, cores - compute);
}

void StepPipeline::undo_early_update(EarlyIndex& job) const {
  torch::NoGradGuard no_grad;
  for (EarlyRun& run : job.runs) {
    if (run.update.state != SpeculativeUpdate::State::kApplied) continue;
    undo(adam_views(job.index, {run.begin, run.end, run.step, run.group}, false), run.update);
  }
}

void StepPipeline::cancel_early_update(int64_t i) {
  if (overlap_.thread == nullptr || !overlap_.thread->has(i)) return;
  overlap_.thread->quiesce(i);
  if (EarlyIndex* job = overlap_.thread->record(i)) undo_early_update(*job);
  overlap_.thread->erase(i);
  ++overlap_.cancelled;
}

void StepPipeline::cancel_early_updates() {
  if (overlap_.thread == nullptr) return;
  overlap_.thread->quiesce_all();
  std::vector<int64_t> indices;
  for (const auto& [index, job] : overlap_.thread->records()) indices.push_back(index);
  for (int64_t i : indices) cancel_early_update(i);
}

void StepPipeline::attach_early_updates(std::vector<AdamChunk>& runs, const std::vector<RunAt>& where,
                                      const std::vector<bool>& on_device) {
  if (overlap_.thread == nullptr) return;
  overlap_.thread->quiesce_all();
  std::vector<int64_t> indices;
  for (const auto& [index, job] : overlap_.thread->records()) indices.push_back(index);
  for (int64_t i : indices) {
    EarlyIndex* job = overlap_.thread->record(i);
    if (job == nullptr) continue;
    // Each run updated ahead must be one of the step's runs of this index, its gradient unchanged.
    std::vector<size_t> mine;
    bool same = !on_device[static_cast<size_t>(i)];
    for (const EarlyRun& r : job->runs) {
      if (!same) break;
      size_t k = 0;
      while (k < where.size() && !(where[k].index == i && where[k].span.begin == r.begin)) ++k;
      same = k < where.size() && where[k].span.end == r.end && where[k].span.step == r.step &&
             where[k].span.group == r.group && !runs[k].states_from_source;
      // The trainer could write the gradients through views since: the ones read, unchanged.
      if (same && overlap_.verify && r.update.state == SpeculativeUpdate::State::kApplied) {
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

}  // namespace patrickstar::engine_detail
