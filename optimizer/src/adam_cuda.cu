// CUDA Adam: a grid-stride kernel calling the shared rule (adam_rule.h) per element. Compiled with
// --fmad=false so nvcc contracts nothing beyond the rule's explicit fmaf, keeping device results
// equal to the host kernel's. Never run on the project's CI machines (no GPU); see adam_cuda.h.
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

// S: the stored state type, float or uint16_t (bf16 bits); see adam_update_stored().
template <typename S>
__global__ void adam_mixed_kernel(uint16_t* half_param_grad, bool bf16, float* master, S* exp_avg,
                                  S* exp_avg_sq, int64_t numel, AdamStepConstants constants) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += stride) {
    const uint16_t raw = half_param_grad[i];
    const float grad = bf16 ? bf16_to_float(raw) : fp16_to_float(raw);
    float p = master[i];
    S m = exp_avg[i];
    S v = exp_avg_sq[i];
    adam_update_stored(p, m, v, grad, constants);
    master[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    half_param_grad[i] = bf16 ? float_to_bf16(p) : float_to_fp16(p);
  }
}

template <typename S>
__global__ void adam_fp32_kernel(float* param, const float* grad, S* exp_avg, S* exp_avg_sq,
                                 int64_t numel, AdamStepConstants constants) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += stride) {
    float p = param[i];
    S m = exp_avg[i];
    S v = exp_avg_sq[i];
    adam_update_stored(p, m, v, grad[i], constants);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
  }
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

int launch_adam_mixed(uint16_t* half_param_grad, bool bf16, float* master, void* exp_avg,
                      void* exp_avg_sq, bool bf16_states, int64_t numel,
                      const AdamStepConstants& constants, void* stream) {
  if (numel <= 0) return 0;
  const auto s = static_cast<cudaStream_t>(stream);
  if (bf16_states) {
    adam_mixed_kernel<<<grid_for(numel), kThreadsPerBlock, 0, s>>>(
        half_param_grad, bf16, master, static_cast<uint16_t*>(exp_avg),
        static_cast<uint16_t*>(exp_avg_sq), numel, constants);
  } else {
    adam_mixed_kernel<<<grid_for(numel), kThreadsPerBlock, 0, s>>>(
        half_param_grad, bf16, master, static_cast<float*>(exp_avg),
        static_cast<float*>(exp_avg_sq), numel, constants);
  }
  return static_cast<int>(cudaGetLastError());
}

int launch_adam_fp32(float* param, const float* grad, void* exp_avg, void* exp_avg_sq,
                     bool bf16_states, int64_t numel, const AdamStepConstants& constants,
                     void* stream) {
  if (numel <= 0) return 0;
  const auto s = static_cast<cudaStream_t>(stream);
  if (bf16_states) {
    adam_fp32_kernel<<<grid_for(numel), kThreadsPerBlock, 0, s>>>(
        param, grad, static_cast<uint16_t*>(exp_avg), static_cast<uint16_t*>(exp_avg_sq), numel,
        constants);
  } else {
    adam_fp32_kernel<<<grid_for(numel), kThreadsPerBlock, 0, s>>>(
        param, grad, static_cast<float*>(exp_avg), static_cast<float*>(exp_avg_sq), numel,
        constants);
  }
  return static_cast<int>(cudaGetLastError());
}

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
