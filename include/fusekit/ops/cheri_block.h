// cheri_block: the Cheri block of a genomics sequence-to-function model (a ConvNeXt-style block),
// forward for training and inference, and backward; and its first half, dilated_conv_norm.
//
//   conv[n, l, c] = w[0, c] x[n, l - d, c] + w[1, c] x[n, l, c] + w[2, c] x[n, l + d, c]
//                   (x is zero outside 0 <= l < L; d is the dilation)
//   y[n]  = (conv[n] - mean_n) * rstd_n,   mean_n, var_n over the whole (L, C) plane of example n
//           (biased variance), rstd_n = 1 / sqrt(var_n + eps)
//   h     = y @ linear1_weight^T                                  [N, L, E C]
//   out   = x + residual_scale * GELU_tanh(h) @ linear2_weight^T   [N, L, C]   (no biases)
//
// Arguments (N >= 0, L >= 1, C >= 1, d >= 1, d >= L included; E C >= 1):
//   x, out, y and the gradients of x, y and out: [N, L, C], float32, float16 or bfloat16 (all of
//   x's dtype); the last axis contiguous, other strides any
//   conv_weight [3, C], linear1_weight [E C, C], linear2_weight [C, E C]: float32 or x's dtype,
//   any strides; their gradients have the weight's shape and dtype
//   mean, rstd [N]: float32 (what the training forward keeps for the backward)
// All tensors live on one device. N = 0: the forwards write nothing; the backwards write zero
// weight gradients (sums over no examples).
//
// Precision: statistics in float32 from two passes (the mean, then squared deviations), never
// E[y^2] - mean^2. The training path's two products use TF32 tensor cores for float32 inputs when
// `allow_tf32` (as the model trains); false keeps full float32 products. The inference path may
// run its products in half precision (see the backends), and so may the float32 training forward
// with `allow_tf32` (float16 operands keep TF32's 10 bits of mantissa); the float32 backward with
// `allow_tf32` on sm_90a (C of 64 or 128, E = 2) carries its intermediates (y, grad_out, GELU(h)
// and its gradient) in float16, each row scaled by its own power of two, for the same reason. The
// CPU backend computes in float32 with double statistics.
// Determinism: every output and gradient is bitwise the same on every run, the first included:
// the reductions over N and L (the weight gradients, the statistics) run in a fixed order (on
// CUDA, one set by the shape and the device's number of multiprocessors).
// Temporary memory (CUDA, stream-ordered): dilated_conv_norm and the inference forward a few
// bytes per example and the packed weights (so does the training forward where it takes the
// fused kernel, below); else the training forward about (C + E C) N L float32 values; the
// backward about (C + 2 E C) N L float32 values (one C more for half precision or strided
// grad_out) plus one [E C, C] float32 partial per 4096 rows for each linear weight gradient, or,
// where it keeps float16 intermediates (above), (2 C + 2 E C) N L float16 (C fewer when it reads
// the forward's saved rows) and (C + 5) N L 4-byte values plus two [E C, C] float32 partials per
// multiprocessor. The saved rows themselves (cheri_block_saved_bytes) are the caller's.
// The inference forward on CUDA runs its products on float16 operands with float32 accumulation
// in one fused kernel where C is 64 or 128 (E C a multiple of 64, rows of x and out 16-byte
// aligned), on warpgroup MMAs on compute capability 9.0 with a build for sm_90a; other shapes take
// the training forward's products. The float32 training forward with `allow_tf32` takes the same
// kernel where it applies.
// Aliasing: no output may overlap an input or another output (checked).
// Stream: CUDA work is enqueued on `stream` without synchronising; calls can be captured in CUDA
// graphs. On the CPU a call returns when its results are written.
#pragma once

#include <cstdint>

#include "fusekit/tensor.h"

namespace fusekit {

struct DilatedConvNormOptions {
  std::int64_t dilation = 1;
  double eps = 1e-3;
};

/// y = the normalised dilated convolution of x; mean and rstd [N] float32 (each optional: an
/// empty TensorView skips it).
void dilated_conv_norm(const TensorView& y, const TensorView& mean, const TensorView& rstd,
                       const TensorView& x, const TensorView& conv_weight,
                       const DilatedConvNormOptions& options = {}, Stream stream = {});

/// Gradients of dilated_conv_norm given grad_y and the forward's mean and rstd.
void dilated_conv_norm_backward(const TensorView& grad_x, const TensorView& grad_conv_weight,
                                const TensorView& grad_y, const TensorView& x,
                                const TensorView& conv_weight, const TensorView& mean,
                                const TensorView& rstd, const DilatedConvNormOptions& options = {},
                                Stream stream = {});

/// The block's parameters (or, for the backward's outputs, their gradients).
struct CheriBlockWeights {
  TensorView conv_weight;     // [3, C]
  TensorView linear1_weight;  // [E C, C]
  TensorView linear2_weight;  // [C, E C]
};

struct CheriBlockOptions {
  std::int64_t dilation = 1;
  double residual_scale = 0.15;
  double eps = 1e-3;
  /// float32 inputs: TF32 tensor cores for the two products of the training path.
  bool allow_tf32 = true;
};

/// The training forward: out, and the per-example mean and rstd [N] float32 the backward needs.
void cheri_block(const TensorView& out, const TensorView& mean, const TensorView& rstd,
                 const TensorView& x, const CheriBlockWeights& weights,
                 const CheriBlockOptions& options = {}, Stream stream = {});

/// The size in bytes of what the training forward can keep for the backward besides mean and
/// rstd, so that the backward need not recompute it: the normalised rows y in float16, in an
/// order of the backward's own (N L C 2 bytes). 0 where the backward would not read them: it
/// does on CUDA for float32 x with allow_tf32 at C of 64 or 128 and E = 2, on compute capability
/// 9.0 with an sm_90a build. Only the shapes, dtype and device of x and the weights and the
/// options are read (their data may be null).
std::int64_t cheri_block_saved_bytes(const TensorView& x, const CheriBlockWeights& weights,
                                     const CheriBlockOptions& options = {});

/// The training forward, which also writes `saved`: uint8 [cheri_block_saved_bytes(x, weights,
/// options)] on x's device, contiguous and 16-byte aligned (an empty view: nothing kept, as in
/// the overload above).
void cheri_block(const TensorView& out, const TensorView& mean, const TensorView& rstd,
                 const TensorView& saved, const TensorView& x, const CheriBlockWeights& weights,
                 const CheriBlockOptions& options = {}, Stream stream = {});

/// The backward of the training forward: grad_x and the three weight gradients (`grads`), from
/// grad_out, the inputs and the forward's mean and rstd (everything else is recomputed).
void cheri_block_backward(const TensorView& grad_x, const CheriBlockWeights& grads,
                          const TensorView& grad_out, const TensorView& x,
                          const CheriBlockWeights& weights, const TensorView& mean,
                          const TensorView& rstd, const CheriBlockOptions& options = {},
                          Stream stream = {});

/// The backward that reads what the forward kept in `saved` (written by the forward with the
/// same x, weights and options) instead of recomputing it; an empty view recomputes, as the
/// overload above. The gradients may differ from the recomputing backward's in the last bits
/// (y rounded to float16 by another sequence of operations); each is deterministic.
void cheri_block_backward(const TensorView& grad_x, const CheriBlockWeights& grads,
                          const TensorView& grad_out, const TensorView& x,
                          const CheriBlockWeights& weights, const TensorView& mean,
                          const TensorView& rstd, const TensorView& saved,
                          const CheriBlockOptions& options = {}, Stream stream = {});

/// The inference forward: out only, in as few passes over memory as possible, nothing saved.
void cheri_block_inference(const TensorView& out, const TensorView& x,
                           const CheriBlockWeights& weights, const CheriBlockOptions& options = {},
                           Stream stream = {});

}  // namespace fusekit
