// Every legal and every illegal tensor state transition, through ChunkStore::set_state, and the
// chunk state derived from its tensors.
#include "patrickstar/chunk/chunk_store.h"

#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <deque>
#include <map>
#include <set>
#include <tuple>

namespace patrickstar {
namespace tensor_state_test {

using ::testing::HasSubstr;
using S = TensorState;

constexpr S kAll[] = {S::kFree,         S::kCompute,      S::kHold,
                      S::kHoldAfterFwd, S::kHoldAfterBwd, S::kReadyForReduce};

// The table as the data flow of docs/design.md section 4 needs it, written out independently of
// the library.
const std::set<std::pair<S, S>>& expected_legal() {
  static const std::set<std::pair<S, S>> table = {
      {S::kFree, S::kHold},
      {S::kHold, S::kCompute},
      {S::kHold, S::kFree},
      {S::kCompute, S::kHold},
      {S::kCompute, S::kHoldAfterFwd},
      {S::kCompute, S::kHoldAfterBwd},
      {S::kHoldAfterFwd, S::kCompute},
      {S::kHoldAfterFwd, S::kHold},
      {S::kHoldAfterFwd, S::kFree},
      {S::kHoldAfterBwd, S::kCompute},
      {S::kHoldAfterBwd, S::kHold},
      {S::kHoldAfterBwd, S::kReadyForReduce},
      {S::kHoldAfterBwd, S::kFree},
      {S::kReadyForReduce, S::kHold},
      {S::kReadyForReduce, S::kFree},
  };
  return table;
}

// Shortest legal path from HOLD (where allocate() leaves a tensor) to `target`.
std::vector<S> path_from_hold(S target) {
  std::map<S, S> parent;
  std::deque<S> queue{S::kHold};
  parent[S::kHold] = S::kHold;
  while (!queue.empty()) {
    const S s = queue.front();
    queue.pop_front();
    for (S t : kAll) {
      if (expected_legal().count({s, t}) && !parent.count(t)) {
        parent[t] = s;
        queue.push_back(t);
      }
    }
  }
  std::vector<S> path;
  for (S s = target; s != S::kHold; s = parent.at(s)) path.insert(path.begin(), s);
  return path;
}

class StateTransition : public ::testing::TestWithParam<std::tuple<S, S>> {
 protected:
  StateTransition() : device_(1 << 20) {
    Layout layout;
    layout.add_tensor("blk.w", {8});
    layout.add_tensor("blk.b", {4});
    layout.finalize(16);
    store_ = std::make_unique<ChunkStore>(
        std::move(layout), std::vector<ChunkKindSpec>{{ChunkKind::kParam, at::kHalf}}, host_,
        device_);
  }

  HostTier host_{MemoryTier::kUnlimited, HostTier::Pinning::kNever};
  EmulatedDeviceTier device_;
  std::unique_ptr<ChunkStore> store_;
};

TEST_P(StateTransition, FollowsTheTable) {
  const auto [from, to] = GetParam();
  const bool legal = expected_legal().count({from, to}) > 0;
  EXPECT_EQ(is_legal_transition(from, to), legal);

  const ChunkId c = store_->chunk_id(ChunkKind::kParam, 0);
  store_->allocate(c, Tier::kHost);
  ASSERT_EQ(store_->state(0, ChunkKind::kParam), S::kHold);
  for (S step : path_from_hold(from)) store_->set_state(0, ChunkKind::kParam, step);
  ASSERT_EQ(store_->state(0, ChunkKind::kParam), from);

  if (legal) {
    store_->set_state(0, ChunkKind::kParam, to);
    EXPECT_EQ(store_->state(0, ChunkKind::kParam), to);
    EXPECT_EQ(store_->chunk_state(c)[to], to == S::kHold ? 2 : 1);
  } else {
    try {
      store_->set_state(0, ChunkKind::kParam, to);
      FAIL() << "expected " << to_string(from) << " -> " << to_string(to) << " to throw";
    } catch (const c10::Error& e) {
      const std::string msg = e.what();
      EXPECT_THAT(msg, HasSubstr("'blk.w'"));
      EXPECT_THAT(msg, HasSubstr("param chunk 0"));
      EXPECT_THAT(msg,
                  HasSubstr(std::string(to_string(from)) + " -> " + std::string(to_string(to))));
    }
    EXPECT_EQ(store_->state(0, ChunkKind::kParam), from);  // nothing half-applied
    EXPECT_EQ(store_->chunk_state(c)[from], from == S::kHold ? 2 : 1);
  }
  EXPECT_EQ(store_->chunk_state(c).total(), 2);
  // A chunk is movable exactly when no tensor of it is COMPUTE.
  EXPECT_EQ(store_->is_movable(c), store_->state(0, ChunkKind::kParam) != S::kCompute);
}

std::string transition_name(const ::testing::TestParamInfo<std::tuple<S, S>>& info) {
  return std::string(to_string(std::get<0>(info.param))) + "_to_" +
         std::string(to_string(std::get<1>(info.param)));
}

INSTANTIATE_TEST_SUITE_P(AllPairs, StateTransition,
                         ::testing::Combine(::testing::ValuesIn(kAll), ::testing::ValuesIn(kAll)),
                         transition_name);

TEST(TensorState, NamesAreTheDesignNames) {
  EXPECT_EQ(to_string(S::kFree), "FREE");
  EXPECT_EQ(to_string(S::kCompute), "COMPUTE");
  EXPECT_EQ(to_string(S::kHold), "HOLD");
  EXPECT_EQ(to_string(S::kHoldAfterFwd), "HOLD_AFTER_FWD");
  EXPECT_EQ(to_string(S::kHoldAfterBwd), "HOLD_AFTER_BWD");
  EXPECT_EQ(to_string(S::kReadyForReduce), "READY_FOR_REDUCE");
}

TEST(TensorState, ComputeNeedsAPayload) {
  HostTier host(MemoryTier::kUnlimited, HostTier::Pinning::kNever);
  EmulatedDeviceTier device(1 << 20);
  Layout layout;
  layout.add_tensor("w", {4});
  layout.finalize(4);
  ChunkStore store(std::move(layout), {{ChunkKind::kParam, at::kFloat}}, host, device);
  store.set_state(0, ChunkKind::kParam, S::kHold);  // bookkeeping without a payload is allowed
  EXPECT_THROW(store.set_state(0, ChunkKind::kParam, S::kCompute), c10::Error);
  EXPECT_EQ(store.state(0, ChunkKind::kParam), S::kHold);
}

}  // namespace tensor_state_test
}  // namespace patrickstar
