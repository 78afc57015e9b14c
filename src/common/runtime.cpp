#include "fusekit/runtime.h"

#include "fusekit/error.h"

#ifdef FUSEKIT_WITH_CUDA
#include "common/cuda_check.h"
#endif

namespace fusekit {

const BuildInfo& build_info() {
  static const BuildInfo info = [] {
    BuildInfo b;
    b.version = FUSEKIT_VERSION;
#ifdef FUSEKIT_WITH_CUDA
    b.with_cuda = true;
    b.cuda_architectures = FUSEKIT_CUDA_ARCHITECTURES;
#endif
#ifdef _OPENMP
    b.with_openmp = true;
#endif
    return b;
  }();
  return info;
}

int cuda_device_count() {
#ifdef FUSEKIT_WITH_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: not an error for this query
    return 0;
  }
  return count;
#else
  return 0;
#endif
}

CudaDeviceInfo cuda_device_info(int index) {
  const int count = cuda_device_count();
  FUSEKIT_CHECK(index >= 0 && index < count, "cuda_device_info: device ", index,
                " requested, but ", count, " CUDA device(s) are usable");
  CudaDeviceInfo info;
#ifdef FUSEKIT_WITH_CUDA
  cudaDeviceProp prop{};
  FUSEKIT_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
  info.index = index;
  info.name = prop.name;
  info.sm_major = prop.major;
  info.sm_minor = prop.minor;
  info.multiprocessors = prop.multiProcessorCount;
  info.global_memory_bytes = prop.totalGlobalMem;
  info.l2_cache_bytes = static_cast<std::size_t>(prop.l2CacheSize);
#endif
  return info;
}

}  // namespace fusekit
