// ChunkFiles, the disk tier's files: whole chunks round-trip, a missing or short file is an error
// naming the chunk and the file, the files go with the object, and a bad folder is refused.
#include <gtest/gtest.h>

#include <dirent.h>
#include <unistd.h>

#include <cstdlib>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>

#include "patrickstar/chunk/chunk_files.h"

namespace patrickstar {
namespace {

std::string make_folder() {
  std::string pattern = "/tmp/ps-chunk-files-XXXXXX";
  EXPECT_NE(::mkdtemp(pattern.data()), nullptr);
  return pattern;
}

int count_files(const std::string& folder) {
  int n = 0;
  if (DIR* dir = ::opendir(folder.c_str())) {
    while (const dirent* e = ::readdir(dir)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") ++n;
    }
    ::closedir(dir);
  }
  return n;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "<no error>";
}

TEST(ChunkFiles, WholeChunksRoundTripFromTwoThreadsAndTheFilesGoWithTheObject) {
  const std::string folder = make_folder();
  {
    ChunkFiles files(folder);
    std::vector<float> a(300000), b(200001);
    std::iota(a.begin(), a.end(), 1.0f);
    std::iota(b.begin(), b.end(), -5.0f);
    const auto a_bytes = static_cast<int64_t>(a.size() * sizeof(float));
    const auto b_bytes = static_cast<int64_t>(b.size() * sizeof(float));
    std::thread other([&] { files.write(ChunkKind::kVariance, 1, b.data(), b_bytes); });
    files.write(ChunkKind::kMomentum, 0, a.data(), a_bytes);
    other.join();
    EXPECT_EQ(count_files(folder), 2);
    EXPECT_EQ(files.bytes_written(), a_bytes + b_bytes);
    std::vector<float> a2(a.size()), b2(b.size());
    files.check(ChunkKind::kMomentum, 0, a_bytes);
    files.read(ChunkKind::kMomentum, 0, a2.data(), a_bytes);
    files.read(ChunkKind::kVariance, 1, b2.data(), b_bytes);
    EXPECT_EQ(a, a2);
    EXPECT_EQ(b, b2);
    EXPECT_EQ(files.bytes_read(), a_bytes + b_bytes);
    // Rewriting replaces the file.
    a[7] = 42.0f;
    files.write(ChunkKind::kMomentum, 0, a.data(), a_bytes);
    files.read(ChunkKind::kMomentum, 0, a2.data(), a_bytes);
    EXPECT_EQ(a2[7], 42.0f);
    files.remove(ChunkKind::kVariance, 1);
    EXPECT_EQ(count_files(folder), 1);
  }
  EXPECT_EQ(count_files(folder), 0);
  ::rmdir(folder.c_str());
}

TEST(ChunkFiles, AMissingOrShortFileIsAnErrorNamingTheChunkAndTheFile) {
  const std::string folder = make_folder();
  {
    ChunkFiles files(folder);
    std::vector<char> data(4096, 'x');
    files.write(ChunkKind::kParamFp32, 3, data.data(), 4096);
    const std::string never = error_of([&] { files.read(ChunkKind::kMomentum, 5, data.data(), 4096); });
    EXPECT_NE(never.find("momentum chunk 5"), std::string::npos) << never;
    EXPECT_NE(never.find(files.path(ChunkKind::kMomentum, 5)), std::string::npos) << never;
    EXPECT_NE(never.find("removed"), std::string::npos) << never;
    ASSERT_EQ(::truncate(files.path(ChunkKind::kParamFp32, 3).c_str(), 100), 0);
    const std::string short_read =
        error_of([&] { files.read(ChunkKind::kParamFp32, 3, data.data(), 4096); });
    EXPECT_NE(short_read.find("param_fp32 chunk 3"), std::string::npos) << short_read;
    EXPECT_NE(short_read.find("holds 100 bytes, expected 4096"), std::string::npos) << short_read;
    EXPECT_EQ(error_of([&] { files.check(ChunkKind::kParamFp32, 3, 4096); }), short_read);
    ASSERT_EQ(::unlink(files.path(ChunkKind::kParamFp32, 3).c_str()), 0);
    EXPECT_NE(error_of([&] { files.check(ChunkKind::kParamFp32, 3, 4096); }).find("removed"),
              std::string::npos);
  }
  ::rmdir(folder.c_str());
}

TEST(ChunkFiles, AFolderThatIsMissingOrNotAFolderIsRefused) {
  EXPECT_NE(error_of([] { ChunkFiles files("/nonexistent/ps-chunk-files"); })
                .find("\"/nonexistent/ps-chunk-files\" cannot be used"),
            std::string::npos);
  EXPECT_NE(error_of([] { ChunkFiles files("/proc/self/status"); }).find("is not a folder"),
            std::string::npos);
  EXPECT_NE(error_of([] { ChunkFiles files(""); }).find("nvme_path"), std::string::npos);
}

}  // namespace
}  // namespace patrickstar
