#include "causal_attention/module.h"

#include "causal_attention/attention.h"
#include "config.h"
#include "memory/parameters.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <initializer_list>

namespace causal_attention {

namespace {
int64_t checked_dim(int64_t dim, int64_t n_heads) {
  TORCH_CHECK_VALUE(dim > 0 && n_heads > 0, "CausalSelfAttention: dim (got ", dim, ") and n_heads (got ",
                    n_heads, ") must be positive");
  TORCH_CHECK_VALUE(dim % n_heads == 0, "CausalSelfAttention: dim (got ", dim,
                    ") must be divisible by n_heads (got ", n_heads, ")");
  return dim;
}

std::optional<int64_t> checked_kv_heads(int64_t n_heads, std::optional<int64_t> n_kv_heads) {
  TORCH_CHECK_VALUE(!n_kv_heads.has_value() || (*n_kv_heads > 0 && n_heads % *n_kv_heads == 0),
                    "CausalSelfAttention: n_kv_heads must be positive and divide n_heads (got ", n_heads, "); got ",
                    n_kv_heads.value_or(0));
  return n_kv_heads;
}

double checked_dropout(double dropout) {
  check_dropout(dropout);
  return dropout;
}

// Whether a product of `rows` input rows is a decode step's: few rows, no autograd (few_rows_linear's and
// the fused decode step's first condition; Python's _few_rows_step).
bool few_rows_step(int64_t rows) { return rows <= kFewRows && !at::GradMode::is_enabled(); }

// Whether kernels::few_rows_linear_cpu streams these weights (undefined: a layer without bias) against x:
// x and every weight on the CPU in x's dtype, no CPU autocast. few_rows_linear and decode_layer_applies
// share it, so that the fused step runs exactly where its projections would stream (and gives their bits).
// Python's _engine_streams.
bool engine_streams(const at::Tensor& x, std::initializer_list<const at::Tensor*> weights) {
  if (!x.device().is_cpu() || at::autocast::is_autocast_enabled(at::kCPU)) {
    return false;
  }
  return std::all_of(weights.begin(), weights.end(), [&](const at::Tensor* w) {
    return !w->defined() || (w->scalar_type() == x.scalar_type() && w->device().is_cpu());
  });
}
}  // namespace

at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const int64_t rows = x.numel() / std::max<int64_t>(1, x.size(-1));
  if (!few_rows_step(rows)) {
    return project(x, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt);
  }
  if (engine_streams(x, {&weight, &bias})) {  // streams the weight once
    return kernels::few_rows_linear_cpu(x, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt);
  }
  const auto xt = x.reshape({rows, x.size(-1)}).t();                                               // (in, rows)
  const auto y = bias.defined() ? at::addmm(bias.unsqueeze(1), weight, xt) : at::mm(weight, xt);  // (out, rows)
  auto sizes = x.sizes().vec();
  sizes.back() = weight.size(0);
  return y.t().reshape(sizes);  // (..., out)
}

KVCache::KVCache(int64_t batch_size, int64_t n_heads, int64_t head_dim, int64_t max_len,
                 const at::TensorOptions& options) {
  TORCH_CHECK_VALUE(batch_size > 0 && n_heads > 0 && head_dim > 0 && max_len > 0,
                    "KVCache sizes must be positive; got batch_size=", batch_size, ", n_heads=", n_heads,
                    ", head_dim=", head_dim, ", max_len=", max_len);
  // On the CPU on huge pages where it is large enough (kernels::cache_zeros).
  k = kernels::cache_zeros({batch_size, n_heads, max_len, head_dim}, options.dtype().toScalarType(), options.device());
  v = kernels::cache_zeros({batch_size, n_heads, max_len, head_dim}, options.dtype().toScalarType(), options.device());
  lengths = at::zeros({batch_size}, options.dtype(at::kLong));
}

CausalSelfAttentionImpl::CausalSelfAttentionImpl(int64_t dim, int64_t n_heads, double dropout)
    : CausalSelfAttentionImpl(CausalSelfAttentionOptions(dim, n_heads).dropout(dropout)) {}

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const CausalSelfAttentionOptions& options)
    : dim_(checked_dim(options.dim(), options.n_heads())),
      n_heads_(options.n_heads()),
      n_kv_heads_(checked_kv_heads(options.n_heads(), options.n_kv_heads())),
      dropout_(checked_dropout(options.dropout())),
      bias_(options.bias()) {
  const int64_t width = (n_heads_ + 2 * n_kv_heads()) * head_dim();  // q | k | v
  qkv = register_module("qkv", detail::make_linear(dim_, width, bias_, options.dtype(), options.init()));
  proj = register_module("proj", detail::make_linear(dim_, dim_, bias_, options.dtype(), options.init()));
}

void CausalSelfAttentionImpl::check_x(const at::Tensor& x) const {
  TORCH_CHECK_VALUE(x.dim() == 3, "x must be 3-D (B, T, dim); got shape ", x.sizes());
  TORCH_CHECK_VALUE(x.size(2) == dim_, "x must have last dimension dim=", dim_, "; got shape ", x.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(x.scalar_type()), "x must be a floating-point tensor; got dtype ",
                   x.scalar_type());
}

bool CausalSelfAttentionImpl::decode_layer_applies(const at::Tensor& x) const {
  // Where both projections would take few_rows_linear's engine path (as Python's _decode_layer).
  return few_rows_step(x.size(0) * x.size(1)) &&
         engine_streams(x, {&qkv->weight, &qkv->bias, &proj->weight, &proj->bias});  // (bias: undefined without)
}

KVCache CausalSelfAttentionImpl::make_cache(int64_t batch_size, int64_t max_len) const {
  // A decode step streams the weights with the cache: on the CPU they move onto huge pages too, in
  // place (kernels::advise_huge_pages).
  for (const auto* weight : {&qkv->weight, &proj->weight}) {
    if (weight->device().is_cpu()) {
      kernels::advise_huge_pages(*weight);
    }
  }
  return KVCache(batch_size, n_kv_heads(), head_dim(), max_len, qkv->weight.options());
}

at::Tensor CausalSelfAttentionImpl::forward(const at::Tensor& x, const std::optional<at::Tensor>& key_padding_mask,
                                            KVCache& cache) {
  check_x(x);
  TORCH_CHECK_VALUE(x.device().is_cpu(), "the C++ KV cache path runs on CPU tensors; got x on ", x.device());
  if (at::GradMode::is_enabled()) {
    // The cache path has no backward: refuse it while anything that could want a gradient does.
    TORCH_CHECK_VALUE(!x.requires_grad(),
                      "the KV cache is for inference: x requires grad; call the layer under torch::NoGradGuard");
    for (const auto& param : named_parameters()) {
      TORCH_CHECK_VALUE(!param.value().requires_grad(), "the KV cache is for inference: parameter ", param.key(),
                        " requires grad; call the layer under torch::NoGradGuard");
    }
  }
  // Inference tensors may be written in place only in InferenceMode: refuse before writing anything.
  TORCH_CHECK_VALUE(c10::InferenceMode::is_enabled() ||
                        !(cache.k.is_inference() || cache.v.is_inference() || cache.lengths.is_inference()),
                    "the KV cache was made under c10::InferenceMode: step it under InferenceMode too (or make it "
                    "under torch::NoGradGuard)");
  const auto mask = normalize_key_padding_mask(key_padding_mask, x);  // (B, t) bool or none
  if (decode_layer_applies(x)) {  // the steps below fused, the same bits (kernels::decode_layer_cpu)
    const auto optional = [](const at::Tensor& b) { return b.defined() ? std::optional<at::Tensor>(b) : std::nullopt; };
    return kernels::decode_layer_cpu(x, qkv->weight, optional(qkv->bias), proj->weight, optional(proj->bias), cache.k,
                                     cache.v, cache.lengths, mask, n_heads_, n_kv_heads_);
  }
  const auto start = cache.lengths;                                    // (B,)
  const auto end = cache_end(start, mask, x.size(1), cache.max_len());  // (B,), checked
  const auto qkv_out = few_rows_linear(x, qkv->weight, qkv->bias);  // (B, t, (H + 2 Hkv) * hd)
  kernels::kv_cache_write_cpu(qkv_out, cache.k, cache.v, start, end, n_heads_, n_kv_heads_);
  const auto heads =
      kernels::decode_attention_cpu(qkv_out, cache.k, cache.v, start, end, n_heads_, n_kv_heads_);  // (B, t, dim)
  cache.lengths.copy_(end);
  return few_rows_linear(heads, proj->weight, proj->bias);
}

at::Tensor CausalSelfAttentionImpl::forward(const at::Tensor& x, const std::optional<at::Tensor>& key_padding_mask) {
  check_x(x);
  const auto mask = normalize_key_padding_mask(key_padding_mask, x);  // (B, T) bool or none
  const auto optional = [](const at::Tensor& b) { return b.defined() ? std::optional<at::Tensor>(b) : std::nullopt; };
  // The projections by project: qkv->forward's at::linear, widened for half precision where the CPU has
  // no half arithmetic.
  const auto qkv_out = project(x, qkv->weight, optional(qkv->bias));  // (B, T, (H + 2 Hkv) * hd)
  const double dropout_p = is_training() ? dropout_ : 0.0;
  const auto heads = attention(qkv_out, mask, n_heads_, dropout_p, std::nullopt, n_kv_heads_);  // (B, T, dim)
  return project(heads, proj->weight, optional(proj->bias));           // (B, T, dim)
}

}  // namespace causal_attention
