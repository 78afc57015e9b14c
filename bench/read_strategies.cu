// Ways of reading a buffer once, timed as the benchmarks time an operator: CUDA events around one
// launch, after a flush of L2 by writing 256 MB, median of 25. Each way sums the buffer (float32)
// so that nothing is read for nothing. Sizes: x of cheri_block inference in float32 at N512 L1024
// C128 (268 MB), its half (bf16, 134 MB) and N64 L2114 C128 (69 MB). sm_90a (bulk copies).
//
//   build/.../fusekit_read_strategies
//
// The questions it answers (bench/NOTES.md): how close cheri_block's statistics pass, one read of
// x, is to what any read reaches after such a flush; and what one SM carries of that pass's work,
// alone and beside other work, were it streamed by a few SMs.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "common/bulk_copy.cuh"
#include "common/cuda_check.h"
#include "common/cuda_types.cuh"  // load_shared_floats

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
using fusekit::detail::load_shared_floats;

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

// A few multiprocessors streaming a plane [rows, 128] beside other work: persistent blocks, one
// an SM, each with a producer warp that keeps kStages - 1 parts of `part_rows` rows in flight by
// bulk copies, and 16 warps that take each part's rows. What they compute of each value
// (StreamWork): a plain sum; what cheri_block's statistics pass computes (a dilated convolution of
// three taps d = 4 rows apart, within the part, then the shifted sum and sum of squares, summed in
// float over a row's channels and then in double); or the raw moments that give the same
// statistics with less work a value, each channel's sum, sum of squares and products with the
// values d and 2 d rows on (each lane walking rows d apart, so that it loads each row once). The
// question (bench/NOTES.md): at what rate one SM can carry the statistics, were they streamed
// beside the fused kernel instead of in a pass of their own.
constexpr int kStreamWarps = 16;
enum class StreamWork { kSum, kConv, kRawMoments };

template <typename T, int kStages, StreamWork kWork>
__global__ void __launch_bounds__((kStreamWarps + 1) * 32, 1)
    stream_parts(const T* x, std::size_t rows, int part_rows, float* out) {
#if defined(__CUDA_ARCH__)
  constexpr int kC = 128, kV = 16 / sizeof(T), kRowThreads = kC / kV;
  constexpr int kLanes = kStreamWarps * 32 / kRowThreads;
  extern __shared__ __align__(128) unsigned char stage_raw[];
  __shared__ std::uint64_t full[kStages], empty[kStages];
  const T* stage = reinterpret_cast<const T*>(stage_raw);
  const std::size_t parts = (rows + part_rows - 1) / part_rows;
  const int warp = static_cast<int>(threadIdx.x / 32);
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      mbarrier_init(&full[i], 1);
      mbarrier_init(&empty[i], kStreamWarps);
    }
    mbarrier_init_fence();
  }
  __syncthreads();
  if (warp == kStreamWarps) {  // the producer warp
    if (threadIdx.x % 32 != 0) return;
    int k = 0;
    for (std::size_t q = blockIdx.x; q < parts; q += gridDim.x, ++k) {
      const int slot = k % kStages;
      if (k >= kStages) mbarrier_wait(&empty[slot], ((k / kStages) & 1) ^ 1);
      const std::size_t lo = q * part_rows, hi = min(rows, lo + part_rows);
      const auto bytes = static_cast<std::uint32_t>((hi - lo) * kC * sizeof(T));
      mbarrier_arrive_expect_bytes(&full[slot], bytes);
      bulk_copy_to_shared(stage_raw + static_cast<std::size_t>(slot) * part_rows * kC * sizeof(T),
                          x + lo * kC, bytes, &full[slot]);
    }
    return;
  }
  const int t = static_cast<int>(threadIdx.x), c0 = (t % kRowThreads) * kV;
  float wl[kV], wm[kV], wr[kV];
#pragma unroll
  for (int k = 0; k < kV; ++k) {
    wl[k] = 0.25f + 1e-3f * (c0 + k);
    wm[k] = 0.5f - 1e-3f * (c0 + k);
    wr[k] = 0.25f;
  }
  float shift = 0.0f, plain = 0.0f;
  double s1 = 0.0, s2 = 0.0;
  float raw[4][kV] = {};  // sum, squares, products with the values d and 2 d rows on
  int k = 0;
  for (std::size_t q = blockIdx.x; q < parts; q += gridDim.x, ++k) {
    const int slot = k % kStages;
    mbarrier_wait(&full[slot], (k / kStages) & 1);
    const int count = static_cast<int>(min(rows, (q + 1) * part_rows) - q * part_rows);
    const T* part = stage + static_cast<std::size_t>(slot) * part_rows * kC;
    if constexpr (kWork == StreamWork::kRawMoments) {
      // row lane j walks `steps` rows 4 apart from row j % 4 + 4 steps (j / 4)
      const int lane = t / kRowThreads, steps = part_rows / kLanes;
      const int first = lane % 4 + 4 * (lane / 4) * steps;
      const auto row = [&](int r) { return part + min(r, count - 1) * kC + c0; };
      float w0[kV], w1[kV];
      load_shared_floats<T, kV>(row(first), w0);
      load_shared_floats<T, kV>(row(first + 4), w1);
#pragma unroll 4
      for (int i = 0; i < steps; ++i) {
        float w2[kV];
        load_shared_floats<T, kV>(row(first + 4 * i + 8), w2);
#pragma unroll
        for (int c = 0; c < kV; ++c) {
          raw[0][c] += w0[c];
          raw[1][c] = fmaf(w0[c], w0[c], raw[1][c]);
          raw[2][c] = fmaf(w0[c], w1[c], raw[2][c]);
          raw[3][c] = fmaf(w0[c], w2[c], raw[3][c]);
          w0[c] = w1[c];
          w1[c] = w2[c];
        }
      }
    } else {
      for (int r = t / kRowThreads; r < count; r += kLanes) {
        float xm[kV];
        load_shared_floats<T, kV>(part + r * kC + c0, xm);
        if constexpr (kWork == StreamWork::kConv) {
          float xl[kV], xr[kV];
          load_shared_floats<T, kV>(part + max(r - 4, 0) * kC + c0, xl);
          load_shared_floats<T, kV>(part + min(r + 4, count - 1) * kC + c0, xr);
          if (k == 0 && r < kLanes) shift = wm[0] * xm[0] + wl[0] * xl[0] + wr[0] * xr[0];
          float e1 = 0.0f, e2 = 0.0f;
#pragma unroll
          for (int i = 0; i < kV; ++i) {
            const float e = fmaf(wl[i], xl[i], fmaf(wr[i], xr[i], fmaf(wm[i], xm[i], -shift)));
            e1 += e;
            e2 = fmaf(e, e, e2);
          }
          s1 += e1;
          s2 += e2;
        } else {
#pragma unroll
          for (int i = 0; i < kV; ++i) plain += xm[i];
        }
      }
    }
    __syncwarp();
    if (t % 32 == 0) mbarrier_arrive(&empty[slot]);
  }
#pragma unroll
  for (int c = 0; c < kV; ++c) {
    s1 += static_cast<double>(raw[0][c]) + raw[1][c] + raw[2][c] + raw[3][c];
  }
  const float v = plain + static_cast<float>(s1 + s2);
  if (v == 12345.0f) out[blockIdx.x] = v;  // keeps the work; never true for the zeros read here
#endif
}

// Other work for the rest of the SMs: copies `n4` pieces of 16 bytes, four loads in flight a
// thread, as a fused kernel's reads of x and writes of out load the memory system.
__global__ void __launch_bounds__(1024)
    copy_pieces(const float4* from, float4* to, std::size_t n4) {
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  std::size_t i = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n4; i += 4 * stride) {
    const float4 a = from[i], b = from[i + stride];
    const float4 c = from[i + 2 * stride], d = from[i + 3 * stride];
    to[i] = a;
    to[i + stride] = b;
    to[i + 2 * stride] = c;
    to[i + 3 * stride] = d;
  }
  for (; i < n4; i += stride) to[i] = from[i];
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

  // A failure inside a row (an asynchronous kernel error surfaces at the next check) names it.
  const auto time = [&](const char* name, std::size_t bytes, auto launch) {
    std::vector<float> us;
    try {
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
    } catch (const fusekit::Error& e) {
      throw fusekit::Error(std::string(name) + ": " + e.what());
    }
    std::sort(us.begin(), us.end());
    const float median = us[us.size() / 2];
    std::printf("%-40s %8.1f us  %5.2f TB/s\n", name, median, bytes / median / 1e6);
    return median;
  };

  // A few SMs streaming: float32 and bfloat16 planes of N512 L1024 C128, parts of 32 KB (64 rows
  // in float32, 128 in bfloat16), a ring of 6 (five parts in flight), S blocks of one an SM.
  {
    using W = StreamWork;
    using B16 = __nv_bfloat16;
    const int smem6 = 6 * (32 << 10);
    FUSEKIT_CUDA_CHECK(cudaFuncSetAttribute(stream_parts<float, 6, W::kSum>, kSmem, smem6));
    FUSEKIT_CUDA_CHECK(cudaFuncSetAttribute(stream_parts<float, 6, W::kConv>, kSmem, smem6));
    FUSEKIT_CUDA_CHECK(cudaFuncSetAttribute(stream_parts<B16, 6, W::kConv>, kSmem, smem6));
    FUSEKIT_CUDA_CHECK(cudaFuncSetAttribute(stream_parts<float, 6, W::kRawMoments>, kSmem, smem6));
    FUSEKIT_CUDA_CHECK(cudaFuncSetAttribute(stream_parts<B16, 6, W::kRawMoments>, kSmem, smem6));
    const std::size_t rows = std::size_t{512} * 1024;
    constexpr unsigned kStreamThreads = (kStreamWarps + 1) * 32;
    const auto* xf = x;
    const auto* xb = reinterpret_cast<const B16*>(x);
    std::printf("-- a few SMs streaming a plane [%zu, 128]\n", rows);
    for (const int s : {8, 16, 32, sms}) {
      const auto per_sm = [&](const char* what, std::size_t bytes, auto launch) {
        char name[80];
        std::snprintf(name, sizeof name, "%s, %d SMs", what, s);
        const float us = time(name, bytes, launch);
        std::printf("%40s %8.1f GB/s an SM\n", "", bytes / us / 1e3 / s);
      };
      per_sm("plain sum, float32", rows * 512, [&] {
        stream_parts<float, 6, W::kSum><<<s, kStreamThreads, smem6>>>(xf, rows, 64, out);
      });
      per_sm("statistics, float32", rows * 512, [&] {
        stream_parts<float, 6, W::kConv><<<s, kStreamThreads, smem6>>>(xf, rows, 64, out);
      });
      per_sm("raw moments, float32", rows * 512, [&] {
        stream_parts<float, 6, W::kRawMoments><<<s, kStreamThreads, smem6>>>(xf, rows, 64, out);
      });
      per_sm("statistics, bfloat16", rows * 256, [&] {
        stream_parts<B16, 6, W::kConv><<<s, kStreamThreads, smem6>>>(xb, rows, 128, out);
      });
      per_sm("raw moments, bfloat16", rows * 256, [&] {
        stream_parts<B16, 6, W::kRawMoments><<<s, kStreamThreads, smem6>>>(xb, rows, 128, out);
      });
    }
  }

  // The same streams on S SMs while the other SMs copy a plane of the same size (one block of
  // 1024 threads an SM, held there by its shared memory), each started after the flush on a
  // stream of its own: the streams' time and the copy's.
  {
    using W = StreamWork;
    const int smem6 = 6 * (32 << 10);
    const std::size_t rows = std::size_t{512} * 1024, n4 = rows * 128 / 4;
    FUSEKIT_CUDA_CHECK(cudaFuncSetAttribute(copy_pieces, kSmem, smem6));
    float4 *from = nullptr, *to = nullptr;
    FUSEKIT_CUDA_CHECK(cudaMalloc(&from, n4 * 16));
    FUSEKIT_CUDA_CHECK(cudaMalloc(&to, n4 * 16));
    FUSEKIT_CUDA_CHECK(cudaMemset(from, 0, n4 * 16));
    cudaStream_t side[2];
    cudaEvent_t flushed, ends[4];
    for (auto& st : side) FUSEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    FUSEKIT_CUDA_CHECK(cudaEventCreate(&flushed));
    for (auto& e : ends) FUSEKIT_CUDA_CHECK(cudaEventCreate(&e));
    std::printf("-- the streams on S SMs beside a copy of %.0f MB on the others\n", n4 * 16 / 1e6);
    for (const int s : {16, 24, 32}) {
      for (const bool raw : {false, true}) {
        std::vector<float> stream_us, copy_us;
        for (int r = 0; r < 25; ++r) {
          FUSEKIT_CUDA_CHECK(cudaMemsetAsync(flush, r, kFlushBytes));
          FUSEKIT_CUDA_CHECK(cudaEventRecord(flushed));
          for (auto& st : side) FUSEKIT_CUDA_CHECK(cudaStreamWaitEvent(st, flushed));
          FUSEKIT_CUDA_CHECK(cudaEventRecord(ends[0], side[0]));
          copy_pieces<<<sms - s, 1024, smem6, side[0]>>>(from, to, n4);
          FUSEKIT_CUDA_CHECK(cudaEventRecord(ends[1], side[0]));
          FUSEKIT_CUDA_CHECK(cudaEventRecord(ends[2], side[1]));
          if (raw) {
            stream_parts<float, 6, W::kRawMoments><<<s, (kStreamWarps + 1) * 32, smem6, side[1]>>>(
                x, rows, 64, out);
          } else {
            stream_parts<float, 6, W::kConv><<<s, (kStreamWarps + 1) * 32, smem6, side[1]>>>(
                x, rows, 64, out);
          }
          FUSEKIT_CUDA_CHECK(cudaEventRecord(ends[3], side[1]));
          FUSEKIT_CUDA_CHECK(cudaDeviceSynchronize());
          float a = 0.0f, b = 0.0f;
          FUSEKIT_CUDA_CHECK(cudaEventElapsedTime(&a, ends[0], ends[1]));
          FUSEKIT_CUDA_CHECK(cudaEventElapsedTime(&b, ends[2], ends[3]));
          copy_us.push_back(a * 1000.0f);
          stream_us.push_back(b * 1000.0f);
        }
        FUSEKIT_CUDA_CHECK(cudaGetLastError());
        std::sort(stream_us.begin(), stream_us.end());
        std::sort(copy_us.begin(), copy_us.end());
        const float su = stream_us[12], cu = copy_us[12];
        std::printf("%s, float32, %d SMs: %8.1f us (%5.1f GB/s an SM); copy on %d SMs %8.1f us"
                    " (%4.2f TB/s)\n", raw ? "raw moments" : "statistics", s, su,
                    rows * 512 / su / 1e3 / s, sms - s, cu, 2.0 * n4 * 16 / cu / 1e6);
      }
    }
    for (auto& st : side) FUSEKIT_CUDA_CHECK(cudaStreamDestroy(st));
    FUSEKIT_CUDA_CHECK(cudaFree(from));
    FUSEKIT_CUDA_CHECK(cudaFree(to));
  }

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
