#include "delayed_update.h"

#include <chrono>

#include <c10/util/Exception.h>

#include "patrickstar/optimizer/cpu_adam.h"

namespace patrickstar::engine_detail {

namespace {
double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}
}  // namespace

DelayedUpdate::~DelayedUpdate() {
  if (running_.valid()) running_.wait();
}

at::Tensor DelayedUpdate::buffer(size_t k, int64_t numel, at::ScalarType dtype) {
  if (kept_.size() <= k) kept_.resize(k + 1);
  at::Tensor& kept = kept_[k];
  if (!kept.defined() || kept.numel() != numel || kept.scalar_type() != dtype) {
    kept = at::Tensor();  // its memory back to the tier first (the update in flight keeps its own)
    kept = allocate_(numel, dtype);
  }
  return kept;
}

void DelayedUpdate::launch(DelayedJob job, Work work, int threads) {
  TORCH_CHECK(!pending_, "patrickstar: internal: a delayed update is already in flight");
  job_ = std::move(job);
  error_ = nullptr;
  try {
    running_ = std::async(std::launch::async, [this, work = std::move(work), threads] {
      cpu_adam_threads_on_this_thread(threads);
      const auto start = std::chrono::steady_clock::now();
      StepReport report = work(job_);
      seconds_ = seconds_since(start);
      return report;
    });
  } catch (...) {  // no thread: nothing pending
    job_ = DelayedJob();
    throw;
  }
  pending_ = true;
}

void DelayedUpdate::join() {
  if (!running_.valid()) return;
  const auto start = std::chrono::steady_clock::now();
  try {
    result_ = running_.get();
  } catch (...) {
    error_ = std::current_exception();
  }
  waited_seconds_ += seconds_since(start);
  busy_seconds_ += seconds_;
}

std::pair<const DelayedJob*, StepReport> DelayedUpdate::result() {
  TORCH_CHECK(pending_, "patrickstar: internal: no delayed update to take");
  join();
  if (error_ != nullptr) std::rethrow_exception(error_);
  return {&job_, result_};
}

void DelayedUpdate::done() {
  join();
  pending_ = false;
  job_ = DelayedJob();
  error_ = nullptr;
}

void DelayedUpdate::release_kept() {
  TORCH_CHECK(!pending_,
              "patrickstar: internal: the delayed update's buffers given back while "
              "its update is in flight");
  kept_.clear();
}

int64_t DelayedUpdate::buffer_bytes() const {
  int64_t bytes = 0;
  for (const at::Tensor& t : kept_) {
    if (t.defined()) bytes += t.numel() * static_cast<int64_t>(t.element_size());
  }
  return bytes;
}

double DelayedUpdate::take_busy_seconds() {
  return std::exchange(busy_seconds_, 0.0);
}

double DelayedUpdate::take_waited_seconds() {
  return std::exchange(waited_seconds_, 0.0);
}

}  // namespace patrickstar::engine_detail
