// The drivers of the AVX-512 micro-kernels (the float32 panel GEMM and the bfloat16 pair GEMM):
// both walk C the same way, only their register block differs.
#pragma once

#include "cpu/tile_ops.h"
#include "cpu/vec.h"

#if defined(CPU_CAPABILITY_AVX512)
namespace causal_attention::tile::CPU_CAPABILITY {

// The first `count` of 16 lanes (count clamped to [0, 16]).
inline __mmask16 lanes16(int64_t count) {
  return count >= 16 ? __mmask16(0xFFFF) : count <= 0 ? __mmask16(0) : __mmask16((1u << count) - 1);
}

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

}  // namespace causal_attention::tile::CPU_CAPABILITY
#endif
