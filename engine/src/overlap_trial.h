// OverlapTrial: how "overlap_step": "auto" decides, by measuring. The overlapped step gives the
// serial step's bits, so whether it pays is only a question of time, and the answer depends on the
// machine and the model: on an H200 with GPT2small at batch 8 the overlapped iteration took 1.57x
// the serial one (forward and backward took 0.07 s, far too short to hide the host Adam behind,
// while the undo copies cost 14 bytes per parameter; BENCHMARKS.md), where a longer backward hides
// most of it. So after the warm-up the steady iterations alternate, overlapped first, until each
// way has kIterationsEach of them; the way with the lower median iteration (step end to step end)
// then stays for the rest of the run (a tie keeps the serial step, which holds no undo buffers).
// An iteration that cannot say anything about the ways (the warm-up, a retrace, a skipped or
// clipped step, an overlap paused after one) is not counted, and the trial waits for one that can.
// Plain value type; not thread-safe (the training thread's).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace patrickstar::engine_detail {

class OverlapTrial {
 public:
  static constexpr int kIterationsEach = 3;

  bool decided() const { return decided_; }
  // Whether the iteration now running may update ahead: the decision once made, else the way the
  // trial measures next (overlapped when it has no more overlapped samples than serial ones).
  bool overlap_now() const {
    return decided_ ? overlap_kept_ : overlapped_.size() <= serial_.size();
  }

  // The end of an iteration that ran the way overlap_now() said, `seconds` long; `counted`: it
  // says something about that way. Returns the decision's one line on the iteration that makes it
  // (else "").
  std::string end_iteration(bool counted, double seconds) {
    if (decided_ || !counted) return "";
    (overlap_now() ? overlapped_ : serial_).push_back(seconds);
    if (static_cast<int>(serial_.size()) < kIterationsEach) return "";
    decided_ = true;
    const double overlapped = median(overlapped_);
    const double serial = median(serial_);
    overlap_kept_ = overlapped < serial;
    char line[200];
    std::snprintf(line, sizeof(line),
                  "overlap_step \"auto\": %s (median iteration %.4g s overlapped, %.4g s serial, "
                  "%d of each)",
                  overlap_kept_ ? "overlapped" : "serial", overlapped, serial, kIterationsEach);
    return line;
  }

  const std::vector<double>& overlapped_seconds() const { return overlapped_; }
  const std::vector<double>& serial_seconds() const { return serial_; }

 private:
  static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
  }

  std::vector<double> overlapped_, serial_;
  bool decided_ = false;
  bool overlap_kept_ = false;
};

}  // namespace patrickstar::engine_detail
