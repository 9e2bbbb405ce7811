#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "patrickstar/engine/atomic_file.h"
#include "safetensors_format.h"

namespace patrickstar {

// The format's numbers and tensor bytes are little-endian; they are read and written as they lie.
static_assert(std::endian::native == std::endian::little, "safetensors: a little-endian host");

namespace safetensors_detail {
namespace {
struct DtypeRow {
  const char* name;
  int64_t bytes;
  at::ScalarType type;
};
const std::vector<DtypeRow>& dtype_table() {
  static const std::vector<DtypeRow> rows = {{"F64", 8, at::kDouble},
                                             {"F32", 4, at::kFloat},
                                             {"F16", 2, at::kHalf},
                                             {"BF16", 2, at::kBFloat16},
                                             {"I64", 8, at::kLong},
                                             {"I32", 4, at::kInt},
                                             {"I16", 2, at::kShort},
                                             {"I8", 1, at::kChar},
                                             {"U8", 1, at::kByte},
                                             {"BOOL", 1, at::kBool},
                                             {"U16", 2, at::kUInt16},
                                             {"U32", 4, at::kUInt32},
                                             {"U64", 8, at::kUInt64},
                                             {"F8_E4M3", 1, at::kFloat8_e4m3fn},
                                             {"F8_E5M2", 1, at::kFloat8_e5m2}};
  return rows;
}
}  // namespace

int64_t item_bytes(const std::string& dtype) {
  for (const DtypeRow& row : dtype_table()) {
    if (dtype == row.name) return row.bytes;
  }
  return 0;
}

std::optional<at::ScalarType> scalar_type_of(const std::string& dtype) {
  for (const DtypeRow& row : dtype_table()) {
    if (dtype == row.name) return row.type;
  }
  return std::nullopt;
}

std::string dtype_name(at::ScalarType type) {
  for (const DtypeRow& row : dtype_table()) {
    if (row.type == type) return row.name;
  }
  TORCH_CHECK(false, "safetensors: no dtype name for ", type);
}

std::string join(const std::string& folder, const std::string& name) {
  return folder.empty() || folder.back() == '/' ? folder + name : folder + "/" + name;
}

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

bool make_folders(const std::string& path) {
  if (path.empty() || is_directory(path)) return true;
  const size_t slash = path.find_last_of('/', path.size() > 1 ? path.size() - 2 : 0);
  if (slash != std::string::npos && slash > 0 && !make_folders(path.substr(0, slash))) return false;
  return ::mkdir(path.c_str(), 0755) == 0 || errno == EEXIST;
}

std::vector<std::string> folder_files(const std::string& folder) {
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

}  // namespace safetensors_detail

using namespace safetensors_detail;  // NOLINT: this file's own helpers

struct SafetensorsFolderWriter::Shard {
  std::string file;  // name in the folder
  std::unique_ptr<AtomicFileWriter> out;
  int64_t bytes = 0;  // of tensor data
};

SafetensorsFolderWriter::SafetensorsFolderWriter(std::string folder, Plan plan,
                                                 const SafetensorsOptions& options)
    : folder_(std::move(folder)),
      extra_files_(options.extra_files),
      plan_(std::move(plan)),
      dtype_(options.dtype) {
  TORCH_CHECK(dtype_ == at::kFloat || dtype_ == at::kBFloat16 || dtype_ == at::kHalf,
              "save_safetensors: dtype must be fp32, bf16 or fp16, not ", dtype_);
  TORCH_CHECK(options.max_shard_bytes > 0, "save_safetensors: max_shard_bytes must be positive");
  for (const auto& [name, text] : extra_files_) {
    TORCH_CHECK(!name.empty() && name.find('/') == std::string::npos &&
                    name.find("safetensors") == std::string::npos,
                "save_safetensors: an extra file must be a plain file name, not \"", name,
                "\" (nor a name of the checkpoint's own files)");
  }
  TORCH_CHECK(make_folders(folder_), "save_safetensors: cannot create the folder \"", folder_,
              "\": ", std::strerror(errno));
  const int64_t item = c10::elementSize(dtype_);
  // Shards: consecutive tensors, a new one before a tensor that would pass the limit.
  std::vector<std::vector<size_t>> members(1);
  int64_t size = 0;
  std::set<std::string> seen;
  for (size_t i = 0; i < plan_.size(); ++i) {
    TORCH_CHECK(seen.insert(plan_[i].first).second,
                "save_safetensors: two parameters are written as \"", plan_[i].first, "\"");
    int64_t bytes = item;
    for (int64_t d : plan_[i].second) bytes *= d;
    if (!members.back().empty() && size + bytes > options.max_shard_bytes) {
      members.emplace_back();
      size = 0;
    }
    members.back().push_back(i);
    size += bytes;
  }
  nlohmann::json meta = {{"format", "pt"}};
  for (const auto& [k, v] : options.metadata) meta[k] = v;
  shard_of_.resize(plan_.size());
  char name[64];
  for (size_t s = 0; s < members.size(); ++s) {
    auto shard = std::make_unique<Shard>();
    if (members.size() == 1) {
      shard->file = "model.safetensors";
    } else {
      std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", s + 1, members.size());
      shard->file = name;
    }
    nlohmann::json header = nlohmann::json::object();
    header["__metadata__"] = meta;
    int64_t offset = 0;
    for (size_t i : members[s]) {
      int64_t bytes = item;
      for (int64_t d : plan_[i].second) bytes *= d;
      header[plan_[i].first] = {{"dtype", dtype_name(dtype_)},
                                {"shape", plan_[i].second},
                                {"data_offsets", {offset, offset + bytes}}};
      offset += bytes;
      shard_of_[i] = s;
    }
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-aligned
    const uint64_t length = text.size();
    shard->out = std::make_unique<AtomicFileWriter>(join(folder_, shard->file));
    shard->out->write(&length, 8);
    shard->out->write(text.data(), text.size());
    shard->bytes = offset;
    shards_.push_back(std::move(shard));
  }
}

SafetensorsFolderWriter::~SafetensorsFolderWriter() = default;

void SafetensorsFolderWriter::write(const std::string& name, const at::Tensor& value) {
  TORCH_CHECK(next_ < plan_.size() && plan_[next_].first == name, "save_safetensors: internal: \"",
              name, "\" came out of order");
  TORCH_CHECK(value.sizes() == c10::IntArrayRef(plan_[next_].second), "save_safetensors: \"", name,
              "\" has shape ", value.sizes(), ", planned ", c10::IntArrayRef(plan_[next_].second));
  const at::Tensor out = value.to(at::kCPU, dtype_).contiguous();
  shards_[shard_of_[next_]]->out->write(out.data_ptr(), out.nbytes());
  ++next_;
}

SafetensorsSaveReport SafetensorsFolderWriter::commit() {
  TORCH_CHECK(next_ == plan_.size(), "save_safetensors: internal: ", plan_.size() - next_,
              " tensors were not written");
  const std::string index = join(folder_, "model.safetensors.index.json");
  // Everything on the disk first; a failure here renames nothing.
  std::vector<std::unique_ptr<AtomicFileWriter>> others;  // the extra files, then the index
  for (const auto& [name, text] : extra_files_) {
    others.push_back(std::make_unique<AtomicFileWriter>(join(folder_, name)));
    others.back()->write(text.data(), text.size());
  }
  if (shards_.size() > 1) {
    nlohmann::json map = nlohmann::json::object();
    int64_t total = 0;
    for (size_t i = 0; i < plan_.size(); ++i) map[plan_[i].first] = shards_[shard_of_[i]]->file;
    for (const auto& shard : shards_) total += shard->bytes;
    const std::string text =
        nlohmann::json{{"metadata", {{"total_size", total}}}, {"weight_map", map}}.dump(2) + "\n";
    others.push_back(std::make_unique<AtomicFileWriter>(index));
    others.back()->write(text.data(), text.size());
  }
  for (auto& shard : shards_) shard->out->flush();  // throws the first failed write
  for (auto& other : others) other->flush();
  // An earlier index goes before any of its shards is replaced.
  ::unlink(index.c_str());
  for (auto& shard : shards_) shard->out->publish();
  for (auto& other : others) other->publish();  // the index last
  // What an earlier save left that this one replaces: its other shards.
  std::set<std::string> ours;
  for (const auto& shard : shards_) ours.insert(shard->file);
  // "model.safetensors" or "model-DDDDD-of-DDDDD.safetensors" (no std::regex: GCC 12 warns inside
  // it under the sanitizer build's -O1).
  const auto is_shard = [](const std::string& f) {
    if (f == "model.safetensors") return true;
    const std::string pattern = "model-#####-of-#####.safetensors";
    if (f.size() != pattern.size()) return false;
    for (size_t i = 0; i < f.size(); ++i) {
      if (pattern[i] == '#' ? (f[i] < '0' || f[i] > '9') : f[i] != pattern[i]) return false;
    }
    return true;
  };
  for (const std::string& file : folder_files(folder_)) {
    if (is_shard(file) && ours.count(file) == 0) {
      ::unlink(join(folder_, file).c_str());
    }
  }
  SafetensorsSaveReport report;
  for (const auto& shard : shards_) {
    report.files.push_back(shard->file);
    report.bytes += shard->bytes;
  }
  report.tensors = static_cast<int64_t>(plan_.size());
  return report;
}

}  // namespace patrickstar
