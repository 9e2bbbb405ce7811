// The checked C++ entry points of the CUDA kernels (adam_cuda.h); without CUDA they throw.
#include <c10/util/Exception.h>

#include "patrickstar/optimizer/adam_cuda.h"

#if defined(PATRICKSTAR_OPTIMIZER_CUDA)
#include "adam_cuda_launch.h"
#endif

namespace patrickstar {

#if defined(PATRICKSTAR_OPTIMIZER_CUDA)

bool cuda_adam_compiled() {
  return true;
}

namespace {
void check_launch(int error, const char* what, int64_t numel) {
  TORCH_CHECK(error == 0, what, " on ", numel,
              " elements failed to launch: ", cuda_detail::error_string(error));
}
}  // namespace

void cuda_adam_mixed(uint16_t* half_param_grad, HalfFormat format, float* master, float* exp_avg,
                     float* exp_avg_sq, int64_t numel, const AdamStepConstants& constants,
                     void* stream) {
  check_launch(cuda_detail::launch_adam_mixed(half_param_grad, format == HalfFormat::kBFloat16,
                                              master, exp_avg, exp_avg_sq, /*bf16_states=*/false,
                                              numel, constants, stream),
               "cuda_adam_mixed", numel);
}

void cuda_adam_fp32(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                    int64_t numel, const AdamStepConstants& constants, void* stream) {
  check_launch(cuda_detail::launch_adam_fp32(param, grad, exp_avg, exp_avg_sq,
                                             /*bf16_states=*/false, numel, constants, stream),
               "cuda_adam_fp32", numel);
}

void cuda_adam_mixed(uint16_t* half_param_grad, HalfFormat format, float* master, uint16_t* exp_avg,
                     uint16_t* exp_avg_sq, int64_t numel, const AdamStepConstants& constants,
                     void* stream) {
  check_launch(cuda_detail::launch_adam_mixed(half_param_grad, format == HalfFormat::kBFloat16,
                                              master, exp_avg, exp_avg_sq, /*bf16_states=*/true,
                                              numel, constants, stream),
               "cuda_adam_mixed (bf16 states)", numel);
}

void cuda_adam_fp32(float* param, const float* grad, uint16_t* exp_avg, uint16_t* exp_avg_sq,
                    int64_t numel, const AdamStepConstants& constants, void* stream) {
  check_launch(cuda_detail::launch_adam_fp32(param, grad, exp_avg, exp_avg_sq,
                                             /*bf16_states=*/true, numel, constants, stream),
               "cuda_adam_fp32 (bf16 states)", numel);
}

void cuda_restore_half_from_master(uint16_t* half_param, HalfFormat format, const float* master,
                                   int64_t numel, void* stream) {
  check_launch(cuda_detail::launch_half_from_master(half_param, format == HalfFormat::kBFloat16,
                                                    master, numel, stream),
               "cuda_restore_half_from_master", numel);
}

void cuda_adam_batch(const AdamBatch& batch, const AdamBatchEntry* device_entries,
                     const AdamStepConstants* device_constants, void* stream) {
  check_launch(cuda_detail::launch_adam_batch(
                   device_entries, static_cast<int32_t>(batch.entries().size()), batch.tiles(),
                   device_constants, batch.kind(), batch.bf16_states(), batch.bf16_half(), stream),
               "cuda_adam_batch", batch.elements());
}

void cuda_sum_squares_batch(const AdamBatch& batch, const AdamBatchEntry* device_entries,
                            double* partials, double* out, void* stream) {
  check_launch(cuda_detail::launch_sum_squares_batch(
                   device_entries, static_cast<int32_t>(batch.entries().size()), batch.tiles(),
                   batch.kind(), batch.bf16_half(), partials, out, stream),
               "cuda_sum_squares_batch", batch.elements());
}

#else  // no CUDA in this build

bool cuda_adam_compiled() {
  return false;
}

void cuda_adam_mixed(uint16_t*, HalfFormat, float*, float*, float*, int64_t numel,
                     const AdamStepConstants&, void*) {
  TORCH_CHECK(false, "cuda_adam_mixed(", numel,
              " elements): this build has no CUDA kernels; "
              "configure with PATRICKSTAR_CUDA=ON on a machine with the CUDA toolkit");
}

void cuda_adam_fp32(float*, const float*, float*, float*, int64_t numel, const AdamStepConstants&,
                    void*) {
  TORCH_CHECK(false, "cuda_adam_fp32(", numel,
              " elements): this build has no CUDA kernels; "
              "configure with PATRICKSTAR_CUDA=ON on a machine with the CUDA toolkit");
}

void cuda_adam_mixed(uint16_t*, HalfFormat, float*, uint16_t*, uint16_t*, int64_t numel,
                     const AdamStepConstants&, void*) {
  TORCH_CHECK(false, "cuda_adam_mixed(", numel,
              " elements, bf16 states): this build has no CUDA kernels; "
              "configure with PATRICKSTAR_CUDA=ON on a machine with the CUDA toolkit");
}

void cuda_adam_fp32(float*, const float*, uint16_t*, uint16_t*, int64_t numel,
                    const AdamStepConstants&, void*) {
  TORCH_CHECK(false, "cuda_adam_fp32(", numel,
              " elements, bf16 states): this build has no CUDA kernels; "
              "configure with PATRICKSTAR_CUDA=ON on a machine with the CUDA toolkit");
}

void cuda_restore_half_from_master(uint16_t*, HalfFormat, const float*, int64_t numel, void*) {
  TORCH_CHECK(false, "cuda_restore_half_from_master(", numel,
              " elements): this build has no CUDA "
              "kernels; configure with PATRICKSTAR_CUDA=ON on a machine with the CUDA toolkit");
}

void cuda_adam_batch(const AdamBatch& batch, const AdamBatchEntry*, const AdamStepConstants*,
                     void*) {
  TORCH_CHECK(false, "cuda_adam_batch(", batch.elements(),
              " elements): this build has no CUDA kernels; "
              "configure with PATRICKSTAR_CUDA=ON on a machine with the CUDA toolkit");
}

void cuda_sum_squares_batch(const AdamBatch& batch, const AdamBatchEntry*, double*, double*,
                            void*) {
  TORCH_CHECK(false, "cuda_sum_squares_batch(", batch.elements(),
              " elements): this build has no CUDA kernels; "
              "configure with PATRICKSTAR_CUDA=ON on a machine with the CUDA toolkit");
}

#endif

}  // namespace patrickstar
