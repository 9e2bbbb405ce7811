// A checkpoint's files without an engine (patrickstar/engine/checkpoint_files.h): the index read
// and shown, the data files verified whole, the fp32 weights exported one tensor at a time.
#include "patrickstar/engine/checkpoint_files.h"

#include <algorithm>
#include <vector>

#include <c10/util/Exception.h>

#include "checkpoint_file.h"
#include "checkpoint_index.h"
#include "safetensors_format.h"

namespace patrickstar {
using namespace engine_detail;  // NOLINT: this folder's private helpers

namespace {

CheckpointIndex read_index(const std::string& path) {
  TORCH_CHECK(
      is_checkpoint_index(path), "patrickstar: \"", path,
      "\" is not a checkpoint index "
      "(format 4). A format-3 checkpoint (path.rank<r>-of-<N>, or one file of one process) "
      "converts by loading it into an engine with the ranks that wrote it and saving again");
  return read_checkpoint_index(path);
}

}  // namespace

CheckpointInfo read_checkpoint_info(const std::string& path) {
  const CheckpointIndex index = read_index(path);
  CheckpointInfo info;
  info.precision = index.precision;
  info.config_json = index.config_json;
  info.world_size = index.world_size;
  info.shard_group_size = index.shard_group_size;
  info.chunk_elems = index.chunk_elems;
  info.iteration = index.iteration;
  info.retraces = index.retraces;
  info.adam_step = index.adam_step;
  info.loss_scale = index.scaler.scale;
  for (const IndexFile& f : index.files) info.files.emplace_back(f.name, f.bytes);
  info.data_bytes = index.data_bytes();
  for (const IndexTensor& t : index.tensors) {
    CheckpointTensorInfo out;
    out.name = t.name;
    out.shape = t.shape;
    out.trainable = t.trainable;
    out.moments = t.exp_avg.present();
    out.adam_steps = t.adam_steps;
    out.chunk = t.chunk;
    out.file = index.files[static_cast<size_t>(t.file)].name;
    out.bytes = t.bytes() * (out.moments ? 3 : 1);
    info.parameters += t.numel;
    info.tensors.push_back(std::move(out));
  }
  return info;
}

std::vector<std::string> verify_checkpoint(const std::string& path,
                                           const CheckpointProgress& progress) {
  const CheckpointIndex index = read_index(path);
  DataFileReader reader(path, index);
  std::vector<std::string> problems;
  const int64_t total = index.data_bytes();
  int64_t done = 0;
  std::vector<bool> sound(index.files.size(), false);
  std::vector<unsigned char> buffer(size_t{1} << 20);
  for (size_t f = 0; f < index.files.size(); ++f) {
    try {
      const int fd = reader.open(static_cast<int64_t>(f));
      Checksum sum;
      const int64_t bytes = index.files[f].bytes;
      for (int64_t at = 0; at < bytes;) {
        const size_t want = static_cast<size_t>(std::min<int64_t>(buffer.size(), bytes - at));
        TORCH_CHECK(read_file_at(fd, buffer.data(), want, static_cast<uint64_t>(at)) ==
                        static_cast<int64_t>(want),
                    "cannot read checkpoint file \"", reader.file_path(static_cast<int64_t>(f)),
                    "\"");
        sum.update(buffer.data(), want);
        at += static_cast<int64_t>(want);
        done += static_cast<int64_t>(want);
        if (progress) progress(done, total);
      }
      TORCH_CHECK(sum.value() == index.files[f].checksum, "checkpoint file \"",
                  reader.file_path(static_cast<int64_t>(f)), "\" is damaged: its ", bytes,
                  " bytes of data do not match their checksum");
      sound[f] = true;
    } catch (const c10::Error& e) {
      problems.emplace_back(e.what_without_backtrace());
    }
  }
  // Each tensor's ranges (a file that failed above is reported once, not per tensor).
  for (const IndexTensor& t : index.tensors) {
    if (!sound[static_cast<size_t>(t.file)]) continue;
    for (const IndexRange* r : {&t.master, &t.exp_avg, &t.exp_avg_sq}) {
      if (!r->present()) continue;
      try {
        reader.read(t, *r);
      } catch (const c10::Error& e) {
        problems.emplace_back(e.what_without_backtrace());
      }
    }
  }
  return problems;
}

SafetensorsSaveReport export_checkpoint_weights(const std::string& path, const std::string& folder,
                                                const SafetensorsOptions& options,
                                                const CheckpointProgress& progress) {
  const CheckpointIndex index = read_index(path);
  SafetensorsFolderWriter::Plan plan;
  std::vector<std::pair<const IndexTensor*, std::string>> written;
  int64_t total = 0;
  for (const IndexTensor& t : index.tensors) {
    const std::string name = options.rename ? options.rename(t.name) : t.name;
    if (name.empty()) continue;
    plan.emplace_back(name, t.shape);
    written.emplace_back(&t, name);
    total += t.bytes();
  }
  SafetensorsOptions with_metadata = options;
  with_metadata.metadata.emplace("format", "pt");
  with_metadata.metadata.emplace("patrickstar_iteration", std::to_string(index.iteration));
  SafetensorsFolderWriter out(folder, std::move(plan), with_metadata);
  DataFileReader reader(path, index);
  int64_t done = 0;
  for (const auto& [t, name] : written) {
    out.write(name, reader.read(*t, t->master));  // one tensor in memory at a time
    done += t->bytes();
    if (progress) progress(done, total);
  }
  return out.commit();
}

}  // namespace patrickstar
