// The at::Tensor wrappers of cpu_adam.h: dtype, device, contiguity and size checks, then the raw
// kernels of cpu_adam.cpp.
#include <c10/util/Exception.h>

#include "patrickstar/optimizer/cpu_adam.h"

namespace patrickstar {
namespace {

HalfFormat half_format_of(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf, what,
              " must be bfloat16 or float16, got ", t.scalar_type());
  return t.scalar_type() == at::kBFloat16 ? HalfFormat::kBFloat16 : HalfFormat::kFloat16;
}

void check_cpu_contiguous(const at::Tensor& t, const char* what, int64_t numel) {
  TORCH_CHECK(t.defined(), what, " is undefined");
  TORCH_CHECK(t.device().is_cpu(), what, " must be on the CPU for the host Adam kernel, got ",
              t.device());
  TORCH_CHECK(t.is_contiguous(), what, " must be contiguous (a chunk view), got strides ",
              t.strides());
  TORCH_CHECK(t.numel() == numel, what, " has ", t.numel(), " elements but the chunk view has ",
              numel);
}

void check_fp32(const at::Tensor& t, const char* what, int64_t numel) {
  check_cpu_contiguous(t, what, numel);
  TORCH_CHECK(t.scalar_type() == at::kFloat, what, " must be float32, got ", t.scalar_type());
}

// Momentum and variance: both float32 or both bfloat16. Returns whether they are bfloat16.
bool check_states(const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, int64_t numel) {
  check_cpu_contiguous(exp_avg, "exp_avg", numel);
  check_cpu_contiguous(exp_avg_sq, "exp_avg_sq", numel);
  const auto dtype = exp_avg.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && exp_avg_sq.scalar_type() == dtype,
              "exp_avg and exp_avg_sq must both be float32 or both bfloat16, got ", dtype, " and ",
              exp_avg_sq.scalar_type());
  return dtype == at::kBFloat16;
}

uint16_t* bf16_bits(const at::Tensor& t) {
  return static_cast<uint16_t*>(t.data_ptr());
}

}  // namespace

void adam_step_mixed(const at::Tensor& half_param_grad, const at::Tensor& master,
                     const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                     const AdamStepConstants& constants) {
  const int64_t numel = master.numel();
  const HalfFormat format = half_format_of(half_param_grad, "half_param_grad");
  check_cpu_contiguous(half_param_grad, "half_param_grad", numel);
  check_fp32(master, "master", numel);
  auto* half = static_cast<uint16_t*>(half_param_grad.data_ptr());
  if (check_states(exp_avg, exp_avg_sq, numel)) {
    cpu_adam_mixed(half, format, master.data_ptr<float>(), bf16_bits(exp_avg),
                   bf16_bits(exp_avg_sq), numel, constants);
  } else {
    cpu_adam_mixed(half, format, master.data_ptr<float>(), exp_avg.data_ptr<float>(),
                   exp_avg_sq.data_ptr<float>(), numel, constants);
  }
}

void adam_step_fp32(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const AdamStepConstants& constants) {
  const int64_t numel = param.numel();
  check_fp32(param, "param", numel);
  check_fp32(grad, "grad", numel);
  if (check_states(exp_avg, exp_avg_sq, numel)) {
    cpu_adam_fp32(param.data_ptr<float>(), grad.data_ptr<float>(), bf16_bits(exp_avg),
                  bf16_bits(exp_avg_sq), numel, constants);
  } else {
    cpu_adam_fp32(param.data_ptr<float>(), grad.data_ptr<float>(), exp_avg.data_ptr<float>(),
                  exp_avg_sq.data_ptr<float>(), numel, constants);
  }
}

GradStats grad_stats(const at::Tensor& grad) {
  check_cpu_contiguous(grad, "grad", grad.numel());
  if (grad.scalar_type() == at::kFloat) {
    return cpu_grad_stats_fp32(grad.data_ptr<float>(), grad.numel());
  }
  const HalfFormat format = half_format_of(grad, "grad");
  return cpu_grad_stats_half(static_cast<const uint16_t*>(grad.data_ptr()), format, grad.numel());
}

void restore_half_from_master(const at::Tensor& half_param, const at::Tensor& master) {
  const int64_t numel = master.numel();
  const HalfFormat format = half_format_of(half_param, "half_param");
  check_cpu_contiguous(half_param, "half_param", numel);
  check_fp32(master, "master", numel);
  cpu_restore_half_from_master(static_cast<uint16_t*>(half_param.data_ptr()), format,
                               master.data_ptr<float>(), numel);
}

}  // namespace patrickstar
