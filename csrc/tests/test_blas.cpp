// The tile GEMMs (csrc/attention/blas.h), MKL's path and the ATen fallback, against float64 products
// of the same operands: every transpose combination, strided operands, beta 0 (C never read) and 1
// (accumulate), alpha != 1.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "attention/blas.h"

namespace {

namespace blas = causal_attention::blas;

// op(X) of a stored (rows x ld) matrix: the first `cols` columns, transposed when trans.
torch::Tensor op(const torch::Tensor& stored, bool trans, int64_t cols) {
  const auto used = stored.narrow(1, 0, cols);
  return trans ? used.t() : used;
}

// A stored operand of op-shape (rows x cols): (cols x rows) when trans, with 5 spare columns.
torch::Tensor stored_operand(int64_t rows, int64_t cols, bool trans, torch::ScalarType dtype) {
  return torch::randn({trans ? cols : rows, (trans ? rows : cols) + 5}).to(dtype);
}

// gemm: blas::gemm (MKL where found) or blas::aten::gemm (the fallback), as a generic lambda.
template <typename T, typename C, typename S, typename Gemm>
void check(torch::ScalarType dtype, double tolerance, const Gemm& gemm) {
  const auto c_dtype = c10::CppTypeToScalarType<C>::value;
  for (const bool ta : {false, true}) {
    for (const bool tb : {false, true}) {
      for (const auto& [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1}, {7, 5, 3}, {64, 64, 64},
                                    {65, 48, 130}, {128, 80, 128}}) {
        for (const double beta : {0.0, 1.0}) {
          const auto a = stored_operand(m, k, ta, dtype);
          const auto b = stored_operand(k, n, tb, dtype);
          const int64_t ldc = n + 3;
          auto c = torch::randn({m, ldc}).to(c_dtype);
          const auto c_before = c.clone();
          if (beta == 0) {  // beta 0: C is written, never read
            c.fill_(std::numeric_limits<double>::quiet_NaN());
          }
          const auto tail_before = c.narrow(1, n, ldc - n).clone();
          const double alpha = 0.5;
          gemm(ta, tb, m, n, k, static_cast<S>(alpha), a.template const_data_ptr<T>(), a.size(1),
               b.template const_data_ptr<T>(), b.size(1), static_cast<S>(beta), c.template data_ptr<C>(), ldc);
          const auto product = torch::mm(op(a, ta, ta ? m : k).to(torch::kFloat64),
                                         op(b, tb, tb ? k : n).to(torch::kFloat64));
          const auto expected = alpha * product + beta * c_before.narrow(1, 0, n).to(torch::kFloat64);
          const auto got = c.narrow(1, 0, n).to(torch::kFloat64);
          const double scale = std::sqrt(static_cast<double>(k));  // entries of the product ~ sqrt(k)
          EXPECT_LE((got - expected).abs().max().template item<double>(), tolerance * scale)
              << dtype << " trans_a " << ta << " trans_b " << tb << " m " << m << " n " << n << " k " << k
              << " beta " << beta;
          // The columns past n of C are never touched.
          EXPECT_TRUE(torch::isclose(c.narrow(1, n, ldc - n), tail_before, 0, 0, /*equal_nan=*/true)
                          .all()
                          .template item<bool>());
        }
      }
    }
  }
}

const auto kGemm = [](auto... args) { blas::gemm(args...); };
const auto kAtenGemm = [](auto... args) { blas::aten::gemm(args...); };

TEST(Blas, FloatMatchesFloat64Products) {
  check<float, float, float>(torch::kFloat32, 1e-5, kGemm);
  check<float, float, float>(torch::kFloat32, 1e-5, kAtenGemm);
}

TEST(Blas, DoubleMatchesFloat64Products) {
  check<double, double, double>(torch::kFloat64, 1e-13, kGemm);
  check<double, double, double>(torch::kFloat64, 1e-13, kAtenGemm);
}

// 16-bit operands: products of the exact float32 widenings summed in float32, so the error is
// float32's (a bfloat16 or half accumulation would be off by 1e-3 .. 1e-2 of sqrt(k)).
TEST(Blas, BFloat16SumsInFloat32) {
  check<c10::BFloat16, float, float>(torch::kBFloat16, 1e-5, kGemm);
  check<c10::BFloat16, float, float>(torch::kBFloat16, 1e-5, kAtenGemm);
}

TEST(Blas, HalfSumsInFloat32) {
  check<c10::Half, float, float>(torch::kHalf, 1e-5, kGemm);
  check<c10::Half, float, float>(torch::kHalf, 1e-5, kAtenGemm);
}

TEST(Blas, NamesItsBackend) {
  const std::string backend = blas::gemm_backend();
  EXPECT_TRUE(backend == "MKL" || backend == "ATen") << backend;
}

}  // namespace
