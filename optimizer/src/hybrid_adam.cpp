#include "patrickstar/optimizer/hybrid_adam.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

#include "device_adam.h"
#include "patrickstar/chunk/host_syncs.h"
#include "patrickstar/optimizer/adam_cuda.h"

#if defined(PATRICKSTAR_OPTIMIZER_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace patrickstar {

namespace {

// Its tensors are on a GPU: its update and norm run batched (device_adam.h).
bool on_gpu(const AdamChunk& chunk) {
  return chunk.master.defined() && chunk.master.device().is_cuda();
}

const at::Tensor& grad_of(const AdamChunk& chunk) {
  return chunk.grad_fp32.defined() ? chunk.grad_fp32 : chunk.half_param_grad;
}

void check_view(const at::Tensor& t, const char* what, size_t index, int64_t numel,
                const at::Device& device) {
  TORCH_CHECK(t.defined(), "HybridAdam: chunk ", index, ": ", what, " is undefined");
  TORCH_CHECK(t.numel() == numel, "HybridAdam: chunk ", index, ": ", what, " has ", t.numel(),
              " elements, the master has ", numel);
  TORCH_CHECK(t.is_contiguous(), "HybridAdam: chunk ", index, ": ", what, " is not contiguous");
  TORCH_CHECK(t.device() == device, "HybridAdam: chunk ", index, ": ", what, " is on ", t.device(),
              ", the master on ", device);
}

void check_chunk(const AdamChunk& chunk, size_t index, bool on_device) {
  if (chunk.speculative != nullptr) {
    TORCH_CHECK(!on_device && !chunk.states_from_source &&
                    chunk.speculative->state == SpeculativeUpdate::State::kApplied,
                "HybridAdam: chunk ", index, " carries a speculative update but is ",
                on_device                  ? "placed on the device"
                : chunk.states_from_source ? "given its states by a source"
                                           : "not in the applied state");
  }
  if (chunk.states_from_source) {
    // The states come later (checked then); what is here must be on the host.
    TORCH_CHECK(!on_device, "HybridAdam: chunk ", index,
                " takes its states from a source and is placed on the device");
    const at::Tensor& in_memory = chunk.mixed() ? chunk.half_param_grad : chunk.master;
    TORCH_CHECK(in_memory.defined() && in_memory.device().is_cpu(), "HybridAdam: chunk ", index,
                " takes its states from a source but has no ",
                chunk.mixed() ? "half_param_grad" : "master", " on the CPU");
    return;
  }
  TORCH_CHECK(chunk.master.defined(), "HybridAdam: chunk ", index, " has no master tensor");
  const int64_t numel = chunk.master.numel();
  const at::Device device = chunk.master.device();
  TORCH_CHECK(chunk.master.scalar_type() == at::kFloat, "HybridAdam: chunk ", index,
              ": master must be float32, got ", chunk.master.scalar_type());
  check_view(chunk.master, "master", index, numel, device);
  check_view(chunk.exp_avg, "exp_avg", index, numel, device);
  check_view(chunk.exp_avg_sq, "exp_avg_sq", index, numel, device);
  const auto states = chunk.exp_avg.scalar_type();
  TORCH_CHECK(
      (states == at::kFloat || states == at::kBFloat16) && chunk.exp_avg_sq.scalar_type() == states,
      "HybridAdam: chunk ", index,
      ": exp_avg and exp_avg_sq must both be float32 or both bfloat16, got ", states, " and ",
      chunk.exp_avg_sq.scalar_type());
  if (chunk.mixed()) {
    check_view(chunk.half_param_grad, "half_param_grad", index, numel, device);
    const auto dtype = chunk.half_param_grad.scalar_type();
    TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "HybridAdam: chunk ", index,
                ": half_param_grad must be bfloat16 or float16, got ", dtype);
  }
  if (!chunk.mixed() || chunk.grad_fp32.defined()) {
    check_view(chunk.grad_fp32, "grad_fp32", index, numel, device);
    TORCH_CHECK(chunk.grad_fp32.scalar_type() == at::kFloat, "HybridAdam: chunk ", index,
                ": grad_fp32 must be float32, got ", chunk.grad_fp32.scalar_type());
  }
  if (on_device) {
    TORCH_CHECK(device.is_cpu() || (device.is_cuda() && cuda_adam_compiled()), "HybridAdam: chunk ",
                index, " is placed on the device but its tensors are on ", device,
                (device.is_cuda() ? " and this build has no CUDA kernels" : ""));
  } else {
    TORCH_CHECK(device.is_cpu(), "HybridAdam: chunk ", index,
                " is placed on the host but its tensors are on ", device,
                "; move the chunk before step() or place it on the device");
  }
}

HalfFormat format_of(const at::Tensor& half) {
  return half.scalar_type() == at::kBFloat16 ? HalfFormat::kBFloat16 : HalfFormat::kFloat16;
}

void* stream_for(const at::Tensor& t) {
#if defined(PATRICKSTAR_OPTIMIZER_CUDA)
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
#else
  (void)t;
  return nullptr;
#endif
}

// The gradients' statistics over every chunk: the host kernel for chunks in host memory; the chunks
// on a GPU in one batched pass (device_adam.h), read once (one host synchronization per step).
GradStats stats_of(c10::ArrayRef<AdamChunk> chunks, DeviceAdamBatches& gpu_batches) {
  GradStats total;
  for (const AdamChunk& chunk : chunks) {
    const at::Tensor& grad = grad_of(chunk);
    if (grad.device().is_cpu()) total += grad_stats(grad);
  }
  if (!gpu_batches.empty()) {
    GradStats gpu;
    gpu.sum_squares = gpu_batches.sum_squares();
    total += gpu;
  }
  return total;
}

void restore_half(const AdamChunk& chunk) {
  const at::Tensor& half = chunk.half_param_grad;
  if (half.device().is_cpu()) {
    restore_half_from_master(half, chunk.master);
  } else {
#if defined(PATRICKSTAR_OPTIMIZER_CUDA)
    const c10::cuda::CUDAGuard on(half.device());  // the launch goes to this device's stream
#endif
    cuda_restore_half_from_master(static_cast<uint16_t*>(half.data_ptr()), format_of(half),
                                  chunk.master.data_ptr<float>(), half.numel(), stream_for(half));
  }
}

// A chunk in host memory (the host, or the emulated device); chunks on a GPU update in batches.
void update_chunk(const AdamChunk& chunk, const AdamStepConstants& constants) {
  if (chunk.mixed() && !chunk.grad_fp32.defined()) {
    adam_step_mixed(chunk.half_param_grad, chunk.master, chunk.exp_avg, chunk.exp_avg_sq,
                    constants);
  } else {
    adam_step_fp32(chunk.master, chunk.grad_fp32, chunk.exp_avg, chunk.exp_avg_sq, constants);
  }
  // An fp32 gradient in mixed precision (a gradient space): the half weight from the new master.
  if (chunk.mixed() && chunk.grad_fp32.defined()) restore_half(chunk);
}

}  // namespace

int64_t AdamChunk::state_bytes() const {
  const int64_t numel = master.defined()            ? master.numel()
                        : half_param_grad.defined() ? half_param_grad.numel()
                                                    : 0;
  // The gradient read (2 or 4 bytes), plus the half weight written when the gradient is fp32.
  const int64_t grad_bytes = grad_fp32.defined() ? 4 : 2;
  const int64_t half_bytes = half_param_grad.defined() && grad_fp32.defined() ? 2 : 0;
  return numel * (4 + 2 * moment_bytes() + grad_bytes + half_bytes);
}

GradMultiplier gradient_multiplier(const GradStats& total, double loss_scale,
                                   double max_grad_norm) {
  TORCH_CHECK(loss_scale > 0.0 && std::isfinite(loss_scale),
              "gradient_multiplier: loss_scale must be positive and finite, got ", loss_scale);
  GradMultiplier result;
  result.grad_norm = std::sqrt(total.sum_squares) / loss_scale;
  if (max_grad_norm > 0.0) {
    // As clip_grad_norm_: a float tensor norm, max_norm / (norm + 1e-6) in float, clamped to 1.
    const float norm = static_cast<float>(result.grad_norm);
    const float coef = static_cast<float>(max_grad_norm) / (norm + static_cast<float>(1e-6));
    result.clip_coef = std::min(coef, 1.0f);
  }
  result.multiplier = static_cast<float>(1.0 / loss_scale) * result.clip_coef;
  return result;
}

namespace {

void check_options(const AdamOptions& o, const char* who) {
  TORCH_CHECK(o.lr() >= 0.0 && std::isfinite(o.lr()), who, ": lr must be >= 0, got ", o.lr());
  TORCH_CHECK(o.beta1() >= 0.0 && o.beta1() < 1.0, who, ": beta1 must be in [0, 1), got ",
              o.beta1());
  TORCH_CHECK(o.beta2() >= 0.0 && o.beta2() < 1.0, who, ": beta2 must be in [0, 1), got ",
              o.beta2());
  TORCH_CHECK(o.eps() >= 0.0 && std::isfinite(o.eps()), who, ": eps must be >= 0, got ", o.eps());
  TORCH_CHECK(o.weight_decay() >= 0.0 && std::isfinite(o.weight_decay()), who,
              ": weight_decay must be >= 0, got ", o.weight_decay());
}

}  // namespace

void HybridAdam::set_groups(const std::vector<AdamOptions>& groups) {
  TORCH_CHECK(!groups.empty(), "HybridAdam: at least one parameter group");
  std::vector<AdamOptions> checked = groups;
  for (size_t g = 0; g < checked.size(); ++g) {
    check_options(checked[g], ("HybridAdam: group " + std::to_string(g)).c_str());
    checked[g].decoupled(options().decoupled()).max_grad_norm(options().max_grad_norm());
  }
  groups_ = std::move(checked);
}

void HybridAdam::set_lr(double lr) {
  std::vector<AdamOptions> groups = groups_;
  for (AdamOptions& g : groups) g.lr(lr);
  set_groups(groups);
}

HybridAdam::HybridAdam(const AdamOptions& options, LossScaler loss_scaler)
    : groups_{options}, loss_scaler_(std::move(loss_scaler)) {
  check_options(options, "HybridAdam");
}

AdamStepConstants HybridAdam::constants(int64_t step, int32_t group, float multiplier) const {
  const AdamOptions& o = groups_[static_cast<size_t>(group)];
  return make_adam_step_constants(o.lr(), o.beta1(), o.beta2(), o.eps(), o.weight_decay(),
                                  o.decoupled(), step, multiplier);
}

AdamStepConstants HybridAdam::constants_without_clipping(int64_t step, int32_t group) const {
  TORCH_CHECK(group >= 0 && static_cast<size_t>(group) < groups_.size(), "HybridAdam: group ",
              group, " of ", groups_.size());
  GradMultiplier unclipped;
  unclipped.multiplier = static_cast<float>(1.0 / loss_scaler_.scale()) * unclipped.clip_coef;
  return constants(step, group, unclipped.multiplier);
}

void HybridAdam::set_step_count(int64_t step) {
  TORCH_CHECK(step >= 0, "HybridAdam: step count must be >= 0, got ", step);
  step_ = step;
}

StepReport HybridAdam::step(c10::ArrayRef<AdamChunk> chunks) {
  std::vector<int64_t> bytes;
  bytes.reserve(chunks.size());
  for (const auto& chunk : chunks) bytes.push_back(chunk.state_bytes());
  return step(chunks, all_on_host(bytes));
}

// Runs `work` on chunk k, with its states from `source` when it takes them from there.
template <typename Work>
void with_states(const AdamChunk& chunk, size_t k, AdamStateSource* source, bool updates,
                 Work work) {
  if (!chunk.states_from_source) {
    work(chunk);
    return;
  }
  AdamChunk full = chunk;
  source->acquire(k, full);
  try {
    full.states_from_source = false;
    check_chunk(full, k, /*on_device=*/false);
    work(full);
  } catch (...) {
    source->release(k, /*updated=*/false);
    throw;
  }
  source->release(k, updates);
}

StepReport HybridAdam::step(c10::ArrayRef<AdamChunk> chunks, const PlacementPlan& plan,
                            AdamStateSource* source) {
  TORCH_CHECK(plan.on_device.size() == chunks.size(), "HybridAdam::step: the plan has ",
              plan.on_device.size(), " entries for ", chunks.size(), " chunks");
  for (size_t i = 0; i < chunks.size(); ++i) {
    check_chunk(chunks[i], i, plan.on_device[i]);
    TORCH_CHECK(chunks[i].step >= 0, "HybridAdam: chunk ", i, " has step ", chunks[i].step,
                "; a chunk's step is 1 or more (0: the optimizer's own count plus one)");
    TORCH_CHECK(!chunks[i].states_from_source || source != nullptr, "HybridAdam: chunk ", i,
                " takes its states from a source and step() was given none");
    TORCH_CHECK(
        chunks[i].group >= 0 && static_cast<size_t>(chunks[i].group) < groups_.size(),
        "HybridAdam: chunk ", i, " is of parameter group ", chunks[i].group, " and there ",
        groups_.size() == 1 ? "is 1 group" : "are " + std::to_string(groups_.size()) + " groups");
  }

  StepReport report;
  report.loss_scale = loss_scaler_.scale();

  // The chunks on a GPU (never speculative nor from a source: check_chunk) run batched.
  DeviceAdamBatches gpu_batches;
  auto step_of = [&](size_t k) { return chunks[k].step > 0 ? chunks[k].step : step_ + 1; };
  for (size_t k = 0; k < chunks.size(); ++k) {
    if (on_gpu(chunks[k])) gpu_batches.add(chunks[k], step_of(k));
  }
  GradStats total = stats_of(chunks, gpu_batches);
  // The norm of the chunks on the device is read back: one host synchronization (on the emulated
  // device at the same point, chunk/host_syncs.h).
  if (std::find(plan.on_device.begin(), plan.on_device.end(), true) != plan.on_device.end()) {
    note_host_sync();
  }
  if (agree_) agree_(total);

  if (!total.finite()) {
    // Overflow: no update anywhere. Updates computed ahead are undone; the half slots hold
    // (broken) gradients; put the weights back.
    for (const AdamChunk& chunk : chunks) {
      if (chunk.speculative == nullptr) continue;
      undo(chunk, *chunk.speculative);
      ++report.speculative_undone;
    }
    for (size_t k = 0; k < chunks.size(); ++k) {
      if (chunks[k].mixed()) {
        with_states(chunks[k], k, source, /*updates=*/false, [](const AdamChunk& c) { restore_half(c); });
      }
    }
    report.skipped = true;
    report.step = step_;
    report.grad_norm = total.sum_squares;  // inf or NaN
    loss_scaler_.update(/*overflow=*/true);
    return report;
  }

  const GradMultiplier multiplier =
      gradient_multiplier(total, loss_scaler_.scale(), options().max_grad_norm());
  // Chunks may be at different steps (torch::optim::Adam counts steps per parameter) and of
  // different groups: the constants are made once per distinct (step, group) in a row.
  auto constants_of = [&](int64_t step, int32_t group) {
    return constants(step, group, multiplier.multiplier);
  };
  gpu_batches.update(constants_of);  // asynchronous: the GPU updates while the host's chunks do
  int64_t cached_step = step_ + 1;
  int32_t cached_group = 0;
  AdamStepConstants cached = constants_of(cached_step, cached_group);
  for (size_t k = 0; k < chunks.size(); ++k) {
    if (on_gpu(chunks[k])) continue;
    const int64_t step = step_of(k);
    if (step != cached_step || chunks[k].group != cached_group) {
      cached = constants_of(step, chunks[k].group);
      cached_step = step;
      cached_group = chunks[k].group;
    }
    const AdamStepConstants& constants = cached;
    if (SpeculativeUpdate* ahead = chunks[k].speculative) {
      if (same_constants(ahead->constants, constants)) {
        commit(chunks[k], *ahead);
        ++report.speculative_committed;
        continue;
      }
      undo(chunks[k], *ahead);  // clipped, or another learning rate or loss scale since
      ++report.speculative_undone;
    }
    with_states(chunks[k], k, source, /*updates=*/true,
                [&](const AdamChunk& c) { update_chunk(c, constants); });
  }
  ++step_;
  loss_scaler_.update(/*overflow=*/false);

  report.step = step_;
  report.grad_norm = multiplier.grad_norm;
  report.clip_coef = multiplier.clip_coef;
  report.placement = plan.report;
  return report;
}

}  // namespace patrickstar
