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

}  // namespace

CUtensorMap make_tensor_map_2d(const char* what, DType dtype, const void* base, std::int64_t rows,
                               std::int64_t cols, std::int64_t ld, int box_rows) {
  FUSEKIT_CHECK(dtype == DType::Float16 || dtype == DType::BFloat16, what,
                ": a tensor map of 16-bit elements was asked for ", to_string(dtype));
  FUSEKIT_CHECK(reinterpret_cast<std::uintptr_t>(base) % 16 == 0 && ld % 8 == 0 && ld >= cols &&
                    rows >= 1 && cols >= 1 && box_rows >= 1 && box_rows <= 256,
                what, ": a tensor map needs a 16-byte aligned base and rows a multiple of 16 bytes "
                      "apart (ld ", ld, " elements, ", rows, " x ", cols, ", box rows ", box_rows, ")");
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * 2};  // bytes, of the outer axis
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult status = encoder()(
      &map, dtype == DType::Float16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
      2, const_cast<void*>(base), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  FUSEKIT_CHECK(status == CUDA_SUCCESS, what, ": cuTensorMapEncodeTiled failed with CUresult ",
                static_cast<int>(status), " (", rows, " x ", cols, ", ld ", ld, ")");
  return map;
}

}  // namespace fusekit::detail
