// Private: the plain-C++ face of adam_cuda.cu, so nvcc never sees LibTorch headers. Each launcher
// returns the cudaError_t of the launch as an int (0 = success).
#pragma once

#include <cstdint>

#include "patrickstar/optimizer/adam_batch.h"
#include "patrickstar/optimizer/adam_rule.h"

namespace patrickstar::cuda_detail {

int launch_half_from_master(uint16_t* half_param, bool bf16, const float* master, int64_t numel,
                            void* stream);
// The batched kernels of adam_batch.h, one launch each. entries and constants: device copies of
// the batch's tables; partials: `tiles` doubles of device scratch; out: one device double.
int launch_adam_batch(const AdamBatchEntry* entries, int32_t count, int64_t tiles,
                      const AdamStepConstants* constants, AdamBatchKind kind, bool bf16_states,
                      bool bf16_half, void* stream);
int launch_sum_squares_batch(const AdamBatchEntry* entries, int32_t count, int64_t tiles,
                             AdamBatchKind kind, bool bf16_half, double* partials, double* out,
                             void* stream);
const char* error_string(int error);

}  // namespace patrickstar::cuda_detail
