// libFuzzer target: the safetensors reader (patrickstar::SafetensorsCheckpoint), file bytes in.
// A checkpoint comes from outside (a download, another tool), so every header must be checked
// against its file: the reader must open it and read every tensor, or throw c10::Error; anything
// else (another exception, a crash, a read outside the file, a sanitizer report) is a finding.
// Seeds: fuzz/corpus/safetensors (small files transformers' safetensors library wrote).
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <c10/util/Exception.h>

#include "patrickstar/engine/safetensors.h"

namespace {

// One scratch file for the whole run, rewritten with each input.
const std::string& scratch() {
  static const std::string path = [] {
    const char* tmp = std::getenv("TMPDIR");
    std::string p = std::string(tmp != nullptr ? tmp : "/tmp") + "/safetensors_fuzzer-" +
                    std::to_string(::getpid()) + ".safetensors";
    return p;
  }();
  return path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FILE* f = std::fopen(scratch().c_str(), "wb");
  if (f == nullptr) std::abort();
  if (size > 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
  try {
    patrickstar::SafetensorsCheckpoint checkpoint(scratch());
    for (const std::string& name : checkpoint.names()) {
      if (checkpoint.entry(name).bytes > (int64_t{1} << 20)) continue;  // memory stays bounded
      try {
        const at::Tensor t = checkpoint.read(name);
        if (t.nbytes() != static_cast<size_t>(checkpoint.entry(name).bytes)) std::abort();
      } catch (const c10::Error&) {
        // an unknown dtype: refused with its name
      }
    }
  } catch (const c10::Error&) {
    // refused: what a damaged or foreign file must get
  }
  return 0;
}
