// The safetensors reader and writer (patrickstar/engine/safetensors.h) and the Llama's checks of a
// checkpoint (llama_pretrained.h): shards and index written and read back, every broken input
// refused with the tensor and the file named, nothing half-applied, a full disk leaving the
// folder's checkpoint as it was.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/resource.h>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include <torch/torch.h>

#include "test_data.h"
#include "error_message.h"
#include "patrickstar/models/llama.h"
#include "patrickstar/models/llama_pretrained.h"
#include "patrickstar/patrickstar.h"
#include "safetensors_format.h"
#include "temp_folder.h"

namespace patrickstar {
namespace safetensors_test {
namespace fs = std::filesystem;
using ::testing::HasSubstr;

const std::string kTiny = patrickstar::testing::test_data_dir() + "/llama/tiny";
const std::string kTied = patrickstar::testing::test_data_dir() + "/llama/tiny_tied_bf16";

// Writes `tensors` (fp32 values, written as `dtype`) as a checkpoint in `folder`.
SafetensorsSaveReport write(const std::string& folder,
                            const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                            at::ScalarType dtype = at::kFloat,
                            int64_t max_shard = int64_t{1} << 30) {
  SafetensorsOptions options;
  options.dtype = dtype;
  options.max_shard_bytes = max_shard;
  SafetensorsFolderWriter::Plan plan;
  for (const auto& [name, t] : tensors) plan.emplace_back(name, t.sizes().vec());
  SafetensorsFolderWriter writer(folder, plan, options);
  for (const auto& [name, t] : tensors) writer.write(name, t);
  return writer.commit();
}

std::vector<std::string> sorted_files(const test::TempFolder& folder) {
  std::vector<std::string> files = folder.files();
  std::sort(files.begin(), files.end());
  return files;
}

// Every tensor of the tiny reference checkpoint, fp32, by transformers' name.
std::vector<std::pair<std::string, at::Tensor>> tiny_tensors() {
  SafetensorsCheckpoint ckpt(kTiny);
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const std::string& name : ckpt.names()) out.emplace_back(name, ckpt.read(name));
  return out;
}

TEST(Safetensors, ShardsAndTheirIndexReadBackAndASmallerSaveReplacesThem) {
  test::TempFolder folder("st");
  torch::manual_seed(3);
  const std::vector<std::pair<std::string, at::Tensor>> tensors = {{"a", torch::randn({10, 3})},
                                                                   {"b.weight", torch::randn({7})},
                                                                   {"c", torch::randn({2, 2, 5})}};
  // 120 + 28 + 80 bytes, at most 100 a shard: a (larger, a shard of its own), then b, then c.
  SafetensorsSaveReport report = write(folder.path(), tensors, at::kFloat, 100);
  EXPECT_EQ(report.files, (std::vector<std::string>{"model-00001-of-00003.safetensors",
                                                    "model-00002-of-00003.safetensors",
                                                    "model-00003-of-00003.safetensors"}));
  EXPECT_EQ(report.bytes, 228);
  SafetensorsCheckpoint ckpt(folder.path());
  EXPECT_EQ(ckpt.names(), (std::vector<std::string>{"a", "b.weight", "c"}));
  for (const auto& [name, t] : tensors) EXPECT_TRUE(torch::equal(ckpt.read(name), t)) << name;
  EXPECT_EQ(ckpt.entry("c").file, folder.path() + "/model-00003-of-00003.safetensors");
  EXPECT_EQ(ckpt.entry("a").offset % 8, 0);  // the data starts 8-aligned

  // bf16, one file: the shards and the index of the first save are gone.
  report = write(folder.path(), tensors, at::kBFloat16);
  EXPECT_EQ(report.files, (std::vector<std::string>{"model.safetensors"}));
  EXPECT_EQ(folder.files(), (std::vector<std::string>{"model.safetensors"}));
  SafetensorsCheckpoint single(folder.path());
  EXPECT_EQ(single.entry("a").dtype, "BF16");
  at::Tensor a = torch::empty({10, 3});
  single.read_into("a", a);  // widened to the destination's fp32
  EXPECT_TRUE(torch::equal(a, tensors[0].second.to(at::kBFloat16).to(at::kFloat)));
  const std::string shape = test::error_of([&] {
    at::Tensor wrong = torch::empty({3, 10});
    single.read_into("a", wrong);
  });
  EXPECT_THAT(shape,
              HasSubstr("\"a\" in \"" + folder.path() + "/model.safetensors\" has shape [10, 3]"));
}

TEST(Safetensors, BrokenFilesAreRefusedNamingTheTensorAndTheFile) {
  test::TempFolder folder("st");
  const std::string file = folder.path() + "/model.safetensors";
  fs::copy_file(kTied + "/model.safetensors", file);
  fs::resize_file(file, fs::file_size(file) - 100);
  const std::string truncated = test::error_of([&] { SafetensorsCheckpoint c(folder.path()); });
  EXPECT_THAT(truncated, HasSubstr("in \"" + file + "\""));
  EXPECT_THAT(truncated, HasSubstr("truncated"));
  EXPECT_THAT(truncated, HasSubstr("safetensors: tensor \"model."));

  { std::ofstream(file, std::ios::trunc) << "not a checkpoint at all, but long enough"; }
  EXPECT_THAT(test::error_of([&] { SafetensorsCheckpoint c(file); }),
              HasSubstr("(truncated, or not a safetensors file)"));

  // An index whose shard is missing.
  test::TempFolder sharded("st");
  for (const auto& entry : fs::directory_iterator(kTiny)) {
    fs::copy_file(entry.path(), sharded.path() + "/" + entry.path().filename().string());
  }
  fs::remove(sharded.path() + "/model-00002-of-00004.safetensors");
  EXPECT_THAT(test::error_of([&] { SafetensorsCheckpoint c(sharded.path()); }),
              HasSubstr("/model-00002-of-00004.safetensors\", which does not exist"));
  EXPECT_THAT(test::error_of([&] { SafetensorsCheckpoint c(folder.path() + "/none"); }),
              HasSubstr("no file or folder"));
}

TEST(LlamaCheckpointChecks, AWrongCheckpointIsRefusedBeforeAnythingChanges) {
  const models::LlamaSpec spec = models::llama_spec_from_pretrained(kTiny);
  EXPECT_EQ(spec.kv_heads, 2);
  EXPECT_EQ(spec.intermediate, 176);
  EXPECT_FALSE(spec.tie_embeddings);
  models::Llama model(spec);
  const auto tensors = tiny_tensors();
  const auto refused = [&](std::vector<std::pair<std::string, at::Tensor>> broken) {
    test::TempFolder folder("st");
    write(folder.path(), broken);
    std::string error = test::error_of(
        [&] { model->initialize_from(std::make_shared<SafetensorsCheckpoint>(folder.path())); });
    for (const auto& p : model->parameters()) EXPECT_TRUE(is_deferred(p));  // nothing changed
    return error;
  };
  auto missing = tensors;
  missing.erase(missing.begin() + 3);
  EXPECT_THAT(refused(missing), HasSubstr("missing \"" + tensors[3].first + "\""));
  auto extra = tensors;
  extra.emplace_back("model.layers.2.mlp.up_proj.weight", torch::zeros({2}));
  EXPECT_THAT(refused(extra), HasSubstr("unexpected \"model.layers.2.mlp.up_proj.weight\""));
  auto reshaped = tensors;
  reshaped[0].second = reshaped[0].second.flatten();
  EXPECT_THAT(refused(reshaped), HasSubstr("tensor \"" + tensors[0].first + "\" in \""));
  EXPECT_THAT(refused(reshaped),
              HasSubstr("has shape [" + std::to_string(tensors[0].second.numel()) +
                        "], the model's is " + c10::str(tensors[0].second.sizes())));
  // A checkpoint for the other head: tied has no lm_head.
  auto tied = tensors;
  std::erase_if(tied, [](const auto& t) { return t.first == "lm_head.weight"; });
  EXPECT_THAT(refused(tied), HasSubstr("missing \"lm_head.weight\""));

  // The right one, after all that: the values transformers wrote, exactly.
  model->initialize_from(std::make_shared<SafetensorsCheckpoint>(kTiny));
  materialize_parameters(*model);
  EXPECT_TRUE(
      torch::equal(model->norm->weight, SafetensorsCheckpoint(kTiny).read("model.norm.weight")));

  // config.json describing another model.
  test::TempFolder other("st");
  std::ifstream in(kTiny + "/config.json");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  text.replace(text.find("\"silu\""), 6, "\"gelu\"");
  std::ofstream(other.path() + "/config.json") << text;
  EXPECT_THAT(test::error_of([&] { models::llama_spec_from_pretrained(other.path()); }),
              HasSubstr("config.json\": \"hidden_act\" is \"gelu\", not \"silu\""));
}

std::string contents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// A full disk (a file size limit, as checkpoint_file_test's) partway through a save: the save
// throws and the folder keeps the checkpoint it had, shards, index and config.json alike: with the
// same shard names as before (a shard that fits the limit is not renamed over its old one while a
// later one fails) and with other names (one file).
TEST(LlamaCheckpointChecks, AFailedSaveLeavesTheFolderAsItWas) {
  test::TempFolder folder("st");
  models::Llama model(models::llama_spec_from_pretrained(kTiny));
  model->initialize_from(std::make_shared<SafetensorsCheckpoint>(kTiny));
  Config config = Config::from_string(
      R"({"default_chunk_size": 40000, "client": {"device": {"capacity_bytes": 4194304}}})");
  Engine engine(model.ptr(), config);
  // A shard size whose first shard is smaller than a later one: a file size limit between them
  // lets the first be written whole and stops a later one (a save that renamed each shard as it
  // was done would leave the new first shard beside the old others).
  SafetensorsOptions options;
  std::vector<int64_t> shard_sizes;
  for (int64_t max_shard : {200'000, 150'000, 120'000, 100'000, 80'000, 60'000}) {
    options.max_shard_bytes = max_shard;
    const SafetensorsSaveReport trial =
        models::save_pretrained(engine, *model, folder.path(), options);
    shard_sizes.clear();
    for (const auto& f : trial.files) {
      shard_sizes.push_back(static_cast<int64_t>(contents(folder.path() + "/" + f).size()));
    }
    if (shard_sizes.size() > 1 &&
        shard_sizes.front() < *std::max_element(shard_sizes.begin(), shard_sizes.end())) {
      break;
    }
  }
  ASSERT_GT(shard_sizes.size(), 1u);
  const int64_t largest = *std::max_element(shard_sizes.begin(), shard_sizes.end());
  ASSERT_LT(shard_sizes.front(), largest) << "no shard size gives a first shard below a later one";
  const int64_t limit = (shard_sizes.front() + largest) / 2;
  const auto before = sorted_files(folder);
  std::map<std::string, std::string> bytes;
  for (const auto& f : before) bytes[f] = contents(folder.path() + "/" + f);

  // Another value everywhere, so that a shard renamed into place would show.
  {
    GatheredParameters gathered(*model);
    torch::NoGradGuard no_grad;
    for (auto& p : model->parameters()) p.add_(1.0);
  }
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  auto* previous_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit limited = saved;
  limited.rlim_cur = static_cast<rlim_t>(limit);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limited), 0);
  const std::string same_names =
      test::error_of([&] { models::save_pretrained(engine, *model, folder.path(), options); });
  SafetensorsOptions single = options;
  single.max_shard_bytes = 1000 * 1000;  // one file now, if it could be written
  const std::string other_names =
      test::error_of([&] { models::save_pretrained(engine, *model, folder.path(), single); });
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &saved), 0);
  std::signal(SIGXFSZ, previous_handler);
  EXPECT_THAT(same_names, HasSubstr("File too large; the file is unchanged"));
  EXPECT_THAT(other_names, HasSubstr("model.safetensors\": writing failed"));
  EXPECT_EQ(sorted_files(folder), before);
  for (const auto& f : before) EXPECT_EQ(contents(folder.path() + "/" + f), bytes[f]) << f;
  SafetensorsCheckpoint still(folder.path());
  EXPECT_EQ(still.names().size(), SafetensorsCheckpoint(kTiny).names().size());
}

}  // namespace safetensors_test
}  // namespace patrickstar
