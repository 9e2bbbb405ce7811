// Private to chunk/src: exact-size pinned host blocks for HostTier in builds with CUDA
// (pinned_host.cpp). No CUDA header here, so memory_tier.cpp compiles without them.
#pragma once

#include <cstdint>

namespace patrickstar::cuda_detail {

// `bytes` of page-locked host memory (page-aligned), or nullptr when the system refuses.
void* pinned_host_allocate(int64_t bytes);
void pinned_host_free(void* ptr);

}  // namespace patrickstar::cuda_detail
