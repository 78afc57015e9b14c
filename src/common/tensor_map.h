// Tensor maps for the copy engine (sm_90 `cp.async.bulk.tensor`) over a 2-D row-major matrix or
// a 4-D strided tensor: boxes of 16-bit elements whose rows are 128-byte swizzled (the layout
// warpgroup MMAs take from shared memory, see cuda_wgmma.cuh), and plain boxes of whole rows for
// operands read by threads.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <optional>

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

/// The map of a 4-D tensor of float16 or bfloat16 with `dims` given innermost first (the first
/// contiguous) and `strides` (in elements) of the other three, read in boxes of 64 elements
/// (128 bytes, swizzled by 128 bytes) by `box_rows` of the second axis by `box_depth` of the third
/// by 1 (landing in that order, innermost first); parts of a box outside the tensor read as
/// zeros, and are not written when a box is stored. Empty when the tensor does not fit a map: a
/// base not 16-byte aligned, strides that are not positive multiples of 16 bytes below 2^40
/// bytes, or a layout the driver refuses.
std::optional<CUtensorMap> make_tensor_map_4d(const char* what, DType dtype, const void* base,
                               const std::int64_t (&dims)[4], const std::int64_t (&strides)[3],
                               int box_rows, int box_depth = 1);

}  // namespace fusekit::detail
