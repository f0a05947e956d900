// The table of per-instruction-set kernels: the element-wise work on attention tiles (online softmax,
// rescaling, the backward's probabilities and score gradients), dropout, the decode kernel, the
// few-rows linear kernel, the widening GEMM of half projections and the micro-kernels of the tile
// products (tile_products.h).
//
// Each family is one file compiled once per instruction set (DEFAULT, AVX2, AVX512; cpu/families.h),
// and the table is chosen at run time from ATen's CPU capability, as ATen's own kernels are; the
// environment variable ATEN_CPU_CAPABILITY=default|avx2|avx512 forces a lower one.
//
// Conventions: a tile has `rows` queries and `cols` keys, row-major with leading dimension `ld`.
// acc_t is float for float/bfloat16/half inputs and double for double.
// Row i of a tile may attend columns j <= i + causal_offset (pass kNoCausal for no limit) whose
// key_mask entry is true (key_mask == nullptr: all keys real).
#pragma once

#include <ATen/OpMathType.h>
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <limits>

#include "attention/philox.h"

namespace causal_attention::tile {

inline constexpr int64_t kNoCausal = std::numeric_limits<int64_t>::max() / 2;

// Columns per panel of panel_gemm's B operand.
inline constexpr int64_t kPanel = 16;

// The most values of k per packed block of widened_gemm's B (the size of its pack).
inline constexpr int64_t kWidenedDepth = 1024;
// decode_chunk's rows per pass over the keys and values.
inline constexpr int64_t kDecodeGroupRows = 4;

// Products over the head (scores q . k, the backward's dP = dO . v) sum it in blocks of this many
// values, each from 0, the block sums added in order: a chain over a whole head of 48 or 64 values
// drifts about 1.5x further from the exact score than BLAS's small-matrix kernels, and a nearly
// one-hot softmax passes that drift on to the output and every gradient.
inline constexpr int64_t kScoreSumBlock = 16;

// A float32 head narrower than a panel sums each output over one or a few lanes, further from exact
// than BLAS's many; dS = P (dP - dO . O) turns the forward's drift into a bias of dK and dQ that weight
// gradients sum over T. Such heads are cheap: float32 computes them in float64 and keeps lse in float64.
inline bool computes_in_float64(c10::ScalarType dtype, int64_t head_dim) {
  return dtype == c10::ScalarType::Float && head_dim < kPanel;
}

template <typename scalar_t>
struct TileOps {
  using acc_t = at::opmath_type<scalar_t>;

  // Forward, one key tile. In: s = raw scores q.k. Out: s = exp(scale * s - m_new) for allowed
  // entries, 0 elsewhere. Updates the running max m and sum l of each row and writes the factor
  // alpha = exp(m_old - m_new) that rescales the row's accumulated output. buf: >= cols scratch.
  void (*softmax_tile)(scalar_t* s, int64_t ld, int64_t rows, int64_t cols, acc_t scale, int64_t causal_offset,
                       const bool* key_mask, acc_t* m, acc_t* l, acc_t* alpha, acc_t* buf);

  // Where pair_gemm runs: softmax_tile on float32 scores s whose P is written rounded to bfloat16 at p
  // (rows x cols, ld_p) instead of in place (s is left as scratch): the forward's P for the pair
  // micro-kernel, rounded as it is made rather than in a pass of its own. The same m, l, alpha as
  // softmax_tile, and its P rounded as vcvtneps2bf16 rounds: to nearest even as ATen rounds, but a
  // float32 denormal to a zero of its sign (which vdpbf16ps reads as ATen's bfloat16 denormal anyway).
  void (*softmax_tile_rounded)(acc_t* s, int64_t ld, int64_t rows, int64_t cols, acc_t scale, int64_t causal_offset,
                               const bool* key_mask, acc_t* m, acc_t* l, acc_t* alpha, scalar_t* p, int64_t ld_p);

  // acc[i, :] = acc[i, :] * alpha[i] + x[i, :]   (acc: rows x cols, ld_acc; x: ld_x)
  void (*rescale_add)(acc_t* acc, int64_t ld_acc, const scalar_t* x, int64_t ld_x, int64_t rows, int64_t cols,
                      const acc_t* alpha);

  // acc[i, :] += x[i, :]
  void (*add)(acc_t* acc, int64_t ld_acc, const scalar_t* x, int64_t ld_x, int64_t rows, int64_t cols);

  // Forward epilogue: out[i, :] = acc[i, :] / l[i] and lse[i] = m[i] + log(l[i]); a row with no
  // allowed key (l = 0) gets out = 0 and lse = +inf, so that the backward's probabilities are 0.
  void (*finalize)(const acc_t* acc, int64_t ld_acc, int64_t rows, int64_t cols, const acc_t* m, const acc_t* l,
                   scalar_t* out, int64_t ld_out, acc_t* lse);

  // out[i, :] = x[i, :]   (widening to acc_t, exact)
  void (*widen)(const scalar_t* x, int64_t ld_x, int64_t rows, int64_t cols, acc_t* out, int64_t ld_out);

  // out[i, :] = acc[i, :]   (conversion to the output dtype)
  void (*store)(const acc_t* acc, int64_t ld_acc, int64_t rows, int64_t cols, scalar_t* out, int64_t ld_out);

  // Backward. In: s = raw scores. Out: s = exp(scale * s - lse[i]) where allowed, 0 elsewhere.
  void (*probabilities)(scalar_t* s, int64_t ld, int64_t rows, int64_t cols, acc_t scale, int64_t causal_offset,
                        const bool* key_mask, const acc_t* lse);

  // Decode, one chunk of n cached keys for a few query rows (q: rows x hd, acc_t, contiguous, values of
  // scalar_t widened): row i sees keys j <= i + causal_offset; updates its running max m, sum l and
  // output o (hd), reading each key and value row once for a group of up to kDecodeGroupRows rows (where
  // the ISA has the blocked kernels; once per row elsewhere). bfloat16 on AVX512-BF16 (hd 32, 64, 96,
  // 128) weighs the values with the probabilities rounded to bfloat16, as the tiled kernel's pairs do.
  // buf: >= kDecodeGroupRows * n scratch.
  void (*decode_chunk)(const acc_t* q, int64_t rows, const scalar_t* k, const scalar_t* v, int64_t ld, int64_t n,
                       int64_t hd, acc_t scale, int64_t causal_offset, acc_t* m, acc_t* l, acc_t* o, acc_t* buf);

  // A linear layer on a few rows (a decode step): y[m * ld_y + o] = x[m, :] . w[o, :] (+ bias[o]) for
  // m < rows and o0 <= o < o1. x: rows x in, acc_t, contiguous (bfloat16/half inputs widened by the
  // caller); w: out x in, contiguous, its rows o0..o1 streamed from memory once (3 at a time stay in
  // L1 while every x row passes, 8 x rows per pass on AVX-512 and 4 elsewhere; the rows about 48 KB
  // further on, up to o1, prefetched into L2 meanwhile); bias: nullptr or out values. Sums in acc_t,
  // one rounding to the output.
  void (*linear_rows)(const acc_t* x, int64_t rows, int64_t in, const scalar_t* w, const scalar_t* bias, int64_t o0,
                      int64_t o1, scalar_t* y, int64_t ld_y);

  // bfloat16 only, where the CPU has AVX512-BF16 (else nullptr): linear_rows with x as bfloat16 rows
  // (rows x in, contiguous) and the products summed pair by pair with vdpbf16ps (each pair's two products
  // exact in float32; subnormal bfloat16 operands read as 0 and subnormal sums flushed to 0, as in
  // pair_gemm).
  void (*linear_rows_pairs)(const scalar_t* x, int64_t rows, int64_t in, const scalar_t* w, const scalar_t* bias,
                            int64_t o0, int64_t o1, scalar_t* y, int64_t ld_y);
  // linear_rows and linear_rows_pairs with the sums returned unrounded, in acc_t (float32 logits of a
  // half model; the same sums, so rounding them to scalar_t gives linear_rows' bits).
  void (*linear_rows_acc)(const acc_t* x, int64_t rows, int64_t in, const scalar_t* w, const scalar_t* bias,
                          int64_t o0, int64_t o1, acc_t* y, int64_t ld_y);
  void (*linear_rows_pairs_acc)(const scalar_t* x, int64_t rows, int64_t in, const scalar_t* w,
                                const scalar_t* bias, int64_t o0, int64_t o1, acc_t* y, int64_t ld_y);

  // Rotary positions, rotate-half: out[r] = x[r] (rows x width, contiguous) with each of its first `rotated`
  // values' heads of hd rotated by row r of c and s (rows x hd): x c + rotate_half(x) s, each product rounded
  // to scalar_t, then the sum (ATen's bits); the rest of the row copied.
  void (*rotary_rows)(const scalar_t* x, const scalar_t* c, const scalar_t* s, scalar_t* out, int64_t rows,
                      int64_t width, int64_t rotated, int64_t hd);

  // bfloat16 only, where the CPU has AVX512-BF16 (else nullptr): the pair micro-kernel. C (m x n,
  // float32, ldc) = A . B, or C += A . B when accumulate, over k2 pairs of k: pair (i, p) of A is the two
  // bfloat16 A(i, 2p), A(i, 2p + 1) at a + i * rs_a + p * cs_a (adjacent in memory: a row-major A with
  // rs_a = ld, cs_a = 2, or round_pairs_transposed's layout); B in pair_panels' layout (ps_b its panel
  // stride). Each vdpbf16ps adds the two products of a pair (exact in float32) to the float32 sum of a
  // lane, pairs in order. Reads and writes only the n columns of C.
  void (*pair_gemm)(int64_t m, int64_t n, int64_t k2, const scalar_t* a, int64_t rs_a, int64_t cs_a,
                    const scalar_t* b, int64_t ps_b, bool accumulate, float* c, int64_t ldc);

  // Where pair_gemm runs: B (k x n, element (kk, j) = src[kk * rs + j * cs]) as pairs along k in panels
  // of kPanel columns: pair (p, j) = (B(2p, j), B(2p + 1, j)) at dst[(j / kPanel) * ps + p * 2 * kPanel +
  // 2 * (j % kPanel)], ps = 2 * ceil(k / 2) * kPanel; zero past n and in an odd k's last half pair.
  void (*pair_panels)(const scalar_t* src, int64_t rs, int64_t cs, int64_t k, int64_t n, scalar_t* dst);

  // Where pair_gemm runs: x^T (x: rows x cols, float32, ld) as pair_gemm's A, rounded to bfloat16 as
  // softmax_tile_rounded rounds: pair (j, p) = (x[2p][j], x[2p + 1][j]) at dst + p * ld_dst + 2j
  // (rs_a = 2, cs_a = ld_dst >= 2 cols), an odd rows' last pair completed with 0.
  void (*round_pairs_transposed)(const acc_t* x, int64_t ld, int64_t rows, int64_t cols, scalar_t* dst,
                                 int64_t ld_dst);

  // Where pair_gemm runs: the backward's dS = scale * P (dP - delta[i * delta_stride]) (as score_grad)
  // rounded to bfloat16 (as softmax_tile_rounded rounds), written as pair_gemm's A both ways: rows
  // (ld_rows >= cols + cols % 2, an odd cols' pad column zeroed) and transposed (round_pairs_transposed's
  // layout, ld_t >= 2 cols). dp, p: rows x cols, float32, ld; left as they are.
  void (*score_grad_pairs)(const acc_t* dp, const acc_t* p, int64_t ld, int64_t rows, int64_t cols, acc_t scale,
                           const acc_t* delta, int64_t delta_stride, scalar_t* ds, int64_t ld_rows, scalar_t* ds_t,
                           int64_t ld_t);

  // Where pair_gemm runs: out[r] = x[r, :] . y[r, :] (rows of n bfloat16, n even), summed pair by pair
  // as pair_gemm sums (so that the backward's delta = dO . O cancels dP = dO . v where O = v).
  void (*pair_dots)(const scalar_t* x, const scalar_t* y, int64_t rows, int64_t n, acc_t* out);
  // Where pair_gemm runs: the instructions it sums with ("AMX-BF16 tiles" or "AVX512-BF16 pairs").
  const char* pair_isa = nullptr;

  // float32 on AVX2 and AVX512 (else nullptr: the tile products go to BLAS; for bfloat16 / half the float32 one
  // runs on operands widened by their pack_panels and widen). C (m x n, ldc) = A . B, or C += A . B
  // when accumulate, by a register-blocked micro-kernel (AVX2: 6 rows x kPanel columns of C in ymm
  // registers; AVX512: 12 rows x 2 kPanel columns in zmm registers; one fused multiply-add per product,
  // summed in k order, so both builds give the same bits). sum_block 0: all of k in one chain (from C
  // when accumulating); else k in blocks of sum_block, each chain from 0, the block sums added in order
  // to C (or to the first block's sum). A element (i, kk) at a[i * rs_a + kk * cs_a] (a row-major or a
  // transposed operand alike); B element (kk, j) at b[(j / kPanel) * ps_b + kk * ld_b + j % kPanel]:
  // either row-major rows (ps_b = kPanel, ld_b = the row stride) or pack_panels' layout (ps_b = k *
  // kPanel, ld_b = kPanel). Reads and writes only the n columns of B and C.
  void (*panel_gemm)(int64_t m, int64_t n, int64_t k, int64_t sum_block, const scalar_t* a, int64_t rs_a,
                     int64_t cs_a, const scalar_t* b, int64_t ld_b, int64_t ps_b, bool accumulate, scalar_t* c,
                     int64_t ldc);

  // Where float32's panel_gemm runs (float32, bfloat16, half; else nullptr): B (k x n, element (kk, j) =
  // src[kk * rs + j * cs]) widened to acc_t into panels of kPanel columns, dst[(j / kPanel) * k * kPanel +
  // kk * kPanel + j % kPanel], zero past n: ceil(n / kPanel) * k * kPanel values. The layout in which an
  // operand (keys as columns or as rows) streams through the micro-kernel.
  void (*pack_panels)(const scalar_t* src, int64_t rs, int64_t cs, int64_t k, int64_t n, acc_t* dst);

  // bfloat16 / half on AVX2 and AVX512 (else nullptr): the product of a half model's projection on a CPU
  // without arithmetic in its type. C (m x n, float32, ldc) = A . B (+ bias), A float32 (element (i, kk) at
  // a[i * rs_a + kk * cs_a]), B (k x n, element (kk, j) at b[kk * rs_b + j * cs_b]) widened to float32 (exact)
  // as it is packed, kWidenedDepth rows of k at a time, into pack (>= kWidenedDepth * ceil(n / kPanel) *
  // kPanel floats); k > 0. Each output is one chain of fused multiply-adds over k in order from 0, then + bias[j]
  // (float32, or nullptr): the same bits however a caller splits the rows and columns. b_sums (n float32, or
  // nullptr) receives B's column sums: each block's in k order, the blocks' added in order.
  void (*widened_gemm)(int64_t m, int64_t n, int64_t k, const acc_t* a, int64_t rs_a, int64_t cs_a,
                       const scalar_t* b, int64_t rs_b, int64_t cs_b, const acc_t* bias, acc_t* c, int64_t ldc,
                       acc_t* pack, acc_t* b_sums);

  // out (ld_out) = x (rows x cols, ld) rounded to the input type and back: the operand that a product
  // in the input type would see (a copy for float and double). out may be x itself (then ld_out ==
  // ld); otherwise the two must not overlap.
  void (*round_to_input)(const acc_t* x, int64_t ld, int64_t rows, int64_t cols, acc_t* out, int64_t ld_out);

  // out[r] = x[r, :] . y[r, :] for r < rows (rows of n contiguous values), summed as panel_gemm sums a
  // score product (sum_block kScoreSumBlock), so that the backward's delta = dO . O cancels dP = dO . v
  // bit for bit where O = v (one allowed key) instead of leaving a rounding residue in dS.
  void (*fma_dots)(const scalar_t* x, const scalar_t* y, int64_t rows, int64_t n, acc_t* out);

  // Backward. In: dp = dO . v. Out: dp = scale * p * (dp - delta[i * delta_stride]).
  void (*score_grad)(scalar_t* dp, const scalar_t* p, int64_t ld, int64_t rows, int64_t cols, acc_t scale,
                     const acc_t* delta, int64_t delta_stride);

  // Attention-weight dropout of a tile (acc_t, rows x cols, ld) whose element (i, j) is the weight
  // (bh, row0 + i, col0 + j): x = keep ? x * keep_scale : 0, the keep decisions of philox.h; the
  // same for y (the same layout) unless it is nullptr (the backward drops P and dP together).
  void (*dropout)(acc_t* x, acc_t* y, int64_t ld, int64_t rows, int64_t cols, const philox::Dropout& d, uint64_t bh,
                  int64_t row0, int64_t col0);
};

// The routines for the instruction set chosen at run time.
template <typename scalar_t>
const TileOps<scalar_t>& tile_ops();

// The instruction set chosen: "DEFAULT", "AVX2" or "AVX512".
const char* tile_ops_capability();

}  // namespace causal_attention::tile
