// One launch per step for every chunk whose Adam runs on the device: a table of chunk pointers
// (AdamBatch) split into tiles of kAdamTileElems elements, one CUDA block per tile, each thread
// taking groups of 8 consecutive elements (16-byte loads where every pointer of the chunk is
// 16-byte aligned, element by element otherwise). The same table gives the gradient's squared norm
// in one pass: a double per tile, then the tiles summed in a fixed order, read by the host once.
//
// The per-element work (adam_batch_update, grad_square) and the order of the norm's additions are
// written here once, for nvcc and for the host: run_adam_batch_on_host and sum_squares_on_host run
// the same tiles, groups and additions on CPU memory, so the tests prove the table, the tiling and
// the rule on every machine, and a GPU test checks the kernels against them bit for bit.
// Host functions: not thread-safe on one AdamBatch; the batch holds pointers, owns no memory.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "patrickstar/optimizer/adam_rule.h"

namespace patrickstar {

// How an entry reads its gradient and writes its weights. One launch per kind and state dtype.
enum class AdamBatchKind : uint8_t {
  kMixed = 0,            // the gradient in the half slot; the new half weight written there
  kFp32 = 1,             // fp32 parameter (the master) and fp32 gradient
  kFp32GradHalfOut = 2,  // mixed precision with a gradient space: fp32 gradient, half weight out
};

inline constexpr int64_t kAdamGroupElems = 8;  // one 16-byte load of 16-bit values
inline constexpr int32_t kAdamBatchThreads = 256;
inline constexpr int64_t kAdamTileElems = 8192;    // 4 groups per thread per tile
inline constexpr int32_t kAdamNormThreads = 1024;  // the one block that sums the tiles' partials

// One chunk: device pointers (host pointers for the host reference). POD, copied to the device.
struct AdamBatchEntry {
  uint16_t* half = nullptr;     // kMixed, kFp32GradHalfOut: the half slot
  float* master = nullptr;      // the fp32 master weight (kFp32: the parameter)
  const float* grad = nullptr;  // kFp32, kFp32GradHalfOut: the fp32 gradient
  void* exp_avg = nullptr;      // float*, or uint16_t* of bf16 bits with bf16 states
  void* exp_avg_sq = nullptr;
  int64_t numel = 0;
  int64_t first_tile = 0;  // the builder's: tiles of the entries before this one
  int32_t constants = 0;   // the builder's: index into AdamBatch::constants()
  int32_t vector = 0;      // the builder's: 1 when every pointer is 16-byte aligned
};

// The entry holding tile `tile` of a table whose first_tile values ascend from 0 (binary search).
PS_HOST_DEVICE inline int32_t adam_entry_of_tile(const AdamBatchEntry* entries, int32_t count,
                                                 int64_t tile) {
  int32_t low = 0;
  int32_t high = count - 1;
  while (low < high) {
    const int32_t mid = low + (high - low + 1) / 2;
    if (entries[mid].first_tile <= tile) {
      low = mid;
    } else {
      high = mid - 1;
    }
  }
  return low;
}

// The gradient of one element, widened to fp32.
PS_HOST_DEVICE inline float adam_batch_grad(AdamBatchKind kind, bool bf16_half, uint16_t half,
                                            float grad32) {
  if (kind != AdamBatchKind::kMixed) return grad32;
  return bf16_half ? bf16_to_float(half) : fp16_to_float(half);
}

// One element of an entry: the rule of adam_rule.h, then the half weight where the kind has one.
template <typename S>
PS_HOST_DEVICE inline void adam_batch_update(AdamBatchKind kind, bool bf16_half, float& p, S& m,
                                             S& v, uint16_t& half, float grad32,
                                             const AdamStepConstants& c) {
  adam_update_stored(p, m, v, adam_batch_grad(kind, bf16_half, half, grad32), c);
  if (kind != AdamBatchKind::kFp32) half = bf16_half ? float_to_bf16(p) : float_to_fp16(p);
}

// The square of one element's gradient in double (exact for 16- and 32-bit floats).
PS_HOST_DEVICE inline double grad_square(AdamBatchKind kind, bool bf16_half, uint16_t half,
                                         float grad32) {
  const double g = adam_batch_grad(kind, bf16_half, half, grad32);
  return g * g;
}

// A table of entries of one kind and state dtype, with the constants they use (one per distinct
// Adam step and parameter group among them). Entries of 0 elements are left out.
class AdamBatch {
 public:
  AdamBatch(AdamBatchKind kind, bool bf16_states, bool bf16_half)
      : kind_(kind), bf16_states_(bf16_states), bf16_half_(bf16_half) {}

  // Adds a chunk at Adam step `step` (its bias corrections) of parameter group `group` (its
  // options); the constants come later.
  void add(const AdamBatchEntry& entry, int64_t step, int32_t group = 0);
  // The constants of each distinct (step, group), made once each by `make(step, group)`.
  template <typename Make>
  void set_constants(Make make) {
    static_assert(std::is_invocable_r_v<AdamStepConstants, Make, int64_t, int32_t>,
                  "set_constants takes make(step, group)");
    constants_.clear();
    for (const auto& [step, group] : keys_) constants_.push_back(make(step, group));
  }

  AdamBatchKind kind() const { return kind_; }
  bool bf16_states() const { return bf16_states_; }
  bool bf16_half() const { return bf16_half_; }
  const std::vector<AdamBatchEntry>& entries() const { return entries_; }
  const std::vector<AdamStepConstants>& constants() const { return constants_; }
  // The distinct (step, group) pairs, in first-seen order: constants()[i] is keys()[i]'s.
  const std::vector<std::pair<int64_t, int32_t>>& keys() const { return keys_; }
  int64_t tiles() const { return tiles_; }
  int64_t elements() const { return elements_; }
  bool empty() const { return entries_.empty(); }

 private:
  AdamBatchKind kind_;
  bool bf16_states_;
  bool bf16_half_;
  std::vector<AdamBatchEntry> entries_;
  std::vector<std::pair<int64_t, int32_t>> keys_;  // distinct (step, group): constants_[i]'s
  std::vector<AdamStepConstants> constants_;
  int64_t tiles_ = 0;
  int64_t elements_ = 0;
};

// The host reference of the kernels (scalar, one thread): the update of every entry, and the
// squared norm of every gradient summed in the kernels' order (per thread, per block, per tile).
void run_adam_batch_on_host(const AdamBatch& batch);
double sum_squares_on_host(const AdamBatch& batch);

}  // namespace patrickstar
