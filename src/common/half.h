// Host-side float16 and bfloat16 storage types with round-to-nearest-even conversions, for the
// CPU backend (which must build without the CUDA toolkit).
#pragma once

#include <bit>
#include <cstdint>

#include "fusekit/tensor.h"

namespace fusekit::detail {

struct Half {
  std::uint16_t bits;
};
struct BFloat16 {
  std::uint16_t bits;
};

inline float to_float(float v) { return v; }
inline double to_float(double v) { return v; }

inline float to_float(BFloat16 v) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(v.bits) << 16);
}

inline float to_float(Half v) {
  const std::uint32_t sign = static_cast<std::uint32_t>(v.bits & 0x8000u) << 16;
  std::uint32_t exp = (v.bits >> 10) & 0x1fu;
  std::uint32_t man = v.bits & 0x3ffu;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (man << 13));  // inf, NaN
  if (exp == 0) {
    if (man == 0) return std::bit_cast<float>(sign);
    // subnormal half: normalise into a float
    exp = 127 - 15 + 1;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --exp;
    }
    man &= 0x3ffu;
    return std::bit_cast<float>(sign | (exp << 23) | (man << 13));
  }
  return std::bit_cast<float>(sign | ((exp + 127 - 15) << 23) | (man << 13));
}

template <typename T>
T from_float(float v);

template <>
inline float from_float<float>(float v) {
  return v;
}
template <>
inline double from_float<double>(float v) {
  return v;
}

template <>
inline BFloat16 from_float<BFloat16>(float v) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {static_cast<std::uint16_t>((u >> 16) | 0x40u)};
  const std::uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  return {static_cast<std::uint16_t>(rounded >> 16)};
}

template <>
inline Half from_float<Half>(float v) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(v);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return {static_cast<std::uint16_t>(sign | 0x7e00u)};  // NaN
  if (abs >= 0x477ff000u) return {static_cast<std::uint16_t>(sign | 0x7c00u)};  // rounds to inf
  if (abs < 0x38800000u) {
    // result is subnormal or zero: shift the full mantissa into place, round to nearest even
    if (abs < 0x33000000u) return {sign};  // below half of the smallest subnormal
    const std::uint32_t exp = abs >> 23;
    const std::uint32_t man = (abs & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126 - exp;  // 14..24
    std::uint32_t r = man >> shift;
    const std::uint32_t rem = man & ((1u << shift) - 1u);
    const std::uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return {static_cast<std::uint16_t>(sign | r)};
  }
  const std::uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return {static_cast<std::uint16_t>(sign | ((rounded - 0x38000000u) >> 13))};
}

/// The CPU element type of a floating dtype (see dispatch_floating).
template <DType D>
struct HostType;
template <>
struct HostType<DType::Float32> {
  using type = float;
};
template <>
struct HostType<DType::Float16> {
  using type = Half;
};
template <>
struct HostType<DType::BFloat16> {
  using type = BFloat16;
};

}  // namespace fusekit::detail
