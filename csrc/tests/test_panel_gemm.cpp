// The float32 micro-kernel of the tile products (tile_ops.h: panel_gemm, pack_panels, widen,
// round_to_input), AVX2's table called directly so that it is tested on any CPU with AVX2 whatever
// ATen's chosen capability:
// bit for bit against a scalar fused multiply-add loop in k order (what the kernel computes: one chain,
// or blocks of k each from 0 with their sums added), within float32's bound of float64 products, for
// row-major, column-major and packed operands, partial panels and blocks, accumulation, and never
// touching C past its n columns.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention/tile_products.h"
#include "cpu/tile_ops.h"
#include "cpu/tile_tables.h"
#include "cpu_features.h"

namespace {

namespace tile = causal_attention::tile;

// How the B operand (k x n) is handed to panel_gemm.
enum class BLayout { kRowsInPlace, kPackedRows, kPackedTransposed };

struct Case {
  int64_t m, n, k;
  bool trans_a;
  BLayout layout;
  bool accumulate;
  int64_t sum_block;
};

std::string describe(const Case& c) {
  return "m " + std::to_string(c.m) + " n " + std::to_string(c.n) + " k " + std::to_string(c.k) + " trans_a " +
         std::to_string(c.trans_a) + " layout " + std::to_string(static_cast<int>(c.layout)) + " accumulate " +
         std::to_string(c.accumulate) + " sum_block " + std::to_string(c.sum_block);
}

// A . B (+ C's first columns when accumulate) with one fused multiply-add per product, in k order: in one
// chain from C (or 0) when sum_block is 0, else in blocks of sum_block from 0, each block's sum added in
// order to C (or to the first block's sum).
torch::Tensor fma_product(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& c, bool accumulate,
                          int64_t sum_block) {
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  const auto a_dense = a.contiguous();
  const auto b_dense = b.contiguous();
  const auto a_acc = a_dense.accessor<float, 2>();
  const auto b_acc = b_dense.accessor<float, 2>();
  const auto c0 = c.accessor<float, 2>();
  auto expected = torch::empty({m, n});
  auto e = expected.accessor<float, 2>();
  const int64_t block = sum_block > 0 ? sum_block : std::max<int64_t>(k, 1);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      float total = accumulate ? c0[i][j] : 0.0f;
      for (int64_t k0 = 0; k0 < k || (k0 == 0 && !accumulate); k0 += block) {
        const bool chain_from_c = sum_block == 0 && accumulate;
        float acc = chain_from_c ? total : 0.0f;
        for (int64_t kk = k0; kk < std::min(k, k0 + block); ++kk) {
          acc = std::fma(a_acc[i][kk], b_acc[kk][j], acc);
        }
        total = chain_from_c || (k0 == 0 && !accumulate) ? acc : total + acc;
      }
      e[i][j] = total;
    }
  }
  return expected;
}

void check_case(const tile::TileOps<float>& ops, const Case& c) {
  const auto [m, n, k, trans_a, layout, accumulate, sum_block] = c;
  // A: m x k, stored (k x (m + 3)) when trans_a; element (i, kk) at a[i * rs_a + kk * cs_a].
  const auto a_stored = trans_a ? torch::randn({k, m + 3}) : torch::randn({m, k + 3});
  const int64_t rs_a = trans_a ? 1 : k + 3;
  const int64_t cs_a = trans_a ? m + 3 : 1;
  const auto a = trans_a ? a_stored.narrow(1, 0, m).t() : a_stored.narrow(1, 0, k);  // m x k view
  // B: k x n, as rows (ld n + 5) or as its transpose (n x k, ld k + 2).
  const auto b_rows = torch::randn({k, n + 5});
  const auto b_cols = torch::randn({n, k + 2});
  const bool transposed = layout == BLayout::kPackedTransposed;
  const auto b = transposed ? b_cols.narrow(1, 0, k).t() : b_rows.narrow(1, 0, n);  // k x n view
  std::vector<float> packed((n + tile::kPanel - 1) / tile::kPanel * tile::kPanel * k);
  const float* b_ptr = packed.data();
  int64_t ld_b = tile::kPanel;
  int64_t ps_b = k * tile::kPanel;
  if (layout == BLayout::kRowsInPlace) {
    b_ptr = b_rows.const_data_ptr<float>();
    ld_b = n + 5;
    ps_b = tile::kPanel;
  } else if (layout == BLayout::kPackedRows) {
    ops.pack_panels(b_rows.const_data_ptr<float>(), n + 5, 1, k, n, packed.data());
  } else {
    ops.pack_panels(b_cols.const_data_ptr<float>(), 1, k + 2, k, n, packed.data());
  }
  // C: m x n with 3 spare columns; NaN where it must not be read (accumulate false).
  const int64_t ldc = n + 3;
  auto c_mat = torch::randn({m, ldc});
  if (!accumulate) {
    c_mat.narrow(1, 0, n).fill_(std::numeric_limits<float>::quiet_NaN());
  }
  const auto c_before = c_mat.clone();

  ops.panel_gemm(m, n, k, sum_block, a_stored.const_data_ptr<float>(), rs_a, cs_a, b_ptr, ld_b, ps_b, accumulate,
                 c_mat.data_ptr<float>(), ldc);

  // Bit for bit: one fused multiply-add per product, in k order, in the chains sum_block asks for.
  const auto expected = fma_product(a, b, c_before, accumulate, sum_block);
  const auto got = c_mat.narrow(1, 0, n);
  EXPECT_TRUE(torch::equal(got, expected)) << describe(c) << ": max diff "
                                           << (got - expected).abs().max().item<float>();
  // And within float32's error bound of the float64 product: (k + 1) u (|A| |B| + |C|).
  const auto a64 = a.to(torch::kFloat64);
  const auto b64 = b.to(torch::kFloat64);
  const auto c64 = accumulate ? c_before.narrow(1, 0, n).to(torch::kFloat64) : torch::zeros({m, n}, torch::kFloat64);
  const auto exact = torch::mm(a64, b64) + c64;
  const auto bound = static_cast<double>(k + 1) * std::ldexp(1.0, -24) * (torch::mm(a64.abs(), b64.abs()) + c64.abs());
  EXPECT_TRUE(((got.to(torch::kFloat64) - exact).abs() <= bound + 1e-30).all().item<bool>()) << describe(c);
  // The spare columns are never touched.
  EXPECT_TRUE(torch::equal(c_mat.narrow(1, n, 3), c_before.narrow(1, n, 3))) << describe(c);
}

void check_all_cases(const tile::TileOps<float>& ops);

TEST(PanelGemm, MatchesFusedMultiplyAddInKOrder) {
  if (!has_avx2()) {
    GTEST_SKIP() << "the micro-kernel is built for AVX2 + FMA, which this CPU lacks";
  }
  check_all_cases(tile::AVX2::tile_ops_float());
}

// The AVX512 build runs the same micro-kernel (compiled with the AVX-512 flags).
TEST(PanelGemm, MatchesFusedMultiplyAddInKOrderInTheAvx512Build) {
  if (!has_avx512()) {
    GTEST_SKIP() << "this CPU has no AVX-512";
  }
  check_all_cases(tile::AVX512::tile_ops_float());
}

void check_all_cases(const tile::TileOps<float>& ops) {
  torch::manual_seed(0);
  ASSERT_NE(ops.panel_gemm, nullptr);
  for (const int64_t m : {1, 5, 6, 7, 13, 64}) {
    for (const int64_t n : {1, 8, 15, 16, 17, 40, 64}) {
      for (const int64_t k : {0, 1, 3, 17, 64, 130}) {
        for (const bool trans_a : {false, true}) {
          for (const auto layout : {BLayout::kRowsInPlace, BLayout::kPackedRows, BLayout::kPackedTransposed}) {
            for (const bool accumulate : {false, true}) {
              for (const int64_t sum_block : {int64_t{0}, int64_t{8}, tile::kScoreSumBlock}) {
                check_case(ops, {m, n, k, trans_a, layout, accumulate, sum_block});
              }
            }
          }
        }
      }
    }
  }
}

// pack_panels' layout: element (kk, j) at dst[(j / kPanel) * k * kPanel + kk * kPanel + j % kPanel],
// widened exactly, zero past n; every path (rows of whole panels, 8 x 8 transposes with their tails,
// element by element).
template <typename scalar_t>
void check_pack(const tile::TileOps<scalar_t>& ops, torch::ScalarType dtype) {
  ASSERT_NE(ops.pack_panels, nullptr);
  for (const int64_t k : {1, 7, 8, 19, 64}) {
    for (const int64_t n : {1, 8, 15, 16, 33}) {
      for (const bool transposed : {false, true}) {
        // src: k x n as rows (ld n + 4), or n x k as rows (ld k + 4) read transposed.
        const auto src = transposed ? torch::randn({n, k + 4}).to(dtype) : torch::randn({k, n + 4}).to(dtype);
        const int64_t rs = transposed ? 1 : n + 4;
        const int64_t cs = transposed ? k + 4 : 1;
        const int64_t panels = (n + tile::kPanel - 1) / tile::kPanel;
        std::vector<float> dst(panels * tile::kPanel * k, std::numeric_limits<float>::quiet_NaN());
        ops.pack_panels(src.template const_data_ptr<scalar_t>(), rs, cs, k, n, dst.data());
        const auto wide = src.to(torch::kFloat32);
        const auto w = wide.template accessor<float, 2>();
        int64_t wrong = 0;
        for (int64_t j = 0; j < panels * tile::kPanel; ++j) {
          for (int64_t kk = 0; kk < k; ++kk) {
            const float got = dst[(j / tile::kPanel) * k * tile::kPanel + kk * tile::kPanel + j % tile::kPanel];
            const float want = j >= n ? 0.0f : (transposed ? w[j][kk] : w[kk][j]);
            wrong += got != want;  // NaN (an unwritten entry) never equals
          }
        }
        EXPECT_EQ(wrong, 0) << dtype << " k " << k << " n " << n << " transposed " << transposed;
      }
    }
  }
}

TEST(PanelGemm, PacksPanelsExactly) {
  if (!has_avx2()) {
    GTEST_SKIP() << "the micro-kernel is built for AVX2 + FMA, which this CPU lacks";
  }
  check_pack(tile::AVX2::tile_ops_float(), torch::kFloat32);
  check_pack(tile::AVX2::tile_ops_bfloat16(), torch::kBFloat16);
  check_pack(tile::AVX2::tile_ops_half(), torch::kHalf);
}

// widen: the exact float32 values of 16-bit rows (strided in and out), every instruction set.
template <typename scalar_t>
void check_widen(const tile::TileOps<scalar_t>& ops, torch::ScalarType dtype) {
  for (const int64_t cols : {1, 7, 8, 9, 33}) {
    const auto x = torch::randn({5, cols + 2}).to(dtype);
    auto out = torch::full({5, cols + 3}, std::numeric_limits<float>::quiet_NaN());
    ops.widen(x.template const_data_ptr<scalar_t>(), cols + 2, 5, cols, out.data_ptr<float>(), cols + 3);
    EXPECT_TRUE(torch::equal(out.narrow(1, 0, cols), x.narrow(1, 0, cols).to(torch::kFloat32))) << dtype << cols;
    EXPECT_TRUE(out.narrow(1, cols, 3).isnan().all().item<bool>()) << dtype << cols;
  }
}

TEST(PanelGemm, WidensExactly) {
  check_widen(tile::tile_ops<c10::BFloat16>(), torch::kBFloat16);
  check_widen(tile::tile_ops<c10::Half>(), torch::kHalf);
  if (has_avx2()) {
    check_widen(tile::AVX2::tile_ops_bfloat16(), torch::kBFloat16);
    check_widen(tile::AVX2::tile_ops_half(), torch::kHalf);
  }
}

// round_to_input: float32 values rounded to the 16-bit type and back (ATen's rounding), into another
// buffer (strided, nothing past cols written) or in place; a copy for float.
template <typename scalar_t>
void check_round(const tile::TileOps<scalar_t>& ops, torch::ScalarType dtype) {
  for (const int64_t cols : {1, 7, 15, 16, 17, 33}) {
    const auto x = torch::randn({5, cols + 2}) * 100;
    const auto expected = x.narrow(1, 0, cols).to(dtype).to(torch::kFloat32);
    auto out = torch::full({5, cols + 3}, std::numeric_limits<float>::quiet_NaN());
    ops.round_to_input(x.const_data_ptr<float>(), cols + 2, 5, cols, out.data_ptr<float>(), cols + 3);
    EXPECT_TRUE(torch::equal(out.narrow(1, 0, cols), expected)) << dtype << cols;
    EXPECT_TRUE(out.narrow(1, cols, 3).isnan().all().item<bool>()) << dtype << cols;
    auto in_place = x.clone();
    ops.round_to_input(in_place.data_ptr<float>(), cols + 2, 5, cols, in_place.data_ptr<float>(), cols + 2);
    EXPECT_TRUE(torch::equal(in_place.narrow(1, 0, cols), expected)) << dtype << cols;
    EXPECT_TRUE(torch::equal(in_place.narrow(1, cols, 2), x.narrow(1, cols, 2))) << dtype << cols;
  }
}

TEST(PanelGemm, RoundsToTheInputTypeExactly) {
  check_round(tile::tile_ops<c10::BFloat16>(), torch::kBFloat16);
  check_round(tile::tile_ops<c10::Half>(), torch::kHalf);
  check_round(tile::tile_ops<float>(), torch::kFloat32);
  if (has_avx2()) {
    check_round(tile::AVX2::tile_ops_bfloat16(), torch::kBFloat16);
    check_round(tile::AVX2::tile_ops_half(), torch::kHalf);
  }
}

}  // namespace

// The tile products sum as tile_products.h says, on the CPU's own micro-kernel, bit for bit: score
// products over the head in blocks of kScoreSumBlock; products with the head as columns in one chain,
// or in blocks of kNarrowSumBlock for a head narrower than a panel.
TEST(PanelGemm, TileProductsSumInTheirBlocks) {
  namespace kernels = causal_attention::kernels;
  const auto& ops = tile::tile_ops<float>();
  if (ops.panel_gemm == nullptr) {
    GTEST_SKIP() << "no micro-kernel on this CPU: the products go to BLAS";
  }
  torch::manual_seed(1);
  for (const int64_t rows : {1, 7, 128}) {
    for (const int64_t hd : {1, 15, 16, 48, 80}) {
      for (const int64_t keys : {1, 9, 257}) {
        // Scores: (rows x hd) . (keys x hd)^T.
        const auto q = torch::randn({rows, hd}) * 8;
        const auto k = torch::randn({keys, hd}) * 8;
        std::vector<float> packed(kernels::panels_size(hd, keys));
        const auto panels = kernels::pack_transposed<float>(k.const_data_ptr<float>(), hd, keys, hd, packed.data());
        auto s = torch::full({rows, keys}, std::numeric_limits<float>::quiet_NaN());
        const kernels::Operand<float> q_op{q.const_data_ptr<float>(), hd, q.const_data_ptr<float>(), hd};
        kernels::score_product<float>(q_op, k.const_data_ptr<float>(), hd, rows, keys, hd, s.data_ptr<float>(), keys,
                                      panels);
        const auto none = torch::zeros({rows, keys});
        EXPECT_TRUE(torch::equal(s, fma_product(q, k.t(), none, false, tile::kScoreSumBlock)))
            << "scores: rows " << rows << " hd " << hd << " keys " << keys;
        // Rows: (rows x keys) . (keys x hd), accumulated onto C.
        const auto p = torch::rand({rows, keys});
        const auto v = torch::randn({keys, hd});
        std::vector<float> packed_v(kernels::panels_size(keys, hd));
        const auto v_panels = kernels::pack_rows<float>(v.const_data_ptr<float>(), hd, keys, hd, packed_v.data());
        auto c = torch::randn({rows, hd});
        const auto c_before = c.clone();
        const kernels::Operand<float> p_op{p.const_data_ptr<float>(), keys, p.const_data_ptr<float>(), keys};
        kernels::row_product<float>(false, rows, hd, keys, p_op, v.const_data_ptr<float>(), hd, v_panels, true,
                                    c.data_ptr<float>(), hd);
        const int64_t block = hd < tile::kPanel ? kernels::kNarrowSumBlock : 0;
        EXPECT_TRUE(torch::equal(c, fma_product(p, v, c_before, true, block)))
            << "rows: rows " << rows << " hd " << hd << " keys " << keys;
      }
    }
  }
}
