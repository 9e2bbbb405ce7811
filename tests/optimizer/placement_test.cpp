// plan_placement: first fit in chunk order under the device margin, and its report.
#include <gtest/gtest.h>

#include <c10/util/Exception.h>

#include <numeric>
#include <vector>

#include "patrickstar/optimizer/placement.h"

namespace patrickstar {
namespace placement_test {

TEST(Placement, EqualChunksFillAPrefix) {
  const std::vector<int64_t> bytes(10, 100);
  const PlacementPlan plan = plan_placement(bytes, 350);
  ASSERT_EQ(plan.on_device.size(), 10u);
  for (size_t i = 0; i < 10; ++i) EXPECT_EQ(plan.on_device[i], i < 3) << i;
  EXPECT_EQ(plan.report.chunks_device, 3);
  EXPECT_EQ(plan.report.chunks_host, 7);
  EXPECT_EQ(plan.report.bytes_device, 300);
  EXPECT_EQ(plan.report.bytes_host, 700);
}

TEST(Placement, ExactFitAndNoMargin) {
  const std::vector<int64_t> bytes(4, 64);
  EXPECT_EQ(plan_placement(bytes, 256).report.chunks_device, 4);
  EXPECT_EQ(plan_placement(bytes, 255).report.chunks_device, 3);
  const PlacementPlan none = plan_placement(bytes, -5);
  EXPECT_EQ(none.report.chunks_device, 0);
  EXPECT_EQ(none.report.bytes_host, 256);
}

TEST(Placement, SmallerChunkTakesTheRoomLargerOnesLeave) {
  const std::vector<int64_t> bytes = {100, 100, 100, 30};
  const PlacementPlan plan = plan_placement(bytes, 250);
  EXPECT_EQ(plan.on_device, (std::vector<bool>{true, true, false, true}));
  EXPECT_EQ(plan.report.bytes_device, 230);
  EXPECT_EQ(plan.report.bytes_host, 100);
  // Bytes are conserved whatever the margin.
  for (int64_t margin = 0; margin <= 400; margin += 17) {
    const auto r = plan_placement(bytes, margin).report;
    EXPECT_EQ(r.bytes_device + r.bytes_host, 330);
    EXPECT_LE(r.bytes_device, margin);
    EXPECT_EQ(r.chunks_device + r.chunks_host, 4);
  }
}

TEST(Placement, AllOnHostAndBadInput) {
  const std::vector<int64_t> bytes = {10, 0, 20};
  const PlacementPlan plan = all_on_host(bytes);
  EXPECT_EQ(plan.on_device, (std::vector<bool>{false, false, false}));
  EXPECT_EQ(plan.report.chunks_host, 3);
  EXPECT_EQ(plan.report.bytes_host, 30);
  EXPECT_THROW(plan_placement(std::vector<int64_t>{10, -1}, 100), c10::Error);
}

}  // namespace placement_test
}  // namespace patrickstar
