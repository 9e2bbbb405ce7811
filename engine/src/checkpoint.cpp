#include "patrickstar/engine/checkpoint.h"

#include <algorithm>
#include <chrono>
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
#include <torch/csrc/autograd/variable.h>

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

// Without an engine: a CUDA input's copy in pinned host memory, made and brought back on the
// current stream (which orders both copies after the forward and before the recompute).
class PinnedHostCopy final : public OffloadedActivation {
 public:
  explicit PinnedHostCopy(const at::Tensor& input) : device_(input.device()) {
    host_ = at::empty(input.sizes(), input.options().device(at::kCPU).pinned_memory(true));
    host_.copy_(input, /*non_blocking=*/true);
  }
  at::Tensor take() override { return host_.to(device_, /*non_blocking=*/true); }

 private:
  c10::Device device_;
  at::Tensor host_;
};

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// What the handler that planned a call (ModuleHookHandler::plan_checkpoint) hears of it.
struct PlannedCall {
  ModuleHookHandler* planner = nullptr;
  int64_t call = -1;
};

// The backward of one checkpointed call. A Node of our own rather than a torch::autograd::Function:
// the node must own `fn`, which an AutogradContext (IValues only) cannot hold.
class CheckpointBackward final : public torch::autograd::Node {
 public:
  CheckpointBackward(CheckpointFunction fn, ModuleHookHandler* handler,
                     std::vector<ModuleHookHandler*> handlers, const at::Tensor& input,
                     std::unique_ptr<OffloadedActivation> offloaded,
                     std::optional<RandomStates> random_states, PlannedCall planned)
      : fn_(std::move(fn)),
        handler_(handler),
        handlers_(std::move(handlers)),
        offloaded_(std::move(offloaded)),
        random_states_(std::move(random_states)),
        planned_(planned),
        input_version_(torch::autograd::impl::version_counter(input)),
        saved_version_(input_version_.current_version()) {
    // An offloaded input is not kept here (its copy is): its device memory may go.
    if (offloaded_ == nullptr) input_ = torch::autograd::SavedVariable(input, /*is_output=*/false);
  }

  std::string name() const override { return "patrickstar::CheckpointBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};  // the output did not reach the loss
    at::Tensor input = saved_input().detach().requires_grad_(true);
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
      if (planned_.planner != nullptr) planned_.planner->checkpoint_recompute_begins(planned_.call);
      const auto start = std::chrono::steady_clock::now();
      output = fn_(input);
      if (planned_.planner != nullptr) {
        planned_.planner->checkpoint_recompute_done(planned_.call, seconds_since(start));
      }
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
    offloaded_.reset();
    taken_.reset();
    fn_ = nullptr;  // what fn captured may go now
    random_states_.reset();
  }

 private:
  at::Tensor saved_input() {
    if (offloaded_ == nullptr && !taken_.defined()) {
      // unpack() fails with autograd's own message after a second backward or an in-place change.
      return input_.unpack();
    }
    if (!taken_.defined()) {
      // The check SavedVariable makes: the copy was taken at the forward.
      TORCH_CHECK(
          input_version_.current_version() == saved_version_,
          "patrickstar::checkpoint: the input of an offloaded checkpoint was modified by an "
          "inplace operation after its forward (version ",
          saved_version_, ", now ", input_version_.current_version(),
          "); its recompute needs the value it had");
      taken_ = offloaded_->take();
      offloaded_.reset();
    }
    return taken_;
  }

  CheckpointFunction fn_;
  ModuleHookHandler* handler_;
  std::vector<ModuleHookHandler*> handlers_;
  torch::autograd::SavedVariable input_;
  std::unique_ptr<OffloadedActivation> offloaded_;  // the input while it is away from the device
  at::Tensor taken_;                                // and once it is back (until released)
  std::optional<RandomStates> random_states_;       // at the forward (CheckpointOptions)
  PlannedCall planned_;
  c10::VariableVersion input_version_;  // the input's version counter (not its memory)
  uint32_t saved_version_;
};

// The forward without gradients; collects the handlers whose doors opened in it.
at::Tensor checkpointed_forward(const CheckpointFunction& fn, const at::Tensor& input,
                                std::vector<ModuleHookHandler*>& handlers) {
  at::NoGradGuard no_grad;
  CheckpointedForwardGuard checkpointed;
  std::vector<ModuleHookHandler*>* outer = g_checkpointed_handlers;
  if (outer == nullptr) g_checkpointed_handlers = &handlers;  // the outermost call collects
  try {
    at::Tensor output = fn(input);
    g_checkpointed_handlers = outer;
    return output;
  } catch (...) {
    g_checkpointed_handlers = outer;
    throw;
  }
}

at::Tensor run_checkpoint(torch::nn::Module* block, CheckpointFunction fn, const at::Tensor& input,
                          CheckpointOptions options) {
  TORCH_CHECK(fn, "patrickstar::checkpoint: the function is empty");
  if (!at::GradMode::is_enabled() || !input.defined() || !input.requires_grad()) return fn(input);
  // A named block's engine plans the call before it runs (it may keep the activations).
  PlannedCall planned{block != nullptr ? handler_for(*block) : nullptr, -1};
  ModuleHookHandler::CheckpointPlan plan{-1, options.offload.value_or(false)
                                                 ? ActivationChoice::kOffload
                                                 : ActivationChoice::kRecompute};
  if (planned.planner != nullptr) {
    plan = planned.planner->plan_checkpoint(block, options.offload);
    if (plan.choice == ActivationChoice::kKeep) {
      const auto start = std::chrono::steady_clock::now();
      at::Tensor output = fn(input);
      planned.planner->checkpoint_forward_done(plan.call, input, seconds_since(start));
      return output;
    }
  }
  std::vector<ModuleHookHandler*> handlers;
  std::optional<RandomStates> random_states;
  if (options.preserve_rng_state) random_states = RandomStates::capture(input);
  const auto start = std::chrono::steady_clock::now();
  at::Tensor output = checkpointed_forward(fn, input, handlers);
  const double seconds = seconds_since(start);
  TORCH_CHECK(output.defined() && torch::autograd::isDifferentiableType(output.scalar_type()),
              "patrickstar::checkpoint: the function must return a floating-point tensor, got ",
              output.defined() ? c10::toString(output.scalar_type()) : "an undefined tensor");
  if (planned.planner == nullptr && !handlers.empty()) {
    // An unnamed call: the first engine whose doors opened in it plans it, recompute or offload.
    planned.planner = handlers.front();
    plan = planned.planner->plan_checkpoint(nullptr, options.offload);
  }
  planned.call = plan.call;
  std::unique_ptr<OffloadedActivation> offloaded;
  if (planned.planner != nullptr) {
    planned.planner->checkpoint_forward_done(plan.call, input, seconds);
    if (plan.choice == ActivationChoice::kOffload && input.is_contiguous()) {
      offloaded = planned.planner->offload_activation(plan.call, input);
    }
  } else if (plan.choice == ActivationChoice::kOffload && input.is_contiguous() &&
             input.is_cuda()) {
    offloaded = std::make_unique<PinnedHostCopy>(input);
  }
  // A fresh handle (fn may return its input or a view), which the checkpoint's node produces.
  output = output.detach();
  std::shared_ptr<CheckpointBackward> node(
      new CheckpointBackward(std::move(fn), active_module_hook_handler(), std::move(handlers),
                             input, std::move(offloaded), std::move(random_states), planned),
      torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(input));
  torch::autograd::set_history(output, node);
  return output;
}

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

const char* activation_choice_name(ActivationChoice choice) {
  switch (choice) {
    case ActivationChoice::kKeep:
      return "keep";
    case ActivationChoice::kRecompute:
      return "recompute";
    case ActivationChoice::kOffload:
      return "offload";
  }
  return "?";
}

at::Tensor checkpoint(CheckpointFunction fn, const at::Tensor& input, CheckpointOptions options) {
  return run_checkpoint(nullptr, std::move(fn), input, options);
}

at::Tensor checkpoint(torch::nn::Module& block, CheckpointFunction fn, const at::Tensor& input,
                      CheckpointOptions options) {
  return run_checkpoint(&block, std::move(fn), input, options);
}

}  // namespace patrickstar
