// The CUDA backend of causal_attention: two kernels in the FlashAttention style, one on mma.sync
// for every GPU, dtype and layout (below), one on Hopper's warpgroup MMAs for bfloat16 and float16
// at D = 64 and 128 (further down, "the warpgroup kernel").
//
// The mma.sync kernel: a block takes kBlockM query rows of one (sequence, head), 16 rows per warp,
// and walks the keys from the sequence's first real token to its last row in tiles of kBlockN,
// double-buffered in shared memory by cp.async. Key tiles start at the padding count itself, so no
// padded K or V row is ever read, and the walk stops at the block's last row, so no tile lies
// wholly after the causal diagonal; rows past the end of the keys' range are filled with zeros. For
// each tile a warp computes its 16 x kBlockN scores on tensor cores, masks the keys after each
// row's diagonal, and updates its rows' online softmax: the running max m (in log2 units, the scale
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
#include <optional>
#include <type_traits>

#include "common/bulk_copy.cuh"
#include "common/cuda_check.h"
#include "common/cuda_math.cuh"
#include "common/cuda_mma.cuh"
#include "common/cuda_wgmma.cuh"
#include "common/dispatch.h"
#include "common/tensor_map.h"
#include "fusekit/error.h"
#include "ops/causal_attention/causal_attention_params.h"

namespace fusekit::detail {

namespace {

constexpr const char* kOp = "causal_attention";
constexpr float kLn2 = 0.6931471805599453f;

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
  bool piece_stores;            // out rows may be written in 16-byte pieces
  bool tensor_stores;           // out has a tensor map: rows leave by the copy engine
};

// ------------------------------------------------------------------------------- loading

// Copies rows [row0, row0 + kRows) of a matrix with row stride `stride` into shared memory rows
// of kStride elements: columns [0, d) from global memory, columns [d, kD) and every row outside
// [lo, hi) as zeros. Rows outside are never read. `vector` copies 16-byte pieces by cp.async
// (d, stride and src then hold whole pieces); else element by element.
// Thread `tid` of kThreads takes every kThreads-th piece.
template <typename Bits, int kRows, int kD, int kStride, int kThreads>
__device__ __forceinline__ void load_rows(Bits* smem, const Bits* src, std::int64_t stride,
                                          int row0, int lo, int hi, int d, bool vector, int tid) {
  constexpr int kPiece = 16 / static_cast<int>(sizeof(Bits));  // elements per 16 bytes
  constexpr int kPieces = kD / kPiece;                         // per row
  for (int i = tid; i < kRows * kPieces; i += kThreads) {
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
// Each gives the element type and its bit type, the shared-memory row padding, and for a warp
// that owns kMT tiles of 16 query rows:
//   scores(s, qf, sq, sk)   s[mt][n][4] = those rows . the tile's kBlockN keys (float32)
//   accumulate(o, p, sv)    o[mt][n][4] += P V for the tile (p: the exponentiated scores)
// All fragments have the m16n8 accumulator layout (see common/cuda_mma.cuh); each operand
// fragment read from shared memory serves all kMT row tiles.

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
  template <int kMT, int kD>
  struct QueryFragments {
    std::uint32_t a[kMT][kD / 16][4];
  };

  template <int kMT, int kD, int kStride>
  static __device__ __forceinline__ void load_queries(QueryFragments<kMT, kD>& qf,
                                                      const Bits* sq, int lane) {
    const Bits* row = sq + (lane & 15) * kStride + (lane >> 4) * 8;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        ldmatrix_x4(qf.a[mt][kk], row + mt * 16 * kStride + kk * 16);
      }
    }
  }

  template <int kMT, int kD, int kBlockN, int kStride>
  static __device__ __forceinline__ void scores(float (&s)[kMT][kBlockN / 8][4],
                                                const QueryFragments<kMT, kD>& qf, const Bits*,
                                                const Bits* sk, int lane) {
    // Matrices of ldmatrix_x4: keys 0-7 and 8-15 of a pair of 8-key tiles, d low and high.
    const Bits* row = sk + ((lane & 7) + ((lane >> 4) << 3)) * kStride + ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < kBlockN / 16; ++np) {
        std::uint32_t b[4];
        ldmatrix_x4(b, row + np * 16 * kStride + kk * 16);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma(s[mt][2 * np], qf.a[mt][kk], b[0], b[1]);
          mma(s[mt][2 * np + 1], qf.a[mt][kk], b[2], b[3]);
        }
      }
    }
  }

  template <int kMT, int kD, int kBlockN, int kStride>
  static __device__ __forceinline__ void accumulate(float (&o)[kMT][kD / 8][4],
                                                    const float (&p)[kMT][kBlockN / 8][4],
                                                    const Bits* sv, int lane) {
    // Transposed matrices: keys 0-7 and 8-15 of 16, d low then high.
    const Bits* row = sv + ((lane & 7) + ((lane >> 3) & 1) * 8) * kStride + (lane >> 4) * 8;
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      std::uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        a[mt][0] = pack(p[mt][2 * kk][0], p[mt][2 * kk][1]);
        a[mt][1] = pack(p[mt][2 * kk][2], p[mt][2 * kk][3]);
        a[mt][2] = pack(p[mt][2 * kk + 1][0], p[mt][2 * kk + 1][1]);
        a[mt][3] = pack(p[mt][2 * kk + 1][2], p[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < kD / 16; ++dp) {
        std::uint32_t b[4];
        ldmatrix_x4_trans(b, row + kk * 16 * kStride + dp * 16);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma(o[mt][2 * dp], a[mt], b[0], b[1]);
          mma(o[mt][2 * dp + 1], a[mt], b[2], b[3]);
        }
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
  // Split: big is x rounded to the nearest TF32 value (ties away from zero, as cvt.rna) by
  // integer arithmetic, half a unit of its last place added and the 13 bits below it cleared;
  // small is the exact remainder x - big, passed whole: the tensor cores read the upper 19 bits of
  // a TF32 operand, which truncates it to 2^-21 of x at most, the size of the small * small term
  // that the three products leave out anyway. Three instructions a value, where two cvt.rna (each
  // a test for infinity and an addition) and the mask before the subtraction took six. Infinity
  // and NaN still give NaN through small.
  static __device__ __forceinline__ Split split(float x) {
    if constexpr (kSplit) {
      const std::uint32_t big = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
      return {big, __float_as_uint(x - __uint_as_float(big))};
    } else {
      return {to_tf32(x), 0u};
    }
  }
  struct SplitA {
    std::uint32_t big[4], small[4];
  };
  static __device__ __forceinline__ SplitA split(const float (&x)[4]) {
    SplitA r;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const Split e = split(x[i]);
      r.big[i] = e.big;
      r.small[i] = e.small;
    }
    return r;
  }

  // c += a b, in three products (small terms first) or one.
  static __device__ __forceinline__ void mma(float (&c)[4], const SplitA& a, Split b0, Split b1) {
    if constexpr (kSplit) {
      mma_1688_tf32(c, a.small, b0.big, b1.big);
      mma_1688_tf32(c, a.big, b0.small, b1.small);
    }
    mma_1688_tf32(c, a.big, b0.big, b1.big);
  }

  // Queries are read from shared memory at every tile (float32 fragments would take too many
  // registers to keep).
  template <int kMT, int kD>
  struct QueryFragments {};

  template <int kMT, int kD, int kStride>
  static __device__ __forceinline__ void load_queries(QueryFragments<kMT, kD>&, const Bits*,
                                                      int) {}

  // The fragments by ldmatrix, its 8 x 8 matrices of 16-bit values taken as 8 rows of four
  // float32 (rows of kStride words, 16-byte aligned; kPad keeps them on distinct banks): lane (g,
  // t) receives row g, word t, the m16n8k8 TF32 layout. One instruction for four values.
  template <int kMT, int kD, int kBlockN, int kStride>
  static __device__ __forceinline__ void scores(float (&s)[kMT][kBlockN / 8][4],
                                                const QueryFragments<kMT, kD>&, const Bits* sq,
                                                const Bits* sk, int lane) {
    static_assert(kStride % 4 == 0 && kBlockN % 16 == 0, "16-byte rows, pairs of 8-key tiles");
    // Matrices: queries rows 0-7 and 8-15 of words 0-3, then of words 4-7 (a[0] to a[3]); keys
    // 0-7 of words 0-3 and 4-7, then keys 8-15 of the same (b0, b1 of two 8-key tiles).
    const Bits* q_row = sq + (lane & 15) * kStride + (lane >> 4) * 4;
    const Bits* k_row = sk + ((lane & 7) + ((lane >> 4) << 3)) * kStride + ((lane >> 3) & 1) * 4;
#pragma unroll 2
    for (int kk = 0; kk < kD / 8; ++kk) {
      SplitA a[kMT];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        std::uint32_t q[4];
        ldmatrix_x4(q, q_row + mt * 16 * kStride + kk * 8);
        const float x[4] = {__uint_as_float(q[0]), __uint_as_float(q[1]), __uint_as_float(q[2]),
                            __uint_as_float(q[3])};
        a[mt] = split(x);
      }
#pragma unroll
      for (int np = 0; np < kBlockN / 16; ++np) {
        std::uint32_t k[4];
        ldmatrix_x4(k, k_row + np * 16 * kStride + kk * 8);
        const Split b[4] = {split(__uint_as_float(k[0])), split(__uint_as_float(k[1])),
                            split(__uint_as_float(k[2])), split(__uint_as_float(k[3]))};
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma(s[mt][2 * np], a[mt], b[0], b[1]);
          mma(s[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }
  }

  // P's columns are the keys permuted within each 8-key tile: the accumulator holds keys 2t and
  // 2t + 1 where the A fragment wants t and t + 4, so the fragment takes them as they are and
  // V's rows are read in the same order (row t of B is key 2t, row t + 4 is key 2t + 1).
  template <int kMT, int kD, int kBlockN, int kStride>
  static __device__ __forceinline__ void accumulate(float (&o)[kMT][kD / 8][4],
                                                    const float (&p)[kMT][kBlockN / 8][4],
                                                    const Bits* sv, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int kk = 0; kk < kBlockN / 8; ++kk) {
      SplitA a[kMT];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        const float x[4] = {p[mt][kk][0], p[mt][kk][2], p[mt][kk][1], p[mt][kk][3]};
        a[mt] = split(x);
      }
      const Bits* v = sv + (kk * 8 + 2 * t) * kStride + g;
#pragma unroll
      for (int n = 0; n < kD / 8; ++n) {
        const Split b0 = split(__uint_as_float(v[n * 8]));
        const Split b1 = split(__uint_as_float(v[kStride + n * 8]));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) mma(o[mt][n], a[mt], b0, b1);
      }
    }
  }
};

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

// A row's sum of weights l from the parts of the four lanes of its quad (all four call it).
__device__ __forceinline__ float quad_sum(float l_part) {
  float l = l_part;
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  return l;
}

// The end of one row's walk given its sum l: whether it takes weights (not a padding row, some
// key) and then 1 / l, else 0.
struct RowEnd {
  float l;
  bool real;
  float inv;
};
__device__ __forceinline__ RowEnd end_row(float l, int row, int pad) {
  const bool real = row >= pad && l > 0.0f;
  return {l, real, real ? 1.0f / l : 0.0f};
}

// The lse of a row, by lane 0 of its quad (m in log2 units, l_exp the sum of its exponentials
// in float32): -inf where it takes no weights. Nothing where the caller asked for no lse, nor for
// rows at or past T (`below_t` false).
__device__ __forceinline__ void store_lse(const Args& a, int b, int h, int row, bool below_t,
                                          int t4, const RowEnd& e, float m, float l_exp) {
  if (a.lse && t4 == 0 && below_t) {
    float* lse = a.lse + b * a.lse_stride[0] + h * a.lse_stride[1] + row * a.lse_stride[2];
    *lse = e.real ? m * kLn2 + logf(l_exp) : -INFINITY;
  }
}

// The end of one row's walk, by the four lanes of its quad: their parts of l summed, out = o / l
// in columns 8 n + 2 t4 and 8 n + 2 t4 + 1 (those below D) for n < kChunks, and the lse (from
// the parts l_exp_part, which may be l_part's);
// padding rows and rows with no key get zeros and -inf. `o_pair(n, x)` gives the row's two
// accumulators of chunk n. Rows at or past T are left alone (the quad's lanes still shuffle).
template <int kChunks, typename T, typename Pair>
__device__ __forceinline__ void store_row(const Args& a, T* out, int b, int h, int row, int pad,
                                          int t4, float l_part, float l_exp_part, float m,
                                          Pair o_pair) {
  const float l = quad_sum(l_part);
  const float l_exp = a.lse ? quad_sum(l_exp_part) : l;
  if (row >= a.t) return;
  const RowEnd e = end_row(l, row, pad);
  T* dst = out + row * a.out_stride[2];
#pragma unroll
  for (int n = 0; n < kChunks; ++n) {
    const int c = n * 8 + 2 * t4;
    if (c < a.d) {
      float x[2];
      o_pair(n, x);
      store_pair(dst + c, e.real ? x[0] * e.inv : 0.0f, e.real ? x[1] * e.inv : 0.0f,
                 a.vector_stores, c + 1 < a.d);
    }
  }
  store_lse(a, b, h, row, true, t4, e, m, l_exp);  // rows at or past T returned above
}

// The end of a warpgroup's 64 rows in the warpgroup kernel, where out takes 16-byte pieces: each
// thread writes its rows' o / l (as store_row: zeros for padding rows and rows with no key, the
// lse, from l_exp_part: see the warpgroup kernel's sums) into `staged`, the warpgroup's rows
// of the query tile as they landed: a block of 64
// columns after another, kTileRows rows of 128 bytes each, the 16-byte pieces of row r in the
// order piece ^ (r % 8), so that neither the writes nor the reads meet bank conflicts. After the
// warpgroup's barrier a rolled loop copies whole pieces to out: the code fetched after the
// products is a few cache lines, where a copy of store_row per row and chunk is many. That
// order is the 128-byte swizzle of a tensor map's box, so where out has a map (`o_map`, boxes of
// 64 rows) one thread hands the rows to the copy engine instead (which leaves rows past T
// unwritten) and waits only until it has read them: the warpgroup's other threads leave at once
// (on H100, B8 H12 T1024 D64 44.4 -> 43.7 µs; at D128 7% less time, where the two warpgroups of
// the many-blocks form had stored from registers).
template <int kD, int kTileRows, typename T, typename O>
__device__ __forceinline__ void store_rows_staged(const Args& a, T* out, int b, int h, int row0,
                                                  int pad, unsigned char* staged, int barrier,
                                                  const float (&l_part)[2], const float (&m)[2],
                                                  const float (&l_exp_part)[2], const O& o,
                                                  const CUtensorMap* o_map) {
  const int wg_tid = threadIdx.x % 128, g = (wg_tid % 32) / 4, t4 = wg_tid % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int local = 16 * (wg_tid / 32) + g + 8 * r, row = row0 + local;
    const RowEnd e = end_row(quad_sum(l_part[r]), row, pad);
    unsigned char* const dst = staged + local * 128 + 4 * t4;
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) {
      const float x0 = e.real ? o[4 * n + 2 * r] * e.inv : 0.0f;
      const float x1 = e.real ? o[4 * n + 2 * r + 1] * e.inv : 0.0f;
      *reinterpret_cast<std::uint32_t*>(dst + (n / 8) * kTileRows * 128 + 16 * ((n % 8) ^ g)) =
          HalfMma<T>::pack(x0, x1);
    }
    if (a.lse) store_lse(a, b, h, row, row < a.t, t4, e, m[r], quad_sum(l_exp_part[r]));
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (o_map) {
    fence_proxy_async_shared();  // the staged rows, for the copy engine
    named_barrier_sync(barrier, 128);
    if (wg_tid == 0) {
      for (int cb = 0; cb < kD / 64; ++cb) {
        tensor_store_4d_from_shared(o_map, 64 * cb, row0, h, b, staged + cb * kTileRows * 128);
      }
      bulk_commit();
      bulk_wait_read<0>();
    }
    return;
  }
#endif
  named_barrier_sync(barrier, 128);
  constexpr int kPieces = kD / 8;
#pragma unroll 1
  for (int i = wg_tid; i < 64 * kPieces && row0 + i / kPieces < a.t; i += 128) {
    const int local = i / kPieces, piece = i % kPieces;
    const uint4 v = *reinterpret_cast<const uint4*>(staged + (piece / 8) * kTileRows * 128 +
                                                    local * 128 + 16 * ((piece % 8) ^ (local % 8)));
    *reinterpret_cast<uint4*>(out + (row0 + local) * a.out_stride[2] + 8 * piece) = v;
  }
}

// ---------------------------------------------------------------------------------- kernel

// A block: kGroups groups of kWarps warps; a warp owns kMT tiles of 16 query rows, a group all
// kBlockM = kWarps * 16 * kMT rows of the block. Group r walks key tiles r, r + kGroups, ...
// with K and V buffers of its own, and the groups merge their softmax states at the end (more
// groups shorten the walk of a block, for launches with few blocks).
template <typename Mma, int kD_, int kMT_, int kWarps_, int kBlockN_, int kGroups_,
          int kStages_ = 2>
struct Config {
  using Policy = Mma;
  static constexpr int kD = kD_, kMT = kMT_, kWarps = kWarps_, kBlockN = kBlockN_;
  static constexpr int kGroups = kGroups_;
  static constexpr int kStages = kStages_;  // K and V tiles in flight per group
  static constexpr int kBlockM = kWarps * 16 * kMT;
  static constexpr int kGroupThreads = kWarps * 32;
  static constexpr int kThreads = kGroupThreads * kGroups;
  static constexpr int kStride = kD + Mma::kPad;  // elements per shared-memory row
  static constexpr int kQuery = kBlockM * kStride;
  static constexpr int kKeys = kBlockN * kStride;  // one K or V buffer
  static constexpr int kGroupKeys = 2 * kStages * kKeys;  // a group's K and V buffers
  using Bits = typename Mma::Bits;
  static constexpr std::size_t kSharedBytes =
      sizeof(Bits) * static_cast<std::size_t>(kQuery + kGroups * kGroupKeys);
  // What a group hands the other at the end: per lane m, l (2 rows each) and o.
  static constexpr int kMergeFloats = kMT * (4 + kD / 2);
  // 8 warps of up to 64 columns: two blocks per SM (128 registers a thread).
  static constexpr int kMinBlocks = kThreads == 256 && kD <= 64 ? 2 : 1;
  static_assert(kD % 16 == 0 && kBlockN % 16 == 0 && kGroups >= 1);
  static_assert(kGroups == 1 ||
                sizeof(float) * kMergeFloats * kGroupThreads <= sizeof(Bits) * kGroupKeys);
  static_assert(kStages >= 2);
};

// The online softmax of one row over a tile, by the four lanes of the quad that holds the row:
// `score(n, e)` is this lane's score e (0 or 1) of chunk n < kChunks (a reference). The max and
// the sum run in kPartial independent chains (a power of two), so that their latencies overlap.
// The chains start from their first values, not from -inf and 0: fmaxf(-inf, v) and 0 + v are
// instructions the compiler may not drop (NaN, -0). First, this lane's max of the row's scores
// (unscaled):
template <int kChunks, int kPartial, typename Score>
__device__ __forceinline__ float lane_row_max(Score score) {
  static_assert(kPartial >= 1 && (kPartial & (kPartial - 1)) == 0 && kChunks >= kPartial);
  float part[kPartial];
#pragma unroll
  for (int n = 0; n < kChunks; ++n) {
    const float v = fmaxf(score(n, 0), score(n, 1));
    part[n % kPartial] = n < kPartial ? v : fmaxf(part[n % kPartial], v);
  }
#pragma unroll
  for (int w = kPartial / 2; w >= 1; w /= 2) {
#pragma unroll
    for (int x = 0; x < w; ++x) part[x] = fmaxf(part[x], part[x + w]);
  }
  return part[0];
}

// Replaces this lane's scores of the row by exp2(scale_log2 score - m_use).
template <int kChunks, typename Score>
__device__ __forceinline__ void lane_row_exp(Score score, float scale_log2, float m_use) {
#pragma unroll
  for (int n = 0; n < kChunks; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) score(n, e) = fast_exp2(fmaf(score(n, e), scale_log2, -m_use));
  }
}

// The same, and returns their sum.
template <int kChunks, int kPartial, typename Score>
__device__ __forceinline__ float lane_row_exp_sum(Score score, float scale_log2, float m_use) {
  float part[kPartial];
#pragma unroll
  for (int n = 0; n < kChunks; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float& v = score(n, e);
      v = fast_exp2(fmaf(v, scale_log2, -m_use));
      part[n % kPartial] = n < kPartial && e == 0 ? v : part[n % kPartial] + v;
    }
  }
#pragma unroll
  for (int w = kPartial / 2; w >= 1; w /= 2) {
#pragma unroll
    for (int x = 0; x < w; ++x) part[x] += part[x + w];
  }
  return part[0];
}

// One row's step over a tile, from this lane's max of it (lane_row_max): updates the running max
// m (log2 units, the scale folded in) and this lane's part of the running sum l, replaces the
// scores by their exponentials, and returns the factor the row's output must take. With kLazy
// the running max moves only where the tile's exceeds it by more than kLazyRescaleLog2, and
// `moved` is then set: below that the exponentials are taken against the old max (values up to
// 2^kLazyRescaleLog2, which float32 sums and half-precision P hold at their full relative
// precision) and the factor is exactly 1, so that a warp none of whose rows moved can skip its
// output's rescale.
constexpr float kLazyRescaleLog2 = 8.0f;

template <int kChunks, int kPartial, bool kLazy = false, typename Score>
__device__ __forceinline__ float softmax_row(float lane_max, Score score, float scale_log2,
                                             float& m_run, float& l_run, bool* moved = nullptr) {
  float mx = lane_max;
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  float m_new = fmaxf(m_run, mx * scale_log2);
  if constexpr (kLazy) {
    const bool move = m_new > m_run + kLazyRescaleLog2;  // always from -inf, to a finite max
    m_new = move ? m_new : m_run;
    *moved = *moved || move;
  }
  const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet
  const float alpha = fast_exp2(m_run - m_use);
  m_run = m_new;
  l_run = l_run * alpha + lane_row_exp_sum<kChunks, kPartial>(score, scale_log2, m_use);
  return alpha;
}

template <int kChunks, int kPartial, bool kLazy = false, typename Score>
__device__ __forceinline__ float softmax_row(Score score, float scale_log2, float& m_run,
                                             float& l_run, bool* moved = nullptr) {
  return softmax_row<kChunks, kPartial, kLazy>(lane_row_max<kChunks, kPartial>(score), score,
                                               scale_log2, m_run, l_run, moved);
}

// Folds another part's softmax state of a row (m_other, l_other) into (m, l), for parts that
// walked different keys; gives the factors of this part's output and of the other's.
__device__ __forceinline__ void merge_softmax(float& m, float& l, float m_other, float l_other,
                                              float& alpha, float& beta) {
  const float m_new = fmaxf(m, m_other);
  const float m_use = m_new == -INFINITY ? 0.0f : m_new;
  alpha = fast_exp2(m - m_use);
  beta = fast_exp2(m_other - m_use);
  m = m_new;
  l = l * alpha + l_other * beta;
}

template <typename C>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks) attention_kernel(const Args a) {
  using Mma = typename C::Policy;
  using T = typename Mma::Element;
  using Bits = typename C::Bits;
  constexpr int kD = C::kD, kMT = C::kMT, kBlockM = C::kBlockM, kBlockN = C::kBlockN;
  constexpr int kStride = C::kStride;

  extern __shared__ uint4 shared[];
  Bits* sq = reinterpret_cast<Bits*>(shared);  // [kBlockM][kStride]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = warp / C::kWarps, group_warp = warp % C::kWarps;
  const int group_tid = threadIdx.x % C::kGroupThreads;
  // This group's ring of kStages (K, V) slots, each [kBlockN][kStride].
  Bits* sk = sq + C::kQuery + group * C::kGroupKeys;

  // Longest first: the block index runs over (query tile from the last, sequence and head).
  const int tile = a.query_tiles - 1 - static_cast<int>(blockIdx.x / a.heads);
  const int bh = static_cast<int>(blockIdx.x % a.heads);
  const int b = bh / a.hq, h = bh % a.hq, kvh = h / a.group;
  const int m0 = tile * kBlockM;
  const int pad = a.padding ? min(max(a.padding[b * a.padding_stride], 0), a.t) : a.padding_all;

  const Bits* q = static_cast<const Bits*>(a.q) + b * a.q_stride[0] + h * a.q_stride[1];
  const Bits* k = static_cast<const Bits*>(a.k) + b * a.k_stride[0] + kvh * a.k_stride[1];
  const Bits* v = static_cast<const Bits*>(a.v) + b * a.v_stride[0] + kvh * a.v_stride[1];

  // Keys [pad, key_end): the causal range of the tile's last row; this group's share of them.
  const int key_end = min(a.t, m0 + kBlockM);
  const int key_tiles = key_end > pad ? (key_end - pad + kBlockN - 1) / kBlockN : 0;
  const int my_tiles = key_tiles > group ? (key_tiles - group + C::kGroups - 1) / C::kGroups : 0;

  const int g = lane >> 2, t4 = lane & 3;
  const int warp_row0 = m0 + group_warp * 16 * kMT;  // the warp's first query row

  float o[kMT][kD / 8][4] = {};
  float m_run[kMT][2], l_run[kMT][2];  // per row g and g + 8 of each row tile; m in log2 units
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    m_run[mt][0] = m_run[mt][1] = -INFINITY;
    l_run[mt][0] = l_run[mt][1] = 0.0f;  // this lane's part of the row sums
  }

  if (key_tiles > 0) {
    auto load_keys = [&](int i) {  // the group's i-th tile, into slot i % kStages
      const int j0 = pad + (group + i * C::kGroups) * kBlockN;
      Bits* slot = sk + (i % C::kStages) * 2 * C::kKeys;
      load_rows<Bits, kBlockN, kD, kStride, C::kGroupThreads>(
          slot, k, a.k_stride[2], j0, j0, key_end, a.d, a.vector_loads, group_tid);
      load_rows<Bits, kBlockN, kD, kStride, C::kGroupThreads>(
          slot + C::kKeys, v, a.v_stride[2], j0, j0, key_end, a.d, a.vector_loads, group_tid);
    };
    load_rows<Bits, kBlockM, kD, kStride, C::kThreads>(sq, q, a.q_stride[2], m0, pad, a.t, a.d,
                                                       a.vector_loads, threadIdx.x);
    // Tiles 0 .. kStages - 2 in flight, one commit group each (empty past the last tile), Q
    // with the first.
    for (int i = 0; i < C::kStages - 1; ++i) {
      if (i < my_tiles) load_keys(i);
      cp_async_commit();
    }
    cp_async_wait<C::kStages - 2>();
    __syncthreads();  // Q, loaded by every group

    typename Mma::template QueryFragments<kMT, kD> qf;
    const Bits* warp_q = sq + group_warp * 16 * kMT * kStride;
    Mma::template load_queries<kMT, kD, kStride>(qf, warp_q, lane);

    for (int i = 0; i < my_tiles; ++i) {
      // Tile i has landed and every warp of the group is done with tile i - 1, whose slot
      // takes tile i + kStages - 1.
      cp_async_wait<C::kStages - 2>();
      if constexpr (C::kGroups == 1) {
        __syncthreads();
      } else {
        named_barrier_sync(1 + group, C::kGroupThreads);
      }
      if (i + C::kStages - 1 < my_tiles) load_keys(i + C::kStages - 1);
      cp_async_commit();
      const Bits* slot = sk + (i % C::kStages) * 2 * C::kKeys;

      float s[kMT][kBlockN / 8][4] = {};
      Mma::template scores<kMT, kD, kBlockN, kStride>(s, qf, warp_q, slot, lane);

      // Keys after a row's diagonal (the zero rows past key_end among them) get no weight.
      const int j0 = pad + (group + i * C::kGroups) * kBlockN;
      if (j0 + kBlockN - 1 > warp_row0) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
          for (int n = 0; n < kBlockN / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int key = j0 + n * 8 + 2 * t4 + (e & 1);
              const int row = warp_row0 + mt * 16 + g + (e >> 1) * 8;
              if (key > row) s[mt][n][e] = -INFINITY;
            }
          }
        }
      }

      // Online softmax of rows g (elements 0, 1) and g + 8 (elements 2, 3) of each row tile.
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float alpha = softmax_row<kBlockN / 8, 1>(
              [&](int n, int e) -> float& { return s[mt][n][2 * r + e]; }, a.scale_log2,
              m_run[mt][r], l_run[mt][r]);
#pragma unroll
          for (int n = 0; n < kD / 8; ++n) {
            o[mt][n][2 * r] *= alpha;
            o[mt][n][2 * r + 1] *= alpha;
          }
        }
      }

      Mma::template accumulate<kMT, kD, kBlockN, kStride>(o, s, slot + C::kKeys, lane);
    }
  }

  if constexpr (C::kGroups > 1) {
    // Groups 1, 2, ... hand their states to group 0 through their (now free) key buffers, and
    // group 0 merges them in that order.
    __syncthreads();
    constexpr int kLanes = C::kGroupThreads;
    if (group > 0) {
      float* merge = reinterpret_cast<float*>(sk) + group_tid;
      int x = 0;
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          merge[kLanes * x++] = m_run[mt][r];
          merge[kLanes * x++] = l_run[mt][r];
        }
#pragma unroll
        for (int n = 0; n < kD / 8; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) merge[kLanes * x++] = o[mt][n][e];
        }
      }
    }
    __syncthreads();
    if (group > 0) return;
    for (int other = 1; other < C::kGroups; ++other) {
      const float* merge = reinterpret_cast<const float*>(sq + C::kQuery + other * C::kGroupKeys) +
                           group_tid;
      int x = 0;
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        float alpha[2], beta[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float m_other = merge[kLanes * x++], l_other = merge[kLanes * x++];
          merge_softmax(m_run[mt][r], l_run[mt][r], m_other, l_other, alpha[r], beta[r]);
        }
#pragma unroll
        for (int n = 0; n < kD / 8; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            o[mt][n][e] = o[mt][n][e] * alpha[e >> 1] + merge[kLanes * x++] * beta[e >> 1];
          }
        }
      }
    }
  }

  // Rows: out = o / l; padding rows (and a tile with no keys) zeros and an lse of -inf.
  T* out = static_cast<T*>(a.out) + b * a.out_stride[0] + h * a.out_stride[1];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      store_row<kD / 8>(a, out, b, h, warp_row0 + mt * 16 + g + 8 * r, pad, t4, l_run[mt][r],
                        l_run[mt][r], m_run[mt][r], [&](int n, float (&x)[2]) {
                          x[0] = o[mt][n][2 * r];
                          x[1] = o[mt][n][2 * r + 1];
                        });
    }
  }
}

// ----------------------------------------------------------- the warpgroup kernel (sm_90a)
//
// Hopper, bfloat16 and float16, D = 64 or 128, heads of q, k and v that tensor maps describe.
// A block is kConsumers warpgroups of 128 threads and one producer warp. The producer copies the
// block's query rows once, then the key and value tiles of kBlockN rows through a ring of
// kStages slots, all with the copy engine in 128-byte-swizzled blocks of 64 columns (the layout
// warpgroup MMAs read). Each warpgroup owns 64 query rows; with kSplitKeys the warpgroups share
// the block's 64 rows instead, take alternate key tiles and merge their softmax states at the
// end (for launches with few blocks). For each of its tiles a warpgroup computes
//   S = Q K^T   wgmma m64n{kBlockN}k16, both operands in shared memory (K-major),
//   the causal mask and the online softmax on S in registers, as the mma.sync kernel does,
//   O += P V    wgmma m64n{D}k16, P from registers (the accumulator's layout is the A
//               fragment's) and V read N-major from its tile as it landed,
// and hands the slot back to the producer (at D = 64 with many blocks, K as soon as S is done and
// V after O, each with a barrier of its own). Launches of many blocks run small blocks of one
// warpgroup, four to a multiprocessor, so that one block's softmax, copies and stores overlap the
// others' MMAs. Key tiles start at the padding count and end at the block's last row, as in the
// mma.sync kernel; rows past T arrive as zeros. The query tile is copied whole, so its padding
// rows may be read, but a row never mixes with another and padding rows are written as zeros.
// A warpgroup's finished rows go out through its query rows' bytes (store_rows_staged), by the
// copy engine where out fits a tensor map.

#ifdef FUSEKIT_WGMMA
// Descriptor of the 256 bytes of ones at `smem` as the B operand (k16 x n8, K-major, no swizzle:
// two 8 x 8 core matrices of 128 bytes) of the product that sums P's rows. Both offsets are 128
// bytes, so that whichever steps along k stays in the ones.
__device__ __forceinline__ std::uint64_t ones_descriptor(const void* smem) {
  const std::uint64_t address = shared_address(smem);
  return ((address & 0x3FFFF) >> 4)         // start address
         | (std::uint64_t{128 >> 4} << 16)   // leading byte offset
         | (std::uint64_t{128 >> 4} << 32);  // stride byte offset
}
#endif

template <typename T_, int kD_, int kBlockN_, int kConsumers_, bool kSplitKeys_, int kStages_,
          int kMinBlocks_ = 1, bool kSplitRelease_ = false>
struct WgConfig {
  using T = T_;
  static constexpr int kMinBlocks = kMinBlocks_;  // blocks per multiprocessor
  // A slot's K handed back once S = Q K^T is done, its V once O += P V is, so that the next K
  // tile's copy into the slot starts a softmax and a product earlier (1.5% at B8, four blocks of
  // one warpgroup an SM with two slots each).
  static constexpr bool kSplitRelease = kSplitRelease_;
  static constexpr int kD = kD_, kBlockN = kBlockN_, kConsumers = kConsumers_;
  static constexpr int kStages = kStages_;
  static constexpr bool kSplitKeys = kSplitKeys_;
  static constexpr int kBlockM = kSplitKeys ? 64 : 64 * kConsumers;
  static constexpr int kThreads = 128 * kConsumers + 32;
  static constexpr int kProducerWarp = 4 * kConsumers;
  static constexpr std::uint32_t kQueryBytes = kBlockM * kD * 2;
  static constexpr std::uint32_t kTileBytes = kBlockN * kD * 2;  // one K or V tile
  // Warps that read each tile and hand it back.
  static constexpr int kReaderWarps = 4 * (kSplitKeys ? 1 : kConsumers);
  // Shared memory from a 1024-byte aligned base: Q, then K and V of each slot, then the
  // barriers (Q full, K full and V full of each slot, each slot empty; with kSplitRelease that
  // is its K's, and each slot's V empty follows), then from the next 1024 bytes the ones that
  // sum P's rows on the tensor cores: at D = 64 columns 64 .. 71 of the P V product, which then
  // has N = 72 (16 rows of k, 128-byte swizzled, 2 KB); at D = 128 the B of k16 n8 products of
  // their own (no swizzle, 256 bytes).
  static constexpr std::size_t kBarrierOffset = kQueryBytes + std::size_t{2} * kStages * kTileBytes;
  static constexpr bool kFusedSums = kD == 64;
  static constexpr std::size_t kOnesOffset = kBarrierOffset + 1024;
  static constexpr std::uint32_t kOnesBytes = kFusedSums ? 2048 : 256;
  static_assert(8 * (1 + (kSplitRelease ? 4 : 3) * kStages) <= 1024, "the barriers");
  static constexpr std::size_t kSharedBytes = 1024 + kOnesOffset + kOnesBytes;
  // What a warpgroup hands another at the end, per thread: m, l and l_exp of two rows, and O.
  static constexpr int kMergeFloats = 6 + kD / 2;
  static_assert(kD == 64 || kD == 128);
  static_assert(kBlockN == 64 || kBlockN == 128);
  static_assert(kStages >= 2);
  static_assert(32 * (kProducerWarp + 1) == kThreads, "the producer is the block's last warp");
  static_assert(kReaderWarps % 4 == 0 && kReaderWarps <= 4 * kConsumers, "whole warpgroups read");
  // Split keys: each warpgroup always meets the same slots, so a full barrier's parity only
  // ever tells apart phases of its own tiles.
  // Two slots of its own at least, so that a warpgroup's next tile arrives while it works.
  static_assert(!kSplitKeys || (kStages % kConsumers == 0 && kStages >= 2 * kConsumers));
  static_assert(!kSplitKeys || sizeof(float) * kMergeFloats * 128 * (kConsumers - 1) <=
                                   std::size_t{2} * kStages * kTileBytes);
};

template <typename C>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks)
    wg_attention_kernel(const Args a, const __grid_constant__ CUtensorMap q_map,
                        const __grid_constant__ CUtensorMap k_map,
                        const __grid_constant__ CUtensorMap v_map,
                        const __grid_constant__ CUtensorMap o_map) {
#ifdef FUSEKIT_WGMMA
  using T = typename C::T;
  constexpr int kD = C::kD, kBlockN = C::kBlockN, kStages = C::kStages;
  constexpr int kColumnBlocks = kD / 64;

  extern __shared__ __align__(16) unsigned char wg_shared_raw[];
  // 1024-byte aligned in the shared window (the swizzle repeats every 1024 bytes).
  unsigned char* const base =
      wg_shared_raw + ((1024 - (shared_address(wg_shared_raw) & 1023)) & 1023);
  std::uint64_t* const full_q = reinterpret_cast<std::uint64_t*>(base + C::kBarrierOffset);
  std::uint64_t* const full_k = full_q + 1;
  std::uint64_t* const full_v = full_k + kStages;
  std::uint64_t* const empty = full_v + kStages;
  std::uint64_t* const empty_v = empty + kStages;  // kSplitRelease only
  auto key_tile = [&](int slot) { return base + C::kQueryBytes + slot * 2 * C::kTileBytes; };

  const int warp = warp_uniform(threadIdx.x / 32), lane = threadIdx.x % 32;
  // Longest first: the block index runs over (query tile from the last, sequence and head).
  const int tile = a.query_tiles - 1 - static_cast<int>(blockIdx.x / a.heads);
  const int bh = static_cast<int>(blockIdx.x % a.heads);
  const int b = bh / a.hq, h = bh % a.hq, kvh = h / a.group;
  const int m0 = tile * C::kBlockM;
  const int pad = a.padding ? min(max(a.padding[b * a.padding_stride], 0), a.t) : a.padding_all;
  const int key_end = min(a.t, m0 + C::kBlockM);
  const int key_tiles = key_end > pad ? (key_end - pad + kBlockN - 1) / kBlockN : 0;

  // The producer's copies of key tile i into its ring slot, once the slot's readers are done.
  const auto copy_key_tile = [&](int i) {
    const int slot = i % kStages;
    if (i >= kStages) mbarrier_wait(empty + slot, ((i / kStages) - 1) & 1);
    const int j0 = pad + i * kBlockN;
    unsigned char* const kt = key_tile(slot);
    mbarrier_arrive_expect_bytes(full_k + slot, C::kTileBytes);
    for (int cb = 0; cb < kColumnBlocks; ++cb) {
      tensor_copy_4d_to_shared(kt + cb * kBlockN * 128, &k_map, cb * 64, j0, kvh, b,
                               full_k + slot);
    }
    if (C::kSplitRelease && i >= kStages) mbarrier_wait(empty_v + slot, ((i / kStages) - 1) & 1);
    mbarrier_arrive_expect_bytes(full_v + slot, C::kTileBytes);
    for (int cb = 0; cb < kColumnBlocks; ++cb) {
      tensor_copy_4d_to_shared(kt + C::kTileBytes + cb * kBlockN * 128, &v_map, cb * 64, j0, kvh,
                               b, full_v + slot);
    }
  };
  // The producer thread sets up the barriers and issues the query rows and the first kStages key
  // tiles before the block's barrier (the tensor maps' fetch first, under the set-up), so that
  // the copies start as early as the block does: 0.2 us off the B1 kernel's 11.6 (H200).
  if (key_tiles > 0) {
    if (warp == C::kProducerWarp && lane == 0) {
      prefetch_tensor_map(&q_map);
      prefetch_tensor_map(&k_map);
      prefetch_tensor_map(&v_map);
      mbarrier_init(full_q, 1);
      for (int s = 0; s < kStages; ++s) {
        mbarrier_init(full_k + s, 1);
        mbarrier_init(full_v + s, 1);
        mbarrier_init(empty + s, C::kReaderWarps);
        if (C::kSplitRelease) mbarrier_init(empty_v + s, C::kReaderWarps);
      }
      mbarrier_init_fence();
      mbarrier_arrive_expect_bytes(full_q, C::kQueryBytes);
      for (int cb = 0; cb < kColumnBlocks; ++cb) {
        tensor_copy_4d_to_shared(base + cb * C::kBlockM * 128, &q_map, cb * 64, m0, h, b, full_q);
      }
      for (int i = 0; i < min(key_tiles, kStages); ++i) copy_key_tile(i);
    }
    if (threadIdx.x < 128) {
      constexpr std::uint32_t kOnePair = std::is_same_v<T, __half> ? 0x3C003C00u : 0x3F803F80u;
      for (std::uint32_t i = threadIdx.x; i < C::kOnesBytes / 4; i += 128) {
        reinterpret_cast<std::uint32_t*>(base + C::kOnesOffset)[i] = kOnePair;
      }
      fence_proxy_async_shared();  // for the tensor cores
    }
    __syncthreads();  // the barriers are set up, the ones written
  }

  if (warp == C::kProducerWarp) {
    if (lane == 0) {
      for (int i = kStages; i < key_tiles; ++i) copy_key_tile(i);
    }
    return;
  }

  const int wg = warp / 4, wg_warp = warp % 4, wg_tid = threadIdx.x % 128;
  const int g = lane >> 2, t4 = lane & 3;
  const int wg_row0 = m0 + (C::kSplitKeys ? 0 : 64 * wg);  // the warpgroup's first query row
  const int warp_row0 = wg_row0 + 16 * wg_warp;

  float o[kD / 2] = {};  // columns 8 n + 2 t4 + (e & 1) of rows g + 8 (e >> 1): o[4 n + e]
  // The running max m (log2 units) may lag the row's own by up to kLazyRescaleLog2 (softmax_row),
  // so the row's largest weight need not be 1, and P V takes it rounded. l sums P as rounded, so
  // that out = P V / l weighs the values in P's own proportions (with l over the unrounded
  // exponentials a peaked row's out took that rounding whole: on the H200 the largest errors
  // were 1.6 times SDPA's, at T = 4096 with scores ~ N(0, 16)). The tensor cores sum it, as
  // P times columns of ones beside P V (at D = 64 in the same product, N = 72; at 128 in k16 n8
  // products of their own): l_mma holds rows g and g + 8 (elements 0 and 2) whole in every lane
  // of the quad. The lse takes l_exp, the float32 exponentials' sum, kept only when it is asked
  // for.
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f}, l_exp[2] = {0.0f, 0.0f};
  float l_mma[4] = {};
  const std::uint64_t ones_desc = ones_descriptor(base + C::kOnesOffset);  // D = 128

  if (key_tiles > 0) {
    const std::uint64_t q_desc =
        swizzled_descriptor(base + (C::kSplitKeys ? 0 : wg * 64 * 128));
    mbarrier_wait(full_q, 0);
    const int first = C::kSplitKeys ? wg : 0, step = C::kSplitKeys ? C::kConsumers : 1;
    const auto hand_back = [&](std::uint64_t* bar) {
      __syncwarp();
      if (lane == 0) mbarrier_arrive(bar);
    };
    for (int i = first; i < key_tiles; i += step) {
      const int slot = i % kStages;
      const std::uint32_t phase = (i / kStages) & 1;
      const int j0 = pad + i * kBlockN;
      unsigned char* const kt = key_tile(slot);
      mbarrier_wait(full_k + slot, phase);
      if (j0 <= wg_row0 + 63) {  // else the tile lies wholly after this warpgroup's rows
        float s[kBlockN / 2] = {};
        const std::uint64_t k_desc = swizzled_descriptor(kt);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kD / 16; ++kk) {
          const int cb = kk / 4, within = (kk % 4) * 32;
          wgmma_ss<T, kBlockN>(s, advance_descriptor(q_desc, cb * C::kBlockM * 128 + within),
                               advance_descriptor(k_desc, cb * kBlockN * 128 + within), kk > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(s);
        if constexpr (C::kSplitRelease) hand_back(empty + slot);  // K is read

        // Keys after a row's diagonal (the rows past the keys' range among them) get no weight:
        // key j0 + 8 n + 2 t4 + (e & 1) against row warp_row0 + g + 8 (e >> 1), with the
        // per-row part on the right so that each element's test is against a constant.
        if (j0 + kBlockN - 1 > warp_row0) {
          const int last[2] = {warp_row0 + g - j0 - 2 * t4, warp_row0 + g + 8 - j0 - 2 * t4};
#pragma unroll
          for (int n = 0; n < kBlockN / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              if (n * 8 + (e & 1) > last[e >> 1]) s[4 * n + e] = -INFINITY;
            }
          }
        }

        // Online softmax of rows g (elements 0, 1) and g + 8 (elements 2, 3). Where no lane's
        // scores pass its rows' running max by more than kLazyRescaleLog2, softmax_row would keep
        // the max and give a factor of exactly 1: the warp then takes the exponentials against
        // the running max without the quads' shuffles for the tile's max. Otherwise the output is
        // rescaled only where a row of the warp moved its max (softmax_row's kLazy).
        const auto score = [&](int r) {
          return [&s, r](int n, int e) -> float& { return s[4 * n + 2 * r + e]; };
        };
        float lane_max[2];
        bool keep = true;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          lane_max[r] = lane_row_max<kBlockN / 8, 4>(score(r));
          keep = keep && m_run[r] > -INFINITY &&
                 lane_max[r] * a.scale_log2 <= m_run[r] + kLazyRescaleLog2;
        }
        if (__all_sync(0xffffffffu, keep)) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            if (a.lse) {
              l_exp[r] += lane_row_exp_sum<kBlockN / 8, 4>(score(r), a.scale_log2, m_run[r]);
            } else {
              lane_row_exp<kBlockN / 8>(score(r), a.scale_log2, m_run[r]);
            }
          }
        } else {
          float alpha[2];
          bool moved = false;
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            alpha[r] = softmax_row<kBlockN / 8, 4, true>(lane_max[r], score(r), a.scale_log2,
                                                         m_run[r], l_exp[r], &moved);
          }
          if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
            for (int e = 0; e < 4; ++e) l_mma[e] *= alpha[e / 2];
#pragma unroll
            for (int n = 0; n < kD / 8; ++n) {
#pragma unroll
              for (int e = 0; e < 4; ++e) o[4 * n + e] *= alpha[e / 2];
            }
          }
        }

        // P as the A fragments of the k16 steps over the tile's keys.
        std::uint32_t p[kBlockN / 16][4];
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
          p[kk][0] = HalfMma<T>::pack(s[8 * kk + 0], s[8 * kk + 1]);
          p[kk][1] = HalfMma<T>::pack(s[8 * kk + 2], s[8 * kk + 3]);
          p[kk][2] = HalfMma<T>::pack(s[8 * kk + 4], s[8 * kk + 5]);
          p[kk][3] = HalfMma<T>::pack(s[8 * kk + 6], s[8 * kk + 7]);
        }
        mbarrier_wait(full_v + slot, phase);
        wgmma_fence();
        if constexpr (C::kFusedSums) {
          // V's columns, then the ones as columns 64 .. 71: the leading byte offset reaches them
          // from each k step's V rows, so it shrinks by what the start address grows.
          unsigned char* const vt = kt + C::kTileBytes;
          const std::uint64_t v_desc = mn_major_descriptor(
              vt, static_cast<std::uint32_t>(base + C::kOnesOffset - vt));
#pragma unroll
          for (int kk = 0; kk < kBlockN / 16; ++kk) {
            constexpr std::uint64_t kStep = 16 * 128 / 16;  // a k step, in 16-byte units
            wgmma_rs_n72<T>(o, l_mma, p[kk], v_desc + kk * kStep - ((kk * kStep) << 16), true);
          }
        } else {
          const std::uint64_t v_desc = mn_major_descriptor(kt + C::kTileBytes, kBlockN * 128);
#pragma unroll
          for (int kk = 0; kk < kBlockN / 16; ++kk) {
            wgmma_rs<T, kD, true>(o, p[kk], advance_descriptor(v_desc, kk * 16 * 128), true);
          }
#pragma unroll
          for (int kk = 0; kk < kBlockN / 16; ++kk) wgmma_rs<T, 8>(l_mma, p[kk], ones_desc, true);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(o);
        wgmma_fence_operands(l_mma);
        wgmma_fence_operands(p);
      } else {
        mbarrier_wait(full_v + slot, phase);
        if constexpr (C::kSplitRelease) hand_back(empty + slot);
      }
      hand_back(C::kSplitRelease ? empty_v + slot : empty + slot);
    }
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) l_run[r] = t4 == 0 ? l_mma[2 * r] : 0.0f;  // the quad's sum: l

  if constexpr (C::kSplitKeys) {
    // Warpgroups 1, 2, ... hand their states to warpgroup 0 through the (now idle) key slots,
    // and warpgroup 0 merges them in that order.
    constexpr int kLanes = 128;
    float* const merge = reinterpret_cast<float*>(key_tile(0)) + wg_tid;
    named_barrier_sync(1, 128 * C::kConsumers);
    if (wg > 0) {
      float* mine = merge + (wg - 1) * kLanes * C::kMergeFloats;
      int x = 0;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mine[kLanes * x++] = m_run[r];
        mine[kLanes * x++] = l_run[r];
        mine[kLanes * x++] = l_exp[r];
      }
#pragma unroll
      for (int e = 0; e < kD / 2; ++e) mine[kLanes * x++] = o[e];
    }
    named_barrier_sync(1, 128 * C::kConsumers);
    if (wg > 0) return;
    for (int other = 1; other < C::kConsumers; ++other) {
      const float* theirs = merge + (other - 1) * kLanes * C::kMergeFloats;
      int x = 0;
      float alpha[2], beta[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float m_other = theirs[kLanes * x++], l_other = theirs[kLanes * x++];
        const float l_exp_other = theirs[kLanes * x++];
        merge_softmax(m_run[r], l_run[r], m_other, l_other, alpha[r], beta[r]);
        l_exp[r] = l_exp[r] * alpha[r] + l_exp_other * beta[r];
      }
#pragma unroll
      for (int e = 0; e < kD / 2; ++e) {
        o[e] = o[e] * alpha[(e >> 1) & 1] + theirs[kLanes * x++] * beta[(e >> 1) & 1];
      }
    }
  }

  // Rows: out = o / l; padding rows (and rows with no key) zeros and an lse of -inf.
  T* out = static_cast<T*>(a.out) + b * a.out_stride[0] + h * a.out_stride[1];
  // Staged through the query tile's bytes, which only this warpgroup still reads (its own 64
  // rows, or the merged rows after the split keys' barrier), with a named barrier a warpgroup.
  if (a.piece_stores) {
    const int storer = C::kSplitKeys || C::kConsumers == 1 ? 0 : wg;  // of those that store
    store_rows_staged<kD, C::kBlockM>(a, out, b, h, wg_row0, pad, base + storer * 64 * 128,
                                      2 + storer, l_run, m_run, l_exp, o,
                                      a.tensor_stores ? &o_map : nullptr);
    return;
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    store_row<kD / 8>(a, out, b, h, warp_row0 + g + 8 * r, pad, t4, l_run[r], l_exp[r], m_run[r],
                      [&](int n, float (&x)[2]) {
                        x[0] = o[4 * n + 2 * r];
                        x[1] = o[4 * n + 2 * r + 1];
                      });
  }
#else
  __trap();
#endif
}

// ---------------------------------------------------------------------------------- launch

template <typename C>
void launch(Args a, int device, cudaStream_t stream) {
  static std::atomic<bool> shared_allowed[kMaxDevices];
  const auto kernel = attention_kernel<C>;
  // The largest carveout, so that two blocks fit on an SM.
  allow_shared_memory(kernel, C::kSharedBytes, device, shared_allowed, true, [&] {
    return concat(kOp, ": the kernel for q of D = ", a.d, " (B * Hq = ", a.heads, ", T = ", a.t,
                  ")");
  });
  a.query_tiles = (a.t + C::kBlockM - 1) / C::kBlockM;
  const std::int64_t blocks = static_cast<std::int64_t>(a.query_tiles) * a.heads;
  FUSEKIT_CHECK(blocks <= std::numeric_limits<int>::max(), kOp, ": B * Hq * ceil(T / ",
                C::kBlockM, ") = ", blocks, " blocks, more than one launch takes (",
                std::numeric_limits<int>::max(), ")");
  kernel<<<static_cast<unsigned>(blocks), C::kThreads, C::kSharedBytes, stream>>>(a);
  FUSEKIT_CUDA_CHECK_LAUNCH("attention_kernel");
}

// How many blocks a configuration launches.
std::int64_t blocks_of(const Args& a, int block_m) {
  return static_cast<std::int64_t>(a.heads) * ((a.t + block_m - 1) / block_m);
}

// The head dimension rounds up to 32, 64, 128 or 256 (the extra columns are zeros). Launches
// with few blocks split each block's keys between groups of warps (four groups at D <= 64, two at
// D <= 128); large ones take 128 query rows a block, so K and V are read half as often.
template <typename Mma>
void launch_head_dim(const Args& a, int device, cudaStream_t stream) {
  const std::int64_t sms = multiprocessor_count(device);
  const bool few = blocks_of(a, 64) <= 2 * sms;
  const bool many = blocks_of(a, 128) >= 2 * sms;
  constexpr bool kFloat = std::is_same_v<typename Mma::Element, float>;
  constexpr int kMT = kFloat ? 1 : 2;  // half precision: each K/V fragment serves 32 rows
  if (a.d <= 32) {
    launch<Config<Mma, 32, 1, 4, 64, 1>>(a, device, stream);
  } else if (a.d <= 64) {
    if (few) {
      launch<Config<Mma, 64, 1, 4, 32, 4>>(a, device, stream);
    } else if (many) {
      launch<Config<Mma, 64, kMT, 8 / kMT, 64, 1>>(a, device, stream);
    } else {
      launch<Config<Mma, 64, 1, 4, 64, 1>>(a, device, stream);
    }
  } else if (a.d <= 128) {
    if (few) {
      launch<Config<Mma, 128, 1, 4, 32, 2>>(a, device, stream);
    } else if (many) {
      launch<Config<Mma, 128, 1, 8, kFloat ? 32 : 64, 1>>(a, device, stream);
    } else {
      launch<Config<Mma, 128, 1, 4, kFloat ? 32 : 64, 1>>(a, device, stream);
    }
  } else {
    launch<Config<Mma, 256, 1, 4, 32, 1>>(a, device, stream);
  }
}

// The tensor maps of the warpgroup kernel; out's only where its layout fits one.
struct WgMaps {
  CUtensorMap q, k, v;
  std::optional<CUtensorMap> o;
};

// The map of q, k, v or out [B, H, T, D] (strides of b, h, t in `stride`), in boxes of 64 columns
// by `box_rows` rows of one head; empty where the layout does not fit a map.
std::optional<CUtensorMap> head_map(const CausalAttentionParams& p, const void* base,
                                    std::int64_t heads, const std::int64_t (&stride)[3],
                                    int box_rows) {
  const std::int64_t dims[4] = {p.d, p.t, heads, p.b};
  std::int64_t strides[3] = {stride[2], stride[1], stride[0]};
  // An axis of one element is never stepped along (the single-head form has zero strides): it
  // gets the stride of a dense layout.
  std::int64_t dense = p.d;
  for (int i = 0; i < 3; ++i) {
    if (dims[i + 1] == 1) strides[i] = dense;
    dense = strides[i] * dims[i + 1];
  }
  return make_tensor_map_4d(kOp, p.dtype, base, dims, strides, box_rows);
}

std::optional<WgMaps> wg_maps(const CausalAttentionParams& p, int block_m, int block_n) {
  const auto q = head_map(p, p.q, p.hq, p.q_stride, block_m);
  const auto k = head_map(p, p.k, p.hkv, p.k_stride, block_n);
  const auto v = head_map(p, p.v, p.hkv, p.v_stride, block_n);
  if (!q || !k || !v) return std::nullopt;
  return WgMaps{*q, *k, *v, head_map(p, p.out, p.hq, p.out_stride, 64)};  // a warpgroup's rows
}

template <typename C>
void launch_wg(Args a, const WgMaps& maps, int device, cudaStream_t stream) {
  static std::atomic<bool> shared_allowed[kMaxDevices];
  const auto kernel = wg_attention_kernel<C>;
  allow_shared_memory(kernel, C::kSharedBytes, device, shared_allowed, false, [&] {
    return concat(kOp, ": the warpgroup kernel for D = ", a.d);
  });
  a.query_tiles = (a.t + C::kBlockM - 1) / C::kBlockM;
  const std::int64_t blocks = static_cast<std::int64_t>(a.query_tiles) * a.heads;
  FUSEKIT_CHECK(blocks <= std::numeric_limits<int>::max(), kOp, ": B * Hq * ceil(T / ",
                C::kBlockM, ") = ", blocks, " blocks, more than one launch takes (",
                std::numeric_limits<int>::max(), ")");
  a.tensor_stores = maps.o.has_value();
  kernel<<<static_cast<unsigned>(blocks), C::kThreads, C::kSharedBytes, stream>>>(
      a, maps.q, maps.k, maps.v, maps.o.value_or(CUtensorMap{}));
  FUSEKIT_CUDA_CHECK_LAUNCH("wg_attention_kernel");
}

// The warpgroup kernel's configurations. Many blocks: blocks of one warpgroup (64 rows), four
// (D = 64) or two (D = 128, two warpgroups) to a multiprocessor. Fewer blocks than
// multiprocessors: two warpgroups split the keys of 64 rows, in tiles of 64 keys (at D = 64,
// 3% faster than tiles of 128: the last, partial tile wastes less). Returns false, launching
// nothing, where q, k and v do not fit tensor maps.
template <typename T, int kD>
bool launch_wg_head_dim(const Args& a, const CausalAttentionParams& p, int device,
                        cudaStream_t stream) {
  using Rows = std::conditional_t<kD == 64, WgConfig<T, kD, 64, 1, false, 2, 4, true>,
                                  WgConfig<T, kD, 128, 2, false, 2, 1>>;
  using Split = WgConfig<T, kD, 64, 2, true, 4>;
  const bool few = blocks_of(a, 128) < multiprocessor_count(device);
  auto run = [&](auto config) {
    using C = decltype(config);
    const std::optional<WgMaps> maps = wg_maps(p, C::kBlockM, C::kBlockN);
    if (!maps) return false;
    launch_wg<C>(a, *maps, device, stream);
    return true;
  };
  return few ? run(Split{}) : run(Rows{});
}

// Runs the warpgroup kernel where it fits; false where it does not (nothing launched).
bool try_launch_wg(const Args& a, const CausalAttentionParams& p, int device, cudaStream_t stream) {
  if (!has_warpgroup_mma(device) || (p.d != 64 && p.d != 128)) return false;
  switch (p.dtype) {
    case DType::BFloat16:
      return p.d == 64 ? launch_wg_head_dim<__nv_bfloat16, 64>(a, p, device, stream)
                       : launch_wg_head_dim<__nv_bfloat16, 128>(a, p, device, stream);
    case DType::Float16:
      return p.d == 64 ? launch_wg_head_dim<__half, 64>(a, p, device, stream)
                       : launch_wg_head_dim<__half, 128>(a, p, device, stream);
    default:
      return false;
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
  a.piece_stores = p.d % piece == 0 && aligned(p.out, 16) && strides_divisible(p.out_stride, piece);

  const cudaStream_t s = stream_on(kOp, stream, device);
  if (p.kernel != AttentionKernel::MmaSync) {
    if (try_launch_wg(a, p, device, s)) return;
    FUSEKIT_CHECK(p.kernel == AttentionKernel::Auto, kOp,
                  ": the warpgroup kernel was asked for, but it takes bfloat16 or float16 q, k and "
                  "v with D = 64 or 128, 16-byte aligned, strides of whole 16-byte pieces, on a "
                  "GPU of compute capability 9.0 with an sm_90a build; this call has ",
                  to_string(p.dtype), ", D = ", p.d, ", q, k and v ",
                  aligned(p.q, 16) && aligned(p.k, 16) && aligned(p.v, 16)
                      ? "16-byte aligned"
                      : "not all 16-byte aligned",
                  " with (b, h, t) strides q ", p.q_stride[0], ", ", p.q_stride[1], ", ",
                  p.q_stride[2], " k ", p.k_stride[0], ", ", p.k_stride[1], ", ", p.k_stride[2],
                  " v ", p.v_stride[0], ", ", p.v_stride[1], ", ", p.v_stride[2],
                  " elements, on a device that",
                  has_warpgroup_mma(device) ? " runs warpgroup MMAs" : " does not run them");
  }
  switch (p.dtype) {
    case DType::Float32:
      if (p.allow_tf32) {
        launch_head_dim<Tf32Mma<false>>(a, device, s);
      } else {
        launch_head_dim<Tf32Mma<true>>(a, device, s);
      }
      return;
    case DType::BFloat16:
      launch_head_dim<HalfMma<__nv_bfloat16>>(a, device, s);
      return;
    case DType::Float16:
      launch_head_dim<HalfMma<__half>>(a, device, s);
      return;
    default:
      throw Error(concat(kOp, ": no CUDA kernel for dtype ", to_string(p.dtype)));
  }
}

}  // namespace fusekit::detail
