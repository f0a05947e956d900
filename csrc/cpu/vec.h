// Vector helpers shared by the per-instruction-set kernels (csrc/attention/cpu, csrc/linear/cpu).
// Included only by files compiled once per instruction set: everything lives in the namespace
// causal_attention::tile::<CPU_CAPABILITY>, as at::vec's does, so the builds' copies never mix.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <type_traits>

#ifndef CPU_CAPABILITY
#error "compiled once per instruction set, with -DCPU_CAPABILITY=DEFAULT|AVX2|AVX512"
#endif

namespace causal_attention::tile::CPU_CAPABILITY {

template <typename acc_t>
using Vec = at::vec::Vectorized<acc_t>;

template <typename acc_t>
inline constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();

// bfloat16 and half are widened to float32 in registers, W = Vec<float>::size() values at a time
// (at::vec: vcvtph2ps / a shift on AVX2 and AVX512, a scalar loop in the DEFAULT build), and
// narrowed back with round to nearest even, as static_cast does.
template <typename scalar_t>
inline constexpr bool kReduced = c10::is_reduced_floating_point_v<scalar_t>;

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
// running maxima, so that at::vec::maximum (a max, and an or that keeps NaN) does not wait its
// latency at every vector.
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

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// Lanes [0, 8) of a 256-bit mask for the first `count` of 8 floats (count clamped to [0, 8]): the
// masked loads and stores of a register block's last, partial panel.
inline __m256i lane_mask(int64_t count) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(count, 0, 8))), lanes);
}
#endif

}  // namespace causal_attention::tile::CPU_CAPABILITY
