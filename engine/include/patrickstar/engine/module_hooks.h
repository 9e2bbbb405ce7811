// The doors through which a model's forward tells the engine when a module runs (docs/design.md section 6).
// LibTorch's C++ modules have no hooks, so code that owns parameters says so at the call site:
//
//   x = patrickstar::call(fc1, x);            // a member submodule (any ModuleHolder or module)
//
//   patrickstar::ModuleScope scope(*this);     // a custom module using its own parameters directly
//   auto y = torch::matmul(x, weight_);
//   return scope.done(y);
//
// A door finds its engine from the module it opens: an engine registers every module of its model
// when it is built (and unregisters them when it goes), so `model->forward(x)` on the trainer's own
// holder, helpers taking `Net&`, and two engines in one autograd graph all reach the right engine,
// and a plain module of the same class (built without an engine) is a plain call. Modules no engine
// registered report to the handler active on the thread (ActiveHandlerGuard) when it takes them
// (a test's handler does; an engine does not). Without either, doors are plain calls. Nested doors
// are fine: a module's parameters already in use by an outer door are left to it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include "patrickstar/engine/checkpoint.h"

namespace patrickstar {

// What an engine does around a module's forward. Implemented by the engine; model code never calls it.
class ModuleHookHandler {
 public:
  virtual ~ModuleHookHandler() = default;
  // Makes the parameters of `module` (and its descendants) usable; returns a token for post_forward.
  // Grad mode is off in evaluation and also inside patrickstar::checkpoint's forward, which belongs
  // to a training step: in_checkpointed_forward() (checkpoint.h) tells them apart.
  virtual int64_t pre_forward(torch::nn::Module& module) = 0;
  // Passes the module's `inputs` through the post-backward hook: it runs once the module's
  // backward has produced their gradients, so the module's parameters may go.
  virtual std::vector<at::Tensor> wrap_inputs(int64_t token, std::vector<at::Tensor> inputs) {
    return inputs;
  }
  // Releases what pre_forward acquired and passes `outputs` through the pre-backward hook.
  virtual std::vector<at::Tensor> post_forward(int64_t token, std::vector<at::Tensor> outputs) = 0;
  // The module's forward threw: release what pre_forward acquired; no outputs follow.
  virtual void forward_failed(int64_t token) { post_forward(token, {}); }
  // Whether doors of modules no handler registered report here while this handler is active.
  virtual bool handles_unregistered_modules() const { return true; }
  // A backward pass through this handler's modules begins (patrickstar::checkpoint calls it before a
  // recompute's backward, so that the handler can queue its end-of-backward work on the outer pass).
  virtual void backward_started() {}

  // patrickstar::checkpoint's questions (checkpoint.h). Each checkpointed call of a training
  // iteration gets a number (0, 1, ... in call order) and a choice; `block` is the module the call
  // named (asked before fn runs), or nullptr (asked after its forward, from the first handler whose
  // doors opened in it: kKeep is not an answer then). `offload` is what the call's options say.
  struct CheckpointPlan {
    int64_t call = -1;  // -1: the handler does not track the call
    ActivationChoice choice = ActivationChoice::kRecompute;
  };
  virtual CheckpointPlan plan_checkpoint(const torch::nn::Module* /*block*/,
                                         std::optional<bool> offload) {
    return {-1,
            offload.value_or(false) ? ActivationChoice::kOffload : ActivationChoice::kRecompute};
  }
  // The call's forward ran without gradients in `seconds` (host time) and its input is saved.
  virtual void checkpoint_forward_done(int64_t /*call*/, const at::Tensor& /*input*/,
                                       double /*seconds*/) {}
  // Takes the call's saved input off the device; nullptr leaves it there.
  virtual std::unique_ptr<OffloadedActivation> offload_activation(int64_t /*call*/,
                                                                  const at::Tensor& /*input*/) {
    return nullptr;
  }
  // The call's recompute in backward begins, and its forward (with gradients) is done.
  virtual void checkpoint_recompute_begins(int64_t /*call*/) {}
  virtual void checkpoint_recompute_done(int64_t /*call*/, double /*seconds*/) {}
};

// The registry of doors. Thread-safe. register_module_handler throws c10::Error when `module` is
// registered to another handler already (a module belongs to one engine).
void register_module_handler(const torch::nn::Module& module, ModuleHookHandler* handler);
// Forgets `module` if `handler` registered it.
void unregister_module_handler(const torch::nn::Module& module, const ModuleHookHandler* handler);
// The handler that registered `module`, else the active handler if it handles unregistered modules,
// else nullptr.
ModuleHookHandler* handler_for(const torch::nn::Module& module);

// The handler active on this thread, or nullptr.
ModuleHookHandler* active_module_hook_handler();

// Makes `handler` active on this thread for the guard's lifetime (restores the previous one).
class ActiveHandlerGuard {
 public:
  explicit ActiveHandlerGuard(ModuleHookHandler* handler);
  ~ActiveHandlerGuard();
  ActiveHandlerGuard(const ActiveHandlerGuard&) = delete;
  ActiveHandlerGuard& operator=(const ActiveHandlerGuard&) = delete;

 private:
  ModuleHookHandler* previous_;
};

// The explicit door: construct before using `module`'s parameters, pass the results through done().
class ModuleScope {
 public:
  explicit ModuleScope(torch::nn::Module& module);
  ~ModuleScope();
  ModuleScope(const ModuleScope&) = delete;
  ModuleScope& operator=(const ModuleScope&) = delete;

  // Optional: pass the module's tensor inputs through this before using them, so the engine can
  // release the parameters as soon as the module's backward is over (without it, they stay until
  // their gradients are final).
  at::Tensor input(const at::Tensor& input);

  at::Tensor done(const at::Tensor& output);
  std::vector<at::Tensor> done(std::vector<at::Tensor> outputs);

 private:
  ModuleHookHandler* handler_;
  int64_t token_ = -1;
  bool finished_ = false;
};

namespace detail {
template <typename A>
decltype(auto) scoped_input(ModuleScope& scope, A&& arg) {
  if constexpr (std::is_convertible_v<A, const at::Tensor&>) {
    return scope.input(arg);
  } else {
    return std::forward<A>(arg);
  }
}

template <typename M>
torch::nn::Module& module_of(M& module) {
  if constexpr (std::is_base_of_v<torch::nn::Module, M>) {
    return module;
  } else {
    return *module.ptr();  // a ModuleHolder
  }
}
// Notes `handler` as one whose doors opened inside the checkpointed forward in progress (checkpoint.cpp).
void note_checkpointed_handler(ModuleHookHandler* handler);
}  // namespace detail

// torch::nn::Sequential gets its doors automatically: each entry runs behind its own door (tensor in,
// tensor out, as Sequential chains them). call(seq, x) comes here, and so does `model->forward(x)`
// on an initialize_engine model that is a Sequential.
at::Tensor call_sequential(torch::nn::SequentialImpl& sequential, const at::Tensor& input);

// The one-line door: runs `module(args...)` between the engine's pre- and post-forward; tensor
// arguments go through ModuleScope::input. The module's forward must return a tensor or a vector
// of tensors. A torch::nn::Sequential runs each entry behind its own door instead.
template <typename M, typename... Args>
auto call(M& module, Args&&... args) {
  if constexpr (std::is_same_v<std::remove_const_t<M>, torch::nn::Sequential>) {
    return call_sequential(*module, std::forward<Args>(args)...);
  } else if constexpr (std::is_same_v<std::remove_const_t<M>, torch::nn::SequentialImpl>) {
    return call_sequential(module, std::forward<Args>(args)...);
  } else if (handler_for(detail::module_of(module)) == nullptr) {
    if constexpr (std::is_base_of_v<torch::nn::Module, M>) {
      return module.forward(std::forward<Args>(args)...);
    } else {
      return module(std::forward<Args>(args)...);
    }
  } else {
    ModuleScope scope(detail::module_of(module));
    if constexpr (std::is_base_of_v<torch::nn::Module, M>) {
      return scope.done(module.forward(detail::scoped_input(scope, std::forward<Args>(args))...));
    } else {
      return scope.done(module(detail::scoped_input(scope, std::forward<Args>(args))...));
    }
  }
}

}  // namespace patrickstar
