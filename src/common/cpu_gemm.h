// The CPU backend's matrix product: C = A B^T in float32, through a BLAS when the build found one
// (FUSEKIT_WITH_BLAS), else through OpenMP loops.
#pragma once

#include <cstdint>

namespace fusekit::detail {

/// C[m, n] = sum_k A[m, k] * B[n, k]: row-major operands with leading dimensions lda, ldb, ldc.
void gemm_nt(std::int64_t m, std::int64_t n, std::int64_t k, const float* a, std::int64_t lda,
             const float* b, std::int64_t ldb, float* c, std::int64_t ldc);

/// The same product without a BLAS (what gemm_nt falls back to); always available, for tests.
void gemm_nt_loops(std::int64_t m, std::int64_t n, std::int64_t k, const float* a,
                   std::int64_t lda, const float* b, std::int64_t ldb, float* c, std::int64_t ldc);

/// Whether gemm_nt calls a BLAS.
bool gemm_uses_blas();

}  // namespace fusekit::detail
