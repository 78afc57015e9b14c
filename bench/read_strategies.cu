// Ways of reading a buffer once, timed as the benchmarks time an operator: CUDA events around one
// launch, after a flush of L2 by writing 256 MB, median of 25. Each way sums the buffer (float32)
// so that nothing is read for nothing. Sizes: x of cheri_block inference in float32 at N512 L1024
// C128 (268 MB), its half (bf16, 134 MB) and N64 L2114 C128 (69 MB). sm_90a (bulk copies).
//
//   build/.../fusekit_read_strategies
//
// The question it answers (bench/NOTES.md): how close cheri_block's statistics pass, one read of
// x, is to what any read reaches after such a flush.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "common/bulk_copy.cuh"
#include "common/cuda_check.h"

namespace {

// The bulk-copy helpers exist in the device pass only (bulk_copy.cuh), hence the guards below.
#if defined(__CUDA_ARCH__)
using fusekit::detail::bulk_copy_to_shared;
using fusekit::detail::mbarrier_arrive;
using fusekit::detail::mbarrier_arrive_expect_bytes;
using fusekit::detail::mbarrier_init;
using fusekit::detail::mbarrier_init_fence;
using fusekit::detail::mbarrier_wait;
#endif

constexpr int kThreads = 256;

__device__ float sum4(float4 a) { return a.x + a.y + a.z + a.w; }

// The block's sum, added to out[blockIdx.x].
__device__ void add_block_sum(float v, float* out) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __shared__ float warps[kThreads / 32];
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.0f;
    for (int i = 0; i < kThreads / 32; ++i) s += warps[i];
    out[blockIdx.x] += s;
  }
}

// The sum of x[i], x[i + stride], ... below `end`, four loads in flight.
__device__ float sum_strided(const float4* x, std::size_t i, std::size_t end, std::size_t stride) {
  float s = 0.0f;
  for (; i + 3 * stride < end; i += 4 * stride) {
    s += sum4(__ldg(x + i)) + sum4(__ldg(x + i + stride)) + sum4(__ldg(x + i + 2 * stride)) +
         sum4(__ldg(x + i + 3 * stride));
  }
  for (; i < end; i += stride) s += sum4(__ldg(x + i));
  return s;
}

// Loads of 16 bytes striding over the whole buffer.
__global__ void __launch_bounds__(kThreads) grid_stride(const float4* x, std::size_t n4, float* out) {
  const std::size_t first = std::size_t{blockIdx.x} * kThreads + threadIdx.x;
  add_block_sum(sum_strided(x, first, n4, std::size_t{gridDim.x} * kThreads), out);
}

// A block a chunk of `chunk4` pieces of 16 bytes, loaded directly.
__global__ void __launch_bounds__(kThreads)
    direct_chunks(const float4* x, std::size_t n4, std::size_t chunk4, float* out) {
  const std::size_t lo = blockIdx.x * chunk4, hi = min(n4, lo + chunk4);
  add_block_sum(sum_strided(x, lo + threadIdx.x, hi, kThreads), out);
}

// A block a chunk, brought into shared memory by one bulk copy and summed there (the form of the
// staged statistics pass).
__global__ void __launch_bounds__(kThreads)
    staged_chunks(const float* x, std::size_t n, std::size_t chunk, float* out) {
#if defined(__CUDA_ARCH__)
  extern __shared__ __align__(128) float stage[];
  __shared__ std::uint64_t full;
  const std::size_t lo = blockIdx.x * chunk, hi = min(n, lo + chunk);
  const auto count = static_cast<std::uint32_t>(hi - lo);
  if (threadIdx.x == 0) {
    mbarrier_init(&full, 1);
    mbarrier_init_fence();
    mbarrier_arrive_expect_bytes(&full, count * 4);
    bulk_copy_to_shared(stage, x + lo, count * 4, &full);
  }
  __syncthreads();
  mbarrier_wait(&full, 0);
  float s = 0.0f;
  for (std::uint32_t i = 4 * threadIdx.x; i < count; i += 4 * kThreads) {
    s += sum4(*reinterpret_cast<const float4*>(stage + i));
  }
  add_block_sum(s, out);
#endif
}

// Persistent blocks, each with a ring of kStages chunks in shared memory, the bulk copies kept
// kStages - 1 chunks ahead of the sums.
template <int kStages>
__global__ void __launch_bounds__(kThreads)
    ring(const float* x, std::size_t n, std::size_t chunk, float* out) {
#if defined(__CUDA_ARCH__)
  extern __shared__ __align__(128) float stage[];
  __shared__ std::uint64_t full[kStages], empty[kStages];
  const std::size_t chunks = (n + chunk - 1) / chunk;
  const auto issue = [&](std::size_t c, int slot) {
    const std::size_t lo = c * chunk, hi = min(n, lo + chunk);
    const auto bytes = static_cast<std::uint32_t>(hi - lo) * 4;
    mbarrier_arrive_expect_bytes(&full[slot], bytes);
    bulk_copy_to_shared(stage + slot * chunk, x + lo, bytes, &full[slot]);
  };
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      mbarrier_init(&full[i], 1);
      mbarrier_init(&empty[i], kThreads / 32);
    }
    mbarrier_init_fence();
    for (int i = 0; i < kStages; ++i) {
      const std::size_t c = blockIdx.x + std::size_t{gridDim.x} * i;
      if (c < chunks) issue(c, i);
    }
  }
  __syncthreads();
  float s = 0.0f;
  int k = 0;
  for (std::size_t c = blockIdx.x; c < chunks; c += gridDim.x, ++k) {
    const int slot = k % kStages;
    const auto phase = static_cast<std::uint32_t>((k / kStages) & 1);
    mbarrier_wait(&full[slot], phase);
    const auto count = static_cast<std::uint32_t>(min(n, (c + 1) * chunk) - c * chunk);
    const float* part = stage + slot * chunk;
    for (std::uint32_t i = 4 * threadIdx.x; i < count; i += 4 * kThreads) {
      s += sum4(*reinterpret_cast<const float4*>(part + i));
    }
    __syncwarp();
    if (threadIdx.x % 32 == 0) mbarrier_arrive(&empty[slot]);
    const std::size_t next = c + std::size_t{gridDim.x} * kStages;
    if (threadIdx.x == 0 && next < chunks) {
      mbarrier_wait(&empty[slot], phase);
      issue(next, slot);
    }
  }
  add_block_sum(s, out);
#endif
}

// The tool's work; a failed CUDA call throws fusekit::Error, which main reports.
int run() {
  int sms = 0;
  FUSEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop{};
  FUSEKIT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# %s, %d SMs; median of 25 launches, each after a flush of L2 by writing 256 MB\n",
              prop.name, sms);
  const std::size_t max_n = std::size_t{512} * 1024 * 128;
  constexpr std::size_t kFlushBytes = std::size_t{256} << 20;
  float *x = nullptr, *out = nullptr;
  void* flush = nullptr;
  FUSEKIT_CUDA_CHECK(cudaMalloc(&x, max_n * 4));
  FUSEKIT_CUDA_CHECK(cudaMalloc(&out, std::size_t{1} << 24));
  FUSEKIT_CUDA_CHECK(cudaMalloc(&flush, kFlushBytes));
  FUSEKIT_CUDA_CHECK(cudaMemset(x, 0, max_n * 4));
  cudaEvent_t start, stop;
  FUSEKIT_CUDA_CHECK(cudaEventCreate(&start));
  FUSEKIT_CUDA_CHECK(cudaEventCreate(&stop));
  constexpr auto kSmem = cudaFuncAttributeMaxDynamicSharedMemorySize;
  FUSEKIT_CUDA_CHECK(cudaFuncSetAttribute(staged_chunks, kSmem, 48 << 10));
  FUSEKIT_CUDA_CHECK(cudaFuncSetAttribute(ring<3>, kSmem, 200 << 10));
  FUSEKIT_CUDA_CHECK(cudaFuncSetAttribute(ring<4>, kSmem, 200 << 10));
  FUSEKIT_CUDA_CHECK(cudaFuncSetAttribute(ring<6>, kSmem, 200 << 10));

  const auto time = [&](const char* name, std::size_t bytes, auto launch) {
    std::vector<float> us;
    for (int r = 0; r < 25; ++r) {
      FUSEKIT_CUDA_CHECK(cudaMemsetAsync(flush, r, kFlushBytes));
      FUSEKIT_CUDA_CHECK(cudaEventRecord(start));
      launch();
      FUSEKIT_CUDA_CHECK(cudaEventRecord(stop));
      FUSEKIT_CUDA_CHECK(cudaEventSynchronize(stop));
      float ms = 0.0f;
      FUSEKIT_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
      us.push_back(ms * 1000.0f);
    }
    FUSEKIT_CUDA_CHECK(cudaGetLastError());
    std::sort(us.begin(), us.end());
    const float median = us[us.size() / 2];
    std::printf("%-40s %8.1f us  %5.2f TB/s\n", name, median, bytes / median / 1e6);
  };

  for (const std::size_t n : {max_n, max_n / 2, std::size_t{64} * 2114 * 128}) {
    const std::size_t bytes = n * 4, n4 = n / 4;
    std::printf("-- %.1f MB\n", bytes / 1e6);
    const auto grid = [](std::size_t count, std::size_t per) {
      return static_cast<unsigned>((count + per - 1) / per);
    };
    time("loads striding, 4 blocks an SM", bytes,
         [&] { grid_stride<<<sms * 4, kThreads>>>(reinterpret_cast<const float4*>(x), n4, out); });
    time("loads striding, 8 blocks an SM", bytes,
         [&] { grid_stride<<<sms * 8, kThreads>>>(reinterpret_cast<const float4*>(x), n4, out); });
    for (const std::size_t kb : {16, 40}) {
      char name[64];
      std::snprintf(name, sizeof name, "loads, a block a %zu KB chunk", kb);
      const std::size_t chunk4 = kb * 1024 / 16;
      time(name, bytes, [&] {
        direct_chunks<<<grid(n4, chunk4), kThreads>>>(reinterpret_cast<const float4*>(x), n4,
                                                     chunk4, out);
      });
    }
    for (const std::size_t kb : {20, 40}) {
      char name[64];
      std::snprintf(name, sizeof name, "one bulk copy a block, %zu KB", kb);
      const std::size_t chunk = kb * 1024 / 4;
      time(name, bytes,
           [&] { staged_chunks<<<grid(n, chunk), kThreads, kb * 1024>>>(x, n, chunk, out); });
    }
    const std::size_t k8 = 8 * 1024 / 4, k16 = 16 * 1024 / 4, k32 = 32 * 1024 / 4;
    time("ring of 4 x 16 KB, 2 blocks an SM", bytes,
         [&] { ring<4><<<sms * 2, kThreads, 64 << 10>>>(x, n, k16, out); });
    time("ring of 6 x 16 KB, 2 blocks an SM", bytes,
         [&] { ring<6><<<sms * 2, kThreads, 96 << 10>>>(x, n, k16, out); });
    time("ring of 3 x 32 KB, 2 blocks an SM", bytes,
         [&] { ring<3><<<sms * 2, kThreads, 96 << 10>>>(x, n, k32, out); });
    time("ring of 6 x 32 KB, 1 block an SM", bytes,
         [&] { ring<6><<<sms, kThreads, 192 << 10>>>(x, n, k32, out); });
    time("ring of 6 x 8 KB, 4 blocks an SM", bytes,
         [&] { ring<6><<<sms * 4, kThreads, 48 << 10>>>(x, n, k8, out); });
  }
  return 0;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const fusekit::Error& e) {
    std::fprintf(stderr, "fusekit_read_strategies: %s\n", e.what());
    return 1;
  }
}
