#include "patrickstar/engine/atomic_file.h"

#include <cerrno>
#include <system_error>

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <vector>

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

std::string base_name(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

}  // namespace

int remove_stale_temporaries(const std::string& path) {
  const std::string folder = folder_of(path);
  const std::string prefix = base_name(path) + ".tmp-";
  std::vector<std::string> stale;
  if (DIR* dir = ::opendir(folder.c_str())) {
    while (const dirent* entry = ::readdir(dir)) {
      const std::string name = entry->d_name;
      if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) continue;
      const std::string digits = name.substr(prefix.size());
      if (digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 9) continue;
      const long pid = std::strtol(digits.c_str(), nullptr, 10);
      // A process that no longer exists (ESRCH); one that exists (or that we may not signal:
      // EPERM) may be saving now, and its file stays.
      if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
        stale.push_back(folder + "/" + name);
      }
    }
    ::closedir(dir);
  }
  int removed = 0;
  for (const std::string& file : stale) removed += ::unlink(file.c_str()) == 0 ? 1 : 0;
  return removed;
}

AtomicFileWriter::AtomicFileWriter(std::string path)
    : path_(std::move(path)), temporary_(path_ + ".tmp-" + std::to_string(::getpid())) {
  TORCH_CHECK(!path_.empty() && path_.back() != '/', "patrickstar: cannot write \"", path_,
              "\": not a file name");
  remove_stale_temporaries(path_);  // room on the disk before this save needs it
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
  flush();
  publish();
}

void AtomicFileWriter::flush() {
  TORCH_CHECK(!committed_, "patrickstar: \"", path_, "\" is already written");
  if (flushed_) return;
  if (error_.empty() && ::fsync(fd_) != 0) fail("flushing to the disk (fsync) failed");
  if (fd_ >= 0 && ::close(fd_) != 0 && error_.empty()) fail("closing failed");
  fd_ = -1;
  TORCH_CHECK(error_.empty(), "patrickstar: cannot write \"", path_, "\": ", error_,
              "; the file is unchanged");
  flushed_ = true;
}

void AtomicFileWriter::publish() {
  TORCH_CHECK(!committed_, "patrickstar: \"", path_, "\" is already written");
  TORCH_CHECK(flushed_, "patrickstar: \"", path_, "\" is published before it is flushed");
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
