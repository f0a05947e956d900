// The products of a half-precision model's projections on a CPU without arithmetic in its type
// (tile_ops.h: widened_gemm): B's bfloat16 / half values widened to float32 as they are packed into
// panels, a block of k at a time, so that the widening costs no pass of its own over memory.
#include "cpu/families.h"
#include "cpu/vec.h"

#include <algorithm>

#if defined(CPU_CAPABILITY_AVX512)
#include "attention/cpu/zmm_gemm.h"
#endif

namespace causal_attention::tile::CPU_CAPABILITY {
namespace {

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
constexpr int kRegisterRows = 6;  // both builds' register blocks: 6 rows of C
// Values of k per packed block: the block's panels (AVX-512: 4 at a time, 128 KB; AVX2: 1, 64 KB) stay in L2
// while every row of A passes, and C's registers are loaded and stored once per block.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kDepth = 512;
#else
constexpr int64_t kDepth = 1024;
#endif
static_assert(kDepth <= kWidenedDepth);

// 8 values of src widened to float32 (exact).
inline __m256 widen8(const c10::Half* src) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
}
inline __m256 widen8(const c10::BFloat16* src) {
  const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
}

// The 8 x 8 block r (row i = r[i]) transposed in place.
inline void transpose8(__m256 (&r)[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// B rows k0..k0 + kc (element (kk, j) at b[kk * rs + j * cs], j < n) widened into panels of kPanel columns:
// dst[(j / kPanel) * kc * kPanel + (kk - k0) * kPanel + j % kPanel], zero past n.
template <typename scalar_t>
void pack_block(const scalar_t* b, int64_t rs, int64_t cs, int64_t k0, int64_t kc, int64_t n, float* dst) {
  constexpr int64_t W = Vec<float>::size();
  for (int64_t j0 = 0; j0 < n; j0 += kPanel) {
    float* panel = dst + (j0 / kPanel) * kc * kPanel;
    const int64_t width = std::min(kPanel, n - j0);
    const scalar_t* src = b + k0 * rs + j0 * cs;
    if (cs == 1 && width == kPanel) {  // rows of B in place (a weight's gradient, an input gradient's weight)
      for (int64_t kk = 0; kk < kc; ++kk) {
        for (int64_t j = 0; j < kPanel; j += W) {
          load_widened(src + kk * rs + j).store(panel + kk * kPanel + j);
        }
      }
      continue;
    }
    int64_t kk_done = 0;
    if (rs == 1 && width == kPanel) {  // columns of B in place (a weight (out, in) read as its transpose)
      for (; kk_done + 8 <= kc; kk_done += 8) {
        for (int64_t h = 0; h < kPanel; h += 8) {
          __m256 r[8];
          for (int i = 0; i < 8; ++i) {
            r[i] = widen8(src + (h + i) * cs + kk_done);
          }
          transpose8(r);
          for (int i = 0; i < 8; ++i) {
            _mm256_storeu_ps(panel + (kk_done + i) * kPanel + h, r[i]);
          }
        }
      }
    }
    for (int64_t kk = kk_done; kk < kc; ++kk) {
      float* row = panel + kk * kPanel;
      for (int64_t j = 0; j < kPanel; ++j) {
        row[j] = j < width ? static_cast<float>(src[kk * rs + j * cs]) : 0.0f;
      }
    }
  }
}

// sums[j] (+)= the sum of column j of the packed block in k order (added to sums unless first).
void column_sums(const float* packed, int64_t kc, int64_t n, bool first, float* sums) {
  constexpr int64_t W = Vec<float>::size();
  for (int64_t j0 = 0; j0 < n; j0 += kPanel) {
    const float* panel = packed + (j0 / kPanel) * kc * kPanel;
    float lane[kPanel];
    for (int64_t j = 0; j < kPanel; j += W) {
      Vec<float> s(0.0f);
      for (int64_t kk = 0; kk < kc; ++kk) {
        s = s + Vec<float>::loadu(panel + kk * kPanel + j);
      }
      s.store(lane + j);
    }
    for (int64_t j = 0; j < std::min(kPanel, n - j0); ++j) {
      sums[j0 + j] = first ? lane[j] : sums[j0 + j] + lane[j];
    }
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX512)
constexpr int kGroupPanels = 4;  // 6 rows x 4 panels: 24 zmm accumulators, 4 B vectors, a broadcast

// R rows x NP panels of C over kc values of k: from 0 (first) or from C, one fused multiply-add per product in k
// order; bias (or nullptr) added at the end (last). Columns past `cols` are neither read nor written.
template <int R, int NP>
void block(int64_t kc, const float* a, int64_t rs_a, int64_t cs_a, const float* b, int64_t ps_b, float* c,
           int64_t ldc, int64_t cols, bool first, const float* bias) {
  __mmask16 mask[NP];
  for (int q = 0; q < NP; ++q) {
    mask[q] = lanes16(cols - q * kPanel);
  }
  __m512 acc[R][NP];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int q = 0; q < NP; ++q) {
      acc[r][q] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask[q], c + r * ldc + q * kPanel);
    }
  }
  const float* rows[R];
  for (int r = 0; r < R; ++r) {
    rows[r] = a + r * rs_a;
  }
  for (int64_t kk = 0; kk < kc; ++kk) {
    __m512 bv[NP];
#pragma GCC unroll 4
    for (int q = 0; q < NP; ++q) {
      bv[q] = _mm512_loadu_ps(b + q * ps_b + kk * kPanel);
    }
    const int64_t at = kk * cs_a;
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(rows[r][at]);
#pragma GCC unroll 4
      for (int q = 0; q < NP; ++q) {
        acc[r][q] = _mm512_fmadd_ps(av, bv[q], acc[r][q]);
      }
    }
  }
#pragma GCC unroll 4
  for (int q = 0; q < NP; ++q) {
    const __m512 add = bias != nullptr ? _mm512_maskz_loadu_ps(mask[q], bias + q * kPanel) : _mm512_setzero_ps();
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 sum = bias != nullptr ? _mm512_add_ps(acc[r][q], add) : acc[r][q];
      _mm512_mask_storeu_ps(c + r * ldc + q * kPanel, mask[q], sum);
    }
  }
}
#elif defined(CPU_CAPABILITY_AVX2)
constexpr int kGroupPanels = 1;  // 6 rows x 1 panel: 12 ymm accumulators, 2 B vectors, a broadcast

// The AVX2 build of the block above: R rows x one panel (two ymm registers a row).
template <int R, int NP>
void block(int64_t kc, const float* a, int64_t rs_a, int64_t cs_a, const float* b, int64_t /*ps_b*/, float* c,
           int64_t ldc, int64_t cols, bool first, const float* bias) {
  static_assert(NP == 1);
  const __m256i m0 = lane_mask(cols), m1 = lane_mask(cols - 8);
  const int64_t hi = cols > 8 ? 8 : 0;  // the upper half's offset (0 where it is all masked: no pointer past C)
  __m256 acc[R][2];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    acc[r][0] = first ? _mm256_setzero_ps() : _mm256_maskload_ps(c + r * ldc, m0);
    acc[r][1] = first ? _mm256_setzero_ps() : _mm256_maskload_ps(c + r * ldc + hi, m1);
  }
  const float* rows[R];
  for (int r = 0; r < R; ++r) {
    rows[r] = a + r * rs_a;
  }
  for (int64_t kk = 0; kk < kc; ++kk) {
    const __m256 b0 = _mm256_loadu_ps(b + kk * kPanel);
    const __m256 b1 = _mm256_loadu_ps(b + kk * kPanel + 8);
    const int64_t at = kk * cs_a;
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(rows[r] + at);
      acc[r][0] = _mm256_fmadd_ps(av, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(av, b1, acc[r][1]);
    }
  }
  const __m256 add0 = bias != nullptr ? _mm256_maskload_ps(bias, m0) : _mm256_setzero_ps();
  const __m256 add1 = bias != nullptr ? _mm256_maskload_ps(bias + hi, m1) : _mm256_setzero_ps();
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    _mm256_maskstore_ps(c + r * ldc, m0, bias != nullptr ? _mm256_add_ps(acc[r][0], add0) : acc[r][0]);
    _mm256_maskstore_ps(c + r * ldc + hi, m1, bias != nullptr ? _mm256_add_ps(acc[r][1], add1) : acc[r][1]);
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// block<R, NP> for NP known at run time (1..kGroupPanels).
template <int R>
void block_panels(int np, int64_t kc, const float* a, int64_t rs_a, int64_t cs_a, const float* b, int64_t ps_b,
                  float* c, int64_t ldc, int64_t cols, bool first, const float* bias) {
  if constexpr (kGroupPanels == 4) {
    switch (np) {
      case 4: block<R, 4>(kc, a, rs_a, cs_a, b, ps_b, c, ldc, cols, first, bias); return;
      case 3: block<R, 3>(kc, a, rs_a, cs_a, b, ps_b, c, ldc, cols, first, bias); return;
      case 2: block<R, 2>(kc, a, rs_a, cs_a, b, ps_b, c, ldc, cols, first, bias); return;
      default: break;
    }
  }
  block<R, 1>(kc, a, rs_a, cs_a, b, ps_b, c, ldc, cols, first, bias);
}

// Rows [0, m) of A (rs_a, cs_a) against the packed block (kc x n in panels): register blocks of
// kRegisterRows rows, then the rest; in each, the panels kGroupPanels at a time.
void rows_pass(int64_t m, int64_t n, int64_t kc, const float* a, int64_t rs_a, int64_t cs_a, const float* packed,
               float* c, int64_t ldc, bool first, const float* bias) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const auto group = [&](auto rows, int64_t i) {
    constexpr int R = decltype(rows)::value;
    for (int64_t p = 0; p < panels; p += kGroupPanels) {
      const int np = static_cast<int>(std::min<int64_t>(kGroupPanels, panels - p));
      block_panels<R>(np, kc, a + i * rs_a, rs_a, cs_a, packed + p * kc * kPanel, kc * kPanel, c + i * ldc + p * kPanel,
                      ldc, n - p * kPanel, first, bias != nullptr ? bias + p * kPanel : nullptr);
    }
  };
  int64_t i = 0;
  for (; i + kRegisterRows <= m; i += kRegisterRows) {
    group(std::integral_constant<int, kRegisterRows>{}, i);
  }
  switch (m - i) {
    case 5: group(std::integral_constant<int, 5>{}, i); break;
    case 4: group(std::integral_constant<int, 4>{}, i); break;
    case 3: group(std::integral_constant<int, 3>{}, i); break;
    case 2: group(std::integral_constant<int, 2>{}, i); break;
    case 1: group(std::integral_constant<int, 1>{}, i); break;
    default: break;
  }
}

template <typename scalar_t>
void widened_gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t rs_a, int64_t cs_a, const scalar_t* b,
                  int64_t rs_b, int64_t cs_b, const float* bias, float* c, int64_t ldc, float* pack, float* b_sums) {
  for (int64_t k0 = 0; k0 < k; k0 += kDepth) {
    const int64_t kc = std::min(kDepth, k - k0);
    pack_block(b, rs_b, cs_b, k0, kc, n, pack);
    if (b_sums != nullptr) {
      column_sums(pack, kc, n, k0 == 0, b_sums);
    }
    rows_pass(m, n, kc, a + k0 * cs_a, rs_a, cs_a, pack, c, ldc, k0 == 0, k0 + kc == k ? bias : nullptr);
  }
}
#endif

}  // namespace

template <typename scalar_t>
void set_widened_gemm_ops(TileOps<scalar_t>& ops) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  if constexpr (kReduced<scalar_t>) {
    ops.widened_gemm = &widened_gemm<scalar_t>;
  }
#else
  (void)ops;
#endif
}
CA_INSTANTIATE_TILE_FAMILY(set_widened_gemm_ops)

}  // namespace causal_attention::tile::CPU_CAPABILITY
