// mhc_post: the post mix of mHC hyper-connections.
//
//   out[n, i, h] = post_layer_mix[n, i] * x[n, h] + sum_j comb_res_mix[n, j, i] * residual[n, j, h]
//
// Arguments (N rows, hc streams with 1 <= hc <= 8, hidden size H; any N >= 0 and H >= 0):
//   out             [N, hc, H]               float32, float16 or bfloat16 (x's dtype)
//   x               [N, H]                   float32, float16 or bfloat16
//   residual        [N, hc, H]               x's dtype
//   post_layer_mix  [N, hc] or [N, hc, 1]    float32
//   comb_res_mix    [N, hc, hc]              float32, indexed [n, j, i] (the transpose is applied)
// All tensors live on one device. Any strides are accepted; the CUDA backend takes 16-byte vector
// loads and stores only when every H-axis is contiguous and every row start is 16-byte aligned,
// and an element-wise path otherwise.
//
// Precision: products and sums in float32, one rounding to the output dtype at the end.
// Aliasing: the memory span of `out` must not intersect that of any input (checked; an Error
// says which), so in-place use is not supported.
// Determinism: bitwise deterministic; no atomics.
// Temporary memory: none.
// Stream: the CUDA work is enqueued on `stream`; nothing synchronises, so the call can be
// captured in a CUDA graph. On the CPU the call returns when the result is written.
#pragma once

#include "fusekit/tensor.h"

namespace fusekit {

void mhc_post(const TensorView& out, const TensorView& x, const TensorView& residual,
              const TensorView& post_layer_mix, const TensorView& comb_res_mix, Stream stream = {});

// mhc_post_backward: the gradients of mhc_post, given grad_out = dL/d out.
//
//   grad_x[n, h]              = sum_i post_layer_mix[n, i] * grad_out[n, i, h]
//   grad_residual[n, j, h]    = sum_i comb_res_mix[n, j, i] * grad_out[n, i, h]
//   grad_post_layer_mix[n, i] = sum_h grad_out[n, i, h] * x[n, h]
//   grad_comb_res_mix[n, j, i] = sum_h residual[n, j, h] * grad_out[n, i, h]
//
// Arguments: grad_x [N, H] and grad_residual [N, hc, H] in x's dtype; grad_post_layer_mix in
// post_layer_mix's shape ([N, hc] or [N, hc, 1]) and grad_comb_res_mix [N, hc, hc], both float32;
// grad_out [N, hc, H] in x's dtype; the inputs as for mhc_post. With H = 0 the sums are 0.
//
// Precision: float32 products and sums. The reductions over H are done in a fixed order, so the
// result is bitwise deterministic for a given device, shape and stride pattern.
// Aliasing: no output may overlap an input or another output.
// Temporary memory: on CUDA, when H is split across blocks, N * chunks * (hc + hc * hc) floats,
// taken with cudaMallocAsync on `stream` and returned on it.
void mhc_post_backward(const TensorView& grad_x, const TensorView& grad_residual,
                       const TensorView& grad_post_layer_mix, const TensorView& grad_comb_res_mix,
                       const TensorView& grad_out, const TensorView& x, const TensorView& residual,
                       const TensorView& post_layer_mix, const TensorView& comb_res_mix,
                       Stream stream = {});

}  // namespace fusekit
