// The three autograd hook points the engine is built on, since LibTorch's C++ modules have none
// (docs/design.md section 6):
//   - pre-backward: an identity autograd function on a module's outputs whose backward runs a callback
//     just before autograd runs the module's own backward;
//   - gradient is final: a per-parameter post-accumulate-grad hook (it survives set_data, unlike hooks
//     on the grad accumulator);
//   - end of backward: a callback queued on LibTorch's autograd engine, run when backward completes.
// Thread-safety: callbacks run on the thread that runs backward (on CPU: the caller of backward()).
// Ownership: a HookTable owns its callbacks and must outlive every backward pass through its hooks.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

namespace patrickstar {

// Owns pre-backward callbacks, addressed by the id add() returns. Not thread-safe to add() while a
// backward pass is running.
class HookTable {
 public:
  // Stores `callback`; returns its id for with_pre_backward.
  int64_t add(std::function<void()> callback);
  // Runs callback `id`; throws c10::Error when no such callback exists.
  void call(int64_t id) const;
  size_t size() const { return callbacks_.size(); }
  // Pre-backward nodes inserted through this table whose backward has not run and which are still
  // alive (part of a graph someone holds). 0 after a forward whose loss was dropped unused.
  int64_t pending_nodes() const { return pending_->load(std::memory_order_relaxed); }
  const std::shared_ptr<std::atomic<int64_t>>& pending_counter() const { return pending_; }

 private:
  std::vector<std::function<void()>> callbacks_;
  // Shared with the nodes: a graph may outlive the table.
  std::shared_ptr<std::atomic<int64_t>> pending_ = std::make_shared<std::atomic<int64_t>>(0);
};

// Returns `outputs` unchanged in value, passed through an identity autograd function whose backward
// runs table.call(id) once, before the gradients flow on into whatever produced `outputs`. Tensors that
// do not require grad pass through untouched; if none does, nothing is inserted.
std::vector<at::Tensor> with_pre_backward(const std::vector<at::Tensor>& outputs,
                                          const HookTable& table, int64_t id);
at::Tensor with_pre_backward(const at::Tensor& output, const HookTable& table, int64_t id);

// Installs `hook` to run each time autograd has finished accumulating `param`'s gradient in a backward
// pass (once per pass, even for a parameter used several times). Replaces any previous hook of
// `param` (LibTorch keeps one slot per tensor). `param` must be a leaf that requires grad.
void set_post_accumulate_grad_hook(const at::Tensor& param,
                                   std::function<void(const at::Tensor& param)> hook);
void clear_post_accumulate_grad_hook(const at::Tensor& param);

// Queues `callback` to run when the current backward pass has finished. Must be called while autograd
// runs a backward pass (from one of the hooks above); throws c10::Error otherwise.
void queue_end_of_backward(std::function<void()> callback);

}  // namespace patrickstar
