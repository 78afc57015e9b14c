// trimul: the AlphaFold-3 triangle multiplicative update (outgoing or incoming), forward.
//
//   xn    = LayerNorm_C(x) * norm_weight + norm_bias
//   left  = (xn @ left_proj^T)  * mask * sigmoid(xn @ left_gate^T)            [B, N, N, H]
//   right = (xn @ right_proj^T) * mask * sigmoid(xn @ right_gate^T)
//   gate  = sigmoid(xn @ out_gate^T)
//   outgoing: p[b, i, j, d] = sum_k left[b, i, k, d] * right[b, j, k, d]
//   incoming: p[b, i, j, d] = sum_k left[b, k, i, d] * right[b, k, j, d]
//   out   = ((LayerNorm_H(p) * to_out_norm_weight + to_out_norm_bias) * gate) @ to_out^T
//
// Arguments (B >= 0, N >= 0, C >= 1, H >= 1):
//   out    [B, N, N, C]   x's dtype; the last axis contiguous, other strides any
//   x      [B, N, N, C]   float32, float16 or bfloat16; the last axis contiguous, other strides any
//   mask   [B, N, N] or none (an empty TensorView: no data, no dims): float32, float16, bfloat16,
//          bool or uint8; its value multiplies the row, as mask.to(float) would (normally 0
//          or 1; fractional values scale the row); any strides
//   weights: the module's parameters (names as in the reference PyTorch module), each float32 or
//          x's dtype, any strides:
//          norm_weight, norm_bias [C]; left_proj, right_proj, left_gate, right_gate, out_gate
//          [H, C]; to_out_norm_weight, to_out_norm_bias [H]; to_out [C, H]
// All tensors live on one device.
//
// Precision: on CUDA the five projections, the pairwise product and the output projection run on
// tensor cores with float16 operands and float32 accumulation (the weights are rounded to float16
// on each call; the LayerNorm statistics and every gate are float32). left, right and gate are
// kept in float16 between kernels, and p in float16 scaled by 1/N (LayerNorm_H is computed with
// eps / N^2, so the result is that of the unscaled p); values of left or right beyond about 250
// in magnitude may overflow float16. The CPU backend computes in float32 with double LayerNorm
// statistics.
// Aliasing: `out` must not overlap any input (checked).
// Determinism: bitwise deterministic for a given device, shape and layout.
// Temporary memory: on CUDA, four float16 [B, N, N, H] tensors (left, right, gate, p) and the
// weights in float16, stream-ordered on `stream` from fusekit's memory pool (cudaMallocAsync
// under graph capture).
// Stream: the CUDA work is enqueued on `stream` and never synchronises; the call can be captured
// in a CUDA graph. On the CPU the call returns when the result is written.
#pragma once

#include "fusekit/tensor.h"

namespace fusekit {

enum class TrimulDirection {
  Outgoing,  // p[i, j] = sum_k left[i, k] * right[j, k]
  Incoming,  // p[i, j] = sum_k left[k, i] * right[k, j]
};

/// The module's parameters; every one is required.
struct TrimulWeights {
  TensorView norm_weight, norm_bias;                            // [C]
  TensorView left_proj, right_proj, left_gate, right_gate, out_gate;  // [H, C]
  TensorView to_out_norm_weight, to_out_norm_bias;              // [H]
  TensorView to_out;                                            // [C, H]
};

struct TrimulOptions {
  TrimulDirection direction = TrimulDirection::Outgoing;
  double eps = 1e-5;  // of both LayerNorms
};

void trimul(const TensorView& out, const TensorView& x, const TensorView& mask,
            const TrimulWeights& weights, const TrimulOptions& options = {}, Stream stream = {});

}  // namespace fusekit
