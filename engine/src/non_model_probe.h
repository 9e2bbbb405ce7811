// Private to engine/src: how the engine measures non-model memory (activations and temporaries),
// which the tracer records at every moment and the scheduler's budgets leave room for.
//
// Invariants:
// - On a GPU it is the CUDA caching allocator's bytes (chunk payloads never come from it); on the
//   emulated device the counting CPU allocator's, above the floor the process held before its
//   first iteration (the trainer's dataset is host memory, not the device's).
// - With data parallel the device bytes of gathered comm groups (other ranks' param chunks, placed
//   by the doors, not by the scheduler) count on top: the peak is an upper bound, the base's peak
//   plus the gathered bytes' peak in the same window.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>

#include "patrickstar/engine/config.h"
#include "patrickstar/memtracer/counting_allocator.h"
#include "patrickstar/memtracer/memory_probe.h"

namespace patrickstar::engine_detail {

// Data parallel: gathered groups' bytes read as non-model memory on top of `base`.
class GatheredBytesProbe final : public MemoryProbe {
 public:
  explicit GatheredBytesProbe(std::unique_ptr<MemoryProbe> base) : base_(std::move(base)) {}
  int64_t live_bytes() const override { return base_->live_bytes() + now_; }
  int64_t peak_bytes() const override { return base_->peak_bytes() + peak_; }
  void reset_peak() override {
    base_->reset_peak();
    peak_ = now_;
  }
  void add(int64_t bytes) {
    now_ += bytes;
    peak_ = std::max(peak_, now_);
  }
  int64_t gathered_bytes() const { return now_; }

 private:
  std::unique_ptr<MemoryProbe> base_;
  int64_t now_ = 0;
  int64_t peak_ = 0;
};

class NonModelProbe {
 public:
  // The probe of `device` (GPU `device_index` on CUDA; installs the counting CPU allocator: the
  // counter must see LibTorch's CPU allocations from now on), with the gathered groups' bytes when
  // `gathers_groups` (data parallel).
  NonModelProbe(DeviceType device, int device_index, bool gathers_groups) {
    CountingCpuAllocator& counter = CountingCpuAllocator::install();
    if (device == DeviceType::kCuda) {
      probe_ = make_cuda_memory_probe(static_cast<c10::DeviceIndex>(device_index));
      probe_->reset_peak();
    } else {
      auto probe = std::make_unique<CpuMemoryProbe>(counter);
      cpu_ = probe.get();
      probe_ = std::move(probe);
    }
    if (gathers_groups) {
      auto gathered = std::make_unique<GatheredBytesProbe>(std::move(probe_));
      gathered_ = gathered.get();
      probe_ = std::move(gathered);
    }
  }
  NonModelProbe(const NonModelProbe&) = delete;
  NonModelProbe& operator=(const NonModelProbe&) = delete;

  MemoryProbe& probe() const { return *probe_; }
  MemoryProbe* get() const { return probe_.get(); }
  int64_t live_bytes() const { return probe_->live_bytes(); }
  int64_t peak_bytes() const { return probe_->peak_bytes(); }
  // Before the first iteration: what the process holds now is host memory (emulated device).
  void set_floor_once() {
    if (floor_set_ || cpu_ == nullptr) return;
    cpu_->set_floor_bytes(CountingCpuAllocator::installed()->live_bytes());
    floor_set_ = true;
  }
  // Data parallel: a group's other ranks' chunks arrived on (positive) or left (negative) the
  // device.
  void add_gathered(int64_t bytes) { gathered_->add(bytes); }
  int64_t gathered_bytes() const { return gathered_ != nullptr ? gathered_->gathered_bytes() : 0; }

 private:
  std::unique_ptr<MemoryProbe> probe_;
  CpuMemoryProbe* cpu_ = nullptr;           // the emulated device's: probe_ or its base
  GatheredBytesProbe* gathered_ = nullptr;  // data parallel: probe_
  bool floor_set_ = false;
};

}  // namespace patrickstar::engine_detail
