// The CUDA backend of layernorm_linear_gelu: one kernel normalises the rows into a workspace in
// x's dtype (a warp per row, float32 statistics in two passes), then one cuBLASLt matrix product
// adds the bias and applies the tanh GELU in its epilogue, in float32, before the single rounding
// of the output. cuBLASLt has no erf GELU, and its tanh is a fast approximation (relative error
// near 2^-11, below half precision's rounding but not float32's), so the exact GELU and every
// GELU of the exact float32 path run as a pass over the output instead.
//
// At most 64 rows (decoding) the matrix product is a stream over the weights, which cuBLASLt's
// choices read more slowly than a kernel of fusekit's own (float16 and bfloat16, row-major
// weights, K a multiple of 8), with the bias and either GELU in its epilogue: the warpgroup
// product (sm_90a builds on compute capability 9.0, weights through the copy engine) or else the
// few-rows kernel (mma.sync, cp.async).
//
// The algorithm: cuBLASLt's heuristic proposes candidates for the shape, layout and alignments;
// the first call that is not being captured into a graph times them on the real operands (this
// synchronises the stream once) and keeps the fastest for the rest of the process.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common/cublaslt.h"
#include "common/cuda_check.h"
#include "common/cuda_math.cuh"
#include "common/cuda_mma.cuh"
#include "common/cuda_reduce.cuh"
#include "common/cuda_types.cuh"
#include "common/cuda_wgmma.cuh"
#include "common/dependent_launch.cuh"
#include "common/cuda_workspace.h"
#include "common/tensor_map.h"
#include "common/dispatch.h"
#include "ops/layernorm_linear_gelu/layernorm_linear_gelu_params.h"

namespace fusekit::detail {

namespace {

constexpr const char* kOp = "layernorm_linear_gelu";
constexpr int kRowsPerBlock = 8;  // one warp per row
constexpr std::size_t kMaxGemmWorkspace = std::size_t{32} << 20;

// ------------------------------------------------------------------------------------ LayerNorm

struct LayerNormArgs {
  std::int64_t m, k;
  const void* x;
  std::int64_t row_stride;  // -1: the row's offset comes from its leading-dims index
  int lead_ndim;
  std::int64_t lead_shape[kMaxDims], lead_stride[kMaxDims];
  std::int64_t k_stride;
  const void* ln_weight;
  std::int64_t ln_weight_stride;
  bool ln_weight_f32;
  const void* ln_bias;
  std::int64_t ln_bias_stride;
  bool ln_bias_f32;
  float eps;
  void* xn;        // [M, ld] in x's dtype
  std::int64_t ld; // a multiple of 16 bytes
};

template <typename T>
__device__ __forceinline__ float load_param(const void* p, bool is_f32, std::int64_t i,
                                            std::int64_t stride) {
  return is_f32 ? static_cast<const float*>(p)[i * stride]
                : to_float(static_cast<const T*>(p)[i * stride]);
}

// The code of these kernels is small on purpose (rolled loops, one copy of each step): the
// benchmarks run them after the weights or an L2 flush have swept their code out of the caches,
// and code then arrives from memory at about one cache line (8 instructions) per 200 cycles. The
// first version held the row in a warp's registers, fully unrolled: 2400 instructions, 40 us for
// 16 rows of 4096.

// The element offset of row `row` of x.
__device__ __forceinline__ std::int64_t row_offset(const LayerNormArgs& a, std::int64_t row) {
  if (a.row_stride >= 0) return row * a.row_stride;
  std::int64_t offset = 0;
  for (std::int64_t d = a.lead_ndim - 1, r = row; d >= 0; --d) {
    offset += (r % a.lead_shape[d]) * a.lead_stride[d];
    r /= a.lead_shape[d];
  }
  return offset;
}

// v * ln_weight[q] + ln_bias[q], either optional.
template <typename T>
__device__ __forceinline__ float affine(const LayerNormArgs& a, std::int64_t q, float v) {
  if (a.ln_weight) v *= load_param<T>(a.ln_weight, a.ln_weight_f32, q, a.ln_weight_stride);
  if (a.ln_bias) v += load_param<T>(a.ln_bias, a.ln_bias_f32, q, a.ln_bias_stride);
  return v;
}

// One block of 256 threads per row, held in registers: R 16-byte vectors a thread. For rows that
// are contiguous, 16-byte aligned and a multiple of 16 bytes long, at most R * 4 KB.
template <typename T, int R>
__global__ void __launch_bounds__(256) layernorm_row_block(LayerNormArgs a) {
  constexpr int V = kVec16<T>;
  __shared__ float scratch[8];
  allow_dependents();  // the few-rows product starts streaming its weights now
  const std::int64_t row = blockIdx.x;
  const T* x = static_cast<const T*>(a.x) + row_offset(a, row);
  T* dst = static_cast<T*>(a.xn) + row * a.ld;

  float v[R][V];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const std::int64_t q = (r * 256 + threadIdx.x) * V;
    if (q < a.k) load_vec<T, kVec16<T>>(x + q, v[r]);
  }
  // The sums run on x - x[0]: exact for values near x[0] (within a factor 2), and of the size of
  // the deviations, so a mean far from 0 costs no digits of the variance or of x - mean.
  const float shift = to_float(x[0]);
  float sum = 0.0f;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if ((r * 256 + threadIdx.x) * V < a.k) {
#pragma unroll
      for (int i = 0; i < V; ++i) sum += v[r][i] - shift;
    }
  }
  const float mean = block_sum<8>(sum, scratch) / static_cast<float>(a.k);  // of x - shift
  float sq = 0.0f;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if ((r * 256 + threadIdx.x) * V < a.k) {
#pragma unroll
      for (int i = 0; i < V; ++i) sq += (v[r][i] - shift - mean) * (v[r][i] - shift - mean);
    }
  }
  const float rstd = rsqrtf(block_sum<8>(sq, scratch) / static_cast<float>(a.k) + a.eps);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const std::int64_t q = (r * 256 + threadIdx.x) * V;
    if (q < a.k) {
#pragma unroll
      for (int i = 0; i < V; ++i) v[r][i] = (v[r][i] - shift - mean) * rstd;
      if (a.ln_weight || a.ln_bias) {
        for (int i = 0; i < V; ++i) v[r][i] = affine<T>(a, q + i, v[r][i]);
      }
      store_vec<T, V>(dst + q, v[r]);
    }
  }
}

// One warp per row, for every other row: read three times (sum, squared deviations, output),
// element by element where the row is strided or misaligned.
template <typename T>
__global__ void __launch_bounds__(kRowsPerBlock * 32) layernorm_rows(LayerNormArgs a) {
  constexpr int V = kVec16<T>;
  allow_dependents();
  const int lane = threadIdx.x & 31;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= a.m) return;
  const T* x = static_cast<const T*>(a.x) + row_offset(a, row);
  T* dst = static_cast<T*>(a.xn) + row * a.ld;
  // The 16-byte part of a contiguous, aligned row, then the rest element by element.
  const bool vec = a.k_stride == 1 && is_aligned(x, 16);
  const std::int64_t k_vec = vec ? a.k / V * V : 0;

  const float shift = to_float(x[0]);  // as in layernorm_row_block
  float sum = 0.0f;
#pragma unroll 4
  for (std::int64_t q = lane * V; q < k_vec; q += 32 * V) {
    float v[V];
    load_vec<T, kVec16<T>>(x + q, v);
#pragma unroll
    for (int i = 0; i < V; ++i) sum += v[i] - shift;
  }
#pragma unroll 1
  for (std::int64_t q = k_vec + lane; q < a.k; q += 32) sum += to_float(x[q * a.k_stride]) - shift;
  const float mean = warp_sum(sum) / static_cast<float>(a.k);  // of x - shift

  float sq = 0.0f;
#pragma unroll 1
  for (std::int64_t q = lane * V; q < k_vec; q += 32 * V) {
    float v[V];
    load_vec<T, kVec16<T>>(x + q, v);
#pragma unroll
    for (int i = 0; i < V; ++i) sq += (v[i] - shift - mean) * (v[i] - shift - mean);
  }
#pragma unroll 1
  for (std::int64_t q = k_vec + lane; q < a.k; q += 32) {
    const float d = to_float(x[q * a.k_stride]) - shift - mean;
    sq += d * d;
  }
  const float rstd = rsqrtf(warp_sum(sq) / static_cast<float>(a.k) + a.eps);

  auto normalise = [&](float v, std::int64_t q) { return affine<T>(a, q, (v - shift - mean) * rstd); };
#pragma unroll 1
  for (std::int64_t q = lane * V; q < k_vec; q += 32 * V) {
    float v[V];
    load_vec<T, kVec16<T>>(x + q, v);
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = normalise(v[i], q + i);
    store_vec<T, V>(dst + q, v);
  }
#pragma unroll 1
  for (std::int64_t q = k_vec + lane; q < a.k; q += 32) {
    dst[q] = from_float<T>(normalise(to_float(x[q * a.k_stride]), q));
  }
}

// ------------------------------------------------------------------------------------ GELU pass

// Written without 1 + tanh or 1 + erf, which cancel for negative v (at v = -4.6 a float32 tanh
// leaves 1 + tanh with 2.6% relative error): 0.5 v (1 + tanh u) = v / (1 + exp(-2 u)) and
// 0.5 v (1 + erf w) = 0.5 v erfc(-w), accurate to a few ulp for every v (as the CPU backend).
__device__ __forceinline__ float gelu(float v, bool tanh_form) {
  return tanh_form ? v / (1.0f + expf(-2.0f * 0.7978845608028654f * (v + 0.044715f * v * v * v)))
                   : 0.5f * v * erfcf(-v * 0.7071067811865476f);
}

template <typename T, GeluApproximation A>
__global__ void gelu_rows(T* out, std::int64_t m, std::int64_t n, std::int64_t ld) {
  const std::int64_t total = m * n;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    T* p = out + (i / n) * ld + i % n;
    *p = from_float<T>(gelu(to_float(*p), A == GeluApproximation::Tanh));
  }
}

// ------------------------------------------------------------------------------------ few rows
//
// out[M, Nout] = GELU(xn weight^T + bias) for M <= 64: each block owns kBN output columns (kBN / 16
// warps across them) and walks K in steps of kStepK. A step's weight rows (kBN x kStepK) and
// normalised rows (M x kStepK, zero-filled up to a multiple of 16) arrive by cp.async up to 11
// steps ahead, in rows whose 16-byte chunks are swizzled by the row so that ldmatrix is
// conflict-free. With kBN < 128 the eight warps split each step's k between 2 or 4 groups, whose
// sums are added at the end in a fixed order. The epilogue is a rolled loop over the block's
// outputs, so that its code (GELU included) is a few cache lines to fetch, not one copy per
// accumulator. Launched as a dependent of the LayerNorm kernel, a block puts its first weight
// steps in flight before the normalised rows exist.

constexpr int kFewRowsMax = 64;
constexpr int kFewWarps = 8;
// k per step: rows of 256 bytes. Against 128 (H100, M16 K4096 N16384, weights only): 61.0 us
// against 64.4 at 64 columns a block, 62.5 against 88.0 at 32.
constexpr int kFewStepK = 128;

// What fusekit's own products take (the warpgroup product reads xn and w through tensor maps).
struct ProductArgs {
  std::int64_t m, n, k;
  const void* xn;
  std::int64_t ld_xn;
  const void* w;  // [n, k], rows ld_w apart
  std::int64_t ld_w;
  const void* bias;  // [n] or null
  void* out;
  std::int64_t ld_out;
  bool tanh_gelu;
};

template <typename T, int kMTiles, int kWarpsN, int kStepK>
struct FewRows {
  static constexpr int kRowsA = 16 * kMTiles;
  static constexpr int kBN = 16 * kWarpsN;
  static constexpr int kGroupsK = kFewWarps / kWarpsN;
  static constexpr int kK16PerWarp = kStepK / 16 / kGroupsK;
  static constexpr int kStageElems = (kRowsA + kBN) * kStepK;
  static constexpr std::size_t kStageBytes = std::size_t{kStageElems} * sizeof(T);
  // As many steps in flight as 96 KB hold (at most 12): they hide the LayerNorm's latency too.
  static constexpr int kStages = std::min<int>(12, (std::size_t{96} << 10) / kStageBytes);
  static constexpr std::size_t kSharedBytes = kStages * kStageBytes;
  // The k groups' sums, [group][row][column] in float32, for the epilogue.
  static constexpr std::size_t kSumsBytes = std::size_t{kGroupsK} * kRowsA * kBN * sizeof(float);
  static_assert(kStepK / 16 % kGroupsK == 0 && kSumsBytes <= kSharedBytes && kStages >= 3);
};

// Element offset of 16-byte chunk `chunk` of row `row` in a swizzled tile of kStepK-element rows.
template <int kStepK>
__device__ __forceinline__ int swizzled(int row, int chunk) {
  return row * kStepK + ((chunk ^ (row & 7)) * 8);
}

// Step `step` of kRows rows (`ld` apart from `src`) into a swizzled tile, by cp.async. Chunks of
// rows past `rows` or past `k` are zero-filled, so they add nothing.
template <typename T, int kRows, int kStepK>
__device__ __forceinline__ void load_tile(T* dst, const T* src, std::int64_t ld, std::int64_t rows,
                                          int step, std::int64_t k) {
  constexpr int kChunks = kStepK / 8;  // 16-byte chunks of a row
  const std::int64_t k0 = std::int64_t{step} * kStepK;
#pragma unroll
  for (int i = threadIdx.x; i < kRows * kChunks; i += kFewWarps * 32) {
    const int row = i / kChunks, chunk = i % kChunks;
    const std::int64_t kc = k0 + chunk * 8;
    const bool valid = row < rows && kc < k;
    cp_async_16_or_zero(dst + swizzled<kStepK>(row, chunk), valid ? src + row * ld + kc : src, valid);
  }
}

template <typename T>
__device__ __forceinline__ void mma_half(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                         std::uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    mma_16816(c, a, b0, b1);
  } else {
    mma_16816_bf16(c, a, b0, b1);
  }
}

template <typename T, int kMTiles, int kWarpsN, int kStepK>
__global__ void __launch_bounds__(kFewWarps * 32) few_rows_gemm_gelu(ProductArgs a) {
  using C = FewRows<T, kMTiles, kWarpsN, kStepK>;
  extern __shared__ __align__(128) unsigned char shared_raw[];
  T* shared = reinterpret_cast<T*>(shared_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid / 32;
  const int wn = warp % kWarpsN, wk = warp / kWarpsN;
  const std::int64_t n0 = static_cast<std::int64_t>(blockIdx.x) * C::kBN;
  const int steps = static_cast<int>((a.k + kStepK - 1) / kStepK);
  const T* w = static_cast<const T*>(a.w);
  const T* xn = static_cast<const T*>(a.xn);

  const auto tile_a = [&](int step) { return shared + (step % C::kStages) * C::kStageElems; };
  const auto tile_b = [&](int step) { return tile_a(step) + C::kRowsA * kStepK; };
  const auto load_b = [&](int step) {
    load_tile<T, C::kBN, kStepK>(tile_b(step), w + n0 * a.ld_w, a.ld_w, a.n - n0, step, a.k);
  };
  const auto load_a = [&](int step) {
    load_tile<T, C::kRowsA, kStepK>(tile_a(step), xn, a.ld_xn, a.m, step, a.k);
  };

  // Weights first (one group per step), then the normalised rows once the LayerNorm is done.
  for (int step = 0; step < C::kStages - 1; ++step) {
    if (step < steps) load_b(step);
    cp_async_commit();
  }
  wait_for_prerequisites();
  for (int step = 0; step < C::kStages - 1 && step < steps; ++step) load_a(step);
  cp_async_commit();

  float acc[kMTiles][2][4] = {};
  const int q = lane / 8;  // which 8x8 matrix of an ldmatrix_x4 this lane addresses
  for (int step = 0; step < steps; ++step) {
    if (step == 0) {
      cp_async_wait<0>();
    } else {
      cp_async_wait<C::kStages - 2>();
    }
    __syncthreads();  // the step has landed, and every warp is done with the slot refilled next
    if (const int next = step + C::kStages - 1; next < steps) {
      load_b(next);
      load_a(next);
    }
    cp_async_commit();

    const T* ta = tile_a(step);
    const T* tb = tile_b(step);
#pragma unroll
    for (int j = 0; j < C::kK16PerWarp; ++j) {
      const int k16 = wk + j * C::kGroupsK;
      // Matrices: columns 0-7 then 8-15 of the warp's 16, each at k 0-7 and 8-15 of the k16.
      std::uint32_t b[4];
      ldmatrix_x4(b, tb + swizzled<kStepK>(wn * 16 + (q / 2) * 8 + lane % 8, 2 * k16 + q % 2));
#pragma unroll
      for (int t = 0; t < kMTiles; ++t) {
        std::uint32_t af[4];
        ldmatrix_x4(af, ta + swizzled<kStepK>(t * 16 + (q % 2) * 8 + lane % 8, 2 * k16 + q / 2));
        mma_half<T>(acc[t][0], af, b[0], b[1]);
        mma_half<T>(acc[t][1], af, b[2], b[3]);
      }
    }
  }

  cp_async_wait<0>();
  __syncthreads();  // the stages are free: every warp's sums go there
  float* sums = reinterpret_cast<float*>(shared_raw);
#pragma unroll
  for (int t = 0; t < kMTiles; ++t) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = t * 16 + lane / 4 + (e / 2) * 8;
        const int col = wn * 16 + j * 8 + 2 * (lane % 4) + e % 2;
        sums[(wk * C::kRowsA + row) * C::kBN + col] = acc[t][j][e];
      }
    }
  }
  __syncthreads();

  const T* bias = static_cast<const T*>(a.bias);
  T* out = static_cast<T*>(a.out);
  const int rows = static_cast<int>(a.m);
#pragma unroll 1
  for (int i = tid; i < rows * C::kBN; i += kFewWarps * 32) {
    const int row = i / C::kBN, col = i % C::kBN;
    const std::int64_t n = n0 + col;
    if (n >= a.n) continue;
    float v = sums[row * C::kBN + col];
#pragma unroll
    for (int group = 1; group < C::kGroupsK; ++group) v += sums[(group * C::kRowsA + row) * C::kBN + col];
    if (bias) v += to_float(bias[n]);
    out[row * a.ld_out + n] = from_float<T>(a.tanh_gelu ? gelu_tanh_exp2(v) : gelu(v, false));
  }
}

// What both of fusekit's own products need of the weight: row-major, every row 16-byte aligned
// (K and the row stride multiples of 8 elements).
bool weight_rows_aligned(const LayerNormLinearGeluParams& p) {
  return p.w_stride_k == 1 && p.k % 8 == 0 && p.w_stride_n % 8 == 0 && is_aligned(p.weight, 16);
}

// Whether the few-rows kernel takes a float16 or bfloat16 product (see the top of the file).
bool few_rows_fits(const LayerNormLinearGeluParams& p) {
  return p.m <= kFewRowsMax && weight_rows_aligned(p);
}

ProductArgs product_args(const LayerNormLinearGeluParams& p, const void* xn, std::int64_t ld_xn) {
  ProductArgs a{};
  a.m = p.m;
  a.n = p.nout;
  a.k = p.k;
  a.xn = xn;
  a.ld_xn = ld_xn;
  a.w = p.weight;
  a.ld_w = p.w_stride_n;
  a.bias = p.bias;
  a.out = p.out;
  a.ld_out = p.out_row_stride;
  a.tanh_gelu = p.approximate == GeluApproximation::Tanh;
  return a;
}

template <typename T, int kMTiles, int kWarpsN, int kStepK = kFewStepK>
void launch_few_rows(const ProductArgs& a, int device, cudaStream_t stream) {
  using C = FewRows<T, kMTiles, kWarpsN, kStepK>;
  const auto kernel = few_rows_gemm_gelu<T, kMTiles, kWarpsN, kStepK>;
  static std::atomic<bool> allowed[kMaxDevices];
  allow_shared_memory(kernel, C::kSharedBytes, device, allowed, false,
                      [] { return concat(kOp, ": the kernel for M <= ", C::kRowsA); });
  launch_dependent(kernel, dim3(static_cast<unsigned>(ceil_div(a.n, C::kBN))), kFewWarps * 32,
                   C::kSharedBytes, device, stream, a);
}

// 64 columns a block when that fills the device once, else 32.
template <typename T, int kMTiles>
void launch_few_rows_columns(const ProductArgs& a, int device, cudaStream_t stream) {
  if (ceil_div(a.n, std::int64_t{64}) >= multiprocessor_count(device)) {
    launch_few_rows<T, kMTiles, 4>(a, device, stream);
  } else {
    launch_few_rows<T, kMTiles, 2>(a, device, stream);
  }
}

template <typename T>
void few_rows_matmul(const LayerNormLinearGeluParams& p, const T* xn, std::int64_t ld_xn, int device,
                     cudaStream_t stream) {
  const ProductArgs a = product_args(p, xn, ld_xn);
  if (p.m <= 16) {
    launch_few_rows_columns<T, 1>(a, device, stream);
  } else if (p.m <= 32) {
    launch_few_rows_columns<T, 2>(a, device, stream);
  } else {
    launch_few_rows_columns<T, 4>(a, device, stream);
  }
}

// ------------------------------------------------------------------------------------ warpgroup product
//
// out[M, Nout] = GELU(xn weight^T + bias) on warpgroup MMAs (sm_90a), float16 and bfloat16 with a
// row-major weight. The product is computed transposed, out^T = weight xn^T: a block takes 128
// weight rows (output columns) as the MMA's M side, 64 for each of two warpgroups, and kBM
// normalised rows (16 to 128) as its N side, so that a few rows (decoding) cost no wasted tensor
// work and many rows make wide tiles. A producer warp streams both operands through the copy
// engine in steps of 64 or 128 k (boxes of the two tensor maps, 128-byte swizzled as the MMAs
// read them) into kStages slots, each completing on a "full" mbarrier; a warpgroup waits for a
// step, issues its m64nkBMk16 MMAs from shared memory, and once they are done hands the step's
// slot back on its "empty" mbarrier. With up to 64 rows and K a multiple of 64 the weight comes
// in boxes of 8 rows by 256 bytes (see WgProduct): the weight is then read once and its rate is
// the call's, and each box asks memory for a few contiguous runs rather than 128-byte pieces of
// 128 rows. Launched as a dependent of the LayerNorm kernel, the producer sends the first slots'
// weight boxes before the normalised rows exist and their row boxes after. The epilogue adds the
// bias and applies GELU in float32, and writes out through shared memory in 16-byte pieces of
// output rows.

constexpr int kWgRowsW = 128;   // weight rows (output columns) a block
constexpr int kWgThreads = 288; // two consumer warpgroups, then the producer warp
// Up to this many rows the warpgroup product runs where it fits; above, cuBLASLt's, which was as
// fast or faster from 512 rows on (H100, float16, K 1024, Nout 4096: 18.3 against 19.0 us at 512
// rows with the LayerNorm, 39.2 against 58.7 at 2048, 124 against 200 at 8192; at 16 and 64
// rows, K 4096, Nout 16384: 61.8 and 63.1 us against the few-rows kernel's 62.6 and 69.3).
constexpr std::int64_t kWgMaxRows = 64;

// kChunks = 0: a step is 64 k, its weight one box of 128 rows by 128 bytes. kChunks >= 1: a step
// is kChunks * 64 k, its weight 16 boxes of 8 rows by kChunks * 128 bytes (each box's rows
// contiguous runs of memory), which land as [chunk][8 rows][128 bytes], so that the 8-row atoms
// of one chunk are kChunks * 1024 bytes apart.
template <int kBM, int kChunks>
struct WgProduct {
  static constexpr int kStepChunks = kChunks == 0 ? 1 : kChunks;  // 64 k each
  static constexpr int kStepK = 64 * kStepChunks;
  static constexpr std::uint32_t kAtomStride = 1024 * kStepChunks;  // between 8-row atoms
  static constexpr std::size_t kTileW = std::size_t{kWgRowsW} * kStepK * 2;  // bytes of a step
  static_assert(kWgRowsW / 8 * kAtomStride == kTileW, "a step's weight is whole 8-row atoms");
  static constexpr std::size_t kTileX = std::size_t{kBM} * kStepK * 2;       // of each operand
  static constexpr std::size_t kStageBytes = kTileW + kTileX;
  static constexpr std::size_t kMaxShared = 227 * 1024;  // a block's opt-in limit on sm_90
  static constexpr int kStages =
      std::min<int>(16, (kMaxShared - 1024 - 2 * 16 * sizeof(std::uint64_t)) / kStageBytes);
  // 1024 bytes of slack to align the slots (the swizzle repeats every 1024 bytes), then the
  // slots and the barriers.
  static constexpr std::size_t kSharedBytes =
      1024 + kStages * kStageBytes + 2 * kStages * sizeof(std::uint64_t);
  // The epilogue stages a warpgroup's kBM x 64 pre-activations in float32 in the slots, rows
  // padded by 4 floats against bank conflicts.
  static constexpr int kOutPitch = 64 + 4;
  static_assert(kStages >= 2 && kSharedBytes <= kMaxShared && kStageBytes % 1024 == 0 &&
                std::size_t{2} * kBM * kOutPitch * sizeof(float) <= kStages * kStageBytes);
};

// The warpgroup product's last step: out[m0 + c, col .. col + 7] = GELU(staged + bias) for rows
// c = first, first + 16, ... of the block's kBM, `src` the thread's 8 columns of staged row 0: a
// warp writes 4 rows' 128-byte pieces a turn. A rolled loop, one per GELU, so that the code fetched
// is a few cache lines; each turn's 8 GELUs are independent, so that their latencies overlap. The
// tanh GELU is gelu_tanh_exp2's five instructions, where expf and an IEEE division take some
// thirty: code fetched from memory once per call (see above).
template <typename T, int kBM, int kPitch, bool kTanh>
__device__ __forceinline__ void store_gelu_rows(const ProductArgs& a, const float* src,
                                                std::int64_t m0, std::int64_t col, int first,
                                                const float (&bias)[8]) {
  const auto act = [](float v) { return kTanh ? gelu_tanh_exp2(v) : gelu(v, false); };
  T* const out = static_cast<T*>(a.out);
#pragma unroll 1
  for (int c = first; c < kBM && m0 + c < a.m; c += 16) {
    const float* const row = src + c * kPitch;
    T* const dst = out + (m0 + c) * a.ld_out + col;
    if (col + 8 <= a.n && is_aligned(dst, 16)) {
      const float4 lo = *reinterpret_cast<const float4*>(row);
      const float4 hi = *reinterpret_cast<const float4*>(row + 4);
      float g[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
      for (int e = 0; e < 8; ++e) g[e] = act(g[e] + bias[e]);
      store_vec<T, 8>(dst, g);
    } else {
      // a ragged edge: the bias read again rather than indexed at run time (which would put
      // the registers above in local memory)
      const T* const b = static_cast<const T*>(a.bias);
#pragma unroll 1
      for (int e = 0; e < 8 && col + e < a.n; ++e) {
        dst[e] = from_float<T>(act(row[e] + (b != nullptr ? to_float(b[col + e]) : 0.0f)));
      }
    }
  }
}

// The two consumer warpgroups of wg_product_gelu: the MMAs of every step, then the epilogue
// (instantiated only where the kernel's body is compiled, for sm_90a).
template <typename T, int kBM, int kChunks>
__device__ __forceinline__ void consume(const ProductArgs& a, unsigned char* slots, std::uint64_t* full,
                                       std::uint64_t* empty, std::int64_t n0, std::int64_t m0,
                                       int steps) {
  using C = WgProduct<kBM, kChunks>;
  const int warp = warp_uniform(threadIdx.x / 32), lane = threadIdx.x % 32;
  // A consumer warpgroup: weight rows 64 wg .. 64 wg + 63 of the block's.
  const int wg = warp / 4;
  const std::uint64_t desc_w =
      swizzled_descriptor(slots + wg * 8 * C::kAtomStride, C::kAtomStride);
  const std::uint64_t desc_x = swizzled_descriptor(slots + C::kTileW);
  // The epilogue gives a thread output columns 8 (lane % 8) .. + 7 of the warpgroup's 64: their
  // bias is loaded now, so that its latency passes under the products.
  const std::int64_t col = n0 + wg * 64 + 8 * (lane % 8);
  float bias[8] = {};
  if (a.bias != nullptr) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      if (col + e < a.n) bias[e] = to_float(static_cast<const T*>(a.bias)[col + e]);
    }
  }
  float acc[kBM / 2] = {};
  for (int step = 0; step < steps; ++step) {
    const int slot = step % C::kStages;
    mbarrier_wait(&full[slot], (step / C::kStages) & 1);
    wgmma_fence();
    const auto offset = static_cast<std::uint32_t>(slot * C::kStageBytes);
#pragma unroll
    for (int c = 0; c < C::kStepChunks; ++c) {
#pragma unroll
      for (int k16 = 0; k16 < 4; ++k16) {
        wgmma_ss<T, kBM>(acc, advance_descriptor(desc_w, offset + c * 1024 + k16 * 32),
                         advance_descriptor(desc_x, offset + c * kBM * 128 + k16 * 32),
                         step > 0 || c > 0 || k16 > 0);
      }
    }
    wgmma_commit();
    wgmma_wait<1>();  // the previous step's MMAs are done: its slot is free
    if (step > 0 && lane == 0) mbarrier_arrive(&empty[(step - 1) % C::kStages]);
  }
  wgmma_wait<0>();
  wgmma_fence_operands(acc);  // the epilogue's reads stay below the wait

  // Both warpgroups are done with the slots (every step arrived and was read): they stage the
  // output there. acc[4 j + e] is weight row r = 16 (warp % 4) + lane / 4 + 8 (e / 2) of the
  // warpgroup's 64 (an output column) and normalised row c = 8 j + 2 (lane % 4) + e % 2 (an
  // output row); the loop is unrolled, so that acc stays in registers.
  named_barrier_sync(1, 256);
  float* const staged = reinterpret_cast<float*>(slots) + wg * kBM * C::kOutPitch;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 16 * (warp % 4) + lane / 4 + 8 * h;
#pragma unroll
    for (int j = 0; j < kBM / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        staged[(8 * j + 2 * (lane % 4) + e) * C::kOutPitch + r] = acc[4 * j + 2 * h + e];
      }
    }
  }
  named_barrier_sync(2 + wg, 128);
  // Rows lane / 8 + 4 (warp % 4), + 16, ..., 8 columns a thread.
  const float* const src = staged + 8 * (lane % 8);
  const int first = lane / 8 + 4 * (warp % 4);
  if (a.tanh_gelu) {
    store_gelu_rows<T, kBM, C::kOutPitch, true>(a, src, m0, col, first, bias);
  } else {
    store_gelu_rows<T, kBM, C::kOutPitch, false>(a, src, m0, col, first, bias);
  }
}

template <typename T, int kBM, int kChunks>
__global__ void __launch_bounds__(kWgThreads, 1)
    wg_product_gelu(const __grid_constant__ CUtensorMap w_map,
                    const __grid_constant__ CUtensorMap x_map, const ProductArgs a) {
#ifdef FUSEKIT_WGMMA
  using C = WgProduct<kBM, kChunks>;
  extern __shared__ unsigned char shared_raw[];
  unsigned char* const slots = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<std::uintptr_t>(shared_raw) + 1023) & ~std::uintptr_t{1023});
  auto* const full = reinterpret_cast<std::uint64_t*>(slots + C::kStages * C::kStageBytes);
  auto* const empty = full + C::kStages;
  const int warp = warp_uniform(threadIdx.x / 32), lane = threadIdx.x % 32;
  const std::int64_t n0 = static_cast<std::int64_t>(blockIdx.x) * kWgRowsW;
  const std::int64_t m0 = static_cast<std::int64_t>(blockIdx.y) * kBM;
  const int steps = static_cast<int>((a.k + C::kStepK - 1) / C::kStepK);

  if (threadIdx.x == 256) {
    for (int s = 0; s < C::kStages; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], 8);  // one arrival per consumer warp
    }
    mbarrier_init_fence();
  }
  __syncthreads();

  if (warp < 8) {
    consume<T, kBM, kChunks>(a, slots, full, empty, n0, m0, steps);
  } else if (lane == 0) {  // the producer
    prefetch_tensor_map(&w_map);
    prefetch_tensor_map(&x_map);
    // With one block of rows (every M the automatic choice gives this product; a caller who
    // names it may pass more), each weight line is read once, by this block: evicted first, so
    // that streaming the weight does not push out of L2 the normalised rows that every block
    // reads, nor what the caller keeps there. Decoding (M 16, K 4096, Nout 16384) on H100:
    // 62.5 to 60.5 us in bench_peers.py.
    const std::uint64_t streamed =
        gridDim.y == 1 ? l2_evict_first_policy() : l2_evict_normal_policy();
    const auto load_w = [&](int step) {
      unsigned char* const dst = slots + (step % C::kStages) * C::kStageBytes;
      if constexpr (kChunks == 0) {
        tensor_copy_2d_to_shared(dst, &w_map, step * C::kStepK, static_cast<int>(n0),
                                 &full[step % C::kStages], streamed);
      } else {
        for (int g = 0; g < kWgRowsW / 8; ++g) {
          tensor_copy_4d_to_shared(dst + g * C::kAtomStride, &w_map, 0,
                                   static_cast<int>(n0) + 8 * g, step * kChunks, 0,
                                   &full[step % C::kStages], streamed);
        }
      }
    };
    const auto load_x = [&](int step) {
      unsigned char* const dst = slots + (step % C::kStages) * C::kStageBytes + C::kTileW;
      for (int c = 0; c < C::kStepChunks; ++c) {
        tensor_copy_2d_to_shared(dst + c * kBM * 128, &x_map, step * C::kStepK + 64 * c,
                                 static_cast<int>(m0), &full[step % C::kStages]);
      }
    };
    const int first = steps < C::kStages ? steps : C::kStages;
    for (int step = 0; step < first; ++step) {
      mbarrier_arrive_expect_bytes(&full[step], C::kStageBytes);
      load_w(step);
    }
    wait_for_prerequisites();  // the normalised rows are written
    for (int step = 0; step < first; ++step) load_x(step);
    for (int step = first; step < steps; ++step) {
      const int slot = step % C::kStages;
      mbarrier_wait(&empty[slot], (step / C::kStages - 1) & 1);
      mbarrier_arrive_expect_bytes(&full[slot], C::kStageBytes);
      load_w(step);
      load_x(step);
    }
  }
#else
  __trap();
#endif
}

// Whether the warpgroup product takes a float16 or bfloat16 product on `device`.
bool wg_product_fits(const LayerNormLinearGeluParams& p, int device) {
  // Tensor-map coordinates are ints; the grid's y extent (blocks of rows) is at most 65535.
  return has_warpgroup_mma(device) && weight_rows_aligned(p) &&
         p.nout <= std::numeric_limits<int>::max() && ceil_div(p.m, std::int64_t{128}) <= 65535;
}

template <typename T, int kBM, int kChunks>
void launch_wg_product(const LayerNormLinearGeluParams& p, const T* xn, std::int64_t ld_xn,
                       int device, cudaStream_t stream) {
  using C = WgProduct<kBM, kChunks>;
  const auto kernel = wg_product_gelu<T, kBM, kChunks>;
  static std::atomic<bool> allowed[kMaxDevices];
  allow_shared_memory(kernel, C::kSharedBytes, device, allowed, true,
                      [] { return concat(kOp, ": the warpgroup product of ", kBM, " rows a block"); });
  CUtensorMap w_map;
  if constexpr (kChunks == 0) {
    w_map = make_tensor_map_2d(kOp, p.dtype, p.weight, p.nout, p.k, p.w_stride_n, kWgRowsW);
  } else {
    // The weight as [K / 64][Nout][64]: 64-element chunks of a row, rows, chunks (K a multiple of
    // 64, so that no chunk runs into the next row).
    const std::int64_t dims[4] = {64, p.nout, p.k / 64, 1};
    const std::int64_t strides[3] = {p.w_stride_n, 64, p.k};
    const auto map = make_tensor_map_4d(kOp, p.dtype, p.weight, dims, strides, 8, kChunks);
    FUSEKIT_CHECK(map.has_value(), kOp, ": weight [", p.nout, ", ", p.k, "] with rows ",
                  p.w_stride_n, " elements apart: expected a layout the copy engine maps in ",
                  "boxes of 8 rows, the driver refused it");
    w_map = *map;
  }
  const CUtensorMap x_map = make_tensor_map_2d(kOp, p.dtype, xn, p.m, p.k, ld_xn, kBM);
  launch_dependent(kernel,
                   dim3(static_cast<unsigned>(ceil_div(p.nout, std::int64_t{kWgRowsW})),
                        static_cast<unsigned>(ceil_div(p.m, std::int64_t{kBM}))),
                   kWgThreads, C::kSharedBytes, device, stream, w_map, x_map,
                   product_args(p, xn, ld_xn));
}

// Weight boxes of 8 rows by 256 bytes where K is a multiple of 64 and the weight is streamed
// (float16, H100, K 4096 Nout 16384: M 16 57.3 against 60.0 us for boxes of 128 rows by 128
// bytes, 8 rows by 128 bytes 58.5, by 512 bytes 58.2; M 64 60.0 against 63.1), else the single
// box. Not at 128 rows a block, which only a caller naming this product gets: there its steps
// of 128 k leave three slots, and M 512 K 1024 Nout 4096 took 22.8 against 21.9 us.
template <typename T, int kBM>
void launch_wg_product_for_k(const LayerNormLinearGeluParams& p, const T* xn, std::int64_t ld_xn,
                             int device, cudaStream_t stream) {
  if constexpr (kBM <= 64) {
    if (p.k % 64 == 0) return launch_wg_product<T, kBM, 2>(p, xn, ld_xn, device, stream);
  }
  launch_wg_product<T, kBM, 0>(p, xn, ld_xn, device, stream);
}

// The narrowest tile of rows that holds M.
template <typename T>
void wg_product(const LayerNormLinearGeluParams& p, const T* xn, std::int64_t ld_xn, int device,
                cudaStream_t stream) {
  if (p.m <= 16) {
    launch_wg_product_for_k<T, 16>(p, xn, ld_xn, device, stream);
  } else if (p.m <= 32) {
    launch_wg_product_for_k<T, 32>(p, xn, ld_xn, device, stream);
  } else if (p.m <= 64) {
    launch_wg_product_for_k<T, 64>(p, xn, ld_xn, device, stream);
  } else {
    launch_wg_product_for_k<T, 128>(p, xn, ld_xn, device, stream);
  }
}

// ------------------------------------------------------------------------------------ cuBLASLt

cudaDataType_t cuda_data_type(DType dtype) {
  switch (dtype) {
    case DType::Float32: return CUDA_R_32F;
    case DType::Float16: return CUDA_R_16F;
    case DType::BFloat16: return CUDA_R_16BF;
    default: break;
  }
  throw Error(concat(kOp, ": no cuBLASLt type for dtype ", to_string(dtype)));
}

// Everything the heuristic's choice depends on.
using GemmKey = std::tuple<int, int, bool, std::int64_t, std::int64_t, std::int64_t, bool,
                           std::int64_t, std::int64_t, std::int64_t, std::uint32_t, std::uint32_t,
                           std::uint32_t, std::uint32_t, int>;

// Whether the matrix product applies GELU itself (see the top of the file).
bool gelu_in_epilogue(const LayerNormLinearGeluParams& p) {
  return p.approximate == GeluApproximation::Tanh && (p.dtype != DType::Float32 || p.allow_tf32);
}

constexpr int kCandidates = 16;  // algorithms asked of the heuristic, timed on first use

// Times each candidate a few times on `stream` and returns the index of the fastest.
int fastest(cublasLtHandle_t handle, const LtObjects& lt, const void* a, const void* b, void* d,
            const cublasLtMatmulHeuristicResult_t* results, int count, cudaStream_t stream) {
  std::size_t ws_bytes = 0;
  for (int i = 0; i < count; ++i) ws_bytes = std::max(ws_bytes, results[i].workspaceSize);
  const StreamWorkspace ws(ws_bytes, stream);
  struct Events {  // destroyed on every way out
    cudaEvent_t start = nullptr, stop = nullptr;
    ~Events() {
      if (start) cudaEventDestroy(start);
      if (stop) cudaEventDestroy(stop);
    }
  } ev;
  FUSEKIT_CUDA_CHECK(cudaEventCreate(&ev.start));
  FUSEKIT_CUDA_CHECK(cudaEventCreate(&ev.stop));
  const float alpha = 1.0f, beta = 0.0f;
  // Two rounds over all candidates, each candidate's best round counted: the first round also
  // brings the clocks up, which would otherwise favour whichever candidate runs last.
  constexpr int kRounds = 2, kRuns = 3;
  std::vector<float> ms(count, std::numeric_limits<float>::infinity());
  for (int round = 0; round < kRounds; ++round) {
    for (int i = 0; i < count; ++i) {
      auto run = [&] {
        return cublasLtMatmul(handle, lt.desc, &alpha, a, lt.a, b, lt.b, &beta, d, lt.d, d, lt.d,
                              &results[i].algo, ws.as<void>(), ws_bytes, stream);
      };
      if (run() != CUBLAS_STATUS_SUCCESS) continue;  // a candidate that cannot run is skipped
      FUSEKIT_CUDA_CHECK(cudaEventRecord(ev.start, stream));
      for (int r = 0; r < kRuns; ++r) FUSEKIT_CUBLAS_CHECK(run());
      FUSEKIT_CUDA_CHECK(cudaEventRecord(ev.stop, stream));
      FUSEKIT_CUDA_CHECK(cudaEventSynchronize(ev.stop));
      float t = 0;
      FUSEKIT_CUDA_CHECK(cudaEventElapsedTime(&t, ev.start, ev.stop));
      ms[i] = std::min(ms[i], t);
    }
  }
  // The heuristic's first choice stands unless another is clearly (3%) faster.
  int best = 0;
  for (int i = 1; i < count; ++i) {
    if (ms[i] < ms[best] * (best == 0 ? 0.97f : 1.0f)) best = i;
  }
  return best;
}

// out[M, Nout] = epilogue(xn[M, K] weight^T): in column-major terms D[Nout, M] = op(W) xn^T with
// W read as [K, Nout] (transposed) from a row-major weight, or as [Nout, K] from a transposed one.
void matmul(const LayerNormLinearGeluParams& p, const void* xn, std::int64_t ld_xn, int device,
            cudaStream_t stream) {
  const cudaDataType_t type = cuda_data_type(p.dtype);
  const bool tf32 = p.dtype == DType::Float32 && p.allow_tf32;
  const cublasComputeType_t compute = tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  const bool w_row_major = p.w_stride_k == 1;
  const cublasOperation_t trans_a = w_row_major ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t trans_b = CUBLAS_OP_N;
  const std::int64_t lda = w_row_major ? p.w_stride_n : p.w_stride_k;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  if (gelu_in_epilogue(p)) {
    epilogue = p.bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
  } else if (p.bias) {
    epilogue = CUBLASLT_EPILOGUE_BIAS;
  }

  LtObjects lt;
  FUSEKIT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&lt.desc, compute, CUDA_R_32F));
  set_desc(lt.desc, CUBLASLT_MATMUL_DESC_TRANSA, trans_a);
  set_desc(lt.desc, CUBLASLT_MATMUL_DESC_TRANSB, trans_b);
  set_desc(lt.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
  if (p.bias) set_desc(lt.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, p.bias);
  const auto u64 = [](std::int64_t v) { return static_cast<std::uint64_t>(v); };
  if (w_row_major) {
    FUSEKIT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lt.a, type, u64(p.k), u64(p.nout), lda));
  } else {
    FUSEKIT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lt.a, type, u64(p.nout), u64(p.k), lda));
  }
  FUSEKIT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lt.b, type, u64(p.k), u64(p.m), ld_xn));
  FUSEKIT_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&lt.d, type, u64(p.nout), u64(p.m), p.out_row_stride));

  const std::uint32_t align_a = alignment_of(p.weight), align_b = alignment_of(xn),
                      align_d = alignment_of(p.out),
                      align_bias = p.bias ? alignment_of(p.bias) : 256;
  const GemmKey key{device, static_cast<int>(p.dtype), tf32, p.m, p.nout, p.k, w_row_major,
                    lda, ld_xn, p.out_row_stride, align_a, align_b, align_d, align_bias,
                    static_cast<int>(epilogue)};
  const cublasLtHandle_t handle = lt_handle(device);
  static std::mutex mutex;
  static std::map<GemmKey, cublasLtMatmulHeuristicResult_t> cache;
  cublasLtMatmulHeuristicResult_t chosen{};
  bool cached = false;
  {
    const std::lock_guard lock(mutex);
    if (auto it = cache.find(key); it != cache.end()) {
      chosen = it->second;
      cached = true;
    }
  }
  if (!cached) {
    FUSEKIT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&lt.pref));
    const std::uint64_t max_ws = kMaxGemmWorkspace;
    FUSEKIT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        lt.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_ws, sizeof(max_ws)));
    const std::pair<cublasLtMatmulPreferenceAttributes_t, std::uint32_t> aligns[] = {
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_d},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d}};
    for (const auto& [attr, value] : aligns) {
      FUSEKIT_CUBLAS_CHECK(
          cublasLtMatmulPreferenceSetAttribute(lt.pref, attr, &value, sizeof(value)));
    }
    cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
    int found = 0;
    FUSEKIT_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, lt.desc, lt.a, lt.b, lt.d, lt.d,
                                                        lt.pref, kCandidates, results, &found));
    FUSEKIT_CHECK(found > 0, kOp, ": cuBLASLt has no algorithm for M = ", p.m, ", K = ", p.k,
                  ", Nout = ", p.nout, " in ", to_string(p.dtype), " with these alignments (",
                  "weight ", align_a, ", out ", align_d, " bytes)");
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    FUSEKIT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (capture != cudaStreamCaptureStatusNone) {
      chosen = results[0];  // the heuristic's first choice; not remembered, so a later call tunes
    } else {
      // With one candidate there is nothing to time, but the choice is still remembered, so
      // later calls skip the heuristic.
      chosen = found == 1 ? results[0]
                          : results[fastest(handle, lt, p.weight, xn, p.out, results, found, stream)];
      const std::lock_guard lock(mutex);
      cache.emplace(key, chosen);
    }
  }

  const StreamWorkspace ws(chosen.workspaceSize, stream);
  const float alpha = 1.0f, beta = 0.0f;
  FUSEKIT_CUBLAS_CHECK(cublasLtMatmul(handle, lt.desc, &alpha, p.weight, lt.a, xn, lt.b, &beta,
                                      p.out, lt.d, p.out, lt.d, &chosen.algo, ws.as<void>(),
                                      chosen.workspaceSize, stream));
}

using Product = LayerNormLinearGeluParams::Product;

// The matrix product that takes the call: the one named, where it fits, or the automatic choice.
template <typename T>
Product choose_product(const LayerNormLinearGeluParams& p, int device) {
  if constexpr (std::is_same_v<T, float>) {
    FUSEKIT_CHECK(p.product == Product::Auto || p.product == Product::Library, kOp,
                  ": fusekit's own products take float16 and bfloat16 only");
    return Product::Library;
  } else {
    const bool wg = wg_product_fits(p, device), few = few_rows_fits(p);
    switch (p.product) {
      case Product::Auto:
        return wg && p.m <= kWgMaxRows ? Product::Warpgroup
               : few                   ? Product::FewRows
                                       : Product::Library;
      case Product::Warpgroup:
        FUSEKIT_CHECK(wg, kOp, ": the warpgroup product was asked for, but it needs an sm_90a "
                      "build on a compute capability 9.0 device and a row-major, 16-byte aligned "
                      "weight with K a multiple of 8; device ", device,
                      has_warpgroup_mma(device) ? " runs warpgroup MMAs" : " does not run them",
                      ", K = ", p.k, ", weight strides (", p.w_stride_n, ", ", p.w_stride_k, ")",
                      is_aligned(p.weight, 16) ? "" : ", weight not 16-byte aligned");
        return Product::Warpgroup;
      case Product::FewRows:
        FUSEKIT_CHECK(few, kOp, ": the few-rows product was asked for, but it needs at most ",
                      kFewRowsMax, " rows and a row-major, 16-byte aligned weight with K a "
                      "multiple of 8; M = ", p.m, ", K = ", p.k, ", weight strides (",
                      p.w_stride_n, ", ", p.w_stride_k, ")",
                      is_aligned(p.weight, 16) ? "" : ", weight not 16-byte aligned");
        return Product::FewRows;
      case Product::Library:
        return Product::Library;
    }
    throw Error(concat(kOp, ": unknown product ", static_cast<int>(p.product)));
  }
}

template <typename T>
void run(const LayerNormLinearGeluParams& p, int device, cudaStream_t stream) {
  const Product product = choose_product<T>(p, device);
  const std::int64_t ld_xn = ceil_div(p.k, 8) * 8;  // rows 16-byte aligned (32 for float32)
  const StreamWorkspace xn_ws(static_cast<std::size_t>(p.m * ld_xn) * sizeof(T), stream);
  T* xn = xn_ws.as<T>();

  LayerNormArgs a{};
  a.m = p.m;
  a.k = p.k;
  a.x = p.x;
  a.row_stride = p.x_row_stride;
  a.lead_ndim = p.x_lead_ndim;
  for (int d = 0; d < p.x_lead_ndim; ++d) {
    a.lead_shape[d] = p.x_lead_shape[d];
    a.lead_stride[d] = p.x_lead_stride[d];
  }
  a.k_stride = p.x_k_stride;
  a.ln_weight = p.ln_weight;
  a.ln_weight_stride = p.ln_weight_stride;
  a.ln_weight_f32 = p.ln_weight_dtype == DType::Float32;
  a.ln_bias = p.ln_bias;
  a.ln_bias_stride = p.ln_bias_stride;
  a.ln_bias_f32 = p.ln_bias_dtype == DType::Float32;
  a.eps = p.eps;
  a.xn = xn;
  a.ld = ld_xn;
  // A block per row where the row is contiguous, every row 16-byte aligned, and it fits in
  // registers (at most 16 KB); a warp per row otherwise.
  constexpr int V = kVec16<T>;
  bool vec = p.x_k_stride == 1 && p.k % V == 0 && is_aligned(p.x, 16);
  for (int d = 0; d < p.x_lead_ndim; ++d) {
    vec = vec && (p.x_lead_shape[d] == 1 || p.x_lead_stride[d] % V == 0);
  }
  const std::int64_t per_thread = ceil_div(p.k, 256 * V);  // 16-byte vectors
  const auto rows = static_cast<unsigned>(p.m);
  if (vec && per_thread <= 1) {
    layernorm_row_block<T, 1><<<rows, 256, 0, stream>>>(a);
  } else if (vec && per_thread <= 2) {
    layernorm_row_block<T, 2><<<rows, 256, 0, stream>>>(a);
  } else if (vec && per_thread <= 4) {
    layernorm_row_block<T, 4><<<rows, 256, 0, stream>>>(a);
  } else {
    const auto blocks = static_cast<unsigned>(ceil_div(p.m, kRowsPerBlock));
    layernorm_rows<T><<<blocks, kRowsPerBlock * 32, 0, stream>>>(a);
  }
  FUSEKIT_CUDA_CHECK_LAUNCH("layernorm_rows");

  switch (product) {
    case Product::Warpgroup:
      if constexpr (!std::is_same_v<T, float>) wg_product<T>(p, xn, ld_xn, device, stream);
      return;
    case Product::FewRows:
      if constexpr (!std::is_same_v<T, float>) few_rows_matmul<T>(p, xn, ld_xn, device, stream);
      return;
    case Product::Library:
    case Product::Auto:  // never chosen
      break;
  }
  matmul(p, xn, ld_xn, device, stream);

  if (!gelu_in_epilogue(p)) {
    const std::int64_t total = p.m * p.nout;
    const auto grid = static_cast<unsigned>(
        std::min<std::int64_t>(ceil_div(total, 256), std::int64_t{multiprocessor_count(device)} * 8));
    auto* out = static_cast<T*>(p.out);
    if (p.approximate == GeluApproximation::Tanh) {
      gelu_rows<T, GeluApproximation::Tanh><<<grid, 256, 0, stream>>>(out, p.m, p.nout, p.out_row_stride);
    } else {
      gelu_rows<T, GeluApproximation::None><<<grid, 256, 0, stream>>>(out, p.m, p.nout, p.out_row_stride);
    }
    FUSEKIT_CUDA_CHECK_LAUNCH("gelu_rows");
  }
}

}  // namespace

void launch_layernorm_linear_gelu(const LayerNormLinearGeluParams& p, int device, Stream stream) {
  const CudaDeviceGuard guard(device);
  const cudaStream_t s = stream_on(kOp, stream, device);
  dispatch_floating(p.dtype, kOp, [&](auto tag) {
    run<typename CudaType<decltype(tag)::value>::type>(p, device, s);
  });
}

}  // namespace fusekit::detail
