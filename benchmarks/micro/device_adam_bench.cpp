// The device Adam (ps_micro), interleaved iteration by iteration with ATen's _fused_adamw_ on the
// same tensors and with a device-to-device copy of the same bytes, so the three share the machine's
// state (clocks, caches, other load) and their ratios hold even where absolute times are noisy.
//   BM_DeviceAdam/Fp32, /Mixed, /Mixed_Bf16States, /Fp32_Bf16States: HybridAdam::step on chunks
//   placed on the device, every chunk's gradient norm included (the batched kernels of
//   adam_batch.h on a GPU; the host SIMD kernel on the emulated device's memory).
// Device: PATRICKSTAR_BENCH_DEVICE=cuda (a GPU; refused if none) or cpu (the emulated device, the
// default). Parameters: PATRICKSTAR_BENCH_PARAMS (default 2^26 on cuda, 2^22 on cpu), in chunks of
// 2^22 elements as views into one buffer each.
// Counters: adam_GBps, fused_GBps (both counting the bytes one fused pass must move: 28 per
// parameter, 20 with bf16 states), copy_GBps (bytes read + written), vs_fused = fused time / ours
// (the goal is >= 1.0), of_copy = our bytes per second / the copy's (the goal is >= 0.8).
// Both sides read the gradient's norm back once per step (ours for clipping and the overflow check;
// for fused AdamW, grad.norm().item(), the work clip_grad_norm_ adds). fused_adamw_ wants one
// dtype: the mixed variants give it an fp32 gradient cast from the half slot and cast the new
// master back (the work a mixed step needs); bf16 states run it on fp32 states of the same size
// (it has no bf16-state form).
#include <ATen/ops/_fused_adamw.h>
#include <benchmark/benchmark.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "patrickstar/optimizer/hybrid_adam.h"

namespace patrickstar {
namespace device_adam_bench {

constexpr double kLr = 1e-3, kBeta1 = 0.9, kBeta2 = 0.99, kEps = 1e-8, kWeightDecay = 0.01;
constexpr int64_t kChunkElems = int64_t{1} << 22;

at::Device bench_device() {
  const char* env = std::getenv("PATRICKSTAR_BENCH_DEVICE");
  const std::string name = env == nullptr ? "cpu" : env;
  TORCH_CHECK(name == "cpu" || name == "cuda",
              "PATRICKSTAR_BENCH_DEVICE must be cpu or cuda, got '", name, "'");
  TORCH_CHECK(name == "cpu" || torch::cuda::is_available(),
              "PATRICKSTAR_BENCH_DEVICE=cuda but no CUDA device is available");
  return name == "cuda" ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
}

int64_t bench_params(const at::Device& device) {
  const char* env = std::getenv("PATRICKSTAR_BENCH_PARAMS");
  if (env != nullptr) {
    char* end = nullptr;
    const long long params = std::strtoll(env, &end, 10);
    TORCH_CHECK(end != env && *end == '\0' && params > 0,
                "PATRICKSTAR_BENCH_PARAMS must be a positive number of parameters, got '", env,
                "'");
    return params;
  }
  return device.is_cuda() ? int64_t{1} << 26 : int64_t{1} << 22;
}

void synchronize(const at::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

template <typename Work>
double timed(const at::Device& device, Work work) {
  synchronize(device);
  const auto start = std::chrono::steady_clock::now();
  work();
  synchronize(device);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

struct Variant {
  bool mixed;
  at::ScalarType states;
};

// The whole buffers, and the chunks as views into them.
struct Buffers {
  Buffers(const Variant& v, const at::Device& device, int64_t params) {
    const auto on = torch::TensorOptions().device(device);
    master = torch::randn({params}, on);
    exp_avg = torch::zeros({params}, on.dtype(v.states));
    exp_avg_sq = torch::zeros({params}, on.dtype(v.states));
    const at::Tensor g = torch::randn({params}, on);
    if (v.mixed) half = g.to(at::kBFloat16);
    if (!v.mixed) grad = g;
    for (int64_t start = 0; start < params; start += kChunkElems) {
      const int64_t n = std::min(kChunkElems, params - start);
      AdamChunk c;
      if (v.mixed) c.half_param_grad = half.narrow(0, start, n);
      c.master = master.narrow(0, start, n);
      if (!v.mixed) c.grad_fp32 = grad.narrow(0, start, n);
      c.exp_avg = exp_avg.narrow(0, start, n);
      c.exp_avg_sq = exp_avg_sq.narrow(0, start, n);
      chunks.push_back(c);
    }
    plan.on_device.assign(chunks.size(), true);
  }
  at::Tensor half, master, grad, exp_avg, exp_avg_sq;
  std::vector<AdamChunk> chunks;
  PlacementPlan plan;
};

// _fused_adamw_ on the same parameters, with the casts a mixed step needs.
struct Fused {
  Fused(const Variant& v, Buffers& b)
      : mixed(v.mixed),
        step(torch::zeros({}, b.master.options())),
        grad32(v.mixed ? torch::empty_like(b.master) : b.grad),
        exp_avg(v.states == at::kFloat ? b.exp_avg : torch::zeros_like(b.master)),
        exp_avg_sq(v.states == at::kFloat ? b.exp_avg_sq : torch::zeros_like(b.master)) {}
  void run(Buffers& b) {
    if (mixed) grad32.copy_(b.half);
    // The gradient's norm read back once, as ours (clip_grad_norm_'s work before a fused step).
    norm = grad32.norm().item<double>();
    step.add_(1);
    at::_fused_adamw_({b.master}, {grad32}, {exp_avg}, {exp_avg_sq}, {}, {step}, kLr, kBeta1,
                      kBeta2, kWeightDecay, kEps, false, false, std::nullopt, std::nullopt);
    if (mixed) b.half.copy_(b.master);
  }
  bool mixed;
  double norm = 0;
  at::Tensor step, grad32, exp_avg, exp_avg_sq;
};

// One step of ours and one of fused AdamW from the same values agree (both are AdamW): what is
// timed computes the same thing. Mixed: fused reads the bf16 gradient cast to fp32 exactly.
bool same_update(const Variant& v, const at::Device& device, std::string& why) {
  Buffers ours(v, device, 4 * kChunkElems / 64 + 7);
  Buffers theirs(v, device, ours.master.numel());
  theirs.master.copy_(ours.master);
  if (v.mixed) theirs.half.copy_(ours.half);
  if (!v.mixed) theirs.grad.copy_(ours.grad);
  HybridAdam adam(
      AdamOptions().lr(kLr).beta1(kBeta1).beta2(kBeta2).eps(kEps).weight_decay(kWeightDecay));
  adam.step(ours.chunks, ours.plan);
  Fused fused(v, theirs);
  fused.run(theirs);
  const double diff = (ours.master - theirs.master).abs().max().item<double>() /
                      theirs.master.abs().max().item<double>();
  why = "the device Adam and _fused_adamw_ differ after one step: " + std::to_string(diff);
  return diff < 1e-5;
}

void BM_DeviceAdam(benchmark::State& state, Variant v) {
  const at::Device device = bench_device();
  std::string why;
  if (!same_update(v, device, why)) {
    state.SkipWithError(why.c_str());
    return;
  }
  const int64_t params = bench_params(device);
  Buffers b(v, device, params);
  Fused fused(v, b);
  const int64_t bytes_per_param = 12 + 4 * static_cast<int64_t>(c10::elementSize(v.states));
  const int64_t copy_elems = params * bytes_per_param / 2 / 4;  // read + written: the same bytes
  const at::Tensor source = torch::randn({copy_elems}, b.master.options());
  const at::Tensor target = torch::empty_like(source);
  HybridAdam adam(
      AdamOptions().lr(kLr).beta1(kBeta1).beta2(kBeta2).eps(kEps).weight_decay(kWeightDecay));
  double ours = 0, theirs = 0, copy = 0;
  for (auto _ : state) {
    const double t = timed(device, [&] { adam.step(b.chunks, b.plan); });
    theirs += timed(device, [&] { fused.run(b); });
    copy += timed(device, [&] { target.copy_(source); });
    ours += t;
    state.SetIterationTime(t);
  }
  const double n = static_cast<double>(state.iterations());
  const double bytes = static_cast<double>(params * bytes_per_param);
  state.counters["adam_GBps"] = bytes * n / ours / 1e9;
  state.counters["fused_GBps"] = bytes * n / theirs / 1e9;
  state.counters["copy_GBps"] = bytes * n / copy / 1e9;
  state.counters["vs_fused"] = theirs / ours;
  state.counters["of_copy"] = copy / ours;
  state.counters["params"] = static_cast<double>(params);
  state.SetLabel(device.str());
}

BENCHMARK_CAPTURE(BM_DeviceAdam, Fp32, Variant{false, at::kFloat})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_DeviceAdam, Mixed, Variant{true, at::kFloat})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_DeviceAdam, Mixed_Bf16States, Variant{true, at::kBFloat16})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_DeviceAdam, Fp32_Bf16States, Variant{false, at::kBFloat16})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace device_adam_bench
}  // namespace patrickstar
