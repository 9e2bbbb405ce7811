// Built against the installed package: prints the build line and trains nothing, but touches LibTorch
// through the library's public headers to prove the include paths and link line are complete.
#include <iostream>

#include <patrickstar/patrickstar.h>

int main() {
  std::cout << patrickstar::build_info() << "\n";
  return 0;
}
