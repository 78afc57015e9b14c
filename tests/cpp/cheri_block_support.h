// What the cheri_block tests share between the CPU suite and a CUDA suite: the cases, the inputs
// (rounded to the dtypes they are stored in), the layouts, checked runs of the five entry points on
// any device, and the tolerances.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "common/memory.h"
#include "ops/cheri_block/cheri_block_reference.h"
#include "ops/cheri_block/cheri_block_tolerances.h"
#include "test_support.h"

namespace fusekit_test {

using fusekit::CheriBlockOptions;
using fusekit::CheriBlockWeights;
using fusekit::DilatedConvNormOptions;
using fusekit::testing::CheriBlockGradients;
using fusekit::testing::CheriBlockResult;
using fusekit::testing::CheriHostWeights;
using fusekit::testing::ConvNormGradients;
using fusekit::testing::ConvNormResult;

// ------------------------------------------------------------------------------------ cases

struct CheriCase {
  std::int64_t n, l, c;
  std::int64_t expansion = 2;  // E: linear1 has E C rows
  std::int64_t dilation = 1;
  DType dtype = DType::Float32;         // of x, out, y and the activation gradients
  DType weight_dtype = DType::Float32;  // float32 or dtype
  double residual_scale = 0.15;
  double eps = 1e-3;
  bool allow_tf32 = true;  // the CUDA training path's products; the CPU computes in float32

  std::int64_t hidden() const { return expansion * c; }
  DilatedConvNormOptions conv_options() const { return {dilation, eps}; }
  CheriBlockOptions block_options() const {
    CheriBlockOptions o;
    o.dilation = dilation;
    o.residual_scale = residual_scale;
    o.eps = eps;
    o.allow_tf32 = allow_tf32;
    return o;
  }
};

inline CheriCase with_dtype(CheriCase c, DType dtype) {
  c.dtype = dtype;
  return c;
}

/// "N2_L33_C80_E2_d4_bfloat16" (and "_w<dtype>" for weights not float32).
inline std::string cheri_case_name(const CheriCase& c) {
  std::string s = "N" + std::to_string(c.n) + "_L" + std::to_string(c.l) + "_C" +
                  std::to_string(c.c) + "_E" + std::to_string(c.expansion) + "_d" +
                  std::to_string(c.dilation) + "_" + dtype_name(c.dtype);
  if (c.weight_dtype != DType::Float32) s += "_w" + dtype_name(c.weight_dtype);
  return s;
}

inline void PrintTo(const CheriCase& c, std::ostream* os) { *os << cheri_case_name(c); }

// ------------------------------------------------------------------------------------ inputs

/// Inputs in float64, rounded to their storage dtypes: x and grad_out N(0, 1); the taps N(0, 1);
/// the linear weights N(0, 1 / fan_in) as initialised for training, so that h and out are of
/// unit size. mean and rstd are the float64 forward's, rounded to float32 (what the training
/// forward stores).
struct CheriInputs {
  HostTensor x, grad_out;  // [N, L, C]
  CheriHostWeights w;
  HostTensor mean, rstd;  // [N]
};

inline CheriInputs make_cheri_inputs(const CheriCase& c, std::mt19937_64& rng) {
  using fusekit::testing::random_normal;
  using fusekit::testing::round_to;
  CheriInputs in;
  in.x = random_normal({c.n, c.l, c.c}, rng);
  in.grad_out = random_normal({c.n, c.l, c.c}, rng);
  in.w.conv_weight = random_normal({3, c.c}, rng);
  in.w.linear1 = random_normal({c.hidden(), c.c}, rng, 1.0 / std::sqrt(double(c.c)));
  in.w.linear2 = random_normal({c.c, c.hidden()}, rng, 1.0 / std::sqrt(double(c.hidden())));
  round_to(in.x, c.dtype);
  round_to(in.grad_out, c.dtype);
  for (HostTensor* t : {&in.w.conv_weight, &in.w.linear1, &in.w.linear2}) {
    round_to(*t, c.weight_dtype);
  }
  const ConvNormResult norm =
      fusekit::testing::dilated_conv_norm_reference(in.x, in.w.conv_weight, c.dilation, c.eps);
  in.mean = norm.mean;
  in.rstd = norm.rstd;
  round_to(in.mean, DType::Float32);
  round_to(in.rstd, DType::Float32);
  return in;
}

// ------------------------------------------------------------------------------------ layouts

/// How each tensor is laid out: the [N, L, C] ones (each gradient as its tensor), the weights
/// (their gradients alike) and the statistics; flip_dim views every [N, L, C] tensor backwards
/// along that dim (0 or 1; -1: none).
struct CheriLayouts {
  Layout x = {}, out = {}, grad_out = {}, grad_x = {};
  Layout conv_weight = {}, linear1 = {}, linear2 = {}, stats = {};
  int flip_dim = -1;
};

struct CheriLayoutCase {
  const char* name;
  CheriLayouts layouts;
};
inline void PrintTo(const CheriLayoutCase& c, std::ostream* os) { *os << c.name; }

inline const CheriLayoutCase kCheriLayouts[] = {
    {"contiguous", {}},
    // [L, N, C] in memory (sequence-major activations), weights transposed in memory
    {"lnc_weights_t",
     {.x = {{1, 0, 2}, 0, 0},
      .out = {{1, 0, 2}, 0, 0},
      .grad_out = {{1, 0, 2}, 0, 0},
      .grad_x = {{1, 0, 2}, 0, 0},
      .conv_weight = {{1, 0}, 0, 0},
      .linear1 = {{1, 0}, 0, 0},
      .linear2 = {{1, 0}, 0, 0}}},
    // gaps after every row (odd ones), strided statistics
    {"padded",
     {.x = {{}, 3, 0},
      .out = {{}, 1, 0},
      .grad_out = {{}, 5, 0},
      .grad_x = {{}, 2, 0},
      .conv_weight = {{}, 1, 0},
      .linear1 = {{}, 3, 0},
      .linear2 = {{}, 2, 0},
      .stats = {{}, 0, 0}}},
    // every base pointer one element past an aligned address
    {"misaligned",
     {.x = {{}, 0, 1},
      .out = {{}, 0, 3},
      .grad_out = {{}, 0, 1},
      .grad_x = {{}, 0, 1},
      .conv_weight = {{}, 0, 1},
      .linear1 = {{}, 0, 1},
      .linear2 = {{}, 0, 1},
      .stats = {{}, 0, 1}}},
    // L read and written backwards
    {"flipped_l", {.flip_dim = 1}},
    // the batch backwards, rows padded
    {"flipped_n_padded", {.x = {{}, 1, 0}, .out = {{}, 2, 0}, .grad_x = {{}, 1, 0}, .flip_dim = 0}},
};

// ------------------------------------------------------------------------------------ devices

/// The device tensors of the five calls. Outputs are poisoned; an absent one is an empty view.
struct CheriTensors {
  DeviceTensor x, grad_out, conv_weight, linear1, linear2, mean_in, rstd_in;  // inputs
  DeviceTensor out, mean, rstd;                                               // forward outputs
  DeviceTensor grad_x, grad_conv_weight, grad_linear1, grad_linear2;          // backward outputs

  CheriBlockWeights weights() const { return {conv_weight.view, linear1.view, linear2.view}; }
  CheriBlockWeights grads() const {
    return {grad_conv_weight.view, grad_linear1.view, grad_linear2.view};
  }
};

inline CheriTensors upload_cheri(const CheriInputs& in, const CheriCase& c, Device device,
                                 const CheriLayouts& layouts = {}) {
  using fusekit::testing::empty_poisoned;
  using fusekit::testing::upload;
  const bool flip = layouts.flip_dim >= 0;
  auto activation = [&](const HostTensor& t, const Layout& layout) {
    DeviceTensor d = upload(flip ? flipped(t, layouts.flip_dim) : t, c.dtype, device, layout);
    if (flip) flip_view(d, layouts.flip_dim);
    return d;
  };
  auto empty_activation = [&](const Layout& layout) {
    DeviceTensor d = empty_poisoned({c.n, c.l, c.c}, c.dtype, device, layout);
    if (flip) flip_view(d, layouts.flip_dim);
    return d;
  };
  CheriTensors t;
  t.x = activation(in.x, layouts.x);
  t.grad_out = activation(in.grad_out, layouts.grad_out);
  t.conv_weight = upload(in.w.conv_weight, c.weight_dtype, device, layouts.conv_weight);
  t.linear1 = upload(in.w.linear1, c.weight_dtype, device, layouts.linear1);
  t.linear2 = upload(in.w.linear2, c.weight_dtype, device, layouts.linear2);
  t.mean_in = upload(in.mean, DType::Float32, device, layouts.stats);
  t.rstd_in = upload(in.rstd, DType::Float32, device, layouts.stats);
  t.out = empty_activation(layouts.out);
  t.mean = empty_poisoned({c.n}, DType::Float32, device, layouts.stats);
  t.rstd = empty_poisoned({c.n}, DType::Float32, device, layouts.stats);
  t.grad_x = empty_activation(layouts.grad_x);
  t.grad_conv_weight = empty_poisoned({3, c.c}, c.weight_dtype, device, layouts.conv_weight);
  t.grad_linear1 = empty_poisoned({c.hidden(), c.c}, c.weight_dtype, device, layouts.linear1);
  t.grad_linear2 = empty_poisoned({c.c, c.hidden()}, c.weight_dtype, device, layouts.linear2);
  return t;
}

/// The five calls on the tensors (out, mean and rstd are the forwards' outputs; y of
/// dilated_conv_norm goes to out).
inline void run_conv_norm(const CheriTensors& t, const CheriCase& c) {
  fusekit::dilated_conv_norm(t.out.view, t.mean.view, t.rstd.view, t.x.view, t.conv_weight.view,
                             c.conv_options());
}
inline void run_conv_norm_backward(const CheriTensors& t, const CheriCase& c) {
  fusekit::dilated_conv_norm_backward(t.grad_x.view, t.grad_conv_weight.view, t.grad_out.view,
                                      t.x.view, t.conv_weight.view, t.mean_in.view,
                                      t.rstd_in.view, c.conv_options());
}
inline void run_block(const CheriTensors& t, const CheriCase& c) {
  fusekit::cheri_block(t.out.view, t.mean.view, t.rstd.view, t.x.view, t.weights(),
                       c.block_options());
}
inline void run_block_backward(const CheriTensors& t, const CheriCase& c) {
  fusekit::cheri_block_backward(t.grad_x.view, t.grads(), t.grad_out.view, t.x.view, t.weights(),
                                t.mean_in.view, t.rstd_in.view, c.block_options());
}
/// What the training forward keeps for the backward (cheri_block_saved_bytes), poisoned; an
/// empty tensor (an empty view) where the call keeps nothing.
inline DeviceTensor saved_rows(const CheriTensors& t, const CheriCase& c) {
  const std::int64_t bytes =
      fusekit::cheri_block_saved_bytes(t.x.view, t.weights(), c.block_options());
  if (bytes == 0) return {};
  return fusekit::testing::empty_poisoned({bytes}, DType::UInt8, t.x.view.device);
}
/// The training forward keeping `saved`, then the backward reading it with the forward's mean
/// and rstd.
inline void run_block_through_saved(const CheriTensors& t, const CheriCase& c,
                                    const DeviceTensor& saved) {
  fusekit::cheri_block(t.out.view, t.mean.view, t.rstd.view, saved.view, t.x.view, t.weights(),
                       c.block_options());
  fusekit::cheri_block_backward(t.grad_x.view, t.grads(), t.grad_out.view, t.x.view, t.weights(),
                                t.mean.view, t.rstd.view, saved.view, c.block_options());
}
inline void run_block_inference(const CheriTensors& t, const CheriCase& c) {
  fusekit::cheri_block_inference(t.out.view, t.x.view, t.weights(), c.block_options());
}

// ------------------------------------------------------------------------------------ tolerances
//
// The policy is the library's own (ops/cheri_block/cheri_block_tolerances.h, shared with `fusekit
// check`); the weight gradients' bound takes the case's weight dtype and its N L rows.

using fusekit::testing::cheri_elementwise_tolerance;
using fusekit::testing::cheri_fast_path_bound;
using fusekit::testing::cheri_mean_tolerance;
using fusekit::testing::cheri_relative_to_max;
using fusekit::testing::cheri_stat_tolerance;
using fusekit::testing::cheri_tf32_conv_weight_grad_tolerance;
using fusekit::testing::cheri_tf32_weight_grad_bound;

inline Tolerance cheri_weight_grad_tolerance(const CheriCase& c) {
  return fusekit::testing::cheri_weight_grad_tolerance(c.weight_dtype, c.n * c.l);
}

// ------------------------------------------------------------------------------------ checks

/// The backward's four gradients in `t` against the float64 reference, each written in its view
/// only: within the exact paths' tolerances, or (`tf32`, the CUDA float32 path's TF32 products)
/// within the relative bounds of that path.
inline void expect_block_gradients(const CheriTensors& t, const CheriInputs& in,
                                   const CheriCase& c, bool tf32) {
  using fusekit::testing::download;
  const CheriBlockGradients ref = fusekit::testing::cheri_block_backward_reference(
      in.grad_out, in.x, in.w, in.mean, in.rstd, c.dilation, c.residual_scale);
  expect_only_view_written(t.grad_x, "grad_x");
  expect_only_view_written(t.grad_conv_weight, "grads.conv_weight");
  expect_only_view_written(t.grad_linear1, "grads.linear1_weight");
  expect_only_view_written(t.grad_linear2, "grads.linear2_weight");
  const auto tol = [&](const HostTensor& expected, const Tolerance& exact, double bound = 1e-3) {
    return tf32 ? cheri_relative_to_max(expected, bound) : exact;
  };
  const Tolerance weights = cheri_weight_grad_tolerance(c);
  const double tf32_weights = cheri_tf32_weight_grad_bound(c.n * c.l);
  expect_close(download(t.grad_x.view), ref.grad_x,
               tol(ref.grad_x, cheri_elementwise_tolerance(c.dtype)), "grad_x");
  expect_close(download(t.grad_conv_weight.view), ref.grads.conv_weight,
               tf32 ? cheri_tf32_conv_weight_grad_tolerance(ref.grads.conv_weight,
                                                            ref.conv_weight_spread, tf32_weights)
                    : weights,
               "grads.conv_weight");
  expect_close(download(t.grad_linear1.view), ref.grads.linear1,
               tol(ref.grads.linear1, weights, tf32_weights), "grads.linear1_weight");
  expect_close(download(t.grad_linear2.view), ref.grads.linear2,
               tol(ref.grads.linear2, weights, tf32_weights), "grads.linear2_weight");
}

/// Every output of the forward passes and the backward passes against float64, each written in
/// its view only; inference bitwise equal to the training forward's out.
inline void check_cheri_all(const CheriInputs& in, const CheriCase& c, Device device,
                            const CheriLayouts& layouts = {}) {
  using fusekit::testing::download;
  const Tolerance elementwise = cheri_elementwise_tolerance(c.dtype);
  {
    SCOPED_TRACE("dilated_conv_norm");
    const CheriTensors t = upload_cheri(in, c, device, layouts);
    run_conv_norm(t, c);
    fusekit::detail::synchronize(device);
    const ConvNormResult ref =
        fusekit::testing::dilated_conv_norm_reference(in.x, in.w.conv_weight, c.dilation, c.eps);
    expect_only_view_written(t.out, "y");
    expect_close(download(t.out.view), ref.y, elementwise, "y");
    expect_close(download(t.mean.view), ref.mean, cheri_mean_tolerance(ref.rstd), "mean");
    expect_close(download(t.rstd.view), ref.rstd, cheri_stat_tolerance(), "rstd");
  }
  {
    SCOPED_TRACE("dilated_conv_norm_backward");
    const CheriTensors t = upload_cheri(in, c, device, layouts);
    run_conv_norm_backward(t, c);
    fusekit::detail::synchronize(device);
    const ConvNormGradients ref = fusekit::testing::dilated_conv_norm_backward_reference(
        in.grad_out, in.x, in.w.conv_weight, in.mean, in.rstd, c.dilation);
    expect_only_view_written(t.grad_x, "grad_x");
    expect_only_view_written(t.grad_conv_weight, "grad_conv_weight");
    expect_close(download(t.grad_x.view), ref.grad_x, elementwise, "grad_x");
    expect_close(download(t.grad_conv_weight.view), ref.grad_conv_weight,
                 cheri_weight_grad_tolerance(c), "grad_conv_weight");
  }
  std::vector<unsigned char> training_out;
  {
    SCOPED_TRACE("cheri_block");
    const CheriTensors t = upload_cheri(in, c, device, layouts);
    run_block(t, c);
    fusekit::detail::synchronize(device);
    const CheriBlockResult ref = fusekit::testing::cheri_block_reference(
        in.x, in.w, c.dilation, c.residual_scale, c.eps);
    expect_only_view_written(t.out, "out");
    expect_only_view_written(t.mean, "mean");
    expect_only_view_written(t.rstd, "rstd");
    expect_close(download(t.out.view), ref.out, elementwise, "out");
    expect_close(download(t.mean.view), ref.mean, cheri_mean_tolerance(ref.rstd), "mean");
    expect_close(download(t.rstd.view), ref.rstd, cheri_stat_tolerance(), "rstd");
    training_out = raw_bytes(t.out);
  }
  {
    SCOPED_TRACE("cheri_block_inference");
    const CheriTensors t = upload_cheri(in, c, device, layouts);
    run_block_inference(t, c);
    fusekit::detail::synchronize(device);
    if (device.kind == fusekit::DeviceKind::CPU) {
      EXPECT_EQ(raw_bytes(t.out), training_out) << "inference and training forward differ";
    } else {
      const CheriBlockResult ref = fusekit::testing::cheri_block_reference(
          in.x, in.w, c.dilation, c.residual_scale, c.eps);
      expect_close(download(t.out.view), ref.out, elementwise, "out");
    }
  }
  {
    SCOPED_TRACE("cheri_block_backward");
    const CheriTensors t = upload_cheri(in, c, device, layouts);
    run_block_backward(t, c);
    fusekit::detail::synchronize(device);
    expect_block_gradients(t, in, c, false);
  }
}

}  // namespace fusekit_test
