// The CPU backend of mhc_post: the formula, row by row. Each task stages a block of its rows as
// float32 (any strides, any dtype), so the arithmetic loops are plain and vectorise.
#include <algorithm>

#include "common/dispatch.h"
#include "common/half.h"
#include "ops/mhc_post/mhc_post_params.h"

namespace fusekit::detail {

namespace {

constexpr std::int64_t kBlockH = 1024;  // columns per task: rows staged as float, loops vectorise
constexpr std::int64_t kMinParallelWork = 1 << 16;  // elements; below this threads cost more than they save

// Reads elements [h0, h0 + len) of a strided row as floats.
template <typename T>
void gather(const T* row, std::int64_t stride, std::int64_t h0, std::int64_t len, float* dst) {
  for (std::int64_t k = 0; k < len; ++k) dst[k] = to_float(row[(h0 + k) * stride]);
}

template <typename T>
void scatter(const float* src, std::int64_t len, T* row, std::int64_t stride, std::int64_t h0) {
  for (std::int64_t k = 0; k < len; ++k) row[(h0 + k) * stride] = from_float<T>(src[k]);
}

// out[n, i, h] = post[n, i] * x[n, h] + sum_j comb[n, j, i] * residual[n, j, h], in float32, the
// terms added in the order of the formula (the CUDA kernels use the same order, with FMAs).
template <typename T>
void forward(const MhcPostParams& p) {
  const auto* x = static_cast<const T*>(p.x);
  const auto* res = static_cast<const T*>(p.residual);
  auto* out = static_cast<T*>(p.out);
  const std::int64_t blocks = (p.h + kBlockH - 1) / kBlockH;

#pragma omp parallel for schedule(static) if (p.n * p.h * p.hc > kMinParallelWork)
  for (std::int64_t task = 0; task < p.n * blocks; ++task) {
    const std::int64_t n = task / blocks;
    const std::int64_t h0 = (task % blocks) * kBlockH;
    const std::int64_t len = std::min(kBlockH, p.h - h0);
    float xs[kBlockH], rs[kMhcPostMaxHc][kBlockH], acc[kBlockH];  // [len] x, [hc, len] residual, [len] out row
    gather(x + n * p.x_stride[0], p.x_stride[1], h0, len, xs);
    for (int j = 0; j < p.hc; ++j) {
      gather(res + n * p.residual_stride[0] + j * p.residual_stride[1], p.residual_stride[2], h0, len, rs[j]);
    }
    for (int i = 0; i < p.hc; ++i) {
      const float post = p.post[n * p.post_stride[0] + i * p.post_stride[1]];
      for (std::int64_t k = 0; k < len; ++k) acc[k] = post * xs[k];
      for (int j = 0; j < p.hc; ++j) {
        const float c = p.comb[n * p.comb_stride[0] + j * p.comb_stride[1] + i * p.comb_stride[2]];
        for (std::int64_t k = 0; k < len; ++k) acc[k] += c * rs[j][k];
      }
      scatter(acc, len, out + n * p.out_stride[0] + i * p.out_stride[1], p.out_stride[2], h0);
    }
  }
}

// Element-wise gradients in float32; the sums over H of grad_post and grad_comb in double, in
// index order, so the result is deterministic and more accurate than any float32 order.
template <typename T>
void backward(const MhcPostBackwardParams& p) {
  const auto* g = static_cast<const T*>(p.grad_out);
  const auto* x = static_cast<const T*>(p.x);
  const auto* res = static_cast<const T*>(p.residual);
  auto* gx = static_cast<T*>(p.grad_x);
  auto* gres = static_cast<T*>(p.grad_residual);

#pragma omp parallel for schedule(static) if (p.n * p.h * p.hc > kMinParallelWork)
  for (std::int64_t n = 0; n < p.n; ++n) {
    double sum_post[kMhcPostMaxHc] = {}, sum_comb[kMhcPostMaxHc][kMhcPostMaxHc] = {};
    float gs[kMhcPostMaxHc][kBlockH], xs[kBlockH], rs[kMhcPostMaxHc][kBlockH], acc[kBlockH];
    float post[kMhcPostMaxHc], comb[kMhcPostMaxHc][kMhcPostMaxHc];
    for (int i = 0; i < p.hc; ++i) post[i] = p.post[n * p.post_stride[0] + i * p.post_stride[1]];
    for (int j = 0; j < p.hc; ++j)
      for (int i = 0; i < p.hc; ++i)
        comb[j][i] = p.comb[n * p.comb_stride[0] + j * p.comb_stride[1] + i * p.comb_stride[2]];

    for (std::int64_t h0 = 0; h0 < p.h; h0 += kBlockH) {
      const std::int64_t len = std::min(kBlockH, p.h - h0);
      for (int i = 0; i < p.hc; ++i) {
        gather(g + n * p.grad_out_stride[0] + i * p.grad_out_stride[1], p.grad_out_stride[2], h0, len, gs[i]);
      }
      gather(x + n * p.x_stride[0], p.x_stride[1], h0, len, xs);
      for (int j = 0; j < p.hc; ++j) {
        gather(res + n * p.residual_stride[0] + j * p.residual_stride[1], p.residual_stride[2], h0, len, rs[j]);
      }
      // grad_x[n, h] = sum_i post[n, i] * g[n, i, h]
      std::fill(acc, acc + len, 0.f);
      for (int i = 0; i < p.hc; ++i)
        for (std::int64_t k = 0; k < len; ++k) acc[k] += post[i] * gs[i][k];
      scatter(acc, len, gx + n * p.grad_x_stride[0], p.grad_x_stride[1], h0);
      // grad_residual[n, j, h] = sum_i comb[n, j, i] * g[n, i, h]
      for (int j = 0; j < p.hc; ++j) {
        std::fill(acc, acc + len, 0.f);
        for (int i = 0; i < p.hc; ++i)
          for (std::int64_t k = 0; k < len; ++k) acc[k] += comb[j][i] * gs[i][k];
        scatter(acc, len, gres + n * p.grad_residual_stride[0] + j * p.grad_residual_stride[1],
                p.grad_residual_stride[2], h0);
      }
      // grad_post[n, i] += sum_h g[n, i, h] * x[n, h];  grad_comb[n, j, i] += sum_h res[n, j, h] * g[n, i, h]
      for (int i = 0; i < p.hc; ++i) {
        for (std::int64_t k = 0; k < len; ++k) sum_post[i] += double(gs[i][k]) * xs[k];
        for (int j = 0; j < p.hc; ++j)
          for (std::int64_t k = 0; k < len; ++k) sum_comb[j][i] += double(rs[j][k]) * gs[i][k];
      }
    }
    for (int i = 0; i < p.hc; ++i) {
      p.grad_post[n * p.grad_post_stride[0] + i * p.grad_post_stride[1]] = static_cast<float>(sum_post[i]);
      for (int j = 0; j < p.hc; ++j) {
        p.grad_comb[n * p.grad_comb_stride[0] + j * p.grad_comb_stride[1] + i * p.grad_comb_stride[2]] =
            static_cast<float>(sum_comb[j][i]);
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
