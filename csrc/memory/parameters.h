// torch's Linear and Embedding built as an Init says (causal_attention/module.h): for the layer's
// and the GPT's constructors.
#pragma once

#include "causal_attention/module.h"

#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>

namespace causal_attention::detail {

// Linear(in, out, bias) with parameters in dtype: torch's initialisation in float32, converted
// (Init::kRandom), or uninitialised (Init::kSkip; weight (out, in) on huge pages where it spans one).
torch::nn::Linear make_linear(int64_t in, int64_t out, bool bias, at::ScalarType dtype, Init init);

// Embedding(count, dim) with its weight in dtype, as make_linear's.
torch::nn::Embedding make_embedding(int64_t count, int64_t dim, at::ScalarType dtype, Init init);

}  // namespace causal_attention::detail
