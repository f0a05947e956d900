// A linear layer on a few rows (a decode step's projections): memory bound, so the weight is
// streamed from memory once, 3 rows at a time, while every input row passes over them (tile_ops'
// linear_rows, which prefetches the rows ahead); BLAS routines stream it slower at so few rows.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include "causal_attention/attention.h"
#include "linear/few_rows.h"

namespace causal_attention::kernels {
namespace {

void check_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(x.dim() >= 1, "few_rows_linear: x must have at least one dimension (..., in); got a scalar");
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) == x.size(-1),
                    "few_rows_linear: weight must have shape (out, in) with in = x.size(-1) = ", x.size(-1),
                    "; got ", weight.sizes());
  TORCH_CHECK_TYPE(weight.scalar_type() == x.scalar_type(), "few_rows_linear: weight dtype (", weight.scalar_type(),
                   ") must match x's (", x.scalar_type(), ")");
  TORCH_CHECK_VALUE(x.device().is_cpu() && weight.device().is_cpu(),
                    "few_rows_linear takes CPU tensors; got x on ", x.device(), " and weight on ", weight.device());
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(0),
                      "few_rows_linear: bias must have shape (out,) = (", weight.size(0), ",); got ", bias->sizes());
    TORCH_CHECK_TYPE(bias->scalar_type() == x.scalar_type(), "few_rows_linear: bias dtype (", bias->scalar_type(),
                     ") must match x's (", x.scalar_type(), ")");
    TORCH_CHECK_VALUE(bias->device().is_cpu(), "few_rows_linear takes CPU tensors; got bias on ", bias->device());
  }
}

}  // namespace

at::Tensor few_rows_linear_cpu(const at::Tensor& x, const at::Tensor& weight_in, const std::optional<at::Tensor>& bias_in) {
  check_linear(x, weight_in, bias_in);
  const int64_t in = x.size(-1);
  const int64_t out_features = weight_in.size(0);
  const int64_t rows = in == 0 ? x.numel() : x.numel() / in;
  auto sizes = x.sizes().vec();
  sizes.back() = out_features;
  auto y = at::empty(sizes, x.options());
  if (y.numel() == 0) {
    return y;
  }
  if (in == 0) {  // an empty sum: the bias, or 0
    return bias_in.has_value() ? y.copy_(bias_in->expand(sizes)) : y.zero_();
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "few_rows_linear", [&] {
    FewRowsProduct<scalar_t>(x.reshape({rows, in}), weight_in, bias_in).all(y.data_ptr<scalar_t>(), out_features);
  });
  return y;
}

}  // namespace causal_attention::kernels
