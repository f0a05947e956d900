// The bfloat16 pair micro-kernel of the tile products (tile_ops.h: pair_gemm, pair_panels,
// round_pairs_transposed, score_grad_pairs, pair_dots), AVX512's table called directly; skipped on CPUs without
// AVX512-BF16 (where the table leaves them nullptr, which is tested too).
// pair_gemm is exact where every product and partial sum is (small integers), within float32's error
// bound of the float64 product otherwise, for row-major and transposed A, B packed from rows or from
// columns, odd k, partial panels and row blocks, accumulation, and never touching C past its n columns.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cpu/tile_ops.h"
#include "cpu/tile_tables.h"
#include "cpu_features.h"

namespace {

namespace tile = causal_attention::tile;
using c10::BFloat16;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

uint16_t bits(BFloat16 x) { return x.x; }

// x in bfloat16 as vcvtneps2bf16 narrows it: to nearest even as ATen rounds, but a float32 denormal to a
// zero of its sign (vdpbf16ps reads a bfloat16 denormal as 0 anyway).
torch::Tensor hardware_rounded(const torch::Tensor& x) {
  return torch::where(x.abs() < std::numeric_limits<float>::min(), x * 0, x).to(torch::kBFloat16);
}

// Float32 denormals at the first and the last column of x's first and last rows (in the vectorised part
// and in the scalar tail when cols is not a multiple of 16): small ones, then (written last, so that they
// stay where the cells coincide: one row or one column) the largest denormal, which ATen rounds up to
// FLT_MIN where the instruction gives 0, and its negative.
void plant_denormals(torch::Tensor& x, int64_t rows, int64_t cols) {
  const float largest = std::nextafter(std::numeric_limits<float>::min(), 0.0f);
  x[rows - 1][0] = -1e-39f;
  x[0][cols - 1] = 1e-39f;
  x[0][0] = largest;
  x[rows - 1][cols - 1] = -largest;
}

// The pair panels' value (p, j, half) of dst: element (2p + half, j) of B.
BFloat16 panel_value(const std::vector<BFloat16>& dst, int64_t k, int64_t p, int64_t j, int64_t half) {
  const int64_t ps = 2 * ceil_div(k, 2) * tile::kPanel;
  return dst[(j / tile::kPanel) * ps + p * 2 * tile::kPanel + 2 * (j % tile::kPanel) + half];
}

// The AVX512 table with ONEDNN_MAX_CPU_ISA set to isa (nullopt: unset) while it is built.
tile::TileOps<BFloat16> table_with_isa(const std::optional<std::string>& isa) {
  const char* old = std::getenv("ONEDNN_MAX_CPU_ISA");
  const std::optional<std::string> saved = old != nullptr ? std::optional<std::string>(old) : std::nullopt;
  if (isa) {
    setenv("ONEDNN_MAX_CPU_ISA", isa->c_str(), 1);
  } else {
    unsetenv("ONEDNN_MAX_CPU_ISA");
  }
  auto ops = tile::AVX512::tile_ops_bfloat16();
  if (saved) {
    setenv("ONEDNN_MAX_CPU_ISA", saved->c_str(), 1);
  } else {
    unsetenv("ONEDNN_MAX_CPU_ISA");
  }
  return ops;
}

// The pair kernels this CPU runs: vdpbf16ps's, and AMX's where the CPU and the OS allow them.
std::vector<std::pair<std::string, tile::TileOps<BFloat16>>> pair_tables() {
  std::vector<std::pair<std::string, tile::TileOps<BFloat16>>> tables{
      {"AVX512-BF16", table_with_isa("AVX512_CORE_BF16")}};
  auto all = table_with_isa(std::nullopt);
  if (all.pair_gemm != tables[0].second.pair_gemm) {
    tables.emplace_back("AMX-BF16", all);
  }
  return tables;
}

// Whether this process may use AMX-BF16 tiles (the CPU has them and Linux grants their state).
bool amx_granted() {
  return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
         syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}

// AMX where the CPU and the OS have it, unless ONEDNN_MAX_CPU_ISA holds oneDNN (and so the engine)
// below AMX; vdpbf16ps otherwise.
TEST(PairGemm, TilesWhereTheCpuHasAmx) {
  if (!has_avx512_bf16()) {
    GTEST_SKIP() << "this CPU has no AVX512-BF16";
  }
  const auto held = table_with_isa("AVX512_CORE_BF16");
  const auto all = table_with_isa(std::nullopt);
  const auto amx = table_with_isa("AVX512_CORE_AMX");
  EXPECT_EQ(held.pair_gemm, table_with_isa("AVX2").pair_gemm);
  if (!amx_granted()) {
    EXPECT_EQ(all.pair_gemm, held.pair_gemm);
    GTEST_SKIP() << "this CPU (or this kernel) has no AMX-BF16";
  }
  EXPECT_NE(all.pair_gemm, held.pair_gemm);
  EXPECT_NE(all.pair_dots, held.pair_dots);
  EXPECT_EQ(amx.pair_gemm, all.pair_gemm);
}

TEST(PairGemm, OnlyWhereTheCpuHasAvx512Bf16) {
  if (!has_avx512_bf16()) {
    // The AVX512 table exists on any x86-64 build; without the instructions it must not offer them.
    if (__builtin_cpu_supports("avx512f")) {
      EXPECT_EQ(tile::AVX512::tile_ops_bfloat16().pair_gemm, nullptr);
    }
    GTEST_SKIP() << "this CPU has no AVX512-BF16";
  }
  const auto ops = tile::AVX512::tile_ops_bfloat16();
  EXPECT_NE(ops.pair_gemm, nullptr);
  EXPECT_NE(ops.pair_panels, nullptr);
  EXPECT_NE(ops.round_pairs_transposed, nullptr);
  EXPECT_NE(ops.score_grad_pairs, nullptr);
  EXPECT_NE(ops.pair_dots, nullptr);
}

// pair_panels' layout: B (k x n) read from rows (cs = 1) or from columns (rs = 1), pairs along k, zero
// past n and in an odd k's last half pair.
TEST(PairGemm, PacksPairPanelsExactly) {
  if (!has_avx512_bf16()) {
    GTEST_SKIP() << "this CPU has no AVX512-BF16";
  }
  const auto ops = tile::AVX512::tile_ops_bfloat16();
  torch::manual_seed(0);
  for (const int64_t k : {1, 2, 7, 8, 19, 64}) {
    for (const int64_t n : {1, 15, 16, 17, 33, 64}) {
      for (const bool transposed : {false, true}) {
        const auto src = transposed ? torch::randn({n, k + 4}).to(torch::kBFloat16)
                                    : torch::randn({k, n + 4}).to(torch::kBFloat16);
        const int64_t rs = transposed ? 1 : n + 4;
        const int64_t cs = transposed ? k + 4 : 1;
        const int64_t size = ceil_div(n, tile::kPanel) * tile::kPanel * 2 * ceil_div(k, 2);
        std::vector<BFloat16> dst(size, BFloat16(std::numeric_limits<float>::quiet_NaN()));
        ops.pair_panels(src.const_data_ptr<BFloat16>(), rs, cs, k, n, dst.data());
        const auto s = src.accessor<BFloat16, 2>();
        int64_t wrong = 0;
        for (int64_t j = 0; j < ceil_div(n, tile::kPanel) * tile::kPanel; ++j) {
          for (int64_t kk = 0; kk < 2 * ceil_div(k, 2); ++kk) {
            const BFloat16 want = (j >= n || kk >= k) ? BFloat16(0.0f) : (transposed ? s[j][kk] : s[kk][j]);
            wrong += bits(panel_value(dst, k, kk / 2, j, kk % 2)) != bits(want);
          }
        }
        EXPECT_EQ(wrong, 0) << "k " << k << " n " << n << " transposed " << transposed;
      }
    }
  }
}

// The values of dst (ceil(rows / 2) pair rows, ld) that are not the transposed pairs of r (rows x cols,
// bfloat16: pair (j, p) = (r[2p][j], r[2p + 1][j]), an odd rows' last pair completed with 0), or not still
// NaN past 2 cols of a pair row.
int64_t wrong_transposed_pairs(const std::vector<BFloat16>& dst, int64_t ld, int64_t rows, int64_t cols,
                               const at::TensorAccessor<BFloat16, 2>& r) {
  int64_t wrong = 0;
  for (int64_t p = 0; p < ceil_div(rows, 2); ++p) {
    for (int64_t j = 0; j < cols; ++j) {
      wrong += bits(dst[p * ld + 2 * j]) != bits(r[2 * p][j]);
      const BFloat16 second = 2 * p + 1 < rows ? r[2 * p + 1][j] : BFloat16(0.0f);
      wrong += bits(dst[p * ld + 2 * j + 1]) != bits(second);
    }
    for (int64_t j = 2 * cols; j < ld; ++j) {
      wrong += !std::isnan(static_cast<float>(dst[p * ld + j]));
    }
  }
  return wrong;
}

// round_pairs_transposed: x^T as pairs along x's rows, each value rounded as vcvtneps2bf16 rounds (denormals
// planted), an odd rows' last pair completed with 0; nothing past 2 cols of a pair row written.
TEST(PairGemm, RoundsTransposedPairsExactly) {
  if (!has_avx512_bf16()) {
    GTEST_SKIP() << "this CPU has no AVX512-BF16";
  }
  const auto ops = tile::AVX512::tile_ops_bfloat16();
  torch::manual_seed(0);
  for (const int64_t rows : {1, 2, 7, 64}) {
    for (const int64_t cols : {1, 15, 16, 17, 33, 128}) {
      auto x = torch::randn({rows, cols + 3}) * 100;
      plant_denormals(x, rows, cols);
      const auto rounded = hardware_rounded(x);
      const auto r = rounded.accessor<BFloat16, 2>();
      const int64_t ld_dst = 2 * cols + 5;
      std::vector<BFloat16> dst(ceil_div(rows, 2) * ld_dst, BFloat16(std::numeric_limits<float>::quiet_NaN()));
      ops.round_pairs_transposed(x.const_data_ptr<float>(), cols + 3, rows, cols, dst.data(), ld_dst);
      EXPECT_EQ(wrong_transposed_pairs(dst, ld_dst, rows, cols, r), 0) << "rows " << rows << " cols " << cols;
    }
  }
}

// score_grad_pairs: dS = scale * P (dP - delta) (float32, as score_grad computes it) rounded as
// vcvtneps2bf16 rounds (denormal P planted where dP - delta = 1, so some dS are denormal), in rows (an
// odd cols' pad column zeroed) and as round_pairs_transposed lays out x^T, bit for bit; nothing written
// past either form's columns; dp and p left as they were.
TEST(PairGemm, ScoreGradPairsRoundsDsBothWays) {
  if (!has_avx512_bf16()) {
    GTEST_SKIP() << "this CPU has no AVX512-BF16";
  }
  const auto ops = tile::AVX512::tile_ops_bfloat16();
  const auto float_ops = tile::AVX512::tile_ops_float();
  torch::manual_seed(0);
  const float scale = 0.125f;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const int64_t rows : {1, 2, 7, 64}) {
    for (const int64_t cols : {1, 15, 16, 17, 33, 128}) {
      const int64_t ld = cols + 3;
      auto p = torch::rand({rows, ld});
      plant_denormals(p, rows, cols);
      auto dp = torch::randn({rows, ld}) * 10;
      const auto delta = torch::randn({rows, 2});  // stride 2: one head of two
      dp[0][0] = delta[0][0] + 1.0f;  // dS = scale * P there: denormal where P is
      dp[rows - 1][cols - 1] = delta[rows - 1][0] + 1.0f;
      const auto p0 = p.clone(), dp0 = dp.clone();
      // The float32 dS of score_grad, then rounded.
      auto want = dp.clone();
      float_ops.score_grad(want.data_ptr<float>(), p.const_data_ptr<float>(), ld, rows, cols, scale,
                           delta.const_data_ptr<float>(), 2);
      const auto ds_values = want.slice(1, 0, cols);
      EXPECT_TRUE(
          (ds_values.abs() < std::numeric_limits<float>::min()).logical_and(ds_values != 0).any().item<bool>())
          << "no denormal dS to round: rows " << rows << " cols " << cols;
      const auto want_bf16 = hardware_rounded(want);
      const auto r = want_bf16.accessor<BFloat16, 2>();
      const int64_t ld_rows = cols + cols % 2 + 2;
      const int64_t ld_t = 2 * cols + 5;
      std::vector<BFloat16> ds(rows * ld_rows, BFloat16(nan)), ds_t(ceil_div(rows, 2) * ld_t, BFloat16(nan));
      ops.score_grad_pairs(dp.const_data_ptr<float>(), p.const_data_ptr<float>(), ld, rows, cols, scale,
                           delta.const_data_ptr<float>(), 2, ds.data(), ld_rows, ds_t.data(), ld_t);
      int64_t wrong = 0;
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t j = 0; j < ld_rows; ++j) {
          const float value = static_cast<float>(ds[i * ld_rows + j]);
          if (j < cols) {
            wrong += bits(ds[i * ld_rows + j]) != bits(r[i][j]);
          } else if (j < cols + cols % 2) {
            wrong += value != 0.0f || std::signbit(value);
          } else {
            wrong += !std::isnan(value);
          }
        }
      }
      wrong += wrong_transposed_pairs(ds_t, ld_t, rows, cols, r);
      EXPECT_EQ(wrong, 0) << "rows " << rows << " cols " << cols;
      EXPECT_TRUE(torch::equal(p, p0) && torch::equal(dp, dp0)) << "rows " << rows << " cols " << cols;
    }
  }
}

struct Case {
  int64_t m, n, k;
  bool trans_a, b_from_columns, accumulate, integers;
  int64_t extra = 0;  // B packed with k + extra rows (even) of which the product uses the first k (k even)
};

std::string describe(const Case& c) {
  return "m " + std::to_string(c.m) + " n " + std::to_string(c.n) + " k " + std::to_string(c.k) + " trans_a " +
         std::to_string(c.trans_a) + " b_from_columns " + std::to_string(c.b_from_columns) + " accumulate " +
         std::to_string(c.accumulate) + " integers " + std::to_string(c.integers) + " extra " +
         std::to_string(c.extra);
}

// Values of the case: small integers (every product and sum exact in float32) or normal ones.
torch::Tensor values(const Case& c, at::IntArrayRef shape) {
  return c.integers ? torch::randint(-4, 5, shape).to(torch::kFloat32) : torch::randn(shape);
}

// A (m x k, float32) as pair_gemm reads it: row-major pairs (a zero after an odd k's last value, as
// input_operand pads them), or the transpose of a k x m tile by round_pairs_transposed.
struct PairOperand {
  std::vector<BFloat16> pairs;
  int64_t rs = 0, cs = 0;
};
PairOperand a_operand(const tile::TileOps<BFloat16>& ops, const torch::Tensor& a, bool trans_a) {
  const int64_t m = a.size(0), k = a.size(1), k2 = ceil_div(k, 2);
  PairOperand out;
  if (trans_a) {
    const auto at_tile = a.t().contiguous();  // k x m
    const int64_t ld = 2 * m + 2;
    out.pairs.assign(k2 * ld, BFloat16(std::numeric_limits<float>::quiet_NaN()));
    ops.round_pairs_transposed(at_tile.const_data_ptr<float>(), m, k, m, out.pairs.data(), ld);
    out.rs = 2;
    out.cs = ld;
  } else {
    const int64_t ld = 2 * k2 + 4;
    out.pairs.assign(m * ld, BFloat16(std::numeric_limits<float>::quiet_NaN()));
    const auto a_bf16 = a.to(torch::kBFloat16);
    const auto acc = a_bf16.accessor<BFloat16, 2>();
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t kk = 0; kk < 2 * k2; ++kk) {
        out.pairs[i * ld + kk] = kk < k ? acc[i][kk] : BFloat16(0.0f);
      }
    }
    out.rs = ld;
    out.cs = 2;
  }
  return out;
}

void check_case(const tile::TileOps<BFloat16>& ops, const Case& c) {
  const auto [m, n, k, trans_a, b_from_columns, accumulate, integers, extra] = c;
  const int64_t k2 = ceil_div(k, 2);
  const auto a = values(c, {m, k});
  const auto a_bf16 = a.to(torch::kBFloat16);
  const auto [a_pairs, rs_a, cs_a] = a_operand(ops, a, trans_a);
  // B (k x n) in bfloat16, packed from its rows or from its transpose's rows, with `extra` rows more
  // (Inf, which must not reach C) that the product leaves out, as a tile short of its key block does.
  const auto b_bf16 = values(c, {k, n}).to(torch::kBFloat16);
  const int64_t kp = k + extra;
  const auto b_packed = torch::cat({b_bf16, torch::full({extra, n}, INFINITY).to(torch::kBFloat16)});  // kp x n
  std::vector<BFloat16> packed(ceil_div(n, tile::kPanel) * tile::kPanel * 2 * ceil_div(kp, 2));
  if (b_from_columns) {
    const auto bt = b_packed.t().contiguous();  // n x kp
    ops.pair_panels(bt.const_data_ptr<BFloat16>(), 1, kp, kp, n, packed.data());
  } else {
    const auto br = b_packed.contiguous();
    ops.pair_panels(br.const_data_ptr<BFloat16>(), n, 1, kp, n, packed.data());
  }
  // C: m x n with 3 spare columns; NaN where it must not be read (accumulate false).
  const int64_t ldc = n + 3;
  auto c_mat = values(c, {m, ldc});
  if (!accumulate) {
    c_mat.narrow(1, 0, n).fill_(std::numeric_limits<float>::quiet_NaN());
  }
  const auto c_before = c_mat.clone();

  ops.pair_gemm(m, n, k2, a_pairs.data(), rs_a, cs_a, packed.data(), 2 * ceil_div(kp, 2) * tile::kPanel, accumulate,
                c_mat.data_ptr<float>(), ldc);

  const auto a64 = a_bf16.to(torch::kFloat64);
  const auto b64 = b_bf16.to(torch::kFloat64);
  const auto c64 = accumulate ? c_before.narrow(1, 0, n).to(torch::kFloat64) : torch::zeros({m, n}, torch::kFloat64);
  const auto exact = torch::mm(a64, b64) + c64;
  const auto got = c_mat.narrow(1, 0, n).to(torch::kFloat64);
  if (integers) {  // every product and partial sum is an integer below 2^24: no rounding anywhere
    EXPECT_TRUE(torch::equal(got, exact)) << describe(c) << ": max diff " << (got - exact).abs().max().item<double>();
  } else {  // (k + 1) u (|A| |B| + |C|): at most one rounding per product added
    const auto bound =
        static_cast<double>(k + 1) * std::ldexp(1.0, -24) * (torch::mm(a64.abs(), b64.abs()) + c64.abs());
    EXPECT_TRUE(((got - exact).abs() <= bound + 1e-30).all().item<bool>()) << describe(c);
  }
  // The spare columns are never touched.
  EXPECT_TRUE(torch::equal(c_mat.narrow(1, n, 3), c_before.narrow(1, n, 3))) << describe(c);
}

TEST(PairGemm, MatchesTheProductOfTheRoundedOperands) {
  if (!has_avx512_bf16()) {
    GTEST_SKIP() << "this CPU has no AVX512-BF16";
  }
  for (const auto& [name, ops] : pair_tables()) {
    SCOPED_TRACE(name);
    torch::manual_seed(0);
    // AMX: row tiles of 16 (whole, partial, two at a time), chunks of 16 pairs (k 32, 64, 129: one, two,
    // four and a pair on vdpbf16ps), the 16 chunks it packs on the stack (k 512) and past them (k 544).
    for (const int64_t m : {1, 5, 11, 12, 13, 16, 33, 64}) {
      for (const int64_t n : {1, 15, 16, 17, 32, 40, 64}) {
        for (const int64_t k : {1, 2, 7, 32, 64, 129, 512, 544}) {
          if (k >= 512 && m > 16) {
            continue;
          }
          for (const bool trans_a : {false, true}) {
            for (const bool b_from_columns : {false, true}) {
              for (const bool accumulate : {false, true}) {
                for (const bool integers : {false, true}) {
                  check_case(ops, {m, n, k, trans_a, b_from_columns, accumulate, integers});
                  if (k % 2 == 0) {
                    check_case(ops, {m, n, k, trans_a, b_from_columns, accumulate, integers, 2});
                    check_case(ops, {m, n, k, trans_a, b_from_columns, accumulate, integers, 3});
                  }
                }
              }
            }
          }
        }
      }
    }
  }
}

// pair_dots sums each dot product as pair_gemm sums it, bit for bit: the backward's delta = dO . O and
// dP = dO . v then cancel where O = v.
TEST(PairGemm, PairDotsSumLikeTheKernel) {
  if (!has_avx512_bf16()) {
    GTEST_SKIP() << "this CPU has no AVX512-BF16";
  }
  for (const auto& [name, ops] : pair_tables()) {
    SCOPED_TRACE(name);
    torch::manual_seed(0);
    for (const int64_t n : {2, 8, 64, 80, 130}) {
      const int64_t rows = 37;  // AMX: two whole tiles of 16 rows and a partial one
      const auto x = (torch::randn({rows, n}) * 30).to(torch::kBFloat16);
      const auto y = (torch::randn({rows, n}) * 30).to(torch::kBFloat16);
      std::vector<float> dots(rows);
      ops.pair_dots(x.const_data_ptr<BFloat16>(), y.const_data_ptr<BFloat16>(), rows, n, dots.data());
      for (int64_t r = 0; r < rows; ++r) {
        // Row r of x against y's row r as a one-column B (k = n).
        std::vector<BFloat16> packed(tile::kPanel * n);
        ops.pair_panels(y.const_data_ptr<BFloat16>() + r * n, 1, n, n, 1, packed.data());
        float c = std::numeric_limits<float>::quiet_NaN();
        ops.pair_gemm(1, 1, n / 2, x.const_data_ptr<BFloat16>() + r * n, n, 2, packed.data(), n * tile::kPanel, false,
                      &c, 1);
        uint32_t got = 0;
        uint32_t want = 0;
        std::memcpy(&got, &dots[r], sizeof(got));
        std::memcpy(&want, &c, sizeof(want));
        EXPECT_EQ(got, want) << "n " << n << " row " << r << ": " << dots[r] << " vs " << c;
        const double exact = (x[r].to(torch::kFloat64) * y[r].to(torch::kFloat64)).sum().item<double>();
        const double scale = (x[r].to(torch::kFloat64) * y[r].to(torch::kFloat64)).abs().sum().item<double>();
        EXPECT_LE(std::abs(dots[r] - exact), static_cast<double>(n + 1) * std::ldexp(1.0, -24) * scale) << n;
      }
    }
  }
}

}  // namespace
