// mhc_post entry points: validate -> empty input returns -> pick backend -> launch.
#include "fusekit/ops/mhc_post.h"

#include "common/dispatch.h"
#include "common/validate.h"
#include "fusekit/error.h"
#include "ops/mhc_post/mhc_post_params.h"

namespace fusekit {

namespace {

using detail::Dim;

struct Sizes {
  std::int64_t n, hc, h;
};

void copy_strides(std::int64_t* dst, const TensorView& t, int ndim) {
  for (int d = 0; d < ndim; ++d) dst[d] = t.strides[d];
}

// post_layer_mix and its gradient: [N, hc] or [N, hc, 1].
void check_mix_shape(const char* op, const char* arg, const TensorView& t, const Sizes& s) {
  if (t.ndim == 3) {
    detail::check_shape(op, arg, t, {{"N", s.n}, {"hc", s.hc}, {"1", 1}});
  } else {
    detail::check_shape(op, arg, t, {{"N", s.n}, {"hc", s.hc}});
  }
}

// The inputs shared by the forward and the backward; returns N, hc and H.
Sizes check_inputs(const char* op, const TensorView& x, const TensorView& residual,
                   const TensorView& post, const TensorView& comb) {
  FUSEKIT_CHECK(residual.ndim == 3, op, ": residual has ", residual.ndim, " dims ",
                residual.shape_string(), ", expected 3 dims [N, hc, H]");
  const Sizes s{residual.shape[0], residual.shape[1], residual.shape[2]};
  FUSEKIT_CHECK(s.hc >= 1 && s.hc <= detail::kMhcPostMaxHc, op, ": residual ",
                residual.shape_string(), " has hc = ", s.hc, " streams, expected 1 <= hc <= ",
                detail::kMhcPostMaxHc);
  detail::check_shape(op, "x", x, {{"N", s.n}, {"H", s.h}});
  check_mix_shape(op, "post_layer_mix", post, s);
  detail::check_shape(op, "comb_res_mix", comb, {{"N", s.n}, {"hc", s.hc}, {"hc", s.hc}});

  detail::check_dtype(op, "x", x, {DType::BFloat16, DType::Float16, DType::Float32});
  detail::check_same_dtype(op, "residual", residual, "x", x);
  detail::check_dtype(op, "post_layer_mix", post, {DType::Float32});
  detail::check_dtype(op, "comb_res_mix", comb, {DType::Float32});

  detail::check_same_device(op, "residual", residual, "x", x);
  detail::check_same_device(op, "post_layer_mix", post, "x", x);
  detail::check_same_device(op, "comb_res_mix", comb, "x", x);
  for (auto [name, t] : {std::pair{"x", &x}, {"residual", &residual}, {"post_layer_mix", &post},
                         {"comb_res_mix", &comb}}) {
    detail::check_data(op, name, *t);
  }
  return s;
}

// The fields the forward and backward params share: sizes and the four inputs.
template <typename Params>
void set_inputs(Params& p, const Sizes& s, const TensorView& x, const TensorView& residual,
                const TensorView& post, const TensorView& comb) {
  p.n = s.n;
  p.h = s.h;
  p.hc = static_cast<int>(s.hc);
  p.dtype = x.dtype;
  p.x = x.data;
  copy_strides(p.x_stride, x, 2);
  p.residual = residual.data;
  copy_strides(p.residual_stride, residual, 3);
  p.post = post.data_as<const float>();
  copy_strides(p.post_stride, post, 2);
  p.comb = comb.data_as<const float>();
  copy_strides(p.comb_stride, comb, 3);
}

}  // namespace

void mhc_post(const TensorView& out, const TensorView& x, const TensorView& residual,
              const TensorView& post_layer_mix, const TensorView& comb_res_mix, Stream stream) {
  constexpr const char* op = "mhc_post";
  const Sizes s = check_inputs(op, x, residual, post_layer_mix, comb_res_mix);
  detail::check_shape(op, "out", out, {{"N", s.n}, {"hc", s.hc}, {"H", s.h}});
  detail::check_same_dtype(op, "out", out, "x", x);
  detail::check_same_device(op, "out", out, "x", x);
  detail::check_writable(op, "out", out);
  for (auto [name, t] : {std::pair{"x", &x}, {"residual", &residual},
                         {"post_layer_mix", &post_layer_mix}, {"comb_res_mix", &comb_res_mix}}) {
    detail::check_no_overlap(op, "out", out, name, *t);
  }
  if (s.n == 0 || s.h == 0) return;

  detail::MhcPostParams p;
  set_inputs(p, s, x, residual, post_layer_mix, comb_res_mix);
  p.out = out.data;
  copy_strides(p.out_stride, out, 3);
  detail::dispatch_device(
      op, x.device, [&] { detail::mhc_post_cpu(p); },
      [&] { detail::launch_mhc_post(p, x.device.index, stream); });
}

void mhc_post_backward(const TensorView& grad_x, const TensorView& grad_residual,
                       const TensorView& grad_post_layer_mix, const TensorView& grad_comb_res_mix,
                       const TensorView& grad_out, const TensorView& x, const TensorView& residual,
                       const TensorView& post_layer_mix, const TensorView& comb_res_mix,
                       Stream stream) {
  constexpr const char* op = "mhc_post_backward";
  const Sizes s = check_inputs(op, x, residual, post_layer_mix, comb_res_mix);
  detail::check_shape(op, "grad_out", grad_out, {{"N", s.n}, {"hc", s.hc}, {"H", s.h}});
  detail::check_same_dtype(op, "grad_out", grad_out, "x", x);
  detail::check_same_device(op, "grad_out", grad_out, "x", x);
  detail::check_data(op, "grad_out", grad_out);

  detail::check_shape(op, "grad_x", grad_x, {{"N", s.n}, {"H", s.h}});
  detail::check_shape(op, "grad_residual", grad_residual, {{"N", s.n}, {"hc", s.hc}, {"H", s.h}});
  check_mix_shape(op, "grad_post_layer_mix", grad_post_layer_mix, s);
  detail::check_shape(op, "grad_comb_res_mix", grad_comb_res_mix,
                      {{"N", s.n}, {"hc", s.hc}, {"hc", s.hc}});
  detail::check_same_dtype(op, "grad_x", grad_x, "x", x);
  detail::check_same_dtype(op, "grad_residual", grad_residual, "x", x);
  detail::check_dtype(op, "grad_post_layer_mix", grad_post_layer_mix, {DType::Float32});
  detail::check_dtype(op, "grad_comb_res_mix", grad_comb_res_mix, {DType::Float32});

  const std::pair<const char*, const TensorView*> outputs[] = {
      {"grad_x", &grad_x},
      {"grad_residual", &grad_residual},
      {"grad_post_layer_mix", &grad_post_layer_mix},
      {"grad_comb_res_mix", &grad_comb_res_mix}};
  const std::pair<const char*, const TensorView*> inputs[] = {
      {"grad_out", &grad_out},
      {"x", &x},
      {"residual", &residual},
      {"post_layer_mix", &post_layer_mix},
      {"comb_res_mix", &comb_res_mix}};
  for (std::size_t a = 0; a < std::size(outputs); ++a) {
    const auto& [name, t] = outputs[a];
    detail::check_same_device(op, name, *t, "x", x);
    detail::check_writable(op, name, *t);
    for (const auto& [in_name, in] : inputs) detail::check_no_overlap(op, name, *t, in_name, *in);
    for (std::size_t b = a + 1; b < std::size(outputs); ++b) {
      detail::check_no_overlap(op, name, *t, outputs[b].first, *outputs[b].second);
    }
  }
  if (s.n == 0) return;

  detail::MhcPostBackwardParams p;
  set_inputs(p, s, x, residual, post_layer_mix, comb_res_mix);
  p.grad_x = grad_x.data;
  copy_strides(p.grad_x_stride, grad_x, 2);
  p.grad_residual = grad_residual.data;
  copy_strides(p.grad_residual_stride, grad_residual, 3);
  p.grad_post = grad_post_layer_mix.data_as<float>();
  copy_strides(p.grad_post_stride, grad_post_layer_mix, 2);
  p.grad_comb = grad_comb_res_mix.data_as<float>();
  copy_strides(p.grad_comb_stride, grad_comb_res_mix, 3);
  p.grad_out = grad_out.data;
  copy_strides(p.grad_out_stride, grad_out, 3);
  detail::dispatch_device(
      op, x.device, [&] { detail::mhc_post_backward_cpu(p); },
      [&] { detail::launch_mhc_post_backward(p, x.device.index, stream); });
}

}  // namespace fusekit
