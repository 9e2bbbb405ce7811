// Tests' reader of a format-4 checkpoint, written apart from the engine's: the index is JSON
// followed by a 32-byte trailer, and a tensor's bytes are fp32 at the offset the index gives in
// the data file it names. Tests compare what two checkpoints hold, tensor by tensor.
#pragma once

#include <cstdint>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include <torch/torch.h>
#include <nlohmann/json.hpp>

namespace patrickstar::test {

inline std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline void write_file_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

class SavedTensors {
 public:
  explicit SavedTensors(const std::string& index_path) {
    const std::string bytes = file_bytes(index_path);
    if (bytes.size() < 32) throw std::runtime_error("not a checkpoint index: " + index_path);
    index_ = nlohmann::json::parse(bytes.substr(0, bytes.size() - 32));
    const size_t slash = index_path.rfind('/');
    folder_ = slash == std::string::npos ? "" : index_path.substr(0, slash + 1);
    for (const auto& t : index_["tensors"]) entries_[t["name"].get<std::string>()] = t;
  }

  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [name, entry] : entries_) out.push_back(name);
    return out;
  }
  const nlohmann::json& index() const { return index_; }
  int64_t adam_steps(const std::string& name) const {
    return entries_.at(name)["adam_steps"].get<int64_t>();
  }
  bool has(const std::string& name, const std::string& field) const {
    return entries_.at(name).contains(field);
  }
  // The fp32 tensor of `field` ("master", "exp_avg", "exp_avg_sq"); zeros for an absent moment.
  at::Tensor tensor(const std::string& name, const std::string& field) const {
    const nlohmann::json& t = entries_.at(name);
    const std::vector<int64_t> shape = t["shape"].get<std::vector<int64_t>>();
    at::Tensor out = torch::zeros(shape, at::kFloat);
    if (!t.contains(field)) return out;
    const std::string file =
        folder_ + index_["files"][t["file"].get<size_t>()]["name"].get<std::string>();
    std::ifstream in(file, std::ios::binary);
    in.seekg(t[field][0].get<int64_t>());
    in.read(static_cast<char*>(out.data_ptr()), static_cast<std::streamsize>(out.nbytes()));
    if (!in) throw std::runtime_error("cannot read " + name + " from " + file);
    return out;
  }

 private:
  nlohmann::json index_;
  std::string folder_;
  std::map<std::string, nlohmann::json> entries_;
};

}  // namespace patrickstar::test
