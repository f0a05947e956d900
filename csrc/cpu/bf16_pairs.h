// The AVX512-BF16 pair primitives shared by the pair GEMM (csrc/attention/cpu/pair_gemm.cpp), the
// softmax that feeds it and the few-rows linear kernel (csrc/linear/cpu/linear_rows.cpp). Built into
// the AVX512 build only and called only where the CPU has AVX512-BF16 (has_avx512_bf16).
#pragma once

#include "cpu/vec.h"

#if defined(CPU_CAPABILITY_AVX512)
#include <cstring>

// vdpbf16ps adds, in each float32 lane, the two products of a pair of bfloat16 (exact in float32) to
// the running sum. A pair is two consecutive bfloat16 in memory, read as one 32-bit lane.
#define CA_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace causal_attention::tile::CPU_CAPABILITY {

// Whether this CPU runs the AVX512-BF16 instructions the pair kernels use.
inline bool has_avx512_bf16() { return __builtin_cpu_supports("avx512bf16"); }

// bfloat16 as the AVX512-BF16 instructions narrow and read it: to nearest even as ATen rounds, except
// that a float32 denormal gives a zero of its sign (vcvtneps2bf16). vdpbf16ps, the only reader of values
// narrowed this way, reads a bfloat16 denormal as 0 anyway: the products are ATen rounding's but where a
// float32 denormal within half a bfloat16 step of FLT_MIN rounds up to FLT_MIN (a difference below 1e-38
// times the other factor). One instruction for 16 values, where at::vec's rounding takes eight.
inline c10::BFloat16 round_pair_value(float x) {
  return std::fabs(x) < std::numeric_limits<float>::min() ? c10::BFloat16(std::copysign(0.0f, x)) : c10::BFloat16(x);
}

struct PairRounding {
  // Inline assembly, so that code built for plain AVX-512 can use it: only the pair paths call it, and
  // they are chosen only where the CPU has AVX512-BF16 (has_avx512_bf16).
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

// The pair at x broadcast to every lane.
CA_BF16_TARGET inline __m512i broadcast_pair(const c10::BFloat16* x) {
  uint32_t pair;
  std::memcpy(&pair, x, sizeof(pair));
  return _mm512_set1_epi32(static_cast<int>(pair));
}

}  // namespace causal_attention::tile::CPU_CAPABILITY
#endif
