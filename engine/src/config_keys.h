// The config's keys as data: one row per JSON key of the document (its path, type, default and
// help, how a value is checked and set in a Config, and how to_json writes it back), the sections
// of the document that are read differently from the rest, and the value checks the rows share.
// Config::from_json and Config::to_json (config.cpp) walk these rows. README.md's key table lists
// the same keys, and tests/engine/config_test.cpp (ConfigKeys) fails when the two differ, so a new
// key is a row here and a row there.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "patrickstar/engine/config.h"

namespace patrickstar::config_keys {

// Checks one JSON value against what its key expects and stores it, or records the problem as
// "<path>: expected <what>, got <value>" (the value cut to 60 characters) among the document's.
class ValueReader {
 public:
  ValueReader(std::string path, std::vector<std::string>* errors)
      : path_(std::move(path)), errors_(errors) {}

  const std::string& path() const { return path_; }
  // The reader of element `index` of an array value: its path is "<path>[index]".
  ValueReader element(int index) const;
  // The reader of key `key` of an object value: its path is "<path>.key".
  ValueReader child(std::string_view key) const;

  void error(const nlohmann::json& value, std::string_view expected) const;
  // A problem in its own words, for the few that are not "expected ..., got ...".
  void problem(std::string text) const { errors_->push_back(std::move(text)); }

  void boolean(const nlohmann::json& v, bool& out) const;
  // A number in [min, max]; `open_min` excludes min itself.
  void number(const nlohmann::json& v, double& out, double min, double max,
              bool open_min = false) const;
  void integer(const nlohmann::json& v, int& out, int min, int max) const;
  // A byte count: a non-negative integer or a string such as "2GiB". `alternative` ends the
  // expectation in the message when the key also takes another form.
  void byte_size(const nlohmann::json& v, int64_t& out, std::string_view alternative = "") const;
  // A positive byte count, or the string "auto" (any case), read as `auto_value` (0 is refused:
  // it would read as "auto").
  void byte_size_or_auto(const nlohmann::json& v, int64_t& out, int64_t auto_value) const;
  // One of `names`, in any case: its index, or -1 once the problem is recorded.
  int choice_index(const nlohmann::json& v, const std::vector<std::string_view>& names) const;

  template <typename Enum>
  void choice(const nlohmann::json& v, Enum& out,
              std::initializer_list<std::pair<const char*, Enum>> options) const {
    std::vector<std::string_view> names;
    for (const auto& option : options) names.push_back(option.first);
    if (const int index = choice_index(v, names); index >= 0) out = options.begin()[index].second;
  }

 private:
  std::string path_;
  std::vector<std::string>* errors_;
};

// The param group keys (config_param_groups.cpp): a list of name patterns, the groups, and the
// groups as to_json writes them (null when there are none).
void read_patterns(const nlohmann::json& v, const ValueReader& r, std::vector<std::string>& out);
void read_param_groups(const nlohmann::json& v, const ValueReader& r, OptimizerConfig& optimizer);
nlohmann::json param_groups_json(const OptimizerConfig& optimizer);

// Checks a present value (never null, except in a section whose nulls are values) and sets it in
// the Config; problems go to the reader.
using ReadKey = void (*)(const nlohmann::json& value, const ValueReader& reader, Config& config);
// The value to_json writes for the key; a null json writes nothing.
using WriteKey = nlohmann::json (*)(const Config& config);

// kIgnored: accepted for compatibility and without effect on training. README.md names such keys
// in the prose under its key table rather than in the table, so the table test leaves them out.
enum class KeyUse : uint8_t { kUsed, kIgnored };

struct ConfigKey {
  std::string_view path;           // below "$", dot-separated: "client.scheduler.prefetch_depth"
  std::string_view type;           // what the value may be
  std::string_view default_value;  // the JSON of the default ("" for a key that is never read)
  std::string_view help;           // one line
  KeyUse use;
  ReadKey read;    // nullptr: the key is accepted without being read
  WriteKey write;  // nullptr: to_json never writes the key
};

// Every key from_json knows, in the order it reads them: the order in which a document's problems
// are listed. The keys of one section are consecutive, since the walk leaves a section (reporting
// its unknown keys) when the next key lies outside it.
std::span<const ConfigKey> config_keys();

// An object of the document that is not read the ordinary way. Every other object must be an
// object when present, counts null values as absent, and reports the keys the rows lack.
struct ConfigSection {
  std::string_view path;  // below "$", as ConfigKey::path
  // DeepSpeed's own sections: patrickstar reads a few of their keys and accepts the others
  // (stage, buckets, offload_param, pin_memory, ...) and a value other than an object without a
  // word, since they describe DeepSpeed's machinery or what patrickstar always does.
  bool open;
  // null is a value to check (and refuse) rather than an absent key, as zero_optimization's own
  // keys have always read it.
  bool null_is_value;
  // Checks the section's keys together once they are read, so that its problems are listed with
  // the section's own; nullptr for none.
  void (*check)(const Config& config, std::vector<std::string>& errors);
};

// The section at `path` (below "$"), or nullptr when it is read the ordinary way.
const ConfigSection* find_section(std::string_view path);

}  // namespace patrickstar::config_keys
