// Version and build facts of the patrickstar library. Thread-safe: plain functions over constants.
#pragma once

#include <string>

namespace patrickstar {

// The library version, "major.minor.patch".
std::string version();

// One line describing this build: library version, the LibTorch version it was built against,
// and whether the CUDA parts were compiled.
std::string build_info();

}  // namespace patrickstar
