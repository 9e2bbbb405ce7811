#include "patrickstar/engine/atomic_file.h"

#include <cerrno>
#include <system_error>

#include <fcntl.h>
#include <unistd.h>

#include <c10/util/Exception.h>
#include <torch/serialize/output-archive.h>

namespace patrickstar {
namespace {

std::string reason(int error) { return std::error_code(error, std::generic_category()).message(); }

std::string folder_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

AtomicFileWriter::AtomicFileWriter(std::string path)
    : path_(std::move(path)), temporary_(path_ + ".tmp-" + std::to_string(::getpid())) {
  TORCH_CHECK(!path_.empty() && path_.back() != '/', "patrickstar: cannot write \"", path_,
              "\": not a file name");
  fd_ = ::open(temporary_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd_ >= 0, "patrickstar: cannot write \"", path_, "\": creating a file in folder \"",
              folder_of(path_), "\" failed: ", reason(errno));
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(temporary_.c_str());
}

std::string AtomicFileWriter::fail(const std::string& what) {
  if (error_.empty()) error_ = what + ": " + reason(errno);
  return error_;
}

bool AtomicFileWriter::write(const void* data, size_t bytes) {
  if (!error_.empty() || fd_ < 0) return false;
  const char* from = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd_, from, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n == 0) errno = ENOSPC;
      fail("writing failed after " + std::to_string(bytes_written_) + " bytes");
      return false;
    }
    from += n;
    bytes -= static_cast<size_t>(n);
    bytes_written_ += n;
  }
  return true;
}

void AtomicFileWriter::commit() {
  TORCH_CHECK(!committed_, "patrickstar: \"", path_, "\" is already written");
  if (error_.empty() && ::fsync(fd_) != 0) fail("flushing to the disk (fsync) failed");
  if (fd_ >= 0 && ::close(fd_) != 0 && error_.empty()) fail("closing failed");
  fd_ = -1;
  if (error_.empty() && ::rename(temporary_.c_str(), path_.c_str()) != 0) {
    fail("renaming \"" + temporary_ + "\" over it failed");
  }
  TORCH_CHECK(error_.empty(), "patrickstar: cannot write \"", path_, "\": ", error_,
              "; the file is unchanged");
  committed_ = true;
  // The rename is durable once the folder is flushed. Some file systems refuse fsync on a folder
  // (EINVAL); the new file is complete either way.
  const int folder = ::open(folder_of(path_).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (folder >= 0) {
    ::fsync(folder);
    ::close(folder);
  }
}

void save_archive_atomically(torch::serialize::OutputArchive& archive, const std::string& path) {
  AtomicFileWriter file(path);
  // The writer function always reports every byte taken: LibTorch's zip writer throws from its
  // destructor (std::terminate) when a write comes up short. A failed write is remembered by
  // `file`, later writes are dropped, and commit() throws the cause.
  archive.save_to([&file](const void* data, size_t bytes) -> size_t {
    file.write(data, bytes);
    return bytes;
  });
  file.commit();
}

}  // namespace patrickstar
