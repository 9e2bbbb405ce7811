// Private to engine/src: the model's parameters as the engine registered them (one entry per
// TensorImpl: a tied parameter once), the modules whose doors open over them, and the doors open
// now. It owns what each parameter is and where its storage points; the engine decides when that
// changes (a door opens, a gradient arrives, a step runs) and the chunk store holds the values.
//
// Invariants: a parameter's entry is written only by ParamTable's named operations (operator[] and
// iteration hand out const Param&); its use count never goes below zero, and a pass is counted
// once however many doors of it open; a parameter with has_grad has grad.defined.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include "patrickstar/chunk/layout.h"

namespace patrickstar {
class GatheredParameters;  // patrickstar/engine/gathered_parameters.h
}  // namespace patrickstar

namespace patrickstar::engine_detail {

// How a GatheredParameters scope holds a parameter (as a real fp32 tensor with the master weights).
enum class GatherHold { kNone, kReadOnly, kReadWrite };

// tensor.grad() as LibTorch code sees it (engine_grad_handles.cpp). defined: LibTorch's
// tensor.grad() would be defined (a gradient came since the last reset). tensor: what the engine
// set tensor.grad() to: a view of the chunk slot holding the gradient (is_view, over storage,
// fenced when withdrawn) or a marker without data. consumed: a step used the gradient and
// overwrote its half slot (mixed precision without a gradient space).
struct GradHandle {
  bool defined = false;
  bool is_view = false;
  bool consumed = false;
  at::Tensor tensor;
  c10::Storage storage;
  int64_t version = 0;
};

struct Param {
  std::string name;
  at::Tensor tensor;  // the user's parameter (same TensorImpl throughout)
  // The parameter's storage in a door: re-pointed at the chunk slot (views autograd saved share
  // it). Outside the doors the parameter holds `fence`, which has no data and throws an error
  // naming the parameter when an operator reads it.
  c10::Storage live;
  c10::Storage fence;
  GatherHold gathered = GatherHold::kNone;
  TensorId id = -1;
  bool trainable = true;
  int compute_refs = 0;   // open doors / backward uses holding it
  bool has_grad = false;  // gradient written since the last step (or kept at zero: the step)
  // The autograd passes that will bring this parameter a gradient in the next backward: the
  // plain forward is one, each checkpointed call that uses it another (its recompute has a
  // backward of its own). With two or more, a recompute may still read the weight after a
  // gradient arrived, so gradients wait in pending_grad (mixed precision without a gradient
  // space). last_segment: the pass of the latest use (0 plain, else the checkpoint's serial).
  int segments = 0;
  int64_t last_segment = -1;
  void forget_segments() {  // a forward forgotten, a backward ended or abandoned
    segments = 0;
    last_segment = -1;
  }
  at::Tensor pending_grad;  // fp32 sum of such gradients, written to the half slot at the end
  // An evaluation forward on CUDA whose chunk is on the host reads this device copy of the slot
  // (the schedule is not followed outside training; the copy goes when the door closes). The one
  // field written through a const Param: a cache of the slot, not the parameter's state.
  mutable at::Tensor eval_copy;
  // Data parallel: gradients written this backward (the group is reduced once every trainable
  // tensor of it has `segments` of them), and whether a door used it since its group's gather.
  int grads_this_backward = 0;
  bool touched = false;
  GradHandle grad;
  int64_t adam_steps = 0;  // Adam updates applied to it (torch::optim::Adam counts per parameter)
};

struct ModuleInfo {
  std::string label;
  std::vector<TensorId> params;  // its own and its descendants', registered order
  int64_t hook_id = -1;          // pre-backward (on its outputs)
  int64_t post_hook_id = -1;     // post-backward (on its inputs)
};

class ParamTable {
 public:
  // Registration, step 1: `t` gets the next id unless its TensorImpl has one (a tied parameter).
  // Returns whether it was new.
  bool add(const at::Tensor& t) {
    return ids_.emplace(t.unsafeGetTensorImpl(), static_cast<TensorId>(ids_.size())).second;
  }
  // Registration, step 3: the entries for the ids handed out.
  void create_entries() { params_.resize(ids_.size()); }
  // Registration gave up: nothing is registered.
  // Buffers of the model the engine cast to the compute dtype (mixed precision), kept in fp32.
  void add_cast_buffer(const at::Tensor& buffer) { cast_buffers_.push_back(buffer); }
  const std::vector<at::Tensor>& cast_buffers() const { return cast_buffers_; }
  bool is_cast_buffer(const at::Tensor& buffer) const {
    return std::any_of(cast_buffers_.begin(), cast_buffers_.end(),
                       [&](const at::Tensor& cast) { return cast.is_same(buffer); });
  }
  // The GatheredParameters scopes open now (told when the engine goes).
  void add_scope(GatheredParameters* scope) { scopes_.push_back(scope); }
  void remove_scope(GatheredParameters* scope) {
    scopes_.erase(std::remove(scopes_.begin(), scopes_.end(), scope), scopes_.end());
  }
  const std::vector<GatheredParameters*>& scopes() const { return scopes_; }
  // (Registration gave up: the parameters go; cast buffers and scopes have none yet.)
  void clear() {
    ids_.clear();
    params_.clear();
  }
  // The registered parameter behind `t`, or -1.
  TensorId id_of(const at::Tensor& t) const {
    if (!t.defined()) return -1;
    auto it = ids_.find(t.unsafeGetTensorImpl());
    return it == ids_.end() ? -1 : it->second;
  }

  size_t size() const { return params_.size(); }
  bool empty() const { return params_.empty(); }
  // Read-only: what the engine does to a parameter is one of the operations below.
  const Param& operator[](TensorId id) const { return params_[static_cast<size_t>(id)]; }
  auto begin() const { return params_.cbegin(); }
  auto end() const { return params_.cend(); }

  // --- what the engine does to a parameter ---
  // Registration, step 4: parameter `id` is `tensor`, named `name`; `live` is the storage its
  // doors re-point at its chunk slot, `fence` what it holds outside them.
  void fill(TensorId id, std::string name, at::Tensor tensor, c10::Storage live,
            c10::Storage fence) {
    Param& p = at(id);
    p.name = std::move(name);
    p.trainable = tensor.requires_grad();
    p.tensor = std::move(tensor);
    p.id = id;
    p.live = std::move(live);
    p.fence = std::move(fence);
  }
  // requires_grad changed between iterations (frozen_parameters "full_state").
  void set_trainable(TensorId id, bool trainable) { at(id).trainable = trainable; }
  // Uses by open doors and backward: begin_use is true for the first, end_use for the last (and
  // false when none was open); a gradient that came without its module's pre-backward holds one.
  bool begin_use(TensorId id) { return at(id).compute_refs++ == 0; }
  bool end_use(TensorId id) {
    Param& p = at(id);
    return p.compute_refs > 0 && --p.compute_refs == 0;
  }
  void hold_one_use(TensorId id) { at(id).compute_refs = 1; }
  void end_uses(TensorId id) { at(id).compute_refs = 0; }
  // A use in autograd pass `segment` (0 the plain forward, else a checkpoint's serial): each pass
  // counts once.
  void note_pass(TensorId id, int64_t segment) {
    Param& p = at(id);
    if (p.last_segment == segment) return;
    p.last_segment = segment;
    ++p.segments;
  }
  void forget_passes(TensorId id) { at(id).forget_segments(); }
  // Data parallel: a gradient of this backward arrived; the backward ended; a door used it since
  // its group's gather (false: gathered again).
  void count_backward_gradient(TensorId id) { ++at(id).grads_this_backward; }
  void reset_backward_gradients(TensorId id) { at(id).grads_this_backward = 0; }
  void set_touched(TensorId id, bool touched) { at(id).touched = touched; }
  // Mixed precision, a parameter of several passes: its gradients add up in fp32 until the end of
  // the backward, which takes the sum.
  void add_pending_gradient(TensorId id, const at::Tensor& grad) {
    Param& p = at(id);
    if (p.pending_grad.defined()) {
      p.pending_grad.add_(grad);
    } else {
      p.pending_grad = grad.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    }
  }
  at::Tensor take_pending_gradient(TensorId id) { return std::exchange(at(id).pending_grad, {}); }
  // A gradient landed in its slot: the parameter has one (LibTorch's grad() is defined) and no use
  // holds it any more.
  void note_gradient(TensorId id) {
    Param& p = at(id);
    p.has_grad = true;
    p.grad.defined = true;
    p.compute_refs = 0;
  }
  // zero_grad(set_to_none=false) kept a zero gradient a loss did not reach: the step uses it.
  void keep_zero_gradient(TensorId id) { at(id).has_grad = true; }
  // Its gradient goes (zero_grad, an edit of grad(), a discarded iteration).
  void drop_gradient(TensorId id) {
    Param& p = at(id);
    p.has_grad = false;
    p.grad.consumed = false;
    p.pending_grad.reset();
  }
  // After the step: `counted` adds an Adam update to its count; `consumed`, the half slot now holds
  // the new weight instead of the gradient (mixed precision without a gradient space).
  void after_update(TensorId id, bool counted, bool consumed) {
    Param& p = at(id);
    if (p.has_grad) {
      if (counted) ++p.adam_steps;
      p.grad.consumed = consumed;
    }
    p.has_grad = false;
  }
  // Adam updates applied to it: one more or one taken back (the delayed update), or a checkpoint's.
  void add_adam_steps(TensorId id, int64_t delta) { at(id).adam_steps += delta; }
  void set_adam_steps(TensorId id, int64_t steps) { at(id).adam_steps = steps; }
  // tensor.grad() as LibTorch code sees it (GradHandle).
  void set_grad_defined(TensorId id, bool defined) { at(id).grad.defined = defined; }
  void set_grad_consumed(TensorId id, bool consumed) { at(id).grad.consumed = consumed; }
  void show_grad(TensorId id, at::Tensor handle, bool is_view, c10::Storage view_storage) {
    GradHandle& g = at(id).grad;
    if (is_view) g.storage = std::move(view_storage);
    g.is_view = is_view;
    g.version = static_cast<int64_t>(handle._version());
    g.tensor = std::move(handle);
  }
  // The handle is withdrawn (its view, if any, was fenced by the caller).
  void withdraw_grad(TensorId id) {
    GradHandle& g = at(id).grad;
    g.is_view = false;
    g.storage = c10::Storage();
    g.tensor.reset();
  }
  // GatheredParameters holds it as a real fp32 tensor (kNone: back behind its fence).
  void set_gathered(TensorId id, GatherHold hold) { at(id).gathered = hold; }

  // Parameters a GatheredParameters scope holds (`for_write`: read-write scopes only).
  int64_t gathered(bool for_write = false) const {
    return std::count_if(params_.begin(), params_.end(), [&](const Param& p) {
      return for_write ? p.gathered == GatherHold::kReadWrite : p.gathered != GatherHold::kNone;
    });
  }

  // The model's modules: their names (registration), and what a door needs of each (made on its
  // first door; `make_hooks` gives a new one its backward hooks).
  void name_module(const torch::nn::Module* module, std::string name) {
    module_names_[module] = std::move(name);
  }
  const std::string& module_name(const torch::nn::Module* module) { return module_names_[module]; }
  const std::unordered_map<const torch::nn::Module*, std::string>& module_names() const {
    return module_names_;
  }
  template <typename MakeHooks>
  ModuleInfo& module(torch::nn::Module& module, MakeHooks&& make_hooks) {
    auto it = modules_.find(&module);
    if (it != modules_.end()) return *it->second;
    auto info = std::make_unique<ModuleInfo>();
    auto name = module_names_.find(&module);
    info->label = name != module_names_.end() ? name->second : module.name();
    for (const at::Tensor& t : module.parameters(/*recurse=*/true)) {
      const TensorId id = id_of(t);
      TORCH_CHECK(id >= 0, "patrickstar: module ", info->label,
                  " has a parameter the engine did not register (was it added after "
                  "initialize_engine?)");
      if (std::find(info->params.begin(), info->params.end(), id) == info->params.end()) {
        info->params.push_back(id);
      }
    }
    make_hooks(*info);
    return *modules_.emplace(&module, std::move(info)).first->second;
  }

 private:
  Param& at(TensorId id) { return params_.at(static_cast<size_t>(id)); }

  std::vector<Param> params_;
  std::unordered_map<const c10::TensorImpl*, TensorId> ids_;
  std::unordered_map<const torch::nn::Module*, std::string> module_names_;
  std::unordered_map<const torch::nn::Module*, std::unique_ptr<ModuleInfo>> modules_;
  std::vector<at::Tensor> cast_buffers_;
  std::vector<GatheredParameters*> scopes_;
};

// The doors open now. A door's token indexes the scopes opened since none was open; a closed door
// keeps its slot until every door is closed (a token is not reused while any door is open).
template <typename Scope>
class OpenDoors {
 public:
  int64_t open(Scope scope) {
    scopes_.push_back(std::move(scope));
    ++open_;
    return static_cast<int64_t>(scopes_.size()) - 1;
  }
  // A door closed (any one: slots are not freed one by one); when the last one closes, every slot
  // goes.
  void close() {
    TORCH_INTERNAL_ASSERT(open_ > 0, "a door closed twice");
    if (--open_ == 0) scopes_.clear();
  }
  // The door opened last failed to open: its slot goes.
  void cancel_last() {
    TORCH_INTERNAL_ASSERT(open_ > 0 && !scopes_.empty(), "no door to cancel");
    scopes_.pop_back();
    --open_;
  }
  bool valid(int64_t token) const {
    return token >= 0 && token < static_cast<int64_t>(scopes_.size());
  }
  Scope& operator[](int64_t token) { return scopes_[static_cast<size_t>(token)]; }
  int open_count() const { return open_; }
  bool none_open() const { return open_ == 0; }
  void clear() {  // an iteration dropped: every door forgotten
    scopes_.clear();
    open_ = 0;
  }

 private:
  std::vector<Scope> scopes_;
  int open_ = 0;
};

}  // namespace patrickstar::engine_detail
