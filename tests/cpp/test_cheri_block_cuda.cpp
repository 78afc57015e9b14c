// cheri_block on the CUDA backend: dilated_conv_norm and its backward, the block's training
// forward and backward (exact float32 and TF32 products) and the inference forward (the fused
// float16 tensor-core kernel for C of 64 and 128, the general path otherwise) against the float64
// reference, in every dtype, for L = 1, d >= L, C of 1, 3, 48, 64, 80, 128 and 256, E of 1 to 3,
// the model's dilations and every layout; at a model-sized shape against the CPU backend. Outputs
// are poisoned and checked for writes outside their views. Also bitwise determinism, zero MLP
// weights, gradients of any scale (per example too), the weight-gradient kernel over many tiles a
// block, empty batches, streams and CUDA-graph capture. Every test skips with "no CUDA device"
// where there is none.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "cheri_block_support.h"
#include "common/cuda_check.h"
#include "cuda_test_support.h"

namespace {

using namespace fusekit_test;
using fusekit::testing::download;

constexpr Device kCpu = Device::cpu();
constexpr Device kCuda = Device::cuda(0);
constexpr DType kDtypes[] = {DType::Float32, DType::BFloat16, DType::Float16};

// ------------------------------------------------------------------------------------ tolerances
//
// The exact paths (the plane passes; the training path with allow_tf32 false, or in float16 and
// bfloat16) share the CPU suite's tolerances; the float32 training path with TF32 products and the
// inference path (float16 operands) are held to the relative bounds of
// ops/cheri_block/cheri_block_tolerances.h, which says why each is what it is.

bool uses_tf32(const CheriCase& c) { return c.dtype == DType::Float32 && c.allow_tf32; }

// ------------------------------------------------------------------------------------ checks

void check_conv_norm(const CheriInputs& in, const CheriCase& c, const CheriLayouts& layouts) {
  const Tolerance elementwise = cheri_elementwise_tolerance(c.dtype);
  {
    SCOPED_TRACE("dilated_conv_norm");
    const CheriTensors t = upload_cheri(in, c, kCuda, layouts);
    run_conv_norm(t, c);
    expect_device_ok();
    const ConvNormResult ref =
        fusekit::testing::dilated_conv_norm_reference(in.x, in.w.conv_weight, c.dilation, c.eps);
    expect_only_view_written(t.out, "y");
    expect_only_view_written(t.mean, "mean");
    expect_only_view_written(t.rstd, "rstd");
    expect_close(download(t.out.view), ref.y, elementwise, "y");
    expect_close(download(t.mean.view), ref.mean, cheri_mean_tolerance(ref.rstd), "mean");
    expect_close(download(t.rstd.view), ref.rstd, cheri_stat_tolerance(), "rstd");
  }
  {
    SCOPED_TRACE("dilated_conv_norm_backward");
    const CheriTensors t = upload_cheri(in, c, kCuda, layouts);
    run_conv_norm_backward(t, c);
    expect_device_ok();
    const ConvNormGradients ref = fusekit::testing::dilated_conv_norm_backward_reference(
        in.grad_out, in.x, in.w.conv_weight, in.mean, in.rstd, c.dilation);
    expect_only_view_written(t.grad_x, "grad_x");
    expect_only_view_written(t.grad_conv_weight, "grad_conv_weight");
    expect_close(download(t.grad_x.view), ref.grad_x, elementwise, "grad_x");
    expect_close(download(t.grad_conv_weight.view), ref.grad_conv_weight,
                 cheri_weight_grad_tolerance(c), "grad_conv_weight");
  }
}

void check_block(const CheriInputs& in, const CheriCase& c, const CheriLayouts& layouts) {
  const bool tf32 = uses_tf32(c);
  {
    SCOPED_TRACE(tf32 ? "cheri_block (TF32)" : "cheri_block");
    const CheriTensors t = upload_cheri(in, c, kCuda, layouts);
    run_block(t, c);
    expect_device_ok();
    const CheriBlockResult ref = fusekit::testing::cheri_block_reference(
        in.x, in.w, c.dilation, c.residual_scale, c.eps);
    expect_only_view_written(t.out, "out");
    expect_only_view_written(t.mean, "mean");
    expect_only_view_written(t.rstd, "rstd");
    expect_close(download(t.out.view), ref.out,
                 tf32 ? cheri_relative_to_max(ref.out, 1e-3)
                      : cheri_elementwise_tolerance(c.dtype),
                 "out");
    expect_close(download(t.mean.view), ref.mean, cheri_mean_tolerance(ref.rstd), "mean");
    expect_close(download(t.rstd.view), ref.rstd, cheri_stat_tolerance(), "rstd");
  }
  {
    SCOPED_TRACE(tf32 ? "cheri_block_backward (TF32)" : "cheri_block_backward");
    const CheriTensors t = upload_cheri(in, c, kCuda, layouts);
    run_block_backward(t, c);
    expect_device_ok();
    expect_block_gradients(t, in, c, tf32);
  }
  // The same through the rows the forward keeps, where it keeps any (the TF32 path on sm_90a at
  // C of 64 and 128; written by the fused forward's producer, or by a pass of their own where
  // that kernel does not take the call), with the forward's own mean and rstd.
  const CheriTensors t = upload_cheri(in, c, kCuda, layouts);
  const DeviceTensor saved = saved_rows(t, c);
  if (saved.view.ndim != 0) {
    SCOPED_TRACE("cheri_block and cheri_block_backward through the saved rows (TF32)");
    run_block_through_saved(t, c, saved);
    expect_device_ok();
    const CheriBlockResult ref = fusekit::testing::cheri_block_reference(
        in.x, in.w, c.dilation, c.residual_scale, c.eps);
    expect_close(download(t.out.view), ref.out, cheri_relative_to_max(ref.out, 1e-3), "out");
    expect_block_gradients(t, in, c, tf32);
  }
}

void check_inference(const CheriInputs& in, const CheriCase& c, const CheriLayouts& layouts) {
  SCOPED_TRACE("cheri_block_inference");
  const CheriTensors t = upload_cheri(in, c, kCuda, layouts);
  run_block_inference(t, c);
  expect_device_ok();
  const CheriBlockResult ref =
      fusekit::testing::cheri_block_reference(in.x, in.w, c.dilation, c.residual_scale, c.eps);
  expect_only_view_written(t.out, "out");
  expect_close(download(t.out.view), ref.out,
               cheri_relative_to_max(ref.out, cheri_fast_path_bound(c.dtype)), "out");
}

// Every CUDA path on one case: the plane passes, the training path with exact products (and,
// for float32, with TF32 ones), the inference forward.
void check_cuda_all(const CheriCase& k, std::mt19937_64& rng, const CheriLayouts& layouts = {}) {
  CheriCase c = k;
  c.allow_tf32 = false;
  const CheriInputs in = make_cheri_inputs(c, rng);
  check_conv_norm(in, c, layouts);
  check_block(in, c, layouts);
  if (c.dtype == DType::Float32) {
    c.allow_tf32 = true;
    check_block(in, c, layouts);
  }
  check_inference(in, c, layouts);
}

// ------------------------------------------------------------------------------------ shapes

// C = 1 and 3 (scalar path), L = 1, d = L and d > L; C of 48 and 80 (vector plane passes, general
// inference path); C of 64 and 128 (fused inference: a partial last tile, tiles across example
// boundaries, E = 1 and 2, many examples with d above the x slots' halo); C = 256 and E = 3 at
// C = 128 (too big for the fused kernel's shared memory: the general path); the largest
// dilations. The backward's grad_x pass is staged in shared memory (sm_90, vector rows; dy in
// float16 scaled per row after the TF32 front kernel, else float32) where a block's rows with
// their halo fit: in float32 up to d = 16 at C = 128 (the
// model's dilations below) and beyond at C = 64 ({2, 150, 64, 2, 16}: blocks of 128 and 22 rows),
// and wherever d >= L; larger d and the scalar cases take the plain pass.
const CheriCase kCases[] = {
    {2, 6, 1, 2, 1},     {3, 1, 3, 2, 4},     {2, 7, 3, 2, 7},     {2, 9, 48, 2, 16},
    {3, 33, 80, 2, 2},   {2, 70, 128, 2, 4},  {3, 45, 64, 2, 64},  {1, 300, 128, 2, 256},
    {2, 37, 128, 1, 3},  {2, 20, 256, 2, 8},  {2, 20, 128, 3, 1},  {2, 40, 8, 1, 256},
    {9, 65, 64, 2, 9},   {5, 64, 128, 2, 1},  {2, 150, 64, 2, 16},
};

class CheriCuda : public CudaTest<::testing::TestWithParam<std::tuple<DType, CheriCase>>> {};

TEST_P(CheriCuda, MatchesFloat64) {
  const auto [dtype, c] = GetParam();
  check_cuda_all(with_dtype(c, dtype), rng_);
}

INSTANTIATE_TEST_SUITE_P(All, CheriCuda,
                         ::testing::Combine(::testing::ValuesIn(kDtypes),
                                            ::testing::ValuesIn(kCases)),
                         [](const auto& info) {
                           return cheri_case_name(with_dtype(std::get<1>(info.param),
                                                             std::get<0>(info.param)));
                         });

// Weights in x's dtype, through every path.
class CheriCudaWeightDtype : public CudaTest<::testing::TestWithParam<DType>> {};

TEST_P(CheriCudaWeightDtype, MatchesFloat64) {
  for (CheriCase c : {CheriCase{2, 70, 128, 2, 4}, CheriCase{2, 33, 80, 2, 2}}) {
    c.dtype = GetParam();
    c.weight_dtype = GetParam();
    SCOPED_TRACE(cheri_case_name(c));
    check_cuda_all(c, rng_);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CheriCudaWeightDtype,
                         ::testing::Values(DType::BFloat16, DType::Float16),
                         [](const auto& info) { return dtype_name(info.param); });

// The model's dilations 1, 2, 4, ..., 256 at C = 128 (the fused inference kernel), L = 300.
class CheriCudaDilations : public CudaTest<::testing::TestWithParam<std::int64_t>> {};

TEST_P(CheriCudaDilations, MatchesFloat64) {
  for (DType dtype : {DType::Float32, DType::BFloat16}) {
    const CheriCase c = with_dtype(CheriCase{1, 300, 128, 2, GetParam()}, dtype);
    SCOPED_TRACE(cheri_case_name(c));
    check_cuda_all(c, rng_);
  }
}

INSTANTIATE_TEST_SUITE_P(Model, CheriCudaDilations,
                         ::testing::Values(1, 2, 4, 8, 16, 32, 64, 128, 256),
                         [](const auto& info) {
                           // appended, not "d" + ...: gcc 12 warns of an overlap there (-Wrestrict)
                           std::string name = "d";
                           return name += std::to_string(info.param);
                         });

// Every dilation whose taps the warp-specialised kernel finds in its x slots (d = 1 to 8), at
// both of its Cs: where d divides a part's rows (1, 2, 4, 8), its producer walks the rows of a
// part inside one example d rows apart, the other parts and dilations row by row; L = 150 gives
// three examples, parts of both kinds and a partial last tile.
class CheriCudaSlotDilations
    : public CudaTest<::testing::TestWithParam<std::tuple<std::int64_t, std::int64_t>>> {};

TEST_P(CheriCudaSlotDilations, MatchesFloat64) {
  const auto [channels, dilation] = GetParam();
  for (DType dtype : kDtypes) {
    const CheriCase c = with_dtype(CheriCase{3, 150, channels, 2, dilation}, dtype);
    SCOPED_TRACE(cheri_case_name(c));
    check_cuda_all(c, rng_);
  }
}

INSTANTIATE_TEST_SUITE_P(WarpSpecialised, CheriCudaSlotDilations,
                         ::testing::Combine(::testing::Values(64, 128),
                                            ::testing::Range<std::int64_t>(1, 9)),
                         [](const auto& info) {
                           std::string name = "C";  // (appended: as above)
                           name += std::to_string(std::get<0>(info.param));
                           name += "_d";
                           return name += std::to_string(std::get<1>(info.param));
                         });

// Every layout, with a vectorisable C (the layouts decide between vector and scalar access) and
// the fused-inference Cs (at C = 128 half-precision x takes the warp-specialised kernel, whose
// copies of x go a row at a time when the rows are not one range of memory).
class CheriCudaLayouts
    : public CudaTest<::testing::TestWithParam<std::tuple<DType, CheriLayoutCase>>> {};

TEST_P(CheriCudaLayouts, MatchesFloat64) {
  const auto [dtype, l] = GetParam();
  for (const CheriCase& k :
       {CheriCase{2, 33, 64, 2, 4}, CheriCase{2, 17, 48, 2, 2}, CheriCase{2, 70, 128, 2, 5}}) {
    const CheriCase c = with_dtype(k, dtype);
    SCOPED_TRACE(cheri_case_name(c));
    check_cuda_all(c, rng_, l.layouts);
  }
}

INSTANTIATE_TEST_SUITE_P(All, CheriCudaLayouts,
                         ::testing::Combine(::testing::ValuesIn(kDtypes),
                                            ::testing::ValuesIn(kCheriLayouts)),
                         [](const auto& info) {
                           return dtype_name(std::get<0>(info.param)) + "_" +
                                  std::get<1>(info.param).name;
                         });

// ------------------------------------------------------------------------------------ CPU

/// The block's backward on CUDA against the CPU backend's on the same inputs, every gradient
/// within `bound` of the CPU's relative to its largest value.
void expect_backward_like_cpu(const CheriInputs& in, const CheriCase& c, double bound) {
  const CheriTensors gpu = upload_cheri(in, c, kCuda), cpu = upload_cheri(in, c, kCpu);
  run_block_backward(gpu, c);
  run_block_backward(cpu, c);
  expect_device_ok();
  const auto compare = [&](const DeviceTensor& g, const DeviceTensor& e, const char* what) {
    const HostTensor expected = download(e.view);
    expect_close(download(g.view), expected, cheri_relative_to_max(expected, bound), what);
  };
  compare(gpu.grad_x, cpu.grad_x, "grad_x");
  compare(gpu.grad_conv_weight, cpu.grad_conv_weight, "grads.conv_weight");
  compare(gpu.grad_linear1, cpu.grad_linear1, "grads.linear1_weight");
  compare(gpu.grad_linear2, cpu.grad_linear2, "grads.linear2_weight");
}

// A model-sized shape (many tiles and plane blocks per example) against the CPU backend on the
// same inputs: the CPU's error against float64 (1e-5) is far inside the bounds used here.
class CheriCudaAgainstCpu : public CudaTest<::testing::TestWithParam<DType>> {};

TEST_P(CheriCudaAgainstCpu, ModelShape) {
  CheriCase c{4, 1024, 128, 2, 4, GetParam()};
  const CheriInputs in = make_cheri_inputs(c, rng_);
  const double bound = cheri_fast_path_bound(c.dtype);
  {
    SCOPED_TRACE("cheri_block_inference");
    const CheriTensors gpu = upload_cheri(in, c, kCuda), cpu = upload_cheri(in, c, kCpu);
    run_block_inference(gpu, c);
    run_block_inference(cpu, c);
    expect_device_ok();
    const HostTensor expected = download(cpu.out.view);
    expect_close(download(gpu.out.view), expected, cheri_relative_to_max(expected, bound), "out");
  }
  {
    SCOPED_TRACE("cheri_block_backward");
    expect_backward_like_cpu(in, c, bound);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CheriCudaAgainstCpu, ::testing::ValuesIn(kDtypes),
                         [](const auto& info) { return dtype_name(info.param); });

// ------------------------------------------------------------------------------------ the rest

class CheriCudaMisc : public CudaTest<> {};

// The TF32 backward's weight-gradient kernel gives each block a range of 64-row tiles (one block
// a multiprocessor): here 512 tiles, several a block, so that its ring of stages turns over and
// rows of very different exponents share a block.
TEST_F(CheriCudaMisc, WeightGradientsOverManyTilesABlock) {
  const CheriCase c{8, 4096, 128, 2, 4};
  CheriInputs in = make_cheri_inputs(c, rng_);
  for (std::size_t i = 0; i < in.grad_out.values.size(); ++i) {  // rows 1e-6 to 1e6
    in.grad_out.values[i] *= std::pow(10.0, static_cast<double>((i / c.c) % 13) - 6.0);
  }
  expect_backward_like_cpu(in, c, cheri_fast_path_bound(c.dtype));
}

TEST_F(CheriCudaMisc, BitwiseDeterministic) {
  for (DType dtype : kDtypes) {
    // the last: 320 blocks of the convolution's backward, whose parts are added in two passes
    for (const CheriCase& k : {CheriCase{3, 700, 128, 2, 8}, CheriCase{2, 300, 80, 2, 2},
                               CheriCase{5, 4096, 128, 2, 4}}) {
      const CheriCase c = with_dtype(k, dtype);
      SCOPED_TRACE(cheri_case_name(c));
      const CheriInputs in = make_cheri_inputs(c, rng_);
      const CheriTensors a = upload_cheri(in, c, kCuda), b = upload_cheri(in, c, kCuda);
      const auto same = [&](const char* what) {
        expect_device_ok();
        SCOPED_TRACE(what);
        expect_same_bytes(b.out, a.out, "out");
        expect_same_bytes(b.mean, a.mean, "mean");
        expect_same_bytes(b.rstd, a.rstd, "rstd");
        expect_same_bytes(b.grad_x, a.grad_x, "grad_x");
        expect_same_bytes(b.grad_conv_weight, a.grad_conv_weight, "grads.conv_weight");
        expect_same_bytes(b.grad_linear1, a.grad_linear1, "grads.linear1_weight");
        expect_same_bytes(b.grad_linear2, a.grad_linear2, "grads.linear2_weight");
      };
      for (const auto& run : {run_conv_norm, run_block, run_block_inference}) {
        run(a, c);
        run(b, c);
        run(b, c);
      }
      run_conv_norm_backward(a, c);
      run_conv_norm_backward(b, c);
      same("forwards and dilated_conv_norm_backward");
      run_block_backward(a, c);
      run_block_backward(b, c);
      run_block_backward(b, c);
      same("cheri_block_backward");
      const DeviceTensor saved_a = saved_rows(a, c), saved_b = saved_rows(b, c);
      if (saved_a.view.ndim != 0) {
        run_block_through_saved(a, c, saved_a);
        run_block_through_saved(b, c, saved_b);
        run_block_through_saved(b, c, saved_b);
        same("through the saved rows");
        expect_same_bytes(saved_b, saved_a, "saved");
      }
      // runs that wrote nothing would agree too
      const CheriBlockResult ref = fusekit::testing::cheri_block_reference(
          in.x, in.w, c.dilation, c.residual_scale, c.eps);
      expect_close(download(a.out.view), ref.out,
                   cheri_relative_to_max(ref.out, cheri_fast_path_bound(c.dtype)), "out");
    }
  }
}

// The training forward keeps rows for the backward exactly where the backward's front kernel
// reads them: float32 with TF32 at C of 64 and 128, E = 2, on sm_90a.
TEST_F(CheriCudaMisc, SavedBytesWhereTheBackwardReadsThem) {
  const auto bytes = [](const CheriCase& c, Device device = kCuda) {
    // shapes, dtype and device only: views without data
    const CheriBlockWeights w{{},
                              TensorView(nullptr, c.dtype, {c.hidden(), c.c}, device),
                              TensorView(nullptr, c.dtype, {c.c, c.hidden()}, device)};
    return fusekit::cheri_block_saved_bytes(TensorView(nullptr, c.dtype, {c.n, c.l, c.c}, device),
                                            w, c.block_options());
  };
  const CheriCase model{4, 100, 128, 2, 4};
  const bool hopper = fusekit::detail::has_warpgroup_mma(0);
  EXPECT_EQ(bytes(model), hopper ? 4 * 100 * 128 * 2 : 0);
  EXPECT_EQ(bytes({4, 100, 64, 2, 4}), hopper ? 4 * 100 * 64 * 2 : 0);
  EXPECT_EQ(bytes(model, kCpu), 0);
  EXPECT_EQ(bytes({4, 100, 128, 3, 4}), 0);
  EXPECT_EQ(bytes({4, 100, 48, 2, 4}), 0);
  EXPECT_EQ(bytes(with_dtype(model, DType::BFloat16)), 0);
  CheriCase exact = model;
  exact.allow_tf32 = false;
  EXPECT_EQ(bytes(exact), 0);
  EXPECT_EQ(bytes({0, 100, 128, 2, 4}), 0);
}

// A buffer for the saved rows of the wrong size, dtype or alignment is refused.
TEST_F(CheriCudaMisc, SavedRowsChecked) {
  const CheriCase c{2, 70, 64, 2, 4};
  const CheriTensors t = upload_cheri(make_cheri_inputs(c, rng_), c, kCuda);
  const DeviceTensor saved = saved_rows(t, c);
  if (saved.view.ndim == 0) GTEST_SKIP() << "nothing kept on this device (it needs sm_90a)";
  const std::int64_t bytes = saved.view.shape[0];
  const auto forward = [&](const TensorView& s) {
    fusekit::cheri_block(t.out.view, t.mean.view, t.rstd.view, s, t.x.view, t.weights(),
                         c.block_options());
  };
  using fusekit::testing::empty_poisoned;
  const DeviceTensor short_one = empty_poisoned({bytes - 16}, DType::UInt8, kCuda);
  EXPECT_ERROR_CONTAINS("cheri_block: saved has shape [" + std::to_string(bytes - 16) + "]",
                        [&] { forward(short_one.view); });
  const DeviceTensor halves = empty_poisoned({bytes}, DType::Float16, kCuda);
  EXPECT_ERROR_CONTAINS("cheri_block: saved has dtype float16, expected uint8",
                        [&] { forward(halves.view); });
  const DeviceTensor wide = empty_poisoned({bytes + 16}, DType::UInt8, kCuda);
  TensorView shifted = wide.view;
  shifted.shape[0] = bytes;
  shifted.data = static_cast<char*>(shifted.data) + 8;
  EXPECT_ERROR_CONTAINS("not a multiple of 16 bytes", [&] { forward(shifted); });
  EXPECT_ERROR_CONTAINS("cheri_block_backward: saved has shape", [&] {
    fusekit::cheri_block_backward(t.grad_x.view, t.grads(), t.grad_out.view, t.x.view,
                                  t.weights(), t.mean.view, t.rstd.view, short_one.view,
                                  c.block_options());
  });
}

// Where the fused forward does not take the call (its out not 16-byte aligned) but x and grad_out
// are aligned, the saved rows come from a pass of their own and the backward's front kernel reads
// them.
TEST_F(CheriCudaMisc, SavedRowsWithoutTheFusedForward) {
  for (const CheriCase& c : {CheriCase{3, 45, 64, 2, 4}, CheriCase{2, 70, 128, 2, 300}}) {
    SCOPED_TRACE(cheri_case_name(c));
    check_block(make_cheri_inputs(c, rng_), c, {.out = {{}, 0, 1}});
  }
}

TEST_F(CheriCudaMisc, NonFiniteExamplesStayTheirOwn) {
  // A NaN in example 0 and an infinity in example 1 make their statistics, and so all of their
  // outputs, NaN; example 2 keeps its values (no statistic or tap leaks from one example into
  // the next). C = 128 and L = 70: the fused kernel, with tiles across example boundaries;
  // C = 80: the general path.
  for (DType dtype : kDtypes) {
    for (const CheriCase& k : {CheriCase{3, 70, 128, 2, 4}, CheriCase{3, 70, 80, 2, 2}}) {
      const CheriCase c = with_dtype(k, dtype);
      SCOPED_TRACE(cheri_case_name(c));
      CheriInputs in = make_cheri_inputs(c, rng_);
      const std::int64_t plane = c.l * c.c;
      in.x.values[5 * c.c + 3] = std::numeric_limits<double>::quiet_NaN();
      in.x.values[plane + 10 * c.c + 7] = std::numeric_limits<double>::infinity();
      const CheriTensors t = upload_cheri(in, c, kCuda);
      run_block_inference(t, c);
      expect_device_ok();
      const HostTensor out = download(t.out.view);
      std::int64_t finite = 0;
      for (std::int64_t i = 0; i < 2 * plane; ++i) finite += std::isnan(out.values[i]) ? 0 : 1;
      EXPECT_EQ(finite, 0) << "outputs of the non-finite examples that are not NaN";
      // The poison is a NaN too (every bit set, which no arithmetic NaN has): each of those
      // outputs was written.
      const std::vector<unsigned char> bytes = raw_bytes(t.out);
      const std::size_t size = fusekit::element_size(c.dtype);
      std::int64_t unwritten = 0;
      for (std::int64_t i = 0; i < 2 * plane; ++i) {
        const auto first = bytes.begin() + static_cast<std::ptrdiff_t>(i * size);
        unwritten += std::all_of(first, first + static_cast<std::ptrdiff_t>(size),
                                 [](unsigned char b) { return b == 0xff; });
      }
      EXPECT_EQ(unwritten, 0) << "outputs of the non-finite examples still holding the poison";
      const CheriBlockResult ref = fusekit::testing::cheri_block_reference(
          in.x, in.w, c.dilation, c.residual_scale, c.eps);
      HostTensor got_last({1, c.l, c.c}), ref_last({1, c.l, c.c});
      std::copy(out.values.begin() + 2 * plane, out.values.end(), got_last.values.begin());
      std::copy(ref.out.values.begin() + 2 * plane, ref.out.values.end(),
                ref_last.values.begin());
      expect_close(got_last, ref_last,
                   cheri_relative_to_max(ref_last, cheri_fast_path_bound(c.dtype)),
                   "out of example 2");
    }
  }
}

TEST_F(CheriCudaMisc, ZeroMlpWeightsGiveX) {
  // linear2 = 0: the MLP adds exactly zero, on the fused path (C = 128), the general one (C = 80)
  // and in the training forward.
  for (DType dtype : kDtypes) {
    for (const CheriCase& k : {CheriCase{2, 70, 128, 2, 4}, CheriCase{2, 30, 80, 2, 2}}) {
      const CheriCase c = with_dtype(k, dtype);
      SCOPED_TRACE(cheri_case_name(c));
      CheriInputs in = make_cheri_inputs(c, rng_);
      std::fill(in.w.linear2.values.begin(), in.w.linear2.values.end(), 0.0);
      for (const auto& run : {run_block, run_block_inference}) {
        const CheriTensors t = upload_cheri(in, c, kCuda);
        run(t, c);
        expect_device_ok();
        const HostTensor out = download(t.out.view), x = download(t.x.view);
        EXPECT_EQ(out.values, x.values) << "out differs from x";
      }
    }
  }
}

TEST_F(CheriCudaMisc, GradientsOfAnyScale) {
  // The backward's front kernel (float32 with TF32, C of 64 and 128) rounds grad_out to float16
  // after a power of two per row: gradients far outside float16's range, and rows of scales 1e40
  // apart, keep TF32's accuracy (a scale leaking from one row to another would overflow or flush
  // the other). C = 80 takes cuBLASLt throughout.
  struct Scaling {
    const char* name;
    double (*factor)(std::int64_t row);
  };
  const Scaling scalings[] = {
      {"1e-30", [](std::int64_t) { return 1e-30; }},
      {"1e+30", [](std::int64_t) { return 1e30; }},
      {"1e-20, 1, 1e+20 by row",
       [](std::int64_t r) { return r % 3 == 0 ? 1e-20 : r % 3 == 1 ? 1.0 : 1e20; }},
  };
  for (const CheriCase& c : {CheriCase{2, 70, 128, 2, 4}, CheriCase{3, 45, 64, 2, 8},
                             CheriCase{2, 30, 80, 2, 2}}) {
    const CheriInputs base = make_cheri_inputs(c, rng_);
    for (const Scaling& scaling : scalings) {
      SCOPED_TRACE(cheri_case_name(c) + ", grad_out times " + scaling.name);
      CheriInputs in = base;
      for (std::size_t i = 0; i < in.grad_out.values.size(); ++i) {
        in.grad_out.values[i] *= scaling.factor(static_cast<std::int64_t>(i) / c.c);
      }
      check_block(in, c, {});
    }
  }
}

TEST_F(CheriCudaMisc, EachExampleKeepsTheAccuracyOfItsOwnGradient) {
  // Examples whose gradients are 1e20 apart, in tiles that span two examples (L = 70, C = 128 and
  // 64 take the front kernel): each example's grad_x within the TF32 bound of its own largest
  // value, as if it were alone (the float16 intermediates are scaled per row, not per tile).
  for (const CheriCase& c : {CheriCase{3, 70, 128, 2, 4}, CheriCase{3, 70, 64, 2, 3}}) {
    SCOPED_TRACE(cheri_case_name(c));
    CheriInputs in = make_cheri_inputs(c, rng_);
    const double scale[] = {1e-20, 1.0, 1e20};
    const std::int64_t plane = c.l * c.c;
    for (std::size_t i = 0; i < in.grad_out.values.size(); ++i) {
      in.grad_out.values[i] *= scale[static_cast<std::int64_t>(i) / plane];
    }
    const CheriTensors t = upload_cheri(in, c, kCuda);
    run_block_backward(t, c);
    expect_device_ok();
    const CheriBlockGradients ref = fusekit::testing::cheri_block_backward_reference(
        in.grad_out, in.x, in.w, in.mean, in.rstd, c.dilation, c.residual_scale);
    const HostTensor got = download(t.grad_x.view);
    for (std::int64_t n = 0; n < c.n; ++n) {
      HostTensor got_n({1, c.l, c.c}), ref_n({1, c.l, c.c});
      std::copy_n(got.values.begin() + n * plane, plane, got_n.values.begin());
      std::copy_n(ref.grad_x.values.begin() + n * plane, plane, ref_n.values.begin());
      expect_close(got_n, ref_n, cheri_relative_to_max(ref_n, 1e-3),
                   "grad_x of example " + std::to_string(n));
    }
  }
}

TEST_F(CheriCudaMisc, EmptyBatch) {
  // N = 0: the forwards write nothing; the backwards write zero weight gradients.
  const CheriCase c{0, 5, 16, 2, 1};
  const CheriInputs in = make_cheri_inputs(c, rng_);
  const CheriTensors t = upload_cheri(in, c, kCuda);
  run_block_inference(t, c);
  run_block(t, c);
  run_conv_norm(t, c);
  run_block_backward(t, c);
  expect_device_ok();
  for (const DeviceTensor* g : {&t.grad_conv_weight, &t.grad_linear1, &t.grad_linear2}) {
    const HostTensor got = download(g->view);
    EXPECT_EQ(got.values, std::vector<double>(got.values.size(), 0.0));
  }
  const CheriTensors u = upload_cheri(in, c, kCuda);
  run_conv_norm_backward(u, c);
  expect_device_ok();
  const HostTensor got = download(u.grad_conv_weight.view);
  EXPECT_EQ(got.values, std::vector<double>(got.values.size(), 0.0));
}

TEST_F(CheriCudaMisc, RunsOnTheGivenStream) {
  const CheriCase c{2, 200, 128, 2, 4, DType::BFloat16};
  const CheriInputs in = make_cheri_inputs(c, rng_);
  const CheriTensors on_default = upload_cheri(in, c, kCuda);
  const CheriTensors on_stream = upload_cheri(in, c, kCuda);
  run_block_inference(on_default, c);
  run_block_backward(on_default, c);
  OwnStream s;
  expect_device_ok();  // the uploads and the poison (legacy stream) are done: s does not wait
  fusekit::cheri_block_inference(on_stream.out.view, on_stream.x.view, on_stream.weights(),
                                 c.block_options(), s.stream());
  fusekit::cheri_block_backward(on_stream.grad_x.view, on_stream.grads(),
                                on_stream.grad_out.view, on_stream.x.view, on_stream.weights(),
                                on_stream.mean_in.view, on_stream.rstd_in.view,
                                c.block_options(), s.stream());
  ASSERT_CUDA(cudaStreamSynchronize(s.get()));
  expect_device_ok();
  expect_same_bytes(on_stream.out, on_default.out, "out on its own stream against the default");
  expect_same_bytes(on_stream.grad_x, on_default.grad_x, "grad_x");
  expect_same_bytes(on_stream.grad_linear1, on_default.grad_linear1, "grads.linear1_weight");
}

// Tensors on the second device while the first is current: a stream of the first is rejected
// before anything runs, by every call; one of the second runs the warpgroup kernels there.
TEST_F(CheriCudaMisc, SecondDeviceAndItsStream) {
  SKIP_WITHOUT_TWO_DEVICES();
  const CheriCase c{2, 200, 128, 2, 4, DType::BFloat16};
  const CheriInputs in = make_cheri_inputs(c, rng_);
  const CheriTensors t = upload_cheri(in, c, Device::cuda(1));
  const OwnStream of_first;
  const fusekit::Stream first = of_first.stream();
  EXPECT_ERROR_CONTAINS(stream_of_first_device_error("cheri_block"), [&] {
    fusekit::cheri_block(t.out.view, t.mean.view, t.rstd.view, t.x.view, t.weights(),
                         c.block_options(), first);
  });
  EXPECT_ERROR_CONTAINS(stream_of_first_device_error("cheri_block_backward"), [&] {
    fusekit::cheri_block_backward(t.grad_x.view, t.grads(), t.grad_out.view, t.x.view,
                                  t.weights(), t.mean_in.view, t.rstd_in.view, c.block_options(),
                                  first);
  });
  EXPECT_ERROR_CONTAINS(stream_of_first_device_error("dilated_conv_norm"), [&] {
    fusekit::dilated_conv_norm(t.out.view, t.mean.view, t.rstd.view, t.x.view,
                               t.conv_weight.view, c.conv_options(), first);
  });
  EXPECT_ERROR_CONTAINS(stream_of_first_device_error("dilated_conv_norm_backward"), [&] {
    fusekit::dilated_conv_norm_backward(t.grad_x.view, t.grad_conv_weight.view, t.grad_out.view,
                                        t.x.view, t.conv_weight.view, t.mean_in.view,
                                        t.rstd_in.view, c.conv_options(), first);
  });
  for (const DeviceTensor* u : {&t.mean, &t.rstd, &t.grad_x, &t.grad_conv_weight}) {
    expect_untouched(*u, u->view.describe());
  }
  ASSERT_NO_FATAL_FAILURE(run_on_the_second_device(
      "cheri_block_inference", {&t.out}, [&](fusekit::Stream s) {
        fusekit::cheri_block_inference(t.out.view, t.x.view, t.weights(), c.block_options(), s);
      }));
  const CheriBlockResult ref =
      fusekit::testing::cheri_block_reference(in.x, in.w, c.dilation, c.residual_scale, c.eps);
  expect_only_view_written(t.out, "out");
  expect_close(fusekit::testing::download(t.out.view), ref.out,
               cheri_relative_to_max(ref.out, cheri_fast_path_bound(c.dtype)), "out");
}

// ------------------------------------------------------------------------------------ graphs

class CheriCudaGraph : public CudaTest<::testing::TestWithParam<DType>> {};

TEST_P(CheriCudaGraph, CapturedCallsReplayBitwiseAsDirectCalls) {
  const CheriCase c{2, 130, 128, 2, 2, GetParam()};
  const CheriInputs in = make_cheri_inputs(c, rng_);
  const CheriTensors direct = upload_cheri(in, c, kCuda);
  CheriTensors t = upload_cheri(in, c, kCuda);
  run_block_inference(direct, c);
  run_block_backward(direct, c);
  run_conv_norm(direct, c);  // overwrites out with y; mean and rstd its own
  expect_device_ok();

  OwnStream s;
  const fusekit::Stream stream = s.stream();
  CapturedGraph graph;
  ASSERT_NO_FATAL_FAILURE(graph.capture(s.get(), [&] {
    fusekit::cheri_block_inference(t.out.view, t.x.view, t.weights(), c.block_options(), stream);
    fusekit::cheri_block_backward(t.grad_x.view, t.grads(), t.grad_out.view, t.x.view,
                                  t.weights(), t.mean_in.view, t.rstd_in.view, c.block_options(),
                                  stream);
    fusekit::dilated_conv_norm(t.out.view, t.mean.view, t.rstd.view, t.x.view,
                               t.conv_weight.view, c.conv_options(), stream);
  }));
  for (int replay = 0; replay < 2; ++replay) {
    SCOPED_TRACE("replay " + std::to_string(replay));
    ASSERT_NO_FATAL_FAILURE(graph.replay({&t.out, &t.mean, &t.rstd, &t.grad_x,
                                          &t.grad_conv_weight, &t.grad_linear1, &t.grad_linear2}));
    expect_same_bytes(t.out, direct.out, "y");
    expect_same_bytes(t.mean, direct.mean, "mean");
    expect_same_bytes(t.rstd, direct.rstd, "rstd");
    expect_same_bytes(t.grad_x, direct.grad_x, "grad_x");
    expect_same_bytes(t.grad_conv_weight, direct.grad_conv_weight, "grads.conv_weight");
    expect_same_bytes(t.grad_linear1, direct.grad_linear1, "grads.linear1_weight");
    expect_same_bytes(t.grad_linear2, direct.grad_linear2, "grads.linear2_weight");
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CheriCudaGraph, ::testing::ValuesIn(kDtypes),
                         [](const auto& info) { return dtype_name(info.param); });

}  // namespace
