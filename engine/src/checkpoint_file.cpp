#include "checkpoint_file.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ATen/ops/from_blob.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include "patrickstar/engine/atomic_file.h"

namespace patrickstar::engine_detail {
namespace {

constexpr char kMagic[] = "patrickstar ckpt";  // 16 characters, without the terminating zero
constexpr size_t kMagicBytes = sizeof(kMagic) - 1;
constexpr size_t kTrailerBytes = 16 + kMagicBytes;
static_assert(kMagicBytes == 16);

uint64_t mix(uint64_t h, uint64_t word) {
  h = (h ^ word) * 0xff51afd7ed558ccdULL;  // odd multiplier: a bijection
  return h ^ (h >> 32);                      // a bijection too
}

void put_le64(unsigned char* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<unsigned char>(v >> (8 * i));
}

uint64_t get_le64(const unsigned char* in) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(in[i]) << (8 * i);
  return v;
}

// An open file that closes itself; shared by the archive's read function for as long as it lives.
struct OpenFile {
  int fd = -1;
  ~OpenFile() {
    if (fd >= 0) ::close(fd);
  }
};

int64_t read_at(int fd, void* data, size_t bytes, uint64_t offset) {
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd, static_cast<char*>(data) + done, bytes - done,
                              static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return -1;
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  return static_cast<int64_t>(done);
}

}  // namespace

void Checksum::update(const void* data, size_t bytes) {
  if (bytes == 0) return;  // data may be null then, which memcpy must not see
  const auto* in = static_cast<const unsigned char*>(data);
  bytes_ += bytes;
  while (bytes > 0 && pending_size_ > 0) {  // complete the word an earlier piece began
    pending_[pending_size_++] = *in++;
    --bytes;
    if (pending_size_ == 8) {
      uint64_t word = 0;
      std::memcpy(&word, pending_, 8);
      state_ = mix(state_, word);
      pending_size_ = 0;
    }
  }
  for (; bytes >= 8; bytes -= 8, in += 8) {
    uint64_t word = 0;
    std::memcpy(&word, in, 8);
    state_ = mix(state_, word);
  }
  std::memcpy(pending_ + pending_size_, in, bytes);
  pending_size_ += bytes;
}

uint64_t Checksum::value() const {
  uint64_t h = state_;
  if (pending_size_ > 0) {
    uint64_t word = 0;
    std::memcpy(&word, pending_, pending_size_);
    h = mix(h, word);
  }
  h = mix(h, bytes_);
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ULL;
  return h ^ (h >> 33);
}

void save_sealed_archive(torch::serialize::OutputArchive& archive, const std::string& path) {
  AtomicFileWriter file(path);
  Checksum sum;
  uint64_t bytes = 0;
  // The writer function always reports every byte taken: LibTorch's zip writer throws from its
  // destructor (std::terminate) when a write comes up short. A failed write is remembered by
  // `file`, later writes are dropped, and commit() throws the cause.
  archive.save_to([&](const void* data, size_t n) -> size_t {
    file.write(data, n);
    sum.update(data, n);
    bytes += n;
    return n;
  });
  unsigned char trailer[kTrailerBytes];
  put_le64(trailer, bytes);
  put_le64(trailer + 8, sum.value());
  std::memcpy(trailer + 16, kMagic, kMagicBytes);
  file.write(trailer, sizeof(trailer));
  file.commit();
}

void load_sealed_archive(torch::serialize::InputArchive& archive, const std::string& path) {
  auto refuse = [&](const std::string& why) {
    TORCH_CHECK(false, "patrickstar: checkpoint \"", path, "\" ", why, "; nothing was loaded");
  };
  auto unreadable = [&](const char* why) {
    TORCH_CHECK(false, "patrickstar: cannot read checkpoint \"", path, "\": ", why,
                "; nothing was loaded");
  };
  auto file = std::make_shared<OpenFile>();
  file->fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (file->fd < 0) unreadable(std::strerror(errno));
  struct stat st {};
  if (::fstat(file->fd, &st) != 0) unreadable(std::strerror(errno));
  if (!S_ISREG(st.st_mode)) unreadable("not a regular file");
  const auto size = static_cast<uint64_t>(st.st_size);
  const std::string not_sealed =
      "does not end with the trailer patrickstar's save_checkpoint writes: it was cut short, or "
      "another program (or a patrickstar before checkpoint format " +
      std::to_string(kCheckpointFormat) + ") wrote it";
  if (size < kTrailerBytes) refuse("is " + std::to_string(size) + " bytes and " + not_sealed);
  unsigned char trailer[kTrailerBytes];
  if (read_at(file->fd, trailer, kTrailerBytes, size - kTrailerBytes) !=
      static_cast<int64_t>(kTrailerBytes)) {
    unreadable(std::strerror(errno));
  }
  if (std::memcmp(trailer + 16, kMagic, kMagicBytes) != 0) refuse(not_sealed);
  const uint64_t payload = size - kTrailerBytes;
  if (get_le64(trailer) != payload) {
    refuse("is damaged: its trailer counts " + std::to_string(get_le64(trailer)) +
           " bytes of data before it, the file holds " + std::to_string(payload));
  }
  ::posix_fadvise(file->fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  Checksum sum;
  {
    std::vector<unsigned char> buffer(size_t{1} << 20);
    for (uint64_t at = 0; at < payload;) {
      const size_t want = static_cast<size_t>(std::min<uint64_t>(buffer.size(), payload - at));
      if (read_at(file->fd, buffer.data(), want, at) != static_cast<int64_t>(want)) {
        unreadable(std::strerror(errno));
      }
      sum.update(buffer.data(), want);
      at += want;
    }
  }
  if (sum.value() != get_le64(trailer + 8)) {
    refuse("is damaged: its " + std::to_string(payload) +
           " bytes of data do not match their checksum (a changed byte, or a partial write)");
  }
  // Only verified bytes reach LibTorch's reader.
  try {
    archive.load_from(
        [file, payload](uint64_t pos, void* buf, size_t n) -> size_t {
          if (pos >= payload) return 0;
          const size_t want = static_cast<size_t>(std::min<uint64_t>(n, payload - pos));
          const int64_t got = read_at(file->fd, buf, want, pos);
          return got < 0 ? 0 : static_cast<size_t>(got);
        },
        [payload]() -> size_t { return static_cast<size_t>(payload); });
  } catch (const c10::Error& e) {
    refuse(std::string("passed its checksum but LibTorch cannot read it (") +
           e.what_without_backtrace() + ")");
  } catch (const std::exception& e) {
    refuse(std::string("passed its checksum but LibTorch cannot read it (") + e.what() + ")");
  }
}

int64_t read_file_at(int fd, void* data, size_t bytes, uint64_t offset) {
  return read_at(fd, data, bytes, offset);
}

namespace {
void put_trailer(unsigned char* trailer, uint64_t bytes, uint64_t checksum) {
  put_le64(trailer, bytes);
  put_le64(trailer + 8, checksum);
  std::memcpy(trailer + 16, kMagic, kMagicBytes);
}
}  // namespace

void save_sealed_text(const std::string& text, const std::string& path) {
  AtomicFileWriter file(path);
  Checksum sum;
  sum.update(text.data(), text.size());
  file.write(text.data(), text.size());
  unsigned char trailer[kTrailerBytes];
  put_trailer(trailer, text.size(), sum.value());
  file.write(trailer, sizeof(trailer));
  file.commit();
}

Seal read_seal(int fd, const std::string& path) {
  struct stat st {};
  TORCH_CHECK(::fstat(fd, &st) == 0 && S_ISREG(st.st_mode),
              "patrickstar: cannot read checkpoint "
              "file \"",
              path, "\": not a regular file; nothing was loaded");
  const auto size = static_cast<uint64_t>(st.st_size);
  unsigned char trailer[kTrailerBytes];
  TORCH_CHECK(size >= kTrailerBytes &&
                  read_at(fd, trailer, kTrailerBytes, size - kTrailerBytes) ==
                      static_cast<int64_t>(kTrailerBytes) &&
                  std::memcmp(trailer + 16, kMagic, kMagicBytes) == 0,
              "patrickstar: checkpoint file \"", path, "\" (", size,
              " bytes) does not end with the "
              "trailer patrickstar's save_checkpoint writes: it was cut short, or another program "
              "wrote it; nothing was loaded");
  TORCH_CHECK(get_le64(trailer) == size - kTrailerBytes, "patrickstar: checkpoint file \"", path,
              "\" is damaged: its trailer counts ", get_le64(trailer),
              " bytes of data before it, "
              "the file holds ",
              size - kTrailerBytes, "; nothing was loaded");
  return Seal{static_cast<int64_t>(size - kTrailerBytes), get_le64(trailer + 8)};
}

std::string load_sealed_text(const std::string& path) {
  OpenFile file;
  file.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(file.fd >= 0, "patrickstar: cannot read checkpoint \"", path,
              "\": ", std::strerror(errno), "; nothing was loaded");
  const Seal seal = read_seal(file.fd, path);
  TORCH_CHECK(seal.bytes <= (int64_t{1} << 32), "patrickstar: checkpoint \"", path,
              "\" has an index of ", seal.bytes,
              " bytes, more than an index can be; nothing was loaded");
  std::string text(static_cast<size_t>(seal.bytes), '\0');
  TORCH_CHECK(read_at(file.fd, text.data(), text.size(), 0) == seal.bytes,
              "patrickstar: cannot read checkpoint \"", path, "\": ", std::strerror(errno),
              "; nothing was loaded");
  Checksum sum;
  sum.update(text.data(), text.size());
  TORCH_CHECK(sum.value() == seal.checksum, "patrickstar: checkpoint \"", path,
              "\" is damaged: its ", seal.bytes,
              " bytes of data do not match their checksum (a changed byte, or a "
              "partial write); nothing was loaded");
  return text;
}

struct SealedFileWriter::Impl {
  explicit Impl(const std::string& path) : file(path) {}
  AtomicFileWriter file;
  Checksum sum;
};

SealedFileWriter::SealedFileWriter(const std::string& path) : impl_(new Impl(path)) {}

SealedFileWriter::~SealedFileWriter() {
  delete impl_;
}

void SealedFileWriter::write(const void* data, size_t bytes) {
  impl_->file.write(data, bytes);
  impl_->sum.update(data, bytes);
  bytes_ += static_cast<int64_t>(bytes);
}

uint64_t SealedFileWriter::commit() {
  const uint64_t checksum = impl_->sum.value();
  unsigned char trailer[kTrailerBytes];
  put_trailer(trailer, static_cast<uint64_t>(bytes_), checksum);
  impl_->file.write(trailer, sizeof(trailer));
  impl_->file.commit();
  return checksum;
}

at::Tensor text_tensor(const std::string& text) {
  return at::from_blob(const_cast<char*>(text.data()), {static_cast<int64_t>(text.size())}, at::kChar)
      .clone();
}

std::string tensor_text(const at::Tensor& t) {
  TORCH_CHECK(t.defined() && t.dim() == 1 && (t.scalar_type() == at::kChar ||
                                                 t.scalar_type() == at::kByte),
              "a text record is a 1-D tensor of 8-bit elements");
  if (t.numel() == 0) return {};
  const at::Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.numel()));
}

}  // namespace patrickstar::engine_detail
