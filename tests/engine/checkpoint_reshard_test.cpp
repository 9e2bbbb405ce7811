// Checkpoints that outlive the run that wrote them (format 4): a checkpoint keyed by tensor loads
// into an engine of another chunk size, optimizer-state dtype or disk tier. Checked two ways: the
// tensors the resumed engine saves again are those it loaded (bit for bit, or rounded as bf16
// states round), and training on matches a run that never stopped.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint_file.h"
#include "checkpoint_tensors.h"
#include "gpt_training.h"
#include "patrickstar/patrickstar.h"
#include "temp_folder.h"

namespace patrickstar {
namespace checkpoint_reshard_test {

using namespace test;  // NOLINT: the shared helpers of gpt_training.h

std::vector<double> train(Engine& engine, models::Gpt& model, int from, int to) {
  std::vector<double> losses;
  for (int s = from; s < to; ++s) {
    double loss = 0;
    train_step(engine, model, s, &loss);
    losses.push_back(loss);
  }
  return losses;
}

Config with(const std::string& extra, const std::string& disk_folder = "") {
  Config config = tight_config(extra);
  if (disk_folder.empty()) return config;
  nlohmann::json j = config.to_json();
  j["zero_optimization"]["offload_optimizer"] = {{"device", "nvme"}, {"nvme_path", disk_folder}};
  return Config::from_json(j);
}

struct Case {
  const char* name;
  std::string from, to;  // config patches
  bool from_disk = false, to_disk = false;
};

// Another chunk size, the disk tier on <-> off: the resumed engine holds
// exactly what was saved and trains on as a run that never stopped.
TEST(CheckpointReshard, ResumesUnderAnotherChunkSizeOrDiskTier) {
  // (fp32 <-> bf16 states: Bf16States.CheckpointsLoadBothWaysAndResumeBitExactly.)
  const std::vector<Case> cases = {
      {"chunks of 40000 -> 32768", "{}", R"({"default_chunk_size": 32768})"},
      {"chunks of 32768 -> 40000", R"({"default_chunk_size": 32768})", "{}"},
      {"memory -> disk tier", "{}", "{}", false, true},
      {"disk tier -> memory", "{}", "{}", true, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    TempFolder folder("ps-reshard");
    const std::string saved = folder.path() + "/a.ckpt";
    const std::string again = folder.path() + "/b.ckpt";
    const Config from = with(c.from, c.from_disk ? folder.path() + "/disk_a" : "");
    const Config to = with(c.to, c.to_disk ? folder.path() + "/disk_b" : "");
    if (c.from_disk) std::filesystem::create_directories(folder.path() + "/disk_a");
    if (c.to_disk) std::filesystem::create_directories(folder.path() + "/disk_b");

    models::Gpt first = make_model(1);
    Engine writer(first.ptr(), from);
    train(writer, first, 0, 3);
    writer.save_checkpoint(saved);

    models::Gpt second = make_model(99);  // other weights: the checkpoint replaces them
    Engine resumed(second.ptr(), to);
    resumed.load_checkpoint(saved);
    resumed.save_checkpoint(again);
    const SavedTensors a(saved), b(again);
    ASSERT_EQ(a.names(), b.names());
    for (const std::string& name : a.names()) {
      EXPECT_TRUE(torch::equal(a.tensor(name, "master"), b.tensor(name, "master"))) << name;
      for (const char* moment : {"exp_avg", "exp_avg_sq"}) {
        EXPECT_TRUE(torch::equal(a.tensor(name, moment), b.tensor(name, moment)))
            << name << " " << moment;
      }
      EXPECT_EQ(a.adam_steps(name), b.adam_steps(name)) << name;
    }

    // Training on: as a run of the target config that never stopped, where the states are the
    // same (the chunk size and the disk tier change where the numbers live, not what they are).
    const std::vector<double> got = train(resumed, second, 3, 6);
    models::Gpt straight_model = make_model(1);
    Engine straight(straight_model.ptr(), c.from_disk || c.to_disk ? with("{}") : to);
    std::vector<double> expected = train(straight, straight_model, 0, 6);
    expected.erase(expected.begin(), expected.begin() + 3);
    const double apart = max_relative_difference(got, expected);
    std::printf("%s: losses after resuming within %.3g (relative) of a run that never stopped\n",
                c.name, apart);
    EXPECT_EQ(got, expected) << "bit for bit";
  }
}

// A format-3 checkpoint (one archive per rank, before format 4) still loads with the ranks that
// wrote it: written here from what a format-4 save holds, it gives the engine the same state.
TEST(CheckpointReshard, AFormatThreeCheckpointStillLoads) {
  TempFolder folder("ps-format3");
  const std::string modern = folder.path() + "/modern.ckpt";
  const std::string old = folder.path() + "/old.pt";
  const std::string again = folder.path() + "/again.ckpt";
  models::Gpt model = make_model(1);
  Engine writer(model.ptr(), tight_config());
  train(writer, model, 0, 3);
  writer.save_checkpoint(modern);
  const SavedTensors saved(modern);
  engine_detail::CheckpointContents c;
  c.config_json = "{}";
  c.precision = "fp32";
  c.world_size = 1;
  c.rank = 0;
  c.chunk_elems = 40000;
  c.adam_step = 3;
  c.iteration = 3;
  const auto weights = writer.fp32_state_dict();
  for (size_t id = 0; id < weights.size(); ++id) {
    const std::string& name = weights[id].first;
    c.names.push_back(name);
    c.param_steps.push_back(saved.adam_steps(name));
    c.params[static_cast<int64_t>(id)] = {saved.tensor(name, "master"),
                                          saved.tensor(name, "exp_avg"),
                                          saved.tensor(name, "exp_avg_sq")};
  }
  engine_detail::write_checkpoint_file(c, old);

  models::Gpt other = make_model(99);
  Engine reader(other.ptr(), tight_config());
  reader.load_checkpoint(old);
  reader.save_checkpoint(again);
  const SavedTensors b(again);
  for (const std::string& name : saved.names()) {
    for (const char* field : {"master", "exp_avg", "exp_avg_sq"}) {
      EXPECT_TRUE(torch::equal(saved.tensor(name, field), b.tensor(name, field))) << name << field;
    }
  }
  EXPECT_EQ(train(reader, other, 3, 5), train(writer, model, 3, 5));
}

}  // namespace checkpoint_reshard_test
}  // namespace patrickstar
