// Owning buffers for tests, tools and benchmarks. Operators never allocate through these: their
// temporaries are stream-ordered (see cuda_workspace.cuh).
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusekit/tensor.h"

namespace fusekit::detail {

class Buffer {
 public:
  Buffer() = default;
  Buffer(Device device, std::size_t bytes);
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

  void copy_from_host(const void* src, std::size_t bytes, std::size_t offset = 0);
  void copy_to_host(void* dst, std::size_t bytes, std::size_t offset = 0) const;
  /// Sets every byte to `value` (a poison pattern before a call, say).
  void fill_bytes(std::uint8_t value);

 private:
  void release() noexcept;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  Device device_{};
};

/// Copies `bytes` from `src` on `device` to host memory `dst` (synchronously).
void copy_to_host(void* dst, const void* src, std::size_t bytes, Device device);

/// Waits for all work on `device` (a no-op on the CPU).
void synchronize(Device device);

}  // namespace fusekit::detail
