// The decode step's streaming kernel (tile_ops.h: decode_chunk), each build's table called directly
// (DEFAULT always; AVX2 and AVX512 where the CPU has them), in float32, bfloat16 and half: the running
// max, sum and output it leaves after one or two chunks, normalized, against float64 attention over
// the same (rounded) inputs, for head sizes that are and are not whole vectors (8 .. 80: the blocked
// scores' scalar tail), key counts below, at and across a block of keys (1 .. 100), several query
// rows with their causal limits, and rows that see no key. The queries are values of the dtype (as decode
// widens them); bfloat16's pair kernels (AVX512-BF16) round the probabilities to bfloat16.
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

// Whether the build's decode kernel weighs values with bfloat16 probabilities: its pair path.
bool rounds_probabilities(const std::string& isa, torch::ScalarType dtype, int64_t hd) {
  return isa == "AVX512" && dtype == torch::kBFloat16 && has_avx512_bf16() && hd % 32 == 0 && hd <= 128;
}

// Runs decode_chunk over keys [0, n) in one call or two (split at `cut`), for `rows` queries whose
// row i sees keys j <= i + offset, and checks o / l against float64 softmax(q k^T * scale) v.
template <typename scalar_t>
void check_case(const tile::TileOps<scalar_t>& ops, torch::ScalarType dtype, int64_t rows, int64_t n, int64_t hd,
                int64_t offset, int64_t cut, const std::string& isa, const std::string& where) {
  const auto q = (torch::randn({rows, hd}) * 2).to(dtype).to(torch::kFloat32);  // decode widens its queries
  const auto k = (torch::randn({n, hd}) * 2).to(dtype);
  const auto v = torch::randn({n, hd}).to(dtype);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  std::vector<float> m(rows, -std::numeric_limits<float>::infinity()), l(rows, 0.f), o(rows * hd, 0.f);
  std::vector<float> buf(tile::kDecodeGroupRows * n);
  const float* qp = q.data_ptr<float>();
  const scalar_t* kp = k.data_ptr<scalar_t>();
  const scalar_t* vp = v.data_ptr<scalar_t>();
  for (const auto& [j0, j1] : {std::pair<int64_t, int64_t>{0, cut}, {cut, n}}) {
    if (j1 > j0) {
      ops.decode_chunk(qp, rows, kp + j0 * hd, vp + j0 * hd, hd, j1 - j0, hd, scale, offset - j0, m.data(), l.data(),
                       o.data(), buf.data());
    }
  }
  const auto qd = q.to(torch::kFloat64), kd = k.to(torch::kFloat64), vd = v.to(torch::kFloat64);
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t visible = std::clamp<int64_t>(i + offset + 1, 0, n);
    if (visible == 0) {
      EXPECT_EQ(l[i], 0.f) << where << " row " << i;
      EXPECT_TRUE(std::all_of(o.begin() + i * hd, o.begin() + (i + 1) * hd, [](float x) { return x == 0.f; }))
          << where << " row " << i;
      continue;
    }
    const auto s = torch::mv(kd.narrow(0, 0, visible), qd[i]) * static_cast<double>(scale);
    const auto p = torch::softmax(s, 0);
    const auto ref = torch::mv(vd.narrow(0, 0, visible).t(), p);  // (hd)
    const auto ours = torch::from_blob(o.data() + i * hd, {hd}, torch::kFloat32).to(torch::kFloat64) / l[i];
    // float32 sums: a score is off by at most hd * u * sum_d |q_d k_d| * scale (e_s), which moves the
    // weights by 2 e_s relatively; exp (at::vec's, a few ulp) and the weighted sum over the visible
    // keys add their own roundings. A wrong key, a lost tail or a wrong rescale is off by O(1).
    const double u = std::ldexp(1.0, -24);
    const double e_s = static_cast<double>(hd) * u * static_cast<double>(scale) *
                       torch::mv(kd.narrow(0, 0, visible).abs(), qd[i].abs()).max().item<double>();
    // Probabilities rounded to bfloat16 (the pair kernels) move the weighted sum by up to 2^-8 of the
    // largest value.
    const double rounded_p = rounds_probabilities(isa, dtype, hd) ? std::ldexp(1.0, -8) : 0.0;
    const double tol = 2 * (2 * e_s + (static_cast<double>(visible + hd) + 32) * u + rounded_p) *
                       vd.narrow(0, 0, visible).abs().max().item<double>();
    const double err = (ours - ref).abs().max().item<double>();
    EXPECT_LE(err, tol) << where << " row " << i << " visible " << visible;
    EXPECT_NEAR(m[i], (s.max().item<double>()), 1e-4 * std::max(1.0, std::abs(s.max().item<double>())))
        << where << " row " << i;
  }
}

template <typename scalar_t>
void check_table(const tile::TileOps<scalar_t>& ops, torch::ScalarType dtype, const std::string& isa) {
  ASSERT_NE(ops.decode_chunk, nullptr);
  for (const int64_t hd : {8, 24, 32, 48, 64, 80, 96, 128}) {
    for (const int64_t n : {1, 7, 15, 16, 17, 33, 100}) {
      for (const int64_t rows : {1, 2, 3, 4, 7, 8, 13, 16}) {
        for (const int64_t offset : {n - 1, n - rows, int64_t{-1}, n / 2}) {  // all keys; causal limits; none for row 0
          for (const int64_t cut : {n, n / 2}) {
            check_case(ops, dtype, rows, n, hd, offset, cut, isa,
                       isa + " " + std::string(c10::toString(dtype)) + " hd " + std::to_string(hd) + " n " +
                           std::to_string(n) + " rows " + std::to_string(rows) + " offset " +
                           std::to_string(offset) + " cut " + std::to_string(cut));
          }
        }
      }
    }
  }
}

template <typename F32, typename BF16, typename F16>
void check_isa(F32 f32, BF16 bf16, F16 f16, const std::string& isa) {
  torch::manual_seed(0);
  check_table(f32(), torch::kFloat32, isa);
  check_table(bf16(), torch::kBFloat16, isa);
  check_table(f16(), torch::kHalf, isa);
}

TEST(DecodeChunk, MatchesFloat64AttentionInTheDefaultBuild) {
  check_isa(tile::DEFAULT::tile_ops_float, tile::DEFAULT::tile_ops_bfloat16, tile::DEFAULT::tile_ops_half, "DEFAULT");
}

TEST(DecodeChunk, MatchesFloat64AttentionInTheAvx2Build) {
  if (!has_avx2()) {
    GTEST_SKIP() << "this CPU has no AVX2 + FMA";
  }
  check_isa(tile::AVX2::tile_ops_float, tile::AVX2::tile_ops_bfloat16, tile::AVX2::tile_ops_half, "AVX2");
}

TEST(DecodeChunk, MatchesFloat64AttentionInTheAvx512Build) {
  if (!has_avx512()) {
    GTEST_SKIP() << "this CPU has no AVX-512";
  }
  check_isa(tile::AVX512::tile_ops_float, tile::AVX512::tile_ops_bfloat16, tile::AVX512::tile_ops_half, "AVX512");
}

}  // namespace
