#include "common/validate.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>

#include "fusekit/error.h"

namespace fusekit::detail {

namespace {

std::string names_of(std::initializer_list<Dim> dims) {
  std::string s = "[";
  for (const Dim& d : dims) s += concat(s.size() > 1 ? ", " : "", d.name);
  return s + "]";
}

std::string values_of(std::initializer_list<Dim> dims) {
  std::string s = "[";
  for (const Dim& d : dims) s += concat(s.size() > 1 ? ", " : "", d.value);
  return s + "]";
}

// [lowest, highest] byte address touched by a non-empty view.
std::pair<std::uintptr_t, std::uintptr_t> byte_span(const TensorView& t) {
  std::int64_t lo = 0, hi = 0;
  for (int d = 0; d < t.ndim; ++d) {
    const std::int64_t reach = (t.shape[d] - 1) * t.strides[d];
    (reach < 0 ? lo : hi) += reach;
  }
  const auto base = reinterpret_cast<std::intptr_t>(t.data);
  const auto size = static_cast<std::int64_t>(element_size(t.dtype));
  return {static_cast<std::uintptr_t>(base + lo * size),
          static_cast<std::uintptr_t>(base + hi * size + size - 1)};
}

}  // namespace

void check_shape(const char* op, const char* arg, const TensorView& t,
                 std::initializer_list<Dim> dims) {
  bool ok = t.ndim == static_cast<int>(dims.size());
  for (int d = 0; ok && d < t.ndim; ++d) ok = t.shape[d] == dims.begin()[d].value;
  FUSEKIT_CHECK(ok, op, ": ", arg, " has shape ", t.shape_string(), ", expected ", names_of(dims),
                " = ", values_of(dims));
}

void check_dtype(const char* op, const char* arg, const TensorView& t,
                 std::initializer_list<DType> allowed) {
  if (std::find(allowed.begin(), allowed.end(), t.dtype) != allowed.end()) return;
  std::string names;
  std::size_t i = 0;
  for (DType d : allowed) {
    names += concat(i == 0 ? "" : (i + 1 == allowed.size() ? " or " : ", "), to_string(d));
    ++i;
  }
  throw Error(concat(op, ": ", arg, " has dtype ", to_string(t.dtype), ", expected ", names));
}

void check_same_dtype(const char* op, const char* arg, const TensorView& t, const char* ref_arg,
                      const TensorView& ref) {
  FUSEKIT_CHECK(t.dtype == ref.dtype, op, ": ", arg, " has dtype ", to_string(t.dtype), " but ",
                ref_arg, " has ", to_string(ref.dtype), "; expected the same dtype");
}

void check_same_device(const char* op, const char* arg, const TensorView& t, const char* ref_arg,
                       const TensorView& ref) {
  FUSEKIT_CHECK(t.device == ref.device, op, ": ", arg, " is on ", to_string(t.device), " but ",
                ref_arg, " is on ", to_string(ref.device), "; expected one device");
}

void check_data(const char* op, const char* arg, const TensorView& t) {
  FUSEKIT_CHECK(t.data != nullptr || t.numel() == 0, op, ": ", arg, " (", t.describe(),
                ") has a null data pointer");
}

std::string strides_string(const TensorView& t) {
  std::string s = "(";
  for (int d = 0; d < t.ndim; ++d) s += concat(d ? ", " : "", t.strides[d]);
  return s + ")";
}

void check_writable(const char* op, const char* arg, const TensorView& t) {
  check_data(op, arg, t);
  if (t.numel() == 0) return;
  // Sufficient for distinct addresses: ordered by |stride|, each dimension steps past everything
  // the smaller ones reach. Dimensions of size 1 never step.
  std::array<int, kMaxDims> dims{};
  int count = 0;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] == 1) continue;
    FUSEKIT_CHECK(t.strides[d] != 0, op, ": output ", arg, " has stride 0 in dim ", d, " of size ",
                  t.shape[d], "; expected every output element at its own address");
    dims[count++] = d;
  }
  for (int k = 1; k < count; ++k) {  // insertion sort by |stride|: at most kMaxDims entries
    for (int m = k; m > 0 && std::abs(t.strides[dims[m]]) < std::abs(t.strides[dims[m - 1]]); --m) {
      std::swap(dims[m], dims[m - 1]);
    }
  }
  std::int64_t reach = 0;  // furthest offset the smaller dimensions reach
  for (int k = 0; k < count; ++k) {
    const int d = dims[k];
    FUSEKIT_CHECK(std::abs(t.strides[d]) > reach, op, ": output ", arg, " ", t.shape_string(),
                  " has strides that make elements share addresses (dim ", d, ", stride ",
                  t.strides[d], "); expected every output element at its own address");
    reach += (t.shape[d] - 1) * std::abs(t.strides[d]);
  }
}

void check_no_overlap(const char* op, const char* a_arg, const TensorView& a, const char* b_arg,
                      const TensorView& b) {
  if (a.numel() == 0 || b.numel() == 0 || a.device != b.device) return;
  const auto [a_lo, a_hi] = byte_span(a);
  const auto [b_lo, b_hi] = byte_span(b);
  FUSEKIT_CHECK(a_hi < b_lo || b_hi < a_lo, op, ": ", a_arg, " overlaps ", b_arg,
                " in memory; expected separate buffers (", a_arg, " may not alias ", b_arg, ")");
}

void check_eps(const char* op, double eps) {
  FUSEKIT_CHECK(std::isfinite(eps) && eps >= 0, op, ": options.eps is ", eps,
                ", expected a finite value >= 0");
}

void check_outputs(const char* op, std::initializer_list<NamedTensor> outputs,
                   std::initializer_list<NamedTensor> inputs) {
  for (const auto& [name, t] : outputs) {
    if (given(*t)) check_writable(op, name, *t);
  }
  for (auto out = outputs.begin(); out != outputs.end(); ++out) {
    if (!given(*out->second)) continue;
    for (const auto& [name, t] : inputs) {
      if (given(*t)) check_no_overlap(op, out->first, *out->second, name, *t);
    }
    for (auto other = out + 1; other != outputs.end(); ++other) {
      if (given(*other->second)) {
        check_no_overlap(op, out->first, *out->second, other->first, *other->second);
      }
    }
  }
}

}  // namespace fusekit::detail
