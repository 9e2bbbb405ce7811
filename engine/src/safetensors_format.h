// Private to engine/src: the safetensors format's dtypes and limits (safetensors.h), and the
// writer of a checkpoint folder that the engine feeds one tensor at a time.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "patrickstar/engine/safetensors.h"

namespace patrickstar {
class AtomicFileWriter;

namespace safetensors_detail {

// The format's limit on a header (the reference implementation refuses larger ones).
inline constexpr int64_t kMaxHeaderBytes = 100'000'000;

// Bytes per element of a dtype the header names; 0 for one it does not know.
int64_t item_bytes(const std::string& dtype);
// LibTorch's type for it, when there is one.
std::optional<at::ScalarType> scalar_type_of(const std::string& dtype);
// The header's name for a LibTorch type; throws c10::Error for one the format has no name for.
std::string dtype_name(at::ScalarType type);

// POSIX file-system helpers (not std::filesystem: LibTorch's library exports std::filesystem
// symbols of its own, which the dynamic linker may bind in place of libstdc++'s).
std::string join(const std::string& folder, const std::string& name);
bool is_directory(const std::string& path);
bool exists(const std::string& path);
// mkdir -p; false (errno set) when a part cannot be made.
bool make_folders(const std::string& path);
// The names in `folder` (not "." and "..").
std::vector<std::string> folder_files(const std::string& folder);

}  // namespace safetensors_detail

// Writes a checkpoint folder (safetensors.h): the tensors of `plan` (name and shape, in the order
// write() gets them) split into shards, and the options' extra files, each an atomic file.
// commit() flushes every one of them to the disk before it renames any (a failed write renames
// nothing), removes an earlier index first (so that a rename failing half-way leaves a folder that
// refuses to load rather than one that mixes two saves), renames the shards and the extra files,
// then the index (when sharded), and removes the shards of an earlier save that this one does
// not have. A writer destroyed without commit() leaves the folder as it was.
class SafetensorsFolderWriter {
 public:
  using Plan = std::vector<std::pair<std::string, std::vector<int64_t>>>;
  // Creates `folder` when missing; throws c10::Error when it cannot.
  SafetensorsFolderWriter(std::string folder, Plan plan, const SafetensorsOptions& options);
  ~SafetensorsFolderWriter();
  SafetensorsFolderWriter(const SafetensorsFolderWriter&) = delete;
  SafetensorsFolderWriter& operator=(const SafetensorsFolderWriter&) = delete;

  // The next tensor of the plan (`name` must be it), converted to the options' dtype.
  void write(const std::string& name, const at::Tensor& value);
  SafetensorsSaveReport commit();

 private:
  struct Shard;
  std::string folder_;
  std::map<std::string, std::string> extra_files_;
  Plan plan_;
  at::ScalarType dtype_;
  std::vector<std::unique_ptr<Shard>> shards_;
  std::vector<size_t> shard_of_;  // by plan position
  size_t next_ = 0;
};

}  // namespace patrickstar
