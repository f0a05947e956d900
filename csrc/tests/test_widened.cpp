// The projections of half-precision models on CPUs without half arithmetic (csrc/linear/widened.cpp):
// widened_linear's output and its C++ autograd gradients against float64 over the same half values,
// within the bound of a float32 sum rounded once; project routing to it exactly where
// project_widens says, to oneDNN's float32 sums for float32 without a gradient, and to at::linear bit
// for bit elsewhere; unrounded_linear's float32 sums.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/forward_grad.h>
#include <torch/torch.h>

#include <limits>
#include <string>
#include <tuple>

#include "causal_attention/attention.h"
#include "causal_attention/module.h"

namespace {

namespace ca = causal_attention;

// What a product summed in float32 over k terms of total size magnitude, rounded once to dtype, may
// be off from the exact one.
at::Tensor bound(const at::Tensor& exact, const at::Tensor& magnitude, int64_t k, torch::ScalarType dtype) {
  const double eps = dtype == torch::kBFloat16 ? 0x1p-7 : 0x1p-10;
  return exact.abs() * (eps / 2) + magnitude * (double(k) * std::numeric_limits<float>::epsilon()) + 1e-30;
}

void expect_within(const at::Tensor& got, const at::Tensor& exact, const at::Tensor& magnitude, int64_t k,
                   torch::ScalarType dtype, const std::string& what) {
  ASSERT_EQ(got.scalar_type(), dtype) << what;
  const auto err = (got.to(torch::kFloat64) - exact).abs();
  EXPECT_TRUE(err.le(bound(exact, magnitude, k, dtype)).all().item<bool>())
      << what << ": worst error " << err.max().item<double>();
}

class Widened : public ::testing::TestWithParam<torch::ScalarType> {};

TEST_P(Widened, LinearAndItsGradientsMatchFloat64) {
  const auto dtype = GetParam();
  torch::manual_seed(3);
  const int64_t B = 2, T = 113, in = 48, out = 80;
  auto x = torch::randn({B, T, in}).to(dtype).requires_grad_();
  auto w = (torch::randn({out, in}) / 4).to(dtype).requires_grad_();
  auto b = torch::randn({out}).to(dtype).requires_grad_();
  const auto g = torch::randn({B, T, out}).to(dtype);
  const auto y = ca::kernels::widened_linear(x, w, b);
  y.backward(g);

  const auto x64 = x.detach().to(torch::kFloat64), w64 = w.detach().to(torch::kFloat64);
  const auto g64 = g.to(torch::kFloat64);
  expect_within(y.detach(), at::linear(x64, w64, b.detach().to(torch::kFloat64)), at::linear(x64.abs(), w64.abs()),
                in, dtype, "out");
  expect_within(x.grad(), at::matmul(g64, w64), at::matmul(g64.abs(), w64.abs()), out, dtype, "grad x");
  const auto g2 = g64.flatten(0, 1), x2 = x64.flatten(0, 1);
  expect_within(w.grad(), g2.t().mm(x2), g2.abs().t().mm(x2.abs()), B * T, dtype, "grad weight");
  expect_within(b.grad(), g2.sum(0), g2.abs().sum(0), B * T, dtype, "grad bias");
}

// A weight gradient and its bias gradient in one pass over g: widened_addmm's product bit for bit, and
// g's column sums in float32 from its widening; b widened whole (rows) and in blocks of columns.
TEST_P(Widened, AddmmSumsGivesTheProductAndBColumnSums) {
  const auto dtype = GetParam();
  torch::NoGradGuard no_grad;
  torch::manual_seed(6);
  for (const auto& [M, K, N] : {std::tuple<int64_t, int64_t, int64_t>{7, 113, 5}, {20, 70001, 8}, {40, 80001, 16}}) {
    const auto a = (torch::randn({K, M}) * 2).to(dtype).t();  // column-major, as x^T
    const auto b = (torch::randn({K, N}) * 3).to(dtype);
    const auto [product, sums] = ca::kernels::widened_addmm_sums_cpu(a, b);
    EXPECT_TRUE(torch::equal(product, ca::kernels::widened_addmm_cpu(a, b, std::nullopt))) << K;
    ASSERT_EQ(sums.scalar_type(), torch::kFloat32) << K;
    const auto b64 = b.to(torch::kFloat64);
    const auto err = (sums.to(torch::kFloat64) - b64.sum(0)).abs();
    EXPECT_TRUE(err.le(b64.abs().sum(0) * (double(K) * std::numeric_limits<float>::epsilon())).all().item<bool>())
        << K << ": worst error " << err.max().item<double>();
  }
}

TEST_P(Widened, ProjectWidensExactlyWhereTheCpuHasNoHalfArithmetic) {
  const auto dtype = GetParam();
  torch::NoGradGuard no_grad;
  torch::manual_seed(4);
  const auto x = torch::randn({3, 7, 16}).to(dtype);
  const auto w = torch::randn({24, 16}).to(dtype);
  const auto b = torch::randn({24}).to(dtype);
  const bool widens = !ca::kernels::half_arithmetic(dtype);
  EXPECT_EQ(ca::kernels::project_widens(x, w, b), widens);
  const auto expected = widens ? ca::kernels::widened_linear(x, w, b) : at::linear(x, w, b);
  EXPECT_TRUE(torch::equal(ca::project(x, w, b), expected));
  // float32 (Project.Float32WithoutAGradientSumsInFloat32) and mixed dtypes do not widen.
  const auto xf = x.to(torch::kFloat32), wf = w.to(torch::kFloat32), bf = b.to(torch::kFloat32);
  EXPECT_FALSE(ca::kernels::project_widens(xf, wf, bf));
  EXPECT_FALSE(ca::kernels::project_widens(x, w, bf));
}

// A forward-mode AD level for the scope (Python's forward_ad.dual_level).
struct DualLevel {
  DualLevel() : idx(torch::autograd::ForwardADLevel::get_next_idx()) {}
  ~DualLevel() { torch::autograd::ForwardADLevel::release_idx(idx); }
  DualLevel(const DualLevel&) = delete;
  DualLevel& operator=(const DualLevel&) = delete;
  const uint64_t idx;
};

// float32 with nothing to differentiate: oneDNN's inner product where float32_products says so, a
// float32 sum within its bound of the float64 product; at::linear, bit for bit, wherever a gradient is
// wanted or the weight is not row-major.
TEST(Project, Float32WithoutAGradientSumsInFloat32) {
  torch::manual_seed(5);
  const int64_t k = 768;
  const auto x = torch::randn({3, 113, k}) * 3;
  const auto w = torch::randn({2304, k});
  const auto b = torch::randn({2304});
  const auto x64 = x.to(torch::kFloat64), w64 = w.to(torch::kFloat64), b64 = b.to(torch::kFloat64);
  const auto exact = at::linear(x64, w64, b64);
  const auto magnitude = at::linear(x64.abs(), w64.abs(), b64.abs());
  const std::string route = ca::kernels::float32_products();
  EXPECT_EQ(route, at::hasMKLDNN() ? "oneDNN" : "ATen");
  {
    torch::NoGradGuard no_grad;
    for (const bool with_bias : {true, false}) {
      const auto bias = with_bias ? std::optional<at::Tensor>(b) : std::nullopt;
      const auto y = ca::project(x, w, bias);
      ASSERT_EQ(y.sizes(), torch::IntArrayRef({3, 113, 2304}));
      ASSERT_EQ(y.scalar_type(), torch::kFloat32);
      const auto want = with_bias ? exact : exact - b64;
      const auto err = (y.to(torch::kFloat64) - want).abs();
      const auto limit = magnitude * (double(k + 1) * std::numeric_limits<float>::epsilon()) + 1e-30;
      EXPECT_TRUE(err.le(limit).all().item<bool>()) << "worst error " << err.max().item<double>();
      EXPECT_TRUE(torch::equal(ca::kernels::project_no_autograd(x, w, bias), y));
      // The route float32_products names, bit for bit: oneDNN's op called directly, or at::linear.
      at::Tensor direct = at::linear(x, w, bias);
      if (route == "oneDNN") {
        const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
        torch::jit::Stack stack{x.reshape({-1, k}), w, with_bias ? c10::IValue(b) : c10::IValue(), std::string("none"),
                                c10::List<std::optional<at::Scalar>>(), c10::IValue()};
        op.callBoxed(&stack);
        direct = stack.at(0).toTensor().view({3, 113, 2304});
      }
      EXPECT_TRUE(torch::equal(y, direct)) << "not the route float32_products names: " << route;
    }
    const auto w_columns = w.t().contiguous().t();  // (out, in) stored column-major: ATen's
    EXPECT_TRUE(torch::equal(ca::project(x, w_columns, b), at::linear(x, w_columns, b)));
  }
  // A tangent (forward-mode AD) is differentiated too: ATen's, which carries it.
  {
    torch::NoGradGuard no_grad;
    const DualLevel level;
    ASSERT_EQ(level.idx, 0u);  // the level _fw_grad(0) reads
    const auto tangent = torch::randn_like(x);
    const auto dual = x.clone();
    dual._set_fw_grad(tangent, level.idx, /*is_inplace_op=*/false);
    const auto y = ca::project(dual, w, b);
    EXPECT_TRUE(torch::equal(y, at::linear(x, w, b)));
    ASSERT_TRUE(y._fw_grad(0).defined());
    EXPECT_TRUE(torch::allclose(y._fw_grad(0), at::linear(tangent, w), 1e-4, 1e-4));
  }
  const auto xg = x.clone().requires_grad_();
  const auto y = ca::project(xg, w, b);
  EXPECT_TRUE(torch::equal(y, at::linear(x, w, b)));
  y.backward(torch::ones_like(y));
  ASSERT_TRUE(xg.grad().defined());
  EXPECT_TRUE(torch::allclose(xg.grad(), torch::ones_like(y).matmul(w).expand_as(x), 1e-4, 1e-3));
}

TEST_P(Widened, AddmmRefusesWhatItCannotTake) {
  const auto dtype = GetParam();
  const auto a = torch::ones({2, 4}, dtype), b = torch::ones({4, 3}, dtype);
  EXPECT_THROW(ca::kernels::widened_addmm_cpu(a, b.t(), std::nullopt), c10::ValueError);
  EXPECT_THROW(ca::kernels::widened_addmm_cpu(a.to(torch::kFloat32), b.to(torch::kFloat32), std::nullopt),
               c10::TypeError);
  EXPECT_THROW(ca::kernels::widened_addmm_cpu(a, b, torch::ones({4}, dtype)), c10::ValueError);
  EXPECT_THROW(ca::kernels::widened_linear(torch::ones({2, 5}, dtype), torch::ones({3, 4}, dtype), std::nullopt),
               c10::ValueError);
}

// unrounded_linear (a half model's float32 logits): float32 within the summation bound of the float64
// product of the same half values, not rounded to the dtype, on both row paths (streamed up to 64 rows,
// widened_blocks past them); a decode step's sums rounded are few_rows_linear_cpu's bits.
TEST_P(Widened, UnroundedLinearReturnsTheFloat32Sums) {
  const auto dtype = GetParam();
  torch::NoGradGuard no_grad;
  torch::manual_seed(5);
  const int64_t in = 77, out = 131;
  const auto w = (torch::randn({out, in}) / 2).to(dtype);
  const auto b = torch::randn({out}).to(dtype);
  for (const int64_t rows : {1, 5, 8, 9, 33, 64, 65, 70, 140}) {
    const auto x = (torch::randn({rows, in}) * 3).to(dtype);
    const auto y = ca::kernels::unrounded_linear_cpu(x, w, b);
    ASSERT_EQ(y.scalar_type(), torch::kFloat32) << rows;
    const auto x64 = x.to(torch::kFloat64), w64 = w.to(torch::kFloat64), b64 = b.to(torch::kFloat64);
    const auto exact = at::linear(x64, w64, b64);
    const auto magnitude = at::linear(x64.abs(), w64.abs(), b64.abs());
    const auto err = (y.to(torch::kFloat64) - exact).abs();
    EXPECT_TRUE(err.le(magnitude * (double(in + 1) * std::numeric_limits<float>::epsilon())).all().item<bool>())
        << rows << " rows: worst error " << err.max().item<double>();
    EXPECT_FALSE(torch::equal(y, y.to(dtype).to(torch::kFloat32))) << rows << " rows: rounded to the dtype";
    if (rows <= 8) {
      EXPECT_TRUE(torch::equal(y.to(dtype), ca::kernels::few_rows_linear_cpu(x, w, b))) << rows;
    }
    // The public entry: the same values without autograd, F.linear's on the widenings with it.
    EXPECT_TRUE(torch::equal(ca::unrounded_linear(x, w, b), y)) << rows;
  }
  torch::AutoGradMode grad(true);
  const auto x = torch::randn({4, in}).to(dtype);
  const auto wg = w.clone().requires_grad_();
  const auto y = ca::unrounded_linear(x, wg, at::Tensor());
  ASSERT_EQ(y.scalar_type(), torch::kFloat32);
  y.sum().backward();
  ASSERT_EQ(wg.grad().scalar_type(), dtype);
  const auto expected = x.to(torch::kFloat64).sum(0).expand({out, in});
  const double eps = dtype == torch::kBFloat16 ? 0x1p-8 : 0x1p-11;  // half a step of the dtype
  EXPECT_TRUE((wg.grad().to(torch::kFloat64) - expected).abs().le(expected.abs() * eps * 1.01 + 1e-6).all()
                  .item<bool>());
}

TEST_P(Widened, UnroundedLinearRefusesWhatItCannotTake) {
  const auto dtype = GetParam();
  const auto x = torch::ones({2, 4}, dtype), w = torch::ones({3, 4}, dtype);
  EXPECT_THROW(ca::kernels::unrounded_linear_cpu(x, w.t(), std::nullopt), c10::ValueError);
  EXPECT_THROW(ca::kernels::unrounded_linear_cpu(x, w.to(torch::kFloat32), std::nullopt), c10::TypeError);
  EXPECT_THROW(ca::kernels::unrounded_linear_cpu(x, w, torch::ones({4}, dtype)), c10::ValueError);
}

INSTANTIATE_TEST_SUITE_P(HalfTypes, Widened, ::testing::Values(torch::kBFloat16, torch::kHalf),
                         [](const ::testing::TestParamInfo<torch::ScalarType>& info) {
                           return std::string(info.param == torch::kBFloat16 ? "bfloat16" : "float16");
                         });

}  // namespace
