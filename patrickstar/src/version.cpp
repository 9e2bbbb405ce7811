#include "patrickstar/version.h"

#include <string_view>

#include "absl/strings/str_cat.h"
#include "build_info.h"

namespace patrickstar {

std::string version() { return PATRICKSTAR_VERSION_STRING; }

std::string build_info() {
  const bool cuda = std::string_view(PATRICKSTAR_BUILT_WITH_CUDA_STRING) == "ON";
  return absl::StrCat("patrickstar ", PATRICKSTAR_VERSION_STRING, " (LibTorch ",
                      PATRICKSTAR_TORCH_VERSION_STRING, ", CUDA parts ",
                      cuda ? "compiled" : "not compiled", ")");
}

}  // namespace patrickstar
