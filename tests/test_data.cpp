#include "test_data.h"

#include <cstdlib>

namespace patrickstar::testing {

std::string test_data_dir() {
  const char* env = std::getenv("PATRICKSTAR_TEST_DATA");
  if (env != nullptr && env[0] != '\0') return env;
  return PATRICKSTAR_TEST_DATA;
}

std::string source_file(const std::string& relative) {
  return test_data_dir() + "/../../" + relative;
}

}  // namespace patrickstar::testing
