// Warp-level tensor-core building blocks (sm_80 and later): asynchronous 16-byte copies into
// shared memory, ldmatrix fragment loads, the m16n8k16 float16 and bfloat16 MMAs and the m16n8k8
// TF32 MMA, all with float32 accumulation.
//
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16"): lane l holds, of the 16x8
// accumulator tile, rows l/4 (c[0], c[1]) and l/4 + 8 (c[2], c[3]), columns 2 (l % 4) + {0, 1};
// the m16n8k8 TF32 accumulator has the same layout.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace fusekit::detail {

__device__ __forceinline__ std::uint32_t shared_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

/// 16 bytes global -> shared without passing through registers (cached in L2 only).
__device__ __forceinline__ void cp_async_16(void* smem, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(smem)),
               "l"(global));
}
/// As cp_async_16 when `valid`; otherwise the 16 bytes at `smem` are zeroed and nothing is read
/// (`global` must still be a valid address).
__device__ __forceinline__ void cp_async_16_or_zero(void* smem, const void* global, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(smem)),
               "l"(global), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
/// Waits until at most `Pending` committed groups are still in flight.
template <int Pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
}

/// Barrier `id` (1 to 15; 0 is __syncthreads) among `threads` threads (a multiple of 32).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
/// Arrives at barrier `id` without waiting: the other side of a named_barrier_sync of `threads`.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

/// Four 8x8 float16 matrices; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(smem)));
}
/// Two 8x8 matrices; lanes 0-15 give the addresses.
__device__ __forceinline__ void ldmatrix_x2(std::uint32_t (&r)[2], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(shared_address(smem)));
}

/// As ldmatrix_x4, each 8x8 matrix transposed: the fragment of a row-major B operand.
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(smem)));
}

/// Four 8x8 float16 matrices from their fragments (lane l holds row l / 4, columns 2 (l % 4) and
/// the next, of each), each stored transposed: lane l gives the address of row l % 8 of matrix
/// l / 8, which receives that matrix's column l % 8. sm_90 and later.
__device__ __forceinline__ void stmatrix_x4_trans(void* smem, const std::uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                   shared_address(smem)),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

/// Two floats rounded to float16, as the register of an MMA fragment (lo in the low half).
__device__ __forceinline__ std::uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const std::uint32_t*>(&h);
}

/// The two floats of a register holding two float16 (lo in the low half), as pack_half2 made it.
__device__ __forceinline__ float2 unpack_half2(std::uint32_t v) {
  return __half22float2(*reinterpret_cast<const __half2*>(&v));
}

/// c += a b for a 16x16 (row-major) by 16x8 (column-major) float16 tile pair.
__device__ __forceinline__ void mma_16816(float (&c)[4], const std::uint32_t (&a)[4],
                                          std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/// As mma_16816, for bfloat16 tiles.
__device__ __forceinline__ void mma_16816_bf16(float (&c)[4], const std::uint32_t (&a)[4],
                                               std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/// x rounded to the nearest TF32 value (10-bit mantissa), as the bits of a float32.
__device__ __forceinline__ std::uint32_t to_tf32(float x) {
  std::uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

/// c += a b for a 16x8 (row-major) by 8x8 (column-major) TF32 tile pair. Fragments (PTX ISA,
/// "mma.m16n8k8" for .tf32): lane l holds a[0] = A[l/4][l%4], a[1] = A[l/4 + 8][l%4],
/// a[2] = A[l/4][l%4 + 4], a[3] = A[l/4 + 8][l%4 + 4]; b0 = B[l%4][l/4], b1 = B[l%4 + 4][l/4].
__device__ __forceinline__ void mma_1688_tf32(float (&c)[4], const std::uint32_t (&a)[4],
                                              std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace fusekit::detail
