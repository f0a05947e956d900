// The streaming path of attention over separate heads: a few queries against a long past
// (decode_heads.cpp), chosen by attention_heads_forward_cpu.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace causal_attention::kernels {

// Whether decode_heads_cpu serves the call: 1..kDecodeFewRows queries ending a longer past, no softcap,
// no dropout, and keys and values whose head rows share one dense stride.
bool decodes_heads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, std::optional<double> softcap,
                   double dropout_p);

// attention_heads_forward_cpu's (out (B, Tq, H, hd), lse (B, H, Tq)) for such a call (checked by the caller);
// sinks (H,) in lse's dtype, or undefined.
std::tuple<at::Tensor, at::Tensor> decode_heads_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const std::optional<at::Tensor>& mask, double scale,
                                                    std::optional<int64_t> window, const at::Tensor& sinks = {});

}  // namespace causal_attention::kernels
