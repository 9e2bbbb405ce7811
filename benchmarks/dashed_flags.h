// The benchmarks' flags are spelled with dashes (--chunk-size); Abseil names them with
// underscores. dashed_flags() rewrites the flag names of argv (not their values) for
// absl::ParseCommandLine; `args` keeps the strings the returned pointers point into.
#pragma once

#include <string>
#include <vector>

namespace patrickstar {

inline std::vector<char*> dashed_flags(int argc, char** argv, std::vector<std::string>& args) {
  args.assign(argv, argv + argc);
  std::vector<char*> pointers;
  for (std::string& arg : args) {
    if (arg.rfind("--", 0) == 0) {
      for (size_t i = 2; i < arg.size() && arg[i] != '='; ++i) {
        if (arg[i] == '-') arg[i] = '_';
      }
    }
    pointers.push_back(arg.data());
  }
  return pointers;
}

}  // namespace patrickstar
