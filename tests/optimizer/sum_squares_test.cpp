// sum_squares_on_device: the gradient norm HybridAdam reads of a chunk on a GPU, run here on CPU
// tensors (and on a GPU where there is one): its value (as the host kernel's, in double) and its
// temporaries (one slice in double, measured by the counting allocator), whatever the chunk's size.
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <memory>

#include "patrickstar/memtracer/counting_allocator.h"
#include "patrickstar/memtracer/memory_probe.h"
#include "patrickstar/optimizer/hybrid_adam.h"

namespace patrickstar {
namespace sum_squares_test {

TEST(SumSquaresOnDevice, EqualsTheHostKernelsDoubleSum) {
  torch::manual_seed(3);
  for (const auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    const at::Tensor grad = torch::randn({3 * kSumSquaresSliceElems + 4321}).to(dtype);
    const at::Tensor sum = sum_squares_on_device(grad);
    EXPECT_EQ(sum.dim(), 0);
    EXPECT_EQ(sum.scalar_type(), torch::kDouble);
    EXPECT_EQ(sum.device(), grad.device());
    // Squares of 16- and 32-bit floats are exact in double: only the order of the additions
    // differs, which moves a sum of n positive terms by at most n ulps (relative 2^-52 each).
    const double expected = grad_stats(grad).sum_squares;
    EXPECT_NEAR(sum.item<double>(), expected, 1e-9 * expected) << dtype;
  }
}

TEST(SumSquaresOnDevice, SquaresInDoubleAndPropagatesNonFinite) {
  at::Tensor grad = torch::zeros({2 * kSumSquaresSliceElems + 7});
  grad[5] = std::ldexp(1.0f, 100);  // its square overflows float, not double
  EXPECT_EQ(sum_squares_on_device(grad).item<double>(), std::ldexp(1.0, 200));
  grad[kSumSquaresSliceElems + 3] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(std::isinf(sum_squares_on_device(grad).item<double>()));
  grad[2 * kSumSquaresSliceElems + 1] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(sum_squares_on_device(grad).item<double>()));
}

// A whole-chunk double copy and its square would be 16 bytes per element (4x an fp32 chunk's
// bytes, 8x a half chunk's), allocated on the GPU where the warm-up never traced them.
TEST(SumSquaresOnDevice, TemporariesStayWithinOneSliceInDouble) {
  CountingCpuAllocator& counter = CountingCpuAllocator::install();
  const int64_t bound_bytes = 8 * kSumSquaresSliceElems + (64 << 10);  // + small results
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    const at::Tensor grad = torch::rand({8 * kSumSquaresSliceElems + 99}).to(dtype);
    const int64_t before = counter.live_bytes();
    counter.reset_peak();
    const double sum = sum_squares_on_device(grad).item<double>();
    const int64_t extra = counter.peak_bytes() - before;
    EXPECT_GT(sum, 0.0);
    EXPECT_LE(extra, bound_bytes) << dtype << ": a gradient of " << grad.nbytes() << " bytes";
  }
}

// The same on a GPU, where step() calls it: the value as the host's and the temporaries within one
// slice (the caching allocator's statistics). Skipped, with the reason, without a GPU.
TEST(SumSquaresOnDevice, OnCudaEqualsTheHostAndStaysWithinOneSlice) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device here";
  torch::manual_seed(4);
  const at::Tensor host = torch::randn({8 * kSumSquaresSliceElems + 99});
  const at::Tensor grad = host.to(torch::kCUDA);
  const std::unique_ptr<MemoryProbe> probe = make_cuda_memory_probe(0);
  torch::cuda::synchronize();
  const int64_t before = probe->live_bytes();
  probe->reset_peak();
  const at::Tensor sum = sum_squares_on_device(grad);
  torch::cuda::synchronize();
  EXPECT_LE(probe->peak_bytes() - before, 8 * kSumSquaresSliceElems + (64 << 10));
  EXPECT_EQ(sum.device(), grad.device());
  const double expected = grad_stats(host).sum_squares;
  EXPECT_NEAR(sum.item<double>(), expected, 1e-9 * expected);
}

}  // namespace sum_squares_test
}  // namespace patrickstar
