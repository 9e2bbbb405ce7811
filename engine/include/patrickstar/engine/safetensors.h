// Hugging Face's safetensors format, in and out: the checkpoints people start from and hand back.
//
// A file is an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape
// and byte range, and the tensors' bytes. A checkpoint folder holds one "model.safetensors", or
// shards "model-00001-of-0000N.safetensors" with "model.safetensors.index.json" mapping each
// tensor name to its shard.
//
//   patrickstar::SafetensorsCheckpoint ckpt("Llama-3.2-1B/");        // headers only, checked
//   at::Tensor value = at::empty(ckpt.entry("model.norm.weight").shape);
//   ckpt.read_into("model.norm.weight", value);                      // converted to value's dtype
//
//   engine.save_safetensors("out/", {.dtype = at::kBFloat16});       // one chunk at a time
//
// Reads are memory-mapped, and the pages of a tensor are given back as soon as it is copied, so
// reading a checkpoint tensor by tensor holds one tensor, never the file. Opening checks every
// header against its file (a truncated file, a range outside the data, a size that does not match
// the shape): errors name the tensor and the file. Thread-compatible: one thread reads at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace patrickstar {

class SafetensorsCheckpoint {
 public:
  struct Entry {
    std::string file;   // the shard's path
    std::string dtype;  // as the header names it: "F32", "BF16", "F16", "I64", ...
    std::vector<int64_t> shape;
    int64_t offset = 0;  // of its first byte in the file
    int64_t bytes = 0;
  };

  // `path`: a folder (with model.safetensors.index.json, or one model.safetensors) or one
  // .safetensors file. Reads and checks every header; throws c10::Error naming the file (and the
  // tensor) when one is missing, not safetensors, truncated or inconsistent.
  explicit SafetensorsCheckpoint(const std::string& path);
  ~SafetensorsCheckpoint();
  SafetensorsCheckpoint(const SafetensorsCheckpoint&) = delete;
  SafetensorsCheckpoint& operator=(const SafetensorsCheckpoint&) = delete;

  const std::string& path() const { return path_; }
  // Every tensor's name, sorted.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  // Throws c10::Error naming the checkpoint when there is no tensor `name`.
  const Entry& entry(const std::string& name) const;
  // The tensor's dtype; throws c10::Error naming the tensor and its file when the format's name
  // is one this reader does not know.
  at::ScalarType scalar_type(const std::string& name) const;
  // Copies the tensor into `dst` (contiguous, on the CPU, of its shape), converting to dst's dtype.
  // Throws c10::Error naming the tensor and its file on a shape or dtype it cannot take.
  void read_into(const std::string& name, at::Tensor& dst) const;
  // The tensor as a new CPU tensor of its own dtype.
  at::Tensor read(const std::string& name) const;
  // Sum of every tensor's bytes.
  int64_t total_bytes() const;

 private:
  struct Mapping;
  // Opens `file`, reads its header, adds its tensors (those in `wanted`, when given).
  void read_header(const std::string& file, const std::set<std::string>* wanted);
  const Mapping& mapping(const std::string& file) const;

  std::string path_;
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::unique_ptr<Mapping>> mappings_;  // by file: open, mapped at first read
};

struct SafetensorsOptions {
  // The dtype written: kFloat (the fp32 master weights as they are), kBFloat16 or kHalf (rounded
  // to nearest even, as at::Tensor::to rounds).
  at::ScalarType dtype = at::kFloat;
  // A new shard starts before a tensor that would take the current one past this size (a tensor
  // larger than it has a shard of its own); the default is transformers 4.x's save_pretrained's.
  int64_t max_shard_bytes = int64_t{5} * 1000 * 1000 * 1000;
  // The name each parameter is written under (its name in the model by default); an empty name
  // leaves the parameter out.
  std::function<std::string(const std::string&)> rename;
  // Written as the header's "__metadata__" of every file, with "format": "pt" unless it says
  // otherwise (transformers refuses a file without a format).
  std::map<std::string, std::string> metadata;
  // Other files of the checkpoint (name in the folder -> contents: config.json), written in the
  // same save: flushed with the shards and renamed into place before the index.
  std::map<std::string, std::string> extra_files;
};

// What a save wrote (empty on the ranks other than 0 with data parallel: rank 0 writes).
struct SafetensorsSaveReport {
  std::vector<std::string> files;  // the shards written (file names in the folder), in order
  int64_t tensors = 0;
  int64_t bytes = 0;  // of tensor data, all shards together
};

}  // namespace patrickstar
