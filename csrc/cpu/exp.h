// exp for the softmax, the same bits in the AVX2 and AVX512 builds, and the scaled row exponent
// that the online softmax and the decode kernel share.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include "cpu/vec.h"

namespace causal_attention::tile::CPU_CAPABILITY {

// exp(x) for W lanes, as the softmax needs it (arguments <= 0, -inf for a masked key; x <= ~88), the
// same bits in the AVX2 and AVX512 builds (DEFAULT: std::exp): x = n ln2 + r with |r| <= ln2 / 2 (ln2
// in two parts, Cody and Waite), e^r by Cephes' expf polynomial, times 2^n; 0 at and below ln(FLT_MIN),
// so that no denormal reaches a product; NaN stays NaN (+inf gives NaN). Within 1 ulp of exp over
// [-87.3, 0], where at::vec's exp_u20 is 20 ulp off and its polynomial alone 2 ulp (enough to push
// float32 gradients past the tests' tolerance). exp(0) = 1 exactly (a row of
// one key has P = 1).
namespace exp_poly {
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693145751953125f;  // ln2's first 16 bits: n ln2_hi is exact
constexpr float kLn2Lo = 1.428606765330187e-06f;
// e^r = 1 + r + r^2 P(r), P of degree 5 (Cephes' expf): the exact 1 + r terms added last.
constexpr float kP5 = 1.9875691500e-4f, kP4 = 1.3981999507e-3f, kP3 = 8.3334519073e-3f, kP2 = 4.1665795894e-2f,
                kP1 = 1.6666665459e-1f, kP0 = 5.0000001201e-1f;
constexpr float kMinArg = -87.3365478515625f;  // the float just below ln(FLT_MIN) = -87.33654475...
}  // namespace exp_poly

inline Vec<float> exp_vec(const Vec<float>& x) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  using namespace exp_poly;
  using at::vec::fmadd;
  using at::vec::fnmadd;
  const Vec<float> n = (x * Vec<float>(kLog2e)).round();  // to nearest, ties to even
  const Vec<float> r = fnmadd(n, Vec<float>(kLn2Lo), fnmadd(n, Vec<float>(kLn2Hi), x));
  Vec<float> p = fmadd(r, Vec<float>(kP5), Vec<float>(kP4));
  for (const float c : {kP3, kP2, kP1, kP0}) {
    p = fmadd(r, p, Vec<float>(c));
  }
  p = fmadd(p, r * r, r) + Vec<float>(1.0f);
#if defined(CPU_CAPABILITY_AVX512)
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kMinArg), _CMP_NLE_UQ);  // e^x >= FLT_MIN, or NaN
  return _mm512_maskz_scalef_ps(normal, p, n);
#else
  // 2^n in the exponent field: n is in [-126, 127] wherever the lane is kept (the product is exact
  // scaling, as vscalefps, down to the denormals of n = -126).
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 normal = _mm256_cmp_ps(x, _mm256_set1_ps(kMinArg), _CMP_NLE_UQ);  // e^x >= FLT_MIN, or NaN
  return _mm256_and_ps(normal, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
#endif
#else
  return x.exp_u20();  // std::exp lane by lane
#endif
}

// The row shift of the exponent for a row whose largest raw score is x: scale * x rounded down (toward
// -inf), so that exp_scaled_to's argument at that score is the product's residual (>= 0), which it clamps
// to 0: the row's largest key weighs exactly 1. With one key O = v exactly, and the backward's
// dS = P (dP - dO . O) is exactly 0 there (rounding to nearest left exp(residual) != 1, and dQ, dK a
// residue of 2.8e-5 at scores of std 8).
template <typename acc_t>
inline acc_t scaled_max(acc_t scale, acc_t x) {
  const acc_t product = scale * x;
  return std::fma(x, scale, -product) < 0 ? std::nextafter(product, -std::numeric_limits<acc_t>::infinity())
                                          : product;  // -inf, +inf and NaN as they are
}

// min(x, 0) lane by lane, NaN kept (a NaN score stays NaN).
inline Vec<float> clamp_nonpositive(const Vec<float>& x) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_min_ps(_mm512_setzero_ps(), x);  // the second operand where either is NaN
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_min_ps(_mm256_setzero_ps(), x);
#else
  return at::vec::minimum(x, Vec<float>(0.f));
#endif
}

// dst[j] = exp(min(scale * x[j] - shift, 0)) for j < n, rounded to out_t where narrower, as Rounding rounds
// (dst may be x, in place); returns the sum of the unrounded values. -inf entries give 0. One order of
// operations for every out_t, so P in place and P rounded as it is made hold the same values and sums.
// float: the tail in a last vector whose lanes past n read -inf (so add 0); the lanes summed at the end.
template <typename acc_t, typename out_t, typename Rounding = AtenRounding>
inline acc_t exp_scaled_to(const acc_t* x, int64_t n, acc_t scale, acc_t shift, out_t* dst) {
  static_assert(std::is_same_v<out_t, acc_t> || kReduced<out_t>, "exp_scaled_to: acc_t or a narrower type out");
  int64_t j = 0;
  acc_t sum = 0;
  if constexpr (std::is_same_v<acc_t, float>) {
    constexpr int64_t W = Vec<float>::size();
    const Vec<float> vscale(scale);
    const Vec<float> vshift(shift);
    Vec<float> vsum(0.f);
    for (; j + W <= n; j += W) {
      const auto e = exp_vec(clamp_nonpositive(at::vec::fmsub(Vec<float>::loadu(x + j), vscale, vshift)));
      if constexpr (std::is_same_v<out_t, float>) {
        e.store(dst + j);
      } else {
        Rounding::store(e, dst + j);
      }
      vsum = vsum + e;
    }
    if (j < n) {
      const int64_t rest = n - j;
      const auto e = exp_vec(clamp_nonpositive(at::vec::fmsub(load_first(x + j, rest, kNegInf<float>), vscale, vshift)));
      if constexpr (std::is_same_v<out_t, float>) {
        e.store(dst + j, rest);
      } else {
        Rounding::store(e, dst + j, rest);
      }
      vsum = vsum + e;
      j = n;
    }
    sum = lanes_sum(vsum);
  }
  for (; j < n; ++j) {
    const acc_t e = std::exp(std::min(x[j] * scale - shift, acc_t(0)));  // double (float is done above); NaN kept
    dst[j] = static_cast<out_t>(e);
    sum += e;
  }
  return sum;
}

template <typename acc_t>
inline acc_t exp_scaled_inplace(acc_t* x, int64_t n, acc_t scale, acc_t shift) {
  return exp_scaled_to(x, n, scale, shift, x);
}

}  // namespace causal_attention::tile::CPU_CAPABILITY
