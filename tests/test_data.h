// Where the tests' reference files live (tests/data): the environment's PATRICKSTAR_TEST_DATA when
// set (scripts/gpu-check points it at the copy carried to a GPU machine), else the source tree's
// folder this build was configured from. Defined in test_data.cpp, the only translation unit that
// carries the configured path, so the others compile the same in every clone (the compiler cache).
#pragma once

#include <string>

namespace patrickstar::testing {

std::string test_data_dir();

}  // namespace patrickstar::testing
