// layernorm_linear_gelu entry point: validate -> empty input returns -> pick backend -> launch.
#include "fusekit/ops/layernorm_linear_gelu.h"

#include "common/dispatch.h"
#include "common/validate.h"
#include "fusekit/error.h"
#include "ops/layernorm_linear_gelu/layernorm_linear_gelu_params.h"

namespace fusekit {

namespace {

constexpr const char* kOp = "layernorm_linear_gelu";

// The row stride of the leading dims [0, lead_ndim) of t when they collapse to one (row-major
// order, size-1 dims ignored); -1 when they do not.
std::int64_t collapsed_row_stride(const TensorView& t, int lead_ndim, std::int64_t inner) {
  std::int64_t stride = -1, expected = -1;  // expected: the stride the next outer dim must have
  for (int d = lead_ndim - 1; d >= 0; --d) {
    if (t.shape[d] == 1) continue;
    if (stride < 0) {
      stride = t.strides[d];
    } else if (t.strides[d] != expected) {
      return -1;
    }
    expected = t.strides[d] * t.shape[d];
  }
  return stride < 0 ? inner : stride;  // at most one row: any stride will do
}

// ln_weight / ln_bias: [K], x's dtype or float32.
void check_ln_param(const char* arg, const TensorView& t, const TensorView& x, std::int64_t k) {
  detail::check_shape(kOp, arg, t, {{"K", k}});
  if (x.dtype == DType::Float32) {
    detail::check_dtype(kOp, arg, t, {DType::Float32});
  } else {
    detail::check_dtype(kOp, arg, t, {x.dtype, DType::Float32});
  }
  detail::check_same_device(kOp, arg, t, "x", x);
  detail::check_data(kOp, arg, t);
}

}  // namespace

namespace detail {

LayerNormLinearGeluParams layernorm_linear_gelu_params(const TensorView& out, const TensorView& x,
                                                       const TensorView& weight,
                                                       const TensorView& bias,
                                                       const TensorView& ln_weight,
                                                       const TensorView& ln_bias,
                                                       const LayerNormLinearGeluOptions& options) {
  // ---- shapes
  FUSEKIT_CHECK(x.ndim >= 1, kOp, ": x has 0 dims, expected [..., K]");
  const int lead = x.ndim - 1;
  const std::int64_t k = x.shape[lead];
  FUSEKIT_CHECK(k >= 1, kOp, ": x ", x.shape_string(),
                " has K = 0 features; LayerNorm needs K >= 1");
  FUSEKIT_CHECK(weight.ndim == 2, kOp, ": weight has ", weight.ndim, " dims ",
                weight.shape_string(), ", expected 2 dims [Nout, K]");
  const std::int64_t nout = weight.shape[0];
  detail::check_shape(kOp, "weight", weight, {{"Nout", nout}, {"K", k}});
  std::int64_t m = 1;
  for (int d = 0; d < lead; ++d) m *= x.shape[d];
  FUSEKIT_CHECK(out.ndim == x.ndim, kOp, ": out ", out.shape_string(), " has ", out.ndim,
                " dims, expected ", x.ndim, " (x's leading dims, then Nout = ", nout, ")");
  for (int d = 0; d < lead; ++d) {
    FUSEKIT_CHECK(out.shape[d] == x.shape[d], kOp, ": out ", out.shape_string(), " has size ",
                  out.shape[d], " in dim ", d, ", expected ", x.shape[d], " (x is ",
                  x.shape_string(), ")");
  }
  FUSEKIT_CHECK(out.shape[lead] == nout, kOp, ": out ", out.shape_string(), " has ",
                out.shape[lead], " features in its last dim, expected Nout = ", nout,
                " (weight is ", weight.shape_string(), ")");
  if (detail::given(bias)) detail::check_shape(kOp, "bias", bias, {{"Nout", nout}});

  // ---- dtypes, devices, data
  detail::check_dtype(kOp, "x", x, {DType::BFloat16, DType::Float16, DType::Float32});
  detail::check_same_dtype(kOp, "weight", weight, "x", x);
  detail::check_same_dtype(kOp, "out", out, "x", x);
  detail::check_same_device(kOp, "weight", weight, "x", x);
  detail::check_same_device(kOp, "out", out, "x", x);
  detail::check_data(kOp, "x", x);
  detail::check_data(kOp, "weight", weight);
  if (detail::given(bias)) {
    detail::check_same_dtype(kOp, "bias", bias, "x", x);
    detail::check_same_device(kOp, "bias", bias, "x", x);
    detail::check_data(kOp, "bias", bias);
  }
  if (detail::given(ln_weight)) check_ln_param("ln_weight", ln_weight, x, k);
  if (detail::given(ln_bias)) check_ln_param("ln_bias", ln_bias, x, k);
  detail::check_eps(kOp, options.eps);
  FUSEKIT_CHECK(options.approximate == GeluApproximation::Tanh ||
                    options.approximate == GeluApproximation::None,
                kOp, ": options.approximate is ", static_cast<int>(options.approximate),
                ", expected GeluApproximation::Tanh or GeluApproximation::None");

  // ---- layouts (the matrix product reads weight and writes out through leading dimensions)
  detail::check_outputs(kOp, {{"out", &out}},
                        {{"x", &x}, {"weight", &weight}, {"bias", &bias}, {"ln_weight", &ln_weight},
                         {"ln_bias", &ln_bias}});
  if (m == 0 || nout == 0) {  // nothing to compute (the layouts of empty tensors do not matter)
    LayerNormLinearGeluParams empty;
    empty.m = m;
    empty.nout = nout;
    return empty;
  }

  const std::int64_t out_row_stride = collapsed_row_stride(out, lead, nout);
  FUSEKIT_CHECK((out.strides[lead] == 1 || nout == 1) && out_row_stride >= nout, kOp, ": out ",
                out.shape_string(), " has strides ", detail::strides_string(out),
                "; expected a contiguous last dim and leading dims that collapse to one row "
                "stride >= Nout (as a row-major matrix with padded rows)");
  const bool w_row_major = weight.strides[1] == 1 || k == 1;
  const bool w_col_major = weight.strides[0] == 1 || nout == 1;
  FUSEKIT_CHECK(w_row_major || w_col_major, kOp, ": weight ", weight.shape_string(),
                " has strides ", detail::strides_string(weight),
                "; expected a unit stride on one axis (a row-major [Nout, K] or the transpose of a "
                "row-major [K, Nout])");
  FUSEKIT_CHECK(weight.strides[0] >= 0 && weight.strides[1] >= 0, kOp, ": weight has strides ",
                detail::strides_string(weight), "; expected non-negative strides");
  if (detail::given(bias)) {
    FUSEKIT_CHECK(bias.strides[0] == 1 || nout == 1, kOp, ": bias has stride ", bias.strides[0],
                  ", expected a contiguous [Nout] vector");
  }

  detail::LayerNormLinearGeluParams p;
  p.m = m;
  p.k = k;
  p.nout = nout;
  p.dtype = x.dtype;
  p.x = x.data;
  p.x_row_stride = collapsed_row_stride(x, lead, k);
  p.x_lead_ndim = lead;
  for (int d = 0; d < lead; ++d) {
    p.x_lead_shape[d] = x.shape[d];
    p.x_lead_stride[d] = x.strides[d];
  }
  p.x_k_stride = x.strides[lead];
  p.weight = weight.data;
  if (w_row_major) {  // a row-major [Nout, K]; with K == 1 the column is contiguous either way
    p.w_stride_k = 1;
    p.w_stride_n = (nout == 1) ? k : weight.strides[0];
  } else {
    p.w_stride_n = 1;
    p.w_stride_k = weight.strides[1];
  }
  FUSEKIT_CHECK(p.w_stride_k == 1 ? p.w_stride_n >= k : p.w_stride_k >= nout, kOp, ": weight ",
                weight.shape_string(), " has strides ", detail::strides_string(weight),
                "; its rows overlap (expected the strided axis to step past the contiguous one)");
  p.bias = detail::given(bias) ? bias.data : nullptr;
  if (detail::given(ln_weight)) {
    p.ln_weight = ln_weight.data;
    p.ln_weight_stride = ln_weight.strides[0];
    p.ln_weight_dtype = ln_weight.dtype;
  }
  if (detail::given(ln_bias)) {
    p.ln_bias = ln_bias.data;
    p.ln_bias_stride = ln_bias.strides[0];
    p.ln_bias_dtype = ln_bias.dtype;
  }
  p.out = out.data;
  p.out_row_stride = out_row_stride;
  p.eps = static_cast<float>(options.eps);
  p.approximate = options.approximate;
  p.allow_tf32 = options.allow_tf32;
  p.device = x.device;
  return p;
}

}  // namespace detail

void layernorm_linear_gelu(const TensorView& out, const TensorView& x, const TensorView& weight,
                           const TensorView& bias, const TensorView& ln_weight,
                           const TensorView& ln_bias, const LayerNormLinearGeluOptions& options,
                           Stream stream) {
  const detail::LayerNormLinearGeluParams p =
      detail::layernorm_linear_gelu_params(out, x, weight, bias, ln_weight, ln_bias, options);
  if (p.m == 0 || p.nout == 0) return;
  detail::dispatch_device(
      kOp, p.device, [&] { detail::layernorm_linear_gelu_cpu(p); },
      [&] { detail::launch_layernorm_linear_gelu(p, p.device.index, stream); });
}

}  // namespace fusekit
