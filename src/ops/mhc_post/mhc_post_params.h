// What the mhc_post kernels see: pointers, sizes and strides (in elements), nothing else.
#pragma once

#include <cstdint>

#include "fusekit/tensor.h"

namespace fusekit::detail {

/// The most streams (hc) mhc_post supports: the entry point checks it, the backends size their
/// per-row arrays and instantiate their kernels by it.
inline constexpr int kMhcPostMaxHc = 8;

struct MhcPostParams {
  std::int64_t n = 0, h = 0;
  int hc = 0;
  DType dtype = DType::Float32;           // of out, x and residual
  void* out = nullptr;                    // [N, hc, H]
  std::int64_t out_stride[3] = {};
  const void* x = nullptr;                // [N, H]
  std::int64_t x_stride[2] = {};
  const void* residual = nullptr;         // [N, hc, H]
  std::int64_t residual_stride[3] = {};
  const float* post = nullptr;            // [N, hc]
  std::int64_t post_stride[2] = {};
  const float* comb = nullptr;            // [N, hc (j), hc (i)]
  std::int64_t comb_stride[3] = {};
};

struct MhcPostBackwardParams {
  std::int64_t n = 0, h = 0;
  int hc = 0;
  DType dtype = DType::Float32;           // of grad_x, grad_residual, grad_out, x and residual
  void* grad_x = nullptr;                 // [N, H]
  std::int64_t grad_x_stride[2] = {};
  void* grad_residual = nullptr;          // [N, hc, H]
  std::int64_t grad_residual_stride[3] = {};
  float* grad_post = nullptr;             // [N, hc]
  std::int64_t grad_post_stride[2] = {};
  float* grad_comb = nullptr;             // [N, hc (j), hc (i)]
  std::int64_t grad_comb_stride[3] = {};
  const void* grad_out = nullptr;         // [N, hc, H]
  std::int64_t grad_out_stride[3] = {};
  const void* x = nullptr;                // [N, H]
  std::int64_t x_stride[2] = {};
  const void* residual = nullptr;         // [N, hc, H]
  std::int64_t residual_stride[3] = {};
  const float* post = nullptr;            // [N, hc]
  std::int64_t post_stride[2] = {};
  const float* comb = nullptr;            // [N, hc (j), hc (i)]
  std::int64_t comb_stride[3] = {};
};

void mhc_post_cpu(const MhcPostParams& p);
void mhc_post_backward_cpu(const MhcPostBackwardParams& p);

// ---- CUDA backend (mhc_post_cuda.cu) ----

/// How a forward launch is shaped: a pure function of the params and the multiprocessor count.
struct MhcPostConfig {
  enum class Path {
    Scalar,  // one element per thread, any strides
    Vector,  // 16-byte loads and stores; grid = (N, blocks_per_row)
    Bulk,    // sm_90: a persistent grid streams row tiles into shared memory with bulk copies
  };
  Path path = Path::Scalar;
  int vec = 1;                      // elements along H per thread
  int threads = 0;                  // per block
  std::int64_t blocks_per_row = 0;  // Scalar and Vector
  std::int64_t tiles_per_row = 0;   // Bulk: tiles of kBulkTileBytes per stream
  std::int64_t blocks = 0;          // Bulk: persistent blocks
};

struct MhcPostBackwardConfig {
  bool vectorized = false;
  int vec = 1;
  int threads = 0;
  std::int64_t chunks = 0;     // blocks per row; > 1 adds a fixed-order reduction pass
  std::int64_t chunk_len = 0;  // elements of H per block, a multiple of vec
};

MhcPostConfig select_mhc_post_config(const MhcPostParams& p, int multiprocessors, int sm_major);
MhcPostBackwardConfig select_mhc_post_backward_config(const MhcPostBackwardParams& p,
                                                      int multiprocessors);
void launch_mhc_post(const MhcPostParams& p, int device, Stream stream);
void launch_mhc_post_backward(const MhcPostBackwardParams& p, int device, Stream stream);

}  // namespace fusekit::detail
