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

CUtensorMapDataType data_type(const char* what, DType dtype) {
  switch (dtype) {
    case DType::Float32: return CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
    case DType::Float16: return CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    case DType::BFloat16: return CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    default: throw Error(concat(what, ": no tensor map of ", to_string(dtype), " elements"));
  }
}

// Encodes a map of `rank` dims (innermost first; strides in bytes of dims 1 .. rank - 1) after
// the public functions' checks into `map`; the driver's status.
CUresult try_encode(CUtensorMap& map, const char* what, DType dtype, const void* base, int rank,
                    const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                    CUtensorMapSwizzle swizzle) {
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  return encoder()(&map, data_type(what, dtype), static_cast<cuuint32_t>(rank),
                   const_cast<void*>(base), dims, strides, box, element_strides,
                   CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                   CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

// The same, a refused layout being an error.
CUtensorMap encode(const char* what, DType dtype, const void* base, int rank,
                   const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                   CUtensorMapSwizzle swizzle) {
  CUtensorMap map{};
  const CUresult status = try_encode(map, what, dtype, base, rank, dims, strides, box, swizzle);
  FUSEKIT_CHECK(status == CUDA_SUCCESS, what, ": cuTensorMapEncodeTiled failed with CUresult ",
                static_cast<int>(status), " (", rank, "-d, innermost ", dims[0], " elements)");
  return map;
}

// A 2-D map after its checks.
CUtensorMap encode_2d(const char* what, DType dtype, const void* base, std::int64_t rows,
                      std::int64_t cols, std::int64_t ld, int box_rows, int box_cols,
                      CUtensorMapSwizzle swizzle) {
  const auto size = static_cast<std::int64_t>(element_size(dtype));
  FUSEKIT_CHECK(reinterpret_cast<std::uintptr_t>(base) % 16 == 0 && ld * size % 16 == 0 &&
                    ld >= cols && rows >= 1 && cols >= 1 && box_rows >= 1 && box_rows <= 256 &&
                    box_cols >= 1 && box_cols <= 256 && box_cols * size % 16 == 0,
                what, ": a tensor map needs a 16-byte aligned base and rows a multiple of 16 bytes "
                      "apart (ld ", ld, " elements of ", size, " bytes, ", rows, " x ", cols,
                ", box ", box_rows, " x ", box_cols, ")");
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld * size)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  return encode(what, dtype, base, 2, dims, strides, box, swizzle);
}

}  // namespace

CUtensorMap make_tensor_map_2d(const char* what, DType dtype, const void* base, std::int64_t rows,
                               std::int64_t cols, std::int64_t ld, int box_rows) {
  FUSEKIT_CHECK(dtype == DType::Float16 || dtype == DType::BFloat16, what,
                ": a swizzled tensor map of 16-bit elements was asked for ", to_string(dtype));
  return encode_2d(what, dtype, base, rows, cols, ld, box_rows, 64, CU_TENSOR_MAP_SWIZZLE_128B);
}

CUtensorMap make_tensor_map_rows(const char* what, DType dtype, const void* base, std::int64_t rows,
                                 std::int64_t cols, std::int64_t ld, int box_rows, int box_cols) {
  return encode_2d(what, dtype, base, rows, cols, ld, box_rows, box_cols,
                   CU_TENSOR_MAP_SWIZZLE_NONE);
}

std::optional<CUtensorMap> make_tensor_map_4d(const char* what, DType dtype, const void* base,
                                              const std::int64_t (&dims)[4],
                                              const std::int64_t (&strides)[3], int box_rows,
                                              int box_depth) {
  FUSEKIT_CHECK(dtype == DType::Float16 || dtype == DType::BFloat16, what,
                ": a swizzled tensor map of 16-bit elements was asked for ", to_string(dtype));
  FUSEKIT_CHECK(box_rows >= 1 && box_rows <= 256 && box_depth >= 1 && box_depth <= 256, what,
                ": a box of ", box_rows, " rows by ", box_depth, " (at most 256 each)");
  const auto size = static_cast<std::int64_t>(element_size(dtype));
  if (reinterpret_cast<std::uintptr_t>(base) % 16 != 0) return std::nullopt;
  for (int i = 0; i < 4; ++i) {
    if (dims[i] < 1 || dims[i] > (std::int64_t{1} << 32)) return std::nullopt;
  }
  cuuint64_t s[3];
  for (int i = 0; i < 3; ++i) {
    const std::int64_t bytes = strides[i] * size;
    if (strides[i] <= 0 || bytes % 16 != 0 || bytes >= (std::int64_t{1} << 40)) return std::nullopt;
    s[i] = static_cast<cuuint64_t>(bytes);
  }
  const cuuint64_t d[4] = {static_cast<cuuint64_t>(dims[0]), static_cast<cuuint64_t>(dims[1]),
                           static_cast<cuuint64_t>(dims[2]), static_cast<cuuint64_t>(dims[3])};
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(box_rows),
                             static_cast<cuuint32_t>(box_depth), 1};
  CUtensorMap map{};
  if (try_encode(map, what, dtype, base, 4, d, s, box, CU_TENSOR_MAP_SWIZZLE_128B) != CUDA_SUCCESS) {
    return std::nullopt;
  }
  return map;
}

}  // namespace fusekit::detail
