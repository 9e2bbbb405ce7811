#include "patrickstar/engine/gathered_parameters.h"

#include <algorithm>
#include <exception>
#include <map>

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "absl/strings/str_cat.h"

#include "engine_internal.h"

namespace patrickstar {
using namespace engine_detail;  // NOLINT: this folder's private helpers

void EngineCore::gather_begin(const std::vector<TensorId>& ids, bool write_back) {
  // The weights as they were before the backward, with the delayed update in flight written in.
  const StateAccess access = pipeline_->access();
  zero_grad_if_marker_reset();  // a zero_grad() through torch::optim::Optimizer& takes effect first
  // 1. Check (after recovering from a dead backward or a dropped forward), changing nothing else.
  if (write_back) {
    recover_from_a_dead_backward("GatheredParameters");
    forget_dropped_forward();
    TORCH_CHECK(tracker_.between_iterations() && doors_.none_open(),
                "patrickstar: a read-write GatheredParameters scope opens between a step (or "
                "zero_grad()) and the next forward, and ",
                tracker_.phase() == Phase::kBackwardDone ? "gradients wait for step()"
                                                         : "a forward is in progress",
                "; use GatheredParameters::Mode::kReadOnly to read values now");
  }
  for (TensorId id : ids) {
    const Param& p = params_[id];
    TORCH_CHECK(p.gathered == GatherHold::kNone, "patrickstar: parameter ", p.name,
                " is held by another GatheredParameters scope already");
    TORCH_CHECK(p.compute_refs == 0, "patrickstar: parameter ", p.name,
                " is in use by an open door (a forward or backward in progress); a "
                "GatheredParameters scope takes parameters outside the doors");
  }
  // 2. Copies of the master weights (the only step that allocates), then the parameters.
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> values;
  values.reserve(ids.size());
  if (!dp_.values_from_owners()) {
    values.resize(ids.size());
    for (size_t k : chunk_order(store().layout(), ids)) {
      // On the parameter's compute device (the GPU on CUDA), as the model's tensors would be.
      values[k] =
          access.weight(ids[k]).to(params_[ids[k]].live.device(), at::kFloat, /*non_blocking=*/false,
                                 /*copy=*/true);
    }
    access.finish_views();
  } else {
    // Data parallel: every rank takes every value. The chunks holding them are broadcast from their
    // owners in index order (the same collectives on every rank: every rank opens the same scope).
    std::map<int64_t, at::Tensor> chunks;
    for (TensorId id : ids) chunks[store().layout().placement(id).chunk_index] = at::Tensor();
    for (auto& [index, chunk] : chunks)
      chunk = dp_.master_chunk_everywhere(access, index, master_kind());
    for (TensorId id : ids) {
      values.push_back(DataParallel::value_in(
          store().layout(), chunks[store().layout().placement(id).chunk_index], id));
    }
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    const Param& p = params_[ids[i]];
    c10::TensorImpl* impl = p.tensor.unsafeGetTensorImpl();
    impl->set_storage_and_dtype(values[i].storage(), c10::scalarTypeToTypeMeta(at::kFloat));
    impl->set_storage_offset(0);
    impl->set_sizes_contiguous(store().layout().sizes(p.id));
    params_.set_gathered(p.id, write_back ? GatherHold::kReadWrite : GatherHold::kReadOnly);
  }
}

void EngineCore::gather_end(const std::vector<TensorId>& ids, bool write_back) {
  torch::NoGradGuard no_grad;
  std::string changed;
  if (write_back) {
    for (TensorId id : ids) {
      const Param& p = params_[id];
      const at::Tensor& t = p.tensor;
      if (t.scalar_type() != at::kFloat || t.sizes() != store().layout().sizes(id) ||
          !t.is_contiguous()) {
        absl::StrAppend(&changed, changed.empty() ? "" : ", ", p.name, " (now ", t.scalar_type(),
                        " ", c10::str(t.sizes()), ")");
      }
    }
  }
  // The parameters return to their fences whatever happens while writing back.
  auto restore = [&] {
    const caffe2::TypeMeta half = c10::scalarTypeToTypeMeta(param_dtype(config_.precision()));
    for (TensorId id : ids) {
      const Param& p = params_[id];
      c10::TensorImpl* impl = p.tensor.unsafeGetTensorImpl();
      impl->set_storage_and_dtype(p.fence, half);
      impl->set_storage_offset(0);
      impl->set_sizes_contiguous(store().layout().sizes(p.id));
      params_.set_gathered(p.id, GatherHold::kNone);
    }
  };
  try {
    // Data parallel: rank 0's values are written (as DeepSpeed's modifier rank), each by its owner;
    // a change of shape on any rank writes nothing on every rank.
    if (write_back && dp_.only_others_failed(!changed.empty())) {
      changed = "a parameter on another rank";
    }
    if (write_back && changed.empty()) {
      // (Nothing trained while the scope held them: there is nothing to take back or land.)
      const StateAccess access = pipeline_->access();
      // Data parallel broadcasts in the scope's order (every rank alike); one process goes in
      // chunk order (a disk tier writes each chunk's masters once).
      std::vector<size_t> order(ids.size());
      for (size_t k = 0; k < order.size(); ++k) order[k] = k;
      if (!dp_.values_from_owners()) order = chunk_order(store().layout(), ids);
      for (size_t k : order) {
        const TensorId id = ids[k];
        const at::Tensor& t = params_[id].tensor;
        if (dp_.values_from_owners()) {
          dp_.comm().broadcast(t, 0);
          if (!owns(store().layout().placement(id).chunk_index)) continue;
        }
        if (mixed() && !lean_param(id))
          access.state(id, ChunkKind::kParamFp32, /*write=*/true).copy_(t);
        store().view(id, ChunkKind::kParam).copy_(t);
      }
      access.finish_views();
      dp_.release_remote(/*discard=*/false);  // no gathered copy keeps the old weights
    }
  } catch (...) {
    restore();
    throw;
  }
  restore();
  TORCH_CHECK(changed.empty(), "patrickstar: GatheredParameters: the shape or dtype of ", changed,
              " changed in the scope, so nothing was written back (the parameters keep the "
              "values they had); write values in place, with the same shape");
}

bool EngineCore::cast_buffer(const at::Tensor& buffer) const {
  return params_.is_cast_buffer(buffer);
}

int64_t EngineCore::parameter_version(TensorId id) const { return params_[id].tensor._version(); }

void EngineCore::add_scope(GatheredParameters* scope) { params_.add_scope(scope); }

void EngineCore::remove_scope(GatheredParameters* scope) {
  params_.remove_scope(scope);
}

GatheredParameters::GatheredParameters(torch::nn::Module& module, Mode mode) : mode_(mode) {
  EngineCore* core = dynamic_cast<EngineCore*>(handler_for(module));
  engine_ = core;
  TORCH_CHECK(engine_ != nullptr, "patrickstar: GatheredParameters: module ", module.name(),
              " belongs to no engine (its parameters are ordinary tensors already)");
  // The module's buffers that the engine cast to the compute dtype are fp32 in the scope too, so
  // that torch::save/torch::load in the scope see the fp32 model.
  for (const at::Tensor& b : module.buffers(/*recurse=*/true)) {
    if (engine_->cast_buffer(b)) buffers_.emplace_back(b, b.detach());
  }
  begin(module.parameters(/*recurse=*/true));
}

GatheredParameters::GatheredParameters(Engine& engine, const std::vector<at::Tensor>& params,
                                       Mode mode)
    : engine_(engine.core_.get()), mode_(mode) {
  begin(params);
}

void GatheredParameters::begin(const std::vector<at::Tensor>& params) {
  for (const at::Tensor& t : params) {
    const TensorId id = engine_->gathered_id(t);
    TORCH_CHECK(id >= 0, "patrickstar: GatheredParameters: a tensor of sizes ",
                t.defined() ? c10::str(t.sizes()) : std::string("(undefined)"),
                " is not a parameter of this engine's model");
    if (std::find(ids_.begin(), ids_.end(), id) == ids_.end()) ids_.push_back(id);  // tied: once
  }
  engine_->gather_begin(ids_, mode_ == Mode::kReadWrite);
  torch::NoGradGuard no_grad;
  for (const auto& [buffer, half] : buffers_) buffer.set_data(half.to(at::kFloat));
  for (TensorId id : ids_) versions_.push_back(engine_->parameter_version(id));
  engine_->add_scope(this);
}

void GatheredParameters::end() {
  if (ended_) return;
  ended_ = true;
  if (engine_ == nullptr) return;  // the engine went first (it warned)
  engine_->remove_scope(this);
  bool written = false;
  for (size_t i = 0; i < ids_.size(); ++i) {
    written = written || engine_->parameter_version(ids_[i]) != versions_[i];
  }
  {
    torch::NoGradGuard no_grad;
    for (const auto& [buffer, half] : buffers_) {
      buffer.set_data(mode_ == Mode::kReadWrite ? buffer.to(half.scalar_type()) : half);
    }
  }
  engine_->gather_end(ids_, mode_ == Mode::kReadWrite);
  if (written && mode_ == Mode::kReadOnly) {
    TORCH_WARN("patrickstar: parameters were written in place in a read-only GatheredParameters "
               "scope: the writes are discarded (and a backward pending on those parameters "
               "fails on their changed version); use Mode::kReadWrite between a step and the next "
               "forward");
  }
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
