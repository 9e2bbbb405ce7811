// Compiled only when PATRICKSTAR_HAVE_CUDA (see chunk/CMakeLists.txt); runs on a GPU only (scripts/gpu-check).
#include "patrickstar/chunk/cuda_device_tier.h"
#include "patrickstar/chunk/host_syncs.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <mutex>
#include <vector>

namespace patrickstar {
namespace {

// Every live CUDA tier, for the caching allocator's free-memory callback below. Never destroyed:
// the callback may run during static destruction.
std::mutex& live_tiers_mutex() {
  static auto* m = new std::mutex;
  return *m;
}

std::vector<CudaDeviceTier*>& live_tiers() {
  static auto* tiers = new std::vector<CudaDeviceTier*>;
  return *tiers;
}

}  // namespace

int64_t CudaDeviceTier::release_cached_payloads() {
  std::lock_guard<std::mutex> lock(live_tiers_mutex());
  int64_t bytes = 0;
  for (CudaDeviceTier* tier : live_tiers()) bytes += tier->try_empty_cache();
  return bytes;
}

// LibTorch's caching allocator runs every registered callback when it finds no free block of its
// own, before it asks CUDA for more (with its lock held): payloads our tier keeps for reuse are
// the activations' room in the schedule, so they go back to the device then. A tier busy on
// another thread at that moment keeps its cache (try_empty_cache), which cannot deadlock with a
// tier that waits for LibTorch's lock (raw_allocate's emptyCache). Not while the current stream is
// being captured into a CUDA graph (cudaFree is not allowed then). The callback runs whenever
// LibTorch's pool grows, not only when the device is nearly full: in steady iterations its pool
// has stopped growing, so the cache survives them.
class ReleaseChunkPayloadCaches final : public c10::FreeMemoryCallback {
 public:
  bool Execute() override {
    if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
      return false;
    }
    return CudaDeviceTier::release_cached_payloads() > 0;
  }
};

}  // namespace patrickstar

namespace c10 {
namespace {
REGISTER_FREE_MEMORY_CALLBACK(patrickstar_chunk_payload_caches,
                              patrickstar::ReleaseChunkPayloadCaches)
}  // namespace
}  // namespace c10

namespace patrickstar {

struct CudaDeviceTier::CopyStream {
  c10::cuda::CUDAStream stream;
  cudaEvent_t ready = nullptr;  // recorded on the current stream before a copy
  cudaEvent_t done = nullptr;   // recorded on the copy stream after it
};

CudaDeviceTier::CudaDeviceTier(int device_index, int64_t capacity_bytes)
    // Freed payloads are kept for the next payload of their size: cudaFree waits for the whole
    // device, which would stall the copies and compute that asynchronous moves overlap. They are
    // the activations' room all the same: the free-memory callback above gives them back when
    // LibTorch's allocator runs short.
    : MemoryTier(Tier::kDevice, "cuda:" + std::to_string(device_index), capacity_bytes,
                 /*cache_blocks=*/true),
      device_index_(device_index) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  copy_stream_ = std::make_unique<CopyStream>(
      CopyStream{c10::cuda::getStreamFromPool(/*isHighPriority=*/false,
                                              static_cast<c10::DeviceIndex>(device_index)),
                 nullptr, nullptr});
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&copy_stream_->ready, cudaEventDisableTiming));
  // copy() waits on `done` from the host: blocking sync sleeps there instead of spinning a core.
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&copy_stream_->done,
                                          cudaEventBlockingSync | cudaEventDisableTiming));
  std::lock_guard<std::mutex> lock(live_tiers_mutex());
  live_tiers().push_back(this);
}

CudaDeviceTier::~CudaDeviceTier() {
  {
    std::lock_guard<std::mutex> lock(live_tiers_mutex());
    auto& tiers = live_tiers();
    tiers.erase(std::remove(tiers.begin(), tiers.end(), this), tiers.end());
  }
  release_all();
  if (copy_stream_) {
    cudaEventDestroy(copy_stream_->ready);
    cudaEventDestroy(copy_stream_->done);
  }
}

int64_t CudaDeviceTier::total_memory_bytes(int device_index) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  size_t free = 0;
  size_t total = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return static_cast<int64_t>(total);
}

int64_t CudaDeviceTier::available_memory_bytes(int device_index) {
  const auto device = static_cast<c10::DeviceIndex>(device_index);
  c10::cuda::CUDAGuard guard(device);
  size_t free = 0;
  size_t total = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  // Before LibTorch's CUDA side started, its allocator holds nothing (and cannot be asked).
  int64_t reserved = 0;
  int64_t allocated = 0;
  if (c10::cuda::CUDACachingAllocator::get()->initialized()) {
    constexpr auto kAggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
    reserved = stats.reserved_bytes[kAggregate].current;
    allocated = stats.allocated_bytes[kAggregate].current;
  }
  return cuda_available_bytes(static_cast<int64_t>(free), reserved, allocated);
}

c10::Device CudaDeviceTier::device() const {
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_index_));
}

void* CudaDeviceTier::raw_allocate(int64_t bytes, int64_t alignment) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
  // Payloads come from cudaMalloc, not from LibTorch's caching allocator: its statistics are then
  // exactly the non-model memory the tracer measures. A freed payload waits in the tier's cache
  // until the free-memory callback above gives it to LibTorch's allocator.
  void* ptr = nullptr;
  cudaError_t status = cudaMalloc(&ptr, static_cast<size_t>(bytes));
  if (status == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // clear it
    // Blocks the caching allocator keeps for reuse are free memory to the schedule: release them.
    c10::cuda::CUDACachingAllocator::emptyCache();
    status = cudaMalloc(&ptr, static_cast<size_t>(bytes));
  }
  if (status == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return nullptr;  // MemoryTier::allocate turns this into its own out-of-memory error
  }
  C10_CUDA_CHECK(status);
  // cudaMalloc aligns to at least 256 bytes.
  TORCH_CHECK(reinterpret_cast<uintptr_t>(ptr) % static_cast<uintptr_t>(alignment) == 0,
              "CUDA block ", ptr, " is not aligned to ", alignment, " bytes");
  return ptr;
}

void CudaDeviceTier::raw_deallocate(void* ptr, int64_t /*bytes*/, int64_t /*alignment*/) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
  // Synchronizes the device: no queued kernel or copy still uses it (a payload that waits in the
  // cache instead is reused only by writers ordered after the compute stream: a copy issued after
  // an event recorded on it, or a zero fill or kernel on it). Warns, never throws: this runs from
  // the tier's destructor, maybe after an earlier CUDA error (whose own message must survive).
  note_host_sync();
  C10_CUDA_CHECK_WARN(cudaFree(ptr));
}

void CudaDeviceTier::copy(void* dst, const void* src, int64_t bytes, CopyDirection direction) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
  cudaStream_t compute =
      c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_index_)).stream();
  cudaStream_t copy = copy_stream_->stream.stream();
  C10_CUDA_CHECK(cudaEventRecord(copy_stream_->ready, compute));
  C10_CUDA_CHECK(cudaStreamWaitEvent(copy, copy_stream_->ready, 0));
  C10_CUDA_CHECK(cudaMemcpyAsync(
      dst, src, static_cast<size_t>(bytes),
      direction == CopyDirection::kHostToDevice ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost,
      copy));
  C10_CUDA_CHECK(cudaEventRecord(copy_stream_->done, copy));
  C10_CUDA_CHECK(cudaStreamWaitEvent(compute, copy_stream_->done, 0));
  note_host_sync();
  C10_CUDA_CHECK(cudaEventSynchronize(copy_stream_->done));
}

void CudaDeviceTier::fill_zero(void* ptr, int64_t bytes) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
  cudaStream_t compute =
      c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_index_)).stream();
  C10_CUDA_CHECK(cudaMemsetAsync(ptr, 0, static_cast<size_t>(bytes), compute));
}

}  // namespace patrickstar
