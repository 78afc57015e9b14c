// The CUDA backend of causal_attention: one kernel in the FlashAttention style.
//
// A block takes kBlockM query rows of one (sequence, head), 16 rows per warp, and walks the keys
// from the sequence's first real token to its last row in tiles of kBlockN, double-buffered in
// shared memory by cp.async. Key tiles start at the padding count itself, so no padded K or V row
// is ever read, and the walk stops at the block's last row, so no tile lies wholly after the
// causal diagonal; rows past the end of the keys' range are filled with zeros. For each tile a
// warp computes its 16 x kBlockN scores on tensor cores, masks the keys after each row's
// diagonal, and updates its rows' online softmax: the running max m (in log2 units, the scale
// folded in), the running sum l and the output accumulator, rescaled by exp2(m_old - m_new) when
// the max rises. The probabilities stay in registers as the A operand of the product with V.
//
// Three ways to multiply, one per precision (the `Mma` policies below):
//   HalfMma   bfloat16 / float16 inputs: m16n8k16 MMAs, P rounded to the input type.
//   Tf32Mma   float32 with allow_tf32: m16n8k8 TF32 MMAs, operands rounded to TF32.
//   Tf32x3Mma float32: each operand split into a TF32 "big" part and a TF32 "small" remainder,
//             a b ~ a_big b_big + a_big b_small + a_small b_big: float32 accuracy (the dropped
//             term is ~2^-22 of the product) at tensor-core speed.
// Blocks are launched longest first (the last query tiles of every head), so that the short ones
// fill in behind them.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>

#include "common/cuda_check.h"
#include "common/cuda_mma.cuh"
#include "common/dispatch.h"
#include "fusekit/error.h"
#include "ops/causal_attention/causal_attention_params.h"

namespace fusekit::detail {

namespace {

constexpr const char* kOp = "causal_attention";
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kMaxDevices = 64;

struct Args {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;
  std::int64_t q_stride[3], k_stride[3], v_stride[3], out_stride[3], lse_stride[3];
  int hq, group, t, d;
  int padding_all;
  const std::int32_t* padding;  // or null: padding_all for every sequence
  std::int64_t padding_stride;
  float scale_log2;             // scale * log2(e): scores in log2 units
  int query_tiles;              // ceil(T / kBlockM)
  int heads;                    // B * Hq
  bool vector_loads;            // q, k, v rows may be copied in 16-byte pieces
  bool vector_stores;           // out may be written in pairs of elements
};

// ------------------------------------------------------------------------------- loading

// Copies rows [row0, row0 + kRows) of a matrix with row stride `stride` into shared memory rows
// of kStride elements: columns [0, d) from global memory, columns [d, kD) and every row outside
// [lo, hi) as zeros. Rows outside are never read. `vector` copies 16-byte pieces by cp.async
// (d, stride and src then hold whole pieces); else element by element.
template <typename Bits, int kRows, int kD, int kStride, int kThreads>
__device__ __forceinline__ void load_rows(Bits* smem, const Bits* src, std::int64_t stride,
                                          int row0, int lo, int hi, int d, bool vector) {
  constexpr int kPiece = 16 / static_cast<int>(sizeof(Bits));  // elements per 16 bytes
  constexpr int kPieces = kD / kPiece;                         // per row
  for (int i = threadIdx.x; i < kRows * kPieces; i += kThreads) {
    const int r = i / kPieces, c = (i % kPieces) * kPiece, row = row0 + r;
    Bits* dst = smem + r * kStride + c;
    const bool inside = row >= lo && row < hi;
    if (vector) {
      if (inside && c < d) {
        cp_async_16(dst, src + row * stride + c);
      } else {
        *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
      }
    } else {
#pragma unroll
      for (int e = 0; e < kPiece; ++e) dst[e] = inside && c + e < d ? src[row * stride + c + e] : 0;
    }
  }
}

// ------------------------------------------------------------------------ the MMA policies
// Each gives: the element type and its bit type, the shared-memory row padding, and
//   scores(s, sq, sk, qf, ...)   s[n][4] = the warp's 16 query rows . kBlockN keys (float32)
//   accumulate(o, s, sv)         o[n][4] += P V for the tile, P = s (already exponentiated)
// All fragments have the m16n8 accumulator layout (see common/cuda_mma.cuh).

template <typename T>
struct HalfMma {
  using Element = T;
  using Bits = std::uint16_t;
  static constexpr int kPad = 8;  // 16 bytes: the 8 rows of an ldmatrix hit distinct banks

  static __device__ __forceinline__ void mma(float (&c)[4], const std::uint32_t (&a)[4],
                                             std::uint32_t b0, std::uint32_t b1) {
    if constexpr (std::is_same_v<T, __half>) {
      mma_16816(c, a, b0, b1);
    } else {
      mma_16816_bf16(c, a, b0, b1);
    }
  }

  static __device__ __forceinline__ std::uint32_t pack(float lo, float hi) {
    if constexpr (std::is_same_v<T, __half>) {
      const __half2 h = __floats2half2_rn(lo, hi);
      return *reinterpret_cast<const std::uint32_t*>(&h);
    } else {
      const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
      return *reinterpret_cast<const std::uint32_t*>(&h);
    }
  }

  // The warp's query fragments, kept in registers for the whole walk.
  template <int kD>
  struct QueryFragments {
    std::uint32_t a[kD / 16][4];
  };

  template <int kD, int kStride>
  static __device__ __forceinline__ void load_queries(QueryFragments<kD>& qf, const Bits* sq,
                                                      int lane) {
    const Bits* row = sq + (lane & 15) * kStride + (lane >> 4) * 8;
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) ldmatrix_x4(qf.a[kk], row + kk * 16);
  }

  template <int kD, int kBlockN, int kStride>
  static __device__ __forceinline__ void scores(float (&s)[kBlockN / 8][4],
                                                const QueryFragments<kD>& qf, const Bits* sk,
                                                int lane) {
    // Matrices of ldmatrix_x4: keys 0-7 and 8-15 of a pair of 8-key tiles, d low and high.
    const Bits* row = sk + ((lane & 7) + ((lane >> 4) << 3)) * kStride + ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < kBlockN / 16; ++np) {
        std::uint32_t b[4];
        ldmatrix_x4(b, row + np * 16 * kStride + kk * 16);
        mma(s[2 * np], qf.a[kk], b[0], b[1]);
        mma(s[2 * np + 1], qf.a[kk], b[2], b[3]);
      }
    }
  }

  template <int kD, int kBlockN, int kStride>
  static __device__ __forceinline__ void accumulate(float (&o)[kD / 8][4],
                                                    const float (&p)[kBlockN / 8][4],
                                                    const Bits* sv, int lane) {
    // Transposed matrices: keys 0-7 and 8-15 of 16, d low then high.
    const Bits* row = sv + ((lane & 7) + ((lane >> 3) & 1) * 8) * kStride + (lane >> 4) * 8;
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const std::uint32_t a[4] = {pack(p[2 * kk][0], p[2 * kk][1]),
                                  pack(p[2 * kk][2], p[2 * kk][3]),
                                  pack(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                                  pack(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < kD / 16; ++dp) {
        std::uint32_t b[4];
        ldmatrix_x4_trans(b, row + kk * 16 * kStride + dp * 16);
        mma(o[2 * dp], a, b[0], b[1]);
        mma(o[2 * dp + 1], a, b[2], b[3]);
      }
    }
  }
};

// float32 on TF32 tensor cores; kSplit adds the small parts (Tf32x3), else one TF32 product.
template <bool kSplit>
struct Tf32Mma {
  using Element = float;
  using Bits = std::uint32_t;
  static constexpr int kPad = 4;  // row strides of 4 mod 32 words: conflict-free fragment loads

  struct Split {
    std::uint32_t big, small;
  };
  static __device__ __forceinline__ Split split(float x) {
    const std::uint32_t big = to_tf32(x);
    return {big, kSplit ? to_tf32(x - __uint_as_float(big)) : 0u};
  }

  // c += a b, in three products (small terms first) or one.
  static __device__ __forceinline__ void mma(float (&c)[4], const std::uint32_t (&a_big)[4],
                                             const std::uint32_t (&a_small)[4], Split b0,
                                             Split b1) {
    if constexpr (kSplit) {
      mma_1688_tf32(c, a_small, b0.big, b1.big);
      mma_1688_tf32(c, a_big, b0.small, b1.small);
    }
    mma_1688_tf32(c, a_big, b0.big, b1.big);
  }

  // Queries are read from shared memory at every tile (float32 fragments would take too many
  // registers to keep).
  template <int kD>
  struct QueryFragments {};

  template <int kD, int kStride>
  static __device__ __forceinline__ void load_queries(QueryFragments<kD>&, const Bits*, int) {}

  template <int kD, int kBlockN, int kStride>
  static __device__ __forceinline__ void scores(float (&s)[kBlockN / 8][4],
                                                const QueryFragments<kD>&, const Bits* sq,
                                                const Bits* sk, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll 2
    for (int kk = 0; kk < kD / 8; ++kk) {
      const Bits* q = sq + g * kStride + kk * 8 + t;
      std::uint32_t a_big[4], a_small[4];
      const float qa[4] = {__uint_as_float(q[0]), __uint_as_float(q[8 * kStride]),
                           __uint_as_float(q[4]), __uint_as_float(q[8 * kStride + 4])};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const Split x = split(qa[i]);
        a_big[i] = x.big;
        a_small[i] = x.small;
      }
#pragma unroll
      for (int n = 0; n < kBlockN / 8; ++n) {
        const Bits* k = sk + (n * 8 + g) * kStride + kk * 8 + t;
        mma(s[n], a_big, a_small, split(__uint_as_float(k[0])), split(__uint_as_float(k[4])));
      }
    }
  }

  // P's columns are the keys permuted within each 8-key tile: the accumulator holds keys 2t and
  // 2t + 1 where the A fragment wants t and t + 4, so the fragment takes them as they are and
  // V's rows are read in the same order (row t of B is key 2t, row t + 4 is key 2t + 1).
  template <int kD, int kBlockN, int kStride>
  static __device__ __forceinline__ void accumulate(float (&o)[kD / 8][4],
                                                    const float (&p)[kBlockN / 8][4],
                                                    const Bits* sv, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int kk = 0; kk < kBlockN / 8; ++kk) {
      std::uint32_t a_big[4], a_small[4];
      const float pa[4] = {p[kk][0], p[kk][2], p[kk][1], p[kk][3]};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const Split x = split(pa[i]);
        a_big[i] = x.big;
        a_small[i] = x.small;
      }
      const Bits* v = sv + (kk * 8 + 2 * t) * kStride + g;
#pragma unroll
      for (int n = 0; n < kD / 8; ++n) {
        mma(o[n], a_big, a_small, split(__uint_as_float(v[n * 8])),
            split(__uint_as_float(v[kStride + n * 8])));
      }
    }
  }
};

// The scores' call differs in whether queries come from registers or shared memory.
template <typename Mma, int kD, int kBlockN, int kStride>
__device__ __forceinline__ void tile_scores(float (&s)[kBlockN / 8][4],
                                            const typename Mma::template QueryFragments<kD>& qf,
                                            const typename Mma::Bits* sq,
                                            const typename Mma::Bits* sk, int lane) {
  if constexpr (std::is_same_v<typename Mma::Element, float>) {
    Mma::template scores<kD, kBlockN, kStride>(s, qf, sq, sk, lane);
  } else {
    Mma::template scores<kD, kBlockN, kStride>(s, qf, sk, lane);
  }
}

// --------------------------------------------------------------------------------- output

__device__ __forceinline__ void store_pair(float* dst, float a, float b, bool pair, bool second) {
  if (pair) {
    *reinterpret_cast<float2*>(dst) = make_float2(a, b);
  } else {
    dst[0] = a;
    if (second) dst[1] = b;
  }
}
__device__ __forceinline__ void store_pair(__half* dst, float a, float b, bool pair, bool second) {
  if (pair) {
    *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(a, b);
  } else {
    dst[0] = __float2half_rn(a);
    if (second) dst[1] = __float2half_rn(b);
  }
}
__device__ __forceinline__ void store_pair(__nv_bfloat16* dst, float a, float b, bool pair,
                                           bool second) {
  if (pair) {
    *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(a, b);
  } else {
    dst[0] = __float2bfloat16_rn(a);
    if (second) dst[1] = __float2bfloat16_rn(b);
  }
}

// ---------------------------------------------------------------------------------- kernel

template <typename Mma, int kD, int kBlockM, int kBlockN>
struct Tiles {
  static constexpr int kWarps = kBlockM / 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStride = kD + Mma::kPad;  // elements per shared-memory row
  static constexpr int kQuery = kBlockM * kStride;
  static constexpr int kKeys = kBlockN * kStride;  // one K or V stage
  // 128-row tiles of up to 64 columns: two blocks per SM (128 registers a thread).
  static constexpr int kMinBlocks = kD <= 64 && kWarps == 8 ? 2 : 1;
  static constexpr std::size_t kSharedBytes =
      sizeof(typename Mma::Bits) * static_cast<std::size_t>(kQuery + 4 * kKeys);
};

template <typename Mma, int kD, int kBlockM, int kBlockN>
__global__ void __launch_bounds__(Tiles<Mma, kD, kBlockM, kBlockN>::kThreads,
                                  Tiles<Mma, kD, kBlockM, kBlockN>::kMinBlocks)
    attention_kernel(const Args a) {
  using Tile = Tiles<Mma, kD, kBlockM, kBlockN>;
  using T = typename Mma::Element;
  using Bits = typename Mma::Bits;
  constexpr int kStride = Tile::kStride, kThreads = Tile::kThreads;
  static_assert(kD % 16 == 0 && kBlockN % 16 == 0 && kBlockM % 16 == 0);

  extern __shared__ uint4 shared[];
  Bits* sq = reinterpret_cast<Bits*>(shared);  // [kBlockM][kStride]
  Bits* sk = sq + Tile::kQuery;                // [2][kBlockN][kStride]
  Bits* sv = sk + 2 * Tile::kKeys;             // [2][kBlockN][kStride]

  // Longest first: the block index runs over (query tile from the last, sequence and head).
  const int tile = a.query_tiles - 1 - static_cast<int>(blockIdx.x / a.heads);
  const int bh = static_cast<int>(blockIdx.x % a.heads);
  const int b = bh / a.hq, h = bh % a.hq, kvh = h / a.group;
  const int m0 = tile * kBlockM;
  const int pad = a.padding ? min(max(a.padding[b * a.padding_stride], 0), a.t) : a.padding_all;

  const Bits* q = static_cast<const Bits*>(a.q) + b * a.q_stride[0] + h * a.q_stride[1];
  const Bits* k = static_cast<const Bits*>(a.k) + b * a.k_stride[0] + kvh * a.k_stride[1];
  const Bits* v = static_cast<const Bits*>(a.v) + b * a.v_stride[0] + kvh * a.v_stride[1];

  // Keys [pad, key_end): the causal range of the tile's last row.
  const int key_end = min(a.t, m0 + kBlockM);
  const int key_tiles = key_end > pad ? (key_end - pad + kBlockN - 1) / kBlockN : 0;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, t4 = lane & 3;
  const int warp_row0 = m0 + warp * 16;  // the warp's first query row

  float o[kD / 8][4] = {};
  float m_run[2] = {-INFINITY, -INFINITY};  // per row g and g + 8, in log2 units
  float l_run[2] = {0.0f, 0.0f};            // this lane's part of the row sums

  if (key_tiles > 0) {
    load_rows<Bits, kBlockM, kD, kStride, kThreads>(sq, q, a.q_stride[2], m0, pad, a.t, a.d,
                                                    a.vector_loads);
    auto load_keys = [&](int j, int stage) {
      const int j0 = pad + j * kBlockN;
      load_rows<Bits, kBlockN, kD, kStride, kThreads>(sk + stage * Tile::kKeys, k, a.k_stride[2],
                                                      j0, j0, key_end, a.d, a.vector_loads);
      load_rows<Bits, kBlockN, kD, kStride, kThreads>(sv + stage * Tile::kKeys, v, a.v_stride[2],
                                                      j0, j0, key_end, a.d, a.vector_loads);
    };
    load_keys(0, 0);
    cp_async_commit();

    typename Mma::template QueryFragments<kD> qf;
    const Bits* warp_q = sq + warp * 16 * kStride;
    for (int j = 0; j < key_tiles; ++j) {
      const int stage = j & 1;
      if (j + 1 < key_tiles) {
        load_keys(j + 1, stage ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
      if (j == 0) Mma::template load_queries<kD, kStride>(qf, warp_q, lane);

      float s[kBlockN / 8][4] = {};
      tile_scores<Mma, kD, kBlockN, kStride>(s, qf, warp_q, sk + stage * Tile::kKeys, lane);

      // Keys after a row's diagonal (the zero rows past key_end among them) get no weight.
      const int j0 = pad + j * kBlockN;
      if (j0 + kBlockN - 1 > warp_row0) {
#pragma unroll
        for (int n = 0; n < kBlockN / 8; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = j0 + n * 8 + 2 * t4 + (e & 1), row = warp_row0 + g + (e >> 1) * 8;
            if (key > row) s[n][e] = -INFINITY;
          }
        }
      }

      // Online softmax of rows g (elements 0, 1) and g + 8 (elements 2, 3); the four lanes of
      // a quad share a row.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < kBlockN / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_run[r], mx * a.scale_log2);
        const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet
        const float alpha = exp2f(m_run[r] - m_use);
        m_run[r] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int n = 0; n < kBlockN / 8; ++n) {
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) {
            s[n][e] = exp2f(fmaf(s[n][e], a.scale_log2, -m_use));
            sum += s[n][e];
          }
        }
        l_run[r] = l_run[r] * alpha + sum;
#pragma unroll
        for (int n = 0; n < kD / 8; ++n) {
          o[n][2 * r] *= alpha;
          o[n][2 * r + 1] *= alpha;
        }
      }

      Mma::template accumulate<kD, kBlockN, kStride>(o, s, sv + stage * Tile::kKeys, lane);
      __syncthreads();  // the next iteration's loads overwrite this stage's buffers
    }
  }

  // Rows: out = o / l; padding rows (and a tile with no keys) zeros and an lse of -inf.
  T* out = static_cast<T*>(a.out) + b * a.out_stride[0] + h * a.out_stride[1];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = l_run[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int row = warp_row0 + g + 8 * r;
    if (row >= a.t) continue;
    const bool real = row >= pad && l > 0.0f;
    const float inv = real ? 1.0f / l : 0.0f;
    T* dst = out + row * a.out_stride[2];
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) {
      const int c = n * 8 + 2 * t4;
      if (c < a.d) {
        store_pair(dst + c, o[n][2 * r] * inv, o[n][2 * r + 1] * inv, a.vector_stores,
                   c + 1 < a.d);
      }
    }
    if (a.lse && t4 == 0) {
      float* lse = a.lse + b * a.lse_stride[0] + h * a.lse_stride[1] + row * a.lse_stride[2];
      *lse = real ? m_run[r] * kLn2 + logf(l) : -INFINITY;
    }
  }
}

// ---------------------------------------------------------------------------------- launch

// Dynamic shared memory above the default 48 KiB is opted into once per kernel and device.
template <typename Kernel>
void allow_shared_memory(Kernel kernel, std::size_t bytes, int device,
                         std::atomic<bool> (&done)[kMaxDevices]) {
  if (bytes <= 48 * 1024) return;
  if (device < kMaxDevices && done[device].load(std::memory_order_acquire)) return;
  FUSEKIT_CHECK(bytes <= static_cast<std::size_t>(max_shared_memory_per_block(device)), kOp,
                ": the kernel needs ", bytes, " bytes of shared memory per block; the device "
                "offers ", max_shared_memory_per_block(device));
  FUSEKIT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(bytes)));
  if (device < kMaxDevices) done[device].store(true, std::memory_order_release);
}

template <typename Mma, int kD, int kBlockM, int kBlockN>
void launch(Args a, int device, cudaStream_t stream) {
  using Tile = Tiles<Mma, kD, kBlockM, kBlockN>;
  static std::atomic<bool> shared_allowed[kMaxDevices];
  const auto kernel = attention_kernel<Mma, kD, kBlockM, kBlockN>;
  allow_shared_memory(kernel, Tile::kSharedBytes, device, shared_allowed);
  a.query_tiles = static_cast<int>((a.t + kBlockM - 1) / kBlockM);
  const std::int64_t blocks = static_cast<std::int64_t>(a.query_tiles) * a.heads;
  FUSEKIT_CHECK(blocks <= std::numeric_limits<int>::max(), kOp, ": B * Hq * ceil(T / ",
                kBlockM, ") = ", blocks, " blocks, more than one launch takes (", 
                std::numeric_limits<int>::max(), ")");
  kernel<<<static_cast<unsigned>(blocks), Tile::kThreads, Tile::kSharedBytes, stream>>>(a);
  FUSEKIT_CUDA_CHECK_LAUNCH("attention_kernel");
}

// The head dimension rounds up to 32, 64, 128 or 256; the extra columns are zeros.
template <typename Mma, int kBlockM64, int kBlockM128>
void launch_head_dim(const Args& a, int device, cudaStream_t stream, bool big_batch) {
  constexpr bool kFloat = std::is_same_v<typename Mma::Element, float>;
  if (a.d <= 32) {
    launch<Mma, 32, kBlockM64, 64>(a, device, stream);
  } else if (a.d <= 64) {
    if (big_batch) {
      launch<Mma, 64, kBlockM128, 64>(a, device, stream);
    } else {
      launch<Mma, 64, kBlockM64, 64>(a, device, stream);
    }
  } else if (a.d <= 128) {
    if (big_batch) {
      launch<Mma, 128, kBlockM128, kFloat ? 32 : 64>(a, device, stream);
    } else {
      launch<Mma, 128, kBlockM64, kFloat ? 32 : 64>(a, device, stream);
    }
  } else {
    launch<Mma, 256, kBlockM64, 32>(a, device, stream);
  }
}

bool aligned(const void* p, std::size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

bool strides_divisible(const std::int64_t (&s)[3], std::int64_t n) {
  return s[0] % n == 0 && s[1] % n == 0 && s[2] % n == 0;
}

}  // namespace

void launch_causal_attention(const CausalAttentionParams& p, int device, Stream stream) {
  CudaDeviceGuard guard(device);
  FUSEKIT_CHECK(p.t <= std::numeric_limits<int>::max() / 2, kOp, ": T = ", p.t,
                " is more than the CUDA kernels take (", std::numeric_limits<int>::max() / 2, ")");
  FUSEKIT_CHECK(p.b * p.hq <= std::numeric_limits<int>::max(), kOp, ": B * Hq = ", p.b * p.hq,
                " is more than the CUDA kernels take");
  Args a{};
  a.q = p.q;
  a.k = p.k;
  a.v = p.v;
  a.out = p.out;
  a.lse = p.lse;
  for (int i = 0; i < 3; ++i) {
    a.q_stride[i] = p.q_stride[i];
    a.k_stride[i] = p.k_stride[i];
    a.v_stride[i] = p.v_stride[i];
    a.out_stride[i] = p.out_stride[i];
    a.lse_stride[i] = p.lse_stride[i];
  }
  a.hq = static_cast<int>(p.hq);
  a.group = static_cast<int>(p.group());
  a.t = static_cast<int>(p.t);
  a.d = static_cast<int>(p.d);
  a.padding_all = static_cast<int>(p.padding_all);
  a.padding = p.padding;
  a.padding_stride = p.padding_stride;
  a.scale_log2 = static_cast<float>(static_cast<double>(p.scale) * 1.4426950408889634);
  a.heads = static_cast<int>(p.b * p.hq);

  const std::size_t elem = element_size(p.dtype);
  const std::int64_t piece = static_cast<std::int64_t>(16 / elem);
  a.vector_loads = p.d % piece == 0 && aligned(p.q, 16) && aligned(p.k, 16) &&
                   aligned(p.v, 16) && strides_divisible(p.q_stride, piece) &&
                   strides_divisible(p.k_stride, piece) && strides_divisible(p.v_stride, piece);
  a.vector_stores = p.d % 2 == 0 && aligned(p.out, 2 * elem) && strides_divisible(p.out_stride, 2);

  // Large batches take 128-row query tiles (K and V read half as often); small ones 64-row
  // tiles, for more blocks than multiprocessors.
  const std::int64_t tiles128 = p.b * p.hq * ((p.t + 127) / 128);
  const bool big_batch = tiles128 >= 2 * multiprocessor_count(device);

  const auto s = static_cast<cudaStream_t>(stream.handle);
  switch (p.dtype) {
    case DType::Float32:
      if (p.allow_tf32) {
        launch_head_dim<Tf32Mma<false>, 64, 64>(a, device, s, big_batch);
      } else {
        launch_head_dim<Tf32Mma<true>, 64, 64>(a, device, s, big_batch);
      }
      return;
    case DType::BFloat16:
      launch_head_dim<HalfMma<__nv_bfloat16>, 64, 128>(a, device, s, big_batch);
      return;
    case DType::Float16:
      launch_head_dim<HalfMma<__half>, 64, 128>(a, device, s, big_batch);
      return;
    default:
      throw Error(concat(kOp, ": no CUDA kernel for dtype ", to_string(p.dtype)));
  }
}

}  // namespace fusekit::detail
