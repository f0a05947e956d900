// Attention-weight dropout of a tile: Philox4x32-10 (philox.h) a vector of counters at a time.
#include "attention/philox.h"
#include "cpu/families.h"
#include "cpu/vec.h"

namespace causal_attention::tile::CPU_CAPABILITY {
namespace {

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

}  // namespace

template <typename scalar_t>
void set_dropout_ops(TileOps<scalar_t>& ops) {
  ops.dropout = &dropout<scalar_t>;
}
CA_INSTANTIATE_TILE_FAMILY(set_dropout_ops)

}  // namespace causal_attention::tile::CPU_CAPABILITY
