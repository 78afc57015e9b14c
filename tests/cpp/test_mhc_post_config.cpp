// The pure launch-config selectors of the CUDA backend: which branch each layout takes (16-byte
// vectors, one element per thread, or on sm_90 bulk copies for large problems), and how the grid
// covers the work. They need no GPU (the
// views below point at made-up, never dereferenced addresses), so they run wherever the CUDA
// backend is built, CI included. Built into the cpu test executable of CUDA builds only.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "test_support.h"

namespace {

using namespace fusekit_test;
using fusekit::detail::MhcPostBackwardConfig;
using fusekit::detail::MhcPostConfig;
using fusekit::detail::select_mhc_post_backward_config;
using fusekit::detail::path_name;
using fusekit::detail::select_mhc_post_config;
using Path = MhcPostConfig::Path;

constexpr int kH100Sms = 132;
constexpr int kHopper = 9, kAmpere = 8;  // compute capability (major)
constexpr DType kDtypes[] = {DType::Float32, DType::BFloat16, DType::Float16};

int vec16(DType dtype) { return 16 / static_cast<int>(fusekit::element_size(dtype)); }

void* address(std::uintptr_t a) { return reinterpret_cast<void*>(a); }

// `t` moved by `elements` elements: a base pointer off the 16-byte grid for an odd count.
TensorView shifted(TensorView t, std::int64_t elements) {
  const auto esize = static_cast<std::int64_t>(fusekit::element_size(t.dtype));
  t.data = static_cast<char*>(t.data) + elements * esize;
  return t;
}

struct ForwardArgs {
  TensorView out, x, residual, post, comb;
};

// Contiguous views at separate 4 KiB-aligned made-up addresses.
ForwardArgs forward_args(DType dtype, std::int64_t n, std::int64_t hc, std::int64_t h) {
  return {TensorView(address(0x100000000), dtype, {n, hc, h}),
          TensorView(address(0x200000000), dtype, {n, h}),
          TensorView(address(0x300000000), dtype, {n, hc, h}),
          TensorView(address(0x400000000), DType::Float32, {n, hc}),
          TensorView(address(0x500000000), DType::Float32, {n, hc, hc})};
}

MhcPostConfig select(const ForwardArgs& a, int sms = kH100Sms, int sm_major = kHopper) {
  return select_mhc_post_config(mhc_post_params_of(a.out, a.x, a.residual, a.post, a.comb), sms,
                                sm_major);
}

bool vectorized(const MhcPostConfig& c) { return c.path == Path::Vector; }

// Bytes that one forward moves: x and residual read, out written.
double forward_bytes(DType dtype, std::int64_t n, std::int64_t hc, std::int64_t h) {
  return static_cast<double>(n) * h * static_cast<double>(fusekit::element_size(dtype)) * (1 + 2 * hc);
}

struct BackwardArgs {
  TensorView grad_x, grad_residual, grad_post, grad_comb, grad_out, x, residual, post, comb;
};

BackwardArgs backward_args(DType dtype, std::int64_t n, std::int64_t hc, std::int64_t h) {
  return {TensorView(address(0x100000000), dtype, {n, h}),
          TensorView(address(0x200000000), dtype, {n, hc, h}),
          TensorView(address(0x300000000), DType::Float32, {n, hc}),
          TensorView(address(0x400000000), DType::Float32, {n, hc, hc}),
          TensorView(address(0x500000000), dtype, {n, hc, h}),
          TensorView(address(0x600000000), dtype, {n, h}),
          TensorView(address(0x700000000), dtype, {n, hc, h}),
          TensorView(address(0x800000000), DType::Float32, {n, hc}),
          TensorView(address(0x900000000), DType::Float32, {n, hc, hc})};
}

MhcPostBackwardConfig select(const BackwardArgs& a, int sms = kH100Sms) {
  return select_mhc_post_backward_config(
      mhc_post_backward_params_of(a.grad_x, a.grad_residual, a.grad_post, a.grad_comb, a.grad_out,
                                  a.x, a.residual, a.post, a.comb),
      sms);
}

std::string describe(DType dtype, std::int64_t n, std::int64_t h, int sms) {
  return dtype_name(dtype) + " N=" + std::to_string(n) + " H=" + std::to_string(h) +
         " sms=" + std::to_string(sms);
}

// The shapes of the property tests, from one element to a quarter of a billion per stream.
constexpr std::int64_t kRows[] = {1, 2, 7, 64, 4096, 100000};
constexpr std::int64_t kHidden[] = {1, 7, 8, 127, 128, 1000, 4096, 7168, 7169, 65536, 1000000};

// ------------------------------------------------------------------------------------ forward

TEST(MhcPostForwardConfig, VectorizedWhenContiguousAndAligned) {
  for (DType dtype : kDtypes) {
    SCOPED_TRACE(dtype_name(dtype));
    for (std::int64_t h : {std::int64_t{vec16(dtype)}, std::int64_t{7168}}) {
      const MhcPostConfig c = select(forward_args(dtype, 64, 4, h));
      EXPECT_TRUE(vectorized(c)) << "H=" << h;
      EXPECT_EQ(c.vec, vec16(dtype)) << "H=" << h;
    }
  }
}

TEST(MhcPostForwardConfig, ScalarWhenHIsNotAMultipleOfTheVector) {
  for (DType dtype : kDtypes) {
    SCOPED_TRACE(dtype_name(dtype));
    for (std::int64_t h : {1, 127, 7169}) {
      const MhcPostConfig c = select(forward_args(dtype, 64, 4, h));
      EXPECT_FALSE(vectorized(c)) << "H=" << h;
      EXPECT_EQ(c.vec, 1) << "H=" << h;
    }
  }
  // A multiple of 4 but not of 8: float32 vectors (4 per 16 bytes), 16-bit types none.
  EXPECT_TRUE(vectorized(select(forward_args(DType::Float32, 8, 4, 7164))));
  EXPECT_FALSE(vectorized(select(forward_args(DType::BFloat16, 8, 4, 7164))));
  EXPECT_FALSE(vectorized(select(forward_args(DType::Float16, 8, 4, 7164))));
}

TEST(MhcPostForwardConfig, ScalarWhenAnyStreamedBaseIsMisaligned) {
  for (DType dtype : kDtypes) {
    SCOPED_TRACE(dtype_name(dtype));
    const ForwardArgs good = forward_args(dtype, 8, 4, 4096);
    ForwardArgs a = good;
    a.out = shifted(a.out, 1);
    EXPECT_FALSE(vectorized(select(a))) << "out misaligned";
    a = good;
    a.x = shifted(a.x, 1);
    EXPECT_FALSE(vectorized(select(a))) << "x misaligned";
    a = good;
    a.residual = shifted(a.residual, 1);
    EXPECT_FALSE(vectorized(select(a))) << "residual misaligned";
    // A whole vector further on is aligned again.
    a = good;
    a.x = shifted(a.x, vec16(dtype));
    EXPECT_TRUE(vectorized(select(a))) << "x shifted by one vector";
    // post and comb are read one float at a time: their alignment does not matter.
    a = good;
    a.post = shifted(a.post, 1);
    a.comb = shifted(a.comb, 1);
    EXPECT_TRUE(vectorized(select(a))) << "post and comb misaligned";
  }
}

TEST(MhcPostForwardConfig, ScalarWhenAnHStrideIsNotOne) {
  const std::int64_t n = 8, hc = 4, h = 1024;
  for (DType dtype : kDtypes) {
    SCOPED_TRACE(dtype_name(dtype));
    const ForwardArgs good = forward_args(dtype, n, hc, h);
    ForwardArgs a = good;
    a.x = TensorView(a.x.data, dtype, {n, h}, {1, n});  // x stored transposed
    EXPECT_FALSE(vectorized(select(a))) << "x H stride N";
    a = good;
    a.residual = TensorView(a.residual.data, dtype, {n, hc, h}, {hc * h * 2, h * 2, 2});
    EXPECT_FALSE(vectorized(select(a))) << "residual H stride 2";
    a = good;
    a.out = TensorView(a.out.data, dtype, {n, hc, h}, {hc * h * 2, h * 2, 2});
    EXPECT_FALSE(vectorized(select(a))) << "out H stride 2";
    a = good;
    a.residual = TensorView(a.residual.data, dtype, {n, hc, h}, {h, n * h, 1});  // hc outermost
    EXPECT_TRUE(vectorized(select(a))) << "residual hc-major, H contiguous";
  }
}

TEST(MhcPostForwardConfig, RowStridesMustKeepRowsAligned) {
  const std::int64_t n = 8, hc = 4, h = 1024;
  for (DType dtype : kDtypes) {
    SCOPED_TRACE(dtype_name(dtype));
    const std::int64_t v = vec16(dtype);
    const ForwardArgs good = forward_args(dtype, n, hc, h);
    ForwardArgs a = good;
    a.x = TensorView(a.x.data, dtype, {n, h}, {h + 1, 1});
    EXPECT_FALSE(vectorized(select(a))) << "x rows padded by 1";
    a.x = TensorView(a.x.data, dtype, {n, h}, {h + v, 1});
    EXPECT_TRUE(vectorized(select(a))) << "x rows padded by one vector";
    a = good;
    a.residual = TensorView(a.residual.data, dtype, {n, hc, h}, {hc * (h + 1), h + 1, 1});
    EXPECT_FALSE(vectorized(select(a))) << "residual rows padded by 1";
    a = good;
    a.out = TensorView(a.out.data, dtype, {n, hc, h}, {hc * h + 1, h, 1});
    EXPECT_FALSE(vectorized(select(a))) << "out row stride off the vector grid";
  }
}

TEST(MhcPostForwardConfig, SizeOneDimsDoNotBreakAlignment) {
  // The stride of a dimension of size 1 is never used, whatever its value.
  for (DType dtype : kDtypes) {
    SCOPED_TRACE(dtype_name(dtype));
    const std::int64_t h = 1024;
    ForwardArgs a = forward_args(dtype, 1, 1, h);
    a.x = TensorView(a.x.data, dtype, {1, h}, {h + 1, 1});
    a.residual = TensorView(a.residual.data, dtype, {1, 1, h}, {7, 3, 1});
    a.out = TensorView(a.out.data, dtype, {1, 1, h}, {5, 1, 1});
    EXPECT_TRUE(vectorized(select(a)));
    a = forward_args(dtype, 2, 1, h);
    a.residual = TensorView(a.residual.data, dtype, {2, 1, h}, {h, 3, 1});
    EXPECT_TRUE(vectorized(select(a))) << "hc = 1 with an odd stride in its unit dim";
  }
}

TEST(MhcPostForwardConfig, BulkCopiesForLargeProblemsOnHopperOnly) {
  for (DType dtype : kDtypes) {
    SCOPED_TRACE(dtype_name(dtype));
    const std::int64_t hc = 4, h = 7168;
    const ForwardArgs big = forward_args(dtype, 8192, hc, h);  // about 0.5 to 2 GB moved
    ASSERT_GE(forward_bytes(dtype, 8192, hc, h), 256e6);
    EXPECT_EQ(select(big, kH100Sms, kHopper).path, Path::Bulk);
    EXPECT_EQ(select(big, kH100Sms, kAmpere).path, Path::Vector) << "no bulk copies before sm_90";
    EXPECT_EQ(select(big, kH100Sms, 10).path, Path::Bulk) << "and after";
    EXPECT_EQ(select(forward_args(dtype, 8, hc, h)).path, Path::Vector) << "a small problem";
    // Bulk copies need the conditions of the vector path: any scalar layout stays scalar.
    ForwardArgs odd = big;
    odd.x = shifted(odd.x, 1);
    EXPECT_EQ(select(odd).path, Path::Scalar) << "x misaligned";
    EXPECT_EQ(select(forward_args(dtype, 8192, hc, h + 1)).path, Path::Scalar) << "odd H";
  }
}

TEST(MhcPostForwardConfig, BulkTilesCoverEveryRow) {
  for (DType dtype : kDtypes) {
    const std::int64_t esize = static_cast<std::int64_t>(fusekit::element_size(dtype));
    for (int sms : {1, 108, kH100Sms}) {
      for (std::int64_t n : kRows) {
        for (std::int64_t h : kHidden) {
          const MhcPostConfig c = select(forward_args(dtype, n, 4, h), sms);
          if (c.path != Path::Bulk) continue;
          SCOPED_TRACE(describe(dtype, n, h, sms));
          const std::int64_t tile = std::int64_t{c.threads} * 16 / esize;  // H elements per tile
          EXPECT_EQ(c.vec, vec16(dtype));
          EXPECT_GE(c.tiles_per_row * tile, h) << "part of a row is not covered";
          EXPECT_LT((c.tiles_per_row - 1) * tile, h) << "a tile has no work";
          EXPECT_GE(c.blocks, 1);
          EXPECT_LE(c.blocks, n * c.tiles_per_row) << "a block has no tile";
          EXPECT_LE(c.blocks, 2147483647);
        }
      }
    }
  }
}

TEST(MhcPostForwardConfig, GridCoversEveryRowWithoutIdleBlocks) {
  for (DType dtype : kDtypes) {
    for (int sms : {1, 108, kH100Sms}) {
      for (std::int64_t n : kRows) {
        for (std::int64_t h : kHidden) {
          const MhcPostConfig c = select(forward_args(dtype, n, 4, h), sms, kAmpere);
          SCOPED_TRACE(describe(dtype, n, h, sms) + " path " + path_name(c.path));
          ASSERT_NE(c.path, Path::Bulk);
          const std::int64_t per_block = std::int64_t{c.threads} * c.vec;
          EXPECT_EQ(c.threads % 32, 0);
          EXPECT_GE(c.threads, 32);
          EXPECT_LE(c.threads, 256);
          EXPECT_GE(c.blocks_per_row, 1);
          EXPECT_LE(c.blocks_per_row, 65535);
          EXPECT_GE(c.blocks_per_row * per_block, h) << "part of a row is not covered";
          EXPECT_LT((c.blocks_per_row - 1) * per_block, h) << "a block has no work";
        }
      }
    }
  }
}

TEST(MhcPostForwardConfig, SmallBatchesStillSpreadOverTheDevice) {
  // Fewer rows than the device has multiprocessors: smaller blocks, more of them per row, down to
  // one warp each.
  for (DType dtype : kDtypes) {
    for (std::int64_t n : {1, 8, 64, 4096}) {
      const std::int64_t h = 7168;
      const MhcPostConfig c = select(forward_args(dtype, n, 4, h), kH100Sms, kAmpere);
      SCOPED_TRACE(describe(dtype, n, h, kH100Sms));
      EXPECT_TRUE(n * c.blocks_per_row >= 2 * kH100Sms || c.threads == 32)
          << n * c.blocks_per_row << " blocks of " << c.threads << " threads";
    }
    EXPECT_LE(select(forward_args(dtype, 1, 4, 7168), kH100Sms, kAmpere).threads,
              select(forward_args(dtype, 4096, 4, 7168), kH100Sms, kAmpere).threads);
  }
}

// ------------------------------------------------------------------------------------ backward

TEST(MhcPostBackwardConfig, VectorizedOnlyWhenEveryStreamIsAligned) {
  for (DType dtype : kDtypes) {
    SCOPED_TRACE(dtype_name(dtype));
    const BackwardArgs good = backward_args(dtype, 8, 4, 4096);
    const MhcPostBackwardConfig c = select(good);
    EXPECT_TRUE(c.vectorized);
    EXPECT_EQ(c.vec, vec16(dtype));
    for (TensorView BackwardArgs::*member :
         {&BackwardArgs::grad_x, &BackwardArgs::grad_residual, &BackwardArgs::grad_out,
          &BackwardArgs::x, &BackwardArgs::residual}) {
      BackwardArgs a = good;
      a.*member = shifted(a.*member, 1);
      EXPECT_FALSE(select(a).vectorized) << "one streamed tensor misaligned";
      a.*member = shifted(good.*member, 0);
      TensorView& t = a.*member;
      t.strides[t.ndim - 1] = 2;  // H stride 2 (made-up memory, never read)
      EXPECT_FALSE(select(a).vectorized) << "one streamed tensor with H stride 2";
    }
    for (TensorView BackwardArgs::*member : {&BackwardArgs::grad_post, &BackwardArgs::grad_comb,
                                             &BackwardArgs::post, &BackwardArgs::comb}) {
      BackwardArgs a = good;
      a.*member = shifted(a.*member, 1);
      EXPECT_TRUE(select(a).vectorized) << "a float32 mix misaligned";
    }
  }
}

TEST(MhcPostBackwardConfig, SizeOneDimsDoNotBreakAlignment) {
  for (DType dtype : kDtypes) {
    SCOPED_TRACE(dtype_name(dtype));
    const std::int64_t h = 1024;
    BackwardArgs a = backward_args(dtype, 1, 1, h);
    a.grad_x = TensorView(a.grad_x.data, dtype, {1, h}, {h + 1, 1});
    a.grad_out = TensorView(a.grad_out.data, dtype, {1, 1, h}, {3, 5, 1});
    a.residual = TensorView(a.residual.data, dtype, {1, 1, h}, {7, 3, 1});
    EXPECT_TRUE(select(a).vectorized);
  }
}

TEST(MhcPostBackwardConfig, ScalarWhenHIsNotAMultipleOfTheVector) {
  for (DType dtype : kDtypes) {
    EXPECT_FALSE(select(backward_args(dtype, 8, 4, 127)).vectorized) << dtype_name(dtype);
    EXPECT_FALSE(select(backward_args(dtype, 8, 4, 7167)).vectorized) << dtype_name(dtype);
  }
}

TEST(MhcPostBackwardConfig, FewRowsSplitHIntoChunks) {
  for (DType dtype : kDtypes) {
    for (std::int64_t n : {1, 8, 64}) {
      SCOPED_TRACE(describe(dtype, n, 7168, kH100Sms));
      EXPECT_GT(select(backward_args(dtype, n, 4, 7168)).chunks, 1);
      EXPECT_GT(select(backward_args(dtype, n, 4, 7167)).chunks, 1);
    }
  }
}

TEST(MhcPostBackwardConfig, OneChunkWhenRowsFillTheDeviceOrAreShort) {
  for (DType dtype : kDtypes) {
    SCOPED_TRACE(dtype_name(dtype));
    EXPECT_EQ(select(backward_args(dtype, 4096, 4, 7168)).chunks, 1);
    EXPECT_EQ(select(backward_args(dtype, 8, 4, 127)).chunks, 1);  // within one block's pass
    EXPECT_EQ(select(backward_args(dtype, 1, 4, 1)).chunks, 1);
    EXPECT_EQ(select(backward_args(dtype, 8, 4, 0)).chunks, 1);  // H = 0: the sums are 0
  }
}

TEST(MhcPostBackwardConfig, ChunksPartitionEveryRow) {
  for (DType dtype : kDtypes) {
    for (int sms : {1, 108, kH100Sms}) {
      for (std::int64_t n : kRows) {
        for (std::int64_t h : kHidden) {
          const MhcPostBackwardConfig c = select(backward_args(dtype, n, 4, h), sms);
          SCOPED_TRACE(describe(dtype, n, h, sms));
          EXPECT_EQ(c.threads % 32, 0);
          EXPECT_GE(c.threads, 32);
          EXPECT_GE(c.chunks, 1);
          EXPECT_LE(c.chunks, 65535);
          EXPECT_GE(c.chunk_len, c.vec);
          EXPECT_EQ(c.chunk_len % c.vec, 0) << "a vector straddles two chunks";
          EXPECT_GE(c.chunks * c.chunk_len, h) << "part of a row is not covered";
          EXPECT_LT((c.chunks - 1) * c.chunk_len, h) << "a chunk has no work";
        }
      }
    }
  }
}

}  // namespace
