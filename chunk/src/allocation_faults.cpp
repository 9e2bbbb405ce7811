#include "patrickstar/chunk/allocation_faults.h"

#include <c10/util/Exception.h>

#include <atomic>

namespace patrickstar::allocation_faults {
namespace {

std::atomic<int64_t> g_target{0};  // 0: disarmed
std::atomic<int64_t> g_counted{0};
std::atomic<bool> g_fired{false};

}  // namespace

void arm(int64_t k) {
  TORCH_CHECK(k >= 1, "allocation_faults::arm: k counts from 1, got ", k);
  g_target.store(0);
  g_counted.store(0);
  g_fired.store(false);
  g_target.store(k);
}

void disarm() { g_target.store(0); }

int64_t counted() { return g_counted.load(); }

bool fired() { return g_fired.load(); }

bool should_fail() {
  const int64_t target = g_target.load(std::memory_order_relaxed);
  if (target == 0) return false;
  if (g_counted.fetch_add(1) + 1 != target) return false;
  g_fired.store(true);
  return true;
}

}  // namespace patrickstar::allocation_faults
