#include "patrickstar/engine/module_hooks.h"

#include <mutex>
#include <unordered_map>

#include <c10/util/Exception.h>

#include "patrickstar/engine/checkpoint.h"

namespace patrickstar {
namespace {
thread_local ModuleHookHandler* g_active_handler = nullptr;

struct Registry {
  std::mutex mutex;
  std::unordered_map<const torch::nn::Module*, ModuleHookHandler*> handlers;
};
Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: modules may outlive static destruction
  return *r;
}
}  // namespace

void register_module_handler(const torch::nn::Module& module, ModuleHookHandler* handler) {
  TORCH_CHECK(handler != nullptr, "patrickstar: register_module_handler: null handler");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto [it, inserted] = r.handlers.emplace(&module, handler);
  TORCH_CHECK(inserted || it->second == handler, "patrickstar: module ", module.name(),
              " already belongs to another engine; a module can be trained by one engine only");
}

void unregister_module_handler(const torch::nn::Module& module, const ModuleHookHandler* handler) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.handlers.find(&module);
  if (it != r.handlers.end() && it->second == handler) r.handlers.erase(it);
}

ModuleHookHandler* handler_for(const torch::nn::Module& module) {
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.handlers.find(&module);
    if (it != r.handlers.end()) return it->second;
  }
  ModuleHookHandler* active = g_active_handler;
  return active != nullptr && active->handles_unregistered_modules() ? active : nullptr;
}

ModuleHookHandler* active_module_hook_handler() { return g_active_handler; }

ActiveHandlerGuard::ActiveHandlerGuard(ModuleHookHandler* handler) : previous_(g_active_handler) {
  g_active_handler = handler;
}

ActiveHandlerGuard::~ActiveHandlerGuard() { g_active_handler = previous_; }

ModuleScope::ModuleScope(torch::nn::Module& module) : handler_(handler_for(module)) {
  if (handler_ == nullptr) return;
  if (in_checkpointed_forward()) detail::note_checkpointed_handler(handler_);
  token_ = handler_->pre_forward(module);
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
  if (handler_for(sequential) == nullptr) return sequential.forward(input);
  TORCH_CHECK(!sequential.is_empty(), "patrickstar::call: the Sequential is empty");
  at::Tensor x = input;
  for (torch::nn::AnyModule& entry : sequential) {
    ModuleScope scope(*entry.ptr());
    x = scope.done(entry.forward<at::Tensor>(scope.input(x)));
  }
  return x;
}

}  // namespace patrickstar
