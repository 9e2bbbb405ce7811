#include "patrickstar/engine/checkpoint.h"

#include <algorithm>
#include <vector>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <ATen/core/grad_mode.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include "patrickstar/engine/module_hooks.h"

namespace patrickstar {
namespace {

thread_local int g_checkpointed_forward_depth = 0;
thread_local int64_t g_checkpointed_forward_serial = 0;
thread_local int g_recompute_depth = 0;
// The handlers whose doors opened in the outermost checkpointed forward in progress.
thread_local std::vector<ModuleHookHandler*>* g_checkpointed_handlers = nullptr;

class CheckpointedForwardGuard {
 public:
  CheckpointedForwardGuard() {
    if (g_checkpointed_forward_depth++ == 0) ++g_checkpointed_forward_serial;
  }
  ~CheckpointedForwardGuard() { --g_checkpointed_forward_depth; }
  CheckpointedForwardGuard(const CheckpointedForwardGuard&) = delete;
  CheckpointedForwardGuard& operator=(const CheckpointedForwardGuard&) = delete;
};

// The states of the default generators a checkpointed block can draw from: the CPU's, and the CUDA
// device's where the input lives there (or, for an input on the CPU, the current CUDA device's when
// this process has already used it; one never used is not initialized for this).
class RandomStates {
 public:
  static RandomStates capture(const at::Tensor& input) {
    RandomStates states;
    states.add(at::detail::getDefaultCPUGenerator());
    if (input.is_cuda()) {
      states.add(at::globalContext().defaultGenerator(input.device()));
    } else if (at::globalContext().hasCUDA()) {
      const auto& cuda = at::detail::getCUDAHooks();
      const c10::DeviceIndex current = cuda.current_device();
      if (current >= 0 && cuda.hasPrimaryContext(current)) {
        states.add(at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, current)));
      }
    }
    return states;
  }
  // Sets every generator to the state it had at capture().
  void restore() const {
    for (const auto& [generator, state] : states_) {
      at::Generator g = generator;
      std::lock_guard<std::mutex> lock(g.mutex());
      g.set_state(state);
    }
  }

 private:
  void add(at::Generator generator) {
    at::Tensor state;
    {
      std::lock_guard<std::mutex> lock(generator.mutex());
      state = generator.get_state();
    }
    states_.emplace_back(std::move(generator), std::move(state));
  }
  std::vector<std::pair<at::Generator, at::Tensor>> states_;
};

// For the recompute: the generators replay the forward's states, and continue afterwards (also when
// the recompute throws) from where the program had brought them.
class ReplayedRandomStates {
 public:
  ReplayedRandomStates(const std::optional<RandomStates>& at_forward, const at::Tensor& input) {
    if (!at_forward) return;
    now_ = RandomStates::capture(input);
    at_forward->restore();
  }
  ~ReplayedRandomStates() {
    if (now_) now_->restore();
  }
  ReplayedRandomStates(const ReplayedRandomStates&) = delete;
  ReplayedRandomStates& operator=(const ReplayedRandomStates&) = delete;

 private:
  std::optional<RandomStates> now_;
};

// The backward of one checkpointed call. A Node of our own rather than a torch::autograd::Function:
// the node must own `fn`, which an AutogradContext (IValues only) cannot hold.
class CheckpointBackward final : public torch::autograd::Node {
 public:
  CheckpointBackward(CheckpointFunction fn, ModuleHookHandler* handler,
                     std::vector<ModuleHookHandler*> handlers, const at::Tensor& input,
                     std::optional<RandomStates> random_states)
      : fn_(std::move(fn)),
        handler_(handler),
        handlers_(std::move(handlers)),
        input_(input, /*is_output=*/false),
        random_states_(std::move(random_states)) {}

  std::string name() const override { return "patrickstar::CheckpointBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};  // the output did not reach the loss
    // unpack() fails with autograd's own message after a second backward or an in-place change.
    at::Tensor input = input_.unpack().detach().requires_grad_(true);
    // This runs in the outer backward pass: the engines whose modules fn uses begin their backward
    // here (their end-of-backward work belongs to this pass, not to the recompute's nested one).
    for (ModuleHookHandler* h : handlers_) h->backward_started();
    struct RecomputeGuard {
      RecomputeGuard() { ++g_recompute_depth; }
      ~RecomputeGuard() { --g_recompute_depth; }
    } recomputing;
    at::Tensor output;
    {
      // Autograd runs backward with grad mode off; the recompute must build a graph. Its doors
      // reach the engines that registered their modules; the handler active at the forward is
      // made active again for modules no engine registered.
      at::AutoGradMode grad_mode(true);
      ActiveHandlerGuard active(handler_);
      ReplayedRandomStates replayed(random_states_, input);
      output = fn_(input);
    }
    TORCH_CHECK(output.defined() && output.sizes() == grads[0].sizes(),
                "patrickstar::checkpoint: the recomputed output has shape ",
                output.defined() ? output.sizes() : c10::IntArrayRef{}, " but the forward's had ",
                grads[0].sizes(), "; the function must compute the same thing when run again");
    if (!output.requires_grad()) return {at::Tensor()};
    torch::autograd::backward({output}, {grads[0]});
    return {input.grad()};
  }

  void release_variables() override {
    input_.reset_data();
    fn_ = nullptr;  // what fn captured may go now
    random_states_.reset();
  }

 private:
  CheckpointFunction fn_;
  ModuleHookHandler* handler_;
  std::vector<ModuleHookHandler*> handlers_;
  torch::autograd::SavedVariable input_;
  std::optional<RandomStates> random_states_;  // at the forward (CheckpointOptions)
};

}  // namespace

bool in_checkpointed_forward() {
  return g_checkpointed_forward_depth > 0;
}

int64_t checkpointed_forward_serial() {
  return g_checkpointed_forward_depth > 0 ? g_checkpointed_forward_serial : 0;
}

bool in_checkpoint_recompute() {
  return g_recompute_depth > 0;
}

namespace detail {
void note_checkpointed_handler(ModuleHookHandler* handler) {
  if (g_checkpointed_handlers == nullptr) return;
  auto& seen = *g_checkpointed_handlers;
  if (std::find(seen.begin(), seen.end(), handler) == seen.end()) seen.push_back(handler);
}
}  // namespace detail

at::Tensor checkpoint(CheckpointFunction fn, const at::Tensor& input, CheckpointOptions options) {
  TORCH_CHECK(fn, "patrickstar::checkpoint: the function is empty");
  if (!at::GradMode::is_enabled() || !input.defined() || !input.requires_grad()) return fn(input);
  at::Tensor output;
  std::vector<ModuleHookHandler*> handlers;
  std::optional<RandomStates> random_states;
  if (options.preserve_rng_state) random_states = RandomStates::capture(input);
  {
    at::NoGradGuard no_grad;
    CheckpointedForwardGuard checkpointed;
    std::vector<ModuleHookHandler*>* outer = g_checkpointed_handlers;
    if (outer == nullptr) g_checkpointed_handlers = &handlers;  // the outermost call collects
    try {
      output = fn(input);
    } catch (...) {
      g_checkpointed_handlers = outer;
      throw;
    }
    g_checkpointed_handlers = outer;
  }
  TORCH_CHECK(output.defined() && torch::autograd::isDifferentiableType(output.scalar_type()),
              "patrickstar::checkpoint: the function must return a floating-point tensor, got ",
              output.defined() ? c10::toString(output.scalar_type()) : "an undefined tensor");
  // A fresh handle (fn may return its input or a view), which the checkpoint's node produces.
  output = output.detach();
  std::shared_ptr<CheckpointBackward> node(
      new CheckpointBackward(std::move(fn), active_module_hook_handler(), std::move(handlers), input,
                             std::move(random_states)),
      torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(input));
  torch::autograd::set_history(output, node);
  return output;
}

}  // namespace patrickstar
