// Matrix products on raw tile pointers, with no tensor objects: the fused kernels' tile GEMMs.
//
// Row-major: C (m x n, ldc) = alpha * op(A) . op(B) + beta * C, where op(A) is m x k (A stored
// k x m when trans_a), op(B) is k x n (B stored n x k when trans_b). Leading dimensions are in
// elements and at least the stored row length.
//
// float / double: BLAS sgemm / dgemm. bfloat16 / half operands with a float32 C: each product of
// two exact widenings summed in float32 (what a product in the input type with float32
// accumulation computes), by MKL's cblas_gemm_bf16bf16f32 / cblas_gemm_f16f16f32, which use
// AVX512-BF16 / AMX where the CPU has them.
//
// The routines are MKL's, exported by the libtorch_cpu that the wheel links (found by CMake,
// CA_HAVE_MKL_GEMM); with a torch built without MKL they are ATen products on views of the same
// memory (the same results, with a dispatcher call per product).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace causal_attention::blas {

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha, const double* a, int64_t lda,
          const double* b, int64_t ldb, double beta, double* c, int64_t ldc);
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const c10::BFloat16* a,
          int64_t lda, const c10::BFloat16* b, int64_t ldb, float beta, float* c, int64_t ldc);
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const c10::Half* a, int64_t lda,
          const c10::Half* b, int64_t ldb, float beta, float* c, int64_t ldc);

// The same products as ATen calls on views of the same memory: gemm's path where torch has no MKL,
// always built so that the tests check it against the MKL path.
namespace aten {
// Instantiated for (T, S, C) = (float, float, float), (double, double, double), (BFloat16, float, float)
// and (Half, float, float): the overloads of gemm above.
template <typename T, typename S, typename C>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, S alpha, const T* a, int64_t lda, const T* b,
          int64_t ldb, S beta, C* c, int64_t ldc);
}  // namespace aten

// "MKL" when the products call MKL directly, else "ATen".
const char* gemm_backend();

}  // namespace causal_attention::blas
