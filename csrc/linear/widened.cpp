// The projections of a half-precision model on a CPU without arithmetic in its type (AVX2, or AVX-512
// without BF16 / FP16): ATen's bfloat16 and half GEMMs run 3.5-4x slower than float32 there. Here the
// operands are widened to float32 (exact) as the engine's own GEMM packs them (widened_gemm, the AVX2 and
// AVX512 builds), or in cache-sized blocks multiplied by oneDNN's float32 inner product or sgemm (the
// DEFAULT build), so each output is a float32 sum of exact products, rounded once, at float32's speed.
// float32 projections with nothing to differentiate take oneDNN's inner product (project).
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <memory>
#include <tuple>
#include <vector>

#include "attention/blas.h"
#include "causal_attention/attention.h"
#include "cpu/tile_ops.h"
#include "linear/widened.h"

namespace causal_attention {
namespace kernels {
namespace {

// widened_blocks' blocks: equal blocks whose widened operand and float32 sums take about
// kWidenedBlockBytes together, in multiples of 16 rows (or columns). Each block's GEMM packs the whole
// other operand again, so blocks are few; below glibc's 32 MB mmap ceiling, their buffers are reused
// from the heap instead of faulted in afresh on every call.
constexpr int64_t kWidenedBlockBytes = int64_t(1) << 24;

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
  // (meta: the shapes-only kernel, as torch.compile's fake tensors reach it)
  const auto cpu = [](const at::Tensor& t) { return t.device().is_cpu() || t.device().is_meta(); };
  TORCH_CHECK_VALUE(cpu(a) && cpu(b), "widened_addmm takes CPU tensors; got a on ", a.device(), " and b on ",
                    b.device());
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == b.size(1), "widened_addmm: bias must have shape (N,) = (",
                      b.size(1), ",); got ", bias->sizes());
    TORCH_CHECK_TYPE(bias->scalar_type() == a.scalar_type(), "widened_addmm: bias dtype (", bias->scalar_type(),
                     ") must match a's (", a.scalar_type(), ")");
    TORCH_CHECK_VALUE(cpu(*bias), "widened_addmm takes CPU tensors; got bias on ", bias->device());
  }
}

at::Tensor call_addmm(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("causal_attention::widened_addmm", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();
  return op.call(a, b, bias);
}

std::tuple<at::Tensor, at::Tensor> call_addmm_sums(const at::Tensor& a, const at::Tensor& b) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("causal_attention::widened_addmm_sums", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&)>();
  return op.call(a, b);
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
    const bool needs_gbias = ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2);
    if (ctx->needs_input_grad(0)) {
      ga = WidenedAddmm::apply(g, b.t(), std::nullopt);  // (M, K)
    }
    if (ctx->needs_input_grad(1) && needs_gbias && !at::GradMode::is_enabled()) {
      // The bias gradient summed from g's float32 widening in b's product: ATen's float32 sum of a
      // half g widens it in a slow pass of its own.
      at::Tensor sums;
      std::tie(gb, sums) = call_addmm_sums(a.t(), g);  // (K, N), (N,) float32
      gbias = sums.to(g.scalar_type());
    } else {
      if (ctx->needs_input_grad(1)) {
        gb = WidenedAddmm::apply(a.t(), g, std::nullopt);  // (K, N)
      }
      if (needs_gbias) {
        gbias = g.sum(0, /*keepdim=*/false, at::kFloat).to(g.scalar_type());  // (N,), summed in float32
      }
    }
    return {ga, gb, gbias};
  }
};

// t (rows, cols) widened to float32 in buffer's memory, in t's orientation (rows or columns contiguous),
// so that the copy streams both sides.
at::Tensor widen_into(const at::Tensor& t, const at::Tensor& buffer) {
  const int64_t rows = t.size(0), cols = t.size(1);
  const auto memory = buffer.narrow(0, 0, rows * cols);
  const bool columns = t.stride(0) == 1 && t.stride(1) != 1;
  return (columns ? memory.view({cols, rows}).t() : memory.view({rows, cols})).copy_(t);
}

// Whether oneDNN's default float32 math is left strict: ONEDNN_DEFAULT_FPMATH_MODE (DNNL_ before
// oneDNN 3) set to BF16, TF32 or ANY lets its float32 products round their operands.
bool onednn_fpmath_strict() {
  for (const char* name : {"ONEDNN_DEFAULT_FPMATH_MODE", "DNNL_DEFAULT_FPMATH_MODE"}) {
    const char* mode = std::getenv(name);
    if (mode != nullptr && !std::string_view(mode).empty() && std::string_view(mode) != "STRICT" &&
        std::string_view(mode) != "strict") {
      return false;
    }
  }
  return true;
}

// oneDNN's float32 inner product (torch's mkldnn::_linear_pointwise) where torch has it,
// torch.backends.mkldnn is enabled and its float32 products are IEEE (not rounded to bf16 / tf32, by
// torch's settings or oneDNN's environment): MKL's sgemm takes slower paths on AMD CPUs, oneDNN does not.
std::optional<c10::OperatorHandle> onednn_linear_op() {
  const auto& context = at::globalContext();
  const auto precision = context.float32Precision(at::Float32Backend::MKLDNN, at::Float32Op::MATMUL);
  if (!at::hasMKLDNN() || !context.userEnabledMkldnn() || context.allowTF32OneDNN() || !onednn_fpmath_strict() ||
      (precision != at::Float32Precision::NONE && precision != at::Float32Precision::IEEE)) {
    return std::nullopt;
  }
  return c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
}

// x (rows, K) @ w (cols, K)^T (+ bias (cols,)) -> (rows, cols), float32: w of any strides, x row-major
// (oneDNN copies any other x).
at::Tensor onednn(const c10::OperatorHandle& op, const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  torch::jit::Stack stack{x, w, bias.defined() ? c10::IValue(bias) : c10::IValue(), std::string("none"),
                          c10::List<std::optional<at::Scalar>>(), c10::IValue()};
  op.callBoxed(&stack);
  return stack.at(0).toTensor();
}

// a (rows, K) @ b (K, cols) (+ bias (cols,)) -> (rows, cols), float32 by blas::gemm into buffer's memory.
at::Tensor sgemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias, const at::Tensor& buffer) {
  const int64_t rows = a.size(0), cols = b.size(1);
  const auto [trans_a, lda, a_mem] = gemm_operand(a);
  const auto [trans_b, ldb, b_mem] = gemm_operand(b);
  auto sums = buffer.narrow(0, 0, rows).narrow(1, 0, cols);  // leading dimension buffer.size(1)
  if (bias.defined()) {
    sums.copy_(bias.expand({rows, cols}));
  }
  blas::gemm(trans_a, trans_b, rows, cols, a.size(1), 1.0f, a_mem.const_data_ptr<float>(), lda,
             b_mem.const_data_ptr<float>(), ldb, bias.defined() ? 1.0f : 0.0f, sums.data_ptr<float>(), buffer.size(1));
  return sums;
}

// Columns of C per task of widened_panels.
constexpr int64_t kPanelColumns = 64;
// widened_panels' block of a, widened to float32 rows: it stays in L3 while every block of b's columns passes.
constexpr int64_t kPanelRowBytes = int64_t(1) << 23;

// widened_blocks by the ISA's widened_gemm (false where the build has none): a widened to float32 rows a
// block of rows at a time (row-major whatever its layout, so that the kernel reads each row in order); b
// widened as each task packs it. The tasks of a block of rows are blocks of kPanelColumns columns, split
// by rows as well where there are few (a narrow product; each part packs its own b).
template <typename scalar_t>
bool widened_panels(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias,
                    const at::Tensor& out, const at::Tensor& b_sums) {
  const auto& ops = tile::tile_ops<scalar_t>();
  static_assert(kPanelColumns % tile::kPanel == 0);
  if (ops.widened_gemm == nullptr || ops.store == nullptr || out.stride(1) != 1 ||
      (b_sums.defined() && !b_sums.is_contiguous())) {
    return false;
  }
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  // (rows of at least kPanelColumns values' bytes: a short K would make the rounding's staging rows large)
  const int64_t block_rows =
      std::min(M, std::max<int64_t>(6, kPanelRowBytes / (4 * std::max(K, kPanelColumns)) / 6 * 6));
  const at::Tensor a_block = at::empty({block_rows, K}, a.options().dtype(at::kFloat));
  const at::Tensor bias_f = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const bool in_place = out.scalar_type() == at::kFloat;  // float32 sums written where they belong
  const int64_t chunks = (N + kPanelColumns - 1) / kPanelColumns;
  const int64_t threads = at::get_num_threads();
  const int64_t ld = out.stride(0);
  const scalar_t* b_ptr = b.const_data_ptr<scalar_t>();
  const float* bias_ptr = bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr;
  for (int64_t i0 = 0; i0 < M; i0 += block_rows) {
    const int64_t rows_here = std::min(block_rows, M - i0);
    const at::Tensor a_f = a_block.narrow(0, 0, rows_here).copy_(a.narrow(0, i0, rows_here));  // (rows, K)
    const float* a_ptr = a_f.const_data_ptr<float>();
    const int64_t splits =
        std::clamp<int64_t>((2 * threads + chunks - 1) / chunks, 1, std::max<int64_t>(1, rows_here / 48));
    const int64_t part_rows = ((rows_here + splits - 1) / splits + 5) / 6 * 6;
    float* sums_ptr = b_sums.defined() && i0 == 0 ? b_sums.data_ptr<float>() : nullptr;
    at::parallel_for(0, chunks * splits, 1, [&](int64_t t0, int64_t t1) {
      // (scratch left uninitialised: the kernel writes before it reads)
      const auto pack = std::make_unique_for_overwrite<float[]>(tile::kWidenedDepth * kPanelColumns);
      const int64_t stage_size = in_place ? 0 : std::min(part_rows, rows_here) * kPanelColumns;
      const auto stage = std::make_unique_for_overwrite<float[]>(stage_size);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t j0 = (t / splits) * kPanelColumns, r0 = (t % splits) * part_rows;
        const int64_t cols = std::min(kPanelColumns, N - j0), rows = std::min(part_rows, rows_here - r0);
        if (rows <= 0) {
          continue;
        }
        float* c = in_place ? out.data_ptr<float>() + (i0 + r0) * ld + j0 : stage.get();
        const int64_t ldc = in_place ? ld : kPanelColumns;
        ops.widened_gemm(rows, cols, K, a_ptr + r0 * K, K, 1, b_ptr + j0 * b.stride(1), b.stride(0), b.stride(1),
                         bias_ptr != nullptr ? bias_ptr + j0 : nullptr, c, ldc, pack.get(),
                         sums_ptr != nullptr && r0 == 0 ? sums_ptr + j0 : nullptr);
        if (!in_place) {
          ops.store(c, ldc, rows, cols, out.data_ptr<scalar_t>() + (i0 + r0) * ld + j0, ld);
        }
      }
    });
  }
  return true;
}

}  // namespace

void widened_blocks(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias,
                    const at::Tensor& out, const at::Tensor& b_sums) {
  const bool panels = AT_DISPATCH_REDUCED_FLOATING_TYPES(a.scalar_type(), "widened_blocks", [&] {
    return widened_panels<scalar_t>(a, b, bias, out, b_sums);
  });
  if (panels) {
    return;
  }
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  // Blocks of rows where M >= N (b widened once, whole: up to twice its half size), of columns otherwise
  // (a widened once: a prompt's rows against a head's 50257 columns); a block's widened operand and its
  // sums stay in cache.
  const bool by_rows = M >= N;
  const int64_t along = by_rows ? M : N;
  const int64_t across = by_rows ? N : M;
  const int64_t blocks =
      std::max<int64_t>(1, (along * (K + across) * 4 + kWidenedBlockBytes - 1) / kWidenedBlockBytes);
  const int64_t block = std::min(along, ((along + blocks - 1) / blocks + 15) / 16 * 16);
  const auto f32 = a.options().dtype(at::kFloat);
  const auto onednn_linear = onednn_linear_op();
  const at::Tensor& whole = by_rows ? b : a;
  const at::Tensor whole_f = widen_into(whole, at::empty({whole.numel()}, f32));
  if (b_sums.defined() && by_rows) {
    at::Tensor sums = b_sums;
    at::sum_out(sums, whole_f, 0);
  }
  const at::Tensor part_buffer = at::empty({block * K}, f32);
  const at::Tensor buffer = at::empty({by_rows ? block : M, by_rows ? N : block}, f32);  // sgemm's sums
  const at::Tensor bias_f = bias.has_value() ? bias->to(at::kFloat) : at::Tensor();
  for (int64_t i0 = 0; i0 < along; i0 += block) {
    const int64_t size = std::min(block, along - i0);
    const at::Tensor part_f = widen_into(by_rows ? a.narrow(0, i0, size) : b.narrow(1, i0, size), part_buffer);
    const at::Tensor& a_f = by_rows ? part_f : whole_f;  // (rows, K)
    const at::Tensor& b_f = by_rows ? whole_f : part_f;  // (K, cols)
    if (b_sums.defined() && !by_rows) {
      auto sums_block = b_sums.narrow(0, i0, size);
      at::sum_out(sums_block, part_f, 0);
    }
    const int64_t row0 = by_rows ? i0 : 0, col0 = by_rows ? 0 : i0;
    const at::Tensor bias_block = bias_f.defined() ? bias_f.narrow(0, col0, b_f.size(1)) : at::Tensor();
    // oneDNN takes x row-major and the weight (cols, K) row-major; it would copy any other layout per
    // block (a weight gradient's x^T, an input gradient's weight), which sgemm reads in place.
    const at::Tensor sums = onednn_linear.has_value() && a_f.is_contiguous() && b_f.t().is_contiguous()
                                ? onednn(*onednn_linear, a_f, b_f.t(), bias_block)
                                : sgemm(a_f, b_f, bias_block, buffer);
    out.narrow(0, row0, sums.size(0)).narrow(1, col0, sums.size(1)).copy_(sums);
  }
}

const char* widened_products() {
  if (tile::tile_ops<c10::BFloat16>().widened_gemm != nullptr) {
    return "panels";
  }
  return onednn_linear_op().has_value() ? "oneDNN+sgemm" : "sgemm";
}

const char* float32_products() { return onednn_linear_op().has_value() ? "oneDNN" : "ATen"; }

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
  if (K == 0) {
    return bias.has_value() ? out.copy_(bias->expand({M, N})) : out.zero_();
  }
  widened_blocks(a, b, bias, out);  // rounded once
  return out;
}

std::tuple<at::Tensor, at::Tensor> widened_addmm_sums_cpu(const at::Tensor& a, const at::Tensor& b) {
  check_addmm(a, b, std::nullopt);
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  if (M == 0 || N == 0 || K == 0) {  // nothing to widen: widened_addmm's empty product and ATen's sum
    return {widened_addmm_cpu(a, b, std::nullopt), b.sum(0, /*keepdim=*/false, at::kFloat)};
  }
  at::Tensor out = at::empty({M, N}, a.options());
  at::Tensor sums = at::empty({N}, a.options().dtype(at::kFloat));
  widened_blocks(a, b, std::nullopt, out, sums);
  return {out, sums};
}

std::tuple<at::Tensor, at::Tensor> widened_addmm_sums_meta(const at::Tensor& a, const at::Tensor& b) {
  check_addmm(a, b, std::nullopt);
  return {at::empty_symint({a.sym_size(0), b.sym_size(1)}, a.options()),
          at::empty_symint({b.sym_size(1)}, a.options().dtype(at::kFloat))};
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

namespace {
// float32 x (..., in) against a row-major weight (out, in) by oneDNN's inner product, where
// onednn_linear_op has it: plain CPU float32 operands of matching shapes, no CPU autocast. MKL's
// sgemm takes slower paths on AMD CPUs (Zen 4: 1.3-2.7x the time of oneDNN's at 16-2048 rows).
// Nothing when it does not apply.
std::optional<at::Tensor> onednn_float32_linear(const at::Tensor& x, const at::Tensor& weight,
                                                const std::optional<at::Tensor>& bias) {
  const auto cpu_float = [](const at::Tensor& t) {
    return t.scalar_type() == at::kFloat && t.device().is_cpu() && t.layout() == at::kStrided;
  };
  if (!cpu_float(x) || !cpu_float(weight) || (bias.has_value() && !cpu_float(*bias)) || x.dim() < 1 ||
      weight.dim() != 2 || weight.size(1) != x.size(-1) || !weight.is_contiguous() || x.numel() == 0 ||
      weight.numel() == 0 || (bias.has_value() && (bias->dim() != 1 || bias->size(0) != weight.size(0))) ||
      at::autocast::is_autocast_enabled(at::kCPU)) {
    return std::nullopt;
  }
  const auto op = onednn_linear_op();
  if (!op.has_value()) {
    return std::nullopt;
  }
  return as_linear(x, weight, [&](const at::Tensor& x2, const at::Tensor& wt) {
    return onednn(*op, x2.contiguous(), wt.t(), bias.has_value() ? bias->contiguous() : at::Tensor());
  });
}
}  // namespace

at::Tensor project_no_autograd(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  if (!project_widens(x, weight, bias)) {
    auto y = onednn_float32_linear(x, weight, bias);
    return y.has_value() ? *std::move(y) : at::linear(x, weight, bias);
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
  // Reverse mode (a gradient wanted) or forward mode (a tangent, which oneDNN's op would drop): ATen's.
  const auto wanted = [](const at::Tensor& t) {
    return (at::GradMode::is_enabled() && t.requires_grad()) || t._fw_grad(/*level=*/0).defined();
  };
  const bool differentiated = wanted(x) || wanted(weight) || (bias.has_value() && wanted(*bias));
  return differentiated ? at::linear(x, weight, bias) : kernels::project_no_autograd(x, weight, bias);
}

}  // namespace causal_attention
