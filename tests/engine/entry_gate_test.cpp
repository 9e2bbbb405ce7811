// EntryGate (engine/src/entry_gate.h): an entry nested in another counts once, its time is the
// outermost entry's, take() starts a new count, and the host synchronizations noted meanwhile come
// with it.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <thread>

#include "entry_gate.h"

namespace patrickstar {
namespace entry_gate_test {

using engine_detail::EntryCosts;
using engine_detail::EntryGate;

TEST(EntryGate, CountsOutermostEntriesTheirTimeAndTheSyncsSinceTheLastTake) {
  EntryGate gate;
  note_host_sync();  // before the first take: counted in it
  {
    std::lock_guard<EntryGate> outer(gate);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    std::lock_guard<EntryGate> nested(gate);  // a checkpoint's recompute inside a hook
    note_host_sync();
  }
  { std::lock_guard<EntryGate> second(gate); }
  const EntryCosts first = gate.take();
  EXPECT_EQ(first.entries, 2);
  EXPECT_EQ(first.host_syncs, 2);
  EXPECT_GE(first.host_seconds, 0.020);
  const EntryCosts empty = gate.take();
  EXPECT_EQ(empty.entries, 0);
  EXPECT_EQ(empty.host_syncs, 0);
  EXPECT_EQ(empty.host_seconds, 0.0);
}

TEST(EntryGate, SerializesThreads) {
  EntryGate gate;
  int inside = 0;
  int most = 0;
  auto work = [&] {
    for (int i = 0; i < 200; ++i) {
      std::lock_guard<EntryGate> held(gate);
      most = std::max(most, ++inside);
      --inside;
    }
  };
  std::thread other(work);
  work();
  other.join();
  EXPECT_EQ(most, 1);
  EXPECT_EQ(gate.take().entries, 400);
}

}  // namespace entry_gate_test
}  // namespace patrickstar
