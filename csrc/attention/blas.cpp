// The tile GEMMs (blas.h): MKL's routines from libtorch_cpu, or ATen products where torch has no MKL.
#include "blas.h"

#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/util/Exception.h>

#include <limits>

#ifdef CA_HAVE_MKL_GEMM
extern "C" {
// Fortran BLAS (LP64: 32-bit integers), column-major.
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
// MKL's CBLAS extensions: 16-bit operands, float32 accumulation and result.
void cblas_gemm_bf16bf16f32(int layout, int transa, int transb, int m, int n, int k, float alpha,
                            const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta, float* c, int ldc);
void cblas_gemm_f16f16f32(int layout, int transa, int transb, int m, int n, int k, float alpha, const uint16_t* a,
                          int lda, const uint16_t* b, int ldb, float beta, float* c, int ldc);
}
#endif

namespace causal_attention::blas {
namespace {

#ifdef CA_HAVE_MKL_GEMM
// Tile sizes and leading dimensions fit BLAS's 32-bit integers (a tile is at most T x 3 * dim).
int as_int(int64_t x) {
  TORCH_CHECK(x >= 0 && x <= std::numeric_limits<int>::max(), "tile GEMM: dimension ", x,
              " out of the range of BLAS's 32-bit integers");
  return static_cast<int>(x);
}

constexpr int kRowMajor = 101;
constexpr int kNoTrans = 111;
constexpr int kTrans = 112;

// Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: the operands swap, the flags stay.
template <typename T, typename F>
void fortran_gemm(F f, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
                  int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  const int mi = as_int(m), ni = as_int(n), ki = as_int(k);
  const int lda_i = as_int(lda), ldb_i = as_int(ldb), ldc_i = as_int(ldc);
  f(trans_b ? "T" : "N", trans_a ? "T" : "N", &ni, &mi, &ki, &alpha, b, &ldb_i, a, &lda_i, &beta, c, &ldc_i);
}

template <typename T, typename F>
void cblas_16bit_gemm(F f, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const T* a,
                      int64_t lda, const T* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  f(kRowMajor, trans_a ? kTrans : kNoTrans, trans_b ? kTrans : kNoTrans, as_int(m), as_int(n), as_int(k), alpha,
    reinterpret_cast<const uint16_t*>(a), as_int(lda), reinterpret_cast<const uint16_t*>(b), as_int(ldb), beta, c,
    as_int(ldc));
}
#endif

}  // namespace

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
#ifdef CA_HAVE_MKL_GEMM
  fortran_gemm<float>(sgemm_, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
#else
  aten::gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
#endif
}

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha, const double* a, int64_t lda,
          const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
#ifdef CA_HAVE_MKL_GEMM
  fortran_gemm<double>(dgemm_, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
#else
  aten::gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
#endif
}

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const c10::BFloat16* a,
          int64_t lda, const c10::BFloat16* b, int64_t ldb, float beta, float* c, int64_t ldc) {
#ifdef CA_HAVE_MKL_GEMM
  cblas_16bit_gemm(cblas_gemm_bf16bf16f32, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
#else
  aten::gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
#endif
}

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const c10::Half* a, int64_t lda,
          const c10::Half* b, int64_t ldb, float beta, float* c, int64_t ldc) {
#ifdef CA_HAVE_MKL_GEMM
  cblas_16bit_gemm(cblas_gemm_f16f16f32, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
#else
  aten::gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
#endif
}

namespace aten {
namespace {

// op(X) as a tensor on X's memory (rows x cols after op).
template <typename T>
at::Tensor operand(const T* x, bool trans, int64_t rows, int64_t cols, int64_t ld) {
  const auto dtype = c10::CppTypeToScalarType<T>::value;
  auto* p = const_cast<T*>(x);  // read only
  return trans ? at::from_blob(p, {cols, rows}, {ld, 1}, at::dtype(dtype)).t()
               : at::from_blob(p, {rows, cols}, {ld, 1}, at::dtype(dtype));
}

}  // namespace

template <typename T, typename S, typename C>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, S alpha, const T* a, int64_t lda, const T* b,
          int64_t ldb, S beta, C* c, int64_t ldc) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // plain products, never recorded by autograd
  const auto c_dtype = c10::CppTypeToScalarType<C>::value;
  at::Tensor out = at::from_blob(c, {m, n}, {ldc, 1}, at::dtype(c_dtype));
  // 16-bit operands widen exactly to C's float32, so the product is summed in float32.
  const at::Tensor a_t = operand(a, trans_a, m, k, lda).to(c_dtype);
  const at::Tensor b_t = operand(b, trans_b, k, n, ldb).to(c_dtype);
  if (beta == S(0)) {
    at::mm_out(out, a_t, b_t);
    if (alpha != S(1)) {
      out.mul_(alpha);
    }
  } else {
    at::addmm_out(out, out, a_t, b_t, beta, alpha);
  }
}

template void gemm(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*, int64_t, float,
                   float*, int64_t);
template void gemm(bool, bool, int64_t, int64_t, int64_t, double, const double*, int64_t, const double*, int64_t,
                   double, double*, int64_t);
template void gemm(bool, bool, int64_t, int64_t, int64_t, float, const c10::BFloat16*, int64_t, const c10::BFloat16*,
                   int64_t, float, float*, int64_t);
template void gemm(bool, bool, int64_t, int64_t, int64_t, float, const c10::Half*, int64_t, const c10::Half*, int64_t,
                   float, float*, int64_t);

}  // namespace aten

const char* gemm_backend() {
#ifdef CA_HAVE_MKL_GEMM
  return "MKL";
#else
  return "ATen";
#endif
}

}  // namespace causal_attention::blas
