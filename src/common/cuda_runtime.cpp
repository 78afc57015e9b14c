// Device queries and the device guard (compiled only with CUDA).
#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string_view>

#include "common/cuda_check.h"
#include "common/cuda_workspace.h"

namespace fusekit::detail {

CudaDeviceGuard::CudaDeviceGuard(int device) {
  int current = 0;
  FUSEKIT_CUDA_CHECK(cudaGetDevice(&current));
  if (current != device) {
    FUSEKIT_CUDA_CHECK(cudaSetDevice(device));
    previous_ = current;
  }
}

CudaDeviceGuard::~CudaDeviceGuard() {
  if (previous_ >= 0) cudaSetDevice(previous_);  // a destructor must not throw
}

namespace {

// One device attribute, read once per device.
int cached_attribute(cudaDeviceAttr attribute, int device) {
  struct Entry {
    cudaDeviceAttr attribute;
    std::array<int, kMaxDevices> values{};
    std::array<bool, kMaxDevices> known{};
  };
  static std::array<Entry, 5> cache{{{cudaDevAttrMultiProcessorCount},
                                     {cudaDevAttrComputeCapabilityMajor},
                                     {cudaDevAttrComputeCapabilityMinor},
                                     {cudaDevAttrMaxSharedMemoryPerBlockOptin},
                                     {cudaDevAttrMaxSharedMemoryPerMultiprocessor}}};
  static std::mutex mutex;
  FUSEKIT_CHECK(device >= 0 && device < kMaxDevices, "CUDA device index ", device, " out of range");
  for (Entry& e : cache) {
    if (e.attribute != attribute) continue;
    std::lock_guard lock(mutex);
    if (!e.known[device]) {
      FUSEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&e.values[device], attribute, device));
      e.known[device] = true;
    }
    return e.values[device];
  }
  int value = 0;
  FUSEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&value, attribute, device));
  return value;
}

}  // namespace

int multiprocessor_count(int device) { return cached_attribute(cudaDevAttrMultiProcessorCount, device); }

int compute_capability_major(int device) {
  return cached_attribute(cudaDevAttrComputeCapabilityMajor, device);
}

bool has_warpgroup_mma(int device) {
  static constexpr std::string_view kArchitectures = FUSEKIT_CUDA_ARCHITECTURES;
  return compute_capability_major(device) == 9 &&
         cached_attribute(cudaDevAttrComputeCapabilityMinor, device) == 0 &&
         kArchitectures.find("90a") != std::string_view::npos;
}

int max_shared_memory_per_block(int device) {
  return cached_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
}

int shared_memory_per_multiprocessor(int device) {
  return cached_attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
}

cudaStream_t stream_on(const char* op, Stream stream, int device) {
  const auto s = static_cast<cudaStream_t>(stream.handle);
  if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) return s;
#if CUDART_VERSION >= 12080
  // Asking a stream that is being captured fails and invalidates the capture.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  FUSEKIT_CUDA_CHECK(cudaStreamIsCapturing(s, &capture));
  if (capture != cudaStreamCaptureStatusNone) return s;
  int owner = 0;
  FUSEKIT_CUDA_CHECK(cudaStreamGetDevice(s, &owner));
  FUSEKIT_CHECK(owner == device, op, ": stream belongs to cuda:", owner,
                " but the tensors are on cuda:", device, "; expected a stream of cuda:", device);
#endif
  return s;
}

cudaMemPool_t workspace_pool(int device) {
  static std::mutex mutex;
  static std::map<int, cudaMemPool_t> pools;
  const std::lock_guard lock(mutex);
  auto it = pools.find(device);
  if (it == pools.end()) {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    cudaMemPool_t pool = nullptr;
    FUSEKIT_CUDA_CHECK(cudaMemPoolCreate(&pool, &props));
    std::uint64_t keep = UINT64_MAX;  // keep reserved memory across synchronisations
    FUSEKIT_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    it = pools.emplace(device, pool).first;
  }
  return it->second;
}

}  // namespace fusekit::detail
