#include "memory/parameters.h"

#include "causal_attention/attention.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

namespace causal_attention::detail {
namespace {

void check_dtype(at::ScalarType dtype) {
  TORCH_CHECK_VALUE(at::isFloatingType(dtype), "dtype must be a floating-point type; got ", dtype);
}

// Parameter p given fresh, uninitialised memory of shape and dtype (set_data keeps the Parameter
// that the module and its named_parameters share).
void give_memory(at::Tensor& p, at::IntArrayRef shape, at::ScalarType dtype) {
  at::NoGradGuard no_grad;
  p.set_data(kernels::huge_page_empty(shape, dtype));
}

}  // namespace

torch::nn::Linear make_linear(int64_t in, int64_t out, bool bias, at::ScalarType dtype, Init init) {
  check_dtype(dtype);
  if (init == Init::kRandom) {
    torch::nn::Linear linear(torch::nn::LinearOptions(in, out).bias(bias));
    if (dtype != at::kFloat) linear->to(dtype);
    return linear;
  }
  // torch's Linear always initialises what it allocates: built with no output rows, nothing is
  // drawn; then the real shapes, uninitialised.
  torch::nn::Linear linear(torch::nn::LinearOptions(in, 0).bias(bias));
  linear->options.out_features(out);
  give_memory(linear->weight, {out, in}, dtype);
  if (bias) give_memory(linear->bias, {out}, dtype);
  return linear;
}

torch::nn::Embedding make_embedding(int64_t count, int64_t dim, at::ScalarType dtype, Init init) {
  check_dtype(dtype);
  if (init == Init::kRandom) {
    torch::nn::Embedding embedding(count, dim);
    if (dtype != at::kFloat) embedding->to(dtype);
    return embedding;
  }
  torch::nn::Embedding embedding(0, dim);  // as make_linear's: nothing to draw
  embedding->options.num_embeddings(count);
  give_memory(embedding->weight, {count, dim}, dtype);
  return embedding;
}

}  // namespace causal_attention::detail
