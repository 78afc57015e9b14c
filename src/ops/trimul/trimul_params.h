// What the trimul backends see: pointers, sizes, strides (in elements), options.
#pragma once

#include <cstdint>

#include "fusekit/ops/trimul.h"
#include "fusekit/tensor.h"

namespace fusekit::detail {

/// One weight: a vector (stride[0]) or a matrix (stride[0] between rows, stride[1] along a row).
struct TrimulWeight {
  const void* data = nullptr;
  DType dtype = DType::Float32;
  std::int64_t stride[2] = {0, 0};
};

/// The five [H, C] projections in the order the backends pack them.
enum TrimulProjection { kLeftProj, kRightProj, kLeftGate, kRightGate, kOutGate, kProjections };

/// Which CUDA kernel computes the five projections. Auto: the warpgroup kernel where it fits
/// (sm_90a builds on compute capability 9.0, rows of x 16-byte aligned and evenly spaced, C up
/// to kWgProjectMaxC), else the mma.sync kernel, which takes every call. Naming one that does
/// not fit is an error (for tests and benchmarks).
enum class TrimulProjectKernel { Auto, MmaSync, Warpgroup };

struct TrimulParams {
  std::int64_t b = 0, n = 0, c = 0, h = 0;
  DType dtype = DType::Float32;  // of x and out

  const void* x = nullptr;  // [B, N, N, C], stride 1 on C
  std::int64_t x_stride[3] = {0, 0, 0};  // b, i, j
  void* out = nullptr;      // [B, N, N, C], stride 1 on C
  std::int64_t out_stride[3] = {0, 0, 0};
  const void* mask = nullptr;  // [B, N, N] or null
  DType mask_dtype = DType::Float32;
  std::int64_t mask_stride[3] = {0, 0, 0};

  TrimulWeight norm_weight, norm_bias;    // [C]
  TrimulWeight proj[kProjections];        // [H, C] each
  TrimulWeight to_out_norm_weight, to_out_norm_bias;  // [H]
  TrimulWeight to_out;                    // [C, H]

  TrimulDirection direction = TrimulDirection::Outgoing;
  float eps = 1e-5f;
  TrimulProjectKernel project_kernel = TrimulProjectKernel::Auto;

  /// Rows of x and out: B * N * N.
  std::int64_t rows() const { return b * n * n; }
};

/// Validates a call (as fusekit::trimul does) and describes it; b == 0 or n == 0 means there is
/// nothing to compute.
TrimulParams trimul_params(const TensorView& out, const TensorView& x, const TensorView& mask,
                           const TrimulWeights& weights, const TrimulOptions& options);
void trimul_cpu(const TrimulParams& p);
void launch_trimul(const TrimulParams& p, int device, Stream stream);

}  // namespace fusekit::detail
