// A checkpoint's files without an engine (what the ps_ckpt tool runs): what a checkpoint holds,
// whether its files are sound, and its fp32 weights as a safetensors folder.
//
//   const patrickstar::CheckpointInfo info = patrickstar::read_checkpoint_info("run/ckpt");
//   for (const std::string& problem : patrickstar::verify_checkpoint("run/ckpt")) ...
//   patrickstar::export_checkpoint_weights("run/ckpt", "hf_out", options);  // one tensor at a time
//
// The checkpoint is save_checkpoint's (format 4: an index at the path and a data file per writing
// rank beside it; docs/design.md, "Checkpoints"). A format-3 checkpoint (one archive per rank) is
// refused, saying how to convert it: load it with the ranks that wrote it and save again.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "patrickstar/engine/safetensors.h"

namespace patrickstar {

struct CheckpointTensorInfo {
  std::string name;
  std::vector<int64_t> shape;
  bool trainable = true;
  bool moments = true;  // false: saved lean (a frozen parameter's weights alone)
  int64_t adam_steps = 0;
  int64_t chunk = 0;  // its chunk index in the writing run
  std::string file;   // the data file that holds it
  int64_t bytes = 0;  // of fp32 data in that file (weights, and moments unless lean)
};

struct CheckpointInfo {
  std::string precision;    // of the writing engine
  std::string config_json;  // its effective config
  int64_t world_size = 1, shard_group_size = 1, chunk_elems = 0;
  int64_t iteration = 0, retraces = 0, adam_step = 0;
  double loss_scale = 1.0;
  std::vector<std::pair<std::string, int64_t>> files;  // data files and their bytes of data
  std::vector<CheckpointTensorInfo> tensors;           // in the writing run's registration order
  int64_t parameters = 0;                              // elements over every tensor
  int64_t data_bytes = 0;                              // over every data file
};

// Bytes done and bytes in all, as long work goes on.
using CheckpointProgress = std::function<void(int64_t done, int64_t total)>;

// Reads the checkpoint's index (checked whole). Throws c10::Error naming the file and the problem.
CheckpointInfo read_checkpoint_info(const std::string& path);

// Reads every data file whole: its size and trailer against the index, every byte against the
// file's checksum, every tensor's bytes against theirs. Returns the problems found, each naming
// its file (empty: the checkpoint is sound). Throws c10::Error when the index itself is unsound.
std::vector<std::string> verify_checkpoint(const std::string& path,
                                           const CheckpointProgress& progress = nullptr);

// Writes the fp32 weights of every tensor as a safetensors folder (SafetensorsOptions: dtype,
// shard size, renaming: an empty name leaves a tensor out), reading one tensor at a time, each
// checked against its checksum. Throws c10::Error, leaving the folder as it was, on any problem.
SafetensorsSaveReport export_checkpoint_weights(const std::string& path, const std::string& folder,
                                                const SafetensorsOptions& options,
                                                const CheckpointProgress& progress = nullptr);

}  // namespace patrickstar
