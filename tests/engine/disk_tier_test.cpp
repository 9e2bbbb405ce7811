// The disk tier (issue: scale): optimizer states in files, streamed through the host Adam.
// Training with it equals training with the states in memory bit for bit (losses, weights,
// checkpoints both ways, teardown); a state file that goes missing is a clear error.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>
#include <nlohmann/json.hpp>

#include "error_message.h"
#include "gpt_training.h"
#include "patrickstar/engine/engine_inspect.h"
#include "patrickstar/patrickstar.h"
#include "temp_folder.h"

namespace patrickstar {
namespace disk_tier_test {

using namespace test;  // NOLINT: the shared helpers of gpt_training.h

// bf16 on a device that moves chunks every iteration, with every Adam on the host.
Config bf16_moving() { return config_with_chunk_room(R"({"bf16": {"enabled": true}})", 240000); }

Config with_disk(Config config, const std::string& folder) {
  nlohmann::json j = config.to_json();
  j["zero_optimization"]["offload_optimizer"] = {{"device", "nvme"}, {"nvme_path", folder}};
  return Config::from_json(j);
}

// One step of the whole batch in `micro` backward passes; returns the report, the loss (of the
// last micro-batch) in *loss.
IterationReport step_of(Engine& engine, models::Gpt& model, int step, int micro, double* loss) {
  auto batch = batch_of_step(step);
  engine.zero_grad();
  const int64_t rows = batch.tokens.size(0) / micro;
  for (int k = 0; k < micro; ++k) {
    at::Tensor out;
    {
      auto active = engine.activate();
      out = model->loss(batch.tokens.narrow(0, k * rows, rows), batch.targets.narrow(0, k * rows, rows));
    }
    engine.backward(out);
    *loss = out.item<double>();
  }
  return engine.step();
}

void expect_same_values(const std::vector<std::pair<std::string, at::Tensor>>& a,
                        const std::vector<std::pair<std::string, at::Tensor>>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    EXPECT_TRUE(at::equal(a[i].second, b[i].second)) << a[i].first;
  }
}

struct Case {
  const char* name;
  const char* extra;
  // Bytes for chunks beyond the measured non-model peak; 0: a 1 GiB device; -1: tight_config's.
  int64_t chunk_room;
};

TEST(DiskTier, TrainingEqualsTheInMemoryRunBitForBit) {
  const Case cases[] = {
      {"fp32, moves every iteration", "{}", -1},
      {"bf16, moves every iteration", R"({"bf16": {"enabled": true}})", 240000},
      {"bf16, gradient accumulation (fp32 gradient space)",
       R"({"bf16": {"enabled": true}, "gradient_accumulation_steps": 2})", 480000},
      {"bf16, a device that takes every Adam (the states come home)",
       R"({"bf16": {"enabled": true}})", 0},
      {"bf16 with bf16 optimizer states (2-byte moments in the files)",
       R"({"bf16": {"enabled": true}, "optimizer": {"params": {"state_dtype": "bf16"}}})", 240000},
      {"fp32 with bf16 optimizer states", R"({"optimizer": {"params": {"state_dtype": "bf16"}}})",
       -1},
      {"fp16 overflowing (half weights restored from the masters on disk)",
       R"({"fp16": {"enabled": true, "initial_scale_power": 100}})", 240000},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Config memory_config = c.chunk_room > 0 ? config_with_chunk_room(c.extra, c.chunk_room)
                                            : tight_config(c.extra);
    if (c.chunk_room == 0) memory_config.device.capacity_bytes = int64_t{1} << 30;
    TempFolder folder("ps-disk-tier");
    const Config disk_config = with_disk(memory_config, folder.path());
    const int micro = memory_config.gradient_accumulation_steps;
    const bool mixed = memory_config.precision() != Precision::kFp32;

    models::Gpt memory_model = make_model(1);
    models::Gpt disk_model = make_model(1);
    auto memory_engine = std::make_unique<Engine>(memory_model.ptr(), memory_config);
    auto disk_engine = std::make_unique<Engine>(disk_model.ptr(), disk_config);
    const RegistrationReport& r = disk_engine->registration();
    // Master (mixed precision), momentum and variance of every chunk index: 12 or 8 bytes per
    // element of each index's capacity (8 or 4 with bf16 states; the last index is cut to what it
    // holds).
    int64_t capacity_elems = 0;
    for (const Chunk& c : inspect(*disk_engine).chunks().chunks(ChunkKind::kMomentum)) {
      capacity_elems += c.capacity_elems;
    }
    EXPECT_LT(capacity_elems, r.chunk_elems * r.chunks_per_kind);
    const int64_t moment_bytes = memory_config.optimizer.state_dtype == StateDtype::kBf16 ? 2 : 4;
    EXPECT_EQ(r.disk_bytes, ((mixed ? 4 : 0) + 2 * moment_bytes) * capacity_elems);
    EXPECT_EQ(r.model_data_bytes, memory_engine->registration().model_data_bytes);
    EXPECT_EQ(static_cast<int64_t>(folder.files().size()), (mixed ? 3 : 2) * r.chunks_per_kind);
    // The host holds only the rest of the model data (the states' payloads are freed).
    EXPECT_EQ(inspect(*disk_engine).host_tier().used_bytes(),
              inspect(*memory_engine).host_tier().used_bytes() - r.disk_bytes);

    bool skipped = false;
    for (int step = 0; step < 4; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      double memory_loss = 0;
      double disk_loss = 0;
      const IterationReport m = step_of(*memory_engine, memory_model, step, micro, &memory_loss);
      const IterationReport d = step_of(*disk_engine, disk_model, step, micro, &disk_loss);
      EXPECT_EQ(memory_loss, disk_loss);  // bit for bit
      EXPECT_EQ(m.skipped, d.skipped);
      EXPECT_EQ(m.adam.chunks_host, d.adam.chunks_host);
      skipped = skipped || d.skipped;
      const int64_t all = r.disk_bytes;  // every index's states
      if (c.chunk_room == 0) {
        // Every Adam goes to the device: the states come home at the first step (read once,
        // never written) and the files go.
        EXPECT_EQ(d.disk_read_bytes, step == 0 ? all : 0);
        EXPECT_EQ(d.disk_written_bytes, 0);
        EXPECT_TRUE(folder.files().empty());
      } else if (d.skipped) {
        // Every Adam on the host. An overflow reads the states (the masters restore the half
        // weights) and writes nothing.
        EXPECT_EQ(d.adam.chunks_device, 0);
        EXPECT_EQ(d.disk_read_bytes, all);
        EXPECT_EQ(d.disk_written_bytes, 0);
      } else {
        // Each index's states are read and written once per step, whole chunks.
        EXPECT_EQ(d.adam.chunks_device, 0);
        EXPECT_EQ(d.disk_read_bytes, all);
        EXPECT_EQ(d.disk_written_bytes, all);
      }
      EXPECT_EQ(m.disk_read_bytes + m.disk_written_bytes, 0);
    }
    if (c.chunk_room == 0) {
      EXPECT_GT(disk_engine->history().back().adam.chunks_device, 0);
    } else {
      EXPECT_GT(disk_engine->history().back().adam.chunks_host, 0);
      // The host's peak is the step's staging, and it holds at most three indices' states (the
      // one updated, the one read ahead, the one written behind).
      const MemoryBreakdown& peak = disk_engine->host_peak_breakdown();
      const int64_t chunk4 = 4 * r.chunk_elems;
      const int64_t staged = peak.host_chunk_bytes[static_cast<size_t>(ChunkKind::kMomentum)];
      EXPECT_GT(staged, 0) << peak.moment;
      EXPECT_LE(staged, 3 * chunk4);
      EXPECT_EQ(peak.host_chunk_bytes[static_cast<size_t>(ChunkKind::kVariance)], staged);
      EXPECT_EQ(peak.device_chunk_bytes[static_cast<size_t>(ChunkKind::kMomentum)], 0);
    }
    if (std::string(c.name).rfind("fp16", 0) == 0) {
      EXPECT_TRUE(skipped);
    }
    const auto weights = disk_engine->fp32_state_dict();
    expect_same_values(weights, memory_engine->fp32_state_dict());

    // Checkpoints both ways: the disk engine saves, a memory engine loads (and the other way);
    // one more step each matches.
    const std::string from_disk = folder.path() + ".a.ckpt";
    const std::string from_memory = folder.path() + ".b.ckpt";
    disk_engine->save_checkpoint(from_disk);
    memory_engine->save_checkpoint(from_memory);
    {
      models::Gpt m2 = make_model(7);
      models::Gpt d2 = make_model(8);
      Engine memory_resumed(m2.ptr(), memory_config);
      Engine disk_resumed(d2.ptr(), with_disk(memory_config, folder.path()));
      memory_resumed.load_checkpoint(from_disk);
      disk_resumed.load_checkpoint(from_memory);
      expect_same_values(disk_resumed.fp32_state_dict(), weights);
      double a = 0, b = 0, x = 0;
      step_of(memory_resumed, m2, 4, micro, &a);
      step_of(disk_resumed, d2, 4, micro, &b);
      step_of(*disk_engine, disk_model, 4, micro, &x);
      EXPECT_EQ(a, b);
      EXPECT_EQ(a, x);
      expect_same_values(memory_resumed.fp32_state_dict(), disk_resumed.fp32_state_dict());
    }
    ::unlink(from_disk.c_str());
    ::unlink(from_memory.c_str());

    // Teardown: the model gets the masters back from the files, which go.
    const auto final_weights = disk_engine->fp32_state_dict();
    disk_engine.reset();
    auto named = disk_model->named_parameters();
    for (const auto& [name, value] : final_weights) {
      EXPECT_TRUE(at::equal(named[name], value)) << name;
    }
    EXPECT_TRUE(folder.files().empty()) << folder.files().size() << " files left";
  }
}

TEST(DiskTier, GatheredParametersWriteThroughToTheFiles) {
  TempFolder folder("ps-disk-tier");
  models::Gpt model = make_model(1);
  Engine engine(model.ptr(), with_disk(bf16_moving(), folder.path()));
  double loss = 0;
  step_of(engine, model, 0, 1, &loss);
  {
    GatheredParameters scope(*model, GatheredParameters::Mode::kReadWrite);
    torch::NoGradGuard no_grad;
    for (auto& p : model->parameters()) p.fill_(0.25);
  }
  for (const auto& [name, value] : engine.fp32_state_dict()) {
    EXPECT_TRUE(at::equal(value, at::full_like(value, 0.25))) << name;
  }
}

TEST(DiskTier, AMissingOrShortStateFileIsAClearError) {
  TempFolder folder("ps-disk-tier");
  models::Gpt model = make_model(1);
  Engine engine(model.ptr(), with_disk(bf16_moving(), folder.path()));
  double loss = 0;
  step_of(engine, model, 0, 1, &loss);
  ASSERT_GT(engine.history().back().adam.chunks_host, 0);
  auto file_of = [&](const char* kind) {
    std::string found;
    for (const std::string& f : folder.files()) {
      if (f.find(kind) != std::string::npos) found = f;
    }
    return found;
  };
  // A momentum file, then a master's (which the failed step's clean-up also wants, to put the
  // half weights back: it warns instead of throwing from inside the error handling).
  for (const char* kind : {"momentum", "param_fp32"}) {
    SCOPED_TRACE(kind);
    const std::string victim = file_of((std::string(".") + kind + ".").c_str());
    ASSERT_FALSE(victim.empty());
    const std::string victim_path = folder.path() + "/" + victim;
    const std::string aside = folder.path() + ".aside";
    const auto before = engine.fp32_state_dict();
    ASSERT_EQ(::rename(victim_path.c_str(), aside.c_str()), 0);
    const std::string index = victim.substr(victim.rfind('.') + 1);
    const std::string error = error_of([&] { step_of(engine, model, 1, 1, &loss); });
    EXPECT_NE(error.find(std::string(kind) + " chunk " + index), std::string::npos) << error;
    EXPECT_NE(error.find(folder.path()), std::string::npos) << error;
    EXPECT_NE(error.find("removed"), std::string::npos) << error;
    EXPECT_NE(error.find("the step was not taken"), std::string::npos) << error;
    // Found before any update: with the file back, the masters are as they were and training
    // goes on.
    ASSERT_EQ(::rename(aside.c_str(), victim_path.c_str()), 0);
    expect_same_values(engine.fp32_state_dict(), before);
    step_of(engine, model, 1, 1, &loss);
    EXPECT_TRUE(std::isfinite(loss));
  }
  // A short file likewise, when a checkpoint reads it.
  const std::string other = file_of(".variance.");
  ASSERT_FALSE(other.empty());
  ASSERT_EQ(::truncate((folder.path() + "/" + other).c_str(), 10), 0);
  const std::string short_error =
      error_of([&] { engine.save_checkpoint(folder.path() + ".ckpt"); });
  EXPECT_NE(short_error.find("holds 10 bytes"), std::string::npos) << short_error;
  ::unlink((folder.path() + ".ckpt").c_str());
}

TEST(DiskTier, AFailedWriteKeepsThatChunksStatesInMemoryAndTrainingMatches) {
  TempFolder folder("ps-disk-tier");
  const Config config = bf16_moving();
  models::Gpt memory_model = make_model(1);
  models::Gpt disk_model = make_model(1);
  Engine memory_engine(memory_model.ptr(), config);
  Engine disk_engine(disk_model.ptr(), with_disk(config, folder.path()));
  double a = 0, b = 0;
  step_of(memory_engine, memory_model, 0, 1, &a);
  step_of(disk_engine, disk_model, 0, 1, &b);
  // A folder where the next write of chunk index 1's momentum would go: that write fails.
  std::string victim;
  for (const std::string& f : folder.files()) {
    if (f.size() > 11 && f.substr(f.size() - 11) == ".momentum.1") victim = f;
  }
  ASSERT_FALSE(victim.empty());
  const std::string blocker = folder.path() + "/" + victim + ".tmp";
  ASSERT_EQ(::mkdir(blocker.c_str(), 0700), 0);
  const RegistrationReport& r = disk_engine.registration();
  const ChunkStore& store = inspect(disk_engine).chunks();
  int64_t index_bytes = 0;  // index 1's states on disk (the last index is smaller: it is cut)
  for (ChunkKind kind : {ChunkKind::kParamFp32, ChunkKind::kMomentum, ChunkKind::kVariance}) {
    index_bytes += store.chunk_bytes(store.chunk_id(kind, 1));
  }
  ASSERT_GT(r.chunks_per_kind, 2);
  for (int step = 1; step < 4; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    step_of(memory_engine, memory_model, step, 1, &a);
    const IterationReport d = step_of(disk_engine, disk_model, step, 1, &b);
    EXPECT_EQ(a, b);  // bit for bit: the states written nowhere stayed in memory
    // Index 1 lives in memory from the failed write on: the next steps read and write the others.
    if (step > 1) {
      EXPECT_EQ(d.disk_read_bytes, r.disk_bytes - index_bytes);
      EXPECT_EQ(d.disk_written_bytes, r.disk_bytes - index_bytes);
    }
  }
  for (const std::string& f : folder.files()) {
    if (f == victim + ".tmp") continue;  // the blocker
    EXPECT_NE(f.substr(f.size() - 2), ".1") << f << ": index 1's files should be gone";
  }
  expect_same_values(disk_engine.fp32_state_dict(), memory_engine.fp32_state_dict());
  ::rmdir(blocker.c_str());
}

TEST(DiskTier, BadFoldersAndConfigsAreClearErrors) {
  EXPECT_NE(error_of([] {
              Config::from_string(R"({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}})");
            }).find("nvme_path"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              Config::from_string(
                  R"({"zero_optimization": {"offload_optimizer": {"device": "tape", "nvme_path": "/tmp"}}})");
            }).find("\"nvme\""),
            std::string::npos);
  const Config round = Config::from_json(
      with_disk(tight_config(), "/some/folder").to_json());
  EXPECT_TRUE(round.offload_optimizer.nvme);
  EXPECT_EQ(round.offload_optimizer.nvme_path, "/some/folder");

  models::Gpt model = make_model(1);
  const std::string error = error_of([&] {
    Engine engine(model.ptr(), with_disk(tight_config(), "/nonexistent/ps-disk-folder"));
  });
  EXPECT_NE(error.find("/nonexistent/ps-disk-folder"), std::string::npos) << error;
  // Nothing was registered: the model trains on with plain LibTorch.
  for (const auto& p : model->parameters()) EXPECT_TRUE(p.defined() && p.numel() > 0 && p.sum().defined());
}

}  // namespace disk_tier_test
}  // namespace patrickstar
