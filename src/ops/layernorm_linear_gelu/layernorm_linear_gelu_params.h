// What the layernorm_linear_gelu backends see: pointers, sizes, strides (in elements), options.
#pragma once

#include <cstdint>

#include "fusekit/ops/layernorm_linear_gelu.h"
#include "fusekit/tensor.h"

namespace fusekit::detail {

struct LayerNormLinearGeluParams {
  std::int64_t m = 0, k = 0, nout = 0;
  DType dtype = DType::Float32;  // of x, weight, bias and out
  Device device = Device::cpu();  // of every tensor

  // x [..., K]: row r sits at the offset given by its leading-dims index (row-major order).
  const void* x = nullptr;
  int x_lead_ndim = 0;
  std::int64_t x_lead_shape[kMaxDims] = {};
  std::int64_t x_lead_stride[kMaxDims] = {};
  std::int64_t x_k_stride = 1;
  std::int64_t x_row_stride = -1;  // when the leading dims collapse to one, else -1

  // weight [Nout, K]: w_stride_k == 1 (row-major) or w_stride_n == 1 (transposed row-major).
  const void* weight = nullptr;
  std::int64_t w_stride_n = 0, w_stride_k = 0;
  const void* bias = nullptr;  // [Nout], contiguous, or null

  const void* ln_weight = nullptr;  // [K] or null
  std::int64_t ln_weight_stride = 0;
  DType ln_weight_dtype = DType::Float32;
  const void* ln_bias = nullptr;  // [K] or null
  std::int64_t ln_bias_stride = 0;
  DType ln_bias_dtype = DType::Float32;

  void* out = nullptr;  // [M, Nout] rows out_row_stride apart, last axis contiguous
  std::int64_t out_row_stride = 0;

  float eps = 1e-5f;
  GeluApproximation approximate = GeluApproximation::Tanh;
  bool allow_tf32 = true;

  // The CUDA backend's matrix product: its own choice (Auto), or one named for a benchmark or a
  // test (an error where it does not fit the call).
  enum class Product { Auto, Library, FewRows, Warpgroup } product = Product::Auto;

  /// Element offset of row r of x.
  std::int64_t x_row_offset(std::int64_t r) const {
    std::int64_t offset = 0;
    for (int d = x_lead_ndim - 1; d >= 0; --d) {
      offset += (r % x_lead_shape[d]) * x_lead_stride[d];
      r /= x_lead_shape[d];
    }
    return offset;
  }
};

/// Validates a call (as fusekit::layernorm_linear_gelu does) and describes it; m == 0 or
/// nout == 0 means there is nothing to compute.
LayerNormLinearGeluParams layernorm_linear_gelu_params(const TensorView& out, const TensorView& x,
                                                       const TensorView& weight,
                                                       const TensorView& bias,
                                                       const TensorView& ln_weight,
                                                       const TensorView& ln_bias,
                                                       const LayerNormLinearGeluOptions& options);
void layernorm_linear_gelu_cpu(const LayerNormLinearGeluParams& p);
void launch_layernorm_linear_gelu(const LayerNormLinearGeluParams& p, int device, Stream stream);

}  // namespace fusekit::detail
