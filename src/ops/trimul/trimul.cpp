// trimul entry point: validate -> empty input returns -> pick backend -> launch.
#include "fusekit/ops/trimul.h"


#include "common/dispatch.h"
#include "common/validate.h"
#include "fusekit/error.h"
#include "ops/trimul/trimul_params.h"

namespace fusekit {

namespace {

constexpr const char* kOp = "trimul";

// A weight: the given shape, float32 or x's dtype, on x's device, with data.
detail::TrimulWeight check_weight(const char* arg, const TensorView& t, const TensorView& x,
                                  std::initializer_list<detail::Dim> dims) {
  FUSEKIT_CHECK(detail::given(t), kOp, ": weights.", arg, " is missing (an empty TensorView)");
  detail::check_shape(kOp, arg, t, dims);
  if (x.dtype == DType::Float32) {
    detail::check_dtype(kOp, arg, t, {DType::Float32});
  } else {
    detail::check_dtype(kOp, arg, t, {x.dtype, DType::Float32});
  }
  detail::check_same_device(kOp, arg, t, "x", x);
  detail::check_data(kOp, arg, t);
  detail::TrimulWeight w;
  w.data = t.data;
  w.dtype = t.dtype;
  w.stride[0] = t.strides[0];
  w.stride[1] = t.ndim > 1 ? t.strides[1] : 0;
  return w;
}

// x or out: [B, N, N, C] with a contiguous last axis.
void check_rows(const char* arg, const TensorView& t) {
  FUSEKIT_CHECK(t.strides[3] == 1 || t.shape[3] == 1, kOp, ": ", arg, " ", t.shape_string(),
                " has strides ", detail::strides_string(t),
                "; expected a contiguous last axis (stride 1 on C)");
}

}  // namespace

namespace detail {

TrimulParams trimul_params(const TensorView& out, const TensorView& x, const TensorView& mask,
                           const TrimulWeights& weights, const TrimulOptions& options) {
  // ---- shapes
  FUSEKIT_CHECK(x.ndim == 4, kOp, ": x has ", x.ndim, " dims ", x.shape_string(),
                ", expected 4 dims [B, N, N, C]");
  const std::int64_t b = x.shape[0], n = x.shape[1], c = x.shape[3];
  FUSEKIT_CHECK(x.shape[2] == n, kOp, ": x ", x.shape_string(),
                " is not square in its middle dims, expected [B, N, N, C]");
  FUSEKIT_CHECK(c >= 1, kOp, ": x ", x.shape_string(), " has C = 0 channels, expected C >= 1");
  FUSEKIT_CHECK(detail::given(weights.left_proj), kOp,
                ": weights.left_proj is missing (an empty TensorView)");
  FUSEKIT_CHECK(weights.left_proj.ndim == 2, kOp, ": weights.left_proj has ",
                weights.left_proj.ndim, " dims ",
                weights.left_proj.shape_string(), ", expected 2 dims [H, C]");
  const std::int64_t h = weights.left_proj.shape[0];
  FUSEKIT_CHECK(h >= 1, kOp, ": weights.left_proj ", weights.left_proj.shape_string(),
                " has H = 0 rows, expected H >= 1");
  detail::check_shape(kOp, "out", out, {{"B", b}, {"N", n}, {"N", n}, {"C", c}});
  if (detail::given(mask)) detail::check_shape(kOp, "mask", mask, {{"B", b}, {"N", n}, {"N", n}});

  // ---- dtypes, devices, data
  detail::check_dtype(kOp, "x", x, {DType::BFloat16, DType::Float16, DType::Float32});
  detail::check_same_dtype(kOp, "out", out, "x", x);
  detail::check_same_device(kOp, "out", out, "x", x);
  detail::check_data(kOp, "x", x);
  detail::TrimulParams p;
  if (detail::given(mask)) {
    detail::check_dtype(kOp, "mask", mask,
                        {DType::Float32, DType::Float16, DType::BFloat16, DType::Bool,
                         DType::UInt8});
    detail::check_same_device(kOp, "mask", mask, "x", x);
    detail::check_data(kOp, "mask", mask);
    p.mask = mask.data;
    p.mask_dtype = mask.dtype;
    for (int d = 0; d < 3; ++d) p.mask_stride[d] = mask.strides[d];
  }
  const detail::Dim dc{"C", c}, dh{"H", h};
  p.norm_weight = check_weight("norm_weight", weights.norm_weight, x, {dc});
  p.norm_bias = check_weight("norm_bias", weights.norm_bias, x, {dc});
  p.proj[detail::kLeftProj] = check_weight("left_proj", weights.left_proj, x, {dh, dc});
  p.proj[detail::kRightProj] = check_weight("right_proj", weights.right_proj, x, {dh, dc});
  p.proj[detail::kLeftGate] = check_weight("left_gate", weights.left_gate, x, {dh, dc});
  p.proj[detail::kRightGate] = check_weight("right_gate", weights.right_gate, x, {dh, dc});
  p.proj[detail::kOutGate] = check_weight("out_gate", weights.out_gate, x, {dh, dc});
  p.to_out_norm_weight = check_weight("to_out_norm_weight", weights.to_out_norm_weight, x, {dh});
  p.to_out_norm_bias = check_weight("to_out_norm_bias", weights.to_out_norm_bias, x, {dh});
  p.to_out = check_weight("to_out", weights.to_out, x, {dc, dh});
  detail::check_eps(kOp, options.eps);
  FUSEKIT_CHECK(options.direction == TrimulDirection::Outgoing ||
                    options.direction == TrimulDirection::Incoming,
                kOp, ": options.direction is ", static_cast<int>(options.direction),
                ", expected TrimulDirection::Outgoing or TrimulDirection::Incoming");

  // ---- layouts
  detail::check_outputs(kOp, {{"out", &out}},
                        {{"x", &x},
                         {"mask", &mask},
                         {"norm_weight", &weights.norm_weight},
                         {"norm_bias", &weights.norm_bias},
                         {"left_proj", &weights.left_proj},
                         {"right_proj", &weights.right_proj},
                         {"left_gate", &weights.left_gate},
                         {"right_gate", &weights.right_gate},
                         {"out_gate", &weights.out_gate},
                         {"to_out_norm_weight", &weights.to_out_norm_weight},
                         {"to_out_norm_bias", &weights.to_out_norm_bias},
                         {"to_out", &weights.to_out}});
  if (b == 0 || n == 0) return p;
  check_rows("x", x);
  check_rows("out", out);

  p.b = b;
  p.n = n;
  p.c = c;
  p.h = h;
  p.dtype = x.dtype;
  p.x = x.data;
  p.out = out.data;
  for (int d = 0; d < 3; ++d) {
    p.x_stride[d] = x.strides[d];
    p.out_stride[d] = out.strides[d];
  }
  p.direction = options.direction;
  p.eps = static_cast<float>(options.eps);
  return p;
}

}  // namespace detail

void trimul(const TensorView& out, const TensorView& x, const TensorView& mask,
            const TrimulWeights& weights, const TrimulOptions& options, Stream stream) {
  const detail::TrimulParams p = detail::trimul_params(out, x, mask, weights, options);
  if (p.b == 0 || p.n == 0) return;
  detail::dispatch_device(
      kOp, x.device, [&] { detail::trimul_cpu(p); },
      [&] { detail::launch_trimul(p, x.device.index, stream); });
}

}  // namespace fusekit
