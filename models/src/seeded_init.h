// Private to the zoo: the generator a deferred parameter's value is drawn from, seeded by its name
// and the CPU generator's seed when the model was built, so that it is the same whenever asked.
#pragma once

#include <cstdint>
#include <string>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>

namespace patrickstar::models {

inline at::Generator generator_for(const std::string& name, uint64_t construction_seed) {
  // FNV-1a of the name, mixed with the construction's seed (splitmix64's finalizer).
  uint64_t h = 1469598103934665603ULL;
  for (const char c : name) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ULL;
  uint64_t z = h ^ construction_seed;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return at::make_generator<at::CPUGeneratorImpl>(z ^ (z >> 31));
}

}  // namespace patrickstar::models
