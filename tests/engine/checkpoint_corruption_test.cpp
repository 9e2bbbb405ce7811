// Damaged checkpoints (issue: reliability): a truncated file, a flipped byte anywhere in it, a
// checkpoint of another model, of another precision or of another world size. Each is rejected
// with an error that names the file, and the engine's state is untouched.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include <unistd.h>

#include "checkpoint_tensors.h"
#include "error_message.h"
#include "gpt_training.h"
#include "patrickstar/engine/engine_inspect.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar {
namespace checkpoint_corruption_test {

using ::testing::HasSubstr;
using test::error_of;
using namespace test;  // NOLINT: the shared helpers of gpt_training.h

// Weights and optimizer state (every chunk but the gradient space), the loss scale and the step.
std::vector<at::Tensor> state_of(const Engine& engine) {
  std::vector<at::Tensor> out;
  const ChunkStore& store = inspect(engine).chunks();
  for (ChunkId id = 0; id < store.chunk_count(); ++id) {
    if (store.kind_of(id) != ChunkKind::kGrad) out.push_back(store.chunk_view(id).clone());
  }
  out.push_back(torch::tensor(engine.loss_scale(), at::kDouble));
  return out;
}

bool same(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i], b[i])) return false;
  }
  return true;
}

struct Outcome {
  int tried = 0;
  int rejected = 0;
  int loaded_intact = 0;  // the damage hit bytes that carry nothing (zip padding): same state
};

// Loads each damaged variant of `good` into `engine`: it must be rejected with an error naming the
// file and leave the state as it was, or load exactly the state of the intact file.
Outcome try_damage(Engine& engine, const std::string& good, const std::string& damaged,
                   const std::vector<at::Tensor>& intact,
                   const std::function<std::string(std::string, size_t)>& damage, int points) {
  Outcome outcome;
  std::vector<at::Tensor> before = state_of(engine);
  for (int i = 0; i < points; ++i) {
    const size_t at = good.size() * static_cast<size_t>(i) / static_cast<size_t>(points);
    SCOPED_TRACE("damage at byte " + std::to_string(at) + " of " + std::to_string(good.size()));
    write_file_bytes(damaged, damage(good, at));
    const std::string error = error_of([&] { engine.load_checkpoint(damaged); });
    ++outcome.tried;
    if (error != "<no error>") {
      ++outcome.rejected;
      EXPECT_THAT(error, HasSubstr(damaged));
      EXPECT_THAT(error, HasSubstr("nothing was loaded"));
      EXPECT_TRUE(same(state_of(engine), before)) << error;
    } else {
      ++outcome.loaded_intact;
      EXPECT_TRUE(same(state_of(engine), intact));
      before = state_of(engine);
    }
  }
  return outcome;
}

TEST(CheckpointCorruption, FlippedBytesAndTruncationsAreRejected) {
  const std::string path = ::testing::TempDir() + "/ps_corrupt_" + std::to_string(::getpid());
  const std::string damaged = path + ".damaged";
  {
    models::Gpt model = make_model(1);
    Engine engine(model.ptr(), tight_config());
    train_step(engine, model, 0);
    engine.save_checkpoint(path);
  }
  const std::string good = file_bytes(path);
  std::vector<at::Tensor> intact;
  {
    models::Gpt model = make_model(3);
    Engine engine(model.ptr(), tight_config());
    engine.load_checkpoint(path);
    intact = state_of(engine);
  }
  models::Gpt model = make_model(2);
  Engine engine(model.ptr(), tight_config());
  train_step(engine, model, 0);
  // One flipped bit in the byte at each point (the rest of the file as it was).
  const Outcome flips = try_damage(engine, good, damaged, intact, [](std::string bytes, size_t at) {
    bytes[at] = static_cast<char>(bytes[at] ^ 0x10);
    return bytes;
  }, 257);
  // The file cut short at each point.
  const Outcome cuts = try_damage(engine, good, damaged, intact, [](std::string bytes, size_t at) {
    return bytes.substr(0, at);
  }, 33);
  std::cout << "checkpoint of " << good.size() << " bytes: " << flips.tried
            << " single flipped bits, " << flips.rejected << " rejected, " << flips.loaded_intact
            << " in bytes that carry nothing (loaded intact); " << cuts.tried << " truncations, "
            << cuts.rejected << " rejected\n";
  // The whole file is under the checksum (the trailer checks itself: a changed length, checksum
  // or mark cannot match), so every change is caught.
  EXPECT_EQ(cuts.rejected, cuts.tried);
  EXPECT_EQ(flips.rejected, flips.tried);
  std::remove(path.c_str());
  std::remove(damaged.c_str());
}

// A checkpoint of another precision: refused, naming both; nothing changes.
TEST(CheckpointCorruption, AnotherPrecisionIsRejected) {
  const std::string path = ::testing::TempDir() + "/ps_precision_" + std::to_string(::getpid());
  {
    models::Gpt model = make_model(1);
    Engine engine(model.ptr(), tight_config(R"({"bf16": {"enabled": true}})"));
    train_step(engine, model, 0);
    engine.save_checkpoint(path);
  }
  models::Gpt model = make_model(2);
  Engine engine(model.ptr(), tight_config());
  train_step(engine, model, 0);
  const std::vector<at::Tensor> before = state_of(engine);
  const std::string error = error_of([&] { engine.load_checkpoint(path); });
  EXPECT_THAT(error, HasSubstr("was saved by a bf16 engine and this engine is fp32")) << error;
  EXPECT_TRUE(same(state_of(engine), before));
  std::remove(path.c_str());
}

// A file LibTorch wrote (torch::save of the model), not save_checkpoint: refused before LibTorch's
// reader sees it. A checkpoint whose loss scaler state this engine's fp16 settings cannot hold
// (hysteresis 4 saved, 2 here): refused before any weight changes (it used to be found after).
TEST(CheckpointCorruption, AForeignFileAndAnUnsuitableLossScalerAreRejected) {
  const std::string path = ::testing::TempDir() + "/ps_foreign_" + std::to_string(::getpid());
  models::Gpt model = make_model(2);
  Engine engine(model.ptr(), tight_config(R"({"fp16": {"enabled": true, "hysteresis": 2}})"));
  train_step(engine, model, 0);
  const std::vector<at::Tensor> before = state_of(engine);
  {
    models::Gpt plain = make_model(1);
    torch::save(plain, path);
  }
  std::string error = error_of([&] { engine.load_checkpoint(path); });
  EXPECT_THAT(error, HasSubstr("does not end with the trailer")) << error;
  EXPECT_TRUE(same(state_of(engine), before));
  {
    models::Gpt other = make_model(1);
    Engine saver(other.ptr(), tight_config(R"({"fp16": {"enabled": true, "hysteresis": 4}})"));
    train_step(saver, other, 0);
    saver.save_checkpoint(path);
  }
  error = error_of([&] { engine.load_checkpoint(path); });
  EXPECT_THAT(error, HasSubstr("does not suit this engine's loss scaler")) << error;
  EXPECT_THAT(error, HasSubstr("outside [1, 2]")) << error;
  EXPECT_TRUE(same(state_of(engine), before));
  std::remove(path.c_str());
}

}  // namespace checkpoint_corruption_test
}  // namespace patrickstar
