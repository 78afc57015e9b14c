// Tensor maps for the copy engine (sm_90 `cp.async.bulk.tensor`): a 2-D row-major matrix of
// 16-bit elements, read in boxes whose rows are 128-byte swizzled (the layout warpgroup MMAs take
// from shared memory, see cuda_wgmma.cuh).
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

}  // namespace fusekit::detail
