// Chooses the tile routines for the instruction set of this CPU, once per dtype.
#include "cpu/tile_ops.h"
#include "cpu/tile_tables.h"

#include <ATen/Version.h>

#include <cstring>
#include <string>

namespace causal_attention::tile {
namespace {

enum class Capability { kDefault, kAvx2, kAvx512 };

// ATen's own choice (cpuinfo, capped by ATEN_CPU_CAPABILITY), so that both agree.
Capability detect() {
  const std::string cap = at::get_cpu_capability();
  if (cap == "AVX512") {
    return Capability::kAvx512;
  }
  if (cap == "AVX2") {
    return Capability::kAvx2;
  }
  return Capability::kDefault;
}

Capability capability() {
  static const Capability cap = detect();  // immutable after first use
  return cap;
}

template <typename scalar_t, typename F0, typename F1, typename F2>
TileOps<scalar_t> choose(F0 def, F1 avx2, F2 avx512) {
  switch (capability()) {
    case Capability::kAvx512:
      return avx512();
    case Capability::kAvx2:
      return avx2();
    default:
      return def();
  }
}

}  // namespace

template <>
const TileOps<float>& tile_ops<float>() {
  static const auto ops = choose<float>(DEFAULT::tile_ops_float, AVX2::tile_ops_float, AVX512::tile_ops_float);
  return ops;
}

template <>
const TileOps<double>& tile_ops<double>() {
  static const auto ops = choose<double>(DEFAULT::tile_ops_double, AVX2::tile_ops_double, AVX512::tile_ops_double);
  return ops;
}

template <>
const TileOps<c10::BFloat16>& tile_ops<c10::BFloat16>() {
  static const auto ops =
      choose<c10::BFloat16>(DEFAULT::tile_ops_bfloat16, AVX2::tile_ops_bfloat16, AVX512::tile_ops_bfloat16);
  return ops;
}

template <>
const TileOps<c10::Half>& tile_ops<c10::Half>() {
  static const auto ops = choose<c10::Half>(DEFAULT::tile_ops_half, AVX2::tile_ops_half, AVX512::tile_ops_half);
  return ops;
}

const char* tile_ops_capability() {
  switch (capability()) {
    case Capability::kAvx512:
      return "AVX512";
    case Capability::kAvx2:
      return "AVX2";
    default:
      return "DEFAULT";
  }
}

}  // namespace causal_attention::tile
