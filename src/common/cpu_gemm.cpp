#include "common/cpu_gemm.h"

#include <algorithm>
#include <climits>

#ifdef FUSEKIT_WITH_BLAS
#include <cblas.h>
#endif

namespace fusekit::detail {

void gemm_nt_loops(std::int64_t m, std::int64_t n, std::int64_t k, const float* a,
                   std::int64_t lda, const float* b, std::int64_t ldb, float* c, std::int64_t ldc) {
  // Tiles of kRows x kCols outputs: the kCols rows of B stay in cache while kRows rows of A pass.
  constexpr std::int64_t kRows = 16, kCols = 64;
  const std::int64_t row_tiles = (m + kRows - 1) / kRows, col_tiles = (n + kCols - 1) / kCols;
#pragma omp parallel for schedule(static) if (m * n * k > (1 << 18))
  for (std::int64_t tile = 0; tile < row_tiles * col_tiles; ++tile) {
    const std::int64_t i0 = (tile / col_tiles) * kRows, j0 = (tile % col_tiles) * kCols;
    const std::int64_t i1 = std::min(m, i0 + kRows), j1 = std::min(n, j0 + kCols);
    for (std::int64_t i = i0; i < i1; ++i) {
      const float* ai = a + i * lda;
      for (std::int64_t j = j0; j < j1; ++j) {
        const float* bj = b + j * ldb;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (std::int64_t q = 0; q < k; ++q) sum += ai[q] * bj[q];
        c[i * ldc + j] = sum;
      }
    }
  }
}

void gemm_nt(std::int64_t m, std::int64_t n, std::int64_t k, const float* a, std::int64_t lda,
             const float* b, std::int64_t ldb, float* c, std::int64_t ldc) {
#ifdef FUSEKIT_WITH_BLAS
  const std::int64_t largest = std::max({m, n, k, lda, ldb, ldc});
  if (largest <= INT_MAX) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), static_cast<int>(n),
                static_cast<int>(k), 1.0f, a, static_cast<int>(lda), b, static_cast<int>(ldb), 0.0f,
                c, static_cast<int>(ldc));
    return;
  }
#endif
  gemm_nt_loops(m, n, k, a, lda, b, ldb, c, ldc);
}

bool gemm_uses_blas() {
#ifdef FUSEKIT_WITH_BLAS
  return true;
#else
  return false;
#endif
}

}  // namespace fusekit::detail
