// The CUDA backend of mhc_post: memory-bound kernels, one pass over every tensor.
//
// Forward: each thread owns VEC consecutive elements of H (16 bytes when the layout allows) of
// one row n and produces them for all hc outputs, so x and residual are read exactly once and the
// hc x hc mix stays in registers. For large problems on sm_90 a persistent grid instead streams
// tiles of x and residual into shared memory with bulk copies, several tiles in flight per block:
// that keeps more bytes in flight than registers can hold (bench/NOTES.md has the measurements). Backward: the same element-wise part for grad_x and
// grad_residual, plus per-row sums over H for grad_post_layer_mix and grad_comb_res_mix, reduced
// in a fixed order (warp butterfly, then warps in index order, then chunks in index order), so
// results are bitwise reproducible.
#include <algorithm>
#include <type_traits>

#include "common/bulk_copy.cuh"
#include "common/cuda_check.h"
#include "common/cuda_reduce.cuh"
#include "common/cuda_types.cuh"
#include "common/cuda_workspace.h"
#include "common/dispatch.h"
#include "ops/mhc_post/mhc_post_params.h"

namespace fusekit::detail {

namespace {

constexpr int kFwdMaxThreads = 256;
constexpr int kBwdThreads = 128;
constexpr int kBulkTileBytes = 1024;     // per stream and tile: 64 threads x 16 bytes
[[maybe_unused]] constexpr int kBulkStageBytes = 40960;  // shared memory for tiles in flight, per block
constexpr int kBulkBlocksPerSm = 4;
constexpr double kBulkMinBytes = 256e6;  // below this the launch-per-tile kernel wins (NOTES.md)

/// Tiles in flight per block: as many as kBulkStageBytes holds, at most 8.
template <int HC>
constexpr int bulk_stages() {
  return kBulkStageBytes / ((HC + 1) * kBulkTileBytes) < 8 ? kBulkStageBytes / ((HC + 1) * kBulkTileBytes) : 8;
}

static_assert(kMhcPostMaxHc == 8, "dispatch_hc instantiates hc = 1 .. 8");

template <typename F>
void dispatch_hc(int hc, const char* op, F&& f) {
  switch (hc) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    case 8: return f(std::integral_constant<int, 8>{});
    default: throw Error(concat(op, ": no kernel for hc = ", hc, ", expected 1 <= hc <= ", kMhcPostMaxHc));
  }
}

// True when `ptr` is 16-byte aligned, H is its unit-stride axis and every row start stays aligned
// (the stride of a dimension of size 1 is never used, so it does not count).
struct RowDim {
  std::int64_t size, stride;
};
bool rows_vectorizable(const void* ptr, std::initializer_list<RowDim> row_dims,
                       std::int64_t h_stride, int vec) {
  if (h_stride != 1 || !is_aligned(ptr, 16)) return false;
  return std::all_of(row_dims.begin(), row_dims.end(),
                     [vec](RowDim d) { return d.size == 1 || d.stride % vec == 0; });
}

// post[i] = post_layer_mix[n, i] and comb[j][i] = comb_res_mix[n, j, i], for either params struct.
template <int HC, typename Params>
__device__ __forceinline__ void load_mix(const Params& p, std::int64_t n, float (&post)[HC],
                                         float (&comb)[HC][HC]) {
#pragma unroll
  for (int i = 0; i < HC; ++i) post[i] = __ldg(p.post + n * p.post_stride[0] + i * p.post_stride[1]);
#pragma unroll
  for (int j = 0; j < HC; ++j)
#pragma unroll
    for (int i = 0; i < HC; ++i)
      comb[j][i] = __ldg(p.comb + n * p.comb_stride[0] + j * p.comb_stride[1] + i * p.comb_stride[2]);
}

// ---------------------------------------------------------------------------------- forward

template <typename T, int HC, int VEC>
__global__ void __launch_bounds__(kFwdMaxThreads)
    mhc_post_fwd_kernel(const MhcPostParams p) {
  const std::int64_t n = blockIdx.x;
  const std::int64_t h = (static_cast<std::int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * VEC;
  if (h >= p.h) return;
  const T* x = static_cast<const T*>(p.x) + n * p.x_stride[0] + h * p.x_stride[1];
  const T* res = static_cast<const T*>(p.residual) + n * p.residual_stride[0] + h * p.residual_stride[2];
  T* out = static_cast<T*>(p.out) + n * p.out_stride[0] + h * p.out_stride[2];

  // Every load of the streams is issued before any arithmetic: (1 + HC) accesses in flight.
  float xv[VEC];        // [VEC] x[n, h..h+VEC)
  float r[HC][VEC];     // [HC, VEC] residual[n, :, h..h+VEC)
  load_floats<T, VEC>(x, xv);
#pragma unroll
  for (int j = 0; j < HC; ++j) load_floats<T, VEC>(res + j * p.residual_stride[1], r[j]);

  const float* post = p.post + n * p.post_stride[0];
  const float* comb = p.comb + n * p.comb_stride[0];
#pragma unroll
  for (int i = 0; i < HC; ++i) {
    const float post_i = __ldg(post + i * p.post_stride[1]);
    float acc[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] = post_i * xv[e];
#pragma unroll
    for (int j = 0; j < HC; ++j) {
      const float c = __ldg(comb + j * p.comb_stride[1] + i * p.comb_stride[2]);
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[e] = fmaf(c, r[j][e], acc[e]);
    }
    store_floats<T, VEC>(out + i * p.out_stride[1], acc);
  }
}

// grid = persistent blocks; tile t covers row t / tiles_per_row, H elements from
// (t % tiles_per_row) * kTile. Thread 0 keeps kBulkStages tiles of x and residual in flight; every
// thread computes the 16 bytes of each output row at its position in the tile.
template <typename T, int HC>
__global__ void __launch_bounds__(kBulkTileBytes / 16)
    mhc_post_fwd_bulk_kernel(const MhcPostParams p, std::int64_t tiles_per_row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kVec = kVec16<T>;
  constexpr int kTile = kBulkTileBytes / static_cast<int>(sizeof(T));  // H elements per tile
  constexpr int kBulkStages = bulk_stages<HC>();
  // [stage][x, residual row 0 .. HC-1][kTile] in shared memory
  __shared__ alignas(128) unsigned char tiles[kBulkStages][HC + 1][kBulkTileBytes];
  __shared__ std::uint64_t full[kBulkStages];
  const std::int64_t n_tiles = p.n * tiles_per_row;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kBulkStages; ++s) mbarrier_init(&full[s], 1);
    mbarrier_init_fence();
  }
  __syncthreads();

  auto fetch = [&](std::int64_t t, int stage) {  // thread 0 only
    const std::int64_t n = t / tiles_per_row;
    const std::int64_t h0 = (t - n * tiles_per_row) * kTile;
    const auto bytes = static_cast<std::uint32_t>(min(static_cast<std::int64_t>(kTile), p.h - h0) * sizeof(T));
    mbarrier_arrive_expect_bytes(&full[stage], bytes * (HC + 1));
    bulk_copy_to_shared(tiles[stage][0], static_cast<const T*>(p.x) + n * p.x_stride[0] + h0, bytes,
                        &full[stage]);
#pragma unroll
    for (int j = 0; j < HC; ++j) {
      bulk_copy_to_shared(tiles[stage][1 + j],
                          static_cast<const T*>(p.residual) + n * p.residual_stride[0] +
                              j * p.residual_stride[1] + h0,
                          bytes, &full[stage]);
    }
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < kBulkStages; ++s) {
      const std::int64_t t = blockIdx.x + static_cast<std::int64_t>(s) * gridDim.x;
      if (t < n_tiles) fetch(t, s);
    }
  }

  int k = 0;
  for (std::int64_t t = blockIdx.x; t < n_tiles; t += gridDim.x, ++k) {
    const int stage = k % kBulkStages;
    const std::int64_t n = t / tiles_per_row;
    const std::int64_t h = (t - n * tiles_per_row) * kTile + threadIdx.x * kVec;
    float post[HC];      // [HC] post[n, i]
    float comb[HC][HC];  // [HC (j), HC (i)] comb[n, j, i]
    load_mix(p, n, post, comb);

    mbarrier_wait(&full[stage], (k / kBulkStages) & 1);
    if (h < p.h) {
      float xv[kVec];     // [kVec] x[n, h..h+kVec)
      float r[HC][kVec];  // [HC, kVec] residual[n, :, h..h+kVec)
      load_shared_floats<T, kVec>(tiles[stage][0] + threadIdx.x * 16, xv);
#pragma unroll
      for (int j = 0; j < HC; ++j) load_shared_floats<T, kVec>(tiles[stage][1 + j] + threadIdx.x * 16, r[j]);
      T* out = static_cast<T*>(p.out) + n * p.out_stride[0] + h;
#pragma unroll
      for (int i = 0; i < HC; ++i) {
        float acc[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[e] = post[i] * xv[e];
#pragma unroll
        for (int j = 0; j < HC; ++j)
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc[e] = fmaf(comb[j][i], r[j][e], acc[e]);
        store_floats<T, kVec>(out + i * p.out_stride[1], acc);
      }
    }
    __syncthreads();  // every thread is done reading this stage
    if (threadIdx.x == 0) {
      const std::int64_t next = t + static_cast<std::int64_t>(kBulkStages) * gridDim.x;
      if (next < n_tiles) {
        fence_proxy_async_shared();
        fetch(next, stage);
      }
    }
  }
#endif
}

// ---------------------------------------------------------------------------------- backward

// Writes reduction `r` of row n: r < HC is grad_post[n, r], else grad_comb[n, j, i].
__device__ __forceinline__ void write_reduction(const MhcPostBackwardParams& p, std::int64_t n,
                                                int r, float value) {
  if (r < p.hc) {
    p.grad_post[n * p.grad_post_stride[0] + r * p.grad_post_stride[1]] = value;
  } else {
    const int j = (r - p.hc) / p.hc, i = (r - p.hc) % p.hc;
    p.grad_comb[n * p.grad_comb_stride[0] + j * p.grad_comb_stride[1] + i * p.grad_comb_stride[2]] = value;
  }
}

// grid = (N, chunks); block b of row n covers H in [b * chunk_len, (b + 1) * chunk_len).
// With one chunk it writes the reductions directly, else to partial[N, chunks, HC + HC * HC].
template <typename T, int HC, int VEC>
__global__ void __launch_bounds__(kBwdThreads)
    mhc_post_bwd_kernel(const MhcPostBackwardParams p, std::int64_t chunk_len, float* partial) {
  constexpr int kReductions = HC + HC * HC;
  constexpr int kWarps = kBwdThreads / kWarpSize;
  const std::int64_t n = blockIdx.x;
  const std::int64_t h_end = min(p.h, (blockIdx.y + 1) * chunk_len);

  float post[HC];      // [HC] post[n, i]
  float comb[HC][HC];  // [HC (j), HC (i)] comb[n, j, i]
  load_mix(p, n, post, comb);

  float acc_post[HC] = {};      // partial sum_h g[i, h] * x[h]
  float acc_comb[HC][HC] = {};  // partial sum_h res[j, h] * g[i, h]
  const T* g_row = static_cast<const T*>(p.grad_out) + n * p.grad_out_stride[0];
  const T* x_row = static_cast<const T*>(p.x) + n * p.x_stride[0];
  const T* res_row = static_cast<const T*>(p.residual) + n * p.residual_stride[0];
  T* gx_row = static_cast<T*>(p.grad_x) + n * p.grad_x_stride[0];
  T* gres_row = static_cast<T*>(p.grad_residual) + n * p.grad_residual_stride[0];

  for (std::int64_t h = blockIdx.y * chunk_len + threadIdx.x * VEC; h < h_end;
       h += static_cast<std::int64_t>(blockDim.x) * VEC) {
    float g[HC][VEC];  // [HC, VEC] grad_out[n, :, h..h+VEC)
    float xv[VEC];     // [VEC] x[n, h..h+VEC)
    float r[HC][VEC];  // [HC, VEC] residual[n, :, h..h+VEC)
#pragma unroll
    for (int i = 0; i < HC; ++i)
      load_floats<T, VEC>(g_row + i * p.grad_out_stride[1] + h * p.grad_out_stride[2], g[i]);
    load_floats<T, VEC>(x_row + h * p.x_stride[1], xv);
#pragma unroll
    for (int j = 0; j < HC; ++j)
      load_floats<T, VEC>(res_row + j * p.residual_stride[1] + h * p.residual_stride[2], r[j]);

    float gx[VEC] = {};
#pragma unroll
    for (int i = 0; i < HC; ++i)
#pragma unroll
      for (int e = 0; e < VEC; ++e) gx[e] = fmaf(post[i], g[i][e], gx[e]);
    store_floats<T, VEC>(gx_row + h * p.grad_x_stride[1], gx);

#pragma unroll
    for (int j = 0; j < HC; ++j) {
      float gr[VEC] = {};
#pragma unroll
      for (int i = 0; i < HC; ++i)
#pragma unroll
        for (int e = 0; e < VEC; ++e) gr[e] = fmaf(comb[j][i], g[i][e], gr[e]);
      store_floats<T, VEC>(gres_row + j * p.grad_residual_stride[1] + h * p.grad_residual_stride[2], gr);
    }

#pragma unroll
    for (int i = 0; i < HC; ++i) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc_post[i] = fmaf(g[i][e], xv[e], acc_post[i]);
#pragma unroll
      for (int j = 0; j < HC; ++j)
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc_comb[j][i] = fmaf(r[j][e], g[i][e], acc_comb[j][i]);
    }
  }

  // Fixed-order block reduction of the kReductions partial sums.
  __shared__ float warp_sums[kWarps][kReductions];  // [warps, reductions]
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
#pragma unroll
  for (int r = 0; r < kReductions; ++r) {
    float v = r < HC ? acc_post[r] : acc_comb[(r - HC) / HC][(r - HC) % HC];
    v = warp_sum(v);
    if (lane == 0) warp_sums[warp][r] = v;
  }
  __syncthreads();
  for (int r = threadIdx.x; r < kReductions; r += blockDim.x) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += warp_sums[w][r];
    if (partial) {
      partial[(n * gridDim.y + blockIdx.y) * kReductions + r] = sum;
    } else {
      write_reduction(p, n, r, sum);
    }
  }
}

// One thread per (n, reduction): sums the chunks of row n in index order.
__global__ void mhc_post_bwd_reduce_kernel(const MhcPostBackwardParams p, const float* partial,
                                           std::int64_t chunks) {
  const int reductions = p.hc + p.hc * p.hc;
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= p.n * reductions) return;
  const std::int64_t n = idx / reductions;
  const int r = static_cast<int>(idx % reductions);
  float sum = 0.f;
  for (std::int64_t c = 0; c < chunks; ++c) sum += partial[(n * chunks + c) * reductions + r];
  write_reduction(p, n, r, sum);
}

void check_grid(const char* op, std::int64_t rows, std::int64_t blocks_per_row) {
  FUSEKIT_CHECK(rows <= 0x7fffffff, op, ": N = ", rows, " rows, expected at most 2^31 - 1");
  FUSEKIT_CHECK(blocks_per_row <= 65535, op, ": H needs ", blocks_per_row,
                " blocks per row, expected at most 65535 (H too large)");
}

}  // namespace

// ---------------------------------------------------------------------------------- configs

MhcPostConfig select_mhc_post_config(const MhcPostParams& p, int multiprocessors, int sm_major) {
  MhcPostConfig c;
  const int vec = 16 / static_cast<int>(element_size(p.dtype));
  const bool vectorized =
      p.h % vec == 0 &&
      rows_vectorizable(p.out, {{p.n, p.out_stride[0]}, {p.hc, p.out_stride[1]}}, p.out_stride[2], vec) &&
      rows_vectorizable(p.x, {{p.n, p.x_stride[0]}}, p.x_stride[1], vec) &&
      rows_vectorizable(p.residual, {{p.n, p.residual_stride[0]}, {p.hc, p.residual_stride[1]}},
                        p.residual_stride[2], vec);
  c.path = vectorized ? MhcPostConfig::Path::Vector : MhcPostConfig::Path::Scalar;
  c.vec = vectorized ? vec : 1;
  const double bytes = static_cast<double>(p.n) * p.h * element_size(p.dtype) * (1 + 2 * p.hc);
  if (vectorized && sm_major >= 9 && bytes >= kBulkMinBytes) {
    c.path = MhcPostConfig::Path::Bulk;
    c.threads = kBulkTileBytes / 16;
    c.tiles_per_row = ceil_div(p.h * static_cast<std::int64_t>(element_size(p.dtype)), kBulkTileBytes);
    c.blocks = std::min<std::int64_t>(p.n * c.tiles_per_row,
                                      static_cast<std::int64_t>(multiprocessors) * kBulkBlocksPerSm);
    return c;
  }
  const std::int64_t items = std::max<std::int64_t>(1, ceil_div(p.h, c.vec));  // per row
  // Smaller blocks when the problem is small, so that it still spreads over every SM.
  int max_threads = kFwdMaxThreads;
  while (max_threads > kWarpSize && p.n * ceil_div(items, max_threads) < 2 * multiprocessors) {
    max_threads /= 2;
  }
  c.blocks_per_row = ceil_div(items, max_threads);
  // The fewest warps that cover a row's share, so that no block idles a partial warp's worth.
  c.threads = static_cast<int>(ceil_div(ceil_div(items, c.blocks_per_row), kWarpSize) * kWarpSize);
  return c;
}

MhcPostBackwardConfig select_mhc_post_backward_config(const MhcPostBackwardParams& p,
                                                      int multiprocessors) {
  MhcPostBackwardConfig c;
  const int vec = 16 / static_cast<int>(element_size(p.dtype));
  c.vectorized =
      p.h % vec == 0 &&
      rows_vectorizable(p.grad_x, {{p.n, p.grad_x_stride[0]}}, p.grad_x_stride[1], vec) &&
      rows_vectorizable(p.grad_residual, {{p.n, p.grad_residual_stride[0]}, {p.hc, p.grad_residual_stride[1]}},
                        p.grad_residual_stride[2], vec) &&
      rows_vectorizable(p.grad_out, {{p.n, p.grad_out_stride[0]}, {p.hc, p.grad_out_stride[1]}},
                        p.grad_out_stride[2], vec) &&
      rows_vectorizable(p.x, {{p.n, p.x_stride[0]}}, p.x_stride[1], vec) &&
      rows_vectorizable(p.residual, {{p.n, p.residual_stride[0]}, {p.hc, p.residual_stride[1]}},
                        p.residual_stride[2], vec);
  c.vec = c.vectorized ? vec : 1;
  c.threads = kBwdThreads;
  const std::int64_t items = ceil_div(p.h, c.vec);
  const std::int64_t max_chunks = std::max<std::int64_t>(1, ceil_div(items, c.threads));
  const std::int64_t wanted =
      ceil_div(4 * static_cast<std::int64_t>(multiprocessors), std::max<std::int64_t>(1, p.n));
  const std::int64_t chunks = std::clamp<std::int64_t>(wanted, 1, max_chunks);
  c.chunk_len = std::max<std::int64_t>(1, ceil_div(items, chunks)) * c.vec;
  c.chunks = std::max<std::int64_t>(1, ceil_div(p.h, c.chunk_len));
  return c;
}

// ---------------------------------------------------------------------------------- launchers

void launch_mhc_post(const MhcPostParams& p, int device, Stream stream) {
  CudaDeviceGuard guard(device);
  const MhcPostConfig c =
      select_mhc_post_config(p, multiprocessor_count(device), compute_capability_major(device));
  const cudaStream_t s = stream_on("mhc_post", stream, device);
  using Path = MhcPostConfig::Path;
  if (c.path != Path::Bulk) check_grid("mhc_post", p.n, c.blocks_per_row);
  const dim3 grid(static_cast<unsigned>(p.n), static_cast<unsigned>(c.blocks_per_row));
  dispatch_floating(p.dtype, "mhc_post", [&](auto tag) {
    using T = typename CudaType<decltype(tag)::value>::type;
    dispatch_hc(p.hc, "mhc_post", [&](auto hc) {
      switch (c.path) {
        case Path::Bulk:
          mhc_post_fwd_bulk_kernel<T, hc><<<static_cast<unsigned>(c.blocks), c.threads, 0, s>>>(p, c.tiles_per_row);
          return;
        case Path::Vector:
          mhc_post_fwd_kernel<T, hc, kVec16<T>><<<grid, c.threads, 0, s>>>(p);
          return;
        case Path::Scalar:
          mhc_post_fwd_kernel<T, hc, 1><<<grid, c.threads, 0, s>>>(p);
          return;
      }
      throw Error(concat("mhc_post: unknown kernel path ", static_cast<int>(c.path)));
    });
  });
  FUSEKIT_CUDA_CHECK_LAUNCH("mhc_post_fwd_kernel");
}

void launch_mhc_post_backward(const MhcPostBackwardParams& p, int device, Stream stream) {
  CudaDeviceGuard guard(device);
  const MhcPostBackwardConfig c = select_mhc_post_backward_config(p, multiprocessor_count(device));
  check_grid("mhc_post_backward", p.n, c.chunks);
  const dim3 grid(static_cast<unsigned>(p.n), static_cast<unsigned>(c.chunks));
  const cudaStream_t s = stream_on("mhc_post_backward", stream, device);
  const std::int64_t reductions = p.hc + p.hc * p.hc;
  StreamWorkspace partial(c.chunks > 1 ? p.n * c.chunks * reductions * sizeof(float) : 0, s);

  dispatch_floating(p.dtype, "mhc_post_backward", [&](auto tag) {
    using T = typename CudaType<decltype(tag)::value>::type;
    dispatch_hc(p.hc, "mhc_post_backward", [&](auto hc) {
      if (c.vectorized) {
        mhc_post_bwd_kernel<T, hc, kVec16<T>><<<grid, c.threads, 0, s>>>(p, c.chunk_len, partial.as<float>());
      } else {
        mhc_post_bwd_kernel<T, hc, 1><<<grid, c.threads, 0, s>>>(p, c.chunk_len, partial.as<float>());
      }
    });
  });
  FUSEKIT_CUDA_CHECK_LAUNCH("mhc_post_bwd_kernel");
  if (c.chunks > 1) {
    constexpr int kThreads = 256;
    const auto blocks = static_cast<unsigned>(ceil_div(p.n * reductions, kThreads));
    mhc_post_bwd_reduce_kernel<<<blocks, kThreads, 0, s>>>(p, partial.as<float>(), c.chunks);
    FUSEKIT_CUDA_CHECK_LAUNCH("mhc_post_bwd_reduce_kernel");
  }
}

}  // namespace fusekit::detail
