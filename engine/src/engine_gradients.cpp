#include "engine_core.h"

#include <algorithm>
#include <optional>

#include <ATen/ops/isfinite.h>
#include <c10/util/Exception.h>

#include "engine_internal.h"

namespace patrickstar {
using namespace engine_detail;  // NOLINT: this folder's private helpers

void EngineCore::backward_started() {
  std::lock_guard<engine_detail::EntryGate> serialized(
      entry_gate_);  // a checkpoint's backward calls it
  if (tracker_.in_backward()) return;
  pipeline_->on_gradients_change();  // another backward adds to the gradients updated ahead
  zero_grad_if_marker_reset();
  clear_gradient_handles();  // autograd accumulates into undefined gradients from here
  // A backward over a graph older than the last step (retain_graph): an iteration of its own.
  begin_iteration_if_needed();
  dp_.check_backward(tracker_.backwards_since_step(), gradients_.space());
  tracker_.on(PhaseEvent::kBackwardBegins);
  // Plain loss.backward(): the end of this pass finishes the engine's backward.
  queue_end_of_backward([this] { finish_backward(); });
}

void EngineCore::recover_from_a_dead_backward(const char* where) {
  if (!tracker_.in_backward()) return;
  drop_iteration();
  TORCH_WARN("patrickstar: ", where, " came while a backward was unfinished: the backward threw "
             "inside autograd, so its iteration was discarded (gradients dropped, weights and "
             "optimizer state unchanged)");
}

void EngineCore::pre_backward(ModuleInfo& module) {
  std::lock_guard<engine_detail::EntryGate> serialized(entry_gate_);
  if (module.params.empty()) return;
  backward_started();
  check_not_gathered(module);
  access(module, MomentKind::kPreBackward, /*with_grad_chunks=*/true);
}

void EngineCore::post_backward(ModuleInfo& module) {
  std::lock_guard<engine_detail::EntryGate> serialized(entry_gate_);
  post_backward_release(module);
  dp_.reduce_ready_groups(module.params);  // data parallel: gradients final in a whole group
}

void EngineCore::post_backward_release(ModuleInfo& module) {
  // The module's backward is over. Parameters whose gradient is still to come (a tied weight used
  // again earlier in the model) wait without memory; their gradient lands in the slot later.
  for (TensorId id : module.params) {
    if (!params_.end_use(id)) continue;
    const Param& p = params_[id];
    store().set_state(id, ChunkKind::kParam,
                      p.trainable ? TensorState::kHoldAfterFwd : TensorState::kHold);
    if (gradients_.space() && p.trainable &&
        store().state(id, ChunkKind::kGrad) == TensorState::kCompute) {
      store().set_state(id, ChunkKind::kGrad, TensorState::kHold);
    }
    point_at_nothing(p);
  }
}

void EngineCore::on_gradient(TensorId id, const at::Tensor& param) {
  std::lock_guard<engine_detail::EntryGate> serialized(entry_gate_);
  const Param& p = params_[id];
  at::Tensor grad = param.grad();
  if (!grad.defined()) return;
  TORCH_CHECK(p.gathered == GatherHold::kNone, "patrickstar: a gradient reached parameter ", p.name,
              " while a GatheredParameters scope holds it; the scope gives values (saving, "
              "re-initialization, a penalty's value): a penalty that trains goes behind the "
              "module's door (ModuleScope), or is the optimizer's weight_decay");
  torch::NoGradGuard no_grad;
  // A gradient for an index updated ahead (later than the trace said): that update is undone.
  pipeline_->on_index_used(store().layout().placement(id).chunk_index);
  if (!gradients_.space() && p.segments > 1) {
    // Used in a checkpointed block and elsewhere (or in two): each recompute's backward brings a
    // gradient of its own, and a later recompute still reads the weight, so the half slot keeps
    // the weight until the end of backward; the gradients add up in fp32 meanwhile.
    params_.add_pending_gradient(id, grad);
    param.mutable_grad().reset();
    return;
  }
  if (p.compute_refs == 0) {  // a gradient without its module's pre-backward: take the slot now
    dp_.ensure_gathered({id}, gradients_.space());
    store().set_state(id, ChunkKind::kParam, TensorState::kCompute);
    if (gradients_.space()) store().set_state(id, ChunkKind::kGrad, TensorState::kCompute);
    params_.hold_one_use(id);
  }
  if (gradients_.space()) {
    at::Tensor slot = store().view(id, ChunkKind::kGrad);
    // The slot is where its chunk is: on the device after a pre-backward, anywhere when the branch
    // above took it (on CUDA, maybe a host chunk for a device gradient), and add_ does not cross
    // devices. Same device: no copy.
    const at::Tensor here = grad.to(slot.device());
    // Zeroed by zero_grad(): the first micro-batch adds to zeros. Data parallel: the average over
    // ranks (the owner's chunk accumulates the reduced sums of earlier micro-batches).
    if (dp_.shards_gradients()) {
      slot.add_(here, 1.0 / dp_.world());
    } else {
      slot.add_(here);
    }
    store().set_state(id, ChunkKind::kGrad, TensorState::kHoldAfterBwd);
  } else {
    // The weight's last use is behind us and the fp32 master keeps its value: the half slot
    // takes the gradient (docs/design.md section 4; copy_, unlike add_, copies across devices).
    store().view(id, ChunkKind::kParam).copy_(grad);
  }
  param.mutable_grad().reset();
  params_.note_gradient(id);
  gradients_.set_in_half_slots(!gradients_.space());
  store().set_state(id, ChunkKind::kParam, TensorState::kHoldAfterBwd);
  point_at_nothing(p);
  dp_.note_gradient(id);  // data parallel: the group is reduced once its gradients are final
  dp_.reduce_ready_groups({id});
}

void EngineCore::flush_pending_gradients() {
  torch::NoGradGuard no_grad;
  for (const Param& p : params_) {
    if (!p.pending_grad.defined()) continue;
    pipeline_->on_index_used(store().layout().placement(p.id).chunk_index);
    dp_.ensure_gathered({p.id}, /*with_grad_chunks=*/false);
    dp_.note_gradient(p.id);
    if (store().state(p.id, ChunkKind::kParam) != TensorState::kCompute) {
      store().set_state(p.id, ChunkKind::kParam, TensorState::kCompute);
    }
    store().view(p.id, ChunkKind::kParam).copy_(params_.take_pending_gradient(p.id));
    store().set_state(p.id, ChunkKind::kParam, TensorState::kHoldAfterBwd);
    params_.note_gradient(p.id);
    gradients_.set_in_half_slots(true);
    point_at_nothing(p);
  }
}

void EngineCore::backward(const at::Tensor& loss) {
  recover_from_a_dead_backward("backward()");
  zero_grad_if_marker_reset();
  TORCH_CHECK(tracker_.phase() == Phase::kForward,
              "patrickstar: backward() without a forward since the last ",
              tracker_.phase() == Phase::kBackwardDone ? "backward" : "step");
  TORCH_CHECK(loss.defined() && loss.numel() == 1 && loss.requires_grad(),
              "patrickstar: backward() takes the scalar loss of a training forward (one element "
              "that requires grad)");
  if (config_.precision() != Precision::kFp16) {
    // Data parallel: every rank drops the forward when any rank's loss is not finite (else the
    // others would wait for it in the gradient reduction).
    note_host_sync();  // the read of the check (on CUDA it waits for the forward)
    const bool finite = dp_.all_agree(at::isfinite(loss).item<bool>());
    if (!finite) {
      const double value = loss.item<double>();
      abandon_forward();
      TORCH_CHECK(false, "patrickstar: the loss is ", value, " in ", to_string(config_.precision()),
                  "; the forward was discarded and no gradient was computed (weights unchanged). "
                  "Lower the learning rate or check the data.",
                  dp_.with_ranks(" (data parallel: the loss of at least one rank was not finite)"));
    }
  }
  dp_.check_backward(tracker_.backwards_since_step(), gradients_.space());
  const double factor = pipeline_->adam().loss_scale() / config_.gradient_accumulation_steps;
  pipeline_->on_gradients_change();  // another backward adds to the gradients updated ahead
  clear_gradient_handles();  // autograd accumulates into undefined gradients from here
  tracker_.on(PhaseEvent::kBackwardBegins);
  const char* what = "patrickstar: the backward failed; the iteration was discarded (its gradients "
                     "are dropped, weights and optimizer state are unchanged) and the next forward "
                     "starts a new one";
  try {
    if (factor != 1.0) {
      (loss * factor).backward();
    } else {
      loss.backward();
    }
  } catch (c10::Error& e) {
    drop_iteration();
    e.add_context(what);
    throw;
  } catch (...) {
    drop_iteration();
    throw;
  }
  finish_backward();
}

void EngineCore::sync_trainable() {
  // A lean parameter has no optimizer state to train with: refused before anything changes, so
  // every door refuses until it is frozen again.
  for (const Param& p : params_) {
    TORCH_CHECK(!p.tensor.requires_grad() || p.trainable || !lean_param(p.id),
                "patrickstar: parameter ", p.name,
                " was frozen when the engine registered it, so it has no optimizer state (its "
                "chunk holds its weights alone: zero_optimization \"frozen_parameters\": "
                "\"lean\", the default) and it cannot be unfrozen; set requires_grad back to "
                "false, or build the engine with \"frozen_parameters\": \"full_state\" to "
                "unfreeze parameters later");
  }
  for (const Param& p : params_) {
    const bool wants = p.tensor.requires_grad();
    if (wants == p.trainable) continue;
    params_.set_trainable(p.id, wants);
    const TensorId id = p.id;
    if (wants) {
      set_post_accumulate_grad_hook(p.tensor,
                                    [this, id](const at::Tensor& t) { on_gradient(id, t); });
    } else {
      clear_post_accumulate_grad_hook(p.tensor);
    }
  }
}

void EngineCore::finish_backward() {
  std::lock_guard<engine_detail::EntryGate> serialized(entry_gate_);
  flush_pending_gradients();
  // Parameters whose gradient never arrived (frozen, or unused by this loss) still hold a slot.
  for (const Param& p : params_) {
    const TensorState state = store().state(p.id, ChunkKind::kParam);
    if (p.compute_refs > 0 || state == TensorState::kCompute) {
      params_.end_uses(p.id);
      store().set_state(p.id, ChunkKind::kParam, TensorState::kHold);
      point_at_nothing(p);
    } else if (state == TensorState::kHoldAfterFwd) {
      store().set_state(p.id, ChunkKind::kParam, TensorState::kHold);
    }
    if (gradients_.space() && store().state(p.id, ChunkKind::kGrad) == TensorState::kCompute) {
      store().set_state(p.id, ChunkKind::kGrad, TensorState::kHold);
    }
    params_.forget_passes(p.id);
    params_.reset_backward_gradients(p.id);
  }
  // Data parallel: the groups whose gradients were not all final (parameters unused by this loss)
  // are reduced now, and nothing gathered stays.
  dp_.reduce_remaining_groups();
  dp_.release_remote(/*discard=*/false);
  tracker_.on(PhaseEvent::kBackwardEnds);
  show_gradients(GradientsShown::kAfterBackward);
  pipeline_->on_backward_end(gradients_.views_shown());
}


void EngineCore::discard_gradients() {
  pipeline_->on_gradients_change();  // the fp32 masters the half weights come back from, as they were
  torch::NoGradGuard no_grad;
  const bool restore = mixed() && !gradients_.space();
  // Gradient chunks written since they were last zeroed: those of indices holding a parameter that
  // trains or that received a gradient (trained before it was frozen). A frozen base's are zero.
  std::vector<bool> written(static_cast<size_t>(store().chunks_per_kind()), false);
  for (const Param& p : params_) {
    if (p.trainable || p.has_grad) {
      written[static_cast<size_t>(store().layout().placement(p.id).chunk_index)] = true;
    }
  }
  // The delayed update in flight writes those masters: where half slots hold gradients it is
  // written in first, so that every weight is its (not only the restored ones).
  std::optional<StateAccess> access;
  if (restore &&
      std::any_of(params_.begin(), params_.end(), [](const Param& p) { return p.has_grad; })) {
    access.emplace(pipeline_->access());
  }
  // Data parallel: other ranks' chunks go (with any gradient they held); reduced sums too.
  dp_.release_remote(/*discard=*/true);
  gradients_.drop_reduced();
  // The half slots hold gradients: the weights come back from the fp32 masters, rounded as the
  // step rounds them. In chunk order (a disk tier reads each chunk's masters once). Runs inside
  // error handling: a master that cannot be read (a disk tier's file gone) is reported as a warning
  // after the rest is done, never thrown from here.
  std::string unrestored;
  if (access.has_value()) {
    for (TensorId id : tensors_in_chunk_order(store().layout())) {
      const Param& p = params_[id];
      if (!p.has_grad || !owns(store().layout().placement(id).chunk_index)) continue;
      try {
        store().view(p.id, ChunkKind::kParam).copy_(access->state(p.id, ChunkKind::kParamFp32));
      } catch (const std::exception& e) {
        if (unrestored.empty()) unrestored = p.name + ": " + e.what();
      }
    }
    try {
      access->finish_views();
    } catch (const std::exception& e) {
      if (unrestored.empty()) unrestored = e.what();
    }
  }
  if (!unrestored.empty()) {
    TORCH_WARN("patrickstar: discarding the iteration's gradients, some half weights could not be "
               "restored from their fp32 masters and hold gradients (", unrestored, ")");
  }
  for (const Param& p : params_) {
    params_.set_grad_consumed(p.id, false);
    params_.set_grad_defined(p.id, false);
  }
  clear_gradient_handles();
  for (const Param& p : params_) {
    if (p.tensor.grad().defined()) p.tensor.mutable_grad().reset();
    params_.reset_backward_gradients(p.id);
    if (store().state(p.id, ChunkKind::kParam) == TensorState::kHoldAfterBwd) {
      store().set_state(p.id, ChunkKind::kParam, TensorState::kHold);
    }
    if (gradients_.space() && store().state(p.id, ChunkKind::kGrad) == TensorState::kHoldAfterBwd) {
      store().set_state(p.id, ChunkKind::kGrad, TensorState::kHold);
    }
    params_.drop_gradient(p.id);
  }
  if (gradients_.space()) {
    for (int64_t i = 0; i < store().chunks_per_kind(); ++i) {
      if (!owns(i) || !written[static_cast<size_t>(i)]) continue;
      store().chunk_view(store().chunk_id(ChunkKind::kGrad, i)).zero_();
    }
  }
  tracker_.on(PhaseEvent::kGradientsDiscarded);
  gradients_.set_in_half_slots(false);
}

void EngineCore::drop_iteration() {
  activations_->planner.restart();
  pipeline_->on_iteration_dropped();  // weights and optimizer state as before the iteration
  // Every tensor leaves COMPUTE, every gradient goes, and the trace forgets the iteration.
  for (const Param& p : params_) {
    const TensorState state = store().state(p.id, ChunkKind::kParam);
    if (state == TensorState::kCompute || state == TensorState::kHoldAfterFwd) {
      store().set_state(p.id, ChunkKind::kParam, TensorState::kHold);
    }
    if (gradients_.space() && store().state(p.id, ChunkKind::kGrad) == TensorState::kCompute) {
      store().set_state(p.id, ChunkKind::kGrad, TensorState::kHold);
    }
    params_.end_uses(p.id);
    params_.forget_passes(p.id);
    point_at_nothing(p);
  }
  discard_gradients();
  tracker_.set_open_moment(-1);
  doors_.clear();
  if (tracker_.in_iteration()) {
    recorder_->abort_iteration();
    scheduler_->abort_iteration();
  }
  tracker_.on(PhaseEvent::kIterationDropped);
}

void EngineCore::zero_grad(bool set_to_none) {
  pipeline_->on_gradients_change();
  // set_to_none false: LibTorch keeps the gradients defined (zeros), and its step updates those
  // parameters even where the next loss does not reach them.
  std::vector<char> kept;
  if (!set_to_none) {
    for (const Param& p : params_) kept.push_back(p.grad.defined ? 1 : 0);
  }
  recover_from_a_dead_backward("zero_grad()");
  gradients_.arm_marker();
  const bool after_backward = tracker_.phase() == Phase::kBackwardDone;
  discard_gradients();  // after a backward the phase goes back to kStarted (a forward stays
                        // kForward)
  // A forward in progress keeps its graph (LibTorch loops may call zero_grad() between forward and
  // backward). After a backward, nothing of the iteration so far reaches a step: its moments are
  // forgotten too, so a loop that discards a backward (a GAN's discriminator after the generator's
  // step) keeps the trace it had.
  if (after_backward) {
    recorder_->rewind_to(0);
    tracker_.set_open_moment(-1);
  }
  if (!set_to_none) {
    for (size_t i = 0; i < params_.size(); ++i) {
      params_.set_grad_defined(static_cast<TensorId>(i), kept[i] != 0);
    }
    show_gradients(GradientsShown::kWithdrawn);
  }
}

}  // namespace patrickstar
