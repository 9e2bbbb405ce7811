#include "patrickstar/optimizer/placement.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace patrickstar {

PlacementPlan plan_placement(c10::ArrayRef<int64_t> chunk_state_bytes,
                             int64_t device_margin_bytes) {
  PlacementPlan plan;
  plan.on_device.reserve(chunk_state_bytes.size());
  int64_t left = std::max<int64_t>(0, device_margin_bytes);
  for (size_t i = 0; i < chunk_state_bytes.size(); ++i) {
    const int64_t bytes = chunk_state_bytes[i];
    TORCH_CHECK(bytes >= 0, "plan_placement: chunk ", i, " has a negative state size ", bytes);
    const bool fits = bytes <= left;
    plan.on_device.push_back(fits);
    if (fits) {
      left -= bytes;
      ++plan.report.chunks_device;
      plan.report.bytes_device += bytes;
    } else {
      ++plan.report.chunks_host;
      plan.report.bytes_host += bytes;
    }
  }
  return plan;
}

PlacementPlan all_on_host(c10::ArrayRef<int64_t> chunk_state_bytes) {
  PlacementPlan plan;
  plan.on_device.assign(chunk_state_bytes.size(), false);
  for (size_t i = 0; i < chunk_state_bytes.size(); ++i) {
    TORCH_CHECK(chunk_state_bytes[i] >= 0, "all_on_host: chunk ", i, " has a negative state size ",
                chunk_state_bytes[i]);
    ++plan.report.chunks_host;
    plan.report.bytes_host += chunk_state_bytes[i];
  }
  return plan;
}

}  // namespace patrickstar
