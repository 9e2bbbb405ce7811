// libFuzzer target: the checkpoint loaders, bytes in: format 3's read_checkpoint_file and format
// 4's index parser (parse_checkpoint_index). The first byte picks how the rest is used:
//   2 mod 4: the rest is the text of a format-4 index. Every field is checked by the parser; an
//         index that parses must come back the same from its own text.
//   0 mod 4: the rest is the file, as it is. Damaged, truncated or foreign bytes must be refused
//         before LibTorch's archive reader sees them (only a sealed file passes the trailer).
//   odd:  the rest describes records (key, type, shape, bytes). The target writes them into a
//         LibTorch archive and seals it, so it passes the checksum, and every record check of the
//         loader meets arbitrary types, shapes and values.
// Either way the loader must return contents or throw c10::Error; anything else (another
// exception, a crash, a sanitizer report) is a finding. Contents that load must also survive a
// round trip: written again and read back, they are the same.
//
// PATRICKSTAR_FUZZ_WRITE_SEEDS=<folder> writes seed inputs there (a valid checkpoint in both
// forms) and exits: scripts/test seeds each run with them, so the seeds follow the format.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <unistd.h>

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/serialize/output-archive.h>

#include "checkpoint_file.h"
#include "checkpoint_index.h"

namespace {

using patrickstar::engine_detail::CheckpointContents;
using patrickstar::engine_detail::read_checkpoint_file;
using patrickstar::engine_detail::save_sealed_archive;
using patrickstar::engine_detail::write_checkpoint_file;

const char* const kKeys[] = {"format", "config_json", "precision", "names",    "world_size",
                             "rank",   "chunk_elems", "adam_step", "iteration", "scaler",
                             "master_", "exp_avg_",   "exp_avg_sq_", "other"};
constexpr size_t kKeyCount = sizeof(kKeys) / sizeof(kKeys[0]);
const at::ScalarType kTypes[] = {at::kChar, at::kByte, at::kLong, at::kFloat,
                                 at::kDouble, at::kInt, at::kHalf, at::kBool};
constexpr size_t kTypeCount = sizeof(kTypes) / sizeof(kTypes[0]);

std::string scratch_path() {
  const char* shm = "/dev/shm";
  const std::string folder = ::access(shm, W_OK) == 0 ? shm : "/tmp";
  return folder + "/ps_checkpoint_fuzz_" + std::to_string(::getpid());
}

struct Input {
  const uint8_t* data;
  size_t size;
  uint8_t byte() {
    if (size == 0) return 0;
    --size;
    return *data++;
  }
};

// Record descriptions: key index, parameter index (keys ending in '_'), type index, rank, sizes,
// then the elements' bytes (zeros when the input runs out).
void append_record(std::string& out, size_t key, int id, size_t type, std::vector<uint8_t> sizes,
                   const void* bytes, size_t count) {
  out += static_cast<char>(key);
  if (std::string(kKeys[key]).back() == '_') out += static_cast<char>(id);
  out += static_cast<char>(type);
  out += static_cast<char>(sizes.size());
  for (uint8_t s : sizes) out += static_cast<char>(s);
  out.append(static_cast<const char*>(bytes), count);
}

void write_records(Input in, const std::string& path) {
  torch::serialize::OutputArchive archive;
  std::set<std::string> written;
  for (int records = 0; in.size > 0 && records < 64; ++records) {
    std::string key = kKeys[in.byte() % kKeyCount];
    if (key.back() == '_') key += std::to_string(in.byte() % 8);
    const at::ScalarType type = kTypes[in.byte() % kTypeCount];
    std::vector<int64_t> sizes(in.byte() % 4);
    for (int64_t& s : sizes) s = in.byte() % 9;
    at::Tensor t = at::empty(sizes, at::TensorOptions().dtype(type));
    auto* bytes = static_cast<uint8_t*>(t.data_ptr());
    for (size_t i = 0; i < t.nbytes(); ++i) bytes[i] = in.byte();
    if (type == at::kBool) {
      for (size_t i = 0; i < t.nbytes(); ++i) bytes[i] &= 1;  // a bool is 0 or 1
    }
    if (written.insert(key).second) archive.write(key, t);
  }
  save_sealed_archive(archive, path);
}

// Bit for bit (a NaN read back is the same NaN). Undefined on both sides is the same: a lean
// parameter's record has no moments.
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined()) return a.defined() == b.defined();
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::Tensor x = a.contiguous(), y = b.contiguous();
  return x.nbytes() == 0 || std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

bool same(const CheckpointContents& a, const CheckpointContents& b) {
  if (a.config_json != b.config_json || a.precision != b.precision || a.names != b.names ||
      a.world_size != b.world_size || a.rank != b.rank || a.chunk_elems != b.chunk_elems ||
      a.adam_step != b.adam_step || a.param_steps != b.param_steps || a.iteration != b.iteration ||
      std::memcmp(&a.scaler.scale, &b.scaler.scale, sizeof(double)) != 0 || a.scaler.step != b.scaler.step ||
      a.scaler.last_overflow_step != b.scaler.last_overflow_step ||
      a.scaler.hysteresis_left != b.scaler.hysteresis_left || a.params.size() != b.params.size()) {
    return false;
  }
  for (const auto& [id, p] : a.params) {
    auto it = b.params.find(id);
    if (it == b.params.end() || !same_bits(p.master, it->second.master) ||
        !same_bits(p.exp_avg, it->second.exp_avg) ||
        !same_bits(p.exp_avg_sq, it->second.exp_avg_sq)) {
      return false;
    }
  }
  return true;
}

void write_seeds(const std::string& folder) {
  std::string records;
  const int64_t format = patrickstar::engine_detail::kCheckpointFormat, one = 1, zero = 0;
  const int64_t chunk = 64;
  const std::string config = "{}", precision = "fp32", names = "w\nb\n";
  const double scaler[4] = {65536.0, 1.0, -1.0, 2.0};
  append_record(records, 0, 0, 2, {}, &format, 8);
  append_record(records, 1, 0, 0, {static_cast<uint8_t>(config.size())}, config.data(), config.size());
  append_record(records, 2, 0, 0, {static_cast<uint8_t>(precision.size())}, precision.data(),
                precision.size());
  append_record(records, 3, 0, 0, {static_cast<uint8_t>(names.size())}, names.data(), names.size());
  append_record(records, 4, 0, 2, {}, &one, 8);
  append_record(records, 5, 0, 2, {}, &zero, 8);
  append_record(records, 6, 0, 2, {}, &chunk, 8);
  append_record(records, 7, 0, 2, {}, &one, 8);
  append_record(records, 8, 0, 2, {}, &one, 8);
  append_record(records, 9, 0, 4, {4}, scaler, sizeof(scaler));
  const float w[6] = {0.5f, -1.0f, 2.0f, 0.25f, 3.0f, -0.125f};
  const float b[2] = {0.1f, -0.2f};
  for (size_t key = 10; key <= 12; ++key) {
    append_record(records, key, 0, 3, {2, 3}, w, sizeof(w));
    append_record(records, key, 1, 3, {2}, b, sizeof(b));
  }
  std::ofstream(folder + "/records_valid", std::ios::binary) << '\x01' << records;
  // The same checkpoint as a file: sealed by the target's own writer path, read back as bytes.
  const std::string path = scratch_path();
  write_records(Input{reinterpret_cast<const uint8_t*>(records.data()), records.size()}, path);
  std::ifstream file(path, std::ios::binary);
  std::ofstream(folder + "/file_valid", std::ios::binary) << '\x00' << file.rdbuf();
  std::remove(path.c_str());
}

}  // namespace

// A format-4 index parsed from `text`, written again and parsed back: the same text both times.
int fuzz_index(const std::string& text) {
  using patrickstar::engine_detail::checkpoint_index_text;
  using patrickstar::engine_detail::parse_checkpoint_index;
  std::string once;
  try {
    once = checkpoint_index_text(parse_checkpoint_index(text, "fuzz"));
  } catch (const c10::Error&) {
    return 0;  // refused, with its reason
  }
  if (checkpoint_index_text(parse_checkpoint_index(once, "fuzz")) != once) {
    std::fprintf(stderr, "checkpoint_fuzzer: an index changed in a write and read back\n");
    std::abort();
  }
  return 0;
}

void write_index_seed(const std::string& folder) {
  patrickstar::engine_detail::CheckpointIndex index;
  index.config_json = R"({"train_batch_size": 4})";
  index.precision = "bf16";
  index.world_size = 2;
  index.shard_group_size = 2;
  index.chunk_elems = 64;
  index.iteration = 3;
  index.adam_step = 3;
  index.scaler.scale = 1.0;
  index.files = {{"ckpt.00000000000000aa.rank0-of-2", 96, 0x1234},
                 {"ckpt.00000000000000aa.rank1-of-2", 8, 0x9abc}};
  patrickstar::engine_detail::IndexTensor w;
  w.name = "w";
  w.shape = {2, 4};
  w.numel = 8;
  w.adam_steps = 3;
  w.master = {0, 1};
  w.exp_avg = {32, 2};
  w.exp_avg_sq = {64, 3};
  patrickstar::engine_detail::IndexTensor b = w;
  b.name = "b";
  b.shape = {2};
  b.numel = 2;
  b.trainable = false;
  b.file = 1;
  b.master = {0, 4};
  b.exp_avg = b.exp_avg_sq = {};
  index.tensors = {w, b};
  std::ofstream(folder + "/index_valid", std::ios::binary)
      << '\x02' << patrickstar::engine_detail::checkpoint_index_text(index);
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* folder = std::getenv("PATRICKSTAR_FUZZ_WRITE_SEEDS")) {
    write_seeds(folder);
    write_index_seed(folder);
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = scratch_path();
  Input in{data, size};
  const uint8_t mode = in.byte();
  if (mode % 4 == 2) {
    return fuzz_index(std::string(reinterpret_cast<const char*>(in.data), in.size));
  }
  if (mode % 2 == 0) {
    std::ofstream(path, std::ios::binary | std::ios::trunc)
        .write(reinterpret_cast<const char*>(in.data), static_cast<std::streamsize>(in.size));
  } else {
    write_records(in, path);
  }
  CheckpointContents contents;
  try {
    contents = read_checkpoint_file(path);
  } catch (const c10::Error&) {
    return 0;  // refused, with its reason
  }
  write_checkpoint_file(contents, path);
  if (!same(read_checkpoint_file(path), contents)) {
    std::fprintf(stderr, "checkpoint_fuzzer: contents changed in a write and read back\n");
    std::abort();
  }
  return 0;
}
