// Registers the engine's operators with the dispatcher: torch.ops.causal_attention.*
#include <torch/library.h>

#include "causal_attention/attention.h"

namespace causal_attention {

TORCH_LIBRARY(causal_attention, m) {
  m.def("attention(Tensor qkv, Tensor? key_padding_mask, int n_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(causal_attention, CompositeImplicitAutograd, m) {
  m.impl("attention", &kernels::attention_composite);
}

at::Tensor attention(const at::Tensor& qkv, const std::optional<at::Tensor>& key_padding_mask,
                     int64_t n_heads) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("causal_attention::attention", "")
                             .typed<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&, int64_t)>();
  return op.call(qkv, key_padding_mask, n_heads);
}

}  // namespace causal_attention
