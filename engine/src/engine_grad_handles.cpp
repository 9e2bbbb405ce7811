// Gradients as LibTorch code sees them. The engine keeps gradients in chunks, yet a ported trainer
// still touches tensor.grad(): Module::zero_grad() (which acts only on defined gradients), clipping
// through torch::nn::utils, reading gradients for logging. So every parameter LibTorch would show a
// gradient for gets a handle in its grad():
// - after a backward (and after a step, with a gradient space), in one process and in fp32/bf16:
//   a view of the slot that holds the gradient, so reads, in-place clipping and zero_() act on the
//   engine's own gradient; valid until the next call into the engine, which withdraws it (a view
//   kept past that throws when read: its storage is fenced);
// - otherwise a marker: a meta tensor that takes Module::zero_grad() (reset or zero_) and whose
//   data cannot be read (the error names the parameter and what to do instead); right after a
//   backward with data parallel or fp16, where a view cannot hold what LibTorch would (each rank
//   keeps part of the gradients; fp16's carry the loss scale), a CPU fence that refuses every
//   access, so clipping through LibTorch stops instead of clipping nothing.
// At the next call the engine looks at what was done: a handle reset (set_to_none) drops that
// parameter's gradient, a marker zeroed in place drops it too; every handle reset or zeroed is
// the engine's zero_grad(). Before a backward accumulates, every handle goes (autograd adds into
// undefined gradients, the engine's hooks take them from there).
#include <string>

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/types.h>

#include "engine_internal.h"

namespace patrickstar {
using namespace engine_detail;  // NOLINT: this folder's private helpers

namespace {

std::string unreadable_message(const std::string& name, const char* why) {
  return "patrickstar: the gradient of parameter " + name + " cannot be read here: " + why +
         ". Reset gradients with zero_grad() (the module's or the optimizer's); clip with the "
         "config's \"gradient_clipping\" (global norm), which the engine's step applies";
}

constexpr const char* kLaterWhy =
    "p.grad() shows the engine's gradient (in one process, in fp32 and bf16) between the end of "
    "backward (or a step) and the next call into the engine (a door, backward, step, zero_grad); "
    "read it there";

// A view handle leaves its slot: the storage it (and any copy the trainer kept) shares is fenced.
void withdraw_view(const c10::Storage& storage, const std::string& name) {
  storage.unsafeGetStorageImpl()->release_data_and_set_meta_custom_data_ptr_error_msg_(
      unreadable_message(name, kLaterWhy));
}

}  // namespace

void EngineCore::show_gradients(GradientsShown when) {
  const bool views_possible = !dp_.shards_gradients() && config_.precision() != Precision::kFp16;
  const at::ScalarType half = param_dtype(config_.precision());
  for (const Param& p : params_) {
    if (!p.grad.defined) continue;
    at::Tensor handle;
    c10::Storage view_storage;
    const bool view =
        views_possible &&
        ((when == GradientsShown::kAfterBackward && (gradients_.space() || p.has_grad)) ||
         (when == GradientsShown::kAfterStep && gradients_.space()));
    if (view) {
      const at::Tensor slot =
          store().view(p.id, gradients_.space() ? ChunkKind::kGrad : ChunkKind::kParam);
      view_storage = storage_without_memory(
          slot.numel() * static_cast<int64_t>(slot.element_size()), slot.device());
      repoint(view_storage, slot.data_ptr());
      handle = tensor_over(view_storage, p.tensor.sizes(), slot.scalar_type());
    } else if (when == GradientsShown::kAfterBackward && !views_possible) {
      const char* why = dp_.shards_gradients()
                            ? "with data parallel each rank keeps only its share of the gradients, "
                              "reduced at their owner ranks"
                            : "in fp16 the gradients carry the loss scale";
      handle =
          tensor_over(fence_storage(p.tensor.numel() * static_cast<int64_t>(c10::elementSize(half)),
                                    unreadable_message(p.name, why), c10::Device(c10::kCPU)),
                      p.tensor.sizes(), half);
    } else {
      handle = at::empty(p.tensor.sizes(), at::TensorOptions().dtype(half).device(at::kMeta));
      handle.storage().unsafeGetStorageImpl()->release_data_and_set_meta_custom_data_ptr_error_msg_(
          unreadable_message(p.name, p.grad.consumed ? "the step used this gradient and its slot "
                                                       "now holds the new weight (mixed precision "
                                                       "without a gradient space)"
                                                     : kLaterWhy));
    }
    p.tensor.mutable_grad() = handle;
    params_.show_grad(p.id, handle, view, std::move(view_storage));
    gradients_.note_handles_shown(/*views=*/view);
  }
}

void EngineCore::take_gradient_edits(bool door) {
  if (!gradients_.handles_shown()) return;
  // A door within a forward, or of an evaluation, where only markers are shown (a door withdrew
  // the views and evaluation moves nothing), does not look: what is done to them is looked at
  // when the backward or the step starts, before anything accumulates.
  if (door && !gradients_.views_shown() &&
      (tracker_.phase() == Phase::kForward || !at::GradMode::is_enabled()))
    return;
  torch::NoGradGuard no_grad;
  // First what was done, checked before anything changes: a refused edit leaves the engine and
  // every handle as they were, so the same call refuses again until the trainer does otherwise.
  std::vector<const Param*> reset, zeroed, assigned;
  int64_t with_handle = 0;
  bool edited = false;
  for (const Param& p : params_) {
    if (!p.grad.tensor.defined()) continue;
    ++with_handle;
    const at::Tensor& grad = p.tensor.grad();
    const bool same_storage =
        grad.defined() && grad.has_storage() && grad.storage().is_alias_of(p.grad.tensor.storage());
    const bool written = static_cast<int64_t>(p.grad.tensor._version()) != p.grad.version;
    edited |= written;
    if (!grad.defined()) {
      reset.push_back(&p);
    } else if (same_storage) {
      // The handle, or a detach() of it (Module::zero_grad). A view was edited in place already.
      if (written && !p.grad.is_view) zeroed.push_back(&p);
    } else {
      // Assigned another tensor: its values become the gradient, where a view shows the slot.
      TORCH_CHECK(p.grad.is_view, "patrickstar: the gradient of parameter ", p.name,
                  " was replaced "
                  "by another tensor where the engine shows no view of it (",
                  dp_.shards_gradients()                    ? "data parallel"
                  : config_.precision() == Precision::kFp16 ? "fp16"
                                                            : "after a call into the engine",
                  "); assign gradients between the end of backward and the next call into the "
                  "engine, in one process, in fp32 or bf16");
      TORCH_CHECK(grad.sizes() == p.tensor.sizes(), "patrickstar: the gradient of parameter ",
                  p.name, " was replaced by a tensor of shape ", grad.sizes(),
                  "; the parameter's shape is ", p.tensor.sizes());
      assigned.push_back(&p);
    }
  }
  // Gradients changed since the optimizer thread read them: what it updated ahead is undone.
  if (edited || !reset.empty() || !assigned.empty()) pipeline_->on_gradients_change();
  std::vector<const Param*> dropped = reset;  // reset, or a marker zeroed in place
  dropped.insert(dropped.end(), zeroed.begin(), zeroed.end());
  const bool whole = !dropped.empty() && static_cast<int64_t>(dropped.size()) == with_handle;
  if (!whole) {
    for (const Param* p : dropped) {
      TORCH_CHECK(!dp_.shards_gradients() || !p->has_grad,
                  "patrickstar: data parallel: the gradient of ", p->name,
                  " was reset alone (a submodule's zero_grad(), or one parameter's); "
                  "with several ranks zero the whole model's gradients (model->zero_grad() or the "
                  "optimizer's zero_grad()) or none");
    }
  }
  for (const Param* p : assigned) p->grad.tensor.copy_(p->tensor.grad());
  for (const Param* p : reset) params_.set_grad_defined(p->id, false);
  // Withdraw: views are fenced (a copy of one kept by the trainer throws when read) and every
  // parameter still showing a gradient gets a marker; the chunks may move from here on.
  for (const Param& p : params_) {
    if (p.grad.is_view) withdraw_view(p.grad.storage, p.name);
    params_.withdraw_grad(p.id);
  }
  gradients_.clear_shown();
  if (whole) {
    // Zeroed in place (set_to_none false) stays defined, as in LibTorch: such a parameter is
    // stepped with a zero gradient even where the next loss does not reach it.
    std::vector<TensorId> kept;
    for (const Param* p : dropped) {
      if (p->grad.defined) kept.push_back(p->id);
    }
    zero_grad();  // also takes the handles away
    for (TensorId id : kept) params_.set_grad_defined(id, true);
    if (!kept.empty()) show_gradients(GradientsShown::kWithdrawn);
    return;
  }
  if (!dropped.empty()) {
    // Half weights restored from their fp32 masters (written by the delayed update in flight).
    const bool restores = std::any_of(dropped.begin(), dropped.end(), [&](const Param* p) {
      return restores_half_weight(*p);
    });
    std::optional<StateAccess> access;
    if (restores) access.emplace(pipeline_->access());
    for (const Param* p : dropped) drop_gradient(*p, access ? &*access : nullptr);
    if (access) access->finish_views();
    gradients_.set_in_half_slots(
        !gradients_.space() &&
        std::any_of(params_.begin(), params_.end(), [](const Param& p) { return p.has_grad; }));
  }
  show_gradients(GradientsShown::kWithdrawn);
}

bool EngineCore::restores_half_weight(const Param& p) const {
  return !gradients_.space() && p.has_grad && owns(store().layout().placement(p.id).chunk_index);
}

void EngineCore::drop_gradient(const Param& p, const StateAccess* access) {
  if (gradients_.space()) {
    if (!dp_.shards_gradients() || owns(store().layout().placement(p.id).chunk_index)) {
      store().view(p.id, ChunkKind::kGrad).zero_();
    }
  } else if (restores_half_weight(p)) {
    TORCH_INTERNAL_ASSERT(access != nullptr, "patrickstar: internal: a half weight restored "
                          "without access to the states");
    store().view(p.id, ChunkKind::kParam).copy_(access->state(p.id, ChunkKind::kParamFp32));
  }
  params_.drop_gradient(p.id);
}

void EngineCore::clear_gradient_handles() {
  bool consumed = false;
  for (const Param& p : params_) {
    consumed |= p.grad.consumed && p.grad.tensor.defined();
    params_.set_grad_consumed(p.id, false);
    if (p.grad.is_view) withdraw_view(p.grad.storage, p.name);
    if (p.grad.tensor.defined() && p.tensor.grad().defined()) p.tensor.mutable_grad().reset();
    params_.withdraw_grad(p.id);
  }
  gradients_.clear_shown();
  if (consumed && gradients_.first_consumed_warning()) {
    TORCH_WARN(
        "patrickstar: a backward after step() without zero_grad(): LibTorch would add its "
        "gradients to the previous step's, but in ",
        to_string(config_.precision()),
        " without a gradient space the step used those up, so this backward starts from "
        "zero (as DeepSpeed's step does). Call zero_grad() (the module's or the "
        "optimizer's) after each step to say so; set gradient_accumulation_steps > 1 to "
        "keep gradients across steps");
  }
}

}  // namespace patrickstar
