// mhc_post and mhc_post_backward on the CPU backend: against the float64 reference in every dtype,
// awkward shapes and layouts, finite differences, determinism, and every validation error.
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "test_support.h"

namespace {

using namespace fusekit_test;
using fusekit::testing::download;
using fusekit::testing::empty_poisoned;
using fusekit::testing::mhc_post_backward_reference;
using fusekit::testing::mhc_post_reference;
using fusekit::testing::MhcPostGradients;
using fusekit::testing::upload;

constexpr Device kCpu = Device::cpu();

// ------------------------------------------------------------------------------------ helpers

struct Shape {
  std::int64_t n, hc, h;
  bool post_3d = false;  // post_layer_mix as [N, hc, 1]
};

void PrintTo(const Shape& s, std::ostream* os) {
  *os << "N=" << s.n << " hc=" << s.hc << " H=" << s.h << (s.post_3d ? " post [N, hc, 1]" : "");
}

std::string shape_name(const Shape& s) {
  return "N" + std::to_string(s.n) + "_hc" + std::to_string(s.hc) + "_H" + std::to_string(s.h) +
         (s.post_3d ? "_post3d" : "");
}

// One forward on the CPU into a poisoned `out`, checked against float64 and for writes outside it.
void check_forward(const MhcInputs& in, DType dtype, const MhcLayouts& layouts = {}) {
  const MhcDeviceInputs d = upload_mhc_inputs(in, dtype, kCpu, layouts);
  const DeviceTensor out = empty_poisoned(in.residual.shape, dtype, kCpu, layouts.out);
  run_mhc_post(out, d);
  expect_out_matches_float64(download(out.view), in, dtype);
  expect_only_view_written(out, "out");
}

// One backward on the CPU into poisoned gradients, checked against float64.
void check_backward(const MhcInputs& in, const HostTensor& grad_out, DType dtype,
                    const MhcLayouts& layouts = {}) {
  const MhcDeviceInputs d = upload_mhc_inputs(in, dtype, kCpu, layouts);
  const DeviceTensor g = upload(grad_out, dtype, kCpu, layouts.out);
  const MhcGradTensors grads = empty_mhc_grads(in, dtype, kCpu, layouts);
  run_mhc_post_backward(grads, g, d);
  expect_grads_match_float64(download_grads(grads), grad_out, in, dtype);
  expect_grads_only_view_written(grads);
}

constexpr DType kDtypes[] = {DType::Float32, DType::BFloat16, DType::Float16};

// ------------------------------------------------------------------------------------ shapes

// N = 1, H = 1, H = 127 (odd), H = 7168 (model), every hc from 1 to 8, post as [N, hc, 1].
const Shape kShapes[] = {
    {1, 4, 1},   {7, 4, 1},         {1, 4, 7168}, {3, 4, 127}, {2, 1, 256},
    {4, 2, 33},  {2, 3, 100},       {5, 4, 64, true},          {2, 5, 40},
    {2, 6, 48},  {2, 7, 17},        {3, 8, 129},  {2, 8, 7168}, {4, 4, 7168, true}};

class MhcPostCpuShapes : public Seeded<::testing::TestWithParam<std::tuple<DType, Shape>>> {};

TEST_P(MhcPostCpuShapes, ForwardMatchesFloat64) {
  const auto [dtype, s] = GetParam();
  check_forward(make_mhc_inputs(s.n, s.hc, s.h, dtype, rng_, s.post_3d), dtype);
}

TEST_P(MhcPostCpuShapes, BackwardMatchesFloat64) {
  const auto [dtype, s] = GetParam();
  const MhcInputs in = make_mhc_inputs(s.n, s.hc, s.h, dtype, rng_, s.post_3d);
  check_backward(in, make_grad_out(s.n, s.hc, s.h, dtype, rng_), dtype);
}

INSTANTIATE_TEST_SUITE_P(All, MhcPostCpuShapes,
                         ::testing::Combine(::testing::ValuesIn(kDtypes),
                                            ::testing::ValuesIn(kShapes)),
                         [](const auto& info) {
                           return dtype_name(std::get<0>(info.param)) + "_" +
                                  shape_name(std::get<1>(info.param));
                         });

// ------------------------------------------------------------------------------------ layouts

struct LayoutCase {
  const char* name;
  MhcLayouts layouts;
};

void PrintTo(const LayoutCase& c, std::ostream* os) { *os << c.name; }

// Layout{order, pad_inner, offset_elements}; the gradients follow their tensor's layout.
const LayoutCase kLayouts[] = {
    {"contiguous", {}},
    // residual[n, j, h] at j * N * H + n * H + h: hc outermost
    {"residual_hc_major", {.residual = {{1, 0, 2}, 0, 0}}},
    // x[n, h] at h * N + n: a non-unit H stride
    {"x_h_strided", {.x = {{1, 0}, 0, 0}}},
    {"out_hc_major", {.out = {{1, 0, 2}, 0, 0}}},
    {"comb_and_post_transposed", {.post = {{1, 0}, 0, 0}, .comb = {{0, 2, 1}, 0, 0}}},
    // gaps between rows: every innermost run followed by unused (NaN) elements
    {"padded_rows",
     {.out = {{}, 5, 0},
      .x = {{}, 3, 0},
      .residual = {{}, 7, 0},
      .post = {{}, 1, 0},
      .comb = {{}, 2, 0}}},
    // every base pointer one element past an aligned address
    {"misaligned",
     {.out = {{}, 0, 1},
      .x = {{}, 0, 1},
      .residual = {{}, 0, 1},
      .post = {{}, 0, 1},
      .comb = {{}, 0, 1}}},
    {"everything",
     {.out = {{2, 0, 1}, 2, 1},
      .x = {{1, 0}, 1, 3},
      .residual = {{1, 0, 2}, 3, 1},
      .post = {{}, 1, 1},
      .comb = {{0, 2, 1}, 0, 1}}},
};

const Shape kLayoutShapes[] = {{5, 4, 64}, {3, 3, 127}};

class MhcPostCpuLayouts
    : public Seeded<::testing::TestWithParam<std::tuple<DType, LayoutCase, Shape>>> {};

TEST_P(MhcPostCpuLayouts, ForwardMatchesFloat64) {
  const auto& [dtype, layout, s] = GetParam();
  check_forward(make_mhc_inputs(s.n, s.hc, s.h, dtype, rng_), dtype, layout.layouts);
}

TEST_P(MhcPostCpuLayouts, BackwardMatchesFloat64) {
  const auto& [dtype, layout, s] = GetParam();
  const MhcInputs in = make_mhc_inputs(s.n, s.hc, s.h, dtype, rng_);
  check_backward(in, make_grad_out(s.n, s.hc, s.h, dtype, rng_), dtype, layout.layouts);
}

INSTANTIATE_TEST_SUITE_P(All, MhcPostCpuLayouts,
                         ::testing::Combine(::testing::ValuesIn(kDtypes),
                                            ::testing::ValuesIn(kLayouts),
                                            ::testing::ValuesIn(kLayoutShapes)),
                         [](const auto& info) {
                           return dtype_name(std::get<0>(info.param)) + "_" +
                                  std::get<1>(info.param).name + "_" +
                                  shape_name(std::get<2>(info.param));
                         });

// ------------------------------------------------------------------------------------ named cases

class MhcPostCpu : public Seeded<::testing::TestWithParam<DType>> {};

TEST_P(MhcPostCpu, EmptyBatchWritesNothing) {
  const DType dtype = GetParam();
  const std::int64_t hc = 4, h = 64;
  const MhcInputs in = make_mhc_inputs(0, hc, h, dtype, rng_);
  const MhcDeviceInputs d = upload_mhc_inputs(in, dtype, kCpu);  // N = 0: null data pointers
  EXPECT_EQ(d.x.view.data, nullptr);

  // Outputs of N = 0 rows that point into poisoned memory, which must stay untouched.
  DeviceTensor out = empty_poisoned({2, hc, h}, dtype, kCpu);
  out.view.shape[0] = 0;
  EXPECT_NO_THROW(run_mhc_post(out, d));
  expect_only_view_written(out, "out");

  const DeviceTensor g = upload(make_grad_out(0, hc, h, dtype, rng_), dtype, kCpu);
  MhcGradTensors grads = empty_mhc_grads(make_mhc_inputs(2, hc, h, dtype, rng_), dtype, kCpu);
  for (DeviceTensor* t : {&grads.grad_x, &grads.grad_residual, &grads.grad_post, &grads.grad_comb}) {
    t->view.shape[0] = 0;
  }
  EXPECT_NO_THROW(run_mhc_post_backward(grads, g, d));
  expect_grads_only_view_written(grads);
}

TEST_P(MhcPostCpu, ZeroHidden) {
  expect_zero_hidden_is_valid(kCpu, GetParam(), rng_);
}

TEST_P(MhcPostCpu, NegativeStrides) {
  const DType dtype = GetParam();
  const std::int64_t n = 3, hc = 4, h = 37;
  const MhcInputs in = make_mhc_inputs(n, hc, h, dtype, rng_);
  const DeviceTensor x = upload_reversed(in.x, dtype, kCpu);
  const DeviceTensor residual = upload_reversed(in.residual, dtype, kCpu);
  const DeviceTensor post = upload_reversed(in.post, DType::Float32, kCpu);
  const DeviceTensor comb = upload_reversed(in.comb, DType::Float32, kCpu);
  const DeviceTensor out = empty_reversed(in.residual.shape, dtype, kCpu);
  fusekit::mhc_post(out.view, x.view, residual.view, post.view, comb.view);
  expect_out_matches_float64(download(out.view), in, dtype);

  const HostTensor grad_out = make_grad_out(n, hc, h, dtype, rng_);
  const DeviceTensor g = upload_reversed(grad_out, dtype, kCpu);
  const MhcGradTensors grads{empty_reversed(in.x.shape, dtype, kCpu),
                             empty_reversed(in.residual.shape, dtype, kCpu),
                             empty_reversed(in.post.shape, DType::Float32, kCpu),
                             empty_reversed(in.comb.shape, DType::Float32, kCpu)};
  fusekit::mhc_post_backward(grads.grad_x.view, grads.grad_residual.view, grads.grad_post.view,
                             grads.grad_comb.view, g.view, x.view, residual.view, post.view,
                             comb.view);
  expect_grads_match_float64(download_grads(grads), grad_out, in, dtype);
}

TEST_P(MhcPostCpu, BroadcastInputs) {
  // Inputs may repeat through a zero stride: one x row, one post row and one comb for all N.
  const DType dtype = GetParam();
  const std::int64_t n = 4, hc = 3, h = 50;
  const MhcInputs one = make_mhc_inputs(1, hc, h, dtype, rng_);
  MhcInputs in = make_mhc_inputs(n, hc, h, dtype, rng_);
  for (std::int64_t r = 0; r < n; ++r) {
    for (std::int64_t k = 0; k < h; ++k) in.x.at({r, k}) = one.x.at({0, k});
    for (std::int64_t i = 0; i < hc; ++i) {
      in.post.at({r, i}) = one.post.at({0, i});
      for (std::int64_t j = 0; j < hc; ++j) in.comb.at({r, j, i}) = one.comb.at({0, j, i});
    }
  }
  MhcDeviceInputs d = upload_mhc_inputs(one, dtype, kCpu);
  d.residual = upload(in.residual, dtype, kCpu);
  for (DeviceTensor* t : {&d.x, &d.post, &d.comb}) {
    t->view.shape[0] = n;
    t->view.strides[0] = 0;
  }
  const DeviceTensor out = empty_poisoned(in.residual.shape, dtype, kCpu);
  run_mhc_post(out, d);
  expect_out_matches_float64(download(out.view), in, dtype);

  const HostTensor grad_out = make_grad_out(n, hc, h, dtype, rng_);
  const DeviceTensor g = upload(grad_out, dtype, kCpu);
  const MhcGradTensors grads = empty_mhc_grads(in, dtype, kCpu);
  run_mhc_post_backward(grads, g, d);
  expect_grads_match_float64(download_grads(grads), grad_out, in, dtype);
}

TEST_P(MhcPostCpu, ZeroStrideOnAUnitDimIsAccepted) {
  // hc = 1: out [N, 1, H] may have any stride, zero included, in its unit dim.
  const DType dtype = GetParam();
  const std::int64_t n = 3, hc = 1, h = 16;
  const MhcInputs in = make_mhc_inputs(n, hc, h, dtype, rng_);
  const MhcDeviceInputs d = upload_mhc_inputs(in, dtype, kCpu);
  DeviceTensor out = empty_poisoned(in.residual.shape, dtype, kCpu);
  out.view.strides[1] = 0;
  run_mhc_post(out, d);
  expect_out_matches_float64(download(out.view), in, dtype);
}

TEST_P(MhcPostCpu, ForwardIsBitwiseDeterministic) {
  const DType dtype = GetParam();
  const MhcInputs in = make_mhc_inputs(16, 4, 4096, dtype, rng_);
  const MhcDeviceInputs d = upload_mhc_inputs(in, dtype, kCpu);
  const DeviceTensor a = empty_poisoned(in.residual.shape, dtype, kCpu);
  const DeviceTensor b = empty_poisoned(in.residual.shape, dtype, kCpu);
  run_mhc_post(a, d);
  run_mhc_post(b, d);
  EXPECT_TRUE(raw_bytes(a) == raw_bytes(b)) << "two runs of mhc_post differ";
}

TEST_P(MhcPostCpu, BackwardIsBitwiseDeterministic) {
  const DType dtype = GetParam();
  const std::int64_t n = 16, hc = 4, h = 4096;
  const MhcInputs in = make_mhc_inputs(n, hc, h, dtype, rng_);
  const MhcDeviceInputs d = upload_mhc_inputs(in, dtype, kCpu);
  const DeviceTensor g = upload(make_grad_out(n, hc, h, dtype, rng_), dtype, kCpu);
  const MhcGradTensors a = empty_mhc_grads(in, dtype, kCpu);
  const MhcGradTensors b = empty_mhc_grads(in, dtype, kCpu);
  run_mhc_post_backward(a, g, d);
  run_mhc_post_backward(b, g, d);
  EXPECT_TRUE(raw_bytes(a.grad_x) == raw_bytes(b.grad_x)) << "grad_x differs between runs";
  EXPECT_TRUE(raw_bytes(a.grad_residual) == raw_bytes(b.grad_residual))
      << "grad_residual differs between runs";
  EXPECT_TRUE(raw_bytes(a.grad_post) == raw_bytes(b.grad_post))
      << "grad_post_layer_mix differs between runs";
  EXPECT_TRUE(raw_bytes(a.grad_comb) == raw_bytes(b.grad_comb))
      << "grad_comb_res_mix differs between runs";
}

INSTANTIATE_TEST_SUITE_P(Dtypes, MhcPostCpu, ::testing::ValuesIn(kDtypes),
                         [](const auto& info) { return dtype_name(info.param); });

// ------------------------------------------------------------------------------------ gradients

// out is linear in each input taken alone (x, residual, post, comb), so L = sum(out * grad_out)
// is too: a central difference has no truncation error, whatever the step, and only rounding
// noise is left. Each element of each input is stepped in turn.
template <typename LossFn>
void expect_gradients_by_differences(MhcInputs in, const MhcPostGradients& analytic, double step,
                                     DType rounding, const Tolerance& tol, LossFn loss) {
  const struct {
    const char* name;
    HostTensor MhcInputs::*input;
    const HostTensor& grad;
    DType dtype;
  } tensors[] = {{"x", &MhcInputs::x, analytic.grad_x, rounding},
                 {"residual", &MhcInputs::residual, analytic.grad_residual, rounding},
                 {"post_layer_mix", &MhcInputs::post, analytic.grad_post, DType::Float32},
                 {"comb_res_mix", &MhcInputs::comb, analytic.grad_comb, DType::Float32}};
  for (const auto& t : tensors) {
    HostTensor numeric(t.grad.shape);
    HostTensor& values = in.*t.input;
    for (std::int64_t e = 0; e < values.numel(); ++e) {
      const double v = values.values[e];
      HostTensor plus({1}, v + step), minus({1}, v - step);
      fusekit::testing::round_to(plus, t.dtype);
      fusekit::testing::round_to(minus, t.dtype);
      values.values[e] = plus.values[0];
      const double l_plus = loss(in);
      values.values[e] = minus.values[0];
      const double l_minus = loss(in);
      values.values[e] = v;
      numeric.values[e] = (l_plus - l_minus) / (plus.values[0] - minus.values[0]);
    }
    expect_close(t.grad, numeric, tol, std::string("d L / d ") + t.name);
  }
}

double dot(const HostTensor& a, const HostTensor& b) {
  double s = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) s += a.values[i] * b.values[i];
  return s;
}

class MhcPostCpuGradients : public Seeded<> {};

TEST_F(MhcPostCpuGradients, ReferenceBackwardMatchesDifferencesOfReferenceForward) {
  // The analytic formulas of the header, in float64, against the float64 forward.
  for (bool post_3d : {false, true}) {
    const std::int64_t n = 2, hc = 3, h = 5;
    const MhcInputs in = make_mhc_inputs(n, hc, h, DType::Float64, rng_, post_3d);
    const HostTensor grad_out = make_grad_out(n, hc, h, DType::Float64, rng_);
    const MhcPostGradients analytic =
        mhc_post_backward_reference(grad_out, in.x, in.residual, in.post, in.comb);
    expect_gradients_by_differences(
        in, analytic, 1e-3, DType::Float64, {1e-9, 1e-9, 1e-10}, [&](const MhcInputs& p) {
          return dot(mhc_post_reference(p.x, p.residual, p.post, p.comb), grad_out);
        });
  }
}

TEST_F(MhcPostCpuGradients, BackwardMatchesDifferencesOfForward) {
  // fusekit's float32 backward against differences of fusekit's own float32 forward. A large
  // step (0.5) keeps the rounding noise of the forward, ~1e-6 per output, far below 1e-4.
  const std::int64_t n = 2, hc = 3, h = 6;
  const DType dtype = DType::Float32;
  const MhcInputs in = make_mhc_inputs(n, hc, h, dtype, rng_);
  const HostTensor grad_out = make_grad_out(n, hc, h, dtype, rng_);

  const MhcDeviceInputs d = upload_mhc_inputs(in, dtype, kCpu);
  const DeviceTensor g = upload(grad_out, dtype, kCpu);
  const MhcGradTensors grads = empty_mhc_grads(in, dtype, kCpu);
  run_mhc_post_backward(grads, g, d);

  expect_gradients_by_differences(in, download_grads(grads), 0.5, dtype, {1e-4, 1e-4, 1e-4},
                                  [&](const MhcInputs& p) {
                                    const MhcDeviceInputs pd = upload_mhc_inputs(p, dtype, kCpu);
                                    const DeviceTensor out =
                                        empty_poisoned(p.residual.shape, dtype, kCpu);
                                    run_mhc_post(out, pd);
                                    return dot(download(out.view), grad_out);
                                  });
}

// ------------------------------------------------------------------------------------ errors

// Valid float32 arguments on the CPU, N = 4, hc = 4, H = 8, each test breaking one of them.
class MhcPostErrors : public ::testing::Test {
 protected:
  static constexpr std::int64_t n = 4, hc = 4, h = 8;
  std::vector<float> x_mem = std::vector<float>(n * h);
  std::vector<float> res_mem = std::vector<float>(n * hc * h);
  std::vector<float> post_mem = std::vector<float>(n * hc);
  std::vector<float> comb_mem = std::vector<float>(n * hc * hc);
  std::vector<float> out_mem = std::vector<float>(n * hc * h);
  std::vector<float> gout_mem = std::vector<float>(n * hc * h);
  std::vector<float> gx_mem = std::vector<float>(n * h);
  std::vector<float> gres_mem = std::vector<float>(n * hc * h);
  std::vector<float> gpost_mem = std::vector<float>(n * hc);
  std::vector<float> gcomb_mem = std::vector<float>(n * hc * hc);
  TensorView x{x_mem.data(), DType::Float32, {n, h}};
  TensorView residual{res_mem.data(), DType::Float32, {n, hc, h}};
  TensorView post{post_mem.data(), DType::Float32, {n, hc}};
  TensorView comb{comb_mem.data(), DType::Float32, {n, hc, hc}};
  TensorView out{out_mem.data(), DType::Float32, {n, hc, h}};
  TensorView grad_out{gout_mem.data(), DType::Float32, {n, hc, h}};
  TensorView grad_x{gx_mem.data(), DType::Float32, {n, h}};
  TensorView grad_residual{gres_mem.data(), DType::Float32, {n, hc, h}};
  TensorView grad_post{gpost_mem.data(), DType::Float32, {n, hc}};
  TensorView grad_comb{gcomb_mem.data(), DType::Float32, {n, hc, hc}};

  void forward() const { fusekit::mhc_post(out, x, residual, post, comb); }
  void backward() const {
    fusekit::mhc_post_backward(grad_x, grad_residual, grad_post, grad_comb, grad_out, x, residual,
                               post, comb);
  }
  // `t`'s memory seen with another (contiguous) shape; the calls that use it fail validation.
  static TensorView with_shape(TensorView t, std::initializer_list<std::int64_t> shape) {
    return TensorView(t.data, t.dtype, shape, t.device);
  }
};

TEST_F(MhcPostErrors, ValidArgumentsPass) {
  EXPECT_NO_THROW(forward());
  EXPECT_NO_THROW(backward());
}

TEST_F(MhcPostErrors, WrongDtypes) {
  x.dtype = residual.dtype = out.dtype = DType::Float64;
  EXPECT_ERROR_CONTAINS("mhc_post: x has dtype float64, expected bfloat16, float16 or float32",
                        [&] { forward(); });
  x.dtype = residual.dtype = out.dtype = DType::Int32;
  EXPECT_ERROR_CONTAINS("mhc_post: x has dtype int32, expected bfloat16, float16 or float32",
                        [&] { forward(); });

  x.dtype = out.dtype = DType::BFloat16;
  residual.dtype = DType::Float16;
  EXPECT_ERROR_CONTAINS(
      "mhc_post: residual has dtype float16 but x has bfloat16; expected the same dtype",
      [&] { forward(); });

  residual.dtype = DType::BFloat16;
  post.dtype = DType::BFloat16;
  EXPECT_ERROR_CONTAINS("mhc_post: post_layer_mix has dtype bfloat16, expected float32",
                        [&] { forward(); });
  post.dtype = DType::Float32;
  comb.dtype = DType::Float16;
  EXPECT_ERROR_CONTAINS("mhc_post: comb_res_mix has dtype float16, expected float32",
                        [&] { forward(); });
  comb.dtype = DType::Float32;
  out.dtype = DType::Float32;
  EXPECT_ERROR_CONTAINS("mhc_post: out has dtype float32 but x has bfloat16; expected the same dtype",
                        [&] { forward(); });
}

TEST_F(MhcPostErrors, ShapeMismatches) {
  const TensorView good_x = x, good_residual = residual, good_post = post, good_comb = comb,
                   good_out = out;
  x = with_shape(good_x, {5, 8});
  EXPECT_ERROR_CONTAINS("mhc_post: x has shape [5, 8], expected [N, H] = [4, 8]", [&] { forward(); });
  x = with_shape(good_x, {4, 9});
  EXPECT_ERROR_CONTAINS("mhc_post: x has shape [4, 9], expected [N, H] = [4, 8]", [&] { forward(); });
  x = with_shape(good_x, {4, 1, 8});
  EXPECT_ERROR_CONTAINS("mhc_post: x has shape [4, 1, 8], expected [N, H] = [4, 8]",
                        [&] { forward(); });
  x = good_x;

  residual = with_shape(good_residual, {4, 8});
  EXPECT_ERROR_CONTAINS("mhc_post: residual has 2 dims [4, 8], expected 3 dims [N, hc, H]",
                        [&] { forward(); });
  residual = with_shape(good_residual, {4, 9, 8});
  EXPECT_ERROR_CONTAINS("mhc_post: residual [4, 9, 8] has hc = 9 streams, expected 1 <= hc <= 8",
                        [&] { forward(); });
  residual = with_shape(good_residual, {4, 0, 8});
  EXPECT_ERROR_CONTAINS("mhc_post: residual [4, 0, 8] has hc = 0 streams, expected 1 <= hc <= 8",
                        [&] { forward(); });
  residual = good_residual;

  comb = with_shape(good_comb, {4, 4, 3});
  EXPECT_ERROR_CONTAINS(
      "mhc_post: comb_res_mix has shape [4, 4, 3], expected [N, hc, hc] = [4, 4, 4]",
      [&] { forward(); });
  comb = with_shape(good_comb, {4, 16});
  EXPECT_ERROR_CONTAINS("mhc_post: comb_res_mix has shape [4, 16], expected [N, hc, hc] = [4, 4, 4]",
                        [&] { forward(); });
  comb = good_comb;

  post = with_shape(good_post, {4, 3});
  EXPECT_ERROR_CONTAINS("mhc_post: post_layer_mix has shape [4, 3], expected [N, hc] = [4, 4]",
                        [&] { forward(); });
  post = with_shape(good_post, {4, 4, 2});
  EXPECT_ERROR_CONTAINS(
      "mhc_post: post_layer_mix has shape [4, 4, 2], expected [N, hc, 1] = [4, 4, 1]",
      [&] { forward(); });
  post = with_shape(good_post, {4, 4, 1});
  EXPECT_NO_THROW(forward());
  post = good_post;

  out = with_shape(good_out, {4, 4, 7});
  EXPECT_ERROR_CONTAINS("mhc_post: out has shape [4, 4, 7], expected [N, hc, H] = [4, 4, 8]",
                        [&] { forward(); });
  out = with_shape(good_out, {4, 32});
  EXPECT_ERROR_CONTAINS("mhc_post: out has shape [4, 32], expected [N, hc, H] = [4, 4, 8]",
                        [&] { forward(); });
}

TEST_F(MhcPostErrors, OutputOverlappingAnInput) {
  // In place over residual (same shape and dtype): the tempting misuse.
  out.data = residual.data;
  EXPECT_ERROR_CONTAINS(
      "mhc_post: out overlaps residual in memory; expected separate buffers (out may not alias "
      "residual)",
      [&] { forward(); });

  out.data = out_mem.data();

  // One buffer holding x, then out: out starting on x's last element overlaps by one element.
  std::vector<float> shared(n * h + n * hc * h);
  x.data = shared.data();
  out.data = shared.data() + n * h - 1;
  EXPECT_ERROR_CONTAINS("mhc_post: out overlaps x in memory", [&] { forward(); });
  // Right after x's last element: adjacent, not overlapping.
  out.data = shared.data() + n * h;
  EXPECT_NO_THROW(forward());
  x.data = x_mem.data();

  std::vector<float> over_post(n * hc + n * hc * h);
  post.data = over_post.data();
  out.data = over_post.data() + n * hc - 1;
  EXPECT_ERROR_CONTAINS("mhc_post: out overlaps post_layer_mix in memory", [&] { forward(); });
  post.data = post_mem.data();

  std::vector<float> over_comb(n * hc * h + n * hc * hc);
  out.data = over_comb.data();
  comb.data = over_comb.data() + n * hc * h - 2;
  EXPECT_ERROR_CONTAINS("mhc_post: out overlaps comb_res_mix in memory", [&] { forward(); });
}

TEST_F(MhcPostErrors, OutputWithAZeroStride) {
  out.strides[2] = 0;
  EXPECT_ERROR_CONTAINS(
      "mhc_post: output out has stride 0 in dim 2 of size 8; expected every output element at its "
      "own address",
      [&] { forward(); });
  out.strides[2] = 1;
  out.strides[0] = 0;
  EXPECT_ERROR_CONTAINS("mhc_post: output out has stride 0 in dim 0 of size 4", [&] { forward(); });
}

TEST_F(MhcPostErrors, OutputWhoseElementsShareAddresses) {
  // [4, hc, 8] with strides {8, 1, 1}: out[n, i, h] and out[n, i + 1, h - 1] are one element.
  out.strides[0] = 8;
  out.strides[1] = 1;
  out.strides[2] = 1;
  EXPECT_ERROR_CONTAINS(
      "mhc_post: output out [4, 4, 8] has strides that make elements share addresses",
      [&] { forward(); });
  // Transposed but distinct addresses are fine: {hc * 8, 1, hc}.
  std::vector<float> mem(4 * 4 * 8);
  out.data = mem.data();
  out.strides[0] = 32;
  out.strides[1] = 1;
  out.strides[2] = 4;
  EXPECT_NO_THROW(forward());
}

TEST_F(MhcPostErrors, NullDataPointer) {
  x.data = nullptr;
  EXPECT_ERROR_CONTAINS("mhc_post: x (float32 [4, 8] on cpu) has a null data pointer",
                        [&] { forward(); });
  x.data = x_mem.data();
  comb.data = nullptr;
  EXPECT_ERROR_CONTAINS("mhc_post: comb_res_mix (float32 [4, 4, 4] on cpu) has a null data pointer",
                        [&] { forward(); });
  comb.data = comb_mem.data();
  out.data = nullptr;
  EXPECT_ERROR_CONTAINS("mhc_post: out (float32 [4, 4, 8] on cpu) has a null data pointer",
                        [&] { forward(); });
}

TEST_F(MhcPostErrors, DeviceMismatch) {
  out.device = Device::cuda(0);
  EXPECT_ERROR_CONTAINS("mhc_post: out is on cuda:0 but x is on cpu; expected one device",
                        [&] { forward(); });
  out.device = Device::cpu();
  residual.device = Device::cuda(1);
  EXPECT_ERROR_CONTAINS("mhc_post: residual is on cuda:1 but x is on cpu; expected one device",
                        [&] { forward(); });
  residual.device = Device::cpu();
  comb.device = Device::cuda(0);
  EXPECT_ERROR_CONTAINS("mhc_post: comb_res_mix is on cuda:0 but x is on cpu", [&] { forward(); });
}

TEST_F(MhcPostErrors, CudaTensorsWithoutCuda) {
  // Every tensor claims cuda:0 (its memory is host memory that no backend may touch).
  for (TensorView* t : {&x, &residual, &post, &comb, &out, &grad_out, &grad_x, &grad_residual,
                        &grad_post, &grad_comb}) {
    t->device = Device::cuda(0);
  }
#ifndef FUSEKIT_WITH_CUDA
  EXPECT_ERROR_CONTAINS(
      "mhc_post: no backend for device cuda:0; this fusekit was built without CUDA",
      [&] { forward(); });
  EXPECT_ERROR_CONTAINS(
      "mhc_post_backward: no backend for device cuda:0; this fusekit was built without CUDA",
      [&] { backward(); });
#else
  if (fusekit::cuda_device_count() > 0) {
    GTEST_SKIP() << "a CUDA device is present; the GPU tests cover cuda tensors";
  }
  EXPECT_ERROR_CONTAINS("CUDA error", [&] { forward(); });
  EXPECT_ERROR_CONTAINS("CUDA error", [&] { backward(); });
#endif
}

TEST_F(MhcPostErrors, BackwardArguments) {
  const TensorView good_grad_out = grad_out, good_grad_x = grad_x, good_grad_post = grad_post,
                   good_grad_comb = grad_comb, good_grad_residual = grad_residual;
  grad_out.dtype = DType::Float16;
  EXPECT_ERROR_CONTAINS(
      "mhc_post_backward: grad_out has dtype float16 but x has float32; expected the same dtype",
      [&] { backward(); });
  grad_out = with_shape(good_grad_out, {4, 4, 9});
  EXPECT_ERROR_CONTAINS(
      "mhc_post_backward: grad_out has shape [4, 4, 9], expected [N, hc, H] = [4, 4, 8]",
      [&] { backward(); });
  grad_out = good_grad_out;
  grad_out.data = nullptr;
  EXPECT_ERROR_CONTAINS(
      "mhc_post_backward: grad_out (float32 [4, 4, 8] on cpu) has a null data pointer",
      [&] { backward(); });
  grad_out = good_grad_out;

  grad_x = with_shape(good_grad_x, {4, 7});
  EXPECT_ERROR_CONTAINS("mhc_post_backward: grad_x has shape [4, 7], expected [N, H] = [4, 8]",
                        [&] { backward(); });
  grad_x = good_grad_x;
  grad_residual.dtype = DType::BFloat16;
  EXPECT_ERROR_CONTAINS(
      "mhc_post_backward: grad_residual has dtype bfloat16 but x has float32; expected the same "
      "dtype",
      [&] { backward(); });
  grad_residual = good_grad_residual;
  grad_post = with_shape(good_grad_post, {4, 4, 2});
  EXPECT_ERROR_CONTAINS(
      "mhc_post_backward: grad_post_layer_mix has shape [4, 4, 2], expected [N, hc, 1] = [4, 4, 1]",
      [&] { backward(); });
  grad_post = good_grad_post;
  grad_comb.dtype = DType::BFloat16;
  EXPECT_ERROR_CONTAINS(
      "mhc_post_backward: grad_comb_res_mix has dtype bfloat16, expected float32",
      [&] { backward(); });
  grad_comb = good_grad_comb;

  grad_x.strides[0] = 0;
  EXPECT_ERROR_CONTAINS("mhc_post_backward: output grad_x has stride 0 in dim 0 of size 4",
                        [&] { backward(); });
  grad_x = good_grad_x;
  grad_post.device = Device::cuda(0);
  EXPECT_ERROR_CONTAINS(
      "mhc_post_backward: grad_post_layer_mix is on cuda:0 but x is on cpu; expected one device",
      [&] { backward(); });
  grad_post = good_grad_post;
  grad_comb.data = nullptr;
  EXPECT_ERROR_CONTAINS(
      "mhc_post_backward: grad_comb_res_mix (float32 [4, 4, 4] on cpu) has a null data pointer",
      [&] { backward(); });
  grad_comb = good_grad_comb;

  x.dtype = DType::Float64;
  EXPECT_ERROR_CONTAINS("mhc_post_backward: x has dtype float64, expected bfloat16, float16 or float32",
                        [&] { backward(); });
}

TEST_F(MhcPostErrors, BackwardOverlaps) {
  // grad_residual written over grad_out (an in-place backward)
  grad_residual.data = grad_out.data;
  EXPECT_ERROR_CONTAINS(
      "mhc_post_backward: grad_residual overlaps grad_out in memory; expected separate buffers",
      [&] { backward(); });
  grad_residual.data = gres_mem.data();
  // two outputs sharing memory
  grad_x.data = gres_mem.data() + 3;
  EXPECT_ERROR_CONTAINS("mhc_post_backward: grad_x overlaps grad_residual in memory",
                        [&] { backward(); });
  grad_x.data = gx_mem.data();
  grad_comb.data = gpost_mem.data();
  EXPECT_ERROR_CONTAINS("mhc_post_backward: grad_post_layer_mix overlaps grad_comb_res_mix in memory",
                        [&] { backward(); });
  grad_comb.data = gcomb_mem.data();
  grad_post.data = post_mem.data();
  EXPECT_ERROR_CONTAINS("mhc_post_backward: grad_post_layer_mix overlaps post_layer_mix in memory",
                        [&] { backward(); });
}

}  // namespace
