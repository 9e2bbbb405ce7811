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
// Thread-safety: checkpoint() may run on several threads at once (its state is per call and per
// thread); the engine itself is driven by one thread.
#pragma once

#include <functional>

#include <ATen/core/Tensor.h>

namespace patrickstar {

using CheckpointFunction = std::function<at::Tensor(const at::Tensor&)>;

struct CheckpointOptions {
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
