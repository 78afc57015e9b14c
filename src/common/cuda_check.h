// CUDA error checking: every runtime call and every launch goes through these.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>

#include "fusekit/error.h"
#include "fusekit/tensor.h"

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
/// Whether kernels using warpgroup MMAs (wgmma) run on `device`: compute capability 9.0 and a
/// library built for sm_90a.
bool has_warpgroup_mma(int device);
/// Shared memory of `device` in bytes, read once per device: the most one block may opt in to,
/// and all of one multiprocessor's.
int max_shared_memory_per_block(int device);
int shared_memory_per_multiprocessor(int device);

/// The operator's stream, checked to belong to `device` (the tensors'); call it under the
/// CudaDeviceGuard of `device`. A stream made on another device would fail at the first launch
/// with a CUDA error naming no argument. The default streams (null, cudaStreamLegacy,
/// cudaStreamPerThread) are the current device's, so they always belong. A stream that is being
/// captured cannot be asked, and is not checked.
cudaStream_t stream_on(const char* op, Stream stream, int device);

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

namespace fusekit::detail {

/// Lets `kernel` take `bytes` of dynamic shared memory on `device` (above the default 48 KiB),
/// with the largest shared-memory carveout when `max_carveout`; done once per kernel and device,
/// `done` being that kernel's flags. Where the device offers less, throws an Error that starts
/// with `describe()` (operator and kernel) and says what was needed and what the device offers.
template <typename Kernel, typename Describe>
void allow_shared_memory(Kernel kernel, std::size_t bytes, int device,
                         std::atomic<bool> (&done)[kMaxDevices], bool max_carveout,
                         const Describe& describe) {
  if (device < kMaxDevices && done[device].load(std::memory_order_acquire)) return;
  FUSEKIT_CHECK(bytes <= static_cast<std::size_t>(max_shared_memory_per_block(device)),
                describe(), " needs ", bytes, " bytes of shared memory per block, device ", device,
                " offers ", max_shared_memory_per_block(device));
  FUSEKIT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(bytes)));
  if (max_carveout) {
    FUSEKIT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                            cudaSharedmemCarveoutMaxShared));
  }
  if (device < kMaxDevices) done[device].store(true, std::memory_order_release);
}

}  // namespace fusekit::detail
