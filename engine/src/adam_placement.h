// Private to engine/src: where each chunk index's Adam runs. Registration may keep some
// optimizer-state chunks on the device for good (the host budget could not hold them): their
// indices' Adam always runs on the device. The rest is decided at the first step after the trace
// was dropped (the warm-up's, and each retrace's), from the margin the trace measured; in the
// warm-up itself only the device-only indices update on the device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "patrickstar/chunk/types.h"

namespace patrickstar::engine_detail {

// Where the step runs the Adam of the indices the states kept on the device for good leave open:
// - kMargin: on the device for those whose states fit the margin (what the device keeps free at
//   the peak of activations with every param chunk there): those states never move;
// - kHost: on the host for all;
// - kStreamed: the margin's, plus those whose param, gradient and states fit what the device has
//   free at the step (activations gone): their states come to the device for the update and leave
//   when the next forward needs the room ("optimizer.params.stream_states", or the plan's choice).
enum class AdamSite { kMargin, kHost, kStreamed };

class AdamPlacement {
 public:
  // `chunks`: chunk ids of every kind; `indices`: chunk indices. Everything on the host, undecided.
  void init(int64_t chunks, int64_t indices) {
    state_on_device_.assign(static_cast<size_t>(chunks), false);
    device_only_.assign(static_cast<size_t>(indices), false);
    on_device_.assign(static_cast<size_t>(indices), false);
    decided_ = false;
  }
  // Registration: optimizer-state chunk `id` (of chunk index `index`) lives on the device.
  void keep_state_on_device(ChunkId id, int64_t index) {
    state_on_device_[static_cast<size_t>(id)] = true;
    device_only_[static_cast<size_t>(index)] = true;
  }
  void clear_kept() {  // registration could not place them after all
    state_on_device_.assign(state_on_device_.size(), false);
    device_only_.assign(device_only_.size(), false);
  }
  bool state_on_device(ChunkId id) const { return state_on_device_[static_cast<size_t>(id)]; }
  bool device_only(int64_t index) const { return device_only_[static_cast<size_t>(index)]; }

  // The step's placement per chunk index; the device-only indices are added.
  void decide(std::vector<bool> on_device) {
    for (size_t i = 0; i < on_device.size(); ++i) on_device[i] = on_device[i] || device_only_[i];
    on_device_ = std::move(on_device);
    decided_ = true;
  }
  void forget() { decided_ = false; }  // a retrace: decided again at the next step
  // The non-model bytes at the step of the last trace recorded whole (its tail, the step's own
  // temporaries, is known only at the iteration's end): the streamed placement decides with them.
  void note_step_non_model(int64_t bytes) { step_non_model_ = bytes; }
  int64_t noted_step_non_model() const { return step_non_model_; }
  bool decided() const { return decided_; }
  const std::vector<bool>& on_device() const { return on_device_; }
  // The indices whose Adam runs on the device in this step (the warm-up: the device-only ones).
  const std::vector<bool>& for_step(bool warmup) const {
    return warmup ? device_only_ : on_device_;
  }

 private:
  std::vector<bool> state_on_device_;  // per chunk id
  std::vector<bool> device_only_;      // per chunk index
  std::vector<bool> on_device_;        // per chunk index, the decided placement
  bool decided_ = false;
  int64_t step_non_model_ = 0;
};

}  // namespace patrickstar::engine_detail
