// Checkpoint format 4 (private to engine/): tensors keyed by name, in data files any number of
// ranks can read back (docs/design.md, "Checkpoints").
//
// A checkpoint at `path` is an index (`path` itself) and data files beside it, one per writing rank
// (`<path's name>.<save id>.rank<r>-of-<N>`). A data file is the fp32 bytes of the tensors its rank
// owned, one after the other (for each: the master weight, then momentum and variance unless the
// parameter was held lean), sealed with the trailer of checkpoint_file.h. The index is JSON, sealed
// the same way: the writing run's config, precision, ranks and chunk size (records, not
// requirements), its iteration, Adam step and loss scaler, every data file's size and checksum, and
// for every tensor its name, shape, trainable mark, Adam steps, chunk index and the offset and
// checksum of each of its byte ranges. A loader reads the index whole and, of the data files, only
// the ranges of the tensors it owns in its own layout, each checked against its checksum.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "patrickstar/optimizer/loss_scaler.h"

namespace patrickstar::engine_detail {

inline constexpr int64_t kIndexFormat = 4;

// One fp32 byte range of a data file (numel x 4 bytes, numel from the tensor's shape).
struct IndexRange {
  int64_t offset = -1;  // -1: absent (a lean tensor's moments)
  uint64_t checksum = 0;
  bool present() const { return offset >= 0; }
};

// The Adam options of a tensor's param group when it was saved (lr, betas, eps, weight decay).
struct IndexOptions {
  double lr = 0;
  double beta1 = 0;
  double beta2 = 0;
  double eps = 0;
  double weight_decay = 0;
  std::string group;  // the group's label ("default", "param_groups[0]", "no_decay")
  bool operator==(const IndexOptions&) const = default;
};

struct IndexTensor {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;      // the product of shape
  bool trainable = true;  // requires_grad in the writing run
  int64_t adam_steps = 0;
  int64_t chunk = 0;  // its chunk index in the writing run's layout
  int64_t file = 0;   // which of IndexFile
  IndexRange master, exp_avg, exp_avg_sq;
  // Its group's label and options (absent in checkpoints written before param groups: the groups
  // keep the options they have).
  std::optional<IndexOptions> options;
  int64_t bytes() const { return numel * 4; }
};

struct IndexFile {
  std::string name;   // beside the index (no folder)
  int64_t bytes = 0;  // the data before the trailer
  uint64_t checksum = 0;
};

struct CheckpointIndex {
  std::string config_json;  // the writing engine's effective config
  std::string precision;
  int64_t world_size = 1;
  int64_t shard_group_size = 1;
  int64_t chunk_elems = 1;
  int64_t iteration = 0;
  int64_t retraces = 0;
  int64_t adam_step = 0;
  LossScalerState scaler;
  std::vector<IndexFile> files;
  std::vector<IndexTensor> tensors;  // in the writing run's registration order

  int64_t data_bytes() const;
};

// The index as the text the file holds, and back: parse_checkpoint_index checks every field (types,
// ranges, names unique, every range inside its file, the scaler's state possible) and throws
// c10::Error naming `path` and what is wrong.
std::string checkpoint_index_text(const CheckpointIndex& index);
CheckpointIndex parse_checkpoint_index(const std::string& text, const std::string& path);

// Reads and checks the sealed index at `path` (load_sealed_text, then the parse).
CheckpointIndex read_checkpoint_index(const std::string& path);
// Whether the file at `path` is an index (its data begins with '{'), not a format-3 archive. False
// when the file is missing or unreadable (the format-3 reader then names the reason).
bool is_checkpoint_index(const std::string& path);

// The folder of `path` with its separator ("" for a bare name), and its last component.
std::string index_folder(const std::string& path);
std::string index_file_name(const std::string& path);
// A data file's name: `<index_file_name(path)>.<save id, 16 hex digits>.rank<r>-of-<N>`.
std::string data_file_name(const std::string& path, uint64_t save_id, int rank, int world);
// Whether `file` (a bare name) is one of the data files of the checkpoint at `path`, of any save.
bool is_data_file_of(const std::string& file, const std::string& path);

// The data files of one index, opened as a range is first read from them; each is checked against
// the index (its size and trailer) when it opens. A range read is checked against its checksum.
class DataFileReader {
 public:
  DataFileReader(std::string index_path, const CheckpointIndex& index);
  DataFileReader(std::string index_path, CheckpointIndex&& index) = delete;  // it keeps a reference
  ~DataFileReader();
  DataFileReader(const DataFileReader&) = delete;
  DataFileReader& operator=(const DataFileReader&) = delete;

  // The fp32 tensor of `range` of `t`, in t's shape; throws c10::Error naming the file. Read into
  // the front of `buffer` (fp32, at least t's elements) when it is given: nothing is allocated.
  at::Tensor read(const IndexTensor& t, const IndexRange& range, const at::Tensor& buffer = {});
  // The open file `file` (checked against the index); throws c10::Error naming it.
  int open(int64_t file);
  std::string file_path(int64_t file) const;

 private:
  std::string path_;
  const CheckpointIndex& index_;
  std::vector<int> fds_;
};

// The checksum of a tensor's bytes (contiguous), as the index keeps it.
uint64_t checksum_of(const at::Tensor& t);

std::string hex64(uint64_t v);

}  // namespace patrickstar::engine_detail
