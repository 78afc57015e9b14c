// What the cheri_block backends see: pointers, sizes, strides (in elements), options. One struct
// serves the five entry points; what a pass does not use stays null.
#pragma once

#include <cstdint>

#include "fusekit/ops/cheri_block.h"
#include "fusekit/tensor.h"

namespace fusekit::detail {

/// An [N, L, C] tensor of the activations' dtype: strides of (n, l); C has unit stride.
struct CheriActivation {
  void* data = nullptr;  // const for inputs
  std::int64_t stride[2] = {0, 0};
};

/// A weight ([3, C], [E C, C] or [C, E C]) or its gradient, in its own dtype, any strides.
struct CheriMatrix {
  void* data = nullptr;  // const for inputs
  DType dtype = DType::Float32;
  std::int64_t stride[2] = {0, 0};
};

/// mean or rstd [N] float32.
struct CheriStat {
  float* data = nullptr;  // const for the backward's inputs; null when not asked for
  std::int64_t stride = 0;
};

struct CheriBlockParams {
  std::int64_t n = 0, l = 0, c = 0;
  std::int64_t hidden = 0;         // E C, the rows of linear1_weight; 0 without the MLP
  DType dtype = DType::Float32;    // of every [N, L, C] tensor
  std::int64_t dilation = 1;
  double eps = 1e-3;
  float residual_scale = 0.0f;
  bool allow_tf32 = false;

  // Inputs.
  CheriActivation x;          // [N, L, C]
  CheriActivation grad_out;   // [N, L, C]: grad_out of the block, or grad_y of dilated_conv_norm
  CheriMatrix conv_weight;    // [3, C]
  CheriMatrix linear1;        // [E C, C]
  CheriMatrix linear2;        // [C, E C]
  CheriStat saved_mean, saved_rstd;  // the backward's mean and rstd

  // Outputs.
  CheriActivation out;        // [N, L, C]: out of the block, or y of dilated_conv_norm
  CheriStat mean, rstd;       // the forward's statistics (null: not written)
  // The rows the training forward keeps for the backward (cheri_block_saved_bytes; null: none):
  // y in float16 [N L, C], each row's columns in quad order. An output of the forward, an input
  // of the backward; only the CUDA backend's float32 path with TF32 writes and reads them.
  void* saved_y = nullptr;
  CheriActivation grad_x;     // [N, L, C]
  CheriMatrix grad_conv_weight, grad_linear1, grad_linear2;  // null when not computed
};

// The CPU backend.
void dilated_conv_norm_cpu(const CheriBlockParams& p);
void dilated_conv_norm_backward_cpu(const CheriBlockParams& p);
/// The block's forward, training (mean and rstd set) or inference (null): one code path.
void cheri_block_cpu(const CheriBlockParams& p);
void cheri_block_backward_cpu(const CheriBlockParams& p);

// The CUDA backend.
void launch_dilated_conv_norm(const CheriBlockParams& p, int device, Stream stream);
void launch_dilated_conv_norm_backward(const CheriBlockParams& p, int device, Stream stream);
void launch_cheri_block(const CheriBlockParams& p, int device, Stream stream);
void launch_cheri_block_backward(const CheriBlockParams& p, int device, Stream stream);
void launch_cheri_block_inference(const CheriBlockParams& p, int device, Stream stream);
/// The bytes of the rows the training forward keeps for the backward with these sizes, dtype and
/// options (only those are read), or 0 where the backward's front kernel would not read them.
std::int64_t cheri_block_saved_bytes_cuda(const CheriBlockParams& p, int device);

}  // namespace fusekit::detail
