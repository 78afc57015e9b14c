// sm_90 bulk copies (the TMA engine) from global to shared memory, completing on an mbarrier:
// plain byte ranges, and tiles of a tensor map. Call only from code compiled for
// __CUDA_ARCH__ >= 900. Addresses and sizes of plain copies must be multiples of 16 bytes.
#pragma once

#include <cuda.h>  // CUtensorMap (a type only: nothing here calls the driver)

#include <cstdint>

#include "common/cuda_mma.cuh"  // shared_address

namespace fusekit::detail {

/// Orders this thread's earlier ordinary shared-memory accesses before later accesses of the
/// async proxy (bulk copies, warpgroup MMAs); a barrier must follow before those run.
__device__ __forceinline__ void fence_proxy_async_shared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

/// Initialises `bar` to complete after `arrivals` arrivals (plus the expected transaction bytes).
__device__ __forceinline__ void mbarrier_init(std::uint64_t* bar, std::uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(arrivals));
}

/// Makes initialised barriers visible to the copy engine; follow with __syncthreads().
__device__ __forceinline__ void mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

/// Arrives on `bar` and announces `bytes` that bulk copies will deliver to it.
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(std::uint64_t* bar, std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)),
               "r"(bytes)
               : "memory");
}

/// Waits until the phase of `bar` with the given parity has completed. Each try suspends the
/// thread until the phase completes or up to 10 ms pass, so that a waiting warp does not spin
/// and take issue slots from the warps that have work.
__device__ __forceinline__ void mbarrier_wait(std::uint64_t* bar, std::uint32_t parity) {
  asm volatile(
      "{\n"
      " .reg .pred done;\n"
      "WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1, %2;\n"
      " @!done bra WAIT_%=;\n"
      "}\n" ::"r"(shared_address(bar)),
      "r"(parity), "r"(10000000)
      : "memory");
}

/// A position in a ring of `stages` slots: the slot and the parity of the phase its current use
/// completes (the parity to wait for on the slot's full barrier; its empty barrier's previous
/// phase has parity phase ^ 1).
struct RingPosition {
  int slot = 0;
  std::uint32_t phase = 0;
  /// Moves on by `by` slots (at most `stages`).
  __device__ __forceinline__ void advance(int by, int stages) {
    slot += by;
    if (slot >= stages) {
      slot -= stages;
      phase ^= 1u;
    }
  }
};

/// Copies `bytes` from global `src` to shared `dst`; completion is counted on `bar`.
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, std::uint32_t bytes,
                                                    std::uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          shared_address(dst)),
      "l"(src), "r"(bytes), "r"(shared_address(bar))
      : "memory");
}

/// Arrives on `bar` (an ordinary arrival, no bytes).
__device__ __forceinline__ void mbarrier_arrive(std::uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(bar)) : "memory");
}

/// Copies the box of `map` at (`inner`, `outer`) (elements of the contiguous axis, rows) to
/// shared `dst`, laid out and swizzled as the map says; completion is counted on `bar`. Parts of
/// the box outside the tensor arrive as zeros and still count their bytes.
__device__ __forceinline__ void tensor_copy_2d_to_shared(void* dst, const CUtensorMap* map, int inner,
                                                         int outer, std::uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];" ::"r"(shared_address(dst)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(inner), "r"(outer), "r"(shared_address(bar))
      : "memory");
}

/// An L2 cache policy that makes the lines a copy brings in the first to be evicted: for data
/// read once (a weight streamed through), so that it does not push out what stays in use.
__device__ __forceinline__ std::uint64_t l2_evict_first_policy() {
  std::uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

/// The L2 cache policy of a copy without a hint.
__device__ __forceinline__ std::uint64_t l2_evict_normal_policy() {
  std::uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

/// tensor_copy_2d_to_shared with an L2 cache policy for the lines it reads.
__device__ __forceinline__ void tensor_copy_2d_to_shared(void* dst, const CUtensorMap* map, int inner,
                                                         int outer, std::uint64_t* bar,
                                                         std::uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".L2::cache_hint [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(shared_address(dst)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(inner), "r"(outer), "r"(shared_address(bar)),
      "l"(policy)
      : "memory");
}

/// The same for a 4-D map, the box at (`c0`, `c1`, `c2`, `c3`), innermost first.
__device__ __forceinline__ void tensor_copy_4d_to_shared(void* dst, const CUtensorMap* map, int c0,
                                                         int c1, int c2, int c3,
                                                         std::uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];" ::"r"(shared_address(dst)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
      "r"(shared_address(bar))
      : "memory");
}

/// tensor_copy_4d_to_shared with an L2 cache policy for the lines it reads.
__device__ __forceinline__ void tensor_copy_4d_to_shared(void* dst, const CUtensorMap* map, int c0,
                                                         int c1, int c2, int c3,
                                                         std::uint64_t* bar,
                                                         std::uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".L2::cache_hint [%0], [%1, {%2, %3, %4, %5}], [%6], %7;" ::"r"(shared_address(dst)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
      "r"(shared_address(bar)), "l"(policy)
      : "memory");
}

/// Copies shared `src`, laid out and swizzled as `map` says, to the box of `map` at (`c0`, `c1`,
/// `c2`, `c3`) in global memory; parts of the box outside the tensor are not written. The copy
/// joins the issuing thread's open bulk group (see bulk_commit).
__device__ __forceinline__ void tensor_store_4d_from_shared(const CUtensorMap* map, int c0, int c1,
                                                            int c2, int c3, const void* src) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];" ::"l"(
          reinterpret_cast<std::uint64_t>(map)),
      "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(shared_address(src))
      : "memory");
}

/// Closes the issuing thread's open group of bulk copies from shared memory.
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

/// Waits until at most `Pending` of the thread's committed bulk groups may still read their
/// shared memory sources.
template <int Pending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(Pending) : "memory");
}

/// Waits until at most `Pending` of the thread's committed bulk groups are incomplete (their
/// writes done).
template <int Pending>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(Pending) : "memory");
}

/// Fetches `map` (a __grid_constant__ kernel parameter) into the copy engine's cache ahead of use.
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<std::uint64_t>(map)) : "memory");
}

#endif

}  // namespace fusekit::detail
