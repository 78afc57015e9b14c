// Argument validation shared by every operator entry point. Each check throws fusekit::Error
// with a message naming the operator, the argument, what was expected and what came.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "fusekit/tensor.h"

namespace fusekit::detail {

/// One expected dimension: a symbolic name for messages ("N", "hc") and its value.
struct Dim {
  const char* name;
  std::int64_t value;
};

/// An argument and its name, for the checks over several at once.
using NamedTensor = std::pair<const char*, const TensorView*>;

/// An optional argument is absent when it is an empty TensorView (no data, no dims).
inline bool given(const TensorView& t) { return t.data != nullptr || t.ndim != 0; }

/// "(8192, 1)": the strides of `t`, for messages.
std::string strides_string(const TensorView& t);
/// `t` has exactly `dims.size()` dimensions with the given sizes.
void check_shape(const char* op, const char* arg, const TensorView& t, std::initializer_list<Dim> dims);
/// `t` has one of `allowed` dtypes.
void check_dtype(const char* op, const char* arg, const TensorView& t,
                 std::initializer_list<DType> allowed);
/// `t` has the dtype of `ref` (named `ref_arg`).
void check_same_dtype(const char* op, const char* arg, const TensorView& t, const char* ref_arg,
                      const TensorView& ref);
/// `t` lives on the device of `ref` (named `ref_arg`).
void check_same_device(const char* op, const char* arg, const TensorView& t, const char* ref_arg,
                       const TensorView& ref);
/// `t` has a data pointer when it has elements, and no two of its elements share an address
/// through a zero stride (for outputs).
void check_data(const char* op, const char* arg, const TensorView& t);
void check_writable(const char* op, const char* arg, const TensorView& t);
/// The memory spans of `a` and `b` do not intersect.
void check_no_overlap(const char* op, const char* a_arg, const TensorView& a, const char* b_arg,
                      const TensorView& b);
/// `options.eps` (of a normalisation) is finite and >= 0.
void check_eps(const char* op, double eps);
/// Every given output writable, apart from every given input and from every other output.
void check_outputs(const char* op, std::initializer_list<NamedTensor> outputs,
                   std::initializer_list<NamedTensor> inputs);

}  // namespace fusekit::detail
