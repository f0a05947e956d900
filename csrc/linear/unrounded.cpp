// Logits of a half-precision model in float32: the head's sums as they are, before the rounding to
// bfloat16 / half that would make nearby logits equal (bfloat16 keeps 8 bits: logits of 10 differ by
// 0.0625 at the least), so that greedy and seeded sampling follow the float32 sums.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include "attention/config.h"
#include "causal_attention/attention.h"
#include "causal_attention/module.h"
#include "linear/few_rows.h"
#include "linear/widened.h"

namespace causal_attention {
namespace kernels {
namespace {

// Rows up to which the streaming kernel (one pass over the weight per 8 rows) beats widened_blocks.
constexpr int64_t kStreamRows = 64;

at::ScalarType sum_type(at::ScalarType dtype) {
  return dtype == at::kBFloat16 || dtype == at::kHalf ? at::kFloat : dtype;
}

void check_unrounded(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(x.dim() >= 1, "unrounded_linear: x must have at least one dimension (..., in); got a scalar");
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) == x.size(-1),
                    "unrounded_linear: weight must have shape (out, in) with in = x.size(-1) = ", x.size(-1),
                    "; got ", weight.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(x.scalar_type()), "unrounded_linear: x must be a floating tensor; got ",
                   x.scalar_type());
  TORCH_CHECK_TYPE(weight.scalar_type() == x.scalar_type(), "unrounded_linear: weight dtype (", weight.scalar_type(),
                   ") must match x's (", x.scalar_type(), ")");
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(0),
                      "unrounded_linear: bias must have shape (out,) = (", weight.size(0), ",); got ", bias->sizes());
    TORCH_CHECK_TYPE(bias->scalar_type() == x.scalar_type(), "unrounded_linear: bias dtype (", bias->scalar_type(),
                     ") must match x's (", x.scalar_type(), ")");
  }
}

}  // namespace

at::Tensor unrounded_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_unrounded(x, weight, bias);
  TORCH_CHECK_VALUE(x.device().is_cpu() && weight.device().is_cpu() && (!bias.has_value() || bias->device().is_cpu()),
                    "unrounded_linear takes CPU tensors; got x on ", x.device(), " and weight on ", weight.device());
  const auto dtype = x.scalar_type();
  if (sum_type(dtype) == dtype) {  // float32 / float64: the sums are the dtype's own
    return x.numel() / std::max<int64_t>(1, x.size(-1)) <= kFewRows ? few_rows_linear_cpu(x, weight, bias)
                                                                     : at::linear(x, weight, bias);
  }
  const int64_t in = x.size(-1), out_features = weight.size(0);
  const int64_t rows = in == 0 ? x.numel() : x.numel() / in;
  auto sizes = x.sizes().vec();
  sizes.back() = out_features;
  at::Tensor y = at::empty(sizes, x.options().dtype(at::kFloat));  // (..., out)
  if (y.numel() == 0) {
    return y;
  }
  if (in == 0) {  // an empty sum: the bias, or 0
    return bias.has_value() ? y.copy_(bias->expand(sizes)) : y.zero_();
  }
  const auto x2 = x.reshape({rows, in}).contiguous();  // (rows, in)
  if (rows <= kStreamRows) {  // a decode step's few rows: the weight streamed (FewRowsProduct)
    AT_DISPATCH_REDUCED_FLOATING_TYPES(dtype, "unrounded_linear", [&] {
      FewRowsProduct<scalar_t>(x2, weight, bias).all(y.data_ptr<float>(), out_features);
    });
    return y;
  }
  widened_blocks(x2, weight.t(), bias, y.view({rows, out_features}));
  return y;
}

at::Tensor unrounded_linear_meta(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_unrounded(x, weight, bias);
  auto sizes = x.sym_sizes().vec();
  sizes.back() = weight.sym_size(0);
  return at::empty_symint(sizes, x.options().dtype(sum_type(x.scalar_type())));
}

}  // namespace kernels

at::Tensor unrounded_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const std::optional<at::Tensor> b = bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt;
  const bool grad = at::GradMode::is_enabled() &&
                    (x.requires_grad() || weight.requires_grad() || (bias.defined() && bias.requires_grad()));
  if (!grad && x.device().is_cpu() && weight.device().is_cpu() && (!bias.defined() || bias.device().is_cpu())) {
    return kernels::unrounded_linear_cpu(x, weight, b);
  }
  // Differentiable (or another device): the same sums by at::linear on the exact widenings.
  const auto dtype = kernels::sum_type(x.scalar_type());
  return at::linear(x.to(dtype), weight.to(dtype), bias.defined() ? std::optional<at::Tensor>(bias.to(dtype)) : b);
}

}  // namespace causal_attention
