// mhc_post and mhc_post_backward on the CUDA backend: against the CPU backend on the same inputs
// and against float64, one named case per dispatch branch (asserted through the config
// selectors), every hc, model shapes, determinism, streams and CUDA-graph capture. Every test
// skips with "no CUDA device" where there is none.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "cuda_test_support.h"
#include "test_support.h"

namespace {

using namespace fusekit_test;
using fusekit::detail::MhcPostBackwardConfig;
using fusekit::detail::MhcPostConfig;
using Path = fusekit::detail::MhcPostConfig::Path;
using fusekit::testing::download;
using fusekit::testing::empty_poisoned;
using fusekit::testing::upload;

constexpr Device kCpu = Device::cpu();
constexpr Device kCuda = Device::cuda(0);
constexpr DType kDtypes[] = {DType::Float32, DType::BFloat16, DType::Float16};

int vec16(DType dtype) { return 16 / static_cast<int>(fusekit::element_size(dtype)); }

int multiprocessors() {
  static const int sms = fusekit::cuda_device_info(0).multiprocessors;
  return sms;
}

int sm_major() {
  static const int major = fusekit::cuda_device_info(0).sm_major;
  return major;
}

// ------------------------------------------------------------------------------------ runners

MhcPostConfig forward_config(const DeviceTensor& out, const MhcDeviceInputs& d) {
  return fusekit::detail::select_mhc_post_config(
      mhc_post_params_of(out.view, d.x.view, d.residual.view, d.post.view, d.comb.view),
      multiprocessors(), sm_major());
}

MhcPostBackwardConfig backward_config(const MhcGradTensors& g, const DeviceTensor& grad_out,
                                      const MhcDeviceInputs& d) {
  return fusekit::detail::select_mhc_post_backward_config(
      mhc_post_backward_params_of(g.grad_x.view, g.grad_residual.view, g.grad_post.view,
                                  g.grad_comb.view, grad_out.view, d.x.view, d.residual.view,
                                  d.post.view, d.comb.view),
      multiprocessors());
}

// The CPU backend's out for these inputs (in a contiguous layout: layouts are the CPU tests' job).
HostTensor forward_on_cpu(const MhcInputs& in, DType dtype) {
  const MhcDeviceInputs d = upload_mhc_inputs(in, dtype, kCpu);
  const DeviceTensor out = empty_poisoned(in.residual.shape, dtype, kCpu);
  run_mhc_post(out, d);
  return download(out.view);
}

fusekit::testing::MhcPostGradients backward_on_cpu(const MhcInputs& in, const HostTensor& grad_out,
                                                   DType dtype) {
  const MhcDeviceInputs d = upload_mhc_inputs(in, dtype, kCpu);
  const DeviceTensor g = upload(grad_out, dtype, kCpu);
  const MhcGradTensors grads = empty_mhc_grads(in, dtype, kCpu);
  run_mhc_post_backward(grads, g, d);
  return download_grads(grads);
}

void expect_forward_matches(const HostTensor& got, const MhcInputs& in, DType dtype) {
  const HostTensor terms = mhc_post_terms(in);
  expect_close(got, forward_on_cpu(in, dtype), backend_tolerance(dtype), "out, cuda vs cpu",
               &terms);
  expect_out_matches_float64(got, in, dtype, "out, cuda vs float64");
}

void expect_backward_matches(const fusekit::testing::MhcPostGradients& got, const MhcInputs& in,
                             const HostTensor& grad_out, DType dtype) {
  const fusekit::testing::MhcPostGradients terms = mhc_post_backward_terms(grad_out, in);
  expect_grads_close(got, backward_on_cpu(in, grad_out, dtype), backend_tolerance(dtype),
                     "cuda vs cpu", &terms);
  expect_grads_match_float64(got, grad_out, in, dtype, "cuda vs float64");
}

// One forward on cuda:0 into a poisoned `out` laid out as `layouts.out`; checked against the CPU
// backend and float64, and for writes outside the view. Returns the branch it took.
MhcPostConfig check_forward(const MhcInputs& in, DType dtype, const MhcLayouts& layouts = {}) {
  const MhcDeviceInputs d = upload_mhc_inputs(in, dtype, kCuda, layouts);
  const DeviceTensor out = empty_poisoned(in.residual.shape, dtype, kCuda, layouts.out);
  const MhcPostConfig config = forward_config(out, d);
  run_mhc_post(out, d);
  expect_device_ok();
  expect_forward_matches(download(out.view), in, dtype);
  expect_only_view_written(out, "out");
  return config;
}

MhcPostBackwardConfig check_backward(const MhcInputs& in, const HostTensor& grad_out, DType dtype,
                                     const MhcLayouts& layouts = {}) {
  const MhcDeviceInputs d = upload_mhc_inputs(in, dtype, kCuda, layouts);
  const DeviceTensor g = upload(grad_out, dtype, kCuda, layouts.out);
  const MhcGradTensors grads = empty_mhc_grads(in, dtype, kCuda, layouts);
  const MhcPostBackwardConfig config = backward_config(grads, g, d);
  run_mhc_post_backward(grads, g, d);
  expect_device_ok();
  expect_backward_matches(download_grads(grads), in, grad_out, dtype);
  expect_grads_only_view_written(grads);
  return config;
}

std::string dtype_param_name(const ::testing::TestParamInfo<DType>& info) {
  return dtype_name(info.param);
}

// ------------------------------------------------------------------------------------ forward

class MhcPostCudaForward : public CudaTest<::testing::TestWithParam<DType>> {};

TEST_P(MhcPostCudaForward, VectorizedPath) {
  const DType dtype = GetParam();
  const MhcPostConfig c = check_forward(make_mhc_inputs(8, 4, 7168, dtype, rng_), dtype);
  EXPECT_EQ(c.path, Path::Vector);
  EXPECT_EQ(c.vec, vec16(dtype));
}

TEST_P(MhcPostCudaForward, VectorizedPathWithVectorPaddedRows) {
  // Rows padded by one whole vector keep every row start aligned.
  const DType dtype = GetParam();
  const std::int64_t v = vec16(dtype);
  const MhcLayouts layouts{.out = {{}, v, 0}, .x = {{}, 2 * v, 0}, .residual = {{}, v, 0}};
  const MhcPostConfig c = check_forward(make_mhc_inputs(6, 4, 512, dtype, rng_), dtype, layouts);
  EXPECT_EQ(c.path, Path::Vector);
}

TEST_P(MhcPostCudaForward, ScalarPathOddH) {
  const DType dtype = GetParam();
  const MhcPostConfig c = check_forward(make_mhc_inputs(8, 4, 127, dtype, rng_), dtype);
  EXPECT_EQ(c.path, Path::Scalar);
  EXPECT_EQ(c.vec, 1);
}

TEST_P(MhcPostCudaForward, ScalarPathMisalignedBase) {
  const DType dtype = GetParam();
  for (const MhcLayouts& layouts : {MhcLayouts{.x = {{}, 0, 1}}, MhcLayouts{.out = {{}, 0, 1}},
                                    MhcLayouts{.residual = {{}, 0, 1}}}) {
    const MhcPostConfig c = check_forward(make_mhc_inputs(8, 4, 1024, dtype, rng_), dtype, layouts);
    EXPECT_EQ(c.path, Path::Scalar);
  }
}

TEST_P(MhcPostCudaForward, ScalarPathStridedH) {
  const DType dtype = GetParam();
  const MhcLayouts layouts{.x = {{1, 0}, 0, 0}};  // x[n, h] at h * N + n
  const MhcPostConfig c = check_forward(make_mhc_inputs(8, 4, 1024, dtype, rng_), dtype, layouts);
  EXPECT_EQ(c.path, Path::Scalar);
}

TEST_P(MhcPostCudaForward, ScalarPathOddlyPaddedRows) {
  const DType dtype = GetParam();
  const MhcLayouts layouts{.out = {{}, 3, 0}, .x = {{}, 1, 0}, .residual = {{}, 5, 0}};
  const MhcPostConfig c = check_forward(make_mhc_inputs(5, 4, 1024, dtype, rng_), dtype, layouts);
  EXPECT_EQ(c.path, Path::Scalar);
}

TEST_P(MhcPostCudaForward, HcMajorResidualAndTransposedMixes) {
  // Layouts that keep H contiguous and aligned take the vector path whatever the other strides.
  const DType dtype = GetParam();
  const MhcLayouts layouts{.out = {{1, 0, 2}, 0, 0},
                           .residual = {{1, 0, 2}, 0, 0},
                           .post = {{1, 0}, 0, 0},
                           .comb = {{0, 2, 1}, 0, 1}};
  const MhcPostConfig c = check_forward(make_mhc_inputs(8, 4, 1024, dtype, rng_), dtype, layouts);
  EXPECT_EQ(c.path, Path::Vector);
}

TEST_P(MhcPostCudaForward, NegativeStrides) {
  const DType dtype = GetParam();
  const MhcInputs in = make_mhc_inputs(4, 4, 256, dtype, rng_);
  const DeviceTensor x = upload_reversed(in.x, dtype, kCuda);
  const DeviceTensor residual = upload_reversed(in.residual, dtype, kCuda);
  const DeviceTensor post = upload_reversed(in.post, DType::Float32, kCuda);
  const DeviceTensor comb = upload_reversed(in.comb, DType::Float32, kCuda);
  const DeviceTensor out = empty_reversed(in.residual.shape, dtype, kCuda);
  fusekit::mhc_post(out.view, x.view, residual.view, post.view, comb.view);
  expect_device_ok();
  expect_forward_matches(download(out.view), in, dtype);
}

TEST_P(MhcPostCudaForward, SmallBatches) {
  const DType dtype = GetParam();
  for (std::int64_t n : {1, 8}) {
    for (std::int64_t h : {1, 8, 7168}) {
      SCOPED_TRACE("N=" + std::to_string(n) + " H=" + std::to_string(h));
      check_forward(make_mhc_inputs(n, 4, h, dtype, rng_), dtype);
    }
  }
}

TEST_P(MhcPostCudaForward, ModelShape) {
  const DType dtype = GetParam();
  const MhcPostConfig c =
      check_forward(make_mhc_inputs(64, 4, 7168, dtype, rng_, /*post_3d=*/true), dtype);
  EXPECT_EQ(c.path, Path::Vector);
}

TEST_P(MhcPostCudaForward, EmptyBatchLaunchesNothing) {
  // Captured on a stream, N = 0 leaves an empty graph: no kernel, no allocation.
  const DType dtype = GetParam();
  const std::int64_t hc = 4, h = 256;
  const MhcInputs in = make_mhc_inputs(0, hc, h, dtype, rng_);
  const MhcDeviceInputs d = upload_mhc_inputs(in, dtype, kCuda);
  DeviceTensor out = empty_poisoned({2, hc, h}, dtype, kCuda);
  out.view.shape[0] = 0;
  const DeviceTensor g = upload(make_grad_out(0, hc, h, dtype, rng_), dtype, kCuda);
  MhcGradTensors grads = empty_mhc_grads(make_mhc_inputs(2, hc, h, dtype, rng_), dtype, kCuda);
  for (DeviceTensor* t : {&grads.grad_x, &grads.grad_residual, &grads.grad_post, &grads.grad_comb}) {
    t->view.shape[0] = 0;
  }

  OwnStream s;
  CapturedGraph graph;
  ASSERT_NO_FATAL_FAILURE(graph.capture(s.get(), [&] {
    run_mhc_post(out, d, s.stream());
    run_mhc_post_backward(grads, g, d, s.stream());
  }));
  GraphNodeCounts nodes;
  ASSERT_NO_FATAL_FAILURE(graph.count_nodes(nodes));
  EXPECT_EQ(nodes.total, 0) << "N = 0 enqueued work";
  expect_device_ok();
  expect_only_view_written(out, "out");
  expect_grads_only_view_written(grads);
}

TEST_P(MhcPostCudaForward, ZeroHidden) {
  expect_zero_hidden_is_valid(kCuda, GetParam(), rng_);
  expect_device_ok();
}

TEST_P(MhcPostCudaForward, OnANonDefaultStream) {
  const DType dtype = GetParam();
  const MhcInputs in = make_mhc_inputs(16, 4, 4096, dtype, rng_);
  const MhcDeviceInputs d = upload_mhc_inputs(in, dtype, kCuda);
  const DeviceTensor out = empty_poisoned(in.residual.shape, dtype, kCuda);
  OwnStream s;
  expect_device_ok();  // the uploads and the poison (legacy stream) are done: s does not wait
  run_mhc_post(out, d, s.stream());
  ASSERT_CUDA(cudaStreamSynchronize(s.get()));
  expect_forward_matches(download(out.view), in, dtype);
}

// Tensors on the second device while the first is current: a stream of the first is rejected
// before anything runs, one of the second runs there.
TEST_P(MhcPostCudaForward, SecondDeviceAndItsStream) {
  SKIP_WITHOUT_TWO_DEVICES();
  const DType dtype = GetParam();
  const MhcInputs in = make_mhc_inputs(16, 4, 4096, dtype, rng_);
  const MhcDeviceInputs d = upload_mhc_inputs(in, dtype, Device::cuda(1));
  const DeviceTensor out = empty_poisoned(in.residual.shape, dtype, Device::cuda(1));
  ASSERT_NO_FATAL_FAILURE(run_on_the_second_device(
      "mhc_post", {&out}, [&](fusekit::Stream s) { run_mhc_post(out, d, s); }));
  expect_forward_matches(download(out.view), in, dtype);
}

TEST_P(MhcPostCudaForward, IsBitwiseDeterministic) {
  const DType dtype = GetParam();
  const MhcInputs in = make_mhc_inputs(8, 4, 7168, dtype, rng_);
  const MhcDeviceInputs d = upload_mhc_inputs(in, dtype, kCuda);
  const DeviceTensor a = empty_poisoned(in.residual.shape, dtype, kCuda);
  const DeviceTensor b = empty_poisoned(in.residual.shape, dtype, kCuda);
  run_mhc_post(a, d);
  run_mhc_post(b, d);
  expect_device_ok();
  EXPECT_TRUE(raw_bytes(a) == raw_bytes(b)) << "two runs of mhc_post differ";
}

INSTANTIATE_TEST_SUITE_P(Dtypes, MhcPostCudaForward, ::testing::ValuesIn(kDtypes),
                         dtype_param_name);

// ------------------------------------------------------------------------------------ bulk path

// Large problems on sm_90 and later stream row tiles through shared memory with bulk copies. The
// path is chosen by size (a quarter of a gigabyte moved, or so); these shapes are just above it,
// with an H that leaves a partial last tile.
std::int64_t rows_for_bulk(DType dtype, std::int64_t hc, std::int64_t h) {
  const double row_bytes = static_cast<double>(h) * static_cast<double>(fusekit::element_size(dtype)) *
                           static_cast<double>(1 + 2 * hc);
  return static_cast<std::int64_t>(256e6 / row_bytes) + 3;
}

template <typename Base = ::testing::Test>
class BulkTest : public CudaTest<Base> {
 protected:
  void SetUp() override {
    CudaTest<Base>::SetUp();
    if (::testing::Test::IsSkipped()) return;
    if (sm_major() < 9) GTEST_SKIP() << "the bulk-copy path needs sm_90 or later";
  }
};

class MhcPostCudaBulk : public BulkTest<::testing::TestWithParam<std::tuple<DType, int>>> {};

TEST_P(MhcPostCudaBulk, BulkPath) {
  const auto [dtype, hc] = GetParam();
  const std::int64_t h = 7168 + vec16(dtype);  // one vector into a last, partial tile
  const std::int64_t n = rows_for_bulk(dtype, hc, h);
  const MhcPostConfig c = check_forward(make_mhc_inputs(n, hc, h, dtype, rng_), dtype);
  EXPECT_EQ(c.path, Path::Bulk) << "N=" << n << " H=" << h;
}

INSTANTIATE_TEST_SUITE_P(All, MhcPostCudaBulk,
                         ::testing::Combine(::testing::ValuesIn(kDtypes),
                                            ::testing::Values(1, 4, 5, 8)),
                         [](const auto& info) {
                           return dtype_name(std::get<0>(info.param)) + "_hc" +
                                  std::to_string(std::get<1>(info.param));
                         });

class MhcPostCudaBulkLayouts : public BulkTest<> {};

TEST_F(MhcPostCudaBulkLayouts, PaddedRowsAndHcMajorStreams) {
  // Row strides that keep every row start aligned, and hc as the outermost dim of out and
  // residual: still the bulk path.
  const DType dtype = DType::BFloat16;
  const std::int64_t hc = 4, h = 4096, v = vec16(dtype);
  const std::int64_t n = rows_for_bulk(dtype, hc, h);
  const MhcLayouts cases[] = {
      {.out = {{}, v, 0}, .x = {{}, 3 * v, 0}, .residual = {{}, 2 * v, 0}},
      {.out = {{1, 0, 2}, 0, 0}, .residual = {{1, 0, 2}, v, 0}, .comb = {{0, 2, 1}, 0, 1}}};
  for (const MhcLayouts& layouts : cases) {
    const MhcPostConfig c = check_forward(make_mhc_inputs(n, hc, h, dtype, rng_), dtype, layouts);
    EXPECT_EQ(c.path, Path::Bulk);
  }
}

TEST_F(MhcPostCudaBulkLayouts, LongRows) {
  const DType dtype = DType::BFloat16;
  const std::int64_t hc = 4, h = 65536 + 8;
  const std::int64_t n = rows_for_bulk(dtype, hc, h);
  const MhcPostConfig c = check_forward(make_mhc_inputs(n, hc, h, dtype, rng_), dtype);
  EXPECT_EQ(c.path, Path::Bulk);
}

// ------------------------------------------------------------------------------------ every hc

class MhcPostCudaHc : public CudaTest<::testing::TestWithParam<std::tuple<DType, int>>> {};

TEST_P(MhcPostCudaHc, ForwardBothPaths) {
  const auto [dtype, hc] = GetParam();
  EXPECT_EQ(check_forward(make_mhc_inputs(8, hc, 256, dtype, rng_), dtype).path, Path::Vector);
  EXPECT_EQ(check_forward(make_mhc_inputs(8, hc, 129, dtype, rng_), dtype).path, Path::Scalar);
}

TEST_P(MhcPostCudaHc, BackwardBothPathsAndChunkings) {
  const auto [dtype, hc] = GetParam();
  const struct {
    std::int64_t n, h;
    bool vectorized, chunked;
  } cases[] = {{4, 4096, true, true}, {4, 4095, false, true}, {64, 256, true, false},
               {64, 127, false, false}};
  for (const auto& k : cases) {
    SCOPED_TRACE("N=" + std::to_string(k.n) + " H=" + std::to_string(k.h));
    const MhcInputs in = make_mhc_inputs(k.n, hc, k.h, dtype, rng_, /*post_3d=*/hc % 2 == 1);
    const MhcPostBackwardConfig c =
        check_backward(in, make_grad_out(k.n, hc, k.h, dtype, rng_), dtype);
    EXPECT_EQ(c.vectorized, k.vectorized);
    EXPECT_EQ(c.chunks > 1, k.chunked) << c.chunks << " chunks";
  }
}

INSTANTIATE_TEST_SUITE_P(All, MhcPostCudaHc,
                         ::testing::Combine(::testing::ValuesIn(kDtypes), ::testing::Range(1, 9)),
                         [](const auto& info) {
                           return dtype_name(std::get<0>(info.param)) + "_hc" +
                                  std::to_string(std::get<1>(info.param));
                         });

// ------------------------------------------------------------------------------------ backward

class MhcPostCudaBackward : public CudaTest<::testing::TestWithParam<DType>> {};

TEST_P(MhcPostCudaBackward, OneChunkVectorized) {
  const DType dtype = GetParam();
  const std::int64_t n = 64, hc = 4, h = 512;
  const MhcInputs in = make_mhc_inputs(n, hc, h, dtype, rng_);
  const MhcPostBackwardConfig c = check_backward(in, make_grad_out(n, hc, h, dtype, rng_), dtype);
  EXPECT_TRUE(c.vectorized);
  EXPECT_EQ(c.chunks, 1);
}

TEST_P(MhcPostCudaBackward, OneChunkScalar) {
  const DType dtype = GetParam();
  const std::int64_t n = 16, hc = 4, h = 127;
  const MhcInputs in = make_mhc_inputs(n, hc, h, dtype, rng_);
  const MhcPostBackwardConfig c = check_backward(in, make_grad_out(n, hc, h, dtype, rng_), dtype);
  EXPECT_FALSE(c.vectorized);
  EXPECT_EQ(c.chunks, 1);
}

TEST_P(MhcPostCudaBackward, ManyChunksVectorized) {
  const DType dtype = GetParam();
  const std::int64_t n = 8, hc = 4, h = 7168;
  const MhcInputs in = make_mhc_inputs(n, hc, h, dtype, rng_);
  const MhcPostBackwardConfig c = check_backward(in, make_grad_out(n, hc, h, dtype, rng_), dtype);
  EXPECT_TRUE(c.vectorized);
  EXPECT_GT(c.chunks, 1);
}

TEST_P(MhcPostCudaBackward, ManyChunksScalar) {
  const DType dtype = GetParam();
  const std::int64_t n = 1, hc = 4, h = 7167;
  const MhcInputs in = make_mhc_inputs(n, hc, h, dtype, rng_);
  const MhcPostBackwardConfig c = check_backward(in, make_grad_out(n, hc, h, dtype, rng_), dtype);
  EXPECT_FALSE(c.vectorized);
  EXPECT_GT(c.chunks, 1);
}

TEST_P(MhcPostCudaBackward, ScalarPathLayouts) {
  // Misaligned bases, a non-unit H stride and odd row padding, each forcing the scalar path.
  const DType dtype = GetParam();
  const std::int64_t n = 6, hc = 4, h = 1024;
  const MhcLayouts cases[] = {
      {.out = {{}, 0, 1}},  // grad_out misaligned
      {.x = {{1, 0}, 0, 0}},
      {.out = {{2, 0, 1}, 0, 0}, .x = {{}, 0, 1}, .residual = {{}, 3, 1}, .post = {{}, 1, 1},
       .comb = {{0, 2, 1}, 0, 1}}};
  for (const MhcLayouts& layouts : cases) {
    const MhcInputs in = make_mhc_inputs(n, hc, h, dtype, rng_);
    const MhcPostBackwardConfig c =
        check_backward(in, make_grad_out(n, hc, h, dtype, rng_), dtype, layouts);
    EXPECT_FALSE(c.vectorized);
  }
}

TEST_P(MhcPostCudaBackward, ModelShape) {
  const DType dtype = GetParam();
  const std::int64_t n = 64, hc = 4, h = 7168;
  const MhcInputs in = make_mhc_inputs(n, hc, h, dtype, rng_);
  const MhcPostBackwardConfig c = check_backward(in, make_grad_out(n, hc, h, dtype, rng_), dtype);
  EXPECT_TRUE(c.vectorized);
}

TEST_P(MhcPostCudaBackward, NegativeStrides) {
  const DType dtype = GetParam();
  const std::int64_t n = 4, hc = 4, h = 1000;
  const MhcInputs in = make_mhc_inputs(n, hc, h, dtype, rng_);
  const HostTensor grad_out = make_grad_out(n, hc, h, dtype, rng_);
  const DeviceTensor x = upload_reversed(in.x, dtype, kCuda);
  const DeviceTensor residual = upload_reversed(in.residual, dtype, kCuda);
  const DeviceTensor post = upload_reversed(in.post, DType::Float32, kCuda);
  const DeviceTensor comb = upload_reversed(in.comb, DType::Float32, kCuda);
  const DeviceTensor g = upload_reversed(grad_out, dtype, kCuda);
  const MhcGradTensors grads{empty_reversed(in.x.shape, dtype, kCuda),
                             empty_reversed(in.residual.shape, dtype, kCuda),
                             empty_reversed(in.post.shape, DType::Float32, kCuda),
                             empty_reversed(in.comb.shape, DType::Float32, kCuda)};
  fusekit::mhc_post_backward(grads.grad_x.view, grads.grad_residual.view, grads.grad_post.view,
                             grads.grad_comb.view, g.view, x.view, residual.view, post.view,
                             comb.view);
  expect_device_ok();
  expect_backward_matches(download_grads(grads), in, grad_out, dtype);
}

TEST_P(MhcPostCudaBackward, IsBitwiseDeterministic) {
  const DType dtype = GetParam();
  for (std::int64_t n : {8, 4096}) {  // many chunks (a second reduction pass), then one
    const std::int64_t hc = 4, h = n == 8 ? 7168 : 256;
    const MhcInputs in = make_mhc_inputs(n, hc, h, dtype, rng_);
    const MhcDeviceInputs d = upload_mhc_inputs(in, dtype, kCuda);
    const DeviceTensor g = upload(make_grad_out(n, hc, h, dtype, rng_), dtype, kCuda);
    const MhcGradTensors a = empty_mhc_grads(in, dtype, kCuda);
    const MhcGradTensors b = empty_mhc_grads(in, dtype, kCuda);
    SCOPED_TRACE("N=" + std::to_string(n) + ", " + std::to_string(backward_config(a, g, d).chunks) +
                 " chunks");
    run_mhc_post_backward(a, g, d);
    run_mhc_post_backward(b, g, d);
    expect_device_ok();
    EXPECT_TRUE(raw_bytes(a.grad_x) == raw_bytes(b.grad_x)) << "grad_x differs between runs";
    EXPECT_TRUE(raw_bytes(a.grad_residual) == raw_bytes(b.grad_residual))
        << "grad_residual differs between runs";
    EXPECT_TRUE(raw_bytes(a.grad_post) == raw_bytes(b.grad_post))
        << "grad_post_layer_mix differs between runs";
    EXPECT_TRUE(raw_bytes(a.grad_comb) == raw_bytes(b.grad_comb))
        << "grad_comb_res_mix differs between runs";
  }
}

TEST_P(MhcPostCudaBackward, OnANonDefaultStream) {
  // Chunked, so its temporary memory is taken and returned on the stream too.
  const DType dtype = GetParam();
  const std::int64_t n = 8, hc = 4, h = 7168;
  const MhcInputs in = make_mhc_inputs(n, hc, h, dtype, rng_);
  const HostTensor grad_out = make_grad_out(n, hc, h, dtype, rng_);
  const MhcDeviceInputs d = upload_mhc_inputs(in, dtype, kCuda);
  const DeviceTensor g = upload(grad_out, dtype, kCuda);
  const MhcGradTensors grads = empty_mhc_grads(in, dtype, kCuda);
  ASSERT_GT(backward_config(grads, g, d).chunks, 1);
  OwnStream s;
  expect_device_ok();  // the uploads and the poison (legacy stream) are done: s does not wait
  run_mhc_post_backward(grads, g, d, s.stream());
  ASSERT_CUDA(cudaStreamSynchronize(s.get()));
  expect_backward_matches(download_grads(grads), in, grad_out, dtype);
}

TEST_P(MhcPostCudaBackward, SecondDeviceAndItsStream) {
  SKIP_WITHOUT_TWO_DEVICES();
  const DType dtype = GetParam();
  const std::int64_t n = 8, hc = 4, h = 7168;
  const Device second = Device::cuda(1);
  const MhcInputs in = make_mhc_inputs(n, hc, h, dtype, rng_);
  const HostTensor grad_out = make_grad_out(n, hc, h, dtype, rng_);
  const MhcDeviceInputs d = upload_mhc_inputs(in, dtype, second);
  const DeviceTensor g = upload(grad_out, dtype, second);
  const MhcGradTensors grads = empty_mhc_grads(in, dtype, second);
  ASSERT_NO_FATAL_FAILURE(run_on_the_second_device(
      "mhc_post_backward", {&grads.grad_x, &grads.grad_residual, &grads.grad_post, &grads.grad_comb},
      [&](fusekit::Stream s) { run_mhc_post_backward(grads, g, d, s); }));
  expect_backward_matches(download_grads(grads), in, grad_out, dtype);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, MhcPostCudaBackward, ::testing::ValuesIn(kDtypes),
                         dtype_param_name);

// ------------------------------------------------------------------------------------ graphs

class MhcPostCudaGraph : public CudaTest<::testing::TestWithParam<DType>> {};

TEST_P(MhcPostCudaGraph, CapturedForwardAndBackwardReplay) {
  const DType dtype = GetParam();
  const std::int64_t n = 8, hc = 4, h = 7168;
  const MhcInputs in = make_mhc_inputs(n, hc, h, dtype, rng_);
  const HostTensor grad_out = make_grad_out(n, hc, h, dtype, rng_);
  const MhcDeviceInputs d = upload_mhc_inputs(in, dtype, kCuda);
  const DeviceTensor g = upload(grad_out, dtype, kCuda);
  DeviceTensor out = empty_poisoned(in.residual.shape, dtype, kCuda);
  MhcGradTensors grads = empty_mhc_grads(in, dtype, kCuda);
  // Chunked: the backward's cudaMallocAsync and cudaFreeAsync are captured as graph nodes.
  ASSERT_GT(backward_config(grads, g, d).chunks, 1);

  OwnStream s;
  CapturedGraph graph;
  ASSERT_NO_FATAL_FAILURE(graph.capture(s.get(), [&] {
    run_mhc_post(out, d, s.stream());
    run_mhc_post_backward(grads, g, d, s.stream());
  }));

  GraphNodeCounts nodes;
  ASSERT_NO_FATAL_FAILURE(graph.count_nodes(nodes));
  EXPECT_EQ(nodes.kernels, 3) << "forward, backward, chunk reduction";
  EXPECT_EQ(nodes.allocs, 1);
  EXPECT_EQ(nodes.frees, 1);

  for (int replay = 0; replay < 2; ++replay) {
    SCOPED_TRACE("replay " + std::to_string(replay));
    ASSERT_NO_FATAL_FAILURE(graph.replay(
        {&out, &grads.grad_x, &grads.grad_residual, &grads.grad_post, &grads.grad_comb}));
    expect_forward_matches(download(out.view), in, dtype);
    expect_backward_matches(download_grads(grads), in, grad_out, dtype);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, MhcPostCudaGraph, ::testing::ValuesIn(kDtypes), dtype_param_name);

// ------------------------------------------------------------------------------------ misc

class MhcPostCudaErrors : public CudaTest<> {};

TEST_F(MhcPostCudaErrors, DeviceMismatch) {
  const MhcInputs in = make_mhc_inputs(4, 4, 64, DType::BFloat16, rng_);
  const MhcDeviceInputs d = upload_mhc_inputs(in, DType::BFloat16, kCuda);
  const DeviceTensor out = empty_poisoned(in.residual.shape, DType::BFloat16, kCpu);
  EXPECT_ERROR_CONTAINS("mhc_post: out is on cpu but x is on cuda:0; expected one device",
                        [&] { run_mhc_post(out, d); });
  MhcDeviceInputs mixed = upload_mhc_inputs(in, DType::BFloat16, kCuda);
  mixed.comb = upload(in.comb, DType::Float32, kCpu);
  const DeviceTensor cuda_out = empty_poisoned(in.residual.shape, DType::BFloat16, kCuda);
  EXPECT_ERROR_CONTAINS("mhc_post: comb_res_mix is on cpu but x is on cuda:0; expected one device",
                        [&] { run_mhc_post(cuda_out, mixed); });
  expect_only_view_written(cuda_out, "out");  // nothing was launched
}

TEST_F(MhcPostCudaErrors, DeviceIndexBeyondTheDevices) {
  const int count = fusekit::cuda_device_count();
  const MhcInputs in = make_mhc_inputs(2, 4, 64, DType::Float32, rng_);
  MhcDeviceInputs d = upload_mhc_inputs(in, DType::Float32, kCuda);
  DeviceTensor out = empty_poisoned(in.residual.shape, DType::Float32, kCuda);
  for (TensorView* t : {&d.x.view, &d.residual.view, &d.post.view, &d.comb.view, &out.view}) {
    t->device = Device::cuda(count);
  }
  EXPECT_ERROR_CONTAINS("CUDA error", [&] { run_mhc_post(out, d); });
  // The failed call's error stays the runtime's last error; clear it for whatever runs next.
  (void)cudaGetLastError();
}

TEST(CudaRuntime, DeviceInfoOfEachDevice) {
  const int count = fusekit::cuda_device_count();
  if (count == 0) GTEST_SKIP() << "no CUDA device";
  for (int d = 0; d < count; ++d) {
    const fusekit::CudaDeviceInfo info = fusekit::cuda_device_info(d);
    EXPECT_EQ(info.index, d);
    EXPECT_FALSE(info.name.empty());
    EXPECT_GT(info.multiprocessors, 0);
    EXPECT_GE(info.sm_major, 8);
    EXPECT_GT(info.global_memory_bytes, 0u);
  }
}

}  // namespace
