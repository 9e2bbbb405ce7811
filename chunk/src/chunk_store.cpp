#include "patrickstar/chunk/chunk_store.h"

#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <exception>
#include <utility>

namespace patrickstar {

namespace {
int state_index(TensorState s) {
  return static_cast<int>(s);
}
}  // namespace

ChunkStore::ChunkStore(Layout layout, std::vector<ChunkKindSpec> kinds, MemoryTier& host,
                       MemoryTier& device)
    : layout_(std::move(layout)), kinds_(std::move(kinds)), host_(host), device_(device) {
  TORCH_CHECK(layout_.finalized(),
              "ChunkStore needs a finalized Layout: call finalize() or finalize_search() first");
  TORCH_CHECK(!kinds_.empty(), "ChunkStore needs at least one chunk kind");
  TORCH_CHECK(host_.kind() == Tier::kHost, "ChunkStore: the host tier argument is tier '",
              host_.name(), "' of kind ", to_string(host_.kind()));
  TORCH_CHECK(device_.kind() == Tier::kDevice, "ChunkStore: the device tier argument is tier '",
              device_.name(), "' of kind ", to_string(device_.kind()));
  kind_slot_.fill(-1);
  for (size_t s = 0; s < kinds_.size(); ++s) {
    const ChunkKindSpec& spec = kinds_[s];
    const int k = static_cast<int>(spec.kind);
    TORCH_CHECK(k >= 0 && k < kChunkKindCount, "ChunkStore: unknown chunk kind ", k);
    TORCH_CHECK(kind_slot_[k] < 0, "ChunkStore: chunk kind ", to_string(spec.kind),
                " listed twice");
    chunk_element_bytes(spec.dtype);  // throws for an unsupported dtype
    kind_slot_[k] = static_cast<int>(s);
  }

  const int64_t per_kind = layout_.chunk_count();
  chunks_.resize(kinds_.size() * static_cast<size_t>(per_kind));
  block_of_.assign(chunks_.size(), -1);
  for (size_t s = 0; s < kinds_.size(); ++s) {
    for (int64_t i = 0; i < per_kind; ++i) {
      const ChunkId id = static_cast<int64_t>(s) * per_kind + i;
      Chunk& c = chunks_[static_cast<size_t>(id)];
      c.id = id;
      c.kind = kinds_[s].kind;
      c.index = i;
      c.dtype = kinds_[s].dtype;
      c.capacity_elems = layout_.chunk_capacity(i);
      c.bytes = c.capacity_elems * chunk_element_bytes(c.dtype);
      c.states.counts[state_index(TensorState::kFree)] =
          static_cast<int64_t>(layout_.tensors_in_chunk(i).size());
    }
  }
  states_.assign(
      kinds_.size(),
      std::vector<TensorState>(static_cast<size_t>(layout_.tensor_count()), TensorState::kFree));
}

ChunkStore::~ChunkStore() {
  if (queue_ != nullptr) {
    try {
      queue_->drain();
    } catch (const std::exception&) {
      // A failed copy was reported at its wait, or nobody waits any more: the memory goes anyway.
    }
  }
  for (const PendingFree& f : pending_frees_) free_now(f.tier, f.memory, f.block);
  pending_frees_.clear();
  for (Chunk& c : chunks_) {
    if (c.payload != nullptr && block_of_[static_cast<size_t>(c.id)] < 0) {
      memory(c.tier).deallocate(c.payload);
    }
  }
  for (Block& b : blocks_) {
    if (b.memory != nullptr) memory(b.tier).deallocate(b.memory);
  }
}

int ChunkStore::slot(ChunkKind kind) const {
  const int k = static_cast<int>(kind);
  const int s = (k >= 0 && k < kChunkKindCount) ? kind_slot_[k] : -1;
  TORCH_CHECK(s >= 0, "ChunkStore: chunk kind ", to_string(kind),
              " is not held by this store (it was not listed at construction)");
  return s;
}

at::ScalarType ChunkStore::dtype(ChunkKind kind) const {
  return kinds_[static_cast<size_t>(slot(kind))].dtype;
}

ChunkId ChunkStore::chunk_id(ChunkKind kind, int64_t index) const {
  const int s = slot(kind);
  TORCH_CHECK(index >= 0 && index < chunks_per_kind(), "ChunkStore: ", to_string(kind),
              " chunk index ", index, " out of range [0, ", chunks_per_kind(), ")");
  return static_cast<int64_t>(s) * chunks_per_kind() + index;
}

ChunkId ChunkStore::chunk_of(TensorId tensor, ChunkKind kind) const {
  return chunk_id(kind, layout_.placement(tensor).chunk_index);
}

const Chunk& ChunkStore::chunk(ChunkId id) const {
  TORCH_CHECK(id >= 0 && id < chunk_count(), "ChunkStore: chunk id ", id, " out of range [0, ",
              chunk_count(), ")");
  return chunks_[static_cast<size_t>(id)];
}

std::span<const Chunk> ChunkStore::chunks(ChunkKind kind) const {
  const size_t begin = static_cast<size_t>(slot(kind)) * static_cast<size_t>(chunks_per_kind());
  return std::span<const Chunk>(chunks_.data() + begin, static_cast<size_t>(chunks_per_kind()));
}

Chunk& ChunkStore::mutable_chunk(ChunkId id) {
  return const_cast<Chunk&>(chunk(id));
}

MemoryTier& ChunkStore::memory(Tier tier) const {
  TORCH_CHECK(tier == Tier::kHost || tier == Tier::kDevice,
              "ChunkStore: a payload lives on host or device, not ", to_string(tier));
  return tier == Tier::kHost ? host_ : device_;
}

std::string ChunkStore::describe(ChunkId id) const {
  const Chunk& c = chunk(id);
  return std::string(to_string(c.kind)) + " chunk " + std::to_string(c.index) + " (id " +
         std::to_string(c.id) + ")";
}

int64_t ChunkStore::resident_bytes(Tier tier) const {
  int64_t bytes = 0;
  for (const Chunk& c : chunks_) {
    if (c.tier == tier) bytes += c.bytes;
  }
  return bytes;
}

int64_t ChunkStore::waste_bytes() const {
  int64_t bytes = 0;
  for (const Chunk& c : chunks_) {
    if (c.omitted) continue;
    bytes += (c.capacity_elems - layout_.used_elems(c.index)) * chunk_element_bytes(c.dtype);
  }
  return bytes;
}

void ChunkStore::omit(ChunkId id) {
  Chunk& c = mutable_chunk(id);
  TORCH_CHECK(c.tier == Tier::kNone, "ChunkStore: cannot omit ", describe(id),
              ": it has a payload on ", to_string(c.tier));
  c.omitted = true;
  c.bytes = 0;
}

int64_t ChunkStore::total_chunk_bytes() const {
  int64_t bytes = 0;
  for (const Chunk& c : chunks_) bytes += c.bytes;
  return bytes;
}

void ChunkStore::check_not_in_compute(const Chunk& c, const char* action) const {
  if (c.states[TensorState::kCompute] == 0) return;
  const auto& states = states_[static_cast<size_t>(slot(c.kind))];
  for (TensorId t : layout_.tensors_in_chunk(c.index)) {
    if (states[static_cast<size_t>(t)] == TensorState::kCompute) {
      TORCH_CHECK(false, "ChunkStore: cannot ", action, " ", describe(c.id), ": tensor '",
                  layout_.name(t), "' (id ", t, ") is COMPUTE (", c.states[TensorState::kCompute],
                  " tensors of the chunk are); leave COMPUTE first");
    }
  }
  TORCH_INTERNAL_ASSERT(false, "state counts of ", describe(c.id), " disagree with its tensors");
}

void ChunkStore::allocate(ChunkId id, Tier tier, Fill fill) {
  Chunk& c = mutable_chunk(id);
  TORCH_CHECK(!c.omitted, "ChunkStore: cannot allocate ", describe(id),
              ": it is omitted (it never holds a payload)");
  TORCH_CHECK(c.tier == Tier::kNone, "ChunkStore: cannot allocate ", describe(id),
              ": it already has a payload on ", to_string(c.tier));
  MemoryTier& target = memory(tier);
  collect_pending_frees(/*wait=*/false);
  void* payload = allocate_in(tier, c.bytes);  // may throw OOM: nothing changed yet
  if (fill == Fill::kZero) target.fill_zero(payload, c.bytes);
  c.payload = payload;
  c.tier = tier;
  c.ready = 0;
  hold_free_tensors(c);
}

void ChunkStore::hold_free_tensors(Chunk& c) {
  auto& states = states_[static_cast<size_t>(slot(c.kind))];
  for (TensorId t : layout_.tensors_in_chunk(c.index)) {
    auto& s = states[static_cast<size_t>(t)];
    if (s == TensorState::kFree) {
      s = TensorState::kHold;
      --c.states.counts[state_index(TensorState::kFree)];
      ++c.states.counts[state_index(TensorState::kHold)];
    }
  }
}

at::Tensor ChunkStore::allocate_block(std::span<const ChunkId> ids, Tier tier) {
  const Chunk* first = nullptr;
  for (size_t k = 0; k < ids.size(); ++k) {
    if (ids[k] < 0) continue;
    const Chunk& c = chunk(ids[k]);
    TORCH_CHECK(!c.omitted, "ChunkStore: cannot allocate ", describe(c.id),
                " in a block: it is omitted (it never holds a payload)");
    TORCH_CHECK(c.tier == Tier::kNone, "ChunkStore: cannot allocate ", describe(c.id),
                " in a block: it already has a payload on ", to_string(c.tier));
    TORCH_CHECK(first == nullptr || c.kind == first->kind, "ChunkStore: a block holds chunks of one kind; ",
                describe(c.id), " and ", describe(first->id), " differ");
    TORCH_CHECK(first == nullptr || c.bytes == first->bytes,
                "ChunkStore: a block's slots are equal; ", describe(c.id), " has ", c.bytes,
                " bytes and ", describe(first->id), " ",
                first->bytes, " (a cut last chunk belongs to one process only)");
    for (size_t j = 0; j < k; ++j) {
      TORCH_CHECK(ids[j] != ids[k], "ChunkStore: ", describe(c.id), " appears twice in a block");
    }
    if (first == nullptr) first = &c;
  }
  TORCH_CHECK(first != nullptr, "ChunkStore: a block needs at least one chunk");
  MemoryTier& target = memory(tier);
  const int64_t slots = static_cast<int64_t>(ids.size());
  collect_pending_frees(/*wait=*/false);
  void* block = allocate_in(tier, slots * first->bytes);  // may throw OOM: nothing changed yet
  size_t entry = 0;
  while (entry < blocks_.size() && blocks_[entry].memory != nullptr) ++entry;
  if (entry == blocks_.size()) blocks_.emplace_back();
  Block& b = blocks_[entry];
  b = Block{block, tier, 0};
  for (size_t k = 0; k < ids.size(); ++k) {
    if (ids[k] < 0) continue;
    Chunk& c = mutable_chunk(ids[k]);
    c.payload = static_cast<char*>(block) + static_cast<int64_t>(k) * c.bytes;
    c.tier = tier;
    c.ready = 0;
    block_of_[static_cast<size_t>(c.id)] = static_cast<int64_t>(entry);
    ++b.refs;
    hold_free_tensors(c);
  }
  return at::from_blob(block, {slots * first->capacity_elems},
                       at::TensorOptions().dtype(first->dtype).device(target.device()));
}

int64_t ChunkStore::live_blocks() const {
  int64_t n = 0;
  for (const Block& b : blocks_) n += b.memory != nullptr ? 1 : 0;
  return n;
}

void ChunkStore::free_now(Tier tier, void* memory_ptr, int64_t block) {
  if (block < 0) {
    memory(tier).deallocate(memory_ptr);
    return;
  }
  Block& b = blocks_[static_cast<size_t>(block)];
  if (--b.refs == 0) {
    memory(b.tier).deallocate(b.memory);
    b.memory = nullptr;
  }
}

void ChunkStore::free_payload(Chunk& c, CopyEvent after) {
  int64_t& entry = block_of_[static_cast<size_t>(c.id)];
  after = std::max(after, c.ready);
  if (queue_ != nullptr && after > 0 && !queue_->done(after)) {
    pending_frees_.push_back(PendingFree{after, c.tier, entry < 0 ? c.payload : nullptr, entry});
  } else {
    free_now(c.tier, c.payload, entry);
  }
  entry = -1;
  c.payload = nullptr;
  c.ready = 0;
}

void ChunkStore::collect_pending_frees(bool wait) {
  if (pending_frees_.empty()) return;
  if (wait) {
    CopyEvent last = 0;
    for (const PendingFree& f : pending_frees_) last = std::max(last, f.event);
    queue_->wait(last);
  }
  size_t kept = 0;
  for (size_t i = 0; i < pending_frees_.size(); ++i) {
    const PendingFree& f = pending_frees_[i];
    if (queue_->done(f.event)) {
      free_now(f.tier, f.memory, f.block);
    } else {
      pending_frees_[kept++] = f;
    }
  }
  pending_frees_.resize(kept);
}

void* ChunkStore::allocate_in(Tier tier, int64_t bytes) {
  MemoryTier& target = memory(tier);
  try {
    return target.allocate(bytes);
  } catch (const c10::OutOfMemoryError&) {
    bool waiting = false;
    for (const PendingFree& f : pending_frees_) waiting = waiting || f.tier == tier;
    if (!waiting) throw;
  }
  collect_pending_frees(/*wait=*/true);  // the copies reading them finish; their memory returns
  return target.allocate(bytes);
}

void ChunkStore::set_copy_queue(CopyEngine* queue) {
  if (queue == queue_) return;
  finish_copies();
  queue_ = queue;
}

void ChunkStore::finish_copies() {
  if (queue_ == nullptr) return;
  queue_->drain();
  collect_pending_frees(/*wait=*/false);
  for (Chunk& c : chunks_) c.ready = 0;
}

void ChunkStore::wait_ready(const Chunk& c) const {
  if (queue_ == nullptr || c.ready == 0) return;
  // A device payload's readers are compute (kernels on CUDA, which may wait on the GPU); a host
  // payload's are host code.
  if (c.tier == Tier::kDevice) {
    queue_->order_compute_after(c.ready);
  } else {
    queue_->wait(c.ready);
  }
  const_cast<Chunk&>(c).ready = 0;  // an element of the (non-const) chunk list
}

void ChunkStore::wait_ready(ChunkId id) const {
  wait_ready(chunk(id));
}

bool ChunkStore::copy_complete(ChunkId id) const {
  const Chunk& c = chunk(id);
  return queue_ == nullptr || c.ready == 0 || queue_->done(c.ready);
}

bool ChunkStore::move(ChunkId id, Tier tier) {
  Chunk& c = mutable_chunk(id);
  TORCH_CHECK(tier != Tier::kNone, "ChunkStore: cannot move ", describe(id),
              " to tier none; use release()");
  TORCH_CHECK(c.tier != Tier::kNone, "ChunkStore: cannot move ", describe(id), " to ",
              to_string(tier), ": it has no payload; allocate() it first");
  if (c.tier == tier) return false;
  check_not_in_compute(c, "move");
  MemoryTier& to = memory(tier);
  collect_pending_frees(/*wait=*/false);
  void* payload = allocate_in(tier, c.bytes);  // may throw OOM: nothing changed yet
  const CopyDirection direction =
      tier == Tier::kDevice ? CopyDirection::kHostToDevice : CopyDirection::kDeviceToHost;
  CopyEvent event = 0;
  try {
    if (queue_ == nullptr) {
      device_.copy(payload, c.payload, c.bytes, direction);
    } else {
      // After the copy writing the source, if any (the queue runs copies in order).
      event = queue_->submit_copy(
          device_, payload, c.payload, c.bytes, direction,
          describe(id) + (tier == Tier::kDevice ? " to the device" : " to the host"));
    }
  } catch (...) {
    to.deallocate(payload);
    throw;
  }
  free_payload(c, event);  // the source goes back once the copy reading it completed
  c.payload = payload;
  c.ready = event;
  c.tier = tier;
  if (direction == CopyDirection::kHostToDevice) {
    h2d_bytes_.fetch_add(c.bytes, std::memory_order_relaxed);
    h2d_moves_.fetch_add(1, std::memory_order_relaxed);
  } else {
    d2h_bytes_.fetch_add(c.bytes, std::memory_order_relaxed);
    d2h_moves_.fetch_add(1, std::memory_order_relaxed);
  }
  return true;
}

void ChunkStore::release(ChunkId id) {
  Chunk& c = mutable_chunk(id);
  if (c.tier == Tier::kNone) return;
  check_not_in_compute(c, "release");
  collect_pending_frees(/*wait=*/false);
  free_payload(c);
  c.tier = Tier::kNone;
  auto& states = states_[static_cast<size_t>(slot(c.kind))];
  for (TensorId t : layout_.tensors_in_chunk(c.index))
    states[static_cast<size_t>(t)] = TensorState::kFree;
  c.states = ChunkStateCounts{};
  c.states.counts[state_index(TensorState::kFree)] =
      static_cast<int64_t>(layout_.tensors_in_chunk(c.index).size());
}

at::Tensor ChunkStore::make_view(const Chunk& c, int64_t offset_elems,
                                 c10::IntArrayRef sizes) const {
  char* base = static_cast<char*>(c.payload) + offset_elems * chunk_element_bytes(c.dtype);
  return at::from_blob(base, sizes,
                       at::TensorOptions().dtype(c.dtype).device(memory(c.tier).device()));
}

at::Tensor ChunkStore::view(TensorId tensor, ChunkKind kind) const {
  const TensorPlacement& p = layout_.placement(tensor);
  const Chunk& c = chunk(chunk_id(kind, p.chunk_index));
  TORCH_CHECK(c.payload != nullptr, "ChunkStore: no view of tensor '", layout_.name(tensor),
              "' (id ", tensor, "): its ", describe(c.id),
              c.omitted ? " is omitted (it never holds a payload)"
                        : " has no payload (released); allocate or move it first");
  wait_ready(c);
  return make_view(c, p.offset_elems, layout_.sizes(tensor));
}

at::Tensor ChunkStore::chunk_view(ChunkId id) const {
  const Chunk& c = chunk(id);
  TORCH_CHECK(c.payload != nullptr, "ChunkStore: no view of ", describe(id),
              c.omitted ? ": it is omitted (it never holds a payload)"
                        : ": it has no payload (released); allocate or move it first");
  wait_ready(c);
  return make_view(c, 0, {c.capacity_elems});
}

TensorState ChunkStore::state(TensorId tensor, ChunkKind kind) const {
  const auto& states = states_[static_cast<size_t>(slot(kind))];
  TORCH_CHECK(tensor >= 0 && tensor < layout_.tensor_count(), "ChunkStore: tensor id ", tensor,
              " out of range [0, ", layout_.tensor_count(), ")");
  return states[static_cast<size_t>(tensor)];
}

void ChunkStore::set_state(TensorId tensor, ChunkKind kind, TensorState to) {
  const TensorState from = state(tensor, kind);
  Chunk& c = mutable_chunk(chunk_of(tensor, kind));
  TORCH_CHECK(is_legal_transition(from, to), "ChunkStore: illegal state transition of tensor '",
              layout_.name(tensor), "' (id ", tensor, ") in ", describe(c.id), ": ",
              to_string(from), " -> ", to_string(to));
  TORCH_CHECK(to != TensorState::kCompute || c.payload != nullptr, "ChunkStore: tensor '",
              layout_.name(tensor), "' (id ", tensor, ") cannot enter COMPUTE from ",
              to_string(from), ": its ", describe(c.id), " has no payload");
  if (to == TensorState::kCompute) wait_ready(c);  // compute reads what the copy wrote
  states_[static_cast<size_t>(slot(kind))][static_cast<size_t>(tensor)] = to;
  --c.states.counts[state_index(from)];
  ++c.states.counts[state_index(to)];
}

MoveCounters ChunkStore::move_counters() const {
  MoveCounters m;
  m.h2d_bytes = h2d_bytes_.load(std::memory_order_relaxed);
  m.d2h_bytes = d2h_bytes_.load(std::memory_order_relaxed);
  m.h2d_moves = h2d_moves_.load(std::memory_order_relaxed);
  m.d2h_moves = d2h_moves_.load(std::memory_order_relaxed);
  return m;
}

void ChunkStore::reset_move_counters() {
  h2d_bytes_.store(0, std::memory_order_relaxed);
  d2h_bytes_.store(0, std::memory_order_relaxed);
  h2d_moves_.store(0, std::memory_order_relaxed);
  d2h_moves_.store(0, std::memory_order_relaxed);
}

}  // namespace patrickstar
