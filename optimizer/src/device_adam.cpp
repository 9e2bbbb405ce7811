// DeviceAdamBatches (device_adam.h): the tensor side of the batched device Adam.
#include "device_adam.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cstring>

#include "patrickstar/optimizer/adam_cuda.h"

#if defined(PATRICKSTAR_OPTIMIZER_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace patrickstar {

namespace {

AdamBatchKind kind_of(const AdamChunk& chunk) {
  if (!chunk.mixed()) return AdamBatchKind::kFp32;
  return chunk.grad_fp32.defined() ? AdamBatchKind::kFp32GradHalfOut : AdamBatchKind::kMixed;
}

void* current_stream(const at::Device& device) {
#if defined(PATRICKSTAR_OPTIMIZER_CUDA)
  return c10::cuda::getCurrentCUDAStream(device.index()).stream();
#else
  (void)device;
  return nullptr;
#endif
}

// The chunks' device current while launching: a kernel launched on another device's stream is
// refused (a thread whose current device is not the chunks', on a machine with several GPUs).
struct OnDevice {
#if defined(PATRICKSTAR_OPTIMIZER_CUDA)
  explicit OnDevice(const at::Device& device) : guard(device) {}
  c10::cuda::CUDAGuard guard;
#else
  explicit OnDevice(const at::Device&) {}
#endif
};

}  // namespace

void DeviceAdamBatches::add(const AdamChunk& chunk, int64_t step) {
  const at::Device device = chunk.master.device();
  TORCH_CHECK(device.is_cuda(), "DeviceAdamBatches: a chunk on ", device);
  TORCH_CHECK(entries_on_device_.empty(),
              "DeviceAdamBatches: a chunk added after the tables went to the device");
  if (chunk.master.numel() == 0) return;  // nothing to update (AdamBatch leaves it out too)
  if (!device_) device_ = device;
  TORCH_CHECK(*device_ == device, "HybridAdam: chunks on the device are on ", *device_, " and on ",
              device, "; one engine's device Adam runs on one GPU");
  const AdamBatchKind kind = kind_of(chunk);
  const bool bf16_states = chunk.exp_avg.scalar_type() == at::kBFloat16;
  const bool bf16_half = chunk.mixed() && chunk.half_param_grad.scalar_type() == at::kBFloat16;
  AdamBatch* batch = nullptr;
  for (AdamBatch& b : batches_) {
    if (b.kind() == kind && b.bf16_states() == bf16_states && b.bf16_half() == bf16_half)
      batch = &b;
  }
  if (batch == nullptr) batch = &batches_.emplace_back(kind, bf16_states, bf16_half);
  AdamBatchEntry entry;
  entry.half = chunk.mixed() ? static_cast<uint16_t*>(chunk.half_param_grad.data_ptr()) : nullptr;
  entry.master = chunk.master.data_ptr<float>();
  entry.grad = chunk.grad_fp32.defined() ? chunk.grad_fp32.data_ptr<float>() : nullptr;
  entry.exp_avg = chunk.exp_avg.data_ptr();
  entry.exp_avg_sq = chunk.exp_avg_sq.data_ptr();
  entry.numel = chunk.master.numel();
  batch->add(entry, step, chunk.group);
}

at::Tensor DeviceAdamBatches::upload(const void* data, size_t bytes) const {
  at::Tensor pinned = at::empty({static_cast<int64_t>(bytes)},
                                at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(pinned.data_ptr(), data, bytes);
  return pinned.to(*device_, /*non_blocking=*/true);
}

const AdamBatchEntry* DeviceAdamBatches::device_entries(size_t b) {
  if (entries_on_device_.size() <= b) entries_on_device_.resize(batches_.size());
  at::Tensor& table = entries_on_device_[b];
  if (!table.defined()) {
    const std::vector<AdamBatchEntry>& entries = batches_[b].entries();
    table = upload(entries.data(), entries.size() * sizeof(AdamBatchEntry));
  }
  return static_cast<const AdamBatchEntry*>(table.data_ptr());
}

double DeviceAdamBatches::sum_squares() {
  if (batches_.empty()) return 0.0;
  const OnDevice on(*device_);
  void* stream = current_stream(*device_);
  at::Tensor sums = at::empty({static_cast<int64_t>(batches_.size())},
                              at::TensorOptions().dtype(at::kDouble).device(*device_));
  for (size_t b = 0; b < batches_.size(); ++b) {
    at::Tensor partials =
        at::empty({batches_[b].tiles()}, at::TensorOptions().dtype(at::kDouble).device(*device_));
    cuda_sum_squares_batch(batches_[b], device_entries(b), partials.data_ptr<double>(),
                           sums.data_ptr<double>() + b, stream);
  }
  const at::Tensor on_host = sums.cpu();  // the one synchronization
  double total = 0.0;
  for (int64_t b = 0; b < on_host.numel(); ++b) total += on_host.data_ptr<double>()[b];
  return total;
}

void DeviceAdamBatches::update(const std::function<AdamStepConstants(int64_t, int32_t)>& make) {
  if (batches_.empty()) return;
  const OnDevice on(*device_);
  void* stream = current_stream(*device_);
  for (size_t b = 0; b < batches_.size(); ++b) {
    AdamBatch& batch = batches_[b];
    batch.set_constants(make);
    const std::vector<AdamStepConstants>& constants = batch.constants();
    const at::Tensor table = upload(constants.data(), constants.size() * sizeof(AdamStepConstants));
    cuda_adam_batch(batch, device_entries(b),
                    static_cast<const AdamStepConstants*>(table.data_ptr()), stream);
  }
}

}  // namespace patrickstar
