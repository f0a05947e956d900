// The projections of half-precision models on CPUs without half arithmetic (csrc/linear/widened.cpp):
// widened_linear's output and its C++ autograd gradients against float64 over the same half values,
// within the bound of a float32 sum rounded once; project routing to it exactly where
// project_widens says, and to at::linear bit for bit elsewhere.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>
#include <string>

#include "causal_attention/attention.h"

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
  // float32 and mixed dtypes are ATen's, bit for bit.
  const auto xf = x.to(torch::kFloat32), wf = w.to(torch::kFloat32), bf = b.to(torch::kFloat32);
  EXPECT_FALSE(ca::kernels::project_widens(xf, wf, bf));
  EXPECT_TRUE(torch::equal(ca::project(xf, wf, bf), at::linear(xf, wf, bf)));
  EXPECT_FALSE(ca::kernels::project_widens(x, w, bf));
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

INSTANTIATE_TEST_SUITE_P(HalfTypes, Widened, ::testing::Values(torch::kBFloat16, torch::kHalf),
                         [](const ::testing::TestParamInfo<torch::ScalarType>& info) {
                           return std::string(info.param == torch::kBFloat16 ? "bfloat16" : "float16");
                         });

}  // namespace
