// Input validation shared by the op, the C++ module and (by wording) the Python front.
#include "causal_attention/attention.h"

namespace causal_attention {

void check_qkv(const at::Tensor& qkv, int64_t n_heads) {
  TORCH_CHECK_VALUE(n_heads > 0, "n_heads must be positive; got ", n_heads);
  TORCH_CHECK_VALUE(qkv.dim() == 3, "qkv must be 3-D (B, T, 3 * dim); got shape ", qkv.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(qkv.scalar_type()),
                   "qkv must be a floating-point tensor; got dtype ", qkv.scalar_type());
  const int64_t width = qkv.size(2);
  TORCH_CHECK_VALUE(width % (3 * n_heads) == 0, "qkv last dimension (got ", width,
                    ") must be 3 * dim with dim divisible by n_heads (got ", n_heads, ")");
}

std::optional<at::Tensor> normalize_key_padding_mask(const std::optional<at::Tensor>& key_padding_mask,
                                                     const at::Tensor& x) {
  if (!key_padding_mask.has_value() || !key_padding_mask->defined()) {
    return std::nullopt;
  }
  const at::Tensor& mask = *key_padding_mask;
  const auto dtype = mask.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kBool || at::isIntegralType(dtype, /*includeBool=*/false),
                   "key_padding_mask must be bool (True = real token) or an integer 0/1 tensor; got dtype ",
                   dtype, " (a float mask is ambiguous: additive bias or probability?)");
  TORCH_CHECK_VALUE(mask.dim() == 2 && mask.size(0) == x.size(0) && mask.size(1) == x.size(1),
                    "key_padding_mask must have shape (B, T) = (", x.size(0), ", ", x.size(1),
                    "); got shape ", mask.sizes());
  TORCH_CHECK_VALUE(mask.device() == x.device(), "key_padding_mask must be on the same device as x (",
                    x.device(), "); got ", mask.device());
  if (dtype == at::kBool) {
    return mask;
  }
  TORCH_CHECK_VALUE(mask.numel() == 0 || at::logical_and(mask != 0, mask != 1).any().item<bool>() == false,
                    "key_padding_mask of integer dtype must hold only 0 (padding) and 1 (real token)");
  return mask != 0;
}

}  // namespace causal_attention
