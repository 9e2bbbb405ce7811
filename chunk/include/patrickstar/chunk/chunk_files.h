// ChunkFiles: chunk payloads kept in files on a local disk, one file per chunk (the disk tier).
//
// The unit of I/O is a whole chunk: one large sequential write or read. A file is
// <folder>/ps-<pid>-<n>.<kind>.<index>, where n tells apart the objects of one process; the object
// removes every file it wrote when it goes. After a write the file's pages are written out and
// dropped from the page cache (fdatasync, then posix_fadvise DONTNEED), and after a read they are
// dropped too, so the disk tier does not quietly take host memory back as cache.
//
// Thread-safety: reads and writes of different chunks may run on different threads at once (the
// byte counters are atomic); one chunk's file is read or written by one thread at a time.
//
//   patrickstar::ChunkFiles files("/local_nvme");
//   files.write(ChunkKind::kMomentum, 3, payload, bytes);   // c10::Error naming the file on failure
//   files.read(ChunkKind::kMomentum, 3, payload, bytes);    // a missing or short file is an error
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <set>
#include <string>

#include "patrickstar/chunk/types.h"

namespace patrickstar {

class ChunkFiles {
 public:
  // `folder` must exist and take new files: checked here by writing and removing a probe file.
  explicit ChunkFiles(std::string folder);
  ~ChunkFiles();  // removes the files this object wrote
  ChunkFiles(const ChunkFiles&) = delete;
  ChunkFiles& operator=(const ChunkFiles&) = delete;

  // Writes `bytes` bytes from `data` as the chunk's file: into <file>.tmp, fdatasync, then renamed
  // over the file, so a failed write leaves the previous contents (or no file), never a short one.
  void write(ChunkKind kind, int64_t index, const void* data, int64_t bytes);
  // Reads the chunk's file into `data`. Throws c10::Error naming the chunk and the file when it is
  // missing, or holds other than `bytes` bytes.
  void read(ChunkKind kind, int64_t index, void* data, int64_t bytes) const;
  // Throws what read() would for a missing or short file, reading nothing.
  void check(ChunkKind kind, int64_t index, int64_t bytes) const;
  // Removes the chunk's file (nothing when there is none).
  void remove(ChunkKind kind, int64_t index);

  std::string path(ChunkKind kind, int64_t index) const;
  const std::string& folder() const { return folder_; }
  int64_t bytes_read() const { return bytes_read_.load(std::memory_order_relaxed); }
  int64_t bytes_written() const { return bytes_written_.load(std::memory_order_relaxed); }

 private:
  std::string folder_;
  std::string prefix_;  // <folder>/ps-<pid>-<n>
  std::mutex mutex_;
  std::set<std::string> written_;  // files to remove at the end
  mutable std::atomic<int64_t> bytes_read_{0};
  std::atomic<int64_t> bytes_written_{0};
};

}  // namespace patrickstar
