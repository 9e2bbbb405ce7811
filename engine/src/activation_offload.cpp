#include "activation_offload.h"

#include <algorithm>
#include <exception>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

namespace patrickstar::engine_detail {
namespace offload_detail {

class Entry;

}  // namespace offload_detail

struct ActivationStore::State {
  MemoryTier* device = nullptr;
  MemoryTier* host = nullptr;
  CopyEngine* copies = nullptr;
  std::mutex mutex;
  bool closed = false;
  std::vector<offload_detail::Entry*> entries;  // live ones, in the order they were offloaded
  OffloadFigures figures;

  CopyEvent copy(void* dst, const void* src, int64_t bytes, CopyDirection direction,
                 std::string label) {
    if (copies == nullptr) {
      device->copy(dst, src, bytes, direction);
      return 0;
    }
    return copies->submit_copy(*device, dst, src, bytes, direction, std::move(label));
  }
  void wait(CopyEvent event) {
    if (copies != nullptr && event != 0) copies->wait(event);
  }
  // Backward's next offloaded input (the newest still away) starts coming back, unless one
  // already is (one input ahead of backward at a time).
  void prefetch_next_locked();
  // Every input whose copy out is done goes from the device; on a GPU the newest two only if
  // their copies are done already (the host does not wait for the GPU there), elsewhere all.
  void retire_locked();
  void free_host(void*& block, int64_t bytes) {
    if (block == nullptr) return;
    host->deallocate(block);
    block = nullptr;
    figures.host_bytes -= bytes;
  }
};

namespace offload_detail {

class Entry final : public OffloadedActivation {
 public:
  Entry(std::shared_ptr<ActivationStore::State> state, int64_t call, const at::Tensor& input,
        void* host, CopyEvent out)
      : state_(std::move(state)),
        call_(call),
        device_(input),
        host_(host),
        bytes_(static_cast<int64_t>(input.nbytes())),
        sizes_(input.sizes().vec()),
        options_(input.options()),
        out_(out) {}

  ~Entry() override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->closed) return;
    auto& entries = state_->entries;
    entries.erase(std::remove(entries.begin(), entries.end(), this), entries.end());
    try {
      release_locked();
    } catch (const std::exception& e) {
      TORCH_WARN("patrickstar: an offloaded checkpoint input's copy failed: ", e.what());
    }
  }

  // The copy out is done (`wait`: waited for; else only if it is done now): the device tensor may
  // go (the only copy of the values is the host's). Returns whether it went.
  bool retire_locked(bool wait) {
    if (away_) return true;
    if (!wait && state_->copies != nullptr && out_ != 0 && !state_->copies->done(out_)) {
      return false;
    }
    state_->wait(out_);
    device_ = at::Tensor();
    away_ = true;
    return true;
  }
  bool waiting_to_come_back() const { return away_ && !coming_back_; }
  bool coming_back() const { return coming_back_; }

  void prefetch_locked() {
    if (!away_ || coming_back_) return;
    device_ = at::empty(sizes_, options_);
    back_ = state_->copy(device_.mutable_data_ptr(), host_, bytes_, CopyDirection::kHostToDevice,
                         "prefetch checkpoint " + std::to_string(call_));
    coming_back_ = true;
    state_->figures.prefetched_bytes += bytes_;
  }

  at::Tensor take() override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    TORCH_CHECK(
        !state_->closed,
        "patrickstar::checkpoint: the engine that offloaded this checkpoint's input is gone "
        "(the engine must outlive the backward of its forward)");
    TORCH_CHECK(device_.defined() || (away_ && !coming_back_),
                "patrickstar::checkpoint: an offloaded input was taken twice");
    auto& entries = state_->entries;
    entries.erase(std::remove(entries.begin(), entries.end(), this), entries.end());
    prefetch_locked();
    release_locked();
    // Backward takes inputs in reverse: the next one it needs comes back meanwhile.
    state_->prefetch_next_locked();
    return std::move(device_);
  }

  // Both copies done, the host block given back.
  void release_locked() {
    try {
      state_->wait(out_);
      state_->wait(back_);
    } catch (...) {
      state_->free_host(host_, bytes_);
      throw;
    }
    out_ = back_ = 0;
    state_->free_host(host_, bytes_);
  }

 private:
  std::shared_ptr<ActivationStore::State> state_;
  const int64_t call_;
  at::Tensor device_;  // the input until its copy out is retired; then its copy back
  void* host_;
  const int64_t bytes_;
  const std::vector<int64_t> sizes_;
  const at::TensorOptions options_;
  CopyEvent out_ = 0;
  CopyEvent back_ = 0;
  bool away_ = false;         // only the host holds the values
  bool coming_back_ = false;  // the copy back was issued
};

}  // namespace offload_detail

void ActivationStore::State::prefetch_next_locked() {
  for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
    if ((*it)->coming_back()) return;  // one on its way back at a time
    if ((*it)->waiting_to_come_back()) {
      (*it)->prefetch_locked();
      return;
    }
  }
}

void ActivationStore::State::retire_locked() {
  const bool lazy = device->device().is_cuda();
  const size_t n = entries.size();
  for (size_t i = 0; i < n; ++i) entries[i]->retire_locked(/*wait=*/!lazy || i + 2 < n);
}

ActivationStore::ActivationStore(MemoryTier& device, MemoryTier& host, CopyEngine* copies)
    : state_(std::make_shared<State>()) {
  state_->device = &device;
  state_->host = &host;
  state_->copies = copies;
}

ActivationStore::~ActivationStore() {
  try {
    close();
  } catch (const std::exception& e) {
    TORCH_WARN("patrickstar: an offloaded activation's copy failed at the engine's end: ",
               e.what());
  }
}

std::unique_ptr<OffloadedActivation> ActivationStore::offload(int64_t call,
                                                              const at::Tensor& input) {
  const int64_t bytes = static_cast<int64_t>(input.nbytes());
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (state_->closed || bytes == 0) return nullptr;
  // Chunk evictions need host-tier room for every chunk on the device: an input takes only what
  // they leave.
  const MemoryTier& host_tier = *state_->host;
  if (host_tier.capacity_bytes() != MemoryTier::kUnlimited &&
      host_tier.used_bytes() + bytes + state_->device->used_bytes() > host_tier.capacity_bytes()) {
    state_->figures.refused_bytes += bytes;
    return nullptr;
  }
  state_->entries.reserve(state_->entries.size() + 1);  // push_back below cannot throw
  void* host = nullptr;
  try {
    host = state_->host->allocate(bytes);
  } catch (const c10::OutOfMemoryError&) {
    state_->figures.refused_bytes += bytes;
    return nullptr;
  }
  CopyEvent out = 0;
  try {
    out = state_->copy(host, input.const_data_ptr(), bytes, CopyDirection::kDeviceToHost,
                       "offload checkpoint " + std::to_string(call));
  } catch (...) {
    state_->host->deallocate(host);
    throw;
  }
  auto entry = std::make_unique<offload_detail::Entry>(state_, call, input, host, out);
  OffloadFigures& f = state_->figures;
  f.host_bytes += bytes;
  f.host_peak_bytes = std::max(f.host_peak_bytes, f.host_bytes);
  f.offloaded_bytes += bytes;
  state_->entries.push_back(entry.get());
  return entry;
}

void ActivationStore::call_forward_done() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (!state_->closed) state_->retire_locked();
}

void ActivationStore::recompute_begins() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (!state_->closed) state_->prefetch_next_locked();
}

OffloadFigures ActivationStore::figures() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->figures;
}

void ActivationStore::reset_figures() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  OffloadFigures& f = state_->figures;
  f.offloaded_bytes = f.prefetched_bytes = f.refused_bytes = 0;
  f.host_peak_bytes = f.host_bytes;
}

void ActivationStore::close() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (state_->closed) return;
  std::vector<offload_detail::Entry*> entries = std::move(state_->entries);
  state_->entries.clear();
  state_->closed = true;
  std::exception_ptr first;
  for (offload_detail::Entry* entry : entries) {
    try {
      entry->release_locked();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace patrickstar::engine_detail
