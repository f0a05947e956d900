// The C++ CausalSelfAttention: the same contract as the Python module.
//
//   causal_attention::CausalSelfAttention attn(768, 12);
//   auto y = attn->forward(x);                    // x (B, T, 768) -> y (B, T, 768)
//   auto z = attn->forward(x, key_padding_mask);  // (B, T) bool, True = real token
//   causal_attention::CausalSelfAttention drop(768, 12, /*dropout=*/0.1);  // attention-weight dropout
//   causal_attention::CausalSelfAttention nb(
//       causal_attention::CausalSelfAttentionOptions(768, 12).bias(false));  // no qkv/proj biases
//   causal_attention::CausalSelfAttention gqa(
//       causal_attention::CausalSelfAttentionOptions(2048, 32).n_kv_heads(8));  // grouped-query attention
#pragma once

#include <torch/arg.h>

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <optional>

#include "causal_attention/link.h"

namespace causal_attention {

// A static KV cache for one layer: keys and values (B, n_kv_heads, max_len, head_dim), lengths (B,) int64.
struct KVCache {
  KVCache(int64_t batch_size, int64_t n_heads, int64_t head_dim, int64_t max_len,
          const at::TensorOptions& options = at::kFloat);

  int64_t max_len() const { return k.size(2); }
  void reset() { lengths.zero_(); }  // forget every sequence; the buffers are reused

  at::Tensor k, v, lengths;
};

// What a module's constructor writes into its parameters: torch's initialisation (kRandom, drawn
// from the default generator), or nothing (kSkip, as torch.nn.utils.skip_init: memory of the
// parameters' dtype left uninitialised, on huge pages where a tensor spans one, and no draw from the
// generator), for a loader that overwrites every parameter (load_gpt).
enum class Init { kRandom, kSkip };

// The layer's options, as the Python keywords: dim, n_heads, then dropout (see below), bias
// (False: qkv and proj are Linear layers without bias, nanoGPT's bias=False; the state holds
// qkv.weight and proj.weight only) and n_kv_heads (grouped-query attention: a divisor of n_heads, the
// key/value heads; qkv is then Linear(dim, (n_heads + 2 * n_kv_heads) * head_dim), q | k | v, and query
// head h reads key/value head h / (n_heads / n_kv_heads); none: n_heads, the seed's layer bit for bit).
struct CausalSelfAttentionOptions {
  CausalSelfAttentionOptions(int64_t dim, int64_t n_heads) : dim_(dim), n_heads_(n_heads) {}
  TORCH_ARG(int64_t, dim);
  TORCH_ARG(int64_t, n_heads);
  TORCH_ARG(double, dropout) = 0.0;
  TORCH_ARG(bool, bias) = true;
  TORCH_ARG(std::optional<int64_t>, n_kv_heads) = std::nullopt;
  TORCH_ARG(at::ScalarType, dtype) = at::kFloat;  // the parameters' (a random start is drawn in float32)
  TORCH_ARG(Init, init) = Init::kRandom;
};

class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  // dim % n_heads != 0 is a ValueError naming both numbers. dropout: the probability of dropping
  // an attention weight, in [0, 1) (ValueError otherwise), applied only while the module is
  // training (train()); 0 keeps every exactness guarantee. Seeds come from the default CPU
  // generator (torch::manual_seed reproduces a run).
  CausalSelfAttentionImpl(int64_t dim, int64_t n_heads, double dropout = 0.0);
  explicit CausalSelfAttentionImpl(const CausalSelfAttentionOptions& options);

  // x (B, T, dim), key_padding_mask (B, T) bool or integer 0/1 (True = real) -> (B, T, dim).
  at::Tensor forward(const at::Tensor& x, const std::optional<at::Tensor>& key_padding_mask = std::nullopt);

  // Generation (inference only, CPU): x (B, t, dim) holds the new tokens of each sequence; they
  // attend the cache plus the new tokens up to themselves (never with dropout), their keys and values are written at
  // each sequence's own position, and its length grows by its real new tokens (the mask, right
  // padding, says which). Same contract as the Python forward(x, mask, cache=cache).
  at::Tensor forward(const at::Tensor& x, const std::optional<at::Tensor>& key_padding_mask, KVCache& cache);

  // An empty cache of this layer's dtype and device; on the CPU the layer's weights are also moved
  // onto huge pages in place where they span one (kernels::advise_huge_pages), as the cache is.
  KVCache make_cache(int64_t batch_size, int64_t max_len) const;

  // Whether forward(x, mask, cache) runs its step as one kernels::decode_layer_cpu call: at most
  // a decode step's few rows, no autograd, no autocast, x and the weights on the CPU in x's dtype (where both
  // projections would take few_rows_linear's streaming kernel), as Python's _decode_layer.
  bool decode_layer_applies(const at::Tensor& x) const;

  int64_t dim() const { return dim_; }
  int64_t n_heads() const { return n_heads_; }
  int64_t n_kv_heads() const { return n_kv_heads_.value_or(n_heads_); }
  int64_t head_dim() const { return dim_ / n_heads_; }
  double dropout() const { return dropout_; }
  bool bias() const { return bias_; }

  torch::nn::Linear qkv{nullptr};   // dim -> (n_heads + 2 * n_kv_heads) * head_dim (3 * dim), split q | k | v
  torch::nn::Linear proj{nullptr};  // dim -> dim

 private:
  void check_x(const at::Tensor& x) const;

  int64_t dim_;
  int64_t n_heads_;
  std::optional<int64_t> n_kv_heads_;  // none: n_heads (multi-head: the ops are called without it)
  double dropout_;
  bool bias_;
};

TORCH_MODULE(CausalSelfAttention);

// x (..., in) @ weight^T (+ bias) -> (..., out). Without autograd and with a decode step's few rows, as
// Python's few_rows_matmul: on the CPU by kernels::few_rows_linear_cpu, which streams the weight from
// memory once; elsewhere as (W x^T)^T. bias may be undefined.
at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

// x (..., in) @ weight^T (+ bias) -> (..., out) with the sums unrounded: float32 for bfloat16/half
// (a half model's logits in float32), x's dtype otherwise. Without autograd on the CPU by
// kernels::unrounded_linear_cpu; otherwise at::linear on the exact float32 widenings (differentiable).
// bias may be undefined.
at::Tensor unrounded_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

}  // namespace causal_attention
