// The DeepSpeed-style JSON config: defaults, every accepted key, and a table of bad documents each
// with the message a user should see; and the parser's key table against README.md's.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "config_keys.h"
#include "patrickstar/engine/config.h"
#include "test_data.h"

namespace patrickstar {
namespace config_test {

std::string error_of(const std::string& text) {
  try {
    Config::from_string(text);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "<no error>";
}

TEST(Config, EmptyDocumentTakesTheDocumentedDefaults) {
  const Config c = Config::from_string("{}");
  EXPECT_EQ(c.optimizer.type, OptimizerType::kAdam);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 1e-3);
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.999);
  EXPECT_TRUE(c.optimizer.use_hybrid_adam);
  EXPECT_EQ(c.precision(), Precision::kFp32);
  EXPECT_EQ(c.fp16.initial_scale_power, 16);
  EXPECT_EQ(c.fp16.hysteresis, 2);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  EXPECT_TRUE(c.chunk_size_auto);  // without default_chunk_size the engine chooses the size
  EXPECT_EQ(c.device.type, DeviceType::kEmulated);
  EXPECT_EQ(c.device.capacity_bytes, DeviceConfig::kAutoCapacity);  // the engine resolves it
  EXPECT_EQ(c.scheduler.policy, EvictionPolicy::kOpt);
  EXPECT_EQ(c.overlap_step.mode, OverlapMode::kAuto);
  EXPECT_EQ(c.overlap_step.max_bytes, int64_t{2} << 30);
  EXPECT_TRUE(c.warnings.empty());
}

TEST(Config, OverlapStepIsAutoTrueOrFalseWithAByteBound) {
  const Config on = Config::from_string(
      R"({"zero_optimization": {"overlap_step": true, "overlap_step_max_bytes": "512MiB"}})");
  EXPECT_EQ(on.overlap_step.mode, OverlapMode::kOn);
  EXPECT_EQ(on.overlap_step.max_bytes, int64_t{512} << 20);
  EXPECT_EQ(Config::from_json(on.to_json()).overlap_step.mode, OverlapMode::kOn);
  const Config off = Config::from_string(R"({"zero_optimization": {"overlap_step": false}})");
  EXPECT_EQ(off.overlap_step.mode, OverlapMode::kOff);
  EXPECT_EQ(Config::from_json(off.to_json()).overlap_step.mode, OverlapMode::kOff);
  EXPECT_EQ(Config::from_json(Config::from_string("{}").to_json()).overlap_step.mode,
            OverlapMode::kAuto);
}

TEST(Config, FrozenParametersAreLeanOrKeepFullState) {
  EXPECT_EQ(Config::from_string("{}").frozen_parameters, FrozenParameters::kLean);
  const Config full =
      Config::from_string(R"({"zero_optimization": {"frozen_parameters": "full_state"}})");
  EXPECT_EQ(full.frozen_parameters, FrozenParameters::kFullState);
  EXPECT_EQ(Config::from_json(full.to_json()).frozen_parameters, FrozenParameters::kFullState);
  for (const char* bad : {R"("full")", "true", "1"}) {
    const std::string error =
        error_of(std::string(R"({"zero_optimization": {"frozen_parameters": )") + bad + "}}");
    EXPECT_NE(error.find("$.zero_optimization.frozen_parameters"), std::string::npos) << error;
    EXPECT_NE(error.find("\"full_state\""), std::string::npos) << error;
  }
}

// Hybrid sharding's group size: 0 (the host's ranks), "world" or k >= 2, and DeepSpeed's spelling,
// whose 1 (hpZ off) leaves the default; 1 and negatives refused naming the key.
TEST(Config, ShardGroupSizeIsTheHostsRanksTheWorldOrANumberFromTwo) {
  EXPECT_EQ(Config::from_string("{}").shard_group_size, 0);
  const Config four = Config::from_string(R"({"zero_optimization": {"shard_group_size": 4}})");
  EXPECT_EQ(four.shard_group_size, 4);
  EXPECT_EQ(Config::from_json(four.to_json()).shard_group_size, 4);
  const Config world =
      Config::from_string(R"({"zero_optimization": {"shard_group_size": "World"}})");
  EXPECT_EQ(world.shard_group_size, kShardWholeWorld);
  EXPECT_EQ(Config::from_json(world.to_json()).shard_group_size, kShardWholeWorld);
  EXPECT_EQ(Config::from_string(R"({"zero_optimization": {"zero_hpz_partition_size": 8}})")
                .shard_group_size,
            8);
  EXPECT_EQ(Config::from_string(R"({"zero_optimization": {"zero_hpz_partition_size": 1}})")
                .shard_group_size,
            0);
  for (const char* bad : {"1", "-2", "2.5", R"("host")"}) {
    const std::string error =
        error_of(std::string(R"({"zero_optimization": {"shard_group_size": )") + bad + "}}");
    EXPECT_NE(error.find("$.zero_optimization.shard_group_size"), std::string::npos) << error;
  }
  EXPECT_NE(error_of(R"({"zero_optimization": {"zero_hpz_partition_size": 0}})")
                .find("$.zero_optimization.zero_hpz_partition_size"),
            std::string::npos);
  // Both spellings: they must agree (DeepSpeed's 1 says nothing), else neither is dropped quietly.
  EXPECT_EQ(Config::from_string(
                R"({"zero_optimization": {"shard_group_size": 4, "zero_hpz_partition_size": 4}})")
                .shard_group_size,
            4);
  EXPECT_EQ(Config::from_string(
                R"({"zero_optimization": {"shard_group_size": 4, "zero_hpz_partition_size": 1}})")
                .shard_group_size,
            4);
  EXPECT_NE(
      error_of(R"({"zero_optimization": {"shard_group_size": 4, "zero_hpz_partition_size": 8}})")
          .find("contradicts $.zero_optimization.shard_group_size 4"),
      std::string::npos);
}

// The GPU index: "auto" (the default) is the process's local rank: the launcher's LOCAL_RANK (or
// Open MPI's), else 0; a number is that GPU; the emulated device is always 0.
TEST(Config, DeviceIndexIsTheLocalRankUnlessNamed) {
  EXPECT_EQ(Config::from_string("{}").device.index, DeviceConfig::kLocalRankIndex);
  Config cuda = Config::from_string(R"({"client": {"device": {"type": "cuda", "index": 3}}})");
  EXPECT_EQ(cuda.device.index, 3);
  EXPECT_EQ(Config::from_json(cuda.to_json()).device.index, 3);
  EXPECT_EQ(resolved_device_index(cuda), 3);
  Config local = Config::from_string(R"({"client": {"device": {"type": "cuda", "index": "auto"}}})");
  const char* saved = std::getenv("LOCAL_RANK");
  const std::string before = saved != nullptr ? saved : "";
  setenv("LOCAL_RANK", "5", 1);
  EXPECT_EQ(resolved_device_index(local), 5);
  setenv("LOCAL_RANK", "five", 1);
  EXPECT_THROW(resolved_device_index(local), c10::Error);
  if (saved != nullptr) {
    setenv("LOCAL_RANK", before.c_str(), 1);
  } else {
    unsetenv("LOCAL_RANK");
  }
  local.device.type = DeviceType::kEmulated;
  EXPECT_EQ(resolved_device_index(local), 0);
  EXPECT_NE(error_of(R"({"client": {"device": {"index": -1}}})").find("$.client.device.index"),
            std::string::npos);
}

TEST(Config, PatrickStarStyleDocumentIsReadInFull) {
  const Config c = Config::from_string(R"({
    "train_batch_size": 8,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.0002, "betas": [0.8, 0.95], "eps": 1e-6,
                  "weight_decay": 0.01, "use_hybrid_adam": false}},
    "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 10, "loss_scale_window": 100,
             "hysteresis": 3, "min_loss_scale": 0.5},
    "gradient_clipping": 1.0,
    "gradient_accumulation_steps": 4,
    "default_chunk_size": "auto",
    "release_after_init": true,
    "use_cpu_embedding": true,
    "client": {"mem_tracer": {"use_async_mem_monitor": true, "warmup_gpu_chunk_mem_ratio": 0.2,
                              "overall_gpu_mem_ratio": 0.9, "overall_cpu_mem_ratio": 0.7,
                              "margin_use_ratio": 0.5, "use_fake_dist": false},
               "device": {"type": "emulated", "capacity_bytes": "1.5GiB", "host_capacity_bytes": 1000},
               "scheduler": {"policy": "LRU", "prefetch_depth": 0, "reserve_bytes": "64MiB"}}
  })");
  EXPECT_EQ(c.optimizer.type, OptimizerType::kAdamW);
  EXPECT_DOUBLE_EQ(c.optimizer.beta1, 0.8);
  EXPECT_DOUBLE_EQ(c.optimizer.weight_decay, 0.01);
  EXPECT_FALSE(c.optimizer.use_hybrid_adam);
  EXPECT_EQ(c.precision(), Precision::kFp16);
  EXPECT_EQ(c.fp16.initial_scale_power, 10);
  EXPECT_EQ(c.fp16.hysteresis, 3);
  EXPECT_DOUBLE_EQ(c.fp16.min_loss_scale, 0.5);
  EXPECT_DOUBLE_EQ(c.gradient_clipping, 1.0);
  EXPECT_EQ(c.gradient_accumulation_steps, 4);
  EXPECT_TRUE(c.chunk_size_auto);
  EXPECT_TRUE(c.release_after_init);
  EXPECT_TRUE(c.use_cpu_embedding);
  EXPECT_DOUBLE_EQ(c.mem_tracer.warmup_gpu_chunk_mem_ratio, 0.2);
  EXPECT_DOUBLE_EQ(c.mem_tracer.margin_use_ratio, 0.5);
  EXPECT_EQ(c.device.capacity_bytes, int64_t{3} << 29);
  EXPECT_EQ(c.device.host_capacity_bytes, 1000);
  EXPECT_EQ(c.scheduler.policy, EvictionPolicy::kLru);
  EXPECT_EQ(c.scheduler.prefetch_depth, 0);
  EXPECT_EQ(c.scheduler.reserve_bytes, int64_t{64} << 20);
  EXPECT_TRUE(c.warnings.empty()) << c.warnings.front();
}

TEST(Config, EffectiveConfigRoundTrips) {
  Config c = Config::from_string(R"({"bf16": {"enabled": true}, "default_chunk_size": 4096,
      "client": {"mem_tracer": {"with_static_partition": true}}})");
  EXPECT_EQ(c.scheduler.policy, EvictionPolicy::kStatic);
  const nlohmann::json written = c.to_json();
  const Config again = Config::from_json(written);
  EXPECT_EQ(again.to_json(), written);
  EXPECT_EQ(again.precision(), Precision::kBf16);
  EXPECT_EQ(again.default_chunk_size, 4096);
  EXPECT_TRUE(again.warnings.empty());
}

TEST(Config, UnknownKeysAreWarningsWithTheirPathOrErrorsWhenStrict) {
  const Config c = Config::from_string(R"({"optimizer": {"parms": {}}, "fp17": {}})");
  ASSERT_EQ(c.warnings.size(), 2u);
  EXPECT_NE(c.warnings[0].find("$.optimizer.parms"), std::string::npos) << c.warnings[0];
  EXPECT_NE(c.warnings[0].find("params"), std::string::npos) << "lists the known keys";
  EXPECT_NE(c.warnings[1].find("$.fp17"), std::string::npos) << c.warnings[1];

  const std::string strict = error_of(R"({"strict": true, "optimizer": {"parms": {}}})");
  EXPECT_NE(strict.find("unknown key $.optimizer.parms"), std::string::npos) << strict;
}

struct BadConfig {
  const char* document;
  const char* expected;  // a substring of the error
};

TEST(Config, BadDocumentsAreRejectedWithPathValueAndExpectation) {
  const BadConfig cases[] = {
      {R"({"optimizer": {"type": "SGD"}})",
       R"($.optimizer.type: expected one of "Adam", "AdamW", got "SGD")"},
      {R"({"optimizer": {"params": {"lr": "fast"}}})",
       R"($.optimizer.params.lr: expected a number >= 0, got "fast")"},
      {R"({"optimizer": {"params": {"lr": -1}}})",
       "$.optimizer.params.lr: expected a number >= 0, got -1"},
      {R"({"optimizer": {"params": {"betas": [0.9]}}})",
       "$.optimizer.params.betas: expected an array of two numbers in [0, 1), got [0.9]"},
      {R"({"optimizer": {"params": {"betas": [0.9, 1.5]}}})",
       "$.optimizer.params.betas[1]: expected a number in [0, 1], got 1.5"},
      {R"({"optimizer": {"params": {"eps": 0}}})",
       "$.optimizer.params.eps: expected a number > 0, got 0"},
      {R"({"optimizer": {"params": {"use_hybrid_adam": 1}}})",
       "$.optimizer.params.use_hybrid_adam: expected true or false, got 1"},
      {R"({"optimizer": []})", "$.optimizer: expected an object, got []"},
      {R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})",
       "expected at most one, got both true"},
      {R"({"fp16": {"hysteresis": 0}})",
       "$.fp16.hysteresis: expected an integer from 1 to 2147483647, got 0"},
      {R"({"fp16": {"initial_scale_power": 2.5}})",
       "$.fp16.initial_scale_power: expected an integer from 0 to 126, got 2.5"},
      {R"({"gradient_accumulation_steps": 0})",
       "$.gradient_accumulation_steps: expected an integer from 1"},
      {R"({"default_chunk_size": "big"})",
       R"($.default_chunk_size: expected a number of elements from 1 to 1099511627776 (2^40), or "auto", got "big")"},
      {R"({"default_chunk_size": -5})",
       "$.default_chunk_size: expected a number of elements from 1"},
      // Elements x bytes must not overflow: 2^40 is the largest size.
      {R"({"default_chunk_size": 1099511627777})",
       "$.default_chunk_size: expected a number of elements from 1 to 1099511627776"},
      {R"({"default_chunk_size": 9223372036854775807})",
       "$.default_chunk_size: expected a number of elements from 1 to 1099511627776"},
      {R"({"client": {"device": {"capacity_bytes": "2 parsecs"}}})",
       R"($.client.device.capacity_bytes: expected a byte count: a non-negative integer or a string such as "2GiB", or "auto", got "2 parsecs")"},
      {R"({"client": {"device": {"capacity_bytes": -1}}})",
       "$.client.device.capacity_bytes: expected a byte count: a non-negative integer"},
      {R"({"client": {"device": {"capacity_bytes": "0GiB"}}})",
       R"($.client.device.capacity_bytes: expected a positive byte count, or "auto", got "0GiB")"},
      {R"({"client": {"device": {"host_capacity_bytes": "auto"}}})",
       R"($.client.device.host_capacity_bytes: expected a byte count: a non-negative integer or a string such as "2GiB", got "auto")"},
      {R"({"client": {"device": {"type": "tpu"}}})",
       R"($.client.device.type: expected one of "emulated", "cuda", got "tpu")"},
      {R"({"client": {"scheduler": {"policy": "fifo"}}})",
       R"($.client.scheduler.policy: expected one of "opt", "lru", "static", got "fifo")"},
      {R"({"client": {"mem_tracer": {"overall_gpu_mem_ratio": 1.2}}})",
       "$.client.mem_tracer.overall_gpu_mem_ratio: expected a number in (0, 1], got 1.2"},
      {R"({"client": {"mem_tracer": {"with_static_partition": true}, "scheduler": {"policy": "opt"}}})",
       "contradicts $.client.scheduler.policy"},
      {R"({"client": {"device": {"type": "cuda"}, "scheduler": {"copy_delay_max_us": 50}}})",
       R"($.client.scheduler.copy_delay_max_us: 50 with $.client.device.type "cuda": injected copy delays test the emulated device's copy thread)"},
      {R"({"zero_optimization": {"overlap_step": "sometimes"}})",
       R"($.zero_optimization.overlap_step: expected "auto", true or false, got "sometimes")"},
      {R"({"zero_optimization": {"overlap_step_max_bytes": -1}})",
       "$.zero_optimization.overlap_step_max_bytes: expected a byte count"},
      {R"({"optimizer": )", "not JSON"},
      // Found by fuzz/config_fuzzer: a number beyond double's range escaped as an uncaught
      // nlohmann::json out_of_range, and a byte count above INT64_MAX wrapped to a negative one.
      {R"({"gradient_clipping": 99199999E999})", "not JSON"},
      {R"({"client": {"device": {"capacity_bytes": 18446744073709551615}}})",
       "$.client.device.capacity_bytes: expected a byte count: a non-negative integer"},
      {R"({"client": {"device": {"capacity_bytes": 9223372036854775808}}})",
       "$.client.device.capacity_bytes: expected a byte count: a non-negative integer"},
  };
  for (const BadConfig& bad : cases) {
    const std::string message = error_of(bad.document);
    EXPECT_NE(message.find(bad.expected), std::string::npos)
        << "document: " << bad.document << "\nexpected: " << bad.expected << "\ngot: " << message;
  }
}

TEST(Config, AllProblemsAreReportedTogether) {
  const std::string message =
      error_of(R"({"optimizer": {"params": {"lr": "x", "eps": -1}}, "gradient_clipping": true})");
  EXPECT_NE(message.find("3 problems"), std::string::npos) << message;
  EXPECT_NE(message.find("$.optimizer.params.lr"), std::string::npos);
  EXPECT_NE(message.find("$.optimizer.params.eps"), std::string::npos);
  EXPECT_NE(message.find("$.gradient_clipping"), std::string::npos);
}

TEST(Config, ByteSizes) {
  EXPECT_EQ(parse_byte_size("123"), 123);
  EXPECT_EQ(parse_byte_size("2GiB"), int64_t{2} << 30);
  EXPECT_EQ(parse_byte_size("1.5 GB"), 1500000000);
  EXPECT_EQ(parse_byte_size("64MiB"), int64_t{64} << 20);
  EXPECT_EQ(parse_byte_size("4k"), 4096);
  EXPECT_THROW(parse_byte_size("1.5B"), c10::Error);  // not a whole number of bytes
  EXPECT_THROW(parse_byte_size("-1GiB"), c10::Error);
  EXPECT_THROW(parse_byte_size("GiB"), c10::Error);
}

TEST(Config, FromFileNamesTheFile) {
  const std::string path = ::testing::TempDir() + "/ps_config_test.json";
  {
    std::ofstream out(path);
    out << R"({"optimizer": {"type": "Adamax"}})";
  }
  try {
    Config::from_file(path);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(path), std::string::npos) << message;
    EXPECT_NE(message.find("$.optimizer.type"), std::string::npos) << message;
  }
  std::remove(path.c_str());
  EXPECT_THROW(Config::from_file(path), c10::Error);
}

TEST(Config, ChunkSizeIsTheEnginesChoiceUnlessTheDocumentSetsIt) {
  EXPECT_TRUE(Config::from_string("{}").chunk_size_auto);
  EXPECT_TRUE(Config::from_string(R"({"default_chunk_size": "auto"})").chunk_size_auto);
  const Config set = Config::from_string(R"({"default_chunk_size": 1099511627776})");
  EXPECT_FALSE(set.chunk_size_auto);
  EXPECT_EQ(set.default_chunk_size, Config::kMaxChunkElems);
  // The effective config round-trips either way.
  EXPECT_TRUE(Config::from_json(Config::from_string("{}").to_json()).chunk_size_auto);
  EXPECT_EQ(Config::from_json(set.to_json()).default_chunk_size, Config::kMaxChunkElems);
}

TEST(Config, DeviceCapacityIsAutoUnlessTheDocumentSetsIt) {
  for (const char* document : {R"({})", R"({"client": {"device": {"capacity_bytes": "auto"}}})",
                               R"({"client": {"device": {"capacity_bytes": "AUTO"}}})"}) {
    SCOPED_TRACE(document);
    const Config c = Config::from_string(document);
    EXPECT_EQ(c.device.capacity_bytes, DeviceConfig::kAutoCapacity);
    EXPECT_EQ(c.to_json()["client"]["device"]["capacity_bytes"], "auto");
    EXPECT_EQ(Config::from_json(c.to_json()).device.capacity_bytes, DeviceConfig::kAutoCapacity);
  }
  const Config set = Config::from_string(R"({"client": {"device": {"capacity_bytes": "3GiB"}}})");
  EXPECT_EQ(set.device.capacity_bytes, int64_t{3} << 30);
  EXPECT_EQ(set.to_json()["client"]["device"]["capacity_bytes"], int64_t{3} << 30);
  // What an engine uses: the number when set; "auto" on the emulated device is 4 GiB.
  EXPECT_EQ(resolved_device_capacity(set), int64_t{3} << 30);
  EXPECT_EQ(resolved_device_capacity(Config::from_string("{}")), int64_t{4} << 30);
}

// ConfigKeys: the parser's key table (engine/src/config_keys.cpp) against README.md's.

using config_keys::ConfigKey;
using config_keys::KeyUse;

// The "### The config" section of a README: from its heading to the next heading ("" without it).
std::string config_section(const std::string& readme) {
  const std::string heading = "\n### The config\n";
  const size_t begin = readme.find(heading);
  if (begin == std::string::npos) return "";
  const size_t end = readme.find("\n#", begin + heading.size());
  return readme.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
}

// The keys of the section's table (columns key | default | meaning), in order. A row's key cell
// names one key or several siblings: "`optimizer.params.lr`, `betas`" is optimizer.params.lr and
// optimizer.params.betas, a later name without a dot taking the first one's parent path.
std::vector<std::string> readme_table_keys(const std::string& section) {
  std::vector<std::string> keys;
  std::istringstream lines(section);
  std::string line;
  bool in_table = false;
  while (std::getline(lines, line)) {
    if (!in_table) {
      in_table = line.rfind("| key | default | meaning |", 0) == 0;
      if (in_table) std::getline(lines, line);  // the "| --- | --- | --- |" row
      continue;
    }
    if (line.rfind("|", 0) != 0) break;  // the table ends at its first line that is no row
    const std::string cell = line.substr(1, line.find('|', 1) - 1);
    std::string parent;  // the first name's parent path with its dot: "optimizer.params."
    bool first = true;
    for (size_t open = cell.find('`'); open != std::string::npos;) {
      const size_t close = cell.find('`', open + 1);
      if (close == std::string::npos) break;
      const std::string name = cell.substr(open + 1, close - open - 1);
      if (first || name.find('.') != std::string::npos) {
        keys.push_back(name);
        if (first) parent = name.substr(0, name.rfind('.') + 1);  // "" for a top-level key
        first = false;
      } else {
        keys.push_back(parent + name);
      }
      open = cell.find('`', close + 1);
    }
  }
  return keys;
}

// Each key of `expected` that `listed` lacks, as "`key`".
std::vector<std::string> missing_from(const std::vector<std::string>& listed,
                                      const std::set<std::string>& expected) {
  std::vector<std::string> missing;
  for (const std::string& key : expected) {
    if (std::find(listed.begin(), listed.end(), key) == listed.end()) {
      missing.push_back("`" + key + "`");
    }
  }
  return missing;
}

std::set<std::string> code_keys(KeyUse use) {
  std::set<std::string> keys;
  for (const ConfigKey& key : config_keys::config_keys()) {
    if (key.use == use) keys.emplace(key.path);
  }
  return keys;
}

std::string readme_config_section() {
  const std::string path = patrickstar::testing::source_file("README.md");
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  std::stringstream text;
  text << in.rdbuf();
  const std::string section = config_section(text.str());
  EXPECT_FALSE(section.empty()) << path << " has no \"### The config\" section";
  return section;
}

TEST(ConfigKeys, ReadingTheReadmeTableTakesSiblingsFromTheFirstKeysParent) {
  const std::string readme =
      "# Title\n\n### The config\n\nprose\n\n"
      "| key | default | meaning |\n| --- | --- | --- |\n"
      "| `strict` | false | with `code` in the meaning |\n"
      "| `optimizer.params.lr`, `betas` | 1e-3, [0.9, 0.999] | |\n"
      "| `client.device.type`, `capacity_bytes` | `\"emulated\"` | |\n"
      "\n| `not.in.the.table` | | |\n\n## Next\n| `nor.this` | | |\n";
  const std::vector<std::string> keys = readme_table_keys(config_section(readme));
  EXPECT_EQ(keys,
            (std::vector<std::string>{"strict", "optimizer.params.lr", "optimizer.params.betas",
                                      "client.device.type", "client.device.capacity_bytes"}));
  // What the comparison below reports for a table without a key the code has.
  EXPECT_EQ(missing_from(keys, {"strict", "optimizer.params.eps"}),
            std::vector<std::string>{"`optimizer.params.eps`"});
}

// The README's key table and the parser's rows name the same keys, except those the parser marks
// ignored (accepted for compatibility, without effect), which the README names in its prose.
TEST(ConfigKeys, ReadmeTableListsExactlyTheKeysTheParserUses) {
  const std::vector<std::string> documented = readme_table_keys(readme_config_section());
  ASSERT_FALSE(documented.empty())
      << "README.md's config section has no key | default | meaning table";
  for (const std::string& key : missing_from(documented, code_keys(KeyUse::kUsed))) {
    ADD_FAILURE() << "README.md's config table lacks " << key
                  << ", which engine/src/config_keys.cpp reads";
  }
  const std::set<std::string> ignored = code_keys(KeyUse::kIgnored);
  std::vector<std::string> used_or_ignored;
  for (const ConfigKey& key : config_keys::config_keys()) used_or_ignored.emplace_back(key.path);
  for (const std::string& key :
       missing_from(used_or_ignored, {documented.begin(), documented.end()})) {
    ADD_FAILURE() << "README.md's config table lists " << key
                  << ", which engine/src/config_keys.cpp does not know";
  }
  for (const std::string& key : documented) {
    EXPECT_EQ(std::count(documented.begin(), documented.end(), key), 1)
        << "README.md's config table lists `" << key << "` more than once";
    EXPECT_FALSE(ignored.count(key))
        << "README.md's config table lists `" << key
        << "`, which engine/src/config_keys.cpp marks ignored (the prose names such keys)";
  }
}

TEST(ConfigKeys, IgnoredKeysAreNamedInTheReadmesProse) {
  const std::string section = readme_config_section();
  for (const std::string& key : code_keys(KeyUse::kIgnored)) {
    const std::string name = key.substr(key.rfind('.') + 1);
    EXPECT_TRUE(section.find("`" + key + "`") != std::string::npos ||
                section.find("`" + name + "`") != std::string::npos)
        << "README.md's config section does not name `" << key
        << "`, which the parser accepts and ignores";
  }
}

// Each documented default, written into a document, gives the config an empty document gives.
TEST(ConfigKeys, DocumentedDefaultsAreTheDefaults) {
  const nlohmann::json defaults = Config().to_json();
  for (const ConfigKey& key : config_keys::config_keys()) {
    SCOPED_TRACE(std::string(key.path));
    EXPECT_FALSE(key.type.empty());
    EXPECT_FALSE(key.help.empty());
    if (key.read == nullptr) {
      EXPECT_TRUE(key.default_value.empty()) << "a key that is never read has no default";
      continue;
    }
    std::string pointer = "/" + std::string(key.path);
    std::replace(pointer.begin(), pointer.end(), '.', '/');
    nlohmann::json document;
    document[nlohmann::json::json_pointer(pointer)] = nlohmann::json::parse(key.default_value);
    EXPECT_EQ(Config::from_json(document).to_json(), defaults) << document.dump();
  }
}

// The walk finishes an object (reporting its unknown keys) when it reaches a key outside it, so
// each object's keys must be consecutive in the table, and each key named once.
TEST(ConfigKeys, EachObjectsKeysAreConsecutive) {
  const std::span<const ConfigKey> keys = config_keys::config_keys();
  std::set<std::string> paths, left;
  std::vector<std::string> open;  // the objects the previous key lies in
  for (const ConfigKey& key : keys) {
    EXPECT_TRUE(paths.emplace(key.path).second) << "`" << key.path << "` twice";
    std::vector<std::string> objects;
    for (size_t dot = key.path.find('.'); dot != std::string_view::npos;
         dot = key.path.find('.', dot + 1)) {
      objects.emplace_back(key.path.substr(0, dot));
    }
    for (const std::string& object : open) {
      if (std::find(objects.begin(), objects.end(), object) == objects.end()) left.insert(object);
    }
    for (const std::string& object : objects) {
      EXPECT_FALSE(left.count(object))
          << "`" << key.path << "` comes after other keys left `" << object << "`";
    }
    open = objects;
  }
}

}  // namespace config_test
}  // namespace patrickstar
