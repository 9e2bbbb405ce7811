// DiskStates: the engine's disk tier. The optimizer states (fp32 master in mixed precision,
// momentum, variance) of every chunk index go to files (ChunkFiles) at registration; an index
// stays there until a placement puts its Adam on the device, and comes into host payloads of the
// store only while something uses it: the host Adam (one index at a time, the next one read ahead
// and the last one written behind on I/O threads), checkpoints, fp32_state_dict,
// GatheredParameters and teardown (one index at a time through view()).
//
// An index's state chunks are either on disk (released in the store; `staged` when payloads hold
// them for a while) or in memory for good: brought home when a placement put its Adam on the
// device (a later placement may run it on the host again; the states stay in memory), or kept
// there after a write behind failed.
// The engine's thread drives it; only the file I/O runs on other threads. Private to engine/.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "patrickstar/chunk/chunk_files.h"
#include "patrickstar/chunk/chunk_store.h"
#include "patrickstar/optimizer/hybrid_adam.h"

namespace patrickstar::engine_detail {

class DiskStates {
 public:
  // `kinds`: the state kinds that live on disk. Nothing is on disk until spill().
  DiskStates(const std::string& folder, ChunkStore& store, std::vector<ChunkKind> kinds);
  ~DiskStates();  // waits for I/O in flight and releases what is staged
  DiskStates(const DiskStates&) = delete;
  DiskStates& operator=(const DiskStates&) = delete;

  const std::vector<ChunkKind>& kinds() const { return kinds_; }
  bool is_disk_kind(ChunkKind kind) const;
  bool on_disk(int64_t index) const { return on_disk_[static_cast<size_t>(index)] != 0; }
  bool staged(int64_t index) const { return staging_.count(index) != 0; }
  // Bytes of the state chunks on disk (every kind, every index there).
  int64_t disk_bytes() const;
  // Host bytes that staging one index takes (its state chunks).
  int64_t index_bytes(int64_t index) const;
  const ChunkFiles& files() const { return files_; }
  // Seconds the engine's thread waited for the disk (reads it needed, writes it had to finish).
  double waited_seconds() const { return waited_seconds_; }

  // Throws when a file of an index on disk is missing or short (before a step changes anything).
  void check_files() const;
  // Registration: the index's state payloads are on the host with their first values; they are
  // written to their files and released.
  void spill(int64_t index);
  // The index's states come into host payloads for good and their files go (its Adam moves to
  // the device).
  void bring_home(int64_t index);

  // Host payloads with the index's states, read from its files (waiting for a read ahead, or for
  // a write behind of the same index); unstage(index, write_back) writes them back or frees them.
  void stage(int64_t index);
  // Starts reading the index's states into new host payloads on an I/O thread. Does nothing when
  // staged already or when the host tier has no room for them (stage() reads it when it comes).
  void read_ahead(int64_t index);
  // Writes the staged index back (when `write_back`) on an I/O thread; its payloads go once
  // written. Without write_back the payloads go now. A write that fails keeps the index in host
  // memory for good (its files go, a warning says so): the states are never lost.
  void unstage(int64_t index, bool write_back);
  // Waits for every read and write in flight and releases their payloads (rethrows the first
  // read error, after everything has settled).
  void drain();

  // One parameter's slice of a state kind, staging that kind of its index when it is on disk (one
  // index at a time: asking for another releases the previous one's kinds, written back those for
  // which `write` was asked). Kinds not on disk, and indices in memory, are the store's views.
  at::Tensor view(TensorId tensor, ChunkKind kind, bool write);
  // Ends view()'s staging (writing back what was written); call after a pass of view() calls.
  void finish_views();

 private:
  struct Buffer {
    ChunkKind kind;
    void* data;
    int64_t bytes;
  };
  std::vector<Buffer> buffers(int64_t index) const;
  // Waits for the write behind in flight (if any) and releases its payloads.
  void settle_writes();
  struct Staging {
    std::future<void> io;  // the read ahead, or the write behind (invalid: none)
    bool writing = false;
  };
  void allocate(int64_t index);
  void release(int64_t index);
  // Waits for the index's read or write in flight, if any. Returns whether the index is still
  // staged: false when it was not, and when its write failed (the index stays in memory for good,
  // with a warning). A failed read releases the payloads and throws.
  bool wait_io(int64_t index);
  // allocate(), and when the host tier is full while a write behind holds payloads, once more
  // after it completed.
  void allocate_or_settle(int64_t index);
  // The chunk files of `index` into / from the buffers (callable from an I/O thread: the buffers'
  // addresses are taken on the engine's thread by buffers()).
  void read_all(int64_t index, const std::vector<Buffer>& to) const;
  void write_all(int64_t index, const std::vector<Buffer>& from);
  // The index's states live in its payloads from now on: its files go.
  void keep_in_memory(int64_t index);

  ChunkFiles files_;
  ChunkStore& store_;
  std::vector<ChunkKind> kinds_;
  std::vector<char> on_disk_;  // per index
  std::map<int64_t, Staging> staging_;
  double waited_seconds_ = 0;
  int64_t view_index_ = -1;  // view()'s staged index
  uint32_t view_kinds_ = 0;  // of it, the kinds read (bit 1 << kind)
  uint32_t view_dirty_ = 0;  // of those, the kinds written
};

// One Adam run (consecutive tensors of a chunk index that received gradients) as the disk source
// sees it: its index, its element range and whether its states come from the disk tier.
struct DiskRun {
  int64_t index = 0;
  int64_t begin = 0;
  int64_t end = 0;
  bool from_disk = false;
  bool mixed = false;  // the master is a state (param_fp32), not the param chunk
};

// HybridAdam's source of the states of the runs on disk: stages each index as its first run comes
// (reading the next index on disk ahead), and writes it back behind once its last run is done.
// Runs of one index must be consecutive. finish() waits for the writes (the destructor too, for the
// error path).
class DiskAdamSource final : public AdamStateSource {
 public:
  // `staged` runs after each acquire, when the most is staged (the engine notes its memory then).
  DiskAdamSource(DiskStates& disk, ChunkStore& store, std::vector<DiskRun> runs,
                 std::function<void()> staged);
  ~DiskAdamSource() override;
  DiskAdamSource(const DiskAdamSource&) = delete;
  DiskAdamSource& operator=(const DiskAdamSource&) = delete;
  void acquire(size_t k, AdamChunk& chunk) override;
  void release(size_t k, bool updated) override;
  void finish();

 private:
  DiskStates& disk_;
  ChunkStore& store_;
  std::vector<DiskRun> runs_;  // one per AdamChunk of the step
  std::function<void()> staged_;
  bool updated_ = false;       // the staged index's runs so far changed its states
};

}  // namespace patrickstar::engine_detail
