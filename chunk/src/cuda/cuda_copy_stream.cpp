// Compiled only when PATRICKSTAR_HAVE_CUDA (see chunk/CMakeLists.txt); runs on a GPU only (scripts/gpu-check).
#include "patrickstar/chunk/cuda_copy_stream.h"
#include "patrickstar/chunk/host_syncs.h"

#include "patrickstar/chunk/memory_tier.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <deque>
#include <mutex>
#include <utility>

namespace patrickstar {

struct CudaCopyStream::State {
  // A copy issued and not yet seen complete. `done` is null for a copy that never reached the
  // GPU (a CUDA call failed while it was issued, or an earlier copy had failed): it completes, as
  // a failure, once every copy before it did.
  struct InFlight {
    CopyEvent event = 0;
    cudaEvent_t done = nullptr;
    std::string label;
    std::string error;  // why it failed at issue (empty: unrun after an earlier failure)
  };

  State(int index, c10::cuda::CUDAStream copy_stream) : device_index(index), stream(copy_stream) {}

  c10::DeviceIndex device() const { return static_cast<c10::DeviceIndex>(device_index); }

  // Lock held. Takes every leading copy whose event completed off `in_flight`.
  void poll() {
    while (!in_flight.empty()) {
      InFlight& f = in_flight.front();
      if (f.done == nullptr) {
        fail(f.event, f.label + ": " + (f.error.empty() ? "not run" : f.error));
      } else {
        const cudaError_t status = cudaEventQuery(f.done);
        if (status == cudaErrorNotReady) {
          (void)cudaGetLastError();  // not an error: clear it
          return;
        }
        if (status != cudaSuccess) {
          (void)cudaGetLastError();
          fail(f.event, f.label + ": " + cudaGetErrorString(status));
        }
        spare.push_back(f.done);
      }
      completed = f.event;
      in_flight.pop_front();
    }
  }

  // Lock held. Blocks until every event <= `event` completed.
  void block_until(CopyEvent event) {
    poll();
    if (completed >= event) return;
    const auto start = std::chrono::steady_clock::now();
    c10::cuda::CUDAGuard guard(device());
    while (completed < event) {
      // Copies complete in order on the one stream: wait for the last real one up to `event`.
      cudaEvent_t last = nullptr;
      for (const InFlight& f : in_flight) {
        if (f.event > event) break;
        if (f.done != nullptr) last = f.done;
      }
      if (last != nullptr) {
        note_host_sync();
        const cudaError_t status = cudaEventSynchronize(last);
        if (status != cudaSuccess) (void)cudaGetLastError();  // poll() names the copy
      }
      poll();
    }
    const auto waited = std::chrono::steady_clock::now() - start;
    waited_seconds += std::chrono::duration<double>(waited).count();
  }

  void fail(CopyEvent event, std::string why) {
    if (failed != 0) return;
    failed = event;
    failure = std::move(why);
  }

  // Lock held; `event` completed.
  void check_failure(CopyEvent event) const {
    if (failed == 0 || event < failed) return;
    // A later copy may have run (it was on the stream before the failure was known), but its
    // source may be what the failed copy should have written.
    TORCH_CHECK(event == failed, "CudaCopyStream: copy ", event,
                " cannot be trusted: an earlier copy failed (", failure, ")");
    TORCH_CHECK(false, "CudaCopyStream: ", failure);
  }

  void check_known(CopyEvent event) const {
    TORCH_CHECK(event >= 0 && event <= submitted, "CudaCopyStream: wait on event ", event,
                ", which was never submitted (last ", submitted, ")");
  }

  // A GPU-side wait of compute on a copy: timing events recorded on the compute stream just
  // before and just after its cudaStreamWaitEvent. The time between them is how long the stream
  // stood still waiting for the copy (about 0 when the copy was done before compute got there).
  struct GpuWait {
    cudaEvent_t before = nullptr;
    cudaEvent_t after = nullptr;
  };

  void recycle(const GpuWait& w) {
    if (w.before != nullptr) spare_timing.push_back(w.before);
    if (w.after != nullptr) spare_timing.push_back(w.after);
  }

  // Lock held. Takes the leading GPU-side waits whose events completed off `gpu_waits`, adding
  // their time to waited_seconds (the first `uncounted_waits` are dropped instead: a reset came
  // after them). Never blocks: the host does not wait for the GPU to time a wait, which the GPU
  // may not have reached yet (a later call counts it). Never throws: an error here is warned
  // about (the copies' own errors surface at their waits).
  void settle_gpu_waits() {
    while (!gpu_waits.empty()) {
      const GpuWait w = gpu_waits.front();
      cudaError_t status = cudaEventQuery(w.after);
      if (status == cudaErrorNotReady) {
        (void)cudaGetLastError();
        return;
      }
      const bool count = uncounted_waits == 0;
      if (!count) --uncounted_waits;
      float ms = 0;
      if (status == cudaSuccess) status = cudaEventElapsedTime(&ms, w.before, w.after);
      if (status == cudaSuccess) {
        if (count) waited_seconds += static_cast<double>(ms) / 1000.0;
      } else {
        (void)cudaGetLastError();
        TORCH_WARN("CudaCopyStream: the time of a GPU-side copy wait could not be read (",
                   cudaGetErrorString(status), "); it is left out of waited_seconds()");
      }
      recycle(w);
      gpu_waits.pop_front();
    }
  }

  // An event from `pool` (one a settled copy or wait gave back), else a new one with `flags`.
  static cudaEvent_t take_event(std::vector<cudaEvent_t>& pool, unsigned int flags) {
    if (!pool.empty()) {
      cudaEvent_t e = pool.back();
      pool.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&e, flags));
    return e;
  }


  const int device_index;
  c10::cuda::CUDAStream stream;
  std::mutex mutex;
  cudaEvent_t after_compute = nullptr;  // recorded on the caller's stream before each copy
  std::deque<InFlight> in_flight;       // in event order
  std::vector<cudaEvent_t> spare;       // events of completed copies, for reuse
  std::deque<GpuWait> gpu_waits;        // GPU-side waits not yet added to waited_seconds
  size_t uncounted_waits = 0;           // leading gpu_waits queued before the last reset
  std::vector<cudaEvent_t> spare_timing;  // timing events of settled waits, for reuse
  CopyEvent submitted = 0;
  CopyEvent completed = 0;  // every event <= completed finished
  CopyEvent failed = 0;     // the first failed event (0: none)
  std::string failure;
  CopyEvent failure_reported = 0;
  double waited_seconds = 0;
};

CudaCopyStream::CudaCopyStream(int device_index) {
  TORCH_CHECK(device_index >= 0, "CudaCopyStream: device index must be >= 0, got ", device_index);
  const auto index = static_cast<c10::DeviceIndex>(device_index);
  c10::cuda::CUDAGuard guard(index);
  state_ = std::make_unique<State>(device_index,
                                   c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index));
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&state_->after_compute, cudaEventDisableTiming));
}

CudaCopyStream::~CudaCopyStream() {
  if (!state_) return;
  c10::cuda::CUDAGuard guard(state_->device());
  // Warns, never throws: an earlier CUDA error's own message must survive.
  C10_CUDA_CHECK_WARN(cudaStreamSynchronize(state_->stream.stream()));
  for (const State::InFlight& f : state_->in_flight) {
    if (f.done != nullptr) C10_CUDA_CHECK_WARN(cudaEventDestroy(f.done));
  }
  for (cudaEvent_t e : state_->spare) C10_CUDA_CHECK_WARN(cudaEventDestroy(e));
  for (const State::GpuWait& w : state_->gpu_waits) {
    C10_CUDA_CHECK_WARN(cudaEventDestroy(w.before));
    C10_CUDA_CHECK_WARN(cudaEventDestroy(w.after));
  }
  for (cudaEvent_t e : state_->spare_timing) C10_CUDA_CHECK_WARN(cudaEventDestroy(e));
  if (state_->after_compute != nullptr) {
    C10_CUDA_CHECK_WARN(cudaEventDestroy(state_->after_compute));
  }
}

CopyEvent CudaCopyStream::submit_copy(MemoryTier& device, void* dst, const void* src,
                                      int64_t bytes, CopyDirection direction, std::string label) {
  State& s = *state_;
  TORCH_CHECK(device.device() == c10::Device(c10::kCUDA, s.device()), "CudaCopyStream on cuda:",
              s.device_index, ": tier ", device.name(), " is on ", device.device().str());
  TORCH_CHECK(bytes > 0, "CudaCopyStream: a copy needs a positive size, got ", bytes, " bytes");
  std::lock_guard<std::mutex> lock(s.mutex);
  State::InFlight f{++s.submitted, nullptr, std::move(label), {}};
  if (s.failed == 0) {
    cudaEvent_t done = nullptr;
    bool queued = false;  // the memcpy is on the stream
    const cudaStream_t copy = s.stream.stream();
    try {
      c10::cuda::CUDAGuard guard(s.device());
      // Blocking sync: a host wait on it (wait, drain) sleeps instead of spinning a core that
      // the host Adam and LibTorch's CPU threads need.
      done = State::take_event(s.spare, cudaEventBlockingSync | cudaEventDisableTiming);
      // The compute that may still write the source (or read the destination's old bytes) was
      // issued on this thread's current stream: the copy stream waits for it on the GPU.
      const cudaStream_t compute = c10::cuda::getCurrentCUDAStream(s.device()).stream();
      C10_CUDA_CHECK(cudaEventRecord(s.after_compute, compute));
      C10_CUDA_CHECK(cudaStreamWaitEvent(copy, s.after_compute, 0));
      C10_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes),
                                     direction == CopyDirection::kHostToDevice
                                         ? cudaMemcpyHostToDevice
                                         : cudaMemcpyDeviceToHost,
                                     copy));
      queued = true;
      C10_CUDA_CHECK(cudaEventRecord(done, copy));
      f.done = done;
    } catch (const c10::Error& e) {
      if (done != nullptr) s.spare.push_back(done);
      // A memcpy on the stream without its event: nothing could tell when it stops reading and
      // writing the payloads, which the store frees once this copy "completes". Wait for it here.
      if (queued) C10_CUDA_CHECK_WARN(cudaStreamSynchronize(copy));
      f.error = e.what_without_backtrace();
      // Known now: no later copy is issued, and every wait from here on reports it.
      s.fail(f.event, f.label + ": " + f.error);
    }
  }
  const CopyEvent event = f.event;
  s.in_flight.push_back(std::move(f));
  return event;
}

void CudaCopyStream::wait(CopyEvent event) {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.check_known(event);
  s.block_until(event);
  s.check_failure(event);
}

void CudaCopyStream::order_compute_after(CopyEvent event) {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.check_known(event);
  s.poll();
  if (s.completed < event) {
    const State::InFlight& f =
        s.in_flight[static_cast<size_t>(event - s.in_flight.front().event)];
    if (f.done == nullptr || (s.failed != 0 && event >= s.failed)) {
      s.block_until(event);  // a failure known: wait for the copies before it, then report it
    } else {
      c10::cuda::CUDAGuard guard(s.device());
      // The GPU-side wait: kernels issued on this stream from now on start after the copy; the
      // host goes on. A later reuse of `f.done` for another copy does not change this wait. Timing
      // events around it measure how long the stream stands still (waited_seconds()).
      // The timing is a figure, never a reason to fail the ordering: an error there is warned
      // about and that wait goes untimed.
      const cudaStream_t compute = c10::cuda::getCurrentCUDAStream(s.device()).stream();
      s.settle_gpu_waits();  // keeps the list short
      State::GpuWait w;
      try {
        // Timing on; the host only queries them (no blocking-sync flag needed).
        w.before = State::take_event(s.spare_timing, cudaEventDefault);
        w.after = State::take_event(s.spare_timing, cudaEventDefault);
        C10_CUDA_CHECK(cudaEventRecord(w.before, compute));
      } catch (const c10::Error& e) {
        TORCH_WARN_ONCE("CudaCopyStream: a GPU-side copy wait goes untimed: ",
                        e.what_without_backtrace());
        s.recycle(w);
        w = State::GpuWait{};
      }
      C10_CUDA_CHECK(cudaStreamWaitEvent(compute, f.done, 0));
      if (w.before != nullptr) {
        const cudaError_t status = cudaEventRecord(w.after, compute);
        if (status == cudaSuccess) {
          s.gpu_waits.push_back(w);
        } else {
          (void)cudaGetLastError();
          TORCH_WARN_ONCE("CudaCopyStream: a GPU-side copy wait goes untimed: ",
                          cudaGetErrorString(status));
          s.recycle(w);
        }
      }
      return;
    }
  }
  s.check_failure(event);
}

bool CudaCopyStream::done(CopyEvent event) const {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.poll();
  return s.completed >= event;
}

void CudaCopyStream::drain() {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.block_until(s.submitted);
  if (s.failed != 0 && s.failure_reported != s.failed) {
    s.failure_reported = s.failed;
    TORCH_CHECK(false, "CudaCopyStream: ", s.failure);
  }
}

CopyEvent CudaCopyStream::last_submitted() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->submitted;
}

// Neither blocks on the GPU: the engine reads waited_seconds() at every iteration start and step,
// where waiting for the compute stream to pass its queued copy waits would stall the host (the
// host Adam, the next batch). A GPU-side wait counts once the GPU has passed it: an iteration's
// figure may take in a wait of the previous one and leave one still queued to the next.
double CudaCopyStream::waited_seconds() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  c10::cuda::CUDAGuard guard(state_->device());
  state_->settle_gpu_waits();
  return state_->waited_seconds;
}

void CudaCopyStream::reset_waited_seconds() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  c10::cuda::CUDAGuard guard(state_->device());
  state_->settle_gpu_waits();
  state_->uncounted_waits = state_->gpu_waits.size();  // queued before the reset: dropped later
  state_->waited_seconds = 0;
}

void CudaCopyStream::set_clock(std::function<int64_t()> now_us) {
  TORCH_CHECK(now_us, "CudaCopyStream::set_clock: empty clock");  // no spans to time
}

void CudaCopyStream::set_record_spans(bool /*on*/) {}

std::vector<CopySpan> CudaCopyStream::spans() const {
  return {};
}

void CudaCopyStream::clear_spans() {}

}  // namespace patrickstar
