// Warpgroup tensor-core building blocks (sm_90a): wgmma with A in registers and B in shared
// memory, float16 operands, float32 accumulation. Call only from kernels a launcher runs where
// has_warpgroup_mma(device) holds; compiled for any other target the MMA traps.
//
// Shared-memory operands (PTX ISA, "Matrix Descriptor Format"): B [K, N] is stored K-major, as
// rows of N, each holding 64 consecutive k (128 bytes), in 128-byte-swizzled atoms of 8 rows
// (1024 bytes, 1024-byte aligned): the 16-byte piece j of row r lies at piece j ^ (r % 8). K
// beyond 64 continues in a further block of N rows. One k16 step of such a block starts 32 bytes
// further on.
//
// Register fragments: warp w of the warpgroup owns rows 16 w .. 16 w + 15 of the 64-row tile;
// within a warp A and the accumulators have the layouts of mma.m16n8k16 (see cuda_mma.cuh), the
// accumulator of columns 8 j .. 8 j + 7 being d[4 j .. 4 j + 3].
#pragma once

#include <cstdint>

#include "common/cuda_mma.cuh"

namespace fusekit::detail {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FUSEKIT_WGMMA 1
#endif

/// Byte offset of element (row, k) in a 128-byte-swizzled K-major block of 2-byte elements.
__host__ __device__ constexpr std::uint32_t swizzled_offset(int row, int k) {
  return static_cast<std::uint32_t>(row) * 128 +
         ((static_cast<std::uint32_t>(k / 8) ^ static_cast<std::uint32_t>(row % 8)) * 16) +
         static_cast<std::uint32_t>(k % 8) * 2;
}

/// Descriptor of a 128-byte-swizzled K-major operand starting at `smem` (8-row atoms 1024 bytes
/// apart).
__device__ __forceinline__ std::uint64_t swizzled_descriptor(const void* smem) {
  const std::uint64_t address = shared_address(smem);
  return ((address & 0x3FFFF) >> 4)   // start address
         | (std::uint64_t{1} << 16)    // leading byte offset (unused when swizzled): 16 bytes
         | (std::uint64_t{1024 >> 4} << 32)  // stride byte offset: 8 rows of 128 bytes
         | (std::uint64_t{1} << 62);   // 128-byte swizzle
}

/// `descriptor` moved on by `bytes` (a multiple of 16): the start address is its low field, and
/// shared-memory addresses never carry out of it.
__device__ __forceinline__ std::uint64_t advance_descriptor(std::uint64_t descriptor,
                                                            std::uint32_t bytes) {
  return descriptor + (bytes >> 4);
}

/// Orders earlier register accesses before the warpgroup MMAs that follow.
__device__ __forceinline__ void wgmma_fence() {
#ifdef FUSEKIT_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifdef FUSEKIT_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
/// Waits until at most `Pending` committed groups are in flight.
template <int Pending>
__device__ __forceinline__ void wgmma_wait() {
#ifdef FUSEKIT_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
#endif
}

/// Makes this thread's ordinary shared-memory stores visible to the tensor cores (and the copy
/// engine); a barrier must follow before they read.
__device__ __forceinline__ void fence_proxy_async_shared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

/// d (+)= a [64, 16] b [16, N] for N = 64 or 128; `accumulate` false overwrites d.
template <int N>
__device__ __forceinline__ void wgmma_f16_rs(float (&d)[N / 2], const std::uint32_t (&a)[4],
                                             std::uint64_t b, bool accumulate);

template <>
__device__ __forceinline__ void wgmma_f16_rs<64>(float (&d)[32], const std::uint32_t (&a)[4],
                                                 std::uint64_t b, bool accumulate) {
#ifdef FUSEKIT_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
        "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(0), "r"(accumulate ? 1 : 0));
#else
  __trap();
#endif
}

template <>
__device__ __forceinline__ void wgmma_f16_rs<128>(float (&d)[64], const std::uint32_t (&a)[4],
                                                  std::uint64_t b, bool accumulate) {
#ifdef FUSEKIT_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %70, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, %69;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
        "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]),
        "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),
        "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]),
        "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(0), "r"(accumulate ? 1 : 0));
#else
  __trap();
#endif
}

}  // namespace fusekit::detail
