#include "common/memory.h"

#include <cstdlib>
#include <cstring>
#include <utility>

#include "fusekit/error.h"

#ifdef FUSEKIT_WITH_CUDA
#include "common/cuda_check.h"
#endif

namespace fusekit::detail {

namespace {
[[noreturn, maybe_unused]] void no_cuda() {
  throw Error("fusekit was built without CUDA; a cuda device cannot be used");
}
constexpr std::size_t kHostAlignment = 256;
}  // namespace

Buffer::Buffer(Device device, std::size_t bytes) : bytes_(bytes), device_(device) {
  if (bytes == 0) return;
  if (device.kind == DeviceKind::CPU) {
    data_ = std::aligned_alloc(kHostAlignment, (bytes + kHostAlignment - 1) / kHostAlignment * kHostAlignment);
    FUSEKIT_CHECK(data_ != nullptr, "Buffer: out of host memory allocating ", bytes, " bytes");
    return;
  }
#ifdef FUSEKIT_WITH_CUDA
  CudaDeviceGuard guard(device.index);
  FUSEKIT_CUDA_CHECK(cudaMalloc(&data_, bytes));
#else
  no_cuda();
#endif
}

Buffer::~Buffer() { release(); }

Buffer::Buffer(Buffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      device_(other.device_) {}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    device_ = other.device_;
  }
  return *this;
}

void Buffer::release() noexcept {
  if (data_ == nullptr) return;
  if (device_.kind == DeviceKind::CPU) {
    std::free(data_);
  } else {
#ifdef FUSEKIT_WITH_CUDA
    cudaFree(data_);
#endif
  }
  data_ = nullptr;
}

void Buffer::copy_from_host(const void* src, std::size_t bytes, std::size_t offset) {
  FUSEKIT_CHECK(offset + bytes <= bytes_, "Buffer::copy_from_host: ", bytes, " bytes at offset ",
                offset, " exceed the buffer's ", bytes_);
  if (bytes == 0) return;
  if (device_.kind == DeviceKind::CPU) {
    std::memcpy(static_cast<char*>(data_) + offset, src, bytes);
    return;
  }
#ifdef FUSEKIT_WITH_CUDA
  CudaDeviceGuard guard(device_.index);
  FUSEKIT_CUDA_CHECK(cudaMemcpy(static_cast<char*>(data_) + offset, src, bytes, cudaMemcpyHostToDevice));
#else
  no_cuda();
#endif
}

void Buffer::copy_to_host(void* dst, std::size_t bytes, std::size_t offset) const {
  FUSEKIT_CHECK(offset + bytes <= bytes_, "Buffer::copy_to_host: ", bytes, " bytes at offset ",
                offset, " exceed the buffer's ", bytes_);
  detail::copy_to_host(dst, static_cast<const char*>(data_) + offset, bytes, device_);
}

void copy_to_host(void* dst, const void* src, std::size_t bytes, Device device) {
  if (bytes == 0) return;
  if (device.kind == DeviceKind::CPU) {
    std::memcpy(dst, src, bytes);
    return;
  }
#ifdef FUSEKIT_WITH_CUDA
  CudaDeviceGuard guard(device.index);
  FUSEKIT_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
#else
  no_cuda();
#endif
}

void Buffer::fill_bytes(std::uint8_t value) {
  if (bytes_ == 0) return;
  if (device_.kind == DeviceKind::CPU) {
    std::memset(data_, value, bytes_);
    return;
  }
#ifdef FUSEKIT_WITH_CUDA
  CudaDeviceGuard guard(device_.index);
  FUSEKIT_CUDA_CHECK(cudaMemset(data_, value, bytes_));
#else
  no_cuda();
#endif
}

void synchronize(Device device) {
  if (device.kind == DeviceKind::CPU) return;
#ifdef FUSEKIT_WITH_CUDA
  CudaDeviceGuard guard(device.index);
  FUSEKIT_CUDA_CHECK(cudaDeviceSynchronize());
#else
  no_cuda();
#endif
}

}  // namespace fusekit::detail
