#include "patrickstar/chunk/types.h"
#include "patrickstar/chunk/tensor_state.h"

#include <c10/util/Exception.h>

namespace patrickstar {

std::string_view to_string(ChunkKind kind) {
  switch (kind) {
    case ChunkKind::kParam:
      return "param";
    case ChunkKind::kParamFp32:
      return "param_fp32";
    case ChunkKind::kMomentum:
      return "momentum";
    case ChunkKind::kVariance:
      return "variance";
    case ChunkKind::kGrad:
      return "grad";
  }
  return "unknown_kind";
}

std::string_view to_string(Tier tier) {
  switch (tier) {
    case Tier::kNone:
      return "none";
    case Tier::kHost:
      return "host";
    case Tier::kDevice:
      return "device";
  }
  return "unknown_tier";
}

int64_t chunk_element_bytes(at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat,
              "chunks hold Half, BFloat16 or Float elements, not ", dtype);
  return static_cast<int64_t>(c10::elementSize(dtype));
}

std::string_view to_string(TensorState state) {
  switch (state) {
    case TensorState::kFree:
      return "FREE";
    case TensorState::kCompute:
      return "COMPUTE";
    case TensorState::kHold:
      return "HOLD";
    case TensorState::kHoldAfterFwd:
      return "HOLD_AFTER_FWD";
    case TensorState::kHoldAfterBwd:
      return "HOLD_AFTER_BWD";
    case TensorState::kReadyForReduce:
      return "READY_FOR_REDUCE";
  }
  return "UNKNOWN_STATE";
}

namespace {

using S = TensorState;
constexpr int kN = kTensorStateCount;

// kLegal[from][to]; rows and columns in enum order:
// FREE, COMPUTE, HOLD, HOLD_AFTER_FWD, HOLD_AFTER_BWD, READY_FOR_REDUCE.
constexpr bool kLegal[kN][kN] = {
    /* FREE             */ {false, false, true, false, false, false},
    /* COMPUTE          */ {false, false, true, true, true, false},
    /* HOLD             */ {true, true, false, false, false, false},
    /* HOLD_AFTER_FWD   */ {true, true, true, false, false, false},
    /* HOLD_AFTER_BWD   */ {true, true, true, false, false, true},
    /* READY_FOR_REDUCE */ {true, false, true, false, false, false},
};
static_assert(static_cast<int>(S::kReadyForReduce) == kN - 1);

}  // namespace

bool is_legal_transition(TensorState from, TensorState to) {
  const int f = static_cast<int>(from);
  const int t = static_cast<int>(to);
  if (f < 0 || f >= kN || t < 0 || t >= kN) return false;
  return kLegal[f][t];
}

int64_t ChunkStateCounts::total() const {
  int64_t sum = 0;
  for (int64_t c : counts) sum += c;
  return sum;
}

}  // namespace patrickstar
