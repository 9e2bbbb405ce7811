// The device the engine's training tests run on: the emulated device, or the CUDA engine when
// PATRICKSTAR_TEST_DEVICE=cuda (ctest's engine.cuda entry sets it; scripts/gpu-check runs it on a
// GPU). Tests that honour the switch derive their fixture from OnTestDevice and take their config
// and batches through these helpers. Without a GPU they are skipped with the reason printed, never
// passed; a misspelt value fails them.
#pragma once

#include <c10/core/Device.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <cstdlib>
#include <string>

#include "patrickstar/engine/config.h"
#include "patrickstar/memtracer/memory_probe.h"

namespace patrickstar::test {

// The switch's value: "" or "emulated" (the default), or "cuda".
inline std::string test_device_name() {
  const char* value = std::getenv("PATRICKSTAR_TEST_DEVICE");
  return value == nullptr ? "" : value;
}

inline bool on_cuda() { return test_device_name() == "cuda"; }

// Why the tests cannot run on device `name` here ("" when they can), and whether that is an error
// (a value the switch does not take) rather than a reason to skip.
struct TestDeviceProblem {
  std::string why;
  bool error = false;
};
inline TestDeviceProblem test_device_problem(const std::string& name, bool gpu_present) {
  if (name.empty() || name == "emulated") return {};
  if (name != "cuda") {
    return {"PATRICKSTAR_TEST_DEVICE is \"" + name + "\"; it takes \"emulated\" (the default) or "
            "\"cuda\"", true};
  }
#ifndef PATRICKSTAR_HAVE_CUDA
  (void)gpu_present;
  return {"PATRICKSTAR_TEST_DEVICE=cuda, but this build has no CUDA support: the test did not run",
          false};
#else
  if (!gpu_present) {
    return {"PATRICKSTAR_TEST_DEVICE=cuda, but LibTorch sees no CUDA device on this machine: the "
            "test did not run", false};
  }
  return {};
#endif
}

// Where the trainer puts its inputs (the engine computes there).
inline c10::Device test_device() {
  return on_cuda() ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
}

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

// `config` on the test device; on CUDA its capacity grows by cuda_allowance_bytes().
inline Config& use_test_device(Config& config) {
  if (on_cuda()) {
    config.device.type = DeviceType::kCuda;
    config.device.capacity_bytes += cuda_allowance_bytes();
  }
  return config;
}

// The fixture of the tests that honour the switch.
class OnTestDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    const TestDeviceProblem problem =
        test_device_problem(test_device_name(), torch::cuda::is_available());
    if (problem.error) GTEST_FAIL() << problem.why;
    if (!problem.why.empty()) GTEST_SKIP() << problem.why;
  }
};

}  // namespace patrickstar::test
