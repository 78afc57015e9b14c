// The CPU backend of trimul, in float32 with double LayerNorm statistics (two passes), in three
// steps over float32 planes of B * N * N * H values each:
//   1. in blocks of rows: LayerNorm over C, one product with the five projections stacked into a
//      [5H, C] weight, then mask and sigmoid gates: left and right go to d-major planes
//      [B, H, N, N] (for incoming transposed, so that step 2 is the same product), gate to [M, H];
//   2. per (b, d): p = left_plane @ right_plane^T, written over left's plane;
//   3. in blocks of rows: p gathered back to rows, LayerNorm over H, times gate, one product with
//      to_out into `out`.
// Matrix products go through gemm_nt (a BLAS when the build has one), which runs its own threads,
// so it is always called from serial code; the element-wise loops run rows in parallel.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/cpu_gemm.h"
#include "common/dispatch.h"
#include "common/half.h"
#include "fusekit/error.h"
#include "ops/trimul/trimul_params.h"

namespace fusekit::detail {

namespace {

constexpr const char* kOp = "trimul";
constexpr std::int64_t kBlockRows = 256;
constexpr std::int64_t kMinParallelWork = 1 << 15;  // elements; below this threads cost more

// A weight as a row-major float32 [rows, cols]; a vector is [n, 1] (its stride is stride[0]).
std::vector<float> to_floats(const TrimulWeight& w, std::int64_t rows, std::int64_t cols) {
  std::vector<float> v(static_cast<std::size_t>(rows * cols));
  dispatch_floating(w.dtype, kOp, [&](auto tag) {
    using T = typename HostType<decltype(tag)::value>::type;
    const auto* src = static_cast<const T*>(w.data);
#pragma omp parallel for schedule(static) if (rows * cols > kMinParallelWork)
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t q = 0; q < cols; ++q) {
        v[r * cols + q] = to_float(src[r * w.stride[0] + q * w.stride[1]]);
      }
    }
  });
  return v;
}

// The mask as float32 [B, N, N] (all ones when there is none). bool counts as 0 or 1; the other
// dtypes by their value, so fractional values scale the row.
std::vector<float> mask_values(const TrimulParams& p) {
  const std::int64_t n = p.n, m = p.rows();
  std::vector<float> v(static_cast<std::size_t>(m), 1.0f);
  if (p.mask == nullptr) return v;
  auto read = [&](auto convert) {
#pragma omp parallel for schedule(static) if (m > kMinParallelWork)
    for (std::int64_t row = 0; row < m; ++row) {
      const std::int64_t b = row / (n * n), i = row / n % n, j = row % n;
      v[row] = convert(b * p.mask_stride[0] + i * p.mask_stride[1] + j * p.mask_stride[2]);
    }
  };
  switch (p.mask_dtype) {
    case DType::Bool: {
      const auto* mask = static_cast<const unsigned char*>(p.mask);
      read([&](std::int64_t at) { return mask[at] != 0 ? 1.0f : 0.0f; });
      return v;
    }
    case DType::UInt8: {
      const auto* mask = static_cast<const std::uint8_t*>(p.mask);
      read([&](std::int64_t at) { return static_cast<float>(mask[at]); });
      return v;
    }
    case DType::Float32:
    case DType::Float16:
    case DType::BFloat16:
      dispatch_floating(p.mask_dtype, kOp, [&](auto tag) {
        using T = typename HostType<decltype(tag)::value>::type;
        const auto* mask = static_cast<const T*>(p.mask);
        read([&](std::int64_t at) { return to_float(mask[at]); });
      });
      return v;
    default: break;
  }
  throw Error(concat(kOp, ": no CPU path for a mask of dtype ", to_string(p.mask_dtype)));
}

float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

// dst[q] = (src[q] - mean) / sqrt(var + eps) * weight[q] + bias[q] over `len` values, with the
// mean and variance in double (two passes, so that a large mean costs no precision).
void layer_norm(float* dst, const float* src, std::int64_t len, const float* weight,
                const float* bias, float eps) {
  double sum = 0.0;
  for (std::int64_t q = 0; q < len; ++q) sum += src[q];
  const double mean = sum / static_cast<double>(len);
  double sq = 0.0;
  for (std::int64_t q = 0; q < len; ++q) sq += (src[q] - mean) * (src[q] - mean);
  const double rstd = 1.0 / std::sqrt(sq / static_cast<double>(len) + eps);
  for (std::int64_t q = 0; q < len; ++q) {
    dst[q] = static_cast<float>((src[q] - mean) * rstd) * weight[q] + bias[q];
  }
}

template <typename T>
void run(const TrimulParams& p) {
  const std::int64_t n = p.n, c = p.c, h = p.h, m = p.rows(), plane = n * n;
  const bool incoming = p.direction == TrimulDirection::Incoming;

  // [5H, C] float32: the five projections stacked in TrimulProjection order
  std::vector<float> w5(static_cast<std::size_t>(kProjections * h * c));
  for (int k = 0; k < kProjections; ++k) {
    const std::vector<float> wk = to_floats(p.proj[k], h, c);
    std::copy(wk.begin(), wk.end(), w5.begin() + k * h * c);
  }
  const std::vector<float> norm_w = to_floats(p.norm_weight, c, 1);
  const std::vector<float> norm_b = to_floats(p.norm_bias, c, 1);
  const std::vector<float> out_norm_w = to_floats(p.to_out_norm_weight, h, 1);
  const std::vector<float> out_norm_b = to_floats(p.to_out_norm_bias, h, 1);
  const std::vector<float> w_out = to_floats(p.to_out, c, h);  // [C, H]
  const std::vector<float> mask = mask_values(p);              // [B, N, N]

  std::vector<float> left(static_cast<std::size_t>(m * h));   // [B, H, N, N]; p after step 2
  std::vector<float> right(static_cast<std::size_t>(m * h));  // [B, H, N, N]
  std::vector<float> gate(static_cast<std::size_t>(m * h));   // [M, H]

  const auto* x = static_cast<const T*>(p.x);
  auto* out = static_cast<T*>(p.out);
  const std::int64_t block = std::min(m, kBlockRows);
  std::vector<float> rows_c(static_cast<std::size_t>(block * c));                  // [rows, C]
  std::vector<float> rows_5h(static_cast<std::size_t>(block * kProjections * h));  // [rows, 5H]
  std::vector<float> rows_h(static_cast<std::size_t>(block * h));                  // [rows, H]

  // ---- 1. LayerNorm over C, projections, mask and gates
  for (std::int64_t r0 = 0; r0 < m; r0 += block) {
    const std::int64_t rows = std::min(block, m - r0);
#pragma omp parallel for schedule(static) if (rows * c > kMinParallelWork)
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t row = r0 + r, b = row / plane, i = row / n % n, j = row % n;
      const T* xr = x + b * p.x_stride[0] + i * p.x_stride[1] + j * p.x_stride[2];
      float* xn = rows_c.data() + r * c;
      for (std::int64_t q = 0; q < c; ++q) xn[q] = to_float(xr[q]);
      layer_norm(xn, xn, c, norm_w.data(), norm_b.data(), p.eps);
    }
    gemm_nt(rows, kProjections * h, c, rows_c.data(), c, w5.data(), c, rows_5h.data(),
            kProjections * h);
#pragma omp parallel for schedule(static) if (rows * h > kMinParallelWork)
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t row = r0 + r, b = row / plane, i = row / n % n, j = row % n;
      const float* y = rows_5h.data() + r * kProjections * h;
      // where (b, i, j) sits in a plane: [i, j], or [j, i] for incoming
      const std::int64_t at = b * h * plane + (incoming ? j * n + i : i * n + j);
      for (std::int64_t d = 0; d < h; ++d) {
        left[at + d * plane] = y[kLeftProj * h + d] * mask[row] * sigmoid(y[kLeftGate * h + d]);
        right[at + d * plane] = y[kRightProj * h + d] * mask[row] * sigmoid(y[kRightGate * h + d]);
        gate[row * h + d] = sigmoid(y[kOutGate * h + d]);
      }
    }
  }

  // ---- 2. p[b, d] = left[b, d] @ right[b, d]^T, over left's plane once it is read
  std::vector<float> product(static_cast<std::size_t>(plane));  // [N, N]
  for (std::int64_t bd = 0; bd < p.b * h; ++bd) {
    float* l = left.data() + bd * plane;
    gemm_nt(n, n, n, l, n, right.data() + bd * plane, n, product.data(), n);
    std::copy(product.begin(), product.end(), l);
  }
  const std::vector<float>& pair = left;  // [B, H, N, N], plane [i, j] in both directions

  // ---- 3. LayerNorm over H, gate, output projection
  for (std::int64_t r0 = 0; r0 < m; r0 += block) {
    const std::int64_t rows = std::min(block, m - r0);
#pragma omp parallel for schedule(static) if (rows * h > kMinParallelWork)
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t row = r0 + r, b = row / plane;
      const float* pr = pair.data() + b * h * plane + row % plane;  // d at stride `plane`
      float* dst = rows_h.data() + r * h;
      for (std::int64_t d = 0; d < h; ++d) dst[d] = pr[d * plane];
      layer_norm(dst, dst, h, out_norm_w.data(), out_norm_b.data(), p.eps);
      for (std::int64_t d = 0; d < h; ++d) dst[d] *= gate[row * h + d];
    }
    gemm_nt(rows, c, h, rows_h.data(), h, w_out.data(), h, rows_c.data(), c);
#pragma omp parallel for schedule(static) if (rows * c > kMinParallelWork)
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t row = r0 + r, b = row / plane, i = row / n % n, j = row % n;
      T* dst = out + b * p.out_stride[0] + i * p.out_stride[1] + j * p.out_stride[2];
      const float* src = rows_c.data() + r * c;
      for (std::int64_t q = 0; q < c; ++q) dst[q] = from_float<T>(src[q]);
    }
  }
}

}  // namespace

void trimul_cpu(const TrimulParams& p) {
  dispatch_floating(p.dtype, kOp, [&](auto tag) {
    run<typename HostType<decltype(tag)::value>::type>(p);
  });
}

}  // namespace fusekit::detail
