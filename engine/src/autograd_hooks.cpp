#include "patrickstar/engine/autograd_hooks.h"

#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

namespace patrickstar {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Counts a node as pending from its creation until its backward runs or it is freed unused.
struct PendingNode final : torch::CustomClassHolder {
  explicit PendingNode(std::shared_ptr<std::atomic<int64_t>> counter) : counter_(std::move(counter)) {
    counter_->fetch_add(1, std::memory_order_relaxed);
  }
  ~PendingNode() override { settle(); }
  PendingNode(const PendingNode&) = delete;
  PendingNode& operator=(const PendingNode&) = delete;
  void settle() {
    if (!settled_) counter_->fetch_sub(1, std::memory_order_relaxed);
    settled_ = true;
  }

 private:
  std::shared_ptr<std::atomic<int64_t>> counter_;
  bool settled_ = false;
};

// Identity forward; backward calls the table entry first, then passes gradients through unchanged.
struct PreBackwardFunction : torch::autograd::Function<PreBackwardFunction> {
  // `inputs` is a TensorList, the one list type autograd unpacks into separate inputs.
  static variable_list forward(AutogradContext* ctx, at::TensorList inputs, int64_t table_address,
                               int64_t id) {
    const auto* table = reinterpret_cast<const HookTable*>(table_address);
    ctx->saved_data["table"] = table_address;
    ctx->saved_data["id"] = id;
    ctx->saved_data["pending"] =
        c10::IValue::make_capsule(c10::make_intrusive<PendingNode>(table->pending_counter()));
    return variable_list(inputs.begin(), inputs.end());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto* table = reinterpret_cast<const HookTable*>(ctx->saved_data["table"].toInt());
    static_cast<PendingNode*>(ctx->saved_data["pending"].toCapsule().get())->settle();
    table->call(ctx->saved_data["id"].toInt());
    grad_outputs.emplace_back();  // no gradient for table_address
    grad_outputs.emplace_back();  // nor for id
    return grad_outputs;
  }
};

struct FunctionPostAccumulateGradHook : torch::autograd::PostAccumulateGradHook {
  explicit FunctionPostAccumulateGradHook(std::function<void(const at::Tensor&)> fn)
      : fn_(std::move(fn)) {}
  void operator()(const torch::autograd::Variable& tensor) override { fn_(tensor); }
  std::function<void(const at::Tensor&)> fn_;
};

}  // namespace

int64_t HookTable::add(std::function<void()> callback) {
  TORCH_CHECK(callback, "HookTable::add: empty callback");
  callbacks_.push_back(std::move(callback));
  return static_cast<int64_t>(callbacks_.size()) - 1;
}

void HookTable::call(int64_t id) const {
  TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(callbacks_.size()), "HookTable: no callback ",
              id, " (table holds ", callbacks_.size(), ")");
  callbacks_[static_cast<size_t>(id)]();
}

std::vector<at::Tensor> with_pre_backward(const std::vector<at::Tensor>& outputs,
                                          const HookTable& table, int64_t id) {
  // Only tensors that require grad go through the function: the others have no backward to precede.
  variable_list tracked;
  std::vector<size_t> positions;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i].defined() && outputs[i].requires_grad()) {
      tracked.push_back(outputs[i]);
      positions.push_back(i);
    }
  }
  if (tracked.empty()) return outputs;
  variable_list wrapped =
      PreBackwardFunction::apply(at::TensorList(tracked), reinterpret_cast<int64_t>(&table), id);
  std::vector<at::Tensor> result = outputs;
  for (size_t k = 0; k < positions.size(); ++k) result[positions[k]] = wrapped[k];
  return result;
}

at::Tensor with_pre_backward(const at::Tensor& output, const HookTable& table, int64_t id) {
  return with_pre_backward(std::vector<at::Tensor>{output}, table, id)[0];
}

void set_post_accumulate_grad_hook(const at::Tensor& param,
                                   std::function<void(const at::Tensor& param)> hook) {
  TORCH_CHECK(param.is_leaf() && param.requires_grad(),
              "set_post_accumulate_grad_hook: the tensor must be a leaf that requires grad");
  torch::autograd::impl::set_post_acc_grad_hooks(
      param, std::make_unique<FunctionPostAccumulateGradHook>(std::move(hook)));
}

void clear_post_accumulate_grad_hook(const at::Tensor& param) {
  torch::autograd::impl::set_post_acc_grad_hooks(param, nullptr);
}

void queue_end_of_backward(std::function<void()> callback) {
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(callback));
}

}  // namespace patrickstar
