// Private to engine/src: what the engine reports. The running totals an iteration's report takes
// differences of, the bounded history of reports, the peak breakdowns and the registration figures.
// It reads nothing by itself: the engine passes what it measured (a RunningTotals, a breakdown's
// inputs).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "patrickstar/chunk/chunk_store.h"
#include "patrickstar/comm/communicator.h"
#include "patrickstar/engine/engine.h"
#include "patrickstar/engine/memory_breakdown.h"
#include "patrickstar/engine/reports.h"

namespace patrickstar::engine_detail {

// Counters that only grow over the engine's life; a report is the difference of two.
struct RunningTotals {
  MoveCounters moves;
  CollectiveCounters comm;
  int64_t group_gathers = 0;
  int64_t group_reduces = 0;
  double copy_wait_seconds = 0;
  double collective_seconds = 0;
};

class IterationMetrics {
 public:
  // The iteration's start: `gathered_bytes` are the group buffers held now (data parallel).
  void begin_iteration(const RunningTotals& now, int64_t gathered_bytes) {
    start_ = now;
    gathered_peak_bytes_ = gathered_bytes;
  }
  void note_gathered_bytes(int64_t bytes) {
    gathered_peak_bytes_ = std::max(gathered_peak_bytes_, bytes);
  }
  // The traffic, waits and collectives of the iteration into `report`.
  void fill_traffic(IterationReport& report, const RunningTotals& now) const {
    report.h2d_bytes = now.moves.h2d_bytes - start_.moves.h2d_bytes;
    report.d2h_bytes = now.moves.d2h_bytes - start_.moves.d2h_bytes;
    report.copy_wait_seconds = now.copy_wait_seconds - start_.copy_wait_seconds;
    report.group_gathers = now.group_gathers - start_.group_gathers;
    report.group_reduces = now.group_reduces - start_.group_reduces;
    report.gather_bytes = now.comm.all_gather_bytes - start_.comm.all_gather_bytes;
    report.gathered_peak_bytes = gathered_peak_bytes_;
    report.reduce_bytes = now.comm.reduce_bytes - start_.comm.reduce_bytes;
    report.all_reduce_bytes = now.comm.all_reduce_bytes - start_.comm.all_reduce_bytes;
    report.collective_seconds = now.collective_seconds - start_.collective_seconds;
  }
  // Keeps `report`, dropping the oldest past Engine::kHistoryKept (nothing grows with the run).
  void keep(const IterationReport& report) {
    history_.push_back(report);
    if (history_.size() > Engine::kHistoryKept) history_.erase(history_.begin());
  }
  const std::vector<IterationReport>& history() const { return history_; }

  // A moment's chunks are in place: keeps the breakdown when it is the highest device use (the
  // device tier's blocks plus `non_model` bytes) or host-tier use so far.
  void note_memory(const ChunkStore& store, int64_t non_model, int64_t iteration,
                   const std::string& moment) {
    const int64_t device = store.device_tier().used_bytes() + non_model;
    const int64_t host = store.host_tier().used_bytes();
    if (device_peak_.iteration < 0 || device > device_peak_.device_total()) {
      device_peak_ = take_memory_breakdown(store, non_model, iteration, moment);
    }
    if (host_peak_.iteration < 0 || host > host_peak_.host_used_bytes) {
      host_peak_ = take_memory_breakdown(store, non_model, iteration, moment);
    }
  }
  const MemoryBreakdown& device_peak() const { return device_peak_; }
  const MemoryBreakdown& host_peak() const { return host_peak_; }

  RegistrationReport& registration() { return registration_; }
  const RegistrationReport& registration() const { return registration_; }

 private:
  RunningTotals start_;
  int64_t gathered_peak_bytes_ = 0;
  std::vector<IterationReport> history_;
  MemoryBreakdown device_peak_;
  MemoryBreakdown host_peak_;
  RegistrationReport registration_;
};

}  // namespace patrickstar::engine_detail
