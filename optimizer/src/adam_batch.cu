// The batched device Adam and gradient norm (adam_batch.h): one block per tile of a table of chunk
// pointers, each thread taking groups of 8 elements with 16-byte loads where the entry is aligned.
// The per-element work and the order of the norm's additions are adam_batch.h's, mirrored on the
// host by adam_batch.cpp; --fmad=false keeps nvcc from contracting anything the rule does not.
// Never run on the project's CI machines (no GPU): compiled there, run by scripts/gpu-check.
#include <cuda_runtime.h>

#include "adam_cuda_launch.h"

namespace patrickstar::cuda_detail {
namespace {

constexpr int kGroupsPerThread =
    static_cast<int>(kAdamTileElems / (kAdamGroupElems * kAdamBatchThreads));
static_assert(kGroupsPerThread * kAdamGroupElems * kAdamBatchThreads == kAdamTileElems);

__device__ inline void load8(const float* p, float (&out)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
  out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

__device__ inline void store8(float* p, const float (&in)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(in[0], in[1], in[2], in[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(in[4], in[5], in[6], in[7]);
}

__device__ inline void load8(const uint16_t* p, uint16_t (&out)[8]) {
  const uint4 a = *reinterpret_cast<const uint4*>(p);
  const unsigned words[4] = {a.x, a.y, a.z, a.w};
  for (int j = 0; j < 4; ++j) {  // little-endian: the lower half is the earlier element
    out[2 * j] = static_cast<uint16_t>(words[j] & 0xffffu);
    out[2 * j + 1] = static_cast<uint16_t>(words[j] >> 16);
  }
}

__device__ inline void store8(uint16_t* p, const uint16_t (&in)[8]) {
  unsigned words[4];
  for (int j = 0; j < 4; ++j) words[j] = unsigned{in[2 * j]} | (unsigned{in[2 * j + 1]} << 16);
  *reinterpret_cast<uint4*>(p) = make_uint4(words[0], words[1], words[2], words[3]);
}

// This block's tile: its entry and the elements [begin, end) of that entry.
struct Tile {
  AdamBatchEntry entry;
  int64_t begin;
  int64_t end;
};

__device__ inline Tile tile_of_block(const AdamBatchEntry* entries, int32_t count) {
  const int64_t tile = blockIdx.x;
  Tile t;
  t.entry = entries[adam_entry_of_tile(entries, count, tile)];
  t.begin = (tile - t.entry.first_tile) * kAdamTileElems;
  t.end = t.begin + kAdamTileElems < t.entry.numel ? t.begin + kAdamTileElems : t.entry.numel;
  return t;
}

// Group k of this thread in the tile (adam_batch.cpp's for_each_in_tile: the same order), whether
// it takes the 16-byte path (a whole group of an aligned entry), and its end.
__device__ inline int64_t group_first(const Tile& t, int k) {
  return t.begin +
         (static_cast<int64_t>(threadIdx.x) + int64_t{kAdamBatchThreads} * k) * kAdamGroupElems;
}
__device__ inline bool vector_group(const Tile& t, int64_t first) {
  return t.entry.vector != 0 && first + kAdamGroupElems <= t.end;
}
__device__ inline int64_t group_last(const Tile& t, int64_t first) {
  return first + kAdamGroupElems < t.end ? first + kAdamGroupElems : t.end;
}

template <AdamBatchKind K, typename S>
__global__ void __launch_bounds__(kAdamBatchThreads)
    adam_batch_kernel(const AdamBatchEntry* entries, int32_t count,
                      const AdamStepConstants* constants, bool bf16_half) {
  const Tile t = tile_of_block(entries, count);
  const AdamBatchEntry& e = t.entry;
  const AdamStepConstants c = constants[e.constants];
  S* m = static_cast<S*>(e.exp_avg);
  S* v = static_cast<S*>(e.exp_avg_sq);
  for (int k = 0; k < kGroupsPerThread; ++k) {
    const int64_t first = group_first(t, k);
    if (first >= t.end) break;
    if (vector_group(t, first)) {
      float p[8];
      S mm[8];
      S vv[8];
      uint16_t h[8] = {};
      float g[8] = {};
      load8(e.master + first, p);
      load8(m + first, mm);
      load8(v + first, vv);
      if constexpr (K == AdamBatchKind::kMixed) load8(e.half + first, h);
      if constexpr (K != AdamBatchKind::kMixed) load8(e.grad + first, g);
      for (int j = 0; j < 8; ++j)
        adam_batch_update<S>(K, bf16_half, p[j], mm[j], vv[j], h[j], g[j], c);
      store8(e.master + first, p);
      store8(m + first, mm);
      store8(v + first, vv);
      if constexpr (K != AdamBatchKind::kFp32) store8(e.half + first, h);
      continue;
    }
    const int64_t last = group_last(t, first);
    for (int64_t i = first; i < last; ++i) {
      uint16_t h = K == AdamBatchKind::kMixed ? e.half[i] : 0;
      const float g = K != AdamBatchKind::kMixed ? e.grad[i] : 0.0f;
      adam_batch_update<S>(K, bf16_half, e.master[i], m[i], v[i], h, g, c);
      if constexpr (K != AdamBatchKind::kFp32) e.half[i] = h;
    }
  }
}

// The shared-memory tree of adam_batch.cpp's tree_sum: slot t gets slot t + s, s halving.
template <int N>
__device__ inline double block_sum(double (&slots)[N], double mine) {
  slots[threadIdx.x] = mine;
  __syncthreads();
  for (int s = N / 2; s > 0; s /= 2) {
    if (static_cast<int>(threadIdx.x) < s) slots[threadIdx.x] += slots[threadIdx.x + s];
    __syncthreads();
  }
  return slots[0];
}

template <AdamBatchKind K>
__global__ void __launch_bounds__(kAdamBatchThreads)
    sum_squares_kernel(const AdamBatchEntry* entries, int32_t count, bool bf16_half,
                       double* partials) {
  __shared__ double slots[kAdamBatchThreads];
  const Tile t = tile_of_block(entries, count);
  const AdamBatchEntry& e = t.entry;
  double sum = 0.0;
  for (int k = 0; k < kGroupsPerThread; ++k) {
    const int64_t first = group_first(t, k);
    if (first >= t.end) break;
    if (vector_group(t, first)) {
      uint16_t h[8] = {};
      float g[8] = {};
      if constexpr (K == AdamBatchKind::kMixed) load8(e.half + first, h);
      if constexpr (K != AdamBatchKind::kMixed) load8(e.grad + first, g);
      for (int j = 0; j < 8; ++j) sum += grad_square(K, bf16_half, h[j], g[j]);
      continue;
    }
    const int64_t last = group_last(t, first);
    for (int64_t i = first; i < last; ++i) {
      const uint16_t h = K == AdamBatchKind::kMixed ? e.half[i] : 0;
      const float g = K != AdamBatchKind::kMixed ? e.grad[i] : 0.0f;
      sum += grad_square(K, bf16_half, h, g);
    }
  }
  const double total = block_sum(slots, sum);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

__global__ void __launch_bounds__(kAdamNormThreads)
    sum_partials_kernel(const double* partials, int64_t tiles, double* out) {
  __shared__ double slots[kAdamNormThreads];
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < tiles; i += kAdamNormThreads) sum += partials[i];
  const double total = block_sum(slots, sum);
  if (threadIdx.x == 0) *out = total;
}

template <AdamBatchKind K>
void launch_update(const AdamBatchEntry* entries, int32_t count, int64_t tiles,
                   const AdamStepConstants* constants, bool bf16_states, bool bf16_half,
                   cudaStream_t s) {
  const dim3 grid(static_cast<unsigned>(tiles));
  if (bf16_states) {
    adam_batch_kernel<K, uint16_t>
        <<<grid, kAdamBatchThreads, 0, s>>>(entries, count, constants, bf16_half);
  } else {
    adam_batch_kernel<K, float>
        <<<grid, kAdamBatchThreads, 0, s>>>(entries, count, constants, bf16_half);
  }
}

// The grid is one block per tile: at most 2^31 - 1 blocks (over 17 * 10^12 elements).
bool grid_fits(int64_t tiles) {
  return tiles <= int64_t{0x7fffffff};
}

}  // namespace

int launch_adam_batch(const AdamBatchEntry* entries, int32_t count, int64_t tiles,
                      const AdamStepConstants* constants, AdamBatchKind kind, bool bf16_states,
                      bool bf16_half, void* stream) {
  if (tiles <= 0) return 0;
  if (!grid_fits(tiles)) return static_cast<int>(cudaErrorInvalidConfiguration);
  const auto s = static_cast<cudaStream_t>(stream);
  switch (kind) {
    case AdamBatchKind::kMixed:
      launch_update<AdamBatchKind::kMixed>(entries, count, tiles, constants, bf16_states, bf16_half,
                                           s);
      break;
    case AdamBatchKind::kFp32:
      launch_update<AdamBatchKind::kFp32>(entries, count, tiles, constants, bf16_states, bf16_half,
                                          s);
      break;
    case AdamBatchKind::kFp32GradHalfOut:
      launch_update<AdamBatchKind::kFp32GradHalfOut>(entries, count, tiles, constants, bf16_states,
                                                     bf16_half, s);
      break;
  }
  return static_cast<int>(cudaGetLastError());
}

int launch_sum_squares_batch(const AdamBatchEntry* entries, int32_t count, int64_t tiles,
                             AdamBatchKind kind, bool bf16_half, double* partials, double* out,
                             void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (tiles <= 0) return static_cast<int>(cudaMemsetAsync(out, 0, sizeof(double), s));
  if (!grid_fits(tiles)) return static_cast<int>(cudaErrorInvalidConfiguration);
  const dim3 grid(static_cast<unsigned>(tiles));
  switch (kind) {
    case AdamBatchKind::kMixed:
      sum_squares_kernel<AdamBatchKind::kMixed>
          <<<grid, kAdamBatchThreads, 0, s>>>(entries, count, bf16_half, partials);
      break;
    case AdamBatchKind::kFp32:
      sum_squares_kernel<AdamBatchKind::kFp32>
          <<<grid, kAdamBatchThreads, 0, s>>>(entries, count, bf16_half, partials);
      break;
    case AdamBatchKind::kFp32GradHalfOut:
      sum_squares_kernel<AdamBatchKind::kFp32GradHalfOut>
          <<<grid, kAdamBatchThreads, 0, s>>>(entries, count, bf16_half, partials);
      break;
  }
  const int launched = static_cast<int>(cudaGetLastError());
  if (launched != 0) return launched;
  sum_partials_kernel<<<1, kAdamNormThreads, 0, s>>>(partials, tiles, out);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace patrickstar::cuda_detail
