#include "fusekit/tensor.h"

#include "fusekit/error.h"

namespace fusekit {

const char* to_string(DType dtype) {
  switch (dtype) {
    case DType::Float32: return "float32";
    case DType::Float16: return "float16";
    case DType::BFloat16: return "bfloat16";
    case DType::Float64: return "float64";
    case DType::Int32: return "int32";
    case DType::Int64: return "int64";
    case DType::UInt8: return "uint8";
    case DType::Bool: return "bool";
  }
  return "unknown dtype";
}

std::size_t element_size(DType dtype) {
  switch (dtype) {
    case DType::Float32: return 4;
    case DType::Float16: return 2;
    case DType::BFloat16: return 2;
    case DType::Float64: return 8;
    case DType::Int32: return 4;
    case DType::Int64: return 8;
    case DType::UInt8: return 1;
    case DType::Bool: return 1;
  }
  throw Error(detail::concat("element_size: unknown dtype code ", static_cast<int>(dtype)));
}

std::string to_string(Device device) {
  switch (device.kind) {
    case DeviceKind::CPU: return "cpu";
    case DeviceKind::CUDA: return "cuda:" + std::to_string(device.index);
  }
  return "unknown device";
}

TensorView TensorView::from_arrays(void* data, DType dtype, int ndim, const std::int64_t* shape,
                                   const std::int64_t* strides, Device device) {
  FUSEKIT_CHECK(ndim >= 0 && ndim <= kMaxDims, "TensorView: ndim must be in 0..", kMaxDims,
                ", got ", ndim);
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.ndim = ndim;
  std::int64_t running = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    FUSEKIT_CHECK(shape[d] >= 0, "TensorView: size of dim ", d, " must be >= 0, got ", shape[d]);
    t.shape[d] = shape[d];
    t.strides[d] = strides ? strides[d] : running;
    running *= shape[d];
  }
  return t;
}

TensorView::TensorView(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                       Device device)
    : TensorView(from_arrays(data, dtype, static_cast<int>(shape.size()), shape.begin(), nullptr,
                             device)) {}

TensorView::TensorView(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                       std::initializer_list<std::int64_t> strides, Device device) {
  FUSEKIT_CHECK(shape.size() == strides.size(), "TensorView: ", shape.size(), " sizes but ",
                strides.size(), " strides");
  *this = from_arrays(data, dtype, static_cast<int>(shape.size()), shape.begin(), strides.begin(),
                      device);
}

std::int64_t TensorView::size(int dim) const {
  const int d = dim < 0 ? dim + ndim : dim;
  FUSEKIT_CHECK(d >= 0 && d < ndim, "TensorView::size: dim ", dim, " out of range for ", ndim,
                " dims");
  return shape[d];
}

std::int64_t TensorView::stride(int dim) const {
  const int d = dim < 0 ? dim + ndim : dim;
  FUSEKIT_CHECK(d >= 0 && d < ndim, "TensorView::stride: dim ", dim, " out of range for ", ndim,
                " dims");
  return strides[d];
}

std::int64_t TensorView::numel() const {
  std::int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  std::int64_t expected = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

std::string TensorView::shape_string() const {
  std::string s = "[";
  for (int d = 0; d < ndim; ++d) s += detail::concat(d ? ", " : "", shape[d]);
  return s + "]";
}

std::string TensorView::describe() const {
  return detail::concat(to_string(dtype), ' ', shape_string(), " on ", to_string(device));
}

}  // namespace fusekit
