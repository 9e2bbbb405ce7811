// What the scheduler tests share (scheduler_test.cpp, scheduler_warmup_test.cpp): traces and
// chunk tables by hand, simulation options, and a mover with one chunk that may not move.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "patrickstar/memtracer/scheduler.h"
#include "patrickstar/memtracer/simulator.h"

namespace patrickstar::scheduler_testing {

inline Trace make_trace(const std::vector<std::vector<int64_t>>& accesses,
                 const std::vector<int64_t>& non_model = {}) {
  Trace trace;
  for (size_t m = 0; m < accesses.size(); ++m) {
    trace.moments.push_back(Moment{MomentKind::kPreForward, "m" + std::to_string(m),
                                   non_model.empty() ? 0 : non_model[m], accesses[m]});
  }
  return trace;
}

inline std::map<int64_t, ChunkInfo> equal_chunks(int64_t count, int64_t bytes) {
  std::map<int64_t, ChunkInfo> chunks;
  for (int64_t id = 0; id < count; ++id) chunks[id] = ChunkInfo{bytes, false};
  return chunks;
}

inline SimulationOptions sim_options(int64_t capacity, EvictionPolicy policy, int64_t prefetch_depth,
                              int64_t iterations = 3) {
  SimulationOptions options;
  options.scheduler.capacity_bytes = capacity;
  options.scheduler.policy = policy;
  options.scheduler.prefetch_depth = prefetch_depth;
  options.scheduler.warmup_ratio = 1.0;
  options.iterations = iterations;
  return options;
}


// A mover whose chunk 0 is pinned in COMPUTE: the scheduler evicts around it.
class PinnedMover final : public ChunkMover {
 public:
  bool on_device(int64_t id) override { return resident.count(id) != 0; }
  bool movable(int64_t id) override { return id != 0; }
  void to_device(int64_t id) override { resident.insert(id); }
  void to_host(int64_t id) override {
    ASSERT_NE(id, 0) << "chunk 0 is in COMPUTE";
    resident.erase(id);
  }
  std::set<int64_t> resident;
};

}  // namespace patrickstar::scheduler_testing
