// The CPU backend of mhc_post: the formula, row by row, float32 products and sums for the forward
// (as the CUDA backend) and double sums for the reductions of the backward.
#include <algorithm>

#include "common/dispatch.h"
#include "common/half.h"
#include "ops/mhc_post/mhc_post_params.h"

namespace fusekit::detail {

namespace {

constexpr std::int64_t kBlockH = 2048;  // columns per task, so that few long rows still spread

template <typename T>
void forward(const MhcPostParams& p) {
  const auto* x = static_cast<const T*>(p.x);
  const auto* res = static_cast<const T*>(p.residual);
  auto* out = static_cast<T*>(p.out);
  const std::int64_t blocks = (p.h + kBlockH - 1) / kBlockH;

#pragma omp parallel for schedule(static)
  for (std::int64_t task = 0; task < p.n * blocks; ++task) {
    const std::int64_t n = task / blocks;
    const std::int64_t h_begin = (task % blocks) * kBlockH;
    const std::int64_t h_end = std::min(p.h, h_begin + kBlockH);
    for (int i = 0; i < p.hc; ++i) {
      const float post = p.post[n * p.post_stride[0] + i * p.post_stride[1]];
      for (std::int64_t h = h_begin; h < h_end; ++h) {
        float acc = post * to_float(x[n * p.x_stride[0] + h * p.x_stride[1]]);
        for (int j = 0; j < p.hc; ++j) {
          const float c = p.comb[n * p.comb_stride[0] + j * p.comb_stride[1] + i * p.comb_stride[2]];
          acc += c * to_float(res[n * p.residual_stride[0] + j * p.residual_stride[1] +
                                  h * p.residual_stride[2]]);
        }
        out[n * p.out_stride[0] + i * p.out_stride[1] + h * p.out_stride[2]] = from_float<T>(acc);
      }
    }
  }
}

template <typename T>
void backward(const MhcPostBackwardParams& p) {
  const auto* g = static_cast<const T*>(p.grad_out);
  const auto* x = static_cast<const T*>(p.x);
  const auto* res = static_cast<const T*>(p.residual);
  auto* gx = static_cast<T*>(p.grad_x);
  auto* gres = static_cast<T*>(p.grad_residual);
  auto grad = [&](std::int64_t n, int i, std::int64_t h) {
    return to_float(g[n * p.grad_out_stride[0] + i * p.grad_out_stride[1] + h * p.grad_out_stride[2]]);
  };
  auto post = [&](std::int64_t n, int i) { return p.post[n * p.post_stride[0] + i * p.post_stride[1]]; };
  auto comb = [&](std::int64_t n, int j, int i) {
    return p.comb[n * p.comb_stride[0] + j * p.comb_stride[1] + i * p.comb_stride[2]];
  };

#pragma omp parallel for schedule(static)
  for (std::int64_t n = 0; n < p.n; ++n) {
    // grad_x[n, h] = sum_i post[n, i] * g[n, i, h]
    for (std::int64_t h = 0; h < p.h; ++h) {
      float acc = 0.f;
      for (int i = 0; i < p.hc; ++i) acc += post(n, i) * grad(n, i, h);
      gx[n * p.grad_x_stride[0] + h * p.grad_x_stride[1]] = from_float<T>(acc);
    }
    // grad_residual[n, j, h] = sum_i comb[n, j, i] * g[n, i, h]
    for (int j = 0; j < p.hc; ++j) {
      for (std::int64_t h = 0; h < p.h; ++h) {
        float acc = 0.f;
        for (int i = 0; i < p.hc; ++i) acc += comb(n, j, i) * grad(n, i, h);
        gres[n * p.grad_residual_stride[0] + j * p.grad_residual_stride[1] +
             h * p.grad_residual_stride[2]] = from_float<T>(acc);
      }
    }
    // grad_post[n, i] = sum_h g[n, i, h] * x[n, h];  grad_comb[n, j, i] = sum_h res[n, j, h] * g[n, i, h]
    for (int i = 0; i < p.hc; ++i) {
      double acc = 0.0;
      for (std::int64_t h = 0; h < p.h; ++h) {
        acc += double(grad(n, i, h)) * double(to_float(x[n * p.x_stride[0] + h * p.x_stride[1]]));
      }
      p.grad_post[n * p.grad_post_stride[0] + i * p.grad_post_stride[1]] = static_cast<float>(acc);
      for (int j = 0; j < p.hc; ++j) {
        double cacc = 0.0;
        for (std::int64_t h = 0; h < p.h; ++h) {
          const float r = to_float(res[n * p.residual_stride[0] + j * p.residual_stride[1] +
                                       h * p.residual_stride[2]]);
          cacc += double(r) * double(grad(n, i, h));
        }
        p.grad_comb[n * p.grad_comb_stride[0] + j * p.grad_comb_stride[1] + i * p.grad_comb_stride[2]] =
            static_cast<float>(cacc);
      }
    }
  }
}

}  // namespace

void mhc_post_cpu(const MhcPostParams& p) {
  dispatch_floating(p.dtype, "mhc_post", [&](auto tag) {
    forward<typename HostType<decltype(tag)::value>::type>(p);
  });
}

void mhc_post_backward_cpu(const MhcPostBackwardParams& p) {
  dispatch_floating(p.dtype, "mhc_post_backward", [&](auto tag) {
    backward<typename HostType<decltype(tag)::value>::type>(p);
  });
}

}  // namespace fusekit::detail
