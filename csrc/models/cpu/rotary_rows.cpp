// Rotary positions on qkv rows (tile_ops.h: rotary_rows), compiled once per instruction set. Built with
// -ffp-contract=off (CMakeLists.txt): each product is rounded before the sum, as ATen's composition
// rounds them, so a fused multiply-add would change the bits.
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "cpu/families.h"
#include "cpu/vec.h"

namespace causal_attention::tile::CPU_CAPABILITY {
namespace {

// v rounded to scalar_t and widened back (identity for float and double).
template <typename scalar_t, typename acc_t>
Vec<acc_t> rounded(const Vec<acc_t>& v) {
  if constexpr (kReduced<scalar_t>) {
    return std::get<0>(at::vec::convert_to_float<scalar_t>(at::vec::convert_from_float<scalar_t>(v, v)));
  } else {
    return v;
  }
}

template <typename scalar_t, typename acc_t>
Vec<acc_t> load(const scalar_t* p) {
  if constexpr (kReduced<scalar_t>) {
    return load_widened(p);
  } else {
    return Vec<acc_t>::loadu(p);
  }
}

template <typename scalar_t, typename acc_t>
void store(const Vec<acc_t>& v, scalar_t* p) {
  if constexpr (kReduced<scalar_t>) {
    store_narrowed(v, p);
  } else {
    v.store(p);
  }
}

// One head: o[d] = x[d] c[d] - x[d + half] s[d], o[d + half] = x[d + half] c[d + half] + x[d] s[d + half],
// each product rounded to scalar_t, then the sum.
template <typename scalar_t>
void rotate_head(const scalar_t* x, const scalar_t* c, const scalar_t* s, scalar_t* o, int64_t half) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int64_t W = Vec<acc_t>::size();
  int64_t d = 0;
  for (; d + W <= half; d += W) {
    const auto x1 = load<scalar_t, acc_t>(x + d), x2 = load<scalar_t, acc_t>(x + half + d);
    const auto a = rounded<scalar_t>(x1 * load<scalar_t, acc_t>(c + d));
    const auto b = rounded<scalar_t>(x2 * load<scalar_t, acc_t>(s + d));
    const auto e = rounded<scalar_t>(x2 * load<scalar_t, acc_t>(c + half + d));
    const auto f = rounded<scalar_t>(x1 * load<scalar_t, acc_t>(s + half + d));
    store(a - b, o + d);  // a + (-b): negation is exact
    store(e + f, o + half + d);
  }
  const auto round = [](acc_t v) { return static_cast<acc_t>(static_cast<scalar_t>(v)); };
  for (; d < half; ++d) {
    const acc_t x1 = x[d], x2 = x[half + d];
    o[d] = static_cast<scalar_t>(round(x1 * acc_t(c[d])) - round(x2 * acc_t(s[d])));
    o[half + d] = static_cast<scalar_t>(round(x2 * acc_t(c[half + d])) + round(x1 * acc_t(s[half + d])));
  }
}

template <typename scalar_t>
void rotary_rows(const scalar_t* x, const scalar_t* c, const scalar_t* s, scalar_t* out, int64_t rows,
                 int64_t width, int64_t rotated, int64_t hd) {
  for (int64_t r = 0; r < rows; ++r) {
    const scalar_t* xr = x + r * width;
    scalar_t* o = out + r * width;
    for (int64_t h0 = 0; h0 < rotated; h0 += hd) {
      rotate_head(xr + h0, c + r * hd, s + r * hd, o + h0, hd / 2);
    }
    std::copy(xr + rotated, xr + width, o + rotated);  // v
  }
}

}  // namespace

template <typename scalar_t>
void set_rotary_ops(TileOps<scalar_t>& ops) {
  ops.rotary_rows = &rotary_rows<scalar_t>;
}
CA_INSTANTIATE_TILE_FAMILY(set_rotary_ops)

}  // namespace causal_attention::tile::CPU_CAPABILITY
