#include "patrickstar/chunk/chunk_files.h"

#include <algorithm>
#include <cerrno>
#include <system_error>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <c10/util/Exception.h>

namespace patrickstar {
namespace {

std::string reason(int error) { return std::error_code(error, std::generic_category()).message(); }

std::string name_of(ChunkKind kind, int64_t index) {
  return std::string(to_string(kind)) + " chunk " + std::to_string(index);
}

// Closes a descriptor on every path out.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// pread/pwrite move at most about 2 GiB per call and may move less: loop until done.
template <typename Io, typename Ptr>
int64_t transfer_all(Io io, int fd, Ptr data, int64_t bytes) {
  int64_t done = 0;
  while (done < bytes) {
    const size_t want = static_cast<size_t>(std::min<int64_t>(bytes - done, int64_t{1} << 30));
    const ssize_t got = io(fd, data + done, want, static_cast<off_t>(done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return -1;
    if (got == 0) break;  // end of file
    done += got;
  }
  return done;
}

std::atomic<int64_t> next_instance{0};

}  // namespace

ChunkFiles::ChunkFiles(std::string folder) : folder_(std::move(folder)) {
  TORCH_CHECK(!folder_.empty(), "patrickstar: the disk tier needs a folder (config key "
              "zero_optimization.offload_optimizer.nvme_path)");
  while (folder_.size() > 1 && folder_.back() == '/') folder_.pop_back();
  struct stat st {};
  TORCH_CHECK(::stat(folder_.c_str(), &st) == 0, "patrickstar: the disk tier's folder \"", folder_,
              "\" cannot be used: ", reason(errno));
  TORCH_CHECK(S_ISDIR(st.st_mode), "patrickstar: the disk tier's folder \"", folder_,
              "\" is not a folder");
  prefix_ = folder_ + "/ps-" + std::to_string(::getpid()) + "-" +
            std::to_string(next_instance.fetch_add(1));
  const std::string probe = prefix_ + ".probe";
  Fd f{::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600)};
  TORCH_CHECK(f.fd >= 0, "patrickstar: the disk tier cannot write into \"", folder_, "\": ",
              reason(errno));
  ::unlink(probe.c_str());
}

ChunkFiles::~ChunkFiles() {
  for (const std::string& file : written_) ::unlink(file.c_str());
}

std::string ChunkFiles::path(ChunkKind kind, int64_t index) const {
  return prefix_ + "." + std::string(to_string(kind)) + "." + std::to_string(index);
}

void ChunkFiles::write(ChunkKind kind, int64_t index, const void* data, int64_t bytes) {
  TORCH_CHECK(bytes >= 0 && (data != nullptr || bytes == 0), "ChunkFiles::write: bad buffer");
  const std::string file = path(kind, index);
  // A new file beside the old one, renamed over it once complete: a failed write leaves the old
  // states in place, never a short file.
  const std::string temporary = file + ".tmp";
  {
    std::lock_guard<std::mutex> lock(mutex_);
    written_.insert(file);  // removed at the end
  }
  {
    Fd f{::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600)};
    TORCH_CHECK(f.fd >= 0, "patrickstar: the disk tier cannot write the ", name_of(kind, index),
                " to \"", temporary, "\": ", reason(errno));
    const int64_t done = transfer_all(::pwrite, f.fd, static_cast<const char*>(data), bytes);
    const int error = errno;
    // Out of the page cache: written out first (dirty pages are not dropped), then dropped.
    const bool synced = done == bytes && ::fdatasync(f.fd) == 0;
    const int sync_error = errno;
    if (!synced) ::unlink(temporary.c_str());
    TORCH_CHECK(done == bytes, "patrickstar: the disk tier wrote ", done < 0 ? 0 : done, " of the ",
                bytes, " bytes of the ", name_of(kind, index), " to \"", temporary, "\": ",
                done < 0 ? reason(error) : std::string("the disk is full"));
    TORCH_CHECK(synced, "patrickstar: the disk tier could not write the ", name_of(kind, index),
                " to \"", temporary, "\": ", reason(sync_error));
    ::posix_fadvise(f.fd, 0, 0, POSIX_FADV_DONTNEED);
  }
  if (::rename(temporary.c_str(), file.c_str()) != 0) {
    const int error = errno;
    ::unlink(temporary.c_str());
    TORCH_CHECK(false, "patrickstar: the disk tier could not replace \"", file, "\" with the new ",
                name_of(kind, index), ": ", reason(error));
  }
  bytes_written_.fetch_add(bytes, std::memory_order_relaxed);
}

void ChunkFiles::read(ChunkKind kind, int64_t index, void* data, int64_t bytes) const {
  TORCH_CHECK(bytes >= 0 && (data != nullptr || bytes == 0), "ChunkFiles::read: bad buffer");
  const std::string file = path(kind, index);
  Fd f{::open(file.c_str(), O_RDONLY | O_CLOEXEC)};
  TORCH_CHECK(f.fd >= 0, "patrickstar: the disk tier cannot read the ", name_of(kind, index),
              " from \"", file, "\": ", reason(errno),
              errno == ENOENT ? " (the file was removed while the engine needed it)" : "");
  struct stat st {};
  TORCH_CHECK(::fstat(f.fd, &st) == 0, "patrickstar: the disk tier cannot read \"", file, "\": ",
              reason(errno));
  TORCH_CHECK(st.st_size == bytes, "patrickstar: the disk tier's file \"", file, "\" of the ",
              name_of(kind, index), " holds ", static_cast<int64_t>(st.st_size),
              " bytes, expected ", bytes, " (it was changed while the engine needed it)");
  ::posix_fadvise(f.fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  const int64_t done = transfer_all(::pread, f.fd, static_cast<char*>(data), bytes);
  TORCH_CHECK(done == bytes, "patrickstar: the disk tier read ", done < 0 ? 0 : done, " of the ",
              bytes, " bytes of the ", name_of(kind, index), " from \"", file, "\": ",
              done < 0 ? reason(errno) : std::string("the file is short"));
  ::posix_fadvise(f.fd, 0, 0, POSIX_FADV_DONTNEED);
  bytes_read_.fetch_add(bytes, std::memory_order_relaxed);
}

void ChunkFiles::check(ChunkKind kind, int64_t index, int64_t bytes) const {
  const std::string file = path(kind, index);
  struct stat st {};
  TORCH_CHECK(::stat(file.c_str(), &st) == 0, "patrickstar: the disk tier cannot read the ",
              name_of(kind, index), " from \"", file, "\": ", reason(errno),
              errno == ENOENT ? " (the file was removed while the engine needed it)" : "");
  TORCH_CHECK(st.st_size == bytes, "patrickstar: the disk tier's file \"", file, "\" of the ",
              name_of(kind, index), " holds ", static_cast<int64_t>(st.st_size),
              " bytes, expected ", bytes, " (it was changed while the engine needed it)");
}

void ChunkFiles::remove(ChunkKind kind, int64_t index) {
  const std::string file = path(kind, index);
  ::unlink(file.c_str());
  std::lock_guard<std::mutex> lock(mutex_);
  written_.erase(file);
}

}  // namespace patrickstar
