// The entry points of the cheri_block family (dilated_conv_norm and its backward; the block's
// training forward, backward and inference forward): validate -> empty input returns -> pick
// backend -> launch. The five share their checks: one set of rules for x-like tensors, weights,
// their gradients, the statistics and the options.
#include "fusekit/ops/cheri_block.h"

#include <cmath>

#include "common/dispatch.h"
#include "common/validate.h"
#include "fusekit/error.h"
#include "ops/cheri_block/cheri_block_params.h"

namespace fusekit {

namespace {

struct Sizes {
  std::int64_t n = 0, l = 0, c = 0;
};

// x: [N, L, C] with L >= 1 and C >= 1, a floating dtype (its data not looked at).
Sizes check_x_shape(const char* op, const TensorView& x) {
  FUSEKIT_CHECK(x.ndim == 3, op, ": x has ", x.ndim, " dims ", x.shape_string(),
                ", expected 3 dims [N, L, C]");
  const Sizes s{x.shape[0], x.shape[1], x.shape[2]};
  FUSEKIT_CHECK(s.l >= 1 && s.c >= 1, op, ": x ", x.shape_string(), " has L = ", s.l, " and C = ",
                s.c, ", expected L >= 1 and C >= 1");
  detail::check_dtype(op, "x", x, {DType::Float32, DType::Float16, DType::BFloat16});
  return s;
}

// x as above, with data.
Sizes check_x(const char* op, const TensorView& x) {
  const Sizes s = check_x_shape(op, x);
  detail::check_data(op, "x", x);
  return s;
}

// Another [N, L, C] tensor (y, out, a gradient): x's shape, dtype and device.
void check_like_x(const char* op, const char* arg, const TensorView& t, const TensorView& x,
                  const Sizes& s) {
  detail::check_shape(op, arg, t, {{"N", s.n}, {"L", s.l}, {"C", s.c}});
  detail::check_same_dtype(op, arg, t, "x", x);
  detail::check_same_device(op, arg, t, "x", x);
  detail::check_data(op, arg, t);
}

// [N, L, C] tensors are read and written as contiguous rows of C.
void check_unit_stride_on_c(const char* op, const char* arg, const TensorView& t) {
  FUSEKIT_CHECK(t.strides[2] == 1 || t.shape[2] == 1, op, ": ", arg, " ", t.shape_string(),
                " has strides ", detail::strides_string(t),
                "; expected a unit stride on C (the last dim)");
}

// A weight: float32 or x's dtype, on x's device, with data (any strides).
void check_weight_dtype_device(const char* op, const char* arg, const TensorView& w,
                               const TensorView& x) {
  FUSEKIT_CHECK(w.dtype == DType::Float32 || w.dtype == x.dtype, op, ": ", arg, " has dtype ",
                to_string(w.dtype), ", expected float32 or x's dtype ", to_string(x.dtype));
  detail::check_same_device(op, arg, w, "x", x);
  detail::check_data(op, arg, w);
}

void check_conv_weight(const char* op, const char* arg, const TensorView& w, const TensorView& x,
                       const Sizes& s) {
  detail::check_shape(op, arg, w, {{"3", 3}, {"C", s.c}});
  check_weight_dtype_device(op, arg, w, x);
}

// linear1 [E C, C] and linear2 [C, E C] (their data not looked at); returns E C (the hidden
// width, >= 1).
std::int64_t check_linear_shapes(const char* op, const CheriBlockWeights& w, const Sizes& s) {
  const TensorView& w1 = w.linear1_weight;
  FUSEKIT_CHECK(w1.ndim == 2, op, ": weights.linear1_weight has ", w1.ndim, " dims ",
                w1.shape_string(), ", expected 2 dims [E C, C]");
  const std::int64_t hidden = w1.shape[0];
  FUSEKIT_CHECK(hidden >= 1, op, ": weights.linear1_weight ", w1.shape_string(),
                " has E C = 0 rows, expected E C >= 1");
  detail::check_shape(op, "weights.linear1_weight", w1, {{"E C", hidden}, {"C", s.c}});
  detail::check_shape(op, "weights.linear2_weight", w.linear2_weight,
                      {{"C", s.c}, {"E C", hidden}});
  return hidden;
}

// The linear weights as above, each float32 or x's dtype, on x's device, with data.
std::int64_t check_linear_weights(const char* op, const CheriBlockWeights& w, const TensorView& x,
                                  const Sizes& s) {
  const std::int64_t hidden = check_linear_shapes(op, w, s);
  check_weight_dtype_device(op, "weights.linear1_weight", w.linear1_weight, x);
  check_weight_dtype_device(op, "weights.linear2_weight", w.linear2_weight, x);
  return hidden;
}

// A weight's gradient: the weight's shape and dtype, on x's device.
void check_weight_grad(const char* op, const char* arg, const TensorView& g, const char* w_arg,
                       const TensorView& w, const TensorView& x, const char* rows,
                       const char* cols) {
  detail::check_shape(op, arg, g, {{rows, w.shape[0]}, {cols, w.shape[1]}});
  FUSEKIT_CHECK(g.dtype == w.dtype, op, ": ", arg, " has dtype ", to_string(g.dtype), " but ",
                w_arg, " has ", to_string(w.dtype), "; expected the weight's dtype");
  detail::check_same_device(op, arg, g, "x", x);
  detail::check_data(op, arg, g);
}

// mean or rstd: [N] float32 on x's device.
void check_stat(const char* op, const char* arg, const TensorView& t, const TensorView& x,
                const Sizes& s) {
  detail::check_shape(op, arg, t, {{"N", s.n}});
  detail::check_dtype(op, arg, t, {DType::Float32});
  detail::check_same_device(op, arg, t, "x", x);
  detail::check_data(op, arg, t);
}

void check_conv_options(const char* op, std::int64_t dilation, double eps) {
  FUSEKIT_CHECK(dilation >= 1, op, ": options.dilation is ", dilation, ", expected >= 1");
  detail::check_eps(op, eps);
}

void check_block_options(const char* op, const CheriBlockOptions& options) {
  check_conv_options(op, options.dilation, options.eps);
  const double scale = options.residual_scale;
  FUSEKIT_CHECK(std::isfinite(scale) && std::isfinite(static_cast<float>(scale)), op,
                ": options.residual_scale is ", scale,
                ", expected a finite value (within float32's range)");
}

// The rows kept for the backward (`saved`): absent, or uint8 [bytes] on x's device, contiguous,
// 16-byte aligned, where bytes (cheri_block_saved_bytes) is not 0.
void check_saved(const char* op, const TensorView& saved, const TensorView& x,
                 const CheriBlockWeights& weights, const CheriBlockOptions& options) {
  if (!detail::given(saved)) return;
  const std::int64_t bytes = cheri_block_saved_bytes(x, weights, options);
  FUSEKIT_CHECK(bytes > 0, op, ": saved was given (", saved.describe(),
                "), but this call keeps nothing for the backward (cheri_block_saved_bytes is 0); "
                "expected an empty view");
  detail::check_shape(op, "saved", saved, {{"cheri_block_saved_bytes", bytes}});
  detail::check_dtype(op, "saved", saved, {DType::UInt8});
  detail::check_same_device(op, "saved", saved, "x", x);
  detail::check_data(op, "saved", saved);
  FUSEKIT_CHECK(saved.strides[0] == 1, op, ": saved ", saved.shape_string(), " has stride ",
                saved.strides[0], ", expected a contiguous buffer");
  FUSEKIT_CHECK(reinterpret_cast<std::uintptr_t>(saved.data) % 16 == 0, op,
                ": saved starts at an address that is not a multiple of 16 bytes (",
                saved.describe(), "); expected 16-byte alignment");
}

detail::CheriActivation activation(const TensorView& t) {
  return {t.data, {t.strides[0], t.strides[1]}};
}

detail::CheriMatrix matrix(const TensorView& t) {
  return {t.data, t.dtype, {t.strides[0], t.strides[1]}};
}

detail::CheriStat stat(const TensorView& t) {
  if (!detail::given(t)) return {};
  return {t.data_as<float>(), t.strides[0]};
}

detail::CheriBlockParams base_params(const Sizes& s, const TensorView& x, std::int64_t dilation,
                                     double eps) {
  detail::CheriBlockParams p;
  p.n = s.n;
  p.l = s.l;
  p.c = s.c;
  p.dtype = x.dtype;
  p.dilation = dilation;
  p.eps = eps;
  p.x = activation(x);
  return p;
}

void set_block(detail::CheriBlockParams& p, std::int64_t hidden, const CheriBlockWeights& w,
               const CheriBlockOptions& options) {
  p.hidden = hidden;
  p.residual_scale = static_cast<float>(options.residual_scale);
  p.allow_tf32 = options.allow_tf32;
  p.conv_weight = matrix(w.conv_weight);
  p.linear1 = matrix(w.linear1_weight);
  p.linear2 = matrix(w.linear2_weight);
}

}  // namespace

void dilated_conv_norm(const TensorView& y, const TensorView& mean, const TensorView& rstd,
                       const TensorView& x, const TensorView& conv_weight,
                       const DilatedConvNormOptions& options, Stream stream) {
  constexpr const char* kOp = "dilated_conv_norm";
  const Sizes s = check_x(kOp, x);
  check_like_x(kOp, "y", y, x, s);
  check_conv_weight(kOp, "conv_weight", conv_weight, x, s);
  if (detail::given(mean)) check_stat(kOp, "mean", mean, x, s);
  if (detail::given(rstd)) check_stat(kOp, "rstd", rstd, x, s);
  check_conv_options(kOp, options.dilation, options.eps);
  detail::check_outputs(kOp, {{"y", &y}, {"mean", &mean}, {"rstd", &rstd}},
                        {{"x", &x}, {"conv_weight", &conv_weight}});
  if (s.n == 0) return;
  check_unit_stride_on_c(kOp, "x", x);
  check_unit_stride_on_c(kOp, "y", y);

  detail::CheriBlockParams p = base_params(s, x, options.dilation, options.eps);
  p.conv_weight = matrix(conv_weight);
  p.out = activation(y);
  p.mean = stat(mean);
  p.rstd = stat(rstd);
  detail::dispatch_device(
      kOp, x.device, [&] { detail::dilated_conv_norm_cpu(p); },
      [&] { detail::launch_dilated_conv_norm(p, x.device.index, stream); });
}

void dilated_conv_norm_backward(const TensorView& grad_x, const TensorView& grad_conv_weight,
                                const TensorView& grad_y, const TensorView& x,
                                const TensorView& conv_weight, const TensorView& mean,
                                const TensorView& rstd, const DilatedConvNormOptions& options,
                                Stream stream) {
  constexpr const char* kOp = "dilated_conv_norm_backward";
  const Sizes s = check_x(kOp, x);
  check_like_x(kOp, "grad_x", grad_x, x, s);
  check_like_x(kOp, "grad_y", grad_y, x, s);
  check_conv_weight(kOp, "conv_weight", conv_weight, x, s);
  check_weight_grad(kOp, "grad_conv_weight", grad_conv_weight, "conv_weight", conv_weight, x, "3",
                    "C");
  check_stat(kOp, "mean", mean, x, s);
  check_stat(kOp, "rstd", rstd, x, s);
  check_conv_options(kOp, options.dilation, options.eps);
  detail::check_outputs(kOp, {{"grad_x", &grad_x}, {"grad_conv_weight", &grad_conv_weight}},
                        {{"grad_y", &grad_y}, {"x", &x}, {"conv_weight", &conv_weight},
                         {"mean", &mean}, {"rstd", &rstd}});
  // N = 0 still has a result: grad_conv_weight, a sum over no examples, is zero.
  if (s.n != 0) {
    check_unit_stride_on_c(kOp, "grad_x", grad_x);
    check_unit_stride_on_c(kOp, "grad_y", grad_y);
    check_unit_stride_on_c(kOp, "x", x);
  }

  detail::CheriBlockParams p = base_params(s, x, options.dilation, options.eps);
  p.conv_weight = matrix(conv_weight);
  p.grad_out = activation(grad_y);
  p.saved_mean = stat(mean);
  p.saved_rstd = stat(rstd);
  p.grad_x = activation(grad_x);
  p.grad_conv_weight = matrix(grad_conv_weight);
  detail::dispatch_device(
      kOp, x.device, [&] { detail::dilated_conv_norm_backward_cpu(p); },
      [&] { detail::launch_dilated_conv_norm_backward(p, x.device.index, stream); });
}

std::int64_t cheri_block_saved_bytes(const TensorView& x, const CheriBlockWeights& weights,
                                     const CheriBlockOptions& options) {
  constexpr const char* kOp = "cheri_block_saved_bytes";
  const Sizes s = check_x_shape(kOp, x);
  const std::int64_t hidden = check_linear_shapes(kOp, weights, s);
  check_block_options(kOp, options);
  if (x.device.kind != DeviceKind::CUDA || s.n == 0) return 0;
  detail::CheriBlockParams p = base_params(s, x, options.dilation, options.eps);
  p.hidden = hidden;
  p.allow_tf32 = options.allow_tf32;
  std::int64_t bytes = 0;
  detail::dispatch_device(
      kOp, x.device, [] {},
      [&] { bytes = detail::cheri_block_saved_bytes_cuda(p, x.device.index); });
  return bytes;
}

void cheri_block(const TensorView& out, const TensorView& mean, const TensorView& rstd,
                 const TensorView& x, const CheriBlockWeights& weights,
                 const CheriBlockOptions& options, Stream stream) {
  cheri_block(out, mean, rstd, TensorView{}, x, weights, options, stream);
}

void cheri_block(const TensorView& out, const TensorView& mean, const TensorView& rstd,
                 const TensorView& saved, const TensorView& x, const CheriBlockWeights& weights,
                 const CheriBlockOptions& options, Stream stream) {
  constexpr const char* kOp = "cheri_block";
  const Sizes s = check_x(kOp, x);
  check_like_x(kOp, "out", out, x, s);
  check_stat(kOp, "mean", mean, x, s);
  check_stat(kOp, "rstd", rstd, x, s);
  check_conv_weight(kOp, "weights.conv_weight", weights.conv_weight, x, s);
  const std::int64_t hidden = check_linear_weights(kOp, weights, x, s);
  check_block_options(kOp, options);
  check_saved(kOp, saved, x, weights, options);
  detail::check_outputs(kOp, {{"out", &out}, {"mean", &mean}, {"rstd", &rstd}, {"saved", &saved}},
                        {{"x", &x},
                         {"weights.conv_weight", &weights.conv_weight},
                         {"weights.linear1_weight", &weights.linear1_weight},
                         {"weights.linear2_weight", &weights.linear2_weight}});
  if (s.n == 0) return;
  check_unit_stride_on_c(kOp, "x", x);
  check_unit_stride_on_c(kOp, "out", out);

  detail::CheriBlockParams p = base_params(s, x, options.dilation, options.eps);
  set_block(p, hidden, weights, options);
  p.out = activation(out);
  p.mean = stat(mean);
  p.rstd = stat(rstd);
  p.saved_y = saved.data;
  detail::dispatch_device(
      kOp, x.device, [&] { detail::cheri_block_cpu(p); },
      [&] { detail::launch_cheri_block(p, x.device.index, stream); });
}

void cheri_block_backward(const TensorView& grad_x, const CheriBlockWeights& grads,
                          const TensorView& grad_out, const TensorView& x,
                          const CheriBlockWeights& weights, const TensorView& mean,
                          const TensorView& rstd, const CheriBlockOptions& options,
                          Stream stream) {
  cheri_block_backward(grad_x, grads, grad_out, x, weights, mean, rstd, TensorView{}, options,
                       stream);
}

void cheri_block_backward(const TensorView& grad_x, const CheriBlockWeights& grads,
                          const TensorView& grad_out, const TensorView& x,
                          const CheriBlockWeights& weights, const TensorView& mean,
                          const TensorView& rstd, const TensorView& saved,
                          const CheriBlockOptions& options, Stream stream) {
  constexpr const char* kOp = "cheri_block_backward";
  const Sizes s = check_x(kOp, x);
  check_like_x(kOp, "grad_x", grad_x, x, s);
  check_like_x(kOp, "grad_out", grad_out, x, s);
  check_conv_weight(kOp, "weights.conv_weight", weights.conv_weight, x, s);
  check_linear_weights(kOp, weights, x, s);
  const std::int64_t hidden = weights.linear1_weight.shape[0];
  check_weight_grad(kOp, "grads.conv_weight", grads.conv_weight, "weights.conv_weight",
                    weights.conv_weight, x, "3", "C");
  check_weight_grad(kOp, "grads.linear1_weight", grads.linear1_weight, "weights.linear1_weight",
                    weights.linear1_weight, x, "E C", "C");
  check_weight_grad(kOp, "grads.linear2_weight", grads.linear2_weight, "weights.linear2_weight",
                    weights.linear2_weight, x, "C", "E C");
  check_stat(kOp, "mean", mean, x, s);
  check_stat(kOp, "rstd", rstd, x, s);
  check_block_options(kOp, options);
  check_saved(kOp, saved, x, weights, options);
  detail::check_outputs(kOp,
                        {{"grad_x", &grad_x},
                         {"grads.conv_weight", &grads.conv_weight},
                         {"grads.linear1_weight", &grads.linear1_weight},
                         {"grads.linear2_weight", &grads.linear2_weight}},
                        {{"grad_out", &grad_out},
                         {"x", &x},
                         {"weights.conv_weight", &weights.conv_weight},
                         {"weights.linear1_weight", &weights.linear1_weight},
                         {"weights.linear2_weight", &weights.linear2_weight},
                         {"mean", &mean},
                         {"rstd", &rstd},
                         {"saved", &saved}});
  // N = 0 still has a result: the weight gradients, sums over no examples, are zero.
  if (s.n != 0) {
    check_unit_stride_on_c(kOp, "grad_x", grad_x);
    check_unit_stride_on_c(kOp, "grad_out", grad_out);
    check_unit_stride_on_c(kOp, "x", x);
  }

  detail::CheriBlockParams p = base_params(s, x, options.dilation, options.eps);
  set_block(p, hidden, weights, options);
  p.grad_out = activation(grad_out);
  p.saved_mean = stat(mean);
  p.saved_rstd = stat(rstd);
  p.grad_x = activation(grad_x);
  p.grad_conv_weight = matrix(grads.conv_weight);
  p.grad_linear1 = matrix(grads.linear1_weight);
  p.grad_linear2 = matrix(grads.linear2_weight);
  p.saved_y = saved.data;
  detail::dispatch_device(
      kOp, x.device, [&] { detail::cheri_block_backward_cpu(p); },
      [&] { detail::launch_cheri_block_backward(p, x.device.index, stream); });
}

void cheri_block_inference(const TensorView& out, const TensorView& x,
                           const CheriBlockWeights& weights, const CheriBlockOptions& options,
                           Stream stream) {
  constexpr const char* kOp = "cheri_block_inference";
  const Sizes s = check_x(kOp, x);
  check_like_x(kOp, "out", out, x, s);
  check_conv_weight(kOp, "weights.conv_weight", weights.conv_weight, x, s);
  const std::int64_t hidden = check_linear_weights(kOp, weights, x, s);
  check_block_options(kOp, options);
  detail::check_outputs(kOp, {{"out", &out}},
                        {{"x", &x},
                         {"weights.conv_weight", &weights.conv_weight},
                         {"weights.linear1_weight", &weights.linear1_weight},
                         {"weights.linear2_weight", &weights.linear2_weight}});
  if (s.n == 0) return;
  check_unit_stride_on_c(kOp, "x", x);
  check_unit_stride_on_c(kOp, "out", out);

  detail::CheriBlockParams p = base_params(s, x, options.dilation, options.eps);
  set_block(p, hidden, weights, options);
  p.out = activation(out);
  detail::dispatch_device(
      kOp, x.device, [&] { detail::cheri_block_cpu(p); },
      [&] { detail::launch_cheri_block_inference(p, x.device.index, stream); });
}

}  // namespace fusekit
