// The device Adam: CUDA kernels on the same chunk layout as the host kernel, the per-element rule
// of adam_rule.h. The update and the gradient norm are batched over every chunk on the device
// (adam_batch.h: one launch per step); the half weights' restore after a skipped step is one
// launch per chunk. Compiled by nvcc when the build has CUDA; they cannot run on the machines
// this project is tested on (no GPU), so only compilation is checked there (and the host
// reference of adam_batch.h runs the batched kernels' tiles and order on the CPU).
//
// Why our own kernel and not ATen's _fused_adamw_: the fused op wants the parameter, gradient and
// states in one dtype, so mixed precision would need a half->fp32 gradient copy and an fp32->half
// weight copy around it (about 3x the traffic of one fused pass), and it has no L2 mode that
// matches torch::optim::Adam's order. The per-element rule is memory-bound either way.
// Thread-safety: launches are asynchronous on the given stream; the caller orders them.
#pragma once

#include <cstdint>

#include "patrickstar/optimizer/adam_batch.h"
#include "patrickstar/optimizer/adam_rule.h"
#include "patrickstar/optimizer/cpu_adam.h"

namespace patrickstar {

// Whether this build compiled the CUDA kernels.
bool cuda_adam_compiled();

// Launch on `stream` (a cudaStream_t; nullptr = the legacy default stream). Device pointers.
// Throw c10::Error if the launch fails or the build has no CUDA.
// The half weights rounded from the fp32 masters (a skipped step puts them back).
void cuda_restore_half_from_master(uint16_t* half_param, HalfFormat format, const float* master,
                                   int64_t numel, void* stream);

// The batched kernels (adam_batch.h), one launch for every entry of `batch`. device_entries and
// device_constants: device copies of batch.entries() and batch.constants(), ordered before the
// launch on `stream`. cuda_sum_squares_batch writes the squared norm of every entry's gradient to
// *out (a device double) and uses `partials` (batch.tiles() device doubles) as scratch.
void cuda_adam_batch(const AdamBatch& batch, const AdamBatchEntry* device_entries,
                     const AdamStepConstants* device_constants, void* stream);
void cuda_sum_squares_batch(const AdamBatch& batch, const AdamBatchEntry* device_entries,
                            double* partials, double* out, void* stream);

}  // namespace patrickstar
