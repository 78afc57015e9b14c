// CUDA error checking: every runtime call and every launch goes through these.
#pragma once

#include <cuda_runtime.h>

#include "fusekit/error.h"

namespace fusekit::detail {

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* call, const char* file,
                                          int line) {
  throw Error(concat("CUDA error ", cudaGetErrorName(err), " (", cudaGetErrorString(err),
                     ") in ", call, " at ", file, ":", line));
}

/// Makes `device` current for the lifetime of the guard, restoring the previous one after.
class CudaDeviceGuard {
 public:
  explicit CudaDeviceGuard(int device);
  ~CudaDeviceGuard();
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

/// Devices whose per-kernel settings (shared-memory limits) launchers remember; settings for
/// higher ordinals are made on every call.
inline constexpr int kMaxDevices = 64;

/// Multiprocessor count and compute capability (major) of `device`, read once per device.
int multiprocessor_count(int device);
int compute_capability_major(int device);
/// Shared memory of `device` in bytes, read once per device: the most one block may opt in to,
/// and all of one multiprocessor's.
int max_shared_memory_per_block(int device);
int shared_memory_per_multiprocessor(int device);

}  // namespace fusekit::detail

#define FUSEKIT_CUDA_CHECK(call)                                                      \
  do {                                                                                \
    const cudaError_t fusekit_err_ = (call);                                          \
    if (fusekit_err_ != cudaSuccess) [[unlikely]]                                     \
      ::fusekit::detail::throw_cuda_error(fusekit_err_, #call, __FILE__, __LINE__);   \
  } while (0)

/// Checks the launch just made (configuration errors surface here; no synchronisation).
#define FUSEKIT_CUDA_CHECK_LAUNCH(kernel_name)                                        \
  do {                                                                                \
    const cudaError_t fusekit_err_ = cudaGetLastError();                              \
    if (fusekit_err_ != cudaSuccess) [[unlikely]]                                     \
      ::fusekit::detail::throw_cuda_error(fusekit_err_, "launch of " kernel_name,     \
                                          __FILE__, __LINE__);                        \
  } while (0)
