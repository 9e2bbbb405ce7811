// The device the engine's training tests run on: the emulated device, or the CUDA engine when
// PATRICKSTAR_TEST_DEVICE=cuda (ctest's engine.cuda entry sets it; scripts/gpu-check runs it on a
// GPU). Tests that honour the switch derive their fixture from OnTestDevice and take their config
// and batches through these helpers. Without a GPU they are skipped with the reason printed, never
// passed; a misspelt value fails them.
#pragma once

#include <torch/cuda.h>
#include <torch/torch.h>

#include <cstdint>

#include "patrickstar/engine/config.h"
#include "patrickstar/memtracer/memory_probe.h"
#include "test_device_switch.h"

namespace patrickstar::test {

// On CUDA: the device bytes LibTorch keeps allocated once a matmul has run forward and backward
// (the cuBLAS workspaces of the calling thread and of autograd's device thread, several MiB each),
// which the engine's probe counts as non-model memory at every moment. The tests' capacities were
// sized on the emulated device, which has no such thing; on CUDA they get this much more. 0 on the
// emulated device.
inline int64_t cuda_allowance_bytes() {
  if (!on_cuda()) return 0;
  static const int64_t allowance = [] {
    {
      const at::Tensor a = torch::ones({64, 64}, torch::device(torch::kCUDA).requires_grad(true));
      torch::mm(a, a).sum().backward();
    }
    torch::cuda::synchronize();
    return make_cuda_memory_probe(0)->live_bytes();
  }();
  return allowance;
}

// `config` on the test device; on CUDA a capacity it sets grows by cuda_allowance_bytes() ("auto"
// stays "auto": the GPU's own memory).
inline Config& use_test_device(Config& config) {
  if (on_cuda()) {
    config.device.type = DeviceType::kCuda;
    if (config.device.capacity_bytes != DeviceConfig::kAutoCapacity) {
      config.device.capacity_bytes += cuda_allowance_bytes();
    }
  }
  return config;
}

}  // namespace patrickstar::test
