// Private to engine/src: adds the seconds a scope takes to a total (the collectives' time, the disk
// tier's waits, the delayed update's).
#pragma once

#include <chrono>

namespace patrickstar::engine_detail {

class ScopeTimer {
 public:
  explicit ScopeTimer(double& total)
      : total_(total), start_(std::chrono::steady_clock::now()) {}
  ~ScopeTimer() {
    total_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  ScopeTimer(const ScopeTimer&) = delete;
  ScopeTimer& operator=(const ScopeTimer&) = delete;

 private:
  double& total_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace patrickstar::engine_detail
