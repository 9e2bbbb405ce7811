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
