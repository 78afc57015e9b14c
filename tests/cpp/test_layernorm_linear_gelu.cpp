// layernorm_linear_gelu on the CPU backend: against the float64 reference in every dtype, awkward
// shapes and layouts, large means, determinism, both matrix-product paths, and every validation
// error.
#include <gtest/gtest.h>

#include <cstring>
#include <tuple>

#include "common/cpu_gemm.h"
#include "layernorm_linear_gelu_support.h"

namespace {

using namespace fusekit_test;
using fusekit::testing::download;
using fusekit::testing::empty_poisoned;
using fusekit::testing::upload;

constexpr Device kCpu = Device::cpu();
constexpr DType kDtypes[] = {DType::Float32, DType::BFloat16, DType::Float16};

void check_cpu(const LolaCase& c, DType dtype, std::mt19937_64& rng, const LolaLayouts& layouts = {},
               DType ln_dtype = DType::Float32) {
  const LolaInputs in = make_lola_inputs(c, dtype, rng, ln_dtype);
  const LolaTensors t = upload_lola(in, c, dtype, kCpu, layouts, ln_dtype);
  run_lola(t, c);
  expect_close(download_lola(t, c), lola_reference(in, c), lola_cpu_tolerance(dtype), "out");
  expect_only_view_written(t.out, "out");
}

// ------------------------------------------------------------------------------------ shapes

const LolaCase kCases[] = {
    {{1}, 1, 1},
    {{1}, 3, 1000},
    {{3}, 1000, 3},
    {{7}, 33, 17, false},
    {{5}, 1000, 1, true, true},
    {{2, 3}, 40, 24, true, true, GeluApproximation::None},
    {{64}, 128, 96},
    {{9}, 257, 65, false, true, GeluApproximation::None},
    {{300}, 64, 40},  // more rows than one CPU block
    {{4}, 512, 33, true, false, GeluApproximation::Tanh, 100.0, 1.0},
    {{4}, 511, 20, true, true, GeluApproximation::None, -2.3, 0.5},
    {{2, 1, 3}, 16, 8},
};

class LolaCpu : public Seeded<::testing::TestWithParam<std::tuple<DType, LolaCase>>> {};

TEST_P(LolaCpu, MatchesFloat64) {
  const auto [dtype, c] = GetParam();
  check_cpu(c, dtype, rng_);
}

INSTANTIATE_TEST_SUITE_P(All, LolaCpu,
                         ::testing::Combine(::testing::ValuesIn(kDtypes), ::testing::ValuesIn(kCases)),
                         [](const auto& info) {
                           return dtype_name(std::get<0>(info.param)) + "_" +
                                  lola_case_name(std::get<1>(info.param));
                         });

// ------------------------------------------------------------------------------------ layouts

class LolaCpuLayouts : public Seeded<::testing::TestWithParam<std::tuple<DType, LolaLayoutCase>>> {};

TEST_P(LolaCpuLayouts, MatchesFloat64) {
  const auto [dtype, l] = GetParam();
  check_cpu({{2, 3}, 37, 29, true, true}, dtype, rng_, l.layouts);
}

INSTANTIATE_TEST_SUITE_P(All, LolaCpuLayouts,
                         ::testing::Combine(::testing::ValuesIn(kDtypes), ::testing::ValuesIn(kLolaLayouts)),
                         [](const auto& info) {
                           return dtype_name(std::get<0>(info.param)) + "_" +
                                  std::get<1>(info.param).name;
                         });

// ------------------------------------------------------------------------------------ the rest

class LolaCpuMisc : public Seeded<> {};

TEST_F(LolaCpuMisc, LnParamsInTheInputDtype) {
  check_cpu({{6}, 48, 16, true, true}, DType::BFloat16, rng_, {}, DType::BFloat16);
  check_cpu({{6}, 48, 16, true, true}, DType::Float16, rng_, {}, DType::Float16);
}

TEST_F(LolaCpuMisc, EmptyRowsAndOutputsWriteNothing) {
  for (const LolaCase& c : {LolaCase{{0}, 16, 8}, LolaCase{{4}, 16, 0}, LolaCase{{2, 0}, 5, 3}}) {
    const LolaInputs in = make_lola_inputs(c, DType::Float32, rng_);
    const LolaTensors t = upload_lola(in, c, DType::Float32, kCpu);
    run_lola(t, c);
    expect_only_view_written(t.out, "out");
  }
}

TEST_F(LolaCpuMisc, EpsIsUsed) {
  // constant rows: the variance is 0, so the output is GELU(bias) for any eps; a row of two
  // values +-1 has variance 1, so rstd = 1 / sqrt(1 + eps) shows eps.
  const LolaCase c{{1}, 2, 1, false};
  LolaInputs in = make_lola_inputs(c, DType::Float32, rng_);
  in.x.values = {1.0, -1.0};
  in.weight.values = {1.0, 0.0};
  const LolaTensors t = upload_lola(in, c, DType::Float32, kCpu);
  fusekit::LayerNormLinearGeluOptions options;
  options.eps = 3.0;
  run_lola(t, c, options);
  expect_close(download_lola(t, c), lola_reference(in, c, 3.0), lola_cpu_tolerance(DType::Float32),
               "eps 3");
  EXPECT_NEAR(download_lola(t, c).values[0], fusekit::testing::gelu_reference(0.5, c.approximate),
              1e-6);
}

TEST_F(LolaCpuMisc, BitwiseDeterministic) {
  const LolaCase c{{33}, 300, 70, true, true};
  const LolaInputs in = make_lola_inputs(c, DType::BFloat16, rng_);
  const LolaTensors a = upload_lola(in, c, DType::BFloat16, kCpu);
  const LolaTensors b = upload_lola(in, c, DType::BFloat16, kCpu);
  run_lola(a, c);
  run_lola(b, c);
  EXPECT_EQ(raw_bytes(a.out), raw_bytes(b.out));
}

TEST_F(LolaCpuMisc, GemmPathsAgree) {
  // the BLAS (when built with one) and the loops: C = A B^T with leading dimensions
  const std::int64_t m = 37, n = 53, k = 129, lda = 131, ldb = 140, ldc = 60;
  std::normal_distribution<float> normal;
  std::vector<float> a(m * lda), b(n * ldb), c1(m * ldc, -7.0f), c2(m * ldc, -7.0f);
  for (float& v : a) v = normal(rng_);
  for (float& v : b) v = normal(rng_);
  fusekit::detail::gemm_nt(m, n, k, a.data(), lda, b.data(), ldb, c1.data(), ldc);
  fusekit::detail::gemm_nt_loops(m, n, k, a.data(), lda, b.data(), ldb, c2.data(), ldc);
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < ldc; ++j) {
      double expected = 0;
      for (std::int64_t q = 0; q < k; ++q) expected += double(a[i * lda + q]) * b[j % n * ldb + q];
      if (j >= n) {  // the padding of each C row is left alone
        EXPECT_EQ(c1[i * ldc + j], -7.0f);
        EXPECT_EQ(c2[i * ldc + j], -7.0f);
        continue;
      }
      EXPECT_NEAR(c1[i * ldc + j], expected, 1e-4) << i << ", " << j;
      EXPECT_NEAR(c2[i * ldc + j], expected, 1e-4) << i << ", " << j;
    }
  }
}

// ------------------------------------------------------------------------------------ errors

class LolaErrors : public Seeded<> {
 protected:
  LolaCase c_{{4}, 8, 6, true, true};
  LolaInputs in_ = make_lola_inputs(c_, DType::Float16, rng_);
  LolaTensors t_ = upload_lola(in_, c_, DType::Float16, kCpu);

  void call(const TensorView& out, const TensorView& x, const TensorView& w, const TensorView& b,
            const TensorView& lw, const TensorView& lb,
            fusekit::LayerNormLinearGeluOptions options = {}) {
    fusekit::layernorm_linear_gelu(out, x, w, b, lw, lb, options);
  }
  DeviceTensor tensor(std::vector<std::int64_t> shape, DType dtype, Layout layout = {}) {
    return empty_poisoned(shape, dtype, kCpu, layout);
  }
};

TEST_F(LolaErrors, Shapes) {
  const auto& t = t_;
  const DeviceTensor x_bad_k = tensor({4, 9}, DType::Float16);
  EXPECT_ERROR_CONTAINS("layernorm_linear_gelu: weight has shape [6, 8], expected [Nout, K] = [6, 9]", [&] {
    call(t.out.view, x_bad_k.view, t.weight.view, t.bias.view, {}, {});
  });
  const DeviceTensor w3 = tensor({6, 8, 1}, DType::Float16);
  EXPECT_ERROR_CONTAINS("weight has 3 dims [6, 8, 1], expected 2 dims [Nout, K]",
                        [&] { call(t.out.view, t.x.view, w3.view, t.bias.view, {}, {}); });
  const DeviceTensor out_bad = tensor({4, 7}, DType::Float16);
  EXPECT_ERROR_CONTAINS("out [4, 7] has 7 features in its last dim, expected Nout = 6",
                        [&] { call(out_bad.view, t.x.view, t.weight.view, {}, {}, {}); });
  const DeviceTensor out_rows = tensor({5, 6}, DType::Float16);
  EXPECT_ERROR_CONTAINS("out [5, 6] has size 5 in dim 0, expected 4",
                        [&] { call(out_rows.view, t.x.view, t.weight.view, {}, {}, {}); });
  const DeviceTensor out_3d = tensor({4, 1, 6}, DType::Float16);
  EXPECT_ERROR_CONTAINS("out [4, 1, 6] has 3 dims, expected 2",
                        [&] { call(out_3d.view, t.x.view, t.weight.view, {}, {}, {}); });
  const DeviceTensor bias_bad = tensor({5}, DType::Float16);
  EXPECT_ERROR_CONTAINS("bias has shape [5], expected [Nout] = [6]",
                        [&] { call(t.out.view, t.x.view, t.weight.view, bias_bad.view, {}, {}); });
  const DeviceTensor ln_bad = tensor({7}, DType::Float32);
  EXPECT_ERROR_CONTAINS("ln_weight has shape [7], expected [K] = [8]", [&] {
    call(t.out.view, t.x.view, t.weight.view, {}, ln_bad.view, t.ln_bias.view);
  });
  EXPECT_ERROR_CONTAINS("ln_bias has shape [7], expected [K] = [8]", [&] {
    call(t.out.view, t.x.view, t.weight.view, {}, t.ln_weight.view, ln_bad.view);
  });
  const DeviceTensor x_k0 = tensor({4, 0}, DType::Float16), w_k0 = tensor({6, 0}, DType::Float16);
  EXPECT_ERROR_CONTAINS("x [4, 0] has K = 0 features; LayerNorm needs K >= 1",
                        [&] { call(t.out.view, x_k0.view, w_k0.view, {}, {}, {}); });
  TensorView scalar = t.x.view;
  scalar.ndim = 0;
  EXPECT_ERROR_CONTAINS("x has 0 dims, expected [..., K]",
                        [&] { call(t.out.view, scalar, t.weight.view, {}, {}, {}); });
}

TEST_F(LolaErrors, Dtypes) {
  const auto& t = t_;
  const DeviceTensor x64 = tensor({4, 8}, DType::Float64);
  EXPECT_ERROR_CONTAINS("x has dtype float64, expected bfloat16, float16 or float32",
                        [&] { call(t.out.view, x64.view, t.weight.view, {}, {}, {}); });
  const DeviceTensor w32 = tensor({6, 8}, DType::Float32);
  EXPECT_ERROR_CONTAINS("weight has dtype float32 but x has float16; expected the same dtype",
                        [&] { call(t.out.view, t.x.view, w32.view, {}, {}, {}); });
  const DeviceTensor out32 = tensor({4, 6}, DType::Float32);
  EXPECT_ERROR_CONTAINS("out has dtype float32 but x has float16; expected the same dtype",
                        [&] { call(out32.view, t.x.view, t.weight.view, {}, {}, {}); });
  const DeviceTensor b32 = tensor({6}, DType::Float32);
  EXPECT_ERROR_CONTAINS("bias has dtype float32 but x has float16; expected the same dtype",
                        [&] { call(t.out.view, t.x.view, t.weight.view, b32.view, {}, {}); });
  const DeviceTensor lbf = tensor({8}, DType::BFloat16);
  EXPECT_ERROR_CONTAINS("ln_weight has dtype bfloat16, expected float16 or float32",
                        [&] { call(t.out.view, t.x.view, t.weight.view, {}, lbf.view, {}); });
}

TEST_F(LolaErrors, Layouts) {
  const auto& t = t_;
  const DeviceTensor out_t = tensor({4, 6}, DType::Float16, {{1, 0}, 0, 0});
  EXPECT_ERROR_CONTAINS("out [4, 6] has strides (1, 4); expected a contiguous last dim",
                        [&] { call(out_t.view, t.x.view, t.weight.view, {}, {}, {}); });
  const DeviceTensor out_perm = tensor({2, 3, 6}, DType::Float16, {{1, 0, 2}, 0, 0});
  const DeviceTensor x3 = tensor({2, 3, 8}, DType::Float16);
  EXPECT_ERROR_CONTAINS("leading dims that collapse to one row stride",
                        [&] { call(out_perm.view, x3.view, t.weight.view, {}, {}, {}); });
  TensorView w_strided = t.weight.view;
  w_strided.shape = {6, 4};
  w_strided.strides = {8, 2};
  const DeviceTensor x4 = tensor({4, 4}, DType::Float16);
  EXPECT_ERROR_CONTAINS("weight [6, 4] has strides (8, 2); expected a unit stride on one axis",
                        [&] { call(t.out.view, x4.view, w_strided, {}, {}, {}); });
  TensorView w_overlap = t.weight.view;
  w_overlap.strides = {4, 1};
  EXPECT_ERROR_CONTAINS("its rows overlap",
                        [&] { call(t.out.view, t.x.view, w_overlap, {}, {}, {}); });
  const DeviceTensor bias_strided = tensor({6}, DType::Float16, {{}, 0, 0});
  TensorView b = bias_strided.view;
  b.shape = {3};
  b.strides = {2};
  const DeviceTensor w3 = tensor({3, 8}, DType::Float16), out3 = tensor({4, 3}, DType::Float16);
  EXPECT_ERROR_CONTAINS("bias has stride 2, expected a contiguous [Nout] vector",
                        [&] { call(out3.view, t.x.view, w3.view, b, {}, {}); });
  TensorView out_bcast = t.out.view;
  out_bcast.strides = {0, 1};
  EXPECT_ERROR_CONTAINS("output out has stride 0 in dim 0",
                        [&] { call(out_bcast, t.x.view, t.weight.view, {}, {}, {}); });
}

TEST_F(LolaErrors, OverlapAndOptions) {
  const auto& t = t_;
  TensorView out_on_x = t.x.view;  // [4, 8] float16 storage viewed as a [4, 6] output
  out_on_x.shape = {4, 6};
  EXPECT_ERROR_CONTAINS("out overlaps x in memory",
                        [&] { call(out_on_x, t.x.view, t.weight.view, {}, {}, {}); });
  fusekit::LayerNormLinearGeluOptions options;
  options.eps = -1;
  EXPECT_ERROR_CONTAINS("options.eps is -1, expected a finite value >= 0", [&] {
    call(t.out.view, t.x.view, t.weight.view, {}, {}, {}, options);
  });
  options = {};
  options.approximate = static_cast<GeluApproximation>(7);
  EXPECT_ERROR_CONTAINS("options.approximate is 7", [&] {
    call(t.out.view, t.x.view, t.weight.view, {}, {}, {}, options);
  });
  TensorView null_x = t.x.view;
  null_x.data = nullptr;
  EXPECT_ERROR_CONTAINS("x (float16 [4, 8] on cpu) has a null data pointer", [&] { call(t.out.view, null_x, t.weight.view, {}, {}, {}); });
}

TEST_F(LolaErrors, Devices) {
  const auto& t = t_;
  TensorView w_cuda = t.weight.view;
  w_cuda.device = Device::cuda(0);
  EXPECT_ERROR_CONTAINS("weight is on cuda:0 but x is on cpu; expected one device",
                        [&] { call(t.out.view, t.x.view, w_cuda, {}, {}, {}); });
}

}  // namespace
