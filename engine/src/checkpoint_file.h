// Checkpoint files (private to engine/): what a checkpoint holds, and the file that holds it.
//
// The file is a LibTorch archive followed by a 32-byte trailer: the archive's length and a 64-bit
// checksum of its bytes (little-endian), then the text "patrickstar ckpt". A load verifies the
// whole file against its trailer before LibTorch's reader sees a byte of it, so a truncated or
// damaged file, or one another program wrote, is refused naming the file; then every record is
// read and checked (types, shapes, ranges) into a CheckpointContents before the engine changes
// anything. The checkpoint fuzzer (fuzz/checkpoint_fuzzer.cpp) drives read_checkpoint_file with
// arbitrary bytes and with archives of arbitrary records.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "patrickstar/optimizer/loss_scaler.h"

namespace torch::serialize {
class InputArchive;
class OutputArchive;
}  // namespace torch::serialize

namespace patrickstar::engine_detail {

// The checkpoint format this code writes and reads. Format 3: the sealed file above. (Formats 1
// and 2, before the trailer, are refused with that reason.)
inline constexpr int64_t kCheckpointFormat = 3;

// One parameter's optimizer state, fp32, in the parameter's shape. A parameter its engine held lean
// (frozen, no optimizer state) has its weights as `master` and neither moment (undefined).
struct CheckpointParam {
  at::Tensor master, exp_avg, exp_avg_sq;
};

struct CheckpointContents {
  std::string config_json;         // the saving engine's effective config
  std::string precision;           // to_string(Precision) of the saving engine
  std::vector<std::string> names;  // every parameter's name, in registration order
  int64_t world_size = 1;
  int64_t rank = 0;
  int64_t chunk_elems = 1;
  int64_t adam_step = 0;
  // Adam steps per parameter, in registration order (torch::optim::Adam's per-parameter step).
  // Empty when the file predates them: every parameter is then at adam_step (what the engine that
  // wrote it used for all of them).
  std::vector<int64_t> param_steps;
  int64_t iteration = 0;
  LossScalerState scaler;
  std::map<int64_t, CheckpointParam> params;  // by registration index: those this file holds
};

// Writes `contents` to `path` atomically (AtomicFileWriter), sealed. Throws c10::Error.
void write_checkpoint_file(const CheckpointContents& contents, const std::string& path);
// Reads and checks everything in the file at `path`. Throws c10::Error naming `path` and what is
// wrong; the checks are those that need no engine (the engine compares names and shapes with its
// model).
CheckpointContents read_checkpoint_file(const std::string& path);

// The sealed file under them: `archive` plus the trailer, written atomically.
void save_sealed_archive(torch::serialize::OutputArchive& archive, const std::string& path);
// Verifies the file at `path` against its trailer, then loads its archive into `archive`.
void load_sealed_archive(torch::serialize::InputArchive& archive, const std::string& path);

// Sealed bytes other than an archive (the format-4 index and data files, checkpoint_index.h).
// save_sealed_text writes `text` and the trailer atomically; load_sealed_text verifies the whole
// file and returns its data. Both throw c10::Error naming `path`.
void save_sealed_text(const std::string& text, const std::string& path);
std::string load_sealed_text(const std::string& path);

// A data file written as it streams: the bytes, then the trailer, committed atomically by
// commit() (an uncommitted writer leaves no file). offset() is where the next write lands.
class SealedFileWriter {
 public:
  explicit SealedFileWriter(const std::string& path);
  ~SealedFileWriter();
  SealedFileWriter(const SealedFileWriter&) = delete;
  SealedFileWriter& operator=(const SealedFileWriter&) = delete;
  void write(const void* data, size_t bytes);
  int64_t offset() const { return bytes_; }
  // Seals and renames into place; returns the checksum of the data (the trailer's).
  uint64_t commit();

 private:
  struct Impl;
  Impl* impl_;
  int64_t bytes_ = 0;
};

// A sealed file's trailer, read without the data: the data's length (checked against the file's
// size) and checksum. Throws c10::Error naming `path` when the file is missing, short, or its
// trailer is not one.
struct Seal {
  int64_t bytes = 0;
  uint64_t checksum = 0;
};
Seal read_seal(int fd, const std::string& path);

// pread to the end of `bytes` (fewer only at the end of the file); -1 on an error.
int64_t read_file_at(int fd, void* data, size_t bytes, uint64_t offset);

// A 64-bit checksum of a byte stream, fed in pieces of any size: each 8-byte word passes through a
// bijective mix of the running state, so a change confined to one word always changes the result;
// the byte count is part of it. Not cryptographic: it detects damage, not tampering.
class Checksum {
 public:
  void update(const void* data, size_t bytes);
  uint64_t value() const;

 private:
  uint64_t state_ = 0x9e3779b97f4a7c15ULL;
  uint64_t bytes_ = 0;
  unsigned char pending_[8] = {};
  size_t pending_size_ = 0;
};

at::Tensor text_tensor(const std::string& text);
std::string tensor_text(const at::Tensor& t);  // a 1-D tensor of 8-bit elements; throws otherwise

}  // namespace patrickstar::engine_detail
