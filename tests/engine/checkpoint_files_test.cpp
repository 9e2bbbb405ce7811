// A checkpoint's files (format 4) without an engine, and what save and load cost: ps_ckpt's library
// (read_checkpoint_info, verify_checkpoint, export_checkpoint_weights), damage to a data file
// (every flipped byte caught, by the loader and by verify), and the host memory a save and a load
// take beyond the chunks.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "checkpoint_tensors.h"
#include "error_message.h"
#include "gpt_training.h"
#include "patrickstar/engine/checkpoint_files.h"
#include "patrickstar/engine/engine_inspect.h"
#include "patrickstar/memtracer/counting_allocator.h"
#include "patrickstar/patrickstar.h"
#include "temp_folder.h"

namespace patrickstar {
namespace checkpoint_files_test {

using ::testing::HasSubstr;
using namespace test;  // NOLINT: the shared helpers of gpt_training.h

std::string data_file_of(const std::string& index) {
  return index.substr(0, index.rfind('/') + 1) +
         SavedTensors(index).index()["files"][0]["name"].get<std::string>();
}

TEST(CheckpointFiles, ShowsVerifiesAndExportsWhatWasSaved) {
  TempFolder folder("ps-ckpt-files");
  const std::string path = folder.path() + "/run.ckpt";
  models::Gpt model = make_model(1);
  Engine engine(model.ptr(), tight_config());
  for (int s = 0; s < 3; ++s) train_step(engine, model, s);
  engine.save_checkpoint(path);
  const auto weights = engine.fp32_state_dict();

  const CheckpointInfo info = read_checkpoint_info(path);
  EXPECT_EQ(info.world_size, 1);
  EXPECT_EQ(info.iteration, 3);
  EXPECT_EQ(info.adam_step, 3);
  EXPECT_EQ(info.chunk_elems, 40000);
  EXPECT_EQ(info.precision, "fp32");
  ASSERT_EQ(info.tensors.size(), weights.size());
  int64_t parameters = 0, bytes = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    EXPECT_EQ(info.tensors[i].name, weights[i].first);
    EXPECT_EQ(c10::IntArrayRef(info.tensors[i].shape), weights[i].second.sizes());
    EXPECT_TRUE(info.tensors[i].moments);
    EXPECT_EQ(info.tensors[i].adam_steps, 3);
    parameters += weights[i].second.numel();
    bytes += info.tensors[i].bytes;
  }
  EXPECT_EQ(info.parameters, parameters);
  EXPECT_EQ(info.data_bytes, 12 * parameters);  // weights, momentum, variance in fp32
  EXPECT_EQ(bytes, info.data_bytes);
  ASSERT_EQ(info.files.size(), 1u);
  std::printf(
      "gpt_tiny checkpoint: %zu tensors, %lld parameters, %lld bytes of data, index %zu "
      "bytes\n",
      info.tensors.size(), static_cast<long long>(info.parameters),
      static_cast<long long>(info.data_bytes), file_bytes(path).size());

  EXPECT_TRUE(verify_checkpoint(path).empty());

  // The weights as safetensors, renamed and one left out; read back as they were.
  SafetensorsOptions options;
  options.rename = [](const std::string& name) {
    return name == "wte.weight" ? std::string() : "model." + name;
  };
  int64_t last_done = -1, total = 0;
  const SafetensorsSaveReport report = export_checkpoint_weights(
      path, folder.path() + "/hf", options, [&](int64_t done, int64_t all) {
        EXPECT_GT(done, last_done);
        last_done = done;
        total = all;
      });
  EXPECT_EQ(last_done, total);
  EXPECT_EQ(report.tensors, static_cast<int64_t>(weights.size()) - 1);
  SafetensorsCheckpoint exported(folder.path() + "/hf");
  for (const auto& [name, value] : weights) {
    if (name == "wte.weight") {
      EXPECT_FALSE(exported.contains("model." + name));
      continue;
    }
    EXPECT_TRUE(torch::equal(exported.read("model." + name), value)) << name;
  }

  // A format-3 file or any other is refused, saying what it is not.
  write_file_bytes(folder.path() + "/other", "PK not an index");
  EXPECT_THAT(error_of([&] { read_checkpoint_info(folder.path() + "/other"); }),
              HasSubstr("is not a checkpoint index (format 4)"));
}

// Every flipped byte of the data file, its trailer included, and every truncation: the loader
// refuses the checkpoint naming the file, with nothing loaded, and verify reports it.
TEST(CheckpointFiles, EveryFlippedByteOfADataFileIsCaught) {
  TempFolder folder("ps-ckpt-flips");
  const std::string path = folder.path() + "/run.ckpt";
  {
    models::Gpt model = make_model(1);
    Engine engine(model.ptr(), tight_config());
    train_step(engine, model, 0);
    engine.save_checkpoint(path);
  }
  const std::string data = data_file_of(path);
  const std::string good = file_bytes(data);
  models::Gpt model = make_model(2);
  Engine engine(model.ptr(), tight_config());
  train_step(engine, model, 0);
  const auto before = engine.fp32_state_dict();
  int tried = 0, refused = 0, reported = 0;
  auto damaged_is_caught = [&](const std::string& bytes, const std::string& what) {
    write_file_bytes(data, bytes);
    const std::string error = error_of([&] { engine.load_checkpoint(path); });
    ++tried;
    if (error.find(data) != std::string::npos &&
        error.find("nothing was loaded") != std::string::npos) {
      ++refused;
    } else {
      ADD_FAILURE() << what << ": " << error;
    }
    reported += verify_checkpoint(path).empty() ? 0 : 1;
  };
  // Points spread over the data and every byte of the 32-byte trailer.
  std::vector<size_t> points;
  for (int i = 0; i < 257; ++i) points.push_back(good.size() * static_cast<size_t>(i) / 257);
  for (size_t i = good.size() - 32; i < good.size(); ++i) points.push_back(i);
  for (size_t at : points) {
    std::string bytes = good;
    bytes[at] = static_cast<char>(bytes[at] ^ 0x10);
    damaged_is_caught(bytes, "byte " + std::to_string(at) + " flipped");
  }
  for (int i = 0; i < 33; ++i) {
    const size_t at = good.size() * static_cast<size_t>(i) / 33;
    damaged_is_caught(good.substr(0, at), "cut at " + std::to_string(at));
  }
  const auto after = engine.fp32_state_dict();
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(torch::equal(before[i].second, after[i].second)) << before[i].first;
  }
  std::printf(
      "data file of %zu bytes: %d damaged copies (flipped bits and truncations), %d refused "
      "by the loader, %d reported by verify\n",
      good.size(), tried, refused, reported);
  EXPECT_EQ(refused, tried);
  EXPECT_EQ(reported, tried);
  write_file_bytes(data, good);
  engine.load_checkpoint(path);  // intact again: it loads
}

int64_t vm_hwm_kib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6));
  }
  return -1;
}

// A save streams one tensor at a time and a load reads one at a time: beyond the chunks, each takes
// at most one chunk's fp32 bytes of LibTorch's host memory (the counting allocator's peak).
TEST(CheckpointFiles, SaveAndLoadHoldAtMostOneChunkBeyondTheChunks) {
  TempFolder folder("ps-ckpt-peak");
  const std::string path = folder.path() + "/run.ckpt";
  models::Gpt model = make_model(1);
  Engine engine(model.ptr(), tight_config());
  train_step(engine, model, 0);
  CountingCpuAllocator& counter = CountingCpuAllocator::install();
  const int64_t chunk_bytes = inspect(engine).chunks().chunk_elems() * 4;
  auto extra_peak = [&](const std::function<void()>& f) {
    const int window = counter.open_peak_window();
    const int64_t live = counter.live_bytes();
    f();
    const int64_t peak = counter.window_peak_bytes(window) - live;
    counter.close_peak_window(window);
    return peak;
  };
  const int64_t hwm_before = vm_hwm_kib();
  const int64_t save_peak = extra_peak([&] { engine.save_checkpoint(path); });
  const int64_t load_peak = extra_peak([&] { engine.load_checkpoint(path); });
  const int64_t hwm_after = vm_hwm_kib();
  std::printf(
      "model data %lld bytes (fp32 weights and moments), chunk %lld bytes: host bytes "
      "beyond the chunks at the peak: save %lld, load %lld; VmHWM %lld -> %lld KiB\n",
      static_cast<long long>(read_checkpoint_info(path).data_bytes),
      static_cast<long long>(chunk_bytes), static_cast<long long>(save_peak),
      static_cast<long long>(load_peak), static_cast<long long>(hwm_before),
      static_cast<long long>(hwm_after));
  EXPECT_LE(save_peak, chunk_bytes);
  EXPECT_LE(load_peak, chunk_bytes);
}

}  // namespace checkpoint_files_test
}  // namespace patrickstar
