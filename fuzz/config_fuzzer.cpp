// libFuzzer target: the config parser, JSON text in. Every input must either parse into a Config
// or be refused with a c10::Error (the parser's one way of saying no); any other exception, a
// crash or a sanitizer report is a finding. A config that parses must also survive its documented
// round trip: from_json(to_json()) gives the same config back.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "patrickstar/engine/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  patrickstar::Config config;
  try {
    config = patrickstar::Config::from_string(text);
  } catch (const c10::Error&) {
    return 0;  // refused, with its reasons
  }
  const nlohmann::json once = config.to_json();
  nlohmann::json twice;
  try {
    twice = patrickstar::Config::from_json(once).to_json();
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "config_fuzzer: to_json() of an accepted config is refused:\n%s\n%s\n",
                 once.dump().c_str(), e.what_without_backtrace());
    std::abort();
  }
  if (twice != once) {
    std::fprintf(stderr, "config_fuzzer: the round trip changed the config:\n%s\n%s\n",
                 once.dump().c_str(), twice.dump().c_str());
    std::abort();
  }
  return 0;
}
