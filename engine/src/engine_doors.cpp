#include "engine_core.h"

#include <chrono>

#include <algorithm>

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "patrickstar/engine/checkpoint.h"
#include "patrickstar/memtracer/counting_allocator.h"
#include "patrickstar/memtracer/memory_probe.h"

#include "engine_internal.h"

namespace patrickstar {
using namespace engine_detail;  // NOLINT: this folder's private helpers

namespace {
// A module whose parameters are all a CPU embedding's computes on the host, wherever the device is.
bool computes_on_host(const std::vector<TensorId>& params, const ChunkStore& store,
                      const std::vector<bool>& host_only) {
  if (params.empty()) return false;
  for (TensorId id : params) {
    if (!host_only[static_cast<size_t>(store.layout().placement(id).chunk_index)]) return false;
  }
  return true;
}
}  // namespace

ModuleInfo& EngineCore::module_info(torch::nn::Module& module) {
  return params_.module(module, [this](ModuleInfo& info) {
    ModuleInfo* raw = &info;
    info.hook_id = hooks_.add([this, raw] { pre_backward(*raw); });
    info.post_hook_id = hooks_.add([this, raw] { post_backward(*raw); });
  });
}

void EngineCore::point_at_chunk(const Param& p) {
  // The invariant of asynchronous moves: compute reads a chunk whose last copy has completed.
  // view() waits for that copy; this checks it did.
  const ChunkId c = store().chunk_of(p.id, ChunkKind::kParam);
  const at::Tensor slot = store().view(p.id, ChunkKind::kParam);
  TORCH_INTERNAL_ASSERT(store().copy_complete(c), "parameter ", p.name, " points into ",
                        store().describe(c), " while a copy of it is in flight");
  if (slot.device() != p.live.device()) {
    // Only an evaluation forward on CUDA gets here (a scheduled moment has the chunk on the
    // device): compute reads a device copy of the slot, never host memory.
    p.eval_copy = slot.to(p.live.device());
    repoint(p.live, p.eval_copy.data_ptr());
  } else {
    repoint(p.live, slot.data_ptr());
  }
  p.tensor.unsafeGetTensorImpl()->set_storage_keep_dtype(p.live);
}

// A released parameter holds its fence: an operator reading it (a module called outside a door)
// throws an error naming it instead of reading freed memory. Its live storage points at nothing,
// so a view autograd saved cannot read a slot that moved on.
void EngineCore::point_at_nothing(const Param& p) {
  if (p.gathered != GatherHold::kNone)
    return;  // a GatheredParameters scope holds it; its end gives it the fence
  p.tensor.unsafeGetTensorImpl()->set_storage_keep_dtype(p.fence);
  repoint(p.live, nullptr);
  p.eval_copy.reset();
}

void EngineCore::check_not_gathered(const ModuleInfo& module) const {
  for (TensorId id : module.params) {
    TORCH_CHECK(params_[id].gathered == GatherHold::kNone, "patrickstar: the door of module ",
                module.label, " opened while parameter ", params_[id].name,
                " is held by a GatheredParameters scope; end the scope before the forward");
  }
}

void EngineCore::zero_grad_if_marker_reset(bool door) {
  // Inside a backward (a checkpoint's recompute opens doors there) the request waits for the
  // engine's next call after it.
  if (tracker_.in_backward() || in_checkpoint_recompute()) return;
  // Module::zero_grad() and other edits of the parameters' grad() (engine_grad_handles.cpp).
  take_gradient_edits(door);
  // The optimizer's marker: reset (set_to_none, the default), replaced, or zeroed in place
  // (set_to_none false).
  if (!gradients_.marker_touched()) return;
  zero_grad(/*set_to_none=*/gradients_.marker_reset());
}

void EngineCore::forget_dropped_forward() {
  // A top-level door while the previous forward's graph is gone (no pre-backward node of it is
  // alive and none has run): that forward's loss was dropped unused.
  // A model with nothing to train hooks a door only where its input needs a gradient: without
  // one, each top-level door of it starts a forward of its own. (Every parameter is looked at only
  // when nothing is pending and nothing was hooked: not at the doors of a forward in progress.)
  auto nothing_trains = [this] {
    return std::none_of(params_.begin(), params_.end(), [](const Param& p) { return p.trainable; });
  };
  if (tracker_.phase() == Phase::kForward && doors_.none_open() && hooks_.pending_nodes() == 0 &&
      (tracker_.hooks_in_forward() || nothing_trains())) {
    abandon_forward();
  }
}

void EngineCore::begin_iteration_if_needed() {
  if (tracker_.in_iteration()) return;
  // What the process holds before the first forward (the trainer's dataset, its own state) is
  // host memory: the emulated device is charged for what iterations allocate.
  probe_->set_floor_once();
  sync_trainable();
  tracker_.clear_retraced();
  tracker_.set_open_moment(-1);
  metrics_.begin_iteration(running_totals(),
                           probe_->gathered_bytes());
  storage_.device()->reset_peak();
  recorder_->begin_iteration();
  scheduler_->begin_iteration();
  activations_->iteration_start = std::chrono::steady_clock::now();
}

std::vector<TensorId> EngineCore::access(const ModuleInfo& module, MomentKind kind,
                                     bool with_grad_chunks) {
  dp_.ensure_gathered(module.params, with_grad_chunks);  // data parallel: other ranks' chunks
  std::vector<int64_t> chunk_ids;
  auto add_chunk = [&](ChunkId c) {
    if (storage_.host_only()[store().index_of(c)]) return;  // a CPU embedding's: read on the host
    // Data parallel: another rank's param chunk is on the device with its gathered group.
    if (store().kind_of(c) == ChunkKind::kParam && !owns(store().index_of(c))) return;
    if (std::find(chunk_ids.begin(), chunk_ids.end(), c) == chunk_ids.end()) chunk_ids.push_back(c);
  };
  for (TensorId id : module.params) {
    add_chunk(store().chunk_of(id, ChunkKind::kParam));
    if (with_grad_chunks && gradients_.space() && params_[id].trainable) {
      add_chunk(store().chunk_of(id, ChunkKind::kGrad));
    }
  }
  // Chunks updated ahead that this moment reads or writes (the trace said they were done).
  for (int64_t c : chunk_ids) pipeline_->on_index_used(store().index_of(c));
  close_moment();
  follow_trace(kind, module.label);
  const int64_t m = recorder_->tick(kind, module.label);
  note_plan_moment(m);
  for (int64_t c : chunk_ids) recorder_->record_access(c);
  note_warmup_need(m, module, kind, with_grad_chunks);
  try {
    scheduler_->at_moment(m, kind, chunk_ids, *mover_, probe_->live_bytes());
    tracker_.set_open_moment(m);
    note_memory(module.label);
    if (kind == MomentKind::kPreBackward) pipeline_->on_backward_moment(m, tracker_.retraced());
  } catch (c10::Error& e) {
    e.add_context(absl::StrCat("while making the chunks of module ", module.label,
                               " resident; chunks pinned by tensors in use: ", describe_pinned()));
    throw;
  }
  for (TensorId id : module.params) {
    if (!params_.begin_use(id)) continue;
    const Param& p = params_[id];
    store().set_state(id, ChunkKind::kParam, TensorState::kCompute);
    if (with_grad_chunks && gradients_.space() && p.trainable) {
      store().set_state(id, ChunkKind::kGrad, TensorState::kCompute);
    }
    // A scheduled moment computes on the device (a CPU embedding's chunks stay on the host).
    const ChunkId c = store().chunk_of(id, ChunkKind::kParam);
    TORCH_INTERNAL_ASSERT(
        store().tier(c) == Tier::kDevice || storage_.host_only()[store().index_of(c)], "parameter ",
        p.name, " is used at moment ", m, " from ", store().describe(c), " on the ",
        to_string(store().tier(c)));
    point_at_chunk(p);
  }
  return module.params;
}

void EngineCore::follow_trace(MomentKind kind, const std::string& label) {
  std::string why;
  if (recorder_->matches_next(kind, label, &why)) return;
  // DeepSpeed's ZeRO-3 does the same with its trace: invalidate it and record again. This
  // iteration schedules as a warm-up from here; its moments become the trace at step().
  pipeline_->on_retrace();  // what the overlap and the placement assumed is forgotten
  recorder_->rewarm();
  scheduler_->drop_trace();
  tracker_.note_retrace();
  TORCH_WARN("patrickstar: ", why,
             ": the order of moments changed (the control flow, or a new loop shape); the trace is "
             "re-recorded from here (retrace ", tracker_.retraces(), ")");
}

void EngineCore::abandon_forward() {
  // Nothing of this forward reaches backward: its moments are forgotten (the next forward starts
  // where it started) and its parameters wait for nothing.
  for (const Param& p : params_) {
    if (store().state(p.id, ChunkKind::kParam) == TensorState::kHoldAfterFwd) {
      store().set_state(p.id, ChunkKind::kParam, TensorState::kHold);
    }
    params_.forget_passes(p.id);
  }
  tracker_.set_open_moment(-1);
  recorder_->rewind_to(tracker_.forward_start_moment());
  activations_->planner.forward_abandoned();  // its checkpoint calls are numbered again
  tracker_.on(PhaseEvent::kForwardAbandoned);
  dp_.release_remote(/*discard=*/false);
}

void EngineCore::close_moment() {
  // The previous moment's compute is over: the scheduler may prefetch for the next ones now.
  if (tracker_.open_moment() >= 0) scheduler_->after_moment(tracker_.open_moment(), *mover_);
  tracker_.set_open_moment(-1);
}

std::string EngineCore::describe_pinned() const {
  std::string out;
  for (ChunkId c = 0; c < store().chunk_count(); ++c) {
    if (store().tier(c) != Tier::kDevice || store().is_movable(c)) continue;
    std::string users;
    for (TensorId t : store().layout().tensors_in_chunk(store().index_of(c))) {
      if (store().state(t, store().kind_of(c)) == TensorState::kCompute) {
        absl::StrAppend(&users, users.empty() ? "" : ", ", params_[t].name);
      }
    }
    absl::StrAppend(&out, out.empty() ? "" : "; ", store().describe(c), " (", users, ")");
  }
  return out.empty() ? "none" : out;
}

int64_t EngineCore::pre_forward(torch::nn::Module& module) {
  std::lock_guard<engine_detail::EntryGate> serialized(entry_gate_);
  ModuleInfo& info = module_info(module);
  check_not_gathered(info);
  zero_grad_if_marker_reset(/*door=*/true);
  // A checkpointed forward runs without gradients but is part of the training step: it is a moment
  // like any other (the trace must not depend on where activations are dropped), and its recompute
  // in backward comes through here again as a training forward.
  const ForwardKind kind = at::GradMode::is_enabled() ? ForwardKind::kTraining
                           : in_checkpointed_forward() ? ForwardKind::kCheckpointed
                                                       : ForwardKind::kEvaluation;
  if (kind == ForwardKind::kEvaluation) {
    // Evaluation: no moments, no moves; parameters are read wherever their chunks are.
    TORCH_CHECK(!half_slots_hold_gradients(),
                "patrickstar: a forward without gradients (evaluation) after backward and before "
                "step(): in ", to_string(config_.precision()),
                " without a gradient space the gradients sit where the half weights were; call "
                "step() or zero_grad() first");
    dp_.ensure_gathered(info.params, /*with_grad_chunks=*/false);
    // It reads the weights: updates made ahead in the backward before are undone (in fp32 the
    // parameter is the master the optimizer thread updates in place).
    std::vector<int64_t> indices;
    for (TensorId id : info.params) indices.push_back(store().layout().placement(id).chunk_index);
    pipeline_->on_evaluation_reads(indices);  // and the delayed update in flight is written in
    for (TensorId id : info.params) {
      if (!params_.begin_use(id)) continue;
      store().set_state(id, ChunkKind::kParam, TensorState::kCompute);
      point_at_chunk(params_[id]);
    }
    return doors_.open(OpenScope{&info, info.params, kind});
  }
  if (!in_checkpoint_recompute()) recover_from_a_dead_backward("a forward");
  if (tracker_.phase() == Phase::kBackwardDone) {
    TORCH_CHECK(!half_slots_hold_gradients(),
                "patrickstar: forward after backward without step(): in ",
                to_string(config_.precision()), " the gradients sit where the half weights were "
                "(gradient_accumulation_steps is ", config_.gradient_accumulation_steps,
                "; above 1 the engine keeps a gradient space); call step() or zero_grad() first");
  }
  forget_dropped_forward();
  begin_iteration_if_needed();
  if (tracker_.phase() != Phase::kForward) activations_->planner.forward_begins();
  tracker_.on(PhaseEvent::kForwardBegins, recorder_->current_trace().size());
  const int64_t token = doors_.open(OpenScope{&info, {}, kind});
  if (info.params.empty()) return token;
  try {
    doors_[token].acquired = access(info, MomentKind::kPreForward, false);
  } catch (...) {
    doors_.cancel_last();
    if (doors_.none_open() && !tracker_.in_backward()) abandon_forward();
    throw;
  }
  if (!tracker_.in_backward()) {  // a recompute in backward is not a pass of its own
    const int64_t segment = kind == ForwardKind::kCheckpointed ? checkpointed_forward_serial() : 0;
    for (TensorId id : info.params) params_.note_pass(id, segment);
  }
  return token;
}

void EngineCore::release(TensorId id, TensorState to) {
  const Param& p = params_[id];
  TORCH_CHECK(p.compute_refs > 0, "patrickstar: internal: release of ", p.name, " not in use");
  if (!params_.end_use(id)) return;
  store().set_state(id, ChunkKind::kParam, to);
  point_at_nothing(p);
}

std::vector<at::Tensor> EngineCore::post_forward(int64_t token, std::vector<at::Tensor> outputs) {
  std::lock_guard<engine_detail::EntryGate> serialized(entry_gate_);
  TORCH_CHECK(doors_.valid(token), "patrickstar: internal: unknown door token ", token);
  OpenScope& scope = doors_[token];
  // An output that shares a parameter's storage (the parameter itself, a view of it) would point at
  // nothing once the door closes: it gets storage of its own (autograd still leads to the parameter).
  for (at::Tensor& out : outputs) {
    if (!out.defined() || !out.has_storage()) continue;
    const c10::StorageImpl* storage = out.storage().unsafeGetStorageImpl();
    for (TensorId id : scope.module->params) {
      if (params_[id].live.unsafeGetStorageImpl() == storage) {
        out = out.clone();
        break;
      }
    }
  }
  // A CPU embedding on CUDA: its outputs go to the device (autograd brings their gradients back).
  const c10::Device device = storage_.device()->device();
  if (!device.is_cpu() && computes_on_host(scope.module->params, store(), storage_.host_only())) {
    for (at::Tensor& out : outputs) {
      if (out.defined()) out = out.to(device);
    }
  }
  // Only a training forward leaves a graph that will use the parameters again in backward.
  const bool training = scope.kind == ForwardKind::kTraining;
  for (TensorId id : scope.acquired) {
    release(id, training ? TensorState::kHoldAfterFwd : TensorState::kHold);
  }
  scope.acquired.clear();
  const ModuleInfo* module = scope.module;
  dp_.release_used_groups(module->params);  // data parallel: groups every tensor of which was used
  doors_.close();
  if (!training || outputs.empty() || module->params.empty()) return outputs;
  // Outputs that require no gradient (a frozen module whose inputs need none: the frozen
  // embeddings and first blocks of a model fine-tuned with adapters) put nothing in a graph: the
  // forward is no less alive when the next top-level door finds no pre-backward node pending.
  const bool any_hooked = std::any_of(outputs.begin(), outputs.end(), [](const at::Tensor& t) {
    return t.defined() && t.requires_grad();
  });
  if (!any_hooked) return outputs;
  std::vector<at::Tensor> hooked = with_pre_backward(outputs, hooks_, module->hook_id);
  tracker_.note_hooks_in_forward();
  return hooked;
}

void EngineCore::forward_failed(int64_t token) {
  std::lock_guard<engine_detail::EntryGate> serialized(entry_gate_);
  const bool evaluation = doors_.valid(token) && doors_[token].kind == ForwardKind::kEvaluation;
  post_forward(token, {});
  // The outermost door of a training forward that threw: the next forward starts where this one
  // started. (A failed evaluation leaves a training forward in progress alone.)
  if (!evaluation && doors_.none_open() && tracker_.phase() == Phase::kForward) {
    abandon_forward();
  }
}

std::vector<at::Tensor> EngineCore::wrap_inputs(int64_t token, std::vector<at::Tensor> inputs) {
  std::lock_guard<engine_detail::EntryGate> serialized(entry_gate_);
  TORCH_CHECK(doors_.valid(token), "patrickstar: internal: unknown door token ", token);
  if (mixed()) {
    // Floating-point inputs are cast to the compute dtype (as DeepSpeed does in fp16); integer
    // inputs (indices) are left alone.
    const at::ScalarType half = param_dtype(config_.precision());
    for (at::Tensor& x : inputs) {
      if (x.defined() && at::isFloatingType(x.scalar_type()) && x.scalar_type() != half) {
        x = x.to(half);
      }
    }
  }
  const OpenScope& scope = doors_[token];
  // A CPU embedding on CUDA reads its inputs (token ids) on the host.
  if (!storage_.device()->device().is_cpu() &&
      computes_on_host(scope.module->params, store(), storage_.host_only())) {
    for (at::Tensor& x : inputs) {
      if (x.defined()) x = x.to(at::kCPU);
    }
  }
  if (scope.kind != ForwardKind::kTraining || scope.module->params.empty()) return inputs;
  return with_pre_backward(inputs, hooks_, scope.module->post_hook_id);
}

}  // namespace patrickstar
