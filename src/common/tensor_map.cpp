#include "common/tensor_map.h"

#include <cuda_runtime.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include "common/cuda_check.h"
#include "fusekit/error.h"

namespace fusekit::detail {

namespace {

// The driver's encoder, found through the runtime: the library does not link the driver.
PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    FUSEKIT_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                                        cudaEnableDefault, &found));
    FUSEKIT_CHECK(found == cudaDriverEntryPointSuccess && p != nullptr,
                  "the CUDA driver has no cuTensorMapEncodeTiled (a driver for CUDA 12 or later "
                  "is needed)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// Encodes a 2-D map; the checks of the public functions come first.
CUtensorMap encode(const char* what, DType dtype, const void* base, std::int64_t rows,
                   std::int64_t cols, std::int64_t ld, int box_rows, int box_cols,
                   CUtensorMapSwizzle swizzle) {
  const auto size = static_cast<std::int64_t>(element_size(dtype));
  FUSEKIT_CHECK(reinterpret_cast<std::uintptr_t>(base) % 16 == 0 && ld * size % 16 == 0 &&
                    ld >= cols && rows >= 1 && cols >= 1 && box_rows >= 1 && box_rows <= 256 &&
                    box_cols >= 1 && box_cols <= 256 && box_cols * size % 16 == 0,
                what, ": a tensor map needs a 16-byte aligned base and rows a multiple of 16 bytes "
                      "apart (ld ", ld, " elements of ", size, " bytes, ", rows, " x ", cols,
                ", box ", box_rows, " x ", box_cols, ")");
  CUtensorMapDataType type = CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  switch (dtype) {
    case DType::Float32: type = CU_TENSOR_MAP_DATA_TYPE_FLOAT32; break;
    case DType::Float16: type = CU_TENSOR_MAP_DATA_TYPE_FLOAT16; break;
    case DType::BFloat16: type = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16; break;
    default: throw Error(concat(what, ": no tensor map of ", to_string(dtype), " elements"));
  }
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld * size)};  // bytes, of the outer axis
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult status =
      encoder()(&map, type, 2, const_cast<void*>(base), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  FUSEKIT_CHECK(status == CUDA_SUCCESS, what, ": cuTensorMapEncodeTiled failed with CUresult ",
                static_cast<int>(status), " (", rows, " x ", cols, ", ld ", ld, ")");
  return map;
}

}  // namespace

CUtensorMap make_tensor_map_2d(const char* what, DType dtype, const void* base, std::int64_t rows,
                               std::int64_t cols, std::int64_t ld, int box_rows) {
  FUSEKIT_CHECK(dtype == DType::Float16 || dtype == DType::BFloat16, what,
                ": a swizzled tensor map of 16-bit elements was asked for ", to_string(dtype));
  return encode(what, dtype, base, rows, cols, ld, box_rows, 64, CU_TENSOR_MAP_SWIZZLE_128B);
}

CUtensorMap make_tensor_map_rows(const char* what, DType dtype, const void* base, std::int64_t rows,
                                 std::int64_t cols, std::int64_t ld, int box_rows, int box_cols) {
  return encode(what, dtype, base, rows, cols, ld, box_rows, box_cols, CU_TENSOR_MAP_SWIZZLE_NONE);
}

}  // namespace fusekit::detail
