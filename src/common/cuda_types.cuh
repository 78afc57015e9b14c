// Device element types, conversions and 16-byte vector access for CUDA kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "fusekit/tensor.h"

namespace fusekit::detail {

/// The CUDA element type of a floating dtype (see dispatch_floating).
template <DType D>
struct CudaType;
template <>
struct CudaType<DType::Float32> {
  using type = float;
};
template <>
struct CudaType<DType::Float16> {
  using type = __half;
};
template <>
struct CudaType<DType::BFloat16> {
  using type = __nv_bfloat16;
};

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

/// Elements of T in one 16-byte access.
template <typename T>
inline constexpr int kVec16 = 16 / static_cast<int>(sizeof(T));

/// The two bfloat16 of a 32-bit word (the first in the low half) as floats. A bfloat16 is the upper
/// half of a float's bits, so each widens by one shift or one mask; taken element by element
/// (`__bfloat162float`, `__bfloat1622float2`), the upper one costs a byte permute as well.
__device__ __forceinline__ float2 widen_bf16x2(std::uint32_t w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}

/// The kVec16<T> elements of T in a 16-byte piece, as floats at v[0 .. kVec16<T> - 1].
template <typename T>
__device__ __forceinline__ void unpack16(uint4 raw, float* v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const std::uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 f = widen_bf16x2(w[k]);
      v[2 * k] = f.x;
      v[2 * k + 1] = f.y;
    }
  } else {
    union {
      uint4 raw;
      T e[kVec16<T>];
    } u{raw};
#pragma unroll
    for (int k = 0; k < kVec16<T>; ++k) v[k] = to_float(u.e[k]);
  }
}

/// kVec16<T> floats at v, rounded to T, as one 16-byte piece.
template <typename T>
__device__ __forceinline__ uint4 pack16(const float* v) {
  union {
    uint4 raw;
    T e[kVec16<T>];
  } u;
#pragma unroll
  for (int k = 0; k < kVec16<T>; ++k) u.e[k] = from_float<T>(v[k]);
  return u.raw;
}

/// Loads VEC consecutive elements as floats: one 16-byte streaming load when VEC == kVec16<T>
/// (the address must be 16-byte aligned), else VEC scalar loads.
template <typename T, int VEC>
__device__ __forceinline__ void load_floats(const T* p, float (&v)[VEC]) {
  if constexpr (VEC * sizeof(T) == 16) {
    unpack16<T>(__ldcs(reinterpret_cast<const uint4*>(p)), v);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] = to_float(p[k]);
  }
}

/// V consecutive elements as floats, through L1 (read-only path): whole 16-byte pieces when V
/// elements fill them (the address must then be 16-byte aligned), else one element at a time.
template <typename T, int V>
__device__ __forceinline__ void load_vec(const T* p, float (&v)[V]) {
  if constexpr (V > 1 && V * sizeof(T) % 16 == 0) {
#pragma unroll
    for (int piece = 0; piece < V / kVec16<T>; ++piece) {
      unpack16<T>(__ldg(reinterpret_cast<const uint4*>(p) + piece), v + piece * kVec16<T>);
    }
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = to_float(p[k]);
  }
}

/// V floats, rounded to T, as load_vec reads them, by ordinary stores (cached: for outputs read
/// again soon).
template <typename T, int V>
__device__ __forceinline__ void store_vec(T* p, const float (&v)[V]) {
  if constexpr (V > 1 && V * sizeof(T) % 16 == 0) {
#pragma unroll
    for (int piece = 0; piece < V / kVec16<T>; ++piece) {
      reinterpret_cast<uint4*>(p)[piece] = pack16<T>(v + piece * kVec16<T>);
    }
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) p[k] = from_float<T>(v[k]);
  }
}

/// Stores VEC floats, rounded to T: whole 16-byte pieces when VEC elements fill them (the address
/// must then be 16-byte aligned), else one element at a time. The pieces are evict-first
/// (streaming) stores, for outputs that nothing reads again soon: their lines are the first to
/// leave L2, and what is still to be read stays.
template <typename T, int VEC>
__device__ __forceinline__ void store_floats(T* p, const float (&v)[VEC]) {
  if constexpr (VEC * sizeof(T) % 16 == 0) {
#pragma unroll
    for (int piece = 0; piece < VEC / kVec16<T>; ++piece) {
      __stcs(reinterpret_cast<uint4*>(p) + piece, pack16<T>(v + piece * kVec16<T>));
    }
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) p[k] = from_float<T>(v[k]);
  }
}

/// Stores two floats, rounded to T, at p and p + 1 in one access (p aligned to two elements).
template <typename T>
__device__ __forceinline__ void store_pair(T* p, float a, float b);
template <>
__device__ __forceinline__ void store_pair<float>(float* p, float a, float b) {
  *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
template <>
__device__ __forceinline__ void store_pair<__half>(__half* p, float a, float b) {
  *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
}
template <>
__device__ __forceinline__ void store_pair<__nv_bfloat16>(__nv_bfloat16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}

/// Reads VEC elements, whole 16-byte pieces, from shared memory as floats.
template <typename T, int VEC>
__device__ __forceinline__ void load_shared_floats(const void* p, float (&v)[VEC]) {
  static_assert(VEC * sizeof(T) % 16 == 0, "whole 16-byte pieces");
#pragma unroll
  for (int piece = 0; piece < VEC / kVec16<T>; ++piece) {
    unpack16<T>(static_cast<const uint4*>(p)[piece], v + piece * kVec16<T>);
  }
}

__host__ __device__ inline bool is_aligned(const void* p, std::size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

constexpr std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

}  // namespace fusekit::detail
