// The CUDA backend of trimul, in four launches:
//
//  1. pack_weights: the five [H, C] projections into one float16 matrix, interleaved so that a
//     warp's columns hold all five projections of the same eight hidden channels; to_out into a
//     float16 [C, H]; the LayerNorm parameters into float32. Zero padding to whole tiles.
//  2. project: a tile of rows is normalised over C (float32 statistics, two passes over values
//     held in registers) into shared memory as float16; the five projections then run on tensor
//     cores, 32 hidden channels at a time, with the next weight slices arriving by cp.async while
//     the current ones are multiplied. The epilogue applies the mask and the gates and writes
//     left, right and gate as one float16 [N, N] plane per (b, d), the layout the pairwise
//     product reads (on sm_90a, wg_project does the same on warpgroup MMAs).
//  3. pairwise: one strided-batched cuBLASLt product over the B * H planes, float16 output scaled
//     by 1/N so that sums over N do not overflow float16.
//  4. output: a persistent kernel over tiles of 64 j of one (b, i), read from the planes of p and
//     gate by cp.async one tile ahead, normalised over H (with eps / N^2, which undoes the
//     scaling exactly), multiplied by gate and rounded to float16 in place; the output
//     projection then runs on tensor cores against to_out held in shared memory and writes out
//     in x's dtype.
//
// Nothing of size [B, N, N, 5H] or in float32 is ever materialised: the temporaries are left,
// right, p and gate, four float16 [B, N, N, H] tensors (planes padded to rows of 8 elements).
#include <algorithm>
#include <atomic>
#include <limits>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <type_traits>

#include "common/cublaslt.h"
#include "common/bulk_copy.cuh"
#include "common/cuda_check.h"
#include "common/cuda_math.cuh"
#include "common/cuda_reduce.cuh"
#include "common/cuda_mma.cuh"
#include "common/cuda_types.cuh"
#include "common/cuda_wgmma.cuh"
#include "common/cuda_workspace.h"
#include "common/dispatch.h"
#include "common/tensor_map.h"
#include "ops/trimul/trimul_params.h"

namespace fusekit::detail {

namespace {

constexpr const char* kOp = "trimul";

constexpr int kThreads = 256;                     // 8 warps: 2 along the rows, 4 along the columns
constexpr int kKSlice = 32;                       // k of one pipeline stage
constexpr int kStages = 3;                        // weight slices in flight
constexpr int kSliceLd = kKSlice + 8;             // halves per staged weight row (conflict-free)
constexpr int kChunkD = 32;                       // hidden channels per projection chunk
constexpr int kProjCols = kProjections * kChunkD; // weight rows per projection chunk
constexpr int kProjNT = kProjections;             // n8 tiles per warp: one per projection
constexpr int kCachedC = 24 * 32;                 // rows up to this long are held in registers

template <typename T>
__device__ __forceinline__ float load_weight(const TrimulWeight& w, std::int64_t i,
                                             std::int64_t j = 0) {
  const std::int64_t offset = i * w.stride[0] + j * w.stride[1];
  return w.dtype == DType::Float32 ? static_cast<const float*>(w.data)[offset]
                                   : to_float(static_cast<const T*>(w.data)[offset]);
}

__device__ __forceinline__ float load_mask(const void* mask, DType dtype, std::int64_t offset) {
  switch (dtype) {
    case DType::Float32: return static_cast<const float*>(mask)[offset];
    case DType::Float16: return __half2float(static_cast<const __half*>(mask)[offset]);
    case DType::BFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(mask)[offset]);
    case DType::UInt8: return static_cast<float>(static_cast<const std::uint8_t*>(mask)[offset]);
    default: return static_cast<const std::uint8_t*>(mask)[offset] != 0 ? 1.0f : 0.0f;  // bool
  }
}

// --------------------------------------------------------------------------- the tensor-core loop

// C[rows, chunks * 32 NT] = A[rows, K] B^T for an A tile resident in shared memory (row stride
// lda halves) and B [chunks * 32 NT, ldb] in global memory, streamed through shared memory in
// slices of 32 k. Warp (wm, wn) owns rows wm 16 MT + [0, 16 MT) and columns wn 8 NT + [0, 8 NT)
// of each chunk; after a chunk's last slice, epilogue(chunk, acc) sees the warp's accumulators.
// Every thread of the block must call this (it synchronises the block).
template <int MT, int NT, typename Epilogue>
__device__ __forceinline__ void gemm_chunks(const __half* As, int lda, __half* Bs, const __half* B,
                                            std::int64_t ldb, int chunks, int slices,
                                            Epilogue&& epilogue) {
  constexpr int kCols = 4 * 8 * NT;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp >> 2, wn = warp & 3;
  const int total = chunks * slices;

  auto load_slice = [&](int it) {
    if (it < total) {
      const int chunk = it / slices, s = it % slices;
      __half* dst = Bs + (it % kStages) * kCols * kSliceLd;
      const __half* src = B + static_cast<std::int64_t>(chunk) * kCols * ldb + s * kKSlice;
      for (int i = tid; i < kCols * (kKSlice / 8); i += kThreads) {
        const int row = i / (kKSlice / 8), piece = i % (kKSlice / 8);
        cp_async_16(dst + row * kSliceLd + piece * 8, src + row * ldb + piece * 8);
      }
    }
    cp_async_commit();  // an empty group past the end keeps the counting uniform
  };
  for (int it = 0; it < kStages - 1; ++it) load_slice(it);

  float acc[MT][NT][4] = {};
  for (int it = 0; it < total; ++it) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // slice `it` has landed; slice it - 1 is no longer read by anyone
    load_slice(it + kStages - 1);
    const int chunk = it / slices, s = it % slices;
    const __half* bs = Bs + (it % kStages) * kCols * kSliceLd;
#pragma unroll
    for (int kk = 0; kk < kKSlice; kk += 16) {
      std::uint32_t b[NT][2];
#pragma unroll
      for (int nt = 0; nt + 1 < NT; nt += 2) {
        std::uint32_t r[4];
        const int row = wn * 8 * NT + nt * 8 + (lane >> 4) * 8 + (lane & 7);
        ldmatrix_x4(r, bs + row * kSliceLd + kk + ((lane >> 3) & 1) * 8);
        b[nt][0] = r[0];
        b[nt][1] = r[1];
        b[nt + 1][0] = r[2];
        b[nt + 1][1] = r[3];
      }
      if constexpr (NT % 2 == 1) {
        std::uint32_t r[2];
        const int row = wn * 8 * NT + (NT - 1) * 8 + (lane & 7);
        ldmatrix_x2(r, bs + row * kSliceLd + kk + ((lane >> 3) & 1) * 8);
        b[NT - 1][0] = r[0];
        b[NT - 1][1] = r[1];
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        std::uint32_t a[4];
        const int row = wm * 16 * MT + mt * 16 + (lane & 15);
        ldmatrix_x4(a, As + row * lda + s * kKSlice + kk + (lane >> 4) * 8);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma_16816(acc[mt][nt], a, b[nt][0], b[nt][1]);
      }
    }
    if (s == slices - 1) {
      epilogue(chunk, acc);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.0f;
        }
      }
    }
  }
  cp_async_wait<0>();
}

// --------------------------------------------------------------------------- 1. weights

struct PackArgs {
  TrimulWeight proj[kProjections], to_out, norm_weight, norm_bias, out_norm_weight, out_norm_bias;
  std::int64_t c, h, cp, hp, cpo, chunks;
  bool by_projection;  // a chunk's rows projection by projection (the warpgroup kernel's order)
  __half* w5;   // [chunks * kProjCols, cp]
  __half* wo;   // [cpo, hp]
  float* ln;    // norm_weight [C], norm_bias [C], out_norm_weight [H], out_norm_bias [H]
};

template <typename T>
__global__ void pack_weights(PackArgs a) {
  const std::int64_t n5 = a.chunks * kProjCols * a.cp, no = a.cpo * a.hp;
  const std::int64_t total = n5 + no + 2 * a.c + 2 * a.h;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       i < total; i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    if (i < n5) {
      // mma.sync order: row = chunk * 160 + group * 40 + projection * 8 + channel, hidden
      // d = chunk * 32 + group * 8 + channel; warpgroup order: row = chunk * 160 + projection * 32
      // + channel, d = chunk * 32 + channel
      const std::int64_t row = i / a.cp, q = i % a.cp;
      const std::int64_t chunk = row / kProjCols, within = row % kProjCols;
      const std::int64_t group = within / (8 * kProjections);
      const std::int64_t proj = a.by_projection ? within / kChunkD : within / 8 % kProjections;
      const std::int64_t d = a.by_projection ? chunk * kChunkD + within % kChunkD
                                             : chunk * kChunkD + group * 8 + within % 8;
      a.w5[i] = __float2half_rn(d < a.h && q < a.c ? load_weight<T>(a.proj[proj], d, q) : 0.0f);
    } else if (i < n5 + no) {
      const std::int64_t j = i - n5, row = j / a.hp, d = j % a.hp;
      a.wo[j] = __float2half_rn(row < a.c && d < a.h ? load_weight<T>(a.to_out, row, d) : 0.0f);
    } else {
      std::int64_t j = i - n5 - no;
      float v;
      if (j < a.c) {
        v = load_weight<T>(a.norm_weight, j);
      } else if ((j -= a.c) < a.c) {
        v = load_weight<T>(a.norm_bias, j);
      } else if ((j -= a.c) < a.h) {
        v = load_weight<T>(a.out_norm_weight, j);
      } else {
        v = load_weight<T>(a.out_norm_bias, j - a.h);
      }
      a.ln[i - n5 - no] = v;
    }
  }
}

// --------------------------------------------------------------------------- 2. projections

struct ProjectArgs {
  const void* x;
  std::int64_t x_stride[3];
  bool x_staged;   // rows are 16-byte aligned multiples of 16 bytes: copied by cp.async
  int x_group;     // rows per staged group
  const void* mask;  // or null
  DType mask_dtype;
  std::int64_t mask_stride[3];
  std::int64_t m, n, c, h, cp;
  int chunks;
  const __half* w5;
  const float* ln_weight;
  const float* ln_bias;
  float eps;
  __half* left;   // planes [B, H] of [N, ldn], as right and gate
  __half* right;
  __half* gate;
  std::int64_t ldn, plane;
  std::int64_t x_ld;  // wg_project: row m of x at x + m x_ld
};

// Shared memory of the projection kernel, in bytes from the start. Until the matrix product
// starts, the weight stages and the epilogue staging (together `x_stage_bytes`) hold raw rows of x.
struct ProjectSmem {
  int rows, lda;
  __host__ __device__ ProjectSmem(int rows_, std::int64_t cp)
      : rows(rows_), lda(static_cast<int>(cp) + 8) {}
  __host__ __device__ std::size_t a() const { return 0; }
  __host__ __device__ std::size_t b() const { return a() + std::size_t(rows) * lda * 2; }
  __host__ __device__ std::size_t left() const { return b() + std::size_t(kStages) * kProjCols * kSliceLd * 2; }
  __host__ __device__ std::size_t right() const { return left() + std::size_t(kChunkD) * (rows + 8) * 2; }
  __host__ __device__ std::size_t gate() const { return right() + std::size_t(kChunkD) * (rows + 8) * 2; }
  __host__ __device__ std::size_t row_base() const { return gate() + std::size_t(kChunkD) * (rows + 8) * 2; }
  __host__ __device__ std::size_t row_x() const { return row_base() + std::size_t(rows) * 8; }
  __host__ __device__ std::size_t row_mask() const { return row_x() + std::size_t(rows) * 8; }
  __host__ __device__ std::size_t bytes() const { return row_mask() + std::size_t(rows) * 4; }
  __host__ __device__ std::size_t x_stage_bytes() const { return row_base() - b(); }
};

// LayerNorm_C of one row of x in global memory into shared memory as float16 (zeros past C), by
// one warp. A row of at most kCachedC values is read once into registers, a longer one three times.
template <typename T>
__device__ __forceinline__ void normalise_row(const T* x, int c, int cp, const float* w,
                                              const float* bias, float eps, __half* dst) {
  const int lane = threadIdx.x & 31;
  const float shift = to_float(x[0]);  // sums of x - x[0]: no digits lost to a large mean
  const float inv_c = 1.0f / static_cast<float>(c);
  if (c <= kCachedC) {
    float v[kCachedC / 32];
#pragma unroll
    for (int t = 0; t < kCachedC / 32; ++t) {
      const int q = t * 32 + lane;
      v[t] = q < c ? to_float(x[q]) - shift : 0.0f;
    }
    float sum = 0.0f;
#pragma unroll
    for (int t = 0; t < kCachedC / 32; ++t) sum += v[t];
    const float mean = warp_sum(sum) * inv_c;
    float sq = 0.0f;
#pragma unroll
    for (int t = 0; t < kCachedC / 32; ++t) {
      const float d = t * 32 + lane < c ? v[t] - mean : 0.0f;
      sq += d * d;
    }
    const float rstd = rsqrtf(warp_sum(sq) * inv_c + eps);
#pragma unroll
    for (int t = 0; t < kCachedC / 32; ++t) {
      const int q = t * 32 + lane;
      if (q < cp) dst[q] = __float2half_rn(q < c ? (v[t] - mean) * rstd * w[q] + bias[q] : 0.0f);
    }
    return;
  }
  float sum = 0.0f;
  for (int q = lane; q < c; q += 32) sum += to_float(x[q]) - shift;
  const float mean = warp_sum(sum) * inv_c;
  float sq = 0.0f;
  for (int q = lane; q < c; q += 32) {
    const float d = to_float(x[q]) - shift - mean;
    sq += d * d;
  }
  const float rstd = rsqrtf(warp_sum(sq) * inv_c + eps);
  for (int q = lane; q < cp; q += 32) {
    dst[q] = __float2half_rn(q < c ? (to_float(x[q]) - shift - mean) * rstd * w[q] + bias[q] : 0.0f);
  }
}

// Four consecutive values of T (16 bytes of float32, 8 of a 16-bit type); with kStreaming from
// rows read once (evict-first in L2, not kept in L1).
template <typename T, bool kStreaming = false>
__device__ __forceinline__ void load4(const T* p, float (&v)[4]) {
  using Raw = std::conditional_t<sizeof(T) == 4, float4, uint2>;
  const Raw* const at = reinterpret_cast<const Raw*>(p);
  const Raw raw = kStreaming ? __ldcs(at) : *at;
  if constexpr (sizeof(T) == 4) {
    v[0] = raw.x;
    v[1] = raw.y;
    v[2] = raw.z;
    v[3] = raw.w;
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const float2 lo = widen_bf16x2(raw.x), hi = widen_bf16x2(raw.y);
    v[0] = lo.x;
    v[1] = lo.y;
    v[2] = hi.x;
    v[3] = hi.y;
  } else {
    union {
      uint2 raw;
      T e[4];
    } u;
    u.raw = raw;
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = to_float(u.e[i]);
  }
}

// The same for a row staged in shared memory (C a multiple of 4, 16-byte aligned), read three times
// from there, four values per lane and access.
template <typename T>
__device__ __forceinline__ void normalise_staged_row(const T* x, int c, int cp, const float* w,
                                                     const float* bias, float eps, __half* dst) {
  const int lane = threadIdx.x & 31;
  const float shift = to_float(x[0]);
  const float inv_c = 1.0f / static_cast<float>(c);
  float sum = 0.0f;
  for (int q = lane * 4; q < c; q += 128) {
    float v[4];
    load4(x + q, v);
    sum += ((v[0] - shift) + (v[1] - shift)) + ((v[2] - shift) + (v[3] - shift));
  }
  const float mean = warp_sum(sum) * inv_c;
  float sq = 0.0f;
  for (int q = lane * 4; q < c; q += 128) {
    float v[4];
    load4(x + q, v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float d = v[i] - shift - mean;
      sq += d * d;
    }
  }
  const float rstd = rsqrtf(warp_sum(sq) * inv_c + eps);
  for (int q = lane * 4; q < cp; q += 128) {
    union {
      uint2 raw;
      __half e[4];
    } u;
    if (q < c) {
      float v[4];
      load4(x + q, v);
      const float4 wq = *reinterpret_cast<const float4*>(w + q);
      const float4 bq = *reinterpret_cast<const float4*>(bias + q);
      u.e[0] = __float2half_rn((v[0] - shift - mean) * rstd * wq.x + bq.x);
      u.e[1] = __float2half_rn((v[1] - shift - mean) * rstd * wq.y + bq.y);
      u.e[2] = __float2half_rn((v[2] - shift - mean) * rstd * wq.z + bq.z);
      u.e[3] = __float2half_rn((v[3] - shift - mean) * rstd * wq.w + bq.w);
    } else {
      u.raw = make_uint2(0, 0);
    }
    *reinterpret_cast<uint2*>(dst + q) = u.raw;
  }
}

// Whether rows [m0, m0 + rows) sit back to back in their planes (one batch, no row padding), so
// that a channel's values for the tile are one contiguous, 16-byte aligned run.
__device__ __forceinline__ bool contiguous_tile(std::int64_t m0, int rows, std::int64_t m,
                                                std::int64_t n, std::int64_t ldn) {
  const std::int64_t nn = n * n;
  return ldn == n && m0 + rows <= m && m0 / nn == (m0 + rows - 1) / nn;
}

// Writes a staged chunk of kRows rows (m0 on) by the channels d0 .. d0 + 31 (those below H) to
// left, right and gate (a channel's rows in its plane), by `threads` threads numbered `tid`. The
// three are staged channel by channel ([32][kRows + 8]); `contiguous`: the rows lie back to back
// in their planes (contiguous_tile).
template <int kRows>
__device__ __forceinline__ void store_chunk(const ProjectArgs& a, const __half* stage_left,
                                            const __half* stage_right, const __half* stage_gate,
                                            const std::int64_t* row_base, std::int64_t m0,
                                            std::int64_t d0, bool contiguous, int tid, int threads) {
  const int channels = static_cast<int>(a.h - d0 < kChunkD ? a.h - d0 : kChunkD);
  if (contiguous) {  // a channel's rows are one run of 16-byte pieces of its plane
    constexpr int kPieces = kRows / 8;
    for (int i = tid; i < channels * kPieces; i += threads) {
      const int dl = i / kPieces, piece = i % kPieces;
      const std::int64_t offset = row_base[0] + (d0 + dl) * a.plane + piece * 8;
      const int from = dl * (kRows + 8) + piece * 8;
      *reinterpret_cast<uint4*>(a.left + offset) = *reinterpret_cast<const uint4*>(stage_left + from);
      *reinterpret_cast<uint4*>(a.right + offset) = *reinterpret_cast<const uint4*>(stage_right + from);
      *reinterpret_cast<uint4*>(a.gate + offset) = *reinterpret_cast<const uint4*>(stage_gate + from);
    }
  } else {
    for (int i = tid; i < channels * kRows; i += threads) {
      const int dl = i / kRows, r = i % kRows;
      if (m0 + r < a.m) {
        const std::int64_t offset = row_base[r] + (d0 + dl) * a.plane;
        const int from = dl * (kRows + 8) + r;
        a.left[offset] = stage_left[from];
        a.right[offset] = stage_right[from];
        a.gate[offset] = stage_gate[from];
      }
    }
  }
}

template <typename T, int MT>
__global__ void __launch_bounds__(kThreads, 2) project(ProjectArgs a) {
  constexpr int kRows = 32 * MT;
  extern __shared__ __align__(16) unsigned char smem[];
  const ProjectSmem layout(kRows, a.cp);
  auto* As = reinterpret_cast<__half*>(smem + layout.a());
  auto* Bs = reinterpret_cast<__half*>(smem + layout.b());
  auto* stage_left = reinterpret_cast<__half*>(smem + layout.left());    // [32][rows + 8]
  auto* stage_right = reinterpret_cast<__half*>(smem + layout.right());  // [32][rows + 8]
  auto* stage_gate = reinterpret_cast<__half*>(smem + layout.gate());    // [32][rows + 8]
  auto* row_base = reinterpret_cast<std::int64_t*>(smem + layout.row_base());
  auto* row_x = reinterpret_cast<std::int64_t*>(smem + layout.row_x());
  auto* row_mask = reinterpret_cast<float*>(smem + layout.row_mask());

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const std::int64_t m0 = static_cast<std::int64_t>(blockIdx.x) * kRows;
  const std::int64_t nn = a.n * a.n;
  const T* x = static_cast<const T*>(a.x);

  if (tid < kRows) {
    const std::int64_t m = m0 + tid;
    float mk = 0.0f;
    std::int64_t base = 0, offset = 0;
    if (m < a.m) {
      const std::int64_t b = m / nn, i = m % nn / a.n, j = m % a.n;
      base = b * a.h * a.plane + i * a.ldn + j;
      offset = b * a.x_stride[0] + i * a.x_stride[1] + j * a.x_stride[2];
      mk = a.mask ? load_mask(a.mask, a.mask_dtype,
                              b * a.mask_stride[0] + i * a.mask_stride[1] + j * a.mask_stride[2])
                  : 1.0f;
    }
    row_base[tid] = base;
    row_x[tid] = offset;
    row_mask[tid] = mk;
  }
  __syncthreads();

  // LayerNorm_C into As. Staged: groups of rows arrive by cp.async, all in flight at once.
  auto zero_row = [&](int r) {
    for (int q = lane; q < a.cp; q += 32) As[r * layout.lda + q] = __float2half_rn(0.0f);
  };
  if (a.x_staged) {
    T* xs = reinterpret_cast<T*>(smem + layout.b());
    const int pieces = static_cast<int>(a.c * sizeof(T) / 16);  // per row
    constexpr int kPerPiece = 16 / sizeof(T);
    const int c = static_cast<int>(a.c);
    for (int g0 = 0; g0 < kRows; g0 += a.x_group) {
      const int rows = min(a.x_group, kRows - g0);
      for (int r = warp; r < rows; r += kThreads / 32) {  // a warp per row
        if (m0 + g0 + r < a.m) {
          const T* src = x + row_x[g0 + r];
          for (int piece = lane; piece < pieces; piece += 32) {
            cp_async_16(xs + r * c + piece * kPerPiece, src + piece * kPerPiece);
          }
        }
      }
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
      for (int r = warp; r < rows; r += kThreads / 32) {
        if (m0 + g0 + r < a.m) {
          normalise_staged_row(xs + r * c, c, static_cast<int>(a.cp), a.ln_weight, a.ln_bias,
                               a.eps, As + (g0 + r) * layout.lda);
        } else {
          zero_row(g0 + r);
        }
      }
      __syncthreads();  // the group's rows are read before the next group overwrites them
    }
  } else {
    for (int r = warp; r < kRows; r += kThreads / 32) {
      if (m0 + r < a.m) {
        normalise_row(x + row_x[r], static_cast<int>(a.c), static_cast<int>(a.cp),
                             a.ln_weight, a.ln_bias, a.eps, As + r * layout.lda);
      } else {
        zero_row(r);
      }
    }
  }
  // (gemm_chunks synchronises before its first use of As and before overwriting the x stage)

  const bool contiguous = contiguous_tile(m0, kRows, a.m, a.n, a.ldn);
  gemm_chunks<MT, kProjNT>(
      As, layout.lda, Bs, a.w5, a.cp, a.chunks, static_cast<int>(a.cp / kKSlice),
      [&](int chunk, const float (&acc)[MT][kProjNT][4]) {
        const int wm = warp >> 2, wn = warp & 3;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = wm * 16 * MT + mt * 16 + (lane >> 2) + (e >> 1) * 8;
            const int dl = wn * 8 + 2 * (lane & 3) + (e & 1);
            const float mk = row_mask[r];
            const float left = acc[mt][kLeftProj][e] * mk * fast_sigmoid(acc[mt][kLeftGate][e]);
            const float right = acc[mt][kRightProj][e] * mk * fast_sigmoid(acc[mt][kRightGate][e]);
            stage_left[dl * (kRows + 8) + r] = __float2half_rn(left);
            stage_right[dl * (kRows + 8) + r] = __float2half_rn(right);
            stage_gate[dl * (kRows + 8) + r] = __float2half_rn(fast_sigmoid(acc[mt][kOutGate][e]));
          }
        }
        __syncthreads();
        store_chunk<kRows>(a, stage_left, stage_right, stage_gate, row_base, m0,
                           static_cast<std::int64_t>(chunk) * kChunkD, contiguous, tid, kThreads);
      });
}

// --------------------------------------------------------------------------- 2b. projections, sm_90a
//
// The same work on warpgroup MMAs: a persistent kernel, one block a multiprocessor, of consumer
// warpgroups (three at C <= 128, else two) and two producer warps, over tiles of 64 rows a consumer
// warpgroup. At C <= 128 the x producer warp copies rows of x through a ring of slots (tensor-map
// boxes of whole rows) ahead of use, and a warpgroup normalises its rows from there; above, each
// warp loads its rows from global memory itself, a few at once (kDirectX). Either way they land in
// the warpgroup's A tile, float16 in the 128-byte-swizzled layout the MMAs read. The weight
// producer warp streams the packed weights, 160 rows (the five projections of 32 channels) by 64 k
// a slot, through a ring all warpgroups read. A chunk of 32 channels is one m64n160k16 MMA per 16
// k into 80 accumulators a thread; the epilogue applies mask and gates, stages left, right and
// gate by transposing stmatrix as swizzled boxes of 32 channels by 64 rows, and one thread of the
// warpgroup sends them to their planes by the copy engine (threads copy them where the planes have
// padded rows). Where the weight ring
// holds two chunks (C up to 192) the warpgroups take turns at the MMAs, one's running under the
// others' epilogues.

// Threads of a block with `wgs` consumer warpgroups: theirs, then the weight and the x producer
// warps; with three, the producers' warpgroup is whole (its two other warps idle), so that it can
// hand registers to the consumers (a multiprocessor quarter holds 16 K registers: four warps of
// up to 128, or three consumers at 152 and a producer at 40).
constexpr int wg_project_threads(int wgs) { return 128 * wgs + (wgs == 3 ? 128 : 64); }
constexpr int kWgStepK = 64;     // k a weight slot: one 128-byte swizzled row per weight row
constexpr int kWgChunkCols = kProjections * kChunkD;  // 160 weight rows a chunk
constexpr std::uint32_t kWgSlotBytes = kWgChunkCols * kWgStepK * 2;
// A warpgroup's epilogue stage: left, right and gate of 32 channels by 64 rows, each the
// 128-byte swizzled box of the planes' tensor maps (1024-byte aligned, as the swizzle needs).
constexpr std::size_t kWgStageBytes = std::size_t(3) * kChunkD * 64 * 2;
static_assert(kWgStageBytes % 1024 == 0 && kWgSlotBytes % 1024 == 0, "swizzled boxes are aligned");
constexpr std::int64_t kWgProjectMaxC = 384;
// Whether the kernel for rows of up to 128 kQuads values reads x without slots (direct_x()).
// At C = 384 a slot of 8 rows of float32 x is 12 KB, and one a warpgroup (all that fits beside
// the A tiles and three weight slots) left each warpgroup's LayerNorm waiting on 8 copies in turn
// a tile; loads of 4 rows a warp at once put 48 KB an SM in flight and free the slots' shared
// memory for two more weight slots: -5 to -8% at the benchmark's C = 384 shapes (bench/NOTES.md).
// At C <= 128 the slots (16 rows, two a warpgroup) were the faster.
template <int kQuads>
constexpr bool kDirectX = kQuads >= 2;

// Shared memory of the warpgroup kernel, in bytes from a 1024-byte aligned base: the warpgroups'
// A tiles, the weight slots, the warpgroups' epilogue stages, the x slots, the rows' masks and
// plane offsets, the LayerNorm's weight and bias, then the barriers (full and empty for the
// weight slots, then for the x slots).
struct WgProjectLayout {
  int wgs = 2;                     // consumer warpgroups, 64 rows of a tile each
  int cp = 0;                      // C rounded up to whole 64-k blocks
  int x_rows = 0, x_box_c = 0, x_boxes = 0;  // an x slot: x_boxes boxes of x_rows x x_box_c
  int x_stages = 0, w_stages = 0;
  std::uint32_t x_box_bytes = 0;
  // Rows of more than 128 values (the kernels of kDirectX): the consumers load their rows of x
  // from global memory themselves, several rows a warp at once, and the layout has no x slots
  // (see normalise_global_rows).
  __host__ __device__ bool direct_x() const { return cp > 128; }
  __host__ __device__ std::size_t a(int wg) const { return std::size_t(wg) * 64 * cp * 2; }
  __host__ __device__ int tile_rows() const { return 64 * wgs; }
  __host__ __device__ std::size_t w(int slot) const { return a(wgs) + std::size_t(slot) * kWgSlotBytes; }
  __host__ __device__ std::size_t stage(int wg) const { return w(w_stages) + wg * kWgStageBytes; }
  __host__ __device__ std::uint32_t x_slot_bytes() const { return x_boxes * x_box_bytes; }
  __host__ __device__ std::size_t x(int slot) const { return stage(wgs) + std::size_t(slot) * x_slot_bytes(); }
  __host__ __device__ std::size_t row_mask() const { return x(x_stages); }
  __host__ __device__ std::size_t row_base() const { return row_mask() + tile_rows() * 4; }
  __host__ __device__ std::size_t ln() const { return row_base() + tile_rows() * 8; }  // w, b [cp]
  __host__ __device__ std::size_t barriers() const { return ln() + std::size_t(2) * cp * 4; }
  __host__ __device__ std::size_t bytes() const {
    return 1024 + barriers() + std::size_t(2) * (w_stages + x_stages) * 8;
  }
  // Whether the warpgroups take turns at the MMAs: where the weight ring holds two chunks, since
  // the one that issues a chunk's MMAs is then a chunk ahead of the last, which may still be
  // reading its slots. Taking turns without that room would wait on a slot no one can free.
  __host__ __device__ bool takes_turns() const { return w_stages >= 2 * (cp / kWgStepK); }
};


#ifdef FUSEKIT_WGMMA  // the device code of wg_project, compiled for sm_90a only


// The LayerNorm of kRows rows a warp holds, after shift_row: v is each row's values less its
// first value and sum their sum (a lane holds kQuads groups of four values of a row, C <= 128
// kQuads). The means, the variances (two passes over the values in registers, their reductions
// overlapping), then the first live_rows rows into rows a_row0, a_row0 + 4, ... of a warpgroup's
// swizzled A tile as float16; `ln` is the LayerNorm's weight and bias in shared memory (zeros
// from C to cp).
template <int kQuads, int kRows>
__device__ __forceinline__ void finish_rows(float (&v)[kRows][kQuads][4], float (&sum)[kRows],
                                            int live_rows, const WgProjectLayout& l,
                                            const float* ln, int c, float eps,
                                            unsigned char* a_tile, int a_row0) {
  const int lane = threadIdx.x & 31;
  float sq[kRows];
  const float inv_c = 1.0f / static_cast<float>(c);
#pragma unroll
  for (int k = 0; k < kRows; ++k) sum[k] = warp_sum(sum[k]) * inv_c;  // the means
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    sq[k] = 0.0f;
#pragma unroll
    for (int t = 0; t < kQuads; ++t) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float d = 4 * lane + 128 * t + i < c ? v[k][t][i] - sum[k] : 0.0f;
        sq[k] += d * d;
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kRows; ++k) sq[k] = rsqrtf(warp_sum(sq[k]) * inv_c + eps);  // 1 / std
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    if (k >= live_rows) continue;
    const int a_row = a_row0 + 4 * k;
#pragma unroll
    for (int t = 0; t < kQuads; ++t) {
      const int q = 4 * lane + 128 * t;
      if (q >= l.cp) continue;
      const float4 w = *reinterpret_cast<const float4*>(ln + q);
      const float4 b = *reinterpret_cast<const float4*>(ln + l.cp + q);
      union {
        uint2 raw;
        __half2 h[2];
      } u;
      u.h[0] = __floats2half2_rn((v[k][t][0] - sum[k]) * sq[k] * w.x + b.x,
                                 (v[k][t][1] - sum[k]) * sq[k] * w.y + b.y);
      u.h[1] = __floats2half2_rn((v[k][t][2] - sum[k]) * sq[k] * w.z + b.z,
                                 (v[k][t][3] - sum[k]) * sq[k] * w.w + b.w);
      const int piece = (q % kWgStepK / 8) ^ (a_row & 7);
      *reinterpret_cast<uint2*>(a_tile + (q / kWgStepK) * (64 * 128) + a_row * 128 + piece * 16 +
                                (q % 8) * 2) = u.raw;
    }
  }
}

// A row's values less its first value (no digits lost to a large mean), and their sum.
template <int kQuads>
__device__ __forceinline__ float shift_row(float (&v)[kQuads][4], int c) {
  const int lane = threadIdx.x & 31;
  const float shift = __shfl_sync(0xffffffffu, v[0][0], 0);
  float sum = 0.0f;
#pragma unroll
  for (int t = 0; t < kQuads; ++t) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[t][i] = 4 * lane + 128 * t + i < c ? v[t][i] - shift : 0.0f;
      sum += v[t][i];
    }
  }
  return sum;
}

// LayerNorm_C of kRows rows r0, r0 + 4, ... (those below x_rows) of an x slot into rows a_row0 +
// ... of a warpgroup's swizzled A tile, by one warp; the rows at once, so that their reductions
// overlap (kRows = x_rows / 4: a slot's rows over the warpgroup's four warps, no idle rows).
// `src` is where the lane's values lie from a row's start in the slot (see wg_project_consume).
template <typename T, int kQuads, int kRows>
__device__ __forceinline__ void normalise_slot_rows(const T* slot, const WgProjectLayout& l,
                                                    const int (&src)[kQuads], const float* ln,
                                                    int r0, int c, float eps,
                                                    unsigned char* a_tile, int a_row0) {
  const int lane = threadIdx.x & 31;
  float v[kRows][kQuads][4];
  float sum[kRows];
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    const int r = r0 + 4 * k;
#pragma unroll
    for (int t = 0; t < kQuads; ++t) {
      if (r < l.x_rows && 4 * lane + 128 * t < c) {
        load4(slot + src[t] + r * l.x_box_c, v[k][t]);
      } else {
        v[k][t][0] = v[k][t][1] = v[k][t][2] = v[k][t][3] = 0.0f;
      }
    }
    sum[k] = shift_row<kQuads>(v[k], c);
  }
  finish_rows<kQuads, kRows>(v, sum, (l.x_rows - r0 + 3) / 4, l, ln, c, eps, a_tile, a_row0);
}

// The warpgroup's 64 rows of x from m0, read straight from global memory, into its A tile as
// normalise_slot_rows writes them: warp w takes rows w, w + 4, ..., kRows of them at a time, every
// load of those rows issued before any arithmetic (rows past M read as zeros). Without x slots the
// rows in flight are limited by registers rather than by shared memory (see direct_x()).
template <typename T, int kQuads>
__device__ __forceinline__ void normalise_global_rows(const ProjectArgs& a,
                                                      const WgProjectLayout& l, const float* ln,
                                                      std::int64_t m0, unsigned char* a_tile) {
  constexpr int kRows = kQuads == 2 ? 8 : 4;  // 64 or 48 values a lane
  const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) % 4;
  const int c = static_cast<int>(a.c);
  const T* const x = static_cast<const T*>(a.x);
#pragma unroll 1
  for (int b = 0; b < 16 / kRows; ++b) {
    const int a_row0 = warp + 4 * kRows * b;
    float v[kRows][kQuads][4];
    float sum[kRows];
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      const std::int64_t m = m0 + a_row0 + 4 * k;
#pragma unroll
      for (int t = 0; t < kQuads; ++t) {
        const int q = 4 * lane + 128 * t;
        if (m < a.m && q < c) {
          load4<T, true>(x + m * a.x_ld + q, v[k][t]);
        } else {
          v[k][t][0] = v[k][t][1] = v[k][t][2] = v[k][t][3] = 0.0f;
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kRows; ++k) sum[k] = shift_row<kQuads>(v[k], c);
    finish_rows<kQuads, kRows>(v, sum, kRows, l, ln, c, a.eps, a_tile, a_row0);
  }
}

// A consumer warpgroup of wg_project (one of kWgs), for every tile of the block.
template <typename T, int kQuads, int kWgs>
__device__ __forceinline__ void wg_project_consume(const ProjectArgs& a, const WgProjectLayout& l,
                                                   int tiles, unsigned char* base,
                                                   std::uint64_t* w_full, std::uint64_t* w_empty,
                                                   std::uint64_t* x_full, std::uint64_t* x_empty,
                                                   bool planes_by_copy,
                                                   const CUtensorMap& left_map,
                                                   const CUtensorMap& right_map,
                                                   const CUtensorMap& gate_map) {
  const int wg = warp_uniform(threadIdx.x / 32) / 4;
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  unsigned char* const a_tile = base + l.a(wg);
  const std::uint64_t desc_a = swizzled_descriptor(a_tile);
  const std::uint64_t desc_w = swizzled_descriptor(base + l.w(0));
  auto* const stage_left = reinterpret_cast<__half*>(base + l.stage(wg));  // [32][64], swizzled
  auto* const stage_right = stage_left + kChunkD * 64;
  auto* const stage_gate = stage_right + kChunkD * 64;
  float* const row_mask = reinterpret_cast<float*>(base + l.row_mask()) + 64 * wg;
  std::int64_t* const row_base = reinterpret_cast<std::int64_t*>(base + l.row_base()) + 64 * wg;
  const int groups = kWgs * 64 / l.x_rows;  // x slots a tile, all warpgroups'
  const int kbs = l.cp / kWgStepK;
  const int c = static_cast<int>(a.c);
  const std::int64_t nn = a.n * a.n;
  const float* const ln = reinterpret_cast<const float*>(base + l.ln());
  int src[kQuads];  // this lane's values of a row, from its start in an x slot
#pragma unroll
  for (int t = 0; t < kQuads; ++t) {
    const int q = 4 * lane + 128 * t;
    src[t] = (q / l.x_box_c) * (l.x_rows * l.x_box_c) + q % l.x_box_c;
  }
  RingPosition w_at;          // the weight slot to read next
  RingPosition x_at{wg, 0};   // the x slot to read next: this warpgroup's are every kWgs-th one
  // Taking turns: a warpgroup issues a chunk's MMAs once the one before it (warpgroup 0: the
  // last) has issued its own, warpgroup 0 first, so that one's MMAs run under the others'
  // epilogues instead of all multiplying, then all computing gates, in step.
  const int my_turn = 1 + kWgs + wg, next_turn = 1 + kWgs + (wg + 1) % kWgs;
  const bool take_turns = l.takes_turns();
  if (take_turns && wg == kWgs - 1) named_barrier_arrive(next_turn, 256);
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const std::int64_t m0 = static_cast<std::int64_t>(tile) * (64 * kWgs) + 64 * wg;
    if (tid < 64) {
      const std::int64_t m = m0 + tid;
      float mk = 0.0f;
      std::int64_t rb = 0;
      if (m < a.m) {
        const std::int64_t b = m / nn, i = m % nn / a.n, j = m % a.n;
        rb = b * a.h * a.plane + i * a.ldn + j;
        mk = a.mask ? load_mask(a.mask, a.mask_dtype,
                                b * a.mask_stride[0] + i * a.mask_stride[1] + j * a.mask_stride[2])
                    : 1.0f;
      }
      row_mask[tid] = mk;
      row_base[tid] = rb;
    }
    if constexpr (kDirectX<kQuads>) {
      normalise_global_rows<T, kQuads>(a, l, ln, m0, a_tile);
    } else {
      // The warpgroup's rows from the x slots: groups wg, wg + kWgs, ... of the tile's.
      for (int within = 0; within < groups / kWgs; ++within) {
        mbarrier_wait(&x_full[x_at.slot], x_at.phase);
        const T* rows = reinterpret_cast<const T*>(base + l.x(x_at.slot));
        const int a_row0 = within * l.x_rows + warp;
        if (l.x_rows == 16) {
          normalise_slot_rows<T, kQuads, 4>(rows, l, src, ln, warp, c, a.eps, a_tile, a_row0);
        } else if (l.x_rows == 8) {
          normalise_slot_rows<T, kQuads, 2>(rows, l, src, ln, warp, c, a.eps, a_tile, a_row0);
        } else {
          normalise_slot_rows<T, kQuads, 1>(rows, l, src, ln, warp, c, a.eps, a_tile, a_row0);
        }
        __syncwarp();
        if (lane == 0) mbarrier_arrive(&x_empty[x_at.slot]);
        x_at.advance(kWgs, l.x_stages);
      }
    }
    fence_proxy_async_shared();       // the A tile, written by threads, is read by the MMAs
    named_barrier_sync(1 + wg, 128);  // and the rows' masks and offsets by every thread

    for (int chunk = 0; chunk < a.chunks; ++chunk) {
      float acc[kWgChunkCols / 2] = {};  // (defined here, not live across the LayerNorm)
      int previous = 0;  // the slot read before this one
      // The turn passes on after this chunk's last MMAs, except at the very last (no one takes it).
      const bool pass_turn =
          take_turns && !(wg == kWgs - 1 && tile + gridDim.x >= tiles && chunk == a.chunks - 1);
      if (take_turns) named_barrier_sync(my_turn, 256);
      for (int kb = 0; kb < kbs; ++kb) {
        mbarrier_wait(&w_full[w_at.slot], w_at.phase);
        wgmma_fence();
        // kb and the slot through warp_uniform, so that the descriptors below are built once a warp
        const int kbu = warp_uniform(kb), slot = warp_uniform(w_at.slot);
#pragma unroll
        for (int k16 = 0; k16 < kWgStepK / 16; ++k16) {
          wgmma_ss<__half, kWgChunkCols>(
              acc, advance_descriptor(desc_a, kbu * (64 * 128) + k16 * 32),
              advance_descriptor(desc_w, slot * kWgSlotBytes + k16 * 32), kb > 0 || k16 > 0);
        }
        wgmma_commit();
        if (pass_turn && kb == kbs - 1) named_barrier_arrive(next_turn, 256);
        wgmma_wait<1>();  // the previous slot's MMAs are done: hand it back
        if (kb > 0 && lane == 0) mbarrier_arrive(&w_empty[previous]);
        previous = w_at.slot;
        w_at.advance(1, l.w_stages);
      }
      wgmma_wait<0>();
      wgmma_fence_operands(acc);  // the epilogue's reads stay below the wait
      if (lane == 0) mbarrier_arrive(&w_empty[previous]);

      // acc[4 j + e] is row 16 warp + lane / 4 + 8 (e / 2) and column 8 j + 2 (lane % 4) + e % 2
      // of the chunk's 160: projection j / 4, channel 8 (j % 4) + 2 (lane % 4) + e % 2. Left,
      // right and gate go to the stage as float16 pairs of channels, four 8x8 blocks a
      // transposing stmatrix, so that a channel's 64 rows are one 128-byte row of the stage with
      // its 16-byte pieces swizzled as the copy engine's 128-byte mode lays them.
      if (tid == 0) bulk_wait_read<0>();  // the previous chunk's copies have read the stage
      named_barrier_sync(1 + wg, 128);
      const float mk[2] = {row_mask[16 * warp + lane / 4], row_mask[16 * warp + lane / 4 + 8]};
#pragma unroll
      for (int pair = 0; pair < 2; ++pair) {  // channel blocks 2 pair and 2 pair + 1
        std::uint32_t left[4], right[4], gate[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {  // block 2 pair + q / 2, rows 8 (q % 2) on
          const int cb = 2 * pair + q / 2, h = q % 2;
          const auto at = [&](int proj, int e) { return acc[4 * (4 * proj + cb) + 2 * h + e]; };
          left[q] = pack_half2(at(kLeftProj, 0) * mk[h] * fast_sigmoid(at(kLeftGate, 0)),
                               at(kLeftProj, 1) * mk[h] * fast_sigmoid(at(kLeftGate, 1)));
          right[q] = pack_half2(at(kRightProj, 0) * mk[h] * fast_sigmoid(at(kRightGate, 0)),
                                at(kRightProj, 1) * mk[h] * fast_sigmoid(at(kRightGate, 1)));
          gate[q] = pack_half2(fast_sigmoid(at(kOutGate, 0)), fast_sigmoid(at(kOutGate, 1)));
        }
        const int q = lane / 8, ch = 8 * (2 * pair + q / 2) + lane % 8;
        const int offset = ch * 64 + ((2 * warp + q % 2) ^ (ch & 7)) * 8;  // halves
        stmatrix_x4_trans(stage_left + offset, left);
        stmatrix_x4_trans(stage_right + offset, right);
        stmatrix_x4_trans(stage_gate + offset, gate);
      }
      const std::int64_t d0 = static_cast<std::int64_t>(chunk) * kChunkD;
      if (planes_by_copy) {
        fence_proxy_async_shared();  // the stage, written by threads, is read by the copy engine
        named_barrier_sync(1 + wg, 128);
        if (tid == 0) {
          const std::int64_t b = m0 / nn;
          const int within_plane = static_cast<int>(m0 - b * nn), d = static_cast<int>(d0);
          tensor_store_4d_from_shared(&left_map, within_plane, d, static_cast<int>(b), 0, stage_left);
          tensor_store_4d_from_shared(&right_map, within_plane, d, static_cast<int>(b), 0, stage_right);
          tensor_store_4d_from_shared(&gate_map, within_plane, d, static_cast<int>(b), 0, stage_gate);
          bulk_commit();
        }
      } else {
        named_barrier_sync(1 + wg, 128);
        const int channels = static_cast<int>(a.h - d0 < kChunkD ? a.h - d0 : kChunkD);
        for (int i = tid; i < channels * 64; i += 128) {
          const int dl = i / 64, r = i % 64;
          if (m0 + r < a.m) {
            const std::int64_t to = row_base[r] + (d0 + dl) * a.plane;
            const int from = dl * 64 + ((r / 8) ^ (dl & 7)) * 8 + r % 8;
            a.left[to] = stage_left[from];
            a.right[to] = stage_right[from];
            a.gate[to] = stage_gate[from];
          }
        }
      }
    }
    named_barrier_sync(1 + wg, 128);  // the A tile, masks and offsets are free again
  }
  if (tid == 0) bulk_wait<0>();  // the last copies out of the stage are done
}

#endif  // FUSEKIT_WGMMA

template <typename T, int kQuads, int kWgs>
__global__ void __launch_bounds__(wg_project_threads(kWgs), 1)
    wg_project(const __grid_constant__ CUtensorMap w_map, const __grid_constant__ CUtensorMap x_map,
               const __grid_constant__ CUtensorMap left_map,
               const __grid_constant__ CUtensorMap right_map,
               const __grid_constant__ CUtensorMap gate_map, const ProjectArgs a,
               const WgProjectLayout l, int tiles, bool planes_by_copy) {
#ifdef FUSEKIT_WGMMA
  extern __shared__ __align__(16) unsigned char shared_raw[];
  // 1024-byte aligned in the shared window (the swizzle repeats every 1024 bytes), by pointer
  // arithmetic on the shared array, so that accesses stay shared-memory instructions.
  unsigned char* const base = shared_raw + ((1024 - (shared_address(shared_raw) & 1023)) & 1023);
  auto* const w_full = reinterpret_cast<std::uint64_t*>(base + l.barriers());
  auto* const w_empty = w_full + l.w_stages;
  auto* const x_full = w_empty + l.w_stages;
  auto* const x_empty = x_full + l.x_stages;
  const int warp = warp_uniform(threadIdx.x / 32), lane = threadIdx.x % 32;
  if (threadIdx.x == 128 * kWgs) {
    for (int s = 0; s < l.w_stages; ++s) {
      mbarrier_init(&w_full[s], 1);
      mbarrier_init(&w_empty[s], 4 * kWgs);  // one arrival per consumer warp
    }
    for (int s = 0; s < l.x_stages; ++s) {
      mbarrier_init(&x_full[s], 1);
      mbarrier_init(&x_empty[s], 4);  // one arrival per warp of the warpgroup the rows are for
    }
    mbarrier_init_fence();
  }
  float* const ln = reinterpret_cast<float*>(base + l.ln());
  for (int q = threadIdx.x; q < l.cp; q += wg_project_threads(kWgs)) {
    ln[q] = q < a.c ? a.ln_weight[q] : 0.0f;
    ln[l.cp + q] = q < a.c ? a.ln_bias[q] : 0.0f;
  }
  __syncthreads();
  if constexpr (kWgs == 3) {
    if (warp < 4 * kWgs) {
      warpgroup_raise_registers<152>();
    } else {
      warpgroup_lower_registers<40>();
    }
  }

  if (warp < 4 * kWgs) {
    wg_project_consume<T, kQuads, kWgs>(a, l, tiles, base, w_full, w_empty, x_full, x_empty,
                                        planes_by_copy, left_map, right_map, gate_map);
  } else if (warp == 4 * kWgs && lane == 0) {  // the weight producer
    prefetch_tensor_map(&w_map);
    const int kbs = l.cp / kWgStepK;
    RingPosition at;
    bool first_round = true;  // the slots are empty until the ring wraps
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      for (int chunk = 0; chunk < a.chunks; ++chunk) {
        for (int kb = 0; kb < kbs; ++kb) {
          if (!first_round) mbarrier_wait(&w_empty[at.slot], at.phase ^ 1u);
          mbarrier_arrive_expect_bytes(&w_full[at.slot], kWgSlotBytes);
          tensor_copy_2d_to_shared(base + l.w(at.slot), &w_map, kb * kWgStepK, chunk * kWgChunkCols,
                                   &w_full[at.slot]);
          at.advance(1, l.w_stages);
          first_round = first_round && at.slot != 0;
        }
      }
    }
  } else if (warp == 4 * kWgs + 1 && lane == 0 && !kDirectX<kQuads>) {  // the x producer
    prefetch_tensor_map(&x_map);
    const int groups = kWgs * 64 / l.x_rows;
    RingPosition at;
    bool first_round = true;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      for (int g = 0; g < groups; ++g) {
        const int slot = at.slot;
        if (!first_round) mbarrier_wait(&x_empty[slot], at.phase ^ 1u);
        at.advance(1, l.x_stages);
        first_round = first_round && at.slot != 0;
        mbarrier_arrive_expect_bytes(&x_full[slot], l.x_slot_bytes());
        // group g: rows x_rows (g / kWgs) .. of warpgroup g % kWgs
        const int row = tile * (64 * kWgs) + (g % kWgs) * 64 + (g / kWgs) * l.x_rows;
        for (int box = 0; box < l.x_boxes; ++box) {
          tensor_copy_2d_to_shared(base + l.x(slot) + box * l.x_box_bytes, &x_map,
                                   box * l.x_box_c, row, &x_full[slot]);
        }
      }
    }
  }
#else
  __trap();
#endif
}

// The warpgroup kernel's shared memory for rows of C elements of `element` bytes with `wgs`
// consumer warpgroups, or nothing where C exceeds kWgProjectMaxC or a ring of two weight slots and
// one x slot a warpgroup does not fit in `limit` bytes.
std::optional<WgProjectLayout> wg_project_layout(std::int64_t c, std::size_t element, int limit,
                                                 int wgs) {
  if (c > kWgProjectMaxC) return std::nullopt;
  WgProjectLayout l;
  l.wgs = wgs;
  l.cp = static_cast<int>(ceil_div(c, std::int64_t{kWgStepK}) * kWgStepK);
  l.x_boxes = static_cast<int>(ceil_div(c, std::int64_t{256}));  // a box is at most 256 wide
  // Box rows of whole 32-byte pieces: a box of 4 or more rows is a whole number of 128 bytes, as
  // the copy engine needs of where a box lands.
  const int per32 = static_cast<int>(32 / element);
  l.x_box_c = static_cast<int>(ceil_div(ceil_div(c, std::int64_t{l.x_boxes}), std::int64_t{per32}) * per32);
  const std::size_t row_bytes = std::size_t(l.x_boxes) * l.x_box_c * element;
  l.x_rows = row_bytes * 16 <= 8192 ? 16 : row_bytes * 8 <= 12288 ? 8 : 4;  // slots of <= 12 KiB
  l.x_box_bytes = static_cast<std::uint32_t>(l.x_rows * l.x_box_c * element);
  const auto fits = [&](int x, int w) {
    WgProjectLayout t = l;
    t.x_stages = x;
    t.w_stages = w;
    return t.bytes() <= static_cast<std::size_t>(limit);
  };
  // The x slots go to the warpgroups in turn, so a multiple of their number gives each warpgroup
  // slots of its own, every use of which it reads in turn. (Otherwise a warpgroup would wait on a
  // slot whose previous use, by another warpgroup, may not have landed yet, and the parity of its
  // full barrier could not tell the two uses apart.)
  // A third weight slot first (one in flight beyond the two being read: at C = 384 that gained
  // 4% over two x slots a warpgroup), then two x slots a warpgroup where they fit (one leaves its
  // LayerNorm waiting on every slot's copy), then as many weight slots as fit, up to 8.
  int x = l.direct_x() ? 0 : wgs, w = 2;
  if (!fits(x, w)) return std::nullopt;
  if (fits(x, 3)) w = 3;
  if (!l.direct_x() && fits(2 * wgs, w)) x = 2 * wgs;
  while (w < 8 && fits(x, w + 1)) ++w;
  l.x_stages = x;
  l.w_stages = w;
  return l;
}

// Three consumer warpgroups where they can take turns (more warps to hide each one's LayerNorm and
// epilogue latency): C <= 128, a row one group of four values a lane; above, three A tiles and two
// chunks of weight slots do not fit. Else two.
std::optional<WgProjectLayout> choose_wg_project_layout(std::int64_t c, std::size_t element,
                                                        int limit) {
  if (c <= 128) {
    const std::optional<WgProjectLayout> three = wg_project_layout(c, element, limit, 3);
    if (three && three->takes_turns()) return three;
  }
  return wg_project_layout(c, element, limit, 2);
}

// x as a matrix of M evenly spaced rows: the spacing in elements, or 0 where the rows are not.
std::int64_t uniform_row_stride(const TrimulParams& p) {
  if (p.rows() == 1) return ceil_div(p.c, std::int64_t{8}) * 8;
  if (p.n == 1) return p.x_stride[0];
  const bool uniform = p.x_stride[1] == p.n * p.x_stride[2] &&
                       (p.b == 1 || p.x_stride[0] == p.n * p.x_stride[1]);
  return uniform ? p.x_stride[2] : 0;
}

// --------------------------------------------------------------------------- 3. pairwise product

// Everything the heuristic's choice depends on: device, N, planes, direction.
using PairwiseKey = std::tuple<int, std::int64_t, std::int64_t, int>;

// For each plane pair (L, R) of [N, N] (row-major, rows ldn apart): outgoing P = L R^T, incoming
// P = L^T R, scaled by 1/N. In column-major terms P^T = R L^T (outgoing) or R^T L (incoming).
void pairwise(const TrimulParams& p, const __half* left, const __half* right, __half* out,
              std::int64_t ldn, std::int64_t plane, int device, cudaStream_t stream) {
  const bool outgoing = p.direction == TrimulDirection::Outgoing;
  const auto n = static_cast<std::uint64_t>(p.n);
  const auto batch = static_cast<std::int32_t>(p.b * p.h);
  FUSEKIT_CHECK(p.b * p.h <= INT32_MAX, kOp, ": B * H = ", p.b * p.h,
                " planes exceed what one batched product can take (2^31 - 1)");
  LtObjects lt;
  FUSEKIT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&lt.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  set_desc(lt.desc, CUBLASLT_MATMUL_DESC_TRANSA, outgoing ? CUBLAS_OP_T : CUBLAS_OP_N);
  set_desc(lt.desc, CUBLASLT_MATMUL_DESC_TRANSB, outgoing ? CUBLAS_OP_N : CUBLAS_OP_T);
  for (cublasLtMatrixLayout_t* layout : {&lt.a, &lt.b, &lt.d}) {
    FUSEKIT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(layout, CUDA_R_16F, n, n, ldn));
    set_layout(*layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, batch);
    set_layout(*layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, plane);
  }

  static std::mutex mutex;
  static std::map<PairwiseKey, cublasLtMatmulHeuristicResult_t> cache;
  const PairwiseKey key{device, p.n, p.b * p.h, static_cast<int>(p.direction)};
  const cublasLtHandle_t handle = lt_handle(device);
  cublasLtMatmulHeuristicResult_t chosen{};
  {
    const std::lock_guard lock(mutex);
    auto it = cache.find(key);
    if (it == cache.end()) {
      FUSEKIT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&lt.pref));
      const std::uint64_t max_ws = std::uint64_t{32} << 20;
      FUSEKIT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
          lt.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_ws, sizeof(max_ws)));
      int found = 0;
      FUSEKIT_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, lt.desc, lt.a, lt.b, lt.d,
                                                          lt.d, lt.pref, 1, &chosen, &found));
      FUSEKIT_CHECK(found > 0, kOp, ": cuBLASLt has no algorithm for the pairwise product of ",
                    batch, " float16 planes of ", p.n, " x ", p.n);
      it = cache.emplace(key, chosen).first;
    }
    chosen = it->second;
  }
  const StreamWorkspace ws(chosen.workspaceSize, stream);
  const float alpha = 1.0f / static_cast<float>(p.n), beta = 0.0f;
  // A = the right planes, B = the left planes (see above)
  FUSEKIT_CUBLAS_CHECK(cublasLtMatmul(handle, lt.desc, &alpha, right, lt.a, left, lt.b, &beta,
                                      out, lt.d, out, lt.d, &chosen.algo, ws.as<void>(),
                                      chosen.workspaceSize, stream));
}

// --------------------------------------------------------------------------- 4. output

// A persistent kernel over tiles of 64 consecutive j of one (b, i): a channel's part of a tile is
// one run of p's plane, and of gate's, so a tile arrives as 2 H runs of 128 bytes by cp.async, the
// next tile's while this one is computed. In shared memory a tile stays channel by channel: the
// LayerNorm over H runs with lanes across rows (conflict-free) and writes the normalised, gated
// values over p in place, and the output product reads them from there as its A operand by
// transposing ldmatrix. to_out stays in shared memory for the whole kernel where it fits, else
// its 128-column chunks are copied in as they come.

constexpr int kOutTileRows = 64;                  // rows (j) of an output tile
constexpr int kOutPitch = kOutTileRows + 8;       // halves per staged channel: ldmatrix rows on distinct banks
constexpr int kOutChunkCols = 128;                // output columns per product chunk: 2 x 4 warps of 32 x 32
constexpr int kOutStages = 2;                     // tiles in shared memory: this one and the next
constexpr int kOutBlocksPerSm = 2;                // blocks a multiprocessor, where shared memory allows

struct OutputArgs {
  const __half* p;     // planes [B, H] of [N, ldn], scaled by 1/N
  const __half* gate;  // planes [B, H] of [N, ldn]
  std::int64_t n, c, h, ldn, plane;
  std::int64_t tiles;  // B N row_tiles
  int row_tiles;       // tiles along j: ceil(N / 64)
  int hp, chunks;      // H rounded up to 32; output chunks of 128 columns
  bool resident;       // all of to_out stays in shared memory
  bool pair_stores;    // two output columns per store (even C, strides and alignment)
  const __half* wo;    // [chunks * 128, hp]
  const float* ln_weight;
  const float* ln_bias;
  float eps;           // eps / N^2
  void* out;
  std::int64_t out_stride[3];
};

// Shared memory of the output kernel, in bytes: to_out ([wo_rows][hp + 8]), then the tile slots,
// each p then gate ([hp][64 + 8]), then the LayerNorm's weight and bias ([2][hp] float32).
struct OutputLayout {
  int hp = 0, wo_rows = 0;
  __host__ __device__ OutputLayout(int hp_, int wo_rows_) : hp(hp_), wo_rows(wo_rows_) {}
  __host__ __device__ int wo_pitch() const { return hp + 8; }
  __host__ __device__ std::size_t slot_bytes() const { return std::size_t(2) * hp * kOutPitch * 2; }
  __host__ __device__ std::size_t slot(int s) const {
    return std::size_t(wo_rows) * wo_pitch() * 2 + s * slot_bytes();
  }
  __host__ __device__ std::size_t ln() const { return slot(kOutStages); }
  __host__ __device__ std::size_t bytes() const { return ln() + std::size_t(2) * hp * 4; }
};

// LayerNorm over H of a staged tile, times the gate, written over p as float16; rows from `valid`
// on and channels from H on become zeros. Warp w takes rows 8 w .. 8 w + 7: lane l the rows
// 8 w + 2 (l % 4) and the one after as a pair, over the channels l / 4 + 8 k.
__device__ __forceinline__ void normalise_output_tile(__half* p, const __half* gate,
                                                      const float* ln, const OutputArgs& a,
                                                      int valid) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int r = 8 * warp + 2 * (lane & 3), first = lane >> 2;
  const int h = static_cast<int>(a.h);
  const float inv_h = 1.0f / static_cast<float>(h);
  auto at = [&](const __half* base, int d) {
    return __half22float2(*reinterpret_cast<const __half2*>(base + d * kOutPitch + r));
  };
  auto lanes_sum = [](float2 v) {  // over the eight lanes of the same rows
#pragma unroll
    for (int off = 4; off < 32; off *= 2) {
      v.x += __shfl_xor_sync(0xffffffffu, v.x, off);
      v.y += __shfl_xor_sync(0xffffffffu, v.y, off);
    }
    return v;
  };
  float2 mean = make_float2(0.0f, 0.0f);
  for (int d = first; d < h; d += 8) {
    const float2 v = at(p, d);
    mean.x += v.x;
    mean.y += v.y;
  }
  mean = lanes_sum(mean);
  mean.x *= inv_h;
  mean.y *= inv_h;
  float2 var = make_float2(0.0f, 0.0f);
  for (int d = first; d < h; d += 8) {
    const float2 v = at(p, d);
    var.x += (v.x - mean.x) * (v.x - mean.x);
    var.y += (v.y - mean.y) * (v.y - mean.y);
  }
  var = lanes_sum(var);
  const float rstd0 = rsqrtf(var.x * inv_h + a.eps), rstd1 = rsqrtf(var.y * inv_h + a.eps);
  for (int d = first; d < a.hp; d += 8) {
    float2 o = make_float2(0.0f, 0.0f);
    if (d < h) {
      const float2 v = at(p, d), g = at(gate, d);
      const float w = ln[d], b = ln[a.hp + d];
      // rows past the tile's end hold whatever was staged there before: zeros instead
      o.x = r < valid ? ((v.x - mean.x) * rstd0 * w + b) * g.x : 0.0f;
      o.y = r + 1 < valid ? ((v.y - mean.y) * rstd1 * w + b) * g.y : 0.0f;
    }
    *reinterpret_cast<__half2*>(p + d * kOutPitch + r) = __floats2half2_rn(o.x, o.y);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, kOutBlocksPerSm) output(OutputArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  const OutputLayout l(a.hp, a.resident ? a.chunks * kOutChunkCols : kOutChunkCols);
  auto* const wo = reinterpret_cast<__half*>(smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp >> 2, wn = warp & 3;  // the warp's 32 rows and 32 columns of a chunk
  const int wpitch = l.wo_pitch();
  const int h = static_cast<int>(a.h);

  auto slot_p = [&](int s) { return reinterpret_cast<__half*>(smem + l.slot(s)); };
  auto slot_gate = [&](int s) { return slot_p(s) + a.hp * kOutPitch; };
  auto load_wo = [&](int row0, int rows) {
    const int pieces = a.hp / 8;
    for (int i = tid; i < rows * pieces; i += kThreads) {
      const int row = i / pieces, piece = i % pieces;
      cp_async_16(wo + row * wpitch + piece * 8,
                  a.wo + static_cast<std::int64_t>(row0 + row) * a.hp + piece * 8);
    }
  };
  struct Tile {
    std::int64_t b, i;
    int j0, valid;
  };
  auto tile_at = [&](std::int64_t t) {
    const std::int64_t bi = t / a.row_tiles;
    const int j0 = static_cast<int>(t % a.row_tiles) * kOutTileRows;
    return Tile{bi / a.n, bi % a.n, j0, static_cast<int>(a.n - j0 < kOutTileRows ? a.n - j0 : kOutTileRows)};
  };
  // Pieces of 8 j up to the tile's last valid row, which ends within the plane's padded row.
  auto load_tile = [&](std::int64_t t, int s) {
    if (t < a.tiles) {
      const Tile tile = tile_at(t);
      const std::int64_t base = tile.b * a.h * a.plane + tile.i * a.ldn + tile.j0;
      const int pieces = (tile.valid + 7) / 8;
      __half* const ps = slot_p(s);
      __half* const gs = slot_gate(s);
      for (int k = tid; k < h * 8; k += kThreads) {
        const int d = k >> 3, piece = k & 7;
        if (piece < pieces) {
          const std::int64_t from = base + d * a.plane + piece * 8;
          cp_async_16(ps + d * kOutPitch + piece * 8, a.p + from);
          cp_async_16(gs + d * kOutPitch + piece * 8, a.gate + from);
        }
      }
    }
    cp_async_commit();  // an empty group past the end keeps the counting uniform
  };

  if (a.resident) load_wo(0, a.chunks * kOutChunkCols);  // lands with the first tile
  load_tile(blockIdx.x, 0);
  float* const ln = reinterpret_cast<float*>(smem + l.ln());  // (read after the loop's first barrier)
  for (int d = tid; d < a.hp; d += kThreads) {
    ln[d] = d < h ? a.ln_weight[d] : 0.0f;
    ln[a.hp + d] = d < h ? a.ln_bias[d] : 0.0f;
  }
  T* const out = static_cast<T*>(a.out);
  int it = 0;
  for (std::int64_t t = blockIdx.x; t < a.tiles; t += gridDim.x, ++it) {
    const int s = it % kOutStages;
    load_tile(t + gridDim.x, (it + 1) % kOutStages);  // the slot freed at the end of the last tile
    cp_async_wait<1>();
    __syncthreads();
    const Tile tile = tile_at(t);
    __half* const as = slot_p(s);
    normalise_output_tile(as, slot_gate(s), ln, a, tile.valid);
    __syncthreads();

    const std::int64_t out_base =
        tile.b * a.out_stride[0] + tile.i * a.out_stride[1] + tile.j0 * a.out_stride[2];
    for (int chunk = 0; chunk < a.chunks; ++chunk) {
      const __half* w = wo;
      if (a.resident) {
        w += chunk * kOutChunkCols * wpitch;
      } else {
        __syncthreads();  // the previous chunk's columns are no longer read
        load_wo(chunk * kOutChunkCols, kOutChunkCols);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
      }
      float acc[2][4][4] = {};
      for (int k0 = 0; k0 < a.hp; k0 += 16) {
        std::uint32_t b[4][2];
#pragma unroll
        for (int nt = 0; nt < 4; nt += 2) {
          std::uint32_t r[4];
          const int row = wn * 32 + nt * 8 + (lane >> 4) * 8 + (lane & 7);
          ldmatrix_x4(r, w + row * wpitch + k0 + ((lane >> 3) & 1) * 8);
          b[nt][0] = r[0];
          b[nt][1] = r[1];
          b[nt + 1][0] = r[2];
          b[nt + 1][1] = r[3];
        }
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          // A is staged k by k (channel by channel): 8x8 blocks transposed on the way in
          std::uint32_t fa[4];
          ldmatrix_x4_trans(fa, as + (k0 + (lane >> 4) * 8 + (lane & 7)) * kOutPitch + wm * 32 +
                                    mt * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) mma_16816(acc[mt][nt], fa, b[nt][0], b[nt][1]);
        }
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = wm * 32 + mt * 16 + (lane >> 2) + 8 * half;
          if (r >= tile.valid) continue;
          T* const dst = out + out_base + r * a.out_stride[2];
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            const std::int64_t col = chunk * kOutChunkCols + wn * 32 + nt * 8 + 2 * (lane & 3);
            const float v0 = acc[mt][nt][2 * half], v1 = acc[mt][nt][2 * half + 1];
            if (a.pair_stores) {
              if (col < a.c) store_pair<T>(dst + col, v0, v1);
            } else {
              if (col < a.c) dst[col] = from_float<T>(v0);
              if (col + 1 < a.c) dst[col + 1] = from_float<T>(v1);
            }
          }
        }
      }
    }
    __syncthreads();  // slot s is free for the tile after next
  }
  cp_async_wait<0>();
}

// --------------------------------------------------------------------------- the launcher

std::size_t round_up(std::size_t v, std::size_t to) { return (v + to - 1) / to * to; }

template <typename Kernel, typename Args>
void launch_with_smem(Kernel kernel, std::int64_t blocks, std::size_t smem, const Args& args,
                      cudaStream_t stream, const char* name) {
  FUSEKIT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
  // All of the unified L1/shared memory as shared memory: room for the blocks the registers allow.
  FUSEKIT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                          cudaSharedmemCarveoutMaxShared));
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(args);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    throw_cuda_error(err, name, __FILE__, __LINE__);
  }
}

// The warpgroup projection kernel, one block a multiprocessor, on the mma.sync kernel's arguments.
template <typename T>
void launch_wg_project(const TrimulParams& p, const WgProjectLayout& layout, std::int64_t x_ld,
                       const ProjectArgs& pa, int device, cudaStream_t stream) {
  // Layouts differ with C: the kernel may take all the shared memory a block can have.
  // (Three warpgroups only at C <= 128: choose_wg_project_layout.)
  const int variant = layout.wgs == 3 ? 3 : (layout.cp - 1) / 128;
  const auto kernel = variant == 3          ? wg_project<T, 1, 3>
                      : layout.cp <= 128    ? wg_project<T, 1, 2>
                      : layout.cp <= 256    ? wg_project<T, 2, 2>
                                            : wg_project<T, 3, 2>;
  static std::atomic<bool> allowed[4][kMaxDevices];
  allow_shared_memory(kernel, static_cast<std::size_t>(max_shared_memory_per_block(device)), device,
                      allowed[variant], true,
                      [] { return concat(kOp, ": the warpgroup projection kernel"); });
  const int tiles = static_cast<int>(ceil_div(pa.m, std::int64_t{layout.tile_rows()}));
  const CUtensorMap w_map = make_tensor_map_2d(kOp, DType::Float16, pa.w5, pa.chunks * kWgChunkCols,
                                               layout.cp, layout.cp, kWgChunkCols);
  const CUtensorMap x_map = make_tensor_map_rows(kOp, p.dtype, p.x, pa.m, p.c, x_ld, layout.x_rows,
                                                 layout.x_box_c);
  // left, right and gate leave through the copy engine where the planes have no row padding (a
  // tile's 64 rows are then one run of each plane): boxes of 64 rows by 32 channels of a
  // [B, H, N N] tensor, clipped at H.
  std::optional<CUtensorMap> planes[3];
  if (pa.ldn == pa.n) {
    const std::int64_t nn = pa.n * pa.n;
    const std::int64_t dims[4] = {nn, pa.h, p.b, 1};
    const std::int64_t strides[3] = {pa.plane, pa.h * pa.plane, p.b * pa.h * pa.plane};
    __half* const bases[3] = {pa.left, pa.right, pa.gate};
    for (int i = 0; i < 3; ++i) {
      planes[i] = make_tensor_map_4d(kOp, DType::Float16, bases[i], dims, strides, kChunkD);
    }
  }
  const bool by_copy = planes[0] && planes[1] && planes[2];
  const int blocks = std::min(tiles, multiprocessor_count(device));
  kernel<<<blocks, wg_project_threads(layout.wgs), layout.bytes(), stream>>>(
      w_map, x_map, by_copy ? *planes[0] : w_map, by_copy ? *planes[1] : w_map,
      by_copy ? *planes[2] : w_map, pa, layout, tiles, by_copy);
  FUSEKIT_CUDA_CHECK_LAUNCH("trimul wg_project");
}

template <typename T>
void run(const TrimulParams& p, int device, cudaStream_t stream) {
  const std::int64_t m = p.rows();
  const std::int64_t chunks = ceil_div(p.h, kChunkD), hp = chunks * kChunkD;
  const int smem_limit = max_shared_memory_per_block(device);

  // The projection kernel: the warpgroup kernel where it fits (see TrimulProjectKernel).
  const std::int64_t x_ld = uniform_row_stride(p);
  const std::optional<WgProjectLayout> wg_layout =
      choose_wg_project_layout(p.c, sizeof(T), smem_limit);
  const bool wg_fits = has_warpgroup_mma(device) && wg_layout.has_value() && x_ld >= p.c &&
                       x_ld * static_cast<std::int64_t>(sizeof(T)) % 16 == 0 && is_aligned(p.x, 16) &&
                       m <= std::numeric_limits<int>::max() - wg_layout->tile_rows();
  bool use_wg = false;
  switch (p.project_kernel) {
    case TrimulProjectKernel::Auto: use_wg = wg_fits; break;
    case TrimulProjectKernel::MmaSync: use_wg = false; break;
    case TrimulProjectKernel::Warpgroup:
      FUSEKIT_CHECK(wg_fits, kOp, ": the warpgroup projection kernel was asked for, and it needs an ",
                    "sm_90a build on a compute capability 9.0 device, C <= ", kWgProjectMaxC,
                    " and rows of x 16-byte aligned and evenly spaced (device ", device,
                    has_warpgroup_mma(device) ? " has warpgroup MMAs" : " has no warpgroup MMAs",
                    ", C = ", p.c, ", x strides ", p.x_stride[0], ", ", p.x_stride[1], ", ",
                    p.x_stride[2], ")");
      use_wg = true;
      break;
  }
  const std::int64_t cp = use_wg ? wg_layout->cp : ceil_div(p.c, kKSlice) * kKSlice;
  const std::int64_t out_chunks = ceil_div(p.c, kOutChunkCols), cpo = out_chunks * kOutChunkCols;
  const std::int64_t ldn = ceil_div(p.n, 8) * 8, plane = p.n * ldn;

  // Kernel configurations first, so that an unsupported size fails before any work is queued.
  // The tallest projection tile that leaves room for two blocks per multiprocessor (one block's
  // LayerNorm and stores overlap the other's matrix product), else the tallest that fits.
  const int smem_per_sm = shared_memory_per_multiprocessor(device);
  int project_mt = 0;
  for (int pass = 0; pass < 2 && project_mt == 0; ++pass) {
    for (int mt : {4, 2, 1}) {
      const std::size_t bytes = ProjectSmem(32 * mt, cp).bytes();
      const bool two = 2 * (bytes + 1024) <= static_cast<std::size_t>(smem_per_sm);
      if (bytes <= static_cast<std::size_t>(smem_limit) && (two || pass == 1)) {
        project_mt = mt;
        break;
      }
    }
  }
  FUSEKIT_CHECK(use_wg || project_mt > 0, kOp, ": C = ", p.c, " is too large for the CUDA backend (a tile ",
                "of 32 normalised rows needs ", ProjectSmem(32, cp).bytes(),
                " bytes of shared memory; the device has ", smem_limit, ")");
  // The output kernel keeps all of to_out in shared memory where it fits beside the tile slots.
  const OutputLayout out_resident(static_cast<int>(hp), static_cast<int>(cpo));
  const bool resident = out_resident.bytes() <= static_cast<std::size_t>(smem_limit);
  const OutputLayout out_layout = resident ? out_resident : OutputLayout(static_cast<int>(hp), kOutChunkCols);
  FUSEKIT_CHECK(out_layout.bytes() <= static_cast<std::size_t>(smem_limit), kOp, ": H = ", p.h,
                " is too large for the CUDA backend (two tiles of 64 rows of p and gate and 128 rows ",
                "of to_out need ", out_layout.bytes(), " bytes of shared memory; the device has ",
                smem_limit, ")");

  // One workspace: packed weights, LayerNorm parameters, the planes of left, right, p and gate.
  const std::size_t w5_bytes = round_up(chunks * kProjCols * cp * 2, 256);
  const std::size_t wo_bytes = round_up(cpo * hp * 2, 256);
  const std::size_t ln_bytes = round_up((2 * p.c + 2 * p.h) * 4, 256);
  const std::size_t plane_bytes = round_up(p.b * p.h * plane * 2, 256);
  const StreamWorkspace ws(w5_bytes + wo_bytes + ln_bytes + 4 * plane_bytes, stream);
  auto* base = ws.as<unsigned char>();
  auto* w5 = reinterpret_cast<__half*>(base);
  auto* wo = reinterpret_cast<__half*>(base + w5_bytes);
  auto* ln = reinterpret_cast<float*>(base + w5_bytes + wo_bytes);
  auto* left = reinterpret_cast<__half*>(base + w5_bytes + wo_bytes + ln_bytes);
  auto* right = reinterpret_cast<__half*>(base + w5_bytes + wo_bytes + ln_bytes + plane_bytes);
  auto* pp = reinterpret_cast<__half*>(base + w5_bytes + wo_bytes + ln_bytes + 2 * plane_bytes);
  auto* gate = reinterpret_cast<__half*>(base + w5_bytes + wo_bytes + ln_bytes + 3 * plane_bytes);

  PackArgs pack{};
  for (int i = 0; i < kProjections; ++i) pack.proj[i] = p.proj[i];
  pack.to_out = p.to_out;
  pack.norm_weight = p.norm_weight;
  pack.norm_bias = p.norm_bias;
  pack.out_norm_weight = p.to_out_norm_weight;
  pack.out_norm_bias = p.to_out_norm_bias;
  pack.c = p.c;
  pack.h = p.h;
  pack.cp = cp;
  pack.hp = hp;
  pack.cpo = cpo;
  pack.chunks = chunks;
  pack.by_projection = use_wg;
  pack.w5 = w5;
  pack.wo = wo;
  pack.ln = ln;
  const std::int64_t pack_items = chunks * kProjCols * cp + cpo * hp + 2 * p.c + 2 * p.h;
  const std::int64_t pack_blocks =
      std::min<std::int64_t>(ceil_div(pack_items, kThreads), std::int64_t{multiprocessor_count(device)} * 4);
  pack_weights<T><<<static_cast<unsigned>(pack_blocks), kThreads, 0, stream>>>(pack);
  FUSEKIT_CUDA_CHECK_LAUNCH("trimul pack_weights");

  ProjectArgs pa{};
  pa.x = p.x;
  // Rows of x are copied by cp.async when every row is a 16-byte aligned multiple of 16 bytes.
  const std::int64_t row_bytes = p.c * static_cast<std::int64_t>(sizeof(T));
  pa.x_staged = row_bytes % 16 == 0 && is_aligned(p.x, 16) &&
                std::all_of(p.x_stride, p.x_stride + 3,
                            [](std::int64_t s) { return s * static_cast<std::int64_t>(sizeof(T)) % 16 == 0; });
  const std::int64_t stage_rows =
      static_cast<std::int64_t>(ProjectSmem(32 * project_mt, cp).x_stage_bytes()) / row_bytes / 8 * 8;
  pa.x_group = static_cast<int>(std::min<std::int64_t>(stage_rows, 32 * project_mt));
  if (pa.x_group < 8) pa.x_staged = false;
  pa.mask = p.mask;
  pa.mask_dtype = p.mask_dtype;
  for (int d = 0; d < 3; ++d) {
    pa.x_stride[d] = p.x_stride[d];
    pa.mask_stride[d] = p.mask_stride[d];
  }
  pa.m = m;
  pa.n = p.n;
  pa.c = p.c;
  pa.h = p.h;
  pa.cp = cp;
  pa.chunks = static_cast<int>(chunks);
  pa.w5 = w5;
  pa.ln_weight = ln;
  pa.ln_bias = ln + p.c;
  pa.eps = p.eps;
  pa.left = left;
  pa.right = right;
  pa.gate = gate;
  pa.ldn = ldn;
  pa.plane = plane;
  pa.x_ld = x_ld;
  if (use_wg) {
    launch_wg_project<T>(p, *wg_layout, x_ld, pa, device, stream);
  } else {
    const auto launch_project = [&](auto kernel, int mt) {
      launch_with_smem(kernel, ceil_div(m, 32 * mt), ProjectSmem(32 * mt, cp).bytes(), pa, stream,
                       "launch of trimul project");
    };
    switch (project_mt) {
      case 4: launch_project(project<T, 4>, 4); break;
      case 2: launch_project(project<T, 2>, 2); break;
      default: launch_project(project<T, 1>, 1); break;
    }
  }

  pairwise(p, left, right, pp, ldn, plane, device, stream);

  OutputArgs oa{};
  oa.p = pp;
  oa.gate = gate;
  oa.n = p.n;
  oa.c = p.c;
  oa.h = p.h;
  oa.ldn = ldn;
  oa.plane = plane;
  oa.row_tiles = static_cast<int>(ceil_div(p.n, kOutTileRows));
  oa.tiles = p.b * p.n * oa.row_tiles;
  oa.hp = static_cast<int>(hp);
  oa.chunks = static_cast<int>(out_chunks);
  oa.resident = resident;
  oa.pair_stores = p.c % 2 == 0 && is_aligned(p.out, 2 * sizeof(T)) &&
                   std::all_of(p.out_stride, p.out_stride + 3, [](std::int64_t s) { return s % 2 == 0; });
  oa.wo = wo;
  oa.ln_weight = ln + 2 * p.c;
  oa.ln_bias = ln + 2 * p.c + p.h;
  oa.eps = static_cast<float>(static_cast<double>(p.eps) / (static_cast<double>(p.n) * p.n));
  oa.out = p.out;
  for (int d = 0; d < 3; ++d) oa.out_stride[d] = p.out_stride[d];
  // Persistent: as many blocks as fit on the device at once (kOutBlocksPerSm a multiprocessor
  // where their shared memory fits, else one), each taking every gridDim-th tile.
  const std::size_t out_bytes = out_layout.bytes();
  static std::atomic<bool> allowed[kMaxDevices];
  allow_shared_memory(output<T>, static_cast<std::size_t>(smem_limit), device, allowed, true,
                      [] { return concat(kOp, ": the output kernel"); });
  const int per_sm =
      kOutBlocksPerSm * (out_bytes + 1024) <= static_cast<std::size_t>(smem_per_sm) ? kOutBlocksPerSm : 1;
  const std::int64_t out_blocks =
      std::min<std::int64_t>(oa.tiles, std::int64_t{per_sm} * multiprocessor_count(device));
  output<T><<<static_cast<unsigned>(out_blocks), kThreads, out_bytes, stream>>>(oa);
  FUSEKIT_CUDA_CHECK_LAUNCH("trimul output");
}

}  // namespace

void launch_trimul(const TrimulParams& p, int device, Stream stream) {
  const CudaDeviceGuard guard(device);
  const cudaStream_t s = stream_on(kOp, stream, device);
  dispatch_floating(p.dtype, kOp, [&](auto tag) {
    run<typename CudaType<decltype(tag)::value>::type>(p, device, s);
  });
}

}  // namespace fusekit::detail
