// layernorm_linear_gelu: LayerNorm over the last axis, then a Linear layer, then GELU.
//
//   xn  = (x - mean(x)) / sqrt(var(x) + eps)       over K, biased variance
//   xn  = xn * ln_weight + ln_bias                 each only when given
//   out = GELU(xn @ weight^T + bias)               bias only when given
//
// Arguments (M rows = the product of x's leading dims, any M >= 0, K >= 1, Nout >= 0):
//   out        [..., Nout]   x's dtype; the last axis contiguous and the rows a uniform stride
//                            apart (any leading dims whose strides collapse to one row stride)
//   x          [..., K]      float32, float16 or bfloat16; any strides
//   weight     [Nout, K]     x's dtype (torch Linear layout); one of its axes contiguous: a
//                            row-major [Nout, K] or the transpose of a row-major [K, Nout]
//   bias       [Nout] or none (an empty TensorView: no data, no dims); x's dtype, contiguous
//   ln_weight  [K] or none   x's dtype or float32; any stride
//   ln_bias    [K] or none   x's dtype or float32; any stride
// All tensors live on one device.
//
// Precision: the statistics are computed in float32 in two passes over x - x[0] (the mean, then
// the mean squared deviation), so a mean far from 0 does not cancel digits of the variance. The
// normalised rows are rounded once to x's dtype (as an unfused LayerNorm's output would be),
// multiplied with float32 accumulation, and the bias and GELU are applied in float32 before the
// one rounding of the output. float32 inputs use TF32 tensor cores unless `allow_tf32` is false.
// With half precision and with TF32, the tanh GELU is the matrix product's own epilogue, whose
// tanh is a fast approximation (relative error near 2^-11); the exact float32 path and the erf
// GELU apply GELU in a separate pass with full float32 functions (for half precision the erf
// GELU then reads the pre-activation back rounded to x's dtype). With at most 64 rows of
// float16 or bfloat16, a row-major weight and K a multiple of 8 (16-byte aligned weight rows),
// fusekit's own kernel takes the product (on warpgroup MMAs on compute capability 9.0 with an
// sm_90a build), with the bias and either GELU in float32 in its epilogue; it has no algorithm to
// choose and no workspace. The CPU backend computes in float32 with double statistics and keeps
// the normalised rows in float32.
// Aliasing: `out` must not overlap any input (checked).
// Determinism: bitwise deterministic within a process for a given device, shape, layout and
// alignment. On CUDA, the first call for a shape (outside graph capture) times the matrix
// product's candidate algorithms on the real operands, synchronising the stream once, and keeps
// the fastest; another process may settle on another algorithm.
// Temporary memory: on CUDA, the normalised rows (M * K elements of x's dtype, rows padded to 16
// bytes) and the matrix product's workspace (at most 32 MiB), stream-ordered on `stream` from
// fusekit's memory pool (cudaMallocAsync under graph capture).
// Stream: the CUDA work is enqueued on `stream`; nothing synchronises after the first call for a
// shape, and the call can be captured in a CUDA graph. On the CPU the call returns when the
// result is written.
#pragma once

#include "fusekit/tensor.h"

namespace fusekit {

enum class GeluApproximation {
  Tanh,  // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), the default (torch "tanh")
  None,  // exact: 0.5 x (1 + erf(x / sqrt(2)))                         (torch "none")
};

struct LayerNormLinearGeluOptions {
  double eps = 1e-5;
  GeluApproximation approximate = GeluApproximation::Tanh;
  /// float32 inputs: allow TF32 tensor cores for the matrix product (10-bit mantissa operands,
  /// float32 accumulation). false keeps full float32 products. Ignored for half precision.
  bool allow_tf32 = true;
};

void layernorm_linear_gelu(const TensorView& out, const TensorView& x, const TensorView& weight,
                           const TensorView& bias = {}, const TensorView& ln_weight = {},
                           const TensorView& ln_bias = {},
                           const LayerNormLinearGeluOptions& options = {}, Stream stream = {});

}  // namespace fusekit
