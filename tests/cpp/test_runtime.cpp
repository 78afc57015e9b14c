// What the build contains and which devices it sees; these queries never need a GPU.
#include <gtest/gtest.h>

#include "fusekit/fusekit.h"
#include "test_support.h"

namespace {

TEST(Runtime, BuildInfoMatchesTheBuild) {
  const fusekit::BuildInfo& info = fusekit::build_info();
  EXPECT_FALSE(info.version.empty());
#ifdef FUSEKIT_WITH_CUDA
  EXPECT_TRUE(info.with_cuda);
  EXPECT_FALSE(info.cuda_architectures.empty());
#else
  EXPECT_FALSE(info.with_cuda);
  EXPECT_TRUE(info.cuda_architectures.empty());
#endif
}

TEST(Runtime, DeviceCountNeverThrows) {
  int count = -1;
  EXPECT_NO_THROW(count = fusekit::cuda_device_count());
  EXPECT_GE(count, 0);
#ifndef FUSEKIT_WITH_CUDA
  EXPECT_EQ(count, 0);
#endif
}

TEST(Runtime, DeviceInfoOutOfRangeThrows) {
  const int count = fusekit::cuda_device_count();
  EXPECT_ERROR_CONTAINS("cuda_device_info: device -1 requested",
                        [] { (void)fusekit::cuda_device_info(-1); });
  EXPECT_ERROR_CONTAINS("CUDA device(s) are usable",
                        [&] { (void)fusekit::cuda_device_info(count); });
}

}  // namespace
