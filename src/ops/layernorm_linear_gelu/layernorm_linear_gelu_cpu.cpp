// The CPU backend of layernorm_linear_gelu, in blocks of rows: LayerNorm into a float32 block
// (statistics in double, two passes), one BLAS product with the float32 weight, then bias and GELU
// row by row into `out`.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/cpu_gemm.h"
#include "common/dispatch.h"
#include "common/half.h"
#include "ops/layernorm_linear_gelu/layernorm_linear_gelu_params.h"

namespace fusekit::detail {

namespace {

constexpr std::int64_t kBlockRows = 256;
constexpr std::int64_t kMinParallelWork = 1 << 15;  // elements; below this threads cost more

// n elements of a strided vector of `dtype` as float32.
std::vector<float> to_floats(const void* data, DType dtype, std::int64_t n, std::int64_t stride) {
  std::vector<float> v(static_cast<std::size_t>(n));
  dispatch_floating(dtype, "layernorm_linear_gelu", [&](auto tag) {
    using T = typename HostType<decltype(tag)::value>::type;
    const auto* src = static_cast<const T*>(data);
#pragma omp parallel for schedule(static) if (n > kMinParallelWork)
    for (std::int64_t i = 0; i < n; ++i) v[i] = to_float(src[i * stride]);
  });
  return v;
}

// Without 1 + tanh or 1 + erf, which cancel for negative v (as the CUDA backend's gelu).
float gelu(float v, GeluApproximation approximate) {
  switch (approximate) {
    case GeluApproximation::Tanh:
      return v / (1.0f + std::exp(-2.0f * 0.7978845608028654f * (v + 0.044715f * v * v * v)));
    case GeluApproximation::None:
      return 0.5f * v * std::erfc(-v * 0.7071067811865476f);
  }
  return v;  // unreachable: the options are checked
}

template <typename T>
void run(const LayerNormLinearGeluParams& p) {
  const std::int64_t m = p.m, k = p.k, nout = p.nout;
  // weight as a row-major float32 [Nout, K]
  std::vector<float> w(static_cast<std::size_t>(nout * k));
  const auto* wsrc = static_cast<const T*>(p.weight);
#pragma omp parallel for schedule(static) if (nout * k > kMinParallelWork)
  for (std::int64_t j = 0; j < nout; ++j) {
    for (std::int64_t q = 0; q < k; ++q) w[j * k + q] = to_float(wsrc[j * p.w_stride_n + q * p.w_stride_k]);
  }
  const std::vector<float> bias = p.bias ? to_floats(p.bias, p.dtype, nout, 1) : std::vector<float>();
  const std::vector<float> ln_w =
      p.ln_weight ? to_floats(p.ln_weight, p.ln_weight_dtype, k, p.ln_weight_stride) : std::vector<float>();
  const std::vector<float> ln_b =
      p.ln_bias ? to_floats(p.ln_bias, p.ln_bias_dtype, k, p.ln_bias_stride) : std::vector<float>();

  const auto* x = static_cast<const T*>(p.x);
  auto* out = static_cast<T*>(p.out);
  const std::int64_t block = std::min(m, kBlockRows);
  std::vector<float> xn(static_cast<std::size_t>(block * k));  // [rows, K] normalised rows
  std::vector<float> y(static_cast<std::size_t>(block * nout));  // [rows, Nout] products

  for (std::int64_t r0 = 0; r0 < m; r0 += block) {
    const std::int64_t rows = std::min(block, m - r0);
#pragma omp parallel for schedule(static) if (rows * k > kMinParallelWork)
    for (std::int64_t i = 0; i < rows; ++i) {
      const T* xr = x + p.x_row_offset(r0 + i);
      float* dst = xn.data() + i * k;
      double sum = 0.0;
      for (std::int64_t q = 0; q < k; ++q) {
        dst[q] = to_float(xr[q * p.x_k_stride]);
        sum += dst[q];
      }
      const double mean = sum / static_cast<double>(k);
      double sq = 0.0;
      for (std::int64_t q = 0; q < k; ++q) sq += (dst[q] - mean) * (dst[q] - mean);
      const double rstd = 1.0 / std::sqrt(sq / static_cast<double>(k) + p.eps);
      for (std::int64_t q = 0; q < k; ++q) {
        float v = static_cast<float>((dst[q] - mean) * rstd);
        if (p.ln_weight) v *= ln_w[q];
        if (p.ln_bias) v += ln_b[q];
        dst[q] = v;
      }
    }
    gemm_nt(rows, nout, k, xn.data(), k, w.data(), k, y.data(), nout);
#pragma omp parallel for schedule(static) if (rows * nout > kMinParallelWork)
    for (std::int64_t i = 0; i < rows; ++i) {
      T* dst = out + (r0 + i) * p.out_row_stride;
      const float* src = y.data() + i * nout;
      for (std::int64_t j = 0; j < nout; ++j) {
        const float v = p.bias ? src[j] + bias[j] : src[j];
        dst[j] = from_float<T>(gelu(v, p.approximate));
      }
    }
  }
}

}  // namespace

void layernorm_linear_gelu_cpu(const LayerNormLinearGeluParams& p) {
  dispatch_floating(p.dtype, "layernorm_linear_gelu", [&](auto tag) {
    run<typename HostType<decltype(tag)::value>::type>(p);
  });
}

}  // namespace fusekit::detail
