// The merge of a decode pass's split states: each split of a context leaves, per query row, its output
// sum (hd values), running max m and sum l; the row's output is sum_s O_s e^(m_s - M) / sum_s l_s e^(m_s - M).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace causal_attention::kernels {

// Row r of the splits' states (split s at state(s): o (rows x hd), m (rows), l (rows)) merged into out
// (hd values; merged: hd of scratch). Returns the row's lse, +inf (and out = 0) where no split saw a key.
template <typename acc_t, typename scalar_t, typename State>
acc_t merge_split_row(const State& state, int64_t n_split, int64_t rows, int64_t hd, int64_t r, acc_t* merged,
                      scalar_t* out) {
  acc_t top = -std::numeric_limits<acc_t>::infinity();
  for (int64_t sp = 0; sp < n_split; ++sp) {  // a NaN max (a NaN score) stays: std::max would drop it
    const acc_t m = state(sp)[rows * hd + r];
    top = (std::isnan(m) || m > top) ? m : top;
  }
  if (top == -std::numeric_limits<acc_t>::infinity()) {  // no visible key: output 0
    std::fill(out, out + hd, scalar_t(0));
    return std::numeric_limits<acc_t>::infinity();
  }
  std::fill(merged, merged + hd, acc_t(0));
  acc_t total = 0;
  for (int64_t sp = 0; sp < n_split; ++sp) {
    const acc_t* base = state(sp);
    const acc_t w = std::exp(base[rows * hd + r] - top);  // 0 for a split that saw no key
    total += base[rows * hd + rows + r] * w;
    for (int64_t d = 0; d < hd; ++d) {
      merged[d] += base[r * hd + d] * w;
    }
  }
  for (int64_t d = 0; d < hd; ++d) {
    out[d] = static_cast<scalar_t>(merged[d] / total);
  }
  return top + std::log(total);
}

}  // namespace causal_attention::kernels
