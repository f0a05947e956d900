// What this CPU offers, for tests that call one instruction-set build's routines directly (the
// AVX512 build needs AVX512 F, BW, VL and DQ, as ATen's AVX512 capability does).
#pragma once

inline bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

inline bool has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

inline bool has_avx512_bf16() { return has_avx512() && __builtin_cpu_supports("avx512bf16"); }
