// How close the causal_attention backends must come to the float64 reference
// (causal_attention_reference.h): one policy for the C++ tests and `fusekit check`.
//
// The CPU backend works in float32. A score, a sum of D products, carries an absolute error of
// about sqrt(D) u32 times the size of the scores; through the softmax it becomes an absolute error
// of the same size in out (whose rows are convex combinations of unit-size rows of v) and in lse.
// The sums over up to T keys add less for these random terms. Measured against float64 for D of
// 16 to 256, T of 200 to 1500 and scores of size 1 to 32, the largest errors of out and lse were
// 8 and 5 of these units; the bounds below allow 20. The Frobenius errors stayed below 5e-6. Out
// in float16 and bfloat16 also carries its rounding (relative u).
//
// CUDA. float32 without TF32 keeps float32 accuracy (within 1e-5 relative in norm, as the issue
// asks), but each of its products is three TF32 products of split operands: the small parts' own
// roundings and the dropped product of the two small parts leave up to about 4 u32 of each
// product where a float32 product leaves one. So its unit is four times the CPU backend's. It
// shows at D = 1, where a score is one product and nothing averages: out 38 u32 off at a sharp
// score, above the CPU backend's 20 units.
//
// float32 with TF32, bfloat16 and float16 multiply on tensor cores. Each operand carries one
// rounding of relative size u_op (2^-11 for TF32 and float16, 2^-8 for bfloat16): the weights p,
// rounded before p @ v, in every precision; with TF32 also q, k and v. Rounding p moves out by
// at most u_op times its unit-size rows of v; rounding q and k (TF32) moves each score by about
// u_op times the size of the scores S, which moves out by as much and lse by as much again, or by
// up to 4 u_op |lse| where the conversion truncates (2 u_op on each factor of a product, all of
// one sign, which D = 1 does not average away). Then out is rounded once to float16 or bfloat16
// (relative u_out, its dtype's unit roundoff). So the unit of these errors is u_op (1 + S) with
// TF32 and u_op in half precision. In half precision the scores are exact products summed in
// float32 and the softmax is float32 (its row sums are of the unrounded weights), so lse keeps
// the float32 bound.
//
// In a float64 model of a FlashAttention kernel (blocks of 64 or 128 keys, a running max, p
// rounded to the operand type, TF32 conversions that round or truncate), over T of 2 to 400, D of
// 1 to 256, padding and scores of size 0.01 to 64, the largest errors of thousands of runs were,
// in these units and beyond u_out |out| and 4 u_op |lse| (TF32): out 0.87 (half precision) and
// 4.1 (TF32) per element, 0.9 u_op (half, u_out included) and 1.6 (TF32, beyond 1e-5) in norm;
// lse 1.5 (TF32). The bounds below allow about twice that, the budget of twice the error of the
// same formula computed in that precision: a wrong row, a key block left out or let in, or a
// softmax max that is not carried across blocks misses them by orders of magnitude in some rows.
//
// lse is judged element by element only on CUDA: a row of one key has its score as lse, near 0 as
// often as not, so a norm relative to lse's values tells nothing where rows are few.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "fusekit/tensor.h"
#include "testing/host_tensor.h"

namespace fusekit::testing {

/// What the bounds depend on: the inputs' dtype, whether float32 products may be TF32, the head
/// dimension and the size of the scores (attention_score_size).
struct AttentionPrecision {
  DType dtype = DType::Float32;
  bool allow_tf32 = false;
  std::int64_t d = 1;
  double score_size = 1;
};

/// The size of the scores: their standard deviation for unit-size keys and queries of standard
/// deviation `q_stddev` (at least 1).
inline double attention_score_size(double scale, double q_stddev, std::int64_t d) {
  return std::max(1.0, scale * q_stddev * std::sqrt(static_cast<double>(d)));
}

/// The CPU backend's unit: sqrt(D) u32 times the size of the scores.
inline double attention_score_error_unit(const AttentionPrecision& p) {
  return std::sqrt(static_cast<double>(p.d)) * 0x1p-24 * p.score_size;
}

/// out of the CPU backend: the float32 errors, plus one rounding of a half-precision output.
inline Tolerance attention_cpu_out_tolerance(const AttentionPrecision& p) {
  const double u = half_precision_roundoff(p.dtype);
  return {20 * attention_score_error_unit(p), u + 1e-6, u + 1e-5};
}

/// lse of the CPU backend, float32 in every dtype.
inline Tolerance attention_cpu_lse_tolerance(const AttentionPrecision& p) {
  return {20 * attention_score_error_unit(p), 1e-6, 1e-5};
}

inline bool attention_uses_tf32(const AttentionPrecision& p) {
  return p.dtype == DType::Float32 && p.allow_tf32;
}

/// The tensor cores' unit: u_op (1 + S) with TF32, u_op for float16 and bfloat16.
inline double attention_tensor_core_unit(const AttentionPrecision& p) {
  if (attention_uses_tf32(p)) return 0x1p-11 * (1 + p.score_size);
  return half_precision_roundoff(p.dtype);
}

/// out of the CUDA backend.
inline Tolerance attention_cuda_out_tolerance(const AttentionPrecision& p) {
  const double f32 = 20 * attention_score_error_unit(p), unit = attention_tensor_core_unit(p);
  if (p.dtype == DType::Float32 && !p.allow_tf32) return {4 * f32, 1e-6, 1e-5};
  if (attention_uses_tf32(p)) return {f32 + 8 * unit, 1e-6, 1e-5 + 3 * unit};
  const double u_out = half_precision_roundoff(p.dtype);
  return {f32 + 2 * unit, 1e-6 + u_out, 1e-5 + 2 * unit};
}

/// lse of the CUDA backend, element by element: float32 bounds but for TF32 (and the split
/// products' unit for float32).
inline Tolerance attention_cuda_lse_tolerance(const AttentionPrecision& p) {
  constexpr double kNoNorm = std::numeric_limits<double>::infinity();
  const double f32 = 20 * attention_score_error_unit(p);
  if (attention_uses_tf32(p)) {
    return {f32 + 3 * attention_tensor_core_unit(p), 1e-6 + 4 * 0x1p-11, kNoNorm};
  }
  if (p.dtype == DType::Float32) return {4 * f32, 1e-6, kNoNorm};  // split products, as for out
  return {f32, 1e-6, kNoNorm};
}

}  // namespace fusekit::testing
