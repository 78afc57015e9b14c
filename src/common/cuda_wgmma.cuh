// Warpgroup tensor-core building blocks (sm_90a): wgmma with both operands in shared memory
// (float16 or bfloat16) or with A in registers, float32 accumulation. Call only from
// kernels a launcher runs where has_warpgroup_mma(device) holds; compiled for any other target
// the MMA traps.
//
// Shared-memory operands (PTX ISA, "Matrix Descriptor Format"): A [M, K] and B [K, N] are stored
// K-major, as rows of M (or N), each holding 64 consecutive k (128 bytes), in 128-byte-swizzled
// atoms of 8 rows (1024 bytes, 1024-byte aligned): the 16-byte piece j of row r lies at piece
// j ^ (r % 8), which is how the copy engine writes a box of a tensor map with 128-byte swizzle
// (see tensor_map.h). K beyond 64 continues in a further block of rows. One k16 step of such a
// block starts 32 bytes further on.
//
// Register fragments: warp w of the warpgroup owns rows 16 w .. 16 w + 15 of the 64-row tile;
// within a warp A and the accumulators have the layouts of mma.m16n8k16 (see cuda_mma.cuh), the
// accumulator of columns 8 j .. 8 j + 7 being d[4 j .. 4 j + 3].
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/bulk_copy.cuh"  // fence_proxy_async_shared
#include "common/cuda_mma.cuh"

namespace fusekit::detail {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FUSEKIT_WGMMA 1
#endif

/// v as lane 0 holds it, through a shuffle, which the compiler knows gives every lane the same
/// value: what derives from it (a warp's shared-memory slots, its MMA descriptors) is then
/// computed once a warp in the uniform registers the MMAs read descriptors from, rather than in
/// every lane and moved over one register at a time. For values the same in every lane that the
/// compiler cannot see to be (threadIdx.x / 32, counters of loops it takes as divergent). Call
/// with the whole warp.
__device__ __forceinline__ int warp_uniform(int v) { return __shfl_sync(0xffffffffu, v, 0); }

/// Byte offset of element (row, k) in a 128-byte-swizzled K-major block of 2-byte elements (row
/// and k not negative; taken unsigned, so that % 8 and / 8 are masks and shifts, not the signed
/// forms' four instructions).
__host__ __device__ constexpr std::uint32_t swizzled_offset(int row, int k) {
  const auto r = static_cast<std::uint32_t>(row), c = static_cast<std::uint32_t>(k);
  return r * 128 + (((c / 8) ^ (r % 8)) * 16) + (c % 8) * 2;
}

/// Descriptor of a 128-byte-swizzled K-major operand starting at `smem`, its 8-row atoms
/// `atom_stride` bytes apart (1024: packed; a multiple of 1024 below 256 KiB).
__device__ __forceinline__ std::uint64_t swizzled_descriptor(const void* smem,
                                                             std::uint32_t atom_stride = 1024) {
  const std::uint64_t address = shared_address(smem);
  return ((address & 0x3FFFF) >> 4)   // start address
         | (std::uint64_t{1} << 16)    // leading byte offset (unused when swizzled): 16 bytes
         | (std::uint64_t{(atom_stride >> 4) & 0x3FFF} << 32)  // stride byte offset
         | (std::uint64_t{1} << 62);   // 128-byte swizzle
}

/// Descriptor of a 128-byte-swizzled N-major (MN-major) B operand at `smem`: rows of k, each
/// 64 consecutive n (128 bytes), 8-row atoms 1024 bytes apart along k, and n 64 .. 127 in a
/// further such block `next_n_bytes` on (a multiple of 16, below 256 KiB).
__device__ __forceinline__ std::uint64_t mn_major_descriptor(const void* smem,
                                                             std::uint32_t next_n_bytes) {
  const std::uint64_t address = shared_address(smem);
  return ((address & 0x3FFFF) >> 4)                        // start address
         | (std::uint64_t{(next_n_bytes >> 4) & 0x3FFF} << 16)  // leading byte offset: along n
         | (std::uint64_t{1024 >> 4} << 32)                // stride byte offset: 8 rows of k
         | (std::uint64_t{1} << 62);                       // 128-byte swizzle
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

/// Lowers (raises) the registers of every thread of the calling warpgroup to N, a multiple of 8
/// from 24 to 256, so that warpgroups with light work leave registers to the others: a kernel
/// launched at R registers a thread may raise some warpgroups above R by what others gave up.
template <int N>
__device__ __forceinline__ void warpgroup_lower_registers() {
  static_assert(N % 8 == 0 && N >= 24 && N <= 256);
#ifdef FUSEKIT_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void warpgroup_raise_registers() {
  static_assert(N % 8 == 0 && N >= 24 && N <= 256);
#ifdef FUSEKIT_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}

/// Makes the compiler take `regs` as read and written at this point: placed after a wait, it
/// keeps reads of a warpgroup MMA's accumulators from moving above the wait, and the registers of
/// its A operand from being reused before it.
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float (&regs)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(regs[i])::"memory");
}
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(std::uint32_t (&regs)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(regs[i][j])::"memory");
  }
}

// The accumulators of one MMA as asm operands (d[o] .. d[o + 7] and so on), and their names
// in the instruction text.
#define FUSEKIT_WGMMA_ACC4(d, o) "+f"(d[o + 0]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3])
#define FUSEKIT_WGMMA_ACC8(d, o)                                                               \
  "+f"(d[o + 0]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3]), "+f"(d[o + 4]), "+f"(d[o + 5]), \
      "+f"(d[o + 6]), "+f"(d[o + 7])
#define FUSEKIT_WGMMA_ACC16(d, o) FUSEKIT_WGMMA_ACC8(d, o), FUSEKIT_WGMMA_ACC8(d, o + 8)
#define FUSEKIT_WGMMA_ACC32(d, o) FUSEKIT_WGMMA_ACC16(d, o), FUSEKIT_WGMMA_ACC16(d, o + 16)
#define FUSEKIT_WGMMA_ACC64(d, o) FUSEKIT_WGMMA_ACC32(d, o), FUSEKIT_WGMMA_ACC32(d, o + 32)
#define FUSEKIT_WGMMA_ACC40(d, o) FUSEKIT_WGMMA_ACC32(d, o), FUSEKIT_WGMMA_ACC8(d, o + 32)
#define FUSEKIT_WGMMA_ACC80(d, o) FUSEKIT_WGMMA_ACC64(d, o), FUSEKIT_WGMMA_ACC16(d, o + 64)
#define FUSEKIT_WGMMA_REGS4 "%0, %1, %2, %3"
#define FUSEKIT_WGMMA_REGS8 "%0, %1, %2, %3, %4, %5, %6, %7"
#define FUSEKIT_WGMMA_REGS16 FUSEKIT_WGMMA_REGS8 ", %8, %9, %10, %11, %12, %13, %14, %15"
#define FUSEKIT_WGMMA_REGS32                                                                   \
  FUSEKIT_WGMMA_REGS16 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, "   \
                       "%29, %30, %31"
#define FUSEKIT_WGMMA_REGS64                                                                   \
  FUSEKIT_WGMMA_REGS32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, "   \
                       "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, "     \
                       "%58, %59, %60, %61, %62, %63"
#define FUSEKIT_WGMMA_REGS40 FUSEKIT_WGMMA_REGS32 ", %32, %33, %34, %35, %36, %37, %38, %39"
#define FUSEKIT_WGMMA_REGS80                                                                   \
  FUSEKIT_WGMMA_REGS64 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, "   \
                       "%77, %78, %79"

// One wgmma.m64nNk16 with float32 accumulators: A from shared memory (SS: operands %R, %R+1 are
// the two descriptors) or from four registers (RS: %R .. %R+3, then B's descriptor), the
// accumulate predicate last. A is K-major; B K-major, or N-major where TRANS_B is 1.
#define FUSEKIT_WGMMA_SS(N, NREGS, TYPE, A, B, P, TRANS_B)                                      \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #P ", 0;\n"                                 \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " "              \
               "{" FUSEKIT_WGMMA_REGS##NREGS "}, %" #A ", %" #B ", p, 1, 1, 0, " #TRANS_B ";\n}\n" \
               : FUSEKIT_WGMMA_ACC##NREGS(d, 0)                                                 \
               : "l"(a), "l"(b), "r"(scale_d))
#define FUSEKIT_WGMMA_RS(N, NREGS, TYPE, A0, A1, A2, A3, B, P, TRANS_B)                         \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #P ", 0;\n"                                  \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " "               \
               "{" FUSEKIT_WGMMA_REGS##NREGS "}, {%" #A0 ", %" #A1 ", %" #A2 ", %" #A3 "}, "     \
               "%" #B ", p, 1, 1, " #TRANS_B ";\n}\n"                                          \
               : FUSEKIT_WGMMA_ACC##NREGS(d, 0)                                                  \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d))

/// d (+)= a [64, 16] b [16, N], both operands in shared memory (descriptors `a` and `b`), T
/// __half or __nv_bfloat16, N = 16, 32, 64, 80, 128 or 160; `accumulate` false overwrites d.
/// A is K-major; B K-major, or with kMnMajorB (N = 64 only) N-major as wgmma_rs takes it.
template <typename T, int N, bool kMnMajorB = false>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], std::uint64_t a, std::uint64_t b,
                                         bool accumulate) {
  static_assert(N == 16 || N == 32 || N == 64 || N == 80 || N == 128 || N == 160);
  static_assert(!kMnMajorB || N == 64);
#ifdef FUSEKIT_WGMMA
  const int scale_d = accumulate ? 1 : 0;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (kMnMajorB) {
    if constexpr (kBf16) FUSEKIT_WGMMA_SS(64, 32, "bf16", 32, 33, 34, 1);
    else FUSEKIT_WGMMA_SS(64, 32, "f16", 32, 33, 34, 1);
  } else if constexpr (N == 16) {
    if constexpr (kBf16) FUSEKIT_WGMMA_SS(16, 8, "bf16", 8, 9, 10, 0);
    else FUSEKIT_WGMMA_SS(16, 8, "f16", 8, 9, 10, 0);
  } else if constexpr (N == 32) {
    if constexpr (kBf16) FUSEKIT_WGMMA_SS(32, 16, "bf16", 16, 17, 18, 0);
    else FUSEKIT_WGMMA_SS(32, 16, "f16", 16, 17, 18, 0);
  } else if constexpr (N == 64) {
    if constexpr (kBf16) FUSEKIT_WGMMA_SS(64, 32, "bf16", 32, 33, 34, 0);
    else FUSEKIT_WGMMA_SS(64, 32, "f16", 32, 33, 34, 0);
  } else if constexpr (N == 80) {
    if constexpr (kBf16) FUSEKIT_WGMMA_SS(80, 40, "bf16", 40, 41, 42, 0);
    else FUSEKIT_WGMMA_SS(80, 40, "f16", 40, 41, 42, 0);
  } else if constexpr (N == 128) {
    if constexpr (kBf16) FUSEKIT_WGMMA_SS(128, 64, "bf16", 64, 65, 66, 0);
    else FUSEKIT_WGMMA_SS(128, 64, "f16", 64, 65, 66, 0);
  } else {
    if constexpr (kBf16) FUSEKIT_WGMMA_SS(160, 80, "bf16", 80, 81, 82, 0);
    else FUSEKIT_WGMMA_SS(160, 80, "f16", 80, 81, 82, 0);
  }
#else
  __trap();
#endif
}

/// d (+)= a [64, 16] b [16, N] for N = 8, 64 or 128, T __half or __nv_bfloat16, A from registers
/// (the mma.m16n8k16 A fragment of the thread's warp); `accumulate` false overwrites d. B is
/// K-major (see above), or with kMnMajorB (N = 64 or 128) N-major: rows of 16 k each holding 64
/// consecutive n (128 bytes) in 128-byte-swizzled atoms of 8 k, the next 8 k 1024 bytes on and n
/// beyond 64 in a further block `b`'s leading byte offset away (see mn_major_descriptor).
template <typename T, int N, bool kMnMajorB = false>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const std::uint32_t (&a)[4],
                                         std::uint64_t b, bool accumulate) {
  static_assert(N == 8 || N == 64 || N == 128);
  static_assert(N != 8 || !kMnMajorB);
#ifdef FUSEKIT_WGMMA
  const int scale_d = accumulate ? 1 : 0;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (N == 8) {
    if constexpr (kBf16) FUSEKIT_WGMMA_RS(8, 4, "bf16", 4, 5, 6, 7, 8, 9, 0);
    else FUSEKIT_WGMMA_RS(8, 4, "f16", 4, 5, 6, 7, 8, 9, 0);
  } else if constexpr (N == 64) {
    if constexpr (kBf16 && kMnMajorB) FUSEKIT_WGMMA_RS(64, 32, "bf16", 32, 33, 34, 35, 36, 37, 1);
    else if constexpr (kBf16) FUSEKIT_WGMMA_RS(64, 32, "bf16", 32, 33, 34, 35, 36, 37, 0);
    else if constexpr (kMnMajorB) FUSEKIT_WGMMA_RS(64, 32, "f16", 32, 33, 34, 35, 36, 37, 1);
    else FUSEKIT_WGMMA_RS(64, 32, "f16", 32, 33, 34, 35, 36, 37, 0);
  } else {
    if constexpr (kBf16 && kMnMajorB) FUSEKIT_WGMMA_RS(128, 64, "bf16", 64, 65, 66, 67, 68, 69, 1);
    else if constexpr (kBf16) FUSEKIT_WGMMA_RS(128, 64, "bf16", 64, 65, 66, 67, 68, 69, 0);
    else if constexpr (kMnMajorB) FUSEKIT_WGMMA_RS(128, 64, "f16", 64, 65, 66, 67, 68, 69, 1);
    else FUSEKIT_WGMMA_RS(128, 64, "f16", 64, 65, 66, 67, 68, 69, 0);
  }
#else
  __trap();
#endif
}

/// d (+)= a [64, 16] b [16, 72] with b N-major as wgmma_rs<T, 64, true> takes it, columns 64 ..
/// 71 in the further block at `b`'s leading byte offset: columns 0 .. 63 into d, 64 .. 71 into
/// d8 (the accumulator layout of one more 8-column chunk).
template <typename T>
__device__ __forceinline__ void wgmma_rs_n72(float (&d)[32], float (&d8)[4],
                                             const std::uint32_t (&a)[4], std::uint64_t b,
                                             bool accumulate) {
#ifdef FUSEKIT_WGMMA
  const int scale_d = accumulate ? 1 : 0;
#define FUSEKIT_WGMMA_N72(TYPE)                                                                 \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %41, 0;\n"                                   \
               "wgmma.mma_async.sync.aligned.m64n72k16.f32." TYPE "." TYPE " "                   \
               "{" FUSEKIT_WGMMA_REGS32 ", %32, %33, %34, %35}, {%36, %37, %38, %39}, %40, p, "  \
               "1, 1, 1;\n}\n"                                                                  \
               : FUSEKIT_WGMMA_ACC32(d, 0), FUSEKIT_WGMMA_ACC4(d8, 0)                            \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d))
  if constexpr (std::is_same_v<T, __nv_bfloat16>) FUSEKIT_WGMMA_N72("bf16");
  else FUSEKIT_WGMMA_N72("f16");
#undef FUSEKIT_WGMMA_N72
#else
  __trap();
#endif
}

}  // namespace fusekit::detail
