// Products of bfloat16 / half operands summed in float32 at float32's speed, for CPUs without arithmetic
// in those types: widened_addmm (a half model's projections) and unrounded_linear (its float32 logits).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace causal_attention::kernels {

// a (M, K) @ b (K, N) (+ bias (N,)), bfloat16 or half operands of any strides (one dtype; M, N, K > 0,
// checked by the caller): each output the float32 sum of exact widenings, copied into out (M, N) while
// it is in cache: rounded once where out is bfloat16 / half, kept where it is float32. With the ISA's
// widened_gemm (tile_ops.h): a widened a block of rows at a time (about 8 MB, in L3) and b as the
// kernel packs it. Elsewhere (the DEFAULT build) the operand of the shorter outer dimension is widened
// once, whole (float32: twice its size), the other a block of rows (or columns) at a time, for oneDNN or
// sgemm. b_sums, where defined (float32, (N,)), receives b's column sums b.sum(0), summed from its
// float32 widening (by widened_gemm: in k order within each packed block, the blocks' sums in order).
void widened_blocks(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias,
                    const at::Tensor& out, const at::Tensor& b_sums = at::Tensor());

}  // namespace causal_attention::kernels
