#include "step_overlap.h"

#include <chrono>
#include <string>

#include <c10/util/Exception.h>

#include "patrickstar/optimizer/cpu_adam.h"

namespace patrickstar::engine_detail {

StepOverlap::~StepOverlap() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
    queue_.clear();
  }
  work_.notify_all();
  if (thread_.joinable()) thread_.join();
}

namespace {
int64_t bytes_of(const SpeculativeUpdate& u) {
  int64_t bytes = 0;
  for (const at::Tensor* t : {&u.old_master, &u.old_exp_avg, &u.old_exp_avg_sq, &u.new_half}) {
    if (t->defined()) bytes += t->numel() * static_cast<int64_t>(t->element_size());
  }
  return bytes;
}

int64_t bytes_of(const std::vector<SpeculativeUpdate>& updates) {
  int64_t bytes = 0;
  for (const SpeculativeUpdate& u : updates) bytes += bytes_of(u);
  return bytes;
}
}  // namespace

bool StepOverlap::fits(int64_t index, int64_t bytes) const {
  const auto it = kept_.find(index);
  const int64_t kept_bytes = it != kept_.end() ? bytes_of(it->second) : 0;
  return buffer_bytes_ - kept_bytes + bytes <= max_bytes_;
}

bool StepOverlap::prepare(EarlyIndex& job) {
  TORCH_INTERNAL_ASSERT(!has(job.index), "index ", job.index, " handed over twice");
  std::vector<SpeculativeUpdate> kept;
  if (auto it = kept_.find(job.index); it != kept_.end()) {
    kept = std::move(it->second);
    kept_.erase(it);
  }
  buffer_bytes_ -= bytes_of(kept);  // counted again below for what this job keeps
  auto give_up = [&] {
    for (EarlyRun& run : job.runs) run.update = SpeculativeUpdate{};
    return false;
  };
  int64_t needed = 0;
  for (const AdamChunk& input : job.inputs) needed += speculative_bytes(input);
  if (buffer_bytes_ + needed > max_bytes_) return give_up();
  // A buffer of `numel` elements of `dtype`: the kept one at the same place when it is that.
  auto buffer = [&](at::Tensor& out, at::Tensor kept_one, int64_t numel, at::ScalarType dtype) {
    out = kept_one.defined() && kept_one.numel() == numel && kept_one.scalar_type() == dtype
              ? std::move(kept_one)
              : allocate_(numel, dtype);
  };
  try {
    for (size_t k = 0; k < job.runs.size(); ++k) {
      const AdamChunk& input = job.inputs[k];
      SpeculativeUpdate& u = job.runs[k].update;
      SpeculativeUpdate old = k < kept.size() ? std::move(kept[k]) : SpeculativeUpdate{};
      const int64_t numel = input.master.numel();
      buffer(u.old_master, std::move(old.old_master), numel, at::kFloat);
      const at::ScalarType moments = input.exp_avg.scalar_type();  // fp32, or bf16 states
      buffer(u.old_exp_avg, std::move(old.old_exp_avg), numel, moments);
      buffer(u.old_exp_avg_sq, std::move(old.old_exp_avg_sq), numel, moments);
      if (input.mixed()) {
        buffer(u.new_half, std::move(old.new_half), numel, input.half_param_grad.scalar_type());
      }
    }
  } catch (const c10::Error&) {
    return give_up();  // the host tier is full: this index updates at the step
  }
  for (const EarlyRun& run : job.runs) buffer_bytes_ += bytes_of(run.update);
  return true;
}

void StepOverlap::submit(std::unique_ptr<EarlyIndex> job) {
  TORCH_INTERNAL_ASSERT(!has(job->index), "index ", job->index, " handed over twice");
  EarlyIndex* raw = job.get();
  records_[job->index] = std::move(job);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(raw);
  }
  if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
  work_.notify_one();
}

void StepOverlap::quiesce(int64_t index) {
  auto it = records_.find(index);
  if (it == records_.end()) return;
  EarlyIndex* job = it->second.get();
  std::unique_lock<std::mutex> lock(mutex_);
  finished_.wait(lock, [&] { return job->done; });
}

void StepOverlap::quiesce_all() {
  std::vector<int64_t> indices;
  for (const auto& [index, job] : records_) indices.push_back(index);
  for (int64_t index : indices) quiesce(index);
}

void StepOverlap::drain() {
  std::unique_lock<std::mutex> lock(mutex_);
  finished_.wait(lock, [&] { return queue_.empty() && running_ == nullptr; });
}

EarlyIndex* StepOverlap::record(int64_t index) {
  auto it = records_.find(index);
  if (it == records_.end()) return nullptr;
  std::lock_guard<std::mutex> lock(mutex_);
  return it->second->done ? it->second.get() : nullptr;
}

void StepOverlap::erase(int64_t index) {
  auto it = records_.find(index);
  if (it == records_.end()) return;
  std::vector<SpeculativeUpdate> buffers(it->second->runs.size());
  for (size_t k = 0; k < buffers.size(); ++k) {
    SpeculativeUpdate& u = it->second->runs[k].update;
    buffers[k].old_master = std::move(u.old_master);
    buffers[k].old_exp_avg = std::move(u.old_exp_avg);
    buffers[k].old_exp_avg_sq = std::move(u.old_exp_avg_sq);
    buffers[k].new_half = std::move(u.new_half);
  }
  kept_[index] = std::move(buffers);
  records_.erase(it);
}

void StepOverlap::clear() {
  quiesce_all();
  while (!records_.empty()) erase(records_.begin()->first);
}

void StepOverlap::release_kept() {
  for (const auto& [index, buffers] : kept_) buffer_bytes_ -= bytes_of(buffers);
  kept_.clear();
}

double StepOverlap::take_busy_seconds() {
  std::lock_guard<std::mutex> lock(mutex_);
  const double seconds = busy_seconds_;
  busy_seconds_ = 0;
  return seconds;
}

void StepOverlap::set_record_spans(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  record_spans_ = on && now_us_ != nullptr;
}

std::vector<CopySpan> StepOverlap::spans() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return spans_;
}

void StepOverlap::run() {
  int threads = 0;
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    work_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    EarlyIndex* job = queue_.front();
    queue_.pop_front();
    running_ = job;
    const bool record = record_spans_;
    lock.unlock();
    const int64_t start_us = record ? now_us_() : 0;
    const auto start = std::chrono::steady_clock::now();
    if (job->threads != threads) {
      threads = job->threads;
      cpu_adam_threads_on_this_thread(threads);
    }
    try {
      for (size_t k = 0; k < job->runs.size(); ++k) {
        EarlyRun& run = job->runs[k];
        speculate(job->inputs[k], run.update.constants, run.update);
      }
    } catch (...) {
      // speculate() left the run that threw as it was (pending): the step updates it itself, and
      // the rest of the job's runs likewise; those applied are undoable as usual.
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const int64_t end_us = record ? now_us_() : 0;
    lock.lock();
    if (record) {
      CopySpan span;
      span.label = "adam ahead: chunk index " + std::to_string(job->index);
      span.start_us = start_us;
      span.duration_us = end_us - start_us;
      spans_.push_back(std::move(span));
    }
    busy_seconds_ += seconds;
    job->done = true;
    running_ = nullptr;
    finished_.notify_all();
  }
}

}  // namespace patrickstar::engine_detail
