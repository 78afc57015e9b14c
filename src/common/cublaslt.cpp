#include "common/cublaslt.h"

#include <map>
#include <mutex>

namespace fusekit::detail {

cublasLtHandle_t lt_handle(int device) {
  static std::mutex mutex;
  static std::map<int, cublasLtHandle_t> handles;
  const std::lock_guard lock(mutex);
  auto it = handles.find(device);
  if (it == handles.end()) {
    cublasLtHandle_t handle = nullptr;
    FUSEKIT_CUBLAS_CHECK(cublasLtCreate(&handle));
    it = handles.emplace(device, handle).first;
  }
  return it->second;
}

std::uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  std::uint32_t align = 256;
  while (align > 1 && a % align != 0) align /= 2;
  return align;
}

}  // namespace fusekit::detail
