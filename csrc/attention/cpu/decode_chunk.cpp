// The decode kernel: a few query rows against a chunk of cached keys and values (dot products, the
// softmax update and the weighted sum of the values, each row read once per query).
#include <cstring>

#include "cpu/bf16_pairs.h"
#include "cpu/exp.h"
#include "cpu/families.h"
#include "cpu/vec.h"

namespace causal_attention::tile::CPU_CAPABILITY {
namespace {

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

template <typename V>  // Vec<float> or __m512
inline Vec<float> sum_lanes(const V (&a)[16]) {
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
template <typename V>  // Vec<float> or __m256
inline Vec<float> sum_lanes(const V (&a)[8]) {
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

// One query row against the chunk's first `visible` keys: its scores (one pass over the keys), its
// softmax update, then its weighted sum of the values (one pass over the values).
template <typename scalar_t, typename acc_t>
inline void decode_row(const acc_t* q, const scalar_t* k, const scalar_t* v, int64_t ld, int64_t visible, int64_t hd,
                       acc_t scale, acc_t& m, acc_t& l, acc_t* o, acc_t* buf) {
  constexpr int kKeys = 8;  // keys per pass over the query row
  int64_t j = 0;
  if constexpr (kBlockDots && std::is_same_v<acc_t, float>) {
    constexpr int64_t W = Vec<float>::size();  // keys per block
    for (; j + W <= visible; j += W) {
      dot_block(q, k + j * ld, ld, hd, buf + j);
    }
  }
  for (; j + kKeys <= visible; j += kKeys) {
    dot_rows<kKeys>(q, k + j * ld, ld, hd, buf + j);
  }
  for (; j < visible; ++j) {
    dot_rows<1>(q, k + j * ld, ld, hd, buf + j);
  }
  const acc_t m_new = std::max(scaled_max(scale, max_of(buf, visible)), m);  // a NaN score stays (NaN out)
  const acc_t alpha = std::exp(m - m_new);  // 0 when m = -inf
  l = l * alpha + exp_scaled_inplace(buf, visible, scale, m_new);
  m = m_new;
  weighted_rows(buf, v, ld, visible, hd, alpha, o);
}

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// A group of R query rows (the query heads sharing a key/value head, or a few queries of one head)
// reads each key and value row once for all R: one row at a time, the group's other rows re-read the
// chunk from L2 after it arrived, while the memory stream stands idle.

// Accumulator registers a weighted pass keeps (AVX512: 16 of 32, AVX2: 8 of 16).
constexpr int kAccRegs = Vec<float>::size();

// The group kernels hold their accumulators as raw registers: arrays of at::vec::Vectorized, GCC keeps
// on the stack, storing every accumulator at every key.
#if defined(CPU_CAPABILITY_AVX512)
using Reg = __m512;
inline Reg fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
inline Reg broadcast(float x) { return _mm512_set1_ps(x); }
inline Reg zero() { return _mm512_setzero_ps(); }
inline Reg load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, Reg x) { _mm512_storeu_ps(p, x); }
#else
using Reg = __m256;
inline Reg fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
inline Reg broadcast(float x) { return _mm256_set1_ps(x); }
inline Reg zero() { return _mm256_setzero_ps(); }
inline Reg load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, Reg x) { _mm256_storeu_ps(p, x); }
#endif
template <typename scalar_t>
inline Reg load_float(const scalar_t* p) {  // W values, widened
  return Reg(load_acc<float>(p));
}

// s[r * lds + j] = sum_d q[r * hd + d] * k[j * ld + d] for r < R, j < n: blocks of W / R keys, whose
// R x W / R sums (W lanes each) sum_lanes adds at once (lane r * W / R + c: row r's scores adjacent);
// a scalar tail past the last whole vector of hd, and row by row past the last whole block of keys.
template <int R, typename scalar_t>
inline void dot_group(const float* q, int64_t hd, const scalar_t* k, int64_t ld, int64_t n, float* s, int64_t lds) {
  constexpr int W = Vec<float>::size();
  constexpr int kBlock = W / R;
  const int64_t whole = hd / W * W;
  int64_t j = 0;
  for (; j + kBlock <= n; j += kBlock) {
    Reg acc[W];
#pragma GCC unroll 16
    for (int c = 0; c < kBlock; ++c) {
      const scalar_t* row = k + (j + c) * ld;
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        acc[r * kBlock + c] = zero();
      }
      for (int64_t d = 0; d < whole; d += W) {
        const Reg kd = load_float(row + d);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          acc[r * kBlock + c] = fma(load(q + r * hd + d), kd, acc[r * kBlock + c]);
        }
      }
    }
    alignas(64) float t[W];
    sum_lanes(acc).store(t);
    for (int64_t d = whole; d < hd; ++d) {
      for (int c = 0; c < kBlock; ++c) {
        const float kd = static_cast<float>(k[(j + c) * ld + d]);
        for (int r = 0; r < R; ++r) {
          t[r * kBlock + c] += q[r * hd + d] * kd;
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      std::memcpy(s + r * lds + j, t + r * kBlock, kBlock * sizeof(float));
    }
  }
  for (; j < n; ++j) {
    for (int r = 0; r < R; ++r) {
      dot_rows<1>(q + r * hd, k + j * ld, ld, hd, s + r * lds + j);
    }
  }
}

// o[r * hd + u * W + w] += sum_{j < n} p[r * ldp + j] * v[j * ld + u * W + w] for r < R, u < U:
// R x U vectors of o in registers, each value row loaded once for the R rows.
template <int R, int U, typename scalar_t>
inline void weighted_group_block(const float* p, int64_t ldp, const scalar_t* v, int64_t ld, int64_t n, float* o,
                                 int64_t hd) {
  constexpr int64_t W = Vec<float>::size();
  Reg acc[R][U];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) {
      acc[r][u] = load(o + r * hd + u * W);
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    Reg vj[U];
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) {
      vj[u] = load_float(v + j * ld + u * W);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const Reg pj = broadcast(p[r * ldp + j]);
#pragma GCC unroll 16
      for (int u = 0; u < U; ++u) {
        acc[r][u] = fma(pj, vj[u], acc[r][u]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) {
      store(o + r * hd + u * W, acc[r][u]);
    }
  }
}

// The R rows' weighted sums over keys [0, n): vector blocks of U <= kAccRegs / R across hd (halving
// U for what is left), keys in runs of kKeys so that the later blocks re-read the values from L1,
// a scalar tail past the last whole vector.
template <int R, int U, typename scalar_t>
inline void weighted_blocks(const float* p, int64_t ldp, const scalar_t* v, int64_t ld, int64_t n, int64_t hd,
                            int64_t d0, float* o) {
  constexpr int64_t W = Vec<float>::size();
  for (; d0 + U * W <= hd; d0 += U * W) {
    weighted_group_block<R, U>(p, ldp, v + d0, ld, n, o + d0, hd);
  }
  if constexpr (U > 1) {
    weighted_blocks<R, U / 2>(p, ldp, v, ld, n, hd, d0, o);
  } else {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      for (int64_t d = d0; d < hd; ++d) {
        float acc = o[r * hd + d];
        for (int64_t j = 0; j < n; ++j) {
          acc += p[r * ldp + j] * static_cast<float>(v[j * ld + d]);
        }
        o[r * hd + d] = acc;
      }
    }
  }
}

template <int R, typename scalar_t>
inline void weighted_group(const float* p, int64_t ldp, const scalar_t* v, int64_t ld, int64_t n, int64_t hd,
                           float* o) {
  constexpr int64_t kKeys = 64;  // 16 KB of float32 values at hd = 64
  constexpr int U = std::min(8, kAccRegs / R);
  for (int64_t j0 = 0; j0 < n; j0 += kKeys) {
    weighted_blocks<R, U>(p + j0, ldp, v + j0 * ld, ld, std::min(kKeys, n - j0), hd, 0, o);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// bfloat16 where the CPU has AVX512-BF16: the group's products on vdpbf16ps, which adds the two products
// of a pair of bfloat16 (each exact in float32) to a float32 lane. Scores pair q's and k's bfloat16 along
// hd (the queries are bfloat16 values, widened: narrowing them back is exact); the weighted sums pair two
// keys' probabilities, rounded to bfloat16 as the tiled kernel's pair path rounds them (the row sums l
// are the unrounded ones), with the two keys' value rows interleaved in registers. Per key and row that
// is half the instructions of widening each bfloat16 to float32, and no queries re-read from L1.

// Head sizes with a pair kernel: D = hd / 32 vectors of 32 bfloat16 per row.
inline bool pair_head_dim(int64_t hd) { return hd % 32 == 0 && hd >= 32 && hd <= 128; }

// s[r * lds + j] = q_r . k_j for r < R, j < n, qb: the R query rows in bfloat16 (R x 32 D): blocks of
// 16 / R keys whose R x 16 / R lane sums sum_lanes adds at once (as dot_group), row by row past the last
// whole block (from q, the float32 rows).
template <int R, int D>
CA_BF16_TARGET void dot_group_pairs(const c10::BFloat16* qb, const float* q, const c10::BFloat16* k, int64_t ld,
                                    int64_t n, float* s, int64_t lds) {
  constexpr int W = 16;
  constexpr int kBlock = W / R;
  constexpr int64_t hd = 32 * D;
  __m512bh qv[R][D];  // registers where R x D <= 8 (with the 16 sums), else re-read from L1
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int d = 0; d < D; ++d) {
      qv[r][d] = (__m512bh)_mm512_loadu_si512(qb + r * hd + 32 * d);
    }
  }
  int64_t j = 0;
  for (; j + kBlock <= n; j += kBlock) {
    __m512 acc[W];
#pragma GCC unroll 16
    for (int c = 0; c < kBlock; ++c) {
      const c10::BFloat16* row = k + (j + c) * ld;
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        acc[r * kBlock + c] = _mm512_setzero_ps();
      }
#pragma GCC unroll 16
      for (int d = 0; d < D; ++d) {
        const __m512bh kd = (__m512bh)_mm512_loadu_si512(row + 32 * d);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          acc[r * kBlock + c] = _mm512_dpbf16_ps(acc[r * kBlock + c], qv[r][d], kd);
        }
      }
    }
    alignas(64) float t[W];
    _mm512_store_ps(t, sum_lanes(acc));
    for (int r = 0; r < R; ++r) {
      std::memcpy(s + r * lds + j, t + r * kBlock, kBlock * sizeof(float));
    }
  }
  for (; j < n; ++j) {
    for (int r = 0; r < R; ++r) {
      dot_rows<1>(q + r * hd, k + j * ld, ld, hd, s + r * lds + j);
    }
  }
}

// o[r * hd + 32 u + w] += sum_{j < n} p[r * ldp + j] * v[j * ld + 32 u + w] for r < R, u < U, w < 32: p
// (bfloat16) has a 0 at n when n is odd. Keys in pairs: lane i of unpacklo_epi16(v_j, v_j+1) holds the pair
// (v_j, v_j+1) at w = 8 (i / 4) + i % 4 (unpackhi: + 4), so each row's sums sit in that order in lo and hi
// and are put back in w order once, at the end.
template <int R, int U>
CA_BF16_TARGET void weighted_pairs_block(const c10::BFloat16* p, int64_t ldp, const c10::BFloat16* v, int64_t ld,
                                         int64_t n, float* o, int64_t hd) {
  __m512 lo[R][U], hi[R][U];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) {
      lo[r][u] = hi[r][u] = _mm512_setzero_ps();
    }
  }
  for (int64_t j = 0; j < n; j += 2) {
    __m512bh vlo[U], vhi[U];
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) {
      const __m512i a = _mm512_loadu_si512(v + j * ld + 32 * u);
      const __m512i b = j + 1 < n ? _mm512_loadu_si512(v + (j + 1) * ld + 32 * u) : _mm512_setzero_si512();
      vlo[u] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      vhi[u] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh pj = (__m512bh)broadcast_pair(p + r * ldp + j);
#pragma GCC unroll 16
      for (int u = 0; u < U; ++u) {
        lo[r][u] = _mm512_dpbf16_ps(lo[r][u], pj, vlo[u]);
        hi[r][u] = _mm512_dpbf16_ps(hi[r][u], pj, vhi[u]);
      }
    }
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) {
      float* dst = o + r * hd + 32 * u;
      _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), _mm512_permutex2var_ps(lo[r][u], first, hi[r][u])));
      _mm512_storeu_ps(dst + 16,
                       _mm512_add_ps(_mm512_loadu_ps(dst + 16), _mm512_permutex2var_ps(lo[r][u], second, hi[r][u])));
    }
  }
}

// The R rows' weighted sums over keys [0, n) from their probabilities in s (float32, rows lds apart),
// rounded to bfloat16 in place: row r's pairs start where its float32 values did (each vector is read
// before the narrower store that overlaps it; the float32 values past n, which the rows' further keys
// read, stay). Then 64 values of hd at a time (32 for the last of an odd D) over runs of 64 keys, so
// that the later blocks re-read the values from L1.
template <int R>
CA_BF16_TARGET void weighted_group_pairs(float* s, int64_t lds, const c10::BFloat16* v, int64_t ld, int64_t n,
                                         int64_t hd, float* o) {
  for (int r = 0; r < R; ++r) {
    float* row = s + r * lds;
    auto* pairs = reinterpret_cast<c10::BFloat16*>(row);
    for (int64_t j = 0; j < n; j += 16) {
      const int64_t count = std::min<int64_t>(16, n - j);
      PairRounding::store(Vec<float>(_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << count) - 1), row + j)),
                          pairs + j, count);
    }
    if (n % 2 == 1) {
      pairs[n] = c10::BFloat16(0.f);
    }
  }
  const auto* p = reinterpret_cast<const c10::BFloat16*>(s);
  constexpr int64_t kKeys = 64;
  for (int64_t j0 = 0; j0 < n; j0 += kKeys) {
    const int64_t keys = std::min(kKeys, n - j0);
    int64_t d0 = 0;
    for (; d0 + 64 <= hd; d0 += 64) {
      weighted_pairs_block<R, 2>(p + j0, 2 * lds, v + j0 * ld + d0, ld, keys, o + d0, hd);
    }
    if (d0 < hd) {
      weighted_pairs_block<R, 1>(p + j0, 2 * lds, v + j0 * ld + d0, ld, keys, o + d0, hd);
    }
  }
}

template <int R, int D>
CA_BF16_TARGET void dot_group_pairs_from(const float* q, const c10::BFloat16* k, int64_t ld, int64_t n, float* s,
                                         int64_t lds) {
  alignas(64) c10::BFloat16 qb[R * 32 * D];
  for (int64_t i = 0; i < R * 32 * D; i += 16) {
    PairRounding::store(Vec<float>::loadu(q + i), qb + i);
  }
  dot_group_pairs<R, D>(qb, q, k, ld, n, s, lds);
}

// dot_group on pairs for hd = 32 D (pair_head_dim).
template <int R>
void dot_group_pairs_any(const float* q, int64_t hd, const c10::BFloat16* k, int64_t ld, int64_t n, float* s,
                         int64_t lds) {
  switch (hd / 32) {
    case 1: return dot_group_pairs_from<R, 1>(q, k, ld, n, s, lds);
    case 2: return dot_group_pairs_from<R, 2>(q, k, ld, n, s, lds);
    case 3: return dot_group_pairs_from<R, 3>(q, k, ld, n, s, lds);
    default: return dot_group_pairs_from<R, 4>(q, k, ld, n, s, lds);
  }
}
#endif

// Whether the group kernels take scalar_t's pairs (bfloat16 on AVX512-BF16, pair_head_dim).
template <typename scalar_t>
bool uses_pairs([[maybe_unused]] int64_t hd) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    return pair_head_dim(hd) && has_avx512_bf16();
  }
#endif
  return false;
}

// dot_group's scores (rows of lds = n), on pairs where `pairs` (uses_pairs).
template <int R, typename scalar_t>
void group_scores([[maybe_unused]] bool pairs, const float* q, int64_t hd, const scalar_t* k, int64_t ld, int64_t n,
                  float* s) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (pairs) {
      dot_group_pairs_any<R>(q, hd, k, ld, n, s, n);
      return;
    }
  }
#endif
  dot_group<R>(q, hd, k, ld, n, s, n);
}

// weighted_group's sums over keys [0, n) (the probabilities in rows of s, lds apart), on pairs where `pairs`.
template <int R, typename scalar_t>
void group_weighted([[maybe_unused]] bool pairs, float* s, int64_t lds, const scalar_t* v, int64_t ld, int64_t n,
                    int64_t hd, float* o) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (pairs) {
      weighted_group_pairs<R>(s, lds, v, ld, n, hd, o);
      return;
    }
  }
#endif
  weighted_group<R>(s, lds, v, ld, n, hd, o);
}

// R rows, row r sees keys j <= first_row + r + causal_offset of the chunk's n: scores of the keys the
// last row sees, each row's softmax update over its own, the weighted sum over the keys every row sees
// for all R at once, and each row's few further keys on its own (a later key never enters an earlier
// row's sum, not even as 0 x a non-finite value).
template <int R, typename scalar_t>
void decode_group(const float* q, int64_t first_row, const scalar_t* k, const scalar_t* v, int64_t ld, int64_t n,
                  int64_t hd, float scale, int64_t causal_offset, float* m, float* l, float* o, float* s) {
  const auto visible = [&](int64_t r) { return std::clamp<int64_t>(first_row + r + causal_offset + 1, 0, n); };
  const int64_t all = visible(R - 1), common = visible(0);
  if (all == 0) {
    return;
  }
  const bool pairs = uses_pairs<scalar_t>(hd);
  group_scores<R>(pairs, q, hd, k, ld, all, s);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    float* sr = s + r * all;
    if (visible(r) == 0) {
      continue;
    }
    const float m_new = std::max(scaled_max(scale, max_of(sr, visible(r))), m[r]);  // a NaN score stays (NaN out)
    const float alpha = std::exp(m[r] - m_new);  // 0 when m = -inf
    l[r] = l[r] * alpha + exp_scaled_inplace(sr, visible(r), scale, m_new);
    m[r] = m_new;
    const Vec<float> valpha(alpha);
    int64_t d = 0;
    for (; d + Vec<float>::size() <= hd; d += Vec<float>::size()) {
      (Vec<float>::loadu(o + r * hd + d) * valpha).store(o + r * hd + d);
    }
    for (; d < hd; ++d) {
      o[r * hd + d] *= alpha;
    }
  }
  group_weighted<R>(pairs, s, all, v, ld, common, hd, o);
  for (int r = 1; r < R; ++r) {
    if (visible(r) > common) {
      weighted_rows(s + r * all + common, v + common * ld, ld, visible(r) - common, hd, 1.f, o + r * hd);
    }
  }
}
#endif

// A pass over rows on 4 KB pages stalls at each page's first line: the page walk, and the hardware's
// stream prefetchers stop at page boundaries. One software prefetch (into L2) per page of the chunk's
// keys and values, issued before the passes, walks the pages and brings their first lines in while the
// passes run (a transformers cache is such memory; on huge pages this costs a few dozen prefetches).
inline void prefetch_pages(const void* start, int64_t bytes) {
  constexpr int64_t kPage = 4096;
  const char* first = static_cast<const char*>(start);
  for (int64_t b = 0; b < bytes; b += kPage) {
    __builtin_prefetch(first + b, 0, 2);
  }
}

// The chunk's rows: in groups of 4 and 2 rows where the ISA has the blocked kernels (float32, bfloat16,
// half), one at a time otherwise. Not groups of 8: their weighted pass holds only half a value row of
// each of its rows in registers. Besides the pages (prefetch_pages), no software prefetch: within a page
// each pass reads its rows in address order, which the hardware's stream prefetchers follow.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void decode_chunk(const acc_t* q, int64_t rows, const scalar_t* k, const scalar_t* v, int64_t ld, int64_t n,
                  int64_t hd, acc_t scale, int64_t causal_offset, acc_t* m, acc_t* l, acc_t* o, acc_t* buf) {
  if (n > 0) {
    const int64_t bytes = ((n - 1) * ld + hd) * int64_t(sizeof(scalar_t));
    prefetch_pages(k, bytes);
    prefetch_pages(v, bytes);
  }
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<acc_t, float>) {
    const auto group = [&](auto rows_per_group) {
      constexpr int R = decltype(rows_per_group)::value;
      for (; i + R <= rows; i += R) {
        decode_group<R>(q + i * hd, i, k, v, ld, n, hd, scale, causal_offset, m + i, l + i, o + i * hd, buf);
      }
    };
    static_assert(kDecodeGroupRows == 4);
    group(std::integral_constant<int, 4>{});
    group(std::integral_constant<int, 2>{});
    if (uses_pairs<scalar_t>(hd)) {
      group(std::integral_constant<int, 1>{});
    }
  }
#endif
  for (; i < rows; ++i) {
    const int64_t visible = std::clamp<int64_t>(i + causal_offset + 1, 0, n);
    if (visible > 0) {
      decode_row(q + i * hd, k, v, ld, visible, hd, scale, m[i], l[i], o + i * hd, buf);
    }
  }
}

}  // namespace

template <typename scalar_t>
void set_decode_ops(TileOps<scalar_t>& ops) {
  ops.decode_chunk = &decode_chunk<scalar_t>;
}
CA_INSTANTIATE_TILE_FAMILY(set_decode_ops)

}  // namespace causal_attention::tile::CPU_CAPABILITY
