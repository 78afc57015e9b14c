// trimul on the CUDA backend: against the float64 reference for both directions, normal and
// Cauchy inputs, every mask dtype, x in every dtype with float32 weights and weights in x's dtype,
// awkward sizes, the model's channel counts and every layout; at large N against the CPU backend
// on the same inputs. Outputs are poisoned and checked for writes outside their view. Also empty
// inputs, bitwise determinism, streams and CUDA-graph capture. Every test skips with "no CUDA
// device" where there is none.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "common/cuda_check.h"
#include "cuda_test_support.h"
#include "ops/trimul/trimul_params.h"
#include "trimul_support.h"

namespace {

using namespace fusekit_test;
using fusekit::testing::upload;

constexpr Device kCpu = Device::cpu();
constexpr Device kCuda = Device::cuda(0);
constexpr DType kDtypes[] = {DType::Float32, DType::BFloat16, DType::Float16};
constexpr auto kIncoming = TrimulDirection::Incoming;
constexpr auto kOutgoing = TrimulDirection::Outgoing;
using ProjectKernel = fusekit::detail::TrimulProjectKernel;

// ------------------------------------------------------------------------------------ checks

// One CUDA call into a poisoned output, checked for writes outside out's view; then no error may
// be left on the device.
HostTensor run_cuda(const TrimulInputs& in, const TrimulCase& c, const TrimulLayouts& layouts = {}) {
  HostTensor got = run_trimul_checked(in, c, kCuda, layouts);
  expect_device_ok();
  return got;
}

// The same with the projection kernel named instead of chosen.
HostTensor run_cuda_projecting(const TrimulInputs& in, const TrimulCase& c, ProjectKernel kernel,
                               const TrimulLayouts& layouts = {}) {
  HostTensor got = run_trimul_checked_with(in, c, kCuda, layouts, [&](const TrimulTensors& t) {
    const TrimulOptions options{.direction = c.direction, .eps = c.eps};
    fusekit::detail::TrimulParams p = fusekit::detail::trimul_params(
        t.out.view, t.x.view, t.mask.view, t.weights.views(), options);
    p.project_kernel = kernel;
    fusekit::detail::launch_trimul(p, 0, {});
  });
  expect_device_ok();
  return got;
}

void expect_matches_float64(const HostTensor& got, const TrimulInputs& in, const TrimulCase& c,
                            const std::string& what = "out against float64") {
  const HostTensor expected = trimul_float64(in, c);
  expect_close(got, expected, trimul_cuda_tolerance(c, expected), what);
}

void check_cuda(const TrimulCase& c, std::mt19937_64& rng, const TrimulLayouts& layouts = {}) {
  const TrimulInputs in = make_trimul_inputs(c, rng);
  expect_matches_float64(run_cuda(in, c, layouts), in, c);
}

// The CPU backend on the same inputs, run in float32 (x, out and weights; the mask as it is):
// the inputs are already rounded to their dtypes, so float32 holds them exactly, and the CPU's
// error against float64 (1e-5 of the output size) is far inside the CUDA bound, which therefore
// applies to it unchanged. For the sizes where float64 would be too slow.
HostTensor cpu_float32(const TrimulInputs& in, TrimulCase c) {
  c.dtype = DType::Float32;
  c.weight_dtype = DType::Float32;
  return run_trimul_checked(in, c, kCpu);
}

void expect_matches_cpu(const HostTensor& got, const TrimulInputs& in, const TrimulCase& c,
                        const std::string& what = "out against the CPU backend") {
  const HostTensor expected = cpu_float32(in, c);
  expect_close(got, expected, trimul_cuda_tolerance(c, expected), what);
}

const TrimulLayouts& layouts_named(std::string_view name) {
  for (const TrimulLayoutCase& l : kTrimulLayouts) {
    if (name == l.name) return l.layouts;
  }
  ADD_FAILURE() << "kTrimulLayouts has no layout named " << name;
  return kTrimulLayouts[0].layouts;
}

// ------------------------------------------------------------------------------------ shapes

// x's dtype and the weights' dtype: float32 weights with every x, and weights in x's dtype.
struct DtypeCase {
  DType x, weights;
};

const DtypeCase kDtypeCases[] = {
    {DType::Float32, DType::Float32},   {DType::BFloat16, DType::Float32},
    {DType::Float16, DType::Float32},   {DType::BFloat16, DType::BFloat16},
    {DType::Float16, DType::Float16},
};

TrimulCase with_dtypes(TrimulCase c, const DtypeCase& d) {
  c.dtype = d.x;
  c.weight_dtype = d.weights;
  return c;
}

// Both directions, batch 1 to 8, N of 1, 7, 12, 16, 20, 24 and 33, C of 1, 3, 4, 40, 64, 96 and
// 1000 (beyond the model's 768), H of 1, 24, 40, 128 and 200 (above the model's 128), normal and
// Cauchy inputs, with and without masks; most sizes fill no whole tile. N a multiple of 8 (16,
// 24) sends the warpgroup projection's planes through the copy engine, whose boxes of 32
// channels must stop at H within each batch (B = 2 with H = 24).
//
// The Frobenius bound holds where the float16 rounding errors average out over many outputs.
// C = 1 (LayerNorm over one channel drops x: every output is the same value), C = 3 and H = 1
// leave few independent outputs, so these sizes come only together (C of 1, 3 and 4 with H = 1),
// where each output is a product of a few rounded factors. In a float16 model of the pipeline
// the header describes, C = 1 or 3 with larger H, or H = 1 with C of 40 and more, exceed 1e-3 on
// 1 to 15 percent of seeds.
const TrimulCase kCases[] = {
    {1, 1, 1, 1},
    {8, 1, 96, 128, kIncoming, TrimulMask::Random},
    {2, 7, 40, 24},
    {2, 7, 40, 24, kIncoming, TrimulMask::Random},
    {2, 12, 4, 1, kIncoming},
    {2, 33, 3, 1, kOutgoing, TrimulMask::None, TrimulDist::Cauchy},
    {2, 33, 40, 24, kOutgoing, TrimulMask::Random},
    {2, 33, 40, 24, kIncoming, TrimulMask::Random, TrimulDist::Cauchy},
    {2, 33, 40, 24, kOutgoing, TrimulMask::None, TrimulDist::Cauchy},
    {2, 16, 64, 128, kOutgoing, TrimulMask::Random},
    {2, 16, 40, 24, kIncoming, TrimulMask::Random},  // H = 24 in planes copied as boxes of 32 channels
    {1, 20, 96, 200, kIncoming, TrimulMask::None, TrimulDist::Cauchy},
    {1, 24, 1000, 40, kOutgoing, TrimulMask::Random},
};

// kCases in every pair of dtypes.
std::vector<TrimulCase> cases_in_every_dtype() {
  std::vector<TrimulCase> cases;
  for (const DtypeCase& d : kDtypeCases) {
    for (const TrimulCase& c : kCases) cases.push_back(with_dtypes(c, d));
  }
  return cases;
}

class TrimulCuda : public CudaTest<::testing::TestWithParam<TrimulCase>> {};

TEST_P(TrimulCuda, MatchesFloat64) { check_cuda(GetParam(), rng_); }

INSTANTIATE_TEST_SUITE_P(All, TrimulCuda, ::testing::ValuesIn(cases_in_every_dtype()),
                         [](const auto& info) { return trimul_case_name(info.param); });

// The model's hidden size H = 128 with C of 128, 256, 384 and 768 at N of 32 to 64, in every x
// dtype: outgoing with a mask, float32 weights; incoming without, Cauchy x, weights in x's dtype.
class TrimulCudaModelShapes
    : public CudaTest<::testing::TestWithParam<std::tuple<DType, std::int64_t>>> {};

TEST_P(TrimulCudaModelShapes, MatchesFloat64) {
  const auto [dtype, c] = GetParam();
  for (const TrimulCase& k :
       {TrimulCase{1, 64, c, 128, kOutgoing, TrimulMask::Random, TrimulDist::Normal, dtype},
        TrimulCase{2, 40, c, 128, kIncoming, TrimulMask::None, TrimulDist::Cauchy, dtype,
                   dtype}}) {
    SCOPED_TRACE(trimul_case_name(k));
    check_cuda(k, rng_);
  }
}

INSTANTIATE_TEST_SUITE_P(All, TrimulCudaModelShapes,
                         ::testing::Combine(::testing::ValuesIn(kDtypes),
                                            ::testing::Values(128, 256, 384, 768)),
                         [](const auto& info) {
                           return dtype_name(std::get<0>(info.param)) + "_C" +
                                  std::to_string(std::get<1>(info.param)) + "_H128";
                         });

// N of 128 to 512, against the CPU backend; two of them are shapes of the benchmark.
const TrimulCase kLargeCases[] = {
    {1, 128, 128, 128, kOutgoing, TrimulMask::Random, TrimulDist::Normal, DType::BFloat16},
    {2, 128, 128, 128, kIncoming, TrimulMask::None, TrimulDist::Cauchy, DType::Float16,
     DType::Float16},
    {1, 128, 384, 128, kIncoming, TrimulMask::Fractional, TrimulDist::Normal, DType::Float32},
    {2, 256, 128, 128, kOutgoing, TrimulMask::None, TrimulDist::Normal, DType::Float32},
    {1, 256, 384, 128, kIncoming, TrimulMask::Random, TrimulDist::Normal, DType::BFloat16,
     DType::BFloat16},
    {1, 512, 128, 128, kOutgoing, TrimulMask::None, TrimulDist::Normal, DType::Float32},
};

class TrimulCudaLargeN : public CudaTest<::testing::TestWithParam<TrimulCase>> {};

TEST_P(TrimulCudaLargeN, MatchesCpuBackend) {
  const TrimulCase& c = GetParam();
  const TrimulInputs in = make_trimul_inputs(c, rng_);
  expect_matches_cpu(run_cuda(in, c), in, c);
}

INSTANTIATE_TEST_SUITE_P(All, TrimulCudaLargeN, ::testing::ValuesIn(kLargeCases),
                         [](const auto& info) { return trimul_case_name(info.param); });

// ------------------------------------------------------------------------------------ projections

// Each projection kernel on kCases in every dtype and on the model's channel counts, whatever the
// automatic choice: the mma.sync kernel takes every call; the warpgroup kernel (sm_90a builds on
// compute capability 9.0) takes C up to 384 with rows of whole 16-byte pieces (or a single row),
// and naming it for anything else is an error.
std::vector<TrimulCase> projection_cases() {
  std::vector<TrimulCase> cases = cases_in_every_dtype();
  // one row of Cauchy x: LayerNorm over H of a single row of p shows the relative error of the
  // gates (a sigmoid as 1/2 + tanh/2 lost it to cancellation on large negative inputs)
  cases.push_back({1, 1, 40, 24, kOutgoing, TrimulMask::None, TrimulDist::Cauchy});
  for (DType dtype : kDtypes) {
    for (std::int64_t c : {128, 192, 384, 512}) {  // three warpgroups; two taking turns; two
      cases.push_back({1, 24, c, 128, kOutgoing, TrimulMask::Random, TrimulDist::Normal, dtype});
      cases.push_back({2, 19, c, 96, kIncoming, TrimulMask::None, TrimulDist::Cauchy, dtype, dtype});
    }
  }
  return cases;
}

bool warpgroup_takes(const TrimulCase& c) {
  const bool one_row = c.b * c.n * c.n == 1;  // no spacing between rows to align
  return c.c <= 384 &&
         (one_row || c.c * static_cast<std::int64_t>(fusekit::element_size(c.dtype)) % 16 == 0);
}

class TrimulCudaProjections
    : public CudaTest<::testing::TestWithParam<std::tuple<ProjectKernel, TrimulCase>>> {};

TEST_P(TrimulCudaProjections, MatchesFloat64) {
  const auto [kernel, c] = GetParam();
  if (kernel == ProjectKernel::Warpgroup && !fusekit::detail::has_warpgroup_mma(0)) {
    GTEST_SKIP() << "the warpgroup kernel needs an sm_90a build on a compute capability 9.0 device";
  }
  const TrimulInputs in = make_trimul_inputs(c, rng_);
  if (kernel == ProjectKernel::Warpgroup && !warpgroup_takes(c)) {
    EXPECT_ERROR_CONTAINS("the warpgroup projection kernel was asked for",
                          [&] { run_cuda_projecting(in, c, kernel); });
    return;
  }
  expect_matches_float64(run_cuda_projecting(in, c, kernel), in, c);
}

INSTANTIATE_TEST_SUITE_P(
    All, TrimulCudaProjections,
    ::testing::Combine(::testing::Values(ProjectKernel::MmaSync, ProjectKernel::Warpgroup),
                       ::testing::ValuesIn(projection_cases())),
    [](const auto& info) {
      return std::string(std::get<0>(info.param) == ProjectKernel::MmaSync ? "mma_sync_"
                                                                           : "warpgroup_") +
             trimul_case_name(std::get<1>(info.param));
    });

// Many tiles a block (the warpgroup kernel is persistent) against the CPU backend: at C = 384 and
// 192 the warpgroups load their rows of x themselves (no x slots) and the last tile runs past M;
// at C = 192 two warpgroups take turns at the MMAs, at C = 128 three do, reading x from slots (a
// ring that mixed two warpgroups' slots once went wrong at a bench shape only, never at smaller
// ones).
class TrimulCudaProjectionsLarge : public CudaTest<> {};

TEST_F(TrimulCudaProjectionsLarge, WarpgroupMatchesCpuBackend) {
  if (!fusekit::detail::has_warpgroup_mma(0)) {
    GTEST_SKIP() << "the warpgroup kernel needs an sm_90a build on a compute capability 9.0 device";
  }
  for (const TrimulCase& c :
       {TrimulCase{2, 256, 384, 128, kOutgoing, TrimulMask::Random, TrimulDist::Normal, DType::Float32},
        TrimulCase{1, 200, 384, 128, kIncoming, TrimulMask::Random, TrimulDist::Normal, DType::Float32},
        TrimulCase{3, 130, 128, 128, kOutgoing, TrimulMask::Fractional, TrimulDist::Cauchy,
                   DType::BFloat16},
        TrimulCase{1, 200, 192, 128, kOutgoing, TrimulMask::Random, TrimulDist::Normal,
                   DType::Float32},
        TrimulCase{2, 150, 128, 128, kIncoming, TrimulMask::None, TrimulDist::Normal,
                   DType::Float32}}) {
    SCOPED_TRACE(trimul_case_name(c));
    const TrimulInputs in = make_trimul_inputs(c, rng_);
    expect_matches_cpu(run_cuda_projecting(in, c, ProjectKernel::Warpgroup), in, c);
  }
}

// ------------------------------------------------------------------------------------ masks

struct MaskCase {
  TrimulMask mask;
  DType dtype;  // of Random and Fractional masks
};

const MaskCase kMasks[] = {
    {TrimulMask::Random, DType::Float32},      {TrimulMask::Random, DType::Float16},
    {TrimulMask::Random, DType::BFloat16},     {TrimulMask::Bool, DType::Float32},
    {TrimulMask::UInt8, DType::Float32},       {TrimulMask::Fractional, DType::Float32},
    {TrimulMask::Fractional, DType::Float16},  {TrimulMask::Fractional, DType::BFloat16},
};

// Each mask in both directions.
std::vector<TrimulCase> mask_cases() {
  std::vector<TrimulCase> cases;
  for (const MaskCase& m : kMasks) {
    for (TrimulDirection direction : {kOutgoing, kIncoming}) {
      TrimulCase c{2, 16, 64, 64, direction, m.mask};
      c.mask_dtype = m.dtype;
      cases.push_back(c);
    }
  }
  return cases;
}

class TrimulCudaMasks : public CudaTest<::testing::TestWithParam<TrimulCase>> {};

// Each mask dtype contiguous, padded, transposed and misaligned.
TEST_P(TrimulCudaMasks, MatchesFloat64InEachLayout) {
  for (const char* layout : {"contiguous", "padded", "permuted", "misaligned"}) {
    SCOPED_TRACE(layout);
    check_cuda(GetParam(), rng_, layouts_named(layout));
  }
}

INSTANTIATE_TEST_SUITE_P(All, TrimulCudaMasks, ::testing::ValuesIn(mask_cases()),
                         [](const auto& info) { return trimul_case_name(info.param); });

// ------------------------------------------------------------------------------------ layouts

class TrimulCudaLayouts
    : public CudaTest<::testing::TestWithParam<std::tuple<DType, TrimulLayoutCase>>> {};

TEST_P(TrimulCudaLayouts, MatchesFloat64) {
  const auto [dtype, l] = GetParam();
  const TrimulCase cases[] = {
      // rows of C = 70: no whole 16-byte pieces, so x is read element by element
      {2, 11, 70, 48, kIncoming, TrimulMask::Random, TrimulDist::Normal, dtype},
      // rows of whole 16-byte pieces in whole tiles: the fast copies wherever the layout allows
      {2, 16, 64, 40, kOutgoing, TrimulMask::UInt8, TrimulDist::Normal, dtype, dtype},
      {1, 9, 40, 72, kOutgoing, TrimulMask::Bool, TrimulDist::Cauchy, dtype, dtype},
  };
  for (const TrimulCase& c : cases) {
    SCOPED_TRACE(trimul_case_name(c));
    check_cuda(c, rng_, l.layouts);
  }
}

INSTANTIATE_TEST_SUITE_P(All, TrimulCudaLayouts,
                         ::testing::Combine(::testing::ValuesIn(kDtypes),
                                            ::testing::ValuesIn(kTrimulLayouts)),
                         [](const auto& info) {
                           return dtype_name(std::get<0>(info.param)) + "_" +
                                  std::get<1>(info.param).name;
                         });

// ------------------------------------------------------------------------------------ the rest

class TrimulCudaMisc : public CudaTest<> {};

TEST_F(TrimulCudaMisc, EmptyInputsWriteNothing) {
  // B = 0 or N = 0: out (an allocation of poison, or a view of none) stays as it was, and a
  // captured call enqueues no work at all.
  for (const TrimulCase& c :
       {TrimulCase{0, 5, 8, 4, kOutgoing, TrimulMask::Random},
        TrimulCase{2, 0, 8, 4, kIncoming, TrimulMask::Bool},
        TrimulCase{0, 0, 16, 8, kIncoming, TrimulMask::None, TrimulDist::Normal,
                   DType::BFloat16}}) {
    SCOPED_TRACE(trimul_case_name(c));
    const TrimulInputs in = make_trimul_inputs(c, rng_);
    const TrimulTensors t = upload_trimul(in, c, kCuda, {.out = {{}, 0, 2}});
    EXPECT_NO_THROW(run_trimul(t, c));
    expect_device_ok();
    expect_untouched(t.out, "out");

    OwnStream s;
    CapturedGraph graph;
    ASSERT_NO_FATAL_FAILURE(graph.capture(s.get(), [&] { run_trimul(t, c, s.stream()); }));
    GraphNodeCounts nodes;
    ASSERT_NO_FATAL_FAILURE(graph.count_nodes(nodes));
    EXPECT_EQ(nodes.total, 0) << "an empty call enqueued work";
  }
}

TEST_F(TrimulCudaMisc, BitwiseDeterministic) {
  for (DType dtype : kDtypes) {
    for (const TrimulCase& k :
         {TrimulCase{2, 40, 128, 128, kIncoming, TrimulMask::Random},
          TrimulCase{1, 160, 256, 128, kOutgoing, TrimulMask::None, TrimulDist::Cauchy}}) {
      const TrimulCase c = with_dtype(k, dtype);
      SCOPED_TRACE(trimul_case_name(c));
      const TrimulInputs in = make_trimul_inputs(c, rng_);
      const TrimulTensors a = upload_trimul(in, c, kCuda);
      const TrimulTensors b = upload_trimul(in, c, kCuda);
      run_trimul(a, c);
      run_trimul(b, c);
      run_trimul(b, c);
      expect_device_ok();
      expect_same_bytes(b.out, a.out, "out of a second and third run against the first");
      // two runs that wrote nothing would agree too
      expect_matches_cpu(download_trimul(a), in, c);
    }
  }
}

TEST_F(TrimulCudaMisc, RunsOnTheGivenStream) {
  const TrimulCase c{2, 48, 128, 128, kOutgoing, TrimulMask::Random, TrimulDist::Normal,
                     DType::BFloat16};
  const TrimulInputs in = make_trimul_inputs(c, rng_);
  const TrimulTensors on_default = upload_trimul(in, c, kCuda);
  const TrimulTensors on_stream = upload_trimul(in, c, kCuda);
  run_trimul(on_default, c);
  OwnStream s;
  expect_device_ok();  // the uploads and the poison (legacy stream) are done: s does not wait
  run_trimul(on_stream, c, s.stream());
  ASSERT_CUDA(cudaStreamSynchronize(s.get()));
  expect_device_ok();
  expect_only_view_written(on_stream.out, "out");
  expect_matches_float64(download_trimul(on_stream), in, c);
  expect_same_bytes(on_stream.out, on_default.out, "out on its own stream against the default");
}

// Tensors on the second device while the first is current: a stream of the first is rejected
// before anything runs, one of the second runs the warpgroup projection there.
TEST_F(TrimulCudaMisc, SecondDeviceAndItsStream) {
  SKIP_WITHOUT_TWO_DEVICES();
  const TrimulCase c{1, 33, 128, 128, kOutgoing, TrimulMask::Random, TrimulDist::Normal,
                     DType::BFloat16};
  const TrimulInputs in = make_trimul_inputs(c, rng_);
  const TrimulTensors t = upload_trimul(in, c, Device::cuda(1));
  ASSERT_NO_FATAL_FAILURE(run_on_the_second_device(
      "trimul", {&t.out}, [&](fusekit::Stream s) { run_trimul(t, c, s); }));
  expect_only_view_written(t.out, "out");
  expect_matches_float64(download_trimul(t), in, c);
}

TEST_F(TrimulCudaMisc, EpsIsUsed) {
  // eps 0.5 against x and p of unit size: a result far from that of eps 1e-5 (the CUDA backend
  // normalises p / N, with eps / N^2)
  TrimulCase c{2, 16, 64, 64, kIncoming, TrimulMask::Random};
  c.eps = 0.5;
  const TrimulInputs in = make_trimul_inputs(c, rng_);
  const HostTensor got = run_cuda(in, c);
  expect_matches_float64(got, in, c);
  TrimulCase default_eps = c;
  default_eps.eps = 1e-5;
  const HostTensor other = trimul_float64(in, default_eps);
  const Comparison far =
      fusekit::testing::compare(got, other, trimul_cuda_tolerance(default_eps, other));
  EXPECT_FALSE(far.ok) << "eps 0.5 gave the result of eps 1e-5: " << far.message;
}

TEST_F(TrimulCudaMisc, MaskedOutRowsGiveTheBias) {
  // A mask of zeros: left and right are 0, so p is 0, LayerNorm_H(p) = to_out_norm_bias, and
  // out = (to_out_norm_bias * gate) @ to_out^T, whatever the direction.
  for (TrimulDirection direction : {kOutgoing, kIncoming}) {
    TrimulCase c{1, 20, 24, 40, direction, TrimulMask::Bool};
    TrimulInputs in = make_trimul_inputs(c, rng_);
    std::fill(in.mask.values.begin(), in.mask.values.end(), 0.0);
    expect_matches_float64(run_cuda(in, c), in, c, "all masked, " + trimul_case_name(c));
  }
}

TEST_F(TrimulCudaMisc, BroadcastInputs) {
  const TrimulCase c{2, 16, 48, 32, kIncoming, TrimulMask::Fractional};
  const BroadcastTrimul s = upload_broadcast_trimul(c, rng_, kCuda);
  run_trimul(s.t, c);
  expect_device_ok();
  expect_only_view_written(s.t.out, "out");
  expect_matches_float64(download_trimul(s.t), s.in, c);
}

TEST_F(TrimulCudaMisc, MixedDevicesAreRejected) {
  const TrimulCase c{1, 4, 8, 6, kOutgoing, TrimulMask::Random};
  const TrimulInputs in = make_trimul_inputs(c, rng_);
  const TrimulTensors gpu = upload_trimul(in, c, kCuda);
  const TrimulTensors cpu = upload_trimul(in, c, kCpu);
  fusekit::TrimulWeights w = gpu.weights.views();
  w.to_out = cpu.weights.to_out.view;
  EXPECT_ERROR_CONTAINS("trimul: to_out is on cpu but x is on cuda:0; expected one device",
                        [&] { fusekit::trimul(gpu.out.view, gpu.x.view, gpu.mask.view, w); });
  EXPECT_ERROR_CONTAINS("trimul: mask is on cpu but x is on cuda:0; expected one device", [&] {
    fusekit::trimul(gpu.out.view, gpu.x.view, cpu.mask.view, gpu.weights.views());
  });
  expect_device_ok();
  expect_untouched(gpu.out, "out");  // nothing was launched
}

// ------------------------------------------------------------------------------------ graphs

class TrimulCudaGraph : public CudaTest<::testing::TestWithParam<DType>> {};

TEST_P(TrimulCudaGraph, CapturedCallReplaysBitwiseAsADirectCall) {
  const TrimulCase c{2, 40, 128, 128, kIncoming, TrimulMask::Random, TrimulDist::Normal,
                     GetParam()};
  const TrimulInputs in = make_trimul_inputs(c, rng_);
  const TrimulTensors direct = upload_trimul(in, c, kCuda);
  TrimulTensors t = upload_trimul(in, c, kCuda);
  run_trimul(direct, c);
  expect_device_ok();
  expect_only_view_written(direct.out, "out of the direct call");

  OwnStream s;
  expect_device_ok();  // the uploads and the poison (legacy stream) are done: s does not wait
  CapturedGraph graph;
  ASSERT_NO_FATAL_FAILURE(graph.capture(s.get(), [&] { run_trimul(t, c, s.stream()); }));
  expect_untouched(t.out, "out after the capture (nothing runs while capturing)");

  GraphNodeCounts nodes;
  ASSERT_NO_FATAL_FAILURE(graph.count_nodes(nodes));
  EXPECT_GT(nodes.kernels, 0) << "no kernel was captured";
  EXPECT_EQ(nodes.allocs, nodes.frees) << "every workspace taken in the graph is given back in it";

  for (int replay = 0; replay < 2; ++replay) {
    SCOPED_TRACE("replay " + std::to_string(replay));
    ASSERT_NO_FATAL_FAILURE(graph.replay({&t.out}));
    expect_same_bytes(t.out, direct.out, "out of the replay against the direct call");
  }
  expect_matches_float64(download_trimul(t), in, c, "out of the replays against float64");
}

INSTANTIATE_TEST_SUITE_P(Dtypes, TrimulCudaGraph, ::testing::ValuesIn(kDtypes),
                         [](const auto& info) { return dtype_name(info.param); });

TEST_F(TrimulCudaMisc, CapturedBeforeAnyDirectCallOfItsShape) {
  // A shape no other test uses, captured before it ever ran: what the call sets up on the first
  // run of a shape (the pairwise product's algorithm) must work under capture too.
  const TrimulCase c{1, 27, 48, 40, kOutgoing, TrimulMask::UInt8, TrimulDist::Normal,
                     DType::Float16};
  const TrimulInputs in = make_trimul_inputs(c, rng_);
  const TrimulTensors direct = upload_trimul(in, c, kCuda);
  const TrimulTensors t = upload_trimul(in, c, kCuda);
  OwnStream s;
  expect_device_ok();  // the uploads and the poison (legacy stream) are done: s does not wait
  CapturedGraph graph;
  ASSERT_NO_FATAL_FAILURE(graph.capture(s.get(), [&] { run_trimul(t, c, s.stream()); }));
  ASSERT_NO_FATAL_FAILURE(graph.replay());
  run_trimul(direct, c);
  expect_device_ok();
  expect_only_view_written(t.out, "out of the replay");
  expect_same_bytes(t.out, direct.out, "out of the replay against a direct call made after it");
  expect_matches_float64(download_trimul(t), in, c);
}

}  // namespace
