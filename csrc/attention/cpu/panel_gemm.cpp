// The float32 panel GEMM of the tile products (AVX2 and AVX512 builds; the DEFAULT build leaves the
// products to BLAS) and the packing of its B operand into panels.
#include "attention/cpu/zmm_gemm.h"
#include "cpu/families.h"
#include "cpu/vec.h"

namespace causal_attention::tile::CPU_CAPABILITY {
namespace {

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// How a register block sums its part of k into C: C = A.B (kStore); one chain of fused multiply-adds
// continuing from C (kContinue); or from 0, then added to C (kAdd).
enum class Sum { kStore, kContinue, kAdd };

// block(k0, kb, mode) for each block of k that is summed on its own, in order: all of k in one chain
// when sum_block is 0, else blocks of sum_block, each from 0, their sums added to C in order (to the
// first block's sum when not accumulating).
template <typename Block>
inline void for_each_sum_block(int64_t k, int64_t sum_block, bool accumulate, const Block& block) {
  if (sum_block <= 0) {
    block(0, k, accumulate ? Sum::kContinue : Sum::kStore);
    return;
  }
  if (k == 0 && accumulate) {
    return;
  }
  int64_t k0 = 0;
  do {
    block(k0, std::min(sum_block, k - k0), k0 == 0 && !accumulate ? Sum::kStore : Sum::kAdd);
    k0 += sum_block;
  } while (k0 < k);
}

// kernel.template operator()<mode>() for a mode known at run time.
template <typename Kernel>
inline void with_sum_mode(Sum mode, const Kernel& kernel) {
  switch (mode) {
    case Sum::kStore: kernel.template operator()<Sum::kStore>(); break;
    case Sum::kContinue: kernel.template operator()<Sum::kContinue>(); break;
    case Sum::kAdd: kernel.template operator()<Sum::kAdd>(); break;
  }
}

// R rows of C (kPanel columns, of which `cols` <= kPanel are real) and A . B over k, summed as kMode
// says: 2R accumulators. kTail: the last panel, whose B and C reads and C writes are masked
// to `cols` columns.
template <int R, bool kTail, Sum kMode>
inline void panel_block(int64_t k, const float* a, int64_t rs_a, int64_t cs_a, const float* b, int64_t ld_b,
                        float* c, int64_t ldc, int64_t cols) {
  const __m256i m0 = kTail ? lane_mask(cols) : __m256i{};
  const __m256i m1 = kTail ? lane_mask(cols - 8) : __m256i{};
  const auto load_c = [&](int r, int half) {
    const float* at = c + r * ldc + 8 * half;
    return kTail ? _mm256_maskload_ps(at, half == 0 ? m0 : m1) : _mm256_loadu_ps(at);
  };
  __m256 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    acc[r][0] = kMode == Sum::kContinue ? load_c(r, 0) : _mm256_setzero_ps();
    acc[r][1] = kMode == Sum::kContinue ? load_c(r, 1) : _mm256_setzero_ps();
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
    if constexpr (kMode == Sum::kAdd) {
      acc[r][0] = _mm256_add_ps(load_c(r, 0), acc[r][0]);
      acc[r][1] = _mm256_add_ps(load_c(r, 1), acc[r][1]);
    }
    if constexpr (kTail) {
      _mm256_maskstore_ps(c + r * ldc, m0, acc[r][0]);
      _mm256_maskstore_ps(c + r * ldc + 8, m1, acc[r][1]);
    } else {
      _mm256_storeu_ps(c + r * ldc, acc[r][0]);
      _mm256_storeu_ps(c + r * ldc + 8, acc[r][1]);
    }
  }
}

// R rows of one panel, k in its sum blocks (through C: the AVX2 build has no registers to spare).
template <int R, bool kTail>
inline void panel_sums(int64_t k, int64_t sum_block, bool accumulate, const float* a, int64_t rs_a, int64_t cs_a,
                       const float* b, int64_t ld_b, float* c, int64_t ldc, int64_t cols) {
  for_each_sum_block(k, sum_block, accumulate, [&](int64_t k0, int64_t kb, Sum mode) {
    with_sum_mode(mode, [&]<Sum kMode>() {
      panel_block<R, kTail, kMode>(kb, a + k0 * cs_a, rs_a, cs_a, b + k0 * ld_b, ld_b, c, ldc, cols);
    });
  });
}

// All rows of one panel: blocks of 6 rows, then the remainder.
template <bool kTail>
void panel_rows(int64_t m, int64_t k, int64_t sum_block, bool accumulate, const float* a, int64_t rs_a, int64_t cs_a,
                const float* b, int64_t ld_b, float* c, int64_t ldc, int64_t cols) {
  constexpr int kRows = 6;  // 12 accumulators + 2 B rows + a broadcast: 15 of the 16 ymm registers
  int64_t i = 0;
  for (; i + kRows <= m; i += kRows) {
    panel_sums<kRows, kTail>(k, sum_block, accumulate, a + i * rs_a, rs_a, cs_a, b, ld_b, c + i * ldc, ldc, cols);
  }
  const float* a_rest = a + i * rs_a;
  float* c_rest = c + i * ldc;
  switch (m - i) {
    case 5: panel_sums<5, kTail>(k, sum_block, accumulate, a_rest, rs_a, cs_a, b, ld_b, c_rest, ldc, cols); break;
    case 4: panel_sums<4, kTail>(k, sum_block, accumulate, a_rest, rs_a, cs_a, b, ld_b, c_rest, ldc, cols); break;
    case 3: panel_sums<3, kTail>(k, sum_block, accumulate, a_rest, rs_a, cs_a, b, ld_b, c_rest, ldc, cols); break;
    case 2: panel_sums<2, kTail>(k, sum_block, accumulate, a_rest, rs_a, cs_a, b, ld_b, c_rest, ldc, cols); break;
    case 1: panel_sums<1, kTail>(k, sum_block, accumulate, a_rest, rs_a, cs_a, b, ld_b, c_rest, ldc, cols); break;
    default: break;
  }
}

#if !defined(CPU_CAPABILITY_AVX512)  // (the AVX512 build has panel_gemm512)
// Panel by panel: each panel's k x kPanel slice of B stays in L1 while every row of A passes.
void panel_gemm(int64_t m, int64_t n, int64_t k, int64_t sum_block, const float* a, int64_t rs_a, int64_t cs_a,
                const float* b, int64_t ld_b, int64_t ps_b, bool accumulate, float* c, int64_t ldc) {
  for (int64_t j0 = 0; j0 < n; j0 += kPanel) {
    const float* panel = b + (j0 / kPanel) * ps_b;
    const int64_t cols = std::min(kPanel, n - j0);
    (cols < kPanel ? &panel_rows<true> : &panel_rows<false>)(m, k, sum_block, accumulate, a, rs_a, cs_a, panel, ld_b,
                                                             c + j0, ldc, cols);
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
// two 512-bit FMA units does twice the 256-bit kernel's work per cycle.)
// The zmm register blocks' three steps: R rows x NP panels of C into registers (or 0), the products of
// k rows kk0..kk1 of B added one fused multiply-add each in k order, and the registers back to C.
template <int R, int NP>
inline void load_block512(bool from_c, const float* c, int64_t ldc, __mmask16 mask0, __mmask16 mask1,
                          __m512 (&acc)[R][NP]) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int q = 0; q < NP; ++q) {
      acc[r][q] = from_c ? _mm512_maskz_loadu_ps(q == 0 ? mask0 : mask1, c + r * ldc + q * kPanel)
                         : _mm512_setzero_ps();
    }
  }
}

template <int R, int NP>
inline void fma_rows512(int64_t kk0, int64_t kk1, const float* a, int64_t rs_a, int64_t cs_a, const float* b,
                        int64_t ld_b, int64_t ps_b, __mmask16 mask0, __mmask16 mask1, __m512 (&acc)[R][NP]) {
  for (int64_t kk = kk0; kk < kk1; ++kk) {
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
}

template <int R, int NP>
inline void store_block512(const __m512 (&acc)[R][NP], float* c, int64_t ldc, __mmask16 mask0, __mmask16 mask1) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int q = 0; q < NP; ++q) {
      _mm512_mask_storeu_ps(c + r * ldc + q * kPanel, q == 0 ? mask0 : mask1, acc[r][q]);
    }
  }
}

template <int R, int NP, bool kAccumulate>
inline void panel_block512(int64_t k, const float* a, int64_t rs_a, int64_t cs_a, const float* b, int64_t ld_b,
                           int64_t ps_b, float* c, int64_t ldc, __mmask16 mask0, __mmask16 mask1) {
  __m512 acc[R][NP];
  load_block512<R, NP>(kAccumulate, c, ldc, mask0, mask1, acc);
  fma_rows512<R, NP>(0, k, a, rs_a, cs_a, b, ld_b, ps_b, mask0, mask1, acc);
  store_block512<R, NP>(acc, c, ldc, mask0, mask1);
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

// panel_block512 with k in blocks of sum_block, each block's chain from 0 and its sum added to a running
// total (C, or the first block's sum), both in registers: R <= 6 rows (2 x 12 accumulators of the 32).
template <int R, int NP, bool kAccumulate>
inline void panel_sums512(int64_t k, int64_t sum_block, const float* a, int64_t rs_a, int64_t cs_a, const float* b,
                          int64_t ld_b, int64_t ps_b, float* c, int64_t ldc, __mmask16 mask0, __mmask16 mask1) {
  static_assert(R <= 6, "two sets of R x NP accumulators must fit the zmm registers");
  __m512 total[R][NP];
  load_block512<R, NP>(kAccumulate, c, ldc, mask0, mask1, total);
  for (int64_t k0 = 0; k0 < k; k0 += sum_block) {
    __m512 acc[R][NP];
    load_block512<R, NP>(false, c, ldc, mask0, mask1, acc);
    fma_rows512<R, NP>(k0, std::min(k, k0 + sum_block), a, rs_a, cs_a, b, ld_b, ps_b, mask0, mask1, acc);
    const bool first = k0 == 0 && !kAccumulate;
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
      for (int q = 0; q < NP; ++q) {
        total[r][q] = first ? acc[r][q] : _mm512_add_ps(total[r][q], acc[r][q]);
      }
    }
  }
  store_block512<R, NP>(total, c, ldc, mask0, mask1);
}

// Every row of A against NP panels in blocks of 6 rows, k summed in blocks (panel_sums512).
template <int NP, bool kAccumulate>
void panel_sum_rows512(int64_t m, int64_t k, int64_t sum_block, const float* a, int64_t rs_a, int64_t cs_a,
                       const float* b, int64_t ld_b, int64_t ps_b, float* c, int64_t ldc, int64_t cols) {
  constexpr int kRows = 6;
  const __mmask16 mask0 = lanes16(cols);
  const __mmask16 mask1 = lanes16(cols - kPanel);
  int64_t i = 0;
  for (; i + kRows <= m; i += kRows) {
    panel_sums512<kRows, NP, kAccumulate>(k, sum_block, a + i * rs_a, rs_a, cs_a, b, ld_b, ps_b, c + i * ldc, ldc,
                                          mask0, mask1);
  }
  const float* a_rest = a + i * rs_a;
  float* c_rest = c + i * ldc;
#define CA_SUM_REST(R)                                                                                           \
  case R:                                                                                                        \
    panel_sums512<R, NP, kAccumulate>(k, sum_block, a_rest, rs_a, cs_a, b, ld_b, ps_b, c_rest, ldc, mask0, mask1); \
    break;
  switch (m - i) {
    CA_SUM_REST(5) CA_SUM_REST(4) CA_SUM_REST(3) CA_SUM_REST(2) CA_SUM_REST(1)
    default: break;
  }
#undef CA_SUM_REST
}

void panel_gemm512(int64_t m, int64_t n, int64_t k, int64_t sum_block, const float* a, int64_t rs_a, int64_t cs_a,
                   const float* b, int64_t ld_b, int64_t ps_b, bool accumulate, float* c, int64_t ldc) {
  if (sum_block <= 0) {
    zmm_gemm<FloatBlocks>(m, n, k, a, rs_a, cs_a, b, ld_b, ps_b, accumulate, c, ldc);
    return;
  }
  for (int64_t j0 = 0; j0 < n; j0 += 2 * kPanel) {
    const float* panels = b + (j0 / kPanel) * ps_b;
    const int64_t cols = std::min(2 * kPanel, n - j0);
    const auto rows = cols > kPanel ? (accumulate ? &panel_sum_rows512<2, true> : &panel_sum_rows512<2, false>)
                                    : (accumulate ? &panel_sum_rows512<1, true> : &panel_sum_rows512<1, false>);
    rows(m, k, sum_block, a, rs_a, cs_a, panels, ld_b, ps_b, c + j0, ldc, cols);
  }
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

}  // namespace

template <typename scalar_t>
void set_panel_gemm_ops(TileOps<scalar_t>& ops) {
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
#else
  (void)ops;
#endif
}
CA_INSTANTIATE_TILE_FAMILY(set_panel_gemm_ops)

}  // namespace causal_attention::tile::CPU_CAPABILITY
