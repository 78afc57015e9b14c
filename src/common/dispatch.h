// dtype dispatch: one switch, shared by every backend, ending in an error branch.
#pragma once

#include <type_traits>

#include "fusekit/error.h"
#include "fusekit/tensor.h"

namespace fusekit::detail {

template <DType D>
using DTypeTag = std::integral_constant<DType, D>;

/// Calls `f(DTypeTag<D>{})` for the floating dtypes an operator accepts (float32, float16,
/// bfloat16); each backend maps the tag to its own element type.
template <typename F>
decltype(auto) dispatch_floating(DType dtype, const char* op, F&& f) {
  switch (dtype) {
    case DType::Float32: return f(DTypeTag<DType::Float32>{});
    case DType::Float16: return f(DTypeTag<DType::Float16>{});
    case DType::BFloat16: return f(DTypeTag<DType::BFloat16>{});
    default:
      throw Error(concat(op, ": no kernel for dtype ", to_string(dtype),
                         "; expected float32, float16 or bfloat16"));
  }
}

/// Runs `cpu()` or `cuda()` for the device kind; the error branch names what is missing. In a
/// build without CUDA, `cuda` is never called (nor emitted).
template <typename Cpu, typename Cuda>
void dispatch_device(const char* op, Device device, Cpu&& cpu, [[maybe_unused]] Cuda&& cuda) {
  switch (device.kind) {
    case DeviceKind::CPU:
      cpu();
      return;
    case DeviceKind::CUDA:
#ifdef FUSEKIT_WITH_CUDA
      cuda();
      return;
#else
      throw Error(concat(op, ": no backend for device ", to_string(device),
                         "; this fusekit was built without CUDA"));
#endif
  }
  throw Error(concat(op, ": unknown device kind ", static_cast<int>(device.kind)));
}

}  // namespace fusekit::detail
