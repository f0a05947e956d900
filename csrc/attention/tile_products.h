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
#include <algorithm>
#include <type_traits>
#include <vector>

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

// Whether the tile products of scalar_t run on the float32 micro-kernel (tile_ops' panel_gemm, AVX2),
// bfloat16 and half on operands widened exactly to float32, rather than BLAS. Not for double.
template <typename scalar_t>
bool use_panel_gemm() {
  if constexpr (std::is_same_v<at::opmath_type<scalar_t>, float>) {
    return tile::tile_ops<float>().panel_gemm != nullptr && tile::tile_ops<scalar_t>().pack_panels != nullptr;
  } else {
    return false;
  }
}

// An operand packed for the micro-kernel (tile_ops' pack_panels): a k x n matrix in panels of
// tile::kPanel columns; data == nullptr where the products go to BLAS (which reads operands in place).
template <typename acc_t>
struct Panels {
  const acc_t* data = nullptr;
  int64_t k = 0;  // rows packed: a product may use the first k' <= k of them
};

// Values in the panels of a k x n operand.
inline int64_t panels_size(int64_t k, int64_t n) { return ceil_div(n, tile::kPanel) * tile::kPanel * k; }

// b (k x n, element (kk, j) = b[kk * rs + j * cs]) into dst (panels_size(k, n) values), widened to acc_t.
// Only where use_panel_gemm.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
Panels<acc_t> pack(const scalar_t* b, int64_t rs, int64_t cs, int64_t k, int64_t n, acc_t* dst) {
  tile::tile_ops<scalar_t>().pack_panels(b, rs, cs, k, n, dst);
  return {dst, k};
}

// b^T into dst, b: cols x hd (ld_b): keys or values of a key block as the transposed operand of score
// products (k = hd, n = cols).
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
Panels<acc_t> pack_transposed(const scalar_t* b, int64_t ld_b, int64_t cols, int64_t hd, acc_t* dst) {
  return pack(b, 1, ld_b, hd, cols, dst);
}

// b into dst, b: k x n row-major (ld_b): values, keys, queries or dO as the right operand of row_product.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
Panels<acc_t> pack_rows(const scalar_t* b, int64_t ld_b, int64_t k, int64_t n, acc_t* dst) {
  return pack(b, ld_b, 1, k, n, dst);
}

// pack into buf (resized to fit) where the micro-kernel runs; else empty panels.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
Panels<acc_t> pack_into(std::vector<acc_t>& buf, const scalar_t* b, int64_t rs, int64_t cs, int64_t k, int64_t n) {
  if (!use_panel_gemm<scalar_t>()) {
    return {};
  }
  buf.resize(static_cast<size_t>(panels_size(k, n)));
  return pack(b, rs, cs, k, n, buf.data());
}

// pack_transposed / pack_rows into buf where the micro-kernel runs; else empty panels.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
Panels<acc_t> transposed_panels(const scalar_t* b, int64_t ld_b, int64_t cols, int64_t hd, std::vector<acc_t>& buf) {
  return pack_into(buf, b, 1, ld_b, hd, cols);
}
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
Panels<acc_t> row_panels(const scalar_t* b, int64_t ld_b, int64_t k, int64_t n, std::vector<acc_t>& buf) {
  return pack_into(buf, b, ld_b, 1, k, n);
}

// The left operand of a tile product (rows x cols): x in the input type (leading dimension ld) for BLAS
// and the bfloat16 kernel; `wide` in acc_t (ld_wide) for the micro-kernel: x itself for float, an exact
// widening for bfloat16 / half, nullptr where the micro-kernel does not run.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
struct Operand {
  const scalar_t* x;
  int64_t ld;
  const acc_t* wide;
  int64_t ld_wide;
};

// Rows r0.. of an Operand.
template <typename scalar_t>
Operand<scalar_t> rows_from(const Operand<scalar_t>& a, int64_t r0) {
  return {a.x == nullptr ? nullptr : a.x + r0 * a.ld, a.ld, a.wide == nullptr ? nullptr : a.wide + r0 * a.ld_wide,
          a.ld_wide};
}

// x (rows x cols, ld) of the input type as an Operand, for the micro-kernel when panels (then widened
// into buf, resized to fit, for bfloat16 / half).
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
Operand<scalar_t> operand(const scalar_t* x, int64_t ld, int64_t rows, int64_t cols, bool panels,
                          std::vector<acc_t>& buf) {
  if (!panels) {
    return {x, ld, nullptr, 0};
  }
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return {x, ld, x, ld};
  } else {
    buf.resize(static_cast<size_t>(rows * cols));
    tile::tile_ops<scalar_t>().widen(x, ld, rows, cols, buf.data(), cols);
    return {x, ld, buf.data(), cols};
  }
}

// x (rows x cols, acc_t, ld: P or dS) as the operand of a product in the input type: x itself for
// float and double; for bfloat16 / half, x rounded to the input type, into buf for BLAS or, for the
// micro-kernel (panels), rounded and widened back into wide_buf (x is left as it is).
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
Operand<scalar_t> input_operand(const acc_t* x, [[maybe_unused]] scalar_t* buf, [[maybe_unused]] acc_t* wide_buf,
                                int64_t ld, [[maybe_unused]] int64_t rows, [[maybe_unused]] int64_t cols,
                                bool panels) {
  if constexpr (kReduced<scalar_t>) {
    if (panels) {
      tile::tile_ops<scalar_t>().round_to_input(x, ld, rows, cols, wide_buf, ld);
      return {nullptr, ld, wide_buf, ld};
    }
    tile::tile_ops<scalar_t>().store(x, ld, rows, cols, buf, ld);
    return {buf, ld, nullptr, 0};
  } else {
    return {x, ld, panels ? x : nullptr, ld};
  }
}

// s (rows x cols, acc_t, ld_s) = a . b^T, a: rows x hd, b: cols x hd (ld_b), both in the input type:
// on the micro-kernel from b's transposed_panels (when packed; the first cols keys of them) and a.wide;
// bfloat16 on a CPU with AVX512-BF16 by the vdpbf16ps micro-kernel (pack: its scratch, else nullptr);
// else BLAS.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void score_product(const Operand<scalar_t>& a, const scalar_t* b, int64_t ld_b, int64_t rows, int64_t cols,
                   int64_t hd, acc_t* s, int64_t ld_s, uint32_t* pack, const Panels<acc_t>& panels = {}) {
  if constexpr (std::is_same_v<acc_t, float>) {
    if (panels.data != nullptr) {
      TORCH_INTERNAL_ASSERT(a.wide != nullptr, "score_product: packed keys need the query operand in float32");
      tile::tile_ops<float>().panel_gemm(rows, cols, hd, a.wide, a.ld_wide, 1, panels.data, tile::kPanel,
                                         panels.k * tile::kPanel, false, s, ld_s);
      return;
    }
  }
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (pack != nullptr) {
      TORCH_INTERNAL_ASSERT(a.x != nullptr, "score_product: the bfloat16 kernel needs the operand in bfloat16");
      tile::tile_ops<scalar_t>().bf16_scores(a.x, a.ld, b, ld_b, rows, cols, hd, s, ld_s, pack);
      return;
    }
  }
  TORCH_INTERNAL_ASSERT(a.x != nullptr, "score_product: BLAS needs the operand in the input type");
  blas::gemm(false, true, rows, cols, hd, acc_t(1), a.x, a.ld, b, ld_b, acc_t(0), s, ld_s);
}

// c (m x n, acc_t, ldc) = op(a) . b, or c += op(a) . b when accumulate. op(a) is m x k (a stored k x m
// when trans_a, its leading dimensions either way); b is k x n row-major (ld_b): values, keys, queries
// or dO, on the micro-kernel from its row_panels (when packed: the first k rows of them), else BLAS.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void row_product(bool trans_a, int64_t m, int64_t n, int64_t k, const Operand<scalar_t>& a, const scalar_t* b,
                 int64_t ld_b, const Panels<acc_t>& panels, bool accumulate, acc_t* c, int64_t ldc) {
  if constexpr (std::is_same_v<acc_t, float>) {
    if (panels.data != nullptr) {
      TORCH_INTERNAL_ASSERT(a.wide != nullptr, "row_product: packed panels need the left operand in float32");
      tile::tile_ops<float>().panel_gemm(m, n, k, a.wide, trans_a ? 1 : a.ld_wide, trans_a ? a.ld_wide : 1,
                                         panels.data, tile::kPanel, panels.k * tile::kPanel, accumulate, c, ldc);
      return;
    }
  }
  TORCH_INTERNAL_ASSERT(a.x != nullptr, "row_product: BLAS needs the left operand in the input type");
  blas::gemm(trans_a, false, m, n, k, acc_t(1), a.x, a.ld, b, ld_b, accumulate ? acc_t(1) : acc_t(0), c, ldc);
}

}  // namespace causal_attention::kernels
