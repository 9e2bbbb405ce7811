// The device Adam: a CUDA kernel that calls adam_update() (adam_rule.h) per element, one thread per
// element in a grid-stride loop, on the same chunk layout as the host kernel (half param/grad slot
// rewritten with the new half weight in the same pass). Compiled by nvcc when the build has CUDA;
// it cannot run on the machines this project is tested on (no GPU), so only compilation is checked.
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
void cuda_adam_mixed(uint16_t* half_param_grad, HalfFormat format, float* master, float* exp_avg,
                     float* exp_avg_sq, int64_t numel, const AdamStepConstants& constants,
                     void* stream);
void cuda_adam_fp32(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                    int64_t numel, const AdamStepConstants& constants, void* stream);
// Momentum and variance stored in bf16 (raw bits), as the host kernels of the same signature.
void cuda_adam_mixed(uint16_t* half_param_grad, HalfFormat format, float* master, uint16_t* exp_avg,
                     uint16_t* exp_avg_sq, int64_t numel, const AdamStepConstants& constants,
                     void* stream);
void cuda_adam_fp32(float* param, const float* grad, uint16_t* exp_avg, uint16_t* exp_avg_sq,
                    int64_t numel, const AdamStepConstants& constants, void* stream);
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
