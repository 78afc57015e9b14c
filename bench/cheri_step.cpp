// One cheri_block training step through the C++ API, for timing it kernel by kernel: the
// forward that keeps y for the backward, then the backward, float32 with TF32 allowed (as the
// model trains), C = 128 channels unless given, expansion 2, dilation d. Runs `steps` steps, then
// times `timed` more back to back with CUDA events (no flush) and prints their mean, with the
// host's time in the calls per step (below the mean, the GPU bounds it).
//
//   build/.../fusekit_cheri_step N L [C [d [steps [timed]]]]      (defaults C 128, d 4, 2, 20)
//
// Under a profiler, each kernel of a step alone (bench/NOTES.md, "The training step at N64"):
//
//   ncu --metrics gpu__time_duration.sum --print-units base --csv \
//       build/.../fusekit_cheri_step 64 2114 128 4 2 0

#include <cuda_runtime.h>
#include <fusekit/fusekit.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "common/cuda_check.h"

namespace {

using fusekit::DType;
using fusekit::TensorView;

// A device buffer of `bytes`, zeroed (freed at exit).
void* device_bytes(std::size_t bytes) {
  void* p = nullptr;
  FUSEKIT_CUDA_CHECK(cudaMalloc(&p, bytes));
  FUSEKIT_CUDA_CHECK(cudaMemset(p, 0, bytes));
  return p;
}

// n floats drawn from N(0, scale^2).
float* device_normal(std::size_t n, float scale, std::mt19937& gen) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> host(n);
  for (float& v : host) v = scale * dist(gen);
  auto* p = static_cast<float*>(device_bytes(n * sizeof(float)));
  FUSEKIT_CUDA_CHECK(cudaMemcpy(p, host.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  return p;
}

// The tool's work; fusekit::Error (from the library or a failed CUDA call) is caught by main.
int run(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s N L [C [d [steps [timed]]]]\n", argv[0]);
    return 2;
  }
  const auto arg = [&](int i, long long fallback) {
    return argc > i ? std::atoll(argv[i]) : fallback;
  };
  const std::int64_t n = arg(1, 0), l = arg(2, 0), c = arg(3, 128), d = arg(4, 4);
  const int steps = static_cast<int>(arg(5, 2)), timed = static_cast<int>(arg(6, 20));
  if (n < 1 || l < 1 || c < 1 || d < 1 || steps < 0 || timed < 0) {
    std::fprintf(stderr, "fusekit_cheri_step: N, L, C and d must be at least 1, steps and timed "
                         "at least 0\n");
    return 2;
  }
  const std::int64_t hidden = 2 * c;
  const auto cuda = fusekit::Device::cuda(0);
  std::mt19937 gen(1);
  // x and grad_out ~ N(0, 1); the weights as bench/cheri_block.py draws them (taps N(0, 0.25),
  // the Linear weights N(0, 1 / fan_in)).
  float* x = device_normal(n * l * c, 1.0f, gen);
  float* grad_out = device_normal(n * l * c, 1.0f, gen);
  float* conv = device_normal(3 * c, 0.5f, gen);
  float* linear1 = device_normal(hidden * c, 1.0f / std::sqrt(static_cast<float>(c)), gen);
  float* linear2 = device_normal(c * hidden, 1.0f / std::sqrt(static_cast<float>(hidden)), gen);
  auto* out = static_cast<float*>(device_bytes(n * l * c * sizeof(float)));
  auto* grad_x = static_cast<float*>(device_bytes(n * l * c * sizeof(float)));
  auto* grad_conv = static_cast<float*>(device_bytes(3 * c * sizeof(float)));
  auto* grad_linear1 = static_cast<float*>(device_bytes(hidden * c * sizeof(float)));
  auto* grad_linear2 = static_cast<float*>(device_bytes(c * hidden * sizeof(float)));
  auto* mean = static_cast<float*>(device_bytes(n * sizeof(float)));
  auto* rstd = static_cast<float*>(device_bytes(n * sizeof(float)));

  const TensorView xv(x, DType::Float32, {n, l, c}, cuda);
  const fusekit::CheriBlockWeights weights{
      TensorView(conv, DType::Float32, {3, c}, cuda),
      TensorView(linear1, DType::Float32, {hidden, c}, cuda),
      TensorView(linear2, DType::Float32, {c, hidden}, cuda)};
  const fusekit::CheriBlockWeights grads{
      TensorView(grad_conv, DType::Float32, {3, c}, cuda),
      TensorView(grad_linear1, DType::Float32, {hidden, c}, cuda),
      TensorView(grad_linear2, DType::Float32, {c, hidden}, cuda)};
  fusekit::CheriBlockOptions options;
  options.dilation = d;
  const std::int64_t saved_bytes = fusekit::cheri_block_saved_bytes(xv, weights, options);
  const TensorView saved =
      saved_bytes > 0
          ? TensorView(device_bytes(static_cast<std::size_t>(saved_bytes)), DType::UInt8,
                       {saved_bytes}, cuda)
          : TensorView();
  const TensorView mean_v(mean, DType::Float32, {n}, cuda), rstd_v(rstd, DType::Float32, {n}, cuda);
  const TensorView out_v(out, DType::Float32, {n, l, c}, cuda),
      grad_x_v(grad_x, DType::Float32, {n, l, c}, cuda),
      grad_out_v(grad_out, DType::Float32, {n, l, c}, cuda);

  const auto step = [&] {
    fusekit::cheri_block(out_v, mean_v, rstd_v, saved, xv, weights, options);
    fusekit::cheri_block_backward(grad_x_v, grads, grad_out_v, xv, weights, mean_v, rstd_v, saved,
                                  options);
  };
  for (int i = 0; i < steps; ++i) step();
  FUSEKIT_CUDA_CHECK(cudaDeviceSynchronize());
  if (timed > 0) {
    cudaEvent_t start, stop;
    FUSEKIT_CUDA_CHECK(cudaEventCreate(&start));
    FUSEKIT_CUDA_CHECK(cudaEventCreate(&stop));
    FUSEKIT_CUDA_CHECK(cudaEventRecord(start));
    const auto host_start = std::chrono::steady_clock::now();
    for (int i = 0; i < timed; ++i) step();
    const std::chrono::duration<double, std::micro> host =
        std::chrono::steady_clock::now() - host_start;
    FUSEKIT_CUDA_CHECK(cudaEventRecord(stop));
    FUSEKIT_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    FUSEKIT_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    std::printf("cheri_block training step N%lld L%lld C%lld d%lld: %.1f us (mean of %d, back to "
                "back; the host's calls %.1f us a step)\n",
                static_cast<long long>(n), static_cast<long long>(l), static_cast<long long>(c),
                static_cast<long long>(d), 1000.0 * ms / timed, timed, host.count() / timed);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const fusekit::Error& e) {
    std::fprintf(stderr, "fusekit_cheri_step: %s\n", e.what());
    return 1;
  }
}
