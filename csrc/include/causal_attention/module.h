// The C++ CausalSelfAttention: the same contract as the Python module.
//
//   causal_attention::CausalSelfAttention attn(768, 12);
//   auto y = attn->forward(x);                    // x (B, T, 768) -> y (B, T, 768)
//   auto z = attn->forward(x, key_padding_mask);  // (B, T) bool, True = real token
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <optional>

namespace causal_attention {

class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  // dim % n_heads != 0 is a ValueError naming both numbers.
  CausalSelfAttentionImpl(int64_t dim, int64_t n_heads);

  // x (B, T, dim), key_padding_mask (B, T) bool or integer 0/1 (True = real) -> (B, T, dim).
  at::Tensor forward(const at::Tensor& x, const std::optional<at::Tensor>& key_padding_mask = std::nullopt);

  int64_t dim() const { return dim_; }
  int64_t n_heads() const { return n_heads_; }
  int64_t head_dim() const { return dim_ / n_heads_; }

  torch::nn::Linear qkv{nullptr};   // dim -> 3 * dim, split q | k | v
  torch::nn::Linear proj{nullptr};  // dim -> dim

 private:
  int64_t dim_;
  int64_t n_heads_;
};

TORCH_MODULE(CausalSelfAttention);

}  // namespace causal_attention
