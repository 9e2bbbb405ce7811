#include "disk_states.h"

#include "scope_timer.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <system_error>

#include <c10/util/Exception.h>

namespace patrickstar::engine_detail {

DiskStates::DiskStates(const std::string& folder, ChunkStore& store, std::vector<ChunkKind> kinds)
    : files_(folder),
      store_(store),
      kinds_(std::move(kinds)),
      on_disk_(static_cast<size_t>(store.chunks_per_kind()), 0) {}

DiskStates::~DiskStates() {
  for (auto& [index, s] : staging_) {
    if (s.io.valid()) s.io.wait();
  }
  for (auto& [index, s] : staging_) {
    try {
      release(index);
    } catch (const std::exception&) {
      // The store frees what is left when it goes.
    }
  }
}

bool DiskStates::is_disk_kind(ChunkKind kind) const {
  return std::find(kinds_.begin(), kinds_.end(), kind) != kinds_.end();
}

int64_t DiskStates::index_bytes(int64_t index) const {
  int64_t bytes = 0;
  for (ChunkKind kind : kinds_) bytes += store_.chunk_bytes(store_.chunk_id(kind, index));
  return bytes;
}

int64_t DiskStates::disk_bytes() const {
  int64_t bytes = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(on_disk_.size()); ++i) {
    if (on_disk(i)) bytes += index_bytes(i);
  }
  return bytes;
}

void DiskStates::check_files() const {
  for (int64_t i = 0; i < static_cast<int64_t>(on_disk_.size()); ++i) {
    if (!on_disk(i)) continue;
    for (ChunkKind kind : kinds_) files_.check(kind, i, store_.chunk_bytes(store_.chunk_id(kind, i)));
  }
}

void DiskStates::allocate(int64_t index) {
  std::vector<ChunkId> done;
  try {
    for (ChunkKind kind : kinds_) {
      const ChunkId id = store_.chunk_id(kind, index);
      store_.allocate(id, Tier::kHost, Fill::kUninitialized);
      done.push_back(id);
    }
  } catch (...) {
    for (ChunkId id : done) store_.release(id);
    throw;
  }
}

void DiskStates::release(int64_t index) {
  for (ChunkKind kind : kinds_) store_.release(store_.chunk_id(kind, index));
}

std::vector<DiskStates::Buffer> DiskStates::buffers(int64_t index) const {
  std::vector<Buffer> out;
  for (ChunkKind kind : kinds_) {
    const Chunk& c = store_.chunk(store_.chunk_id(kind, index));
    out.push_back({kind, c.payload, c.bytes});
  }
  return out;
}

void DiskStates::read_all(int64_t index, const std::vector<Buffer>& to) const {
  for (const Buffer& b : to) files_.read(b.kind, index, b.data, b.bytes);
}

void DiskStates::write_all(int64_t index, const std::vector<Buffer>& from) {
  for (const Buffer& b : from) files_.write(b.kind, index, b.data, b.bytes);
}

void DiskStates::keep_in_memory(int64_t index) {
  for (ChunkKind kind : kinds_) files_.remove(kind, index);
  on_disk_[static_cast<size_t>(index)] = 0;
}

void DiskStates::spill(int64_t index) {
  TORCH_INTERNAL_ASSERT(!on_disk(index) && !staged(index));
  for (ChunkKind kind : kinds_) store_.wait_ready(store_.chunk_id(kind, index));
  write_all(index, buffers(index));
  release(index);
  on_disk_[static_cast<size_t>(index)] = 1;
}

void DiskStates::bring_home(int64_t index) {
  if (!on_disk(index)) return;
  stage(index);
  staging_.erase(index);  // the payloads stay: the index lives in memory from now on
  keep_in_memory(index);
}

bool DiskStates::wait_io(int64_t index) {
  auto it = staging_.find(index);
  if (it == staging_.end()) return false;
  if (!it->second.io.valid()) return true;
  std::future<void> io = std::move(it->second.io);
  const bool writing = it->second.writing;
  it->second.writing = false;
  try {
    ScopeTimer timer(waited_seconds_);
    io.get();
  } catch (const std::exception& e) {
    staging_.erase(it);
    if (writing) {
      // The file keeps the old states (writes replace a file only once complete) and the payloads
      // hold the new ones: the index stays in memory for good, its files go, and training goes on.
      keep_in_memory(index);
      TORCH_WARN("patrickstar: the disk tier could not write the optimizer states of chunk index ",
                 index, " (", e.what(), "); they stay in host memory from now on");
      return false;
    }
    // A failed read leaves the payloads without the states: they go, and the error surfaces here.
    release(index);
    throw;
  }
  return true;
}

void DiskStates::allocate_or_settle(int64_t index) {
  try {
    allocate(index);
  } catch (const c10::OutOfMemoryError&) {
    if (!std::any_of(staging_.begin(), staging_.end(), [](const auto& e) { return e.second.writing; })) {
      throw;
    }
    settle_writes();  // the write behind's payloads go back to the host tier first
    allocate(index);
  }
}

void DiskStates::stage(int64_t index) {
  TORCH_INTERNAL_ASSERT(on_disk(index), "patrickstar: internal: chunk index ", index,
                        " is not on disk");
  if (view_index_ == index) finish_views();  // its payloads are staged here as a whole
  if (staged(index)) {
    wait_io(index);  // a read ahead arrives, or a write behind completes (the payloads keep it)
    return;
  }
  allocate_or_settle(index);
  try {
    ScopeTimer timer(waited_seconds_);
    read_all(index, buffers(index));
  } catch (...) {
    release(index);
    throw;
  }
  staging_[index] = Staging{};
}

void DiskStates::read_ahead(int64_t index) {
  if (!on_disk(index) || staged(index) || view_index_ == index) return;
  try {
    allocate(index);
  } catch (const c10::OutOfMemoryError&) {
    return;  // no room now: stage() reads it when it is needed
  }
  Staging s;
  try {
    // The I/O thread gets the payloads' addresses, not the store (which is the engine thread's).
    s.io = std::async(std::launch::async,
                      [this, index, to = buffers(index)] { read_all(index, to); });
  } catch (...) {
    release(index);  // no thread: stage() reads it when it is needed
    return;
  }
  staging_[index] = std::move(s);
}

void DiskStates::unstage(int64_t index, bool write_back) {
  if (!staged(index)) return;
  if (!wait_io(index)) return;  // a write that failed left the index in memory
  if (!write_back) {
    staging_.erase(index);
    release(index);
    return;
  }
  // One write behind at a time: the host holds the index being updated, the one read ahead and
  // the one being written, at most.
  settle_writes();
  Staging& s = staging_[index];
  s.writing = true;
  try {
    s.io = std::async(std::launch::async,
                      [this, index, from = buffers(index)] { write_all(index, from); });
  } catch (const std::system_error&) {
    // No thread to write behind: written here.
    s.writing = false;
    std::promise<void> done;
    try {
      write_all(index, buffers(index));
      done.set_value();
    } catch (...) {
      done.set_exception(std::current_exception());
    }
    s.writing = true;
    s.io = done.get_future();
  }
}

void DiskStates::settle_writes() {
  std::vector<int64_t> written;
  for (auto& [index, s] : staging_) {
    if (s.writing) written.push_back(index);
  }
  for (int64_t index : written) {
    if (!wait_io(index)) continue;  // the write failed: the index stays in memory
    staging_.erase(index);
    release(index);
  }
}

void DiskStates::drain() {
  std::exception_ptr first;
  std::vector<int64_t> indices;
  for (const auto& [index, s] : staging_) indices.push_back(index);
  for (int64_t index : indices) {
    try {
      if (!wait_io(index)) continue;  // gone (a failed read) or kept in memory (a failed write)
    } catch (...) {
      if (!first) first = std::current_exception();
      continue;
    }
    staging_.erase(index);
    release(index);
  }
  if (first) std::rethrow_exception(first);
}

at::Tensor DiskStates::view(TensorId tensor, ChunkKind kind, bool write) {
  const int64_t index = store_.layout().placement(tensor).chunk_index;
  if (!is_disk_kind(kind) || !on_disk(index)) return store_.view(tensor, kind);
  if (view_index_ != index) {
    finish_views();
    view_index_ = index;
  }
  // Only the kinds asked for are read (fp32_state_dict and teardown read the masters alone).
  const auto bit = static_cast<uint32_t>(1u << static_cast<unsigned>(kind));
  if ((view_kinds_ & bit) == 0) {
    const ChunkId id = store_.chunk_id(kind, index);
    store_.allocate(id, Tier::kHost, Fill::kUninitialized);
    try {
      ScopeTimer timer(waited_seconds_);
      files_.read(kind, index, store_.chunk(id).payload, store_.chunk_bytes(id));
    } catch (...) {
      store_.release(id);
      throw;
    }
    view_kinds_ |= bit;
  }
  if (write) view_dirty_ |= bit;
  return store_.view(tensor, kind);
}

void DiskStates::finish_views() {
  if (view_index_ < 0) return;
  const int64_t index = view_index_;
  const uint32_t kinds = view_kinds_;
  const uint32_t dirty = view_dirty_;
  view_index_ = -1;
  view_kinds_ = 0;
  view_dirty_ = 0;
  std::exception_ptr failed;
  for (ChunkKind kind : kinds_) {
    const auto bit = static_cast<uint32_t>(1u << static_cast<unsigned>(kind));
    if ((kinds & bit) == 0) continue;
    const ChunkId id = store_.chunk_id(kind, index);
    if ((dirty & bit) != 0 && !failed) {
      try {
        ScopeTimer timer(waited_seconds_);
        files_.write(kind, index, store_.chunk(id).payload, store_.chunk_bytes(id));
      } catch (...) {
        failed = std::current_exception();
      }
    }
    store_.release(id);
  }
  if (failed) std::rethrow_exception(failed);
}

}  // namespace patrickstar::engine_detail
