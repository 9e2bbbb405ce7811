// The eviction policies' names (config files, reports), apart from the scheduler: the config parser
// and its fuzzer use them without the scheduler.
#include <string>

#include <c10/util/Exception.h>

#include "patrickstar/memtracer/scheduler.h"

namespace patrickstar {

const char* eviction_policy_name(EvictionPolicy policy) {
  switch (policy) {
    case EvictionPolicy::kOpt:
      return "opt";
    case EvictionPolicy::kLru:
      return "lru";
    case EvictionPolicy::kStatic:
      return "static";
  }
  return "unknown";
}

EvictionPolicy parse_eviction_policy(const std::string& name) {
  if (name == "opt") return EvictionPolicy::kOpt;
  if (name == "lru") return EvictionPolicy::kLru;
  if (name == "static") return EvictionPolicy::kStatic;
  TORCH_CHECK(false, "unknown eviction policy '", name, "': expected opt, lru or static");
}

}  // namespace patrickstar
