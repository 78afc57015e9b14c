// float64 evaluation of trimul straight from the formula: what the tests and `fusekit check`
// compare the backends against. x is [B, N, N, C]; mask [B, N, N] is used when it has values
// (else all ones); the weights have the shapes of TrimulWeights. Also the upload of a mask in any
// of the dtypes trimul takes (testing::upload stores floating dtypes only).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "fusekit/ops/trimul.h"
#include "testing/host_tensor.h"

namespace fusekit::testing {

/// The module's parameters as float64 host tensors (see TrimulWeights for the shapes).
struct TrimulHostWeights {
  HostTensor norm_weight, norm_bias;                                  // [C]
  HostTensor left_proj, right_proj, left_gate, right_gate, out_gate;  // [H, C]
  HostTensor to_out_norm_weight, to_out_norm_bias;                    // [H]
  HostTensor to_out;                                                  // [C, H]
};

namespace trimul_detail {

inline double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

// dst = LayerNorm(src) * weight + bias over `len` values (two passes).
inline void layer_norm(double* dst, const double* src, std::int64_t len, const double* weight,
                       const double* bias, double eps) {
  double mean = 0, var = 0;
  for (std::int64_t q = 0; q < len; ++q) mean += src[q];
  mean /= static_cast<double>(len);
  for (std::int64_t q = 0; q < len; ++q) var += (src[q] - mean) * (src[q] - mean);
  var /= static_cast<double>(len);
  const double rstd = 1.0 / std::sqrt(var + eps);
  for (std::int64_t q = 0; q < len; ++q) dst[q] = (src[q] - mean) * rstd * weight[q] + bias[q];
}

// row . weight[d] for a [H, C] weight.
inline double dot_row(const double* row, const HostTensor& weight, std::int64_t d, std::int64_t c) {
  double acc = 0;
  for (std::int64_t q = 0; q < c; ++q) acc += row[q] * weight.values[d * c + q];
  return acc;
}

}  // namespace trimul_detail

inline HostTensor trimul_reference(const HostTensor& x, const HostTensor& mask,
                                   const TrimulHostWeights& w, TrimulDirection direction,
                                   double eps = 1e-5) {
  using trimul_detail::sigmoid;
  const std::int64_t b_size = x.shape[0], n = x.shape[1], c = x.shape[3];
  const std::int64_t h = w.left_proj.shape[0], m = b_size * n * n;
  // left, right, gate: [B, N, N, H]
  std::vector<double> left(static_cast<std::size_t>(m * h)), right(left.size()), gate(left.size());
  std::vector<double> xn(static_cast<std::size_t>(c));  // [C] the normalised row
#pragma omp parallel for schedule(static) firstprivate(xn)
  for (std::int64_t row = 0; row < m; ++row) {
    trimul_detail::layer_norm(xn.data(), x.values.data() + row * c, c, w.norm_weight.values.data(),
                              w.norm_bias.values.data(), eps);
    const double mk = mask.numel() ? mask.values[row] : 1.0;
    const double* r = xn.data();
    for (std::int64_t d = 0; d < h; ++d) {
      left[row * h + d] = trimul_detail::dot_row(r, w.left_proj, d, c) * mk *
                          sigmoid(trimul_detail::dot_row(r, w.left_gate, d, c));
      right[row * h + d] = trimul_detail::dot_row(r, w.right_proj, d, c) * mk *
                           sigmoid(trimul_detail::dot_row(r, w.right_gate, d, c));
      gate[row * h + d] = sigmoid(trimul_detail::dot_row(r, w.out_gate, d, c));
    }
  }

  HostTensor out({b_size, n, n, c});
  std::vector<double> pair(static_cast<std::size_t>(h)), normed(pair.size());  // [H] of one (i, j)
#pragma omp parallel for schedule(static) collapse(2) firstprivate(pair, normed)
  for (std::int64_t b = 0; b < b_size; ++b) {
    for (std::int64_t i = 0; i < n; ++i) {
      for (std::int64_t j = 0; j < n; ++j) {
        // outgoing: p[i, j] = sum_k left[i, k] * right[j, k]
        // incoming: p[i, j] = sum_k left[k, i] * right[k, j]
        std::fill(pair.begin(), pair.end(), 0.0);
        for (std::int64_t k = 0; k < n; ++k) {
          const bool outgoing = direction == TrimulDirection::Outgoing;
          const std::int64_t l_row = outgoing ? (b * n + i) * n + k : (b * n + k) * n + i;
          const std::int64_t r_row = outgoing ? (b * n + j) * n + k : (b * n + k) * n + j;
          for (std::int64_t d = 0; d < h; ++d) {
            pair[d] += left[l_row * h + d] * right[r_row * h + d];
          }
        }
        const std::int64_t row = (b * n + i) * n + j;
        trimul_detail::layer_norm(normed.data(), pair.data(), h, w.to_out_norm_weight.values.data(),
                                  w.to_out_norm_bias.values.data(), eps);
        for (std::int64_t d = 0; d < h; ++d) normed[d] *= gate[row * h + d];
        for (std::int64_t q = 0; q < c; ++q) {
          out.values[row * c + q] = trimul_detail::dot_row(normed.data(), w.to_out, q, h);
        }
      }
    }
  }
  return out;
}

/// `mask` [B, N, N] (values 0 or 1 for bool and uint8) in `dtype`, laid out as `layout` on
/// `device`; unused bytes are 0xff, as upload leaves them.
inline DeviceTensor upload_trimul_mask(const HostTensor& mask, DType dtype, Device device,
                                       const Layout& layout = {}) {
  if (dtype != DType::Bool && dtype != DType::UInt8) return upload(mask, dtype, device, layout);
  // The layout's strides and extent, from a float32 copy on the host; then one byte per element.
  const DeviceTensor f32 = upload(mask, DType::Float32, Device::cpu(), layout);
  const std::int64_t extent = static_cast<std::int64_t>(f32.buffer.bytes() / sizeof(float));
  const std::int64_t base = layout.offset_elements;
  std::vector<unsigned char> bytes(static_cast<std::size_t>(extent), 0xff);
  const std::int64_t n0 = mask.shape[0], n1 = mask.shape[1], n2 = mask.shape[2];
  for (std::int64_t i = 0; i < n0; ++i) {
    for (std::int64_t j = 0; j < n1; ++j) {
      for (std::int64_t k = 0; k < n2; ++k) {
        const double v = mask.at({i, j, k});
        const std::int64_t at =
            base + i * f32.view.strides[0] + j * f32.view.strides[1] + k * f32.view.strides[2];
        bytes[at] = dtype == DType::Bool ? (v != 0 ? 1 : 0) : static_cast<unsigned char>(v);
      }
    }
  }
  DeviceTensor out;
  out.buffer = detail::Buffer(device, bytes.size());
  if (!bytes.empty()) out.buffer.copy_from_host(bytes.data(), bytes.size());
  char* data = extent ? static_cast<char*>(out.buffer.data()) + base : nullptr;
  out.view = TensorView::from_arrays(data, dtype, 3, mask.shape.data(), f32.view.strides.data(),
                                     device);
  return out;
}

}  // namespace fusekit::testing
