// ChunkFiles, the disk tier's files: whole chunks round-trip, a missing or short file is an error
// naming the chunk and the file, the files go with the object, and a bad folder is refused.
#include <gtest/gtest.h>

#include <unistd.h>

#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>

#include "error_message.h"
#include "patrickstar/chunk/chunk_files.h"
#include "temp_folder.h"

namespace patrickstar {
namespace chunk_files_test {

using test::error_of;
using test::TempFolder;

int count_files(const std::string& folder) {
  return static_cast<int>(test::folder_entries(folder).size());
}

TEST(ChunkFiles, WholeChunksRoundTripFromTwoThreadsAndTheFilesGoWithTheObject) {
  TempFolder scratch("ps-chunk-files");
  const std::string& folder = scratch.path();
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
}

TEST(ChunkFiles, AMissingOrShortFileIsAnErrorNamingTheChunkAndTheFile) {
  TempFolder scratch("ps-chunk-files");
  {
    ChunkFiles files(scratch.path());
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
}

TEST(ChunkFiles, AFolderThatIsMissingOrNotAFolderIsRefused) {
  EXPECT_NE(error_of([] { ChunkFiles files("/nonexistent/ps-chunk-files"); })
                .find("\"/nonexistent/ps-chunk-files\" cannot be used"),
            std::string::npos);
  EXPECT_NE(error_of([] { ChunkFiles files("/proc/self/status"); }).find("is not a folder"),
            std::string::npos);
  EXPECT_NE(error_of([] { ChunkFiles files(""); }).find("nvme_path"), std::string::npos);
}

}  // namespace chunk_files_test
}  // namespace patrickstar
