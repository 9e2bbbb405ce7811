// Host Adam micro-benchmarks (ps_micro), 64M parameters each, wall-clock time (multi-threaded):
//   BM_CpuAdam_Mixed:        our kernel, bf16 param/grad slot + fp32 master/m/v (28 bytes/param).
//   BM_CpuAdam_Fp32:         our kernel, all fp32 with a separate gradient (28 bytes/param).
//   BM_CpuAdam_Mixed_Bf16States, BM_CpuAdam_Fp32_Bf16States: the same with momentum and variance
//                            in bf16 ("state_dtype": "bf16"): 20 bytes/param.
//   BM_AtenFusedAdamW_Mixed: ATen's CPU _fused_adamw_ on the fp32 master plus the two casts the
//   same
//                            mixed work needs (bf16 grad -> fp32, fp32 master -> bf16 weight).
//   BM_AtenFusedAdamW_Fp32:  ATen's CPU _fused_adamw_, all fp32.
//   BM_TorchOptimAdamW:      torch::optim::AdamW (unfused tensor ops), fp32.
//   BM_MemoryRMW:            in-place read-modify-write of a 1 GiB buffer with the same threads:
//                            the bandwidth limit. Adam's bound in params/s = RMW bytes_per_second
//                            / 28.
//   BM_CpuAdam_{Mixed,Fp32}_OnTarget/<bit>: our kernels on each SIMD target this CPU supports
//                            (Highway pointed at it; the label names it), and
//                            BM_CpuAdam_Mixed_NoBf16Conversions: the mixed kernel on the best
//                            target without the AVX512-BF16 conversion (where the CPU has it);
//                            the same for the bf16-state kernels (*_Bf16States_NoBf16Conversions).
// items_per_second = parameters updated per second; bytes_per_second counts 28 bytes/param for
// every Adam variant (the bytes a fused pass must move) so the figures compare with BM_MemoryRMW.
#include <ATen/Parallel.h>
#include <ATen/ops/_fused_adamw.h>
#include <benchmark/benchmark.h>
#include <hwy/targets.h>
#include <torch/torch.h>

#include <optional>
#include <string>

#include "patrickstar/optimizer/cpu_adam.h"

namespace patrickstar {
namespace {

constexpr int64_t kParams = 64LL << 20;
constexpr int64_t kBytesPerParam = 28;
constexpr double kLr = 1e-3, kBeta1 = 0.9, kBeta2 = 0.999, kEps = 1e-8, kWeightDecay = 0.01;

void finish(benchmark::State& state, int64_t bytes_per_param = kBytesPerParam) {
  const auto params = static_cast<int64_t>(state.iterations()) * kParams;
  state.SetItemsProcessed(params);
  state.SetBytesProcessed(params * bytes_per_param);
  state.counters["threads"] = at::get_num_threads();
}

struct MixedBuffers {
  explicit MixedBuffers(at::ScalarType states = at::kFloat)
      : exp_avg(torch::zeros({kParams}, states)), exp_avg_sq(torch::zeros({kParams}, states)) {}
  at::Tensor half = torch::randn({kParams}).to(torch::kBFloat16);
  at::Tensor master = torch::randn({kParams});
  at::Tensor exp_avg;
  at::Tensor exp_avg_sq;
};

// 2 + 2 (gradient in, weight out) + 8 (master) + 2 * 2 * state bytes.
void cpu_adam_mixed_bench(benchmark::State& state, at::ScalarType states) {
  MixedBuffers b(states);
  int64_t step = 0;
  for (auto _ : state) {
    const auto c = make_adam_step_constants(kLr, kBeta1, kBeta2, kEps, kWeightDecay, true, ++step);
    adam_step_mixed(b.half, b.master, b.exp_avg, b.exp_avg_sq, c);
    benchmark::ClobberMemory();
  }
  finish(state, 12 + 4 * static_cast<int64_t>(c10::elementSize(states)));
  state.SetLabel(std::string("simd=") + cpu_adam_simd_target());
}

void BM_CpuAdam_Mixed(benchmark::State& state) {
  cpu_adam_mixed_bench(state, at::kFloat);
}
void BM_CpuAdam_Mixed_Bf16States(benchmark::State& state) {
  cpu_adam_mixed_bench(state, at::kBFloat16);
}

// 8 (param) + 4 (gradient) + 2 * 2 * state bytes.
void cpu_adam_fp32_bench(benchmark::State& state, at::ScalarType states) {
  auto param = torch::randn({kParams});
  auto grad = torch::randn({kParams});
  auto exp_avg = torch::zeros({kParams}, states);
  auto exp_avg_sq = torch::zeros({kParams}, states);
  int64_t step = 0;
  for (auto _ : state) {
    const auto c = make_adam_step_constants(kLr, kBeta1, kBeta2, kEps, kWeightDecay, true, ++step);
    adam_step_fp32(param, grad, exp_avg, exp_avg_sq, c);
    benchmark::ClobberMemory();
  }
  finish(state, 12 + 4 * static_cast<int64_t>(c10::elementSize(states)));
  state.SetLabel(std::string("simd=") + cpu_adam_simd_target());
}

void BM_CpuAdam_Fp32(benchmark::State& state) {
  cpu_adam_fp32_bench(state, at::kFloat);
}
void BM_CpuAdam_Fp32_Bf16States(benchmark::State& state) {
  cpu_adam_fp32_bench(state, at::kBFloat16);
}

void BM_AtenFusedAdamW_Mixed(benchmark::State& state) {
  MixedBuffers b;
  auto grad32 = torch::empty({kParams});  // allocated once, as a real optimizer would keep it
  auto step = torch::zeros({}, torch::kFloat);
  for (auto _ : state) {
    grad32.copy_(b.half);  // bf16 gradient -> fp32
    step.add_(1);
    at::_fused_adamw_({b.master}, {grad32}, {b.exp_avg}, {b.exp_avg_sq}, {}, {step}, kLr, kBeta1,
                      kBeta2, kWeightDecay, kEps, false, false, std::nullopt, std::nullopt);
    b.half.copy_(b.master);  // new fp32 master -> bf16 weight
    benchmark::ClobberMemory();
  }
  finish(state);
}

void BM_AtenFusedAdamW_Fp32(benchmark::State& state) {
  auto param = torch::randn({kParams});
  auto grad = torch::randn({kParams});
  auto exp_avg = torch::zeros({kParams});
  auto exp_avg_sq = torch::zeros({kParams});
  auto step = torch::zeros({}, torch::kFloat);
  for (auto _ : state) {
    step.add_(1);
    at::_fused_adamw_({param}, {grad}, {exp_avg}, {exp_avg_sq}, {}, {step}, kLr, kBeta1, kBeta2,
                      kWeightDecay, kEps, false, false, std::nullopt, std::nullopt);
    benchmark::ClobberMemory();
  }
  finish(state);
}

void BM_TorchOptimAdamW(benchmark::State& state) {
  auto param = torch::randn({kParams}).requires_grad_(true);
  param.mutable_grad() = torch::randn({kParams});
  torch::optim::AdamW optimizer(
      {param},
      torch::optim::AdamWOptions(kLr).betas({kBeta1, kBeta2}).eps(kEps).weight_decay(kWeightDecay));
  for (auto _ : state) {
    optimizer.step();
    benchmark::ClobberMemory();
  }
  finish(state);
}

void BM_MemoryRMW(benchmark::State& state) {
  constexpr int64_t kFloats = (1LL << 30) / 4;  // 1 GiB, more than the 0.9 GB mixed Adam touches
  auto buffer = torch::zeros({kFloats});
  for (auto _ : state) {
    cpu_memory_rmw(buffer.data_ptr<float>(), kFloats);
    benchmark::ClobberMemory();
  }
  const double bytes = static_cast<double>(state.iterations()) * kFloats * 4 * 2;
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
  state.counters["threads"] = at::get_num_threads();
  state.counters["adam_bound_params_per_s"] =
      benchmark::Counter(bytes / kBytesPerParam, benchmark::Counter::kIsRate);
}

// Highway pointed at one target for the benchmark's duration.
class OnTarget {
 public:
  explicit OnTarget(int64_t target) { hwy::SetSupportedTargetsForTest(target); }
  ~OnTarget() { hwy::SetSupportedTargetsForTest(0); }
  OnTarget(const OnTarget&) = delete;
  OnTarget& operator=(const OnTarget&) = delete;
};

void BM_CpuAdam_Mixed_OnTarget(benchmark::State& state) {
  OnTarget on(int64_t{1} << state.range(0));
  cpu_adam_mixed_bench(state, at::kFloat);
}
void BM_CpuAdam_Fp32_OnTarget(benchmark::State& state) {
  OnTarget on(int64_t{1} << state.range(0));
  cpu_adam_fp32_bench(state, at::kFloat);
}
void BM_CpuAdam_Mixed_NoBf16Conversions(benchmark::State& state) {
  cpu_adam_use_bf16_conversions(false);
  cpu_adam_mixed_bench(state, at::kFloat);
  cpu_adam_use_bf16_conversions(true);
}
void BM_CpuAdam_Mixed_Bf16States_NoBf16Conversions(benchmark::State& state) {
  cpu_adam_use_bf16_conversions(false);
  cpu_adam_mixed_bench(state, at::kBFloat16);
  cpu_adam_use_bf16_conversions(true);
}
void BM_CpuAdam_Fp32_Bf16States_NoBf16Conversions(benchmark::State& state) {
  cpu_adam_use_bf16_conversions(false);
  cpu_adam_fp32_bench(state, at::kBFloat16);
  cpu_adam_use_bf16_conversions(true);
}

// One argument per SIMD target this CPU supports (the target's bit in Highway's mask).
void supported_targets(benchmark::internal::Benchmark* b) {
  for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
    for (int bit = 0; bit < 63; ++bit) {
      if (target == (int64_t{1} << bit)) b->Arg(bit);
    }
  }
}

BENCHMARK(BM_MemoryRMW)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CpuAdam_Mixed_OnTarget)
    ->Apply(supported_targets)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_CpuAdam_Fp32_OnTarget)
    ->Apply(supported_targets)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_CpuAdam_Mixed_NoBf16Conversions)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CpuAdam_Mixed_Bf16States_NoBf16Conversions)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_CpuAdam_Fp32_Bf16States_NoBf16Conversions)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_CpuAdam_Mixed)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CpuAdam_Fp32)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CpuAdam_Mixed_Bf16States)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CpuAdam_Fp32_Bf16States)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_AtenFusedAdamW_Mixed)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_AtenFusedAdamW_Fp32)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_TorchOptimAdamW)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace patrickstar
