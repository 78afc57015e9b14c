// What this build of fusekit contains and which devices it sees.
#pragma once

#include <string>
#include <vector>

namespace fusekit {

struct BuildInfo {
  std::string version;              // "0.1.0"
  bool with_cuda = false;           // CUDA kernels compiled in
  std::string cuda_architectures;   // "80 90a", empty without CUDA
  bool with_openmp = false;
};

const BuildInfo& build_info();

struct CudaDeviceInfo {
  int index = 0;
  std::string name;
  int sm_major = 0, sm_minor = 0;
  int multiprocessors = 0;
  std::size_t global_memory_bytes = 0;
  std::size_t l2_cache_bytes = 0;
};

/// Number of CUDA devices usable by this build: 0 without CUDA support, without a driver or
/// without a device (never throws for those cases).
int cuda_device_count();
CudaDeviceInfo cuda_device_info(int index);

}  // namespace fusekit
