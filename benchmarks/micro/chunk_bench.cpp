// Chunk store micro-benchmarks (ps_micro):
//   BM_ChunkMove/<dtype>: one 64M-element chunk host -> emulated device -> host per iteration.
//   BM_Memcpy/<dtype>:    the same bytes with two plain memcpy calls between prefaulted buffers:
//                         the baseline (goal: BM_ChunkMove >= 0.95 x BM_Memcpy bytes_per_second).
//   BM_Register100k:      registering 100k tensors of mixed shapes and placing them (goal < 50 ms).
//   BM_ChunkSizeSearch10k: the chunk-size search over 10k tensors and 1024 candidate sizes.
#include "patrickstar/chunk/chunk_store.h"

#include <benchmark/benchmark.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace patrickstar {
namespace {

constexpr int64_t kChunkElems = 64LL << 20;  // 64M elements

at::ScalarType dtype_arg(const benchmark::State& state) {
  return state.range(0) == 2 ? at::kHalf : at::kFloat;
}

void BM_ChunkMove(benchmark::State& state) {
  const at::ScalarType dtype = dtype_arg(state);
  const int64_t bytes = kChunkElems * chunk_element_bytes(dtype);
  HostTier host(MemoryTier::kUnlimited, HostTier::Pinning::kNever);
  EmulatedDeviceTier device(2 * bytes);
  Layout layout;
  layout.add_tensor("chunk_sized_tensor", {kChunkElems});
  layout.finalize(kChunkElems);
  ChunkStore store(std::move(layout), {{ChunkKind::kParam, dtype}}, host, device);
  const ChunkId c = store.chunk_id(ChunkKind::kParam, 0);
  store.allocate(c, Tier::kHost);  // zero-filled: every page touched
  // One untimed round trip so both tiers hold a faulted block in their caches, as in training.
  store.move(c, Tier::kDevice);
  store.move(c, Tier::kHost);
  store.reset_move_counters();
  for (auto _ : state) {
    store.move(c, Tier::kDevice);
    store.move(c, Tier::kHost);
    benchmark::DoNotOptimize(store.chunk(c).payload);
  }
  const MoveCounters m = store.move_counters();
  if (m.h2d_bytes + m.d2h_bytes != 2 * bytes * static_cast<int64_t>(state.iterations())) {
    state.SkipWithError("move counters disagree with the moves made");
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * 2 * bytes);
  state.counters["chunk_MiB"] = static_cast<double>(bytes) / (1 << 20);
}

void BM_Memcpy(benchmark::State& state) {
  const int64_t bytes = kChunkElems * chunk_element_bytes(dtype_arg(state));
  auto* a = static_cast<char*>(std::aligned_alloc(64, static_cast<size_t>(bytes)));
  auto* b = static_cast<char*>(std::aligned_alloc(64, static_cast<size_t>(bytes)));
  std::memset(a, 1, static_cast<size_t>(bytes));
  std::memset(b, 2, static_cast<size_t>(bytes));
  for (auto _ : state) {
    std::memcpy(b, a, static_cast<size_t>(bytes));
    std::memcpy(a, b, static_cast<size_t>(bytes));
    benchmark::DoNotOptimize(a);
    benchmark::DoNotOptimize(b);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * 2 * bytes);
  state.counters["chunk_MiB"] = static_cast<double>(bytes) / (1 << 20);
  std::free(a);
  std::free(b);
}

// 100k tensors shaped like transformer blocks of varied width: weights [d, 4d], [d, d], biases and
// norms [d], the odd scalar.
struct Shapes {
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> sizes;
};

const Shapes& mixed_shapes() {
  static const Shapes shapes = [] {
    Shapes s;
    std::mt19937_64 rng(2024);
    const int64_t widths[] = {64, 128, 256, 384, 512, 768, 1024};
    for (int i = 0; i < 100000; ++i) {
      const int64_t d = widths[rng() % 7];
      switch (rng() % 5) {
        case 0:
          s.sizes.push_back({d, 4 * d});
          break;
        case 1:
          s.sizes.push_back({d, d});
          break;
        case 2:
        case 3:
          s.sizes.push_back({d});
          break;
        default:
          s.sizes.push_back({});
          break;
      }
      s.names.push_back("blocks." + std::to_string(i / 8) + ".p" + std::to_string(i % 8));
    }
    return s;
  }();
  return shapes;
}

void BM_Register100k(benchmark::State& state) {
  const Shapes& shapes = mixed_shapes();
  int64_t chunks = 0;
  double waste = 0;
  for (auto _ : state) {
    Layout layout;
    for (size_t i = 0; i < shapes.names.size(); ++i)
      layout.add_tensor(shapes.names[i], shapes.sizes[i]);
    layout.finalize(kChunkElems / 16);  // 4M elements: hundreds of chunks
    chunks = layout.chunk_count();
    waste = layout.waste_fraction();
    benchmark::DoNotOptimize(layout);
  }
  state.counters["tensors"] = static_cast<double>(shapes.names.size());
  state.counters["chunks"] = static_cast<double>(chunks);
  state.counters["waste_pct"] = waste * 100.0;
}

// The chunk-size search over 10k of the same tensors: 1024 candidate sizes from 4M to 8M elements.
void BM_ChunkSizeSearch10k(benchmark::State& state) {
  const Shapes& shapes = mixed_shapes();
  std::vector<int64_t> numels;
  for (size_t i = 0; i < 10000; ++i) {
    int64_t n = 1;
    for (int64_t s : shapes.sizes[i]) n *= s;
    numels.push_back(n);
  }
  PackingResult best;
  for (auto _ : state) {
    best = Layout::search_chunk_size(numels, 4LL << 20, 8LL << 20, 4096);
    benchmark::DoNotOptimize(best);
  }
  state.counters["chunk_elems"] = static_cast<double>(best.chunk_elems);
  state.counters["waste_elems"] = static_cast<double>(best.waste_elems);
}

BENCHMARK(BM_ChunkMove)->Arg(2)->Arg(4)->ArgName("elem_bytes")->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Memcpy)->Arg(2)->Arg(4)->ArgName("elem_bytes")->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Register100k)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ChunkSizeSearch10k)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace patrickstar
