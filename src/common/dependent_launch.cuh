// Programmatic dependent launch (sm_90): a kernel launched as a dependent of the kernel before it
// on its stream may start once every block of that kernel has called allow_dependents() (or
// exited), and waits for that kernel's completion and memory with wait_for_prerequisites() before
// touching what it wrote (or anything a kernel before it wrote: the wait covers the whole chain).
// Work that reads only what earlier launches finished with, such as staging weights, can run
// before the wait, under the previous kernel's tail. Both are no-ops on older devices and for
// kernels launched the ordinary way.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "common/cuda_check.h"

namespace fusekit::detail {

__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_prerequisites() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/// Launches `kernel` as a programmatic dependent of the kernel before it on `stream` (sm_90; an
/// ordinary launch on older devices). Checked like every launch.
template <typename Kernel, typename... Args>
void launch_dependent(Kernel kernel, dim3 grid, dim3 block, std::size_t shared_bytes, int device,
                      cudaStream_t stream, const Args&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = compute_capability_major(device) >= 9 ? 1 : 0;
  FUSEKIT_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, args...));
}

}  // namespace fusekit::detail
