// cuBLASLt plumbing shared by the operators: the error check, one handle per device, the pointer
// alignment the heuristic may assume, and RAII for a call's descriptors.
#pragma once

#include <cublasLt.h>

#include <cstdint>

#include "fusekit/error.h"

#define FUSEKIT_CUBLAS_CHECK(call)                                                         \
  do {                                                                                     \
    const cublasStatus_t fusekit_status_ = (call);                                         \
    if (fusekit_status_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                             \
      throw ::fusekit::Error(::fusekit::detail::concat(                                    \
          "cuBLASLt error ", cublasLtGetStatusName(fusekit_status_), " (",                 \
          cublasLtGetStatusString(fusekit_status_), ") in " #call " at ", __FILE__, ":", \
          __LINE__));                                                                      \
  } while (0)

namespace fusekit::detail {

/// One cuBLASLt handle per device, made on first use and kept for the life of the process.
cublasLtHandle_t lt_handle(int device);

/// The largest power of two (at most 256) dividing the address: what cuBLASLt may assume.
std::uint32_t alignment_of(const void* p);

/// The descriptors of one matrix product, destroyed on every way out.
struct LtObjects {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  LtObjects() = default;
  LtObjects(const LtObjects&) = delete;
  LtObjects& operator=(const LtObjects&) = delete;
  ~LtObjects() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

template <typename V>
void set_desc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const V& value) {
  FUSEKIT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)));
}

template <typename V>
void set_layout(cublasLtMatrixLayout_t layout, cublasLtMatrixLayoutAttribute_t attr,
                const V& value) {
  FUSEKIT_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, attr, &value, sizeof(value)));
}

}  // namespace fusekit::detail
