// CopyQueue: copies run in submission order on the copy thread, an event's completion makes its
// bytes visible to the waiter, seeded delays reorder nothing, errors surface at the wait with the
// copy named (and fail every later copy), and the destructor finishes what was queued. Plain memory
// only (no LibTorch kernels), so ThreadSanitizer sees every access.
#include "patrickstar/chunk/copy_queue.h"
#include "patrickstar/chunk/memory_tier.h"

#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "error_message.h"

namespace patrickstar {
namespace copy_queue_test {

using ::testing::HasSubstr;
using test::error_of;

// A chain of copies where each reads what the one before wrote: a[0] -> b -> c -> ... Any reordering
// or early completion would show a stale value at the end.
TEST(CopyQueue, CopiesRunInOrderOnTheCopyThreadAndCompleteBeforeTheWait) {
  for (int64_t max_delay_us : {0, 200}) {
    for (uint64_t seed = 1; seed <= (max_delay_us > 0 ? 8u : 1u); ++seed) {
      CopyQueue queue(CopyQueueOptions{true, max_delay_us, seed});
      constexpr int kLinks = 32;
      constexpr size_t kBytes = 4096;
      std::vector<std::vector<unsigned char>> buffers(kLinks + 1, std::vector<unsigned char>(kBytes, 0));
      for (size_t i = 0; i < kBytes; ++i) buffers[0][i] = static_cast<unsigned char>(i * 7 + seed);
      const std::thread::id caller = std::this_thread::get_id();
      std::atomic<int> on_caller{0};
      std::vector<CopyEvent> events;
      for (int k = 0; k < kLinks; ++k) {
        events.push_back(queue.submit(
            [&, k] {
              if (std::this_thread::get_id() == caller) ++on_caller;
              std::memcpy(buffers[k + 1].data(), buffers[k].data(), kBytes);
            },
            "link " + std::to_string(k)));
      }
      EXPECT_EQ(events.front(), 1);
      EXPECT_EQ(events.back(), kLinks);
      EXPECT_EQ(queue.last_submitted(), kLinks);
      queue.wait(events.back());
      for (CopyEvent e : events) EXPECT_TRUE(queue.done(e));  // earlier events complete first
      EXPECT_EQ(buffers[kLinks], buffers[0]) << "delay " << max_delay_us << " seed " << seed;
      EXPECT_EQ(on_caller.load(), 0);
    }
  }
}

// A slow copy: submit returns before it ran, done() says so, wait() blocks until it has and counts
// the time blocked; event 0 is always complete.
TEST(CopyQueue, SubmitReturnsAtOnceAndTheWaitIsCounted) {
  CopyQueue queue;
  std::atomic<bool> release{false};
  int value = 0;
  const CopyEvent e = queue.submit(
      [&] {
        while (!release.load()) std::this_thread::yield();
        value = 42;
      },
      "slow");
  EXPECT_FALSE(queue.done(e));
  EXPECT_TRUE(queue.done(0));
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    release = true;
  });
  queue.wait(e);
  opener.join();
  EXPECT_EQ(value, 42);
  EXPECT_GE(queue.waited_seconds(), 0.01);
  queue.reset_waited_seconds();
  EXPECT_EQ(queue.waited_seconds(), 0.0);
  EXPECT_THAT(error_of([&] { queue.wait(e + 1); }), HasSubstr("never submitted"));
}

// The timeline: with recording on, every copy that ran is a span on the copy thread (its label, its
// event, timed by the queue's clock) and every wait that blocked is a wait span covering the copy it
// waited for; nothing is recorded with recording off; clear_spans empties it.
TEST(CopyQueue, RecordsCopiesAndBlockingWaitsOnItsClock) {
  CopyQueue queue;
  std::atomic<int64_t> clock{1000};
  queue.set_clock([&] { return clock.fetch_add(10); });  // strictly increasing, any thread
  queue.wait(queue.submit([] {}, "unrecorded"));
  EXPECT_TRUE(queue.spans().empty());
  queue.set_record_spans(true);
  std::atomic<bool> release{false};
  const CopyEvent slow = queue.submit(
      [&] {
        while (!release.load()) std::this_thread::yield();
      },
      "slow copy");
  const CopyEvent fast = queue.submit([] {}, "fast copy");
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    release = true;
  });
  queue.wait(fast);
  opener.join();
  queue.wait(slow);  // already complete: no wait span
  const std::vector<CopySpan> spans = queue.spans();
  std::vector<CopySpan> copies, waits;
  for (const CopySpan& s : spans) (s.wait ? waits : copies).push_back(s);
  ASSERT_EQ(copies.size(), 2u);
  EXPECT_EQ(copies[0].event, slow);
  EXPECT_EQ(copies[0].label, "slow copy");
  EXPECT_EQ(copies[1].event, fast);
  EXPECT_EQ(copies[1].label, "fast copy");
  EXPECT_GE(copies[1].start_us, copies[0].start_us + copies[0].duration_us);  // in order
  ASSERT_EQ(waits.size(), 1u);
  EXPECT_EQ(waits[0].event, fast);
  EXPECT_TRUE(waits[0].label.empty());
  // The wait began before the slow copy ended and ended after the fast copy did.
  EXPECT_LT(waits[0].start_us, copies[0].start_us + copies[0].duration_us);
  EXPECT_GE(waits[0].start_us + waits[0].duration_us, copies[1].start_us + copies[1].duration_us);
  queue.clear_spans();
  EXPECT_TRUE(queue.spans().empty());
  EXPECT_THAT(error_of([&] { queue.set_clock({}); }), HasSubstr("empty clock"));
}

// A failing copy: its wait names it and the cause; later copies do not run and say why; drain
// reports the failure once.
TEST(CopyQueue, AFailedCopyIsReportedAtItsWaitAndStopsTheCopiesAfterIt) {
  for (bool threaded : {true, false}) {
    CopyQueue queue(CopyQueueOptions{threaded, 0, 0});
    int ran = 0;
    const CopyEvent ok = queue.submit([&] { ++ran; }, "momentum chunk 0 (id 4) to host");
    const CopyEvent bad = queue.submit(
        [&] { TORCH_CHECK(false, "the link went down"); }, "param chunk 2 (id 2) to device");
    const CopyEvent after = queue.submit([&] { ++ran; }, "param chunk 3 (id 3) to device");
    queue.wait(ok);
    const std::string message = error_of([&] { queue.wait(bad); });
    EXPECT_THAT(message, HasSubstr("param chunk 2 (id 2) to device"));
    EXPECT_THAT(message, HasSubstr("the link went down"));
    EXPECT_THAT(error_of([&] { queue.wait(after); }), HasSubstr("an earlier copy failed"));
    EXPECT_EQ(ran, 1) << "threaded " << threaded;
    EXPECT_THAT(error_of([&] { queue.drain(); }), HasSubstr("param chunk 2"));
    EXPECT_NO_THROW(queue.drain());  // reported once
  }
}

// Not threaded: the copy runs in the caller before submit returns.
TEST(CopyQueue, UnthreadedCopiesRunInTheCaller) {
  CopyQueue queue(CopyQueueOptions{false, 0, 0});
  std::thread::id ran_on;
  const CopyEvent e = queue.submit([&] { ran_on = std::this_thread::get_id(); }, "inline");
  EXPECT_TRUE(queue.done(e));
  EXPECT_EQ(ran_on, std::this_thread::get_id());
}

// Copies still queued when the queue goes are finished first: their destinations are written, and
// nothing runs after the destructor returned.
TEST(CopyQueue, TheDestructorFinishesQueuedCopies) {
  std::vector<int> written(64, 0);
  {
    CopyQueue queue(CopyQueueOptions{true, 100, 3});
    for (int k = 0; k < 64; ++k) {
      queue.submit([&written, k] { written[static_cast<size_t>(k)] = k + 1; }, "fill");
    }
  }
  for (int k = 0; k < 64; ++k) EXPECT_EQ(written[static_cast<size_t>(k)], k + 1);
}

// Submitting and waiting from several threads at once (the engine's thread and a hook's, say).
TEST(CopyQueue, SeveralThreadsSubmitAndWait) {
  CopyQueue queue;
  constexpr int kThreads = 4;
  constexpr int kCopies = 200;
  std::vector<std::vector<int>> out(kThreads, std::vector<int>(kCopies, 0));
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int k = 0; k < kCopies; ++k) {
        int* slot = &out[static_cast<size_t>(t)][static_cast<size_t>(k)];
        const CopyEvent e = queue.submit([slot, k] { *slot = k; }, "copy");
        if (k % 10 == 0) queue.wait(e);
      }
      queue.drain();
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    for (int k = 0; k < kCopies; ++k) EXPECT_EQ(out[static_cast<size_t>(t)][static_cast<size_t>(k)], k);
  }
  EXPECT_EQ(queue.last_submitted(), kThreads * kCopies);
}

// A tier whose memory is off the host (it says CUDA; it never hands out a block).
class OffHostTier final : public MemoryTier {
 public:
  OffHostTier() : MemoryTier(Tier::kDevice, "gpu_like", 1 << 20, /*cache_blocks=*/false) {}
  ~OffHostTier() override { release_all(); }
  c10::Device device() const override { return c10::Device(c10::kCUDA, 0); }

 protected:
  void* raw_allocate(int64_t, int64_t) override { return nullptr; }
  void raw_deallocate(void*, int64_t, int64_t) override {}
};

// The copy thread runs copies on the host, outside the compute thread's CUDA stream: a CUDA tier's
// copies there would not wait for the compute writing their source. Refused, nothing queued.
TEST(CopyQueue, RefusesATierWhoseMemoryIsOffTheHost) {
  OffHostTier tier;
  CopyQueue queue;
  char from[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  char to[8] = {};
  const std::string message = error_of([&] {
    queue.submit_copy(tier, to, from, 8, CopyDirection::kHostToDevice, "param chunk 0 (id 0)");
  });
  EXPECT_THAT(message, HasSubstr("gpu_like"));
  EXPECT_THAT(message, HasSubstr("cuda:0"));
  EXPECT_THAT(message, HasSubstr("CudaCopyStream"));
  EXPECT_EQ(queue.last_submitted(), 0);
  EXPECT_EQ(to[0], 0);
}

}  // namespace copy_queue_test
}  // namespace patrickstar
