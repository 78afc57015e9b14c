// Warp and block reductions for CUDA kernels.
#pragma once

namespace fusekit::detail {

constexpr int kWarpSize = 32;

/// The sum of `v` over the 32 lanes of a full warp, in every lane. The butterfly adds in a fixed
/// order, so that the result is the same bits in every lane and on every run.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

/// The sum of `v` over a block of kWarps full warps, in every thread, in a fixed order.
/// `scratch` holds kWarps floats of shared memory; the call synchronises the block twice, so that
/// `scratch` may be reused right after.
template <int kWarps>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  if (threadIdx.x % kWarpSize == 0) scratch[threadIdx.x / kWarpSize] = v;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += scratch[w];
  __syncthreads();
  return total;
}

}  // namespace fusekit::detail
