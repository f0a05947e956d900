// The bfloat16 pair GEMM (AVX512-BF16, and AMX-BF16 tiles where the CPU and the OS allow them): its
// micro-kernels, the packing of its operands and the backward's steps that write them rounded (AVX512
// build; chosen only where the CPU has AVX512-BF16).
#include "attention/cpu/zmm_gemm.h"
#include "cpu/bf16_pairs.h"
#include "cpu/families.h"
#include "cpu/vec.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <string_view>
#include <vector>

namespace causal_attention::tile::CPU_CAPABILITY {
namespace {

#if defined(CPU_CAPABILITY_AVX512)
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

// Pairs: over k2 pairs of B's rows, a B panel row holding kPanel pairs (2 kPanel bfloat16).
void pair_gemm(int64_t m, int64_t n, int64_t k2, const c10::BFloat16* a, int64_t rs_a, int64_t cs_a,
               const c10::BFloat16* b, int64_t ps_b, bool accumulate, float* c, int64_t ldc) {
  zmm_gemm<PairBlocks>(m, n, k2, a, rs_a, cs_a, b, 2 * kPanel, ps_b, accumulate, c, ldc);
}

// ---- AMX-BF16 -------------------------------------------------------------------------------------
// A tile is 16 rows of 64 bytes: 16 pairs of an A row, 16 pairs (rows) of a B panel, or 16 float32 of
// C. tdpbf16ps adds the 16 pairs' products of a row and a column to C's float32 sums, as vdpbf16ps
// does, though not with the same roundings (some sums differ in their last bit), so a call sums its
// pairs in one fixed way whatever its shape: the first whole chunks of 16 pairs on
// tiles, the rest of k2 on vdpbf16ps from those sums. pair_dots_amx sums the same way.
#define CA_AMX_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))

inline constexpr int64_t kTileRows = 16;
inline constexpr int64_t kTileElems = kTileRows * 2 * kPanel;  // bfloat16 of an A or B tile
// A row block's packed pairs live on the stack: calls with more pairs than this run on vdpbf16ps.
inline constexpr int64_t kAmxMaxChunks = 16;

// Whether this process may use AMX-BF16 tiles: the CPU has them and Linux grants the tile state
// (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA; once per process, for every thread).
bool amx_bf16_granted() {
  static const bool granted = [] {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) {
      return false;
    }
    constexpr long kReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// Whether the pair GEMM runs on AMX tiles: granted, and not held back by ONEDNN_MAX_CPU_ISA (the
// variable that holds torch's oneDNN to an instruction set: below AMX it holds ours there too).
bool use_amx_bf16() {
  const char* isa = std::getenv("ONEDNN_MAX_CPU_ISA");
  if (isa != nullptr && *isa != '\0') {
    const std::string_view v(isa);
    if (v.find("AMX") == std::string_view::npos && v.find("amx") == std::string_view::npos && v != "ALL" &&
        v != "all" && v != "DEFAULT" && v != "default") {
      return false;
    }
  }
  return amx_bf16_granted();
}

// Palette 1, eight 16 x 64-byte tiles: tmm0..3 C (row tile r, panel q: 2r + q), tmm4..5 A (row tile
// 0, 1), tmm6..7 B (panel 0, 1). Loading it zeroes every tile.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

CA_AMX_TARGET inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = kTileRows;
  }
  _tile_loadconfig(&config);
}

// Where a row tile's A comes from: rows of the caller's A (rs_a apart, pairs adjacent) or the packed
// tiles (16 x 16 pairs each, chunk after chunk).
struct ATiles {
  const c10::BFloat16* x;
  int64_t stride_bytes;
  int64_t chunk_step;  // elements from one chunk of 16 pairs to the next
};

// Rows i0.. (up to 16) of A over `chunks` chunks of 16 pairs as tiles at dst: pair (i, p) of A is at
// a + i * rs_a + p * cs_a, in one of pair_gemm's two layouts (cs_a = 2 or rs_a = 2); rows past `rows`
// zero.
CA_AMX_TARGET void pack_a_tiles(const c10::BFloat16* a, int64_t rs_a, int64_t cs_a, int64_t rows, int64_t chunks,
                                c10::BFloat16* dst) {
  const __mmask16 valid = lanes16(rows);
  for (int64_t ch = 0; ch < chunks; ++ch) {
    c10::BFloat16* tile = dst + ch * kTileElems;
    if (cs_a == 2) {  // each row's 16 pairs are adjacent
      for (int64_t i = 0; i < kTileRows; ++i) {
        const __m512i row = i < rows ? _mm512_loadu_si512(a + i * rs_a + ch * 2 * kTileRows) : _mm512_setzero_si512();
        _mm512_storeu_si512(tile + i * 2 * kPanel, row);
      }
    } else {  // round_pairs_transposed's layout: a pair row p holds the pairs of consecutive rows
      __m512i r[16];
      for (int64_t p = 0; p < kTileRows; ++p) {
        r[p] = _mm512_maskz_loadu_epi32(valid, a + (ch * kTileRows + p) * cs_a);
      }
      transpose_16x16_epi32(r, tile);
    }
  }
}

// Where C tile for rows x cols of c (ldc) loads from: c itself (a whole tile) or tmp, which holds the
// real cells and zeros; nullptr: it starts at zero. (The tile intrinsics name their tile by a literal.)
CA_AMX_TARGET inline const float* c_source(bool accumulate, const float* c, int64_t ldc, int64_t rows, int64_t cols,
                                           float* tmp, int64_t& stride_bytes) {
  if (!accumulate) {
    return nullptr;
  }
  if (rows == kTileRows && cols == kPanel) {
    stride_bytes = ldc * static_cast<int64_t>(sizeof(float));
    return c;
  }
  const __mmask16 mask = lanes16(cols);
  for (int64_t i = 0; i < kTileRows; ++i) {
    _mm512_storeu_ps(tmp + i * kPanel, i < rows ? _mm512_maskz_loadu_ps(mask, c + i * ldc) : _mm512_setzero_ps());
  }
  stride_bytes = kPanel * static_cast<int64_t>(sizeof(float));
  return tmp;
}

// Where C tile for rows x cols of c stores to: c itself (a whole tile) or tmp, then copied back by
// copy_back, so that nothing past the real cells is written.
inline float* c_destination(float* c, int64_t ldc, int64_t rows, int64_t cols, float* tmp, int64_t& stride_bytes) {
  const bool whole = rows == kTileRows && cols == kPanel;
  stride_bytes = (whole ? ldc : kPanel) * static_cast<int64_t>(sizeof(float));
  return whole ? c : tmp;
}

CA_AMX_TARGET inline void copy_back(const float* tmp, float* c, int64_t ldc, int64_t rows, int64_t cols) {
  if (rows == kTileRows && cols == kPanel) {
    return;
  }
  const __mmask16 mask = lanes16(cols);
  for (int64_t i = 0; i < rows; ++i) {
    _mm512_mask_storeu_ps(c + i * ldc, mask, _mm512_loadu_ps(tmp + i * kPanel));
  }
}

#define CA_AMX_LOAD_C(T, C, ROWS, COLS)                                                       \
  do {                                                                                        \
    int64_t stride = 0;                                                                       \
    const float* src = c_source(accumulate, (C), ldc, (ROWS), (COLS), tmp[T], stride);       \
    if (src == nullptr) {                                                                     \
      _tile_zero(T);                                                                          \
    } else {                                                                                  \
      _tile_loadd(T, src, stride);                                                            \
    }                                                                                         \
  } while (false)

#define CA_AMX_STORE_C(T, C, ROWS, COLS)                                          \
  do {                                                                            \
    int64_t stride = 0;                                                           \
    _tile_stored(T, c_destination((C), ldc, (ROWS), (COLS), tmp[T], stride), stride); \
    copy_back(tmp[T], (C), ldc, (ROWS), (COLS));                                  \
  } while (false)

// NR row tiles (rows[r] real rows each) against NP panels (cols[q] real columns each) over `chunks`
// chunks of 16 pairs.
template <int NR, int NP>
CA_AMX_TARGET void amx_block(int64_t chunks, const ATiles (&a)[2], const c10::BFloat16* b, int64_t ps_b,
                             bool accumulate, float* c, int64_t ldc, const int64_t (&rows)[2],
                             const int64_t (&cols)[2]) {
  alignas(64) float tmp[4][kTileRows * kPanel];
  CA_AMX_LOAD_C(0, c, rows[0], cols[0]);
  if constexpr (NP == 2) CA_AMX_LOAD_C(1, c + kPanel, rows[0], cols[1]);
  if constexpr (NR == 2) CA_AMX_LOAD_C(2, c + kTileRows * ldc, rows[1], cols[0]);
  if constexpr (NR == 2 && NP == 2) CA_AMX_LOAD_C(3, c + kTileRows * ldc + kPanel, rows[1], cols[1]);
  constexpr int64_t kBStride = 2 * kPanel * static_cast<int64_t>(sizeof(c10::BFloat16));
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const c10::BFloat16* bc = b + ch * kTileElems;
    _tile_loadd(4, a[0].x + ch * a[0].chunk_step, a[0].stride_bytes);
    _tile_loadd(6, bc, kBStride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NP == 2) {
      _tile_loadd(7, bc + ps_b, kBStride);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (NR == 2) {
      _tile_loadd(5, a[1].x + ch * a[1].chunk_step, a[1].stride_bytes);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NP == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  CA_AMX_STORE_C(0, c, rows[0], cols[0]);
  if constexpr (NP == 2) CA_AMX_STORE_C(1, c + kPanel, rows[0], cols[1]);
  if constexpr (NR == 2) CA_AMX_STORE_C(2, c + kTileRows * ldc, rows[1], cols[0]);
  if constexpr (NR == 2 && NP == 2) CA_AMX_STORE_C(3, c + kTileRows * ldc + kPanel, rows[1], cols[1]);
}

// pair_gemm on AMX tiles for the whole chunks of 16 pairs, then vdpbf16ps for the rest of k2.
CA_AMX_TARGET void pair_gemm_amx(int64_t m, int64_t n, int64_t k2, const c10::BFloat16* a, int64_t rs_a,
                                 int64_t cs_a, const c10::BFloat16* b, int64_t ps_b, bool accumulate, float* c,
                                 int64_t ldc) {
  const int64_t chunks = k2 / kTileRows;
  if (chunks == 0 || chunks > kAmxMaxChunks) {
    zmm_gemm<PairBlocks>(m, n, k2, a, rs_a, cs_a, b, 2 * kPanel, ps_b, accumulate, c, ldc);
    return;
  }
  TORCH_INTERNAL_ASSERT(cs_a == 2 || rs_a == 2, "pair_gemm: A's pairs must be adjacent along its rows or columns");
  configure_tiles();
  alignas(64) c10::BFloat16 packed[2][kAmxMaxChunks * kTileElems];
  for (int64_t i0 = 0; i0 < m; i0 += 2 * kTileRows) {
    const int64_t rows[2] = {std::min(kTileRows, m - i0),
                             std::max<int64_t>(0, std::min(kTileRows, m - i0 - kTileRows))};
    const int nr = rows[1] > 0 ? 2 : 1;
    ATiles tiles[2];
    for (int r = 0; r < nr; ++r) {
      const c10::BFloat16* rows_a = a + (i0 + r * kTileRows) * rs_a;
      if (cs_a == 2 && rows[r] == kTileRows) {
        tiles[r] = {rows_a, rs_a * static_cast<int64_t>(sizeof(c10::BFloat16)), 2 * kTileRows};
      } else {
        pack_a_tiles(rows_a, rs_a, cs_a, rows[r], chunks, packed[r]);
        tiles[r] = {packed[r], 2 * kPanel * static_cast<int64_t>(sizeof(c10::BFloat16)), kTileElems};
      }
    }
    if (nr == 1) {
      tiles[1] = tiles[0];
    }
    for (int64_t j0 = 0; j0 < n; j0 += 2 * kPanel) {
      const int64_t cols[2] = {std::min(kPanel, n - j0), std::max<int64_t>(0, std::min(kPanel, n - j0 - kPanel))};
      const c10::BFloat16* panels = b + (j0 / kPanel) * ps_b;
      float* cc = c + i0 * ldc + j0;
      const bool np2 = cols[1] > 0;
      if (nr == 2) {
        (np2 ? &amx_block<2, 2> : &amx_block<2, 1>)(chunks, tiles, panels, ps_b, accumulate, cc, ldc, rows, cols);
      } else {
        (np2 ? &amx_block<1, 2> : &amx_block<1, 1>)(chunks, tiles, panels, ps_b, accumulate, cc, ldc, rows, cols);
      }
    }
  }
  const int64_t done = chunks * kTileRows;
  if (done < k2) {
    zmm_gemm<PairBlocks>(m, n, k2 - done, a + done * cs_a, rs_a, cs_a, b + done * 2 * kPanel, 2 * kPanel, ps_b, true,
                         c, ldc);
  }
}

#undef CA_AMX_LOAD_C
#undef CA_AMX_STORE_C

// pair_dots summed as pair_gemm_amx sums: 16 rows at a time, x's rows against y's rows as one panel
// of B, the diagonal kept.
CA_AMX_TARGET void pair_dots_amx(const c10::BFloat16* x, const c10::BFloat16* y, int64_t rows, int64_t n,
                                 float* out) {
  const int64_t k2 = n / 2;
  std::vector<c10::BFloat16> panel(static_cast<size_t>(2 * k2 * kPanel));
  alignas(64) float prod[kTileRows * kPanel];
  for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
    const int64_t count = std::min(kTileRows, rows - r0);
    pair_panels(y + r0 * n, 1, n, n, count, panel.data());
    pair_gemm_amx(count, count, k2, x + r0 * n, n, 2, panel.data(), 2 * k2 * kPanel, false, prod, kPanel);
    for (int64_t i = 0; i < count; ++i) {
      out[r0 + i] = prod[i * kPanel + i];
    }
  }
}
#endif

}  // namespace

template <typename scalar_t>
void set_pair_gemm_ops(TileOps<scalar_t>& ops) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (has_avx512_bf16()) {
      const bool amx = use_amx_bf16();
      ops.pair_gemm = amx ? &pair_gemm_amx : &pair_gemm;
      ops.pair_panels = &pair_panels;
      ops.round_pairs_transposed = &round_pairs_transposed;
      ops.score_grad_pairs = &score_grad_pairs;
      ops.pair_dots = amx ? &pair_dots_amx : &pair_dots;
      ops.pair_isa = amx ? "AMX-BF16 tiles" : "AVX512-BF16 pairs";
    }
  }
#else
  (void)ops;
#endif
}
CA_INSTANTIATE_TILE_FAMILY(set_pair_gemm_ops)

}  // namespace causal_attention::tile::CPU_CAPABILITY
