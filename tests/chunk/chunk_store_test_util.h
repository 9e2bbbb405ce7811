// What the chunk store tests share (chunk_store_test.cpp, chunk_store_async_test.cpp): a small
// layout and the fixture's two tiers.
#pragma once

#include <gtest/gtest.h>

#include "patrickstar/chunk/chunk_store.h"

namespace patrickstar::chunk_store_testing {

// Three tensors in chunks of 64 elements: w (6x8 = 48) and b (8) share chunk 0, e (40) chunk 1.
inline Layout small_layout() {
  Layout layout;
  layout.add_tensor("layer.w", {6, 8});
  layout.add_tensor("layer.b", {8});
  layout.add_tensor("embed", {40});
  layout.finalize(64);
  return layout;
}

class ChunkStoreTest : public ::testing::Test {
 protected:
  HostTier host_{MemoryTier::kUnlimited, HostTier::Pinning::kNever};
  EmulatedDeviceTier device_{1 << 20};
};


}  // namespace patrickstar::chunk_store_testing
