#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "patrickstar/engine/safetensors.h"
#include "safetensors_format.h"

namespace patrickstar {
using namespace safetensors_detail;  // NOLINT: the format's helpers

// A file of the checkpoint, open from when its header was read (a file replaced since is not the
// one read), mapped at its first read.
struct SafetensorsCheckpoint::Mapping {
  int fd = -1;
  void* base = nullptr;
  size_t length = 0;
  ~Mapping() {
    if (base != nullptr) munmap(base, length);
    if (fd >= 0) close(fd);
  }
};

void SafetensorsCheckpoint::read_header(const std::string& file,
                                        const std::set<std::string>* wanted) {
  std::map<std::string, Entry>& out = entries_;
  auto opened = std::make_unique<Mapping>();
  opened->fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(opened->fd >= 0, "safetensors: cannot open \"", file, "\": ", std::strerror(errno));
  struct stat st {};
  TORCH_CHECK(::fstat(opened->fd, &st) == 0 && S_ISREG(st.st_mode), "safetensors: \"", file,
              "\" is not a file");
  const auto file_size = static_cast<int64_t>(st.st_size);
  opened->length = static_cast<size_t>(st.st_size);
  const int fd = opened->fd;
  mappings_[file] = std::move(opened);
  const auto read_at = [&](void* to, size_t bytes, int64_t at) {
    size_t done = 0;
    while (done < bytes) {
      const ssize_t n = ::pread(fd, static_cast<char*>(to) + done, bytes - done,
                                static_cast<off_t>(at + static_cast<int64_t>(done)));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      done += static_cast<size_t>(n);
    }
    return true;
  };
  uint64_t header_len = 0;  // little-endian, as the host (safetensors_write.cpp asserts it)
  TORCH_CHECK(file_size >= 8 && read_at(&header_len, 8, 0), "safetensors: \"", file, "\" is ",
              file_size, " bytes, too short for a header (truncated, or not a safetensors file)");
  TORCH_CHECK(header_len <= static_cast<uint64_t>(kMaxHeaderBytes) &&
                  static_cast<int64_t>(header_len) <= file_size - 8,
              "safetensors: \"", file, "\" announces a header of ", header_len, " bytes but holds ",
              file_size, " (truncated, or not a safetensors file)");
  std::string text(header_len, '\0');
  TORCH_CHECK(read_at(text.data(), header_len, 8), "safetensors: cannot read the header of \"",
              file, "\"");
  nlohmann::json header = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK(header.is_object(), "safetensors: the header of \"", file,
              "\" is not a JSON object (not a safetensors file)");
  const int64_t data_start = 8 + static_cast<int64_t>(header_len);
  const int64_t data_bytes = file_size - data_start;
  for (const auto& field : header.items()) {
    const std::string& name = field.key();  // not a structured binding: the lambda below names it
    const nlohmann::json& info = field.value();
    if (name == "__metadata__") continue;
    if (wanted != nullptr && wanted->count(name) == 0) continue;
    const auto bad = [&](const std::string& why) {
      return c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                        "safetensors: tensor \"" + name + "\" in \"" + file + "\": " + why);
    };
    if (!info.is_object() || !info.contains("dtype") || !info["dtype"].is_string() ||
        !info.contains("shape") || !info["shape"].is_array() || !info.contains("data_offsets") ||
        !info["data_offsets"].is_array() || info["data_offsets"].size() != 2) {
      throw bad("the header entry lacks a dtype, shape or data_offsets");
    }
    Entry e;
    e.file = file;
    e.dtype = info["dtype"].get<std::string>();
    int64_t numel = 1;
    for (const auto& d : info["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) throw bad("a dimension is not a size");
      e.shape.push_back(d.get<int64_t>());
      if (__builtin_mul_overflow(numel, e.shape.back(), &numel)) throw bad("its shape overflows");
    }
    const auto& offs = info["data_offsets"];
    if (!offs[0].is_number_unsigned() || !offs[1].is_number_unsigned()) {
      throw bad("data_offsets are not byte offsets");
    }
    const auto begin = offs[0].get<uint64_t>(), end = offs[1].get<uint64_t>();
    if (begin > end) throw bad("data_offsets end before they begin");
    if (end > static_cast<uint64_t>(data_bytes)) {
      throw bad("its bytes end at " + std::to_string(end) + " of the data but the file holds " +
                std::to_string(data_bytes) + " bytes of data (truncated?)");
    }
    e.offset = data_start + static_cast<int64_t>(begin);
    e.bytes = static_cast<int64_t>(end - begin);
    const int64_t item = item_bytes(e.dtype);
    int64_t needed = 0;
    if (item > 0 && __builtin_mul_overflow(numel, item, &needed)) throw bad("its shape overflows");
    if (item > 0 && e.bytes != needed) {
      throw bad("shape " + c10::str(c10::IntArrayRef(e.shape)) + " of " + e.dtype + " needs " +
                std::to_string(needed) + " bytes, its range holds " + std::to_string(e.bytes));
    }
    if (!out.emplace(name, std::move(e)).second) {
      throw bad("the checkpoint holds it twice (another shard has it too)");
    }
  }
}

SafetensorsCheckpoint::SafetensorsCheckpoint(const std::string& path) : path_(path) {
  if (!is_directory(path)) {
    TORCH_CHECK(exists(path), "safetensors: no file or folder \"", path, "\"");
    read_header(path, nullptr);
    return;
  }
  const std::string index = join(path, "model.safetensors.index.json");
  const std::string single = join(path, "model.safetensors");
  if (!exists(index)) {
    TORCH_CHECK(exists(single), "safetensors: \"", path,
                "\" holds neither model.safetensors nor model.safetensors.index.json");
    read_header(single, nullptr);
    return;
  }
  std::ifstream in(index);
  TORCH_CHECK(in, "safetensors: cannot open \"", index, "\"");
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(),
              "safetensors: \"", index, "\" has no \"weight_map\" object");
  std::map<std::string, std::set<std::string>> by_file;
  for (const auto& [name, file] : j["weight_map"].items()) {
    // A shard is a file of the folder: no path leads elsewhere.
    TORCH_CHECK(file.is_string() && !file.get<std::string>().empty() &&
                    file.get<std::string>().find('/') == std::string::npos &&
                    file.get<std::string>() != "." && file.get<std::string>() != "..",
                "safetensors: \"", index, "\" maps \"", name,
                "\" to something not a file name of its folder");
    by_file[file.get<std::string>()].insert(name);
  }
  for (const auto& [file, names] : by_file) {
    const std::string shard = join(path, file);
    TORCH_CHECK(exists(shard), "safetensors: \"", index, "\" puts \"", *names.begin(), "\" in \"",
                shard, "\", which does not exist");
    read_header(shard, &names);
    for (const std::string& name : names) {
      TORCH_CHECK(entries_.count(name) != 0, "safetensors: \"", index, "\" puts \"", name,
                  "\" in \"", shard, "\", whose header does not have it");
    }
  }
}

SafetensorsCheckpoint::~SafetensorsCheckpoint() = default;

std::vector<std::string> SafetensorsCheckpoint::names() const {
  std::vector<std::string> out;
  for (const auto& item : entries_) out.push_back(item.first);
  return out;
}

const SafetensorsCheckpoint::Entry& SafetensorsCheckpoint::entry(const std::string& name) const {
  const auto it = entries_.find(name);
  TORCH_CHECK(it != entries_.end(), "safetensors: \"", path_, "\" has no tensor \"", name, "\"");
  return it->second;
}

at::ScalarType SafetensorsCheckpoint::scalar_type(const std::string& name) const {
  const Entry& e = entry(name);
  const auto type = scalar_type_of(e.dtype);
  TORCH_CHECK(type.has_value(), "safetensors: tensor \"", name, "\" in \"", e.file, "\" is ",
              e.dtype, ", a dtype this reader does not know");
  return *type;
}

int64_t SafetensorsCheckpoint::total_bytes() const {
  int64_t total = 0;
  for (const auto& item : entries_) total += item.second.bytes;
  return total;
}

const SafetensorsCheckpoint::Mapping& SafetensorsCheckpoint::mapping(
    const std::string& file) const {
  Mapping& m = *mappings_.at(file);  // opened when its header was read
  if (m.base == nullptr && m.length > 0) {
    void* base = ::mmap(nullptr, m.length, PROT_READ, MAP_PRIVATE, m.fd, 0);
    TORCH_CHECK(base != MAP_FAILED, "safetensors: cannot map \"", file,
                "\": ", std::strerror(errno));
    m.base = base;
  }
  return m;
}

void SafetensorsCheckpoint::read_into(const std::string& name, at::Tensor& dst) const {
  const Entry& e = entry(name);
  const at::ScalarType type = scalar_type(name);
  TORCH_CHECK(dst.device().is_cpu() && dst.is_contiguous(), "safetensors: reading \"", name,
              "\" needs a contiguous CPU tensor");
  TORCH_CHECK(dst.sizes() == c10::IntArrayRef(e.shape), "safetensors: tensor \"", name, "\" in \"",
              e.file, "\" has shape ", c10::IntArrayRef(e.shape), ", the destination ",
              dst.sizes());
  if (e.bytes == 0) return;
  const Mapping& m = mapping(e.file);
  TORCH_CHECK(static_cast<size_t>(e.offset + e.bytes) <= m.length, "safetensors: \"", e.file,
              "\" is shorter than when it was opened (truncated while reading \"", name, "\")");
  const char* src = static_cast<const char*>(m.base) + e.offset;
  const int64_t item = item_bytes(e.dtype);
  if (reinterpret_cast<uintptr_t>(src) % static_cast<uintptr_t>(item) == 0) {
    dst.copy_(at::from_blob(const_cast<char*>(src), e.shape, at::TensorOptions(type)));
  } else {  // a range not aligned to its element: through an aligned copy
    at::Tensor aligned = at::empty(e.shape, at::TensorOptions(type));
    std::memcpy(aligned.data_ptr(), src, static_cast<size_t>(e.bytes));
    dst.copy_(aligned);
  }
  // Give the pages back: the process holds one tensor of the file at a time, not the file.
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto first = (reinterpret_cast<uintptr_t>(src) + page - 1) / page * page;
  const auto last =
      (reinterpret_cast<uintptr_t>(src) + static_cast<uintptr_t>(e.bytes)) / page * page;
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

at::Tensor SafetensorsCheckpoint::read(const std::string& name) const {
  at::Tensor out = at::empty(entry(name).shape, at::TensorOptions(scalar_type(name)));
  read_into(name, out);
  return out;
}

}  // namespace patrickstar
