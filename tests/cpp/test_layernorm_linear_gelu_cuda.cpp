// layernorm_linear_gelu on the CUDA backend: against float64 and against the CPU backend on the
// same inputs, in every dtype, TF32 and exact float32, awkward shapes and layouts (misaligned
// pointers included), large means, the benchmark shapes, determinism, streams and CUDA-graph
// capture. Every test skips with "no CUDA device" where there is none.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "common/cuda_check.h"
#include "cuda_test_support.h"
#include "layernorm_linear_gelu_support.h"
#include "ops/layernorm_linear_gelu/layernorm_linear_gelu_params.h"

namespace {

using namespace fusekit_test;
using fusekit::testing::download;

constexpr Device kCpu = Device::cpu();
constexpr Device kCuda = Device::cuda(0);
constexpr DType kDtypes[] = {DType::Float32, DType::BFloat16, DType::Float16};
using Product = fusekit::detail::LayerNormLinearGeluParams::Product;

// The call with the CUDA backend's matrix product named instead of chosen.
void run_lola_product(const LolaTensors& t, const LolaCase& c, LayerNormLinearGeluOptions options,
                      Product product) {
  options.approximate = c.approximate;
  fusekit::detail::LayerNormLinearGeluParams p = fusekit::detail::layernorm_linear_gelu_params(
      t.out.view, t.x.view, t.weight.view, t.bias.view, t.ln_weight.view, t.ln_bias.view, options);
  p.product = product;
  fusekit::detail::launch_layernorm_linear_gelu(p, 0, {});
}

// One CUDA call into a poisoned output, checked against float64, against the CPU backend on the
// same inputs, and for writes outside the output's view.
void check_cuda(const LolaCase& c, DType dtype, std::mt19937_64& rng, const LolaLayouts& layouts = {},
                LayerNormLinearGeluOptions options = {}, DType ln_dtype = DType::Float32,
                Product product = Product::Auto) {
  const LolaInputs in = make_lola_inputs(c, dtype, rng, ln_dtype);
  const LolaTensors t = upload_lola(in, c, dtype, kCuda, layouts, ln_dtype);
  if (product == Product::Auto) {
    run_lola(t, c, options);
  } else {
    run_lola_product(t, c, options, product);
  }
  expect_device_ok();
  const HostTensor got = download_lola(t, c);
  const Tolerance tol = lola_cuda_tolerance(dtype, options.allow_tf32);
  expect_close(got, lola_reference(in, c, options.eps), tol, "out against float64");
  expect_only_view_written(t.out, "out");

  const LolaTensors cpu = upload_lola(in, c, dtype, kCpu, {}, ln_dtype);
  run_lola(cpu, c, options);
  expect_close(got, download_lola(cpu, c), tol, "out against the CPU backend");
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
    {{300}, 64, 40},
    {{1000}, 1000, 1000},
    {{4}, 512, 33, true, false, GeluApproximation::Tanh, 100.0, 1.0},
    {{33}, 1024, 64, true, true, GeluApproximation::Tanh, 100.0, 1.0},
    {{4}, 511, 20, true, true, GeluApproximation::None, -2.3, 0.5},
    {{2, 1, 3}, 16, 8},
    {{16}, 4096, 2048},  // decode-like: few rows, long K
    // Up to 64 rows with K a multiple of 8 take the few-rows kernel: partial steps of k, partial
    // tiles of rows and columns, 16, 32 and 64 rows a block, 32 and 64 columns a block.
    {{17}, 200, 130, true, false, GeluApproximation::None},
    {{2, 16}, 72, 4100},
    {{1}, 256, 9001, true, true, GeluApproximation::None, 100.0, 1.0},
    {{48}, 8, 70},
    {{65}, 64, 40},  // one row past the few-rows kernel
};

class LolaCuda : public CudaTest<::testing::TestWithParam<std::tuple<DType, LolaCase>>> {};

TEST_P(LolaCuda, MatchesFloat64AndCpu) {
  const auto [dtype, c] = GetParam();
  check_cuda(c, dtype, rng_);
}

INSTANTIATE_TEST_SUITE_P(All, LolaCuda,
                         ::testing::Combine(::testing::ValuesIn(kDtypes), ::testing::ValuesIn(kCases)),
                         [](const auto& info) {
                           return dtype_name(std::get<0>(info.param)) + "_" +
                                  lola_case_name(std::get<1>(info.param));
                         });

class LolaCudaExactFloat32 : public CudaTest<::testing::TestWithParam<LolaCase>> {};

TEST_P(LolaCudaExactFloat32, MatchesFloat64) {
  LayerNormLinearGeluOptions options;
  options.allow_tf32 = false;
  check_cuda(GetParam(), DType::Float32, rng_, {}, options);
}

INSTANTIATE_TEST_SUITE_P(All, LolaCudaExactFloat32, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return lola_case_name(info.param); });

// The benchmark shapes (the first, and the decode shape), in float16.
class LolaCudaBenchShapes : public CudaTest<::testing::TestWithParam<LolaCase>> {};

TEST_P(LolaCudaBenchShapes, MatchesFloat64AndCpu) { check_cuda(GetParam(), DType::Float16, rng_); }

INSTANTIATE_TEST_SUITE_P(Float16, LolaCudaBenchShapes,
                         ::testing::Values(LolaCase{{512}, 1024, 4096}, LolaCase{{16}, 4096, 16384}),
                         [](const auto& info) { return lola_case_name(info.param); });

// ------------------------------------------------------------------------------------ products
//
// Each matrix product on calls it takes, whatever the automatic choice: cuBLASLt, the few-rows
// kernel (at most 64 rows) and the warpgroup product (sm_90a builds on compute capability 9.0):
// partial tiles of rows, columns and k, one row, K = 8, large means, both GELUs.

const LolaCase kProductCases[] = {
    {{2}, 8, 67},
    {{16}, 4096, 2048},
    {{17}, 200, 130, true, false, GeluApproximation::None},
    {{48}, 8, 70},
    {{1}, 256, 9001, true, true, GeluApproximation::None, 100.0, 1.0},
    {{3, 21}, 72, 257},
    {{65}, 64, 40},
    {{129}, 136, 257, false, true, GeluApproximation::None},
    {{300}, 1024, 130, true, false, GeluApproximation::Tanh, 100.0, 1.0},
    {{1000}, 1000, 1000},
    // K a multiple of 64 and at most 64 rows (the warpgroup product's weight in boxes of 8 rows
    // by two 64-element chunks): an odd number of chunks (the last step's second chunk outside
    // the weight), rows and columns past a tile.
    {{5}, 192, 300},
    {{40}, 320, 130, true, true, GeluApproximation::None},
    // Rows of one value (no variance: rstd = 1 / sqrt(eps), the normalised rows 0) and a large
    // negative mean, through every product.
    {{33}, 512, 200, true, false, GeluApproximation::Tanh, 3.25, 0.0},
    {{70}, 1024, 300, true, false, GeluApproximation::None, -100.0, 2.0},
};

class LolaCudaProducts
    : public CudaTest<::testing::TestWithParam<std::tuple<Product, DType, LolaCase>>> {};

TEST_P(LolaCudaProducts, MatchesFloat64AndCpu) {
  const auto [product, dtype, c] = GetParam();
  if (product == Product::FewRows && rows_of(c) > 64) GTEST_SKIP() << "more than 64 rows";
  if (product == Product::Warpgroup && !fusekit::detail::has_warpgroup_mma(0)) {
    GTEST_SKIP() << "the warpgroup product needs an sm_90a build on a compute capability 9.0 device";
  }
  check_cuda(c, dtype, rng_, {}, {}, DType::Float32, product);
}

INSTANTIATE_TEST_SUITE_P(
    All, LolaCudaProducts,
    ::testing::Combine(::testing::Values(Product::Library, Product::FewRows, Product::Warpgroup),
                       ::testing::Values(DType::BFloat16, DType::Float16),
                       ::testing::ValuesIn(kProductCases)),
    [](const auto& info) {
      const Product product = std::get<0>(info.param);
      const char* name = product == Product::Library   ? "library"
                         : product == Product::FewRows ? "few_rows"
                                                       : "warpgroup";
      return std::string(name) + "_" + dtype_name(std::get<1>(info.param)) + "_" +
             lola_case_name(std::get<2>(info.param));
    });

// ------------------------------------------------------------------------------------ layouts

class LolaCudaLayouts : public CudaTest<::testing::TestWithParam<std::tuple<DType, LolaLayoutCase>>> {};

TEST_P(LolaCudaLayouts, MatchesFloat64AndCpu) {
  const auto [dtype, l] = GetParam();
  check_cuda({{2, 3}, 40, 24, true, true}, dtype, rng_, l.layouts);
  check_cuda({{4, 16}, 256, 128, true, true}, dtype, rng_, l.layouts);
}

INSTANTIATE_TEST_SUITE_P(All, LolaCudaLayouts,
                         ::testing::Combine(::testing::ValuesIn(kDtypes), ::testing::ValuesIn(kLolaLayouts)),
                         [](const auto& info) {
                           return dtype_name(std::get<0>(info.param)) + "_" +
                                  std::get<1>(info.param).name;
                         });

// ------------------------------------------------------------------------------------ the rest

class LolaCudaMisc : public CudaTest<> {};

TEST_F(LolaCudaMisc, NamedProductThatDoesNotFitIsAnError) {
  const LolaCase c{{4}, 12, 6};  // K not a multiple of 8
  const LolaInputs in = make_lola_inputs(c, DType::Float16, rng_);
  const LolaTensors t = upload_lola(in, c, DType::Float16, kCuda);
  EXPECT_ERROR_CONTAINS("the few-rows product was asked for",
                        [&] { run_lola_product(t, c, {}, Product::FewRows); });
  EXPECT_ERROR_CONTAINS("the warpgroup product was asked for",
                        [&] { run_lola_product(t, c, {}, Product::Warpgroup); });
  const LolaInputs in32 = make_lola_inputs(c, DType::Float32, rng_);
  const LolaTensors t32 = upload_lola(in32, c, DType::Float32, kCuda);
  EXPECT_ERROR_CONTAINS("fusekit's own products take float16 and bfloat16 only",
                        [&] { run_lola_product(t32, c, {}, Product::Warpgroup); });
}

TEST_F(LolaCudaMisc, LnParamsInTheInputDtype) {
  check_cuda({{6}, 48, 16, true, true}, DType::BFloat16, rng_, {}, {}, DType::BFloat16);
  check_cuda({{6}, 48, 16, true, true}, DType::Float16, rng_, {}, {}, DType::Float16);
}

TEST_F(LolaCudaMisc, EmptyRowsAndOutputsWriteNothing) {
  for (const LolaCase& c : {LolaCase{{0}, 16, 8}, LolaCase{{4}, 16, 0}, LolaCase{{2, 0}, 5, 3}}) {
    const LolaInputs in = make_lola_inputs(c, DType::Float16, rng_);
    const LolaTensors t = upload_lola(in, c, DType::Float16, kCuda);
    run_lola(t, c);
    expect_device_ok();
    expect_only_view_written(t.out, "out");
  }
}

TEST_F(LolaCudaMisc, BitwiseDeterministic) {
  for (DType dtype : kDtypes) {
    // 40 rows: the few-rows kernel adds its k groups' sums in a fixed order
    for (const LolaCase& c : {LolaCase{{257}, 1000, 520, true, true}, LolaCase{{40}, 1000, 520}}) {
      const LolaInputs in = make_lola_inputs(c, dtype, rng_);
      const LolaTensors a = upload_lola(in, c, dtype, kCuda);
      const LolaTensors b = upload_lola(in, c, dtype, kCuda);
      run_lola(a, c);
      run_lola(b, c);
      run_lola(b, c);
      expect_device_ok();
      EXPECT_EQ(raw_bytes(a.out), raw_bytes(b.out)) << fusekit::to_string(dtype);
    }
  }
}

TEST_F(LolaCudaMisc, RunsOnTheGivenStream) {
  const LolaCase c{{64}, 512, 256, true, true, GeluApproximation::None};
  const LolaInputs in = make_lola_inputs(c, DType::BFloat16, rng_);
  const LolaTensors t = upload_lola(in, c, DType::BFloat16, kCuda);
  OwnStream s;
  run_lola(t, c, {}, s.stream());
  ASSERT_CUDA(cudaStreamSynchronize(s.get()));
  expect_close(download_lola(t, c), lola_reference(in, c), lola_cuda_tolerance(DType::BFloat16),
               "out");
}

// Tensors on the second device while the first is current: a stream of the first is rejected
// before anything runs, one of the second runs the warpgroup product there.
TEST_F(LolaCudaMisc, SecondDeviceAndItsStream) {
  SKIP_WITHOUT_TWO_DEVICES();
  const LolaCase c{{7}, 128, 96, true, true, GeluApproximation::Tanh};
  const LolaInputs in = make_lola_inputs(c, DType::BFloat16, rng_);
  const LolaTensors t = upload_lola(in, c, DType::BFloat16, Device::cuda(1));
  ASSERT_NO_FATAL_FAILURE(run_on_the_second_device(
      "layernorm_linear_gelu", {&t.out}, [&](fusekit::Stream s) { run_lola(t, c, {}, s); }));
  expect_close(download_lola(t, c), lola_reference(in, c), lola_cuda_tolerance(DType::BFloat16),
               "out");
}

class LolaCudaGraph
    : public CudaTest<::testing::TestWithParam<std::tuple<GeluApproximation, std::int64_t>>> {};

// Both row counts take fusekit's own product where it runs (the warpgroup product on sm_90a, the
// few-rows kernel and cuBLASLt elsewhere), launched as a dependent of the LayerNorm.
TEST_P(LolaCudaGraph, CapturedCallReplays) {
  const auto [approximate, rows] = GetParam();
  LolaCase c{{3, rows / 3}, 768, 1000, true, true, approximate};
  const LolaInputs in = make_lola_inputs(c, DType::Float16, rng_);
  LolaTensors t = upload_lola(in, c, DType::Float16, kCuda);

  OwnStream s;
  CapturedGraph graph;
  ASSERT_NO_FATAL_FAILURE(graph.capture(s.get(), [&] { run_lola(t, c, {}, s.stream()); }));
  GraphNodeCounts nodes;
  ASSERT_NO_FATAL_FAILURE(graph.count_nodes(nodes));
  EXPECT_GE(nodes.total, 3) << "workspace allocation, LayerNorm, matrix product";

  for (int replay = 0; replay < 2; ++replay) {
    SCOPED_TRACE("replay " + std::to_string(replay));
    ASSERT_NO_FATAL_FAILURE(graph.replay({&t.out}));
    expect_close(download_lola(t, c), lola_reference(in, c), lola_cuda_tolerance(DType::Float16),
                 "out");
  }
}

INSTANTIATE_TEST_SUITE_P(Gelu, LolaCudaGraph,
                         ::testing::Combine(::testing::Values(GeluApproximation::Tanh,
                                                              GeluApproximation::None),
                                            ::testing::Values(std::int64_t{120}, std::int64_t{15})),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) == GeluApproximation::Tanh
                                                  ? "tanh"
                                                  : "erf") +
                                  "_M" + std::to_string(std::get<1>(info.param));
                         });

TEST_F(LolaCudaMisc, MixedDevicesAreRejected) {
  const LolaCase c{{4}, 8, 6};
  const LolaInputs in = make_lola_inputs(c, DType::Float16, rng_);
  const LolaTensors gpu = upload_lola(in, c, DType::Float16, kCuda);
  const LolaTensors cpu = upload_lola(in, c, DType::Float16, kCpu);
  EXPECT_ERROR_CONTAINS("weight is on cpu but x is on cuda:0; expected one device", [&] {
    fusekit::layernorm_linear_gelu(gpu.out.view, gpu.x.view, cpu.weight.view, gpu.bias.view);
  });
}

}  // namespace
