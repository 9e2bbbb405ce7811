// Export of the scheduler's statistics and timeline: statistics as JSON, the timeline as Chrome
// trace-event JSON (opens in Perfetto and chrome://tracing: chunk moves are "X" events, device
// memory "C" counters) and a memory-timeline plot as SVG. Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "patrickstar/chunk/copy_queue.h"
#include "patrickstar/memtracer/scheduler.h"
#include "patrickstar/memtracer/simulator.h"

namespace patrickstar {

// {"iterations": [{"iteration", "warmup", "h2d_bytes", "d2h_bytes", "loads", "evictions",
//   "prefetches", "prefetches_used", "peak_chunk_bytes", "peak_device_bytes", "budget_bytes":
//   [...]}]}
std::string stats_to_json(const std::vector<IterationStats>& iterations);
// {"h2d_bytes", "d2h_bytes", "loads", "evictions", "proven", "method"}
std::string bound_to_json(const TrafficBound& bound);

// Chrome trace-event JSON ({"traceEvents": [...]}): one "X" event per move as the scheduler issued
// it (thread "h2d issued" or "d2h issued": with asynchronous moves only the queueing), one "i"
// instant per moment, a "C" counter "device memory" per moment with chunk, non-model and budget
// bytes, and, from a copy queue's timeline (same clock as the moves), one "X" event per copy
// (thread "copy thread") and per wait that blocked compute (thread "compute waits for copies"),
// and one "X" event per chunk index the overlapped step's optimizer thread updated ahead (thread
// "optimizer thread (host Adam ahead)").
std::string chrome_trace_json(const std::vector<MoveEvent>& moves,
                              const std::vector<MomentRecord>& moments, int64_t capacity_bytes,
                              const std::vector<CopySpan>& copies = {},
                              const std::vector<CopySpan>& optimizer_thread = {});

// SVG plot over the moment sequence: capacity, budget, chunk bytes, non-model bytes and their sum,
// with axis labels (bytes in MiB) and a legend.
std::string memory_timeline_svg(const std::vector<MomentRecord>& moments, int64_t capacity_bytes);

// Writes `text` to `path`; throws c10::Error naming the path on failure.
void write_text_file(const std::string& path, const std::string& text);

}  // namespace patrickstar
