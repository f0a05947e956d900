// Small helpers shared by the fused kernels (flash.cpp, decode.cpp): workspace views and the
// precision rule of the tile products.
//
// Precision: every tile product is computed and accumulated in acc_t (float32 for bfloat16/half
// inputs, else the input type). bfloat16/half operands are widened to float32 exactly, so a
// product of widened operands summed in float32 is what a product in the input type with float32
// accumulation computes; intermediate operands (P, dS) are rounded to the input type first.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace causal_attention::kernels {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A (rows, cols) matrix view of a flat workspace.
inline at::Tensor tile(const at::Tensor& workspace, int64_t rows, int64_t cols) {
  return workspace.narrow(0, 0, rows * cols).view({rows, cols});
}

// The operand of a tile product in acc_t: x itself for float/double, bfloat16/half widened to float32.
inline at::Tensor widened(const at::Tensor& x) {
  return at::isReducedFloatingType(x.scalar_type()) ? x.to(at::kFloat) : x;
}

// acc (a.size(0) x b.size(1), leading dimension ld, in a's dtype) += a @ b, straight into acc.
inline void accumulate_product(void* acc, int64_t ld, const at::Tensor& a, const at::Tensor& b) {
  at::Tensor out = at::from_blob(acc, {a.size(0), b.size(1)}, {ld, 1}, a.options());
  at::addmm_out(out, out, a, b);
}

}  // namespace causal_attention::kernels
