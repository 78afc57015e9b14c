// Device queries and the device guard (compiled only with CUDA).
#include <array>
#include <mutex>

#include "common/cuda_check.h"

namespace fusekit::detail {

CudaDeviceGuard::CudaDeviceGuard(int device) {
  int current = 0;
  FUSEKIT_CUDA_CHECK(cudaGetDevice(&current));
  if (current != device) {
    FUSEKIT_CUDA_CHECK(cudaSetDevice(device));
    previous_ = current;
  }
}

CudaDeviceGuard::~CudaDeviceGuard() {
  if (previous_ >= 0) cudaSetDevice(previous_);  // a destructor must not throw
}

int multiprocessor_count(int device) {
  static std::array<int, 64> cache{};
  static std::mutex mutex;
  FUSEKIT_CHECK(device >= 0 && device < static_cast<int>(cache.size()), "CUDA device index ",
                device, " out of range");
  std::lock_guard lock(mutex);
  if (cache[device] == 0) {
    FUSEKIT_CUDA_CHECK(
        cudaDeviceGetAttribute(&cache[device], cudaDevAttrMultiProcessorCount, device));
  }
  return cache[device];
}

}  // namespace fusekit::detail
