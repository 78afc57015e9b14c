// causal_attention: causal self-attention over left-padded sequences, forward.
//
//   query i of sequence b attends keys j with n_padd[b] <= j <= i:
//   out[b, h, i] = softmax_j(scale * q[b, h, i] . k[b, g, j]) @ v[b, g, j]   for i >= n_padd[b]
//   out[b, h, i] = 0                                                        for i <  n_padd[b]
//   lse[b, h, i] = log sum_j exp(scale * q . k_j)   (natural log; -inf on padding rows)
// where g = h / (Hq / Hkv) is the key/value head of query head h (grouped-query attention).
//
// Arguments (B >= 0, T >= 0, Hq >= 1, Hkv >= 1 dividing Hq, 1 <= D <= 256):
//   out   [B, Hq, T, D]   q's dtype
//   lse   [B, Hq, T] or none (an empty TensorView): float32, the log-sum-exp of each row's scaled
//         scores, for a later backward
//   q     [B, Hq, T, D]   float32, float16 or bfloat16
//   k, v  [B, Hkv, T, D]  q's dtype
//   All of them may instead drop B and the heads together (q, k, v, out [T, D], lse [T]): a
//   single head.
//   Any strides with a unit stride on D (lse: any strides); no copies are made.
//   padding: LeftPadding{all} pads every sequence by `all` tokens; LeftPadding{0, per_sequence}
//   takes int32 [B] (one count per sequence, any stride, on the tensors' device; [1] for the
//   single-head form); `all` must then be 0. Each count lies in [0, T] (`all` is checked on every
//   device, per_sequence on the CPU; on CUDA a per-sequence count outside is clamped into [0, T]).
// All tensors live on one device.
//
// Padded rows are written as zeros (never NaN, never left unwritten), and the padding rows of k
// and v are never read, so NaN or garbage there cannot leak into the result; q's padding rows may
// be read (the Hopper kernel copies query tiles whole) but never reach another row.
//
// Precision: float32 inputs keep float32 accuracy unless `allow_tf32` is set: on CUDA each
// float32 operand is split into two TF32 parts and each product takes three TF32 tensor-core
// products (the dropped part is ~2^-22 of it), with float32 accumulation, exp and sums;
// `allow_tf32` takes one TF32 product instead. Half-precision inputs multiply on tensor cores
// with float32 accumulation and a float32 softmax (the probabilities are rounded to the input
// type for their product with v). The CPU backend computes in float32 with a float32 online
// softmax (`allow_tf32` changes nothing there).
// Aliasing: `out` and `lse` must not overlap any input or each other (checked).
// Determinism: bitwise deterministic for a given device, shape and layout (on the CPU whatever
// the number of threads).
// Temporary memory: the CPU backend keeps float32 scratch of a few blocks of rows per thread
// (about 260 KiB per thread at D = 256); the CUDA backend takes none (one kernel launch).
// Speed: head dims up to 32, 64, 128 and 256 run kernels specialised for them (a D in between
// pads to the next, with zeros); D = 32, 64 and 128 are the fast ones. On Hopper (compute
// capability 9.0, sm_90a build), bfloat16 and float16 at D = 64 and 128 run warpgroup MMAs fed by
// the copy engine when q, k and v start 16-byte aligned with strides of whole 16-byte pieces;
// other layouts take the mma.sync kernel. Rows of q, k and v that
// start 16-byte aligned, with strides in whole 16-byte pieces, are copied by cp.async; any other
// layout takes element-wise loads, correct and slower. The float32 kernels at D > 128 (and at
// 64 < D <= 128 when B * Hq * T is small) take up to 195 KiB of shared memory per block: a GPU
// that offers less (sm_80 offers 163 KiB) gets a fusekit::Error saying so.
// Stream: the CUDA work is enqueued on `stream` and never synchronises; the call can be captured
// in a CUDA graph. On the CPU the call returns when the result is written.
#pragma once

#include <cstdint>
#include <optional>

#include "fusekit/tensor.h"

namespace fusekit {

/// How many leading tokens of each sequence are padding.
struct LeftPadding {
  std::int64_t all = 0;       // the same count for every sequence (used when per_sequence is empty)
  TensorView per_sequence{};  // or int32 [B], one count per sequence
};

struct CausalAttentionOptions {
  /// The scores' scale, finite and > 0; default 1 / sqrt(D).
  std::optional<double> scale;
  /// float32 inputs: allow TF32 tensor cores for both products (10-bit mantissa operands, float32
  /// accumulation). false keeps float32 accuracy. Ignored for half precision.
  bool allow_tf32 = false;
};

void causal_attention(const TensorView& out, const TensorView& lse, const TensorView& q,
                      const TensorView& k, const TensorView& v, const LeftPadding& padding = {},
                      const CausalAttentionOptions& options = {}, Stream stream = {});

}  // namespace fusekit
