#include "patrickstar/chunk/copy_queue.h"

#include "patrickstar/chunk/memory_tier.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <utility>

#include <c10/util/Exception.h>

namespace patrickstar {

std::function<int64_t()> microseconds_since_now() {
  const auto start = std::chrono::steady_clock::now();
  return [start] {
    return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() -
                                                                 start)
        .count();
  };
}

CopyQueue::CopyQueue(CopyQueueOptions options)
    : options_(options), now_us_(microseconds_since_now()), delays_(options.delay_seed) {
  TORCH_CHECK(options_.max_delay_us >= 0, "CopyQueue: max_delay_us must be >= 0, got ",
              options_.max_delay_us);
  if (options_.threaded) thread_ = std::thread([this] { run_thread(); });
}

CopyQueue::~CopyQueue() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  work_.notify_all();
  if (thread_.joinable()) thread_.join();  // the thread finishes every queued copy first
}

CopyEvent CopyQueue::submit(std::function<void()> copy, std::string label) {
  Task task;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!stop_, "CopyQueue: submit after the queue was stopped");
    task = Task{++submitted_, std::move(copy), std::move(label)};
    if (options_.threaded) {
      const CopyEvent event = task.event;
      tasks_.push_back(std::move(task));
      work_.notify_one();
      return event;
    }
  }
  run(task);
  return task.event;
}

CopyEvent CopyQueue::submit_copy(MemoryTier& device, void* dst, const void* src, int64_t bytes,
                                 CopyDirection direction, std::string label) {
  // A CUDA tier's copy orders itself after the calling thread's current stream, which on the copy
  // thread is not the compute thread's: a CUDA tier takes a CudaCopyStream.
  TORCH_CHECK(device.device().is_cpu(), "CopyQueue: the copy thread runs copies on the host; ",
              "tier ", device.name(), " is on ", device.device().str(),
              " and needs a CUDA copy engine (CudaCopyStream)");
  MemoryTier* copier = &device;
  return submit([copier, dst, src, bytes, direction] { copier->copy(dst, src, bytes, direction); },
                std::move(label));
}

void CopyQueue::run(Task& task) {
  bool skip = false;
  bool record = false;
  std::function<int64_t()> now_us;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    skip = failed_ != 0;
    record = record_spans_;
    if (record) now_us = now_us_;
  }
  const int64_t start_us = record ? now_us() : 0;
  std::string error;
  if (!skip) {
    try {
      task.copy();
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    } catch (const std::exception& e) {
      error = e.what();
    } catch (...) {
      error = "an unknown exception";
    }
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!error.empty() && failed_ == 0) {
      failed_ = task.event;
      failure_ = task.label + ": " + error;
    }
    completed_ = std::max(completed_, task.event);
    if (record && !skip) {
      spans_.push_back(CopySpan{task.event, false, task.label, start_us, now_us() - start_us});
    }
  }
  completed_cv_.notify_all();
}

void CopyQueue::run_thread() {
  for (;;) {
    Task task;
    int64_t delay_us = 0;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopped, and nothing left to copy
      task = std::move(tasks_.front());
      tasks_.pop_front();
      if (options_.max_delay_us > 0) {
        delay_us = static_cast<int64_t>(delays_() % static_cast<uint64_t>(options_.max_delay_us + 1));
      }
    }
    if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    run(task);
  }
}

void CopyQueue::check_failure(CopyEvent event) const {
  if (failed_ == 0 || event < failed_) return;
  TORCH_CHECK(event == failed_, "CopyQueue: copy ", event, " did not run: an earlier copy failed (",
              failure_, ")");
  TORCH_CHECK(false, "CopyQueue: ", failure_);
}

void CopyQueue::block_until(std::unique_lock<std::mutex>& lock, CopyEvent event) {
  if (completed_ >= event) return;
  const auto start = std::chrono::steady_clock::now();
  const int64_t start_us = record_spans_ ? now_us_() : 0;
  completed_cv_.wait(lock, [&] { return completed_ >= event; });
  waited_seconds_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (record_spans_) spans_.push_back(CopySpan{event, true, {}, start_us, now_us_() - start_us});
}

void CopyQueue::wait(CopyEvent event) {
  std::unique_lock<std::mutex> lock(mutex_);
  TORCH_CHECK(event >= 0 && event <= submitted_, "CopyQueue: wait on event ", event,
              ", which was never submitted (last ", submitted_, ")");
  block_until(lock, event);
  check_failure(event);
}

bool CopyQueue::done(CopyEvent event) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_ >= event;
}

void CopyQueue::drain() {
  std::unique_lock<std::mutex> lock(mutex_);
  block_until(lock, submitted_);
  if (failed_ != 0 && failure_reported_ != failed_) {
    failure_reported_ = failed_;
    TORCH_CHECK(false, "CopyQueue: ", failure_);
  }
}

CopyEvent CopyQueue::last_submitted() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return submitted_;
}

double CopyQueue::waited_seconds() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return waited_seconds_;
}

void CopyQueue::reset_waited_seconds() {
  std::lock_guard<std::mutex> lock(mutex_);
  waited_seconds_ = 0;
}

void CopyQueue::set_clock(std::function<int64_t()> now_us) {
  TORCH_CHECK(now_us, "CopyQueue::set_clock: empty clock");
  std::lock_guard<std::mutex> lock(mutex_);
  now_us_ = std::move(now_us);
}

void CopyQueue::set_record_spans(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  record_spans_ = on;
}

std::vector<CopySpan> CopyQueue::spans() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return spans_;
}

void CopyQueue::clear_spans() {
  std::lock_guard<std::mutex> lock(mutex_);
  spans_.clear();
}

}  // namespace patrickstar
