#include "causal_attention/module.h"

#include "causal_attention/attention.h"

namespace causal_attention {

namespace {
int64_t checked_dim(int64_t dim, int64_t n_heads) {
  TORCH_CHECK_VALUE(dim > 0 && n_heads > 0, "CausalSelfAttention: dim (got ", dim, ") and n_heads (got ",
                    n_heads, ") must be positive");
  TORCH_CHECK_VALUE(dim % n_heads == 0, "CausalSelfAttention: dim (got ", dim,
                    ") must be divisible by n_heads (got ", n_heads, ")");
  return dim;
}
}  // namespace

CausalSelfAttentionImpl::CausalSelfAttentionImpl(int64_t dim, int64_t n_heads)
    : dim_(checked_dim(dim, n_heads)), n_heads_(n_heads) {
  qkv = register_module("qkv", torch::nn::Linear(torch::nn::LinearOptions(dim, 3 * dim).bias(true)));
  proj = register_module("proj", torch::nn::Linear(torch::nn::LinearOptions(dim, dim).bias(true)));
}

at::Tensor CausalSelfAttentionImpl::forward(const at::Tensor& x, const std::optional<at::Tensor>& key_padding_mask) {
  TORCH_CHECK_VALUE(x.dim() == 3, "x must be 3-D (B, T, dim); got shape ", x.sizes());
  TORCH_CHECK_VALUE(x.size(2) == dim_, "x must have last dimension dim=", dim_, "; got shape ", x.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(x.scalar_type()), "x must be a floating-point tensor; got dtype ",
                   x.scalar_type());
  const auto mask = normalize_key_padding_mask(key_padding_mask, x);  // (B, T) bool or none
  const auto qkv_out = qkv->forward(x);                                // (B, T, 3 * dim)
  const auto heads = attention(qkv_out, mask, n_heads_);               // (B, T, dim)
  return proj->forward(heads);                                         // (B, T, dim)
}

}  // namespace causal_attention
