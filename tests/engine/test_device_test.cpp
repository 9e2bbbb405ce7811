// The PATRICKSTAR_TEST_DEVICE switch (tests/test_device.h): which values it takes, what it does
// where the CUDA engine cannot run, and what it does to a config.
#include <gtest/gtest.h>

#include <string>

#include "test_device.h"

namespace patrickstar::test {
namespace test_device_test {

TEST(TestDeviceSwitch, TakesEmulatedAndCudaAndRefusesTheRest) {
  EXPECT_TRUE(test_device_problem("", false).why.empty());
  EXPECT_TRUE(test_device_problem("emulated", false).why.empty());
  const TestDeviceProblem misspelt = test_device_problem("cdua", true);
  EXPECT_TRUE(misspelt.error);
  EXPECT_NE(misspelt.why.find("\"cdua\"; it takes"), std::string::npos) << misspelt.why;
  // Without a GPU: skipped, with the reason (never passed, never an error).
  const TestDeviceProblem no_gpu = test_device_problem("cuda", false);
  EXPECT_FALSE(no_gpu.error);
  EXPECT_NE(no_gpu.why.find("the test did not run"), std::string::npos) << no_gpu.why;
#ifdef PATRICKSTAR_HAVE_CUDA
  EXPECT_TRUE(test_device_problem("cuda", true).why.empty());
#endif
}

class TestDevice : public OnTestDevice {};

TEST_F(TestDevice, TheSwitchPicksTheDeviceAndTheConfig) {
  Config config;
  use_test_device(config);
  if (on_cuda()) {
    EXPECT_EQ(config.device.type, DeviceType::kCuda);
    EXPECT_TRUE(test_device().is_cuda());
  } else {
    EXPECT_EQ(config.device.type, DeviceType::kEmulated);
    EXPECT_TRUE(test_device().is_cpu());
  }
}

}  // namespace test_device_test
}  // namespace patrickstar::test
