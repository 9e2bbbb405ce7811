// The format-4 index (checkpoint_index.h): JSON text, every field checked as it is read.
#include "checkpoint_index.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>

#include <fcntl.h>
#include <unistd.h>

#include <ATen/ops/empty.h>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "checkpoint_file.h"

namespace patrickstar::engine_detail {

using nlohmann::json;

std::string hex64(uint64_t v) {
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(v));
  return text;
}

int64_t CheckpointIndex::data_bytes() const {
  int64_t total = 0;
  for (const IndexFile& f : files) total += f.bytes;
  return total;
}

std::string index_folder(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string() : path.substr(0, slash + 1);
}

std::string index_file_name(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

std::string data_file_name(const std::string& path, uint64_t save_id, int rank, int world) {
  return index_file_name(path) + "." + hex64(save_id) + ".rank" + std::to_string(rank) + "-of-" +
         std::to_string(world);
}

bool is_data_file_of(const std::string& file, const std::string& path) {
  const std::string base = index_file_name(path) + ".";
  if (file.compare(0, base.size(), base) != 0) return false;
  // <16 hex digits>.rank<digits>-of-<digits>
  const std::string rest = file.substr(base.size());
  if (rest.size() < 16 + 10 || rest.compare(16, 5, ".rank") != 0) return false;
  for (size_t i = 0; i < 16; ++i) {
    if (std::isxdigit(static_cast<unsigned char>(rest[i])) == 0) return false;
  }
  const size_t of = rest.find("-of-", 21);
  if (of == std::string::npos || of == 21 || of + 4 == rest.size()) return false;
  for (size_t i = 21; i < rest.size(); ++i) {
    if (i >= of && i < of + 4) continue;
    if (std::isdigit(static_cast<unsigned char>(rest[i])) == 0) return false;
  }
  return true;
}

namespace {

json range_json(const IndexRange& r) {
  return json::array({r.offset, hex64(r.checksum)});
}

}  // namespace

std::string checkpoint_index_text(const CheckpointIndex& index) {
  json files = json::array();
  for (const IndexFile& f : index.files) {
    files.push_back({{"name", f.name}, {"bytes", f.bytes}, {"checksum", hex64(f.checksum)}});
  }
  json tensors = json::array();
  for (const IndexTensor& t : index.tensors) {
    json entry = {{"name", t.name},
                  {"shape", t.shape},
                  {"trainable", t.trainable},
                  {"adam_steps", t.adam_steps},
                  {"chunk", t.chunk},
                  {"file", t.file},
                  {"master", range_json(t.master)}};
    if (t.exp_avg.present()) {
      entry["exp_avg"] = range_json(t.exp_avg);
      entry["exp_avg_sq"] = range_json(t.exp_avg_sq);
    }
    if (t.options) {
      const IndexOptions& o = *t.options;
      entry["options"] = {{"lr", o.lr},
                          {"betas", json::array({o.beta1, o.beta2})},
                          {"eps", o.eps},
                          {"weight_decay", o.weight_decay},
                          {"group", o.group}};
    }
    tensors.push_back(std::move(entry));
  }
  const json j = {{"format", kIndexFormat},
                  {"writer", "patrickstar"},
                  {"config", json::parse(index.config_json.empty() ? "{}" : index.config_json)},
                  {"precision", index.precision},
                  {"world_size", index.world_size},
                  {"shard_group_size", index.shard_group_size},
                  {"chunk_elems", index.chunk_elems},
                  {"iteration", index.iteration},
                  {"retraces", index.retraces},
                  {"adam_step", index.adam_step},
                  {"scaler",
                   {{"scale", index.scaler.scale},
                    {"step", index.scaler.step},
                    {"last_overflow_step", index.scaler.last_overflow_step},
                    {"hysteresis_left", index.scaler.hysteresis_left}}},
                  {"files", files},
                  {"tensors", tensors}};
  return j.dump(1) + "\n";
}

namespace {

// The fields of one JSON object, each read with its checks; anything wrong refuses the index.
class Fields {
 public:
  Fields(const json& object, std::string where, const std::string& path)
      : object_(object), where_(std::move(where)), path_(path) {
    if (!object_.is_object()) refuse("is not an object");
  }

  [[noreturn]] void refuse(const std::string& why) const {
    TORCH_CHECK(false, "patrickstar: checkpoint \"", path_,
                "\" is damaged or not patrickstar's: ", where_, " ", why, "; nothing was loaded");
    std::abort();  // not reached
  }

  const json& at(const char* key) const {
    auto it = object_.find(key);
    if (it == object_.end()) refuse(std::string("has no \"") + key + "\"");
    return *it;
  }
  bool has(const char* key) const { return object_.contains(key); }

  int64_t integer(const char* key, int64_t low, int64_t high = int64_t{1} << 62) const {
    const json& v = at(key);
    if (!v.is_number_integer()) refuse(std::string("has a \"") + key + "\" that is not an integer");
    const int64_t x = v.get<int64_t>();
    if (x < low || x > high) {
      refuse(std::string("has \"") + key + "\" " + std::to_string(x) + ", outside [" +
             std::to_string(low) + ", " + std::to_string(high) + "]");
    }
    return x;
  }
  std::string text(const char* key) const {
    const json& v = at(key);
    if (!v.is_string()) refuse(std::string("has a \"") + key + "\" that is not text");
    return v.get<std::string>();
  }
  bool boolean(const char* key) const {
    const json& v = at(key);
    if (!v.is_boolean()) refuse(std::string("has a \"") + key + "\" that is not true or false");
    return v.get<bool>();
  }
  uint64_t checksum(const json& v) const {
    const std::string t = v.is_string() ? v.get<std::string>() : std::string();
    uint64_t x = 0;
    if (t.size() != 16) refuse("has a checksum that is not 16 hex digits");
    for (char c : t) {
      const int d = std::isdigit(static_cast<unsigned char>(c)) != 0 ? c - '0'
                    : (c >= 'a' && c <= 'f')                         ? c - 'a' + 10
                                                                     : -1;
      if (d < 0) refuse("has a checksum that is not 16 hex digits");
      x = (x << 4) | static_cast<uint64_t>(d);
    }
    return x;
  }
  IndexRange range(const char* key) const {
    const json& v = at(key);
    if (!v.is_array() || v.size() != 2 || !v[0].is_number_integer() || v[0].get<int64_t>() < 0) {
      refuse(std::string("has a \"") + key + "\" that is not [offset, checksum]");
    }
    return IndexRange{v[0].get<int64_t>(), checksum(v[1])};
  }

 private:
  const json& object_;
  std::string where_;
  const std::string& path_;
};

void parse_scaler(const Fields& top, CheckpointIndex& index, const std::string& path) {
  const Fields s(top.at("scaler"), "its loss scaler", path);
  const json& scale = s.at("scale");
  if (!scale.is_number() || !std::isfinite(scale.get<double>()) || scale.get<double>() <= 0) {
    s.refuse("has a scale that is not a positive number");
  }
  index.scaler.scale = scale.get<double>();
  index.scaler.step = s.integer("step", 0);
  index.scaler.last_overflow_step = s.integer("last_overflow_step", -1);
  index.scaler.hysteresis_left =
      static_cast<int>(s.integer("hysteresis_left", 1, int64_t{1} << 30));
}

void parse_files(const Fields& top, CheckpointIndex& index, const std::string& path) {
  const json& files = top.at("files");
  if (!files.is_array() || files.empty()) top.refuse("has no list of data files");
  if (static_cast<int64_t>(files.size()) > index.world_size) {
    top.refuse("lists more data files than the ranks that wrote them");
  }
  std::set<std::string> names;
  for (size_t i = 0; i < files.size(); ++i) {
    const Fields f(files[i], "data file " + std::to_string(i), path);
    // (Bounds that keep every sum over the files and tensors within 63 bits.)
    IndexFile file{f.text("name"), f.integer("bytes", 0, int64_t{1} << 44),
                   f.checksum(f.at("checksum"))};
    if (file.name.empty() || file.name.find('/') != std::string::npos || file.name[0] == '.') {
      f.refuse("has a name that is not a file beside the index");
    }
    if (!names.insert(file.name).second) f.refuse("is listed twice");
    index.files.push_back(std::move(file));
  }
}

// A tensor's group options: finite, not negative, betas in [0, 1).
IndexOptions parse_options(const Fields& f) {
  auto number = [&](const json& v, const char* what, double high) {
    if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < 0 ||
        v.get<double>() >= high) {
      f.refuse(std::string("has a \"") + what + "\" that is not a number in its range");
    }
    return v.get<double>();
  };
  constexpr double kAny = std::numeric_limits<double>::infinity();
  IndexOptions o;
  o.lr = number(f.at("lr"), "lr", kAny);
  const json& betas = f.at("betas");
  if (!betas.is_array() || betas.size() != 2) f.refuse("has \"betas\" that are not two numbers");
  o.beta1 = number(betas[0], "betas", 1.0);
  o.beta2 = number(betas[1], "betas", 1.0);
  o.eps = number(f.at("eps"), "eps", kAny);
  o.weight_decay = number(f.at("weight_decay"), "weight_decay", kAny);
  o.group = f.text("group");
  return o;
}

IndexTensor parse_tensor(const json& entry, size_t i, const CheckpointIndex& index,
                         const std::string& path) {
  const Fields f(entry, "tensor " + std::to_string(i), path);
  IndexTensor t;
  t.name = f.text("name");
  if (t.name.empty()) f.refuse("has an empty name");
  const json& shape = f.at("shape");
  if (!shape.is_array() || shape.size() > 16) f.refuse("has a shape that is not a list of sizes");
  t.numel = 1;
  for (const json& d : shape) {
    if (!d.is_number_integer() || d.get<int64_t>() < 0 || d.get<int64_t>() > (int64_t{1} << 40)) {
      f.refuse("has a shape that is not a list of sizes");
    }
    t.shape.push_back(d.get<int64_t>());
    if (t.numel > 0 && d.get<int64_t>() > (int64_t{1} << 40) / t.numel) f.refuse("is too large");
    t.numel *= d.get<int64_t>();
  }
  t.trainable = f.boolean("trainable");
  t.adam_steps = f.integer("adam_steps", 0);
  t.chunk = f.integer("chunk", 0);
  t.file = f.integer("file", 0, static_cast<int64_t>(index.files.size()) - 1);
  t.master = f.range("master");
  if (f.has("exp_avg") != f.has("exp_avg_sq")) f.refuse("has one Adam moment and not the other");
  if (f.has("exp_avg")) {
    t.exp_avg = f.range("exp_avg");
    t.exp_avg_sq = f.range("exp_avg_sq");
  }
  if (f.has("options"))
    t.options =
        parse_options(Fields(f.at("options"), "tensor " + std::to_string(i) + "'s options", path));
  const int64_t file_bytes = index.files[static_cast<size_t>(t.file)].bytes;
  for (const IndexRange* r : {&t.master, &t.exp_avg, &t.exp_avg_sq}) {
    if (r->present() && r->offset > file_bytes - t.bytes()) {
      f.refuse("has a byte range past the end of its data file");
    }
  }
  return t;
}

}  // namespace

CheckpointIndex parse_checkpoint_index(const std::string& text, const std::string& path) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    TORCH_CHECK(false, "patrickstar: checkpoint \"", path, "\" has an index that is not JSON (",
                e.what(), "); nothing was loaded");
  }
  const Fields top(j, "its index", path);
  if (top.text("writer") != "patrickstar") top.refuse("was not written by patrickstar");
  const int64_t format = top.integer("format", 0);
  if (format != kIndexFormat) {
    top.refuse("is in checkpoint format " + std::to_string(format) + "; this patrickstar reads " +
               std::to_string(kIndexFormat) + " (and 3)");
  }
  CheckpointIndex index;
  const json& config = top.at("config");
  if (!config.is_object()) top.refuse("has a config that is not a JSON object");
  index.config_json = config.dump();
  index.precision = top.text("precision");
  index.world_size = top.integer("world_size", 1, int64_t{1} << 16);
  index.shard_group_size = top.integer("shard_group_size", 1, index.world_size);
  index.chunk_elems = top.integer("chunk_elems", 1);
  index.iteration = top.integer("iteration", 0);
  index.retraces = top.integer("retraces", 0);
  index.adam_step = top.integer("adam_step", 0);
  parse_scaler(top, index, path);
  parse_files(top, index, path);
  const json& tensors = top.at("tensors");
  if (!tensors.is_array() || tensors.size() > (size_t{1} << 20)) {
    top.refuse("has no list of tensors (of at most 2^20)");
  }
  std::set<std::string> names;
  for (size_t i = 0; i < tensors.size(); ++i) {
    index.tensors.push_back(parse_tensor(tensors[i], i, index, path));
    if (!names.insert(index.tensors.back().name).second) {
      top.refuse("names tensor " + index.tensors.back().name + " twice");
    }
  }
  return index;
}

CheckpointIndex read_checkpoint_index(const std::string& path) {
  return parse_checkpoint_index(load_sealed_text(path), path);
}

bool is_checkpoint_index(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char first = 0;
  return in.get(first) && first == '{';
}

uint64_t checksum_of(const at::Tensor& t) {
  Checksum sum;
  sum.update(t.data_ptr(), t.nbytes());
  return sum.value();
}

DataFileReader::DataFileReader(std::string index_path, const CheckpointIndex& index)
    : path_(std::move(index_path)), index_(index), fds_(index.files.size(), -1) {}

DataFileReader::~DataFileReader() {
  for (int fd : fds_) {
    if (fd >= 0) ::close(fd);
  }
}

std::string DataFileReader::file_path(int64_t file) const {
  return index_folder(path_) + index_.files[static_cast<size_t>(file)].name;
}

at::Tensor DataFileReader::read(const IndexTensor& t, const IndexRange& range,
                                const at::Tensor& buffer) {
  const std::string where = file_path(t.file);
  const int fd = open(t.file);
  at::Tensor out = buffer.defined() ? buffer.narrow(0, 0, t.numel).view(t.shape)
                                    : at::empty(t.shape, at::kFloat);
  TORCH_CHECK(read_file_at(fd, out.data_ptr(), static_cast<size_t>(t.bytes()),
                           static_cast<uint64_t>(range.offset)) == t.bytes(),
              "patrickstar: cannot read checkpoint file \"", where, "\" (", t.name,
              "); nothing was loaded");
  TORCH_CHECK(checksum_of(out) == range.checksum, "patrickstar: checkpoint file \"", where,
              "\" is damaged: the bytes of ", t.name, " at offset ", range.offset,
              " do not match their checksum; nothing was loaded");
  return out;
}

int DataFileReader::open(int64_t file) {
  int& fd = fds_[static_cast<size_t>(file)];
  if (fd >= 0) return fd;
  const std::string where = file_path(file);
  const int opened = ::open(where.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(opened >= 0, "patrickstar: cannot read checkpoint file \"", where, "\" (",
              std::strerror(errno), "), a data file of checkpoint \"", path_,
              "\"; nothing was loaded");
  // Kept only once it passes the checks below.
  struct Closer {
    int fd;
    ~Closer() {
      if (fd >= 0) ::close(fd);
    }
  } closer{opened};
  const Seal seal = read_seal(opened, where);
  const IndexFile& expected = index_.files[static_cast<size_t>(file)];
  TORCH_CHECK(seal.bytes == expected.bytes && seal.checksum == expected.checksum,
              "patrickstar: checkpoint file \"", where, "\" is not the one its index \"", path_,
              "\" lists (", seal.bytes, " bytes, checksum ", hex64(seal.checksum),
              "; the index: ", expected.bytes, " bytes, ", hex64(expected.checksum),
              "); nothing was loaded");
  fd = opened;
  closer.fd = -1;
  return fd;
}

}  // namespace patrickstar::engine_detail
