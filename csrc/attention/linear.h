// The few-rows linear product of a decode step (few_rows_linear_cpu, and the fused decode layer of
// decode.cpp): x's rows prepared once, then any range of output features computed on its own, so
// that work items split the weight's rows between threads. Each output is the same sum whichever
// range computes it (linear_rows sums every output alone, in the same order), so a split never
// changes a bit.
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include <algorithm>
#include <optional>
#include <utility>

#include "tile_ops.h"

namespace causal_attention::kernels {

// Output features per work item of few_rows_linear_cpu (a multiple of linear_rows' 3 weight rows).
inline constexpr int64_t kFewRowsBlock = 96;

// The output features [first, second) that thread `thread` of `threads` computes in
// few_rows_linear_cpu's parallel_for over blocks of kFewRowsBlock (ATen's split of a range: equal
// chunks of whole items, in thread order).
inline std::pair<int64_t, int64_t> few_rows_share(int64_t out_features, int64_t thread, int64_t threads) {
  const int64_t blocks = (out_features + kFewRowsBlock - 1) / kFewRowsBlock;
  const int64_t used = std::min(threads, blocks);
  const int64_t chunk = (blocks + used - 1) / std::max<int64_t>(used, 1);
  const int64_t first = std::min(out_features, thread * chunk * kFewRowsBlock);
  return {first, std::min(out_features, (thread + 1) * chunk * kFewRowsBlock)};
}

template <typename scalar_t>
class FewRowsProduct {
 public:
  using acc_t = at::opmath_type<scalar_t>;

  // x: (rows, in) rows of any layout; weight (out, in) and bias (out,), checked by the caller.
  FewRowsProduct(const at::Tensor& x_rows, const at::Tensor& weight, const std::optional<at::Tensor>& bias)
      : ops_(tile::tile_ops<scalar_t>()),
        rows_(x_rows.size(0)),
        in_(x_rows.size(1)),
        // bfloat16 pairs read the rows as they are; otherwise the rows are widened to acc_t once.
        x_(ops_.linear_rows_pairs != nullptr ? x_rows.contiguous()
                                             : x_rows.to(c10::CppTypeToScalarType<acc_t>::value).contiguous()),
        weight_(weight.contiguous()),
        bias_(bias.has_value() ? bias->contiguous() : at::Tensor()) {}

  // Asks for the weight rows [o0, o1) to be brought into L2 (prefetcht1; a hint, it never faults).
  static void prefetch(const at::Tensor& weight, int64_t o0, int64_t o1) {
    const char* first = static_cast<const char*>(weight.const_data_ptr()) + o0 * weight.stride(0) * weight.itemsize();
    const int64_t bytes = std::max<int64_t>(0, o1 - o0) * weight.stride(0) * weight.itemsize();
    for (int64_t b = 0; b < bytes; b += 64) {
      __builtin_prefetch(first + b, 0, 2);
    }
  }

  // y[m * ld_y + o] = x[m] . weight[o] (+ bias[o]) for every row m and o0 <= o < o1.
  void operator()(int64_t o0, int64_t o1, scalar_t* y, int64_t ld_y) const {
    const scalar_t* w = weight_.const_data_ptr<scalar_t>();
    const scalar_t* b = bias_.defined() ? bias_.const_data_ptr<scalar_t>() : nullptr;
    if (ops_.linear_rows_pairs != nullptr) {
      ops_.linear_rows_pairs(x_.const_data_ptr<scalar_t>(), rows_, in_, w, b, o0, o1, y, ld_y);
    } else {
      ops_.linear_rows(x_.const_data_ptr<acc_t>(), rows_, in_, w, b, o0, o1, y, ld_y);
    }
  }

 private:
  const tile::TileOps<scalar_t>& ops_;
  const int64_t rows_, in_;
  const at::Tensor x_, weight_, bias_;
};

}  // namespace causal_attention::kernels
