// The CUDA backend of the cheri_block family.
//
// Plane passes (dilated_conv_norm and the first half of every block pass). The plane of example n
// is cut into blocks of whole rows (about kBlockElements values); a block recomputes the dilated
// convolution from x (the +-d taps come through L1/L2) and writes one partial per block:
//   - statistics: (count, mean, M2) of its conv values, from per-thread Chan merges of 16-byte
//     vectors and a warp/block merge in a fixed order; a finalize kernel merges an example's
//     partials in block order in double and writes mean and rstd;
//   - backward: the sums of dy and dy * y, then grad_x and the block's [3, C] share of the
//     convolution weight gradient; the shares are added in a fixed order by sum_partials.
// 16-byte vector loads where C and every pointer and stride allow, one element at a time
// otherwise.
//
// Inference (cheri_block_inference). The statistics, then one persistent kernel: each CTA turns
// the two linear weights into float16 in shared memory once, then loops over tiles of 128 rows
// of (n, l), x of the next tile arriving by cp.async while the current one runs. Each of the 8
// warps owns 16 rows through both products: conv + norm straight into float16 A fragments in
// registers (taps from the shared tile, or from global near the tile's ends), then per 16 hidden
// columns GEMM1 (mma.sync m16n8k16, float32 accumulation), GELU(tanh) in float32 into GEMM2's A
// fragments, GEMM2 accumulating [16, C] in registers; out = x + residual_scale * acc, x kept in
// registers from the tile. C of 64 and 128 with E C a multiple of 64; other shapes (or
// misaligned rows) take the training forward's path. On sm_90a the block runs on a
// warp-specialised warpgroup-MMA kernel for E = 2 (cheri_inference_ws_kernel), and on the
// warpgroup MMAs of cheri_inference_wgmma_kernel for other E.
//
// Training (cheri_block, cheri_block_backward). In float32 with allow_tf32 and C of 64 or 128,
// the forward is the inference path with its statistics kept, and on sm_90a with E = 2 the
// backward is one warpgroup-MMA kernel that writes y, grad_out, GELU(h) and dg in float16 (each
// row scaled by a power of two) and the norm's row sums (cheri_backward_front_kernel), then
// weight_grad_kernel for grad W1 with dy = dg W1 (float16, each 32-column piece of a row scaled
// by a power of two, where the staged pass below takes it) and for grad W2, then the norm's and
// convolution's backward. Otherwise float32 intermediates, the activation products through
// cuBLASLt (TF32 for float32 inputs when allow_tf32, full float32 otherwise) and elementwise
// kernels between them; float32 x, out and grad_out that are matrices (rows one stride apart)
// enter the products in place: the forward's second product adds x, the backward reads grad_out
// with residual_scale as alpha. There the weight gradients are strided-batched products over
// slices of kSliceRows rows, added slice by slice in order.
//
// Determinism: no float atomics; every reduction has a fixed order, set by the shape (and, for
// weight_grad_kernel's blocks, the number of multiprocessors); cuBLASLt runs the heuristic's first
// algorithm without split-K reductions.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>

#include "common/cublaslt.h"
#include "common/cuda_check.h"
#include "common/cuda_math.cuh"
#include "common/cuda_mma.cuh"
#include "common/cuda_wgmma.cuh"
#include "common/cuda_reduce.cuh"
#include "common/cuda_types.cuh"
#include "common/cuda_workspace.h"
#include "common/dependent_launch.cuh"
#include "common/dispatch.h"
#include "fusekit/error.h"
#include "ops/cheri_block/cheri_block_params.h"

namespace fusekit::detail {

namespace {

constexpr const char* kOp = "cheri_block";
constexpr int kThreads = 256;
constexpr std::int64_t kBlockElements = 8192;  // conv values per block of the plane passes
constexpr std::int64_t kStatsElements = 32768;  // conv values per block of the statistics pass
constexpr int kStatsUnroll = 2;                 // rows whose loads a thread issues together
// Shared memory of a block of the staged statistics pass (its rows of x and their halo), and the
// blocks an SM holds.
constexpr std::size_t kStatsStageBytes = 40960;
constexpr int kStatsStagedBlocks = 4;
constexpr int kFrontScratchFloats = 4;  // the front kernel's weight norms
constexpr std::int64_t kSliceRows = 4096;      // rows per slice of the weight-gradient products
constexpr std::size_t kMaxGemmWorkspace = std::size_t{32} << 20;
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

// ------------------------------------------------------------------------------------ device

template <typename T>
__device__ __forceinline__ const T* row_of(const CheriActivation& a, std::int64_t n,
                                           std::int64_t l) {
  return static_cast<const T*>(a.data) + n * a.stride[0] + l * a.stride[1];
}

template <typename T>
__device__ __forceinline__ T* out_row_of(const CheriActivation& a, std::int64_t n,
                                         std::int64_t l) {
  return static_cast<T*>(a.data) + n * a.stride[0] + l * a.stride[1];
}

__device__ __forceinline__ float load_weight(const CheriMatrix& m, std::int64_t r,
                                             std::int64_t c) {
  const std::int64_t off = r * m.stride[0] + c * m.stride[1];
  switch (m.dtype) {
    case DType::Float16: return __half2float(static_cast<const __half*>(m.data)[off]);
    case DType::BFloat16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(m.data)[off]);
    default: return static_cast<const float*>(m.data)[off];
  }
}

__device__ __forceinline__ void store_weight(const CheriMatrix& m, std::int64_t r, std::int64_t c,
                                             float v) {
  const std::int64_t off = r * m.stride[0] + c * m.stride[1];
  switch (m.dtype) {
    case DType::Float16: static_cast<__half*>(m.data)[off] = __float2half_rn(v); break;
    case DType::BFloat16:
      static_cast<__nv_bfloat16*>(m.data)[off] = __float2bfloat16_rn(v);
      break;
    default: static_cast<float*>(m.data)[off] = v; break;
  }
}

__device__ __forceinline__ float gelu_tanh(float h) {
  return 0.5f * h * (1.0f + tanhf(kGeluScale * (h + kGeluCubic * h * h * h)));
}

/// GELU(h) and GELU'(h) from one tanh.
struct GeluAndGrad {
  float value, grad;
};

__device__ __forceinline__ GeluAndGrad gelu_tanh_and_grad(float h) {
  const float t = tanhf(kGeluScale * (h + kGeluCubic * h * h * h));
  return {0.5f * h * (1.0f + t),
          0.5f * (1.0f + t) +
              0.5f * h * (1.0f - t * t) * kGeluScale * (1.0f + 3.0f * kGeluCubic * h * h)};
}

/// GELU(tanh) and GELU' from the parts of gelu_tanh_parts (s = 1 / (1 + e), p = e s, e =
/// exp(2 u)): GELU = h p and GELU' = p + 2 h s p u' (large h give h and 1). Some 13 instructions
/// where tanhf takes about twice that.
__device__ __forceinline__ GeluAndGrad gelu_tanh_and_grad_fast(float h) {
  const auto [s, p] = gelu_tanh_parts(h);
  const float du = fmaf(6.0f * kGeluCubic * kGeluScale, h * h, 2.0f * kGeluScale);  // 2 u'
  return {h * p, fmaf(h * s * p, du, p)};
}

/// The same function through the hardware tanh (tanh.approx, relative error about 2^-11, the
/// rounding of the float16 it is stored in next).
__device__ __forceinline__ float gelu_tanh_approx(float h) {
  const float u = h * (kGeluScale + kGeluScale * kGeluCubic * h * h);
  float t;
  asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(u));
  const float half_h = 0.5f * h;
  return fmaf(half_h, t, half_h);
}

/// conv[n, l, c0 .. c0 + V) from x and the taps w [3, C] float32 (x is zero outside 0..L-1).
template <typename T, int V>
__device__ __forceinline__ void conv_at(const CheriBlockParams& p, const float* w, std::int64_t n,
                                        std::int64_t l, std::int64_t c0, float (&v)[V]) {
  float mid[V], tap[V], wk[V];
  load_vec<T, V>(row_of<T>(p.x, n, l) + c0, mid);
  load_vec<float, V>(w + p.c + c0, wk);
#pragma unroll
  for (int k = 0; k < V; ++k) v[k] = wk[k] * mid[k];
  if (l >= p.dilation) {
    load_vec<T, V>(row_of<T>(p.x, n, l - p.dilation) + c0, tap);
    load_vec<float, V>(w + c0, wk);
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] += wk[k] * tap[k];
  }
  if (l + p.dilation < p.l) {
    load_vec<T, V>(row_of<T>(p.x, n, l + p.dilation) + c0, tap);
    load_vec<float, V>(w + 2 * p.c + c0, wk);
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] += wk[k] * tap[k];
  }
}

/// A block of the plane passes: rows [l0, l1) of example n; threads laid out as `tpr` channel
/// groups (of V channels) by `lanes` rows.
struct PlaneBlock {
  std::int64_t n, l0, l1;
  int groups, tpr, lanes;
};

template <int V>
__device__ __forceinline__ PlaneBlock plane_block(const CheriBlockParams& p, std::int64_t rows,
                                                  std::int64_t chunks) {
  PlaneBlock b;
  b.n = blockIdx.x / chunks;
  b.l0 = (blockIdx.x % chunks) * rows;
  b.l1 = min(p.l, b.l0 + rows);
  b.groups = static_cast<int>(p.c / V);
  b.tpr = min(b.groups, kThreads);
  b.lanes = kThreads / b.tpr;
  return b;
}

struct Moments {
  double count, mean, m2;
};

// Chan et al.: the moments of the union of two disjoint sets.
__device__ __forceinline__ Moments merge(const Moments& a, const Moments& b) {
  const double count = a.count + b.count;
  if (count == 0.0) return a;
  const double delta = b.mean - a.mean;
  const double fb = b.count / count;
  return {count, a.mean + delta * fb, a.m2 + b.m2 + delta * delta * a.count * fb};
}

/// Calls f(l, c0) for every row l and channel group c0 of the block's part of the plane.
template <int V, typename F>
__device__ __forceinline__ void for_each_unit(const PlaneBlock& b, F&& f) {
  const int t = threadIdx.x;
  if (t >= b.tpr * b.lanes) return;
  for (int cg = t % b.tpr; cg < b.groups; cg += b.tpr) {
    for (std::int64_t l = b.l0 + t / b.tpr; l < b.l1; l += b.lanes) {
      f(l, static_cast<std::int64_t>(cg) * V);
    }
  }
}

// ------------------------------------------------------------------------------------ kernels

/// Elements first, first + step, ... of weight [rows, cols] (any dtype and strides) into dense
/// float32 `dst`.
__device__ __forceinline__ void pack_elements(const CheriMatrix& src, std::int64_t rows,
                                              std::int64_t cols, float* dst, std::int64_t first,
                                              std::int64_t step) {
  for (std::int64_t i = first; i < rows * cols; i += step) {
    dst[i] = load_weight(src, i / cols, i % cols);
  }
}

/// Weight [rows, cols] of any dtype and strides -> dense float32.
__global__ void pack_matrix_kernel(const CheriMatrix src, std::int64_t rows, std::int64_t cols,
                                   float* dst) {
  pack_elements(src, rows, cols, dst,
                blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x,
                static_cast<std::int64_t>(gridDim.x) * blockDim.x);
}

/// What the backward's front path reads of the weights besides their elements, one value per row j
/// of linear1 [E C, C] and of W2^T [E C, C]: [kWeightRowFacts][E C] floats, computed once a call
/// (backward_weights_kernel), where every block of the front and weight-gradient kernels used to
/// read both matrices for them (16 us of a training step at N64 L2114 C128 on H100).
enum WeightRowFact : int {
  kRowSum,      // sum_c W1[j, c]: u, whose products with dg give the norm's row sums
  kRowNorm1,    // |W1[j, :]|
  kRowNorm2,    // |W2^T[j, :]|
  kRowLargest,  // max_c |W1[j, c]|, found as bits (a NaN of the row above infinity)
  kWeightRowFacts
};

/// The front path's weights in one launch: the first `fact_blocks` blocks take a row j of linear1
/// (`w1`, dense) a warp and write its WeightRowFacts into `facts`; the others pack W2^T dense
/// (`w2t_src`: linear2 seen transposed) into `w2t`, as pack_matrix_kernel does.
__global__ void __launch_bounds__(kThreads)
    backward_weights_kernel(const float* w1, const CheriMatrix w2t_src, std::int64_t hidden,
                            std::int64_t c, float* w2t, float* facts, unsigned fact_blocks) {
  if (blockIdx.x < fact_blocks) {
    constexpr int kWarps = kThreads / kWarpSize;
    const std::int64_t j = blockIdx.x * std::int64_t{kWarps} + threadIdx.x / kWarpSize;
    if (j >= hidden) return;
    float sum = 0.0f, square1 = 0.0f, square2 = 0.0f;
    int largest = 0;  // non-negative floats order as their bits
    for (std::int64_t k = threadIdx.x % kWarpSize; k < c; k += kWarpSize) {
      const float a = w1[j * c + k], b = load_weight(w2t_src, j, k);
      sum += a;
      square1 = fmaf(a, a, square1);
      square2 = fmaf(b, b, square2);
      largest = max(largest, __float_as_int(fabsf(a)));
    }
    sum = warp_sum(sum);
    square1 = warp_sum(square1);
    square2 = warp_sum(square2);
    largest = __reduce_max_sync(0xffffffffu, largest);
    if (threadIdx.x % kWarpSize == 0) {
      facts[kRowSum * hidden + j] = sum;
      facts[kRowNorm1 * hidden + j] = sqrtf(square1);
      facts[kRowNorm2 * hidden + j] = sqrtf(square2);
      facts[kRowLargest * hidden + j] = __int_as_float(largest);
    }
    return;
  }
  pack_elements(w2t_src, hidden, c, w2t,
                (blockIdx.x - fact_blocks) * std::int64_t{blockDim.x} + threadIdx.x,
                static_cast<std::int64_t>(gridDim.x - fact_blocks) * blockDim.x);
}

/// A thread's running sums of the statistics pass: its values' count, and the sums of the values
/// and their squares, shifted by its first value so that the sums do not cancel.
struct ShiftedSums {
  float shift = 0.0f;
  double s1 = 0.0, s2 = 0.0;
  int count = 0;

  /// Adds conv = wm x + wl left + wr right (a tap left out where it lies outside the plane) of V
  /// channels of one row: summed in float over the row's channels, then in double.
  template <int V>
  __device__ __forceinline__ void add_row(const float (&wl)[V], const float (&wm)[V],
                                          const float (&wr)[V], const float (&left)[V],
                                          const float (&mid)[V], const float (&right)[V],
                                          bool has_left, bool has_right) {
    float e1 = 0.0f, e2 = 0.0f;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      float v = wm[k] * mid[k];
      if (has_left) v += wl[k] * left[k];
      if (has_right) v += wr[k] * right[k];
      if (count == 0 && k == 0) shift = v;
      const float e = v - shift;
      e1 += e;
      e2 += e * e;
    }
    s1 += e1;
    s2 += e2;
    count += V;
  }

  /// add_row where a tap outside the plane reads zeros: no selection, the shift folded into the
  /// first product (taken as the first value of the thread's first row).
  template <int V>
  __device__ __forceinline__ void add_padded_row(const float (&wl)[V], const float (&wm)[V],
                                                 const float (&wr)[V], const float (&left)[V],
                                                 const float (&mid)[V], const float (&right)[V]) {
    if (count == 0) shift = wm[0] * mid[0] + wl[0] * left[0] + wr[0] * right[0];
    float e1 = 0.0f, e2 = 0.0f;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float e = fmaf(wl[k], left[k], fmaf(wr[k], right[k], fmaf(wm[k], mid[k], -shift)));
      e1 += e;
      e2 = fmaf(e, e, e2);
    }
    s1 += e1;
    s2 += e2;
    count += V;
  }
};

/// The block's moments (its threads' sums merged, Chan, in a fixed order) into its partial
/// [3] (count, mean, M2) of `partial` (double).
__device__ __forceinline__ void write_block_moments(const ShiftedSums& sums, double* partial) {
  const int t = threadIdx.x;
  Moments acc{0.0, 0.0, 0.0};
  if (sums.count > 0) {
    const double count = sums.count;
    acc = {count, sums.shift + sums.s1 / count, fmax(0.0, sums.s2 - sums.s1 * sums.s1 / count)};
  }
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
    const Moments other{__shfl_down_sync(0xffffffffu, acc.count, offset),
                        __shfl_down_sync(0xffffffffu, acc.mean, offset),
                        __shfl_down_sync(0xffffffffu, acc.m2, offset)};
    acc = merge(acc, other);
  }
  __shared__ Moments warps[kThreads / kWarpSize];
  if (t % kWarpSize == 0) warps[t / kWarpSize] = acc;
  __syncthreads();
  if (t == 0) {
    Moments total = warps[0];
    for (int i = 1; i < kThreads / kWarpSize; ++i) total = merge(total, warps[i]);
    double* dst = partial + 3 * static_cast<std::int64_t>(blockIdx.x);
    dst[0] = total.count;
    dst[1] = total.mean;
    dst[2] = total.m2;
  }
}

/// Per block: (count, mean, M2) of its conv values into partial [N chunks, 3] (double). Each
/// thread keeps its channels' taps in registers and walks its rows kStatsUnroll at a time, every
/// load of those rows issued before the arithmetic (ShiftedSums); the threads' moments are then
/// merged in a fixed order.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    plane_stats_kernel(const CheriBlockParams p, const float* w, std::int64_t rows,
                       std::int64_t chunks, double* partial) {
  allow_dependents();  // the finalize waits for this pass's completion
  const PlaneBlock b = plane_block<V>(p, rows, chunks);
  const int t = threadIdx.x;
  const std::int64_t d = p.dilation;
  ShiftedSums sums;
  if (t < b.tpr * b.lanes) {
    for (int cg = t % b.tpr; cg < b.groups; cg += b.tpr) {
      const std::int64_t c0 = static_cast<std::int64_t>(cg) * V;
      float wl[V], wm[V], wr[V];
      load_vec<float, V>(w + c0, wl);
      load_vec<float, V>(w + p.c + c0, wm);
      load_vec<float, V>(w + 2 * p.c + c0, wr);
      for (std::int64_t l = b.l0 + t / b.tpr; l < b.l1; l += kStatsUnroll * b.lanes) {
        // Rows past the block's end or taps outside the plane read a row that exists (their
        // values are then left out, never multiplied by zero, so that no NaN or inf of them
        // leaks in).
        float xl[kStatsUnroll][V], xm[kStatsUnroll][V], xr[kStatsUnroll][V];
#pragma unroll
        for (int u = 0; u < kStatsUnroll; ++u) {
          const std::int64_t lu = min(l + u * b.lanes, b.l1 - 1);
          load_vec<T, V>(row_of<T>(p.x, b.n, lu) + c0, xm[u]);
          load_vec<T, V>(row_of<T>(p.x, b.n, lu >= d ? lu - d : lu) + c0, xl[u]);
          load_vec<T, V>(row_of<T>(p.x, b.n, lu + d < p.l ? lu + d : lu) + c0, xr[u]);
        }
#pragma unroll
        for (int u = 0; u < kStatsUnroll; ++u) {
          const std::int64_t lu = l + u * b.lanes;
          if (lu >= b.l1) break;
          sums.add_row(wl, wm, wr, xl[u], xm[u], xr[u], lu >= d, lu + d < p.l);
        }
      }
    }
  }
  write_block_moments(sums, partial);
}

/// The statistics pass on sm_90 where x's rows are dense and 16-byte aligned: the same blocks'
/// work, but each block first brings its rows and their halo ([l0 - d, l1 + d) of example n,
/// clipped to the plane) into shared memory with one bulk copy, after a row of zeros that the
/// taps outside the plane read; every row is read from global memory once (stats_grid sizes the
/// blocks).
template <typename T, int V>
__global__ void __launch_bounds__(kThreads, kStatsStagedBlocks)
    plane_stats_staged_kernel(const CheriBlockParams p, const float* w, std::int64_t rows,
                              std::int64_t chunks, double* partial) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  allow_dependents();  // the finalize waits for this pass's completion
  extern __shared__ __align__(128) unsigned char stage_raw[];
  __shared__ std::uint64_t arrived;
  const PlaneBlock b = plane_block<V>(p, rows, chunks);
  const int t = threadIdx.x;
  const std::int64_t d = p.dilation, c = p.c;
  const std::int64_t halo = d < p.l ? d : 0;  // no taps at all for d >= L
  const std::int64_t lo = max(b.l0 - halo, std::int64_t{0}), hi = min(b.l1 + halo, p.l);
  const auto row_bytes = static_cast<std::uint32_t>(c * sizeof(T));
  const T* xs = reinterpret_cast<const T*>(stage_raw);  // zeros, then row lo + r at row 1 + r
  if (t == 0) {
    mbarrier_init(&arrived, 1);
    mbarrier_init_fence();
    const auto bytes = static_cast<std::uint32_t>(hi - lo) * row_bytes;
    mbarrier_arrive_expect_bytes(&arrived, bytes);
    bulk_copy_to_shared(stage_raw + row_bytes, row_of<T>(p.x, b.n, lo), bytes, &arrived);
  }
  for (std::uint32_t i = t; i < row_bytes / 16; i += kThreads) {
    reinterpret_cast<uint4*>(stage_raw)[i] = make_uint4(0, 0, 0, 0);
  }
  __syncthreads();  // the zeros are written and the barrier initialised before anyone waits
  // offsets within the stage in int: rows of the stage, elements from its start
  const int r_end = static_cast<int>(b.l1 - lo) + 1, hd = static_cast<int>(halo);
  const int cc = static_cast<int>(c);
  ShiftedSums sums;
  if (t < b.tpr * b.lanes) {
    for (int cg = t % b.tpr; cg < b.groups; cg += b.tpr) {
      const int c0 = cg * V;
      float wl[V], wm[V], wr[V];
      load_vec<float, V>(w + c0, wl);
      load_vec<float, V>(w + c + c0, wm);
      load_vec<float, V>(w + 2 * c + c0, wr);
      mbarrier_wait(&arrived, 0);  // returns at once after the first time
      for (int r = static_cast<int>(b.l0 - lo) + 1 + t / b.tpr; r < r_end; r += b.lanes) {
        const std::int64_t l = lo + r - 1;
        const int left = l >= d ? r - hd : 0, right = l + d < p.l ? r + hd : 0;
        float xl[V], xm[V], xr[V];
        load_shared_floats<T, V>(xs + r * cc + c0, xm);
        load_shared_floats<T, V>(xs + left * cc + c0, xl);
        load_shared_floats<T, V>(xs + right * cc + c0, xr);
        sums.add_padded_row(wl, wm, wr, xl, xm, xr);
      }
    }
  }
  write_block_moments(sums, partial);
#endif
}

/// Per example (a warp each): its partials merged (Chan, double) in a fixed order, lane i taking
/// partials i, i + 32, ... and the lanes' moments then merged in a fixed tree -> mean and rstd,
/// into the workspace [N] and, when given, the caller's outputs.
__global__ void stats_finalize_kernel(const double* partial, std::int64_t n_examples,
                                      std::int64_t chunks, double eps, float* mean_ws,
                                      float* rstd_ws, const CheriStat mean_out,
                                      const CheriStat rstd_out) {
  allow_dependents();
  wait_for_prerequisites();  // launched as a dependent of the statistics pass
  const std::int64_t n =
      (blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x % kWarpSize);
  if (n >= n_examples) return;  // the whole warp
  Moments m{0.0, 0.0, 0.0};
  for (std::int64_t i = lane; i < chunks; i += kWarpSize) {
    const double* part = partial + 3 * (n * chunks + i);
    m = merge(m, {part[0], part[1], part[2]});
  }
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const Moments other{__shfl_down_sync(0xffffffffu, m.count, offset),
                        __shfl_down_sync(0xffffffffu, m.mean, offset),
                        __shfl_down_sync(0xffffffffu, m.m2, offset)};
    m = merge(m, other);
  }
  if (lane != 0) return;
  const float mean_f = static_cast<float>(m.mean);
  const float rstd_f = static_cast<float>(1.0 / sqrt(m.m2 / m.count + eps));
  mean_ws[n] = mean_f;
  rstd_ws[n] = rstd_f;
  if (mean_out.data) mean_out.data[n * mean_out.stride] = mean_f;
  if (rstd_out.data) rstd_out.data[n * rstd_out.stride] = rstd_f;
}

/// y = (conv - mean) * rstd for every row, into `y` (x's dtype, or a dense float32 buffer).
template <typename T, typename O, int V>
__global__ void __launch_bounds__(kThreads)
    conv_norm_apply_kernel(const CheriBlockParams p, const float* w, const CheriStat mean,
                           const CheriStat rstd, const CheriActivation y, std::int64_t rows,
                           std::int64_t chunks) {
  const PlaneBlock b = plane_block<V>(p, rows, chunks);
  const float m = mean.data[b.n * mean.stride], r = rstd.data[b.n * rstd.stride];
  for_each_unit<V>(b, [&](std::int64_t l, std::int64_t c0) {
    float v[V];
    conv_at<T, V>(p, w, b.n, l, c0, v);
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = (v[k] - m) * r;
    store_vec<O, V>(out_row_of<O>(y, b.n, l) + c0, v);
  });
}

/// dst (dense float32 [N L, C]) = src.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    to_dense_kernel(const CheriBlockParams p, const CheriActivation src, float* dst,
                    std::int64_t rows, std::int64_t chunks) {
  const PlaneBlock b = plane_block<V>(p, rows, chunks);
  for_each_unit<V>(b, [&](std::int64_t l, std::int64_t c0) {
    float v[V];
    load_vec<T, V>(row_of<T>(src, b.n, l) + c0, v);
    store_vec<float, V>(dst + (b.n * p.l + l) * p.c + c0, v);
  });
}

/// out = x + residual_scale * mlp, mlp dense float32 [N L, C].
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    residual_kernel(const CheriBlockParams p, const float* mlp, std::int64_t rows,
                    std::int64_t chunks) {
  const PlaneBlock b = plane_block<V>(p, rows, chunks);
  for_each_unit<V>(b, [&](std::int64_t l, std::int64_t c0) {
    float x[V], m[V];
    load_vec<T, V>(row_of<T>(p.x, b.n, l) + c0, x);
    load_vec<float, V>(mlp + (b.n * p.l + l) * p.c + c0, m);
#pragma unroll
    for (int k = 0; k < V; ++k) x[k] += p.residual_scale * m[k];
    store_vec<T, V>(out_row_of<T>(p.out, b.n, l) + c0, x);
  });
}

/// h -> GELU(h) in place (dense float32, 16-byte aligned): four values a thread per step.
__global__ void gelu_kernel(float* h, std::int64_t count) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t first = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  for (std::int64_t i = first; i < count / 4; i += stride) {
    float4 v = reinterpret_cast<const float4*>(h)[i];
    v = make_float4(gelu_tanh(v.x), gelu_tanh(v.y), gelu_tanh(v.z), gelu_tanh(v.w));
    reinterpret_cast<float4*>(h)[i] = v;
  }
  for (std::int64_t i = count / 4 * 4 + first; i < count; i += stride) h[i] = gelu_tanh(h[i]);
}

/// h -> GELU(h) and dg -> dg * GELU'(h), in place (dense float32, 16-byte aligned).
__global__ void gelu_backward_kernel(float* h, float* dg, std::int64_t count) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t first = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  for (std::int64_t i = first; i < count / 4; i += stride) {
    float4 v = reinterpret_cast<const float4*>(h)[i];
    float4 d = reinterpret_cast<const float4*>(dg)[i];
    const auto apply = [](float& hv, float& dv) {
      const GeluAndGrad r = gelu_tanh_and_grad(hv);
      hv = r.value;
      dv *= r.grad;
    };
    apply(v.x, d.x);
    apply(v.y, d.y);
    apply(v.z, d.z);
    apply(v.w, d.w);
    reinterpret_cast<float4*>(dg)[i] = d;
    reinterpret_cast<float4*>(h)[i] = v;
  }
  for (std::int64_t i = count / 4 * 4 + first; i < count; i += stride) {
    const GeluAndGrad r = gelu_tanh_and_grad(h[i]);
    dg[i] *= r.grad;
    h[i] = r.value;
  }
}

/// Per block of the plane: sum dy and sum dy * y (y from the saved statistics) into
/// partial [N chunks, 2].
template <typename T, typename G, int V>
__global__ void __launch_bounds__(kThreads)
    grad_sums_kernel(const CheriBlockParams p, const float* w, const CheriActivation grad_y,
                     std::int64_t rows, std::int64_t chunks, float* partial) {
  const PlaneBlock b = plane_block<V>(p, rows, chunks);
  const int t = threadIdx.x;
  const float mean = p.saved_mean.data[b.n * p.saved_mean.stride];
  const float rstd = p.saved_rstd.data[b.n * p.saved_rstd.stride];
  float sum_dy = 0.0f, sum_dy_y = 0.0f;
  if (t < b.tpr * b.lanes) {
    for (int cg = t % b.tpr; cg < b.groups; cg += b.tpr) {
      const std::int64_t c0 = static_cast<std::int64_t>(cg) * V;
      for (std::int64_t l = b.l0 + t / b.tpr; l < b.l1; l += b.lanes) {
        float v[V], dy[V];
        conv_at<T, V>(p, w, b.n, l, c0, v);
        load_vec<G, V>(row_of<G>(grad_y, b.n, l) + c0, dy);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          sum_dy += dy[k];
          sum_dy_y += dy[k] * ((v[k] - mean) * rstd);
        }
      }
    }
  }
  sum_dy = warp_sum(sum_dy);
  sum_dy_y = warp_sum(sum_dy_y);
  __shared__ float warps[2][kThreads / kWarpSize];
  if (t % kWarpSize == 0) {
    warps[0][t / kWarpSize] = sum_dy;
    warps[1][t / kWarpSize] = sum_dy_y;
  }
  __syncthreads();
  if (t == 0) {
    float a = 0.0f, c = 0.0f;
    for (int i = 0; i < kThreads / kWarpSize; ++i) {
      a += warps[0][i];
      c += warps[1][i];
    }
    partial[2 * static_cast<std::int64_t>(blockIdx.x)] = a;
    partial[2 * static_cast<std::int64_t>(blockIdx.x) + 1] = c;
  }
}

/// Per example: mean(dy) and mean(dy y) over the plane, its partials added in block order.
__global__ void grad_sums_finalize_kernel(const float* partial, std::int64_t n_examples,
                                          std::int64_t chunks, double plane, float* means) {
  const std::int64_t n = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (n >= n_examples) return;
  double a = 0, c = 0;
  for (std::int64_t i = 0; i < chunks; ++i) {
    a += partial[2 * (n * chunks + i)];
    c += partial[2 * (n * chunks + i) + 1];
  }
  means[2 * n] = static_cast<float>(a / plane);
  means[2 * n + 1] = static_cast<float>(c / plane);
}

/// The front kernel's per-row sums of dy and dy y (row_sums [N L, 2]) and where their means go
/// (means [N, 2], over the plane's `plane` values); row_sums null: nothing to do.
struct RowMeans {
  const float* row_sums;
  std::int64_t n_examples, len;
  double plane;
  float* means;
};

#ifdef FUSEKIT_WGMMA  // used by the sm_90a kernels only
/// mean(dy) and mean(dy y) of example n by a warp: lane i adds rows i, i + 32, ... in double,
/// and the lanes are merged in a fixed tree.
__device__ void finalize_row_means(const RowMeans& m, std::int64_t n, int lane) {
  double a = 0, c = 0;
  for (std::int64_t r = lane; r < m.len; r += kWarpSize) {
    a += m.row_sums[2 * (n * m.len + r)];
    c += m.row_sums[2 * (n * m.len + r) + 1];
  }
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    a += __shfl_down_sync(0xffffffffu, a, offset);
    c += __shfl_down_sync(0xffffffffu, c, offset);
  }
  if (lane == 0) {
    m.means[2 * n] = static_cast<float>(a / m.plane);
    m.means[2 * n + 1] = static_cast<float>(c / m.plane);
  }
}
#endif

struct DconvStats {
  float mean, rstd, mean_dy, mean_dy_y;
};

/// dconv[n, l, c0 .. c0 + V) = rstd (dy - mean(dy) - y mean(dy y)); zero outside 0 <= l < L.
template <typename T, typename G, int V>
__device__ __forceinline__ void dconv_at(const CheriBlockParams& p, const float* w,
                                         const CheriActivation& grad_y, const DconvStats& s,
                                         std::int64_t n, std::int64_t l, std::int64_t c0,
                                         float (&g)[V]) {
  if (l < 0 || l >= p.l) {
#pragma unroll
    for (int k = 0; k < V; ++k) g[k] = 0.0f;
    return;
  }
  float v[V], dy[V];
  conv_at<T, V>(p, w, n, l, c0, v);
  load_vec<G, V>(row_of<G>(grad_y, n, l) + c0, dy);
#pragma unroll
  for (int k = 0; k < V; ++k) {
    g[k] = s.rstd * (dy[k] - s.mean_dy - ((v[k] - s.mean) * s.rstd) * s.mean_dy_y);
  }
}

/// grad_x [n, l, c0 .. c0 + V): gx, plus grad_out there when kResidual, stored in x's dtype.
template <typename T, int V, bool kResidual>
__device__ __forceinline__ void store_grad_x(const CheriBlockParams& p, std::int64_t n,
                                             std::int64_t l, std::int64_t c0, float (&gx)[V]) {
  if constexpr (kResidual) {
    float go[V];
    load_vec<T, V>(row_of<T>(p.grad_out, n, l) + c0, go);
#pragma unroll
    for (int k = 0; k < V; ++k) gx[k] += go[k];
  }
  store_vec<T, V>(out_row_of<T>(p.grad_x, n, l) + c0, gx);
}

/// The block's share of the convolution weight gradient for channel groups it * tpr on, into
/// partial [N chunks, 3, C]: each thread's sums gw [tap][channel] go to red [kThreads][3 V]
/// (shared), then thread (tap, group, k) adds the row lanes of its column in order.
template <int V>
__device__ __forceinline__ void write_weight_grad_partial(const CheriBlockParams& p,
                                                          const PlaneBlock& b, int it,
                                                          const float (&gw)[3][V], float* red,
                                                          float* partial) {
  const int t = threadIdx.x;
#pragma unroll
  for (int tap = 0; tap < 3; ++tap) {
#pragma unroll
    for (int k = 0; k < V; ++k) red[t * 3 * V + tap * V + k] = gw[tap][k];
  }
  __syncthreads();
  for (int i = t; i < 3 * b.tpr * V; i += kThreads) {
    const int tap = i / (b.tpr * V), rem = i % (b.tpr * V), g = rem / V, k = rem % V;
    const std::int64_t c = (static_cast<std::int64_t>(g) + it * b.tpr) * V + k;
    if (c >= p.c) continue;
    float s = 0.0f;
    for (int lane = 0; lane < b.lanes; ++lane) s += red[(lane * b.tpr + g) * 3 * V + tap * V + k];
    partial[(static_cast<std::int64_t>(blockIdx.x) * 3 + tap) * p.c + c] = s;
  }
}

/// grad_x (plus grad_out when kResidual) and the block's share of the convolution weight
/// gradient, partial [N chunks, 3, C]. dconv = rstd (dy - mean(dy) - y mean(dy y)) is recomputed
/// at l and l +- d from x, the saved statistics and dy.
template <typename T, typename G, int V, bool kResidual>
__global__ void __launch_bounds__(kThreads)
    conv_norm_backward_kernel(const CheriBlockParams p, const float* w,
                              const CheriActivation grad_y, const float* means,
                              std::int64_t rows, std::int64_t chunks, float* partial) {
  const PlaneBlock b = plane_block<V>(p, rows, chunks);
  const int t = threadIdx.x;
  const float mean = p.saved_mean.data[b.n * p.saved_mean.stride];
  const float rstd = p.saved_rstd.data[b.n * p.saved_rstd.stride];
  const DconvStats stats{mean, rstd, means[2 * b.n], means[2 * b.n + 1]};
  const std::int64_t d = p.dilation;
  __shared__ float red[kThreads][3 * V];  // [thread][tap, channel]


  const bool active_thread = t < b.tpr * b.lanes;
  const int iterations = (b.groups + b.tpr - 1) / b.tpr;
  for (int it = 0; it < iterations; ++it) {
    const int cg = t % b.tpr + it * b.tpr;
    float gw[3][V] = {};
    if (active_thread && cg < b.groups) {
      const std::int64_t c0 = static_cast<std::int64_t>(cg) * V;
      float w0[V], w1[V], w2[V];
      load_vec<float, V>(w + c0, w0);
      load_vec<float, V>(w + p.c + c0, w1);
      load_vec<float, V>(w + 2 * p.c + c0, w2);
      for (std::int64_t l = b.l0 + t / b.tpr; l < b.l1; l += b.lanes) {
        float mid[V], right[V], left[V], x[V];
        dconv_at<T, G, V>(p, w, grad_y, stats, b.n, l, c0, mid);
        dconv_at<T, G, V>(p, w, grad_y, stats, b.n, l + d, c0, right);
        dconv_at<T, G, V>(p, w, grad_y, stats, b.n, l - d, c0, left);
        float gx[V];
#pragma unroll
        for (int k = 0; k < V; ++k) gx[k] = w1[k] * mid[k] + w0[k] * right[k] + w2[k] * left[k];
        store_grad_x<T, V, kResidual>(p, b.n, l, c0, gx);
        load_vec<T, V>(row_of<T>(p.x, b.n, l) + c0, x);
#pragma unroll
        for (int k = 0; k < V; ++k) gw[1][k] += mid[k] * x[k];
        if (l >= d) {
          load_vec<T, V>(row_of<T>(p.x, b.n, l - d) + c0, x);
#pragma unroll
          for (int k = 0; k < V; ++k) gw[0][k] += mid[k] * x[k];
        }
        if (l + d < p.l) {
          load_vec<T, V>(row_of<T>(p.x, b.n, l + d) + c0, x);
#pragma unroll
          for (int k = 0; k < V; ++k) gw[2][k] += mid[k] * x[k];
        }
      }
    }
    write_weight_grad_partial<V>(p, b, it, gw, &red[0][0], partial);
    __syncthreads();  // red is free for the next channel groups
  }
}

/// conv_norm_backward_kernel on sm_90 where the rows of x and dy are dense and 16-byte aligned,
/// dy float32 (G = float), or float16 with each 32-column segment of a dense row scaled by
/// 2^dy_exps[n L + l][c / 32] (G = __half, weight_grad_kernel's): the block brings dy rows
/// [l0 - d, l1 + d) and x rows [l0 - 2 d, l1 + 2 d) of example n (clipped to the plane; no halo
/// for d >= L) into shared memory by two bulk copies, turns dy into float32 dconv there (each
/// row once, where the plain kernel computes it three times from nine rows of x), then computes
/// grad_x and the block's share of the weight gradient from shared memory. Shared memory:
/// gx_stage_bytes (C / V <= kThreads: one channel group a thread).
template <typename T, typename G, int V, bool kResidual>
__global__ void __launch_bounds__(kThreads, 2)
    conv_norm_backward_staged_kernel(const CheriBlockParams p, const float* w,
                                     const CheriActivation grad_y, const int* dy_exps,
                                     const float* means, std::int64_t rows, std::int64_t chunks,
                                     float* partial) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(std::is_same_v<G, float> || std::is_same_v<G, __half>, "float or scaled half dy");
  extern __shared__ __align__(128) unsigned char gx_stage_raw[];
  __shared__ std::uint64_t arrived;
  allow_dependents();
  wait_for_prerequisites();  // launched as a dependent of the kernel that wrote dy
  const PlaneBlock b = plane_block<V>(p, rows, chunks);
  const int t = threadIdx.x, cc = static_cast<int>(p.c);
  const std::int64_t d = p.dilation, halo = d < p.l ? d : 0;
  const std::int64_t dlo = max(b.l0 - halo, std::int64_t{0}), dhi = min(b.l1 + halo, p.l);
  const std::int64_t xlo = max(b.l0 - 2 * halo, std::int64_t{0});
  const std::int64_t xhi = min(b.l1 + 2 * halo, p.l);
  constexpr bool kScaled = std::is_same_v<G, __half>;
  const int segments = cc / 32;  // kScaled: exponents a row
  float* const dc = reinterpret_cast<float*>(gx_stage_raw);  // [dhi - dlo][C]: dy, then dconv
  T* const xs = reinterpret_cast<T*>(dc + (dhi - dlo) * cc);  // [xhi - xlo][C]
  // dy as copied: float32 in place of its dconv, or float16 [dhi - dlo][C] after x with its
  // exponents [dhi - dlo][C / 32]
  G* const dys = kScaled ? reinterpret_cast<G*>(xs + (xhi - xlo) * cc) : reinterpret_cast<G*>(dc);
  int* const exps = reinterpret_cast<int*>(dys + (dhi - dlo) * cc);
  if constexpr (kScaled) {
    const int* src = dy_exps + (b.n * p.l + dlo) * segments;
    for (int i = t; i < (dhi - dlo) * segments; i += kThreads) exps[i] = src[i];
  }
  if (t == 0) {
    mbarrier_init(&arrived, 1);
    mbarrier_init_fence();
    const auto dy_bytes = static_cast<std::uint32_t>((dhi - dlo) * cc * sizeof(G));
    const auto x_bytes = static_cast<std::uint32_t>((xhi - xlo) * cc * sizeof(T));
    mbarrier_arrive_expect_bytes(&arrived, dy_bytes + x_bytes);
    bulk_copy_to_shared(dys, row_of<G>(grad_y, b.n, dlo), dy_bytes, &arrived);
    bulk_copy_to_shared(xs, row_of<T>(p.x, b.n, xlo), x_bytes, &arrived);
  }
  __syncthreads();  // the barrier is initialised before anyone waits on it
  const float mean = p.saved_mean.data[b.n * p.saved_mean.stride];
  const float rstd = p.saved_rstd.data[b.n * p.saved_rstd.stride];
  const float mean_dy = means[2 * b.n], mean_dy_y = means[2 * b.n + 1];
  const bool active = t < b.tpr * b.lanes;
  const int c0 = (t % b.tpr) * V, first = t / b.tpr;
  float w0[V], w1[V], w2[V];
  load_vec<float, V>(w + c0, w0);
  load_vec<float, V>(w + p.c + c0, w1);
  load_vec<float, V>(w + 2 * p.c + c0, w2);
  const auto x_row = [&](std::int64_t l) { return xs + static_cast<int>(l - xlo) * cc + c0; };
  const auto dc_row = [&](std::int64_t l) { return dc + static_cast<int>(l - dlo) * cc + c0; };
  // grad_out (the residual's share of grad_x) of the thread's first kEarly rows, 16 bytes each,
  // loaded now so that their latency passes under the copies and dconv (each was a dependent
  // load a row); kEarly covers every row of a thread where C / V divides kThreads (kBlockElements
  // / (V kThreads) rows)
  static_assert(V * sizeof(T) == 16, "a thread's piece of a row is 16 bytes");
  constexpr int kEarly = kResidual ? static_cast<int>(kBlockElements / (V * kThreads)) : 0;
  union Piece {
    uint4 raw;
    T e[V];
  } early[kEarly > 0 ? kEarly : 1];
#pragma unroll
  for (int i = 0; i < kEarly; ++i) {
    const std::int64_t l = b.l0 + first + static_cast<std::int64_t>(i) * b.lanes;
    if (active && l < b.l1) {
      early[i].raw = __ldg(reinterpret_cast<const uint4*>(row_of<T>(p.grad_out, b.n, l) + c0));
    }
  }
  mbarrier_wait(&arrived, 0);

  // dconv = rstd (dy - mean(dy) - y mean(dy y)), y = (conv - mean) rstd, into dc (over dy there
  // when it came in float32).
  if (active) {
    for (std::int64_t l = dlo + first; l < dhi; l += b.lanes) {
      float xv[V], conv[V], g[V];
      load_shared_floats<T, V>(x_row(l), xv);
#pragma unroll
      for (int k = 0; k < V; ++k) conv[k] = w1[k] * xv[k];
      if (l >= d) {
        load_shared_floats<T, V>(x_row(l - d), xv);
#pragma unroll
        for (int k = 0; k < V; ++k) conv[k] += w0[k] * xv[k];
      }
      if (l + d < p.l) {
        load_shared_floats<T, V>(x_row(l + d), xv);
#pragma unroll
        for (int k = 0; k < V; ++k) conv[k] += w2[k] * xv[k];
      }
      if constexpr (kScaled) {  // the row's segment, unscaled by its exponent
        static_assert(V % 2 == 0 && 32 % V == 0, "pairs of float16 within a segment");
        const int r = static_cast<int>(l - dlo);
        const auto* src = reinterpret_cast<const __half2*>(dys + r * cc + c0);
        const float unscale = ldexpf(1.0f, -exps[r * segments + c0 / 32]);
#pragma unroll
        for (int k = 0; k < V; k += 2) {
          const float2 v = __half22float2(src[k / 2]);
          g[k] = v.x * unscale;
          g[k + 1] = v.y * unscale;
        }
      } else {
        load_shared_floats<float, V>(dc_row(l), g);
      }
#pragma unroll
      for (int k = 0; k < V; ++k) {
        g[k] = rstd * (g[k] - mean_dy - ((conv[k] - mean) * rstd) * mean_dy_y);
      }
#pragma unroll
      for (int k = 0; k < V; k += 4) {
        *reinterpret_cast<float4*>(dc_row(l) + k) = make_float4(g[k], g[k + 1], g[k + 2], g[k + 3]);
      }
    }
  }
  __syncthreads();  // every row's dconv is in place

  float gw[3][V] = {};  // [tap][channel]
  // grad_x of row l (plus `residual`, grad_out there) and the row's share of the weight gradient
  const auto row_grad = [&](std::int64_t l, const float (&residual)[V]) {
    float mid[V], side[V], gx[V], xv[V];
    load_shared_floats<float, V>(dc_row(l), mid);
#pragma unroll
    for (int k = 0; k < V; ++k) gx[k] = w1[k] * mid[k];
    if (l + d < p.l) {
      load_shared_floats<float, V>(dc_row(l + d), side);
#pragma unroll
      for (int k = 0; k < V; ++k) gx[k] += w0[k] * side[k];
    }
    if (l >= d) {
      load_shared_floats<float, V>(dc_row(l - d), side);
#pragma unroll
      for (int k = 0; k < V; ++k) gx[k] += w2[k] * side[k];
    }
    if constexpr (kResidual) {
#pragma unroll
      for (int k = 0; k < V; ++k) gx[k] += residual[k];
    }
    store_vec<T, V>(out_row_of<T>(p.grad_x, b.n, l) + c0, gx);
    load_shared_floats<T, V>(x_row(l), xv);
#pragma unroll
    for (int k = 0; k < V; ++k) gw[1][k] += mid[k] * xv[k];
    if (l >= d) {
      load_shared_floats<T, V>(x_row(l - d), xv);
#pragma unroll
      for (int k = 0; k < V; ++k) gw[0][k] += mid[k] * xv[k];
    }
    if (l + d < p.l) {
      load_shared_floats<T, V>(x_row(l + d), xv);
#pragma unroll
      for (int k = 0; k < V; ++k) gw[2][k] += mid[k] * xv[k];
    }
  };
  if (active) {
#pragma unroll
    for (int i = 0; i < kEarly; ++i) {
      const std::int64_t l = b.l0 + first + static_cast<std::int64_t>(i) * b.lanes;
      float residual[V];
#pragma unroll
      for (int k = 0; k < V; ++k) residual[k] = to_float(early[i].e[k]);
      if (l < b.l1) row_grad(l, residual);
    }
    for (std::int64_t l = b.l0 + first + static_cast<std::int64_t>(kEarly) * b.lanes; l < b.l1;
         l += b.lanes) {
      float residual[V] = {};
      if constexpr (kResidual) load_vec<T, V>(row_of<T>(p.grad_out, b.n, l) + c0, residual);
      row_grad(l, residual);
    }
  }
  __syncthreads();  // the stage is free: it holds the threads' sums next
  write_weight_grad_partial<V>(p, b, 0, gw, reinterpret_cast<float*>(gx_stage_raw), partial);
#endif
}

/// The quad order of a row's columns: within each group of 32, column 8 a + 2 q + e (the pair a
/// of lane q of a quad in the m16n8 fragment layouts, e = 0, 1) at position 8 q + 2 a + e, which
/// is where store_quad (below) puts a lane's four pairs untransposed (one 16-byte store, and no
/// shuffles). It is its own inverse, keeps pairs together and leaves whole groups in place.
__host__ __device__ constexpr int quad_order(int i) {
  return (i & ~31) | (((i >> 1) & 3) << 3) | (((i >> 3) & 3) << 1) | (i & 1);
}

/// Warps of a block of sum_partials_kernel, each taking every kSumWarps-th row of its range.
constexpr int kSumWarps = 8;

/// V adjacent values of `part` (16-byte aligned where V is 4).
template <typename In, int V>
__device__ __forceinline__ void load_sum_piece(const In* part, In (&v)[V]) {
  if constexpr (V == 4 && std::is_same_v<In, float>) {
    const float4 f = *reinterpret_cast<const float4*>(part);
    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
  } else if constexpr (V == 4) {
    const double2 a = reinterpret_cast<const double2*>(part)[0];
    const double2 b = reinterpret_cast<const double2*>(part)[1];
    v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = part[k];
  }
}

/// Sums over the rows of part [count, width] (float32 parts, or the double sums of a first pass),
/// in double and a fixed order: block (x, y) takes columns [(32 x + lane) V, + V) of its lanes and
/// rows [y per, (y + 1) per); warp w of it rows w, w + kSumWarps, ... of that range, four rows'
/// loads issued together, and the warps' sums are added in order of w. With `segments`, a
/// range's sums go to segments [gridDim.y, width] for a second pass over them; else column j
/// goes to dst[j / cols, j % cols], or column quad_order(j) where part's columns are in quad
/// order (cols a multiple of 32). Blocks with z = 1 do the same for part_b, dst_b and cols_b (a
/// second sum of the same shape in the same launch).
template <typename In, int V>
__global__ void __launch_bounds__(kSumWarps* kWarpSize)
    sum_partials_kernel(const In* part_a, std::int64_t count, std::int64_t width,
                        std::int64_t per, double* segments, const CheriMatrix dst_a,
                        std::int64_t cols_a, bool quad, const In* part_b, const CheriMatrix dst_b,
                        std::int64_t cols_b) {
  __shared__ double red[kSumWarps][V][kWarpSize];
  allow_dependents();
  wait_for_prerequisites();  // launched as a dependent of the kernel that wrote part
  // the second sum's arguments where z = 1, selected field by field (the parameters stay in place)
  const bool b = blockIdx.z == 1;
  const In* const part = b ? part_b : part_a;
  const CheriMatrix dst{b ? dst_b.data : dst_a.data,
                        b ? dst_b.dtype : dst_a.dtype,
                        {b ? dst_b.stride[0] : dst_a.stride[0],
                         b ? dst_b.stride[1] : dst_a.stride[1]}};
  const std::int64_t cols = b ? cols_b : cols_a;
  const std::int64_t from = (blockIdx.x * std::int64_t{kWarpSize} + threadIdx.x) * V;
  const std::int64_t r1 = std::min(count, (blockIdx.y + 1) * per);
  double s[V] = {};
  if (from < width) {
    constexpr int kUnroll = 4;
    std::int64_t r = blockIdx.y * per + threadIdx.y;
    for (; r + (kUnroll - 1) * kSumWarps < r1; r += kUnroll * kSumWarps) {
      In v[kUnroll][V];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        load_sum_piece<In, V>(part + (r + u * kSumWarps) * width + from, v[u]);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int k = 0; k < V; ++k) s[k] += v[u][k];
      }
    }
    for (; r < r1; r += kSumWarps) {
      In v[V];
      load_sum_piece<In, V>(part + r * width + from, v);
#pragma unroll
      for (int k = 0; k < V; ++k) s[k] += v[k];
    }
  }
#pragma unroll
  for (int k = 0; k < V; ++k) red[threadIdx.y][k][threadIdx.x] = s[k];
  __syncthreads();
  if (threadIdx.y != 0 || from >= width) return;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    double total = 0;
#pragma unroll
    for (int w = 0; w < kSumWarps; ++w) total += red[w][k][threadIdx.x];
    const std::int64_t j = from + k;
    if (segments) {
      segments[blockIdx.y * width + j] = total;
    } else {
      const std::int64_t to =
          quad ? (j & ~std::int64_t{31}) | quad_order(static_cast<int>(j & 31)) : j;
      store_weight(dst, to / cols, to % cols, static_cast<float>(total));
    }
  }
}

// ------------------------------------------------------------------------------------ inference

constexpr int kPad = 8;  // halves after each shared weight row: ldmatrix rows on distinct banks

constexpr int kRowTile = 128;    // rows of (n, l) per tile of the fused kernel: 16 per warp
// Elements from one row of a shared x tile to the next: 8 of padding, so that the 8-byte (float32)
// or 4-byte (half) pair loads of a warp's fragment rows fall on distinct banks.
template <int kC>
constexpr int kXTileLd = kC + 8;
constexpr int kHiddenStep = 16;  // hidden columns per GEMM1 -> GELU -> GEMM2 step of one warp
// E C of the fused kernel: whole steps, and 16-byte ldmatrix rows on distinct banks (any multiple
// of 16 would do; multiples of 64 are what the tests cover).
constexpr int kFusedHiddenMultiple = 64;

template <typename T, int kC>
std::size_t fused_smem_bytes(std::int64_t hidden) {
  const auto h = static_cast<std::size_t>(hidden);
  return kRowTile * kXTileLd<kC> * sizeof(T)  // x tile
         + h * (kC + kPad) * sizeof(__half)   // linear1 [E C, C]
         + kC * (h + kPad) * sizeof(__half)   // linear2 [C, E C]
         + 3 * kC * sizeof(float);            // taps
}

/// Two consecutive elements of T in one access.
template <typename T>
struct PairOf {
  using type = float2;
};
template <>
struct PairOf<__half> {
  using type = __half2;
};
template <>
struct PairOf<__nv_bfloat16> {
  using type = __nv_bfloat162;
};
__device__ __forceinline__ float2 to_float2(float2 v) { return v; }
__device__ __forceinline__ float2 to_float2(__half2 v) { return __half22float2(v); }
__device__ __forceinline__ float2 to_float2(__nv_bfloat162 v) {
  return widen_bf16x2(*reinterpret_cast<const std::uint32_t*>(&v));
}

/// Per-example statistics as the fused kernels read them: data[n * stride].
struct StatRef {
  const float* data;
  std::int64_t stride = 1;
};

/// A row (n, l) of the [N L] rows of the plane.
struct PlaneRow {
  std::int64_t n, l;
};

/// The row r after `first` (r >= 0); one comparison when first.l + r < L.
__device__ __forceinline__ PlaneRow plane_row(PlaneRow first, std::int64_t r, std::int64_t len) {
  PlaneRow at{first.n, first.l + r};
  while (at.l >= len) {
    at.l -= len;
    ++at.n;
  }
  return at;
}

/// The A fragments [16, C] (float16) of conv + norm for rows r0 + g and r0 + g + 8 of a tile of
/// kTileRows rows of (n, l) starting at row `first`, lane (g, q) holding columns
/// 16 ks + 8 j + 2 q + {0, 1} (the m16n8k16 A layout); x of the tile is in `xs` (rows
/// kXTileLd<kC> elements apart), taps outside the tile come from global memory. keep(nt, h2,
/// x pair) receives x at the positions of the n8 accumulator tile nt, row half h2.
template <typename T, int kC, int kTileRows, typename Keep>
__device__ __forceinline__ void conv_norm_fragments(std::uint32_t (&af)[kC / 16][4], const T* xs,
                                                    int r0, PlaneRow first,
                                                    const CheriBlockParams& p, const float* cw,
                                                    StatRef mean, StatRef rstd, Keep&& keep) {
  using Pair = typename PairOf<T>::type;
  constexpr int kLdX = kXTileLd<kC>;
  const int lane = threadIdx.x % kWarpSize, g = lane / 4, q = lane % 4;
  const std::int64_t d = p.dilation, len = p.l;
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) {
    const int r = r0 + g + 8 * h2;
    const PlaneRow at = plane_row(first, r, len);
    const bool live = at.n < p.n;
    const std::int64_t n = live ? at.n : 0, l = live ? at.l : 0;
    const bool has_left = live && l >= d, has_right = live && l + d < len;
    const T* mid = xs + r * kLdX;
    // a tap inside the tile comes from shared memory, else from global; a missing one reads
    // the row itself and counts as zero
    const T* left = !has_left ? mid : (r >= d ? mid - d * kLdX : row_of<T>(p.x, n, l - d));
    const T* right =
        !has_right ? mid : (r + d < kTileRows ? mid + d * kLdX : row_of<T>(p.x, n, l + d));
    const float m = live ? mean.data[n * mean.stride] : 0.0f;
    const float rs = live ? rstd.data[n * rstd.stride] : 0.0f;
#pragma unroll
    for (int ks = 0; ks < kC / 16; ++ks) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int c = 16 * ks + 8 * j + 2 * q;
        const Pair xm = *reinterpret_cast<const Pair*>(mid + c);
        const float2 vl = to_float2(*reinterpret_cast<const Pair*>(left + c));
        const float2 vr = to_float2(*reinterpret_cast<const Pair*>(right + c));
        keep(2 * ks + j, h2, xm);
        const float2 vm = to_float2(xm);
        const float2 wl = *reinterpret_cast<const float2*>(cw + c);
        const float2 wm = *reinterpret_cast<const float2*>(cw + kC + c);
        const float2 wr = *reinterpret_cast<const float2*>(cw + 2 * kC + c);
        float v0 = wm.x * vm.x, v1 = wm.y * vm.y;
        if (has_left) {
          v0 += wl.x * vl.x;
          v1 += wl.y * vl.y;
        }
        if (has_right) {
          v0 += wr.x * vr.x;
          v1 += wr.y * vr.y;
        }
        af[ks][2 * j + h2] = live ? pack_half2((v0 - m) * rs, (v1 - m) * rs) : 0u;
      }
    }
  }
}

#ifdef FUSEKIT_WGMMA  // used by the sm_90a kernels only
/// 2 sqrt(2 / pi) GELU(h / sqrt(2 / pi)) = h (1 + tanh(h (1 + 0.044715 h^2 / (2 / pi)))) of two
/// values (lo in the low half) in float16 arithmetic, for products whose first weight carries the
/// factor sqrt(2 / pi) and whose second carries its inverse over 2 (stage_swizzled's scale), one
/// multiply a pair fewer.
__device__ __forceinline__ std::uint32_t gelu_scaled_half2(float lo, float hi) {
  constexpr std::uint32_t kCubic = 0x2c7f2c7fu;  // 0.044715 / (2 / pi)
  constexpr std::uint32_t kOne = 0x3c003c00u;
  std::uint32_t h, r;
  asm("cvt.rn.satfinite.f16x2.f32 %0, %2, %1;" : "=r"(h) : "f"(lo), "f"(hi));
  asm("{\n"
      " .reg .b32 s, c;\n"
      " mul.rn.f16x2 s, %1, %1;\n"     // h^2
      " fma.rn.f16x2 c, s, %2, %3;\n"  // 1 + c h^2
      " mul.rn.f16x2 s, %1, c;\n"      // u
      " tanh.approx.f16x2 c, s;\n"     // tanh u
      " fma.rn.f16x2 %0, %1, c, %1;\n" // h (1 + tanh u)
      "}"
      : "=r"(r)
      : "r"(h), "r"(kCubic), "r"(kOne));
  return r;
}

/// gelu_scaled_half2 of an m16n8 accumulator pair (columns 16 kk .. 16 kk + 15) as a k16 A
/// fragment.
__device__ __forceinline__ void gelu_scaled_fragment(std::uint32_t (&a)[4], const float* lo,
                                                     const float* hi) {
  a[0] = gelu_scaled_half2(lo[0], lo[1]);
  a[1] = gelu_scaled_half2(lo[2], lo[3]);
  a[2] = gelu_scaled_half2(hi[0], hi[1]);
  a[3] = gelu_scaled_half2(hi[2], hi[3]);
}
#endif

/// GELU(h) of an m16n8 accumulator pair (columns 16 kk .. 16 kk + 15) as a k16 A fragment.
template <bool kApprox = false>
__device__ __forceinline__ void gelu_fragment(std::uint32_t (&a)[4], const float* lo,
                                              const float* hi) {
  const auto gelu = [](float h) { return kApprox ? gelu_tanh_approx(h) : gelu_tanh_exp2(h); };
  a[0] = pack_half2(gelu(lo[0]), gelu(lo[1]));
  a[1] = pack_half2(gelu(lo[2]), gelu(lo[3]));
  a[2] = pack_half2(gelu(hi[0]), gelu(hi[1]));
  a[3] = pack_half2(gelu(hi[2]), gelu(hi[3]));
}

// Each warp owns 16 rows of a 128-row tile through both products, so that GELU(h) goes from
// GEMM1's accumulators straight into GEMM2's A fragments (the m16n8 accumulator layout is the
// m16k16 A layout) and no warp waits for another between them. Per tile: the x rows (arrived by
// cp.async into one shared tile) become the warp's A fragments (conv + norm, float16) in
// registers, and the x values at the positions of the warp's output fragment are kept for the
// residual; then the next tile's x is requested and streams in while the products run.
// The taps of rows near the tile's ends (or all, for d of 128 and more) come from global memory.
template <typename T, int kC>
__global__ void __launch_bounds__(kThreads, 1)
    cheri_inference_kernel(const CheriBlockParams p, const float* conv_w, const float* w1,
                                const float* w2, const float* mean, const float* rstd) {
  using Pair = typename PairOf<T>::type;
  constexpr int kV = kVec16<T>;
  constexpr int kLdX = kXTileLd<kC>;
  constexpr int kLdW1 = kC + kPad;
  constexpr int kKSteps = kC / 16;                  // k16 steps of GEMM1
  constexpr int kNT = kC / 8;                       // n8 tiles of GEMM2
  constexpr int kGroups = kC / kV;                  // 16-byte pieces per row
  constexpr int kRowsPerPass = kThreads / kGroups;  // rows one pass of the threads copies
  static_assert(kThreads % kGroups == 0 && kRowTile % kRowsPerPass == 0, "whole rows per pass");
  static_assert(kRowTile == 16 * (kThreads / kWarpSize), "16 rows per warp");
  const int hidden = static_cast<int>(p.hidden);
  const int ld_w2 = hidden + kPad;
  extern __shared__ __align__(16) unsigned char smem[];
  T* xs = reinterpret_cast<T*>(smem);                                   // [128][C + pad] x
  __half* w1s = reinterpret_cast<__half*>(xs + kRowTile * kLdX);        // [E C][C + 8]
  __half* w2s = w1s + static_cast<std::size_t>(hidden) * kLdW1;         // [C][E C + 8]
  float* cw = reinterpret_cast<float*>(w2s + static_cast<std::size_t>(kC) * ld_w2);  // [3][C]

  const int t = threadIdx.x, warp = t / kWarpSize, lane = t % kWarpSize;
  const int g = lane / 4, q = lane % 4;
  const std::int64_t rows = p.n * p.l, tiles = ceil_div(rows, kRowTile);
  const std::int64_t len = p.l;

#pragma unroll 8
  for (int i = t; i < hidden * kC / 4; i += kThreads) {
    const int e = 4 * i, r = e / kC, c = e % kC;
    const float4 v = __ldg(reinterpret_cast<const float4*>(w1) + i);
    __half2* dst = reinterpret_cast<__half2*>(w1s + r * kLdW1 + c);
    dst[0] = __floats2half2_rn(v.x, v.y);
    dst[1] = __floats2half2_rn(v.z, v.w);
  }
#pragma unroll 8
  for (int i = t; i < hidden * kC / 4; i += kThreads) {
    const int e = 4 * i, r = e / hidden, c = e % hidden;
    const float4 v = __ldg(reinterpret_cast<const float4*>(w2) + i);
    __half2* dst = reinterpret_cast<__half2*>(w2s + r * ld_w2 + c);
    dst[0] = __floats2half2_rn(v.x, v.y);
    dst[1] = __floats2half2_rn(v.z, v.w);
  }
  for (int i = t; i < 3 * kC; i += kThreads) cw[i] = conv_w[i];

  // The tile's rows into xs: thread t copies piece t % kGroups of rows t / kGroups + k
  // kRowsPerPass, walking (n, l) along without a division per row.
  auto issue_x = [&](std::int64_t tile) {
    const int r0 = t / kGroups, piece = t % kGroups;
    std::int64_t f = tile * kRowTile + r0;
    std::int64_t n = f / len, l = f % len;
#pragma unroll
    for (int u = 0; u < kRowTile / kRowsPerPass; ++u) {
      if (f < rows) {
        cp_async_16(xs + (r0 + u * kRowsPerPass) * kLdX + piece * kV,
                    row_of<T>(p.x, n, l) + piece * kV);
      }
      f += kRowsPerPass;
      l += kRowsPerPass;
      while (l >= len) {
        l -= len;
        ++n;
      }
    }
    cp_async_commit();
  };

  if (blockIdx.x < tiles) issue_x(blockIdx.x);
  for (std::int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    cp_async_wait<0>();
    __syncthreads();  // this tile's x landed (every thread's copies)

    // A fragments [16, C] float16 of the warp's rows, and x at the output fragment's positions.
    std::uint32_t af[kKSteps][4];
    Pair xr[kNT][2];
    const std::int64_t first = tile * kRowTile;
    conv_norm_fragments<T, kC, kRowTile>(af, xs, 16 * warp, {first / len, first % len}, p, cw,
                                         {mean}, {rstd},
                                         [&](int nt, int h2, Pair xm) { xr[nt][h2] = xm; });
    __syncthreads();  // every warp is done with xs
    if (tile + gridDim.x < tiles) issue_x(tile + gridDim.x);

    float acc2[kNT][4] = {};  // [n8 tile][fragment]: out [16, C] of the warp's rows
    for (int hc = 0; hc < hidden; hc += kHiddenStep) {
      constexpr int kSteps = kHiddenStep / 16;
      float acc1[2 * kSteps][4] = {};  // h [16, kHiddenStep]: hidden columns hc ..
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
#pragma unroll
        for (int np = 0; np < kSteps; ++np) {
          std::uint32_t b[4];
          ldmatrix_x4(b, w1s + (hc + 16 * np + (lane & 7) + ((lane >> 4) << 3)) * kLdW1 +
                             16 * ks + ((lane >> 3) & 1) * 8);
          mma_16816(acc1[2 * np], af[ks], b[0], b[1]);
          mma_16816(acc1[2 * np + 1], af[ks], b[2], b[3]);
        }
      }
      // GELU(h) as GEMM2's A fragments [16, kHiddenStep] (kSteps k16 steps).
      std::uint32_t ag[kSteps][4];
#pragma unroll
      for (int kk = 0; kk < kSteps; ++kk) gelu_fragment(ag[kk], acc1[2 * kk], acc1[2 * kk + 1]);
#pragma unroll
      for (int kk = 0; kk < kSteps; ++kk) {
#pragma unroll
        for (int np = 0; np < kC / 16; ++np) {
          std::uint32_t b[4];
          ldmatrix_x4(b, w2s + (16 * np + (lane & 7) + ((lane >> 4) << 3)) * ld_w2 + hc +
                             16 * kk + ((lane >> 3) & 1) * 8);
          mma_16816(acc2[2 * np], ag[kk], b[0], b[1]);
          mma_16816(acc2[2 * np + 1], ag[kk], b[2], b[3]);
        }
      }
    }

#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const std::int64_t f = tile * kRowTile + 16 * warp + g + 8 * h2;
      if (f >= rows) continue;
      T* dst = out_row_of<T>(p.out, f / len, f % len);
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const float2 x = to_float2(xr[nt][h2]);
        store_pair<T>(dst + 8 * nt + 2 * q, x.x + p.residual_scale * acc2[nt][2 * h2],
                      x.y + p.residual_scale * acc2[nt][2 * h2 + 1]);
      }
    }
  }
  cp_async_wait<0>();
}

// The same block on warpgroup MMAs (sm_90a). Each of the two warpgroups walks its own tiles of 64
// rows of (n, l) (its x tile arriving by cp.async while the previous tile's products run) and
// synchronises only its own 128 threads. Per tile: conv + norm into float16 A fragments in
// registers (as above), then per 64 hidden columns one wgmma chain h = A linear1^T [64, 64]
// (B from shared memory), GELU in float32 into the A fragments of GEMM2, and out += GELU(h)
// linear2^T [64, C]. GEMM2 is committed without a wait, but ptxas waits for it before the next
// chunk, so a warpgroup's products do not overlap each other; the other warpgroup fills the gaps.
// The residual x is read again (from L2) in the epilogue. Weights live in shared memory as
// float16 in the 128-byte-swizzled K-major layout of cuda_wgmma.cuh.
constexpr int kWgRows = 64;     // rows of (n, l) per warpgroup tile
constexpr int kWgHidden = 64;   // hidden columns per GEMM1 -> GELU -> GEMM2 step
constexpr int kWgThreads = 128;

template <typename T, int kC>
std::size_t wgmma_smem_bytes(std::int64_t hidden) {
  const auto h = static_cast<std::size_t>(hidden);
  return 1024                                                    // room to align to 1024 bytes
         + 2 * h * kC * sizeof(__half)                           // linear1, linear2
         + 2 * kWgRows * kXTileLd<kC> * sizeof(T)                // x tile of each warpgroup
         + 3 * kC * sizeof(float);                               // taps
}

/// The shared memory of the warpgroup kernels (wgmma_smem_bytes): from a 1024-byte-aligned base,
/// two float16 weights of E C x C elements each (128-byte-swizzled blocks), the two warpgroups' x
/// tiles [2][kWgRows][kXTileLd] and the taps [3][C]; anything more follows the taps.
template <typename T, int kC>
struct WgShared {
  unsigned char* w1;
  unsigned char* w2;
  T* xs;
  float* cw;

  __device__ WgShared(unsigned char* raw, int hidden) {
    w1 = raw + ((1024 - shared_address(raw) % 1024) % 1024);
    w2 = w1 + static_cast<std::size_t>(hidden) * kC * 2;
    xs = reinterpret_cast<T*>(w2 + static_cast<std::size_t>(hidden) * kC * 2);
    cw = reinterpret_cast<float*>(xs + 2 * kWgRows * kXTileLd<kC>);
  }
};

/// A dense float32 matrix [rows, cols] (cols a multiple of 64, 16-byte aligned) times `scale` into
/// `dst` as float16 blocks [cols / 64][rows][64], 128-byte swizzled, its rows in quad order where
/// `quad_rows` (rows a multiple of 32); the whole block of threads takes part. Each thread has the
/// loads of kBatch pieces of 8 values in flight at once: one at a time, a block spent about a
/// round trip to L2 for every 3 KB (384 threads) of the 256 KB of its two weight matrices.
__device__ __forceinline__ void stage_swizzled(const float* src, int rows, int cols,
                                               unsigned char* dst, float scale = 1.0f,
                                               bool quad_rows = false) {
  constexpr int kBatch = 4;
  const int pieces = rows * cols / 8, step = static_cast<int>(blockDim.x);
  for (int i0 = threadIdx.x; i0 < pieces; i0 += kBatch * step) {
    float4 a[kBatch], b[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      // past the end: the last piece again (loaded, and stored with the same values)
      const int e = 8 * min(i0 + u * step, pieces - 1);
      a[u] = __ldg(reinterpret_cast<const float4*>(src + e));
      b[u] = __ldg(reinterpret_cast<const float4*>(src + e) + 1);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {  // no branch, so that the loads stay ahead of the stores
      const int e = 8 * min(i0 + u * step, pieces - 1);
      const int k = e % cols, r = quad_rows ? quad_order(e / cols) : e / cols;
      *reinterpret_cast<uint4*>(dst + static_cast<std::size_t>(k / 64) * rows * 128 +
                                swizzled_offset(r, k % 64)) =
          make_uint4(pack_half2(a[u].x * scale, a[u].y * scale),
                     pack_half2(a[u].z * scale, a[u].w * scale),
                     pack_half2(b[u].x * scale, b[u].y * scale),
                     pack_half2(b[u].z * scale, b[u].w * scale));
    }
  }
}

/// Thread t (of a warpgroup's 128) of the copy of tile `tile` (kWgRows rows of (n, l)) of the
/// activation `a` (x, or grad_out: rows 16-byte aligned, channels contiguous) into xs (rows
/// kXTileLd apart) by cp.async, one commit group: piece t % groups of rows t / groups + k (128 /
/// groups). Rows past the plane are not copied.
template <typename T, int kC>
__device__ __forceinline__ void copy_rows_tile(const CheriActivation& a, T* xs, std::int64_t tile,
                                               const CheriBlockParams& p, int t) {
  constexpr int kV = kVec16<T>;
  constexpr int kLdX = kXTileLd<kC>;
  constexpr int kGroups = kC / kV;                     // 16-byte pieces per row
  constexpr int kRowsPerPass = kWgThreads / kGroups;   // rows one pass of a warpgroup copies
  static_assert(kWgThreads % kGroups == 0 && kWgRows % kRowsPerPass == 0, "whole rows per pass");
  const std::int64_t len = p.l;
  const int r0 = t / kGroups, piece = t % kGroups;
  const std::int64_t first = tile * kWgRows;
  const PlaneRow start{first / len, first % len};
  T* dst = xs + r0 * kLdX + piece * kV;
  if (start.l + kWgRows <= len) {  // rows of one example: a pointer step per row
    const T* src = row_of<T>(a, start.n, start.l + r0) + piece * kV;
    const std::int64_t step = kRowsPerPass * a.stride[1];
#pragma unroll
    for (int u = 0; u < kWgRows / kRowsPerPass; ++u) {
      cp_async_16(dst + u * kRowsPerPass * kLdX, src + u * step);
    }
  } else {
#pragma unroll 1
    for (int u = 0; u < kWgRows / kRowsPerPass; ++u) {
      const PlaneRow at = plane_row(start, r0 + u * kRowsPerPass, len);
      if (at.n < p.n) {
        cp_async_16(dst + u * kRowsPerPass * kLdX, row_of<T>(a, at.n, at.l) + piece * kV);
      }
    }
  }
  cp_async_commit();
}

/// p, hidden from the optimiser: offsets added to it afterwards stay immediates of the accesses
/// rather than 64-bit additions of their own.
template <typename P>
__device__ __forceinline__ P* opaque(P* p) {
  asm("" : "+l"(p));
  return p;
}

/// A lane's pair (two floats, or two 16-bit values in a word) from lane ^ step of its warp.
__device__ __forceinline__ float2 shuffle_pair(float2 v, int step) {
  return make_float2(__shfl_xor_sync(0xffffffffu, v.x, step),
                     __shfl_xor_sync(0xffffffffu, v.y, step));
}
__device__ __forceinline__ std::uint32_t shuffle_pair(std::uint32_t v, int step) {
  return __shfl_xor_sync(0xffffffffu, v, step);
}

/// The accumulator pairs of lane (g, q) of the epilogues (store_residual_rows: rows g + 8 h2,
/// columns 8 j + 2 q + {0, 1} in acc[4 j + 2 h2 + {0, 1}]) as v[h2][m][slot] = pair(the two
/// floats), moved across the quad by 4 x 4 transposes (two shuffle steps) so that v[h2][m][slot]
/// holds columns 8 (4 m + q) + 2 slot + {0, 1}: lane q then has 8 consecutive columns of its row
/// for every m.
template <int kGroups, typename Pair, typename MakePair>
__device__ __forceinline__ void quad_row_pairs(const float* acc, int q, MakePair pair,
                                               Pair (&v)[2][kGroups][4]) {
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) {
#pragma unroll
    for (int m = 0; m < kGroups; ++m) {
#pragma unroll
      for (int a = 0; a < 4; ++a) {
        const int i = 4 * (4 * m + a) + 2 * h2;
        v[h2][m][a] = pair(acc[i], acc[i + 1]);
      }
    }
  }
#pragma unroll
  for (int step = 1; step <= 2; step *= 2) {
    const bool upper = (q & step) != 0;
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
#pragma unroll
      for (int m = 0; m < kGroups; ++m) {
#pragma unroll
        for (int a = 0; a < 4; ++a) {
          if ((a & step) != 0) continue;
          Pair& keep_low = v[h2][m][a];
          Pair& keep_high = v[h2][m][a ^ step];
          const Pair got = shuffle_pair(upper ? keep_low : keep_high, step);
          (upper ? keep_low : keep_high) = got;
        }
      }
    }
  }
}

/// store_residual_rows for bfloat16 x and out: residual_scale acc is rounded to bfloat16 pairs
/// first, so that the quads' transposes move one word a pair instead of two floats, and x is
/// added in bfloat16 arithmetic (`add.rn.bf16x2`), one rounding of the sum: out = bf16(x +
/// bf16(residual_scale acc)). The second rounding is at most 2^-9 of the MLP term (the issue's
/// bound for bf16 is 1e-2 of the output), and bfloat16 holds any float's range, so no value that
/// fits out overflows on the way. Rows as store_residual_rows takes them (`rows`: those of lane
/// (g, q) of the warp).
template <int kC>
__device__ __forceinline__ void store_residual_rows_bf16(const CheriBlockParams& p,
                                                         const PlaneRow (&rows)[2], int lane,
                                                         const float (&acc)[kC / 2]) {
  constexpr int kGroups = kC / 32;
  const int q = lane % 4;
  std::uint32_t v[2][kGroups][4];  // [row half][m][slot]: columns 8 (4 m + q) + 2 slot
  quad_row_pairs(acc, q, [&](float a, float b) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(p.residual_scale * a, p.residual_scale * b);
    return *reinterpret_cast<const std::uint32_t*>(&pair);
  }, v);
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) {
    if (rows[h2].n >= p.n) continue;
    const auto* x = reinterpret_cast<const uint4*>(
        opaque(row_of<__nv_bfloat16>(p.x, rows[h2].n, rows[h2].l) + 8 * q));
    uint4 xv[kGroups];
#pragma unroll
    for (int m = 0; m < kGroups; ++m) xv[m] = __ldg(x + 4 * m);
    auto* dst = reinterpret_cast<uint4*>(
        opaque(out_row_of<__nv_bfloat16>(p.out, rows[h2].n, rows[h2].l) + 8 * q));
#pragma unroll
    for (int m = 0; m < kGroups; ++m) {
      const std::uint32_t xw[4] = {xv[m].x, xv[m].y, xv[m].z, xv[m].w};
      std::uint32_t o[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const __nv_bfloat162 sum = __hadd2(*reinterpret_cast<const __nv_bfloat162*>(&xw[e]),
                                           *reinterpret_cast<const __nv_bfloat162*>(&v[h2][m][e]));
        o[e] = *reinterpret_cast<const std::uint32_t*>(&sum);
      }
      __stcs(dst + 4 * m, make_uint4(o[0], o[1], o[2], o[3]));
    }
  }
}

/// out = x + residual_scale * acc for a warpgroup's tile of kWgRows rows from `first`: lane
/// (g, q) of warp w (thread t of the warpgroup) holds rows 16 w + g (+ 8), columns
/// 8 j + 2 q + {0, 1} in acc[4 j + 2 h2 + {0, 1}]. The four lanes of a row first swap their
/// pairs (a 4 x 4 transpose per 32 columns, two shuffle steps), so that lane q holds the 8
/// consecutive columns 8 (4 m + q) .. + 7 of its row for every m and x and out move in 16-byte
/// pieces. A row's x (an L2 hit: the tile was just read) is loaded whole before its stores, so
/// that the loads overlap; interleaved with the stores, which the compiler may not move them
/// past, each would wait for L2 alone. out is stored evict-first, so that its lines leave L2
/// before the x rows that later tiles' epilogues still read (bench/NOTES.md).
template <typename T, int kC>
__device__ __forceinline__ void store_residual_rows(const CheriBlockParams& p, PlaneRow first,
                                                    int t, const float (&acc)[kC / 2]) {
  constexpr int kGroups = kC / 32;
  const int lane = t % kWarpSize, g = lane / 4, q = lane % 4;
  const PlaneRow at0 = plane_row(first, 16 * (t / kWarpSize) + g, p.l);
  const PlaneRow rows[2] = {at0, plane_row(at0, 8, p.l)};
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    store_residual_rows_bf16<kC>(p, rows, lane, acc);
    return;
  }
  float2 v[2][kGroups][4];  // [row half][m][slot]: columns 8 (4 m + q) + 2 slot
  quad_row_pairs(acc, q, [](float a, float b) { return make_float2(a, b); }, v);
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) {
    if (rows[h2].n >= p.n) continue;
    const T* x = opaque(row_of<T>(p.x, rows[h2].n, rows[h2].l) + 8 * q);
    float xv[kGroups][8];
#pragma unroll
    for (int m = 0; m < kGroups; ++m) load_vec<T, 8>(x + 32 * m, xv[m]);
    T* dst = opaque(out_row_of<T>(p.out, rows[h2].n, rows[h2].l) + 8 * q);
#pragma unroll
    for (int m = 0; m < kGroups; ++m) {
      float o[8];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        o[2 * e] = xv[m][2 * e] + p.residual_scale * v[h2][m][e].x;
        o[2 * e + 1] = xv[m][2 * e + 1] + p.residual_scale * v[h2][m][e].y;
      }
      store_floats<T, 8>(dst + 32 * m, o);
    }
  }
}

template <typename T, int kC>
__global__ void __launch_bounds__(kThreads, 1)
    cheri_inference_wgmma_kernel(const CheriBlockParams p, const float* conv_w, const float* w1,
                                 const float* w2, const float* mean, const float* rstd) {
  using Pair = typename PairOf<T>::type;
  constexpr int kLdX = kXTileLd<kC>;
  constexpr int kKSteps = kC / 16;
  static_assert(kThreads == 2 * kWgThreads, "two warpgroups");
  const int hidden = static_cast<int>(p.hidden);
  extern __shared__ unsigned char smem_raw[];
  const WgShared<T, kC> shared(smem_raw, hidden);
  unsigned char* w1s = shared.w1;  // [C / 64][E C][64]
  unsigned char* w2s = shared.w2;  // [E C / 64][C][64]
  T* xs_all = shared.xs;
  float* cw = shared.cw;

  stage_swizzled(w1, hidden, kC, w1s);
  stage_swizzled(w2, kC, hidden, w2s);
  for (int i = threadIdx.x; i < 3 * kC; i += kThreads) cw[i] = conv_w[i];
  fence_proxy_async_shared();  // the tensor cores read what ordinary stores wrote
  __syncthreads();

  const int wg = warp_uniform(threadIdx.x / 32) / 4, t = threadIdx.x % kWgThreads;
  T* xs = xs_all + wg * kWgRows * kLdX;
  const std::uint64_t w1_desc = swizzled_descriptor(w1s), w2_desc = swizzled_descriptor(w2s);
  const auto w1_block = static_cast<std::uint32_t>(hidden) * 128;  // bytes per 64 k of linear1
  const std::int64_t rows = p.n * p.l, tiles = ceil_div(rows, kWgRows), len = p.l;
  const std::int64_t stride = 2 * static_cast<std::int64_t>(gridDim.x);
  const auto sync_warpgroup = [&] { named_barrier_sync(1 + wg, kWgThreads); };
  const auto issue_x = [&](std::int64_t tile) { copy_rows_tile<T, kC>(p.x, xs, tile, p, t); };

  std::int64_t tile = 2 * static_cast<std::int64_t>(blockIdx.x) + wg;
  if (tile < tiles) issue_x(tile);
  for (; tile < tiles; tile += stride) {
    cp_async_wait<0>();
    sync_warpgroup();  // this tile's x landed (every thread's copies)
    const PlaneRow first{tile * kWgRows / len, tile * kWgRows % len};
    std::uint32_t af[kKSteps][4];
    conv_norm_fragments<T, kC, kWgRows>(af, xs, 16 * (t / kWarpSize), first, p, cw, {mean},
                                        {rstd}, [](int, int, Pair) {});
    sync_warpgroup();  // every warp is done with xs
    if (tile + stride < tiles) issue_x(tile + stride);

    // The accumulators start here (zeroed, though the first MMA of each overwrites them), so that
    // they hold no registers while the fragments above are built.
    float acc2[kC / 2];  // out [64, C]
#pragma unroll
    for (float& v : acc2) v = 0.0f;
    for (int hc = 0; hc < hidden; hc += kWgHidden) {
      float acc1[kWgHidden / 2];  // h [64, 64] of this hidden chunk
#pragma unroll
      for (float& v : acc1) v = 0.0f;
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        const std::uint32_t offset = (ks / 4) * w1_block + hc * 128 + (ks % 4) * 32;
        wgmma_rs<__half, kWgHidden>(acc1, af[ks], advance_descriptor(w1_desc, offset), ks > 0);
      }
      wgmma_commit();
      wgmma_wait<0>();  // also the previous chunk's GEMM2, which read the fragments below
      wgmma_fence_operands(acc1);
      std::uint32_t ag[kWgHidden / 16][4];
#pragma unroll
      for (int kk = 0; kk < kWgHidden / 16; ++kk) {
        gelu_fragment<true>(ag[kk], acc1 + 8 * kk, acc1 + 8 * kk + 4);
      }
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kWgHidden / 16; ++kk) {
        wgmma_rs<__half, kC>(acc2, ag[kk], advance_descriptor(w2_desc, hc * kC * 2 + kk * 32),
                         hc > 0 || kk > 0);
      }
      wgmma_commit();
    }
    wgmma_wait<0>();
    wgmma_fence_operands(acc2);

    store_residual_rows<T, kC>(p, first, t, acc2);
  }
  cp_async_wait<0>();
}

// The block on warp-specialised warpgroup MMAs (sm_90a), for E = 2 (see ws_fits): a producer
// warpgroup and two consumer warpgroups, with registers moved from the first to the others. The
// block takes the tiles blockIdx.x + i gridDim.x (64 rows of (n, l) each), in order.
//   - Producer: bulk copies bring x of tile i, a part at a time (the whole tile, or a half for
//     float32 x) with kWsHalo rows on each side (one copy when the rows are one range of memory,
//     else one a row), into a ring of kXStages x slots; its 128 threads turn the tile into
//     A = conv + norm [64, C], float16 in the 128-byte-swizzled K-major layout, in a ring of
//     kAStages A slots, and hand it over on the slot's full barrier. Taps outside the plane read
//     a row of zeros; for d above kWsHalo, those past the part's rows (and no halo rows are
//     copied) come from global memory. In a part inside one example, with d of 1, 2, 4 or 8, a
//     thread walks rows d apart and loads one row of x a row (ws_produce_interior_part).
//   - Consumer k takes the block's tiles k, k + 2, ...: per 64 hidden columns h = A W1^T (both
//     operands in shared memory), GELU(h) into registers, out += GELU(h) W2^T (A from registers).
//     The chunks are software pipelined: h of two chunks in flight, so that the tensor cores run
//     the next chunk's products while GELU runs; the A slot is released once its last product is
//     done, and out = x + residual_scale acc is written (store_residual_rows).
constexpr int kWsThreads = 3 * kWgThreads;
// E C of the kernel: 2 C (the block's expansion). Its chunk loop is unrolled whole: across a loop
// edge ptxas cannot tell the chunks' registers apart and serialises the products.
template <int kC>
constexpr int kWsHidden = 2 * kC;

/// The x slots of the warp-specialised kernel hold a part of a tile (kWsPartRows rows: the whole
/// tile, or half of it for float32 x, so that two slots fit in 227 KiB beside the weights and the
/// A slots at C = 128) and kWsHalo rows on each side: for d up to kWsHalo every tap of the part's
/// rows comes from its slot.
constexpr int kWsHalo = 8;
template <typename T>
constexpr int kWsPartRows = sizeof(T) == 2 ? kWgRows : kWgRows / 2;
template <typename T>
constexpr int kWsSlotRows = kWsPartRows<T> + 2 * kWsHalo;
constexpr int kWsXStages = 2;
constexpr int kWsAStages = 3;

template <typename T, int kC>
std::size_t ws_smem_bytes(std::int64_t hidden) {
  const auto h = static_cast<std::size_t>(hidden);
  return 1024                                                           // alignment to 1024
         + 2 * h * kC * sizeof(__half)                                  // linear1, linear2
         + kWsAStages * kWgRows * kC * sizeof(__half)                   // A slots
         + kWsXStages * kWsSlotRows<T> * kC * sizeof(T)                 // x slots
         + kC * sizeof(T)                                               // a row of zeros
         + (kWsXStages + 2 * kWsAStages) * sizeof(std::uint64_t);       // barriers
}

/// The shared memory of cheri_inference_ws_kernel (ws_smem_bytes), from a 1024-byte-aligned base.
template <typename T, int kC>
struct WsShared {
  static constexpr int kXStages = kWsXStages, kAStages = kWsAStages;
  static constexpr int kSlotRows = kWsSlotRows<T>;
  unsigned char* w1;        // [C / 64][E C][64] float16, swizzled
  unsigned char* w2;        // [E C / 64][C][64]
  unsigned char* a;         // [kAStages][C / 64][64][64]
  T* xs;                    // [kXStages][kSlotRows][C]: a part's rows after kWsHalo rows
  T* zero;                  // [C]: the taps outside the plane
  std::uint64_t* x_full;    // [kXStages]: x of the slot's part arrived
  std::uint64_t* a_full;    // [kAStages]: the producer wrote the slot's A
  std::uint64_t* a_empty;   // [kAStages]: the consumer's products read it

  __device__ WsShared(unsigned char* raw, int hidden) {
    w1 = raw + ((1024 - shared_address(raw) % 1024) % 1024);
    w2 = w1 + static_cast<std::size_t>(hidden) * kC * 2;
    a = w2 + static_cast<std::size_t>(hidden) * kC * 2;
    xs = reinterpret_cast<T*>(a + kAStages * kWgRows * kC * 2);
    zero = xs + kXStages * kSlotRows * kC;
    x_full = reinterpret_cast<std::uint64_t*>(zero + kC);
    a_full = x_full + kXStages;
    a_empty = a_full + kAStages;
  }
  __device__ T* x_slot(int slot) const { return xs + slot * kSlotRows * kC; }
  __device__ unsigned char* a_slot(int slot) const { return a + slot * kWgRows * kC * 2; }
};

#ifdef FUSEKIT_WGMMA  // the producer and consumers of cheri_inference_ws_kernel

// Registers a thread: 168 at launch (384 threads, one block an SM), then the producer's 128
// threads give up 48 each and the consumers' 256 take 24 each. With fewer, ptxas serialises the
// consumers' products (C7512 at 184: each MMA waited for before the next is issued); with the
// taps from shared memory the producer runs in 120 without spilling (bench/NOTES.md).
constexpr int kWsProducerRegisters = 120;
constexpr int kWsConsumerRegisters = 192;
constexpr int kATileBlockBytes = kWgRows * 128;  // one 64-k block of an A tile

/// Warp 0 of the producer: the kWsPartRows<T> rows of the plane [N L, C] from `first` (a part of
/// a tile), and for d <= kWsHalo kWsHalo rows on each side, into the x slot `dst` by bulk copies
/// (one when the rows are one range of memory, else one a row), completing on `bar` (which
/// expects their bytes). Row first + r goes to the slot's row kWsHalo + r.
template <typename T, int kC>
__device__ __forceinline__ void issue_x_rows(const CheriBlockParams& p, T* dst, std::uint64_t* bar,
                                             std::int64_t first, int lane) {
  constexpr std::uint32_t kRowBytes = kC * sizeof(T);
  const int halo = p.dilation <= kWsHalo ? kWsHalo : 0;
  const std::int64_t lo = max(first - halo, std::int64_t{0});
  const std::int64_t hi = min(first + kWsPartRows<T> + halo, p.n * p.l);
  const int count = hi > lo ? static_cast<int>(hi - lo) : 0;  // none for a part past the plane
  T* to = dst + (kWsHalo + lo - first) * kC;
  if (lane == 0) mbarrier_arrive_expect_bytes(bar, count * kRowBytes);
  __syncwarp();
  if (count == 0) return;
  if (p.x.stride[1] == kC && (p.x.stride[0] == p.l * kC || lo / p.l == (hi - 1) / p.l)) {
    // the rows are one range of memory: one copy
    if (lane == 0) {
      bulk_copy_to_shared(to, row_of<T>(p.x, lo / p.l, lo % p.l), count * kRowBytes, bar);
    }
    return;
  }
  for (int r = lane; r < count; r += kWarpSize) {
    bulk_copy_to_shared(to + r * kC, row_of<T>(p.x, (lo + r) / p.l, (lo + r) % p.l), kRowBytes,
                        bar);
  }
}

/// Channels of a row that a producer thread turns into A: 16 bytes of A in float16, one or two
/// 16-byte pieces of x.
constexpr int kWsChannels = 8;
/// Producer threads a row (thread t takes channels (t % kWsGroups) kWsChannels on, in row lane
/// t / kWsGroups), and the rows each thread builds in a part.
template <int kC>
constexpr int kWsGroups = kC / kWsChannels;
template <typename T, int kC>
constexpr int kWsPasses = kWsPartRows<T> / (kWgThreads / kWsGroups<kC>);

/// The order of a producer thread's channels: a float32 thread whose lane % 8 is 4 or more
/// takes the second 16-byte piece of its 8 channels first, so that the loads of a quarter of a
/// warp cover 128 distinct bytes (no bank conflicts). Its k-th value is channel c0 + (k ^ flip).
template <typename T>
__device__ __forceinline__ int ws_channel_flip(int t) {
  return sizeof(T) == 4 ? (t & 4) : 0;
}

/// kWsChannels elements of x as they lie in memory, in the order of ws_channel_flip.
template <typename T>
struct XPiece {
  static constexpr int kPieces = kWsChannels * sizeof(T) / 16;
  uint4 raw[kPieces];

  __device__ __forceinline__ void load(const T* from, int flip) {
    constexpr int kPer = 16 / sizeof(T);
#pragma unroll
    for (int k = 0; k < kPieces; ++k) {
      raw[k] = *reinterpret_cast<const uint4*>(from + ((k * kPer) ^ flip));
    }
  }
  __device__ __forceinline__ float operator[](int k) const {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      const float2 pair = widen_bf16x2(reinterpret_cast<const std::uint32_t*>(raw)[k / 2]);
      return k % 2 == 0 ? pair.x : pair.y;
    } else {
      return to_float(reinterpret_cast<const T*>(raw)[k]);
    }
  }
};

/// x at row `at` + `offset` of the plane (row r of the slot's part; `exists` false where that row
/// lies outside the plane), channels c0 on: from the x slot `xs` where it holds the row (kNear,
/// d <= kWsHalo: always; else when it lies in the part), else from global memory; zeros where it
/// does not exist.
template <typename T, int kC, bool kNear>
__device__ __forceinline__ XPiece<T> tap_piece(const CheriBlockParams& p,
                                               const WsShared<T, kC>& s, const T* xs, int r,
                                               std::int64_t offset, PlaneRow at, int c0,
                                               int flip, bool exists) {
  const T* from = s.zero + c0;
  if constexpr (kNear) {
    if (exists) from = xs + (r + kWsHalo + static_cast<int>(offset)) * kC + c0;
  } else if (exists) {
    const std::int64_t part_row = r + offset;
    if (part_row < 0 || part_row >= kWsPartRows<T>) {
      from = row_of<T>(p.x, at.n, at.l + offset) + c0;
    } else {
      from = xs + (kWsHalo + part_row) * kC + c0;
    }
  }
  XPiece<T> piece;
  piece.load(from, flip);
  return piece;
}

/// A producer thread's current row of the plane, (n, l) in int (ws_fits keeps N L below
/// INT_MAX - kWgRows), with its example's statistics as A = conv scale + shift (scale = rstd,
/// shift = -mean rstd; both 0 for rows past the plane, whose outputs are never written).
/// A cursor is built a tile ahead: its statistics are requested then and put to use by ready()
/// when its tile comes, so that their loads' latency passes under the tile before.
struct RowCursor {
  int n, l, examples, len;
  float scale, shift;  // before ready(): rstd and mean

  __device__ __forceinline__ RowCursor(const CheriBlockParams& p, int row, const float* mean,
                                       const float* rstd)
      : examples(static_cast<int>(p.n)), len(static_cast<int>(p.l)) {
    n = row / len;
    l = row - n * len;
    request_statistics(mean, rstd);
  }
  __device__ __forceinline__ bool live() const { return n < examples; }
  __device__ __forceinline__ void request_statistics(const float* mean, const float* rstd) {
    scale = live() ? rstd[n] : 0.0f;
    shift = live() ? mean[n] : 0.0f;
  }
  __device__ __forceinline__ void ready() { shift = -shift * scale; }
  /// Moves on by `rows` rows (the statistics of a new example used at once).
  __device__ __forceinline__ void advance(int rows, const float* mean, const float* rstd) {
    l += rows;
    if (l >= len) {
      do {
        l -= len;
        ++n;
      } while (l >= len);
      request_statistics(mean, rstd);
      ready();
    }
  }
};

/// A producer thread's 8 channels of one row of A: conv = the taps' weights times x at the row
/// d before (`xl`), at the row (`xm`) and d after (`xr`), then conv scale + shift in float16, into
/// the A slot's block `a` at tile row `r`; kKeep: also, where `save`, into the saved rows at plane
/// row `plane_row`, the columns in quad order.
template <typename T, int kC, bool kKeep>
__device__ __forceinline__ void ws_store_row(const CheriBlockParams& p, unsigned char* a, int r,
                                             bool save, int plane_row, int c0, int flip,
                                             const XPiece<T>& xl, const XPiece<T>& xm,
                                             const XPiece<T>& xr, const float (&wl)[kWsChannels],
                                             const float (&wm)[kWsChannels],
                                             const float (&wr)[kWsChannels], float scale,
                                             float shift) {
  constexpr int kV = kWsChannels;
  std::uint32_t h[kV / 2];  // channels c0 + (j ^ flip), + 1 in h[j / 2]
#pragma unroll
  for (int j = 0; j < kV; j += 2) {
    float v[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float conv =
          fmaf(wl[j + e], xl[j + e], fmaf(wr[j + e], xr[j + e], wm[j + e] * xm[j + e]));
      v[e] = fmaf(conv, scale, shift);
    }
    h[j / 2] = pack_half2(v[0], v[1]);
  }
  if constexpr (kKeep) {
    // the training forward keeps y for the backward (saved_y), its columns in quad order
    if (save) {
      auto* y = static_cast<__half*>(p.saved_y) + static_cast<std::int64_t>(plane_row) * kC;
#pragma unroll
      for (int j = 0; j < kV; j += 2) {
        *reinterpret_cast<std::uint32_t*>(y + quad_order(c0 + (j ^ flip))) = h[j / 2];
      }
    }
  }
  *reinterpret_cast<uint4*>(a + swizzled_offset(r, c0 % 64)) =
      flip ? make_uint4(h[2], h[3], h[0], h[1]) : make_uint4(h[0], h[1], h[2], h[3]);
}

/// The producer's work on part `part` of a tile: A = conv + norm of the part's rows (in the x
/// slot `xs`) into the A slot's block `a`, `at` at the thread's first row of the part (see
/// ws_producer; kNear: d <= kWsHalo).
template <typename T, int kC, bool kNear, bool kKeep>
__device__ __forceinline__ void ws_produce_part(const CheriBlockParams& p,
                                                const WsShared<T, kC>& s, const T* xs,
                                                unsigned char* a, int part, RowCursor& at,
                                                const float* mean, const float* rstd,
                                                const float (&wl)[kWsChannels],
                                                const float (&wm)[kWsChannels],
                                                const float (&wr)[kWsChannels], int t) {
  constexpr int kGroups = kWsGroups<kC>, kPasses = kWsPasses<T, kC>;
  constexpr int kRowsPerPass = kWgThreads / kGroups;  // rows the warpgroup covers at once
  // rows whose loads are issued together (float32: a row's six 16-byte pieces)
  constexpr int kBatch = sizeof(T) == 4 ? 1 : 2;
  static_assert(kWgThreads % kGroups == 0 && kPasses % kBatch == 0, "whole rows per pass");
  const int c0 = (t % kGroups) * kWsChannels, r_first = t / kGroups;
  const int flip = ws_channel_flip<T>(t);
  const int r_part = part * kWsPartRows<T>;  // the part's first row in the tile
  const std::int64_t d = p.dilation;
  // d in int where it is compared with a row (rows are below INT_MAX)
  const int di = static_cast<int>(min(d, std::int64_t{std::numeric_limits<int>::max()}));
#pragma unroll 1
  for (int u0 = 0; u0 < kPasses; u0 += kBatch) {
    // Every load of the batch first, so that their latencies overlap; then the arithmetic.
    XPiece<T> xm[kBatch], xl[kBatch], xr[kBatch];
    float scale[kBatch], shift[kBatch];
    [[maybe_unused]] int plane_row[kBatch];  // kKeep: the row of the plane, -1 past it
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (b > 0) at.advance(kRowsPerPass, mean, rstd);
      const int r = r_first + (u0 + b) * kRowsPerPass;  // in the part
      const PlaneRow row{at.n, at.l};
      if constexpr (kKeep) plane_row[b] = at.live() ? at.n * at.len + at.l : -1;
      xm[b].load(xs + (r + kWsHalo) * kC + c0, flip);
      xl[b] = tap_piece<T, kC, kNear>(p, s, xs, r, -d, row, c0, flip, at.live() && at.l >= di);
      xr[b] = tap_piece<T, kC, kNear>(p, s, xs, r, d, row, c0, flip,
                                      at.live() && at.l < at.len - di);
      scale[b] = at.scale;
      shift[b] = at.shift;
    }
    at.advance(kRowsPerPass, mean, rstd);
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int r = r_part + r_first + (u0 + b) * kRowsPerPass;  // in the tile
      const bool save = kKeep && plane_row[b] >= 0;  // kKeep: rows past the plane are not saved
      ws_store_row<T, kC, kKeep>(p, a, r, save, kKeep ? plane_row[b] : 0, c0, flip, xl[b], xm[b],
                                 xr[b], wl, wm, wr, scale[b], shift[b]);
    }
  }
}

/// A part's rows in chain order: the rows r with r % d == 0 in increasing order, then those with
/// r % d == 1, and so on; rows next to each other in a chain are d apart and share two of their
/// three taps. Where d divides the part's rows and each chain is a whole number of runs of kPasses
/// rows, the thread's rows of a part (ws_produce_interior_part) are the run of its row lane
/// (t / kWsGroups): first, first + d, ..., first + (kPasses - 1) d; returns first, or -1 for any
/// other d (d > kWsHalo among them).
template <typename T, int kC>
__device__ __forceinline__ int ws_chain_first_row(std::int64_t d, int t) {
  constexpr int kRows = kWsPartRows<T>, kPasses = kWsPasses<T, kC>;
  if (d > kWsHalo || kRows % d != 0 || (kRows / d) % kPasses != 0) return -1;
  const int chain_rows = kRows / static_cast<int>(d), place = (t / kWsGroups<kC>) * kPasses;
  return place / chain_rows + (place % chain_rows) * static_cast<int>(d);
}

/// ws_produce_part where the part and its taps lie inside one example and d allows chains
/// (ws_chain_first_row gave `first`): no tap is zero and every row has the statistics of `at`.
/// The thread walks its rows first, first + d, ...: it loads x of one row for each (the next
/// row's right tap; its left and middle taps are this row's middle and right ones), issued before
/// this row's arithmetic. `at` is at the thread's row lane's row of the part (as for
/// ws_produce_part) and is left at the same row of the next part.
template <typename T, int kC, bool kKeep>
__device__ __forceinline__ void ws_produce_interior_part(
    const CheriBlockParams& p, const T* xs, unsigned char* a, int part, RowCursor& at, int first,
    const float* mean, const float* rstd, const float (&wl)[kWsChannels],
    const float (&wm)[kWsChannels], const float (&wr)[kWsChannels], int t) {
  constexpr int kGroups = kWsGroups<kC>, kPasses = kWsPasses<T, kC>;
  const int c0 = (t % kGroups) * kWsChannels, flip = ws_channel_flip<T>(t);
  int d = static_cast<int>(p.dilation);
  if constexpr (sizeof(T) == 2) {
    // Half-precision x: the rows' A offsets are computed again for every part (kept from one
    // part to the next, they spill); float32 was faster keeping them.
    asm volatile("" : "+r"(d));
  }
  const int r0 = part * kWsPartRows<T> + first;  // the thread's first row in the tile
  // kKeep: the plane's row of the thread's first row (`at` is at row t / kGroups of the part)
  [[maybe_unused]] const int plane_r0 = at.n * at.len + at.l - t / kGroups + first;
  const T* row = xs + (kWsHalo + first) * kC + c0;  // x of the thread's first row, its channels
  const float scale = at.scale, shift = at.shift;
  XPiece<T> x[4];  // a ring: the taps of the thread's u-th row are x[u % 4] to x[(u + 2) % 4]
  x[0].load(row - d * kC, flip);
  x[1].load(row, flip);
  x[2].load(row + d * kC, flip);
#pragma unroll
  for (int u = 0; u < kPasses; ++u) {
    if (u + 1 < kPasses) x[(u + 3) % 4].load(row + (u + 2) * d * kC, flip);
    ws_store_row<T, kC, kKeep>(p, a, r0 + u * d, true, plane_r0 + u * d, c0, flip, x[u % 4],
                               x[(u + 1) % 4], x[(u + 2) % 4], wl, wm, wr, scale, shift);
  }
  at.advance(kWsPartRows<T>, mean, rstd);
}

template <typename T, int kC, bool kKeep>
__device__ __forceinline__ void ws_producer(const CheriBlockParams& p, const WsShared<T, kC>& s,
                                            const float* conv_w, const float* mean,
                                            const float* rstd, int tiles, int t) {
  constexpr int kV = kWsChannels;
  constexpr int kParts = kWgRows / kWsPartRows<T>;
  const int lane = t % kWarpSize, warp = t / kWarpSize, parts = tiles * kParts;
  // the first row of the plane of the block's part q (of tile q / kParts)
  const auto part_first = [&](int q) {
    return static_cast<int>(blockIdx.x + (q / kParts) * gridDim.x) * kWgRows +
           (q % kParts) * kWsPartRows<T>;
  };
  // the thread's first row of the block's tile i (its row lane's, t / kWsGroups)
  const auto cursor = [&](int i) {
    return RowCursor(p, part_first(i * kParts) + t / kWsGroups<kC>, mean, rstd);
  };
  const bool near = p.dilation <= kWsHalo;
  // the thread's first row of a part inside one example, in chain order (-1: d allows none)
  const int chain_first = ws_chain_first_row<T, kC>(p.dilation, t);
  if (warp == 0) {
    for (int q = 0; q < s.kXStages && q < parts; ++q) {
      issue_x_rows<T, kC>(p, s.x_slot(q), s.x_full + q, part_first(q), lane);
    }
  }
  if (tiles == 0) return;
  const int c0 = (t % kWsGroups<kC>) * kV, flip = ws_channel_flip<T>(t);
  const std::uint32_t block_offset = (c0 / 64) * kATileBlockBytes;
  float wl[kV], wm[kV], wr[kV];  // the taps of the thread's channels, in its order
#pragma unroll
  for (int k = 0; k < kV; ++k) {
    wl[k] = conv_w[c0 + (k ^ flip)];
    wm[k] = conv_w[kC + c0 + (k ^ flip)];
    wr[k] = conv_w[2 * kC + c0 + (k ^ flip)];
  }
  RingPosition xpos, apos;
  RowCursor next = cursor(0);
  for (int i = 0; i < tiles; ++i) {
    unsigned char* a = s.a_slot(apos.slot) + block_offset;
    RowCursor at = next;
    if (i + 1 < tiles) next = cursor(i + 1);
    at.ready();
    mbarrier_wait(s.a_empty + apos.slot, apos.phase ^ 1u);
#pragma unroll 1
    for (int part = 0; part < kParts; ++part) {
      const int q = i * kParts + part;
      T* xs = s.x_slot(xpos.slot);
      mbarrier_wait(s.x_full + xpos.slot, xpos.phase);
      // the part's row 0 in the example of the thread's row (below 0: in an example before)
      const int start = at.l - t / kWsGroups<kC>;
      const bool inside = start >= p.dilation && start + kWsPartRows<T> + p.dilation <= at.len;
      if (chain_first >= 0 && at.live() && inside) {
        ws_produce_interior_part<T, kC, kKeep>(p, xs, a, part, at, chain_first, mean, rstd, wl, wm,
                                               wr, t);
      } else if (near) {
        ws_produce_part<T, kC, true, kKeep>(p, s, xs, a, part, at, mean, rstd, wl, wm, wr, t);
      } else {
        ws_produce_part<T, kC, false, kKeep>(p, s, xs, a, part, at, mean, rstd, wl, wm, wr,
                                             t);
      }
      named_barrier_sync(1, kWgThreads);  // every producer thread is done with the x slot
      if (warp == 0 && q + s.kXStages < parts) {
        issue_x_rows<T, kC>(p, xs, s.x_full + xpos.slot, part_first(q + s.kXStages), lane);
      }
      xpos.advance(1, s.kXStages);
    }
    fence_proxy_async_shared();  // the tensor cores read what ordinary stores wrote
    mbarrier_arrive(s.a_full + apos.slot);
    apos.advance(1, s.kAStages);
  }
}

template <typename T, int kC>
__device__ __forceinline__ void ws_consumer(const CheriBlockParams& p, const WsShared<T, kC>& s,
                                            std::int64_t count, int k, int t) {
  constexpr int kKSteps = kC / 16;
  constexpr int kChunks = kWsHidden<kC> / kWgHidden;  // even (see kWsHidden)
  const int hidden = kWsHidden<kC>;
  const std::uint64_t w1_desc = swizzled_descriptor(s.w1), w2_desc = swizzled_descriptor(s.w2);
  const auto w1_block = static_cast<std::uint32_t>(hidden) * 128;  // bytes per 64 k of linear1
  const int len = static_cast<int>(p.l);
  RingPosition apos;
  apos.advance(k, s.kAStages);
  for (std::int64_t i = k; i < count; i += 2) {
    const std::int64_t tile = blockIdx.x + i * gridDim.x;
    mbarrier_wait(s.a_full + apos.slot, apos.phase);
    const std::uint64_t a_desc = swizzled_descriptor(s.a_slot(apos.slot));
    float acc2[kC / 2];  // out [64, C]
#pragma unroll
    for (float& v : acc2) v = 0.0f;
    float h0[kWgHidden / 2], h1[kWgHidden / 2];             // h of two chunks [64, 64]
    std::uint32_t g0[kWgHidden / 16][4], g1[kWgHidden / 16][4];  // GELU(h) as A fragments
    const auto gemm1 = [&](float (&h)[kWgHidden / 2], int chunk) {
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        const std::uint32_t a_off = (ks / 4) * kATileBlockBytes + (ks % 4) * 32;
        const std::uint32_t b_off = (ks / 4) * w1_block + chunk * kWgHidden * 128 + (ks % 4) * 32;
        wgmma_ss<__half, kWgHidden>(h, advance_descriptor(a_desc, a_off),
                                    advance_descriptor(w1_desc, b_off), ks > 0);
      }
      wgmma_commit();
    };
    const auto gelu = [&](std::uint32_t (&g)[kWgHidden / 16][4], float (&h)[kWgHidden / 2]) {
      wgmma_fence_operands(h);
#pragma unroll
      for (int kk = 0; kk < kWgHidden / 16; ++kk) {
        gelu_scaled_fragment(g[kk], h + 8 * kk, h + 8 * kk + 4);
      }
    };
    const auto gemm2 = [&](std::uint32_t (&g)[kWgHidden / 16][4], int chunk) {
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kWgHidden / 16; ++kk) {
        wgmma_rs<__half, kC>(acc2, g[kk],
                             advance_descriptor(w2_desc, chunk * kWgHidden * kC * 2 + kk * 32),
                             chunk > 0 || kk > 0);
      }
      wgmma_commit();
    };
    // Commit order G1(0) G1(1) G2(0) [G1(c) G2(c-1) G1(c+1) G2(c)]... G2(last): each wait leaves
    // the groups committed after the G1 it needs in flight; a GELU's registers were last read by
    // a G2 committed before that G1.
    gemm1(h0, 0);
    gemm1(h1, 1);
    wgmma_wait<1>();
    gelu(g0, h0);
    gemm2(g0, 0);
#pragma unroll
    for (int c = 2; c < kChunks; c += 2) {
      gemm1(h0, c);
      wgmma_wait<2>();
      gelu(g1, h1);
      gemm2(g1, c - 1);
      gemm1(h1, c + 1);
      wgmma_wait<2>();
      gelu(g0, h0);
      gemm2(g0, c);
    }
    wgmma_wait<1>();
    mbarrier_arrive(s.a_empty + apos.slot);  // every product reading the A slot is done
    gelu(g1, h1);
    gemm2(g1, kChunks - 1);
    wgmma_wait<0>();
    wgmma_fence_operands(acc2);
    const int row0 = static_cast<int>(tile) * kWgRows;  // ws_fits keeps N L in int
    store_residual_rows<T, kC>(p, {row0 / len, row0 % len}, t, acc2);
    apos.advance(2, s.kAStages);
  }
}

#endif  // FUSEKIT_WGMMA

template <typename T, int kC, bool kKeep>
__global__ void __launch_bounds__(kWsThreads, 1)
    cheri_inference_ws_kernel(const CheriBlockParams p, const float* conv_w, const float* w1,
                              const float* w2, const float* mean, const float* rstd) {
#ifdef FUSEKIT_WGMMA
  const int hidden = static_cast<int>(p.hidden);
  extern __shared__ unsigned char smem_raw[];
  const WsShared<T, kC> s(smem_raw, hidden);
  stage_swizzled(w1, hidden, kC, s.w1, kGeluScale);  // gelu_scaled_half2's factors
  stage_swizzled(w2, kC, hidden, s.w2, 0.5f / kGeluScale);
  for (int i = threadIdx.x; i < kC; i += kWsThreads) s.zero[i] = from_float<T>(0.0f);
  if (threadIdx.x == 0) {
    for (int i = 0; i < s.kXStages; ++i) mbarrier_init(s.x_full + i, 1);
    for (int i = 0; i < s.kAStages; ++i) {
      mbarrier_init(s.a_full + i, kWgThreads);
      mbarrier_init(s.a_empty + i, kWgThreads);
    }
    mbarrier_init_fence();
  }
  fence_proxy_async_shared();  // the tensor cores read the weights that ordinary stores wrote
  __syncthreads();
  // Launched as a dependent of the statistics: the weights above were staged under their tail;
  // mean and rstd are read, and out written (it may be x), from here on.
  wait_for_prerequisites();

  // the block's tiles, in int (ws_fits keeps N L below INT_MAX - kWgRows)
  const int tiles = static_cast<int>(ceil_div(p.n * p.l, static_cast<std::int64_t>(kWgRows)));
  const int block = static_cast<int>(blockIdx.x);
  const int count =
      tiles > block ? static_cast<int>(ceil_div(tiles - block, static_cast<int>(gridDim.x))) : 0;
  const int wg = warp_uniform(threadIdx.x / 32) / 4, t = threadIdx.x % kWgThreads;
  if (wg == 0) {
    warpgroup_lower_registers<kWsProducerRegisters>();
    ws_producer<T, kC, kKeep>(p, s, conv_w, mean, rstd, count, t);
  } else {
    warpgroup_raise_registers<kWsConsumerRegisters>();
    ws_consumer<T, kC>(p, s, count, wg - 1, t);
  }
#else
  __trap();
#endif
}

/// The training forward's saved rows (CheriBlockParams::saved_y) where the warp-specialised kernel
/// does not write them: y = (conv - mean) rstd of float32 x in float16, each row's columns in quad
/// order (quad_order), one 16-byte piece (position 8 q of a 32-column group) a thread.
__global__ void __launch_bounds__(kThreads) save_rows_kernel(const CheriBlockParams p) {
  const std::int64_t pieces_a_row = p.c / 8, len = p.l, d = p.dilation;
  const auto* w = static_cast<const float*>(p.conv_weight.data);
  const std::int64_t ws0 = p.conv_weight.stride[0], ws1 = p.conv_weight.stride[1];
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       i < p.n * len * pieces_a_row; i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = i / pieces_a_row, n = row / len, l = row % len;
    const int piece = static_cast<int>(i % pieces_a_row), q = piece % 4;
    const float* mid = row_of<float>(p.x, n, l);
    const float* left = l >= d ? row_of<float>(p.x, n, l - d) : nullptr;
    const float* right = l + d < len ? row_of<float>(p.x, n, l + d) : nullptr;
    const float mean = p.mean.data[n * p.mean.stride], rstd = p.rstd.data[n * p.rstd.stride];
    std::uint32_t v[4];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      float y[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const std::int64_t c = 32 * (piece / 4) + 8 * a + 2 * q + e;
        float conv = w[ws0 + c * ws1] * mid[c];
        if (left != nullptr) conv += w[c * ws1] * left[c];
        if (right != nullptr) conv += w[2 * ws0 + c * ws1] * right[c];
        y[e] = (conv - mean) * rstd;
      }
      v[a] = pack_half2(y[0], y[1]);
    }
    *reinterpret_cast<uint4*>(static_cast<__half*>(p.saved_y) + row * p.c + 8 * piece) =
        make_uint4(v[0], v[1], v[2], v[3]);
  }
}

// The front of the training backward on the same machinery (sm_90a, float32 x with TF32
// allowed): per warpgroup tile of 64 rows, y (conv + norm; with kSaved, the forward's saved rows)
// and grad_out as float16 A fragments, then per 64 hidden columns h = y W1^T and e = grad_out W2
// as two wgmma chains on the tile, and in float32 g = GELU(h), dg = residual_scale e GELU'(h). It
// writes y (unless kSaved), grad_out, g and dg as float16 (FrontOut) for weight_grad_kernel,
// replacing four passes (conv + norm, two products, GELU and GELU') over float32 buffers. Each
// row of grad_out is scaled by a power of two that brings its largest value into [2^14, 2^15)
// before its rounding to float16 for the products here, so that gradients of any size keep
// TF32's 10 bits of mantissa (values below 2^-28 of their row's largest excepted); rows whose
// largest value is below 2^-86 are scaled by 2^100 only. g and dg
// are written scaled per row too (row_exponent), from bounds known before the products:
// |h| <= |y_r| max_j |W1_j| for g, |e| <= |grad_out_r| max_j |W2^T_j| and |GELU'| < 1.13 for dg
// (so a row's values stay below 2^15 and keep 10 bits, whatever the scale of the gradient or of
// the weights). y needs no scale: |y| <= sqrt(L C) (bench/NOTES.md). W2^T [E C, C] arrives
// packed, so that both products read their B operand as the inference kernel reads linear1.
// It also writes, per row r, sum_c dy[r, c] and sum_c dy[r, c] y[r, c] for the norm's backward,
// without dy = dg W1: they are sum_j dg[r, j] u_j (u = W1 1, the row sums of linear1) and
// sum_j dg[r, j] h[r, j] (h = y W1^T), from the accumulators.
template <int kC>
std::size_t front_smem_bytes(std::int64_t hidden) {
  return wgmma_smem_bytes<float, kC>(hidden) + static_cast<std::size_t>(hidden) * sizeof(float) +
         kFrontScratchFloats * sizeof(float);
}

#ifdef FUSEKIT_WGMMA  // used by the sm_90a kernels only
/// Four 4-byte pieces of a row held by the four lanes of a quad, lane q holding the pieces at
/// columns 8 a + 2 q (a = 0 .. 3, two float16 each), exchanged (a 4 x 4 transpose, two shuffle
/// steps) so that lane q holds columns 8 q .. 8 q + 7 in v[0 .. 3]: one 16-byte store instead of
/// four 4-byte ones, which the memory system would take as four partial sectors.
__device__ __forceinline__ void quad_transpose(std::uint32_t (&v)[4], int q) {
#pragma unroll
  for (int step = 1; step <= 2; step *= 2) {
    const bool upper = (q & step) != 0;
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      if ((a & step) != 0) continue;
      const std::uint32_t got = __shfl_xor_sync(0xffffffffu, upper ? v[a] : v[a ^ step], step);
      (upper ? v[a] : v[a ^ step]) = got;
    }
  }
}
#endif

/// Stores `v` as the 8 float16 at positions 8 q .. of a 32-column group: after quad_transpose,
/// columns 8 q .. 8 q + 7; without it, the lane's own columns in quad order (quad_order).
__device__ __forceinline__ void store_quad(__half* group, const std::uint32_t (&v)[4], int q) {
  *reinterpret_cast<uint4*>(group + 8 * q) = make_uint4(v[0], v[1], v[2], v[3]);
}

/// The front kernel's float16 outputs: y and grad_out [N L, C], g and dg [N L, E C], the columns
/// of each row in quad order, each row r of the last three scaled by 2^exps[k exps_stride + r]
/// (k = 0, 1, 2; exps_stride a multiple of 64, so that each array starts 256-byte aligned).
/// weight_grad_kernel reads them so. Where the forward kept the saved rows (saved_y, the same
/// layout as y), y is those, which the front kernel reads instead of writing.
struct FrontOut {
  __half* y;
  __half* go;
  __half* g;
  __half* dg;
  int* exps;
  std::int64_t exps_stride;
};

/// The exponent e of a power of two that brings `bound` into [2^14, 2^15): at most 100 (so that
/// zeros and tiny values are not scaled without end); 0 where the bound is not finite (NaN and
/// infinity then stay what they are).
__device__ __forceinline__ int row_exponent(float bound) {
  const int e = (__float_as_int(bound) >> 23) & 0xff;  // biased; bound >= 0
  return e == 0xff ? 0 : min(141 - e, 100);
}

/// 2^e as a float (e in [-126, 127]).
__device__ __forceinline__ float power_of_two(int e) { return __int_as_float((e + 127) << 23); }

template <int kC, bool kSaved>
__global__ void __launch_bounds__(kThreads, 1)
    cheri_backward_front_kernel(const CheriBlockParams p, const float* conv_w, const float* w1,
                                const float* w2t, const float* weight_facts, const FrontOut out,
                                float* row_sums) {
  using T = float;
  constexpr int kLdX = kXTileLd<kC>;
  constexpr int kKSteps = kC / 16;
  static_assert(kThreads == 2 * kWgThreads, "two warpgroups");
  const int hidden = static_cast<int>(p.hidden);
  extern __shared__ unsigned char smem_raw[];
  const WgShared<T, kC> shared(smem_raw, hidden);
  unsigned char* w1s = shared.w1;  // [C / 64][E C][64]
  unsigned char* w2s = shared.w2;  // W2^T, [C / 64][E C][64]
  T* xs_all = shared.xs;
  float* cw = shared.cw;
  float* u = cw + 3 * kC;  // [E C]: the row sums of linear1
  float* norms = u + hidden;  // [2]: the largest |W1_j| and |W2^T_j| (as int bits, for atomicMax)
  allow_dependents();  // its dependent waits for the whole kernel

  stage_swizzled(w1, hidden, kC, w1s);
  stage_swizzled(w2t, hidden, kC, w2s);
  for (int i = threadIdx.x; i < 3 * kC; i += kThreads) cw[i] = conv_w[i];
  if (threadIdx.x < 2) norms[threadIdx.x] = 0.0f;
  __syncthreads();
  // weight_facts come from the launch before this one, which has completed (this kernel is not
  // launched as a dependent)
  for (int j = threadIdx.x; j < hidden; j += kThreads) {
    u[j] = weight_facts[kRowSum * hidden + j];
    // non-negative floats order as their bits (NaN, bits above infinity's, wins too)
    atomicMax(reinterpret_cast<int*>(norms), __float_as_int(weight_facts[kRowNorm1 * hidden + j]));
    atomicMax(reinterpret_cast<int*>(norms) + 1,
              __float_as_int(weight_facts[kRowNorm2 * hidden + j]));
  }
  fence_proxy_async_shared();  // the tensor cores read what ordinary stores wrote
  __syncthreads();
  // The products read the weights rounded to float16: their norms grow by at most 2^-11.
  const float w1_norm = norms[0] * 1.001f, w2_norm = norms[1] * 1.001f;

  const int wg = warp_uniform(threadIdx.x / 32) / 4, t = threadIdx.x % kWgThreads;
  const int lane = t % kWarpSize, g = lane / 4, q = lane % 4, r0 = 16 * (t / kWarpSize);
  T* xs = xs_all + wg * kWgRows * kLdX;
  const std::uint64_t w1_desc = swizzled_descriptor(w1s), w2_desc = swizzled_descriptor(w2s);
  const auto w_block = static_cast<std::uint32_t>(hidden) * 128;  // bytes per 64 k of a weight
  const std::int64_t rows = p.n * p.l, tiles = ceil_div(rows, kWgRows), len = p.l;
  const std::int64_t stride = 2 * static_cast<std::int64_t>(gridDim.x);
  const auto sync_warpgroup = [&] { named_barrier_sync(1 + wg, kWgThreads); };

  std::int64_t tile = 2 * static_cast<std::int64_t>(blockIdx.x) + wg;
  // x of the tile (to rebuild y), or where y was kept, grad_out of the tile: its rows come by
  // cp.async into xs a tile ahead, so that the tile's start waits for shared memory rather than
  // for loads from memory (a third of the warps' waiting, bench/NOTES.md).
  if (tile < tiles) copy_rows_tile<T, kC>(kSaved ? p.grad_out : p.x, xs, tile, p, t);
  for (; tile < tiles; tile += stride) {
    const PlaneRow first{tile * kWgRows / len, tile * kWgRows % len};
    std::uint32_t af[kKSteps][4];
    if constexpr (kSaved) {
      // y as the forward kept it (columns in quad order): each lane's pieces of a 32-column
      // group are 16 bytes
      const auto* saved = static_cast<const __half*>(p.saved_y);
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        const std::int64_t row = tile * kWgRows + r0 + g + 8 * h2;
#pragma unroll
        for (int m = 0; m < kC / 32; ++m) {
          const uint4 v = row < rows ? *reinterpret_cast<const uint4*>(saved + row * kC + 32 * m +
                                                                       8 * q)
                                     : make_uint4(0u, 0u, 0u, 0u);
          af[2 * m][h2] = v.x;
          af[2 * m][2 + h2] = v.y;
          af[2 * m + 1][h2] = v.z;
          af[2 * m + 1][2 + h2] = v.w;
        }
      }
    } else {
      cp_async_wait<0>();
      sync_warpgroup();  // this tile's x landed (every thread's copies)
      conv_norm_fragments<T, kC, kWgRows>(af, xs, r0, first, p, cw,
                                          {p.saved_mean.data, p.saved_mean.stride},
                                          {p.saved_rstd.data, p.saved_rstd.stride},
                                          [](int, int, float2) {});
      sync_warpgroup();  // every warp is done with xs
      if (tile + stride < tiles) copy_rows_tile<T, kC>(p.x, xs, tile + stride, p, t);
    }

    if constexpr (kSaved) {
      cp_async_wait<0>();
      sync_warpgroup();  // this tile's grad_out landed (every thread's copies)
    }

    // The thread's rows r0 + g + 8 h2 of the tile: y out, grad_out in (scaled per row).
    std::uint32_t ad[kKSteps][4];
    float unscale[2];  // residual_scale / the row's power of two
    float2 v[2][kKSteps][2];
    // what the row's float16 outputs are scaled by (dg_scale: of e GELU'(h), unscale included)
    float go_scale[2], g_scale[2], dg_scale[2];
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const std::int64_t row = tile * kWgRows + r0 + g + 8 * h2;
      const PlaneRow at = plane_row(first, r0 + g + 8 * h2, len);
      const bool live = at.n < p.n;
      float largest = 0.0f, y_square = 0.0f;
      const float* go = kSaved ? xs + (r0 + g + 8 * h2) * kLdX
                               : (live ? row_of<T>(p.grad_out, at.n, at.l) : nullptr);
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int c = 16 * ks + 8 * j + 2 * q;
          v[h2][ks][j] = live ? *reinterpret_cast<const float2*>(go + c) : make_float2(0.0f, 0.0f);
          largest = fmaxf(largest, fmaxf(fabsf(v[h2][ks][j].x), fabsf(v[h2][ks][j].y)));
          const float2 yv = unpack_half2(af[ks][2 * j + h2]);
          y_square = fmaf(yv.x, yv.x, fmaf(yv.y, yv.y, y_square));
        }
      }
      // y (unless it was read): the pieces of 32-column group m are
      // af[2 m + a / 2][2 (a % 2) + h2], a = 0 .. 3
      if constexpr (!kSaved) {
#pragma unroll
        for (int m = 0; m < kC / 32; ++m) {
          std::uint32_t piece[4];
#pragma unroll
          for (int a = 0; a < 4; ++a) piece[a] = af[2 * m + a / 2][2 * (a % 2) + h2];
          if (live) store_quad(out.y + row * kC + 32 * m, piece, q);
        }
      }
      largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, 1));
      largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, 2));
      // Biased exponents: of the largest value e, of the scale 268 - e (at most 227, 2^100);
      // NaN and infinity (e = 255) pass through as themselves.
      const int e = (__float_as_int(largest) >> 23) & 0xff;
      const int b = min(268 - e, 227);
      const float scale = __int_as_float(b << 23);
      unscale[h2] = p.residual_scale * __int_as_float((254 - b) << 23);
      float d_square = 0.0f;
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          ad[ks][2 * j + h2] = pack_half2(v[h2][ks][j].x * scale, v[h2][ks][j].y * scale);
          const float2 dv = unpack_half2(ad[ks][2 * j + h2]);
          d_square = fmaf(dv.x, dv.x, fmaf(dv.y, dv.y, d_square));
        }
      }
      for (int mask = 1; mask <= 2; mask *= 2) {
        y_square += __shfl_xor_sync(0xffffffffu, y_square, mask);
        d_square += __shfl_xor_sync(0xffffffffu, d_square, mask);
      }
      // The row's exponents (row_exponent): of grad_out, and of g and dg from their bounds.
      const int exps[3] = {
          row_exponent(largest), row_exponent(fmaxf(sqrtf(y_square) * w1_norm, 0.2f)),
          row_exponent(sqrtf(d_square) * w2_norm * fabsf(unscale[h2]) * 1.13f)};
      if (q == 0 && live) {
#pragma unroll
        for (int k = 0; k < 3; ++k) out.exps[k * out.exps_stride + row] = exps[k];
      }
      go_scale[h2] = power_of_two(exps[0]);
      g_scale[h2] = power_of_two(exps[1]);
      dg_scale[h2] = power_of_two(exps[2]) * unscale[h2];  // exact: times a power of two
#pragma unroll
      for (int m = 0; m < kC / 32; ++m) {
        std::uint32_t piece[4];
#pragma unroll
        for (int a = 0; a < 4; ++a) {
          const float2 x = v[h2][2 * m + a / 2][a % 2];
          piece[a] = pack_half2(x.x * go_scale[h2], x.y * go_scale[h2]);
        }
        if (live) store_quad(out.go + row * kC + 32 * m, piece, q);
      }
    }
    if constexpr (kSaved) {
      sync_warpgroup();  // every warp has read this tile's grad_out
      if (tile + stride < tiles) copy_rows_tile<T, kC>(p.grad_out, xs, tile + stride, p, t);
    }

    float sum_dy[2] = {0.0f, 0.0f}, sum_dy_y[2] = {0.0f, 0.0f};  // of rows g, g + 8
    for (int hc = 0; hc < hidden; hc += kWgHidden) {
      float acc_h[kWgHidden / 2], acc_e[kWgHidden / 2];  // [64, 64] of this hidden chunk
#pragma unroll
      for (int i = 0; i < kWgHidden / 2; ++i) acc_h[i] = acc_e[i] = 0.0f;
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        const std::uint32_t offset = (ks / 4) * w_block + hc * 128 + (ks % 4) * 32;
        wgmma_rs<__half, kWgHidden>(acc_h, af[ks], advance_descriptor(w1_desc, offset), ks > 0);
      }
      wgmma_commit();
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        const std::uint32_t offset = (ks / 4) * w_block + hc * 128 + (ks % 4) * 32;
        wgmma_rs<__half, kWgHidden>(acc_e, ad[ks], advance_descriptor(w2_desc, offset), ks > 0);
      }
      wgmma_commit();
      // Lane (g, q) of warp w holds rows 16 w + g (+ 8), columns 8 j + 2 q + {0, 1} of the
      // chunk in acc[4 j + 2 h2 + {0, 1}]. Per row half h2 and 32-column group m: g = GELU(h)
      // out, GELU'(h) into `grad`; then dg (from e and grad) out and the row's sums.
      const auto g_group = [&](int h2, int m, float (&grad)[8]) {
        std::uint32_t g_piece[4];
#pragma unroll
        for (int a = 0; a < 4; ++a) {
          const int i = 4 * (4 * m + a) + 2 * h2;
          const GeluAndGrad ga = gelu_tanh_and_grad_fast(acc_h[i]);
          const GeluAndGrad gb = gelu_tanh_and_grad_fast(acc_h[i + 1]);
          g_piece[a] = pack_half2(ga.value * g_scale[h2], gb.value * g_scale[h2]);
          grad[2 * a] = ga.grad;
          grad[2 * a + 1] = gb.grad;
        }
        const std::int64_t row = tile * kWgRows + r0 + g + 8 * h2;
        if (row < rows) store_quad(out.g + row * hidden + hc + 32 * m, g_piece, q);
      };
      const auto dg_group = [&](int h2, int m, const float (&grad)[8]) {
        std::uint32_t dg_piece[4];
#pragma unroll
        for (int a = 0; a < 4; ++a) {
          const int j = 4 * m + a, i = 4 * j + 2 * h2;
          // dg / unscale (the row's sums are unscaled once at the end)
          const float2 d = make_float2(acc_e[i] * grad[2 * a], acc_e[i + 1] * grad[2 * a + 1]);
          dg_piece[a] = pack_half2(d.x * dg_scale[h2], d.y * dg_scale[h2]);
          const float2 uj = *reinterpret_cast<const float2*>(u + hc + 8 * j + 2 * q);
          sum_dy[h2] += d.x * uj.x + d.y * uj.y;
          sum_dy_y[h2] += d.x * acc_h[i] + d.y * acc_h[i + 1];
        }
        const std::int64_t row = tile * kWgRows + r0 + g + 8 * h2;
        if (row < rows) store_quad(out.dg + row * hidden + hc + 32 * m, dg_piece, q);
      };
      if constexpr (kSaved) {
        // With y read rather than rebuilt there are registers for GELU' of the whole chunk:
        // GELU(h) runs while the tensor cores still compute e.
        wgmma_wait<1>();
        wgmma_fence_operands(acc_h);
        float grad[2][kWgHidden / 32][8];
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
#pragma unroll
          for (int m = 0; m < kWgHidden / 32; ++m) g_group(h2, m, grad[h2][m]);
        }
        // (the barrier keeps ptxas from moving the work above past the wait below)
        sync_warpgroup();
        wgmma_wait<0>();
        wgmma_fence_operands(acc_e);
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
#pragma unroll
          for (int m = 0; m < kWgHidden / 32; ++m) dg_group(h2, m, grad[h2][m]);
        }
      } else {
        wgmma_wait<0>();
        wgmma_fence_operands(acc_h);
        wgmma_fence_operands(acc_e);
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
#pragma unroll
          for (int m = 0; m < kWgHidden / 32; ++m) {
            float grad[8];
            g_group(h2, m, grad);
            dg_group(h2, m, grad);
          }
        }
      }
    }
    // The four lanes of a row hold its columns 2 q + 8 j: added in a fixed butterfly (every lane
    // ends with the same sum), written by lane q = 0.
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      for (int mask = 1; mask <= 2; mask *= 2) {
        sum_dy[h2] += __shfl_xor_sync(0xffffffffu, sum_dy[h2], mask);
        sum_dy_y[h2] += __shfl_xor_sync(0xffffffffu, sum_dy_y[h2], mask);
      }
      const std::int64_t row = tile * kWgRows + r0 + g + 8 * h2;
      if (q == 0 && row < rows) {
        *reinterpret_cast<float2*>(row_sums + 2 * row) =
            make_float2(sum_dy[h2] * unscale[h2], sum_dy_y[h2] * unscale[h2]);
      }
    }
  }
  cp_async_wait<0>();
}

// The weight gradients from the front kernel's float16 rows (FrontOut), and dy, on warpgroup MMAs
// (sm_90a):
//   part[b] = alpha sum over the rows r of block b's tiles of A[r, :]^T B[r, :]
// for A [rows, MA] and B [rows, NB] float16, whose row r was stored scaled by 2^ea[r] and 2^eb[r]
// (eb null: not scaled); sum_partials then adds the blocks' parts [grid][MA][NB] in a fixed
// order. Block b takes a contiguous range of 64-row tiles, brought in by cp.async through a ring
// of kStages stages (as many as fit beside W1: 3 with kDy, else 4), each stage A and B as blocks
// of 64 columns [64 rows][64] (128-byte swizzled), then the rows' exponents [2][64]. The products'
// k is the row: A^T comes through ldmatrix into register fragments, B is read by the tensor cores
// from shared memory (N-major). One accumulator serves every row: the A fragments of row r are
// multiplied by 2^(E - E_r) (E_r = ea[r] + eb[r], E the smallest of the block's: exact powers of
// two, at most 1; only a row below 2^-10 of the block's largest loses bits, and below 2^-24 it is
// left out), and the sums by 2^-E at the end. The two warpgroups split the [MA][NB] output by
// rows of MA where MA >= 128 (kMs blocks of 64 rows each, by all NB), else by columns (64 by
// NB / 2).
// With kDy (A = dg [rows, E C], B = y [rows, C]) it also writes dy = dg W1 [rows, C] of type D,
// each tile's rows from its stage (W1 in shared memory as float16, scaled by a power of two that
// brings its largest value into [2^14, 2^15)), by columns, 64 a warpgroup, on MMAs with both
// operands in shared memory (the tile's A rows K-major, W1 N-major), committed before the weight
// gradient's so that dy's epilogue runs while those are on the tensor cores. In float32 every row
// is unscaled by its own exponent; in float16 every 32-column segment of a row is scaled by a
// power of two that brings its largest value into [2^14, 2^15), its exponent into dy_exps
// [rows][NB / 32] (dy = stored 2^-dy_exps[r][c / 32]): half the bytes to write here and to read
// in the norm's backward, with the 11 significant bits the products' operands carry.
constexpr int kGradThreads = 256;
template <int NB>
constexpr int kDySegments = NB / 32;  // float16 dy: exponents a row
template <bool kDy>
constexpr int kGradStages = kDy ? 3 : 4;

// Bytes of a stage of weight_grad_kernel: 64 rows of both operands, and room to align them.
constexpr int grad_stage_bytes(int ma, int nb) { return kWgRows * (ma + nb) * 2 + 1024; }

#ifdef FUSEKIT_WGMMA  // the sm_90a kernel's tiling
template <int MA, int NB>
struct GradShape {
  static_assert(MA % 64 == 0 && NB % 64 == 0, "blocks of 64 columns");
  static constexpr bool kSplitM = MA >= 128;
  static constexpr int kMs = kSplitM ? MA / 128 : 1;     // blocks of 64 rows of MA a warpgroup
  static constexpr int kCols = kSplitM ? NB : NB / 2;     // columns of NB a warpgroup
  static constexpr int kChunk = kCols >= 128 ? 128 : 64;  // columns an MMA
  static constexpr int kChunks = kCols / kChunk;
  static_assert(kCols % kChunk == 0, "whole MMAs");
  static constexpr int kDyWgs = NB >= 128 ? 2 : 1;  // warpgroups on dy, 64 columns each
  static constexpr int kBlock = kWgRows * 128;      // bytes of 64 columns of a tile
  static constexpr int kStageBytes = grad_stage_bytes(MA, NB);
};
#endif

template <int MA, int NB, bool kDy>
constexpr std::size_t grad_smem_bytes() {
  // room to align to 1024 bytes, the stages, W1 as float16 (kDy)
  return 1024 + kGradStages<kDy> * grad_stage_bytes(MA, NB) + (kDy ? MA * NB * 2 : 0);
}

template <int MA, int NB, bool kDy, typename D>
__global__ void __launch_bounds__(kGradThreads, 1)
    weight_grad_kernel(const __half* a, const __half* b, const int* ea, const int* eb,
                       std::int64_t rows, float alpha, float* part, const float* w1,
                       const float* w1_largest, D* dy, int* dy_exps, const RowMeans row_means) {
#ifdef FUSEKIT_WGMMA
  using S = GradShape<MA, NB>;
  constexpr int kStages = kGradStages<kDy>;
  constexpr int kKSteps = kWgRows / 16;
  static_assert(kGradThreads == 2 * kWgThreads, "two warpgroups");
  static_assert(!kDy || NB == 64 * S::kDyWgs, "dy: 64 columns a warpgroup");
  extern __shared__ unsigned char grad_raw[];
  unsigned char* const stages = grad_raw + (1024 - shared_address(grad_raw) % 1024) % 1024;
  unsigned char* const w1s = stages + kStages * S::kStageBytes;  // kDy: [NB / 64][MA][64]
  const int t = threadIdx.x, warp = warp_uniform(t / kWarpSize), lane = t % kWarpSize;
  const int wg = warp / 4, wq = warp % 4;  // wq: the warp's place in its warpgroup
  const int g = lane / 4, q = lane % 4;
  const std::int64_t tiles = ceil_div(rows, static_cast<std::int64_t>(kWgRows));
  const std::int64_t per = tiles / gridDim.x, extra = tiles % gridDim.x;
  const std::int64_t t0 = blockIdx.x * per + min(static_cast<std::int64_t>(blockIdx.x), extra);
  const std::int64_t t1 = t0 + per + (blockIdx.x < extra ? 1 : 0);

  const auto load_tile = [&](std::int64_t tile, int stage) {
    unsigned char* as = stages + stage * S::kStageBytes;
    unsigned char* bs = as + kWgRows * MA * 2;
    auto* es = reinterpret_cast<int*>(bs + kWgRows * NB * 2);  // [2][64]: ea, eb of the rows
    const int live = static_cast<int>(min(rows - tile * kWgRows, std::int64_t{kWgRows}));
    // 16-byte pieces: thread t copies piece t % kPerRow of rows t / kPerRow + k kRowStep, a
    // multiple of 8 apart (so one swizzle phase: each copy is the first one's addresses plus
    // constants); rows past the end read as zeros
    const auto copy_rows = [&](const __half* src, unsigned char* dst, auto width) {
      constexpr int kWidth = decltype(width)::value, kPerRow = kWidth / 8;
      constexpr int kRowStep = kGradThreads / kPerRow;
      static_assert(kGradThreads % kPerRow == 0 && kRowStep % 8 == 0, "one swizzle phase");
      const int r = t / kPerRow, c = (t % kPerRow) * 8;
      const __half* from = src + (tile * kWgRows + r) * kWidth + c;
      unsigned char* to = dst + (c / 64) * S::kBlock + swizzled_offset(r, c % 64);
#pragma unroll
      for (int k = 0; k < kWgRows / kRowStep; ++k) {
        const bool valid = r + k * kRowStep < live;
        cp_async_16_or_zero(to + k * kRowStep * 128, valid ? from + k * kRowStep * kWidth : src,
                            valid);
      }
    };
    copy_rows(a, as, std::integral_constant<int, MA>{});
    copy_rows(b, bs, std::integral_constant<int, NB>{});
    if (t < 2 * kWgRows / 4) {  // 16-byte pieces of the exponents: rows past the end read 0
      const int* e = t < kWgRows / 4 ? ea : eb;
      const int r = 4 * (t % (kWgRows / 4));
      const std::int64_t row = tile * kWgRows + r;
      if (e == nullptr) {
        *reinterpret_cast<int4*>(es + (t / (kWgRows / 4)) * kWgRows + r) = make_int4(0, 0, 0, 0);
      } else if (row + 4 <= rows && (reinterpret_cast<std::uintptr_t>(e + row) % 16) == 0) {
        cp_async_16(es + (t / (kWgRows / 4)) * kWgRows + r, e + row);
      } else {
        for (int i = 0; i < 4; ++i) {
          es[(t / (kWgRows / 4)) * kWgRows + r + i] = row + i < rows ? e[row + i] : 0;
        }
      }
    }
  };
  allow_dependents();
  // dy's operand W1 [MA = E C][NB = C], and its exponent from its rows' largest magnitudes
  // (kRowLargest of backward_weights_kernel, two launches back): staged before the wait, under the
  // previous kernel's tail.
  int w_exp = 0;
  if constexpr (kDy) {
    __shared__ int largest;
    if (t == 0) largest = 0;
    __syncthreads();
    int most = 0;
    for (int j = t; j < MA; j += kGradThreads) most = max(most, __float_as_int(w1_largest[j]));
    atomicMax(&largest, most);
    __syncthreads();
    w_exp = row_exponent(__int_as_float(largest));
    // its rows (dy's k) in quad order, as dg's columns
    stage_swizzled(w1, MA, NB, w1s, power_of_two(w_exp), true);
  }

  wait_for_prerequisites();  // launched as a dependent of the kernel that wrote a and b
  for (int s = 0; s < kStages - 1; ++s) {
    if (t0 + s < t1) load_tile(t0 + s, s);
    cp_async_commit();
  }
  // The norm's means from the front kernel's row sums (for the norm's backward, four kernels
  // later), a warp an example while the first tiles arrive: a kernel of their own sat behind
  // the front kernel's tail.
  if (row_means.row_sums) {
    constexpr int kWarps = kGradThreads / kWarpSize;
    for (std::int64_t n = blockIdx.x * kWarps + t / kWarpSize; n < row_means.n_examples;
         n += static_cast<std::int64_t>(gridDim.x) * kWarps) {
      finalize_row_means(row_means, n, lane);
    }
  }

  // The smallest exponent of the block's rows (every warp finds the same).
  int e_min = std::numeric_limits<int>::max();
  const std::int64_t row_end = min(t1 * kWgRows, rows);
  for (std::int64_t i = t0 * kWgRows + lane; i < row_end; i += kWarpSize) {
    e_min = min(e_min, ea[i] + (eb ? eb[i] : 0));
  }
  for (int mask = 1; mask < kWarpSize; mask *= 2) {
    e_min = min(e_min, __shfl_xor_sync(0xffffffffu, e_min, mask));
  }

  const int m0 = S::kSplitM ? wg * (MA / 2) : 0, n0 = S::kSplitM ? 0 : wg * (NB / 2);
  float acc[S::kMs][S::kChunks][S::kChunk / 2];
#pragma unroll
  for (auto& m : acc) {
#pragma unroll
    for (auto& n : m) {
#pragma unroll
      for (float& v : n) v = 0.0f;
    }
  }
  // 2^(e_min - E_r) for rows r and r + 1 of a stage's exponents, as float16 (rows past the end,
  // whose values are zeros, take 1)
  const auto factors = [&](const int* es, int r) {
    const int2 e_a = *reinterpret_cast<const int2*>(es + r);  // r is even
    const int2 e_b = *reinterpret_cast<const int2*>(es + kWgRows + r);
    const int shift[2] = {min(e_min - (e_a.x + e_b.x), 0), min(e_min - (e_a.y + e_b.y), 0)};
    return __floats2half2_rn(shift[0] < -24 ? 0.0f : power_of_two(shift[0]),
                             shift[1] < -24 ? 0.0f : power_of_two(shift[1]));
  };
  const auto scale_pair = [](std::uint32_t& r, __half2 f) {
    const __half2 v = __hmul2(*reinterpret_cast<const __half2*>(&r), f);
    r = *reinterpret_cast<const std::uint32_t*>(&v);
  };
  for (std::int64_t tile = t0; tile < t1; ++tile) {
    const int stage = static_cast<int>((tile - t0) % kStages);
    cp_async_wait<kStages - 2>();
    fence_proxy_async_shared();  // the tensor cores read what cp.async (and W1's staging) wrote
    __syncthreads();  // the tile landed for every thread; the stage refilled below is free
    {
      const std::int64_t next = tile + kStages - 1;
      if (next < t1) load_tile(next, static_cast<int>((next - t0) % kStages));
      cp_async_commit();
    }
    const unsigned char* as = stages + stage * S::kStageBytes;
    const unsigned char* bs = as + kWgRows * MA * 2;
    const auto* es = reinterpret_cast<const int*>(bs + kWgRows * NB * 2);
    // A^T fragments of the warpgroup's rows of MA: registers 0 and 1 of a fragment hold rows
    // (k) 2 q and 2 q + 1 of the k step, 2 and 3 rows 2 q + 8 and 2 q + 9.
    std::uint32_t af[kKSteps][S::kMs][4];
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      const __half2 f_low = factors(es, 16 * ks + 2 * q), f_high = factors(es, 16 * ks + 2 * q + 8);
#pragma unroll
      for (int mb = 0; mb < S::kMs; ++mb) {
        const int k = 16 * ks + lane % 8 + 8 * (lane / 16);
        const int m = m0 + 64 * mb + 16 * wq + 8 * ((lane / 8) % 2);
        ldmatrix_x4_trans(af[ks][mb], as + (m / 64) * S::kBlock + swizzled_offset(k, m % 64));
        scale_pair(af[ks][mb][0], f_low);
        scale_pair(af[ks][mb][1], f_low);
        scale_pair(af[ks][mb][2], f_high);
        scale_pair(af[ks][mb][3], f_high);
      }
    }
    float dacc[32];  // kDy: the warpgroup's dy [64 rows][64 columns]
#pragma unroll
    for (float& v : dacc) v = 0.0f;
    wgmma_fence();
    if constexpr (kDy) {
      // (NB = 64: both warpgroups, warpgroup 1's copy unused, so that no branch serializes the
      // MMAs)
      const std::uint64_t a_desc = swizzled_descriptor(as);
      const std::uint64_t w_desc =
          mn_major_descriptor(w1s + (wg % S::kDyWgs) * MA * 128, MA * 128);
#pragma unroll
      for (int ks = 0; ks < MA / 16; ++ks) {
        wgmma_ss<__half, 64, true>(
            dacc, advance_descriptor(a_desc, (ks / 4) * S::kBlock + (ks % 4) * 32),
            advance_descriptor(w_desc, ks * 16 * 128), true);
      }
      wgmma_commit();
    }
#pragma unroll
    for (int ch = 0; ch < S::kChunks; ++ch) {
      const std::uint64_t b_desc =
          mn_major_descriptor(bs + ((n0 + ch * S::kChunk) / 64) * S::kBlock, S::kBlock);
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
#pragma unroll
        for (int mb = 0; mb < S::kMs; ++mb) {
          wgmma_rs<__half, S::kChunk, true>(acc[mb][ch], af[ks][mb],
                                            advance_descriptor(b_desc, ks * 16 * 128), true);
        }
      }
    }
    wgmma_commit();
    if constexpr (kDy) {
      wgmma_wait<1>();
      wgmma_fence_operands(dacc);
      // float32: each row unscaled by its exponent; float16: each 32-column segment of a row
      // scaled by its own power of two, with no exchange between warps
      if (wg < S::kDyWgs) {
        const int dn = 64 * wg;
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          const int r = 16 * wq + g + 8 * h2;
          const std::int64_t row = tile * kWgRows + r;
          if constexpr (std::is_same_v<D, float>) {
            if (row >= rows) continue;
            const int unscale = -(es[r] + w_exp);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              *reinterpret_cast<float2*>(dy + row * NB + dn + 8 * j + 2 * q) =
                  make_float2(ldexpf(dacc[4 * j + 2 * h2], unscale),
                              ldexpf(dacc[4 * j + 2 * h2 + 1], unscale));
            }
          } else {
#pragma unroll
            for (int s = 0; s < 2; ++s) {  // 32-column segments
              float most = 0.0f;
#pragma unroll
              for (int j = 4 * s; j < 4 * s + 4; ++j) {
                most = fmaxf(most, fmaxf(fabsf(dacc[4 * j + 2 * h2]),
                                         fabsf(dacc[4 * j + 2 * h2 + 1])));
              }
              most = fmaxf(most, __shfl_xor_sync(0xffffffffu, most, 1));
              most = fmaxf(most, __shfl_xor_sync(0xffffffffu, most, 2));
              const int e = row_exponent(most);
              const float scale = power_of_two(e);
              std::uint32_t piece[4];
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                const int j = 4 * s + i;
                piece[i] = pack_half2(dacc[4 * j + 2 * h2] * scale,
                                      dacc[4 * j + 2 * h2 + 1] * scale);
              }
              quad_transpose(piece, q);
              if (row >= rows) continue;
              store_quad(dy + row * NB + dn + 32 * s, piece, q);
              if (q == 0) dy_exps[row * kDySegments<NB> + dn / 32 + s] = es[r] + w_exp + e;
            }
          }
        }
      }
    }
    wgmma_wait<0>();  // before the next tile's barrier frees this stage
#pragma unroll
    for (auto& m : acc) {
#pragma unroll
      for (auto& n : m) wgmma_fence_operands(n);
    }
#pragma unroll
    for (auto& k : af) wgmma_fence_operands(k);
  }
  cp_async_wait<0>();
  // The warpgroup's piece, times alpha 2^-E (no tiles: zeros), its rows out of quad order, its
  // columns still in it (whole 32-byte sectors a quad; sum_partials takes them out).
  float* dst = part + static_cast<std::int64_t>(blockIdx.x) * MA * NB;
#pragma unroll
  for (int mb = 0; mb < S::kMs; ++mb) {
#pragma unroll
    for (int ch = 0; ch < S::kChunks; ++ch) {
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        const int m = quad_order(m0 + 64 * mb + 16 * wq + g + 8 * h2);
#pragma unroll
        for (int j = 0; j < S::kChunk / 8; ++j) {
          const float* v = acc[mb][ch] + 4 * j + 2 * h2;
          const float x0 = t0 < t1 ? alpha * ldexpf(v[0], -e_min) : 0.0f;
          const float x1 = t0 < t1 ? alpha * ldexpf(v[1], -e_min) : 0.0f;
          *reinterpret_cast<float2*>(dst + m * NB + n0 + ch * S::kChunk + 8 * j + 2 * q) =
              make_float2(x0, x1);
        }
      }
    }
  }
#else
  __trap();
#endif
}

// ------------------------------------------------------------------------------------ host

/// Pieces of one workspace, each 256-byte aligned (what cuBLASLt assumes of its operands).
class Carve {
 public:
  std::size_t take(std::size_t bytes) {
    const std::size_t offset = total_;
    total_ += (bytes + 255) / 256 * 256;
    return offset;
  }
  std::size_t total() const { return total_; }

 private:
  std::size_t total_ = 0;
};

std::size_t doubles(std::int64_t count) {
  return static_cast<std::size_t>(count) * sizeof(double);
}

template <typename U>
U* at(const StreamWorkspace& ws, std::size_t offset) {
  return reinterpret_cast<U*>(ws.as<unsigned char>() + offset);
}

std::size_t floats(std::int64_t count) {
  return static_cast<std::size_t>(count) * sizeof(float);
}

std::size_t ints(std::int64_t count) { return static_cast<std::size_t>(count) * sizeof(int); }

unsigned grid_for(std::int64_t units, int device) {
  const std::int64_t cap = static_cast<std::int64_t>(multiprocessor_count(device)) * 16;
  return static_cast<unsigned>(std::max<std::int64_t>(1, std::min(ceil_div(units, kThreads), cap)));
}

/// Whether [N, L, C] rows of `a` (element size `bytes`) can be read in 16-byte pieces.
bool rows_aligned(const CheriActivation& a, const CheriBlockParams& p, std::size_t bytes) {
  const auto piece = static_cast<std::int64_t>(16 / bytes);
  return p.c % piece == 0 && is_aligned(a.data, 16) && a.stride[0] % piece == 0 &&
         a.stride[1] % piece == 0;
}

struct PlaneGrid {
  std::int64_t rows;    // of L per block
  std::int64_t chunks;  // blocks per example
};

PlaneGrid plane_grid(const CheriBlockParams& p) {
  const std::int64_t rows = std::clamp<std::int64_t>(kBlockElements / p.c, 1, p.l);
  return {rows, ceil_div(p.l, rows)};
}

/// The blocks of the statistics pass (stage_bytes > 0: plane_stats_staged_kernel's, with that
/// much dynamic shared memory).
struct StatsGrid {
  std::int64_t rows;    // of L per block
  std::int64_t chunks;  // blocks per example
  std::size_t stage_bytes;
};

/// The statistics pass's blocks: larger than the other plane passes', so that each block's merge
/// of its threads' moments is paid over more values. Staged on sm_90 where x's rows are dense and
/// 16-byte aligned and a block's rows with their halo (d rows on each side, none for d >= L) fit
/// kStatsStageBytes: the whole plane when it fits, else equal blocks of at most capacity - 2 d
/// rows, where d is at most a quarter of the capacity (the halo read at most as often as the rows).
template <typename T>
StatsGrid stats_grid(const CheriBlockParams& p, int device) {
  const auto row_bytes = static_cast<std::int64_t>(p.c * sizeof(T));
  const std::int64_t capacity = static_cast<std::int64_t>(kStatsStageBytes) / row_bytes - 1;
  const std::int64_t halo = p.dilation < p.l ? p.dilation : 0;
  if (has_warpgroup_mma(device) && rows_aligned(p.x, p, sizeof(T)) && p.x.stride[1] == p.c &&
      capacity >= 1 && (p.l <= capacity || 4 * halo <= capacity)) {
    const std::int64_t chunks = p.l <= capacity ? 1 : ceil_div(p.l, capacity - 2 * halo);
    const std::int64_t rows = ceil_div(p.l, chunks);
    const std::int64_t staged = std::min(p.l, rows + 2 * halo);
    return {rows, chunks, static_cast<std::size_t>((staged + 1) * row_bytes)};  // and the zeros
  }
  const std::int64_t rows = std::clamp<std::int64_t>(kStatsElements / p.c, 1, p.l);
  return {rows, ceil_div(p.l, rows), 0};
}

/// Bytes of the partial moments the statistics pass writes.
template <typename T>
std::size_t stats_partial_bytes(const CheriBlockParams& p, int device) {
  return doubles(3 * p.n * stats_grid<T>(p, device).chunks);
}

void pack(const CheriMatrix& m, std::int64_t rows, std::int64_t cols, float* dst, int device,
          cudaStream_t stream) {
  pack_matrix_kernel<<<grid_for(rows * cols, device), kThreads, 0, stream>>>(m, rows, cols, dst);
  FUSEKIT_CUDA_CHECK_LAUNCH("pack_matrix_kernel");
}

/// `m` [rows, cols] as a dense row-major float32 matrix: `m` itself where it is one (16-byte
/// aligned), else packed into `dst`.
const float* dense_float32(const CheriMatrix& m, std::int64_t rows, std::int64_t cols, float* dst,
                           int device, cudaStream_t stream) {
  if (m.dtype == DType::Float32 && m.stride[1] == 1 && (m.stride[0] == cols || rows == 1) &&
      is_aligned(m.data, 16)) {
    return static_cast<const float*>(m.data);
  }
  pack(m, rows, cols, dst, device, stream);
  return dst;
}

/// One pass of sum_partials_kernel over part [count, width], ranges of `per` rows a block; with
/// part_b, over it too (into dst_b, cols_b) in the same launch.
template <typename In>
void sum_partials_pass(const In* part, std::int64_t count, std::int64_t width, std::int64_t per,
                       double* segments, const CheriMatrix& dst, std::int64_t cols, bool quad,
                       int device, cudaStream_t stream, const In* part_b = nullptr,
                       const CheriMatrix& dst_b = {}, std::int64_t cols_b = 0) {
  const auto launch = [&](auto kernel, int v) {
    const dim3 grid(static_cast<unsigned>(ceil_div(width, std::int64_t{kWarpSize} * v)),
                    static_cast<unsigned>(std::max<std::int64_t>(1, ceil_div(count, per))),
                    part_b ? 2 : 1);
    launch_dependent(kernel, grid, dim3(kWarpSize, kSumWarps), 0, device, stream, part, count,
                     width, per, segments, dst, cols, quad, part_b, dst_b, cols_b);
  };
  if (width % 4 == 0) {
    launch(sum_partials_kernel<In, 4>, 4);
  } else {
    launch(sum_partials_kernel<In, 1>, 1);
  }
}

/// Rows of part that sum_partials takes in one pass (32 a thread), and the ranges of its first
/// pass where there are more (16 a thread).
constexpr std::int64_t kSumOnePassRows = 32 * kSumWarps, kSumRangeRows = 16 * kSumWarps;

/// dst[j / cols, j % cols] = the sum over i of part[i, j] (part [count, width], 256-byte aligned),
/// in double and an order fixed by the shapes; with `quad`, part's columns are in quad order. Up
/// to kSumOnePassRows rows in one pass (256 rows: 32 a thread); more in two, the first over
/// ranges of kSumRangeRows rows (16 a thread), so that enough blocks run: the weight-gradient
/// kernels' parts are one a block of a few hundred, the convolution's one a block of thousands.
void sum_partials(const float* part, std::int64_t count, std::int64_t width,
                  const CheriMatrix& dst, std::int64_t cols, int device, cudaStream_t stream,
                  bool quad = false) {
  constexpr std::int64_t kMaxRanges = 65535;  // gridDim.y
  if (width == 0) return;
  if (count <= kSumOnePassRows) {
    sum_partials_pass(part, count, width, std::max<std::int64_t>(count, 1), nullptr, dst, cols,
                      quad, device, stream);
    return;
  }
  const std::int64_t per = std::max(kSumRangeRows, ceil_div(count, kMaxRanges));
  const std::int64_t ranges = ceil_div(count, per);
  const StreamWorkspace ws(doubles(ranges * width), stream);
  sum_partials_pass(part, count, width, per, ws.as<double>(), dst, cols, quad, device, stream);
  sum_partials_pass(ws.as<const double>(), ranges, width, ranges, nullptr, dst, cols, quad, device,
                    stream);
}

/// sum_partials of two parts of the same shape (dst_a and dst_b with cols_a and cols_b), in one
/// launch where each takes one pass.
void sum_partials_both(const float* part_a, const float* part_b, std::int64_t count,
                       std::int64_t width, const CheriMatrix& dst_a, std::int64_t cols_a,
                       const CheriMatrix& dst_b, std::int64_t cols_b, int device,
                       cudaStream_t stream, bool quad) {
  if (width == 0) return;
  if (count <= kSumOnePassRows) {
    sum_partials_pass(part_a, count, width, std::max<std::int64_t>(count, 1), nullptr, dst_a,
                      cols_a, quad, device, stream, part_b, dst_b, cols_b);
    return;
  }
  sum_partials(part_a, count, width, dst_a, cols_a, device, stream, quad);
  sum_partials(part_b, count, width, dst_b, cols_b, device, stream, quad);
}

/// Calls f(std::integral_constant<int, V>) with V = 16 bytes of T when `vector`, else 1.
template <typename T, typename F>
void with_vec(bool vector, F&& f) {
  if (vector) {
    f(std::integral_constant<int, kVec16<T>>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

/// The statistics of every example into mean_ws and rstd_ws [N] (and p.mean, p.rstd if set):
/// the plane pass, then the finalize as its programmatic dependent (see dependent_launch.cuh),
/// whose blocks let the next kernel start as soon as they run; a kernel launched after it in the
/// ordinary way waits for it whole.
template <typename T>
void plane_statistics(const CheriBlockParams& p, const float* conv_w, double* partial,
                      float* mean_ws, float* rstd_ws, int device, cudaStream_t stream) {
  const StatsGrid g = stats_grid<T>(p, device);
  const auto blocks = static_cast<unsigned>(p.n * g.chunks);
  if (g.stage_bytes > 0) {
    plane_stats_staged_kernel<T, kVec16<T>><<<blocks, kThreads, g.stage_bytes, stream>>>(
        p, conv_w, g.rows, g.chunks, partial);
    FUSEKIT_CUDA_CHECK_LAUNCH("plane_stats_staged_kernel");
  } else {
    with_vec<T>(rows_aligned(p.x, p, sizeof(T)), [&](auto v) {
      plane_stats_kernel<T, decltype(v)::value>
          <<<blocks, kThreads, 0, stream>>>(p, conv_w, g.rows, g.chunks, partial);
      FUSEKIT_CUDA_CHECK_LAUNCH("plane_stats_kernel");
    });
  }
  constexpr int kFinalizeThreads = 128;  // 4 examples a block
  launch_dependent(stats_finalize_kernel,
                   dim3(static_cast<unsigned>(ceil_div(p.n * kWarpSize, kFinalizeThreads))),
                   kFinalizeThreads, 0, device, stream, static_cast<const double*>(partial), p.n,
                   g.chunks, p.eps, mean_ws, rstd_ws, p.mean, p.rstd);
}

/// y into `y` of type O (x's dtype in the caller's layout, or a dense float32 buffer).
template <typename T, typename O>
void conv_norm_apply(const CheriBlockParams& p, const float* conv_w, const CheriStat& mean,
                     const CheriStat& rstd, const CheriActivation& y, int device,
                     cudaStream_t stream) {
  const bool vector = rows_aligned(p.x, p, sizeof(T)) && rows_aligned(y, p, sizeof(O)) &&
                      rows_aligned(y, p, sizeof(T));
  const PlaneGrid g = plane_grid(p);
  with_vec<T>(vector, [&](auto v) {
    constexpr int V = decltype(v)::value;
    conv_norm_apply_kernel<T, O, V><<<static_cast<unsigned>(p.n * g.chunks), kThreads, 0, stream>>>(
        p, conv_w, mean, rstd, y, g.rows, g.chunks);
    FUSEKIT_CUDA_CHECK_LAUNCH("conv_norm_apply_kernel");
  });
}

CheriActivation dense(float* data, const CheriBlockParams& p) {
  return {data, {p.l * p.c, p.c}};
}

/// Shared memory of conv_norm_backward_staged_kernel for the plane passes' blocks (plane_grid),
/// or 0 where that kernel does not apply: it needs dy in float32 (or, `scaled`, in float16 with
/// each 32-column segment of a row scaled by its own power of two), x and dy in dense 16-byte
/// aligned rows, sm_90, a halo of at most half a block's rows, and the block's rows with their
/// halo (d rows on each side for dy, 2 d for x) in at most kGxStageBytes: two blocks an SM, up to
/// d = 16 at C = 128 in float32 and d = 32 in half precision (faster than the plain pass at every
/// d measured, 4, 8 and 16; bench/NOTES.md).
constexpr std::size_t kGxStageBytes = 112 * 1024;

template <typename T, typename G>
std::size_t gx_stage_bytes(const CheriBlockParams& p, const CheriActivation& dy,
                           const PlaneGrid& g, bool vector, int device, bool scaled = false) {
  const bool dy_type =
      std::is_same_v<G, float> || (std::is_same_v<G, __half> && scaled && p.c % 32 == 0);
  if (!dy_type || !vector || !has_warpgroup_mma(device) ||
      p.x.stride[1] != p.c || dy.stride[1] != p.c || p.c / kVec16<T> > kThreads) {
    return 0;
  }
  const std::int64_t rows = g.rows, halo = p.dilation < p.l ? p.dilation : 0;
  if (2 * halo > rows) return 0;
  const std::int64_t x_rows = std::min(rows + 4 * halo, p.l);
  const std::int64_t dy_rows = std::min(rows + 2 * halo, p.l);
  // x, dy (then dconv) in float32, and the scaled dy's float16 rows and exponents
  const std::size_t stage =
      static_cast<std::size_t>(p.c) * (static_cast<std::size_t>(x_rows) * sizeof(T) +
                                       static_cast<std::size_t>(dy_rows) * sizeof(float)) +
      (scaled ? static_cast<std::size_t>(dy_rows * p.c) * sizeof(__half) +
                    static_cast<std::size_t>(dy_rows * (p.c / 32)) * sizeof(int)
              : 0);
  // the threads' weight-gradient sums reuse the stage
  const std::size_t sums = std::size_t{kThreads} * 3 * kVec16<T> * sizeof(float);
  return stage <= kGxStageBytes ? std::max(stage, sums) : 0;
}

template <typename T, typename G, bool kResidual>
void launch_gx_staged(const CheriBlockParams& p, const float* conv_w, const CheriActivation& dy,
                      const int* dy_exps, const float* means, const PlaneGrid& g,
                      std::size_t bytes, float* part, int device, cudaStream_t stream) {
  static std::atomic<bool> allowed[kMaxDevices];
  const auto kernel = conv_norm_backward_staged_kernel<T, G, kVec16<T>, kResidual>;
  allow_shared_memory(kernel, kGxStageBytes, device, allowed, true, [] {
    return concat(kOp, ": the staged backward of the convolution and norm");
  });
  launch_dependent(kernel, dim3(static_cast<unsigned>(p.n * g.chunks)), kThreads, bytes, device,
                   stream, p, conv_w, dy, dy_exps, means, g.rows, g.chunks, part);
}

/// Whether conv_norm_backward's rows can be read and written in 16-byte pieces.
template <typename T, typename G>
bool gx_vector(const CheriBlockParams& p, const CheriActivation& dy, bool residual) {
  return rows_aligned(p.x, p, sizeof(T)) && rows_aligned(p.grad_x, p, sizeof(T)) &&
         rows_aligned(dy, p, sizeof(G)) && rows_aligned(dy, p, sizeof(T)) &&
         (!residual || rows_aligned(p.grad_out, p, sizeof(T)));
}

/// The backward of the norm and the convolution: grad_x (plus grad_out when `residual`) and
/// grad_conv_weight, from grad_y of type G (x's dtype in the caller's layout, or dense float32).
/// `known_means`, where given, holds mean(dy) and mean(dy y) of every example already ([N, 2]).
/// With `dy_exps`, dy is dense float16 whose 32-column segments are scaled by
/// 2^dy_exps[n L + l][c / 32], which only the staged kernel takes (the caller checks
/// gx_stage_bytes with `scaled`).
template <typename T, typename G>
void conv_norm_backward(const CheriBlockParams& p, const float* conv_w, const CheriActivation& dy,
                        bool residual, int device, cudaStream_t stream,
                        const float* known_means = nullptr, const int* dy_exps = nullptr) {
  const PlaneGrid g = plane_grid(p);
  const bool vector = gx_vector<T, G>(p, dy, residual);
  const std::size_t staged = gx_stage_bytes<T, G>(p, dy, g, vector, device, dy_exps != nullptr);
  FUSEKIT_CHECK(dy_exps == nullptr || (staged && known_means), kOp,
                ": internal error: scaled float16 dy without the staged kernel");
  const std::int64_t blocks = p.n * g.chunks;
  Carve carve;
  const std::size_t o_sums = carve.take(floats(known_means ? 0 : 2 * blocks));
  const std::size_t o_means = carve.take(floats(known_means ? 0 : 2 * p.n));
  const std::size_t o_part = carve.take(floats(blocks * 3 * p.c));
  const StreamWorkspace ws(carve.total(), stream);
  float* sums = at<float>(ws, o_sums);
  const float* means = known_means ? known_means : at<float>(ws, o_means);
  float* part = at<float>(ws, o_part);
  // float16 dy with a float32 x is the scaled dy, which only the staged kernel reads
  constexpr bool kScaled = std::is_same_v<T, float> && std::is_same_v<G, __half>;
  constexpr bool kStageable = std::is_same_v<G, float> || kScaled;
  if (blocks > 0) {
    with_vec<T>(vector, [&](auto v) {
      [[maybe_unused]] constexpr int V = decltype(v)::value;
      if constexpr (!kScaled) {
        if (!known_means) {
          grad_sums_kernel<T, G, V><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
              p, conv_w, dy, g.rows, g.chunks, sums);
          FUSEKIT_CUDA_CHECK_LAUNCH("grad_sums_kernel");
          grad_sums_finalize_kernel<<<static_cast<unsigned>(ceil_div(p.n, 128)), 128, 0,
                                      stream>>>(sums, p.n, g.chunks,
                                                static_cast<double>(p.l * p.c),
                                                at<float>(ws, o_means));
          FUSEKIT_CUDA_CHECK_LAUNCH("grad_sums_finalize_kernel");
        }
      }
      if constexpr (kStageable) {
        if (staged) {
          if (residual) {
            launch_gx_staged<T, G, true>(p, conv_w, dy, dy_exps, means, g, staged, part, device,
                                         stream);
          } else {
            launch_gx_staged<T, G, false>(p, conv_w, dy, dy_exps, means, g, staged, part,
                                          device, stream);
          }
          return;
        }
      }
      if constexpr (!kScaled) {
        const auto launch = [&](auto kernel) {
          kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p, conv_w, dy, means,
                                                                         g.rows, g.chunks, part);
          FUSEKIT_CUDA_CHECK_LAUNCH("conv_norm_backward_kernel");
        };
        if (residual) {
          launch(conv_norm_backward_kernel<T, G, V, true>);
        } else {
          launch(conv_norm_backward_kernel<T, G, V, false>);
        }
      }
    });
  }
  sum_partials(part, blocks, 3 * p.c, p.grad_conv_weight, p.c, device, stream);
}

// ------------------------------------------------------------------------------------ cuBLASLt

/// A row-major operand: [rows, cols] as stored, or its transpose when `transposed`.
struct Operand {
  const float* data;
  std::int64_t ld;
  bool transposed;
  std::int64_t batch_stride = 0;
};

/// Row-major D [m, n] (ld ldd) = alpha A [m, k] B [k, n] (+ C), float32, `batch` times (strided).
struct Gemm {
  std::int64_t m, n, k;
  Operand a, b;
  float* d;
  std::int64_t ldd;
  std::int64_t d_stride = 0;
  int batch = 1;
  float alpha = 1.0f;
  const float* c = nullptr;  // the addend (beta = 1), row-major [m, n] with leading dimension ldc
  std::int64_t ldc = 0;
};

struct GemmKey {
  int device;
  bool tf32;
  std::int64_t m, n, k;
  bool a_transposed, b_transposed;
  std::int64_t lda, ldb, ldc, ldd;
  int batch;
  std::uint32_t align_a, align_b, align_c, align_d;
  auto operator<=>(const GemmKey&) const = default;
};

/// The descriptors of `g` (column-major: D^T [n, m] = B^T [n, k] A^T [k, m]; cuBLASLt's A is our
/// B and its B our A).
void describe(const Gemm& g, bool tf32, LtObjects& lt) {
  const cublasComputeType_t compute = tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  const auto u64 = [](std::int64_t v) { return static_cast<std::uint64_t>(v); };
  FUSEKIT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&lt.desc, compute, CUDA_R_32F));
  set_desc(lt.desc, CUBLASLT_MATMUL_DESC_TRANSA, g.b.transposed ? CUBLAS_OP_T : CUBLAS_OP_N);
  set_desc(lt.desc, CUBLASLT_MATMUL_DESC_TRANSB, g.a.transposed ? CUBLAS_OP_T : CUBLAS_OP_N);
  if (g.b.transposed) {
    FUSEKIT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lt.a, CUDA_R_32F, u64(g.k), u64(g.n), g.b.ld));
  } else {
    FUSEKIT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lt.a, CUDA_R_32F, u64(g.n), u64(g.k), g.b.ld));
  }
  if (g.a.transposed) {
    FUSEKIT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lt.b, CUDA_R_32F, u64(g.m), u64(g.k), g.a.ld));
  } else {
    FUSEKIT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lt.b, CUDA_R_32F, u64(g.k), u64(g.m), g.a.ld));
  }
  FUSEKIT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lt.d, CUDA_R_32F, u64(g.n), u64(g.m), g.ldd));
  if (g.c) {
    FUSEKIT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lt.c, CUDA_R_32F, u64(g.n), u64(g.m), g.ldc));
  }
  if (g.batch > 1) {
    const std::int32_t count = g.batch;
    for (auto [layout, stride] : {std::pair{lt.a, g.b.batch_stride},
                                  std::pair{lt.b, g.a.batch_stride}, std::pair{lt.d, g.d_stride}}) {
      set_layout(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, count);
      set_layout(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, stride);
    }
  }
}

/// The heuristic's first algorithm for `g` (asked once per shape, layout and alignment, then
/// remembered); none when cuBLASLt has no algorithm for it.
std::optional<cublasLtMatmulHeuristicResult_t> algorithm(const Gemm& g, bool tf32,
                                                         const LtObjects& lt, int device) {
  const std::uint32_t align_a = alignment_of(g.a.data), align_b = alignment_of(g.b.data),
                      align_c = alignment_of(g.c ? g.c : g.d), align_d = alignment_of(g.d);
  const GemmKey key{device,   tf32,     g.m,     g.n,     g.k,     g.a.transposed,
                    g.b.transposed,     g.a.ld,  g.b.ld,  g.c ? g.ldc : 0,
                    g.ldd,    g.batch,  align_a, align_b, align_c, align_d};
  static std::mutex mutex;
  static std::map<GemmKey, std::optional<cublasLtMatmulHeuristicResult_t>> cache;
  {
    const std::lock_guard lock(mutex);
    if (auto it = cache.find(key); it != cache.end()) return it->second;
  }
  cublasLtMatmulPreference_t pref = nullptr;
  FUSEKIT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>,
                        decltype(&cublasLtMatmulPreferenceDestroy)>
      owned(pref, &cublasLtMatmulPreferenceDestroy);
  const auto prefer = [&](cublasLtMatmulPreferenceAttributes_t attr, auto value) {
    FUSEKIT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)));
  };
  prefer(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, std::uint64_t{kMaxGemmWorkspace});
  // No split-K: its partial sums could be added in an order that varies between runs.
  prefer(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
         static_cast<std::uint32_t>(CUBLASLT_REDUCTION_SCHEME_NONE));
  // cuBLASLt's A is our B.
  prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_b);
  prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_a);
  prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c);
  prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d);
  cublasLtMatmulHeuristicResult_t chosen{};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      lt_handle(device), lt.desc, lt.a, lt.b, lt.c ? lt.c : lt.d, lt.d, pref, 1, &chosen, &found);
  // NOT_SUPPORTED: no algorithm for this combination (of alignments, say).
  if (status != CUBLAS_STATUS_NOT_SUPPORTED) FUSEKIT_CUBLAS_CHECK(status);
  std::optional<cublasLtMatmulHeuristicResult_t> result;
  if (status == CUBLAS_STATUS_SUCCESS && found > 0) result = chosen;
  const std::lock_guard lock(mutex);
  cache.emplace(key, result);
  return result;
}

/// Enqueues `g` and returns true, or returns false (nothing enqueued) when cuBLASLt has no
/// algorithm for it.
bool try_gemm(const Gemm& g, bool tf32, int device, cudaStream_t stream) {
  if (g.m == 0 || g.n == 0 || g.batch == 0) return true;
  LtObjects lt;
  describe(g, tf32, lt);
  const auto chosen = algorithm(g, tf32, lt, device);
  if (!chosen) return false;
  const StreamWorkspace ws(chosen->workspaceSize, stream);
  const float beta = g.c ? 1.0f : 0.0f;
  FUSEKIT_CUBLAS_CHECK(cublasLtMatmul(lt_handle(device), lt.desc, &g.alpha, g.b.data, lt.a,
                                      g.a.data, lt.b, &beta, g.c ? g.c : g.d, lt.c ? lt.c : lt.d,
                                      g.d, lt.d, &chosen->algo, ws.as<void>(),
                                      chosen->workspaceSize, stream));
  return true;
}

void gemm(const Gemm& g, bool tf32, int device, cudaStream_t stream) {
  FUSEKIT_CHECK(try_gemm(g, tf32, device, stream), kOp, ": cuBLASLt has no algorithm for the "
                "product [", g.m, ", ", g.k, "] x [", g.k, ", ", g.n, "] (batch ", g.batch, ")");
}

/// alpha times the sum over rows r of A[r, :]^T B[r, :] for A [M, ma] (leading dimension lda)
/// and dense B [M, nb]: one product per slice of kSliceRows rows into part [slices, ma, nb];
/// returns the number of slices.
std::int64_t slice_products(std::int64_t rows, std::int64_t ma, std::int64_t nb, const float* a,
                            std::int64_t lda, float alpha, const float* b, float* part, bool tf32,
                            int device, cudaStream_t stream) {
  const std::int64_t full = rows / kSliceRows, tail = rows % kSliceRows;
  if (full > 0) {
    gemm({.m = ma, .n = nb, .k = kSliceRows, .a = {a, lda, true, kSliceRows * lda},
          .b = {b, nb, false, kSliceRows * nb}, .d = part, .ldd = nb, .d_stride = ma * nb,
          .batch = static_cast<int>(full), .alpha = alpha},
         tf32, device, stream);
  }
  if (tail > 0) {
    gemm({.m = ma, .n = nb, .k = tail, .a = {a + full * kSliceRows * lda, lda, true},
          .b = {b + full * kSliceRows * nb, nb, false}, .d = part + full * ma * nb, .ldd = nb,
          .alpha = alpha},
         tf32, device, stream);
  }
  return full + (tail > 0 ? 1 : 0);
}

// ------------------------------------------------------------------------------------ passes

bool use_tf32(const CheriBlockParams& p) { return p.dtype == DType::Float32 && p.allow_tf32; }

/// The leading dimension of `a` read as a row-major float32 [N L, C] matrix (its rows one stride
/// apart), or 0 when it is not one.
template <typename T>
std::int64_t matrix_ld(const CheriActivation& a, const CheriBlockParams& p) {
  if constexpr (!std::is_same_v<T, float>) {
    return 0;
  } else {
    const std::int64_t ld = p.l > 1 ? a.stride[1] : p.n > 1 ? a.stride[0] : p.c;
    const bool uniform = p.n == 1 || p.l == 1 || a.stride[0] == p.l * a.stride[1];
    return uniform && ld >= p.c ? ld : 0;
  }
}

/// The block's forward through float32 buffers and cuBLASLt: out, and the statistics. For float32
/// x and out that are matrices, the second product adds x itself (out = residual_scale g W2^T + x).
template <typename T>
void block_forward(const CheriBlockParams& p, bool tf32, int device, cudaStream_t stream) {
  const std::int64_t rows = p.n * p.l, c = p.c, h = p.hidden;
  const PlaneGrid g = plane_grid(p);
  const std::int64_t ld_x = matrix_ld<T>(p.x, p), ld_out = matrix_ld<T>(p.out, p);
  Carve carve;
  const std::size_t o_conv = carve.take(floats(3 * c)), o_w1 = carve.take(floats(h * c)),
                    o_w2 = carve.take(floats(c * h)),
                    o_part = carve.take(stats_partial_bytes<T>(p, device)),
                    o_mean = carve.take(floats(p.n)), o_rstd = carve.take(floats(p.n)),
                    o_y = carve.take(floats(rows * c)), o_h = carve.take(floats(rows * h));
  const StreamWorkspace ws(carve.total(), stream);
  const float* conv_w = dense_float32(p.conv_weight, 3, c, at<float>(ws, o_conv), device, stream);
  const float* w1 = dense_float32(p.linear1, h, c, at<float>(ws, o_w1), device, stream);
  const float* w2 = dense_float32(p.linear2, c, h, at<float>(ws, o_w2), device, stream);
  float* mean = at<float>(ws, o_mean);
  float* rstd = at<float>(ws, o_rstd);
  float* y = at<float>(ws, o_y);
  float* hid = at<float>(ws, o_h);
  plane_statistics<T>(p, conv_w, at<double>(ws, o_part), mean, rstd, device, stream);
  conv_norm_apply<T, float>(p, conv_w, {mean, 1}, {rstd, 1}, dense(y, p), device, stream);
  gemm({.m = rows, .n = h, .k = c, .a = {y, c, false}, .b = {w1, c, true}, .d = hid, .ldd = h},
       tf32, device, stream);
  gelu_kernel<<<grid_for(ceil_div(rows * h, 4), device), kThreads, 0, stream>>>(hid, rows * h);
  FUSEKIT_CUDA_CHECK_LAUNCH("gelu_kernel");
  Gemm second{.m = rows, .n = c, .k = h, .a = {hid, h, false}, .b = {w2, h, true},
              .d = static_cast<float*>(p.out.data), .ldd = ld_out, .alpha = p.residual_scale,
              .c = static_cast<const float*>(p.x.data), .ldc = ld_x};
  if (ld_x && ld_out && try_gemm(second, tf32, device, stream)) return;
  float* mlp = y;  // y is no longer read
  gemm({.m = rows, .n = c, .k = h, .a = {hid, h, false}, .b = {w2, h, true}, .d = mlp, .ldd = c},
       tf32, device, stream);
  const bool vector = rows_aligned(p.x, p, sizeof(T)) && rows_aligned(p.out, p, sizeof(T));
  with_vec<T>(vector, [&](auto v) {
    constexpr int V = decltype(v)::value;
    residual_kernel<T, V><<<static_cast<unsigned>(p.n * g.chunks), kThreads, 0, stream>>>(
        p, mlp, g.rows, g.chunks);
    FUSEKIT_CUDA_CHECK_LAUNCH("residual_kernel");
  });
}

/// Whether a warpgroup-MMA kernel taking `smem_bytes` of shared memory can run this call (its
/// C and the alignment of its rows checked by the caller).
bool warpgroup_kernel_fits(const CheriBlockParams& p, int device, std::size_t smem_bytes) {
  return has_warpgroup_mma(device) && p.hidden % kWgHidden == 0 &&
         smem_bytes <= static_cast<std::size_t>(max_shared_memory_per_block(device));
}

/// Whether the warpgroup-MMA inference kernel for C = kC takes this call (and its rows are
/// aligned, which fused_fits checks).
template <typename T, int kC>
bool wgmma_fits(const CheriBlockParams& p, int device) {
  return warpgroup_kernel_fits(p, device, wgmma_smem_bytes<T, kC>(p.hidden));
}

/// Whether the warp-specialised inference kernel for C = kC takes this call (and its rows are
/// aligned, which fused_fits checks): E = 2, fewer than INT_MAX rows, on sm_90a. Where it runs it
/// measured faster than cheri_inference_wgmma_kernel for every dtype at C = 64 and 128 (H100,
/// 2026-11-22, bench/NOTES.md).
template <typename T, int kC>
bool ws_fits(const CheriBlockParams& p, int device) {
  constexpr std::int64_t kIntRows = std::numeric_limits<int>::max() - kWgRows;  // RowCursor
  return p.hidden == kWsHidden<kC> && p.n * p.l < kIntRows &&
         warpgroup_kernel_fits(p, device, ws_smem_bytes<T, kC>(p.hidden));
}

/// Whether a fused inference kernel for C = kC takes this call.
template <typename T, int kC>
bool fused_fits(const CheriBlockParams& p, int device) {
  if (p.c != kC || !rows_aligned(p.x, p, sizeof(T)) || !rows_aligned(p.out, p, sizeof(T))) {
    return false;
  }
  return wgmma_fits<T, kC>(p, device) ||
         (p.hidden % kFusedHiddenMultiple == 0 &&
          fused_smem_bytes<T, kC>(p.hidden) <=
              static_cast<std::size_t>(max_shared_memory_per_block(device)));
}

/// Which fused kernel took a call: none, the warp-specialised kernel (whose producer also writes
/// the training forward's saved rows, p.saved_y, where set) or another.
enum class Fused { kNone, kWarpSpecialised, kOther };

/// The statistics pass and the fused kernel; p.mean and p.rstd are written where set (the
/// training forward's). Returns the kernel that ran.
template <typename T, int kC>
Fused inference_fused(const CheriBlockParams& p, int device, cudaStream_t stream) {
  const std::int64_t c = p.c, h = p.hidden;
  Carve carve;
  const std::size_t o_conv = carve.take(floats(3 * c)), o_w1 = carve.take(floats(h * c)),
                    o_w2 = carve.take(floats(c * h)),
                    o_part = carve.take(stats_partial_bytes<T>(p, device)),
                    o_mean = carve.take(floats(p.n)), o_rstd = carve.take(floats(p.n));
  const StreamWorkspace ws(carve.total(), stream);
  const float* conv_w = dense_float32(p.conv_weight, 3, c, at<float>(ws, o_conv), device, stream);
  const float* w1 = dense_float32(p.linear1, h, c, at<float>(ws, o_w1), device, stream);
  const float* w2 = dense_float32(p.linear2, c, h, at<float>(ws, o_w2), device, stream);
  float* mean = at<float>(ws, o_mean);
  float* rstd = at<float>(ws, o_rstd);
  plane_statistics<T>(p, conv_w, at<double>(ws, o_part), mean, rstd, device, stream);
  // Each kernel may take all the shared memory a block can have (set once per device); the
  // sizes, which follow E C, were checked against it by fused_fits and wgmma_fits.
  const int max_smem = max_shared_memory_per_block(device);
  const std::int64_t rows = p.n * p.l, sms = multiprocessor_count(device);
  const auto describe = [&] { return concat(kOp, ": the fused inference kernel (C = ", c, ")"); };
  if (ws_fits<T, kC>(p, device)) {
    // the training forward's producer also writes the saved rows (float32 x only)
    const auto launch = [&](auto kernel, std::atomic<bool>(&allowed)[kMaxDevices]) {
      allow_shared_memory(kernel, max_smem, device, allowed, true, describe);
      const auto blocks =
          static_cast<unsigned>(std::min<std::int64_t>(ceil_div(rows, kWgRows), sms));
      launch_dependent(kernel, dim3(blocks), kWsThreads, ws_smem_bytes<T, kC>(h), device,
                       stream, p, conv_w, w1, w2, static_cast<const float*>(mean),
                       static_cast<const float*>(rstd));
      return Fused::kWarpSpecialised;
    };
    static std::atomic<bool> allowed[2][kMaxDevices];
    if constexpr (std::is_same_v<T, float>) {
      if (p.saved_y != nullptr) return launch(cheri_inference_ws_kernel<T, kC, true>, allowed[1]);
    }
    return launch(cheri_inference_ws_kernel<T, kC, false>, allowed[0]);
  }
  if (wgmma_fits<T, kC>(p, device)) {
    static std::atomic<bool> allowed[kMaxDevices];
    const auto kernel = cheri_inference_wgmma_kernel<T, kC>;
    allow_shared_memory(kernel, max_smem, device, allowed, true, describe);
    const auto blocks = static_cast<unsigned>(
        std::min<std::int64_t>(ceil_div(ceil_div(rows, kWgRows), 2), sms));
    kernel<<<blocks, kThreads, wgmma_smem_bytes<T, kC>(h), stream>>>(p, conv_w, w1, w2, mean,
                                                                      rstd);
    FUSEKIT_CUDA_CHECK_LAUNCH("cheri_inference_wgmma_kernel");
  } else {
    static std::atomic<bool> allowed[kMaxDevices];
    const auto kernel = cheri_inference_kernel<T, kC>;
    allow_shared_memory(kernel, max_smem, device, allowed, true, describe);
    const auto blocks = static_cast<unsigned>(std::min(ceil_div(rows, kRowTile), sms));
    kernel<<<blocks, kThreads, fused_smem_bytes<T, kC>(h), stream>>>(p, conv_w, w1, w2, mean,
                                                                     rstd);
    FUSEKIT_CUDA_CHECK_LAUNCH("cheri_inference_kernel");
  }
  return Fused::kOther;
}

/// Whether the backward's front kernel for C = kC takes this call: float32 with TF32 allowed,
/// rows of x and grad_out aligned, E = 2 (weight_grad_kernel's shapes), and the inference
/// kernel's conditions.
template <typename T, int kC>
bool front_fits(const CheriBlockParams& p, int device) {
  return std::is_same_v<T, float> && use_tf32(p) && p.c == kC && p.hidden == 2 * kC &&
         rows_aligned(p.x, p, sizeof(T)) && rows_aligned(p.grad_out, p, sizeof(T)) &&
         warpgroup_kernel_fits(p, device, front_smem_bytes<kC>(p.hidden));
}

/// The front kernel, its per-row sums of dy and dy y into row_sums [N L, 2] (their means come
/// from the first weight-gradient kernel: RowMeans).
template <int kC>
void backward_front(const CheriBlockParams& p, const float* conv_w, const float* w1,
                    const float* w2t, const float* weight_facts, const FrontOut& out,
                    float* row_sums, int device, cudaStream_t stream) {
  static std::atomic<bool> allowed[2][kMaxDevices];
  const bool saved = p.saved_y != nullptr;
  const auto kernel =
      saved ? cheri_backward_front_kernel<kC, true> : cheri_backward_front_kernel<kC, false>;
  allow_shared_memory(kernel, max_shared_memory_per_block(device), device, allowed[saved], true,
                      [&] { return concat(kOp, ": the backward's front kernel (C = ", kC, ")"); });
  const std::int64_t rows = p.n * p.l, sms = multiprocessor_count(device);
  const auto blocks =
      static_cast<unsigned>(std::min<std::int64_t>(ceil_div(ceil_div(rows, kWgRows), 2), sms));
  kernel<<<blocks, kThreads, front_smem_bytes<kC>(p.hidden), stream>>>(
      p, conv_w, w1, w2t, weight_facts, out, row_sums);
  FUSEKIT_CUDA_CHECK_LAUNCH("cheri_backward_front_kernel");
}

/// Whether the training forward keeps y for the backward's front kernel at C = kC: the front
/// kernel's conditions that the forward can see (front_fits less the rows' alignment, which
/// save_rows covers in the forward and the backward checks itself). It depends on the shapes,
/// dtype, options and device only, so that the saved rows' size is known before the call.
template <int kC>
bool keeps_rows(const CheriBlockParams& p, int device) {
  constexpr std::int64_t kIntRows = std::numeric_limits<int>::max() - kWgRows;  // RowCursor
  return use_tf32(p) && p.c == kC && p.hidden == 2 * kC && p.n * p.l < kIntRows &&
         warpgroup_kernel_fits(p, device, front_smem_bytes<kC>(p.hidden)) &&
         warpgroup_kernel_fits(p, device, ws_smem_bytes<float, kC>(p.hidden));
}

/// save_rows_kernel over the plane's rows.
void save_rows(const CheriBlockParams& p, int device, cudaStream_t stream) {
  const std::int64_t pieces = p.n * p.l * (p.c / 8);
  save_rows_kernel<<<grid_for(pieces, device), kThreads, 0, stream>>>(p);
  FUSEKIT_CUDA_CHECK_LAUNCH("save_rows_kernel");
}

/// The backward's weights as dense float32, in the workspace pieces at the given offsets where
/// they are not so already: the convolution's taps [3, C], linear1 [E C, C], and W2^T [E C, C]
/// (always packed: the front kernel's B operand, and for cuBLASLt a B read as the forward's
/// products read theirs, K contiguous; 299 against 381 us at N512 L1024 C128 on H100).
struct BackwardWeights {
  const float* conv_w;
  const float* w1;
  const float* w2t;
};

/// With `facts` ([kWeightRowFacts][E C], for the front path), W2^T is packed by
/// backward_weights_kernel, which writes the rows' facts in the same launch.
BackwardWeights backward_weights(const CheriBlockParams& p, const StreamWorkspace& ws,
                                 std::size_t o_conv, std::size_t o_w1, std::size_t o_w2,
                                 int device, cudaStream_t stream, float* facts = nullptr) {
  const std::int64_t c = p.c, h = p.hidden;
  const CheriMatrix w2_transposed{p.linear2.data, p.linear2.dtype,
                                  {p.linear2.stride[1], p.linear2.stride[0]}};
  const float* conv_w = dense_float32(p.conv_weight, 3, c, at<float>(ws, o_conv), device, stream);
  const float* w1 = dense_float32(p.linear1, h, c, at<float>(ws, o_w1), device, stream);
  float* w2t = at<float>(ws, o_w2);
  if (facts == nullptr) {
    pack(w2_transposed, h, c, w2t, device, stream);
  } else {
    const auto fact_blocks = static_cast<unsigned>(ceil_div(h, std::int64_t{kThreads / kWarpSize}));
    backward_weights_kernel<<<fact_blocks + grid_for(h * c, device), kThreads, 0, stream>>>(
        w1, w2_transposed, h, c, w2t, facts, fact_blocks);
    FUSEKIT_CUDA_CHECK_LAUNCH("backward_weights_kernel");
  }
  return {conv_w, w1, w2t};
}

/// weight_grad_kernel over the 64-row tiles of `rows` rows on `grid` blocks (each kernel's shared
/// memory allowed once per device).
template <int MA, int NB, bool kDy, typename D = float>
void weight_grad(unsigned grid, const __half* a, const __half* b, const int* ea, const int* eb,
                 std::int64_t rows, float alpha, float* part, const float* w1,
                 const float* w1_largest, D* dy, int* dy_exps, const RowMeans& row_means,
                 int device, cudaStream_t stream) {
  static std::atomic<bool> allowed[kMaxDevices];
  const auto kernel = weight_grad_kernel<MA, NB, kDy, D>;
  constexpr std::size_t kBytes = grad_smem_bytes<MA, NB, kDy>();
  allow_shared_memory(kernel, kBytes, device, allowed, false, [&] {
    return concat(kOp, ": the weight-gradient kernel (", MA, " x ", NB, ")");
  });
  launch_dependent(kernel, dim3(grid), kGradThreads, kBytes, device, stream, a, b, ea, eb, rows,
                   alpha, part, w1, w1_largest, dy, dy_exps, row_means);
}

/// The backward where the front kernel takes the call (front_fits): the front kernel's float16
/// intermediates, the weight gradients and dy from weight_grad_kernel (one block an SM, each a
/// range of tiles, their parts added in a fixed order), then the norm's and convolution's
/// backward. dy is float16, each 32-column segment of a row scaled by its own power of two,
/// where the staged kernel of that backward applies (gx_stage_bytes), else float32.
template <int kC>
void block_backward_front(const CheriBlockParams& p, int device, cudaStream_t stream) {
  constexpr std::int64_t kH = 2 * kC;
  const std::int64_t rows = p.n * p.l, tiles = ceil_div(rows, static_cast<std::int64_t>(kWgRows));
  const std::int64_t stride = tiles * kWgRows;  // of the three exponent arrays (FrontOut)
  const auto grid = static_cast<unsigned>(
      std::min<std::int64_t>(tiles, multiprocessor_count(device)));
  const auto halves = [](std::int64_t count) {
    return static_cast<std::size_t>(count) * sizeof(__half);
  };
  Carve carve;
  const std::size_t o_conv = carve.take(floats(3 * kC)), o_w1 = carve.take(floats(kH * kC)),
                    o_w2 = carve.take(floats(kC * kH)),
                    o_y = carve.take(p.saved_y != nullptr ? 0 : halves(rows * kC)),
                    o_go = carve.take(halves(rows * kC)), o_g = carve.take(halves(rows * kH)),
                    o_dg = carve.take(halves(rows * kH)),
                    o_exps = carve.take(ints(3 * stride)),
                    o_dy = carve.take(floats(rows * kC)),
                    o_dy_exps = carve.take(ints(rows * kC / 32)),
                    o_p1 = carve.take(floats(grid * kH * kC)),
                    o_p2 = carve.take(floats(grid * kC * kH)),
                    o_rows = carve.take(floats(2 * rows)), o_means = carve.take(floats(2 * p.n)),
                    o_facts = carve.take(floats(kWeightRowFacts * kH));
  const StreamWorkspace ws(carve.total(), stream);
  float* facts = at<float>(ws, o_facts);
  const auto [conv_w, w1, w2t] =
      backward_weights(p, ws, o_conv, o_w1, o_w2, device, stream, facts);
  const float* w1_largest = facts + kRowLargest * kH;
  // y: the forward's saved rows where it kept them, else the front kernel's
  __half* y = p.saved_y != nullptr ? static_cast<__half*>(p.saved_y) : at<__half>(ws, o_y);
  const FrontOut out{y, at<__half>(ws, o_go), at<__half>(ws, o_g), at<__half>(ws, o_dg),
                     at<int>(ws, o_exps), stride};
  float* part1 = at<float>(ws, o_p1);
  float* part2 = at<float>(ws, o_p2);
  float* means = at<float>(ws, o_means);
  const CheriActivation dy{at<void>(ws, o_dy), {p.l * p.c, p.c}};
  int* dy_exps = at<int>(ws, o_dy_exps);
  const bool scaled_dy =
      gx_stage_bytes<float, __half>(p, dy, plane_grid(p), gx_vector<float, __half>(p, dy, true),
                                    device, true) > 0;
  float* row_sums = at<float>(ws, o_rows);
  backward_front<kC>(p, conv_w, w1, w2t, facts, out, row_sums, device, stream);
  // grad W1 = dg^T y and dy = dg W1, and the norm's means; grad W2 = residual_scale grad_out^T g
  const RowMeans row_means{row_sums, p.n, p.l, static_cast<double>(p.l * p.c), means};
  if (scaled_dy) {
    weight_grad<kH, kC, true>(grid, out.dg, out.y, out.exps + 2 * stride, nullptr, rows, 1.0f,
                              part1, w1, w1_largest, static_cast<__half*>(dy.data), dy_exps,
                              row_means, device, stream);
  } else {
    weight_grad<kH, kC, true>(grid, out.dg, out.y, out.exps + 2 * stride, nullptr, rows, 1.0f,
                              part1, w1, w1_largest, static_cast<float*>(dy.data), nullptr,
                              row_means, device, stream);
  }
  weight_grad<kC, kH, false>(grid, out.go, out.g, out.exps, out.exps + stride, rows,
                             p.residual_scale, part2, nullptr, nullptr,
                             static_cast<float*>(nullptr), nullptr, RowMeans{}, device, stream);
  sum_partials_both(part2, part1, grid, kC * kH, p.grad_linear2, kH, p.grad_linear1, kC, device,
                    stream, true);
  if (scaled_dy) {
    conv_norm_backward<float, __half>(p, conv_w, dy, true, device, stream, means, dy_exps);
  } else {
    conv_norm_backward<float, float>(p, conv_w, dy, true, device, stream, means);
  }
}

/// The block's backward through float32 buffers and cuBLASLt. With dz = residual_scale grad_out
/// (grad_out read in place where it is a float32 matrix, residual_scale then the products' alpha):
/// h = y W1^T, g = GELU(h), dg = (dz W2) GELU'(h), grad W2 = dz^T g, grad W1 = dg^T y,
/// dy = dg W1, then the norm's and convolution's backward. y, g and dg, and the norm's mean(dy)
/// and mean(dy y), come from the front kernel where it applies (float32 with TF32 allowed, C of
/// 64 or 128, sm_90a).
template <typename T>
void block_backward(const CheriBlockParams& p, int device, cudaStream_t stream) {
  const bool tf32 = use_tf32(p);
  const std::int64_t rows = p.n * p.l, c = p.c, h = p.hidden;
  if (rows > 0 && front_fits<T, 128>(p, device)) {
    return block_backward_front<128>(p, device, stream);
  }
  if (rows > 0 && front_fits<T, 64>(p, device)) {
    return block_backward_front<64>(p, device, stream);
  }
  const std::int64_t slices = ceil_div(rows, kSliceRows);
  const std::int64_t ld_go = matrix_ld<T>(p.grad_out, p);
  Carve carve;
  const std::size_t o_conv = carve.take(floats(3 * c)), o_w1 = carve.take(floats(h * c)),
                    o_w2 = carve.take(floats(c * h)), o_y = carve.take(floats(rows * c)),
                    o_dz = carve.take(floats(ld_go ? 0 : rows * c)),
                    o_h = carve.take(floats(rows * h)), o_dg = carve.take(floats(rows * h)),
                    o_p1 = carve.take(floats(slices * h * c)),
                    o_p2 = carve.take(floats(slices * c * h));
  const StreamWorkspace ws(carve.total(), stream);
  const auto [conv_w, w1, w2t] = backward_weights(p, ws, o_conv, o_w1, o_w2, device, stream);
  float* y = at<float>(ws, o_y);
  float* hid = at<float>(ws, o_h);
  float* dg = at<float>(ws, o_dg);
  float* part1 = at<float>(ws, o_p1);
  float* part2 = at<float>(ws, o_p2);
  std::int64_t count1 = 0, count2 = 0;
  if (rows > 0) {
    conv_norm_apply<T, float>(p, conv_w, p.saved_mean, p.saved_rstd, dense(y, p), device, stream);
    const float* dz = static_cast<const float*>(p.grad_out.data);
    std::int64_t ld_dz = ld_go;
    if (!ld_go) {
      float* dense_dz = at<float>(ws, o_dz);
      const bool vector = rows_aligned(p.grad_out, p, sizeof(T));
      with_vec<T>(vector, [&](auto v) {
        constexpr int V = decltype(v)::value;
        const PlaneGrid g = plane_grid(p);
        to_dense_kernel<T, V><<<static_cast<unsigned>(p.n * g.chunks), kThreads, 0, stream>>>(
            p, p.grad_out, dense_dz, g.rows, g.chunks);
        FUSEKIT_CUDA_CHECK_LAUNCH("to_dense_kernel");
      });
      dz = dense_dz;
      ld_dz = c;
    }
    const float s = p.residual_scale;
    gemm({.m = rows, .n = h, .k = c, .a = {y, c, false}, .b = {w1, c, true}, .d = hid, .ldd = h},
         tf32, device, stream);  // h
    gemm({.m = rows, .n = h, .k = c, .a = {dz, ld_dz, false}, .b = {w2t, c, true}, .d = dg,
          .ldd = h, .alpha = s},
         tf32, device, stream);  // dz W2
    gelu_backward_kernel<<<grid_for(ceil_div(rows * h, 4), device), kThreads, 0, stream>>>(
        hid, dg, rows * h);
    FUSEKIT_CUDA_CHECK_LAUNCH("gelu_backward_kernel");
    count2 = slice_products(rows, c, h, dz, ld_dz, s, hid, part2, tf32, device, stream);
    count1 = slice_products(rows, h, c, dg, h, 1.0f, y, part1, tf32, device, stream);
    // dy into y's buffer: the last product that reads y is enqueued above.
    gemm({.m = rows, .n = c, .k = h, .a = {dg, h, false}, .b = {w1, c, false}, .d = y, .ldd = c},
         tf32, device, stream);
  }
  sum_partials(part2, count2, c * h, p.grad_linear2, h, device, stream);
  sum_partials(part1, count1, h * c, p.grad_linear1, c, device, stream);
  conv_norm_backward<T, float>(p, conv_w, dense(y, p), true, device, stream, nullptr);
}

/// Runs the statistics and a fused kernel when one takes the call; returns which one did.
template <typename T>
Fused try_fused(const CheriBlockParams& p, int device, cudaStream_t stream) {
  if (fused_fits<T, 128>(p, device)) return inference_fused<T, 128>(p, device, stream);
  if (fused_fits<T, 64>(p, device)) return inference_fused<T, 64>(p, device, stream);
  return Fused::kNone;
}

}  // namespace

void launch_dilated_conv_norm(const CheriBlockParams& p, int device, Stream stream) {
  const CudaDeviceGuard guard(device);
  const cudaStream_t s = stream_on("dilated_conv_norm", stream, device);
  dispatch_floating(p.dtype, kOp, [&](auto tag) {
    using T = typename CudaType<decltype(tag)::value>::type;
    Carve carve;
    const std::size_t o_conv = carve.take(floats(3 * p.c)),
                      o_part = carve.take(stats_partial_bytes<T>(p, device)),
                      o_mean = carve.take(floats(p.n)), o_rstd = carve.take(floats(p.n));
    const StreamWorkspace ws(carve.total(), s);
    float* conv_w = at<float>(ws, o_conv);
    float* mean = at<float>(ws, o_mean);
    float* rstd = at<float>(ws, o_rstd);
    pack(p.conv_weight, 3, p.c, conv_w, device, s);
    plane_statistics<T>(p, conv_w, at<double>(ws, o_part), mean, rstd, device, s);
    conv_norm_apply<T, T>(p, conv_w, {mean, 1}, {rstd, 1}, p.out, device, s);
  });
}

void launch_dilated_conv_norm_backward(const CheriBlockParams& p, int device, Stream stream) {
  const CudaDeviceGuard guard(device);
  const cudaStream_t s = stream_on("dilated_conv_norm_backward", stream, device);
  dispatch_floating(p.dtype, kOp, [&](auto tag) {
    using T = typename CudaType<decltype(tag)::value>::type;
    const StreamWorkspace ws(floats(3 * p.c), s);
    float* conv_w = ws.as<float>();
    pack(p.conv_weight, 3, p.c, conv_w, device, s);
    conv_norm_backward<T, T>(p, conv_w, p.grad_out, false, device, s);
  });
}

void launch_cheri_block(const CheriBlockParams& p, int device, Stream stream) {
  const CudaDeviceGuard guard(device);
  const cudaStream_t s = stream_on("cheri_block", stream, device);
  dispatch_floating(p.dtype, kOp, [&](auto tag) {
    using T = typename CudaType<decltype(tag)::value>::type;
    // With TF32 allowed, float32 takes the fused kernel where it applies: its float16 operands
    // keep TF32's 10 bits of mantissa.
    const Fused fused =
        std::is_same_v<T, float> && use_tf32(p) ? try_fused<T>(p, device, s) : Fused::kNone;
    if (fused == Fused::kNone) block_forward<T>(p, use_tf32(p), device, s);
    // The rows the backward's front kernel reads, where the warp-specialised kernel (whose
    // producer writes them as it builds its tiles) did not take the call.
    if (p.saved_y != nullptr && fused != Fused::kWarpSpecialised) save_rows(p, device, s);
  });
}

void launch_cheri_block_backward(const CheriBlockParams& p, int device, Stream stream) {
  const CudaDeviceGuard guard(device);
  const cudaStream_t s = stream_on("cheri_block_backward", stream, device);
  dispatch_floating(p.dtype, kOp, [&](auto tag) {
    using T = typename CudaType<decltype(tag)::value>::type;
    block_backward<T>(p, device, s);
  });
}

std::int64_t cheri_block_saved_bytes_cuda(const CheriBlockParams& p, int device) {
  const CudaDeviceGuard guard(device);
  return keeps_rows<128>(p, device) || keeps_rows<64>(p, device)
             ? p.n * p.l * p.c * static_cast<std::int64_t>(sizeof(__half))
             : 0;
}

void launch_cheri_block_inference(const CheriBlockParams& p, int device, Stream stream) {
  const CudaDeviceGuard guard(device);
  const cudaStream_t s = stream_on("cheri_block_inference", stream, device);
  dispatch_floating(p.dtype, kOp, [&](auto tag) {
    using T = typename CudaType<decltype(tag)::value>::type;
    if (try_fused<T>(p, device, s) == Fused::kNone) {
      // The training forward's path, without keeping the statistics; TF32 products for float32.
      CheriBlockParams q = p;
      q.mean = {};
      q.rstd = {};
      block_forward<T>(q, p.dtype == DType::Float32, device, s);
    }
  });
}

}  // namespace fusekit::detail
