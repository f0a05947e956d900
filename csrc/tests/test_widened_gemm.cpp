// The widening GEMM of half models' projections (tile_ops.h: widened_gemm), each instruction-set build's
// table called directly so that both are tested on a CPU that runs them, whatever ATen's chosen capability:
// bit for bit against a scalar fused multiply-add chain in k order (then + bias), within float32's bound
// of the float64 product, for B as rows, as columns (a weight read as its transpose) and strided, k over
// one and several packed blocks, partial panels and register blocks; B's column sums bit for bit against
// their block-by-block order; C never touched past its n columns.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "cpu/tile_ops.h"
#include "cpu/tile_tables.h"
#include "cpu_features.h"

namespace {

namespace tile = causal_attention::tile;

enum class BLayout { kRows, kColumns, kStrided };

struct Case {
  int64_t m, n, k;
  bool trans_a;
  BLayout layout;
  bool bias, sums;
};

std::string describe(const Case& c) {
  return "m " + std::to_string(c.m) + " n " + std::to_string(c.n) + " k " + std::to_string(c.k) + " trans_a " +
         std::to_string(c.trans_a) + " layout " + std::to_string(static_cast<int>(c.layout)) + " bias " +
         std::to_string(c.bias) + " sums " + std::to_string(c.sums);
}

template <typename scalar_t>
void check_case(const tile::TileOps<scalar_t>& ops, int64_t depth, const Case& c) {
  const c10::ScalarType dtype = c10::CppTypeToScalarType<scalar_t>::value;
  const auto [m, n, k, trans_a, layout, with_bias, with_sums] = c;
  // A: m x k float32 (exact widenings of dtype values, as the caller hands them), stored with spare room.
  const auto a_stored = (trans_a ? torch::randn({k, m + 3}) : torch::randn({m, k + 3})).to(dtype).to(torch::kFloat32);
  const int64_t rs_a = trans_a ? 1 : k + 3;
  const int64_t cs_a = trans_a ? m + 3 : 1;
  const auto a = trans_a ? a_stored.narrow(1, 0, m).t() : a_stored.narrow(1, 0, k);  // m x k view
  // B: k x n in dtype, as rows (ld n + 5), as columns (n x k, ld k + 2) or every other value of rows.
  torch::Tensor b_stored;
  torch::Tensor b;
  int64_t rs_b = 0, cs_b = 0;
  if (layout == BLayout::kRows) {
    b_stored = (torch::randn({k, n + 5}) * 3).to(dtype);
    b = b_stored.narrow(1, 0, n);
    rs_b = n + 5;
    cs_b = 1;
  } else if (layout == BLayout::kColumns) {
    b_stored = (torch::randn({n, k + 2}) * 3).to(dtype);
    b = b_stored.narrow(1, 0, k).t();
    rs_b = 1;
    cs_b = k + 2;
  } else {
    b_stored = (torch::randn({k, 2 * n}) * 3).to(dtype);
    b = b_stored.slice(1, 0, 2 * n, 2);
    rs_b = 2 * n;
    cs_b = 2;
  }
  const auto bias = torch::randn({n}) * 5;
  const int64_t ldc = n + 3;
  auto c_mat = torch::full({m, ldc}, std::numeric_limits<float>::quiet_NaN());  // NaN: never read
  const auto spare = torch::randn({m, 3});
  c_mat.narrow(1, n, 3).copy_(spare);
  std::vector<float> pack(tile::kWidenedDepth * ((n + tile::kPanel - 1) / tile::kPanel) * tile::kPanel);
  auto sums = torch::full({n}, std::numeric_limits<float>::quiet_NaN());

  ops.widened_gemm(m, n, k, a_stored.const_data_ptr<float>(), rs_a, cs_a, b_stored.const_data_ptr<scalar_t>(), rs_b,
                   cs_b, with_bias ? bias.const_data_ptr<float>() : nullptr, c_mat.data_ptr<float>(), ldc, pack.data(),
                   with_sums ? sums.data_ptr<float>() : nullptr);

  const auto a_dense = a.contiguous();
  const auto b_f = b.to(torch::kFloat32).contiguous();
  const auto aa = a_dense.accessor<float, 2>();
  const auto ba = b_f.accessor<float, 2>();
  const auto bias_a = bias.accessor<float, 1>();
  auto expected = torch::empty({m, n});
  auto e = expected.accessor<float, 2>();
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      float acc = 0.0f;
      for (int64_t kk = 0; kk < k; ++kk) {
        acc = std::fma(aa[i][kk], ba[kk][j], acc);
      }
      e[i][j] = with_bias ? acc + bias_a[j] : acc;
    }
  }
  const auto got = c_mat.narrow(1, 0, n);
  EXPECT_TRUE(torch::equal(got, expected)) << describe(c) << ": max diff "
                                           << (got - expected).abs().max().item<float>();
  const auto a64 = a.to(torch::kFloat64);
  const auto b64 = b.to(torch::kFloat64);
  const auto bias64 = with_bias ? bias.to(torch::kFloat64) : torch::zeros({n}, torch::kFloat64);
  const auto exact = torch::mm(a64, b64) + bias64;
  const auto bound =
      static_cast<double>(k + 1) * std::ldexp(1.0, -24) * (torch::mm(a64.abs(), b64.abs()) + bias64.abs());
  EXPECT_TRUE(((got.to(torch::kFloat64) - exact).abs() <= bound + 1e-30).all().item<bool>()) << describe(c);
  EXPECT_TRUE(torch::equal(c_mat.narrow(1, n, 3), spare)) << describe(c) << ": C written past its n columns";
  if (with_sums) {  // each packed block's column in k order, the blocks' sums added in order
    auto sums_expected = torch::empty({n});
    auto se = sums_expected.accessor<float, 1>();
    for (int64_t j = 0; j < n; ++j) {
      float total = 0.0f;
      for (int64_t k0 = 0; k0 < k; k0 += depth) {
        float block = 0.0f;
        for (int64_t kk = k0; kk < std::min(k, k0 + depth); ++kk) {
          block += ba[kk][j];
        }
        total = k0 == 0 ? block : total + block;
      }
      se[j] = total;
    }
    EXPECT_TRUE(torch::equal(sums, sums_expected)) << describe(c) << ": column sums";
  }
}

template <typename scalar_t>
void check_all_cases(const tile::TileOps<scalar_t>& ops, int64_t depth) {
  ASSERT_NE(ops.widened_gemm, nullptr);
  torch::manual_seed(0);
  // k: below a register block's 8-value transposes, one packed block, several (the AVX-512 build packs 512
  // values of k at a time, the AVX2 build 1024); n: partial and whole panels and 4-panel groups; m: partial
  // register blocks of 6 rows.
  for (const int64_t k : {1, 7, 8, 9, 77, 1030, 2100}) {
    for (const int64_t n : {1, 15, 16, 17, 64, 70}) {
      for (const int64_t m : {1, 5, 6, 13}) {
        for (const BLayout layout : {BLayout::kRows, BLayout::kColumns, BLayout::kStrided}) {
          // (the slow scalar reference: long k with one register block, or two for k = 1030 with whole panels)
          if (k > 100 && (layout == BLayout::kStrided || (m > 6 && (k != 1030 || n % 16 != 0)))) {
            continue;
          }
          const bool odd = (m + n + k) % 2 == 1;
          check_case(ops, depth, Case{m, n, k, odd, layout, !odd, odd || n == 64});
        }
      }
    }
  }
}

TEST(WidenedGemm, MatchesFusedMultiplyAddInKOrder) {
  if (!has_avx2()) {
    GTEST_SKIP() << "the widening GEMM is built for AVX2 + FMA + F16C, which this CPU lacks";
  }
  check_all_cases(tile::AVX2::tile_ops_bfloat16(), 1024);
  check_all_cases(tile::AVX2::tile_ops_half(), 1024);
}

TEST(WidenedGemm, MatchesFusedMultiplyAddInKOrderInTheAvx512Build) {
  if (!has_avx512()) {
    GTEST_SKIP() << "this CPU has no AVX-512";
  }
  check_all_cases(tile::AVX512::tile_ops_bfloat16(), 512);
  check_all_cases(tile::AVX512::tile_ops_half(), 512);
}

TEST(WidenedGemm, OnlyHalfTypesOnTheVectorBuilds) {
  EXPECT_EQ(tile::DEFAULT::tile_ops_bfloat16().widened_gemm, nullptr);
  EXPECT_EQ(tile::DEFAULT::tile_ops_half().widened_gemm, nullptr);
  EXPECT_EQ(tile::AVX2::tile_ops_float().widened_gemm, nullptr);
  EXPECT_EQ(tile::AVX512::tile_ops_double().widened_gemm, nullptr);
}

}  // namespace
