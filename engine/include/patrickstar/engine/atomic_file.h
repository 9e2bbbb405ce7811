// Files that are either wholly old or wholly new: checkpoints and saved weights are written to a
// temporary file in the destination's folder, flushed to the disk (fsync), and renamed over the
// destination, whose folder is then flushed too. A process killed during a save, or a disk that
// fills up, leaves the previous file as it was. A killed process may leave its temporary file
// behind, named "<destination>.tmp-<pid>"; the next save to the same destination deletes those
// whose process no longer exists (processes in another PID namespace, such as another machine on
// a shared file system, look gone: do not save to one path from two of them at once).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace torch::serialize {
class OutputArchive;
}

namespace patrickstar {

// Deletes "<path>.tmp-<pid>" files in path's folder whose process no longer exists; returns how
// many. Called by AtomicFileWriter before it creates its own.
int remove_stale_temporaries(const std::string& path);

class AtomicFileWriter {
 public:
  // Creates the temporary file next to `path`; throws c10::Error naming the folder when it is
  // missing or not writable.
  explicit AtomicFileWriter(std::string path);
  // Removes the temporary file unless commit() succeeded.
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  // Appends `bytes` bytes. Returns false on a failed write (a full disk, a file size limit) and
  // remembers the reason; commit() then throws it.
  bool write(const void* data, size_t bytes);
  // fsync, close, rename over the destination, fsync of the folder. Throws c10::Error (naming the
  // destination and the system's reason) when any of them or an earlier write failed; the
  // destination is then unchanged. Equals flush() then publish().
  void commit();
  // The two halves of commit(), for a save of several files that renames none of them until all
  // are on the disk: flush() (fsync and close; throws the first failure, changing no destination)
  // and publish() (the rename and the folder's fsync).
  void flush();
  void publish();

  bool failed() const { return !error_.empty(); }
  int64_t bytes_written() const { return bytes_written_; }
  const std::string& temporary_path() const { return temporary_; }

 private:
  std::string fail(const std::string& what);

  std::string path_;
  std::string temporary_;
  int fd_ = -1;
  int64_t bytes_written_ = 0;
  std::string error_;  // the first failure, empty while none
  bool flushed_ = false;
  bool committed_ = false;
};

// Saves `archive` to `path` through an AtomicFileWriter. Throws c10::Error saying what failed.
void save_archive_atomically(torch::serialize::OutputArchive& archive, const std::string& path);

}  // namespace patrickstar
