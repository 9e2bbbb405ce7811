// ChunkStore: ids, allocation, moves that keep bytes for every dtype, exact traffic counters, views
// that alias chunk memory, COMPUTE pinning, and out-of-memory without leaks (asynchronous moves:
// chunk_store_async_test.cpp).
#include "patrickstar/chunk/chunk_store.h"
#include "patrickstar/chunk/copy_queue.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/randn.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <string>
#include <utility>
#include <vector>

#include "chunk_store_test_util.h"
#include "error_message.h"

namespace patrickstar {
namespace chunk_store_test {

using ::testing::HasSubstr;
using test::error_of;
using namespace chunk_store_testing;  // NOLINT: the chunk store tests' shared helpers

TEST_F(ChunkStoreTest, ChunkIdsRunKindByKind) {
  ChunkStore store(small_layout(),
                   {{ChunkKind::kParam, at::kHalf}, {ChunkKind::kMomentum, at::kFloat}}, host_,
                   device_);
  EXPECT_EQ(store.chunks_per_kind(), 2);
  EXPECT_EQ(store.chunk_count(), 4);
  for (ChunkKind kind : {ChunkKind::kParam, ChunkKind::kMomentum}) {
    for (int64_t i = 0; i < 2; ++i) {
      const ChunkId id = store.chunk_id(kind, i);
      EXPECT_EQ(store.kind_of(id), kind);
      EXPECT_EQ(store.index_of(id), i);
      EXPECT_EQ(store.tier(id), Tier::kNone);
    }
  }
  EXPECT_EQ(store.chunk_id(ChunkKind::kMomentum, 1), 3);
  const auto momentum = store.chunks(ChunkKind::kMomentum);
  ASSERT_EQ(momentum.size(), 2u);
  EXPECT_EQ(momentum[0].id, 2);
  EXPECT_EQ(momentum[1].kind, ChunkKind::kMomentum);
  EXPECT_EQ(momentum[1].capacity_elems, 64);
  EXPECT_EQ(momentum[1].dtype, at::kFloat);
  EXPECT_EQ(store.chunk_bytes(store.chunk_id(ChunkKind::kParam, 0)), 128);
  EXPECT_EQ(store.chunk_bytes(store.chunk_id(ChunkKind::kMomentum, 0)), 256);
  EXPECT_EQ(store.chunk_of(2, ChunkKind::kMomentum), 3);
  EXPECT_EQ(store.describe(3), "momentum chunk 1 (id 3)");
  EXPECT_THROW(store.chunk_id(ChunkKind::kVariance, 0), c10::Error);
  EXPECT_THROW(store.chunk_id(ChunkKind::kParam, 2), c10::Error);
  EXPECT_THROW(store.chunk(4), c10::Error);
  EXPECT_EQ(store.dtype(ChunkKind::kMomentum), at::kFloat);
  // Waste: 8 elements in chunk 0 and 24 in chunk 1, paid in fp16 and in fp32.
  EXPECT_EQ(store.waste_bytes(), 32 * 2 + 32 * 4);
  EXPECT_EQ(store.total_chunk_bytes(), 2 * 128 + 2 * 256);
}

TEST_F(ChunkStoreTest, AnOmittedChunkHasNoBytesAndRefusesEveryPayload) {
  ChunkStore store(small_layout(),
                   {{ChunkKind::kParam, at::kHalf}, {ChunkKind::kMomentum, at::kFloat}}, host_,
                   device_);
  const ChunkId kept = store.chunk_id(ChunkKind::kMomentum, 0);
  const ChunkId gone = store.chunk_id(ChunkKind::kMomentum, 1);
  store.omit(gone);
  EXPECT_TRUE(store.omitted(gone));
  EXPECT_FALSE(store.omitted(kept));
  EXPECT_EQ(store.chunk_bytes(gone), 0);
  EXPECT_EQ(store.chunk_bytes(kept), 256);
  // Chunk 1 wastes 24 elements: in fp16 still, no longer in fp32.
  EXPECT_EQ(store.waste_bytes(), 32 * 2 + 8 * 4);
  EXPECT_EQ(store.total_chunk_bytes(), 2 * 128 + 256);
  EXPECT_THAT(error_of([&] { store.allocate(gone, Tier::kHost); }), HasSubstr("omitted"));
  const ChunkId block[] = {gone};
  EXPECT_THAT(error_of([&] { store.allocate_block(block, Tier::kDevice); }), HasSubstr("omitted"));
  EXPECT_THAT(error_of([&] { store.view(2, ChunkKind::kMomentum); }), HasSubstr("omitted"));
  EXPECT_THAT(error_of([&] { store.chunk_view(gone); }), HasSubstr("omitted"));
  EXPECT_EQ(host_.used_bytes(), 0);
  EXPECT_EQ(device_.used_bytes(), 0);
  EXPECT_EQ(store.tier(gone), Tier::kNone);
  // A chunk with a payload cannot be omitted.
  store.allocate(kept, Tier::kHost);
  EXPECT_THAT(error_of([&] { store.omit(kept); }), HasSubstr("has a payload"));
  EXPECT_FALSE(store.omitted(kept));
  EXPECT_EQ(store.chunk_bytes(kept), 256);
}

TEST_F(ChunkStoreTest, RejectsBadConstruction) {
  Layout unfinished;
  unfinished.add_tensor("w", {4});
  EXPECT_THROW(ChunkStore(std::move(unfinished), {{ChunkKind::kParam, at::kHalf}}, host_, device_),
               c10::Error);
  EXPECT_THROW(ChunkStore(small_layout(), {{ChunkKind::kParam, at::kDouble}}, host_, device_),
               c10::Error);
  EXPECT_THROW(
      ChunkStore(small_layout(), {{ChunkKind::kParam, at::kHalf}, {ChunkKind::kParam, at::kFloat}},
                 host_, device_),
      c10::Error);
  EXPECT_THROW(ChunkStore(small_layout(), {{ChunkKind::kParam, at::kHalf}}, device_, host_),
               c10::Error);
}

TEST_F(ChunkStoreTest, AllocateZeroFillsAndCountsTierBytes) {
  ChunkStore store(small_layout(), {{ChunkKind::kParamFp32, at::kFloat}}, host_, device_);
  const ChunkId c0 = store.chunk_id(ChunkKind::kParamFp32, 0);
  const ChunkId c1 = store.chunk_id(ChunkKind::kParamFp32, 1);
  store.allocate(c0, Tier::kHost);
  store.allocate(c1, Tier::kDevice);
  EXPECT_EQ(host_.used_bytes(), 256);
  EXPECT_EQ(device_.used_bytes(), 256);
  EXPECT_EQ(store.resident_bytes(Tier::kHost), 256);
  EXPECT_EQ(store.resident_bytes(Tier::kDevice), 256);
  EXPECT_EQ(store.chunk_view(c0).count_nonzero().item<int64_t>(), 0);
  EXPECT_EQ(store.chunk_view(c1).count_nonzero().item<int64_t>(), 0);
  EXPECT_EQ(store.state(0, ChunkKind::kParamFp32), TensorState::kHold);
  EXPECT_EQ(store.chunk_state(c0)[TensorState::kHold], 2);
  EXPECT_THROW(store.allocate(c0, Tier::kDevice), c10::Error);  // already has a payload
  EXPECT_THROW(store.allocate(c0, Tier::kNone), c10::Error);
  store.release(c0);
  EXPECT_EQ(store.tier(c0), Tier::kNone);
  EXPECT_EQ(store.chunk(c0).payload, nullptr);
  EXPECT_EQ(host_.used_bytes(), 0);
  EXPECT_EQ(store.state(1, ChunkKind::kParamFp32), TensorState::kFree);
  EXPECT_TRUE(store.chunk_state(c0).all(TensorState::kFree));
  store.release(c0);  // releasing a released chunk is a no-op
  EXPECT_THROW(store.view(0, ChunkKind::kParamFp32), c10::Error);
}

TEST_F(ChunkStoreTest, MoveRoundTripKeepsBytesForEveryDtype) {
  for (at::ScalarType dtype : {at::kHalf, at::kBFloat16, at::kFloat}) {
    SCOPED_TRACE(c10::toString(dtype));
    ChunkStore store(small_layout(), {{ChunkKind::kParam, dtype}}, host_, device_);
    const ChunkId c = store.chunk_id(ChunkKind::kParam, 0);
    store.allocate(c, Tier::kHost, Fill::kUninitialized);
    const int64_t bytes = store.chunk_bytes(c);
    // Fill with arbitrary bit patterns (NaN payloads included) and keep a copy of the raw bytes.
    std::vector<unsigned char> original(static_cast<size_t>(bytes));
    for (size_t i = 0; i < original.size(); ++i)
      original[i] = static_cast<unsigned char>(i * 37 + 11);
    std::memcpy(store.chunk(c).payload, original.data(), original.size());

    EXPECT_TRUE(store.move(c, Tier::kDevice));
    EXPECT_EQ(store.tier(c), Tier::kDevice);
    EXPECT_EQ(std::memcmp(store.chunk(c).payload, original.data(), original.size()), 0);
    EXPECT_EQ(host_.used_bytes(), 0);
    EXPECT_EQ(device_.used_bytes(), bytes);
    EXPECT_FALSE(store.move(c, Tier::kDevice));  // already there: no copy, not counted
    EXPECT_TRUE(store.move(c, Tier::kHost));
    EXPECT_EQ(std::memcmp(store.chunk(c).payload, original.data(), original.size()), 0);

    const MoveCounters m = store.move_counters();
    EXPECT_EQ(m.h2d_bytes, bytes);
    EXPECT_EQ(m.d2h_bytes, bytes);
    EXPECT_EQ(m.h2d_moves, 1);
    EXPECT_EQ(m.d2h_moves, 1);
    store.reset_move_counters();
    EXPECT_EQ(store.move_counters().h2d_bytes, 0);
  }
  EXPECT_EQ(host_.used_bytes(), 0);  // every store gave its payloads back
  EXPECT_EQ(device_.used_bytes(), 0);
}

TEST_F(ChunkStoreTest, MovingAReleasedChunkOrToNoneIsAnError) {
  ChunkStore store(small_layout(), {{ChunkKind::kParam, at::kHalf}}, host_, device_);
  const ChunkId c = store.chunk_id(ChunkKind::kParam, 0);
  EXPECT_THROW(store.move(c, Tier::kDevice), c10::Error);
  store.allocate(c, Tier::kHost);
  EXPECT_THROW(store.move(c, Tier::kNone), c10::Error);
  EXPECT_EQ(store.move_counters().h2d_moves, 0);
}

TEST_F(ChunkStoreTest, ViewsAliasChunkMemory) {
  ChunkStore store(small_layout(),
                   {{ChunkKind::kParam, at::kBFloat16}, {ChunkKind::kVariance, at::kFloat}}, host_,
                   device_);
  for (ChunkKind kind : {ChunkKind::kParam, ChunkKind::kVariance}) {
    for (int64_t i = 0; i < store.chunks_per_kind(); ++i)
      store.allocate(store.chunk_id(kind, i), Tier::kHost);
  }
  const at::Tensor w = store.view(0, ChunkKind::kVariance);
  const at::Tensor b = store.view(1, ChunkKind::kVariance);
  const at::Tensor e = store.view(2, ChunkKind::kVariance);
  EXPECT_EQ(w.sizes().vec(), (std::vector<int64_t>{6, 8}));
  EXPECT_EQ(b.sizes().vec(), (std::vector<int64_t>{8}));
  EXPECT_EQ(w.scalar_type(), at::kFloat);
  EXPECT_TRUE(w.is_cpu());
  const ChunkId v0 = store.chunk_id(ChunkKind::kVariance, 0);
  const at::Tensor flat = store.chunk_view(v0);
  EXPECT_EQ(flat.numel(), 64);
  EXPECT_EQ(w.data_ptr(), store.chunk(v0).payload);
  EXPECT_EQ(static_cast<char*>(b.data_ptr()) - static_cast<char*>(w.data_ptr()), 48 * 4);
  EXPECT_EQ(e.data_ptr(), store.chunk(store.chunk_id(ChunkKind::kVariance, 1)).payload);

  // Writes through a view land in the chunk and the other way round.
  const at::Tensor values = at::randn({6, 8});
  w.copy_(values);
  EXPECT_TRUE(at::equal(flat.slice(0, 0, 48).view({6, 8}), values));
  flat.slice(0, 48, 56).fill_(3.5);
  EXPECT_EQ(b.sum().item<float>(), 8 * 3.5f);
  EXPECT_EQ(flat.slice(0, 56, 64).count_nonzero().item<int64_t>(), 0);  // padding untouched

  // The param kind has its own payload and dtype at the same offsets.
  const at::Tensor wp = store.view(0, ChunkKind::kParam);
  EXPECT_EQ(wp.scalar_type(), at::kBFloat16);
  EXPECT_EQ(wp.data_ptr(), store.chunk(store.chunk_id(ChunkKind::kParam, 0)).payload);
  EXPECT_EQ(wp.count_nonzero().item<int64_t>(), 0);

  // After a move the new view sees the same values in the new payload.
  store.move(v0, Tier::kDevice);
  EXPECT_TRUE(at::equal(store.view(0, ChunkKind::kVariance), values));
  EXPECT_EQ(store.view(0, ChunkKind::kVariance).data_ptr(), store.chunk(v0).payload);
}

TEST_F(ChunkStoreTest, ComputeRefusesMoveAndRelease) {
  ChunkStore store(small_layout(), {{ChunkKind::kParam, at::kHalf}}, host_, device_);
  const ChunkId c = store.chunk_id(ChunkKind::kParam, 0);
  store.allocate(c, Tier::kHost);
  store.set_state(1, ChunkKind::kParam, TensorState::kCompute);
  EXPECT_FALSE(store.is_movable(c));
  for (bool release : {false, true}) {
    try {
      if (release) {
        store.release(c);
      } else {
        store.move(c, Tier::kDevice);
      }
      FAIL() << "expected an error";
    } catch (const c10::Error& e) {
      const std::string msg = e.what();
      EXPECT_THAT(msg, HasSubstr(release ? "cannot release" : "cannot move"));
      EXPECT_THAT(msg, HasSubstr("param chunk 0"));
      EXPECT_THAT(msg, HasSubstr("'layer.b'"));
      EXPECT_THAT(msg, HasSubstr("COMPUTE"));
    }
    EXPECT_EQ(store.tier(c), Tier::kHost);
    EXPECT_EQ(host_.used_bytes(), store.chunk_bytes(c));
    EXPECT_EQ(device_.used_bytes(), 0);
  }
  EXPECT_EQ(store.move_counters().h2d_moves, 0);
  // The other chunk is not pinned.
  const ChunkId other = store.chunk_id(ChunkKind::kParam, 1);
  store.allocate(other, Tier::kHost);
  EXPECT_TRUE(store.move(other, Tier::kDevice));
  // Leaving COMPUTE unpins.
  store.set_state(1, ChunkKind::kParam, TensorState::kHoldAfterFwd);
  EXPECT_TRUE(store.is_movable(c));
  EXPECT_TRUE(store.move(c, Tier::kDevice));
  store.release(c);
  EXPECT_EQ(store.state(1, ChunkKind::kParam), TensorState::kFree);
}

TEST_F(ChunkStoreTest, OutOfMemoryOnMoveAndAllocateChangesNothing) {
  EmulatedDeviceTier small_device(300);  // room for one 256-byte fp32 chunk, not two
  ChunkStore store(small_layout(), {{ChunkKind::kMomentum, at::kFloat}}, host_, small_device);
  const ChunkId c0 = store.chunk_id(ChunkKind::kMomentum, 0);
  const ChunkId c1 = store.chunk_id(ChunkKind::kMomentum, 1);
  store.allocate(c0, Tier::kDevice);
  store.allocate(c1, Tier::kHost);
  store.view(2, ChunkKind::kMomentum).fill_(7.0);
  try {
    store.move(c1, Tier::kDevice);
    FAIL() << "expected an out-of-memory error";
  } catch (const c10::OutOfMemoryError& e) {
    const std::string msg = e.what();
    EXPECT_THAT(msg, HasSubstr("capacity 300 bytes"));
    EXPECT_THAT(msg, HasSubstr("256 bytes in use"));
    EXPECT_THAT(msg, HasSubstr("256 bytes requested"));
  }
  EXPECT_EQ(store.tier(c1), Tier::kHost);
  EXPECT_EQ(store.view(2, ChunkKind::kMomentum).sum().item<float>(), 40 * 7.0f);
  EXPECT_EQ(small_device.used_bytes(), 256);
  EXPECT_EQ(small_device.allocation_count(), 1);
  EXPECT_EQ(host_.used_bytes(), 256);
  EXPECT_EQ(store.move_counters().h2d_moves, 0);

  store.release(c1);
  EXPECT_THROW(store.allocate(c1, Tier::kDevice), c10::OutOfMemoryError);
  EXPECT_EQ(store.tier(c1), Tier::kNone);
  EXPECT_EQ(store.state(2, ChunkKind::kMomentum), TensorState::kFree);
  EXPECT_EQ(small_device.used_bytes(), 256);
  EXPECT_EQ(host_.used_bytes(), 0);

  // Make room the way a scheduler would: evict c0 to the host, then c1 fits.
  store.move(c0, Tier::kHost);
  store.allocate(c1, Tier::kDevice);
  EXPECT_EQ(small_device.used_bytes(), 256);
  EXPECT_EQ(small_device.peak_bytes(), 256);
}

TEST_F(ChunkStoreTest, DestructorReturnsEveryPayload) {
  {
    ChunkStore store(small_layout(),
                     {{ChunkKind::kParam, at::kHalf},
                      {ChunkKind::kParamFp32, at::kFloat},
                      {ChunkKind::kMomentum, at::kFloat},
                      {ChunkKind::kVariance, at::kFloat},
                      {ChunkKind::kGrad, at::kFloat}},
                     host_, device_);
    for (ChunkId id = 0; id < store.chunk_count(); ++id) {
      store.allocate(id, id % 2 == 0 ? Tier::kHost : Tier::kDevice);
    }
    store.set_state(0, ChunkKind::kGrad, TensorState::kCompute);
    EXPECT_GT(host_.used_bytes(), 0);
    EXPECT_GT(device_.used_bytes(), 0);
  }
  EXPECT_EQ(host_.used_bytes(), 0);
  EXPECT_EQ(device_.used_bytes(), 0);
  EXPECT_EQ(host_.allocation_count(), 0);
  EXPECT_EQ(device_.allocation_count(), 0);
}

TEST_F(ChunkStoreTest, OwnerRankFollowsCommGroups) {
  Layout layout(/*world_size=*/2);
  for (int i = 0; i < 3; ++i) layout.add_tensor("t" + std::to_string(i), {64});
  layout.finalize(64);
  ChunkStore store(std::move(layout), {{ChunkKind::kParam, at::kHalf}}, host_, device_);
  EXPECT_EQ(store.chunks_per_kind(), 4);
  EXPECT_EQ(store.owner_rank(store.chunk_id(ChunkKind::kParam, 3)), 1);
  EXPECT_EQ(store.comm_group(store.chunk_id(ChunkKind::kParam, 3)), 1);
  EXPECT_EQ(store.chunk_state(store.chunk_id(ChunkKind::kParam, 3)).total(), 0);
}

// A group buffer: chunks side by side in one block, one slot left to the caller; the block's
// bytes are the chunks' payloads; it goes back to its tier with the last chunk that leaves it
// (released or moved away), and bad requests change nothing.
TEST_F(ChunkStoreTest, ABlockHoldsChunksSideBySideUntilTheLastLeaves) {
  Layout layout;
  for (int i = 0; i < 4; ++i) layout.add_tensor("t" + std::to_string(i), {64});
  layout.finalize(64);
  ChunkStore store(std::move(layout), {{ChunkKind::kParam, at::kHalf}, {ChunkKind::kMomentum, at::kFloat}},
                   host_, device_);
  const ChunkId c0 = store.chunk_id(ChunkKind::kParam, 0);
  const ChunkId c1 = store.chunk_id(ChunkKind::kParam, 1);
  const ChunkId c3 = store.chunk_id(ChunkKind::kParam, 3);
  store.allocate(c1, Tier::kHost);  // this rank's own chunk: its slot stays the caller's
  const std::vector<ChunkId> slots{c0, -1, store.chunk_id(ChunkKind::kParam, 2), c3};
  at::Tensor block = store.allocate_block(slots, Tier::kDevice);
  ASSERT_EQ(block.numel(), 4 * 64);
  EXPECT_EQ(block.scalar_type(), at::kHalf);
  EXPECT_EQ(device_.used_bytes(), 4 * 128);
  EXPECT_EQ(store.live_blocks(), 1);
  EXPECT_EQ(store.tier(c0), Tier::kDevice);
  EXPECT_EQ(store.state(3, ChunkKind::kParam), TensorState::kHold);
  // The block's bytes are the payloads: what a collective writes into slot k is chunk k.
  block.copy_(at::arange(4 * 64, at::kFloat).to(at::kHalf));
  EXPECT_TRUE(at::equal(store.chunk_view(c3), block.narrow(0, 3 * 64, 64)));
  EXPECT_EQ(store.view(0, ChunkKind::kParam)[0].item<float>(), 0.0f);
  // A move copies the chunk out of the block; the block stays while chunks remain in it.
  const at::Tensor expected = store.chunk_view(c3).clone();
  EXPECT_TRUE(store.move(c3, Tier::kHost));
  EXPECT_TRUE(at::equal(store.chunk_view(c3), expected));
  EXPECT_EQ(store.live_blocks(), 1);
  store.release(c0);
  EXPECT_EQ(store.live_blocks(), 1);
  EXPECT_EQ(device_.used_bytes(), 4 * 128);
  store.release(store.chunk_id(ChunkKind::kParam, 2));
  EXPECT_EQ(store.live_blocks(), 0);
  EXPECT_EQ(device_.used_bytes(), 0);
  // Refused, nothing changed: a chunk with a payload, mixed kinds, a repeat, no chunk, no room.
  EXPECT_THROW(store.allocate_block(std::vector<ChunkId>{c0, c1}, Tier::kDevice), c10::Error);
  EXPECT_THROW(store.allocate_block(
                   std::vector<ChunkId>{c0, store.chunk_id(ChunkKind::kMomentum, 0)}, Tier::kDevice),
               c10::Error);
  EXPECT_THROW(store.allocate_block(std::vector<ChunkId>{c0, c0}, Tier::kDevice), c10::Error);
  EXPECT_THROW(store.allocate_block(std::vector<ChunkId>{-1, -1}, Tier::kDevice), c10::Error);
  EmulatedDeviceTier small(3 * 128);
  ChunkStore tight(small_layout(), {{ChunkKind::kParam, at::kHalf}}, host_, small);
  EXPECT_THROW(tight.allocate_block(std::vector<ChunkId>{0, 1, -1, -1}, Tier::kDevice),
               c10::OutOfMemoryError);
  EXPECT_EQ(tight.tier(0), Tier::kNone);
  EXPECT_EQ(small.used_bytes(), 0);
  EXPECT_EQ(store.live_blocks(), 0);
  EXPECT_EQ(store.tier(c0), Tier::kNone);
  // A block is reused after it was freed, and the store's destructor frees one still alive.
  store.allocate_block(std::vector<ChunkId>{c0, -1}, Tier::kHost);
  EXPECT_EQ(store.live_blocks(), 1);
}

// A cut last chunk (one process, Layout::chunk_capacity): its payloads, views, moves and traffic
// are its own size in every kind, and a block refuses to mix it with a full chunk.
TEST_F(ChunkStoreTest, CutLastChunkIsItsOwnSizeEverywhere) {
  Layout layout;
  layout.add_tensor("w", {3000});
  layout.add_tensor("b", {3000});
  layout.finalize(4096);
  ASSERT_EQ(layout.chunk_capacity(1), 3072);
  ChunkStore store(std::move(layout),
                   {{ChunkKind::kParam, at::kHalf}, {ChunkKind::kMomentum, at::kFloat}}, host_,
                   device_);
  const ChunkId p1 = store.chunk_id(ChunkKind::kParam, 1);
  const ChunkId m1 = store.chunk_id(ChunkKind::kMomentum, 1);
  EXPECT_EQ(store.chunk(p1).capacity_elems, 3072);
  EXPECT_EQ(store.chunk_bytes(p1), 3072 * 2);
  EXPECT_EQ(store.chunk_bytes(m1), 3072 * 4);
  EXPECT_EQ(store.chunk_bytes(store.chunk_id(ChunkKind::kParam, 0)), 4096 * 2);
  EXPECT_EQ(store.total_chunk_bytes(), (4096 + 3072) * (2 + 4));
  EXPECT_EQ(store.waste_bytes(), (1096 + 72) * (2 + 4));

  store.allocate(m1, Tier::kHost);
  EXPECT_EQ(host_.used_bytes(), 3072 * 4);
  EXPECT_EQ(store.chunk_view(m1).numel(), 3072);
  store.view(1, ChunkKind::kMomentum).fill_(2.5f);
  store.reset_move_counters();
  store.move(m1, Tier::kDevice);
  EXPECT_EQ(device_.used_bytes(), 3072 * 4);
  EXPECT_EQ(host_.used_bytes(), 0);
  EXPECT_EQ(store.move_counters().h2d_bytes, 3072 * 4);
  EXPECT_TRUE(at::equal(store.view(1, ChunkKind::kMomentum), at::full({3000}, 2.5f)));
  store.release(m1);

  const std::vector<ChunkId> mixed = {store.chunk_id(ChunkKind::kParam, 0), p1};
  EXPECT_THAT(error_of([&] { store.allocate_block(mixed, Tier::kHost); }),
              HasSubstr("a block's slots are equal"));
  EXPECT_EQ(store.tier(mixed[0]), Tier::kNone);  // nothing allocated
  EXPECT_EQ(host_.used_bytes(), 0);
}

}  // namespace chunk_store_test
}  // namespace patrickstar
