// The cheri_block family on the CPU backend: dilated_conv_norm and its backward, the block's
// training forward, backward and inference forward, against the float64 reference in every dtype
// (weights in float32 and in x's dtype), for L of 1 to 1500, C of 1 to 128, dilations of 1 to 256
// (d >= L included), every layout; the float64 backward itself against finite differences; zero
// MLP weights; empty batches; determinism across runs and thread counts; every validation error.
// Outputs start as NaN and padding around inputs is NaN.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "cheri_block_support.h"

namespace {

using namespace fusekit_test;
using fusekit::testing::download;
using fusekit::testing::empty_poisoned;

constexpr Device kCpu = Device::cpu();
constexpr DType kDtypes[] = {DType::Float32, DType::BFloat16, DType::Float16};

void check_cpu(const CheriCase& c, std::mt19937_64& rng, const CheriLayouts& layouts = {}) {
  check_cheri_all(make_cheri_inputs(c, rng), c, kCpu, layouts);
}

// ------------------------------------------------------------------------------------ shapes

// L = 1 (and L = C = 1 below); C of 1, 3, 48, 80 and 128; dilations 1, 2, 4, 7 (= L), 16 (> L), 64 and 256 (one
// sequence longer than 256 and one shorter); E of 1, 2 and 4.
const CheriCase kCases[] = {
    {2, 6, 1, 2, 1},
    {3, 1, 3, 2, 4},
    {2, 5, 3, 4, 1},
    {2, 7, 3, 2, 7},
    {2, 9, 48, 4, 16},
    {3, 33, 80, 2, 2},
    {2, 20, 128, 4, 4},
    {2, 150, 16, 2, 64},
    {2, 300, 3, 2, 256},
    {1, 40, 8, 1, 256},
};

class CheriCpu : public Seeded<::testing::TestWithParam<std::tuple<DType, CheriCase>>> {};

TEST_P(CheriCpu, MatchesFloat64) {
  const auto [dtype, c] = GetParam();
  check_cpu(with_dtype(c, dtype), rng_);
}

INSTANTIATE_TEST_SUITE_P(All, CheriCpu,
                         ::testing::Combine(::testing::ValuesIn(kDtypes),
                                            ::testing::ValuesIn(kCases)),
                         [](const auto& info) {
                           return cheri_case_name(
                               with_dtype(std::get<1>(info.param), std::get<0>(info.param)));
                         });

// ------------------------------------------------------------------------------------ layouts

class CheriCpuLayouts
    : public Seeded<::testing::TestWithParam<std::tuple<DType, CheriLayoutCase>>> {};

TEST_P(CheriCpuLayouts, MatchesFloat64) {
  const auto [dtype, l] = GetParam();
  check_cpu({3, 17, 24, 2, 3, dtype}, rng_, l.layouts);
  check_cpu({2, 6, 5, 1, 9, dtype}, rng_, l.layouts);
}

INSTANTIATE_TEST_SUITE_P(All, CheriCpuLayouts,
                         ::testing::Combine(::testing::ValuesIn(kDtypes),
                                            ::testing::ValuesIn(kCheriLayouts)),
                         [](const auto& info) {
                           return dtype_name(std::get<0>(info.param)) + "_" +
                                  std::get<1>(info.param).name;
                         });

// ------------------------------------------------------------------------------------ the rest

class CheriCpuMisc : public Seeded<> {};

TEST_F(CheriCpuMisc, WeightsInTheActivationsDtype) {
  for (DType dtype : {DType::BFloat16, DType::Float16}) {
    CheriCase c{2, 21, 16, 2, 3, dtype, dtype};
    check_cpu(c, rng_);
  }
}

TEST_F(CheriCpuMisc, OptionsReachTheBackend) {
  CheriCase c{2, 19, 12, 2, 5};
  c.eps = 0.5;
  c.residual_scale = -2.0;
  check_cpu(c, rng_);
  c.eps = 0.0;
  c.residual_scale = 0.0;
  check_cpu(c, rng_);
}

TEST_F(CheriCpuMisc, ManyChunksOfExamples) {
  // 1500 rows per example: the MLP runs on chunks of two examples, three chunks in all.
  check_cpu({5, 1500, 4, 2, 37}, rng_);
}

// The float64 backward formulas against central differences of the float64 forward, for the loss
// sum(out * grad_out) (and sum(y * grad_y)): the references that judge the backends are checked
// themselves. The statistics are recomputed at every perturbed point, so the norm's backward is
// tested in full.
TEST_F(CheriCpuMisc, Float64BackwardMatchesFiniteDifferences) {
  using namespace fusekit::testing;
  const CheriCase c{2, 5, 3, 2, 2};
  CheriInputs in = make_cheri_inputs(c, rng_);
  const ConvNormResult stats = dilated_conv_norm_reference(in.x, in.w.conv_weight, c.dilation, c.eps);
  const CheriBlockGradients block = cheri_block_backward_reference(
      in.grad_out, in.x, in.w, stats.mean, stats.rstd, c.dilation, c.residual_scale);
  const ConvNormGradients conv = dilated_conv_norm_backward_reference(
      in.grad_out, in.x, in.w.conv_weight, stats.mean, stats.rstd, c.dilation);
  auto dot = [&](const HostTensor& a) {
    double s = 0;
    for (std::int64_t i = 0; i < a.numel(); ++i) s += a.values[i] * in.grad_out.values[i];
    return s;
  };
  auto block_loss = [&] {
    return dot(cheri_block_reference(in.x, in.w, c.dilation, c.residual_scale, c.eps).out);
  };
  auto conv_loss = [&] {
    return dot(dilated_conv_norm_reference(in.x, in.w.conv_weight, c.dilation, c.eps).y);
  };
  const double step = 1e-6;
  auto expect_gradient = [&](HostTensor& param, const HostTensor& grad, auto loss,
                             const std::string& what) {
    for (std::int64_t i = 0; i < param.numel(); ++i) {
      const double saved = param.values[i];
      param.values[i] = saved + step;
      const double up = loss();
      param.values[i] = saved - step;
      const double down = loss();
      param.values[i] = saved;
      const double numeric = (up - down) / (2 * step);
      EXPECT_NEAR(grad.values[i], numeric, 1e-6 * (1 + std::abs(numeric)))
          << what << " element " << i;
    }
  };
  expect_gradient(in.x, block.grad_x, block_loss, "cheri_block grad_x");
  expect_gradient(in.w.conv_weight, block.grads.conv_weight, block_loss,
                  "cheri_block grads.conv_weight");
  expect_gradient(in.w.linear1, block.grads.linear1, block_loss, "cheri_block grads.linear1");
  expect_gradient(in.w.linear2, block.grads.linear2, block_loss, "cheri_block grads.linear2");
  expect_gradient(in.x, conv.grad_x, conv_loss, "dilated_conv_norm grad_x");
  expect_gradient(in.w.conv_weight, conv.grad_conv_weight, conv_loss,
                  "dilated_conv_norm grad_conv_weight");
}

// The scale the CUDA TF32 path's conv weight gradient is held to (its terms' spread, which can be
// far above the gradient where the norm's backward cancels them) is the gradient's own where
// nothing cancels (many rows, many channels): the bound stays tight there, rejecting a gradient 2%
// off and taking one 0.1% off.
TEST_F(CheriCpuMisc, ConvWeightSpreadIsTheGradientsScaleWhereNothingCancels) {
  using namespace fusekit::testing;
  const CheriCase c{4, 256, 32, 2, 3};
  const CheriInputs in = make_cheri_inputs(c, rng_);
  const CheriBlockGradients ref = cheri_block_backward_reference(
      in.grad_out, in.x, in.w, in.mean, in.rstd, c.dilation, c.residual_scale);
  double g2 = 0, s2 = 0;
  for (std::int64_t i = 0; i < ref.grads.conv_weight.numel(); ++i) {
    g2 += ref.grads.conv_weight.values[i] * ref.grads.conv_weight.values[i];
    s2 += ref.conv_weight_spread.values[i] * ref.conv_weight_spread.values[i];
  }
  EXPECT_GT(std::sqrt(s2 / g2), 0.5);
  EXPECT_LT(std::sqrt(s2 / g2), 2.0);
  const Tolerance tol = cheri_tf32_conv_weight_grad_tolerance(
      ref.grads.conv_weight, ref.conv_weight_spread, cheri_tf32_weight_grad_bound(c.n * c.l));
  for (const auto& [factor, ok] : {std::pair{1.02, false}, std::pair{1.001, true}}) {
    HostTensor off = ref.grads.conv_weight;
    for (double& v : off.values) v *= factor;
    EXPECT_EQ(compare(off, ref.grads.conv_weight, tol).ok, ok) << "gradient times " << factor;
  }
}

TEST_F(CheriCpuMisc, PlaneOfOneElement) {
  // L = C = 1: conv equals its mean, so y = 0 exactly, out = x, and every gradient but the
  // residual's is 0 (the float64 reference, fed the float32 mean, sees only rounding noise).
  for (DType dtype : kDtypes) {
    const CheriCase c{3, 1, 1, 2, 1, dtype};
    const CheriInputs in = make_cheri_inputs(c, rng_);
    const CheriTensors t = upload_cheri(in, c, kCpu);
    const HostTensor zeros({3, 1, 1});
    run_conv_norm(t, c);
    expect_close(download(t.out.view), zeros, {0, 0, 0}, "y");
    run_block(t, c);
    expect_close(download(t.out.view), in.x, {0, 0, 0}, "out");
    run_conv_norm_backward(t, c);
    expect_close(download(t.grad_x.view), zeros, {0, 0, 0}, "grad_x");
    expect_close(download(t.grad_conv_weight.view), HostTensor({3, 1}), {0, 0, 0},
                 "grad_conv_weight");
    run_block_backward(t, c);
    expect_close(download(t.grad_x.view), in.grad_out, {0, 0, 0}, "block grad_x");
    expect_close(download(t.grad_conv_weight.view), HostTensor({3, 1}), {0, 0, 0},
                 "grads.conv_weight");
    expect_close(download(t.grad_linear1.view), HostTensor({2, 1}), {0, 0, 0},
                 "grads.linear1_weight");
    expect_close(download(t.grad_linear2.view), HostTensor({1, 2}), {0, 0, 0},
                 "grads.linear2_weight");
  }
}

TEST_F(CheriCpuMisc, ZeroMlpWeightsGiveX) {
  // linear2 = 0 (or linear1 = 0, whence GELU(0) = 0): out is x, bit for bit, in every dtype.
  for (DType dtype : kDtypes) {
    for (int zero : {1, 2}) {
      const CheriCase c{2, 13, 8, 2, 3, dtype};
      CheriInputs in = make_cheri_inputs(c, rng_);
      HostTensor& w = zero == 1 ? in.w.linear1 : in.w.linear2;
      std::fill(w.values.begin(), w.values.end(), 0.0);
      const CheriTensors t = upload_cheri(in, c, kCpu);
      run_block(t, c);
      const DeviceTensor x_copy = fusekit::testing::upload(in.x, dtype, kCpu);
      EXPECT_EQ(raw_bytes(t.out), raw_bytes(x_copy))
          << dtype_name(dtype) << " with linear" << zero << " zero";
      run_block_inference(t, c);
      EXPECT_EQ(raw_bytes(t.out), raw_bytes(x_copy)) << "inference";
    }
  }
}

TEST_F(CheriCpuMisc, EmptyBatch) {
  // N = 0: the forwards have nothing to write; the backwards' weight gradients, sums over no
  // examples, are zero.
  for (DType dtype : kDtypes) {
    const CheriCase c{0, 7, 5, 2, 2, dtype};
    const CheriInputs in = make_cheri_inputs(c, rng_);
    const CheriTensors t = upload_cheri(in, c, kCpu);
    EXPECT_NO_THROW(run_conv_norm(t, c));
    EXPECT_NO_THROW(run_block(t, c));
    EXPECT_NO_THROW(run_block_inference(t, c));
    ASSERT_NO_THROW(run_conv_norm_backward(t, c));
    expect_close(download(t.grad_conv_weight.view), HostTensor({3, 5}), {0, 0, 0},
                 "grad_conv_weight");
    ASSERT_NO_THROW(run_block_backward(t, c));
    expect_close(download(t.grad_conv_weight.view), HostTensor({3, 5}), {0, 0, 0},
                 "grads.conv_weight");
    expect_close(download(t.grad_linear1.view), HostTensor({10, 5}), {0, 0, 0},
                 "grads.linear1_weight");
    expect_close(download(t.grad_linear2.view), HostTensor({5, 10}), {0, 0, 0},
                 "grads.linear2_weight");
  }
}

/// The bytes of every output of the five calls on `in`.
std::vector<unsigned char> all_output_bytes(const CheriInputs& in, const CheriCase& c) {
  std::vector<unsigned char> bytes;
  auto append = [&](const DeviceTensor& t) {
    const std::vector<unsigned char> b = raw_bytes(t);
    bytes.insert(bytes.end(), b.begin(), b.end());
  };
  const CheriTensors t = upload_cheri(in, c, kCpu);
  run_conv_norm(t, c);
  append(t.out);
  run_conv_norm_backward(t, c);
  append(t.grad_x);
  append(t.grad_conv_weight);
  run_block(t, c);
  append(t.out);
  append(t.mean);
  append(t.rstd);
  run_block_backward(t, c);
  for (const DeviceTensor* g : {&t.grad_x, &t.grad_conv_weight, &t.grad_linear1, &t.grad_linear2}) {
    append(*g);
  }
  return bytes;
}

TEST_F(CheriCpuMisc, BitwiseDeterministicAcrossRunsAndThreadCounts) {
  for (const CheriCase& c : {CheriCase{7, 900, 16, 2, 5}, CheriCase{9, 40, 32, 4, 3, DType::BFloat16}}) {
    const CheriInputs in = make_cheri_inputs(c, rng_);
    const std::vector<unsigned char> first = all_output_bytes(in, c);
    EXPECT_EQ(first, all_output_bytes(in, c)) << cheri_case_name(c);
#ifdef _OPENMP
    const int threads = omp_get_max_threads();
    for (int n : {1, 3}) {
      omp_set_num_threads(n);
      EXPECT_EQ(first, all_output_bytes(in, c)) << cheri_case_name(c) << " with " << n << " threads";
    }
    omp_set_num_threads(threads);
#endif
  }
}

// ------------------------------------------------------------------------------------ errors

class CheriErrors : public Seeded<> {
 protected:
  CheriCase c_{2, 5, 4, 2, 1, DType::Float16};
  CheriInputs in_ = make_cheri_inputs(c_, rng_);
  CheriTensors t_ = upload_cheri(in_, c_, kCpu);

  DeviceTensor tensor(std::vector<std::int64_t> shape, DType dtype = DType::Float16,
                      Layout layout = {}) {
    return empty_poisoned(shape, dtype, kCpu, layout);
  }
  // The five valid calls with arguments replaced.
  void conv_norm(const TensorView& y, const TensorView& mean, const TensorView& rstd,
                 const TensorView& x, const TensorView& w, DilatedConvNormOptions o = {}) {
    fusekit::dilated_conv_norm(y, mean, rstd, x, w, o);
  }
  void block(const TensorView& out, const TensorView& x, CheriBlockWeights w,
             CheriBlockOptions o = {}) {
    fusekit::cheri_block(out, t_.mean.view, t_.rstd.view, x, w, o);
  }
  void backward(const TensorView& grad_x, const CheriBlockWeights& grads,
                const TensorView& grad_out, const TensorView& mean, const TensorView& rstd,
                CheriBlockWeights w) {
    fusekit::cheri_block_backward(grad_x, grads, grad_out, t_.x.view, w, mean, rstd);
  }
  void backward_grads(const CheriBlockWeights& grads) {
    backward(t_.grad_x.view, grads, t_.grad_out.view, t_.mean_in.view, t_.rstd_in.view,
             t_.weights());
  }
  void backward_weights(const CheriBlockWeights& w) {
    backward(t_.grad_x.view, t_.grads(), t_.grad_out.view, t_.mean_in.view, t_.rstd_in.view, w);
  }
  void inference(const TensorView& out, const TensorView& x, CheriBlockWeights w,
                 CheriBlockOptions o = {}) {
    fusekit::cheri_block_inference(out, x, w, o);
  }
  void conv_backward(const TensorView& grad_x, const TensorView& grad_w, const TensorView& grad_y,
                     const TensorView& mean, const TensorView& rstd) {
    fusekit::dilated_conv_norm_backward(grad_x, grad_w, grad_y, t_.x.view, t_.conv_weight.view,
                                        mean, rstd);
  }
  CheriBlockWeights with_conv(const TensorView& v) {
    CheriBlockWeights w = t_.weights();
    w.conv_weight = v;
    return w;
  }
  CheriBlockWeights with_linear1(const TensorView& v) {
    CheriBlockWeights w = t_.weights();
    w.linear1_weight = v;
    return w;
  }
  CheriBlockWeights with_linear2(const TensorView& v) {
    CheriBlockWeights w = t_.weights();
    w.linear2_weight = v;
    return w;
  }
};

TEST_F(CheriErrors, TheValidCallsRun) {
  EXPECT_NO_THROW(conv_norm(t_.out.view, t_.mean.view, t_.rstd.view, t_.x.view,
                            t_.conv_weight.view));
  EXPECT_NO_THROW(conv_norm(t_.out.view, {}, {}, t_.x.view, t_.conv_weight.view));
  EXPECT_NO_THROW(conv_backward(t_.grad_x.view, t_.grad_conv_weight.view, t_.grad_out.view,
                                t_.mean_in.view, t_.rstd_in.view));
  EXPECT_NO_THROW(block(t_.out.view, t_.x.view, t_.weights()));
  EXPECT_NO_THROW(backward_grads(t_.grads()));
  EXPECT_NO_THROW(inference(t_.out.view, t_.x.view, t_.weights()));
}

TEST_F(CheriErrors, Shapes) {
  const DeviceTensor x2 = tensor({2, 5});
  EXPECT_ERROR_CONTAINS("dilated_conv_norm: x has 2 dims [2, 5], expected 3 dims [N, L, C]",
                        [&] { conv_norm(t_.out.view, {}, {}, x2.view, t_.conv_weight.view); });
  EXPECT_ERROR_CONTAINS("cheri_block_inference: x has 2 dims [2, 5], expected 3 dims [N, L, C]",
                        [&] { inference(t_.out.view, x2.view, t_.weights()); });
  const DeviceTensor l0 = tensor({2, 0, 4}), c0 = tensor({2, 5, 0});
  EXPECT_ERROR_CONTAINS("cheri_block: x [2, 0, 4] has L = 0 and C = 4, expected L >= 1 and C >= 1",
                        [&] { block(l0.view, l0.view, t_.weights()); });
  EXPECT_ERROR_CONTAINS("x [2, 5, 0] has L = 5 and C = 0, expected L >= 1 and C >= 1",
                        [&] { block(c0.view, c0.view, t_.weights()); });
  const DeviceTensor out_bad = tensor({2, 5, 3}), out_n = tensor({3, 5, 4});
  EXPECT_ERROR_CONTAINS("cheri_block: out has shape [2, 5, 3], expected [N, L, C] = [2, 5, 4]",
                        [&] { block(out_bad.view, t_.x.view, t_.weights()); });
  EXPECT_ERROR_CONTAINS("dilated_conv_norm: y has shape [3, 5, 4], expected [N, L, C] = [2, 5, 4]",
                        [&] { conv_norm(out_n.view, {}, {}, t_.x.view, t_.conv_weight.view); });
  EXPECT_ERROR_CONTAINS("cheri_block_backward: grad_out has shape [2, 5, 3], expected [N, L, C]",
                        [&] {
                          backward(t_.grad_x.view, t_.grads(), out_bad.view, t_.mean_in.view,
                                   t_.rstd_in.view, t_.weights());
                        });
  EXPECT_ERROR_CONTAINS("cheri_block_backward: grad_x has shape [2, 5, 3], expected [N, L, C]",
                        [&] {
                          backward(out_bad.view, t_.grads(), t_.grad_out.view, t_.mean_in.view,
                                   t_.rstd_in.view, t_.weights());
                        });
  EXPECT_ERROR_CONTAINS("dilated_conv_norm_backward: grad_y has shape [2, 5, 3]", [&] {
    conv_backward(t_.grad_x.view, t_.grad_conv_weight.view, out_bad.view, t_.mean_in.view,
                  t_.rstd_in.view);
  });
  // weights
  const DeviceTensor conv_bad = tensor({2, 4}, DType::Float32);
  EXPECT_ERROR_CONTAINS("cheri_block: weights.conv_weight has shape [2, 4], expected [3, C] = "
                        "[3, 4]",
                        [&] { block(t_.out.view, t_.x.view, with_conv(conv_bad.view)); });
  EXPECT_ERROR_CONTAINS("dilated_conv_norm: conv_weight has shape [2, 4], expected [3, C]",
                        [&] { conv_norm(t_.out.view, {}, {}, t_.x.view, conv_bad.view); });
  const DeviceTensor w1_3d = tensor({8, 4, 1}, DType::Float32), w1_0 = tensor({0, 4}, DType::Float32),
                     w1_c = tensor({8, 5}, DType::Float32), w2_bad = tensor({4, 6}, DType::Float32);
  EXPECT_ERROR_CONTAINS("cheri_block: weights.linear1_weight has 3 dims [8, 4, 1], expected 2 "
                        "dims [E C, C]",
                        [&] { block(t_.out.view, t_.x.view, with_linear1(w1_3d.view)); });
  EXPECT_ERROR_CONTAINS("weights.linear1_weight [0, 4] has E C = 0 rows, expected E C >= 1",
                        [&] { inference(t_.out.view, t_.x.view, with_linear1(w1_0.view)); });
  EXPECT_ERROR_CONTAINS("weights.linear1_weight has shape [8, 5], expected [E C, C] = [8, 4]",
                        [&] { block(t_.out.view, t_.x.view, with_linear1(w1_c.view)); });
  EXPECT_ERROR_CONTAINS("weights.linear2_weight has shape [4, 6], expected [C, E C] = [4, 8]",
                        [&] { backward_weights(with_linear2(w2_bad.view)); });
  // weight gradients
  const DeviceTensor gw1 = tensor({4, 8}, DType::Float32), gconv = tensor({3, 5}, DType::Float32);
  CheriBlockWeights grads = t_.grads();
  grads.linear1_weight = gw1.view;
  EXPECT_ERROR_CONTAINS("cheri_block_backward: grads.linear1_weight has shape [4, 8], expected "
                        "[E C, C] = [8, 4]",
                        [&] { backward_grads(grads); });
  grads = t_.grads();
  grads.linear2_weight = t_.grad_linear1.view;
  EXPECT_ERROR_CONTAINS("grads.linear2_weight has shape [8, 4], expected [C, E C] = [4, 8]",
                        [&] { backward_grads(grads); });
  grads = t_.grads();
  grads.conv_weight = gconv.view;
  EXPECT_ERROR_CONTAINS("grads.conv_weight has shape [3, 5], expected [3, C] = [3, 4]",
                        [&] { backward_grads(grads); });
  EXPECT_ERROR_CONTAINS("dilated_conv_norm_backward: grad_conv_weight has shape [3, 5]", [&] {
    conv_backward(t_.grad_x.view, gconv.view, t_.grad_out.view, t_.mean_in.view, t_.rstd_in.view);
  });
  // statistics
  const DeviceTensor stat3 = tensor({3}, DType::Float32), stat2d = tensor({2, 1}, DType::Float32);
  EXPECT_ERROR_CONTAINS("dilated_conv_norm: mean has shape [3], expected [N] = [2]",
                        [&] { conv_norm(t_.out.view, stat3.view, {}, t_.x.view, t_.conv_weight.view); });
  EXPECT_ERROR_CONTAINS("dilated_conv_norm: rstd has shape [2, 1], expected [N] = [2]", [&] {
    conv_norm(t_.out.view, {}, stat2d.view, t_.x.view, t_.conv_weight.view);
  });
  EXPECT_ERROR_CONTAINS("cheri_block: mean has shape [], expected [N] = [2]", [&] {
    fusekit::cheri_block(t_.out.view, {}, t_.rstd.view, t_.x.view, t_.weights());
  });
  EXPECT_ERROR_CONTAINS("cheri_block_backward: rstd has shape [3], expected [N] = [2]", [&] {
    backward(t_.grad_x.view, t_.grads(), t_.grad_out.view, t_.mean_in.view, stat3.view,
             t_.weights());
  });
  EXPECT_ERROR_CONTAINS("dilated_conv_norm_backward: mean has shape [3], expected [N] = [2]", [&] {
    conv_backward(t_.grad_x.view, t_.grad_conv_weight.view, t_.grad_out.view, stat3.view,
                  t_.rstd_in.view);
  });
}

TEST_F(CheriErrors, Dtypes) {
  const DeviceTensor x64 = tensor({2, 5, 4}, DType::Float64);
  EXPECT_ERROR_CONTAINS("cheri_block: x has dtype float64, expected float32, float16 or bfloat16",
                        [&] { block(x64.view, x64.view, t_.weights()); });
  const DeviceTensor out32 = tensor({2, 5, 4}, DType::Float32);
  EXPECT_ERROR_CONTAINS("cheri_block: out has dtype float32 but x has float16; expected the same "
                        "dtype",
                        [&] { block(out32.view, t_.x.view, t_.weights()); });
  EXPECT_ERROR_CONTAINS("dilated_conv_norm: y has dtype float32 but x has float16",
                        [&] { conv_norm(out32.view, {}, {}, t_.x.view, t_.conv_weight.view); });
  EXPECT_ERROR_CONTAINS("cheri_block_backward: grad_out has dtype float32 but x has float16", [&] {
    backward(t_.grad_x.view, t_.grads(), out32.view, t_.mean_in.view, t_.rstd_in.view,
             t_.weights());
  });
  EXPECT_ERROR_CONTAINS("cheri_block_backward: grad_x has dtype float32 but x has float16", [&] {
    backward(out32.view, t_.grads(), t_.grad_out.view, t_.mean_in.view, t_.rstd_in.view,
             t_.weights());
  });
  const DeviceTensor conv_bf = tensor({3, 4}, DType::BFloat16);
  EXPECT_ERROR_CONTAINS("cheri_block: weights.conv_weight has dtype bfloat16, expected float32 or "
                        "x's dtype float16",
                        [&] { block(t_.out.view, t_.x.view, with_conv(conv_bf.view)); });
  const DeviceTensor w1_64 = tensor({8, 4}, DType::Float64), w2_bf = tensor({4, 8}, DType::BFloat16);
  EXPECT_ERROR_CONTAINS("weights.linear1_weight has dtype float64, expected float32 or x's dtype",
                        [&] { inference(t_.out.view, t_.x.view, with_linear1(w1_64.view)); });
  EXPECT_ERROR_CONTAINS("weights.linear2_weight has dtype bfloat16, expected float32 or x's dtype",
                        [&] { backward_weights(with_linear2(w2_bf.view)); });
  // a weight in x's dtype is fine; its gradient must follow it
  const DeviceTensor w2_16 = tensor({4, 8}, DType::Float16);
  EXPECT_NO_THROW(inference(t_.out.view, t_.x.view, with_linear2(w2_16.view)));
  EXPECT_ERROR_CONTAINS("cheri_block_backward: grads.linear2_weight has dtype float32 but "
                        "weights.linear2_weight has float16; expected the weight's dtype",
                        [&] { backward_weights(with_linear2(w2_16.view)); });
  const DeviceTensor gconv16 = tensor({3, 4}, DType::Float16);
  EXPECT_ERROR_CONTAINS("dilated_conv_norm_backward: grad_conv_weight has dtype float16 but "
                        "conv_weight has float32",
                        [&] {
                          conv_backward(t_.grad_x.view, gconv16.view, t_.grad_out.view,
                                        t_.mean_in.view, t_.rstd_in.view);
                        });
  const DeviceTensor stat16 = tensor({2}, DType::Float16);
  EXPECT_ERROR_CONTAINS("cheri_block: mean has dtype float16, expected float32", [&] {
    fusekit::cheri_block(t_.out.view, stat16.view, t_.rstd.view, t_.x.view, t_.weights());
  });
  EXPECT_ERROR_CONTAINS("cheri_block_backward: rstd has dtype float16, expected float32", [&] {
    backward(t_.grad_x.view, t_.grads(), t_.grad_out.view, t_.mean_in.view, stat16.view,
             t_.weights());
  });
}

TEST_F(CheriErrors, Devices) {
  auto on_cuda = [](TensorView t) {
    t.device = Device::cuda(0);
    return t;
  };
  EXPECT_ERROR_CONTAINS("cheri_block: out is on cuda:0 but x is on cpu; expected one device",
                        [&] { block(on_cuda(t_.out.view), t_.x.view, t_.weights()); });
  EXPECT_ERROR_CONTAINS("weights.linear1_weight is on cuda:0 but x is on cpu", [&] {
    inference(t_.out.view, t_.x.view, with_linear1(on_cuda(t_.linear1.view)));
  });
  EXPECT_ERROR_CONTAINS("dilated_conv_norm: mean is on cuda:0 but x is on cpu", [&] {
    conv_norm(t_.out.view, on_cuda(t_.mean.view), {}, t_.x.view, t_.conv_weight.view);
  });
  CheriBlockWeights grads = t_.grads();
  grads.linear2_weight = on_cuda(grads.linear2_weight);
  EXPECT_ERROR_CONTAINS("cheri_block_backward: grads.linear2_weight is on cuda:0 but x is on cpu",
                        [&] { backward_grads(grads); });
  // all on a CUDA device: a build without CUDA says so; one with CUDA refuses until the kernels
  // exist (or, without a GPU, fails in the runtime); either way a fusekit::Error
  TensorView x = on_cuda(t_.x.view), out = on_cuda(t_.out.view);
  CheriBlockWeights w{on_cuda(t_.conv_weight.view), on_cuda(t_.linear1.view),
                      on_cuda(t_.linear2.view)};
  EXPECT_THROW(fusekit::cheri_block_inference(out, x, w), fusekit::Error);
}

TEST_F(CheriErrors, NullData) {
  auto null = [](TensorView t) {
    t.data = nullptr;
    return t;
  };
  EXPECT_ERROR_CONTAINS("cheri_block: x (float16 [2, 5, 4] on cpu) has a null data pointer",
                        [&] { block(t_.out.view, null(t_.x.view), t_.weights()); });
  EXPECT_ERROR_CONTAINS("out (float16 [2, 5, 4] on cpu) has a null data pointer",
                        [&] { block(null(t_.out.view), t_.x.view, t_.weights()); });
  EXPECT_ERROR_CONTAINS("weights.conv_weight (float32 [3, 4] on cpu) has a null data pointer",
                        [&] { block(t_.out.view, t_.x.view, with_conv(null(t_.conv_weight.view))); });
  EXPECT_ERROR_CONTAINS("rstd (float32 [2] on cpu) has a null data pointer", [&] {
    backward(t_.grad_x.view, t_.grads(), t_.grad_out.view, t_.mean_in.view,
             null(t_.rstd_in.view), t_.weights());
  });
  CheriBlockWeights grads = t_.grads();
  grads.linear1_weight = null(grads.linear1_weight);
  EXPECT_ERROR_CONTAINS("grads.linear1_weight (float32 [8, 4] on cpu) has a null data pointer",
                        [&] { backward_grads(grads); });
}

TEST_F(CheriErrors, Options) {
  for (std::int64_t d : {0, -3}) {
    DilatedConvNormOptions o;
    o.dilation = d;
    const std::string expected =
        "dilated_conv_norm: options.dilation is " + std::to_string(d) + ", expected >= 1";
    EXPECT_ERROR_CONTAINS(expected.c_str(), [&] {
      conv_norm(t_.out.view, {}, {}, t_.x.view, t_.conv_weight.view, o);
    });
    CheriBlockOptions b;
    b.dilation = d;
    EXPECT_ERROR_CONTAINS("cheri_block: options.dilation is ",
                          [&] { block(t_.out.view, t_.x.view, t_.weights(), b); });
  }
  for (double eps : {-1e-3, std::nan(""), std::numeric_limits<double>::infinity()}) {
    CheriBlockOptions b;
    b.eps = eps;
    EXPECT_ERROR_CONTAINS("cheri_block_inference: options.eps is ",
                          [&] { inference(t_.out.view, t_.x.view, t_.weights(), b); });
    EXPECT_ERROR_CONTAINS(", expected a finite value >= 0",
                          [&] { inference(t_.out.view, t_.x.view, t_.weights(), b); });
    DilatedConvNormOptions o;
    o.eps = eps;
    EXPECT_ERROR_CONTAINS("dilated_conv_norm: options.eps is ", [&] {
      conv_norm(t_.out.view, {}, {}, t_.x.view, t_.conv_weight.view, o);
    });
  }
  for (double scale : {std::nan(""), std::numeric_limits<double>::infinity(), 1e300}) {
    CheriBlockOptions b;
    b.residual_scale = scale;
    EXPECT_ERROR_CONTAINS("cheri_block: options.residual_scale is ",
                          [&] { block(t_.out.view, t_.x.view, t_.weights(), b); });
    EXPECT_ERROR_CONTAINS(", expected a finite value (within float32's range)",
                          [&] { block(t_.out.view, t_.x.view, t_.weights(), b); });
  }
}

TEST_F(CheriErrors, Layouts) {
  const Layout c_outer{{2, 0, 1}, 0, 0};
  const DeviceTensor x_bad = tensor({2, 5, 4}, DType::Float16, c_outer);
  EXPECT_ERROR_CONTAINS("cheri_block: x [2, 5, 4] has strides (5, 1, 10); expected a unit stride "
                        "on C (the last dim)",
                        [&] { block(t_.out.view, x_bad.view, t_.weights()); });
  const DeviceTensor out_bad = tensor({2, 5, 4}, DType::Float16, c_outer);
  EXPECT_ERROR_CONTAINS("cheri_block_inference: out [2, 5, 4] has strides (5, 1, 10); expected a "
                        "unit stride on C",
                        [&] { inference(out_bad.view, t_.x.view, t_.weights()); });
  EXPECT_ERROR_CONTAINS("dilated_conv_norm: y [2, 5, 4] has strides (5, 1, 10)", [&] {
    conv_norm(out_bad.view, {}, {}, t_.x.view, t_.conv_weight.view);
  });
  EXPECT_ERROR_CONTAINS("cheri_block_backward: grad_out [2, 5, 4] has strides (5, 1, 10)", [&] {
    backward(t_.grad_x.view, t_.grads(), x_bad.view, t_.mean_in.view, t_.rstd_in.view,
             t_.weights());
  });
  EXPECT_ERROR_CONTAINS("cheri_block_backward: grad_x [2, 5, 4] has strides (5, 1, 10)", [&] {
    backward(out_bad.view, t_.grads(), t_.grad_out.view, t_.mean_in.view, t_.rstd_in.view,
             t_.weights());
  });
  TensorView x_reversed = t_.x.view;  // a stride of -1 on C is not a unit stride
  x_reversed.data = static_cast<char*>(x_reversed.data) + 3 * 2;
  x_reversed.strides[2] = -1;
  EXPECT_ERROR_CONTAINS("expected a unit stride on C",
                        [&] { block(t_.out.view, x_reversed, t_.weights()); });
  // outputs whose elements share addresses
  TensorView out_bcast = t_.out.view;
  out_bcast.strides[0] = 0;
  EXPECT_ERROR_CONTAINS("cheri_block: output out has stride 0 in dim 0",
                        [&] { block(out_bcast, t_.x.view, t_.weights()); });
  TensorView mean_bcast = t_.mean.view;
  mean_bcast.strides[0] = 0;
  EXPECT_ERROR_CONTAINS("dilated_conv_norm: output mean has stride 0 in dim 0", [&] {
    conv_norm(t_.out.view, mean_bcast, {}, t_.x.view, t_.conv_weight.view);
  });
  CheriBlockWeights grads = t_.grads();
  grads.linear1_weight.strides[1] = 0;
  EXPECT_ERROR_CONTAINS("cheri_block_backward: output grads.linear1_weight has stride 0 in dim 1",
                        [&] { backward_grads(grads); });
  // inputs may share addresses: x broadcast over the batch
  TensorView x_bcast = t_.x.view;
  x_bcast.strides[0] = 0;
  EXPECT_NO_THROW(inference(t_.out.view, x_bcast, t_.weights()));
}

TEST_F(CheriErrors, Overlap) {
  EXPECT_ERROR_CONTAINS("cheri_block: out overlaps x in memory",
                        [&] { block(t_.x.view, t_.x.view, t_.weights()); });
  EXPECT_ERROR_CONTAINS("cheri_block_inference: out overlaps weights.linear1_weight in memory", [&] {
    const TensorView out_in_w1(t_.linear1.view.data, DType::Float16, {2, 5, 4});
    inference(out_in_w1, t_.x.view, t_.weights());
  });
  EXPECT_ERROR_CONTAINS("dilated_conv_norm: y overlaps conv_weight in memory", [&] {
    const TensorView y_in_w(t_.conv_weight.view.data, DType::Float16, {2, 5, 4});
    conv_norm(y_in_w, {}, {}, t_.x.view, t_.conv_weight.view);
  });
  EXPECT_ERROR_CONTAINS("dilated_conv_norm: y overlaps mean in memory", [&] {
    const TensorView mean_in_y(t_.out.view.data, DType::Float32, {2});
    conv_norm(t_.out.view, mean_in_y, {}, t_.x.view, t_.conv_weight.view);
  });
  EXPECT_ERROR_CONTAINS("cheri_block: mean overlaps rstd in memory", [&] {
    fusekit::cheri_block(t_.out.view, t_.mean.view, t_.mean.view, t_.x.view, t_.weights());
  });
  EXPECT_ERROR_CONTAINS("cheri_block_backward: grad_x overlaps grad_out in memory", [&] {
    backward(t_.grad_out.view, t_.grads(), t_.grad_out.view, t_.mean_in.view, t_.rstd_in.view,
             t_.weights());
  });
  EXPECT_ERROR_CONTAINS("cheri_block_backward: grads.conv_weight overlaps mean in memory", [&] {
    CheriBlockWeights grads = t_.grads();
    grads.conv_weight = TensorView(t_.mean_in.view.data, DType::Float32, {3, 4});
    backward_grads(grads);
  });
  EXPECT_ERROR_CONTAINS("cheri_block_backward: grads.linear1_weight overlaps grads.linear2_weight",
                        [&] {
                          CheriBlockWeights grads = t_.grads();
                          grads.linear2_weight =
                              TensorView(grads.linear1_weight.data, DType::Float32, {4, 8});
                          backward_grads(grads);
                        });
  EXPECT_ERROR_CONTAINS("cheri_block_backward: grads.linear2_weight overlaps weights.linear2_weight",
                        [&] {
                          CheriBlockWeights grads = t_.grads();
                          grads.linear2_weight = t_.linear2.view;
                          backward_grads(grads);
                        });
  EXPECT_ERROR_CONTAINS("dilated_conv_norm_backward: grad_conv_weight overlaps conv_weight", [&] {
    conv_backward(t_.grad_x.view, t_.conv_weight.view, t_.grad_out.view, t_.mean_in.view,
                  t_.rstd_in.view);
  });
}

// The rows the training forward keeps for the backward: none on the CPU, so a buffer given for
// them is refused by both calls; cheri_block_saved_bytes checks the shapes it reads.
TEST_F(CheriErrors, SavedRows) {
  EXPECT_EQ(fusekit::cheri_block_saved_bytes(t_.x.view, t_.weights()), 0);
  const DeviceTensor saved = tensor({64}, DType::UInt8);
  EXPECT_ERROR_CONTAINS("cheri_block: saved was given (uint8 [64] on cpu), but this call keeps "
                        "nothing for the backward (cheri_block_saved_bytes is 0)",
                        [&] {
                          fusekit::cheri_block(t_.out.view, t_.mean.view, t_.rstd.view, saved.view,
                                               t_.x.view, t_.weights());
                        });
  EXPECT_ERROR_CONTAINS("cheri_block_backward: saved was given", [&] {
    fusekit::cheri_block_backward(t_.grad_x.view, t_.grads(), t_.grad_out.view, t_.x.view,
                                  t_.weights(), t_.mean_in.view, t_.rstd_in.view, saved.view);
  });
  CheriBlockWeights w = t_.weights();
  w.linear2_weight = t_.linear1.view;
  EXPECT_ERROR_CONTAINS("cheri_block_saved_bytes: weights.linear2_weight has shape [8, 4], "
                        "expected [C, E C] = [4, 8]",
                        [&] { fusekit::cheri_block_saved_bytes(t_.x.view, w); });
  EXPECT_ERROR_CONTAINS("cheri_block_saved_bytes: x has 2 dims", [&] {
    fusekit::cheri_block_saved_bytes(TensorView(nullptr, DType::Float32, {2, 5}), t_.weights());
  });
}

}  // namespace
