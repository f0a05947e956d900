// The tile routines of tile_ops.h, compiled once per instruction set. CMake builds this file three
// times with CPU_CAPABILITY = DEFAULT, AVX2, AVX512 (and the matching -m flags); every symbol lives
// in the namespace causal_attention::tile::<CPU_CAPABILITY>, as at::vec's do, so the copies never mix.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <cmath>
#include <type_traits>
#include <utility>

#include "tile_ops.h"

#ifndef CPU_CAPABILITY
#error "tile_ops_isa.cpp is compiled with -DCPU_CAPABILITY=DEFAULT|AVX2|AVX512"
#endif

namespace causal_attention::tile::CPU_CAPABILITY {
namespace {

template <typename acc_t>
using Vec = at::vec::Vectorized<acc_t>;

template <typename acc_t>
constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();

// bfloat16 and half are widened to float32 in registers, W = Vec<float>::size() values at a time
// (at::vec: vcvtph2ps / a shift on AVX2 and AVX512, a scalar loop in the DEFAULT build), and
// narrowed back with round to nearest even, as static_cast does.
template <typename scalar_t>
constexpr bool kReduced = c10::is_reduced_floating_point_v<scalar_t>;

template <typename scalar_t>
inline Vec<float> load_widened(const scalar_t* src) {  // W values
  Vec<float> out;
  at::vec::load_to_float(src, out);
  return out;
}

template <typename scalar_t>
inline void store_narrowed(const Vec<float>& x, scalar_t* dst, int64_t count = Vec<float>::size()) {  // count <= W
  at::vec::convert_from_float<scalar_t>(x, x).store(dst, count);
}

template <typename scalar_t>
inline void store_narrowed(const Vec<float>& lo, const Vec<float>& hi, scalar_t* dst) {  // 2W values
  at::vec::convert_from_float<scalar_t>(lo, hi).store(dst);
}

// How a float32 value is narrowed where a kernel may choose: as ATen rounds (static_cast), on any CPU.
struct AtenRounding {
  template <typename out_t>
  static void store(const Vec<float>& x, out_t* dst, int64_t count = Vec<float>::size()) {  // count <= W values
    store_narrowed(x, dst, count);
  }
};

// bfloat16 as the AVX512-BF16 instructions narrow and read it: to nearest even as ATen rounds, except
// that a float32 denormal gives a zero of its sign (vcvtneps2bf16). vdpbf16ps, the only reader of values
// narrowed this way, reads a bfloat16 denormal as 0 anyway: the products are ATen rounding's but where a
// float32 denormal within half a bfloat16 step of FLT_MIN rounds up to FLT_MIN (a difference below 1e-38
// times the other factor). One instruction for 16 values, where at::vec's rounding takes eight.
inline c10::BFloat16 round_pair_value(float x) {
  return std::fabs(x) < std::numeric_limits<float>::min() ? c10::BFloat16(std::copysign(0.0f, x)) : c10::BFloat16(x);
}
#if defined(CPU_CAPABILITY_AVX512)
struct PairRounding {
  // Inline assembly, so that code built for plain AVX-512 can use it: only the pair paths call it, and
  // they are chosen only where the CPU has AVX512-BF16 (make_tile_ops).
  static void store(const Vec<float>& x, c10::BFloat16* dst, int64_t count = Vec<float>::size()) {  // count <= W
    __m256i narrowed;
    __asm__("vcvtneps2bf16 %1, %0" : "=v"(narrowed) : "v"(static_cast<__m512>(x)));
    if (count == Vec<float>::size()) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), narrowed);
    } else {
      _mm256_mask_storeu_epi16(dst, static_cast<__mmask16>((1u << count) - 1), narrowed);
    }
  }
};
#endif

// dst[j] = scale * src[j] for j < n.
template <typename scalar_t, typename acc_t>
inline void load_scaled(const scalar_t* src, int64_t n, acc_t scale, acc_t* dst) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    constexpr int64_t W = Vec<acc_t>::size();
    const Vec<acc_t> vscale(scale);
    int64_t j = 0;
    for (; j + W <= n; j += W) {
      (Vec<acc_t>::loadu(src + j) * vscale).store(dst + j);
    }
    for (; j < n; ++j) {
      dst[j] = src[j] * scale;
    }
  } else {
    int64_t j = 0;
    if constexpr (kReduced<scalar_t>) {
      constexpr int64_t W = Vec<float>::size();
      const Vec<float> vscale(scale);
      for (; j + W <= n; j += W) {
        (load_widened(src + j) * vscale).store(dst + j);
      }
    }
    for (; j < n; ++j) {
      dst[j] = static_cast<acc_t>(src[j]) * scale;
    }
  }
}

// dst[j] = src[j] for j < n, converted; dst[j] = 0 for n <= j < cols.
template <typename scalar_t, typename acc_t>
inline void store_row(const acc_t* src, int64_t n, int64_t cols, scalar_t* dst) {
  int64_t j = 0;
  if constexpr (kReduced<scalar_t>) {
    constexpr int64_t W = Vec<float>::size();
    for (; j + 2 * W <= n; j += 2 * W) {
      store_narrowed(Vec<float>::loadu(src + j), Vec<float>::loadu(src + j + W), dst + j);
    }
    for (; j + W <= n; j += W) {
      store_narrowed(Vec<float>::loadu(src + j), dst + j);
    }
  }
  for (; j < n; ++j) {
    dst[j] = static_cast<scalar_t>(src[j]);
  }
  std::fill(dst + n, dst + cols, scalar_t(0));
}

// The first `count` (< W) values at x, the other lanes `fill` (nothing read past count).
template <typename acc_t>
inline Vec<acc_t> load_first(const acc_t* x, int64_t count, acc_t fill) {
  return Vec<acc_t>::set(Vec<acc_t>(fill), Vec<acc_t>::loadu(x, count), count);
}

// The W lanes of v added / their maximum (a NaN lane gives NaN): float in log2(W) shuffle steps on AVX2
// and AVX-512 (at::vec; W - 1 steps in the DEFAULT build), where a loop over the stored lanes took W - 1
// dependent steps; double (the float64 path) by that loop (GCC 12 warns inside the double shuffle
// intrinsics).
template <typename acc_t>
inline acc_t lanes_sum(const Vec<acc_t>& v) {
  if constexpr (std::is_same_v<acc_t, float>) {
    return at::vec::vec_reduce_all<float>([](const Vec<float>& a, const Vec<float>& b) { return a + b; }, v);
  } else {
    acc_t lanes[Vec<acc_t>::size()];
    v.store(lanes);
    return std::accumulate(lanes + 1, lanes + Vec<acc_t>::size(), lanes[0]);
  }
}
template <typename acc_t>
inline acc_t lanes_max(const Vec<acc_t>& v) {
  if constexpr (std::is_same_v<acc_t, float>) {
    return at::vec::vec_reduce_all<float>(
        [](const Vec<float>& a, const Vec<float>& b) { return at::vec::maximum(a, b); }, v);
  } else {
    acc_t lanes[Vec<acc_t>::size()];
    v.store(lanes);
    acc_t result = lanes[0];
    for (int64_t w = 1; w < Vec<acc_t>::size(); ++w) {
      result = (std::isnan(lanes[w]) || lanes[w] > result) ? lanes[w] : result;
    }
    return result;
  }
}

// max_j x[j] (-inf for n = 0); the tail in a last vector whose lanes past n read -inf. Four
// running maxima: at::vec::maximum (a max, and an or that keeps NaN) in one chain waited its latency at
// every vector (19% of the bfloat16 softmax's samples at T = 2048).
template <typename acc_t>
inline acc_t max_of(const acc_t* x, int64_t n) {
  constexpr int64_t W = Vec<acc_t>::size();
  Vec<acc_t> vmax(kNegInf<acc_t>);
  int64_t j = 0;
  if (n >= 4 * W) {
    Vec<acc_t> v1(kNegInf<acc_t>), v2(kNegInf<acc_t>), v3(kNegInf<acc_t>);
    for (; j + 4 * W <= n; j += 4 * W) {
      vmax = at::vec::maximum(vmax, Vec<acc_t>::loadu(x + j));
      v1 = at::vec::maximum(v1, Vec<acc_t>::loadu(x + j + W));
      v2 = at::vec::maximum(v2, Vec<acc_t>::loadu(x + j + 2 * W));
      v3 = at::vec::maximum(v3, Vec<acc_t>::loadu(x + j + 3 * W));
    }
    vmax = at::vec::maximum(at::vec::maximum(vmax, v1), at::vec::maximum(v2, v3));
  }
  for (; j + W <= n; j += W) {
    vmax = at::vec::maximum(vmax, Vec<acc_t>::loadu(x + j));
  }
  if (j < n) {
    vmax = at::vec::maximum(vmax, load_first(x + j, n - j, kNegInf<acc_t>));
  }
  return lanes_max(vmax);
}

// exp(x) for W lanes, as the softmax needs it (arguments <= 0, -inf for a masked key; x <= ~88), the
// same bits in the AVX2 and AVX512 builds (DEFAULT: std::exp): x = n ln2 + r with |r| <= ln2 / 2 (ln2
// in two parts, Cody and Waite), e^r by Cephes' expf polynomial, times 2^n; 0 at and below ln(FLT_MIN),
// so that no denormal reaches a product; NaN stays NaN (+inf gives NaN). Within 1 ulp of exp over
// [-87.3, 0], where at::vec's exp_u20 is 20 ulp off and its polynomial alone 2 ulp (enough to move a
// float32 fuzz draw's weight gradient from 1.04x to 2.08x its tolerance). exp(0) = 1 exactly (a row of
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

// dst[j] = exp(scale * x[j] - shift) for j < n, rounded to out_t where narrower, as Rounding rounds
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
      const auto e = exp_vec(at::vec::fmsub(Vec<float>::loadu(x + j), vscale, vshift));
      if constexpr (std::is_same_v<out_t, float>) {
        e.store(dst + j);
      } else {
        Rounding::store(e, dst + j);
      }
      vsum = vsum + e;
    }
    if (j < n) {
      const int64_t rest = n - j;
      const auto e = exp_vec(at::vec::fmsub(load_first(x + j, rest, kNegInf<float>), vscale, vshift));
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
    const acc_t e = std::exp(x[j] * scale - shift);  // double (float is done above)
    dst[j] = static_cast<out_t>(e);
    sum += e;
  }
  return sum;
}

template <typename acc_t>
inline acc_t exp_scaled_inplace(acc_t* x, int64_t n, acc_t scale, acc_t shift) {
  return exp_scaled_to(x, n, scale, shift, x);
}

// x[0..count) = +0 (all bits clear, for float, double, bfloat16 and half alike): one memset where
// std::fill of bfloat16 stored two bytes at a time.
template <typename T>
inline void zero_fill(T* x, int64_t count) {
  static_assert(std::is_trivially_copyable_v<T>, "zero_fill: a type whose zero is all bits clear");
  if (count > 0) {
    std::memset(static_cast<void*>(x), 0, static_cast<size_t>(count) * sizeof(T));
  }
}

// row[j] = -inf for the keys j < n that key_mask marks as padding. float rows a vector at a time (the
// tile that holds a padded sequence's last real key is masked, a scalar loop over its every score).
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
inline void mask_keys(scalar_t* row, int64_t n, const bool* key_mask) {
  int64_t j = 0;
  if constexpr (std::is_same_v<scalar_t, float>) {
    static_assert(sizeof(bool) == 1, "mask_keys: one byte per key");
#if defined(CPU_CAPABILITY_AVX512)
    for (; j + 16 <= n; j += 16) {
      const __mmask16 real = _mm_test_epi8_mask(_mm_loadu_si128(reinterpret_cast<const __m128i*>(key_mask + j)),
                                                _mm_set1_epi8(-1));
      _mm512_storeu_ps(row + j, _mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf<float>), real, row + j));
    }
#elif defined(CPU_CAPABILITY_AVX2)
    for (; j + 8 <= n; j += 8) {
      const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(key_mask + j)));
      const __m256 padding = _mm256_castsi256_ps(_mm256_cmpeq_epi32(bytes, _mm256_setzero_si256()));
      _mm256_storeu_ps(row + j, _mm256_blendv_ps(_mm256_loadu_ps(row + j), _mm256_set1_ps(kNegInf<float>), padding));
    }
#endif
  }
  for (; j < n; ++j) {
    row[j] = key_mask[j] ? row[j] : static_cast<scalar_t>(kNegInf<acc_t>);
  }
}

// The online-softmax step of one tile (tile_ops.h, softmax_tile): the scores in s (scalar_t; widened
// into buf when narrower than acc_t), P out to p (ld_p): in place when p is s; rounded as it is made
// (as Rounding rounds) when out_t is narrower than acc_t.
template <typename scalar_t, typename out_t, typename Rounding = AtenRounding,
          typename acc_t = at::opmath_type<scalar_t>>
void softmax_rows(scalar_t* s, int64_t ld, int64_t rows, int64_t cols, acc_t scale, int64_t causal_offset,
                  const bool* key_mask, acc_t* m, acc_t* l, acc_t* alpha, acc_t* buf, out_t* p, int64_t ld_p) {
  static_assert(std::is_same_v<out_t, acc_t> ? std::is_same_v<scalar_t, acc_t> : kReduced<out_t>,
                "softmax_rows: P in acc_t only in place over acc_t scores");
  for (int64_t i = 0; i < rows; ++i) {
    scalar_t* row = s + i * ld;
    out_t* p_row = p + i * ld_p;
    const int64_t n = std::clamp<int64_t>(i + causal_offset + 1, 0, cols);  // allowed prefix
    if (key_mask != nullptr) {
      mask_keys(row, n, key_mask);
    }
    // float works in place; narrower types are widened into buf once (vectorised max and exp).
    acc_t* x = nullptr;
    if constexpr (std::is_same_v<scalar_t, acc_t>) {
      x = row;
    } else {
      load_scaled(row, n, acc_t(1), buf);
      x = buf;
    }
    // scale > 0, so the max of the scaled row is scale times the max of the raw row.
    const acc_t m_new = std::max(scale * max_of(x, n), m[i]);  // a NaN score first: it stays (NaN out)
    if (m_new == kNegInf<acc_t>) {  // no allowed key yet: the row stays empty
      alpha[i] = 1;
      zero_fill(p_row, cols);
      continue;
    }
    alpha[i] = std::exp(m[i] - m_new);  // 0 when m[i] = -inf
    const acc_t sum = exp_scaled_to<acc_t, out_t, Rounding>(x, n, scale, m_new, p_row);  // in place, or rounded
    zero_fill(p_row + n, cols - n);
    l[i] = l[i] * alpha[i] + sum;
    m[i] = m_new;
  }
}

template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void softmax_tile(scalar_t* s, int64_t ld, int64_t rows, int64_t cols, acc_t scale, int64_t causal_offset,
                  const bool* key_mask, acc_t* m, acc_t* l, acc_t* alpha, acc_t* buf) {
  softmax_rows(s, ld, rows, cols, scale, causal_offset, key_mask, m, l, alpha, buf, s, ld);
}

#if defined(CPU_CAPABILITY_AVX512)
// bfloat16 P for the pair micro-kernel, rounded as PairRounding rounds (AVX512-BF16 only).
void softmax_tile_rounded(float* s, int64_t ld, int64_t rows, int64_t cols, float scale, int64_t causal_offset,
                          const bool* key_mask, float* m, float* l, float* alpha, c10::BFloat16* p, int64_t ld_p) {
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY(ld_p >= cols);
  softmax_rows<float, c10::BFloat16, PairRounding>(s, ld, rows, cols, scale, causal_offset, key_mask, m, l, alpha,
                                                   static_cast<float*>(nullptr), p, ld_p);
}
#endif

template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void rescale_add(acc_t* acc, int64_t ld_acc, const scalar_t* x, int64_t ld_x, int64_t rows, int64_t cols,
                 const acc_t* alpha) {
  for (int64_t i = 0; i < rows; ++i) {
    acc_t* a = acc + i * ld_acc;
    const scalar_t* xi = x + i * ld_x;
    const acc_t f = alpha[i];
    int64_t j = 0;
    if constexpr (kReduced<scalar_t>) {  // a[j] * f + x[j] in one fused multiply-add
      constexpr int64_t W = Vec<float>::size();
      const Vec<float> vf(f);
      for (; j + W <= cols; j += W) {
        at::vec::fmadd(Vec<float>::loadu(a + j), vf, load_widened(xi + j)).store(a + j);
      }
    }
    for (; j < cols; ++j) {
      a[j] = a[j] * f + static_cast<acc_t>(xi[j]);
    }
  }
}

template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void add(acc_t* acc, int64_t ld_acc, const scalar_t* x, int64_t ld_x, int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    acc_t* a = acc + i * ld_acc;
    const scalar_t* xi = x + i * ld_x;
    int64_t j = 0;
    if constexpr (kReduced<scalar_t>) {
      constexpr int64_t W = Vec<float>::size();
      for (; j + W <= cols; j += W) {
        (Vec<float>::loadu(a + j) + load_widened(xi + j)).store(a + j);
      }
    }
    for (; j < cols; ++j) {
      a[j] += static_cast<acc_t>(xi[j]);
    }
  }
}

template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void finalize(const acc_t* acc, int64_t ld_acc, int64_t rows, int64_t cols, const acc_t* m, const acc_t* l,
              scalar_t* out, int64_t ld_out, acc_t* lse) {
  for (int64_t i = 0; i < rows; ++i) {
    scalar_t* o = out + i * ld_out;
    if (l[i] == 0) {  // no allowed key: output 0; +inf makes the backward's probabilities 0
      std::fill(o, o + cols, scalar_t(0));
      lse[i] = std::numeric_limits<acc_t>::infinity();
      continue;
    }
    const acc_t inv = acc_t(1) / l[i];
    const acc_t* a = acc + i * ld_acc;
    int64_t j = 0;
    if constexpr (kReduced<scalar_t>) {
      constexpr int64_t W = Vec<float>::size();
      const Vec<float> vinv(inv);
      for (; j + 2 * W <= cols; j += 2 * W) {
        store_narrowed(Vec<float>::loadu(a + j) * vinv, Vec<float>::loadu(a + j + W) * vinv, o + j);
      }
      for (; j + W <= cols; j += W) {
        store_narrowed(Vec<float>::loadu(a + j) * vinv, o + j);
      }
    }
    for (; j < cols; ++j) {
      o[j] = static_cast<scalar_t>(a[j] * inv);
    }
    lse[i] = m[i] + std::log(l[i]);
  }
}

template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void store(const acc_t* acc, int64_t ld_acc, int64_t rows, int64_t cols, scalar_t* out, int64_t ld_out) {
  for (int64_t i = 0; i < rows; ++i) {
    const acc_t* a = acc + i * ld_acc;
    scalar_t* o = out + i * ld_out;
    if constexpr (kReduced<scalar_t>) {
      store_row(a, cols, cols, o);
      continue;
    }
    for (int64_t j = 0; j < cols; ++j) {
      o[j] = static_cast<scalar_t>(a[j]);
    }
  }
}

template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void widen(const scalar_t* x, int64_t ld_x, int64_t rows, int64_t cols, acc_t* out, int64_t ld_out) {
  for (int64_t i = 0; i < rows; ++i) {
    const scalar_t* xi = x + i * ld_x;
    acc_t* o = out + i * ld_out;
    int64_t j = 0;
    if constexpr (kReduced<scalar_t>) {
      constexpr int64_t W = Vec<float>::size();
      for (; j + W <= cols; j += W) {
        load_widened(xi + j).store(o + j);
      }
    }
    for (; j < cols; ++j) {
      o[j] = static_cast<acc_t>(xi[j]);
    }
  }
}

template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void fma_dots(const scalar_t* x, const scalar_t* y, int64_t rows, int64_t n, acc_t* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const scalar_t* xr = x + r * n;
    const scalar_t* yr = y + r * n;
    acc_t acc = 0;
    for (int64_t j = 0; j < n; ++j) {
      acc = std::fma(static_cast<acc_t>(xr[j]), static_cast<acc_t>(yr[j]), acc);
    }
    out[r] = acc;
  }
}

template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void probabilities(scalar_t* s, int64_t ld, int64_t rows, int64_t cols, acc_t scale, int64_t causal_offset,
                   const bool* key_mask, const acc_t* lse) {
  for (int64_t i = 0; i < rows; ++i) {
    scalar_t* row = s + i * ld;
    const int64_t n = std::clamp<int64_t>(i + causal_offset + 1, 0, cols);
    if (lse[i] == std::numeric_limits<acc_t>::infinity()) {  // a row with no allowed key
      zero_fill(row, cols);
      continue;
    }
    if constexpr (std::is_same_v<scalar_t, acc_t>) {  // in place
      if (key_mask != nullptr) {
        mask_keys(row, n, key_mask);
      }
      exp_scaled_inplace(row, n, scale, lse[i]);
    } else {  // widened into a row of scratch on the stack per block of columns (free of allocation)
      constexpr int64_t kChunk = 256;
      acc_t buf[kChunk];
      for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
        const int64_t c = std::min(kChunk, n - c0);
        load_scaled(row + c0, c, acc_t(1), buf);
        if (key_mask != nullptr) {
          mask_keys<acc_t>(buf, c, key_mask + c0);
        }
        exp_scaled_to(buf, c, scale, lse[i], row + c0);
      }
    }
    zero_fill(row + n, cols - n);
  }
}

template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void score_grad(scalar_t* dp, const scalar_t* p, int64_t ld, int64_t rows, int64_t cols, acc_t scale,
                const acc_t* delta, int64_t delta_stride) {
  for (int64_t i = 0; i < rows; ++i) {
    scalar_t* d = dp + i * ld;
    const scalar_t* pi = p + i * ld;
    const acc_t di = delta[i * delta_stride];
    for (int64_t j = 0; j < cols; ++j) {
      d[j] = static_cast<scalar_t>(scale * static_cast<acc_t>(pi[j]) * (static_cast<acc_t>(d[j]) - di));
    }
  }
}

template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void round_to_input(const acc_t* x, int64_t ld, int64_t rows, int64_t cols, acc_t* out, int64_t ld_out) {
  TORCH_INTERNAL_ASSERT(out != x || ld_out == ld, "round_to_input: in place needs ld_out == ld");
  for (int64_t i = 0; i < rows; ++i) {
    const acc_t* row = x + i * ld;
    acc_t* dst = out + i * ld_out;
    if constexpr (std::is_same_v<scalar_t, acc_t>) {
      if (dst != row) {
        std::copy(row, row + cols, dst);
      }
    } else {
      constexpr int64_t W = Vec<float>::size();
      int64_t j = 0;
      for (; j + 2 * W <= cols; j += 2 * W) {
        const auto rounded = at::vec::convert_from_float<scalar_t>(Vec<float>::loadu(row + j), Vec<float>::loadu(row + j + W));
        const auto [lo, hi] = at::vec::convert_to_float<scalar_t>(rounded);
        lo.store(dst + j);
        hi.store(dst + j + W);
      }
      for (; j < cols; ++j) {
        dst[j] = static_cast<float>(static_cast<scalar_t>(row[j]));
      }
    }
  }
}

// Philox4x32-10 of kLanes consecutive first counter words c0 .. c0 + kLanes - 1 (the other words
// and the key shared), bit for bit philox::philox4x32_10, the four output words to out[0..3].
// AVX2 / AVX512: 32 x 32 -> 64-bit products of the even and the odd lanes (vpmuludq), then the
// high and low halves blended back into 32-bit lanes.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kLanes = 16;

inline __m512i mulhilo(__m512i a, __m512i m, __m512i& lo) {
  const __m512i even = _mm512_mul_epu32(a, m);                       // lanes 0, 2, ...: 64-bit products
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);  // lanes 1, 3, ...
  lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
  return _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
}

inline void philox_lanes(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1,
                         uint32_t* out[4]) {
  __m512i x0 = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(c0)),
                                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  __m512i x1 = _mm512_set1_epi32(static_cast<int>(c1));
  __m512i x2 = _mm512_set1_epi32(static_cast<int>(c2));
  __m512i x3 = _mm512_set1_epi32(static_cast<int>(c3));
  const __m512i m0 = _mm512_set1_epi32(static_cast<int>(philox::kM0));
  const __m512i m1 = _mm512_set1_epi32(static_cast<int>(philox::kM1));
  for (int round = 0; round < 10; ++round) {
    __m512i lo0, lo1;
    const __m512i hi0 = mulhilo(x0, m0, lo0);
    const __m512i hi1 = mulhilo(x2, m1, lo1);
    x0 = _mm512_xor_si512(_mm512_xor_si512(hi1, x1), _mm512_set1_epi32(static_cast<int>(k0)));
    x1 = lo1;
    x2 = _mm512_xor_si512(_mm512_xor_si512(hi0, x3), _mm512_set1_epi32(static_cast<int>(k1)));
    x3 = lo0;
    k0 += philox::kW0;
    k1 += philox::kW1;
  }
  _mm512_storeu_si512(out[0], x0);
  _mm512_storeu_si512(out[1], x1);
  _mm512_storeu_si512(out[2], x2);
  _mm512_storeu_si512(out[3], x3);
}
#elif defined(CPU_CAPABILITY_AVX2)
constexpr int64_t kLanes = 8;

inline __m256i mulhilo(__m256i a, __m256i m, __m256i& lo) {
  const __m256i even = _mm256_mul_epu32(a, m);                       // lanes 0, 2, ...: 64-bit products
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);  // lanes 1, 3, ...
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  return _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

inline void philox_lanes(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1,
                         uint32_t* out[4]) {
  __m256i x0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(c0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256i x1 = _mm256_set1_epi32(static_cast<int>(c1));
  __m256i x2 = _mm256_set1_epi32(static_cast<int>(c2));
  __m256i x3 = _mm256_set1_epi32(static_cast<int>(c3));
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(philox::kM0));
  const __m256i m1 = _mm256_set1_epi32(static_cast<int>(philox::kM1));
  for (int round = 0; round < 10; ++round) {
    __m256i lo0, lo1;
    const __m256i hi0 = mulhilo(x0, m0, lo0);
    const __m256i hi1 = mulhilo(x2, m1, lo1);
    x0 = _mm256_xor_si256(_mm256_xor_si256(hi1, x1), _mm256_set1_epi32(static_cast<int>(k0)));
    x1 = lo1;
    x2 = _mm256_xor_si256(_mm256_xor_si256(hi0, x3), _mm256_set1_epi32(static_cast<int>(k1)));
    x3 = lo0;
    k0 += philox::kW0;
    k1 += philox::kW1;
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[0]), x0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[1]), x1);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[2]), x2);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[3]), x3);
}
#else
constexpr int64_t kLanes = 1;

inline void philox_lanes(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1,
                         uint32_t* out[4]) {
  uint32_t words[4];
  philox::philox4x32_10(c0, c1, c2, c3, k0, k1, words);
  for (int w = 0; w < 4; ++w) {
    *out[w] = words[w];
  }
}
#endif

// Dropout of a tile: the Philox words of four query rows (one call) for a chunk of columns, then
// each row of that group of four (a branch-free, vectorised select).
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void dropout(acc_t* x, acc_t* y, int64_t ld, int64_t rows, int64_t cols, const philox::Dropout& d, uint64_t bh,
             int64_t row0, int64_t col0) {
  constexpr int64_t kChunk = 64;
  static_assert(kChunk % kLanes == 0);
  alignas(64) uint32_t bits[4][kChunk];
  const auto k0 = static_cast<uint32_t>(d.seed);
  const auto k1 = static_cast<uint32_t>(d.seed >> 32);
  const auto c2 = static_cast<uint32_t>(bh);
  const auto c3 = static_cast<uint32_t>(bh >> 32);
  const uint32_t threshold = d.threshold;
  const auto keep_scale = static_cast<acc_t>(d.keep_scale);
  for (int64_t i = 0; i < rows;) {
    const int64_t group = (row0 + i) >> 2;                        // query rows 4 * group .. 4 * group + 3
    const int64_t i_end = std::min(rows, 4 * (group + 1) - row0);  // this tile's rows of the group
    for (int64_t j0 = 0; j0 < cols; j0 += kChunk) {
      const int64_t n = std::min(kChunk, cols - j0);
      for (int64_t jj = 0; jj < n; jj += kLanes) {
        uint32_t* out[4] = {bits[0] + jj, bits[1] + jj, bits[2] + jj, bits[3] + jj};
        philox_lanes(static_cast<uint32_t>(col0 + j0 + jj), static_cast<uint32_t>(group), c2, c3, k0, k1, out);
      }
      for (int64_t r = i; r < i_end; ++r) {
        const uint32_t* word = bits[(row0 + r) & 3];
        acc_t* xr = x + r * ld + j0;
        for (int64_t jj = 0; jj < n; ++jj) {
          xr[jj] = word[jj] >= threshold ? xr[jj] * keep_scale : acc_t(0);
        }
        if (y != nullptr) {
          acc_t* yr = y + r * ld + j0;
          for (int64_t jj = 0; jj < n; ++jj) {
            yr[jj] = word[jj] >= threshold ? yr[jj] * keep_scale : acc_t(0);
          }
        }
      }
    }
    i = i_end;
  }
}

// W values of src as acc_t: a plain load, or bfloat16/half widened to float32.
template <typename acc_t, typename scalar_t>
inline Vec<acc_t> load_acc(const scalar_t* src) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return Vec<acc_t>::loadu(src);
  } else {
    static_assert(kReduced<scalar_t> && std::is_same_v<acc_t, float>);
    return load_widened(src);
  }
}

// s[r] = sum_d a[d] * b[r * ld + d] for r < R: a (acc_t) is read once for R rows of b (scalar_t;
// bfloat16/half widened in registers). Each row sums its products in W lanes of acc_t (float32 for
// bfloat16/half), then across the lanes; a scalar tail past the last whole vector.
template <int R, typename scalar_t, typename acc_t>
inline void dot_rows(const acc_t* a, const scalar_t* b, int64_t ld, int64_t hd, acc_t* s) {
  int64_t d = 0;
  acc_t sum[R] = {};
  if constexpr (std::is_same_v<scalar_t, acc_t> || kReduced<scalar_t>) {
    constexpr int64_t W = Vec<acc_t>::size();
    if (hd >= W) {
      Vec<acc_t> acc[R];
      for (int r = 0; r < R; ++r) {
        acc[r] = Vec<acc_t>(0);
      }
      for (; d + W <= hd; d += W) {
        const Vec<acc_t> va = Vec<acc_t>::loadu(a + d);
        for (int r = 0; r < R; ++r) {
          acc[r] = at::vec::fmadd(va, load_acc<acc_t>(b + r * ld + d), acc[r]);
        }
      }
      for (int r = 0; r < R; ++r) {
        sum[r] = at::vec::vec_reduce_all<acc_t>(std::plus<Vec<acc_t>>(), acc[r]);
      }
    }
  }
  for (; d < hd; ++d) {
    for (int r = 0; r < R; ++r) {
      sum[r] += a[d] * static_cast<acc_t>(b[r * ld + d]);
    }
  }
  for (int r = 0; r < R; ++r) {
    s[r] = sum[r];
  }
}

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
constexpr bool kBlockDots = true;

// Lane r of the result = the sum of the W lanes of a[r], r < W: the W vectors transposed and added
// in a tree (log2 W steps of shuffles and adds for all W sums at once, instead of a reduction per
// vector).
#if defined(CPU_CAPABILITY_AVX512)
// (The all-lanes masked forms: GCC 12 warns of an uninitialized variable inside the unmasked ones.)
inline __m512 unpacklo(__m512 x, __m512 y) { return _mm512_mask_unpacklo_ps(x, 0xFFFF, x, y); }
inline __m512 unpackhi(__m512 x, __m512 y) { return _mm512_mask_unpackhi_ps(x, 0xFFFF, x, y); }
inline __m512d unpacklo(__m512d x, __m512d y) { return _mm512_mask_unpacklo_pd(x, 0xFF, x, y); }
inline __m512d unpackhi(__m512d x, __m512d y) { return _mm512_mask_unpackhi_pd(x, 0xFF, x, y); }
template <int kImm>
inline __m512 shuffle128(__m512 x, __m512 y) { return _mm512_mask_shuffle_f32x4(x, 0xFFFF, x, y, kImm); }

inline Vec<float> sum_lanes(const Vec<float> (&a)[16]) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) {  // b[i]: per 128-bit lane, two partial sums each of a[2i] and a[2i + 1]
    const __m512 x = a[2 * i], y = a[2 * i + 1];
    b[i] = _mm512_add_ps(unpacklo(x, y), unpackhi(x, y));
  }
  for (int i = 0; i < 4; ++i) {  // c[i]: per 128-bit lane, one partial sum each of a[4i .. 4i + 3]
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(unpacklo(x, y)), _mm512_castpd_ps(unpackhi(x, y)));
  }
  for (int i = 0; i < 2; ++i) {  // d[i]: 128-bit lanes (c[2i] lanes 0+1, 2+3, c[2i+1] lanes 0+1, 2+3)
    d[i] = _mm512_add_ps(shuffle128<0x88>(c[2 * i], c[2 * i + 1]), shuffle128<0xdd>(c[2 * i], c[2 * i + 1]));
  }
  return _mm512_add_ps(shuffle128<0x88>(d[0], d[1]), shuffle128<0xdd>(d[0], d[1]));
}
#else
inline Vec<float> sum_lanes(const Vec<float> (&a)[8]) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // 128-bit halves: a[0..3] / a[4..7]
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

// s[r] = sum_d a[d] * b[r * ld + d] for the W = Vec<float>::size() rows r < W of b (float32, or
// bfloat16/half widened in registers): row by row (so memory is read in address order), each row
// sums its products in W lanes, sum_lanes adds the W rows' lanes at once, then a scalar tail past the
// last whole vector.
template <typename scalar_t>
inline void dot_block(const float* a, const scalar_t* b, int64_t ld, int64_t hd, float* s) {
  constexpr int W = Vec<float>::size();
  const int64_t whole = hd / W * W;
  Vec<float> acc[W];
  for (int r = 0; r < W; ++r) {
    const scalar_t* row = b + r * ld;
    Vec<float> sum(0.f);
    for (int64_t d = 0; d < whole; d += W) {
      sum = at::vec::fmadd(Vec<float>::loadu(a + d), load_acc<float>(row + d), sum);
    }
    acc[r] = sum;
  }
  sum_lanes(acc).store(s);
  for (int64_t d = whole; d < hd; ++d) {
    for (int r = 0; r < W; ++r) {
      s[r] += a[d] * static_cast<float>(b[r * ld + d]);
    }
  }
}
#else
constexpr bool kBlockDots = false;
#endif

// o[u * W + w] = o[.] * alpha + sum_j p[j] * v[j * ld + u * W + w] for u < U: U vectors of o stay in
// registers while the n value rows stream past once (bfloat16/half widened in registers). Where the
// registers allow, the even and the odd j sum in two chains, added at the end: a chain of dependent
// fused multiply-adds waits their latency for every row, two halve that wait.
template <int U, typename scalar_t, typename acc_t>
inline void weighted_block(const acc_t* p, const scalar_t* v, int64_t ld, int64_t n, acc_t alpha, acc_t* o) {
  constexpr int64_t W = Vec<acc_t>::size();
  constexpr int kChains = 2 * U <= W ? 2 : 1;  // 2U accumulators: up to 8 of AVX2's 16 registers, 16 of AVX512's 32
  const Vec<acc_t> valpha(alpha);
  Vec<acc_t> acc[kChains][U];
  for (int u = 0; u < U; ++u) {
    acc[0][u] = Vec<acc_t>::loadu(o + u * W) * valpha;
    if constexpr (kChains == 2) {
      acc[1][u] = Vec<acc_t>(0);
    }
  }
  int64_t j = 0;
  for (; j + kChains <= n; j += kChains) {
    for (int c = 0; c < kChains; ++c) {
      const Vec<acc_t> pj(p[j + c]);
      const scalar_t* row = v + (j + c) * ld;
      for (int u = 0; u < U; ++u) {
        acc[c][u] = at::vec::fmadd(pj, load_acc<acc_t>(row + u * W), acc[c][u]);
      }
    }
  }
  for (; j < n; ++j) {
    const Vec<acc_t> pj(p[j]);
    const scalar_t* row = v + j * ld;
    for (int u = 0; u < U; ++u) {
      acc[0][u] = at::vec::fmadd(pj, load_acc<acc_t>(row + u * W), acc[0][u]);
    }
  }
  for (int u = 0; u < U; ++u) {
    if constexpr (kChains == 2) {
      acc[0][u] = acc[0][u] + acc[1][u];
    }
    acc[0][u].store(o + u * W);
  }
}

// o[d] = o[d] * alpha + sum_j p[j] * v[j * ld + d]: blocks of up to 8 vectors of o (hd = 64 is one
// block on AVX2 and AVX512), so each value row is read once per query; a scalar tail past them.
template <typename scalar_t, typename acc_t>
inline void weighted_rows(const acc_t* p, const scalar_t* v, int64_t ld, int64_t n, int64_t hd, acc_t alpha,
                          acc_t* o) {
  int64_t d0 = 0;
  if constexpr (std::is_same_v<scalar_t, acc_t> || kReduced<scalar_t>) {
    constexpr int64_t W = Vec<acc_t>::size();
    for (; d0 + 8 * W <= hd; d0 += 8 * W) {
      weighted_block<8>(p, v + d0, ld, n, alpha, o + d0);
    }
    if (d0 + 4 * W <= hd) {
      weighted_block<4>(p, v + d0, ld, n, alpha, o + d0);
      d0 += 4 * W;
    }
    if (d0 + 2 * W <= hd) {
      weighted_block<2>(p, v + d0, ld, n, alpha, o + d0);
      d0 += 2 * W;
    }
    if (d0 + W <= hd) {
      weighted_block<1>(p, v + d0, ld, n, alpha, o + d0);
      d0 += W;
    }
  }
  for (int64_t d = d0; d < hd; ++d) {
    acc_t acc = o[d] * alpha;
    for (int64_t j = 0; j < n; ++j) {
      acc += p[j] * static_cast<acc_t>(v[j * ld + d]);
    }
    o[d] = acc;
  }
}

// Asks for rows r of x (each `bytes` long, ld elements apart) to be brought into L1 (prefetcht0); a
// hint, it never faults.
template <typename scalar_t>
inline void prefetch_rows(const scalar_t* x, int64_t ld, int64_t rows, int64_t bytes) {
  for (int64_t r = 0; r < rows; ++r) {
    const char* row = reinterpret_cast<const char*>(x + r * ld);
    for (int64_t b = 0; b < bytes; b += 64) {
      __builtin_prefetch(row + b, 0, 3);
    }
  }
}

// Each query row's scores over the chunk's keys (one pass over the keys), its softmax update, then
// its weighted sum of the values (one pass over the values). No software prefetch: each pass reads
// its rows in address order, which the hardware's stream prefetchers follow. Asking for a chunk's
// values into L2 during its key pass (and, in float32, for the next chunk's during its value pass)
// had paid while the kernel was compute bound (0.86 -> 0.94 of `sum`'s rate) and on 4 KB pages;
// once the cache sat on huge pages, the two plain passes took less time. Float32, B=8, ctx 2048,
// 12 heads of 64, 2 threads, each call after a 64 MB read, op / torch.sum over K and V (medians of
// 25 rounds, one process): 1.018-1.078 with no hint against 1.095-1.110 with both (3 processes);
// context 8192 1.029 against 1.058; bfloat16 0.968 against 1.022, half 0.965 against 1.000; on
// 4 KB pages 1.051-1.088 against 1.055-1.146; one thread 1.21 against 1.39. Asking for only the
// first 2-32 KB of the values before the softmax (to start their stream early) changed nothing.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void decode_chunk(const acc_t* q, int64_t rows, const scalar_t* k, const scalar_t* v, int64_t ld, int64_t n,
                  int64_t hd, acc_t scale, int64_t causal_offset, acc_t* m, acc_t* l, acc_t* o, acc_t* buf) {
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t visible = std::clamp<int64_t>(i + causal_offset + 1, 0, n);
    if (visible == 0) {
      continue;
    }
    constexpr int kKeys = 8;  // keys per pass over the query row
    int64_t j = 0;
    if constexpr (kBlockDots && std::is_same_v<acc_t, float>) {
      constexpr int64_t W = Vec<float>::size();  // keys per block
      for (; j + W <= visible; j += W) {
        dot_block(q + i * hd, k + j * ld, ld, hd, buf + j);
      }
    }
    for (; j + kKeys <= visible; j += kKeys) {
      dot_rows<kKeys>(q + i * hd, k + j * ld, ld, hd, buf + j);
    }
    for (; j < visible; ++j) {
      dot_rows<1>(q + i * hd, k + j * ld, ld, hd, buf + j);
    }
    const acc_t m_new = std::max(scale * max_of(buf, visible), m[i]);  // a NaN score stays (NaN out)
    const acc_t alpha = std::exp(m[i] - m_new);  // 0 when m[i] = -inf
    l[i] = l[i] * alpha + exp_scaled_inplace(buf, visible, scale, m_new);
    m[i] = m_new;
    weighted_rows(buf, v, ld, visible, hd, alpha, o + i * hd);
  }
}

// Keeps v in a register (AVX-512, whose 32 registers hold the linear block's x vectors and
// accumulators). Without it GCC folds a vector loaded once and used RO times into each fused
// multiply-add's memory operand, and Zen 4 runs such FMAs at half the rate: the linear block
// below went from 1.6 to 3.0 G FMA/s per core when its x vectors stayed in registers. (With
// AVX2's 16 registers the x vectors would spill: there the memory operands stay.)
template <typename acc_t>
inline void keep_in_register([[maybe_unused]] Vec<acc_t>& v) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<acc_t, float>) {
    __m512 r = v;
    __asm__("" : "+v"(r));
    v = r;
  }
#endif
}

// s[i * RO + r] = x[i] . w[r] for RM rows of x (acc_t) and RO rows of w, each dot product summed
// as dot_rows sums it (lane-wise in k order, then across lanes, then the scalar tail): RM x RO
// accumulators in registers. Each step loads the RM x vectors once, then each weight vector once
// and feeds it to RM fused multiply-adds. Meanwhile `lines` cache lines from pf are prefetched
// into L2, spread evenly over the pass.
template <int RM, int RO, typename scalar_t, typename acc_t>
inline void linear_block(const acc_t* x, const scalar_t* w, int64_t in, acc_t* s, const char* pf, int64_t lines) {
  acc_t sum[RM][RO] = {};
  int64_t d = 0;
  int64_t line = 0;
  if constexpr (std::is_same_v<scalar_t, acc_t> || kReduced<scalar_t>) {
    constexpr int64_t W = Vec<acc_t>::size();
    const int64_t steps = in / W;
    if (steps > 0) {
      Vec<acc_t> acc[RM][RO];
      for (int i = 0; i < RM; ++i) {
        for (int r = 0; r < RO; ++r) {
          acc[i][r] = Vec<acc_t>(0);
        }
      }
      int64_t owed = 0;  // Bresenham: `lines` prefetches over `steps` steps
      for (int64_t step = 0; step < steps; ++step, d += W) {
        for (owed += lines; owed >= steps; owed -= steps, ++line) {
          __builtin_prefetch(pf + 64 * line, 0, 2);  // prefetcht1: into L2
        }
        Vec<acc_t> xv[RM];
        for (int i = 0; i < RM; ++i) {
          xv[i] = Vec<acc_t>::loadu(x + i * in + d);
          keep_in_register(xv[i]);
        }
        for (int r = 0; r < RO; ++r) {
          const Vec<acc_t> wv = load_acc<acc_t>(w + r * in + d);
          for (int i = 0; i < RM; ++i) {
            acc[i][r] = at::vec::fmadd(xv[i], wv, acc[i][r]);
          }
        }
      }
      for (int i = 0; i < RM; ++i) {
        for (int r = 0; r < RO; ++r) {
          sum[i][r] = at::vec::vec_reduce_all<acc_t>(std::plus<Vec<acc_t>>(), acc[i][r]);
        }
      }
    }
  }
  for (; line < lines; ++line) {
    __builtin_prefetch(pf + 64 * line, 0, 2);
  }
  // The scalar tail, rounded the same way in every block shape: GCC contracts a * b + c into a fused
  // multiply-add where it vectorises (-ffp-contract=fast, its C++ default), which it did for some
  // RM x RO blocks and not others, so an output's bits depended on the block that computed it (a
  // range of output features may start anywhere: FewRowsProduct promises the same bits). An
  // explicit fused multiply-add where the build has one; a multiply and an add, never contracted,
  // where it has not.
  for (; d < in; ++d) {
    for (int i = 0; i < RM; ++i) {
      for (int r = 0; r < RO; ++r) {
#if defined(__FMA__)
        sum[i][r] = std::fma(x[i * in + d], static_cast<acc_t>(w[r * in + d]), sum[i][r]);
#else
        sum[i][r] += x[i * in + d] * static_cast<acc_t>(w[r * in + d]);
#endif
      }
    }
  }
  for (int i = 0; i < RM; ++i) {
    for (int r = 0; r < RO; ++r) {
      s[i * RO + r] = sum[i][r];
    }
  }
}

// Input rows per pass over a block of weight rows: 8 where there are 32 vector registers (8 x
// vectors + 8 x 3 accumulators, all but one in registers; the weight is then read once for up to 8
// rows), 4 with AVX2's 16 and in the DEFAULT build (on Zen 3 the 8-row block spilled and streamed at
// 16 GB/s against 20 for 4 rows).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kLinearRows = 8;
#else
constexpr int kLinearRows = 4;
#endif

// The block kernel of linear_rows: fused multiply-adds on x widened to acc_t (linear_block, every
// build); the AVX512 build also has pairs of bfloat16 (PairBlock) for CPUs with AVX512-BF16.
struct FmaBlock {
  template <int RM, int RO, typename scalar_t, typename acc_t>
  static void run(const acc_t* x, const scalar_t* w, int64_t in, acc_t* s, const char* pf, int64_t lines) {
    linear_block<RM, RO>(x, w, in, s, pf, lines);
  }
};

// The RO weight rows at w against every row of x, in blocks of kLinearRows, then 4, 2 and 1 rows (each
// by Block::run); the pf_lines cache lines from pf are prefetched over the blocks, in proportion to
// their rows.
template <int RO, typename Block, typename x_t, typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void linear_rows_block(const x_t* x, int64_t rows, int64_t in, const scalar_t* w, const scalar_t* bias, int64_t o,
                       scalar_t* y, int64_t ld_y, const char* pf, int64_t pf_lines) {
  acc_t s[kLinearRows * RO];
  int64_t done = 0;  // lines prefetched so far
  const auto run = [&](auto rm, int64_t m) {
    constexpr int RM = decltype(rm)::value;
    const int64_t lines = pf_lines * (m + RM) / rows - done;
    Block::template run<RM, RO>(x + m * in, w, in, s, pf + 64 * done, lines);
    done += lines;
    for (int i = 0; i < RM; ++i) {
      for (int r = 0; r < RO; ++r) {
        const acc_t b = bias == nullptr ? acc_t(0) : static_cast<acc_t>(bias[o + r]);
        y[(m + i) * ld_y + o + r] = static_cast<scalar_t>(s[i * RO + r] + b);
      }
    }
  };
  int64_t m = 0;
  for (; m + kLinearRows <= rows; m += kLinearRows) {
    run(std::integral_constant<int, kLinearRows>{}, m);
  }
  if constexpr (kLinearRows > 4) {
    for (; m + 4 <= rows; m += 4) {
      run(std::integral_constant<int, 4>{}, m);
    }
  }
  for (; m + 2 <= rows; m += 2) {
    run(std::integral_constant<int, 2>{}, m);
  }
  for (; m < rows; ++m) {
    run(std::integral_constant<int, 1>{}, m);
  }
}

// linear_rows of tile_ops.h with Block's kernel on x's rows (acc_t for FmaBlock, bfloat16 for PairBlock).
template <typename scalar_t, typename Block = FmaBlock, typename x_t = at::opmath_type<scalar_t>>
void linear_rows(const x_t* x, int64_t rows, int64_t in, const scalar_t* w, const scalar_t* bias, int64_t o0,
                 int64_t o1, scalar_t* y, int64_t ld_y) {
  // 3 weight rows per block; the rows of the block about kAheadBytes ahead are prefetched into L2
  // meanwhile, so that memory streams while the FMAs work (into L1 they streamed at 0.5-0.6 of
  // torch's sum). How far ahead, measured on Zen 4 (the decode bench's qkv, 8 x 768 by 2304 x 768,
  // and proj, by 768 x 768, weight from memory, 2 threads, medians of 40 interleaved calls each
  // after a 64 MB read, three processes): float32 qkv 0.33 / 0.29 / 0.29 / 0.28 ms at 2 / 4 / 6 / 8
  // blocks (18 / 36 / 54 / 72 KB) ahead, proj 0.13 / 0.12 / 0.12 / 0.12; bfloat16 qkv 0.21 / 0.17
  // / 0.17 / 0.17 at 2 / 4 / 6 / 11 blocks; one row 0.31-0.36 / 0.27-0.32 / 0.26-0.30 at 2 / 4 / 6.
  constexpr int kOut = 3;
  constexpr int64_t kAheadBytes = 48 * 1024;
  const int64_t block_bytes = kOut * in * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t ahead = std::max<int64_t>(2, (kAheadBytes + block_bytes - 1) / std::max<int64_t>(block_bytes, 1));
  // The cache lines of w's rows [first, first + count) within [o0, o1): from the line of their
  // first byte to the line of their last; none when the range is empty.
  const auto lines_of = [&](int64_t first, int64_t count) -> std::pair<const char*, int64_t> {
    const int64_t last = std::min(first + count, o1);
    if (first >= last || in == 0) {  // (in == 0: rows of no bytes)
      return {nullptr, 0};
    }
    const auto begin = reinterpret_cast<uintptr_t>(w + first * in) & ~uintptr_t(63);
    const auto end = (reinterpret_cast<uintptr_t>(w + last * in) - 1) & ~uintptr_t(63);
    return {reinterpret_cast<const char*>(begin), static_cast<int64_t>((end - begin) / 64 + 1)};
  };
  const auto [first_lines, n_first] = lines_of(o0, ahead * kOut);
  for (int64_t line = 0; line < n_first; ++line) {
    __builtin_prefetch(first_lines + 64 * line, 0, 2);
  }
  int64_t o = o0;
  for (; o + kOut <= o1; o += kOut) {
    const auto [pf, lines] = lines_of(o + ahead * kOut, kOut);
    linear_rows_block<kOut, Block>(x, rows, in, w + o * in, bias, o, y, ld_y, pf, lines);
  }
  for (; o < o1; ++o) {
    linear_rows_block<1, Block>(x, rows, in, w + o * in, bias, o, y, ld_y, nullptr, 0);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// ---- The bfloat16 pair micro-kernel (AVX512-BF16) --------------------------------------------------
// vdpbf16ps adds, in each float32 lane, the two products of a pair of bfloat16 (exact in float32) to
// the running sum. A pair is two consecutive bfloat16 in memory, read as one 32-bit lane.
#define CA_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// The pair at x broadcast to every lane.
CA_BF16_TARGET inline __m512i broadcast_pair(const c10::BFloat16* x) {
  uint32_t pair;
  std::memcpy(&pair, x, sizeof(pair));
  return _mm512_set1_epi32(static_cast<int>(pair));
}

// The first `count` of 16 lanes (count clamped to [0, 16]).
inline __mmask16 lanes16(int64_t count) {
  return count >= 16 ? __mmask16(0xFFFF) : count <= 0 ? __mmask16(0) : __mmask16((1u << count) - 1);
}

// Pairs of lo[j] and hi[j] (16 bfloat16 each, as bits): lane j = lo[j] | hi[j] << 16.
CA_BF16_TARGET inline __m512i interleave16(__m256i lo, __m256i hi) {
  return _mm512_or_si512(_mm512_cvtepu16_epi32(lo), _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
}

// R rows of C against NP (1 or 2) panels of B, kPanel columns each (mask0 / mask1: the real ones), over
// k2 pairs: R x NP float32 accumulators, each B vector feeding R products, each A pair NP.
template <int R, int NP, bool kAccumulate>
CA_BF16_TARGET inline void pair_block(int64_t k2, const c10::BFloat16* a, int64_t rs_a, int64_t cs_a,
                                      const c10::BFloat16* b, int64_t ld_b, int64_t ps_b, float* c, int64_t ldc,
                                      __mmask16 mask0, __mmask16 mask1) {
  __m512 acc[R][NP];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int q = 0; q < NP; ++q) {
      acc[r][q] = kAccumulate ? _mm512_maskz_loadu_ps(q == 0 ? mask0 : mask1, c + r * ldc + q * kPanel)
                              : _mm512_setzero_ps();
    }
  }
  for (int64_t p = 0; p < k2; ++p) {
    __m512bh bv[NP];
#pragma GCC unroll 2
    for (int q = 0; q < NP; ++q) {
      bv[q] = (__m512bh)_mm512_loadu_si512(b + q * ps_b + p * ld_b);
    }
    const c10::BFloat16* ap = a + p * cs_a;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh av = (__m512bh)broadcast_pair(ap + r * rs_a);
#pragma GCC unroll 2
      for (int q = 0; q < NP; ++q) {
        acc[r][q] = _mm512_dpbf16_ps(acc[r][q], av, bv[q]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int q = 0; q < NP; ++q) {
      _mm512_mask_storeu_ps(c + r * ldc + q * kPanel, q == 0 ? mask0 : mask1, acc[r][q]);
    }
  }
}

// pair_block as the zmm drivers (zmm_rows, zmm_gemm) call it: A pairs, B pair panels (ld_b = 2 kPanel).
struct PairBlocks {
  using A = c10::BFloat16;
  using B = c10::BFloat16;
  template <int R, int NP, bool kAccumulate>
  static void block(int64_t k2, const A* a, int64_t rs_a, int64_t cs_a, const B* b, int64_t ld_b, int64_t ps_b,
                    float* c, int64_t ldc, __mmask16 mask0, __mmask16 mask1) {
    pair_block<R, NP, kAccumulate>(k2, a, rs_a, cs_a, b, ld_b, ps_b, c, ldc, mask0, mask1);
  }
};

// dst[c * 2 kPanel ..] = the 32-bit lane c of rows[0..16) (a 16 x 16 transpose of 32-bit values): rows
// are 16 keys' 16 pairs, the result 16 panel rows of pairs.
CA_BF16_TARGET inline void transpose_16x16_epi32(const __m512i (&r)[16], c10::BFloat16* dst) {
  __m512i t[16];
  __m512i u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + c], 128-bit lane L: rows 4i..4i+3 of column 4L + c
    u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);  // lanes 0 and 2 of each
    const __m512i x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);  // lanes 1 and 3
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i y1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    _mm512_storeu_si512(dst + (c + 0) * 2 * kPanel, _mm512_shuffle_i32x4(x0, y0, 0x88));
    _mm512_storeu_si512(dst + (c + 4) * 2 * kPanel, _mm512_shuffle_i32x4(x1, y1, 0x88));
    _mm512_storeu_si512(dst + (c + 8) * 2 * kPanel, _mm512_shuffle_i32x4(x0, y0, 0xDD));
    _mm512_storeu_si512(dst + (c + 12) * 2 * kPanel, _mm512_shuffle_i32x4(x1, y1, 0xDD));
  }
}

// Row pairs ahead of the one pair_panels' row path packs, asked into L1 meanwhile: its rows (of qkv,
// or of dO) sit thousands of bytes apart (a qkv row of dim 768 in bfloat16: 4.5 KB), each a miss of
// its own that the hardware prefetchers do not see coming.
inline constexpr int64_t kPairsAhead = 8;

// B (k x n, element (kk, j) = src[kk * rs + j * cs]) as pairs along k in panels of kPanel columns: pair
// (p, j) = (B(2p, j), B(2p + 1, j)) at dst[(j / kPanel) * ps + p * 2 * kPanel + 2 * (j % kPanel)], ps =
// 2 * ceil(k / 2) * kPanel; zero past n and, for an odd k, in the last pair's second half.
CA_BF16_TARGET void pair_panels(const c10::BFloat16* src, int64_t rs, int64_t cs, int64_t k, int64_t n,
                                c10::BFloat16* dst) {
  const int64_t k2 = (k + 1) / 2;
  const int64_t ps = 2 * k2 * kPanel;
  int64_t whole = 0;  // columns in whole panels done by a vector path
  if (cs == 1 && n >= kPanel) {
    // B's rows: two rows' 16 values interleaved, a pair of rows at a time across every whole panel,
    // so that each row is read once, from start to end.
    whole = n / kPanel * kPanel;
    for (int64_t p = 0; p < k2; ++p) {
      const c10::BFloat16* row0 = src + 2 * p * rs;
      const bool second = 2 * p + 1 < k;
      const int64_t ahead = 2 * (p + kPairsAhead);  // the pair's first row
      if (ahead < k) {
        prefetch_rows(src + ahead * rs, rs, std::min<int64_t>(2, k - ahead),
                         whole * static_cast<int64_t>(sizeof(c10::BFloat16)));
      }
      for (int64_t j0 = 0; j0 < whole; j0 += kPanel) {
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row0 + j0));
        const __m256i hi = second ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row0 + rs + j0))
                                  : _mm256_setzero_si256();
        _mm512_storeu_si512(dst + (j0 / kPanel) * ps + p * 2 * kPanel, interleave16(lo, hi));
      }
    }
  }
  for (int64_t j0 = whole; j0 < n; j0 += kPanel) {
    c10::BFloat16* panel = dst + (j0 / kPanel) * ps;
    const int64_t width = std::min(kPanel, n - j0);
    int64_t p0 = 0;
    if (rs == 1 && width == kPanel) {  // B's columns (keys as rows): their pairs are adjacent already
      // The next panel's 16 rows, asked for now (rows far apart, as for the row path above).
      if (j0 + 2 * kPanel <= n) {
        prefetch_rows(src + (j0 + kPanel) * cs, cs, kPanel, k * static_cast<int64_t>(sizeof(c10::BFloat16)));
      }
      for (; 2 * (p0 + 16) <= k; p0 += 16) {  // 16 keys x 16 pairs at a time, transposed in registers
        __m512i r[16];
        for (int j = 0; j < 16; ++j) {
          r[j] = _mm512_loadu_si512(src + (j0 + j) * cs + 2 * p0);
        }
        transpose_16x16_epi32(r, panel + p0 * 2 * kPanel);
      }
    }
    // Element by element: the rest.
    for (int64_t j = 0; j < kPanel; ++j) {
      const c10::BFloat16* col = j < width ? src + (j0 + j) * cs : nullptr;
      for (int64_t p = p0; p < k2; ++p) {
        c10::BFloat16* pair = panel + p * 2 * kPanel + 2 * j;
        pair[0] = col != nullptr ? col[2 * p * rs] : c10::BFloat16(0.0f);
        pair[1] = col != nullptr && 2 * p + 1 < k ? col[(2 * p + 1) * rs] : c10::BFloat16(0.0f);
      }
    }
  }
}

// The row pairs of a rows x cols float32 tile whose values come from value(i, j) (W of them from j)
// and value1(i, j) (one), rounded to bfloat16 as PairRounding rounds (vcvtne2ps2bf16), written as
// pair_gemm's transposed A (round_pairs_transposed's layout at dst_t, ld_t; an odd rows' last pair
// completed with 0) and, where dst_rows is not nullptr, as rows (ld_rows; an odd cols' pad column zeroed).
template <typename Value, typename Value1>
CA_BF16_TARGET inline void round_row_pairs(int64_t rows, int64_t cols, const Value& value, const Value1& value1,
                                           c10::BFloat16* dst_t, int64_t ld_t, c10::BFloat16* dst_rows,
                                           int64_t ld_rows) {
  constexpr int64_t W = Vec<float>::size();  // 16
  // 16-bit lane 2j of the pairs takes lane j of the first half, lane 2j + 1 lane j of the second.
  const __m512i pairs_of_halves = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                   22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t q = 0; q < (rows + 1) / 2; ++q) {
    const int64_t i = 2 * q;
    const bool pair = i + 1 < rows;  // else row i + 1 is the pad: 0 there
    c10::BFloat16* out_t = dst_t + q * ld_t;
    c10::BFloat16* out0 = dst_rows == nullptr ? nullptr : dst_rows + i * ld_rows;
    int64_t j = 0;
    for (; j + W <= cols; j += W) {
      const Vec<float> hi = pair ? value(i + 1, j) : Vec<float>(0.0f);
      const auto both = (__m512i)_mm512_cvtne2ps_pbh(hi, value(i, j));  // row i's 16, then i + 1's
      const __m256i lo16 = _mm512_castsi512_si256(both);
      const __m256i hi16 = _mm512_extracti64x4_epi64(both, 1);
      _mm512_storeu_si512(out_t + 2 * j, _mm512_permutexvar_epi16(pairs_of_halves, both));
      if (out0 != nullptr) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out0 + j), lo16);
        if (pair) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out0 + ld_rows + j), hi16);
        }
      }
    }
    for (; j < cols; ++j) {
      const auto lo = round_pair_value(value1(i, j));
      const auto hi = pair ? round_pair_value(value1(i + 1, j)) : c10::BFloat16(0.0f);
      out_t[2 * j] = lo;
      out_t[2 * j + 1] = hi;
      if (out0 != nullptr) {
        out0[j] = lo;
        if (pair) {
          out0[ld_rows + j] = hi;
        }
      }
    }
    if (out0 != nullptr && cols % 2 != 0) {
      out0[cols] = c10::BFloat16(0.0f);
      if (pair) {
        out0[ld_rows + cols] = c10::BFloat16(0.0f);
      }
    }
  }
}

// The transposed operand A = x^T (cols x rows) of a float32 tile x (rows x cols, ld) as pairs along
// x's rows, rounded to bfloat16 as PairRounding rounds: pair (j, p) = (x[2p][j], x[2p + 1][j]) at dst + p * ld_dst
// + 2j (the second half 0 for an odd rows' last pair). ld_dst >= 2 cols.
CA_BF16_TARGET void round_pairs_transposed(const float* x, int64_t ld, int64_t rows, int64_t cols,
                                           c10::BFloat16* dst, int64_t ld_dst) {
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY(ld_dst >= 2 * cols);
  round_row_pairs(
      rows, cols, [&](int64_t i, int64_t j) { return Vec<float>::loadu(x + i * ld + j); },
      [&](int64_t i, int64_t j) { return x[i * ld + j]; }, dst, ld_dst, nullptr, 0);
}

// One step of pair_linear_block: the 32 values from d of RM x rows and RO weight rows (those outside
// `mask` read as 0) into the accumulators.
template <int RM, int RO>
CA_BF16_TARGET inline void pair_linear_step(const c10::BFloat16* x, const c10::BFloat16* w, int64_t in, int64_t d,
                                            __mmask32 mask, __m512 (&acc)[RM][RO]) {
  __m512i xv[RM];
#pragma GCC unroll 8
  for (int i = 0; i < RM; ++i) {
    xv[i] = _mm512_maskz_loadu_epi16(mask, x + i * in + d);
    __asm__("" : "+v"(xv[i]));  // in a register: see keep_in_register
  }
#pragma GCC unroll 8
  for (int r = 0; r < RO; ++r) {
    const __m512i wv = _mm512_maskz_loadu_epi16(mask, w + r * in + d);
#pragma GCC unroll 8
    for (int i = 0; i < RM; ++i) {
      acc[i][r] = _mm512_dpbf16_ps(acc[i][r], (__m512bh)xv[i], (__m512bh)wv);
    }
  }
}

// out[i][r]: float32 lanes that add up to x[i] . w[r], for RM rows of x and RO rows of w, all
// bfloat16: 32 values (16 pairs) a step, each vdpbf16ps adding a pair's two products (exact in float32)
// to a lane's sum, the last step's values past `in` loaded as 0. Half the instructions of widening the
// weights for float32 fused multiply-adds, which left the 8 rows of a decode step compute bound. (8 x 3:
// the 8 x vectors, 24 accumulators and a weight vector are one more than the 32 registers, so GCC keeps
// one accumulator on the stack; 8 x 2 was slower.) Meanwhile `lines` cache lines from pf are prefetched
// into L2, spread evenly over the pass.
template <int RM, int RO>
CA_BF16_TARGET void pair_linear_block(const c10::BFloat16* x, const c10::BFloat16* w, int64_t in,
                                      __m512 (&out)[RM][RO], const char* pf, int64_t lines) {
  constexpr int64_t kStep = 32;
  __m512 acc[RM][RO];  // local, so that they stay in registers (out is memory)
#pragma GCC unroll 8
  for (int i = 0; i < RM; ++i) {
#pragma GCC unroll 8
    for (int r = 0; r < RO; ++r) {
      acc[i][r] = _mm512_setzero_ps();
    }
  }
  const int64_t steps = (in + kStep - 1) / kStep;
  int64_t line = 0;
  int64_t owed = 0;  // Bresenham: `lines` prefetches over `steps` steps
  for (int64_t d = 0; d < in; d += kStep) {
    for (owed += lines; owed >= steps; owed -= steps, ++line) {
      __builtin_prefetch(pf + 64 * line, 0, 2);  // prefetcht1: into L2
    }
    const __mmask32 mask = d + kStep <= in ? ~__mmask32(0) : (__mmask32(1) << (in - d)) - 1;  // 0 < in - d < 32
    pair_linear_step<RM, RO>(x, w, in, d, mask, acc);
  }
  for (; line < lines; ++line) {
    __builtin_prefetch(pf + 64 * line, 0, 2);
  }
#pragma GCC unroll 8
  for (int i = 0; i < RM; ++i) {
#pragma GCC unroll 8
    for (int r = 0; r < RO; ++r) {
      out[i][r] = acc[i][r];
    }
  }
}

// linear_rows' block kernel on bfloat16 pairs (x as the input's bfloat16 rows).
// (The lanes are added here, outside the AVX512-BF16 target, where GCC 12 does not warn inside the
// shuffle intrinsics of at::vec's reduction.)
struct PairBlock {
  template <int RM, int RO>
  static void run(const c10::BFloat16* x, const c10::BFloat16* w, int64_t in, float* s, const char* pf,
                  int64_t lines) {
    __m512 acc[RM][RO];
    pair_linear_block<RM, RO>(x, w, in, acc, pf, lines);
    for (int i = 0; i < RM; ++i) {
      for (int r = 0; r < RO; ++r) {
        s[i * RO + r] = at::vec::vec_reduce_all<float>(std::plus<Vec<float>>(), Vec<float>(acc[i][r]));
      }
    }
  }
};

// dS = scale * P (dP - delta_i), row i, as score_grad computes it, rounded to bfloat16 as PairRounding
// rounds it, written in both forms the pair micro-kernel reads: rows (ld_rows >= cols + cols % 2; an odd cols'
// pad column zeroed) and transposed pairs (round_pairs_transposed's layout, ld_t >= 2 cols). dp and p
// (rows x cols, float32, ld) are left as they are.
CA_BF16_TARGET void score_grad_pairs(const float* dp, const float* p, int64_t ld, int64_t rows, int64_t cols,
                                     float scale, const float* delta, int64_t delta_stride, c10::BFloat16* ds,
                                     int64_t ld_rows, c10::BFloat16* ds_t, int64_t ld_t) {
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY(ld_rows >= cols + cols % 2 && ld_t >= 2 * cols);
  const Vec<float> vscale(scale);
  round_row_pairs(
      rows, cols,
      [&](int64_t i, int64_t j) {
        return vscale * Vec<float>::loadu(p + i * ld + j) *
               (Vec<float>::loadu(dp + i * ld + j) - Vec<float>(delta[i * delta_stride]));
      },
      [&](int64_t i, int64_t j) { return scale * p[i * ld + j] * (dp[i * ld + j] - delta[i * delta_stride]); }, ds_t,
      ld_t, ds, ld_rows);
}

// out[r] = x[r, :] . y[r, :] (rows of n bfloat16, n even) summed pair by pair with vdpbf16ps from 0, as
// pair_gemm sums a dot product: the backward's delta = dO . O then cancels dP = dO . v bit for bit where
// O = v.
CA_BF16_TARGET void pair_dots(const c10::BFloat16* x, const c10::BFloat16* y, int64_t rows, int64_t n, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t p = 0; p < n / 2; ++p) {
      acc = _mm512_dpbf16_ps(acc, (__m512bh)broadcast_pair(x + r * n + 2 * p),
                             (__m512bh)broadcast_pair(y + r * n + 2 * p));
    }
    out[r] = _mm512_cvtss_f32(acc);
  }
}
#undef CA_BF16_TARGET
#endif


#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// ---- The float32 micro-kernel (AVX2 + FMA; also in the AVX512 build) ------------------------------

// Lanes [0, 8) of a 256-bit mask for the first `count` of 8 floats (count clamped to [0, 8]).
inline __m256i lane_mask(int64_t count) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(count, 0, 8))), lanes);
}

// R rows of C (kPanel columns, of which `cols` <= kPanel are real) += / = A . B over k: 2R accumulators.
// kTail: the last panel, whose B and C reads and C writes are masked to `cols` columns.
template <int R, bool kTail, bool kAccumulate>
inline void panel_block(int64_t k, const float* a, int64_t rs_a, int64_t cs_a, const float* b, int64_t ld_b,
                        float* c, int64_t ldc, int64_t cols) {
  const __m256i m0 = kTail ? lane_mask(cols) : __m256i{};
  const __m256i m1 = kTail ? lane_mask(cols - 8) : __m256i{};
  __m256 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    if constexpr (!kAccumulate) {
      acc[r][0] = _mm256_setzero_ps();
      acc[r][1] = _mm256_setzero_ps();
    } else if constexpr (kTail) {
      acc[r][0] = _mm256_maskload_ps(c + r * ldc, m0);
      acc[r][1] = _mm256_maskload_ps(c + r * ldc + 8, m1);
    } else {
      acc[r][0] = _mm256_loadu_ps(c + r * ldc);
      acc[r][1] = _mm256_loadu_ps(c + r * ldc + 8);
    }
  }
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* brow = b + kk * ld_b;
    const __m256 b0 = kTail ? _mm256_maskload_ps(brow, m0) : _mm256_loadu_ps(brow);
    const __m256 b1 = kTail ? _mm256_maskload_ps(brow + 8, m1) : _mm256_loadu_ps(brow + 8);
    const float* acol = a + kk * cs_a;
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(acol + r * rs_a);
      acc[r][0] = _mm256_fmadd_ps(av, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(av, b1, acc[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    if constexpr (kTail) {
      _mm256_maskstore_ps(c + r * ldc, m0, acc[r][0]);
      _mm256_maskstore_ps(c + r * ldc + 8, m1, acc[r][1]);
    } else {
      _mm256_storeu_ps(c + r * ldc, acc[r][0]);
      _mm256_storeu_ps(c + r * ldc + 8, acc[r][1]);
    }
  }
}

// All rows of one panel: blocks of 6 rows, then the remainder.
template <bool kTail, bool kAccumulate>
void panel_rows(int64_t m, int64_t k, const float* a, int64_t rs_a, int64_t cs_a, const float* b, int64_t ld_b,
                float* c, int64_t ldc, int64_t cols) {
  constexpr int kRows = 6;  // 12 accumulators + 2 B rows + a broadcast: 15 of the 16 ymm registers
  int64_t i = 0;
  for (; i + kRows <= m; i += kRows) {
    panel_block<kRows, kTail, kAccumulate>(k, a + i * rs_a, rs_a, cs_a, b, ld_b, c + i * ldc, ldc, cols);
  }
  const float* a_rest = a + i * rs_a;
  float* c_rest = c + i * ldc;
  switch (m - i) {
    case 5: panel_block<5, kTail, kAccumulate>(k, a_rest, rs_a, cs_a, b, ld_b, c_rest, ldc, cols); break;
    case 4: panel_block<4, kTail, kAccumulate>(k, a_rest, rs_a, cs_a, b, ld_b, c_rest, ldc, cols); break;
    case 3: panel_block<3, kTail, kAccumulate>(k, a_rest, rs_a, cs_a, b, ld_b, c_rest, ldc, cols); break;
    case 2: panel_block<2, kTail, kAccumulate>(k, a_rest, rs_a, cs_a, b, ld_b, c_rest, ldc, cols); break;
    case 1: panel_block<1, kTail, kAccumulate>(k, a_rest, rs_a, cs_a, b, ld_b, c_rest, ldc, cols); break;
    default: break;
  }
}

#if !defined(CPU_CAPABILITY_AVX512)  // (the AVX512 build has panel_gemm512)
// Panel by panel: each panel's k x kPanel slice of B stays in L1 while every row of A passes.
void panel_gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t rs_a, int64_t cs_a, const float* b,
                int64_t ld_b, int64_t ps_b, bool accumulate, float* c, int64_t ldc) {
  for (int64_t j0 = 0; j0 < n; j0 += kPanel) {
    const float* panel = b + (j0 / kPanel) * ps_b;
    const int64_t cols = std::min(kPanel, n - j0);
    const auto rows = cols < kPanel ? (accumulate ? &panel_rows<true, true> : &panel_rows<true, false>)
                                    : (accumulate ? &panel_rows<false, true> : &panel_rows<false, false>);
    rows(m, k, a, rs_a, cs_a, panel, ld_b, c + j0, ldc, cols);
  }
}
#endif

// dst[r * ld_dst + c] = src[c * ld_src + r] for r, c < 8.
inline void transpose_8x8(const float* src, int64_t ld_src, float* dst, int64_t ld_dst) {
  __m256 r[8];
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm256_loadu_ps(src + i * ld_src);
  }
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(dst + 0 * ld_dst, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(dst + 1 * ld_dst, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(dst + 2 * ld_dst, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(dst + 3 * ld_dst, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(dst + 4 * ld_dst, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(dst + 5 * ld_dst, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(dst + 6 * ld_dst, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(dst + 7 * ld_dst, _mm256_permute2f128_ps(u3, u7, 0x31));
}

void pack_panels(const float* src, int64_t rs, int64_t cs, int64_t k, int64_t n, float* dst) {
  for (int64_t j0 = 0; j0 < n; j0 += kPanel) {
    float* panel = dst + (j0 / kPanel) * k * kPanel;
    const int64_t width = std::min(kPanel, n - j0);
    if (width < kPanel) {
      std::fill(panel, panel + k * kPanel, 0.0f);
    }
    if (cs == 1 && width == kPanel) {  // rows of kPanel contiguous values: one copy per row
      for (int64_t kk = 0; kk < k; ++kk) {
        _mm256_storeu_ps(panel + kk * kPanel, _mm256_loadu_ps(src + kk * rs + j0));
        _mm256_storeu_ps(panel + kk * kPanel + 8, _mm256_loadu_ps(src + kk * rs + j0 + 8));
      }
      continue;
    }
    int64_t j = 0;
    if (rs == 1) {  // runs of contiguous values (keys as rows): 8 x 8 blocks through registers
      for (; j + 8 <= width; j += 8) {
        int64_t kk = 0;
        for (; kk + 8 <= k; kk += 8) {
          transpose_8x8(src + (j0 + j) * cs + kk, cs, panel + kk * kPanel + j, kPanel);
        }
        for (; kk < k; ++kk) {
          for (int64_t jj = j; jj < j + 8; ++jj) {
            panel[kk * kPanel + jj] = src[(j0 + jj) * cs + kk];
          }
        }
      }
    }
    // Column j of the panel is a run of k values src[j * cs + kk * rs]: read each run in order.
    for (; j < width; ++j) {
      const float* col = src + (j0 + j) * cs;
      for (int64_t kk = 0; kk < k; ++kk) {
        panel[kk * kPanel + j] = col[kk * rs];
      }
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// The AVX-512 build of panel_gemm: the same products in the same order (one fused multiply-add per
// product, k in order, from C or 0), so the same bits, with a panel row in one zmm register: R rows x
// NP (1 or 2) panels of C in registers, each B vector feeding R products, each A value NP. (A CPU with
// two 512-bit FMA units does twice the 256-bit kernel's work per cycle; Zen 4 splits a zmm FMA in two.)
template <int R, int NP, bool kAccumulate>
inline void panel_block512(int64_t k, const float* a, int64_t rs_a, int64_t cs_a, const float* b, int64_t ld_b,
                           int64_t ps_b, float* c, int64_t ldc, __mmask16 mask0, __mmask16 mask1) {
  __m512 acc[R][NP];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int q = 0; q < NP; ++q) {
      acc[r][q] = kAccumulate ? _mm512_maskz_loadu_ps(q == 0 ? mask0 : mask1, c + r * ldc + q * kPanel)
                              : _mm512_setzero_ps();
    }
  }
  for (int64_t kk = 0; kk < k; ++kk) {
    __m512 bv[NP];
#pragma GCC unroll 2
    for (int q = 0; q < NP; ++q) {  // masked: nothing past n is read (B may be rows in place)
      bv[q] = _mm512_maskz_loadu_ps(q == 0 ? mask0 : mask1, b + q * ps_b + kk * ld_b);
    }
    const float* acol = a + kk * cs_a;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(acol[r * rs_a]);
#pragma GCC unroll 2
      for (int q = 0; q < NP; ++q) {
        acc[r][q] = _mm512_fmadd_ps(av, bv[q], acc[r][q]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int q = 0; q < NP; ++q) {
      _mm512_mask_storeu_ps(c + r * ldc + q * kPanel, q == 0 ? mask0 : mask1, acc[r][q]);
    }
  }
}

// panel_block512 as the zmm drivers call it.
struct FloatBlocks {
  using A = float;
  using B = float;
  template <int R, int NP, bool kAccumulate>
  static void block(int64_t k, const A* a, int64_t rs_a, int64_t cs_a, const B* b, int64_t ld_b, int64_t ps_b,
                    float* c, int64_t ldc, __mmask16 mask0, __mmask16 mask1) {
    panel_block512<R, NP, kAccumulate>(k, a, rs_a, cs_a, b, ld_b, ps_b, c, ldc, mask0, mask1);
  }
};

// The zmm micro-kernels' drivers (Blocks: FloatBlocks or PairBlocks; k counts B's rows, or their pairs).
// Every row of A against NP panels: blocks of 12 rows (24 accumulators + 2 B vectors + a broadcast of the
// 32 zmm registers), then the remainder.
template <typename Blocks, int NP, bool kAccumulate>
void zmm_rows(int64_t m, int64_t k, const typename Blocks::A* a, int64_t rs_a, int64_t cs_a,
              const typename Blocks::B* b, int64_t ld_b, int64_t ps_b, float* c, int64_t ldc, int64_t cols) {
  constexpr int kRows = 12;
  const __mmask16 mask0 = lanes16(cols);
  const __mmask16 mask1 = lanes16(cols - kPanel);
  int64_t i = 0;
  for (; i + kRows <= m; i += kRows) {
    Blocks::template block<kRows, NP, kAccumulate>(k, a + i * rs_a, rs_a, cs_a, b, ld_b, ps_b, c + i * ldc, ldc,
                                                   mask0, mask1);
  }
  const auto* a_rest = a + i * rs_a;
  float* c_rest = c + i * ldc;
#define CA_ZMM_REST(R)                                                                                           \
  case R:                                                                                                        \
    Blocks::template block<R, NP, kAccumulate>(k, a_rest, rs_a, cs_a, b, ld_b, ps_b, c_rest, ldc, mask0, mask1); \
    break;
  switch (m - i) {
    CA_ZMM_REST(11) CA_ZMM_REST(10) CA_ZMM_REST(9) CA_ZMM_REST(8) CA_ZMM_REST(7) CA_ZMM_REST(6)
    CA_ZMM_REST(5) CA_ZMM_REST(4) CA_ZMM_REST(3) CA_ZMM_REST(2) CA_ZMM_REST(1)
    default: break;
  }
#undef CA_ZMM_REST
}

// Two panels at a time: their slice of B stays in L1 while every row of A passes.
template <typename Blocks>
void zmm_gemm(int64_t m, int64_t n, int64_t k, const typename Blocks::A* a, int64_t rs_a, int64_t cs_a,
              const typename Blocks::B* b, int64_t ld_b, int64_t ps_b, bool accumulate, float* c, int64_t ldc) {
  for (int64_t j0 = 0; j0 < n; j0 += 2 * kPanel) {
    const auto* panels = b + (j0 / kPanel) * ps_b;
    const int64_t cols = std::min(2 * kPanel, n - j0);
    if (cols > kPanel) {
      (accumulate ? &zmm_rows<Blocks, 2, true> : &zmm_rows<Blocks, 2, false>)(m, k, a, rs_a, cs_a, panels, ld_b,
                                                                            ps_b, c + j0, ldc, cols);
    } else {
      (accumulate ? &zmm_rows<Blocks, 1, true> : &zmm_rows<Blocks, 1, false>)(m, k, a, rs_a, cs_a, panels, ld_b,
                                                                            ps_b, c + j0, ldc, cols);
    }
  }
}

void panel_gemm512(int64_t m, int64_t n, int64_t k, const float* a, int64_t rs_a, int64_t cs_a, const float* b,
                   int64_t ld_b, int64_t ps_b, bool accumulate, float* c, int64_t ldc) {
  zmm_gemm<FloatBlocks>(m, n, k, a, rs_a, cs_a, b, ld_b, ps_b, accumulate, c, ldc);
}

// Pairs: over k2 pairs of B's rows, a B panel row holding kPanel pairs (2 kPanel bfloat16).
void pair_gemm(int64_t m, int64_t n, int64_t k2, const c10::BFloat16* a, int64_t rs_a, int64_t cs_a,
               const c10::BFloat16* b, int64_t ps_b, bool accumulate, float* c, int64_t ldc) {
  zmm_gemm<PairBlocks>(m, n, k2, a, rs_a, cs_a, b, 2 * kPanel, ps_b, accumulate, c, ldc);
}
#endif

// bfloat16 / half: the same layout, widened to float32 (exactly).
template <typename scalar_t>
void pack_panels_widened(const scalar_t* src, int64_t rs, int64_t cs, int64_t k, int64_t n, float* dst) {
  constexpr int64_t W = Vec<float>::size();
  for (int64_t j0 = 0; j0 < n; j0 += kPanel) {
    float* panel = dst + (j0 / kPanel) * k * kPanel;
    const int64_t width = std::min(kPanel, n - j0);
    if (cs == 1 && width == kPanel) {
      for (int64_t kk = 0; kk < k; ++kk) {
        for (int64_t j = 0; j < kPanel; j += W) {
          load_widened(src + kk * rs + j0 + j).store(panel + kk * kPanel + j);
        }
      }
      continue;
    }
    if (width < kPanel) {
      std::fill(panel, panel + k * kPanel, 0.0f);
    }
    for (int64_t j = 0; j < width; ++j) {
      const scalar_t* col = src + (j0 + j) * cs;
      for (int64_t kk = 0; kk < k; ++kk) {
        panel[kk * kPanel + j] = static_cast<float>(col[kk * rs]);
      }
    }
  }
}
#endif

template <typename scalar_t>
TileOps<scalar_t> make_tile_ops() {
  TileOps<scalar_t> ops{};
  ops.softmax_tile = &softmax_tile<scalar_t>;
  ops.softmax_tile_rounded = nullptr;
  ops.rescale_add = &rescale_add<scalar_t>;
  ops.add = &add<scalar_t>;
  ops.finalize = &finalize<scalar_t>;
  ops.store = &store<scalar_t>;
  ops.widen = &widen<scalar_t>;
  ops.fma_dots = &fma_dots<scalar_t>;
  ops.decode_chunk = &decode_chunk<scalar_t>;
  ops.linear_rows = &linear_rows<scalar_t>;
  ops.probabilities = &probabilities<scalar_t>;
  ops.score_grad = &score_grad<scalar_t>;
  ops.round_to_input = &round_to_input<scalar_t>;
  ops.dropout = &dropout<scalar_t>;
  ops.panel_gemm = nullptr;
  ops.pack_panels = nullptr;
  ops.pair_gemm = nullptr;
  ops.pair_panels = nullptr;
  ops.round_pairs_transposed = nullptr;
  ops.score_grad_pairs = nullptr;
  ops.linear_rows_pairs = nullptr;
  ops.pair_dots = nullptr;
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<scalar_t, float>) {
#if defined(CPU_CAPABILITY_AVX512)
    ops.panel_gemm = &panel_gemm512;
#else
    ops.panel_gemm = &panel_gemm;
#endif
    ops.pack_panels = &pack_panels;
  } else if constexpr (kReduced<scalar_t>) {
    ops.pack_panels = &pack_panels_widened<scalar_t>;
  }
#endif
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (__builtin_cpu_supports("avx512bf16")) {
      ops.softmax_tile_rounded = &softmax_tile_rounded;
      ops.pair_gemm = &pair_gemm;
      ops.pair_panels = &pair_panels;
      ops.round_pairs_transposed = &round_pairs_transposed;
      ops.score_grad_pairs = &score_grad_pairs;
      ops.linear_rows_pairs = &linear_rows<c10::BFloat16, PairBlock, c10::BFloat16>;
      ops.pair_dots = &pair_dots;
    }
  }
#endif
  return ops;
}

}  // namespace

// The entry points tile_ops.cpp chooses from.
TileOps<float> tile_ops_float() { return make_tile_ops<float>(); }
TileOps<double> tile_ops_double() { return make_tile_ops<double>(); }
TileOps<c10::BFloat16> tile_ops_bfloat16() { return make_tile_ops<c10::BFloat16>(); }
TileOps<c10::Half> tile_ops_half() { return make_tile_ops<c10::Half>(); }

}  // namespace causal_attention::tile::CPU_CAPABILITY
