// Input validation shared by the ops, the C++ module and (by wording) the Python front. Every check
// on values runs inside an operator, so that it holds in eager, compiled and exported code alike.
#include "causal_attention/attention.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <mutex>

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

void check_qkv(const at::Tensor& qkv, int64_t n_heads, int64_t n_kv_heads) {
  if (n_kv_heads == n_heads) {
    check_qkv(qkv, n_heads);
    return;
  }
  TORCH_CHECK_VALUE(n_heads > 0, "n_heads must be positive; got ", n_heads);
  TORCH_CHECK_VALUE(n_kv_heads > 0 && n_heads % n_kv_heads == 0, "n_kv_heads must be positive and divide n_heads (",
                    n_heads, "); got ", n_kv_heads);
  TORCH_CHECK_VALUE(qkv.dim() == 3, "qkv must be 3-D (B, T, (n_heads + 2 * n_kv_heads) * head_dim); got shape ",
                    qkv.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(qkv.scalar_type()),
                   "qkv must be a floating-point tensor; got dtype ", qkv.scalar_type());
  const int64_t width = qkv.size(2);
  TORCH_CHECK_VALUE(width > 0 && width % (n_heads + 2 * n_kv_heads) == 0, "qkv last dimension (got ", width,
                    ") must be (n_heads + 2 * n_kv_heads) * head_dim = (", n_heads, " + 2 * ", n_kv_heads,
                    ") * head_dim");
}

void check_heads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const std::optional<at::Tensor>& key_mask, std::optional<double> scale, std::optional<int64_t> window,
                 std::optional<double> softcap, double dropout_p, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
                    "q, k, v must be 4-D: q (B, H, Tq, head_dim), k and v (B, Hkv, Tk, head_dim); got shapes ",
                    q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(q.scalar_type()) && k.scalar_type() == q.scalar_type() &&
                       v.scalar_type() == q.scalar_type(),
                   "q, k, v must share one floating-point dtype; got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
                   v.scalar_type());
  TORCH_CHECK_VALUE(q.device() == k.device() && q.device() == v.device(), "q, k, v must share one device; got ",
                    q.device(), ", ", k.device(), ", ", v.device());
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), hd = q.size(3);
  const int64_t Hkv = k.size(1), Tk = k.size(2);
  TORCH_CHECK_VALUE(k.size(0) == B && k.size(3) == hd && v.sizes() == k.sizes(),
                    "k and v must both be (B, Hkv, Tk, head_dim) = (", B, ", Hkv, Tk, ", hd, ") for q of shape ",
                    q.sizes(), "; got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK_VALUE(hd > 0 && H > 0 && Hkv > 0 && H % Hkv == 0,
                    "k's heads (Hkv) must divide q's heads (H), both positive, and head_dim must be positive; got H = ",
                    H, ", Hkv = ", Hkv, ", head_dim = ", hd);
  TORCH_CHECK_VALUE(Tq <= Tk, "q's length (", Tq, ") must not exceed k's (", Tk,
                    "): the queries end the key sequence");
  if (key_mask.has_value()) {
    TORCH_CHECK_VALUE(key_mask->scalar_type() == at::kBool && key_mask->dim() == 2 && key_mask->size(0) == B &&
                          key_mask->size(1) == Tk,
                      "key_mask must be a bool tensor of shape (B, Tk) = (", B, ", ", Tk, "); got ",
                      key_mask->scalar_type(), " of shape ", key_mask->sizes());
    TORCH_CHECK_VALUE(key_mask->device() == q.device(), "key_mask must be on q's device (", q.device(), "); got ",
                      key_mask->device());
  }
  TORCH_CHECK_VALUE(!scale.has_value() || (std::isfinite(*scale) && *scale > 0),
                    "scale must be a positive finite number; got ", scale.value_or(0));
  TORCH_CHECK_VALUE(!window.has_value() || *window > 0, "window must be a positive number of keys; got ",
                    window.value_or(0));
  TORCH_CHECK_VALUE(!softcap.has_value() || (std::isfinite(*softcap) && *softcap > 0),
                    "softcap must be a positive finite number; got ", softcap.value_or(0));
  check_dropout(dropout_p);
  TORCH_CHECK_VALUE(dropout_p == 0 || Tq == Tk, "dropout needs q and k of one length (training); got Tq = ", Tq,
                    ", Tk = ", Tk);
  if (sinks.has_value()) {
    TORCH_CHECK_VALUE(at::isFloatingType(sinks->scalar_type()) && sinks->dim() == 1 && sinks->size(0) == H,
                      "sinks must be a floating tensor of shape (H,) = (", H, ",), one logit per query head; got ",
                      sinks->scalar_type(), " of shape ", sinks->sizes());
    TORCH_CHECK_VALUE(sinks->device() == q.device(), "sinks must be on q's device (", q.device(), "); got ",
                      sinks->device());
  }
}

void check_dropout(double dropout_p) {
  TORCH_CHECK_VALUE(dropout_p >= 0 && dropout_p < 1, "dropout must be a probability in [0, 1); got ", dropout_p);
}

int64_t seed_value(const at::Tensor& seed) {
  TORCH_CHECK_TYPE(seed.scalar_type() == at::kLong, "the dropout seed must be an int64 tensor; got dtype ",
                   seed.scalar_type());
  TORCH_CHECK_VALUE(seed.numel() == 1 && seed.dim() <= 1, "the dropout seed must have one element (0-d or (1,)); got shape ",
                    seed.sizes());
  TORCH_CHECK_VALUE(seed.device().is_cpu(), "the dropout seed must be a CPU tensor; got device ", seed.device());
  return seed.reshape({}).item<int64_t>();
}

at::Tensor draw_dropout_seed() {
  auto generator = at::detail::getDefaultCPUGenerator();
  uint64_t bits = 0;
  {
    std::lock_guard<std::mutex> lock(generator.mutex());  // the generator is shared by every thread
    bits = generator.get<at::CPUGeneratorImpl>()->random64();
  }
  return at::scalar_tensor(static_cast<int64_t>(bits), at::TensorOptions().dtype(at::kLong));
}

namespace {
void check_mask_dtype(const at::Tensor& mask) {
  const auto dtype = mask.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kBool || at::isIntegralType(dtype, /*includeBool=*/false),
                   "key_padding_mask must be bool (True = real token) or an integer 0/1 tensor; got dtype ",
                   dtype, " (a float mask is ambiguous: additive bias or probability?)");
}
}  // namespace

at::Tensor mask_to_bool(const at::Tensor& key_padding_mask) {
  check_mask_dtype(key_padding_mask);
  if (key_padding_mask.scalar_type() == at::kBool) {
    return key_padding_mask.clone();  // an op's output never aliases its input
  }
  TORCH_CHECK_VALUE(key_padding_mask.numel() == 0 ||
                        !at::logical_and(key_padding_mask != 0, key_padding_mask != 1).any().item<bool>(),
                    "key_padding_mask of integer dtype must hold only 0 (padding) and 1 (real token)");
  return key_padding_mask != 0;
}

std::optional<at::Tensor> normalize_key_padding_mask(const std::optional<at::Tensor>& key_padding_mask,
                                                     const at::Tensor& x) {
  if (!key_padding_mask.has_value() || !key_padding_mask->defined()) {
    return std::nullopt;
  }
  const at::Tensor& mask = *key_padding_mask;
  check_mask_dtype(mask);
  TORCH_CHECK_VALUE(mask.dim() == 2 && mask.size(0) == x.size(0) && mask.size(1) == x.size(1),
                    "key_padding_mask must have shape (B, T) = (", x.size(0), ", ", x.size(1),
                    "); got shape ", mask.sizes());
  TORCH_CHECK_VALUE(mask.device() == x.device(), "key_padding_mask must be on the same device as x (",
                    x.device(), "); got ", mask.device());
  return mask.scalar_type() == at::kBool ? mask : mask_to_bool(mask);
}

void check_cache_positions(const int64_t* start, const int64_t* end, int64_t batch, int64_t new_tokens,
                           int64_t max_len) {
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK_VALUE(0 <= start[b] && start[b] <= end[b] && end[b] - start[b] <= new_tokens,  // no overflow
                      "cache positions of sequence ", b,
                      " must satisfy 0 <= start <= end <= start + new tokens (", new_tokens, "); got start=", start[b],
                      ", end=", end[b]);
    TORCH_CHECK_VALUE(end[b] <= max_len, "KV cache overflow: sequence ", b, " holds ", start[b], " tokens and ",
                      end[b] - start[b], " more do not fit in max_len=", max_len,
                      " (make the cache longer, or reset it)");
  }
}

void check_cache_positions(const at::Tensor& start, const at::Tensor& end, int64_t new_tokens, int64_t max_len) {
  const auto s = start.to(at::kCPU).contiguous();
  const auto e = end.to(at::kCPU).contiguous();
  check_cache_positions(s.data_ptr<int64_t>(), e.data_ptr<int64_t>(), s.numel(), new_tokens, max_len);
}

at::Tensor cache_end(const at::Tensor& lengths, const std::optional<at::Tensor>& key_padding_mask, int64_t new_tokens,
                     int64_t max_len) {
  TORCH_CHECK_TYPE(lengths.scalar_type() == at::kLong && lengths.dim() == 1,
                   "cache lengths must be a 1-D int64 tensor (B,); got ", lengths.scalar_type(), " of shape ",
                   lengths.sizes());
  TORCH_CHECK_VALUE(new_tokens >= 0, "the number of new tokens must be >= 0; got ", new_tokens);
  at::Tensor end;
  if (key_padding_mask.has_value() && key_padding_mask->defined()) {
    const auto& mask = *key_padding_mask;  // (B, t) bool, True = real
    TORCH_CHECK_VALUE(mask.scalar_type() == at::kBool && mask.dim() == 2 && mask.size(0) == lengths.size(0) &&
                          mask.size(1) == new_tokens,
                      "key_padding_mask must be a bool tensor of shape (B, t) = (", lengths.size(0), ", ",
                      new_tokens, "); got ", mask.scalar_type(), " of shape ", mask.sizes());
    const auto n_real = mask.sum(1);  // (B,) int64
    const auto right_padded = at::arange(new_tokens, n_real.options()).unsqueeze(0) < n_real.unsqueeze(1);
    const auto wrong = mask.ne(right_padded).any(1);  // (B,)
    TORCH_CHECK_VALUE(!wrong.any().item<bool>(),
                      "with a cache, key_padding_mask must be right padding (real tokens first); sequence ",
                      wrong.nonzero().select(1, 0)[0].item<int64_t>(), " is not");
    end = lengths + n_real;
  } else {
    end = lengths + new_tokens;
  }
  check_cache_positions(lengths, end, new_tokens, max_len);
  return end;
}

}  // namespace causal_attention
