// Where the tests' reference files live (tests/data), and with them the source tree's own files
// that tests read (README.md): the environment's PATRICKSTAR_TEST_DATA when set (scripts/gpu-check
// points it at the copy carried to a GPU machine), else the source tree's folder this build was
// configured from. Defined in test_data.cpp, the only translation unit that carries the configured
// path, so the others compile the same in every clone (the compiler cache).
#pragma once

#include <string>

namespace patrickstar::testing {

std::string test_data_dir();

// A file of the source tree the test data belongs to, by its path from the tree's root
// ("README.md"): test_data_dir() is that tree's tests/data, wherever the environment points it, so
// the file is found next to the data on every machine the data is carried to.
std::string source_file(const std::string& relative);

}  // namespace patrickstar::testing
