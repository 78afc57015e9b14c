// Stream-ordered temporary device memory, taken on the operator's stream and given back on it, so
// operators never synchronise and stay capturable in CUDA graphs.
//
// Outside a capture the memory comes from fusekit's own memory pool on the device, which keeps
// what it has reserved (up to the largest workspace used at once) instead of returning it to the
// driver at every synchronisation, so repeated calls do not pay for mapping memory again. Under
// stream capture it is taken with cudaMallocAsync, which becomes an allocation node of the graph.
#pragma once

#include <cstddef>

#include "common/cuda_check.h"

namespace fusekit::detail {

/// fusekit's memory pool on `device` (made on first use, kept for the life of the process).
cudaMemPool_t workspace_pool(int device);

class StreamWorkspace {
 public:
  StreamWorkspace(std::size_t bytes, cudaStream_t stream) : stream_(stream) {
    if (bytes == 0) return;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    FUSEKIT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (capture != cudaStreamCaptureStatusNone) {
      FUSEKIT_CUDA_CHECK(cudaMallocAsync(&data_, bytes, stream));
    } else {
      int device = 0;
      FUSEKIT_CUDA_CHECK(cudaGetDevice(&device));
      FUSEKIT_CUDA_CHECK(cudaMallocFromPoolAsync(&data_, bytes, workspace_pool(device), stream));
    }
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
