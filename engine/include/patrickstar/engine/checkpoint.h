// Activation checkpointing: run part of a forward without keeping its activations, and run it again
// during backward to get them back. Memory for compute: only the part's input is kept.
//
//   x = patrickstar::checkpoint([&](const at::Tensor& h) { return block->forward(h); }, x);
//
// Works with plain LibTorch and under an Engine. Under an engine, the dropped forward still goes
// through the doors as a training forward (its chunks are made resident, its moments recorded), and
// the recompute in backward goes through them again, so the trace is the same every iteration.
// Random state is replayed (CheckpointOptions::preserve_rng_state, on by default, as PyTorch's
// torch.utils.checkpoint): the recompute draws the same dropout masks as the forward did, from the
// CPU default generator and, when `input` is on a CUDA device, that device's default generator;
// after the recompute the generators continue where they were, so the program's random sequence
// is the same as without checkpointing. `fn` must otherwise compute the same result when run twice
// (a generator of its own, or another device's, is not replayed).
// Offloading: with {.offload = true}, or an engine's "activation_checkpointing": {"policy":
// "offload"}, the saved input leaves the device after the forward (under an engine, into its host
// tier through its copy queue; without one, a CUDA input goes to pinned host memory) and comes back
// before the recompute (under an engine, prefetched while the block after it in backward runs). The
// values are copied, not changed: gradients are bit for bit those of the plain recompute. Only a
// contiguous input is offloaded (others stay where they are).
// Keeping: checkpoint(block, fn, x) names the module `fn` runs; an engine that registered it may
// then also keep the block's activations (policy "none", or "auto"'s choice: fn runs once, with
// gradients, as without checkpointing).
// Thread-safety: checkpoint() may run on several threads at once (its state is per call and per
// thread); the engine itself is driven by one thread.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>

#include <ATen/core/Tensor.h>

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace patrickstar {

using CheckpointFunction = std::function<at::Tensor(const at::Tensor&)>;

// How a checkpointed call runs: its activations kept (as without checkpointing), recomputed in
// backward from its saved input, or recomputed with that input offloaded to the host meanwhile.
enum class ActivationChoice : uint8_t { kKeep, kRecompute, kOffload };
const char* activation_choice_name(ActivationChoice choice);  // "keep", "recompute", "offload"

struct CheckpointOptions {
  // true: offload the saved input; false: keep it on the device (plain recompute). Unset: as the
  // engine's "activation_checkpointing" policy says (recompute without an engine or a policy).
  std::optional<bool> offload = std::nullopt;
  // Keep the default generators' states at the forward and replay them for the recompute (then put
  // back the states the program had reached). Off: the recompute draws new numbers, which changes
  // the result of any block that draws (dropout); it saves one state copy per call for blocks that
  // draw nothing. The CPU generator's state is about 5 KB.
  bool preserve_rng_state = true;
};

// Returns fn(input). When grad mode is on and `input` requires grad, fn runs without gradients and
// its activations are dropped; in backward, fn runs again with gradients on a detached copy of
// `input` and the incoming gradient goes through that recomputed graph: parameters used by fn
// receive their gradients as usual (accumulated into .grad, or into chunks under an engine).
// Otherwise (evaluation, or an input that needs no gradient) it is simply fn(input).
// The autograd graph owns a copy of `fn` until backward has run (or the graph is freed): what fn
// refers to (modules, tensors) must live that long, and so must the engines whose doors fn opened
// and the module hook handler active now. Modifying `input` in place before backward is an error
// then. The recompute runs with the random state the forward started from (`options`).
//
//   x = patrickstar::checkpoint(block_fn, x, {.preserve_rng_state = false});  // draws nothing
at::Tensor checkpoint(CheckpointFunction fn, const at::Tensor& input, CheckpointOptions options = {});
// The same, naming the module `fn` runs (a transformer block): the engine that registered it plans
// the call, and may keep its activations (see above). The module must outlive the backward.
//
//   x = patrickstar::checkpoint(*block, [&](const at::Tensor& h) { return block->forward(h); }, x);
at::Tensor checkpoint(torch::nn::Module& block, CheckpointFunction fn, const at::Tensor& input,
                      CheckpointOptions options = {});

// A checkpoint's saved input while it is away from the device (an engine's host copy).
// ModuleHookHandler::offload_activation makes one; checkpoint's backward takes it back once.
class OffloadedActivation {
 public:
  virtual ~OffloadedActivation() = default;
  // The input on its device with its values (waits for the copy back); called once.
  virtual at::Tensor take() = 0;
};

// True on this thread while checkpoint() runs the forward whose activations it drops. Grad mode is
// off then, yet the forward belongs to a training step: a ModuleHookHandler (the engine) treats its
// doors as training moments, not as evaluation.
bool in_checkpointed_forward();
// Inside a checkpointed forward: a number that differs for every outermost checkpoint call on this
// thread (never 0); outside, 0.
int64_t checkpointed_forward_serial();
// True on this thread while a checkpoint's backward runs its recompute (a forward inside backward).
bool in_checkpoint_recompute();

}  // namespace patrickstar
