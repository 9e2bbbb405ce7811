// Allocation-failure injection, for tests (the way SQLite tests its out-of-memory paths): after
// arm(k), the k-th allocation counted from then on fails as if the system had refused the memory,
// and every other one succeeds. The allocations counted are the library's own: blocks of the host
// and device tiers (MemoryTier::allocate) and LibTorch's CPU allocations through the counting
// allocator (CountingCpuAllocator::allocate, installed on the emulated device). Disarmed, the cost
// is one relaxed atomic load per allocation. Process-wide; meant for one test thread at a time.
// Test-only: seen by this build tree (the chunk library's testing/ folder), not installed.
//
//   allocation_faults::arm(12);
//   try { train_step(); } catch (const c10::Error&) { ... }
//   bool reached = allocation_faults::fired();  // false: the step made fewer than 12 allocations
//   allocation_faults::disarm();
#pragma once

#include <cstdint>

namespace patrickstar::allocation_faults {

// Counts allocations from 0 and fails the k-th (k >= 1).
void arm(int64_t k);
// No allocation fails; the count stops.
void disarm();
// Allocations counted since arm().
int64_t counted();
// Whether the armed failure has happened.
bool fired();
// The allocators' check: counts one allocation while armed; true for the one that must fail.
bool should_fail();

}  // namespace patrickstar::allocation_faults
