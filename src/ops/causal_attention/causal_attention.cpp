// causal_attention entry point: validate (causal_attention_params) -> empty input returns -> pick
// backend -> launch.
#include "fusekit/ops/causal_attention.h"

#include <cmath>

#include "common/dispatch.h"
#include "common/validate.h"
#include "fusekit/error.h"
#include "ops/causal_attention/causal_attention_params.h"

namespace fusekit {

namespace {

constexpr const char* kOp = "causal_attention";

// k, v or out: as many dims as q (both forms), before any of their sizes is read.
void check_ndim(const char* arg, const TensorView& t, const TensorView& q, const char* expected) {
  FUSEKIT_CHECK(t.ndim == q.ndim, kOp, ": ", arg, " has ", t.ndim, " dims ", t.shape_string(),
                " but q has ", q.ndim, " dims ", q.shape_string(), "; expected ", arg, " ",
                expected);
}

// q, k, v or out: D is read and written as contiguous rows.
void check_unit_stride_on_d(const char* arg, const TensorView& t) {
  const int last = t.ndim - 1;
  FUSEKIT_CHECK(t.strides[last] == 1 || t.shape[last] == 1, kOp, ": ", arg, " ",
                t.shape_string(), " has strides ", detail::strides_string(t),
                "; expected a unit stride on D (the last dim)");
}

// The (b, h, t) strides of a [B, H, T, D] tensor (or an lse [B, H, T]), t_dim = 2, or of a
// [T, D] one (or an lse [T]) as a single head, t_dim = 0.
void copy_strides(std::int64_t* dst, const TensorView& t, int t_dim) {
  dst[0] = t_dim == 2 ? t.strides[0] : 0;
  dst[1] = t_dim == 2 ? t.strides[1] : 0;
  dst[2] = t.strides[t_dim];
}

// Every count of a per-sequence padding on the CPU lies in [0, T] (on CUDA the kernels clamp, so
// that the call never reads the counts back to the host).
void check_counts_on_cpu(const TensorView& counts, std::int64_t b, std::int64_t t) {
  const auto* values = counts.data_as<const std::int32_t>();
  for (std::int64_t i = 0; i < b; ++i) {
    const std::int32_t n = values[i * counts.strides[0]];
    FUSEKIT_CHECK(n >= 0 && n <= t, kOp, ": padding.per_sequence[", i, "] is ", n,
                  ", expected a count in [0, T] = [0, ", t, "]");
  }
}

}  // namespace

namespace detail {

CausalAttentionParams causal_attention_params(const TensorView& out, const TensorView& lse,
                                              const TensorView& q, const TensorView& k,
                                              const TensorView& v, const LeftPadding& padding,
                                              const CausalAttentionOptions& options) {
  // ---- shapes
  FUSEKIT_CHECK(q.ndim == 4 || q.ndim == 2, kOp, ": q has ", q.ndim, " dims ", q.shape_string(),
                ", expected 4 dims [B, Hq, T, D] or 2 dims [T, D]");
  const bool heads = q.ndim == 4;  // else the single-head form [T, D]
  const int t_dim = q.ndim - 2;
  const std::int64_t b = heads ? q.shape[0] : 1, hq = heads ? q.shape[1] : 1;
  const std::int64_t t = q.shape[t_dim], d = q.shape[t_dim + 1];
  FUSEKIT_CHECK(hq >= 1, kOp, ": q ", q.shape_string(), " has Hq = 0 heads, expected Hq >= 1");
  FUSEKIT_CHECK(d >= 1 && d <= detail::kCausalAttentionMaxHeadDim, kOp, ": q ", q.shape_string(),
                " has D = ", d, ", expected 1 <= D <= ", detail::kCausalAttentionMaxHeadDim);
  const char* kv_dims = heads ? "[B, Hkv, T, D]" : "[T, D]";
  check_ndim("k", k, q, kv_dims);
  check_ndim("v", v, q, kv_dims);
  check_ndim("out", out, q, heads ? "[B, Hq, T, D]" : "[T, D]");
  const std::int64_t hkv = heads ? k.shape[1] : 1;
  FUSEKIT_CHECK(hkv >= 1 && hq % hkv == 0, kOp, ": k ", k.shape_string(), " has Hkv = ", hkv,
                " heads, expected Hkv >= 1 dividing q's Hq = ", hq, " (grouped-query attention)");
  if (heads) {
    detail::check_shape(kOp, "k", k, {{"B", b}, {"Hkv", hkv}, {"T", t}, {"D", d}});
    detail::check_shape(kOp, "v", v, {{"B", b}, {"Hkv", hkv}, {"T", t}, {"D", d}});
    detail::check_shape(kOp, "out", out, {{"B", b}, {"Hq", hq}, {"T", t}, {"D", d}});
    if (detail::given(lse)) detail::check_shape(kOp, "lse", lse, {{"B", b}, {"Hq", hq}, {"T", t}});
  } else {
    detail::check_shape(kOp, "k", k, {{"T", t}, {"D", d}});
    detail::check_shape(kOp, "v", v, {{"T", t}, {"D", d}});
    detail::check_shape(kOp, "out", out, {{"T", t}, {"D", d}});
    if (detail::given(lse)) detail::check_shape(kOp, "lse", lse, {{"T", t}});
  }

  // ---- dtypes, devices, data
  detail::check_dtype(kOp, "q", q, {DType::BFloat16, DType::Float16, DType::Float32});
  detail::check_same_dtype(kOp, "k", k, "q", q);
  detail::check_same_dtype(kOp, "v", v, "q", q);
  detail::check_same_dtype(kOp, "out", out, "q", q);
  detail::check_same_device(kOp, "k", k, "q", q);
  detail::check_same_device(kOp, "v", v, "q", q);
  detail::check_same_device(kOp, "out", out, "q", q);
  if (detail::given(lse)) {
    detail::check_dtype(kOp, "lse", lse, {DType::Float32});
    detail::check_same_device(kOp, "lse", lse, "q", q);
  }
  detail::check_data(kOp, "q", q);
  detail::check_data(kOp, "k", k);
  detail::check_data(kOp, "v", v);

  // ---- padding and options
  const TensorView& counts = padding.per_sequence;
  const bool per_sequence = detail::given(counts);
  if (per_sequence) {
    FUSEKIT_CHECK(padding.all == 0, kOp, ": padding.all is ", padding.all,
                  " and padding.per_sequence is given; expected one of the two (padding.all = 0 "
                  "with per_sequence)");
    detail::check_shape(kOp, "padding.per_sequence", counts, {{"B", b}});
    detail::check_dtype(kOp, "padding.per_sequence", counts, {DType::Int32});
    detail::check_same_device(kOp, "padding.per_sequence", counts, "q", q);
    detail::check_data(kOp, "padding.per_sequence", counts);
    if (counts.device.kind == DeviceKind::CPU) check_counts_on_cpu(counts, b, t);
  } else {
    FUSEKIT_CHECK(padding.all >= 0 && padding.all <= t, kOp, ": padding.all is ", padding.all,
                  ", expected a count in [0, T] = [0, ", t, "]");
  }
  const double scale =
      options.scale ? *options.scale : 1.0 / std::sqrt(static_cast<double>(d));
  const auto scale_f32 = static_cast<float>(scale);  // the backends scale in float32
  FUSEKIT_CHECK(std::isfinite(scale) && scale > 0 && std::isfinite(scale_f32) && scale_f32 > 0,
                kOp, ": options.scale is ", scale,
                ", expected a finite value > 0 (and within float32's range)");

  // ---- outputs
  detail::check_outputs(kOp, {{"out", &out}, {"lse", &lse}},
                        {{"q", &q}, {"k", &k}, {"v", &v}, {"padding.per_sequence", &counts}});
  detail::CausalAttentionParams p;
  p.b = b;
  p.t = t;
  if (b == 0 || t == 0) return p;

  // ---- layouts
  check_unit_stride_on_d("q", q);
  check_unit_stride_on_d("k", k);
  check_unit_stride_on_d("v", v);
  check_unit_stride_on_d("out", out);

  p.hq = hq;
  p.hkv = hkv;
  p.t = t;
  p.d = d;
  p.dtype = q.dtype;
  p.q = q.data;
  copy_strides(p.q_stride, q, t_dim);
  p.k = k.data;
  copy_strides(p.k_stride, k, t_dim);
  p.v = v.data;
  copy_strides(p.v_stride, v, t_dim);
  p.out = out.data;
  copy_strides(p.out_stride, out, t_dim);
  if (detail::given(lse)) {
    p.lse = lse.data_as<float>();
    copy_strides(p.lse_stride, lse, t_dim);
  }
  p.padding_all = padding.all;
  if (per_sequence) {
    p.padding = counts.data_as<const std::int32_t>();
    p.padding_stride = counts.strides[0];
  }
  p.scale = scale_f32;
  p.allow_tf32 = options.allow_tf32;
  return p;
}

}  // namespace detail

void causal_attention(const TensorView& out, const TensorView& lse, const TensorView& q,
                      const TensorView& k, const TensorView& v, const LeftPadding& padding,
                      const CausalAttentionOptions& options, Stream stream) {
  const detail::CausalAttentionParams p =
      detail::causal_attention_params(out, lse, q, k, v, padding, options);
  if (p.b == 0 || p.t == 0) return;
  detail::dispatch_device(
      kOp, q.device, [&] { detail::causal_attention_cpu(p); },
      [&] { detail::launch_causal_attention(p, q.device.index, stream); });
}

}  // namespace fusekit
