// What the causal_attention backends see: pointers, sizes, strides (in elements), options.
#pragma once

#include <cstdint>

#include "fusekit/ops/causal_attention.h"
#include "fusekit/tensor.h"

namespace fusekit::detail {

inline constexpr std::int64_t kCausalAttentionMaxHeadDim = 256;

/// The CUDA kernel a call runs: Auto picks the warpgroup kernel where it fits (sm_90a on a GPU of
/// compute capability 9.0, bfloat16 or float16, D = 64 or 128, and q, k and v that tensor maps
/// describe: 16-byte aligned, strides of whole 16-byte pieces), else the mma.sync kernel. Naming
/// the warpgroup kernel where it does not fit is an error.
enum class AttentionKernel { Auto, MmaSync, Warpgroup };

struct CausalAttentionParams {
  // The single-head form [T, D] arrives as b = hq = hkv = 1 with zero batch and head strides.
  std::int64_t b = 0, hq = 0, hkv = 0, t = 0, d = 0;
  DType dtype = DType::Float32;  // of q, k, v and out

  // Strides of (b, h, t); D is the unit-stride axis of each.
  const void* q = nullptr;  // [B, Hq, T, D]
  std::int64_t q_stride[3] = {0, 0, 0};
  const void* k = nullptr;  // [B, Hkv, T, D]
  std::int64_t k_stride[3] = {0, 0, 0};
  const void* v = nullptr;  // [B, Hkv, T, D]
  std::int64_t v_stride[3] = {0, 0, 0};
  void* out = nullptr;      // [B, Hq, T, D]
  std::int64_t out_stride[3] = {0, 0, 0};
  float* lse = nullptr;     // [B, Hq, T] float32, or null when not asked for
  std::int64_t lse_stride[3] = {0, 0, 0};

  // Left padding: `padding[b * padding_stride]` tokens of sequence b when `padding` is set (int32
  // [B] on the tensors' device; on the CPU already checked to lie in [0, T], on CUDA to be clamped
  // there), else `padding_all` (in [0, T]) for every sequence.
  std::int64_t padding_all = 0;
  const std::int32_t* padding = nullptr;
  std::int64_t padding_stride = 0;

  float scale = 1.0f;  // of the scores
  bool allow_tf32 = false;
  AttentionKernel kernel = AttentionKernel::Auto;  // CUDA only

  /// Query heads per key/value head: query head h reads key/value head h / group().
  std::int64_t group() const { return hq / hkv; }
};

/// Validates a call of fusekit::causal_attention and describes it; an empty input (B or T of 0)
/// comes back with b or t 0 and nothing else filled in.
CausalAttentionParams causal_attention_params(const TensorView& out, const TensorView& lse,
                                              const TensorView& q, const TensorView& k,
                                              const TensorView& v, const LeftPadding& padding,
                                              const CausalAttentionOptions& options);

void causal_attention_cpu(const CausalAttentionParams& p);
void launch_causal_attention(const CausalAttentionParams& p, int device, Stream stream);

}  // namespace fusekit::detail
