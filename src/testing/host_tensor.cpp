#include "testing/host_tensor.h"

#include <cmath>
#include <cstring>
#include <numeric>
#include <sstream>

#include "common/half.h"
#include "fusekit/error.h"

namespace fusekit::testing {

namespace {

double stored_value(const void* base, std::int64_t i, DType dtype) {
  switch (dtype) {
    case DType::Float32: return static_cast<const float*>(base)[i];
    case DType::Float64: return static_cast<const double*>(base)[i];
    case DType::Float16: return detail::to_float(static_cast<const detail::Half*>(base)[i]);
    case DType::BFloat16: return detail::to_float(static_cast<const detail::BFloat16*>(base)[i]);
    default: throw Error(detail::concat("testing: no float view of dtype ", to_string(dtype)));
  }
}

void store_value(void* base, std::int64_t i, DType dtype, double v) {
  const auto f = static_cast<float>(v);
  switch (dtype) {
    case DType::Float32: static_cast<float*>(base)[i] = f; return;
    case DType::Float64: static_cast<double*>(base)[i] = v; return;
    case DType::Float16: static_cast<detail::Half*>(base)[i] = detail::from_float<detail::Half>(f); return;
    case DType::BFloat16:
      static_cast<detail::BFloat16*>(base)[i] = detail::from_float<detail::BFloat16>(f);
      return;
    default: throw Error(detail::concat("testing: cannot store dtype ", to_string(dtype)));
  }
}

// Strides (in elements) and allocation size of `shape` laid out as `layout`.
std::pair<std::vector<std::int64_t>, std::int64_t> strides_for(const std::vector<std::int64_t>& shape,
                                                              const Layout& layout) {
  const int ndim = static_cast<int>(shape.size());
  std::vector<int> order = layout.order;
  if (order.empty()) {
    order.resize(ndim);
    std::iota(order.begin(), order.end(), 0);
  }
  FUSEKIT_CHECK(static_cast<int>(order.size()) == ndim, "testing: layout order has ", order.size(),
                " dims for a tensor of ", ndim);
  std::vector<std::int64_t> strides(ndim, 1);
  std::int64_t extent = 1;
  for (int k = ndim - 1; k >= 0; --k) {
    const int d = order[k];
    strides[d] = extent;
    extent *= shape[d] + (k == ndim - 1 ? layout.pad_inner : 0);
  }
  return {strides, extent + layout.offset_elements};
}

std::string index_string(const std::vector<std::int64_t>& shape, std::int64_t flat) {
  std::vector<std::int64_t> idx(shape.size());
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    idx[d] = shape[d] ? flat % shape[d] : 0;
    flat = shape[d] ? flat / shape[d] : 0;
  }
  std::ostringstream s;
  s << '[';
  for (std::size_t d = 0; d < idx.size(); ++d) s << (d ? ", " : "") << idx[d];
  s << ']';
  return s.str();
}

}  // namespace

HostTensor::HostTensor(std::vector<std::int64_t> shape_, double fill) : shape(std::move(shape_)) {
  std::int64_t n = 1;
  for (auto s : shape) n *= s;
  values.assign(static_cast<std::size_t>(n), fill);
}

std::int64_t HostTensor::offset(std::initializer_list<std::int64_t> index) const {
  std::int64_t off = 0;
  std::size_t d = 0;
  for (auto i : index) off = off * shape[d++] + i;
  return off;
}

std::string HostTensor::shape_string() const {
  std::ostringstream s;
  s << '[';
  for (std::size_t d = 0; d < shape.size(); ++d) s << (d ? ", " : "") << shape[d];
  s << ']';
  return s.str();
}

HostTensor random_normal(std::vector<std::int64_t> shape, std::mt19937_64& rng, double stddev) {
  HostTensor t(std::move(shape));
  std::normal_distribution<double> dist(0.0, stddev);
  for (double& v : t.values) v = dist(rng);
  return t;
}

void round_to(HostTensor& t, DType dtype) {
  std::uint64_t scratch = 0;
  for (double& v : t.values) {
    store_value(&scratch, 0, dtype, v);
    v = stored_value(&scratch, 0, dtype);
  }
}

HostTensor abs(HostTensor t) {
  for (double& v : t.values) v = std::abs(v);
  return t;
}

DeviceTensor empty_poisoned(const std::vector<std::int64_t>& shape, DType dtype, Device device,
                            const Layout& layout) {
  auto [strides, extent] = strides_for(shape, layout);
  DeviceTensor t;
  t.buffer = detail::Buffer(device, static_cast<std::size_t>(extent) * element_size(dtype));
  t.buffer.fill_bytes(0xff);  // all-ones bits: a NaN in every floating dtype
  char* base = static_cast<char*>(t.buffer.data()) + layout.offset_elements * element_size(dtype);
  t.view = TensorView::from_arrays(extent ? base : nullptr, dtype, static_cast<int>(shape.size()),
                                   shape.data(), strides.data(), device);
  return t;
}

DeviceTensor upload(const HostTensor& t, DType dtype, Device device, const Layout& layout) {
  auto [strides, extent] = strides_for(t.shape, layout);
  const std::size_t esize = element_size(dtype);
  std::vector<unsigned char> host(static_cast<std::size_t>(extent) * esize, 0xff);
  const int ndim = static_cast<int>(t.shape.size());
  if (layout.order.empty() && layout.pad_inner == 0) {  // contiguous: the common, large case
#pragma omp parallel for schedule(static)
    for (std::int64_t flat = 0; flat < t.numel(); ++flat) {
      store_value(host.data(), layout.offset_elements + flat, dtype, t.values[flat]);
    }
  } else {
    std::vector<std::int64_t> idx(ndim, 0);
    for (std::int64_t flat = 0; flat < t.numel(); ++flat) {
      std::int64_t off = layout.offset_elements;
      for (int d = 0; d < ndim; ++d) off += idx[d] * strides[d];
      store_value(host.data(), off, dtype, t.values[flat]);
      for (int d = ndim - 1; d >= 0 && ++idx[d] == t.shape[d]; --d) idx[d] = 0;
    }
  }
  DeviceTensor out;
  out.buffer = detail::Buffer(device, host.size());
  out.buffer.copy_from_host(host.data(), host.size());
  char* base = static_cast<char*>(out.buffer.data()) + layout.offset_elements * esize;
  out.view = TensorView::from_arrays(extent ? base : nullptr, dtype, ndim, t.shape.data(),
                                     strides.data(), device);
  return out;
}

HostTensor download(const TensorView& view) {
  HostTensor t(std::vector<std::int64_t>(view.shape.begin(), view.shape.begin() + view.ndim));
  if (t.numel() == 0) return t;
  // The span the view reaches, [lo, hi] in elements from its data pointer.
  std::int64_t lo = 0, hi = 0;
  for (int d = 0; d < view.ndim; ++d) {
    const std::int64_t reach = (view.shape[d] - 1) * view.strides[d];
    (reach < 0 ? lo : hi) += reach;
  }
  const std::size_t esize = element_size(view.dtype);
  std::vector<unsigned char> host(static_cast<std::size_t>(hi - lo + 1) * esize);
  detail::copy_to_host(host.data(), static_cast<const char*>(view.data) + lo * static_cast<std::int64_t>(esize),
                       host.size(), view.device);
  std::vector<std::int64_t> idx(view.ndim, 0);
  for (std::int64_t flat = 0; flat < t.numel(); ++flat) {
    std::int64_t off = -lo;
    for (int d = 0; d < view.ndim; ++d) off += idx[d] * view.strides[d];
    t.values[flat] = stored_value(host.data(), off, view.dtype);
    for (int d = view.ndim - 1; d >= 0 && ++idx[d] == view.shape[d]; --d) idx[d] = 0;
  }
  return t;
}

Comparison compare(const HostTensor& got, const HostTensor& expected, const Tolerance& tol,
                   const HostTensor* scale) {
  Comparison c;
  std::ostringstream msg;
  if (got.shape != expected.shape) {
    c.message = "shape " + got.shape_string() + " != expected " + expected.shape_string();
    return c;
  }
  if (scale && scale->shape != expected.shape) {
    c.message =
        "scale's shape " + scale->shape_string() + " != expected " + expected.shape_string();
    return c;
  }
  double err2 = 0, ref2 = 0, worst_excess = -1;
  std::int64_t worst_i = -1;
  for (std::int64_t i = 0; i < got.numel(); ++i) {
    const double g = got.values[i], e = expected.values[i];
    if (std::isfinite(g) != std::isfinite(e) || std::isnan(g) != std::isnan(e)) {
      ++c.nan_mismatches;
      ++c.mismatches;
      if (worst_excess < INFINITY) worst_excess = INFINITY, worst_i = i;
      continue;
    }
    if (!std::isfinite(e)) {
      if (g != e && !(std::isnan(g) && std::isnan(e))) ++c.mismatches;
      continue;
    }
    const double d = std::abs(g - e), r = scale ? scale->values[i] : e;
    err2 += d * d;
    ref2 += r * r;
    c.max_abs_error = std::max(c.max_abs_error, d);
    const double excess = d - (tol.atol + tol.rtol * std::abs(e));
    if (excess > 0) ++c.mismatches;
    if (excess > worst_excess) worst_excess = excess, worst_i = i;
  }
  c.rel_error = ref2 > 0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
  if (worst_i >= 0) {
    std::ostringstream w;
    w.precision(9);
    w << index_string(got.shape, worst_i) << ": got " << got.values[worst_i] << ", expected "
      << expected.values[worst_i];
    c.worst = w.str();
  }
  c.ok = c.mismatches == 0 && c.rel_error <= tol.rel;
  msg.precision(3);
  msg << "shape " << got.shape_string() << ", " << c.mismatches << " of " << got.numel()
      << " elements outside atol " << tol.atol << " + rtol " << tol.rtol << " (" << c.nan_mismatches
      << " NaN/inf mismatches), max abs error " << c.max_abs_error << ", rel error " << c.rel_error
      << " (limit " << tol.rel << (scale ? ", of the terms' norm" : "") << "), worst "
      << (c.worst.empty() ? "-" : c.worst);
  c.message = msg.str();
  return c;
}

}  // namespace fusekit::testing
