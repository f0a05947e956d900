// The merge of a decode pass's split states: each split of a context leaves, per query row, its output
// sum (hd values), running max m and sum l; the row's output is sum_s O_s e^(m_s - M) / sum_s l_s e^(m_s - M).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace causal_attention::kernels {

// An attention sink (gpt-oss): one more logit `sink` in a row's softmax, of value 0, merged into the row's
// state (o: hd unnormalised sums, running max m, sum l) as a split of one key would be. A row that saw no
// key stays empty (its output 0); sink = -inf leaves the state as it was, bit for bit.
template <typename acc_t>
void merge_sink(acc_t sink, int64_t hd, acc_t* o, acc_t& m, acc_t& l) {
  if (l == 0 || std::isnan(m)) {
    return;
  }
  if (sink > m) {  // the sink's logit becomes the max: rescale the sums to it
    const acc_t w = std::exp(m - sink);
    for (int64_t d = 0; d < hd; ++d) {
      o[d] *= w;
    }
    l = l * w + 1;
    m = sink;
  } else {
    l += std::exp(sink - m);  // NaN for a NaN sink
  }
}

// Row r of the splits' states (split s at state(s): o (rows x hd), m (rows), l (rows)) merged into out
// (hd values; merged: hd of scratch), with the row's sink logit where sink is given. Returns the row's lse,
// +inf (and out = 0) where no split saw a key.
template <typename acc_t, typename scalar_t, typename State>
acc_t merge_split_row(const State& state, int64_t n_split, int64_t rows, int64_t hd, int64_t r, acc_t* merged,
                      scalar_t* out, const acc_t* sink = nullptr) {
  acc_t top = -std::numeric_limits<acc_t>::infinity();
  for (int64_t sp = 0; sp < n_split; ++sp) {  // a NaN max (a NaN score) stays: std::max would drop it
    const acc_t m = state(sp)[rows * hd + r];
    top = (std::isnan(m) || m > top) ? m : top;
  }
  if (top == -std::numeric_limits<acc_t>::infinity()) {  // no visible key: output 0
    std::fill(out, out + hd, scalar_t(0));
    return std::numeric_limits<acc_t>::infinity();
  }
  if (sink != nullptr && (*sink > top || std::isnan(*sink))) {
    top = *sink;
  }
  std::fill(merged, merged + hd, acc_t(0));
  acc_t total = sink == nullptr ? acc_t(0) : *sink == top ? acc_t(1) : std::exp(*sink - top);  // 1 at +inf too
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
