// The batched device Adam (adam_batch.h): the table and its tiles, the host reference against the
// host SIMD kernel bit for bit (every kind, state dtype and half format, aligned and misaligned
// chunks, per-chunk steps), and the norm's value; where a GPU is, the kernels against the host
// reference bit for bit and HybridAdam on the GPU against HybridAdam on the host.
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(PATRICKSTAR_HAVE_CUDA)
#include <c10/cuda/CUDAStream.h>
#endif

#include "optimizer_test_util.h"
#include "patrickstar/optimizer/adam_batch.h"
#include "patrickstar/optimizer/adam_cuda.h"
#include "patrickstar/optimizer/cpu_adam.h"
#include "patrickstar/optimizer/hybrid_adam.h"

namespace patrickstar {
namespace adam_batch_test {

using testing::bit_equal;

// One chunk's tensors: views at `offset` elements into larger buffers (offset 1 or 3 misaligns
// every pointer by 4 or 12 bytes for fp32, 2 or 6 for 16-bit values).
struct Chunk {
  Chunk(AdamBatchKind kind, at::ScalarType states, at::ScalarType half_dtype, int64_t numel,
        int64_t offset, uint64_t seed) {
    torch::manual_seed(seed);
    auto view = [&](at::Tensor whole) { return whole.narrow(0, offset, numel); };
    master = view(torch::randn({numel + offset}));
    exp_avg = view(torch::randn({numel + offset}).mul_(0.1).to(states));
    exp_avg_sq = view(torch::rand({numel + offset}).mul_(0.01).to(states));
    const at::Tensor g = torch::randn({numel + offset}).mul_(1024);  // a loss scale of 1024
    if (kind != AdamBatchKind::kFp32) {
      // kFp32GradHalfOut: the slot's old value is overwritten with the new half weight.
      half = view(kind == AdamBatchKind::kMixed ? g.to(half_dtype) : g.neg().to(half_dtype));
    }
    if (kind != AdamBatchKind::kMixed) grad = view(g);
  }
  Chunk(const Chunk& other, const at::Device& device)
      : master(copy_to(other.master, device)),
        exp_avg(copy_to(other.exp_avg, device)),
        exp_avg_sq(copy_to(other.exp_avg_sq, device)),
        half(copy_to(other.half, device)),
        grad(copy_to(other.grad, device)) {}

  // A copy on `device` at the same offset into a buffer of its own (the same alignment).
  static at::Tensor copy_to(const at::Tensor& t, const at::Device& device) {
    if (!t.defined()) return t;
    const int64_t offset = t.storage_offset();
    return torch::empty({t.numel() + offset}, t.options().device(device))
        .narrow(0, offset, t.numel())
        .copy_(t);
  }
  AdamBatchEntry entry() const {
    AdamBatchEntry e;
    e.half = half.defined() ? static_cast<uint16_t*>(half.data_ptr()) : nullptr;
    e.master = master.data_ptr<float>();
    e.grad = grad.defined() ? grad.data_ptr<float>() : nullptr;
    e.exp_avg = exp_avg.data_ptr();
    e.exp_avg_sq = exp_avg_sq.data_ptr();
    e.numel = master.numel();
    return e;
  }
  AdamChunk adam_chunk(int64_t step) const {
    AdamChunk c;
    c.half_param_grad = half;
    c.master = master;
    c.grad_fp32 = grad;
    c.exp_avg = exp_avg;
    c.exp_avg_sq = exp_avg_sq;
    c.step = step;
    return c;
  }
  // The host SIMD kernel's update of this chunk (what HybridAdam runs in host memory).
  void update_with_host_kernel(AdamBatchKind kind, const AdamStepConstants& c) const {
    if (kind == AdamBatchKind::kMixed) {
      adam_step_mixed(half, master, exp_avg, exp_avg_sq, c);
      return;
    }
    adam_step_fp32(master, grad, exp_avg, exp_avg_sq, c);
    if (kind == AdamBatchKind::kFp32GradHalfOut) restore_half_from_master(half, master);
  }
  void expect_bit_equal(const Chunk& other, const std::string& what) const {
    EXPECT_TRUE(bit_equal(master.cpu(), other.master.cpu())) << what << ": master";
    EXPECT_TRUE(bit_equal(exp_avg.cpu(), other.exp_avg.cpu())) << what << ": exp_avg";
    EXPECT_TRUE(bit_equal(exp_avg_sq.cpu(), other.exp_avg_sq.cpu())) << what << ": exp_avg_sq";
    if (half.defined()) {
      EXPECT_TRUE(bit_equal(half.cpu(), other.half.cpu())) << what << ": half";
    }
  }

  at::Tensor master, exp_avg, exp_avg_sq, half, grad;
};

struct Case {
  AdamBatchKind kind;
  at::ScalarType states;
  at::ScalarType half_dtype;
  std::string name() const {
    const char* kinds[] = {"mixed", "fp32", "fp32 gradient, half out"};
    return std::string(kinds[static_cast<int>(kind)]) + ", states " + c10::toString(states) +
           ", half " + c10::toString(half_dtype);
  }
};

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (const auto kind :
       {AdamBatchKind::kMixed, AdamBatchKind::kFp32, AdamBatchKind::kFp32GradHalfOut}) {
    for (const auto states : {at::kFloat, at::kBFloat16}) {
      for (const auto half : {at::kBFloat16, at::kHalf}) {
        if (kind == AdamBatchKind::kFp32 && half == at::kHalf) continue;  // no half slot
        cases.push_back({kind, states, half});
      }
    }
  }
  return cases;
}

// Sizes around the tile and the group, offsets aligned and not, two distinct Adam steps, two
// parameter groups (three distinct constants).
struct Shape {
  int64_t numel;
  int64_t offset;
  int64_t step;
  int32_t group;
};
const std::vector<Shape> kShapes = {{20000, 0, 3, 0}, {8192, 1, 3, 1}, {8193, 0, 7, 0},
                                    {13, 3, 3, 1},    {8, 0, 7, 0},    {25000, 3, 7, 0}};

// Group 1: another learning rate, betas and eps, and no weight decay.
AdamStepConstants constants_of(int64_t step, int32_t group = 0) {
  if (group == 1) {
    return make_adam_step_constants(3e-4, 0.8, 0.95, 1e-6, 0.0, /*decoupled=*/true, step,
                                    1.0 / 1024);
  }
  return make_adam_step_constants(1e-3, 0.9, 0.99, 1e-8, 0.01, /*decoupled=*/true, step,
                                  1.0 / 1024);
}

std::vector<Chunk> chunks_of(const Case& c) {
  std::vector<Chunk> chunks;
  uint64_t seed = 11;
  for (const Shape& s : kShapes)
    chunks.emplace_back(c.kind, c.states, c.half_dtype, s.numel, s.offset, ++seed);
  return chunks;
}

AdamBatch batch_of(const Case& c, const std::vector<Chunk>& chunks) {
  AdamBatch batch(c.kind, c.states == at::kBFloat16, c.half_dtype == at::kBFloat16);
  for (size_t k = 0; k < chunks.size(); ++k) {
    batch.add(chunks[k].entry(), kShapes[k].step, kShapes[k].group);
  }
  batch.set_constants([](int64_t step, int32_t group) { return constants_of(step, group); });
  return batch;
}

TEST(AdamBatch, TilesCoverEveryElementOnceAndEmptyEntriesAreLeftOut) {
  std::vector<Chunk> chunks;
  const std::vector<int64_t> sizes = {1, 8191, 0, 8192, 8193, 20000, 5};
  for (const int64_t numel : sizes) {
    chunks.emplace_back(AdamBatchKind::kFp32, at::kFloat, at::kBFloat16, numel, 0, 1);
  }
  AdamBatch batch(AdamBatchKind::kFp32, false, false);
  for (const Chunk& chunk : chunks) batch.add(chunk.entry(), 1);
  ASSERT_EQ(batch.entries().size(), sizes.size() - 1);  // the empty one is left out
  int64_t tiles = 0;
  int64_t elements = 0;
  for (const int64_t numel : sizes) {
    tiles += (numel + kAdamTileElems - 1) / kAdamTileElems;
    elements += numel;
  }
  EXPECT_EQ(batch.tiles(), tiles);  // 1 + 1 + 1 + 2 + 3 + 1
  EXPECT_EQ(batch.elements(), elements);
  const auto& entries = batch.entries();
  const auto count = static_cast<int32_t>(entries.size());
  for (int64_t tile = 0; tile < batch.tiles(); ++tile) {
    int32_t expected = 0;
    while (expected + 1 < count && entries[static_cast<size_t>(expected) + 1].first_tile <= tile) {
      ++expected;
    }
    EXPECT_EQ(adam_entry_of_tile(entries.data(), count, tile), expected) << "tile " << tile;
  }
  EXPECT_EQ(batch.keys(), (std::vector<std::pair<int64_t, int32_t>>{{1, 0}}));
}

TEST(AdamBatch, RefusesEntriesItsKindCannotUpdate) {
  const Chunk fp32(AdamBatchKind::kFp32, at::kFloat, at::kBFloat16, 64, 0, 1);
  const Chunk mixed(AdamBatchKind::kMixed, at::kFloat, at::kBFloat16, 64, 0, 1);
  AdamBatch batch(AdamBatchKind::kMixed, false, true);
  EXPECT_THROW(batch.add(fp32.entry(), 1), c10::Error);   // no half slot, a gradient
  EXPECT_THROW(batch.add(mixed.entry(), 0), c10::Error);  // steps count from 1
  EXPECT_TRUE(batch.empty());
  batch.add(mixed.entry(), 2);
  EXPECT_EQ(batch.entries().size(), 1U);
  EXPECT_THROW(run_adam_batch_on_host(batch), c10::Error);  // constants not set
}

TEST(AdamBatch, HostReferenceEqualsTheHostKernelBitForBit) {
  for (const Case& c : all_cases()) {
    const std::vector<Chunk> batched = chunks_of(c);
    std::vector<Chunk> reference;
    for (const Chunk& chunk : batched) reference.emplace_back(chunk, at::kCPU);
    const AdamBatch batch = batch_of(c, batched);
    ASSERT_EQ(batch.keys().size(), 3U);  // (3, 0), (3, 1), (7, 0)
    for (size_t k = 0; k < kShapes.size(); ++k) {
      EXPECT_EQ(batch.entries()[k].vector, kShapes[k].offset == 0 ? 1 : 0) << c.name();
    }
    run_adam_batch_on_host(batch);
    for (size_t k = 0; k < reference.size(); ++k) {
      reference[k].update_with_host_kernel(c.kind, constants_of(kShapes[k].step, kShapes[k].group));
      batched[k].expect_bit_equal(reference[k], c.name() + ", chunk " + std::to_string(k));
    }
  }
}

TEST(AdamBatch, NormSumsEveryGradientInDoubleAndPropagatesNonFinite) {
  for (const Case& c : all_cases()) {
    const std::vector<Chunk> chunks = chunks_of(c);
    const AdamBatch batch = batch_of(c, chunks);
    double expected = 0.0;
    for (const Chunk& chunk : chunks) {
      expected += grad_stats(c.kind == AdamBatchKind::kMixed ? chunk.half : chunk.grad).sum_squares;
    }
    // Squares are exact in double; only the order of additions differs (n ulps at most).
    EXPECT_NEAR(sum_squares_on_host(batch), expected, 1e-12 * expected) << c.name();
  }
  Chunk chunk(AdamBatchKind::kFp32, at::kFloat, at::kBFloat16, 3 * kAdamTileElems + 5, 0, 1);
  chunk.grad.zero_();
  chunk.grad[5] = std::ldexp(1.0f, 100);  // its square overflows float, not double
  AdamBatch batch(AdamBatchKind::kFp32, false, false);
  batch.add(chunk.entry(), 1);
  EXPECT_EQ(sum_squares_on_host(batch), std::ldexp(1.0, 200));
  chunk.grad[kAdamTileElems + 3] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(std::isinf(sum_squares_on_host(batch)));
  chunk.grad[3 * kAdamTileElems + 4] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(sum_squares_on_host(batch)));
}

// ---- On a GPU ----

class AdamBatchOnGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device here";
    if (!cuda_adam_compiled()) GTEST_SKIP() << "this build has no CUDA kernels";
  }
};

// LibTorch's current stream of GPU 0, where the tables' copies and the reads are ordered.
void* current_stream() {
#if defined(PATRICKSTAR_HAVE_CUDA)
  return c10::cuda::getCurrentCUDAStream(0).stream();
#else
  return nullptr;
#endif
}

at::Tensor device_table(const void* data, size_t bytes) {
  const at::Tensor host = torch::empty({static_cast<int64_t>(bytes)}, torch::kUInt8);
  std::memcpy(host.data_ptr(), data, bytes);
  return host.to(torch::kCUDA);
}

TEST_F(AdamBatchOnGpu, KernelsEqualTheHostReferenceBitForBit) {
  for (const Case& c : all_cases()) {
    const std::vector<Chunk> on_host = chunks_of(c);
    std::vector<Chunk> on_gpu;
    for (const Chunk& chunk : on_host) on_gpu.emplace_back(chunk, torch::kCUDA);
    const AdamBatch host_batch = batch_of(c, on_host);
    const AdamBatch gpu_batch = batch_of(c, on_gpu);
    const auto& entries = gpu_batch.entries();
    const at::Tensor table = device_table(entries.data(), entries.size() * sizeof(AdamBatchEntry));
    const auto* device_entries = static_cast<const AdamBatchEntry*>(table.data_ptr());
    const at::Tensor partials =
        torch::empty({gpu_batch.tiles()}, torch::dtype(torch::kDouble).device(torch::kCUDA));
    const at::Tensor sum = torch::empty({1}, torch::dtype(torch::kDouble).device(torch::kCUDA));
    cuda_sum_squares_batch(gpu_batch, device_entries, partials.data_ptr<double>(),
                           sum.data_ptr<double>(), current_stream());
    // Same groups, same additions: the same double, whichever loads the groups took.
    EXPECT_EQ(sum.item<double>(), sum_squares_on_host(host_batch)) << c.name();

    const auto& constants = gpu_batch.constants();
    const at::Tensor constants_table =
        device_table(constants.data(), constants.size() * sizeof(AdamStepConstants));
    cuda_adam_batch(gpu_batch, device_entries,
                    static_cast<const AdamStepConstants*>(constants_table.data_ptr()),
                    current_stream());
    run_adam_batch_on_host(host_batch);
    for (size_t k = 0; k < on_host.size(); ++k) {
      on_gpu[k].expect_bit_equal(on_host[k], c.name() + ", chunk " + std::to_string(k));
    }
  }
}

TEST_F(AdamBatchOnGpu, HybridAdamOnTheGpuEqualsTheHostStepAndReadsOnce) {
  for (const Case& c : all_cases()) {
    const std::vector<Chunk> on_host = chunks_of(c);
    std::vector<Chunk> on_gpu;
    for (const Chunk& chunk : on_host) on_gpu.emplace_back(chunk, torch::kCUDA);
    std::vector<AdamChunk> host_chunks;
    std::vector<AdamChunk> gpu_chunks;
    for (size_t k = 0; k < on_host.size(); ++k) {
      host_chunks.push_back(on_host[k].adam_chunk(kShapes[k].step));
      gpu_chunks.push_back(on_gpu[k].adam_chunk(kShapes[k].step));
      host_chunks.back().group = gpu_chunks.back().group = kShapes[k].group;
    }
    const auto options = AdamOptions().lr(1e-3).beta2(0.99).weight_decay(0.01);
    const std::vector<AdamOptions> groups = {
        options, AdamOptions(options).lr(3e-4).beta1(0.8).beta2(0.95).eps(1e-6).weight_decay(0)};
    HybridAdam host_adam(options, LossScaler::disabled());
    HybridAdam gpu_adam(options, LossScaler::disabled());
    host_adam.set_groups(groups);
    gpu_adam.set_groups(groups);
    PlacementPlan all_device;
    all_device.on_device.assign(gpu_chunks.size(), true);
    const StepReport host_report = host_adam.step(host_chunks);
    const StepReport gpu_report = gpu_adam.step(gpu_chunks, all_device);
    // The norm's additions differ in order (host kernel vs tiles): equal to n ulps.
    EXPECT_NEAR(gpu_report.grad_norm, host_report.grad_norm, 1e-12 * host_report.grad_norm);
    for (size_t k = 0; k < on_host.size(); ++k) {
      on_gpu[k].expect_bit_equal(on_host[k], c.name() + ", chunk " + std::to_string(k));
    }
  }
}

}  // namespace adam_batch_test
}  // namespace patrickstar
