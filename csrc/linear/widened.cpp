// The projections of a half-precision model on a CPU without arithmetic in its type (AVX2, or AVX-512
// without BF16 / FP16): ATen's bfloat16 and half GEMMs run 3.5-4x slower than float32 there, while
// MKL's mixed products (blas::gemm: each product of two exact widenings summed in float32) run at
// float32's speed. The products here read the half operands as they are and round each output once.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <string_view>
#include <tuple>

#include "attention/blas.h"
#include "causal_attention/attention.h"

namespace causal_attention {
namespace kernels {
namespace {

// widened_addmm's output blocks: float32 sums of about kWidenedBlockBytes, at least kWidenedMinRows rows
// (or columns).
constexpr int64_t kWidenedBlockBytes = int64_t(1) << 22;
constexpr int64_t kWidenedMinRows = 64;

bool is_half(at::ScalarType dtype) { return dtype == at::kBFloat16 || dtype == at::kHalf; }

// A (rows, cols) operand as blas::gemm reads it: (transposed, leading dimension, tensor), the tensor
// itself where one of its strides is 1 (a weight's .t() view reads in place), else a contiguous copy.
std::tuple<bool, int64_t, at::Tensor> gemm_operand(const at::Tensor& t) {
  const int64_t rows = t.size(0), cols = t.size(1);
  if (t.stride(1) == 1 && t.stride(0) >= std::max<int64_t>(1, cols)) {
    return {false, t.stride(0), t};
  }
  if (t.stride(0) == 1 && t.stride(1) >= std::max<int64_t>(1, rows)) {
    return {true, t.stride(1), t};
  }
  return {false, std::max<int64_t>(1, cols), t.contiguous()};
}

void check_addmm(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0),
                    "widened_addmm: a must be (M, K) and b (K, N); got a ", a.sizes(), " and b ", b.sizes());
  TORCH_CHECK_TYPE(is_half(a.scalar_type()) && b.scalar_type() == a.scalar_type(),
                   "widened_addmm: a and b must both be bfloat16 or both float16; got ", a.scalar_type(), " and ",
                   b.scalar_type());
  TORCH_CHECK_VALUE(a.device().is_cpu() && b.device().is_cpu(), "widened_addmm takes CPU tensors; got a on ",
                    a.device(), " and b on ", b.device());
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == b.size(1), "widened_addmm: bias must have shape (N,) = (",
                      b.size(1), ",); got ", bias->sizes());
    TORCH_CHECK_TYPE(bias->scalar_type() == a.scalar_type(), "widened_addmm: bias dtype (", bias->scalar_type(),
                     ") must match a's (", a.scalar_type(), ")");
    TORCH_CHECK_VALUE(bias->device().is_cpu(), "widened_addmm takes CPU tensors; got bias on ", bias->device());
  }
}

at::Tensor call_addmm(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("causal_attention::widened_addmm", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();
  return op.call(a, b, bias);
}

// a @ b (+ bias) with its gradients by the same products, so that it is differentiable any number of times.
class WidenedAddmm : public torch::autograd::Function<WidenedAddmm> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b,
                            const std::optional<at::Tensor>& bias) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({a, b});
    ctx->saved_data["bias"] = bias.has_value();
    return call_addmm(a, b, bias);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& a = saved[0];
    const auto& b = saved[1];
    const auto& g = grads[0];  // (M, N)
    at::Tensor ga, gb, gbias;
    if (ctx->needs_input_grad(0)) {
      ga = WidenedAddmm::apply(g, b.t(), std::nullopt);  // (M, K)
    }
    if (ctx->needs_input_grad(1)) {
      gb = WidenedAddmm::apply(a.t(), g, std::nullopt);  // (K, N)
    }
    if (ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2)) {
      gbias = g.sum(0, /*keepdim=*/false, at::kFloat).to(g.scalar_type());  // (N,), summed in float32
    }
    return {ga, gb, gbias};
  }
};

}  // namespace

bool half_arithmetic(at::ScalarType dtype) {
  TORCH_CHECK_VALUE(at::isFloatingType(dtype), "half_arithmetic: dtype must be a floating type; got ", dtype);
  if (!is_half(dtype)) {
    return true;
  }
  if (std::string_view(cpu_capability()) != "AVX512") {
    return false;
  }
  // AMX-BF16 and AMX-FP16 come with AVX512-BF16 and AVX512-FP16.
  return dtype == at::kBFloat16 ? __builtin_cpu_supports("avx512bf16") : __builtin_cpu_supports("avx512fp16");
}

at::Tensor widened_addmm_cpu(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias) {
  check_addmm(a, b, bias);
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  at::Tensor out = at::empty({M, N}, a.options());  // (M, N) in the dtype
  if (M == 0 || N == 0) {
    return out;
  }
  const auto bias_row = bias.has_value() ? bias->to(at::kFloat) : at::zeros({N}, a.options().dtype(at::kFloat));
  if (K == 0) {
    return out.copy_(bias_row.expand({M, N}));
  }
  const auto [trans_a, lda, a_mem] = gemm_operand(a);
  const auto [trans_b, ldb, b_mem] = gemm_operand(b);
  // Blocks of the output whose float32 sums stay in cache until they are rounded, in one buffer (no
  // (M, N) float32 tensor to fault in and read back): blocks of rows where M >= N (each block re-packs b),
  // of columns otherwise (each re-packs a; a head's 50257 columns against a prompt's rows).
  const bool by_rows = M >= N;
  const int64_t across = by_rows ? N : M;
  const int64_t block = std::min(by_rows ? M : N, std::max<int64_t>(kWidenedMinRows, kWidenedBlockBytes / (4 * across)));
  at::Tensor buffer = at::empty({by_rows ? block : M, by_rows ? N : block}, a.options().dtype(at::kFloat));
  AT_DISPATCH_REDUCED_FLOATING_TYPES(a.scalar_type(), "widened_addmm", [&] {
    const scalar_t* a_ptr = a_mem.const_data_ptr<scalar_t>();
    const scalar_t* b_ptr = b_mem.const_data_ptr<scalar_t>();
    for (int64_t i0 = 0; i0 < (by_rows ? M : N); i0 += block) {
      const int64_t size = std::min(block, (by_rows ? M : N) - i0);
      const int64_t rows = by_rows ? size : M, cols = by_rows ? N : size;
      auto c = buffer.narrow(0, 0, rows).narrow(1, 0, cols);  // (rows, cols), leading dimension buffer.size(1)
      if (bias.has_value()) {
        c.copy_(bias_row.narrow(0, by_rows ? 0 : i0, cols).expand({rows, cols}));
      }
      const scalar_t* a_block = by_rows ? a_ptr + (trans_a ? i0 : i0 * lda) : a_ptr;
      const scalar_t* b_block = by_rows ? b_ptr : b_ptr + (trans_b ? i0 * ldb : i0);
      blas::gemm(trans_a, trans_b, rows, cols, K, 1.0f, a_block, lda, b_block, ldb, bias.has_value() ? 1.0f : 0.0f,
                 c.data_ptr<float>(), buffer.size(1));
      (by_rows ? out.narrow(0, i0, rows) : out.narrow(1, i0, cols)).copy_(c);
    }
  });
  return out;
}

at::Tensor widened_addmm_meta(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias) {
  check_addmm(a, b, bias);
  return at::empty_symint({a.sym_size(0), b.sym_size(1)}, a.options());
}

namespace {
// x (..., in) against weight (out, in) as a 2-D product: product(x (rows, in), weight^T (in, out)) ->
// (rows, out), viewed back as (..., out).
template <typename Product>
at::Tensor as_linear(const at::Tensor& x, const at::Tensor& weight, Product product) {
  TORCH_CHECK_VALUE(x.dim() >= 1 && weight.dim() == 2 && weight.size(1) == x.size(-1),
                    "widened_linear: x must be (..., in) and weight (out, in); got x ", x.sizes(), " and weight ",
                    weight.sizes());
  const at::Tensor y = product(x.reshape({-1, x.size(-1)}), weight.t());  // (rows, out)
  auto sizes = x.sizes().vec();
  sizes.back() = weight.size(0);
  return y.view(sizes);
}
}  // namespace

at::Tensor widened_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return as_linear(x, weight, [&](const at::Tensor& x2, const at::Tensor& wt) {
    return WidenedAddmm::apply(x2, wt, bias);
  });
}

at::Tensor project_no_autograd(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  if (!project_widens(x, weight, bias)) {
    return at::linear(x, weight, bias);
  }
  return as_linear(x, weight, [&](const at::Tensor& x2, const at::Tensor& wt) {
    return widened_addmm_cpu(x2, wt, bias);
  });
}

bool project_widens(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const auto dtype = x.scalar_type();
  return is_half(dtype) && x.device().is_cpu() && weight.scalar_type() == dtype && weight.device().is_cpu() &&
         (!bias.has_value() || (bias->scalar_type() == dtype && bias->device().is_cpu())) && x.dim() >= 1 &&
         weight.dim() == 2 && weight.size(1) == x.size(-1) && !at::autocast::is_autocast_enabled(at::kCPU) &&
         !half_arithmetic(dtype);
}

}  // namespace kernels

at::Tensor project(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  if (kernels::project_widens(x, weight, bias)) {
    return kernels::widened_linear(x, weight, bias);
  }
  return at::linear(x, weight, bias);
}

}  // namespace causal_attention
