// The online softmax of a tile and the element-wise steps around the tile products (tile_ops.h):
// rescaling, the epilogue, conversions, the backward's probabilities and score gradients.
#include "cpu/bf16_pairs.h"
#include "cpu/exp.h"
#include "cpu/families.h"
#include "cpu/vec.h"

#include <cstring>

namespace causal_attention::tile::CPU_CAPABILITY {
namespace {

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
    const acc_t m_new = std::max(scaled_max(scale, max_of(x, n)), m[i]);  // a NaN score first: it stays (NaN out)
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
    acc_t total = 0;
    for (int64_t j0 = 0; j0 < n; j0 += kScoreSumBlock) {
      acc_t block = 0;
      for (int64_t j = j0; j < std::min(n, j0 + kScoreSumBlock); ++j) {
        block = std::fma(static_cast<acc_t>(xr[j]), static_cast<acc_t>(yr[j]), block);
      }
      total = j0 == 0 ? block : total + block;
    }
    out[r] = total;
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

}  // namespace

template <typename scalar_t>
void set_softmax_ops(TileOps<scalar_t>& ops) {
  ops.softmax_tile = &softmax_tile<scalar_t>;
  ops.rescale_add = &rescale_add<scalar_t>;
  ops.add = &add<scalar_t>;
  ops.finalize = &finalize<scalar_t>;
  ops.store = &store<scalar_t>;
  ops.widen = &widen<scalar_t>;
  ops.fma_dots = &fma_dots<scalar_t>;
  ops.probabilities = &probabilities<scalar_t>;
  ops.score_grad = &score_grad<scalar_t>;
  ops.round_to_input = &round_to_input<scalar_t>;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (has_avx512_bf16()) {
      ops.softmax_tile_rounded = &softmax_tile_rounded;
    }
  }
#endif
}
CA_INSTANTIATE_TILE_FAMILY(set_softmax_ops)

}  // namespace causal_attention::tile::CPU_CAPABILITY
