// The half weights rounded from the fp32 masters, on the device (a skipped step puts them back): a
// grid-stride kernel with adam_rule.h's rounding. The update and the norm are adam_batch.cu's.
// Compiled with --fmad=false like them. Never run on the project's CI machines (no GPU).
#include <cuda_runtime.h>

#include <algorithm>

#include "adam_cuda_launch.h"

namespace patrickstar::cuda_detail {
namespace {

constexpr int kThreadsPerBlock = 256;

dim3 grid_for(int64_t numel) {
  // Enough blocks to fill any current GPU several times over; the loop covers the rest.
  const int64_t blocks =
      std::min<int64_t>((numel + kThreadsPerBlock - 1) / kThreadsPerBlock, 65535);
  return dim3(static_cast<unsigned>(std::max<int64_t>(blocks, 1)));
}

__global__ void half_from_master_kernel(uint16_t* half_param, bool bf16, const float* master,
                                        int64_t numel) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += stride) {
    half_param[i] = bf16 ? float_to_bf16(master[i]) : float_to_fp16(master[i]);
  }
}

}  // namespace

int launch_half_from_master(uint16_t* half_param, bool bf16, const float* master, int64_t numel,
                            void* stream) {
  if (numel <= 0) return 0;
  half_from_master_kernel<<<grid_for(numel), kThreadsPerBlock, 0,
                            static_cast<cudaStream_t>(stream)>>>(half_param, bf16, master, numel);
  return static_cast<int>(cudaGetLastError());
}

const char* error_string(int error) {
  return cudaGetErrorString(static_cast<cudaError_t>(error));
}

}  // namespace patrickstar::cuda_detail
