// The forward's online-softmax step (tile_ops.h: softmax_tile, softmax_tile_rounded), each build's table
// called directly (DEFAULT always; AVX2 and AVX512 where the CPU has them). The float32 step against
// float64 (P, the running max and sum, the rescale factor) over two tiles in a row, with causal limits,
// key masks and rows that see no key; the bfloat16 / half tables' own step in place over scores of their
// type against the float32 step over the widened scores then static_cast (bit for bit, masked tails
// included); and the rounded step (bfloat16 P for the pair micro-kernel, AVX512
// with AVX512-BF16 only) against the float32 step followed by rounding each value as vcvtneps2bf16 does
// (to nearest even as ATen rounds, a float32 denormal to a zero of its sign): the same m, l, alpha and, bit
// for bit, the same rounded P, zeros included, at the underflow edge too.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iostream>
#include <limits>
#include <string>
#include <vector>

#include "cpu/tile_ops.h"
#include "cpu/tile_tables.h"
#include "cpu_features.h"

namespace {

namespace tile = causal_attention::tile;

constexpr float kInf = std::numeric_limits<float>::infinity();

struct Case {
  int64_t rows, cols, causal_offset;
  bool masked;
};

// The cases: tile widths below, at and across a vector (odd ones too); all keys visible, a causal
// diagonal, and an offset that leaves the first rows with no key; with and without a key mask.
std::vector<Case> cases() {
  std::vector<Case> out;
  for (const int64_t cols : {1, 7, 16, 31, 33, 64, 100}) {
    for (const int64_t offset : {cols, int64_t{0}, int64_t{-2}}) {
      for (const bool masked : {false, true}) {
        out.push_back({5, cols, offset, masked});
        out.push_back({1, cols, offset, masked});
      }
    }
  }
  return out;
}

// Key mask with the first key real (so that the diagonal rows keep one) and about a third padding.
std::vector<uint8_t> key_mask(int64_t cols) {
  const auto keep = torch::rand({cols}) > 0.3;
  std::vector<uint8_t> mask(cols);
  for (int64_t j = 0; j < cols; ++j) {
    mask[j] = j == 0 || keep[j].item<bool>();
  }
  return mask;
}

void check_float_step(const tile::TileOps<float>& ops, const std::string& isa) {
  torch::manual_seed(0);
  const float scale = 0.125f;
  for (const auto& c : cases()) {
    const std::string where = isa + " cols " + std::to_string(c.cols) + " offset " + std::to_string(c.causal_offset) +
                              (c.masked ? " masked" : "");
    std::vector<float> m(c.rows, -kInf), l(c.rows, 0.f), alpha(c.rows), buf(c.cols);
    std::vector<double> m_ref(c.rows, -kInf), l_ref(c.rows, 0.0);
    for (int step = 0; step < 2; ++step) {  // two tiles: the second rescales the first's sums
      const auto scores = (torch::randn({c.rows, c.cols}) * 20).contiguous();
      std::vector<float> s(scores.data_ptr<float>(), scores.data_ptr<float>() + scores.numel());
      const auto mask = key_mask(c.cols);
      static_assert(sizeof(bool) == sizeof(uint8_t));
      ops.softmax_tile(s.data(), c.cols, c.rows, c.cols, scale, c.causal_offset,
                       c.masked ? reinterpret_cast<const bool*>(mask.data()) : nullptr, m.data(), l.data(),
                       alpha.data(), buf.data());
      for (int64_t i = 0; i < c.rows; ++i) {
        const int64_t n = std::clamp<int64_t>(i + c.causal_offset + 1, 0, c.cols);
        double row_max = m_ref[i];
        for (int64_t j = 0; j < n; ++j) {
          if (!c.masked || mask[j]) {
            row_max = std::max(row_max, scale * static_cast<double>(scores[i][j].item<float>()));
          }
        }
        const double a = row_max == -kInf ? 1.0 : std::exp(m_ref[i] - row_max);
        double sum = 0;
        for (int64_t j = 0; j < c.cols; ++j) {
          const bool allowed = j < n && (!c.masked || mask[j]);
          const double p = allowed ? std::exp(scale * static_cast<double>(scores[i][j].item<float>()) - row_max) : 0;
          sum += p;
          // exp (exp_vec: 1 ulp on AVX2 and AVX-512, std::exp in DEFAULT) of an argument rounded once (|arg| <= ~15 here: 15
          // ulp of 1).
          EXPECT_NEAR(s[i * c.cols + j], p, 4e-6 * p + 1e-30) << where << " step " << step << " (" << i << ", " << j
                                                               << ")";
        }
        if (row_max != -kInf) {
          EXPECT_NEAR(alpha[i], a, 4e-6 * a + 1e-30) << where << " row " << i;
          l_ref[i] = l_ref[i] * a + sum;
          m_ref[i] = row_max;
        } else {
          EXPECT_EQ(alpha[i], 1.f) << where << " row " << i;
        }
        EXPECT_EQ(static_cast<double>(m[i]), m_ref[i]) << where << " row " << i;  // a max of products by 2^-3
        EXPECT_NEAR(l[i], l_ref[i], 1e-5 * l_ref[i]) << where << " row " << i;
      }
    }
  }
}

// Row i's running max, sum and rescale factor the same, bit for bit, in two runs of the step.
void expect_same_stats(const std::vector<float>& m, const std::vector<float>& m2, const std::vector<float>& l,
                       const std::vector<float>& l2, const std::vector<float>& alpha, const std::vector<float>& alpha2,
                       int64_t i, const std::string& where) {
  EXPECT_EQ(m[i], m2[i]) << where << " row " << i;
  EXPECT_EQ(l[i], l2[i]) << where << " row " << i;
  EXPECT_EQ(alpha[i], alpha2[i]) << where << " row " << i;
}

// x in bfloat16 as vcvtneps2bf16 narrows it.
c10::BFloat16 hardware_rounded(float x) {
  if (std::fabs(x) < std::numeric_limits<float>::min()) {
    return c10::BFloat16(std::signbit(x) ? -0.0f : 0.0f);
  }
  return static_cast<c10::BFloat16>(x);
}

void check_rounded_step(const tile::TileOps<float>& float_ops, const tile::TileOps<c10::BFloat16>& ops,
                        const std::string& isa) {
  ASSERT_NE(ops.softmax_tile_rounded, nullptr);
  torch::manual_seed(1);
  const float scale = 0.125f;
  auto all_cases = cases();
  // The underflow edge, in the vector part and the tail (cols 16-18): scores 0, then -698 / -704 that
  // scale to exp(-87.25) (1.3e-38, just above FLT_MIN) and exp(-88) (below it: 0 from the exp, no denormal).
  all_cases.push_back({2, 19, 19, false});
  int near_flt_min = 0;
  for (const auto& c : all_cases) {
    const bool tiny = c.cols == 19;
    const std::string where = isa + " cols " + std::to_string(c.cols) + " offset " + std::to_string(c.causal_offset) +
                              (c.masked ? " masked" : "");
    std::vector<float> m(c.rows, -kInf), l(c.rows, 0.f), alpha(c.rows);
    std::vector<float> m2(c.rows, -kInf), l2(c.rows, 0.f), alpha2(c.rows), buf(c.cols);
    for (int step = 0; step < 2; ++step) {
      auto scores = (torch::randn({c.rows, c.cols}) * 20).contiguous();
      if (tiny) {
        scores = torch::full({c.rows, c.cols}, -704.0f);
        scores.select(1, 0).fill_(0.f);
        scores.select(0, step).slice(0, 1, 19, 2).fill_(-698.0f);
      }
      std::vector<float> s(scores.data_ptr<float>(), scores.data_ptr<float>() + scores.numel());
      std::vector<float> s2 = s;
      const auto mask = key_mask(c.cols);
      const bool* mp = c.masked ? reinterpret_cast<const bool*>(mask.data()) : nullptr;
      const int64_t ld_p = c.cols + 3;  // a wider row: what lies past cols stays as it was
      std::vector<c10::BFloat16> p(c.rows * ld_p, c10::BFloat16(7.0f));
      ops.softmax_tile_rounded(s.data(), c.cols, c.rows, c.cols, scale, c.causal_offset, mp, m.data(), l.data(),
                               alpha.data(), p.data(), ld_p);
      float_ops.softmax_tile(s2.data(), c.cols, c.rows, c.cols, scale, c.causal_offset, mp, m2.data(), l2.data(),
                             alpha2.data(), buf.data());
      for (int64_t i = 0; i < c.rows; ++i) {
        expect_same_stats(m, m2, l, l2, alpha, alpha2, i, where);
        for (int64_t j = 0; j < ld_p; ++j) {
          const float value = j < c.cols ? s2[i * c.cols + j] : 7.0f;
          near_flt_min += value != 0 && std::fabs(value) < 2 * std::numeric_limits<float>::min();
          if (tiny && j > 0 && j < c.cols) {  // the exp's cut-off: FLT_MIN and up kept, below it exactly 0
            const float score = scores[i][j].item<float>();
            if (score == -704.0f) {
              EXPECT_EQ(value, 0.0f) << where << " step " << step << " (" << i << ", " << j << ")";
            } else {
              EXPECT_GE(value, std::numeric_limits<float>::min())
                  << where << " step " << step << " (" << i << ", " << j << ")";
            }
          }
          const c10::BFloat16 want = hardware_rounded(value);
          EXPECT_EQ(std::memcmp(&p[i * ld_p + j], &want, sizeof(want)), 0)
              << where << " step " << step << " (" << i << ", " << j << "): " << static_cast<float>(p[i * ld_p + j])
              << " vs " << static_cast<float>(want);
        }
      }
    }
  }
  EXPECT_GT(near_flt_min, 0) << isa << ": the underflow case made no P near FLT_MIN";
}

// The bfloat16 / half tables' own step, in place over scores of that type (widened, then P rounded as
// ATen rounds, masked tails included): the float32 step over the widened scores, then static_cast, bit
// for bit, with the same m, l and alpha.
template <typename scalar_t>
void check_narrow_step(const tile::TileOps<float>& float_ops, const tile::TileOps<scalar_t>& ops,
                       torch::ScalarType dtype, const std::string& isa) {
  torch::manual_seed(2);
  const float scale = 0.125f;
  for (const auto& c : cases()) {
    const std::string where = isa + " " + std::string(c10::toString(dtype)) + " cols " + std::to_string(c.cols) +
                              " offset " + std::to_string(c.causal_offset) + (c.masked ? " masked" : "");
    std::vector<float> m(c.rows, -kInf), l(c.rows, 0.f), alpha(c.rows), buf(c.cols);
    std::vector<float> m2(c.rows, -kInf), l2(c.rows, 0.f), alpha2(c.rows), buf2(c.cols);
    for (int step = 0; step < 2; ++step) {
      const auto scores = (torch::randn({c.rows, c.cols}) * 20).to(dtype).contiguous();
      std::vector<scalar_t> s(scores.data_ptr<scalar_t>(), scores.data_ptr<scalar_t>() + scores.numel());
      const auto widened = scores.to(torch::kFloat).contiguous();
      std::vector<float> s2(widened.data_ptr<float>(), widened.data_ptr<float>() + widened.numel());
      const auto mask = key_mask(c.cols);
      const bool* mp = c.masked ? reinterpret_cast<const bool*>(mask.data()) : nullptr;
      ops.softmax_tile(s.data(), c.cols, c.rows, c.cols, scale, c.causal_offset, mp, m.data(), l.data(),
                       alpha.data(), buf.data());
      float_ops.softmax_tile(s2.data(), c.cols, c.rows, c.cols, scale, c.causal_offset, mp, m2.data(), l2.data(),
                             alpha2.data(), buf2.data());
      for (int64_t i = 0; i < c.rows; ++i) {
        expect_same_stats(m, m2, l, l2, alpha, alpha2, i, where);
        for (int64_t j = 0; j < c.cols; ++j) {
          const auto want = static_cast<scalar_t>(s2[i * c.cols + j]);
          EXPECT_EQ(std::memcmp(&s[i * c.cols + j], &want, sizeof(scalar_t)), 0)
              << where << " step " << step << " (" << i << ", " << j << "): " << static_cast<float>(s[i * c.cols + j])
              << " vs " << static_cast<float>(want);
        }
      }
    }
  }
}

// The rounded step only where the pair micro-kernel is: bfloat16, AVX512 with AVX512-BF16.
template <typename F32, typename BF16, typename F16>
void check_isa(F32 f32, BF16 bf16, F16 f16, const std::string& isa, bool pairs) {
  check_float_step(f32(), isa);
  check_narrow_step(f32(), bf16(), torch::kBFloat16, isa);
  check_narrow_step(f32(), f16(), torch::kHalf, isa);
  if (pairs) {
    check_rounded_step(f32(), bf16(), isa);
  } else {
    EXPECT_EQ(bf16().softmax_tile_rounded, nullptr) << isa;
  }
  EXPECT_EQ(f16().softmax_tile_rounded, nullptr) << isa;
  EXPECT_EQ(f32().softmax_tile_rounded, nullptr) << isa;
}

// The exp (exp_vec, cpu/exp.h) of the AVX2 and AVX512 builds over its whole range, through the float32 step: one
// row of scale 1 whose max is its first score, 0, so that P[j] = exp(x[j]) for the other scores x[j] (the
// argument x[j] - 0 is exact). Within 1 ulp of the result (ulps of its own binade) of exp in float64 from 0
// down to the float above ln(FLT_MIN), as its comment says: the reduction x - n ln2 is exact, so the error
// does not grow with |x| (a reduction in base 2 through a rounded t = x log2(e) reached 3.3e-6 relatively at
// x = -44, 28 ulp, and failed the float32 fuzz at scale 8); exactly 0 at and below the cut-off (no
// denormal), exactly 1 at 0. Returns P.
std::vector<float> check_exp(const tile::TileOps<float>& ops, const char* isa) {
  torch::manual_seed(3);
  constexpr float kCut = -87.3365478515625f;  // the float just below ln(FLT_MIN)
  std::vector<float> x = {0.0f, -0.0f, -1e-30f, -1e-8f, -5.9604645e-8f, std::nextafter(-0.5f, 0.0f), -0.5f,
                          std::nextafter(-1.0f, 0.0f), -1.0f, std::nextafter(-1.0f, -2.0f), std::nextafter(kCut, 0.0f),
                          kCut, -87.34f, -100.0f, -1e4f, -kInf};
  const int64_t kGrid = 100000;
  for (int64_t j = 1; j <= kGrid; ++j) {  // a step of 8.7e-4: every binade of the result, many points in each
    x.push_back(kCut * static_cast<float>(j) / static_cast<float>(kGrid));
  }
  const auto random = (torch::rand({20000}) * kCut).contiguous();
  x.insert(x.end(), random.data_ptr<float>(), random.data_ptr<float>() + random.numel());
  const auto cols = static_cast<int64_t>(x.size());
  std::vector<float> s = x;
  float m = -kInf, l = 0.f, alpha = 0.f;
  std::vector<float> buf(cols);
  ops.softmax_tile(s.data(), cols, 1, cols, 1.0f, tile::kNoCausal, nullptr, &m, &l, &alpha, buf.data());
  EXPECT_EQ(m, 0.0f) << isa;
  EXPECT_EQ(s[0], 1.0f) << isa;
  EXPECT_EQ(s[1], 1.0f) << isa;
  double worst = 0;  // the largest error, in ulps of the result
  float worst_x = 0;
  int64_t wrong = 0;  // results off by more than 1 ulp, below FLT_MIN, or not 0 past the cut-off
  float first_wrong = 0;
  for (int64_t j = 0; j < cols; ++j) {
    if (x[j] <= kCut) {
      if (s[j] != 0.0f && wrong++ == 0) {
        first_wrong = x[j];
      }
      continue;
    }
    const double want = std::exp(static_cast<double>(x[j]));  // >= FLT_MIN here: ilogb is of a normal float
    const double ulp = std::ldexp(1.0, std::ilogb(static_cast<float>(want)) - 23);  // of want's float binade
    const double ulps = std::fabs(s[j] - want) / ulp;
    if (!(s[j] >= std::numeric_limits<float>::min() && ulps <= 1.0) && wrong++ == 0) {
      first_wrong = x[j];
    }
    if (ulps > worst) {
      worst = ulps;
      worst_x = x[j];
    }
  }
  EXPECT_EQ(wrong, 0) << isa << ": of " << cols << " arguments; the first: exp(" << first_wrong
                      << "); the largest error " << worst << " ulp, at exp(" << worst_x << ")";
  std::cout << "[ exp_vec " << isa << " ] largest error: " << worst << " ulp, at exp(" << worst_x << ")\n";
  return s;
}

TEST(SoftmaxTile, ExpOfTheAvx512BuildWithinItsBoundOverItsWholeRange) {
  if (!has_avx512()) {
    GTEST_SKIP() << "this CPU has no AVX-512";
  }
  check_exp(tile::AVX512::tile_ops_float(), "AVX512");
}

// The AVX2 build's exp is the AVX512 one with 2^n made in the exponent field: the same bound, and the same
// bits where both run.
TEST(SoftmaxTile, ExpOfTheAvx2BuildWithinItsBoundAndTheAvx512Bits) {
  if (!has_avx2()) {
    GTEST_SKIP() << "this CPU has no AVX2 + FMA";
  }
  const auto avx2 = check_exp(tile::AVX2::tile_ops_float(), "AVX2");
  if (has_avx512()) {
    const auto avx512 = check_exp(tile::AVX512::tile_ops_float(), "AVX512");
    ASSERT_EQ(avx2.size(), avx512.size());
    EXPECT_EQ(std::memcmp(avx2.data(), avx512.data(), avx2.size() * sizeof(float)), 0);
  }
}

TEST(SoftmaxTile, MatchesFloat64AndRoundsAsPairsReadInTheDefaultBuild) {
  check_isa(tile::DEFAULT::tile_ops_float, tile::DEFAULT::tile_ops_bfloat16, tile::DEFAULT::tile_ops_half, "DEFAULT",
            false);
}

TEST(SoftmaxTile, MatchesFloat64AndRoundsAsPairsReadInTheAvx2Build) {
  if (!has_avx2()) {
    GTEST_SKIP() << "this CPU has no AVX2 + FMA";
  }
  check_isa(tile::AVX2::tile_ops_float, tile::AVX2::tile_ops_bfloat16, tile::AVX2::tile_ops_half, "AVX2", false);
}

TEST(SoftmaxTile, MatchesFloat64AndRoundsAsPairsReadInTheAvx512Build) {
  if (!has_avx512()) {
    GTEST_SKIP() << "this CPU has no AVX-512";
  }
  check_isa(tile::AVX512::tile_ops_float, tile::AVX512::tile_ops_bfloat16, tile::AVX512::tile_ops_half, "AVX512",
            has_avx512_bf16());
}

}  // namespace
