// OverlapTrial ("overlap_step": "auto"): the ways alternate, overlapped first, until each has three
// counted iterations; the lower median stays; iterations not counted change nothing.
#include <gtest/gtest.h>

#include <string>

#include "overlap_trial.h"

namespace patrickstar::engine_detail {
namespace overlap_trial_test {

// Runs iterations of `overlapped` seconds when the trial overlaps and `serial` seconds otherwise
// until it decides; returns the decision's line.
std::string run_until_decided(OverlapTrial& trial, double overlapped, double serial) {
  for (int i = 0; i < 100; ++i) {
    const std::string line = trial.end_iteration(true, trial.overlap_now() ? overlapped : serial);
    if (!line.empty()) return line;
  }
  return "";
}

TEST(OverlapTrial, AlternatesOverlappedFirstAndKeepsTheFasterWay) {
  OverlapTrial slower_overlap;
  std::vector<bool> ways;
  for (int i = 0; i < 2 * OverlapTrial::kIterationsEach; ++i) {
    ASSERT_FALSE(slower_overlap.decided());
    ways.push_back(slower_overlap.overlap_now());
    const std::string line =
        slower_overlap.end_iteration(true, slower_overlap.overlap_now() ? 0.98 : 0.62);
    EXPECT_EQ(line.empty(), i + 1 < 2 * OverlapTrial::kIterationsEach) << i;
  }
  EXPECT_EQ(ways, (std::vector<bool>{true, false, true, false, true, false}));
  EXPECT_TRUE(slower_overlap.decided());
  EXPECT_FALSE(slower_overlap.overlap_now());
  EXPECT_EQ(slower_overlap.end_iteration(true, 0.1), "") << "decided once";
  EXPECT_FALSE(slower_overlap.overlap_now());

  OverlapTrial faster_overlap;
  const std::string line = run_until_decided(faster_overlap, 0.5, 0.6);
  EXPECT_NE(line.find("overlapped (median iteration 0.5 s overlapped, 0.6 s serial"),
            std::string::npos)
      << line;
  EXPECT_TRUE(faster_overlap.overlap_now());

  OverlapTrial tie;
  run_until_decided(tie, 0.5, 0.5);
  EXPECT_FALSE(tie.overlap_now()) << "a tie keeps the serial step";
}

TEST(OverlapTrial, TheMedianIgnoresOneSlowIterationAndUncountedOnesChangeNothing) {
  OverlapTrial trial;
  // The first overlapped iteration allocates the undo buffers: slow once.
  const double overlapped[] = {5.0, 0.5, 0.5};
  int k = 0;
  while (!trial.decided()) {
    EXPECT_EQ(trial.end_iteration(false, 100.0), "");  // a retrace, a skipped step: not counted
    const bool way = trial.overlap_now();
    trial.end_iteration(true, way ? overlapped[k] : 0.6);
    if (way) ++k;
  }
  EXPECT_EQ(trial.overlapped_seconds().size(), 3u);
  EXPECT_EQ(trial.serial_seconds().size(), 3u);
  EXPECT_TRUE(trial.overlap_now());
}

}  // namespace overlap_trial_test
}  // namespace patrickstar::engine_detail
