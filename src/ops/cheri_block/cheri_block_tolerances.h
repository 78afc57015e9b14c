// How close the cheri_block backends must come to the float64 reference
// (cheri_block_reference.h): one policy for the C++ tests and `fusekit check`.
//
// The exact paths (every CPU path; on CUDA the plane passes, and the training path in float32
// without TF32 or in half precision, whose products run in float32) are held element-wise: y, out
// and grad_x are float32 sums of a few hundred unit-size products at most (below 1e-5), plus for
// half-precision outputs one rounding (relative u). mean and rstd are float32 roundings of double
// statistics. The weight gradients are float32 sums over the N L rows, so their absolute part
// grows with sqrt(N L); weights in half precision are rounded once more.
//
// The CUDA fast paths (the inference kernel, whose operands are float16, and the float32 training
// path with TF32 products) are held to a relative bound on the whole tensor (Frobenius): 1e-3 for
// float32 (TF32 and float16 both keep 10 bits of mantissa), 2e-3 for float16 x (its own rounding of
// out, 2^-11, comes on top), 1e-2 for bfloat16 x (rounding of out, 2^-9). Element-wise, each
// element within 4 times the bound of the tensor's largest value: an element that sums few
// products (small C or N L) does not average their roundings out. The TF32 weight gradients are
// held to 4e-3: they sum over the N L rows, and where rows are few, products that cancel keep their
// 1e-3 relative to the products, not to their sum; below 64 rows (3.1e-3 seen at N L = 3, 6.1e-3
// at N L = 14 for a [3, 3] conv weight gradient) the bound is 1.6e-2. The conv weight gradient's
// bound is relative to the spread of its terms where that is larger than the gradient (the norm's
// backward cancels whole directions of it).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "fusekit/tensor.h"
#include "testing/host_tensor.h"

namespace fusekit::testing {

/// y, out and grad_x of the exact paths.
inline Tolerance cheri_elementwise_tolerance(DType dtype) {
  const double u = half_precision_roundoff(dtype);
  return {1e-5, u + 1e-5, u + 1e-5};
}

/// rstd: a float32 rounding of a double statistic.
inline Tolerance cheri_stat_tolerance() { return {1e-6, 1e-6, 1e-6}; }

/// The per-example means on the scale of the values they average: within 1e-6 of the largest
/// standard deviation (1 / rstd). A relative bound would give a mean near zero (a one-example
/// batch draws one now and then) no room at all, and what y sees of a mean's error is that error
/// over the standard deviation.
inline Tolerance cheri_mean_tolerance(const HostTensor& expected_rstd) {
  double deviation = 0;
  for (const double r : expected_rstd.values) deviation = std::max(deviation, 1.0 / r);
  return {1e-6 * deviation, 0.0, std::numeric_limits<double>::infinity()};
}

/// The exact paths' weight gradients, summed over `rows` = N L rows and stored in `weight_dtype`:
/// each element within 1e-5 relative plus 1e-5 sqrt(N L) absolute; the whole tensor within 4e-5
/// relative (Frobenius), since a tensor of a few elements, some of them sums whose terms cancel,
/// keeps their error (1.3e-5 seen at 3 x 3).
inline Tolerance cheri_weight_grad_tolerance(DType weight_dtype, std::int64_t rows) {
  const double u = half_precision_roundoff(weight_dtype);
  const double n = static_cast<double>(std::max<std::int64_t>(1, rows));
  return {1e-5 * std::sqrt(n), u + 1e-5, u + 4e-5};
}

/// The fast paths' relative bound for an output in x's dtype.
inline double cheri_fast_path_bound(DType dtype) {
  switch (dtype) {
    case DType::Float32: return 1e-3;
    case DType::Float16: return 2e-3;
    default: return 1e-2;
  }
}

/// The TF32 training path's bound for the weight gradients, summed over `rows` = N L rows.
inline double cheri_tf32_weight_grad_bound(std::int64_t rows) { return rows >= 64 ? 4e-3 : 1.6e-2; }

/// The TF32 path's grads.conv_weight: as cheri_relative_to_max, relative to the larger of the
/// tensor and the spread of its terms (CheriBlockGradients::conv_weight_spread, the same measure
/// for a tensor whose sums do not cancel). The norm makes the block blind to a plane's scale and
/// shift, so with few rows or channels this gradient can be far smaller than what rounds in it
/// (1.9e-2 relative to the tensor seen at N 3, L 1, C 3).
inline Tolerance cheri_tf32_conv_weight_grad_tolerance(const HostTensor& expected,
                                                       const HostTensor& spread, double bound) {
  double expected2 = 0, spread2 = 0, largest = 0;
  for (std::size_t i = 0; i < expected.values.size(); ++i) {
    const double e = expected.values[i], s = spread.values[i];
    expected2 += e * e;
    spread2 += s * s;
    largest = std::max({largest, std::abs(e), s});
  }
  const double scale = expected2 > 0 ? std::max(1.0, std::sqrt(spread2 / expected2)) : 1.0;
  return {4 * bound * std::max(largest, 1e-30), bound, bound * scale};
}

/// `bound` relative on the whole tensor, and element-wise within 4 `bound` of its largest value.
inline Tolerance cheri_relative_to_max(const HostTensor& expected, double bound) {
  double largest = 0;
  for (const double v : expected.values) largest = std::max(largest, std::abs(v));
  return {4 * bound * std::max(largest, 1e-30), bound, bound};
}

}  // namespace fusekit::testing
