// Helpers shared by the optimizer tests: relative differences and bitwise comparison.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cstring>

namespace patrickstar::testing {

// max_i |a_i - b_i| / max(|b_i|, floor): elementwise relative difference; `floor` keeps exact
// zeros from dividing by zero (differences there are reported relative to `floor`).
inline double max_rel_diff(const torch::Tensor& a, const torch::Tensor& b, double floor = 1e-30) {
  const auto a64 = a.to(torch::kDouble);
  const auto b64 = b.to(torch::kDouble);
  return ((a64 - b64).abs() / b64.abs().clamp_min(floor)).max().item<double>();
}

// ||a - b||_inf / ||b||_inf: the largest difference relative to the tensor's magnitude.
inline double max_norm_rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  const auto a64 = a.to(torch::kDouble);
  const auto b64 = b.to(torch::kDouble);
  return (a64 - b64).abs().max().item<double>() / b64.abs().max().item<double>();
}

// Same bits (dtype, size and every byte); at::equal would call -0 == +0 and fail on NaN.
inline bool bit_equal(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const auto ac = a.contiguous();
  const auto bc = b.contiguous();
  return std::memcmp(ac.data_ptr(), bc.data_ptr(), ac.numel() * ac.element_size()) == 0;
}

inline int64_t count_bit_diffs(const torch::Tensor& a, const torch::Tensor& b) {
  const auto ai = a.contiguous().view(torch::kInt32);
  const auto bi = b.contiguous().view(torch::kInt32);
  return (ai != bi).sum().item<int64_t>();
}

}  // namespace patrickstar::testing
