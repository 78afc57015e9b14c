// causal_attention on the CUDA backend: against the float64 reference in float32, float32 with
// TF32, bfloat16 and float16, with grouped-query heads and the single-head form, left padding of
// 0, 1, T - 1 and T for the whole batch and per sequence (counts outside [0, T] clamped), T of 1
// to 1000 and D of 1 to 256 over few and many blocks, every layout (q, k and v packed in one
// buffer too), sharp and flat softmaxes and scores that rise across every block of keys; at
// T = 4096 against the CPU backend on the same inputs. NaN fills every padding row of q, k and v;
// out and lse start as NaN and are checked for writes outside their views. Also empty inputs, lse
// left out, bitwise determinism, streams and CUDA-graph capture; each half-precision kernel by
// name (the warpgroup kernel where the device runs it, an error where not or where the layout
// does not fit). Every test skips with "no CUDA device" where there is none.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "causal_attention_support.h"
#include "common/cuda_check.h"
#include "cuda_test_support.h"

namespace {

using namespace fusekit_test;
using fusekit::testing::upload_padding_counts;

constexpr Device kCpu = Device::cpu();
constexpr Device kCuda = Device::cuda(0);
constexpr auto kAll = PaddingKind::All;
constexpr auto kPerSeq = PaddingKind::PerSequence;
using fusekit::detail::AttentionKernel;

// The four ways the CUDA backend multiplies: float32 (float32 accuracy), float32 with TF32, and
// the two half-precision dtypes.
struct Precision {
  DType dtype;
  bool tf32;
};

constexpr Precision kPrecisions[] = {{DType::Float32, false},
                                     {DType::Float32, true},
                                     {DType::BFloat16, false},
                                     {DType::Float16, false}};

AttentionCase with_precision(AttentionCase c, const Precision& p) {
  c.dtype = p.dtype;
  c.allow_tf32 = p.tf32;
  return c;
}

std::string precision_name(const Precision& p) { return p.tf32 ? "tf32" : dtype_name(p.dtype); }

void PrintTo(const Precision& p, std::ostream* os) { *os << precision_name(p); }

// ------------------------------------------------------------------------------------ checks

// The call of case c: fusekit::causal_attention, or the kernel c names through the internal
// parameters (validated as the public call validates them).
void run_named(const AttentionTensors& t, const AttentionCase& c) {
  if (c.kernel == AttentionKernel::Auto) {
    run_attention(t, c);
    return;
  }
  fusekit::detail::CausalAttentionParams p = fusekit::detail::causal_attention_params(
      t.out.view, t.lse.view, t.q.view, t.k.view, t.v.view, t.padding(), attention_options(c));
  if (p.b == 0 || p.t == 0) return;
  p.kernel = c.kernel;
  fusekit::detail::launch_causal_attention(p, t.q.view.device.index, {});
}

// One CUDA call into poisoned outputs, checked for writes outside their views; then no error may
// be left on the device.
CausalAttentionResult run_cuda(const AttentionInputs& in, const AttentionCase& c,
                               const AttentionLayouts& layouts = {}) {
  CausalAttentionResult got = run_attention_checked_with(
      in, c, kCuda, layouts, [&](const AttentionTensors& t) { run_named(t, c); });
  expect_device_ok();
  return got;
}

void check_cuda(const AttentionCase& c, std::mt19937_64& rng,
                const AttentionLayouts& layouts = {}) {
  const AttentionInputs in = make_attention_inputs(c, rng);
  expect_attention_cuda_close(run_cuda(in, c, layouts), attention_float64(in, c), in.n_padd, c);
}

// The CPU backend on the same inputs, in float32: they are already rounded to their dtype, so
// float32 holds them exactly, and the CPU's error against float64 is its float32 bound, which the
// comparison adds to the CUDA bound. For the sizes where float64 would be too slow.
void expect_matches_cpu(const CausalAttentionResult& got, const AttentionInputs& in,
                        const AttentionCase& c) {
  AttentionCase f32 = c;
  f32.dtype = DType::Float32;
  f32.allow_tf32 = false;
  const CausalAttentionResult cpu = run_attention_checked(in, f32, kCpu);
  expect_attention_cuda_close(got, cpu, in.n_padd, c, attention_out_tolerance(f32),
                              attention_lse_tolerance(f32));
}

void expect_same_outputs(const AttentionTensors& got, const AttentionTensors& expected,
                         const std::string& what) {
  expect_same_bytes(got.out, expected.out, "out " + what);
  expect_same_bytes(got.lse, expected.lse, "lse " + what);
}

const AttentionLayouts& layouts_named(std::string_view name) {
  for (const AttentionLayoutCase& l : kAttentionLayouts) {
    if (name == l.name) return l.layouts;
  }
  ADD_FAILURE() << "kAttentionLayouts has no layout named " << name;
  return kAttentionLayouts[0].layouts;
}

// ------------------------------------------------------------------------------------ shapes

// T of 1, 2, 17, 63, 64, 65 (one key block and a row past it), 127, 300 and 1000; D of 1, 3, 8,
// 32, 40, 64, 80, 96, 128, 200 and 256; B and H of small odd sizes, 8 query heads over 2 key/value
// heads and 6 over 1; padding of 0, 1, T - 1 and T for the batch, and per sequence fixed and
// drawn on every run.
const AttentionCase kCases[] = {
    {1, 1, 1, 1, 1},
    {1, 1, 1, 1, 1, kAll, {1}},
    {3, 3, 1, 2, 3, kPerSeq, {0, 1, 2}},
    {1, 3, 3, 17, 8, kAll, {1}},
    {2, 6, 1, 17, 32, kPerSeq, {0, 16}},
    {3, 5, 5, 63, 40, kPerSeq, {}},
    {2, 8, 2, 64, 64, kAll, {63}},
    {1, 3, 1, 65, 80, kPerSeq, {64}},
    {3, 3, 3, 65, 96, kAll, {0}},
    {2, 4, 2, 127, 128, kPerSeq, {0, 126}},
    {1, 3, 3, 127, 200, kPerSeq, {5}},
    {1, 2, 1, 100, 256, kAll, {17}},
    {3, 1, 1, 127, 64, kAll, {127}},
    {5, 1, 1, 65, 32, kPerSeq, {65, 0, 1, 64, 33}},
    {1, 1, 1, 300, 1, kAll, {2}},
    {1, 3, 1, 300, 3, kPerSeq, {}},
    {2, 3, 1, 1000, 64, kPerSeq, {}},
    {1, 1, 1, 1000, 128, kAll, {0}},
};

class AttentionCuda
    : public CudaTest<::testing::TestWithParam<std::tuple<Precision, AttentionCase>>> {};

TEST_P(AttentionCuda, MatchesFloat64) {
  const auto [precision, c] = GetParam();
  check_cuda(with_precision(c, precision), rng_);
}

INSTANTIATE_TEST_SUITE_P(All, AttentionCuda,
                         ::testing::Combine(::testing::ValuesIn(kPrecisions),
                                            ::testing::ValuesIn(kCases)),
                         [](const auto& info) {
                           return attention_case_name(
                               with_precision(std::get<1>(info.param), std::get<0>(info.param)));
                         });

// Hundreds of (sequence, head) pairs: launches of many blocks and of a middling count (at the 132
// multiprocessors of an H100 or H200), besides the few blocks of the cases above, which a launch
// may spread differently (say, splitting each block's keys between groups of warps). The last
// three have more query tiles of 64 rows than multiprocessors but fewer of 128 (the first is
// GPT-2's shape of the benchmark): the warpgroup kernel splits keys, in more than one wave.
const AttentionCase kManyBlockCases[] = {
    {3, 100, 20, 129, 64, kPerSeq, {}},
    {2, 50, 10, 200, 64, kPerSeq, {0, 199}},
    {3, 100, 25, 129, 128, kPerSeq, {}},
    {2, 50, 5, 200, 128, kAll, {1}},
    {1, 12, 12, 1024, 64, kAll, {100}},
    {3, 5, 5, 700, 64, kPerSeq, {}},
    {2, 4, 2, 2000, 128, kPerSeq, {}},
};

class AttentionCudaManyBlocks
    : public CudaTest<::testing::TestWithParam<std::tuple<Precision, AttentionCase>>> {};

TEST_P(AttentionCudaManyBlocks, MatchesFloat64) {
  const auto [precision, c] = GetParam();
  check_cuda(with_precision(c, precision), rng_);
}

INSTANTIATE_TEST_SUITE_P(All, AttentionCudaManyBlocks,
                         ::testing::Combine(::testing::ValuesIn(kPrecisions),
                                            ::testing::ValuesIn(kManyBlockCases)),
                         [](const auto& info) {
                           return attention_case_name(
                               with_precision(std::get<1>(info.param), std::get<0>(info.param)));
                         });

// T = 4096 with few heads, against the CPU backend: no padding (over a middling count of blocks),
// per-sequence counts drawn on every run, and all but the last token padded.
const AttentionCase kLongCases[] = {
    {1, 6, 2, 4096, 64, kAll, {0}},
    {2, 1, 1, 4096, 128, kPerSeq, {}},
    {1, 1, 1, 4096, 256, kAll, {4095}},
};

class AttentionCudaLong
    : public CudaTest<::testing::TestWithParam<std::tuple<Precision, AttentionCase>>> {};

TEST_P(AttentionCudaLong, MatchesCpuBackend) {
  const auto [precision, k] = GetParam();
  const AttentionCase c = with_precision(k, precision);
  const AttentionInputs in = make_attention_inputs(c, rng_);
  expect_matches_cpu(run_cuda(in, c), in, c);
}

INSTANTIATE_TEST_SUITE_P(All, AttentionCudaLong,
                         ::testing::Combine(::testing::ValuesIn(kPrecisions),
                                            ::testing::ValuesIn(kLongCases)),
                         [](const auto& info) {
                           return attention_case_name(
                               with_precision(std::get<1>(info.param), std::get<0>(info.param)));
                         });

// ------------------------------------------------------------------------------------ kernels

// Each kernel of the half-precision path by name (the warpgroup kernel runs only on compute
// capability 9.0 with an sm_90a build, and elsewhere naming it is an error): one row and one
// token, T around its 128-row tiles, padding of T - 1 and T, grouped-query heads, few blocks
// (keys split between warpgroups) and many, and GPT-2's shape padded by 100.
const AttentionCase kKernelCases[] = {
    {1, 1, 1, 1, 64},
    {1, 1, 1, 1, 128, kAll, {1}},
    {2, 8, 2, 64, 64, kAll, {63}},
    {3, 3, 3, 65, 64, kPerSeq, {}},
    {2, 4, 2, 127, 128, kPerSeq, {0, 126}},
    {3, 1, 1, 129, 64, kAll, {127}},
    {5, 1, 1, 200, 128, kPerSeq, {200, 0, 1, 128, 129}},
    {2, 3, 1, 1000, 64, kPerSeq, {}},
    {1, 1, 1, 1000, 128, kAll, {0}},
    {3, 100, 20, 129, 64, kPerSeq, {}},
    {2, 50, 5, 200, 128, kAll, {1}},
    {2, 12, 4, 1024, 64, kPerSeq, {}},
    {1, 12, 12, 1024, 64, kAll, {100}},
};

constexpr Precision kHalfPrecisions[] = {{DType::BFloat16, false}, {DType::Float16, false}};
constexpr AttentionKernel kKernels[] = {AttentionKernel::MmaSync, AttentionKernel::Warpgroup};

class AttentionCudaKernels
    : public CudaTest<::testing::TestWithParam<
          std::tuple<Precision, AttentionKernel, AttentionCase>>> {};

TEST_P(AttentionCudaKernels, MatchesFloat64) {
  const auto [precision, kernel, k] = GetParam();
  AttentionCase c = with_precision(k, precision);
  c.kernel = kernel;
  if (kernel == AttentionKernel::Warpgroup && !fusekit::detail::has_warpgroup_mma(0)) {
    const AttentionInputs in = make_attention_inputs(c, rng_);
    const AttentionTensors t = upload_attention(in, c, kCuda);
    EXPECT_THROW(run_named(t, c), fusekit::Error);
    GTEST_SKIP() << "this device runs no warpgroup MMAs (the error was checked)";
  }
  check_cuda(c, rng_);
}

INSTANTIATE_TEST_SUITE_P(All, AttentionCudaKernels,
                         ::testing::Combine(::testing::ValuesIn(kHalfPrecisions),
                                            ::testing::ValuesIn(kKernels),
                                            ::testing::ValuesIn(kKernelCases)),
                         [](const auto& info) {
                           AttentionCase c =
                               with_precision(std::get<2>(info.param), std::get<0>(info.param));
                           c.kernel = std::get<1>(info.param);
                           return attention_case_name(c);
                         });

// The warpgroup kernel named where it does not fit: float32, D other than 64 and 128, rows that
// are not 16-byte aligned, negative strides: a clear error.
class AttentionCudaNamedKernel : public CudaTest<> {};

TEST_F(AttentionCudaNamedKernel, WarpgroupKernelThatDoesNotFitIsAnError) {
  struct Misfit {
    AttentionCase c;
    AttentionLayouts layouts;
  };
  AttentionCase f32{1, 2, 2, 100, 64, kAll, {3}};
  AttentionCase d32{1, 2, 2, 100, 32, kAll, {3}, DType::BFloat16};
  AttentionCase misaligned{1, 2, 2, 100, 64, kAll, {3}, DType::Float16};
  AttentionLayouts odd_rows;
  odd_rows.q = Layout{{}, 1, 0};  // rows 65 elements apart
  AttentionCase flipped{2, 2, 2, 100, 128, kAll, {3}, DType::BFloat16};
  AttentionLayouts flip;
  flip.flip_dim = 2;
  for (const Misfit& m : {Misfit{f32, {}}, Misfit{d32, {}}, Misfit{misaligned, odd_rows},
                          Misfit{flipped, flip}}) {
    AttentionCase c = m.c;
    c.kernel = AttentionKernel::Warpgroup;
    SCOPED_TRACE(attention_case_name(c));
    const AttentionInputs in = make_attention_inputs(c, rng_);
    const AttentionTensors t = upload_attention(in, c, kCuda, m.layouts);
    EXPECT_ERROR_CONTAINS("the warpgroup kernel was asked for", [&] { run_named(t, c); });
    expect_device_ok();
  }
}

// ------------------------------------------------------------------------------------ layouts

// Every layout of the [B, H, T, D] form: with D of 64 and 128, rows of whole 16-byte pieces, the
// fast copies wherever the layout allows them (odd row strides and bases one element past an
// aligned address must not take them); with D = 17, element by element. The second and third
// cases have enough blocks for the many-blocks warpgroup kernel (at D = 128 two warpgroups a
// block, each storing its own rows), the others run few. Where out fits no tensor map but takes
// 16-byte pieces (flipped_t_out), the warpgroup kernel's threads copy its staged rows.
class AttentionCudaLayouts
    : public CudaTest<::testing::TestWithParam<std::tuple<Precision, AttentionLayoutCase>>> {};

TEST_P(AttentionCudaLayouts, MatchesFloat64) {
  const auto [precision, l] = GetParam();
  for (const AttentionCase& k : {AttentionCase{2, 4, 2, 130, 64, kPerSeq, {}},
                                 AttentionCase{1, 67, 1, 129, 64, kAll, {3}},
                                 AttentionCase{2, 34, 2, 130, 128, kPerSeq, {}},
                                 AttentionCase{1, 3, 1, 70, 128, kAll, {5}},
                                 AttentionCase{3, 3, 1, 33, 17, kPerSeq, {0, 32, 7}}}) {
    const AttentionCase c = with_precision(k, precision);
    SCOPED_TRACE(attention_case_name(c));
    check_cuda(c, rng_, l.layouts);
  }
}

INSTANTIATE_TEST_SUITE_P(All, AttentionCudaLayouts,
                         ::testing::Combine(::testing::ValuesIn(kPrecisions),
                                            ::testing::ValuesIn(kAttentionLayouts)),
                         [](const auto& info) {
                           return precision_name(std::get<0>(info.param)) + "_" +
                                  std::get<1>(info.param).name;
                         });

// The [T, D] form (lse [T]), padded for the batch of one or by a per-sequence count [1].
class AttentionCudaSingleHead
    : public CudaTest<::testing::TestWithParam<std::tuple<Precision, AttentionLayoutCase>>> {};

TEST_P(AttentionCudaSingleHead, MatchesFloat64) {
  const auto [precision, l] = GetParam();
  AttentionCase all{1, 1, 1, 150, 48, kAll, {7}};
  AttentionCase per_sequence{1, 1, 1, 65, 96, kPerSeq, {50}};
  AttentionCase fast{1, 1, 1, 200, 64, kPerSeq, {1}};
  for (AttentionCase* c : {&all, &per_sequence, &fast}) {
    c->single_head = true;
    *c = with_precision(*c, precision);
    SCOPED_TRACE(attention_case_name(*c));
    check_cuda(*c, rng_, l.layouts);
  }
}

INSTANTIATE_TEST_SUITE_P(All, AttentionCudaSingleHead,
                         ::testing::Combine(::testing::ValuesIn(kPrecisions),
                                            ::testing::ValuesIn(kSingleHeadLayouts)),
                         [](const auto& info) {
                           return precision_name(std::get<0>(info.param)) + "_" +
                                  std::get<1>(info.param).name;
                         });

// q, k and v as rows of one fused-projection buffer [B, T, Hq + 2 Hkv, D]: rows Hq + 2 Hkv heads
// apart, as they are, padded by an odd count (misaligned rows), and the buffer one element past
// an aligned address.
struct PackedLayout {
  std::int64_t pad_inner, offset_elements;
};

constexpr PackedLayout kPackedLayouts[] = {{0, 0}, {0, 1}, {3, 0}, {5, 1}};

class AttentionCudaPackedQkv : public CudaTest<::testing::TestWithParam<Precision>> {};

TEST_P(AttentionCudaPackedQkv, MatchesFloat64) {
  for (const AttentionCase& k : {AttentionCase{2, 4, 4, 70, 64, kPerSeq, {}},
                                 AttentionCase{2, 8, 2, 65, 128, kAll, {3}},
                                 AttentionCase{3, 6, 1, 40, 40, kPerSeq, {0, 39, 12}}}) {
    const AttentionCase c = with_precision(k, GetParam());
    for (const PackedLayout& l : kPackedLayouts) {
      SCOPED_TRACE(attention_case_name(c) + ", rows padded by " + std::to_string(l.pad_inner) +
                   ", offset by " + std::to_string(l.offset_elements));
      const AttentionInputs in = make_attention_inputs(c, rng_);
      const AttentionTensors t =
          upload_packed_attention(in, c, kCuda, l.pad_inner, l.offset_elements);
      run_attention(t, c);
      expect_device_ok();
      expect_only_view_written(t.out, "out");
      expect_only_view_written(t.lse, "lse");
      expect_attention_cuda_close(download_attention(t, c), attention_float64(in, c), in.n_padd,
                                  c);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, AttentionCudaPackedQkv, ::testing::ValuesIn(kPrecisions),
                         [](const auto& info) { return precision_name(info.param); });

// ------------------------------------------------------------------------------------ softmax

class AttentionCudaSoftmax : public CudaTest<::testing::TestWithParam<Precision>> {};

TEST_P(AttentionCudaSoftmax, SharpAndFlat) {
  // Scores of size 32 (a softmax close to one-hot: the running max must be subtracted before any
  // exp; in float16 a stale one overflows p), of size 128 (there in every dtype), and of size
  // 0.01 (nearly uniform weights).
  AttentionCase sharp{2, 2, 1, 150, 64, kPerSeq, {3, 40}};
  sharp.scale = 1.0;
  sharp.q_stddev = 4.0;
  AttentionCase sharper{1, 3, 1, 300, 64, kAll, {1}};
  sharper.scale = 1.0;
  sharper.q_stddev = 16.0;
  AttentionCase flat{2, 2, 2, 150, 64, kAll, {9}};
  flat.scale = 0.01;
  AttentionCase large_scale{1, 2, 2, 130, 128, kPerSeq, {0}};
  large_scale.scale = 2.0;
  for (const AttentionCase& k : {sharp, sharper, flat, large_scale}) {
    const AttentionCase c = with_precision(k, GetParam());
    SCOPED_TRACE(attention_case_name(c));
    check_cuda(c, rng_);
  }
}

TEST_P(AttentionCudaSoftmax, ScoresRiseAcrossEveryBlockOfKeys) {
  // q = (1, 0, ..., 0) and k[j] = (j / 4, ...) (rounded to the dtype) with scale 1: every
  // query's score of key j is k[j][0] exactly, in any precision, so each block of 64 keys raises
  // the row max by about 16 and the last keys carry the softmax. A max that is not carried from
  // block to block overflows exp (float32 past e^88 by the 6th block; float16 p past 65504 at
  // once).
  AttentionCase ramp{2, 2, 1, 1000, 128, kPerSeq, {0, 100}};
  ramp.scale = 1.0;
  const AttentionCase c = with_precision(ramp, GetParam());
  AttentionInputs in = make_attention_inputs(c, rng_);
  for (std::int64_t b = 0; b < c.b; ++b) {
    for (std::int64_t i = in.n_padd[b]; i < c.t; ++i) {
      for (std::int64_t h = 0; h < c.hq; ++h) {
        for (std::int64_t e = 0; e < c.d; ++e) in.q.at({b, h, i, e}) = e == 0 ? 1.0 : 0.0;
      }
      for (std::int64_t g = 0; g < c.hkv; ++g) in.k.at({b, g, i, 0}) = static_cast<double>(i) / 4;
    }
  }
  fusekit::testing::round_to(in.k, c.dtype);
  const CausalAttentionResult expected = attention_float64(in, c);
  expect_attention_cuda_close(run_cuda(in, c), expected, in.n_padd, c);
}

INSTANTIATE_TEST_SUITE_P(All, AttentionCudaSoftmax, ::testing::ValuesIn(kPrecisions),
                         [](const auto& info) { return precision_name(info.param); });

// ------------------------------------------------------------------------------------ first call

class AttentionCudaMisc : public CudaTest<> {};

TEST_F(AttentionCudaMisc, CapturedBeforeAnyDirectCallOfItsShape) {
  // A shape and dtype no other test of this suite uses (D = 200 in float16), captured before it
  // ever ran: whatever the call sets up on its first run (device attributes, kernel attributes
  // such as the shared-memory size) must work under capture too. The suite's first test, so run
  // on its own or with the suite it is also the operator's first call in the process.
  const AttentionCase c{1, 5, 1, 77, 200, kAll, {9}, DType::Float16};
  const AttentionInputs in = make_attention_inputs(c, rng_);
  const AttentionTensors direct = upload_attention(in, c, kCuda);
  const AttentionTensors t = upload_attention(in, c, kCuda);
  OwnStream s;
  expect_device_ok();  // the uploads and the poison (legacy stream) are done: s does not wait
  CapturedGraph graph;
  ASSERT_NO_FATAL_FAILURE(graph.capture(s.get(), [&] { run_attention(t, c, s.stream()); }));
  ASSERT_NO_FATAL_FAILURE(graph.replay());
  run_attention(direct, c);
  expect_device_ok();
  expect_only_view_written(t.out, "out of the replay");
  expect_only_view_written(t.lse, "lse of the replay");
  expect_same_outputs(t, direct, "of the replay against a direct call made after it");
  expect_attention_cuda_close(download_attention(t, c), attention_float64(in, c), in.n_padd, c);
}

// ------------------------------------------------------------------------------------ padding

TEST_F(AttentionCudaMisc, PaddingCountsOutsideAreClamped) {
  // On CUDA the counts are not read back to the host: one below 0 reads as 0 and one above T as
  // T, so the result is that of the clamped counts (read 2 int32 apart).
  constexpr std::int32_t kMin = std::numeric_limits<std::int32_t>::min();
  constexpr std::int32_t kMax = std::numeric_limits<std::int32_t>::max();
  const std::vector<std::int64_t> counts = {-3, 38, kMin, kMax, 0, 33, -1, 34};
  const std::vector<std::int64_t> clamped = {0, 33, 0, 33, 0, 33, 0, 33};
  for (const Precision& p : {kPrecisions[0], kPrecisions[2]}) {
    const AttentionCase c = with_precision({8, 2, 1, 33, 64, kPerSeq, clamped}, p);
    SCOPED_TRACE(attention_case_name(c));
    const AttentionInputs in = make_attention_inputs(c, rng_);
    AttentionTensors t = upload_attention(in, c, kCuda);
    t.counts = upload_padding_counts(counts, kCuda, 2);
    run_attention(t, c);
    expect_device_ok();
    expect_only_view_written(t.out, "out");
    expect_only_view_written(t.lse, "lse");
    expect_attention_cuda_close(download_attention(t, c), attention_float64(in, c), clamped, c);
  }
}

TEST_F(AttentionCudaMisc, ManySequencesAndHeads) {
  // More than 65535 (sequence, head) pairs, the limit of a grid's y and z dims: 70001 short
  // sequences of one head, and 3 sequences of 24000 query heads over 8000 key/value heads.
  for (const AttentionCase& k : {AttentionCase{70001, 1, 1, 3, 16, kPerSeq, {}},
                                 AttentionCase{3, 24000, 8000, 2, 8, kPerSeq, {}}}) {
    for (const Precision& p : {kPrecisions[0], kPrecisions[2]}) {
      const AttentionCase c = with_precision(k, p);
      SCOPED_TRACE(attention_case_name(c));
      check_cuda(c, rng_);
    }
  }
}

// ------------------------------------------------------------------------------------ options

TEST_F(AttentionCudaMisc, DefaultScaleIsOneOverSqrtD) {
  const AttentionCase c{2, 2, 1, 70, 80, kPerSeq, {0, 7}, DType::BFloat16};
  const AttentionInputs in = make_attention_inputs(c, rng_);
  AttentionCase explicit_scale = c;
  explicit_scale.scale = 1.0 / std::sqrt(80.0);
  AttentionCase other = c;
  other.scale = 0.5;
  const AttentionTensors a = upload_attention(in, c, kCuda);
  const AttentionTensors b = upload_attention(in, explicit_scale, kCuda);
  const AttentionTensors d = upload_attention(in, other, kCuda);
  run_attention(a, c);
  run_attention(b, explicit_scale);
  run_attention(d, other);
  expect_device_ok();
  expect_same_outputs(b, a, "with the scale 1 / sqrt(D) given against the default");
  expect_attention_cuda_close(download_attention(d, other), attention_float64(in, other),
                              in.n_padd, other);
}

TEST_F(AttentionCudaMisc, LseIsOptional) {
  // Without lse, out holds the bytes it holds with lse; lse's absence is no reason to compute
  // differently.
  for (const Precision& p : kPrecisions) {
    const AttentionCase c = with_precision({2, 4, 2, 130, 64, kPerSeq, {5, 60}}, p);
    SCOPED_TRACE(attention_case_name(c));
    const AttentionInputs in = make_attention_inputs(c, rng_);
    const AttentionTensors with_lse = upload_attention(in, c, kCuda);
    const AttentionTensors without = upload_attention(in, c, kCuda, {}, false);
    run_attention(with_lse, c);
    run_attention(without, c);
    expect_device_ok();
    expect_same_bytes(without.out, with_lse.out, "out without lse against out with it");
    expect_attention_cuda_close(download_attention(without, c), attention_float64(in, c),
                                in.n_padd, c);
  }
}

TEST_F(AttentionCudaMisc, Tf32ChangesNothingInHalfPrecision) {
  for (DType dtype : {DType::BFloat16, DType::Float16}) {
    const AttentionCase c{2, 4, 2, 100, 64, kPerSeq, {3, 50}, dtype};
    AttentionCase tf32 = c;
    tf32.allow_tf32 = true;
    SCOPED_TRACE(attention_case_name(c));
    const AttentionInputs in = make_attention_inputs(c, rng_);
    const AttentionTensors a = upload_attention(in, c, kCuda);
    const AttentionTensors b = upload_attention(in, tf32, kCuda);
    run_attention(a, c);
    run_attention(b, tf32);
    expect_device_ok();
    expect_same_outputs(b, a, "with allow_tf32 against without");
  }
}

// ------------------------------------------------------------------------------------ the rest

TEST_F(AttentionCudaMisc, EmptyInputsWriteNothing) {
  // B = 0 or T = 0: out and lse (allocations of poison, or views of none) stay as they were, and
  // a captured call enqueues no work at all.
  AttentionCase single{1, 1, 1, 0, 16};
  single.single_head = true;
  for (const AttentionCase& c : {AttentionCase{0, 4, 2, 9, 16, kPerSeq, {}},
                                 AttentionCase{2, 4, 2, 0, 16, kPerSeq, {0, 0}},
                                 AttentionCase{3, 2, 2, 0, 64, kAll, {}, DType::BFloat16},
                                 single}) {
    SCOPED_TRACE(attention_case_name(c));
    const AttentionInputs in = make_attention_inputs(c, rng_);
    const AttentionTensors t =
        upload_attention(in, c, kCuda, {.out = {{}, 0, 2}, .lse = {{}, 0, 1}});
    EXPECT_NO_THROW(run_attention(t, c));
    expect_device_ok();
    expect_untouched(t.out, "out");
    expect_untouched(t.lse, "lse");

    OwnStream s;
    CapturedGraph graph;
    ASSERT_NO_FATAL_FAILURE(graph.capture(s.get(), [&] { run_attention(t, c, s.stream()); }));
    GraphNodeCounts nodes;
    ASSERT_NO_FATAL_FAILURE(graph.count_nodes(nodes));
    EXPECT_EQ(nodes.total, 0) << "an empty call enqueued work";
  }
}

TEST_F(AttentionCudaMisc, BitwiseDeterministic) {
  for (const Precision& p : kPrecisions) {
    for (const AttentionCase& k : {AttentionCase{2, 4, 2, 300, 64, kPerSeq, {}},
                                   AttentionCase{1, 6, 1, 1000, 128, kAll, {37}}}) {
      const AttentionCase c = with_precision(k, p);
      SCOPED_TRACE(attention_case_name(c));
      const AttentionInputs in = make_attention_inputs(c, rng_);
      const AttentionTensors a = upload_attention(in, c, kCuda, layouts_named("padded"));
      const AttentionTensors b = upload_attention(in, c, kCuda, layouts_named("padded"));
      run_attention(a, c);
      run_attention(b, c);
      run_attention(b, c);
      expect_device_ok();
      expect_same_outputs(b, a, "of a second and third run against the first");
      // two runs that wrote nothing would agree too
      expect_matches_cpu(download_attention(a, c), in, c);
    }
  }
}

TEST_F(AttentionCudaMisc, RunsOnTheGivenStream) {
  const AttentionCase c{3, 4, 2, 257, 64, kPerSeq, {}, DType::BFloat16};
  const AttentionInputs in = make_attention_inputs(c, rng_);
  const AttentionTensors on_default = upload_attention(in, c, kCuda);
  const AttentionTensors on_stream = upload_attention(in, c, kCuda);
  run_attention(on_default, c);
  OwnStream s;
  expect_device_ok();  // the uploads and the poison (legacy stream) are done: s does not wait
  run_attention(on_stream, c, s.stream());
  ASSERT_CUDA(cudaStreamSynchronize(s.get()));
  expect_device_ok();
  expect_only_view_written(on_stream.out, "out");
  expect_only_view_written(on_stream.lse, "lse");
  expect_attention_cuda_close(download_attention(on_stream, c), attention_float64(in, c),
                              in.n_padd, c);
  expect_same_outputs(on_stream, on_default, "on its own stream against the default");
}

// Tensors on the second device while the first is current: a stream of the first is rejected
// before anything runs, one of the second runs the warpgroup kernel there.
TEST_F(AttentionCudaMisc, SecondDeviceAndItsStream) {
  SKIP_WITHOUT_TWO_DEVICES();
  const AttentionCase c{2, 4, 2, 129, 64, kPerSeq, {}, DType::BFloat16};
  const AttentionInputs in = make_attention_inputs(c, rng_);
  const AttentionTensors t = upload_attention(in, c, Device::cuda(1));
  ASSERT_NO_FATAL_FAILURE(run_on_the_second_device(
      "causal_attention", {&t.out}, [&](fusekit::Stream s) { run_attention(t, c, s); }));
  expect_only_view_written(t.out, "out");
  expect_attention_cuda_close(download_attention(t, c), attention_float64(in, c), in.n_padd, c);
}

TEST_F(AttentionCudaMisc, MixedDevicesAreRejected) {
  const AttentionCase c{2, 2, 1, 5, 8, kPerSeq, {1, 2}};
  const AttentionInputs in = make_attention_inputs(c, rng_);
  const AttentionTensors gpu = upload_attention(in, c, kCuda);
  const AttentionTensors cpu = upload_attention(in, c, kCpu);
  auto call = [&](const TensorView& k, const LeftPadding& padding) {
    fusekit::causal_attention(gpu.out.view, gpu.lse.view, gpu.q.view, k, gpu.v.view, padding);
  };
  EXPECT_ERROR_CONTAINS("causal_attention: k is on cpu but q is on cuda:0; expected one device",
                        [&] { call(cpu.k.view, gpu.padding()); });
  EXPECT_ERROR_CONTAINS("causal_attention: padding.per_sequence is on cpu but q is on cuda:0",
                        [&] { call(gpu.k.view, cpu.padding()); });
  expect_device_ok();
  expect_untouched(gpu.out, "out");  // nothing was launched
  expect_untouched(gpu.lse, "lse");
}

// ------------------------------------------------------------------------------------ graphs

class AttentionCudaGraph : public CudaTest<::testing::TestWithParam<Precision>> {};

TEST_P(AttentionCudaGraph, CapturedCallReplaysBitwiseAsADirectCall) {
  // Replays write what a direct call writes, and read the per-sequence counts where they lie at
  // the time of the replay: counts changed between replays change the result.
  const AttentionCase c = with_precision({3, 4, 2, 200, 64, kPerSeq, {0, 17, 150}}, GetParam());
  const AttentionInputs in = make_attention_inputs(c, rng_);
  const AttentionTensors direct = upload_attention(in, c, kCuda);
  AttentionTensors t = upload_attention(in, c, kCuda);
  run_attention(direct, c);
  expect_device_ok();
  expect_only_view_written(direct.out, "out of the direct call");

  OwnStream s;
  expect_device_ok();  // the uploads and the poison (legacy stream) are done: s does not wait
  CapturedGraph graph;
  ASSERT_NO_FATAL_FAILURE(graph.capture(s.get(), [&] { run_attention(t, c, s.stream()); }));
  expect_untouched(t.out, "out after the capture (nothing runs while capturing)");

  GraphNodeCounts nodes;
  ASSERT_NO_FATAL_FAILURE(graph.count_nodes(nodes));
  EXPECT_GT(nodes.kernels, 0) << "no kernel was captured";
  EXPECT_EQ(nodes.allocs, nodes.frees) << "every workspace taken in the graph is given back in it";

  for (int i = 0; i < 2; ++i) {
    SCOPED_TRACE("replay " + std::to_string(i));
    ASSERT_NO_FATAL_FAILURE(graph.replay({&t.out, &t.lse}));
    expect_same_outputs(t, direct, "of the replay against the direct call");
  }
  expect_attention_cuda_close(download_attention(t, c), attention_float64(in, c), in.n_padd, c);

  // Larger counts only: rows that were padding hold NaN and must stay padding.
  AttentionInputs repadded = in;
  repadded.n_padd = {5, 200, 151};
  const std::vector<std::int32_t> counts = {5, 200, 151};
  t.counts.buffer.copy_from_host(counts.data(), counts.size() * sizeof(std::int32_t));
  {
    SCOPED_TRACE("replay with other counts");
    ASSERT_NO_FATAL_FAILURE(graph.replay({&t.out, &t.lse}));
    expect_only_view_written(t.out, "out");
    expect_only_view_written(t.lse, "lse");
    expect_attention_cuda_close(download_attention(t, c), attention_float64(repadded, c),
                                repadded.n_padd, c);
  }
}

INSTANTIATE_TEST_SUITE_P(All, AttentionCudaGraph, ::testing::ValuesIn(kPrecisions),
                         [](const auto& info) { return precision_name(info.param); });

}  // namespace
