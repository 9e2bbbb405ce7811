// A chunk's Adam update computed ahead of the step, before the step's global decisions (gradient
// clipping's norm, an fp16 overflow) are known, and kept undoable until they are: the overlapped
// step (docs/design.md, "The overlapped step") runs these on an optimizer thread while backward
// goes on, and HybridAdam::step() commits each one whose constants turn out to be the step's own
// or undoes it and updates the chunk itself.
//
// The update runs in place on the chunk's fp32 master, momentum and variance, after copying their
// old values into the undo log. The half weight of mixed precision goes to a buffer of its own and
// reaches the chunk's half slot only at commit: until the step the slot is what the trainer may
// read (a gradient, or the weight a door shows). The result is bit for bit the update that
// HybridAdam::step() would compute with the same constants: the same kernels, element-wise, on the
// same values (the thread split does not change an element's arithmetic).
//
// Memory: 12 bytes per element (fp32 master or parameter, momentum, variance) plus 2 in mixed
// precision, for as long as the update is undoable.
//
// Thread-safety: speculate() may run on another thread than the one that built `chunk`, provided
// nothing else reads or writes the chunk's memory meanwhile; commit() and undo() run on the step's
// thread after speculate() returned.
//
// Usage (the engine):
//   SpeculativeUpdate u(buffers);                          // on the training thread
//   speculate(chunk, adam.constants_without_clipping(step), u);   // on the optimizer thread
//   chunk.speculative = &u;  adam.step(chunks, plan);      // commits it, or undoes and recomputes
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "patrickstar/optimizer/adam_rule.h"

namespace patrickstar {

struct AdamChunk;

struct SpeculativeUpdate {
  enum class State : uint8_t { kPending, kApplied, kCommitted, kUndone };
  State state = State::kPending;
  AdamStepConstants constants;  // what the update was computed with
  // The undo log: the values from before the update (fp32, the chunk's numel each).
  at::Tensor old_master, old_exp_avg, old_exp_avg_sq;
  // Mixed precision: the new half weight, written into the chunk's half slot at commit.
  at::Tensor new_half;
  // gradient_fingerprint() of the gradient the update read: a trainer that may have written the
  // gradients since (through grad() views, where in-place edits on .data() leave no version) is
  // checked against it before the update is committed.
  uint64_t grad_fingerprint = 0;
  double seconds = 0;  // how long speculate() took
};

// A 64-bit fingerprint of a contiguous CPU tensor's bytes: the sum mod 2^64 of a bijective mix
// (splitmix64's finalizer) of each 8-byte word (the tail zero-padded) plus a multiple of its
// position. Any change of a single word changes it; the mix is far from linear, so structured
// edits (every element scaled by a power of two, signs flipped in pairs) do not cancel out.
uint64_t gradient_fingerprint(const at::Tensor& t);

// Exact float equality, field by field in their bits (what decides that a speculative update is
// the step's own).
bool same_constants(const AdamStepConstants& a, const AdamStepConstants& b);

// Bytes of buffers speculate() needs for `chunk`.
int64_t speculative_bytes(const AdamChunk& chunk);

// Copies the old values into the undo log (buffers in `update` of the right size and dtype are
// reused), then updates the chunk in place with `constants`. kPending -> kApplied. The chunk must
// be in host memory with its states (not states_from_source). Also sets update.grad_fingerprint.
void speculate(const AdamChunk& chunk, const AdamStepConstants& constants,
               SpeculativeUpdate& update);
// kApplied -> kCommitted: the half slot takes the new half weight (mixed precision).
void commit(const AdamChunk& chunk, SpeculativeUpdate& update);
// kApplied -> kUndone: master, momentum and variance get their old values back; the half slot was
// never written. `chunk` may have moved since speculate() (same values, other memory).
void undo(const AdamChunk& chunk, SpeculativeUpdate& update);

}  // namespace patrickstar
