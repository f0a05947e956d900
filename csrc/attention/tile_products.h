// The tile products shared by the fused kernels (flash.cpp, decode.cpp), on raw pointers.
//
// Precision: every tile product is computed and accumulated in acc_t (float32 for bfloat16/half
// inputs, else the input type): products of two values of the input type, summed in float32, which
// is what a product in the input type with float32 accumulation computes. Intermediate operands
// (P, dS) are rounded to the input type first (input_operand).
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include <cstdint>
#include <type_traits>

#include "blas.h"
#include "tile_ops.h"

namespace causal_attention::kernels {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// x (B, T, C) with rows that BLAS can read by a leading dimension: the last dimension dense and
// rows at least C apart. A view whose rows overlap (T expanded: stride 0) is materialised.
inline at::Tensor blas_rows(const at::Tensor& x) {
  const bool ok = x.stride(-1) == 1 && (x.size(1) <= 1 || x.stride(1) >= x.size(2));
  return ok ? x : x.contiguous();
}

// The leading dimension of blas_rows(x)'s rows. With one row its stride is arbitrary (PyTorch
// ignores the strides of size-1 dimensions), but BLAS checks ld >= the row length all the same.
inline int64_t row_stride(const at::Tensor& x) { return x.size(1) == 1 ? x.size(2) : x.stride(1); }

// bfloat16 / half inputs: every tile product is computed and accumulated in float32.
template <typename scalar_t>
constexpr bool kReduced = !std::is_same_v<scalar_t, at::opmath_type<scalar_t>>;

// Whether the AVX512-BF16 score micro-kernel runs (bfloat16 on a CPU that has it, even head_dim).
template <typename scalar_t>
bool use_bf16_scores(int64_t hd) {
  return tile::tile_ops<scalar_t>().bf16_scores != nullptr && hd % 2 == 0;
}

// s (rows x cols, acc_t, ld_s) = a . b^T, a: rows x hd (ld_a), b: cols x hd (ld_b), both in the input
// type; bfloat16 on a CPU with AVX512-BF16 by the vdpbf16ps micro-kernel (pack: its scratch, else
// nullptr).
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void score_product(const scalar_t* a, int64_t ld_a, const scalar_t* b, int64_t ld_b, int64_t rows, int64_t cols,
                   int64_t hd, acc_t* s, int64_t ld_s, uint32_t* pack) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (pack != nullptr) {
      tile::tile_ops<scalar_t>().bf16_scores(a, ld_a, b, ld_b, rows, cols, hd, s, ld_s, pack);
      return;
    }
  }
  blas::gemm(false, true, rows, cols, hd, acc_t(1), a, ld_a, b, ld_b, acc_t(0), s, ld_s);
}

// x (rows x cols, acc_t, ld) as the operand of a product in the input type: x itself for float and
// double; for bfloat16 / half, x rounded into buf (the same layout).
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
const scalar_t* input_operand(const acc_t* x, [[maybe_unused]] scalar_t* buf, [[maybe_unused]] int64_t ld,
                              [[maybe_unused]] int64_t rows, [[maybe_unused]] int64_t cols) {
  if constexpr (kReduced<scalar_t>) {
    tile::tile_ops<scalar_t>().store(x, ld, rows, cols, buf, ld);
    return buf;
  } else {
    return x;
  }
}

}  // namespace causal_attention::kernels
