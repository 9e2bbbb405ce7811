// config_keys.h's ValueReader: one config value read into its field, or a problem listed under its
// path.
#include <cmath>
#include <limits>

#include <c10/util/Exception.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "config_keys.h"  // NOLINT: its own header (the file has no same-named one)

namespace patrickstar::config_keys {
namespace {

using json = nlohmann::json;

// A value as a problem quotes it.
std::string shown_value(const json& value) {
  std::string text = value.dump();
  if (text.size() > 60) {
    // Cut in place rather than as substr(0, 57) + "...", which GCC 12 at -O2 misreads as an
    // out-of-bounds copy (-Warray-bounds) once inlined into error().
    text.resize(57);
    text += "...";
  }
  return text;
}

bool whole_number(double d) {
  return std::isfinite(d) && d == std::floor(d);
}

}  // namespace

ValueReader ValueReader::child(std::string_view key) const {
  return ValueReader(absl::StrCat(path_, ".", std::string(key)), errors_);
}

ValueReader ValueReader::element(int index) const {
  return ValueReader(absl::StrCat(path_, "[", index, "]"), errors_);
}

void ValueReader::error(const json& value, std::string_view expected) const {
  errors_->push_back(
      absl::StrCat(path_, ": expected ", std::string(expected), ", got ", shown_value(value)));
}

void ValueReader::boolean(const json& v, bool& out) const {
  if (v.is_boolean()) {
    out = v.get<bool>();
  } else {
    error(v, "true or false");
  }
}

void ValueReader::number(const json& v, double& out, double min, double max, bool open_min) const {
  if (v.is_number()) {
    const double d = v.get<double>();
    if (std::isfinite(d) && (open_min ? d > min : d >= min) && d <= max) {
      out = d;
      return;
    }
  }
  const std::string range = max == std::numeric_limits<double>::max()
                                ? absl::StrCat(open_min ? "> " : ">= ", min)
                                : absl::StrCat("in ", open_min ? "(" : "[", min, ", ", max, "]");
  error(v, absl::StrCat("a number ", range));
}

void ValueReader::integer(const json& v, int& out, int min, int max) const {
  if (v.is_number_integer() || (v.is_number_float() && whole_number(v.get<double>()))) {
    const double d = v.get<double>();
    if (d >= min && d <= max) {
      out = static_cast<int>(d);
      return;
    }
  }
  error(v, absl::StrCat("an integer from ", min, " to ", max));
}

void ValueReader::byte_size(const json& v, int64_t& out, std::string_view alternative) const {
  const bool fits = v.is_number_unsigned() ? v.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX)
                                           : v.is_number_integer() && v.get<int64_t>() >= 0;
  if (fits) {
    out = v.get<int64_t>();
    return;
  }
  if (v.is_string()) {
    try {
      out = parse_byte_size(v.get<std::string>(), path_);
      return;
    } catch (const c10::Error&) {
    }
  }
  error(v, absl::StrCat("a byte count: a non-negative integer or a string such as \"2GiB\"",
                        std::string(alternative)));
}

void ValueReader::byte_size_or_auto(const json& v, int64_t& out, int64_t auto_value) const {
  if (v.is_string() && absl::AsciiStrToLower(v.get<std::string>()) == "auto") {
    out = auto_value;
    return;
  }
  int64_t bytes = -1;
  byte_size(v, bytes, ", or \"auto\"");
  if (bytes == 0) error(v, "a positive byte count, or \"auto\"");
  if (bytes > 0) out = bytes;
}

int ValueReader::choice_index(const json& v, const std::vector<std::string_view>& names) const {
  if (v.is_string()) {
    const std::string text = absl::AsciiStrToLower(v.get<std::string>());
    for (size_t i = 0; i < names.size(); ++i) {
      if (text == absl::AsciiStrToLower(std::string(names[i]))) return static_cast<int>(i);
    }
  }
  std::vector<std::string> quoted;
  for (std::string_view name : names) quoted.push_back(absl::StrCat("\"", std::string(name), "\""));
  error(v, absl::StrCat("one of ", absl::StrJoin(quoted, ", ")));
  return -1;
}

}  // namespace patrickstar::config_keys
