#include "patrickstar/engine/gathered_parameters.h"

#include <algorithm>
#include <exception>

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "absl/strings/str_cat.h"

#include "engine_internal.h"

namespace patrickstar {
using namespace engine_detail;  // NOLINT: this folder's private helpers

TensorId Engine::id_of(const at::Tensor& t) const {
  if (!t.defined()) return -1;
  auto it = param_of_impl_.find(t.unsafeGetTensorImpl());
  return it == param_of_impl_.end() ? -1 : it->second;
}

void Engine::gather_begin(const std::vector<TensorId>& ids, bool write_back) {
  // 1. Check, changing nothing.
  if (write_back) {
    recover_from_a_dead_backward("GatheredParameters");
    forget_dropped_forward();
    TORCH_CHECK(phase_ == Phase::kIdle && !in_backward_ && open_scopes_ == 0,
                "patrickstar: a read-write GatheredParameters scope opens between a step (or "
                "zero_grad()) and the next forward, and ",
                phase_ == Phase::kBackwardDone ? "gradients wait for step()"
                                               : "a forward is in progress",
                "; use GatheredParameters::Mode::kReadOnly to read values now");
  }
  for (TensorId id : ids) {
    const Param& p = params_[id];
    TORCH_CHECK(!p.gathered, "patrickstar: parameter ", p.name,
                " is held by another GatheredParameters scope already");
    TORCH_CHECK(p.compute_refs == 0, "patrickstar: parameter ", p.name,
                " is in use by an open door (a forward or backward in progress); a "
                "GatheredParameters scope takes parameters outside the doors");
  }
  // 2. Copies of the master weights (the only step that allocates), then the parameters.
  torch::NoGradGuard no_grad;
  const ChunkKind master = mixed_ ? ChunkKind::kParamFp32 : ChunkKind::kParam;
  std::vector<at::Tensor> values;
  values.reserve(ids.size());
  for (TensorId id : ids) {
    values.push_back(store_->view(id, master).to(at::kFloat, /*non_blocking=*/false, /*copy=*/true));
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    Param& p = params_[ids[i]];
    c10::TensorImpl* impl = p.tensor.unsafeGetTensorImpl();
    impl->set_storage_and_dtype(values[i].storage(), c10::scalarTypeToTypeMeta(at::kFloat));
    impl->set_storage_offset(0);
    impl->set_sizes_contiguous(store_->layout().sizes(p.id));
    p.gathered = true;
    ++gathered_;
  }
}

void Engine::gather_end(const std::vector<TensorId>& ids, bool write_back) {
  torch::NoGradGuard no_grad;
  std::string changed;
  if (write_back) {
    for (TensorId id : ids) {
      const Param& p = params_[id];
      const at::Tensor& t = p.tensor;
      if (t.scalar_type() != at::kFloat || t.sizes() != store_->layout().sizes(id) ||
          !t.is_contiguous()) {
        absl::StrAppend(&changed, changed.empty() ? "" : ", ", p.name, " (now ", t.scalar_type(),
                        " ", c10::str(t.sizes()), ")");
      }
    }
  }
  if (write_back && changed.empty()) {
    for (TensorId id : ids) {
      const at::Tensor& t = params_[id].tensor;
      if (mixed_) store_->view(id, ChunkKind::kParamFp32).copy_(t);
      store_->view(id, ChunkKind::kParam).copy_(t);
    }
  }
  const caffe2::TypeMeta half = c10::scalarTypeToTypeMeta(param_dtype(config_.precision()));
  for (TensorId id : ids) {
    Param& p = params_[id];
    c10::TensorImpl* impl = p.tensor.unsafeGetTensorImpl();
    impl->set_storage_and_dtype(p.fence, half);
    impl->set_storage_offset(0);
    impl->set_sizes_contiguous(store_->layout().sizes(p.id));
    p.gathered = false;
    --gathered_;
  }
  TORCH_CHECK(changed.empty(), "patrickstar: GatheredParameters: the shape or dtype of ", changed,
              " changed in the scope, so nothing was written back (the parameters keep the "
              "values they had); write values in place, with the same shape");
}

GatheredParameters::GatheredParameters(torch::nn::Module& module, Mode mode) : mode_(mode) {
  engine_ = dynamic_cast<Engine*>(handler_for(module));
  TORCH_CHECK(engine_ != nullptr, "patrickstar: GatheredParameters: module ", module.name(),
              " belongs to no engine (its parameters are ordinary tensors already)");
  begin(module.parameters(/*recurse=*/true));
}

GatheredParameters::GatheredParameters(Engine& engine, const std::vector<at::Tensor>& params,
                                       Mode mode)
    : engine_(&engine), mode_(mode) {
  begin(params);
}

void GatheredParameters::begin(const std::vector<at::Tensor>& params) {
  for (const at::Tensor& t : params) {
    const TensorId id = engine_->id_of(t);
    TORCH_CHECK(id >= 0, "patrickstar: GatheredParameters: a tensor of sizes ",
                t.defined() ? c10::str(t.sizes()) : std::string("(undefined)"),
                " is not a parameter of this engine's model");
    if (std::find(ids_.begin(), ids_.end(), id) == ids_.end()) ids_.push_back(id);  // tied: once
  }
  engine_->gather_begin(ids_, mode_ == Mode::kReadWrite);
}

void GatheredParameters::end() {
  if (ended_) return;
  ended_ = true;
  engine_->gather_end(ids_, mode_ == Mode::kReadWrite);
}

GatheredParameters::~GatheredParameters() {
  try {
    end();
  } catch (const c10::Error& e) {
    TORCH_WARN(e.what_without_backtrace());
  } catch (const std::exception& e) {
    TORCH_WARN("patrickstar: GatheredParameters: ", e.what());
  }
}

}  // namespace patrickstar
