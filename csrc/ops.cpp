// Registers the engine's operators with the dispatcher: torch.ops.causal_attention.*
//
//   attention(qkv, key_padding_mask, n_heads, dropout_p=0, seed=None, n_kv_heads=None) -> out   differentiable
//   attention_forward(qkv, key_padding_mask, n_heads, dropout_p=0, seed=None, n_kv_heads=None) -> (out, lse)
//   attention_backward(grad_out, qkv, key_padding_mask, out, lse, n_heads, dropout_p=0, seed=None,
//                      n_kv_heads=None) -> grad_qkv       the fused CPU kernel; n_kv_heads: grouped-query
//   attention_heads_forward(q, k, v, key_mask, scale=None, window=None, softcap=None, dropout_p=0, seed=None,
//                           sinks=None) -> (out, lse)   separate heads: q (B, H, Tq, hd) ending k, v (B, Hkv, Tk, hd)
//   attention_heads_backward(grad_out, q, k, v, key_mask, out, lse, scale, window, softcap, dropout_p, seed)
//                      -> (grad_q, grad_k, grad_v)
//   attention_sinks_backward(grad_out, out, lse, sinks) -> grad_sinks   ATen operations (traced as they are)
//   dropout_keep_mask(seed, B, H, T, dropout_p) -> keep (B, H, T, T) bool   the kernels' dropout decisions
//   kv_cache_write(qkv, k_cache!, v_cache!, start, end, n_heads, n_kv_heads=None)   generation: static KV cache
//   decode_attention(qkv, k_cache, v_cache, start, end, n_heads, n_kv_heads=None) -> out
//   decode_layer(x, qkv_weight, qkv_bias, proj_weight, proj_bias, k_cache!, v_cache!, lengths!, key_padding_mask,
//                n_heads, n_kv_heads=None) -> out      a whole decode step: cache_end, the ops above and below, fused
//   few_rows_linear(x, weight, bias) -> y                              a decode step's linear layers
//   project(x, weight, bias) -> y           differentiable; half on CPUs without half arithmetic: widened;
//                                           float32 with nothing to differentiate: oneDNN (float32_products)
//   widened_addmm(a, b, bias) -> c          a @ b + bias, half operands summed in float32, rounded once
//   widened_addmm_sums(a, b) -> (c, sums)   a @ b as above and b.sum(0) in float32 (a weight's and a bias's grads)
//   half_arithmetic(dtype) -> bool          whether project leaves dtype to ATen here
//   widened_products() -> str               "panels", "oneDNN+sgemm" or "sgemm": what multiplies widened_addmm's
//                                           operands (the engine's own widening GEMM, or widened blocks)
//   float32_products() -> str               "oneDNN" or "ATen": what multiplies project's float32 inference
//   tile_products(dtype) -> str             what runs the attention kernels' tile products of dtype here
//   unrounded_linear(x, weight, bias) -> y  x @ weight^T + bias summed in float32, not rounded back to half
//   rotary_qkv(qkv, cos, sin, n_heads, n_kv_heads) -> qkv   q and k rotated (rotate-half) in one pass
//   mask_to_bool(key_padding_mask) -> mask                              checks an integer mask's values
//   cache_end(lengths, key_padding_mask, new_tokens, max_len) -> end    checks a cache step
//   cache_zeros(size, dtype, device=None) -> zeros                     a KV cache buffer, on the CPU on huge pages
//   advise_huge_pages(tensor) -> bytes                                 a CPU tensor's memory onto huge pages, in place
//   huge_page_empty(size, dtype) -> tensor                             uninitialised CPU memory for weights, huge pages
//
// On CPU, `attention` runs the fused kernels with a C++ autograd function (the C++ module's path);
// on other devices it is the ATen composition (kernels::attention_composite). The Python front
// calls attention_forward / attention_backward with autograd registered through torch.library
// (_ops.py), so that torch.func transforms work. Meta kernels (shapes only, symbolic sizes) are
// registered here, so torch.compile and torch.export trace every op with just the library loaded.
#include <initializer_list>
#include <utility>

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "cpu/tile_ops.h"
#include "causal_attention/attention.h"

namespace causal_attention {
namespace {

using OptionalTensor = std::optional<at::Tensor>;

std::tuple<at::Tensor, at::Tensor> call_forward(const at::Tensor& qkv, const OptionalTensor& mask, int64_t n_heads,
                                                double dropout_p, const OptionalTensor& seed,
                                                std::optional<int64_t> n_kv_heads) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("causal_attention::attention_forward", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const OptionalTensor&, int64_t, double,
                                                    const OptionalTensor&, std::optional<int64_t>)>();
  return op.call(qkv, mask, n_heads, dropout_p, seed, n_kv_heads);
}

at::Tensor call_backward(const at::Tensor& grad_out, const at::Tensor& qkv, const OptionalTensor& mask,
                         const at::Tensor& out, const at::Tensor& lse, int64_t n_heads, double dropout_p,
                         const OptionalTensor& seed, std::optional<int64_t> n_kv_heads) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("causal_attention::attention_backward", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&, const at::Tensor&,
                            const at::Tensor&, int64_t, double, const OptionalTensor&, std::optional<int64_t>)>();
  return op.call(grad_out, qkv, mask, out, lse, n_heads, dropout_p, seed, n_kv_heads);
}

// The seed of a call with dropout: the given one, or a fresh one from the default CPU generator.
OptionalTensor seed_for(double dropout_p, const OptionalTensor& seed) {
  check_dropout(dropout_p);
  if (dropout_p == 0) {
    return std::nullopt;
  }
  return (seed.has_value() && seed->defined()) ? seed : OptionalTensor(draw_dropout_seed());
}

class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& qkv, const OptionalTensor& mask,
                            int64_t n_heads, double dropout_p, const OptionalTensor& seed,
                            std::optional<int64_t> n_kv_heads) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse] = call_forward(qkv, mask, n_heads, dropout_p, seed, n_kv_heads);
    ctx->save_for_backward({qkv, out, lse, mask.value_or(at::Tensor()), seed.value_or(at::Tensor())});
    ctx->saved_data["n_heads"] = n_heads;
    ctx->saved_data["n_kv_heads"] = n_kv_heads.value_or(n_heads);
    ctx->saved_data["dropout_p"] = dropout_p;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const OptionalTensor mask = saved[3].defined() ? OptionalTensor(saved[3]) : std::nullopt;
    const OptionalTensor seed = saved[4].defined() ? OptionalTensor(saved[4]) : std::nullopt;
    const int64_t n_heads = ctx->saved_data["n_heads"].toInt();
    const int64_t n_kv_heads = ctx->saved_data["n_kv_heads"].toInt();
    const double dropout_p = ctx->saved_data["dropout_p"].toDouble();
    if (at::GradMode::is_enabled()) {
      // create_graph (double backward, gradient penalties): the fused backward has no derivative
      // of its own, so differentiate the same attention written in ATen operations instead, with
      // the forward's dropout decisions.
      const auto& qkv = saved[0];
      OptionalTensor keep;
      if (dropout_p > 0) {
        keep = dropout_keep_mask(*seed, qkv.size(0), n_heads, qkv.size(1), dropout_p);
      }
      const auto out = kernels::attention_math(qkv, mask, n_heads, dropout_p, keep, n_kv_heads);
      const auto grad_qkv = torch::autograd::grad({out}, {qkv}, {grads[0]}, /*retain_graph=*/true,
                                                  /*create_graph=*/true);
      return {grad_qkv[0], at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    const auto grad_qkv = call_backward(grads[0], saved[0], mask, saved[1], saved[2], n_heads, dropout_p, seed,
                                        n_kv_heads);
    return {grad_qkv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor attention_autograd(const at::Tensor& qkv, const OptionalTensor& mask, int64_t n_heads, double dropout_p,
                              const OptionalTensor& seed, std::optional<int64_t> n_kv_heads) {
  if (qkv.device().is_cpu()) {
    return AttentionFunction::apply(qkv, mask, n_heads, dropout_p, seed_for(dropout_p, seed), n_kv_heads);
  }
  return kernels::attention_composite(qkv, mask, n_heads, dropout_p, n_kv_heads);  // differentiated by ATen
}

at::Tensor attention_no_autograd(const at::Tensor& qkv, const OptionalTensor& mask, int64_t n_heads, double dropout_p,
                                 const OptionalTensor& seed, std::optional<int64_t> n_kv_heads) {
  if (qkv.device().is_cpu()) {
    return std::get<0>(call_forward(qkv, mask, n_heads, dropout_p, seed_for(dropout_p, seed), n_kv_heads));
  }
  return kernels::attention_composite(qkv, mask, n_heads, dropout_p, n_kv_heads);
}

// Meta kernels: output shapes and dtypes only, with symbolic sizes (torch.compile, torch.export).
at::Tensor heads_like(const at::Tensor& qkv) {  // (B, T, 3 * dim) -> empty (B, T, dim)
  return at::empty_symint({qkv.sym_size(0), qkv.sym_size(1), qkv.sym_size(2) / 3}, qkv.options());
}

at::Tensor attention_meta(const at::Tensor& qkv, const OptionalTensor& /*mask*/, int64_t n_heads, double dropout_p,
                          const OptionalTensor& /*seed*/, std::optional<int64_t> n_kv_heads) {
  TORCH_CHECK_VALUE(n_heads > 0 && qkv.dim() == 3, "qkv must be 3-D (B, T, 3 * dim) and n_heads positive");
  check_dropout(dropout_p);
  if (!n_kv_heads.has_value()) {
    return heads_like(qkv);
  }
  TORCH_CHECK_VALUE(*n_kv_heads > 0 && n_heads % *n_kv_heads == 0, "n_kv_heads must be positive and divide n_heads (",
                    n_heads, "); got ", *n_kv_heads);
  const auto head_dim = qkv.sym_size(2) / (n_heads + 2 * *n_kv_heads);
  return at::empty_symint({qkv.sym_size(0), qkv.sym_size(1), head_dim * n_heads}, qkv.options());
}

std::tuple<at::Tensor, at::Tensor> attention_forward_meta(const at::Tensor& qkv, const OptionalTensor& mask,
                                                          int64_t n_heads, double dropout_p, const OptionalTensor& seed,
                                                          std::optional<int64_t> n_kv_heads_in) {
  const int64_t n_kv_heads = n_kv_heads_in.value_or(n_heads);
  TORCH_CHECK_VALUE(n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0 && qkv.dim() == 3,
                    "qkv must be 3-D (B, T, (n_heads + 2 * n_kv_heads) * head_dim), n_heads positive and n_kv_heads "
                    "a positive divisor of it");
  if (n_kv_heads == n_heads) {
    attention_meta(qkv, mask, n_heads, dropout_p, seed, std::nullopt);  // the same checks as the op
  }
  check_dropout(dropout_p);
  const int64_t head_dim = qkv.sym_size(2).guard_int(__FILE__, __LINE__) / (n_heads + 2 * n_kv_heads);
  const bool wide = qkv.scalar_type() == at::kDouble || tile::computes_in_float64(qkv.scalar_type(), head_dim);
  auto out = at::empty_symint({qkv.sym_size(0), qkv.sym_size(1), c10::SymInt(n_heads * head_dim)}, qkv.options());
  return {out, at::empty_symint({qkv.sym_size(0), c10::SymInt(n_heads), qkv.sym_size(1)},
                                qkv.options().dtype(wide ? at::kDouble : at::kFloat))};
}

at::Tensor attention_backward_meta(const at::Tensor& /*grad_out*/, const at::Tensor& qkv, const OptionalTensor& /*mask*/,
                                   const at::Tensor& /*out*/, const at::Tensor& /*lse*/, int64_t /*n_heads*/,
                                   double dropout_p, const OptionalTensor& /*seed*/,
                                   std::optional<int64_t> /*n_kv_heads*/) {
  check_dropout(dropout_p);
  return at::empty_symint(qkv.sym_sizes(), qkv.options());
}

at::Tensor dropout_keep_mask_meta(const at::Tensor& /*seed*/, int64_t B, int64_t H, int64_t T, double dropout_p) {
  check_dropout(dropout_p);
  return at::empty({B, H, T, T}, at::TensorOptions().dtype(at::kBool).device(at::kMeta));
}

// The dispatcher runs a meta kernel wherever any argument is on the meta device. With the others on
// a real device, the kernel would return an uninitialised tensor there, and the real kernel's device
// checks would never run: so every meta kernel of an op that takes several tensors checks that they
// share the first one's device (under FakeTensorMode, torch.compile and torch.export all are meta).
using NamedTensor = std::pair<const char*, const at::Tensor*>;

void check_one_device(const char* op, const char* first_name, const at::Tensor& first,
                      std::initializer_list<NamedTensor> others) {
  for (const auto& [name, t] : others) {
    TORCH_CHECK_VALUE(t == nullptr || !t->defined() || t->device() == first.device(), op, ": ", name,
                      " must be on ", first_name, "'s device (", first.device(), "); got ", t->device());
  }
}

const at::Tensor* maybe(const OptionalTensor& t) { return t.has_value() ? &*t : nullptr; }

std::tuple<at::Tensor, at::Tensor> attention_heads_forward_meta(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptionalTensor& mask,
    std::optional<double> /*scale*/, std::optional<int64_t> /*window*/, std::optional<double> /*softcap*/,
    double dropout_p, const OptionalTensor& seed, const OptionalTensor& sinks) {
  TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
                    "q, k, v must be 4-D: q (B, H, Tq, head_dim), k and v (B, Hkv, Tk, head_dim); got shapes ",
                    q.sym_sizes(), ", ", k.sym_sizes(), ", ", v.sym_sizes());
  check_dropout(dropout_p);
  check_one_device("attention_heads_forward", "q", q,
                   {{"k", &k}, {"v", &v}, {"key_mask", maybe(mask)}, {"seed", maybe(seed)}, {"sinks", maybe(sinks)}});
  TORCH_CHECK_VALUE(!sinks.has_value() || (sinks->dim() == 1 && sinks->sym_size(0) == q.sym_size(1)),
                    "sinks must be of shape (H,), one logit per query head of q ", q.sym_sizes(), "; got ",
                    sinks->sym_sizes());
  const int64_t head_dim = q.sym_size(3).guard_int(__FILE__, __LINE__);
  const bool wide = q.scalar_type() == at::kDouble || tile::computes_in_float64(q.scalar_type(), head_dim);
  auto out = at::empty_symint({q.sym_size(0), q.sym_size(2), q.sym_size(1), q.sym_size(3)}, q.options());
  return {out, at::empty_symint({q.sym_size(0), q.sym_size(1), q.sym_size(2)},
                                q.options().dtype(wide ? at::kDouble : at::kFloat))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_heads_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const OptionalTensor& mask, const at::Tensor& out, const at::Tensor& lse, std::optional<double> /*scale*/,
    std::optional<int64_t> /*window*/, std::optional<double> /*softcap*/, double dropout_p,
    const OptionalTensor& seed) {
  check_dropout(dropout_p);
  check_one_device("attention_heads_backward", "q", q,
                   {{"grad_out", &grad_out}, {"k", &k}, {"v", &v}, {"key_mask", maybe(mask)}, {"out", &out},
                    {"lse", &lse}, {"seed", maybe(seed)}});
  return {kernels::heads_grad_like(q), kernels::heads_grad_like(k), kernels::heads_grad_like(v)};
}


void kv_cache_write_meta(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& start, const at::Tensor& end, int64_t /*n_heads*/,
                         std::optional<int64_t> /*n_kv_heads*/) {
  check_one_device("kv_cache_write", "qkv", qkv,
                   {{"k_cache", &k_cache}, {"v_cache", &v_cache}, {"start", &start}, {"end", &end}});
}

at::Tensor decode_attention_meta(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& start, const at::Tensor& end, int64_t n_heads,
                                 std::optional<int64_t> n_kv_heads) {
  check_one_device("decode_attention", "qkv", qkv,
                   {{"k_cache", &k_cache}, {"v_cache", &v_cache}, {"start", &start}, {"end", &end}});
  if (!n_kv_heads.has_value()) {
    return heads_like(qkv);
  }
  TORCH_CHECK_VALUE(n_heads > 0 && *n_kv_heads > 0 && qkv.dim() == 3,
                    "decode_attention: qkv must be 3-D and n_heads, n_kv_heads positive");
  const auto head_dim = qkv.sym_size(2) / (n_heads + 2 * *n_kv_heads);
  return at::empty_symint({qkv.sym_size(0), qkv.sym_size(1), head_dim * n_heads}, qkv.options());
}

at::Tensor few_rows_linear_meta(const at::Tensor& x, const at::Tensor& weight, const OptionalTensor& bias) {
  check_one_device("few_rows_linear", "x", x, {{"weight", &weight}, {"bias", maybe(bias)}});
  auto sizes = x.sym_sizes().vec();
  TORCH_CHECK_VALUE(!sizes.empty() && weight.dim() == 2, "few_rows_linear: x (..., in) and weight (out, in)");
  sizes.back() = weight.sym_size(0);
  return at::empty_symint(sizes, x.options());
}

at::Tensor decode_layer_meta(const at::Tensor& x, const at::Tensor& qkv_weight, const OptionalTensor& qkv_bias,
                             const at::Tensor& proj_weight, const OptionalTensor& proj_bias, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& lengths,
                             const OptionalTensor& key_padding_mask, int64_t /*n_heads*/,
                             std::optional<int64_t> /*n_kv_heads*/) {
  check_one_device("decode_layer", "x", x,
                   {{"qkv_weight", &qkv_weight}, {"qkv_bias", maybe(qkv_bias)}, {"proj_weight", &proj_weight},
                    {"proj_bias", maybe(proj_bias)}, {"k_cache", &k_cache}, {"v_cache", &v_cache},
                    {"lengths", &lengths}, {"key_padding_mask", maybe(key_padding_mask)}});
  return at::empty_symint(x.sym_sizes(), x.options());
}

at::Tensor mask_to_bool_meta(const at::Tensor& key_padding_mask) {
  return at::empty_symint(key_padding_mask.sym_sizes(), key_padding_mask.options().dtype(at::kBool));
}

at::Tensor cache_end_meta(const at::Tensor& lengths, const OptionalTensor& mask, int64_t /*new_tokens*/,
                          int64_t /*max_len*/) {
  check_one_device("cache_end", "lengths", lengths, {{"key_padding_mask", maybe(mask)}});
  return at::empty_symint(lengths.sym_sizes(), lengths.options());
}

}  // namespace

TORCH_LIBRARY(causal_attention, m) {
  m.def(
      "attention(Tensor qkv, Tensor? key_padding_mask, int n_heads, float dropout_p=0., Tensor? seed=None, "
      "int? n_kv_heads=None) -> Tensor");
  m.def(
      "attention_forward(Tensor qkv, Tensor? key_padding_mask, int n_heads, float dropout_p=0., "
      "Tensor? seed=None, int? n_kv_heads=None) -> (Tensor out, Tensor lse)");
  m.def(
      "attention_backward(Tensor grad_out, Tensor qkv, Tensor? key_padding_mask, Tensor out, Tensor lse, "
      "int n_heads, float dropout_p=0., Tensor? seed=None, int? n_kv_heads=None) -> Tensor grad_qkv");
  m.def(
      "attention_heads_forward(Tensor q, Tensor k, Tensor v, Tensor? key_mask, float? scale=None, int? window=None, "
      "float? softcap=None, float dropout_p=0., Tensor? seed=None, Tensor? sinks=None) -> (Tensor out, Tensor lse)");
  m.def(
      "attention_heads_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor? key_mask, Tensor out, "
      "Tensor lse, float? scale=None, int? window=None, float? softcap=None, float dropout_p=0., Tensor? seed=None) "
      "-> (Tensor grad_q, Tensor grad_k, Tensor grad_v)");
  m.def("attention_sinks_backward(Tensor grad_out, Tensor out, Tensor lse, Tensor sinks) -> Tensor");
  m.def("dropout_keep_mask(Tensor seed, int B, int H, int T, float dropout_p) -> Tensor");
  m.def("cpu_capability() -> str");
  m.def("tile_products(ScalarType dtype) -> str");
  m.def(
      "kv_cache_write(Tensor qkv, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor start, Tensor end, int n_heads, "
      "int? n_kv_heads=None) -> ()");
  m.def(
      "decode_attention(Tensor qkv, Tensor k_cache, Tensor v_cache, Tensor start, Tensor end, int n_heads, "
      "int? n_kv_heads=None) -> Tensor");
  m.def(
      "decode_layer(Tensor x, Tensor qkv_weight, Tensor? qkv_bias, Tensor proj_weight, Tensor? proj_bias, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) lengths, Tensor? key_padding_mask, int n_heads, "
      "int? n_kv_heads=None) -> Tensor");
  m.def("mask_to_bool(Tensor key_padding_mask) -> Tensor");
  m.def("cache_end(Tensor lengths, Tensor? key_padding_mask, int new_tokens, int max_len) -> Tensor");
  m.def("few_rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("project(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("widened_addmm(Tensor a, Tensor b, Tensor? bias) -> Tensor");
  m.def("widened_addmm_sums(Tensor a, Tensor b) -> (Tensor, Tensor)");
  m.def("unrounded_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("rotary_qkv(Tensor qkv, Tensor cos, Tensor sin, int n_heads, int n_kv_heads) -> Tensor");
  m.def("half_arithmetic(ScalarType dtype) -> bool");
  m.def("widened_products() -> str");
  m.def("float32_products() -> str");
  m.def("cache_zeros(int[] size, ScalarType dtype, Device? device=None) -> Tensor");
  m.def("advise_huge_pages(Tensor tensor) -> int");
  m.def("huge_page_empty(int[] size, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(causal_attention, Autograd, m) {
  m.impl("attention", &attention_autograd);
  // The raw kernels have no derivative of their own (the Python front wraps them in autograd
  // Functions, the C++ one in AttentionFunction): differentiating them directly is an error.
  m.impl("attention_forward", torch::autograd::autogradNotImplementedFallback());
  m.impl("attention_backward", torch::autograd::autogradNotImplementedFallback());
  m.impl("attention_heads_forward", torch::autograd::autogradNotImplementedFallback());
  m.impl("attention_heads_backward", torch::autograd::autogradNotImplementedFallback());
  m.impl("few_rows_linear", torch::autograd::autogradNotImplementedFallback());  // inference only
  m.impl("project", &causal_attention::project);                              // its own autograd where it widens
  m.impl("widened_addmm", torch::autograd::autogradNotImplementedFallback());  // differentiated by project
  m.impl("widened_addmm_sums", torch::autograd::autogradNotImplementedFallback());
  m.impl("unrounded_linear", torch::autograd::autogradNotImplementedFallback());  // inference only
  m.impl("decode_layer", torch::autograd::autogradNotImplementedFallback());     // inference only
  m.impl("rotary_qkv", torch::autograd::autogradNotImplementedFallback());       // Rotary::apply differentiates
  m.impl("advise_huge_pages", torch::autograd::autogradNotImplementedFallback());  // no tensor out
}

TORCH_LIBRARY_IMPL(causal_attention, CompositeExplicitAutograd, m) {
  m.impl("attention", &attention_no_autograd);
  m.impl("mask_to_bool", &mask_to_bool);
  m.impl("cache_end", &cache_end);
  m.impl("cache_zeros", &kernels::cache_zeros);
  m.impl("huge_page_empty", &kernels::huge_page_empty);
  m.impl("project", &kernels::project_no_autograd);
}

TORCH_LIBRARY_IMPL(causal_attention, CompositeImplicitAutograd, m) {
  m.impl("attention_sinks_backward", &kernels::attention_sinks_backward);
}

TORCH_LIBRARY_IMPL(causal_attention, Meta, m) {
  m.impl("attention", &attention_meta);
  m.impl("attention_forward", &attention_forward_meta);
  m.impl("attention_backward", &attention_backward_meta);
  m.impl("attention_heads_forward", &attention_heads_forward_meta);
  m.impl("attention_heads_backward", &attention_heads_backward_meta);
  m.impl("dropout_keep_mask", &dropout_keep_mask_meta);
  m.impl("kv_cache_write", &kv_cache_write_meta);
  m.impl("decode_attention", &decode_attention_meta);
  m.impl("mask_to_bool", &mask_to_bool_meta);
  m.impl("cache_end", &cache_end_meta);
  m.impl("few_rows_linear", &few_rows_linear_meta);
  m.impl("project", [](const at::Tensor& x, const at::Tensor& weight, const OptionalTensor& bias) {
    return at::linear(x, weight, bias);  // ATen's shapes and checks
  });
  m.impl("widened_addmm", &kernels::widened_addmm_meta);
  m.impl("widened_addmm_sums", &kernels::widened_addmm_sums_meta);
  m.impl("unrounded_linear", &kernels::unrounded_linear_meta);
  m.impl("rotary_qkv", &kernels::rotary_qkv_meta);
  m.impl("decode_layer", &decode_layer_meta);
  m.impl("advise_huge_pages", [](const at::Tensor&) -> int64_t { return 0; });  // no memory to advise
}

TORCH_LIBRARY_IMPL(causal_attention, CPU, m) {
  m.impl("attention_forward", &kernels::attention_forward_cpu);
  m.impl("attention_backward", &kernels::attention_backward_cpu);
  m.impl("attention_heads_forward", &kernels::attention_heads_forward_cpu);
  m.impl("attention_heads_backward", &kernels::attention_heads_backward_cpu);
  m.impl("dropout_keep_mask", &kernels::dropout_keep_mask_cpu);
  m.impl("kv_cache_write", &kernels::kv_cache_write_cpu);
  m.impl("decode_attention", &kernels::decode_attention_cpu);
  m.impl("few_rows_linear", &kernels::few_rows_linear_cpu);
  m.impl("widened_addmm", &kernels::widened_addmm_cpu);
  m.impl("widened_addmm_sums", &kernels::widened_addmm_sums_cpu);
  m.impl("unrounded_linear", &kernels::unrounded_linear_cpu);
  m.impl("rotary_qkv", &kernels::rotary_qkv_cpu);
  m.impl("decode_layer", &kernels::decode_layer_cpu);
  m.impl("advise_huge_pages", &kernels::advise_huge_pages);
}

TORCH_LIBRARY_IMPL(causal_attention, CatchAll, m) {
  m.impl("cpu_capability", [] { return std::string(kernels::cpu_capability()); });
  m.impl("tile_products", &kernels::tile_products);
  m.impl("half_arithmetic", &kernels::half_arithmetic);
  m.impl("widened_products", [] { return std::string(kernels::widened_products()); });
  m.impl("float32_products", [] { return std::string(kernels::float32_products()); });
}

const char* kernels::cpu_capability() { return tile::tile_ops_capability(); }

std::string kernels::tile_products(at::ScalarType dtype) {
  TORCH_CHECK_VALUE(at::isFloatingType(dtype), "tile_products: dtype must be a floating type; got ", dtype);
  const std::string isa = tile::tile_ops_capability();
  if (dtype == at::kBFloat16 && tile::tile_ops<c10::BFloat16>().pair_isa != nullptr) {
    return tile::tile_ops<c10::BFloat16>().pair_isa;
  }
  if (dtype != at::kDouble && tile::tile_ops<float>().panel_gemm != nullptr) {
    return isa + " float32 micro-kernel";
  }
  return "BLAS";
}

at::Tensor attention(const at::Tensor& qkv, const std::optional<at::Tensor>& key_padding_mask, int64_t n_heads,
                     double dropout_p, const std::optional<at::Tensor>& seed, std::optional<int64_t> n_kv_heads) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("causal_attention::attention", "")
          .typed<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&, int64_t, double,
                            const std::optional<at::Tensor>&, std::optional<int64_t>)>();
  return op.call(qkv, key_padding_mask, n_heads, dropout_p, seed, n_kv_heads);
}

at::Tensor dropout_keep_mask(const at::Tensor& seed, int64_t B, int64_t H, int64_t T, double dropout_p) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("causal_attention::dropout_keep_mask", "")
                             .typed<at::Tensor(const at::Tensor&, int64_t, int64_t, int64_t, double)>();
  return op.call(seed, B, H, T, dropout_p);
}

}  // namespace causal_attention
