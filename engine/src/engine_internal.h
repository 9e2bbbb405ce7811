// Private to engine/src: what the engine's translation units share (how a parameter's storage is
// pointed at a chunk, and the mover that carries out the scheduler's decisions).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>

#include "patrickstar/chunk/chunk_store.h"
#include "patrickstar/engine/config.h"
#include "engine_core.h"
#include "scope_timer.h"
#include "patrickstar/memtracer/memory_probe.h"
#include "patrickstar/memtracer/scheduler.h"

namespace patrickstar {
namespace engine_detail {

// Every tensor id, chunk by chunk (ids within a chunk in placement order): a pass over optimizer
// states in this order stages each chunk of a disk tier once (first-fit placement puts later small
// tensors into earlier chunks, so registration order jumps between chunks).
// An exception's message: a c10::Error's without its backtrace (what errors shown to other ranks
// and users carry).
inline std::string error_text(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) return c10->what_without_backtrace();
  return e.what();
}

// Data parallel: a registration that failed on some rank fails on every rank with this text and the
// failing rank's message (DataParallel::first_error) between the two.
inline constexpr const char* kRegistrationFailed = "patrickstar::Engine: registration failed on ";
inline constexpr const char* kNoRankRegistered =
    "; no rank registered the model (each rank's model is left without the values of the other "
    "ranks' parameters, as when registration fails with data parallel)";

inline std::vector<TensorId> tensors_in_chunk_order(const Layout& layout) {
  std::vector<TensorId> ids;
  for (int64_t i = 0; i < layout.chunk_count(); ++i) {
    for (TensorId id : layout.tensors_in_chunk(i)) ids.push_back(id);
  }
  return ids;
}

// Positions of `ids` (indices into it) ordered by their tensors' chunk index, stable: a pass over
// optimizer states in this order stages each chunk of a disk tier once (first-fit placement puts
// later small tensors into earlier chunks, so registration order jumps between chunks).
inline std::vector<size_t> chunk_order(const Layout& layout, const std::vector<TensorId>& ids) {
  std::vector<size_t> order(ids.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = k;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return layout.placement(ids[a]).chunk_index < layout.placement(ids[b]).chunk_index;
  });
  return order;
}

// A storage object of `nbytes` without memory. The engine points a parameter's live storage at a
// chunk slot while the parameter is in use; views that autograd saves share that storage object,
// so they follow every re-pointing.
// `device`: where the parameter computes (the CPU on the emulated device and for a CPU embedding,
// the GPU on CUDA); the storage keeps it through every re-pointing.
inline c10::Storage storage_without_memory(int64_t nbytes, c10::Device device) {
  return c10::Storage(c10::Storage::use_byte_size_t(), nbytes, c10::DataPtr(nullptr, device),
                      /*allocator=*/nullptr, /*resizable=*/false);
}

// A storage object of `nbytes` whose data cannot be read: every access throws c10::Error with
// `message` (LibTorch's own mechanism for storages without data).
inline c10::Storage fence_storage(int64_t nbytes, std::string message, c10::Device device) {
  c10::Storage storage = storage_without_memory(nbytes, device);
  storage.unsafeGetStorageImpl()->release_data_and_set_meta_custom_data_ptr_error_msg_(
      std::move(message));
  return storage;
}

// A tensor of `sizes` and `dtype` over `storage` (which it shares), on the storage's device.
inline at::Tensor tensor_over(const c10::Storage& storage, c10::IntArrayRef sizes,
                              at::ScalarType dtype) {
  const c10::DispatchKey key =
      storage.device().is_cuda() ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU;
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(storage), c10::DispatchKeySet(key), c10::scalarTypeToTypeMeta(dtype));
  t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return t;
}

inline void repoint(const c10::Storage& storage, void* data) {
  storage.unsafeGetStorageImpl()->set_data_ptr_noswap(c10::DataPtr(data, storage.device()));
}

// A copy of `t` in host memory (checkpoints and state dicts are host tensors on every device).
inline at::Tensor host_copy(const at::Tensor& t) {
  return t.to(at::kCPU, t.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
}
// A host copy in fp32 (bf16 optimizer states widen exactly).
inline at::Tensor fp32_copy(const at::Tensor& t) {
  return t.to(at::kCPU, at::kFloat, /*non_blocking=*/false, /*copy=*/true);
}

// The device tier `config` asks for: the emulated device (CPU memory with a hard capacity) or,
// in builds with CUDA, a GPU's (compute_device.cpp).
std::unique_ptr<MemoryTier> make_device_tier(const Config& config);
// The copy engine of asynchronous moves on that device: the copy thread (CopyQueue, with the
// config's test delays) on the emulated device, a CUDA copy stream (CudaCopyStream) on a GPU.
std::unique_ptr<CopyEngine> make_copy_engine(const Config& config);
// Empty when `config`'s device can be used here; else why not (no CUDA in this build, no GPU).
std::string device_unavailable_reason(const Config& config);
// On "cuda": GPU config.device.index becomes LibTorch's current CUDA device (a DDP trainer's
// set_device), so that the trainer's tensors sent to torch::kCUDA meet the engine's.
void make_current_device(const Config& config);

// The device bytes the engine plans with: capacity x overall_gpu_mem_ratio (rounded down) less
// the scheduler's reserve, as the scheduler's budgets count them.
inline int64_t usable_device_bytes(const Config& config) {
  return static_cast<int64_t>(std::floor(static_cast<double>(config.device.capacity_bytes) *
                                         config.mem_tracer.overall_gpu_mem_ratio)) -
         config.scheduler.reserve_bytes;
}

inline at::ScalarType param_dtype(Precision precision) {
  switch (precision) {
    case Precision::kFp32: return at::kFloat;
    case Precision::kBf16: return at::kBFloat16;
    case Precision::kFp16: return at::kHalf;
  }
  return at::kFloat;
}


}  // namespace engine_detail

// Carries out the scheduler's decisions on the chunk store. Data parallel (`lazy_grads`): another
// rank's gradient chunk without a payload (its group holds no gradients now) starts as zeros on
// the device when the scheduler first wants it there (no copy: a backward is about to fill it), and
// is left alone when the scheduler would send it to the host. Other ranks' param chunks are not the
// scheduler's at all (the doors gather them onto the device). With one process every chunk has a
// payload and a move of one without is the chunk store's error.
class EngineCore::Mover final : public ChunkMover {
 public:
  Mover(ChunkStore& store, bool lazy_grads) : store_(store), lazy_grads_(lazy_grads) {}
  bool on_device(int64_t id) override { return store_.tier(id) == Tier::kDevice; }
  bool movable(int64_t id) override { return store_.is_movable(id); }
  void to_device(int64_t id) override {
    if (before_move) before_move(id);
    if (lazy_grads_ && store_.tier(id) == Tier::kNone && store_.kind_of(id) == ChunkKind::kGrad) {
      store_.allocate(id, Tier::kDevice);  // zeros
      return;
    }
    store_.move(id, Tier::kDevice);
  }
  void to_host(int64_t id) override {
    if (before_move) before_move(id);
    if (!lazy_grads_ || store_.tier(id) != Tier::kNone) store_.move(id, Tier::kHost);
  }
  // Called before chunk `id` moves (the overlapped step: the optimizer thread leaves its chunks).
  std::function<void(int64_t)> before_move;

 private:
  ChunkStore& store_;
  bool lazy_grads_;
};

}  // namespace patrickstar
