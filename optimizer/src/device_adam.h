// Private to HybridAdam: the chunks of one step whose Adam runs on a GPU, as batched launches
// (adam_batch.h). Their gradient norm is one pass per batch and one host read for all of them;
// their update is one launch per batch (one batch per kind and state dtype: one in practice).
// The tables go to the device through pinned memory on the current stream (the caching host
// allocator keeps a pinned block until the copy that reads it is done). Not thread-safe.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <vector>

#include "patrickstar/optimizer/adam_batch.h"
#include "patrickstar/optimizer/hybrid_adam.h"

namespace patrickstar {

class DeviceAdamBatches {
 public:
  // Adds a chunk whose tensors are on a CUDA device (all on one device) at Adam step `step`, of
  // its parameter group (chunk.group).
  void add(const AdamChunk& chunk, int64_t step);
  bool empty() const { return batches_.empty(); }
  // The squared norm of every added chunk's gradient, summed on the device; one synchronization.
  double sum_squares();
  // The update of every added chunk with the constants make(step, group) gives; asynchronous.
  void update(const std::function<AdamStepConstants(int64_t, int32_t)>& make);

 private:
  at::Tensor upload(const void* data, size_t bytes) const;
  const AdamBatchEntry* device_entries(size_t b);

  std::optional<at::Device> device_;
  std::vector<AdamBatch> batches_;
  std::vector<at::Tensor> entries_on_device_;  // per batch, uploaded at first use
};

}  // namespace patrickstar
