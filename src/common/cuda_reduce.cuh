// Warp reductions for CUDA kernels.
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

}  // namespace fusekit::detail
