// The tile products shared by the fused kernels (flash.cpp, decode.cpp), on raw pointers.
//
// Precision: every tile product is computed and accumulated in acc_t (float32 for bfloat16/half
// inputs, else the input type): products of two values of the input type, summed in float32, which
// is what a product in the input type with float32 accumulation computes. Intermediate operands
// (P, dS) are rounded to the input type first (input_operand). bfloat16's pair micro-kernel (vdpbf16ps)
// treats subnormal bfloat16 operands (|x| < 1.2e-38) as 0 and flushes subnormal sums to 0, as the
// instruction does whatever MXCSR says: there, and only there, it differs from float32 sums.
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "blas.h"
#include "cpu/tile_ops.h"

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

// How the tile products of a call run.
enum class Products : uint8_t {
  kBlas,    // BLAS in the input type (double; CPUs without AVX2)
  kPanels,  // the float32 micro-kernel (tile_ops' panel_gemm); bfloat16 / half on operands widened exactly
  kPairs,   // bfloat16 on a CPU with AVX512-BF16 and an even head_dim: the pair micro-kernel (pair_gemm)
};

// Whether the tile products of scalar_t run on the float32 micro-kernel (tile_ops' panel_gemm, AVX2 and
// AVX512), bfloat16 and half on operands widened exactly to float32, rather than BLAS. Not for double.
template <typename scalar_t>
bool use_panel_gemm() {
  if constexpr (std::is_same_v<at::opmath_type<scalar_t>, float>) {
    return tile::tile_ops<float>().panel_gemm != nullptr && tile::tile_ops<scalar_t>().pack_panels != nullptr;
  } else {
    return false;
  }
}

// The products of a call with head_dim hd.
template <typename scalar_t>
Products products_for(int64_t hd) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (tile::tile_ops<scalar_t>().pair_gemm != nullptr && hd % 2 == 0) {
      return Products::kPairs;
    }
  }
  return use_panel_gemm<scalar_t>() ? Products::kPanels : Products::kBlas;
}

// An operand packed for a micro-kernel: a k x n matrix in panels of tile::kPanel columns, float32
// (pack_panels: data) or pairs of bfloat16 along k (pair_panels: pairs); both nullptr where the products
// go to BLAS (which reads operands in place).
template <typename acc_t>
struct Panels {
  const acc_t* data = nullptr;
  int64_t k = 0;  // rows packed: a product may use the first k' <= k of them (k' even, or k' = k, for pairs)
  const c10::BFloat16* pairs = nullptr;
};

// Values in the panels of a k x n operand: float32 ones, and bfloat16 pairs (2 ceil(k / 2) rows).
inline int64_t panels_size(int64_t k, int64_t n) { return ceil_div(n, tile::kPanel) * tile::kPanel * k; }
inline int64_t pair_panels_size(int64_t k, int64_t n) { return panels_size(2 * ceil_div(k, 2), n); }
// Values a packed k x n operand takes for the products (none for BLAS, which reads operands in place).
inline int64_t packed_size(Products products, int64_t k, int64_t n) {
  switch (products) {
    case Products::kPanels: return panels_size(k, n);
    case Products::kPairs: return pair_panels_size(k, n);
    case Products::kBlas: break;
  }
  return 0;
}
// The stride between panels of pairs of a k x n operand.
inline int64_t pair_panel_stride(int64_t k) { return 2 * ceil_div(k, 2) * tile::kPanel; }

// b (k x n, element (kk, j) = b[kk * rs + j * cs]) into dst (panels_size(k, n) values), widened to acc_t.
// Only where use_panel_gemm.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
Panels<acc_t> pack(const scalar_t* b, int64_t rs, int64_t cs, int64_t k, int64_t n, acc_t* dst) {
  tile::tile_ops<scalar_t>().pack_panels(b, rs, cs, k, n, dst);
  return {dst, k, nullptr};
}

// The same as pairs of bfloat16 along k into dst (pair_panels_size(k, n) values). Only for Products::kPairs.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
Panels<acc_t> pack_pairs(const scalar_t* b, int64_t rs, int64_t cs, int64_t k, int64_t n, scalar_t* dst) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    tile::tile_ops<scalar_t>().pair_panels(b, rs, cs, k, n, dst);
    return {nullptr, k, dst};
  } else {
    TORCH_INTERNAL_ASSERT(false, "pack_pairs: bfloat16 only");
    return {};
  }
}

// Packed b^T, b: cols x hd (ld_b): keys or values of a key block as the transposed operand of score
// products (k = hd, n = cols).
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
Panels<acc_t> pack_transposed(const scalar_t* b, int64_t ld_b, int64_t cols, int64_t hd, acc_t* dst) {
  return pack(b, 1, ld_b, hd, cols, dst);
}

// Packed b, b: k x n row-major (ld_b): values, keys, queries or dO as the right operand of row_product.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
Panels<acc_t> pack_rows(const scalar_t* b, int64_t ld_b, int64_t k, int64_t n, acc_t* dst) {
  return pack(b, ld_b, 1, k, n, dst);
}

// The scratch a packed operand lives in: float32 panels or bfloat16 pairs.
template <typename scalar_t>
struct PanelBuffer {
  std::vector<at::opmath_type<scalar_t>> wide;
  std::vector<scalar_t> pairs;
};

// v holding at least `size` elements: it only grows (a resize down and up again zeroed the regrown part
// at every smaller diagonal tile, 0.8% of the bfloat16 backward).
template <typename T>
T* at_least(std::vector<T>& v, int64_t size) {
  if (v.size() < static_cast<size_t>(size)) {
    v.resize(static_cast<size_t>(size));
  }
  return v.data();
}

// b packed into buf (grown to fit) for the products' micro-kernel; empty panels for BLAS.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
Panels<acc_t> pack_into(PanelBuffer<scalar_t>& buf, Products products, const scalar_t* b, int64_t rs, int64_t cs,
                        int64_t k, int64_t n) {
  switch (products) {
    case Products::kPanels:
      return pack(b, rs, cs, k, n, at_least(buf.wide, packed_size(products, k, n)));
    case Products::kPairs:
      return pack_pairs(b, rs, cs, k, n, at_least(buf.pairs, packed_size(products, k, n)));
    case Products::kBlas:
      break;
  }
  return {};
}

// b^T (b: cols x hd, ld_b) / b (k x n row-major, ld_b) packed into buf; empty panels for BLAS.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
Panels<acc_t> transposed_panels(const scalar_t* b, int64_t ld_b, int64_t cols, int64_t hd, PanelBuffer<scalar_t>& buf,
                                Products products) {
  return pack_into(buf, products, b, 1, ld_b, hd, cols);
}
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
Panels<acc_t> row_panels(const scalar_t* b, int64_t ld_b, int64_t k, int64_t n, PanelBuffer<scalar_t>& buf,
                         Products products) {
  return pack_into(buf, products, b, ld_b, 1, k, n);
}

// A left operand as pairs of bfloat16 along its k: pair (i, p) at x + i * rs + p * cs (pair_gemm's A).
struct PairView {
  const c10::BFloat16* x = nullptr;
  int64_t rs = 0, cs = 0;
};

// The left operand of a tile product (rows x cols): x in the input type (leading dimension ld) for BLAS;
// `wide` in acc_t (ld_wide) for the float32 micro-kernel: x itself for float, an exact widening for
// bfloat16 / half, nullptr where it does not run; for the pair micro-kernel, `pairs` as the operand itself
// (pairs along its columns) and `tpairs` as its transpose (pairs along its rows), each where a product
// reads it that way.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
struct Operand {
  const scalar_t* x;
  int64_t ld;
  const acc_t* wide;
  int64_t ld_wide;
  PairView pairs = {};
  PairView tpairs = {};
};

// Rows r0.. of an Operand (not of its transposed pairs).
template <typename scalar_t>
Operand<scalar_t> rows_from(const Operand<scalar_t>& a, int64_t r0) {
  TORCH_INTERNAL_ASSERT(a.tpairs.x == nullptr, "rows_from: an operand read transposed");
  return {a.x == nullptr ? nullptr : a.x + r0 * a.ld,
          a.ld,
          a.wide == nullptr ? nullptr : a.wide + r0 * a.ld_wide,
          a.ld_wide,
          {a.pairs.x == nullptr ? nullptr : a.pairs.x + r0 * a.pairs.rs, a.pairs.rs, a.pairs.cs},
          {}};
}

// x (rows x cols, ld) of the input type as an Operand: for the float32 micro-kernel widened into buf
// (grown to fit) for bfloat16 / half; for the pair micro-kernel read in place (cols even, as head_dim is
// there).
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
Operand<scalar_t> operand(const scalar_t* x, int64_t ld, int64_t rows, int64_t cols, Products products,
                          std::vector<acc_t>& buf) {
  if (products == Products::kPairs) {
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      TORCH_INTERNAL_ASSERT(cols % 2 == 0, "operand: pairs along an odd number of columns");
      return {x, ld, nullptr, 0, {x, ld, 2}, {}};
    }
  }
  if (products != Products::kPanels) {
    return {x, ld, nullptr, 0};
  }
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return {x, ld, x, ld};
  } else {
    acc_t* wide = at_least(buf, rows * cols);
    tile::tile_ops<scalar_t>().widen(x, ld, rows, cols, wide, cols);
    return {x, ld, wide, cols};
  }
}

// Where the forms of a tile (P, dS) that the pair micro-kernel reads are written: as pairs along its
// rows' columns (`rows`, rows x even(cols) values) and transposed (`transposed`, ceil(rows / 2) x 2 cols
// values); nullptr for a form no product reads.
template <typename scalar_t>
struct PairScratch {
  scalar_t* rows = nullptr;
  scalar_t* transposed = nullptr;
};

// The leading dimension of a tile of `cols` columns written as pairs along its rows: even.
inline int64_t pair_row_ld(int64_t cols) { return 2 * ceil_div(cols, 2); }

// A tile of `cols` columns (P or dS) as the pair micro-kernel reads it: its rows at x (ld
// pair_row_ld(cols)), and its transpose in round_pairs_transposed's layout at x (ld 2 cols).
inline PairView pair_rows_view(const c10::BFloat16* x, int64_t cols) { return {x, pair_row_ld(cols), 2}; }
inline PairView transposed_pairs_view(const c10::BFloat16* x, int64_t cols) { return {x, 2, 2 * cols}; }

// rows x cols values of the input type at x (ld pair_row_ld(cols)) as the pair micro-kernel's operand,
// pairs along its columns; the pad column of an odd cols is zeroed here.
inline Operand<c10::BFloat16> pair_rows_operand(c10::BFloat16* x, int64_t rows, int64_t cols) {
  const int64_t ld = pair_row_ld(cols);
  if (cols % 2 != 0) {
    for (int64_t i = 0; i < rows; ++i) {
      x[i * ld + cols] = c10::BFloat16(0.0f);
    }
  }
  return {nullptr, ld, nullptr, 0, pair_rows_view(x, cols), {}};
}

// x (rows x cols, acc_t, ld: P or dS) as the operand of a product in the input type: x itself for
// float and double; for bfloat16 / half, x rounded to the input type: into buf for BLAS; for the float32
// micro-kernel rounded and widened back into wide_buf; for the pair micro-kernel into the forms of
// `pairs` asked for (x is left as it is).
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
Operand<scalar_t> input_operand(const acc_t* x, [[maybe_unused]] scalar_t* buf, [[maybe_unused]] acc_t* wide_buf,
                                int64_t ld, [[maybe_unused]] int64_t rows, [[maybe_unused]] int64_t cols,
                                Products products, [[maybe_unused]] const PairScratch<scalar_t>& pairs = {}) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (products == Products::kPairs) {
      const auto& ops = tile::tile_ops<scalar_t>();
      Operand<scalar_t> a{nullptr, ld, nullptr, 0};
      if (pairs.rows != nullptr) {
        ops.store(x, ld, rows, cols, pairs.rows, pair_row_ld(cols));
        a.pairs = pair_rows_operand(pairs.rows, rows, cols).pairs;
      }
      if (pairs.transposed != nullptr) {
        ops.round_pairs_transposed(x, ld, rows, cols, pairs.transposed, 2 * cols);
        a.tpairs = transposed_pairs_view(pairs.transposed, cols);
      }
      return a;
    }
  }
  if constexpr (kReduced<scalar_t>) {
    if (products == Products::kPanels) {
      tile::tile_ops<scalar_t>().round_to_input(x, ld, rows, cols, wide_buf, ld);
      return {nullptr, ld, wide_buf, ld};
    }
    tile::tile_ops<scalar_t>().store(x, ld, rows, cols, buf, ld);
    return {buf, ld, nullptr, 0};
  } else {
    return {x, ld, products == Products::kPanels ? x : nullptr, ld};
  }
}

// s (rows x cols, acc_t, ld_s) = a . b^T, a: rows x hd, b: cols x hd (ld_b), both in the input type:
// on a micro-kernel from b's transposed_panels (when packed; the first cols keys of them) and a.wide or
// a.pairs; else BLAS.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void score_product(const Operand<scalar_t>& a, const scalar_t* b, int64_t ld_b, int64_t rows, int64_t cols,
                   int64_t hd, acc_t* s, int64_t ld_s, const Panels<acc_t>& panels = {}) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (panels.pairs != nullptr) {
      TORCH_INTERNAL_ASSERT(a.pairs.x != nullptr && panels.k == hd, "score_product: pairs need the operand's pairs");
      tile::tile_ops<scalar_t>().pair_gemm(rows, cols, ceil_div(hd, 2), a.pairs.x, a.pairs.rs, a.pairs.cs,
                                           panels.pairs, pair_panel_stride(hd), false, s, ld_s);
      return;
    }
  }
  if constexpr (std::is_same_v<acc_t, float>) {
    if (panels.data != nullptr) {
      TORCH_INTERNAL_ASSERT(a.wide != nullptr, "score_product: packed keys need the query operand in float32");
      tile::tile_ops<float>().panel_gemm(rows, cols, hd, tile::kScoreSumBlock, a.wide, a.ld_wide, 1, panels.data,
                                         tile::kPanel, panels.k * tile::kPanel, false, s, ld_s);
      return;
    }
  }
  TORCH_INTERNAL_ASSERT(a.x != nullptr, "score_product: BLAS needs the operand in the input type");
  blas::gemm(false, true, rows, cols, hd, acc_t(1), a.x, a.ld, b, ld_b, acc_t(0), s, ld_s);
}

// Products whose columns are the head (P V, P^T dO, dS K, dS^T Q) sum keys or queries, up to a block of
// them, in one chain of fused multiply-adds per output. For a head narrower than a panel BLAS sums in
// many lanes and one chain drifts further; dS = P (dP - dO . O) turns the drift of O into a bias of dK
// and dQ. Such products (half precision only: float32 narrow heads run in float64) are summed in blocks
// of kNarrowSumBlock (panel_gemm's sum_block). Wide products stay one chain, as BLAS's.
inline constexpr int64_t kNarrowSumBlock = 8;

// c (m x n, acc_t, ldc) = op(a) . b, or c += op(a) . b when accumulate. op(a) is m x k (a stored k x m
// when trans_a, its leading dimensions either way); b is k x n row-major (ld_b): values, keys, queries
// or dO, on a micro-kernel from its row_panels (when packed: the first k rows of them), else BLAS.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void row_product(bool trans_a, int64_t m, int64_t n, int64_t k, const Operand<scalar_t>& a, const scalar_t* b,
                 int64_t ld_b, const Panels<acc_t>& panels, bool accumulate, acc_t* c, int64_t ldc) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (panels.pairs != nullptr) {
      const PairView& view = trans_a ? a.tpairs : a.pairs;
      // An odd k short of the packed rows would pair its last value with the next row's.
      TORCH_INTERNAL_ASSERT(view.x != nullptr && (k == panels.k || (k % 2 == 0 && k <= panels.k)),
                            "row_product: pairs need the operand's pairs and k even or all the packed rows");
      tile::tile_ops<scalar_t>().pair_gemm(m, n, ceil_div(k, 2), view.x, view.rs, view.cs, panels.pairs,
                                           pair_panel_stride(panels.k), accumulate, c, ldc);
      return;
    }
  }
  if constexpr (std::is_same_v<acc_t, float>) {
    if (panels.data != nullptr) {
      TORCH_INTERNAL_ASSERT(a.wide != nullptr, "row_product: packed panels need the left operand in float32");
      const int64_t rs_a = trans_a ? 1 : a.ld_wide, cs_a = trans_a ? a.ld_wide : 1;
      tile::tile_ops<float>().panel_gemm(m, n, k, n < tile::kPanel ? kNarrowSumBlock : 0, a.wide, rs_a, cs_a,
                                         panels.data, tile::kPanel, panels.k * tile::kPanel, accumulate, c, ldc);
      return;
    }
  }
  TORCH_INTERNAL_ASSERT(a.x != nullptr, "row_product: BLAS needs the left operand in the input type");
  blas::gemm(trans_a, false, m, n, k, acc_t(1), a.x, a.ld, b, ld_b, accumulate ? acc_t(1) : acc_t(0), c, ldc);
}

// ---- Masked keys that hold NaN or inf ----------------------------------------------------------

// Whether every one of the n values at x is finite: the exponent bits of each, OR-ed (vectorised).
template <typename acc_t>
bool all_finite(const acc_t* x, int64_t n) {
  using Bits = std::conditional_t<sizeof(acc_t) == 4, uint32_t, uint64_t>;
  constexpr Bits kExponent = static_cast<Bits>(sizeof(acc_t) == 4 ? 0x7f800000ull : 0x7ff0000000000000ull);
  Bits bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    Bits bits;
    std::memcpy(&bits, x + i, sizeof(bits));
    bad |= static_cast<Bits>((bits & kExponent) == kExponent);
  }
  return bad == 0;
}

// Element (i, j) of a product's left operand, as the product reads it.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
acc_t operand_at(const Operand<scalar_t>& a, int64_t i, int64_t j) {
  if (a.wide != nullptr) {
    return a.wide[i * a.ld_wide + j];
  }
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (a.pairs.x != nullptr) {  // pairs along the row: element j at j
      return static_cast<acc_t>(a.pairs.x[i * a.pairs.rs + j]);
    }
  }
  return static_cast<acc_t>(a.x[i * a.ld + j]);
}

// A product P V sums every key of the tile for every row, so a key that a row may not see (later, or
// padding: P = 0 there) still adds 0 * v, which is NaN where v is NaN or inf: a later position's NaN
// reached earlier rows. Rows of pv (n x hd) that came out non-finite are summed again over the keys the
// row may see only (row i: window_first + i <= j <= i + causal_offset, key_mask[j] where given), in k order
// with fused multiply-adds (the micro-kernel's order). Only tiles with masked entries can have such keys.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void exclude_masked_values(const Operand<scalar_t>& p, const scalar_t* v, int64_t ld_v, int64_t n, int64_t cols,
                           int64_t hd, int64_t causal_offset, int64_t window_first, const bool* key_mask, acc_t* pv) {
  for (int64_t i = 0; i < n; ++i) {
    acc_t* row = pv + i * hd;
    if (all_finite(row, hd)) {
      continue;
    }
    std::fill(row, row + hd, acc_t(0));
    const int64_t seen = std::clamp<int64_t>(i + causal_offset + 1, 0, cols);
    for (int64_t j = std::clamp<int64_t>(window_first + i, 0, cols); j < seen; ++j) {
      if (key_mask != nullptr && !key_mask[j]) {
        continue;
      }
      const acc_t w = operand_at(p, i, j);
      const scalar_t* vj = v + j * ld_v;
      for (int64_t d = 0; d < hd; ++d) {
        row[d] = std::fma(w, static_cast<acc_t>(vj[d]), row[d]);
      }
    }
  }
}

}  // namespace causal_attention::kernels
