// TensorView, dtypes and devices: the one tensor type of the API.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "fusekit/fusekit.h"
#include "test_support.h"

namespace {

using fusekit::Device;
using fusekit::DeviceKind;
using fusekit::DType;
using fusekit::TensorView;

TEST(DType, NamesAndSizes) {
  const struct {
    DType dtype;
    const char* name;
    std::size_t size;
  } cases[] = {{DType::Float32, "float32", 4}, {DType::Float16, "float16", 2},
               {DType::BFloat16, "bfloat16", 2}, {DType::Float64, "float64", 8},
               {DType::Int32, "int32", 4},     {DType::Int64, "int64", 8},
               {DType::UInt8, "uint8", 1},     {DType::Bool, "bool", 1}};
  for (const auto& c : cases) {
    EXPECT_STREQ(fusekit::to_string(c.dtype), c.name);
    EXPECT_EQ(fusekit::element_size(c.dtype), c.size) << c.name;
  }
}

TEST(DType, UnknownCodeIsNamedAndRejected) {
  const auto bad = static_cast<DType>(200);
  EXPECT_STREQ(fusekit::to_string(bad), "unknown dtype");
  EXPECT_ERROR_CONTAINS("element_size: unknown dtype code 200",
                        [&] { (void)fusekit::element_size(bad); });
}

TEST(Device, NamesAndEquality) {
  EXPECT_EQ(fusekit::to_string(Device::cpu()), "cpu");
  EXPECT_EQ(fusekit::to_string(Device::cuda()), "cuda:0");
  EXPECT_EQ(fusekit::to_string(Device::cuda(3)), "cuda:3");
  EXPECT_EQ(Device{}, Device::cpu());
  EXPECT_EQ(Device::cuda(1), (Device{DeviceKind::CUDA, 1}));
  EXPECT_NE(Device::cuda(0), Device::cuda(1));
  EXPECT_NE(Device::cuda(0), Device::cpu());
}

TEST(TensorView, DefaultIsEmptyCpuFloat32) {
  const TensorView t;
  EXPECT_EQ(t.data, nullptr);
  EXPECT_EQ(t.dtype, DType::Float32);
  EXPECT_EQ(t.device, Device::cpu());
  EXPECT_EQ(t.ndim, 0);
  EXPECT_EQ(t.numel(), 1);  // a 0-d tensor holds one element
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.shape_string(), "[]");
}

TEST(TensorView, ContiguousStridesAreRowMajor) {
  float storage[2 * 3 * 4];
  const TensorView t(storage, DType::Float32, {2, 3, 4});
  EXPECT_EQ(t.data, storage);
  EXPECT_EQ(t.data_as<float>(), storage);
  EXPECT_EQ(t.ndim, 3);
  EXPECT_EQ(t.shape[0], 2);
  EXPECT_EQ(t.shape[1], 3);
  EXPECT_EQ(t.shape[2], 4);
  EXPECT_EQ(t.strides[0], 12);
  EXPECT_EQ(t.strides[1], 4);
  EXPECT_EQ(t.strides[2], 1);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.device, Device::cpu());
}

TEST(TensorView, ContiguousOnADevice) {
  const TensorView t(nullptr, DType::BFloat16, {4096, 4, 7168}, Device::cuda(0));
  EXPECT_EQ(t.device, Device::cuda(0));
  EXPECT_EQ(t.strides[0], 4 * 7168);
  EXPECT_EQ(t.describe(), "bfloat16 [4096, 4, 7168] on cuda:0");
  EXPECT_EQ(t.shape_string(), "[4096, 4, 7168]");
}

TEST(TensorView, StridedViews) {
  float storage[64];
  const TensorView transposed(storage, DType::Float32, {3, 4}, {1, 3});
  EXPECT_EQ(transposed.stride(0), 1);
  EXPECT_EQ(transposed.stride(1), 3);
  EXPECT_FALSE(transposed.is_contiguous());

  const TensorView padded(storage, DType::Float32, {3, 4}, {5, 1});
  EXPECT_FALSE(padded.is_contiguous());

  const TensorView broadcast(storage, DType::Float32, {3, 4}, {0, 1});
  EXPECT_FALSE(broadcast.is_contiguous());
  EXPECT_EQ(broadcast.numel(), 12);

  const TensorView reversed(storage + 3, DType::Float32, {4}, {-1});
  EXPECT_EQ(reversed.stride(0), -1);
  EXPECT_FALSE(reversed.is_contiguous());
}

TEST(TensorView, SizeOneDimsMayHaveAnyStride) {
  float storage[16];
  // [N, hc, 1] with an arbitrary stride on the unit dim is still row-major contiguous.
  const TensorView t(storage, DType::Float32, {2, 4, 1}, {4, 1, 77});
  EXPECT_TRUE(t.is_contiguous());
  const TensorView u(storage, DType::Float32, {1, 8}, {1000, 1});
  EXPECT_TRUE(u.is_contiguous());
}

TEST(TensorView, ZeroSizedDims) {
  const TensorView t(nullptr, DType::Float16, {0, 4, 8});
  EXPECT_EQ(t.numel(), 0);
  EXPECT_EQ(t.strides[0], 32);
  EXPECT_EQ(t.strides[1], 8);
  EXPECT_EQ(t.describe(), "float16 [0, 4, 8] on cpu");
}

TEST(TensorView, FromArrays) {
  const std::int64_t shape[] = {2, 3, 5};
  const std::int64_t strides[] = {1, 2, 6};
  double storage[30];
  const TensorView contiguous =
      TensorView::from_arrays(storage, DType::Float64, 3, shape, nullptr, Device::cuda(2));
  EXPECT_EQ(contiguous.ndim, 3);
  EXPECT_EQ(contiguous.stride(0), 15);
  EXPECT_EQ(contiguous.stride(1), 5);
  EXPECT_EQ(contiguous.stride(2), 1);
  EXPECT_EQ(contiguous.device, Device::cuda(2));
  EXPECT_TRUE(contiguous.is_contiguous());

  const TensorView strided = TensorView::from_arrays(storage, DType::Float64, 3, shape, strides);
  EXPECT_EQ(strided.stride(0), 1);
  EXPECT_EQ(strided.stride(1), 2);
  EXPECT_EQ(strided.stride(2), 6);
  EXPECT_EQ(strided.size(2), 5);
  EXPECT_FALSE(strided.is_contiguous());
  EXPECT_EQ(strided.numel(), 30);

  const TensorView scalar = TensorView::from_arrays(storage, DType::Int64, 0, nullptr, nullptr);
  EXPECT_EQ(scalar.ndim, 0);
  EXPECT_EQ(scalar.numel(), 1);

  std::int64_t eight[fusekit::kMaxDims];
  for (auto& s : eight) s = 2;
  const TensorView widest =
      TensorView::from_arrays(storage, DType::UInt8, fusekit::kMaxDims, eight, nullptr);
  EXPECT_EQ(widest.numel(), 256);
  EXPECT_EQ(widest.stride(0), 128);
}

TEST(TensorView, NegativeDimsCountFromTheEnd) {
  const TensorView t(nullptr, DType::Float32, {2, 3, 4}, {100, 10, 1});
  EXPECT_EQ(t.size(-1), 4);
  EXPECT_EQ(t.size(-2), 3);
  EXPECT_EQ(t.size(-3), 2);
  EXPECT_EQ(t.stride(-1), 1);
  EXPECT_EQ(t.stride(-2), 10);
  EXPECT_EQ(t.stride(-3), 100);
}

TEST(TensorView, DimOutOfRangeThrows) {
  const TensorView t(nullptr, DType::Float32, {2, 3, 4});
  EXPECT_ERROR_CONTAINS("TensorView::size: dim 3 out of range for 3 dims", [&] { (void)t.size(3); });
  EXPECT_ERROR_CONTAINS("TensorView::size: dim -4 out of range for 3 dims", [&] { (void)t.size(-4); });
  EXPECT_ERROR_CONTAINS("TensorView::stride: dim 7 out of range for 3 dims",
                        [&] { (void)t.stride(7); });
  EXPECT_ERROR_CONTAINS("TensorView::stride: dim -4 out of range for 3 dims",
                        [&] { (void)t.stride(-4); });
  const TensorView scalar;
  EXPECT_ERROR_CONTAINS("TensorView::size: dim 0 out of range for 0 dims",
                        [&] { (void)scalar.size(0); });
}

TEST(TensorView, MisuseThrows) {
  EXPECT_ERROR_CONTAINS("TensorView: 3 sizes but 2 strides", [] {
    const TensorView t(nullptr, DType::Float32, {2, 3, 4}, {12, 4});
  });
  EXPECT_ERROR_CONTAINS("TensorView: size of dim 1 must be >= 0, got -2", [] {
    const TensorView t(nullptr, DType::Float32, {4, -2, 3});
  });
  const std::int64_t shape[fusekit::kMaxDims + 1] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  EXPECT_ERROR_CONTAINS("TensorView: ndim must be in 0..8, got 9", [&] {
    (void)TensorView::from_arrays(nullptr, DType::Float32, fusekit::kMaxDims + 1, shape, nullptr);
  });
  EXPECT_ERROR_CONTAINS("TensorView: ndim must be in 0..8, got -1", [&] {
    (void)TensorView::from_arrays(nullptr, DType::Float32, -1, shape, nullptr);
  });
}

TEST(TensorView, ErrorsAreFusekitErrors) {
  // Callers catch one type: fusekit::Error, itself a std::runtime_error.
  const TensorView t(nullptr, DType::Float32, {2});
  EXPECT_THROW((void)t.size(1), fusekit::Error);
  EXPECT_THROW((void)t.size(1), std::runtime_error);
}

TEST(Stream, DefaultIsTheLegacyDefaultStream) {
  const fusekit::Stream s;
  EXPECT_EQ(s.handle, nullptr);
}

}  // namespace
