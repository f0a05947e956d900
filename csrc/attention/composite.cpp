// The attention core as a composition of ATen operations. It runs on any device and gets its
// backward from ATen's autograd; the fused CPU kernel (flash.cpp) is the fast path on CPU.
#include "causal_attention/attention.h"

#include <cmath>
#include <limits>

namespace causal_attention::kernels {

std::tuple<at::Tensor, at::Tensor, at::Tensor> split_heads(const at::Tensor& qkv, int64_t n_heads, int64_t n_kv_heads) {
  check_qkv(qkv, n_heads, n_kv_heads);
  const int64_t hd = qkv.size(2) / (n_heads + 2 * n_kv_heads);
  const auto parts = qkv.split({n_heads * hd, n_kv_heads * hd, n_kv_heads * hd}, 2);
  return {parts[0].unflatten(2, {n_heads, hd}).transpose(1, 2), parts[1].unflatten(2, {n_kv_heads, hd}).transpose(1, 2),
          parts[2].unflatten(2, {n_kv_heads, hd}).transpose(1, 2)};
}

at::Tensor attention_composite(const at::Tensor& qkv, const std::optional<at::Tensor>& key_padding_mask,
                               int64_t n_heads, double dropout_p, std::optional<int64_t> n_kv_heads_in) {
  check_dropout(dropout_p);
  const int64_t n_kv_heads = n_kv_heads_in.value_or(n_heads);
  const auto [q, k, v] = split_heads(qkv, n_heads, n_kv_heads);  // (B, H, T, hd), (B, Hkv, T, hd) twice
  const int64_t B = qkv.size(0);
  const int64_t T = qkv.size(1);
  const int64_t dim = q.size(1) * q.size(3);
  const bool gqa = n_kv_heads != n_heads;

  at::Tensor out;  // (B, H, T, hd)
  if (!key_padding_mask.has_value()) {
    out = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/std::nullopt, dropout_p,
                                           /*is_causal=*/true, /*scale=*/std::nullopt, gqa);
  } else {
    const auto& mask = *key_padding_mask;  // (B, T) bool, True = real
    TORCH_CHECK_VALUE(mask.scalar_type() == at::kBool && mask.dim() == 2 && mask.size(0) == B &&
                          mask.size(1) == T,
                      "key_padding_mask must be a bool tensor of shape (B, T) = (", B, ", ", T, "); got ",
                      mask.scalar_type(), " of shape ", mask.sizes());
    const auto opts = mask.options();
    const auto causal = at::ones({T, T}, opts).tril();               // (T, T)
    auto allowed = causal.unsqueeze(0).logical_and(mask.unsqueeze(1));  // (B, T, T)
    // A query has an allowed key iff some key 0..t is real.
    const auto has_key = mask.cumsum(1, at::kInt).gt(0);              // (B, T)
    // A row with no allowed key would be all -inf (NaN): let it see its own key, then zero it.
    allowed = allowed.logical_or(has_key.logical_not().unsqueeze(2).logical_and(at::eye(T, opts)));
    out = at::scaled_dot_product_attention(q, k, v, allowed.unsqueeze(1), dropout_p, false, std::nullopt, gqa);
    out = out.masked_fill(has_key.logical_not().view({B, 1, T, 1}), 0);
  }
  return out.transpose(1, 2).reshape({B, T, dim});  // (B, T, H, hd) -> (B, T, dim)
}

}  // namespace causal_attention::kernels

namespace causal_attention::kernels {

at::Tensor attention_math(const at::Tensor& qkv, const std::optional<at::Tensor>& key_padding_mask, int64_t n_heads,
                          double dropout_p, const std::optional<at::Tensor>& keep,
                          std::optional<int64_t> n_kv_heads_in, std::optional<int64_t> window) {
  check_dropout(dropout_p);
  const int64_t n_kv_heads = n_kv_heads_in.value_or(n_heads);
  auto [q, k, v] = split_heads(qkv, n_heads, n_kv_heads);
  if (n_kv_heads != n_heads) {  // each query head's own copy of its group's key/value head: (B, H, T, hd)
    k = k.repeat_interleave(n_heads / n_kv_heads, 1);
    v = v.repeat_interleave(n_heads / n_kv_heads, 1);
  }
  const int64_t B = qkv.size(0);
  const int64_t T = qkv.size(1);
  const int64_t hd = q.size(3);
  const int64_t dim = n_heads * hd;
  auto allowed = at::ones({T, T}, qkv.options().dtype(at::kBool)).tril();  // (T, T)
  if (window.has_value()) {
    TORCH_CHECK_VALUE(*window > 0, "window must be a positive number of keys; got ", *window);
    allowed = allowed.triu(1 - *window);  // key j within the window of query i: i - j < window
  }
  allowed = allowed.view({1, 1, T, T});
  if (key_padding_mask.has_value()) {
    allowed = allowed.logical_and(key_padding_mask->view({B, 1, 1, T}));  // (B, 1, T, T)
  }
  const auto scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));  // (B, H, T, T)
  auto weights = at::softmax(scores.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity()), -1);
  weights = at::where(allowed.any(-1, /*keepdim=*/true), weights, at::zeros_like(weights));  // empty rows: 0
  if (dropout_p > 0) {
    TORCH_CHECK_VALUE(keep.has_value() && keep->defined(), "attention_math: dropout_p > 0 needs the keep mask");
    weights = weights * keep->to(weights.scalar_type()) / (1.0 - dropout_p);  // P_drop (B, H, T, T)
  }
  return at::matmul(weights, v).transpose(1, 2).reshape({B, T, dim});  // (B, T, dim)
}

}  // namespace causal_attention::kernels
