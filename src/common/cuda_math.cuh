// Float32 functions through the multiprocessor's special-function unit, for softmaxes, gates and
// activations: a single instruction each (ex2.approx, rcp.approx) where expf and an IEEE division
// take tens, which counts twice in an epilogue, once as work and once as code fetched from memory
// after the benchmarks' L2 flush. Each is within a few float32 ulps (subnormal inputs and results
// flushed to zero), below the rounding of the half-precision values they usually produce.
#pragma once

namespace fusekit::detail {

/// 2^x.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/// 1 / x.
__device__ __forceinline__ float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/// The logistic function 1 / (1 + 2^(-v log2 e)): 2^(-v log2 e) overflowing to infinity gives 0,
/// and results below 2^-126 are 0 (as they are in float16 anyway).
__device__ __forceinline__ float fast_sigmoid(float v) {
  return fast_rcp(1.0f + fast_exp2(v * -1.4426950408889634f));
}

/// The tanh GELU from e = exp(2 u), u = sqrt(2 / pi) (h + 0.044715 h^3): with s = 1 / (1 + e) and
/// p = e s (that is, (1 + tanh u) / 2 without its cancellation for negative u), GELU(h) = h p. The
/// exponent is held at most 126, so that e and s stay finite and normal: large h give h, very
/// negative ones 0.
struct GeluTanhParts {
  float s, p;
};

__device__ __forceinline__ GeluTanhParts gelu_tanh_parts(float h) {
  constexpr float kTwoLog2e = 2.0f * 1.4426950408889634f;
  constexpr float kScale = 0.7978845608028654f, kCubic = 0.044715f;  // sqrt(2 / pi), GELU's
  const float x = fminf(h * fmaf(kTwoLog2e * kScale * kCubic, h * h, kTwoLog2e * kScale), 126.0f);
  const float e = fast_exp2(x);
  const float s = fast_rcp(1.0f + e);
  return {s, e * s};
}

/// GELU(h) with the tanh approximation, in five instructions (see gelu_tanh_parts).
__device__ __forceinline__ float gelu_tanh_exp2(float h) { return h * gelu_tanh_parts(h).p; }

}  // namespace fusekit::detail
