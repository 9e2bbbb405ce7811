// The device the engine's training tests run on: the emulated device, or the CUDA engine when
// PATRICKSTAR_TEST_DEVICE=cuda (ctest's engine.cuda entry sets it; scripts/gpu-check runs it on a
// GPU). Tests that honour the switch derive their fixture from OnTestDevice and take their config
// and batches through these helpers. Without a GPU they are skipped with the reason printed, never
// passed; a misspelt value fails them.
#pragma once

#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "patrickstar/engine/config.h"
#include "patrickstar/memtracer/memory_probe.h"
#include "test_device_switch.h"

namespace patrickstar::test {

// On CUDA: the device bytes LibTorch keeps allocated for itself once matmuls have run forward and
// backward (cuBLAS's and cublasLt's workspaces of the calling thread and of autograd's device thread,
// forward and backward, several MiB each: 64 MiB on an H200 with LibTorch 2.11), plus what earlier tests of the process
// left there. The engine's probe counts all of it as non-model memory at every moment; the tests'
// capacities were sized on the emulated device, which has no such thing. Read now, after running the
// matmuls the engine's models run (Linear with its bias, so the cublasLt path too, in every compute
// dtype), not once per process: a workspace created by an earlier test stays. 0 on the emulated device.
inline int64_t cuda_allowance_bytes() {
  if (!on_cuda()) return 0;
  static const bool warmed = [] {
    for (const auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      const auto options = torch::device(torch::kCUDA).dtype(dtype);
      const at::Tensor x = torch::ones({64, 64}, options.requires_grad(true));
      const at::Tensor w = torch::ones({64, 64}, options.requires_grad(true));
      const at::Tensor b = torch::ones({64}, options.requires_grad(true));
      at::Tensor h = torch::nn::functional::linear(torch::mm(x, w), w, b);
      // A forward inside the backward, on autograd's device thread (activation checkpointing's
      // recompute): that thread's handles get their workspaces too.
      h.register_hook([w, b](const at::Tensor& grad) {
        torch::NoGradGuard no_grad;
        (void)torch::nn::functional::linear(grad, w, b);
        return grad;
      });
      h.sum().backward();
    }
    torch::cuda::synchronize();
    return true;
  }();
  (void)warmed;
  return make_cuda_memory_probe(0)->live_bytes();
}

// On CUDA, the caching allocator rounds every block up to a multiple of 512 bytes and CUDA's kernels
// keep other temporaries than the CPU's: the same activations take 2 to 5% more device bytes than on
// the emulated device (GPT tiny: 30 to 62 KB more on 1.2 to 1.3 MB, measured on an H200; a
// two-Linear MLP: about 1 KB). A capacity sized on the emulated device gets a sixteenth more, at
// least 2 KiB: enough for that, not so much that a device sized to force moves stops forcing them.
inline int64_t cuda_rounding_room(int64_t capacity_bytes) {
  return std::max<int64_t>(capacity_bytes / 16, int64_t{2} << 10);
}

// `config` on the test device; on CUDA a capacity it sets grows so that the usable bytes (capacity
// x client.mem_tracer.overall_gpu_mem_ratio) grow by cuda_allowance_bytes() and
// cuda_rounding_room() ("auto" stays "auto": the GPU's own memory). Call it last, after the
// capacity and the ratio are set.
//
// Data parallel suites: PATRICKSTAR_TEST_SHARD_GROUP=k runs them with hybrid sharding
// (zero_optimization.shard_group_size k; ctest's distributed.mpi_4_ranks_hybrid sets it).
inline Config& use_test_device(Config& config) {
  if (const char* k = std::getenv("PATRICKSTAR_TEST_SHARD_GROUP"); k != nullptr && *k != '\0') {
    config.shard_group_size = std::atoi(k);
  }
  if (on_cuda()) {
    config.device.type = DeviceType::kCuda;
    // Every rank of a data parallel test on GPU 0: two ranks share it (through the store backend;
    // NCCL takes one GPU per rank).
    config.device.index = 0;
    const int64_t capacity = config.device.capacity_bytes;
    if (capacity != DeviceConfig::kAutoCapacity) {
      const double room =
          static_cast<double>(cuda_allowance_bytes() + cuda_rounding_room(capacity));
      config.device.capacity_bytes =
          capacity + static_cast<int64_t>(
                         std::ceil(room / config.mem_tracer.overall_gpu_mem_ratio));
    }
  }
  return config;
}

}  // namespace patrickstar::test
