// The step pipeline's delayed parameter update (docs/design.md, "The delayed update"): handing a
// step's update to its thread (delayed_update.h), and writing the weights it made into the
// parameters when the next step, or a reader of the weights, takes it.
#include "step_pipeline.h"

#include <algorithm>

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "patrickstar/optimizer/cpu_adam.h"

namespace patrickstar::engine_detail {

void StepPipeline::hand_over_delayed_update(const std::vector<AdamChunk>& views,
                                          const std::vector<RunAt>& where) {
  torch::NoGradGuard no_grad;
  TORCH_CHECK(!delayed_->pending(),
              "patrickstar: internal: the delayed update in flight was not "
              "taken before the step");
  // The buffers first: a tier that cannot give them fails the step before anything changes.
  // Two per run: the gradient's copy, and the fp32 weight's (fp32) or the new half weight
  // HybridAdam writes and the engine does not read (mixed precision with a gradient space).
  std::vector<at::Tensor> grads(views.size()), others(views.size());
  for (size_t k = 0; k < views.size(); ++k) {
    const AdamChunk& v = views[k];
    const at::Tensor& grad = v.grad_fp32.defined() ? v.grad_fp32 : v.half_param_grad;
    grads[k] = delayed_->buffer(2 * k, grad.numel(), grad.scalar_type());
    if (!mixed_) {
      others[k] = delayed_->buffer(2 * k + 1, v.master.numel(), at::kFloat);
    } else if (v.grad_fp32.defined()) {
      others[k] =
          delayed_->buffer(2 * k + 1, v.half_param_grad.numel(), v.half_param_grad.scalar_type());
    }
  }
  DelayedJob job;
  for (size_t k = 0; k < views.size(); ++k) {
    const AdamChunk& v = views[k];
    AdamChunk run = v;
    run.speculative = nullptr;
    if (!mixed_) {
      // fp32: the parameter is the master the next forward reads; the update gets its own.
      others[k].copy_(v.master);
      grads[k].copy_(v.grad_fp32);
      run.master = others[k];
      run.grad_fp32 = grads[k];
    } else if (v.grad_fp32.defined()) {
      grads[k].copy_(v.grad_fp32);
      run.grad_fp32 = grads[k];
      run.half_param_grad = others[k];
    } else {
      grads[k].copy_(v.half_param_grad);
      run.half_param_grad = grads[k];
    }
    job.runs.push_back(std::move(run));
    job.where.push_back({where[k].index, where[k].span.begin, where[k].span.end});
  }
  // The half slots that held this iteration's gradients get their weights back (rounded from the
  // fp32 masters, which the last update made): the next forward reads them.
  if (mixed_ && !grad_space_) {
    for (const RunAt& at : where) {
      write_half_weights(at.index, at.span.begin, at.span.end, /*skip_gradients=*/false);
    }
  }
  for (const Param& p : wiring_.params) {
    if (p.has_grad && wiring_.owns(store().layout().placement(p.id).chunk_index))
      job.params.push_back(p.id);
  }
  const std::vector<int64_t> stepped = job.params;
  HybridAdam* adam = adam_.get();
  delayed_->launch(
      std::move(job), [adam](const DelayedJob& j) { return adam->step(j.runs); },
      optimizer_thread_kernels());
  // Their Adam step counts advance now (the next runs are made from them); an update that turns
  // out skipped (non-finite gradients) takes its back when landed.
  for (int64_t id : stepped) wiring_.params.add_adam_steps(id, 1);
}

void StepPipeline::land_delayed_update(bool even_mid_iteration) {
  if (delayed_ == nullptr || !delayed_->pending()) return;
  // A forward whose backward is still to come, or that backward, reads the weights it began with:
  // the update stays in flight (waited for, so that its chunks hold still) and the step lands it.
  const Phase phase = wiring_.tracker.phase();
  if (!even_mid_iteration && (phase == Phase::kForward || phase == Phase::kBackward)) {
    delayed_->join();
    return;
  }
  torch::NoGradGuard no_grad;
  std::pair<const DelayedJob*, StepReport> taken;
  try {
    taken = delayed_->result();
  } catch (...) {
    // It failed on its thread: the states of the chunks it was updating may be partly updated.
    for (int64_t id : delayed_->job().params) wiring_.params.add_adam_steps(id, -1);
    delayed_->done();
    TORCH_WARN(
        "patrickstar: the delayed update failed on its thread; the optimizer states of the "
        "chunks it was updating may be partly updated");
    throw;
  }
  // (A throw here leaves it pending: the next caller writes it in again.)
  write_delayed_weights(*taken.first, /*skip_gradients=*/true);
  if (taken.second.skipped) {
    for (int64_t id : taken.first->params) wiring_.params.add_adam_steps(id, -1);
  }
  delayed_taken_ = taken.second;
  delayed_->done();
}

void StepPipeline::write_delayed_weights(const DelayedJob& taken, bool skip_gradients) {
  for (size_t k = 0; k < taken.where.size(); ++k) {
    const DelayedRun& r = taken.where[k];
    if (mixed_) {
      write_half_weights(r.index, r.begin, r.end, skip_gradients);
      continue;
    }
    const ChunkId c = store().chunk_id(ChunkKind::kParam, r.index);
    store().wait_ready(c);
    store().chunk_view(c).narrow(0, r.begin, r.end - r.begin).copy_(taken.runs[k].master);
  }
}

void StepPipeline::write_half_weights(int64_t index, int64_t begin, int64_t end,
                                    bool skip_gradients) {
  const Layout& layout = store().layout();
  const ChunkId half_id = store().chunk_id(ChunkKind::kParam, index);
  const ChunkId master_id = store().chunk_id(ChunkKind::kParamFp32, index);
  store().wait_ready(half_id);
  store().wait_ready(master_id);
  const at::Tensor half = store().chunk_view(half_id);
  const at::Tensor master = store().chunk_view(master_id);
  for (TensorId t : layout.tensors_in_chunk(index)) {
    // A slot holding this iteration's gradient keeps it (the step writes its weight).
    if (skip_gradients && !grad_space_ && wiring_.params[t].has_grad) continue;
    const int64_t first = std::max(begin, layout.placement(t).offset_elems);
    const int64_t last = std::min(end, layout.placement(t).offset_elems + layout.numel(t));
    if (first >= last) continue;
    const at::Tensor h = half.narrow(0, first, last - first);
    const at::Tensor m = master.narrow(0, first, last - first);
    if (h.device().is_cpu()) {
      restore_half_from_master(h, m);
    } else {  // a GPU's chunk: rounded on the host as the step rounds it, then copied
      at::Tensor rounded = at::empty({last - first}, h.options().device(at::kCPU));
      restore_half_from_master(rounded, m);
      h.copy_(rounded);
    }
  }
}

}  // namespace patrickstar::engine_detail
