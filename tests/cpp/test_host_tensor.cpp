// The test support itself: every other test trusts its rounding, layouts and comparison.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "test_support.h"

namespace {

using namespace fusekit_test;
using fusekit::testing::compare;
using fusekit::testing::download;
using fusekit::testing::empty_poisoned;
using fusekit::testing::round_to;
using fusekit::testing::upload;

double rounded(double v, DType dtype) {
  HostTensor t({1}, v);
  round_to(t, dtype);
  return t.values[0];
}

TEST(RoundTo, BFloat16RoundsToNearestEven) {
  EXPECT_EQ(rounded(1.0, DType::BFloat16), 1.0);
  EXPECT_EQ(rounded(1.0 + 0x1p-8, DType::BFloat16), 1.0);  // halfway: to even
  EXPECT_EQ(rounded(1.0 + 3 * 0x1p-8, DType::BFloat16), 1.0 + 0x1p-6);  // halfway: to even
  EXPECT_EQ(rounded(1.0 + 0x1p-8 + 0x1p-20, DType::BFloat16), 1.0 + 0x1p-7);
  EXPECT_EQ(rounded(-3.0, DType::BFloat16), -3.0);
  EXPECT_TRUE(std::isnan(rounded(std::nan(""), DType::BFloat16)));
  EXPECT_EQ(rounded(1e39, DType::BFloat16), INFINITY);  // beyond float32 already
}

TEST(RoundTo, Float16RoundsToNearestEven) {
  EXPECT_EQ(rounded(1.0 + 0x1p-11, DType::Float16), 1.0);
  EXPECT_EQ(rounded(1.0 + 3 * 0x1p-11, DType::Float16), 1.0 + 0x1p-9);
  EXPECT_EQ(rounded(65504.0, DType::Float16), 65504.0);
  EXPECT_EQ(rounded(65519.0, DType::Float16), 65504.0);
  EXPECT_EQ(rounded(65520.0, DType::Float16), INFINITY);
  EXPECT_EQ(rounded(-65520.0, DType::Float16), -INFINITY);
  // Subnormals: the smallest is 2^-24; halfway cases go to even.
  EXPECT_EQ(rounded(0x1p-24, DType::Float16), 0x1p-24);
  EXPECT_EQ(rounded(0x1p-25, DType::Float16), 0.0);
  EXPECT_EQ(rounded(1.5 * 0x1p-24, DType::Float16), 0x1p-23);
  EXPECT_EQ(rounded(0x1p-14 - 0x1p-24, DType::Float16), 0x1p-14 - 0x1p-24);
  EXPECT_TRUE(std::isnan(rounded(std::nan(""), DType::Float16)));
}

TEST(RoundTo, Float32) {
  EXPECT_EQ(rounded(1.0 + 0x1p-24, DType::Float32), 1.0);
  EXPECT_EQ(rounded(1.0 + 0x1p-23, DType::Float32), 1.0 + 0x1p-23);
  EXPECT_EQ(rounded(0.1, DType::Float32), static_cast<double>(0.1f));
}

class UploadDownload : public Seeded<::testing::TestWithParam<DType>> {};

TEST_P(UploadDownload, RoundTripsInEveryLayout) {
  const DType dtype = GetParam();
  HostTensor t = fusekit::testing::random_normal({3, 4, 5}, rng_);
  round_to(t, dtype);
  const Layout layouts[] = {{}, {{1, 0, 2}, 0, 0}, {{2, 1, 0}, 3, 1}, {{}, 7, 5}};
  for (const Layout& layout : layouts) {
    const DeviceTensor d = upload(t, dtype, Device::cpu(), layout);
    EXPECT_EQ(d.view.dtype, dtype);
    expect_close(download(d.view), t, {0, 0, 0}, "round trip");
    // Padding and the offset hold NaN, never zero, so that a read of them poisons a result.
    expect_only_view_written(d, "upload");
  }
}

TEST_P(UploadDownload, EmptyPoisonedIsNaNEverywhere) {
  const DType dtype = GetParam();
  const DeviceTensor d = empty_poisoned({2, 3}, dtype, Device::cpu(), {{}, 2, 1});
  const HostTensor got = download(d.view);
  for (double v : got.values) EXPECT_TRUE(std::isnan(v));
  for (unsigned char b : raw_bytes(d)) ASSERT_EQ(b, 0xff);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, UploadDownload,
                         ::testing::Values(DType::Float32, DType::BFloat16, DType::Float16,
                                           DType::Float64),
                         [](const auto& info) { return dtype_name(info.param); });

TEST(Compare, AcceptsWithinTolerance) {
  HostTensor a({2, 2}, 1.0), b({2, 2}, 1.0);
  a.values[3] = 1.0 + 1e-7;
  const auto c = compare(a, b, {1e-6, 0, 1e-6});
  EXPECT_TRUE(c.ok) << c.message;
  EXPECT_EQ(c.mismatches, 0);
}

TEST(Compare, ReportsTheWorstElement) {
  HostTensor a({2, 3}, 1.0), b({2, 3}, 1.0);
  a.at({1, 2}) = 1.5;
  a.at({0, 1}) = 1.1;
  const auto c = compare(a, b, {1e-3, 0, 1});
  EXPECT_FALSE(c.ok);
  EXPECT_EQ(c.mismatches, 2);
  EXPECT_DOUBLE_EQ(c.max_abs_error, 0.5);
  EXPECT_PRED_FORMAT2(::testing::IsSubstring, "[1, 2]: got 1.5, expected 1", c.worst);
  EXPECT_PRED_FORMAT2(::testing::IsSubstring, "2 of 6 elements", c.message);
}

TEST(Compare, NaNIsAMismatch) {
  HostTensor a({3}, 1.0), b({3}, 1.0);
  a.values[1] = std::nan("");
  const auto c = compare(a, b, {1e9, 1e9, 1e9});
  EXPECT_FALSE(c.ok);
  EXPECT_EQ(c.nan_mismatches, 1);
  EXPECT_PRED_FORMAT2(::testing::IsSubstring, "[1]: got nan", c.worst);
}

TEST(Compare, RelativeErrorInNorm) {
  HostTensor a({4}, 1.0), b({4}, 1.0);
  a.values[0] = 1.0 + 1e-3;  // rel error 1e-3 / 2
  EXPECT_TRUE(compare(a, b, {1, 1, 1e-3}).ok);
  EXPECT_FALSE(compare(a, b, {1, 1, 1e-4}).ok);
}

TEST(Compare, ShapeMismatch) {
  const auto c = compare(HostTensor({2, 3}), HostTensor({3, 2}), {1, 1, 1});
  EXPECT_FALSE(c.ok);
  EXPECT_EQ(c.message, "shape [2, 3] != expected [3, 2]");
}

}  // namespace
