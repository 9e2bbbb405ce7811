// ChunkStore: the chunks of every kind over one Layout, their payloads in the tiers, moves between
// host and device, zero-copy tensor views and the per-tensor state machine.
// NOT thread-safe: one thread (the engine's) drives it; only move_counters() may be read from
// any thread. With a copy engine (set_copy_queue: a CopyQueue, or a CudaCopyStream on CUDA), moves
// are asynchronous: move() allocates the destination, queues the copy and returns; the chunk's
// payload is the destination from then on, and every access to its bytes through the store (view,
// chunk_view, entering COMPUTE) first orders the caller after that copy (an error in it surfaces
// there, naming the chunk): a host payload is waited for on the host; a device payload is waited
// for by compute (CopyEngine::order_compute_after: on the host on the emulated device, on the GPU
// on CUDA). A payload a queued copy reads or writes goes back to its tier only once that copy
// completed. The store owns the payloads (freed on release() and in the destructor) but only
// refers to the tiers, which the caller owns and which must outlive the store. Usage:
//
//   patrickstar::HostTier host;
//   patrickstar::EmulatedDeviceTier device(1LL << 30);
//   patrickstar::ChunkStore store(std::move(layout),
//       {{ChunkKind::kParam, at::kHalf}, {ChunkKind::kMomentum, at::kFloat}}, host, device);
//   ChunkId c = store.chunk_id(ChunkKind::kParam, 0);
//   store.allocate(c, Tier::kHost);                       // zero-filled; its tensors become HOLD
//   store.move(c, Tier::kDevice);                         // counted as h2d bytes
//   store.set_state(w, ChunkKind::kParam, TensorState::kCompute);   // pins the chunk
//   at::Tensor weight = store.view(w, ChunkKind::kParam);           // aliases the payload
#pragma once

#include "patrickstar/chunk/copy_queue.h"
#include "patrickstar/chunk/layout.h"
#include "patrickstar/chunk/memory_tier.h"
#include "patrickstar/chunk/tensor_state.h"
#include "patrickstar/chunk/types.h"

#include <ATen/core/Tensor.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

namespace patrickstar {

// The dtype of one chunk kind, e.g. {kParam, kHalf}, {kMomentum, kFloat}.
struct ChunkKindSpec {
  ChunkKind kind;
  at::ScalarType dtype;
};

// One chunk: `capacity_elems` elements of `dtype`, a payload in exactly one tier or none.
struct Chunk {
  ChunkId id = -1;
  ChunkKind kind = ChunkKind::kParam;
  int64_t index = -1;  // position in its kind's list (the Layout's chunk index)
  at::ScalarType dtype = at::kFloat;
  int64_t capacity_elems = 0;
  int64_t bytes = 0;  // capacity_elems * element size: what a payload and every move costs
  Tier tier = Tier::kNone;
  void* payload = nullptr;  // nullptr exactly when tier == kNone
  ChunkStateCounts states;  // its tensors per state, kept in step with set_state()
  CopyEvent ready = 0;      // the queued copy writing the payload (0: none not yet waited for)
  bool omitted = false;     // ChunkStore::omit(): never holds a payload; bytes is 0
};

// Exact traffic since construction or the last reset_move_counters().
struct MoveCounters {
  int64_t h2d_bytes = 0;
  int64_t d2h_bytes = 0;
  int64_t h2d_moves = 0;
  int64_t d2h_moves = 0;
};

enum class Fill : uint8_t { kZero, kUninitialized };

class ChunkStore {
 public:
  // `layout` must be finalized. `kinds` lists each kind once with a dtype in {Half, BFloat16,
  // Float}; chunk ids run kind by kind in this order. `host` must be a host tier and `device` a
  // device tier. Nothing is allocated: every chunk starts released, every tensor FREE.
  ChunkStore(Layout layout, std::vector<ChunkKindSpec> kinds, MemoryTier& host, MemoryTier& device);
  ~ChunkStore();  // gives every payload back to its tier
  ChunkStore(const ChunkStore&) = delete;
  ChunkStore& operator=(const ChunkStore&) = delete;

  const Layout& layout() const { return layout_; }
  const std::vector<ChunkKindSpec>& kinds() const { return kinds_; }
  bool has_kind(ChunkKind kind) const { return kind_slot_[static_cast<int>(kind)] >= 0; }
  at::ScalarType dtype(ChunkKind kind) const;
  MemoryTier& host_tier() const { return host_; }
  MemoryTier& device_tier() const { return device_; }

  // --- chunk ids ---------------------------------------------------------------------------
  int64_t chunks_per_kind() const { return layout_.chunk_count(); }
  int64_t chunk_count() const { return static_cast<int64_t>(chunks_.size()); }  // all kinds
  ChunkId chunk_id(ChunkKind kind, int64_t index) const;
  ChunkKind kind_of(ChunkId id) const { return chunk(id).kind; }
  int64_t index_of(ChunkId id) const { return chunk(id).index; }
  ChunkId chunk_of(TensorId tensor, ChunkKind kind) const;
  const Chunk& chunk(ChunkId id) const;
  // The chunk list of one kind, in index order (its ids are consecutive).
  std::span<const Chunk> chunks(ChunkKind kind) const;
  Tier tier(ChunkId id) const { return chunk(id).tier; }
  int64_t chunk_bytes(ChunkId id) const { return chunk(id).bytes; }
  // The layout's chunk size; a chunk's own is chunk(id).capacity_elems (a last chunk may be cut).
  int64_t chunk_elems() const { return layout_.chunk_elems(); }
  // Sum of chunk_bytes over the chunks whose payload is in `tier`.
  int64_t resident_bytes(Tier tier) const;
  // Bytes of every kind's chunks that hold no tensor: each chunk's capacity minus its tensors'
  // elements, in its kind's dtype (omitted chunks hold nothing and waste nothing).
  int64_t waste_bytes() const;
  // Bytes of every chunk of every kind, resident or not (the model data once all are allocated;
  // omitted chunks count 0).
  int64_t total_chunk_bytes() const;
  // A chunk that will never hold a payload (the engine omits the optimizer-state and gradient
  // chunks of an index whose parameters are all frozen): its bytes become 0, and allocating it, or
  // a view of it, throws c10::Error saying it is omitted. Only a released chunk can be omitted;
  // nothing undoes it.
  void omit(ChunkId id);
  bool omitted(ChunkId id) const { return chunk(id).omitted; }
  // "momentum chunk 3 (id 7)": for error messages and logs.
  std::string describe(ChunkId id) const;

  // Multi-GPU bookkeeping: rank r owns the r-th chunk of every group of world_size chunks.
  int64_t comm_group(ChunkId id) const { return layout_.comm_group(index_of(id)); }
  int64_t owner_rank(ChunkId id) const { return layout_.owner_rank(index_of(id)); }

  // --- payloads ------------------------------------------------------------------------------
  // Gives a released chunk a payload in `tier` (host or device), zero-filled unless `fill` says
  // otherwise; its FREE tensors become HOLD. Throws c10::OutOfMemoryError from the tier (nothing
  // changes then) or c10::Error when the chunk already has a payload.
  void allocate(ChunkId id, Tier tier, Fill fill = Fill::kZero);
  // Gives released chunks of one kind payloads side by side in one new block of `tier` (a group
  // buffer a collective fills in one call): slot k of the block, chunk_bytes each, is ids[k]'s
  // payload; an id of -1 leaves its slot to the caller (what this rank sends, gathered in place).
  // Contents are uninitialized; the chunks' FREE tensors become HOLD. Returns the whole block as a
  // flat tensor of ids.size() x their capacity elements of the kind's dtype, valid while the block
  // lives: it goes back to its tier when the last of its chunks is released or moved away. Throws
  // c10::OutOfMemoryError from the tier (nothing changes) or c10::Error for a chunk that has a
  // payload, chunks of different kinds or sizes, a repeated id, or no chunk at all.
  at::Tensor allocate_block(std::span<const ChunkId> ids, Tier tier);
  // Blocks from allocate_block() still alive.
  int64_t live_blocks() const;

  // --- asynchronous moves --------------------------------------------------------------------
  // Moves go through `queue` from now on (nullptr: synchronous, the default). The queue must
  // outlive the store; switching needs no copy in flight (finish_copies() first).
  void set_copy_queue(CopyEngine* queue);
  CopyEngine* copy_queue() const { return queue_; }
  // Orders the caller after the chunk's last queued copy (throws that copy's error): blocks until
  // it completed for a host payload; for a device payload orders compute after it
  // (CopyEngine::order_compute_after).
  void wait_ready(ChunkId id) const;
  // True when nothing the caller does next can overtake a queued copy writing the chunk's
  // payload: that copy completed, or the caller was ordered after it (wait_ready).
  bool copy_complete(ChunkId id) const;
  // Waits for every queued copy and gives back the payloads they were holding.
  void finish_copies();
  // Payloads waiting for a queued copy before they go back to their tier.
  int64_t pending_frees() const { return static_cast<int64_t>(pending_frees_.size()); }
  // Moves the payload to `tier`, bytes preserved; returns false (no copy) when it is already
  // there. Throws c10::Error naming the chunk and the tensor when a tensor of it is COMPUTE, or
  // when it has no payload; c10::OutOfMemoryError when the target tier is full (nothing changes).
  // Views taken before the move dangle afterwards.
  bool move(ChunkId id, Tier tier);
  // Frees the payload (tier none) and sets every tensor of the chunk FREE. A no-op for a released
  // chunk. Throws c10::Error naming the chunk and the tensor when a tensor of it is COMPUTE.
  void release(ChunkId id);
  // False when any tensor of the chunk is COMPUTE.
  bool is_movable(ChunkId id) const { return chunk(id).states[TensorState::kCompute] == 0; }

  // --- views ---------------------------------------------------------------------------------
  // The tensor's slice of its `kind` chunk with its shape and the kind's dtype, on the tier's
  // device, aliasing the payload (zero-copy). Valid only while the chunk stays where it is: a
  // move or release leaves it dangling. Throws c10::Error when the chunk has no payload.
  at::Tensor view(TensorId tensor, ChunkKind kind) const;
  // The whole payload as a flat tensor of its capacity_elems (for the optimizer).
  at::Tensor chunk_view(ChunkId id) const;

  // --- tensor states -------------------------------------------------------------------------
  TensorState state(TensorId tensor, ChunkKind kind) const;
  // Applies one transition of the table in tensor_state.h. Throws c10::Error naming the tensor,
  // its chunk and both states for an illegal one; entering COMPUTE also needs a payload.
  void set_state(TensorId tensor, ChunkKind kind, TensorState to);
  // The chunk's state, derived from its tensors.
  const ChunkStateCounts& chunk_state(ChunkId id) const { return chunk(id).states; }

  // --- traffic (thread-safe) -----------------------------------------------------------------
  MoveCounters move_counters() const;
  void reset_move_counters();

 private:
  int slot(ChunkKind kind) const;
  Chunk& mutable_chunk(ChunkId id);
  MemoryTier& memory(Tier tier) const;
  // Throws when a tensor of the chunk is COMPUTE; `action` is "move" or "release".
  void check_not_in_compute(const Chunk& c, const char* action) const;
  at::Tensor make_view(const Chunk& c, int64_t offset_elems, c10::IntArrayRef sizes) const;
  // FREE tensors of a chunk that just got a payload become HOLD.
  void hold_free_tensors(Chunk& c);
  // Gives the chunk's payload back: to its tier, or to its block (freed with its last chunk); once
  // copy `after` (and the copy writing it) completed when they are still queued.
  void free_payload(Chunk& c, CopyEvent after = 0);
  // Returns the memory of a payload or a block entry now.
  void free_now(Tier tier, void* memory, int64_t block);
  // Frees what waited for copies that have completed (all of them when `wait`, waiting first).
  void collect_pending_frees(bool wait);
  // tier.allocate(bytes); when the tier is full and payloads wait for copies, waits for those and
  // tries once more.
  void* allocate_in(Tier tier, int64_t bytes);
  void wait_ready(const Chunk& c) const;

  struct PendingFree {
    CopyEvent event = 0;
    Tier tier = Tier::kNone;
    void* memory = nullptr;  // a payload of its own, or
    int64_t block = -1;      // its chunk's block entry (one reference)
  };

  // A block of chunk payloads from allocate_block(): freed when `refs` (its chunks still in it)
  // reaches 0.
  struct Block {
    void* memory = nullptr;
    Tier tier = Tier::kNone;
    int64_t refs = 0;
  };

  Layout layout_;
  std::vector<ChunkKindSpec> kinds_;
  std::array<int, kChunkKindCount> kind_slot_{};  // kind -> position in kinds_, or -1
  MemoryTier& host_;
  MemoryTier& device_;
  std::vector<Chunk> chunks_;                     // id = slot * chunks_per_kind + index
  std::vector<std::vector<TensorState>> states_;  // [slot][tensor]
  std::vector<Block> blocks_;                     // entries with memory == nullptr are free
  std::vector<int64_t> block_of_;                 // per chunk id: its block in blocks_, or -1
  CopyEngine* queue_ = nullptr;                   // asynchronous moves (not owned)
  std::vector<PendingFree> pending_frees_;

  std::atomic<int64_t> h2d_bytes_{0};
  std::atomic<int64_t> d2h_bytes_{0};
  std::atomic<int64_t> h2d_moves_{0};
  std::atomic<int64_t> d2h_moves_{0};
};

}  // namespace patrickstar
