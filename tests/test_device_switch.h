// The PATRICKSTAR_TEST_DEVICE switch without the engine: which device a test runs on (the emulated
// device, or CUDA when PATRICKSTAR_TEST_DEVICE=cuda), and the fixture that skips a test with the
// reason printed where that device cannot run (a misspelt value fails it). Tests of the chunk and
// memtracer libraries include this; engine tests include test_device.h, which adds the config.
#pragma once

#include <c10/core/Device.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <cstdlib>
#include <string>

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
