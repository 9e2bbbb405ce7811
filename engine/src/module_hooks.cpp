#include "patrickstar/engine/module_hooks.h"

#include <c10/util/Exception.h>

namespace patrickstar {
namespace {
thread_local ModuleHookHandler* g_active_handler = nullptr;
}  // namespace

ModuleHookHandler* active_module_hook_handler() { return g_active_handler; }

ActiveHandlerGuard::ActiveHandlerGuard(ModuleHookHandler* handler) : previous_(g_active_handler) {
  g_active_handler = handler;
}

ActiveHandlerGuard::~ActiveHandlerGuard() { g_active_handler = previous_; }

ModuleScope::ModuleScope(torch::nn::Module& module) : handler_(active_module_hook_handler()) {
  if (handler_ != nullptr) token_ = handler_->pre_forward(module);
}

ModuleScope::~ModuleScope() {
  // A forward that threw: release what was acquired, passing no outputs on.
  if (handler_ != nullptr && !finished_) {
    try {
      handler_->forward_failed(token_);
    } catch (...) {
    }
  }
}

at::Tensor ModuleScope::input(const at::Tensor& input) {
  if (handler_ == nullptr || finished_) return input;
  return handler_->wrap_inputs(token_, {input})[0];
}

at::Tensor ModuleScope::done(const at::Tensor& output) {
  return done(std::vector<at::Tensor>{output})[0];
}

std::vector<at::Tensor> ModuleScope::done(std::vector<at::Tensor> outputs) {
  TORCH_CHECK(!finished_, "ModuleScope::done called twice");
  finished_ = true;
  if (handler_ == nullptr) return outputs;
  return handler_->post_forward(token_, std::move(outputs));
}

at::Tensor call_sequential(torch::nn::SequentialImpl& sequential, const at::Tensor& input) {
  if (active_module_hook_handler() == nullptr) return sequential.forward(input);
  TORCH_CHECK(!sequential.is_empty(), "patrickstar::call: the Sequential is empty");
  at::Tensor x = input;
  for (torch::nn::AnyModule& entry : sequential) {
    ModuleScope scope(*entry.ptr());
    x = scope.done(entry.forward<at::Tensor>(scope.input(x)));
  }
  return x;
}

}  // namespace patrickstar
