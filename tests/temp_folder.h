// Folders for the tests that write files: list, remove, and a scratch folder that goes with its
// scope. POSIX, not std::filesystem: LibTorch's library exports std::filesystem symbols of its own,
// which the dynamic linker may bind in place of libstdc++'s.
#pragma once

#include <dirent.h>
#include <unistd.h>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

namespace patrickstar::test {

// The names in `folder` (not "." and ".."); empty when it cannot be read.
inline std::vector<std::string> folder_entries(const std::string& folder) {
  std::vector<std::string> out;
  if (DIR* dir = ::opendir(folder.c_str())) {
    while (const dirent* entry = ::readdir(dir)) {
      const std::string name = entry->d_name;
      if (name != "." && name != "..") out.push_back(name);
    }
    ::closedir(dir);
  }
  return out;
}

// Removes the folder and the files in it (an empty subfolder too).
inline void remove_folder(const std::string& folder) {
  for (const std::string& name : folder_entries(folder)) {
    const std::string path = folder + "/" + name;
    if (::unlink(path.c_str()) != 0) ::rmdir(path.c_str());
  }
  ::rmdir(folder.c_str());
}

// A new folder under $TMPDIR (or /tmp), named <prefix>-XXXXXX, removed with what is in it when the
// object goes.
class TempFolder {
 public:
  explicit TempFolder(const std::string& prefix) {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp != nullptr ? tmp : "/tmp") + "/" + prefix + "-XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed: " + pattern);
    path_ = pattern;
  }
  ~TempFolder() { remove_folder(path_); }
  TempFolder(const TempFolder&) = delete;
  TempFolder& operator=(const TempFolder&) = delete;

  const std::string& path() const { return path_; }
  std::vector<std::string> files() const { return folder_entries(path_); }

 private:
  std::string path_;
};

}  // namespace patrickstar::test
