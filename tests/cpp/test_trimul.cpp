// trimul on the CPU backend: against the float64 reference for both directions, normal and Cauchy
// inputs, every mask dtype, every x dtype with float32 weights and weights in x's dtype, awkward
// sizes and layouts, broadcast inputs, empty inputs, determinism, and every validation error.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "trimul_support.h"

namespace {

using namespace fusekit_test;
using fusekit::testing::empty_poisoned;
using fusekit::testing::upload;

constexpr Device kCpu = Device::cpu();
constexpr DType kDtypes[] = {DType::Float32, DType::BFloat16, DType::Float16};
constexpr auto kIncoming = TrimulDirection::Incoming;
constexpr auto kOutgoing = TrimulDirection::Outgoing;

void expect_matches_float64(const HostTensor& got, const TrimulInputs& in, const TrimulCase& c,
                            const std::string& what = "out") {
  const HostTensor expected = trimul_float64(in, c);
  expect_close(got, expected, trimul_cpu_tolerance(c, expected), what);
}

void check_cpu(const TrimulCase& c, std::mt19937_64& rng, const TrimulLayouts& layouts = {}) {
  const TrimulInputs in = make_trimul_inputs(c, rng);
  expect_matches_float64(run_trimul_checked(in, c, kCpu, layouts), in, c);
}

// ------------------------------------------------------------------------------------ shapes

// Both directions, batch 1 and 2, N of 1, 7, 33 and 48 (where a product of several CPU blocks of
// rows), C of 1, 40 and 128, H of 1, 24 and 128, normal and Cauchy inputs, with and without masks.
const TrimulCase kCases[] = {
    {1, 1, 1, 1},
    {1, 1, 8, 4, kIncoming, TrimulMask::Random},
    {1, 7, 40, 24},
    {2, 7, 40, 24, kIncoming},
    {1, 7, 1, 24, kOutgoing, TrimulMask::Random},
    {2, 7, 40, 1, kIncoming, TrimulMask::Random},
    {1, 33, 40, 24, kOutgoing, TrimulMask::Random},
    {2, 33, 40, 24, kIncoming, TrimulMask::Random, TrimulDist::Cauchy},
    {2, 33, 40, 24, kOutgoing, TrimulMask::None, TrimulDist::Cauchy},
    {1, 33, 1, 1, kIncoming, TrimulMask::Fractional},
    {1, 16, 128, 128, kOutgoing, TrimulMask::Random},
    {1, 16, 128, 128, kIncoming, TrimulMask::None, TrimulDist::Cauchy},
    {2, 48, 64, 32, kOutgoing, TrimulMask::Fractional, TrimulDist::Cauchy},
    {1, 48, 128, 16, kIncoming, TrimulMask::Random},
};

class TrimulCpu : public Seeded<::testing::TestWithParam<std::tuple<DType, TrimulCase>>> {};

TEST_P(TrimulCpu, MatchesFloat64) {
  const auto [dtype, c] = GetParam();
  check_cpu(with_dtype(c, dtype), rng_);
}

INSTANTIATE_TEST_SUITE_P(
    All, TrimulCpu, ::testing::Combine(::testing::ValuesIn(kDtypes), ::testing::ValuesIn(kCases)),
    [](const auto& info) {
      return trimul_case_name(with_dtype(std::get<1>(info.param), std::get<0>(info.param)));
    });

// Weights stored in x's dtype (float32 weights with float16 and bfloat16 x are above).
class TrimulCpuWeightsInXDtype : public Seeded<::testing::TestWithParam<DType>> {};

TEST_P(TrimulCpuWeightsInXDtype, MatchesFloat64) {
  for (const TrimulCase& c : {TrimulCase{2, 7, 40, 24, kIncoming, TrimulMask::Random},
                              TrimulCase{1, 33, 40, 24, kOutgoing, TrimulMask::None,
                                         TrimulDist::Cauchy}}) {
    SCOPED_TRACE(trimul_case_name(with_dtype(c, GetParam(), true)));
    check_cpu(with_dtype(c, GetParam(), true), rng_);
  }
}

INSTANTIATE_TEST_SUITE_P(All, TrimulCpuWeightsInXDtype,
                         ::testing::Values(DType::BFloat16, DType::Float16),
                         [](const auto& info) { return dtype_name(info.param); });

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

class TrimulCpuMasks
    : public Seeded<::testing::TestWithParam<std::tuple<MaskCase, TrimulDirection, int>>> {};

TrimulCase mask_case(const MaskCase& m, TrimulDirection direction) {
  TrimulCase c{2, 9, 24, 16, direction, m.mask};
  c.mask_dtype = m.dtype;
  return c;
}

TEST_P(TrimulCpuMasks, MatchesFloat64) {
  const auto [m, direction, layout] = GetParam();
  check_cpu(mask_case(m, direction), rng_, kTrimulLayouts[layout].layouts);
}

// Each mask dtype contiguous, padded, transposed and misaligned.
INSTANTIATE_TEST_SUITE_P(All, TrimulCpuMasks,
                         ::testing::Combine(::testing::ValuesIn(kMasks),
                                            ::testing::Values(kOutgoing, kIncoming),
                                            ::testing::Values(0, 1, 3, 4)),
                         [](const auto& info) {
                           return trimul_case_name(mask_case(std::get<0>(info.param),
                                                             std::get<1>(info.param))) +
                                  "_" + kTrimulLayouts[std::get<2>(info.param)].name;
                         });

// ------------------------------------------------------------------------------------ layouts

class TrimulCpuLayouts
    : public Seeded<::testing::TestWithParam<std::tuple<DType, TrimulLayoutCase>>> {};

TEST_P(TrimulCpuLayouts, MatchesFloat64) {
  const auto [dtype, l] = GetParam();
  check_cpu({2, 11, 37, 20, kIncoming, TrimulMask::Random, TrimulDist::Normal, dtype}, rng_,
            l.layouts);
  check_cpu({1, 6, 20, 9, kOutgoing, TrimulMask::Bool, TrimulDist::Normal, dtype, dtype}, rng_,
            l.layouts);
}

INSTANTIATE_TEST_SUITE_P(All, TrimulCpuLayouts,
                         ::testing::Combine(::testing::ValuesIn(kDtypes),
                                            ::testing::ValuesIn(kTrimulLayouts)),
                         [](const auto& info) {
                           return dtype_name(std::get<0>(info.param)) + "_" +
                                  std::get<1>(info.param).name;
                         });

// ------------------------------------------------------------------------------------ the rest

class TrimulCpuMisc : public Seeded<> {};

TEST_F(TrimulCpuMisc, EmptyInputsWriteNothing) {
  // B = 0 or N = 0: nothing to compute; out (an allocation of poison, or a view of none) stays.
  for (const TrimulCase& c : {TrimulCase{0, 5, 8, 4, kOutgoing, TrimulMask::Random},
                              TrimulCase{2, 0, 8, 4, kIncoming, TrimulMask::Bool}}) {
    const TrimulInputs in = make_trimul_inputs(c, rng_);
    const TrimulTensors t = upload_trimul(in, c, kCpu, {.out = {{}, 0, 2}});
    EXPECT_NO_THROW(run_trimul(t, c));
    expect_only_view_written(t.out, "out");
  }
}

TEST_F(TrimulCpuMisc, EpsIsUsed) {
  // eps 0.5 against p of unit size: a result far from that of eps 1e-5
  TrimulCase c{1, 5, 16, 8, kIncoming, TrimulMask::Random};
  c.eps = 0.5;
  check_cpu(c, rng_);
  const TrimulInputs in = make_trimul_inputs(c, rng_);
  const HostTensor got = run_trimul_checked(in, c, kCpu);
  TrimulCase default_eps = c;
  default_eps.eps = 1e-5;
  const HostTensor other = trimul_float64(in, default_eps);
  const Comparison far =
      fusekit::testing::compare(got, other, trimul_cpu_tolerance(default_eps, other));
  EXPECT_FALSE(far.ok) << "eps 0.5 gave the result of eps 1e-5: " << far.message;
}

TEST_F(TrimulCpuMisc, DirectionsDiffer) {
  // The same inputs, outgoing and incoming: the reference tells them apart, and so must the
  // backend (a backend that ignored the direction would fail one of the two comparisons).
  const TrimulCase out_case{1, 6, 12, 8, kOutgoing, TrimulMask::Random};
  TrimulCase in_case = out_case;
  in_case.direction = kIncoming;
  const TrimulInputs in = make_trimul_inputs(out_case, rng_);
  const HostTensor outgoing = run_trimul_checked(in, out_case, kCpu);
  const HostTensor incoming = run_trimul_checked(in, in_case, kCpu);
  expect_matches_float64(outgoing, in, out_case, "outgoing");
  expect_matches_float64(incoming, in, in_case, "incoming");
  EXPECT_FALSE(
      fusekit::testing::compare(outgoing, incoming, trimul_cpu_tolerance(in_case, incoming)).ok);
}

TEST_F(TrimulCpuMisc, MaskedOutRowsGiveTheBias) {
  // A mask of zeros: left and right are 0, so p is 0, LayerNorm_H(p) = to_out_norm_bias, and
  // out = (to_out_norm_bias * gate) @ to_out^T, whatever the direction.
  TrimulCase c{1, 4, 10, 6, kOutgoing, TrimulMask::Bool};
  TrimulInputs in = make_trimul_inputs(c, rng_);
  std::fill(in.mask.values.begin(), in.mask.values.end(), 0.0);
  expect_matches_float64(run_trimul_checked(in, c, kCpu), in, c, "all masked");
}

TEST_F(TrimulCpuMisc, BroadcastInputs) {
  const TrimulCase c{2, 7, 24, 12, kIncoming, TrimulMask::Fractional};
  const BroadcastTrimul s = upload_broadcast_trimul(c, rng_, kCpu);
  run_trimul(s.t, c);
  expect_matches_float64(download_trimul(s.t), s.in, c);
}

TEST_F(TrimulCpuMisc, BitwiseDeterministic) {
  const TrimulCase c{2, 20, 48, 32, kIncoming, TrimulMask::Random, TrimulDist::Normal,
                     DType::BFloat16};
  const TrimulInputs in = make_trimul_inputs(c, rng_);
  const TrimulTensors a = upload_trimul(in, c, kCpu);
  const TrimulTensors b = upload_trimul(in, c, kCpu);
  run_trimul(a, c);
  run_trimul(b, c);
  EXPECT_EQ(raw_bytes(a.out), raw_bytes(b.out));
}

// ------------------------------------------------------------------------------------ errors

class TrimulErrors : public Seeded<> {
 protected:
  TrimulCase c_{2, 4, 6, 3, kOutgoing, TrimulMask::Random, TrimulDist::Normal, DType::Float16};
  TrimulInputs in_ = make_trimul_inputs(c_, rng_);
  TrimulTensors t_ = upload_trimul(in_, c_, kCpu);

  void call(const TensorView& out, const TensorView& x, const TensorView& mask,
            const fusekit::TrimulWeights& w, TrimulOptions options = {}) {
    fusekit::trimul(out, x, mask, w, options);
  }
  void call_with_weights(const fusekit::TrimulWeights& w) {
    call(t_.out.view, t_.x.view, t_.mask.view, w);
  }
  DeviceTensor tensor(std::vector<std::int64_t> shape, DType dtype, Layout layout = {}) {
    return empty_poisoned(shape, dtype, kCpu, layout);
  }
};

// Each weight by name, for the checks that go through all ten.
struct WeightSlot {
  const char* name;
  TensorView fusekit::TrimulWeights::*member;
};
const WeightSlot kWeightSlots[] = {
    {"norm_weight", &fusekit::TrimulWeights::norm_weight},
    {"norm_bias", &fusekit::TrimulWeights::norm_bias},
    {"left_proj", &fusekit::TrimulWeights::left_proj},
    {"right_proj", &fusekit::TrimulWeights::right_proj},
    {"left_gate", &fusekit::TrimulWeights::left_gate},
    {"right_gate", &fusekit::TrimulWeights::right_gate},
    {"out_gate", &fusekit::TrimulWeights::out_gate},
    {"to_out_norm_weight", &fusekit::TrimulWeights::to_out_norm_weight},
    {"to_out_norm_bias", &fusekit::TrimulWeights::to_out_norm_bias},
    {"to_out", &fusekit::TrimulWeights::to_out},
};

TEST_F(TrimulErrors, TheValidCallRuns) {
  EXPECT_NO_THROW(call_with_weights(t_.weights.views()));
}

TEST_F(TrimulErrors, Shapes) {
  const auto& t = t_;
  const auto w = t.weights.views();
  const DeviceTensor x3 = tensor({2, 4, 6}, DType::Float16);
  EXPECT_ERROR_CONTAINS("trimul: x has 3 dims [2, 4, 6], expected 4 dims [B, N, N, C]",
                        [&] { call(t.out.view, x3.view, t.mask.view, w); });
  const DeviceTensor x_rect = tensor({2, 4, 5, 6}, DType::Float16);
  EXPECT_ERROR_CONTAINS("x [2, 4, 5, 6] is not square in its middle dims",
                        [&] { call(t.out.view, x_rect.view, t.mask.view, w); });
  const DeviceTensor x_c0 = tensor({2, 4, 4, 0}, DType::Float16);
  EXPECT_ERROR_CONTAINS("x [2, 4, 4, 0] has C = 0 channels",
                        [&] { call(t.out.view, x_c0.view, t.mask.view, w); });
  const DeviceTensor out_bad = tensor({2, 4, 4, 7}, DType::Float16);
  EXPECT_ERROR_CONTAINS("out has shape [2, 4, 4, 7], expected [B, N, N, C] = [2, 4, 4, 6]",
                        [&] { call(out_bad.view, t.x.view, t.mask.view, w); });
  const DeviceTensor mask_bad = tensor({2, 4, 3}, DType::Float32);
  EXPECT_ERROR_CONTAINS("mask has shape [2, 4, 3], expected [B, N, N] = [2, 4, 4]",
                        [&] { call(t.out.view, t.x.view, mask_bad.view, w); });
  const DeviceTensor mask_4d = tensor({2, 4, 4, 1}, DType::Float32);
  EXPECT_ERROR_CONTAINS("mask has shape [2, 4, 4, 1], expected [B, N, N]",
                        [&] { call(t.out.view, t.x.view, mask_4d.view, w); });
  // left_proj gives H; the other weights are checked against it and C
  const DeviceTensor proj_h0 = tensor({0, 6}, DType::Float32);
  fusekit::TrimulWeights h0 = w;
  h0.left_proj = proj_h0.view;
  EXPECT_ERROR_CONTAINS("weights.left_proj [0, 6] has H = 0 rows", [&] { call_with_weights(h0); });
  const DeviceTensor proj_1d = tensor({3}, DType::Float32);
  fusekit::TrimulWeights l1 = w;
  l1.left_proj = proj_1d.view;
  EXPECT_ERROR_CONTAINS("weights.left_proj has 1 dims [3], expected 2 dims [H, C]",
                        [&] { call_with_weights(l1); });
  const DeviceTensor vec = tensor({5}, DType::Float32), mat = tensor({3, 5}, DType::Float32),
                     to_out_bad = tensor({6, 4}, DType::Float32);
  for (const WeightSlot& s : kWeightSlots) {
    if (std::string(s.name) == "left_proj") continue;
    fusekit::TrimulWeights bad = w;
    const bool is_vector = (w.*s.member).ndim == 1;
    bad.*s.member = is_vector                         ? vec.view
                    : std::string(s.name) == "to_out" ? to_out_bad.view
                                                      : mat.view;
    const std::string expected =
        std::string(s.name) + " has shape " + (bad.*s.member).shape_string() + ", expected ";
    EXPECT_ERROR_CONTAINS(expected.c_str(), [&] { call_with_weights(bad); });
  }
}

TEST_F(TrimulErrors, Dtypes) {
  const auto& t = t_;
  const auto w = t.weights.views();
  const DeviceTensor x64 = tensor({2, 4, 4, 6}, DType::Float64);
  const DeviceTensor out64 = tensor({2, 4, 4, 6}, DType::Float64);
  EXPECT_ERROR_CONTAINS("trimul: x has dtype float64, expected bfloat16, float16 or float32",
                        [&] { call(out64.view, x64.view, t.mask.view, w); });
  const DeviceTensor out32 = tensor({2, 4, 4, 6}, DType::Float32);
  EXPECT_ERROR_CONTAINS("out has dtype float32 but x has float16; expected the same dtype",
                        [&] { call(out32.view, t.x.view, t.mask.view, w); });
  const DeviceTensor mask_i32 = tensor({2, 4, 4}, DType::Int32);
  EXPECT_ERROR_CONTAINS(
      "mask has dtype int32, expected float32, float16, bfloat16, bool or uint8",
      [&] { call(t.out.view, t.x.view, mask_i32.view, w); });
  // a weight in neither float32 nor x's dtype
  for (const WeightSlot& s : kWeightSlots) {
    const TensorView& good = w.*s.member;
    const DeviceTensor bf = tensor(std::vector<std::int64_t>(good.shape.begin(),
                                                             good.shape.begin() + good.ndim),
                                   DType::BFloat16);
    fusekit::TrimulWeights bad = w;
    bad.*s.member = bf.view;
    const std::string expected =
        std::string(s.name) + " has dtype bfloat16, expected float16 or float32";
    EXPECT_ERROR_CONTAINS(expected.c_str(), [&] { call_with_weights(bad); });
  }
  // float32 x: weights in float32 only
  const TrimulCase c32 = with_dtype(c_, DType::Float32, true);
  const TrimulTensors t32 = upload_trimul(make_trimul_inputs(c32, rng_), c32, kCpu);
  fusekit::TrimulWeights half_norm = t32.weights.views();
  const DeviceTensor norm16 = tensor({6}, DType::Float16);
  half_norm.norm_weight = norm16.view;
  EXPECT_ERROR_CONTAINS("norm_weight has dtype float16, expected float32", [&] {
    call(t32.out.view, t32.x.view, t32.mask.view, half_norm);
  });
}

TEST_F(TrimulErrors, MissingWeights) {
  for (const WeightSlot& s : kWeightSlots) {
    fusekit::TrimulWeights w = t_.weights.views();
    w.*s.member = TensorView();
    const std::string expected = std::string("weights.") + s.name + " is missing";
    EXPECT_ERROR_CONTAINS(expected.c_str(), [&] { call_with_weights(w); });
  }
  for (const WeightSlot& s : kWeightSlots) {
    fusekit::TrimulWeights w = t_.weights.views();
    (w.*s.member).data = nullptr;
    const std::string expected = std::string(s.name) + " (float32 ";
    EXPECT_ERROR_CONTAINS(expected.c_str(), [&] { call_with_weights(w); });
    EXPECT_ERROR_CONTAINS("has a null data pointer", [&] { call_with_weights(w); });
  }
  TensorView null_x = t_.x.view, null_mask = t_.mask.view;
  null_x.data = nullptr;
  null_mask.data = nullptr;
  EXPECT_ERROR_CONTAINS("x (float16 [2, 4, 4, 6] on cpu) has a null data pointer",
                        [&] { call(t_.out.view, null_x, t_.mask.view, t_.weights.views()); });
  EXPECT_ERROR_CONTAINS("mask (float32 [2, 4, 4] on cpu) has a null data pointer",
                        [&] { call(t_.out.view, t_.x.view, null_mask, t_.weights.views()); });
}

TEST_F(TrimulErrors, Devices) {
  const auto& t = t_;
  const auto w = t.weights.views();
  TensorView out_cuda = t.out.view, mask_cuda = t.mask.view;
  out_cuda.device = Device::cuda(0);
  mask_cuda.device = Device::cuda(0);
  EXPECT_ERROR_CONTAINS("out is on cuda:0 but x is on cpu; expected one device",
                        [&] { call(out_cuda, t.x.view, t.mask.view, w); });
  EXPECT_ERROR_CONTAINS("mask is on cuda:0 but x is on cpu; expected one device",
                        [&] { call(t.out.view, t.x.view, mask_cuda, w); });
  for (const WeightSlot& s : kWeightSlots) {
    fusekit::TrimulWeights bad = w;
    (bad.*s.member).device = Device::cuda(0);
    const std::string expected = std::string(s.name) + " is on cuda:0 but x is on cpu";
    EXPECT_ERROR_CONTAINS(expected.c_str(), [&] { call_with_weights(bad); });
  }
}

TEST_F(TrimulErrors, Overlap) {
  const auto& t = t_;
  const auto w = t.weights.views();
  TensorView out_on_x = t.x.view;  // x's own storage as the output
  EXPECT_ERROR_CONTAINS("trimul: out overlaps x in memory",
                        [&] { call(out_on_x, t.x.view, t.mask.view, w); });
  // every weight and the mask placed inside out's allocation
  const DeviceTensor big = tensor({2, 4, 4, 6}, DType::Float16);
  TensorView mask_in_out = TensorView(big.view.data, DType::Float16, {2, 4, 4});
  EXPECT_ERROR_CONTAINS("out overlaps mask in memory",
                        [&] { call(big.view, t.x.view, mask_in_out, w); });
  for (const WeightSlot& s : kWeightSlots) {
    fusekit::TrimulWeights bad = w;
    TensorView& v = bad.*s.member;
    v = TensorView::from_arrays(big.view.data, DType::Float16, v.ndim, v.shape.data(), nullptr,
                                kCpu);
    const std::string expected = std::string("out overlaps ") + s.name + " in memory";
    EXPECT_ERROR_CONTAINS(expected.c_str(), [&] { call(big.view, t.x.view, t.mask.view, bad); });
  }
}

TEST_F(TrimulErrors, Layouts) {
  const auto& t = t_;
  const auto w = t.weights.views();
  // C not the innermost axis
  const DeviceTensor x_c_outer = tensor({2, 4, 4, 6}, DType::Float16, {{3, 0, 1, 2}, 0, 0});
  EXPECT_ERROR_CONTAINS("x [2, 4, 4, 6] has strides (16, 4, 1, 32); expected a contiguous last "
                        "axis (stride 1 on C)",
                        [&] { call(t.out.view, x_c_outer.view, t.mask.view, w); });
  const DeviceTensor out_c_outer = tensor({2, 4, 4, 6}, DType::Float16, {{3, 0, 1, 2}, 0, 0});
  EXPECT_ERROR_CONTAINS("out [2, 4, 4, 6] has strides (16, 4, 1, 32); expected a contiguous last "
                        "axis",
                        [&] { call(out_c_outer.view, t.x.view, t.mask.view, w); });
  TensorView out_bcast = t.out.view;
  out_bcast.strides[1] = 0;
  EXPECT_ERROR_CONTAINS("output out has stride 0 in dim 1",
                        [&] { call(out_bcast, t.x.view, t.mask.view, w); });
  TensorView out_shared = t.out.view;  // rows i and j on top of each other
  out_shared.strides[2] = out_shared.strides[1];
  EXPECT_ERROR_CONTAINS("output out [2, 4, 4, 6] has strides that make elements share addresses",
                        [&] { call(out_shared, t.x.view, t.mask.view, w); });
}

TEST_F(TrimulErrors, Options) {
  const auto& t = t_;
  const auto w = t.weights.views();
  for (double eps : {-1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    TrimulOptions options;
    options.eps = eps;
    EXPECT_ERROR_CONTAINS("trimul: options.eps is ",
                          [&] { call(t.out.view, t.x.view, t.mask.view, w, options); });
    EXPECT_ERROR_CONTAINS(", expected a finite value >= 0",
                          [&] { call(t.out.view, t.x.view, t.mask.view, w, options); });
  }
  TrimulOptions options;
  options.direction = static_cast<TrimulDirection>(5);
  EXPECT_ERROR_CONTAINS("trimul: options.direction is 5, expected TrimulDirection::Outgoing or "
                        "TrimulDirection::Incoming",
                        [&] { call(t.out.view, t.x.view, t.mask.view, w, options); });
}

}  // namespace
