// Tensor maps for the copy engine (sm_90 `cp.async.bulk.tensor`) over a 2-D row-major matrix:
// boxes of 16-bit elements whose rows are 128-byte swizzled (the layout warpgroup MMAs take from
// shared memory, see cuda_wgmma.cuh), and plain boxes of whole rows for operands read by threads.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "fusekit/tensor.h"

namespace fusekit::detail {

/// The map of `rows` rows of `cols` elements of `dtype` (float16 or bfloat16), rows `ld` elements
/// apart, read in boxes of `box_rows` rows by 64 elements (128 bytes), swizzled by 128 bytes;
/// parts of a box outside the matrix read as zeros. The base must be 16-byte aligned and `ld` a
/// multiple of 8 (checked: a violation throws fusekit::Error naming `what`).
CUtensorMap make_tensor_map_2d(const char* what, DType dtype, const void* base, std::int64_t rows,
                               std::int64_t cols, std::int64_t ld, int box_rows);

/// The same for `dtype` float32, float16 or bfloat16, read in unswizzled boxes of `box_rows` rows
/// by `box_cols` elements (at most 256 each, box_cols times the element size a multiple of 16
/// bytes), which land in shared memory as a row-major [box_rows, box_cols] block. The base must be
/// 16-byte aligned and rows a multiple of 16 bytes apart (checked).
CUtensorMap make_tensor_map_rows(const char* what, DType dtype, const void* base, std::int64_t rows,
                                 std::int64_t cols, std::int64_t ld, int box_rows, int box_cols);

}  // namespace fusekit::detail
