// Stream-ordered temporary device memory: taken with cudaMallocAsync on the operator's stream and
// given back on it, so operators stay capturable in CUDA graphs and never synchronise.
#pragma once

#include <cstddef>

#include "common/cuda_check.h"

namespace fusekit::detail {

class StreamWorkspace {
 public:
  StreamWorkspace(std::size_t bytes, cudaStream_t stream) : stream_(stream) {
    if (bytes) FUSEKIT_CUDA_CHECK(cudaMallocAsync(&data_, bytes, stream));
  }
  ~StreamWorkspace() {
    if (data_) cudaFreeAsync(data_, stream_);  // a destructor must not throw
  }
  StreamWorkspace(const StreamWorkspace&) = delete;
  StreamWorkspace& operator=(const StreamWorkspace&) = delete;

  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  void* data_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace fusekit::detail
