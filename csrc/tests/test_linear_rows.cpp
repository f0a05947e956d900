// The few-rows linear kernel (tile_ops.h: linear_rows), each build's table called directly (DEFAULT
// always; AVX2 and AVX512 where the CPU has them), in float64, float32, bfloat16 and half: every output
// in [o0, o1) against float64 x w^T + b over the same (rounded) operands, elementwise within a bound
// derived from the data, and nothing written outside [o0, o1). Row counts below, at and across the
// builds' row blocks (8 on AVX-512, 4 on AVX2, then 4 / 2 / 1), input sizes that are and are not whole
// vectors (the scalar tail), weight ranges that do and do not fill the 3- and 6-row blocks (and, at the
// largest input size, run past the first prefetch window); and the bfloat16 pair kernel (linear_rows_pairs) where the CPU has AVX512-BF16.
// Every output also one at a time: the same bits whichever block computes it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include "cpu/tile_ops.h"
#include "cpu/tile_tables.h"
#include "cpu_features.h"

namespace {

namespace tile = causal_attention::tile;

// pairs: the bfloat16 table's linear_rows_pairs (x as bfloat16 rows) instead of linear_rows.
template <typename scalar_t>
void check_case(const tile::TileOps<scalar_t>& ops, torch::ScalarType dtype, int64_t rows, int64_t in, int64_t out,
                int64_t o0, int64_t o1, bool with_bias, bool pairs, const std::string& where) {
  using acc_t = at::opmath_type<scalar_t>;
  const auto acc_type = c10::CppTypeToScalarType<acc_t>::value;
  const auto x = (torch::randn({rows, in}, torch::kFloat64) * 3).to(dtype);  // the caller widens x to acc_t
  const auto w = torch::randn({out, in}, torch::kFloat64).to(dtype);
  const auto b = torch::randn({out}, torch::kFloat64).to(dtype);
  const at::Tensor x_acc = x.to(acc_type).contiguous();
  // y is wider than the outputs (ld_y = out + 3), has a row past the last and starts as NaN: what the
  // kernel must not touch stays NaN.
  const int64_t ld_y = out + 3;
  auto y_all = torch::full({rows + 1, ld_y}, std::numeric_limits<double>::quiet_NaN(), torch::kFloat64).to(dtype);
  auto y = y_all.narrow(0, 0, rows);
  const scalar_t* bias = with_bias ? b.const_data_ptr<scalar_t>() : nullptr;
  if (pairs) {
    ops.linear_rows_pairs(x.const_data_ptr<scalar_t>(), rows, in, w.const_data_ptr<scalar_t>(), bias, o0, o1,
                          y.data_ptr<scalar_t>(), ld_y);
  } else {
    ops.linear_rows(x_acc.const_data_ptr<acc_t>(), rows, in, w.const_data_ptr<scalar_t>(), bias, o0, o1,
                    y.data_ptr<scalar_t>(), ld_y);
  }
  // Each output is the same sum whichever block computes it (the 3- or 6-row blocks, a lone row, where a
  // range starts: FewRowsProduct takes any range, and the threads' split moves where ranges start):
  // one output at a time, the same bits.
  auto y_one = torch::zeros_like(y);
  for (int64_t o = o0; o < o1; ++o) {
    if (pairs) {
      ops.linear_rows_pairs(x.const_data_ptr<scalar_t>(), rows, in, w.const_data_ptr<scalar_t>(), bias, o, o + 1,
                            y_one.data_ptr<scalar_t>(), ld_y);
    } else {
      ops.linear_rows(x_acc.const_data_ptr<acc_t>(), rows, in, w.const_data_ptr<scalar_t>(), bias, o, o + 1,
                      y_one.data_ptr<scalar_t>(), ld_y);
    }
  }
  EXPECT_TRUE(torch::equal(y_one.narrow(1, o0, o1 - o0), y.narrow(1, o0, o1 - o0)))
      << where << ": an output's bits depend on the block that computed it";
  const auto xd = x.to(torch::kFloat64), wd = w.to(torch::kFloat64), bd = b.to(torch::kFloat64);
  const auto yd = y.to(torch::kFloat64);
  const auto ref = torch::mm(xd, wd.t()) + (with_bias ? bd : torch::zeros_like(bd));  // (rows, out)
  // Sums of `in` products in acc_t: off by at most in * u * sum_d |x_d w_d| (plus the bias's addition);
  // then one rounding to scalar_t. A wrong row, a lost tail or a missing bias is off by O(|x||w|).
  const double u = std::is_same_v<acc_t, double> ? std::ldexp(1.0, -53) : std::ldexp(1.0, -24);
  const double u_out = dtype == torch::kBFloat16 ? std::ldexp(1.0, -8)
                       : dtype == torch::kHalf   ? std::ldexp(1.0, -11)
                                                 : u;
  const auto magnitude = torch::mm(xd.abs(), wd.abs().t()) + (with_bias ? bd.abs() : torch::zeros_like(bd));
  // (Below half's smallest normal, 6.1e-5, its rounding error is up to half its spacing there, 2^-25.)
  const double tiny = dtype == torch::kHalf ? std::ldexp(1.0, -25) : 1e-300;
  const auto bound = (static_cast<double>(in) + 2) * u * magnitude + u_out * ref.abs() + tiny;
  const auto inside = yd.narrow(1, o0, o1 - o0);
  const auto excess = ((inside - ref.narrow(1, o0, o1 - o0)).abs() - bound.narrow(1, o0, o1 - o0)).max();
  EXPECT_LE(excess.item<double>(), 0.0) << where;
  EXPECT_FALSE(inside.isnan().any().item<bool>()) << where << ": an output in [o0, o1) was not written";
  EXPECT_TRUE(yd.narrow(1, 0, o0).isnan().all().item<bool>()) << where << ": wrote before o0";
  EXPECT_TRUE(yd.narrow(1, o1, ld_y - o1).isnan().all().item<bool>()) << where << ": wrote at or after o1";
  EXPECT_TRUE(y_all[rows].isnan().all().item<bool>()) << where << ": wrote past the last row";
}

template <typename scalar_t>
void check_table(const tile::TileOps<scalar_t>& ops, torch::ScalarType dtype, const std::string& isa,
                 bool pairs = false) {
  ASSERT_TRUE(pairs ? ops.linear_rows_pairs != nullptr : ops.linear_rows != nullptr);
  constexpr int64_t out = 40;
  for (const int64_t rows : {1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 16, 17}) {
    for (const int64_t in : {0, 1, 7, 16, 17, 33, 80, 768}) {  // 0: the bias alone
      for (const auto& [o0, o1] : {std::pair<int64_t, int64_t>{0, out}, {5, out - 1}, {7, 8}, {0, 31}}) {
        for (const bool with_bias : {true, false}) {
          check_case(ops, dtype, rows, in, out, o0, o1, with_bias, pairs,
                     isa + (pairs ? " pairs " : " ") + std::string(c10::toString(dtype)) + " rows " +
                         std::to_string(rows) + " in " + std::to_string(in) + " outputs [" + std::to_string(o0) +
                         ", " + std::to_string(o1) + ")" + (with_bias ? " bias" : ""));
        }
      }
    }
  }
}

template <typename F64, typename F32, typename BF16, typename F16>
void check_isa(F64 f64, F32 f32, BF16 bf16, F16 f16, const std::string& isa) {
  torch::manual_seed(0);
  check_table(f64(), torch::kFloat64, isa);
  check_table(f32(), torch::kFloat32, isa);
  check_table(bf16(), torch::kBFloat16, isa);
  check_table(f16(), torch::kHalf, isa);
}

TEST(LinearRows, MatchesFloat64LinearInTheDefaultBuild) {
  check_isa(tile::DEFAULT::tile_ops_double, tile::DEFAULT::tile_ops_float, tile::DEFAULT::tile_ops_bfloat16,
            tile::DEFAULT::tile_ops_half, "DEFAULT");
}

TEST(LinearRows, MatchesFloat64LinearInTheAvx2Build) {
  if (!has_avx2()) {
    GTEST_SKIP() << "this CPU has no AVX2 + FMA";
  }
  check_isa(tile::AVX2::tile_ops_double, tile::AVX2::tile_ops_float, tile::AVX2::tile_ops_bfloat16,
            tile::AVX2::tile_ops_half, "AVX2");
}

TEST(LinearRows, MatchesFloat64LinearInTheAvx512Build) {
  if (!has_avx512()) {
    GTEST_SKIP() << "this CPU has no AVX-512";
  }
  check_isa(tile::AVX512::tile_ops_double, tile::AVX512::tile_ops_float, tile::AVX512::tile_ops_bfloat16,
            tile::AVX512::tile_ops_half, "AVX512");
}

// bfloat16 pairs (vdpbf16ps): each pair's products exact in float32, sums in float32, as the bound assumes
// (the normal values here are far from bfloat16's subnormals, which the instruction reads as 0).
TEST(LinearRows, PairsMatchFloat64LinearWhereTheCpuHasAvx512Bf16) {
  if (!has_avx512_bf16()) {
    if (has_avx512()) {
      EXPECT_EQ(tile::AVX512::tile_ops_bfloat16().linear_rows_pairs, nullptr);
    }
    GTEST_SKIP() << "this CPU has no AVX512-BF16";
  }
  torch::manual_seed(0);
  check_table(tile::AVX512::tile_ops_bfloat16(), torch::kBFloat16, "AVX512", true);
  EXPECT_EQ(tile::AVX512::tile_ops_float().linear_rows_pairs, nullptr);
  EXPECT_EQ(tile::AVX512::tile_ops_half().linear_rows_pairs, nullptr);
}

}  // namespace
