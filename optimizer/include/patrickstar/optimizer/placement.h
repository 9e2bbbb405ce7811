// Hybrid placement of the optimizer step: which chunks update on the device and which on the host,
// given the device margin the tracer reports after backward. A pure function; thread-safe.
//
// Rule: first fit in chunk order. Walk the chunks in the given order; a chunk runs on the device if
// its optimizer-state bytes fit in what is left of the margin (the margin then shrinks by them),
// otherwise on the host. With equal-size chunks (the normal case) this is a prefix and maximises
// both the number of chunks and the bytes on the device; with a smaller last chunk, that chunk can
// still take the room the larger ones leave. Order is the caller's: pass the chunks most worth
// keeping on the device (those already resident) first.
#pragma once

#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <vector>

namespace patrickstar {

// How many chunks and bytes of optimizer state ran where.
struct PlacementReport {
  int64_t chunks_device = 0;
  int64_t chunks_host = 0;
  int64_t bytes_device = 0;
  int64_t bytes_host = 0;
};

struct PlacementPlan {
  std::vector<bool> on_device;  // one entry per chunk, in the order given
  PlacementReport report;
};

// chunk_state_bytes[i]: bytes the update of chunk i needs on the device (fp32 master + momentum +
// variance, plus the gradient if it is not already there). A negative margin counts as 0. Throws
// c10::Error on a negative chunk size.
PlacementPlan plan_placement(c10::ArrayRef<int64_t> chunk_state_bytes, int64_t device_margin_bytes);

// Every chunk on the host (no device, or the device has no room).
PlacementPlan all_on_host(c10::ArrayRef<int64_t> chunk_state_bytes);

}  // namespace patrickstar
