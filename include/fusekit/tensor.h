// TensorView: the only tensor type of the fusekit API. It owns nothing.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace fusekit {

enum class DType : std::uint8_t { Float32, Float16, BFloat16, Float64, Int32, Int64, UInt8, Bool };

/// "float32", "bfloat16", ...
const char* to_string(DType dtype);
/// Bytes per element.
std::size_t element_size(DType dtype);

enum class DeviceKind : std::uint8_t { CPU, CUDA };

struct Device {
  DeviceKind kind = DeviceKind::CPU;
  int index = 0;  // CUDA ordinal; 0 on CPU

  static constexpr Device cpu() { return {DeviceKind::CPU, 0}; }
  static constexpr Device cuda(int index = 0) { return {DeviceKind::CUDA, index}; }
  friend constexpr bool operator==(const Device&, const Device&) = default;
};

/// "cpu", "cuda:0", ...
std::string to_string(Device device);

inline constexpr int kMaxDims = 8;

/// A non-owning view of a strided tensor: data pointer, dtype, device, and shape and strides
/// counted in elements (not bytes). Strides may be any value, including 0 (broadcast) and
/// negative; each operator states which layouts it accepts and rejects the rest with an Error.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::Float32;
  Device device{};
  int ndim = 0;
  std::array<std::int64_t, kMaxDims> shape{};
  std::array<std::int64_t, kMaxDims> strides{};

  TensorView() = default;
  /// A contiguous (row-major) view.
  TensorView(void* data, DType dtype, std::initializer_list<std::int64_t> shape, Device device = {});
  /// A strided view; `strides` has one entry per dimension.
  TensorView(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
             std::initializer_list<std::int64_t> strides, Device device = {});
  /// A view from arrays of `ndim` sizes and strides; `strides == nullptr` means contiguous.
  static TensorView from_arrays(void* data, DType dtype, int ndim, const std::int64_t* shape,
                                const std::int64_t* strides, Device device = {});

  /// Size and stride of dimension `dim`; negative `dim` counts from the end.
  std::int64_t size(int dim) const;
  std::int64_t stride(int dim) const;
  std::int64_t numel() const;
  bool is_contiguous() const;
  /// "[4096, 4, 7168]"
  std::string shape_string() const;
  /// A short description: "bfloat16 [4096, 4, 7168] on cuda:0".
  std::string describe() const;

  template <typename T>
  T* data_as() const {
    return static_cast<T*>(data);
  }
};

/// A CUDA stream (a cudaStream_t) on which an operator runs; ignored on the CPU. The default,
/// a null handle, is the legacy default stream (of the tensors' device). A stream of another
/// device is an Error, except while it is being captured into a graph, when CUDA cannot be asked
/// its device: such a capture records kernels that fault when the graph is launched.
struct Stream {
  void* handle = nullptr;
};

}  // namespace fusekit
