// The few-rows linear product of a decode step (few_rows_linear_cpu, and the fused decode layer of
// attention/decode.cpp): x's rows prepared once, then any range of output features computed on its own, so
// that threads split the weight's rows between them (all()). Each output is the same sum whichever
// range computes it (linear_rows sums every output alone, in the same order), so a split never
// changes a bit.
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <optional>
#include <type_traits>

#include "cpu/tile_ops.h"

namespace causal_attention::kernels {

// Output features per block of FewRowsProduct::all, the threads' unit (a multiple of linear_rows' 3 and 6
// weight rows).
inline constexpr int64_t kFewRowsBlock = 96;

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

  // Every output feature, blocks of kFewRowsBlock split between the threads: y[m * ld_y + o] for
  // every row m and o < out; y is scalar_t (rounded once) or acc_t (the sums as they are).
  template <typename y_t>
  void all(y_t* y, int64_t ld_y) const {
    const int64_t out = weight_.size(0);
    TORCH_INTERNAL_ASSERT_DEBUG_ONLY(ld_y >= out);
    at::parallel_for(0, (out + kFewRowsBlock - 1) / kFewRowsBlock, 1, [&](int64_t begin, int64_t end) {
      (*this)(begin * kFewRowsBlock, std::min(out, end * kFewRowsBlock), y, ld_y);
    });
  }

  // y[m * ld_y + o] = x[m] . weight[o] (+ bias[o]) for every row m and o0 <= o < o1.
  template <typename y_t>
  void operator()(int64_t o0, int64_t o1, y_t* y, int64_t ld_y) const {
    static_assert(std::is_same_v<y_t, scalar_t> || std::is_same_v<y_t, acc_t>);
    const scalar_t* w = weight_.const_data_ptr<scalar_t>();
    const scalar_t* b = bias_.defined() ? bias_.const_data_ptr<scalar_t>() : nullptr;
    constexpr bool kRounded = std::is_same_v<y_t, scalar_t>;
    if (ops_.linear_rows_pairs != nullptr) {
      if constexpr (kRounded) {
        ops_.linear_rows_pairs(x_.const_data_ptr<scalar_t>(), rows_, in_, w, b, o0, o1, y, ld_y);
      } else {
        ops_.linear_rows_pairs_acc(x_.const_data_ptr<scalar_t>(), rows_, in_, w, b, o0, o1, y, ld_y);
      }
    } else if constexpr (kRounded) {
      ops_.linear_rows(x_.const_data_ptr<acc_t>(), rows_, in_, w, b, o0, o1, y, ld_y);
    } else {
      ops_.linear_rows_acc(x_.const_data_ptr<acc_t>(), rows_, in_, w, b, o0, o1, y, ld_y);
    }
  }

 private:
  const tile::TileOps<scalar_t>& ops_;
  const int64_t rows_, in_;
  const at::Tensor x_, weight_, bias_;
};

}  // namespace causal_attention::kernels
