// Test and tool support (not part of the library's API): float64 host tensors for references,
// putting them on a device in any floating dtype and layout, reading results back, and the one
// comparison of fusekit's C++ tests and `fusekit check`.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "common/memory.h"
#include "fusekit/tensor.h"

namespace fusekit::testing {

/// A row-major float64 tensor on the host.
struct HostTensor {
  std::vector<std::int64_t> shape;
  std::vector<double> values;

  HostTensor() = default;
  explicit HostTensor(std::vector<std::int64_t> shape, double fill = 0.0);
  std::int64_t numel() const { return static_cast<std::int64_t>(values.size()); }
  std::int64_t offset(std::initializer_list<std::int64_t> index) const;
  double& at(std::initializer_list<std::int64_t> index) { return values[offset(index)]; }
  double at(std::initializer_list<std::int64_t> index) const { return values[offset(index)]; }
  std::string shape_string() const;
};

/// Normal(0, stddev) values from `rng`.
HostTensor random_normal(std::vector<std::int64_t> shape, std::mt19937_64& rng, double stddev = 1.0);
/// Rounds every value to the nearest value of `dtype`, as storing it would.
void round_to(HostTensor& t, DType dtype);
/// |t|, element by element.
HostTensor abs(HostTensor t);
/// The relative error of one rounding to nearest in a half-precision dtype: 2^-8 for bfloat16,
/// 2^-11 for float16; 0 for float32, whose roundings tolerances cover with terms of their own.
inline double half_precision_roundoff(DType dtype) {
  switch (dtype) {
    case DType::BFloat16: return 0x1p-8;
    case DType::Float16: return 0x1p-11;
    default: return 0.0;
  }
}

/// How a tensor is laid out in its allocation. The default is contiguous and 256-byte aligned.
struct Layout {
  std::vector<int> order;            // dims from outermost to innermost in memory; empty: 0, 1, ...
  std::int64_t pad_inner = 0;        // unused elements after each innermost run (gaps between rows)
  std::int64_t offset_elements = 0;  // the view starts this far into the allocation
};

/// An allocation and a view of it. Unused elements (padding, the offset) are NaN.
struct DeviceTensor {
  detail::Buffer buffer;
  TensorView view;
};

/// A tensor of `shape` in `dtype` on `device`, every element (and padding) set to NaN.
DeviceTensor empty_poisoned(const std::vector<std::int64_t>& shape, DType dtype, Device device,
                            const Layout& layout = {});
/// `t` rounded to `dtype`, laid out as `layout`, on `device`.
DeviceTensor upload(const HostTensor& t, DType dtype, Device device, const Layout& layout = {});
/// Reads any strided floating view back as float64.
HostTensor download(const TensorView& view);

/// Tolerance of a comparison: |got - expected| <= atol + rtol * |expected| element-wise, and
/// ||got - expected|| / ||expected|| <= rel (Frobenius; see compare for a scale in its place).
struct Tolerance {
  double atol = 0, rtol = 0, rel = 0;
};

struct Comparison {
  bool ok = false;
  std::int64_t mismatches = 0;
  std::int64_t nan_mismatches = 0;  // NaN/inf in one tensor where the other is finite
  double max_abs_error = 0;
  double rel_error = 0;  // Frobenius
  std::string worst;     // "[3, 1, 77]: got 1.25, expected 1.2421875"
  std::string message;   // everything above in one line, for failures
};

/// got against expected within tol. With `scale` (expected's shape), the Frobenius bound is
/// ||got - expected|| <= rel ||scale||: for a sum whose terms may cancel, pass the same sum over
/// the terms' absolute values, to which its rounding errors are proportional. (A sum of four
/// products can come out far below its terms; held to rel of its own size, a one-element result
/// then fails now and then with no fault in the code.)
Comparison compare(const HostTensor& got, const HostTensor& expected, const Tolerance& tol,
                   const HostTensor* scale = nullptr);

}  // namespace fusekit::testing
