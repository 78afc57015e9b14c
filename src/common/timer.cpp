#include "common/timer.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "common/memory.h"
#include "fusekit/error.h"

#ifdef FUSEKIT_WITH_CUDA
#include "common/cuda_check.h"
#endif

namespace fusekit::detail {

namespace {

Timing summarise(std::vector<double> samples_us) {
  std::sort(samples_us.begin(), samples_us.end());
  Timing t;
  t.runs = static_cast<int>(samples_us.size());
  t.min_us = samples_us.front();
  const std::size_t mid = samples_us.size() / 2;
  t.median_us = samples_us.size() % 2 ? samples_us[mid] : 0.5 * (samples_us[mid - 1] + samples_us[mid]);
  return t;
}

Timing time_cpu(const std::function<void()>& fn, const TimerOptions& options) {
  using clock = std::chrono::steady_clock;
  for (int i = 0; i < options.warmup; ++i) fn();
  std::vector<double> samples;
  const auto start = clock::now();
  for (int i = 0; i < options.repeats; ++i) {
    const auto t0 = clock::now();
    fn();
    const auto t1 = clock::now();
    samples.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    if (i >= 2 && std::chrono::duration<double>(t1 - start).count() > options.max_seconds) break;
  }
  return summarise(std::move(samples));
}

#ifdef FUSEKIT_WITH_CUDA
class Event {
 public:
  Event() { FUSEKIT_CUDA_CHECK(cudaEventCreate(&event_)); }
  ~Event() { cudaEventDestroy(event_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_{};
};

Timing time_cuda(Device device, Stream stream, const std::function<void()>& fn,
                 const TimerOptions& options) {
  CudaDeviceGuard guard(device.index);
  const auto s = static_cast<cudaStream_t>(stream.handle);
  int l2_bytes = 0;
  FUSEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device.index));
  Buffer flush(device, options.flush_l2 ? 4 * static_cast<std::size_t>(l2_bytes) : 0);
  for (int i = 0; i < options.warmup; ++i) fn();
  FUSEKIT_CUDA_CHECK(cudaStreamSynchronize(s));

  std::vector<double> samples;
  Event begin, end;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < options.repeats; ++i) {
    if (flush.bytes()) FUSEKIT_CUDA_CHECK(cudaMemsetAsync(flush.data(), i & 0xff, flush.bytes(), s));
    FUSEKIT_CUDA_CHECK(cudaEventRecord(begin.get(), s));
    fn();
    FUSEKIT_CUDA_CHECK(cudaEventRecord(end.get(), s));
    FUSEKIT_CUDA_CHECK(cudaEventSynchronize(end.get()));
    float ms = 0;
    FUSEKIT_CUDA_CHECK(cudaEventElapsedTime(&ms, begin.get(), end.get()));
    samples.push_back(1e3 * ms);
    const double spent = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (i >= 2 && spent > options.max_seconds) break;
  }
  return summarise(std::move(samples));
}
#endif

}  // namespace

Timing time_it(Device device, Stream stream, const std::function<void()>& fn,
               const TimerOptions& options) {
  FUSEKIT_CHECK(options.repeats >= 1, "time_it: repeats must be >= 1, got ", options.repeats);
  if (device.kind == DeviceKind::CPU) return time_cpu(fn, options);
#ifdef FUSEKIT_WITH_CUDA
  return time_cuda(device, stream, fn, options);
#else
  (void)stream;
  throw Error("time_it: fusekit was built without CUDA");
#endif
}

double measure_copy_bandwidth(Device device) {
  if (device.kind == DeviceKind::CPU) {
    constexpr std::size_t kBytes = std::size_t{256} << 20;
    Buffer src(device, kBytes), dst(device, kBytes);
    src.fill_bytes(1);
    dst.fill_bytes(0);
    auto* s = static_cast<const char*>(src.data());
    auto* d = static_cast<char*>(dst.data());
    constexpr std::int64_t kChunk = std::int64_t{1} << 20;
    constexpr std::int64_t kChunks = static_cast<std::int64_t>(kBytes) / kChunk;
    const Timing t = time_it(device, {}, [&] {
#pragma omp parallel for schedule(static)
      for (std::int64_t c = 0; c < kChunks; ++c) std::memcpy(d + c * kChunk, s + c * kChunk, kChunk);
    }, {.warmup = 2, .repeats = 10, .max_seconds = 2.0, .flush_l2 = false});
    return 2.0 * kBytes / (t.median_us * 1e-6);
  }
#ifdef FUSEKIT_WITH_CUDA
  constexpr std::size_t kBytes = std::size_t{1} << 30;
  Buffer src(device, kBytes), dst(device, kBytes);
  src.fill_bytes(1);
  const Timing t = time_it(device, {}, [&] {
    FUSEKIT_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), kBytes, cudaMemcpyDeviceToDevice, nullptr));
  }, {.warmup = 3, .repeats = 20, .max_seconds = 2.0, .flush_l2 = false});
  return 2.0 * kBytes / (t.median_us * 1e-6);
#else
  throw Error("measure_copy_bandwidth: fusekit was built without CUDA");
#endif
}

}  // namespace fusekit::detail
