// The CPU backend of the cheri_block family, in float32 with double statistics.
//
// Example by example (in parallel): x as float32, the dilated convolution, the plane's mean and
// variance in double (two passes), y. The MLP runs on chunks of whole examples (about kChunkRows
// rows) as two BLAS products over all their rows. The backward recomputes conv, y and h from x and
// the saved statistics, then runs the chain rule back through the products (four more) and the
// norm and the convolution, example by example.
//
// Determinism: every element of out, y and grad_x is computed by one thread in a fixed order.
// The weight gradients are sums over examples: the linear ones are one product per chunk (its sum
// over the chunk's rows inside the BLAS, which splits the output, never the sum) added in chunk
// order into double; the convolution's is one double partial per example, added in example
// order. Chunks are cut by the shape alone, so results do not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/cpu_gemm.h"
#include "common/dispatch.h"
#include "common/half.h"
#include "ops/cheri_block/cheri_block_params.h"

namespace fusekit::detail {

namespace {

constexpr const char* kOp = "cheri_block";
constexpr std::int64_t kChunkRows = 4096;            // rows (examples x L) per chunk of the MLP
constexpr std::int64_t kMinParallelWork = 1 << 15;   // elements; below this threads cost more
constexpr float kGeluScale = 0.7978845608028654f;    // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

float gelu_tanh(float h) {
  return 0.5f * h * (1.0f + std::tanh(kGeluScale * (h + kGeluCubic * h * h * h)));
}

float gelu_tanh_grad(float h) {
  const float t = std::tanh(kGeluScale * (h + kGeluCubic * h * h * h));
  return 0.5f * (1.0f + t) +
         0.5f * h * (1.0f - t * t) * kGeluScale * (1.0f + 3.0f * kGeluCubic * h * h);
}

// A weight as a row-major float32 [rows, cols], or its transpose [cols, rows].
std::vector<float> load_matrix(const CheriMatrix& m, std::int64_t rows, std::int64_t cols,
                               bool transposed) {
  std::vector<float> v(static_cast<std::size_t>(rows * cols));
  dispatch_floating(m.dtype, kOp, [&](auto tag) {
    using T = typename HostType<decltype(tag)::value>::type;
    const auto* src = static_cast<const T*>(m.data);
    for (std::int64_t i = 0; i < rows; ++i) {
      for (std::int64_t j = 0; j < cols; ++j) {
        const float value = to_float(src[i * m.stride[0] + j * m.stride[1]]);
        v[transposed ? j * rows + i : i * cols + j] = value;
      }
    }
  });
  return v;
}

// A weight gradient [rows, cols] (row-major doubles) written in its dtype and layout.
void store_matrix(const CheriMatrix& m, std::int64_t rows, std::int64_t cols,
                  const std::vector<double>& v) {
  dispatch_floating(m.dtype, kOp, [&](auto tag) {
    using T = typename HostType<decltype(tag)::value>::type;
    auto* dst = static_cast<T*>(m.data);
    for (std::int64_t i = 0; i < rows; ++i) {
      for (std::int64_t j = 0; j < cols; ++j) {
        dst[i * m.stride[0] + j * m.stride[1]] = from_float<T>(static_cast<float>(v[i * cols + j]));
      }
    }
  });
}

// dst[c, r] = src[r, c] for a row-major [rows, cols] src.
void transpose(const float* src, std::int64_t rows, std::int64_t cols, float* dst) {
#pragma omp parallel for schedule(static) if (rows * cols > kMinParallelWork)
  for (std::int64_t c = 0; c < cols; ++c) {
    for (std::int64_t r = 0; r < rows; ++r) dst[c * rows + r] = src[r * cols + c];
  }
}

template <typename T>
const T* row_of(const CheriActivation& a, std::int64_t n, std::int64_t l) {
  return static_cast<const T*>(a.data) + n * a.stride[0] + l * a.stride[1];
}

template <typename T>
T* out_row_of(const CheriActivation& a, std::int64_t n, std::int64_t l) {
  return static_cast<T*>(a.data) + n * a.stride[0] + l * a.stride[1];
}

// Example n of an [N, L, C] tensor as a float32 [L, C].
template <typename T>
void load_example(const CheriBlockParams& p, const CheriActivation& a, std::int64_t n,
                  float* dst) {
  for (std::int64_t l = 0; l < p.l; ++l) {
    const T* src = row_of<T>(a, n, l);
    float* row = dst + l * p.c;
    for (std::int64_t c = 0; c < p.c; ++c) row[c] = to_float(src[c]);
  }
}

// conv [L, C] of one example from its x [L, C] and the taps w [3, C] (zero outside 0 <= l < L).
void dilated_conv(const CheriBlockParams& p, const float* x, const float* w, float* conv) {
  const std::int64_t len = p.l, ch = p.c, d = p.dilation;
  for (std::int64_t l = 0; l < len; ++l) {
    const float* mid = x + l * ch;
    const float* left = l - d >= 0 ? x + (l - d) * ch : nullptr;
    const float* right = l + d < len ? x + (l + d) * ch : nullptr;
    float* dst = conv + l * ch;
    for (std::int64_t c = 0; c < ch; ++c) {
      float v = w[ch + c] * mid[c];
      if (left) v += w[c] * left[c];
      if (right) v += w[2 * ch + c] * right[c];
      dst[c] = v;
    }
  }
}

struct PlaneStats {
  double mean, rstd;
};

// Mean and 1 / sqrt(biased variance + eps) of `count` values: two passes in double.
PlaneStats plane_stats(const float* v, std::int64_t count, double eps) {
  double sum = 0;
  for (std::int64_t i = 0; i < count; ++i) sum += v[i];
  const double mean = sum / static_cast<double>(count);
  double sq = 0;
  for (std::int64_t i = 0; i < count; ++i) sq += (v[i] - mean) * (v[i] - mean);
  return {mean, 1.0 / std::sqrt(sq / static_cast<double>(count) + eps)};
}

void normalize(float* v, std::int64_t count, double mean, double rstd) {
  for (std::int64_t i = 0; i < count; ++i) v[i] = static_cast<float>((v[i] - mean) * rstd);
}

// The forward's first half for example n: y [L, C] float32 into `y`; x [L, C] float32 scratch.
// The statistics come from the plane (forward), or from the saved mean and rstd (backward).
template <typename T>
void conv_norm_example(const CheriBlockParams& p, const float* w, std::int64_t n, float* x,
                       float* y, bool saved) {
  const std::int64_t plane = p.l * p.c;
  load_example<T>(p, p.x, n, x);
  dilated_conv(p, x, w, y);
  if (saved) {
    normalize(y, plane, p.saved_mean.data[n * p.saved_mean.stride],
              p.saved_rstd.data[n * p.saved_rstd.stride]);
    return;
  }
  const PlaneStats s = plane_stats(y, plane, p.eps);
  normalize(y, plane, s.mean, s.rstd);
  if (p.mean.data) p.mean.data[n * p.mean.stride] = static_cast<float>(s.mean);
  if (p.rstd.data) p.rstd.data[n * p.rstd.stride] = static_cast<float>(s.rstd);
}

// The backward of the norm and the convolution for example n, given y [L, C] and dy [L, C]
// (overwritten with dconv): grad_x (plus grad_out when `residual`) and the example's
// convolution weight gradient [3, C] into `grad_w`. x [L, C] float32 scratch.
template <typename T>
void conv_norm_backward_example(const CheriBlockParams& p, const float* w, std::int64_t n,
                                const float* y, float* dy, float* x, bool residual,
                                double* grad_w) {
  const std::int64_t len = p.l, ch = p.c, d = p.dilation, plane = len * ch;
  // dconv = rstd (dy - mean(dy) - y mean(dy y)), the means over the plane
  double sum_dy = 0, sum_dy_y = 0;
  for (std::int64_t i = 0; i < plane; ++i) {
    sum_dy += dy[i];
    sum_dy_y += static_cast<double>(dy[i]) * y[i];
  }
  const double mean_dy = sum_dy / static_cast<double>(plane);
  const double mean_dy_y = sum_dy_y / static_cast<double>(plane);
  const double rstd = p.saved_rstd.data[n * p.saved_rstd.stride];
  for (std::int64_t i = 0; i < plane; ++i) {
    dy[i] = static_cast<float>(rstd * (dy[i] - mean_dy - y[i] * mean_dy_y));
  }
  const float* dconv = dy;

  load_example<T>(p, p.x, n, x);
  std::fill_n(grad_w, 3 * ch, 0.0);
  for (std::int64_t l = 0; l < len; ++l) {
    const float* g_mid = dconv + l * ch;
    const float* g_right = l + d < len ? dconv + (l + d) * ch : nullptr;  // reads x[l] via w0
    const float* g_left = l - d >= 0 ? dconv + (l - d) * ch : nullptr;    // reads x[l] via w2
    const float* x_mid = x + l * ch;
    const float* x_left = l - d >= 0 ? x + (l - d) * ch : nullptr;
    const float* x_right = l + d < len ? x + (l + d) * ch : nullptr;
    const T* gout = residual ? row_of<T>(p.grad_out, n, l) : nullptr;
    T* gx = out_row_of<T>(p.grad_x, n, l);
    for (std::int64_t c = 0; c < ch; ++c) {
      float v = w[ch + c] * g_mid[c];
      if (g_right) v += w[c] * g_right[c];
      if (g_left) v += w[2 * ch + c] * g_left[c];
      if (residual) v += to_float(gout[c]);
      gx[c] = from_float<T>(v);
      grad_w[ch + c] += static_cast<double>(g_mid[c]) * x_mid[c];
      if (x_left) grad_w[c] += static_cast<double>(g_mid[c]) * x_left[c];
      if (x_right) grad_w[2 * ch + c] += static_cast<double>(g_mid[c]) * x_right[c];
    }
  }
}

// ------------------------------------------------------------------------------------ passes

template <typename T>
void conv_norm_forward(const CheriBlockParams& p) {
  const std::int64_t plane = p.l * p.c;
  const std::vector<float> w = load_matrix(p.conv_weight, 3, p.c, false);
#pragma omp parallel if (p.n * plane > kMinParallelWork)
  {
    std::vector<float> x(static_cast<std::size_t>(plane)), y(static_cast<std::size_t>(plane));
#pragma omp for schedule(static)
    for (std::int64_t n = 0; n < p.n; ++n) {
      conv_norm_example<T>(p, w.data(), n, x.data(), y.data(), false);
      for (std::int64_t l = 0; l < p.l; ++l) {
        T* dst = out_row_of<T>(p.out, n, l);
        const float* src = y.data() + l * p.c;
        for (std::int64_t c = 0; c < p.c; ++c) dst[c] = from_float<T>(src[c]);
      }
    }
  }
}

template <typename T>
void conv_norm_backward(const CheriBlockParams& p) {
  const std::int64_t plane = p.l * p.c;
  const std::vector<float> w = load_matrix(p.conv_weight, 3, p.c, false);
  std::vector<double> partial(static_cast<std::size_t>(p.n * 3 * p.c));  // [N, 3, C]
#pragma omp parallel if (p.n * plane > kMinParallelWork)
  {
    std::vector<float> x(static_cast<std::size_t>(plane)), y(static_cast<std::size_t>(plane)),
        dy(static_cast<std::size_t>(plane));
#pragma omp for schedule(static)
    for (std::int64_t n = 0; n < p.n; ++n) {
      conv_norm_example<T>(p, w.data(), n, x.data(), y.data(), true);
      load_example<T>(p, p.grad_out, n, dy.data());
      conv_norm_backward_example<T>(p, w.data(), n, y.data(), dy.data(), x.data(), false,
                                    partial.data() + n * 3 * p.c);
    }
  }
  std::vector<double> grad_w(static_cast<std::size_t>(3 * p.c), 0.0);
  for (std::int64_t n = 0; n < p.n; ++n) {
    for (std::int64_t i = 0; i < 3 * p.c; ++i) grad_w[i] += partial[n * 3 * p.c + i];
  }
  store_matrix(p.grad_conv_weight, 3, p.c, grad_w);
}

// Examples per chunk of the MLP: whole examples, about kChunkRows rows; the shape alone decides.
std::int64_t chunk_examples(const CheriBlockParams& p) {
  return std::max<std::int64_t>(1, std::min(p.n, kChunkRows / p.l));
}

template <typename T>
void block_forward(const CheriBlockParams& p) {
  const std::int64_t len = p.l, ch = p.c, hid = p.hidden, plane = len * ch;
  const std::vector<float> w = load_matrix(p.conv_weight, 3, ch, false);
  const std::vector<float> w1 = load_matrix(p.linear1, hid, ch, false);  // [E C, C]
  const std::vector<float> w2 = load_matrix(p.linear2, ch, hid, false);  // [C, E C]
  const std::int64_t chunk = chunk_examples(p);
  const std::int64_t max_rows = chunk * len;
  std::vector<float> y(static_cast<std::size_t>(max_rows * ch));   // [rows, C]
  std::vector<float> h(static_cast<std::size_t>(max_rows * hid));  // [rows, E C], then GELU(h)
  std::vector<float> o(static_cast<std::size_t>(max_rows * ch));   // [rows, C] the MLP's output
  for (std::int64_t n0 = 0; n0 < p.n; n0 += chunk) {
    const std::int64_t count = std::min(chunk, p.n - n0), rows = count * len;
#pragma omp parallel if (count > 1 && rows * ch > kMinParallelWork)
    {
      std::vector<float> x(static_cast<std::size_t>(plane));
#pragma omp for schedule(static)
      for (std::int64_t i = 0; i < count; ++i) {
        conv_norm_example<T>(p, w.data(), n0 + i, x.data(), y.data() + i * plane, false);
      }
    }
    gemm_nt(rows, hid, ch, y.data(), ch, w1.data(), ch, h.data(), hid);
#pragma omp parallel for schedule(static) if (rows * hid > kMinParallelWork)
    for (std::int64_t r = 0; r < rows; ++r) {
      float* row = h.data() + r * hid;
      for (std::int64_t j = 0; j < hid; ++j) row[j] = gelu_tanh(row[j]);
    }
    gemm_nt(rows, ch, hid, h.data(), hid, w2.data(), hid, o.data(), ch);
#pragma omp parallel for schedule(static) if (rows * ch > kMinParallelWork)
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t n = n0 + r / len, l = r % len;
      const T* x = row_of<T>(p.x, n, l);
      T* dst = out_row_of<T>(p.out, n, l);
      const float* src = o.data() + r * ch;
      for (std::int64_t c = 0; c < ch; ++c) {
        dst[c] = from_float<T>(to_float(x[c]) + p.residual_scale * src[c]);
      }
    }
  }
}

template <typename T>
void block_backward(const CheriBlockParams& p) {
  const std::int64_t len = p.l, ch = p.c, hid = p.hidden, plane = len * ch;
  const std::vector<float> w = load_matrix(p.conv_weight, 3, ch, false);
  const std::vector<float> w1 = load_matrix(p.linear1, hid, ch, false);   // [E C, C]
  const std::vector<float> w1t = load_matrix(p.linear1, hid, ch, true);   // [C, E C]
  const std::vector<float> w2t = load_matrix(p.linear2, ch, hid, true);   // [E C, C]
  std::vector<double> grad_w1(static_cast<std::size_t>(hid * ch), 0.0);   // [E C, C]
  std::vector<double> grad_w2(static_cast<std::size_t>(ch * hid), 0.0);   // [C, E C]
  std::vector<double> partial_w(static_cast<std::size_t>(p.n * 3 * ch));  // [N, 3, C]

  const std::int64_t chunk = chunk_examples(p);
  const std::int64_t max_rows = chunk * len;
  auto buffer = [](std::int64_t size) { return std::vector<float>(static_cast<std::size_t>(size)); };
  std::vector<float> y = buffer(max_rows * ch), yt = buffer(ch * max_rows);      // [rows, C], [C, rows]
  std::vector<float> g = buffer(max_rows * hid), gt = buffer(hid * max_rows);    // GELU(h), transposed
  std::vector<float> gp = buffer(max_rows * hid);                                // GELU'(h)
  std::vector<float> dz = buffer(max_rows * ch), dzt = buffer(ch * max_rows);    // s grad_out
  std::vector<float> dh = buffer(max_rows * hid), dht = buffer(hid * max_rows);  // [rows, E C]
  std::vector<float> dy = buffer(max_rows * ch);                                 // [rows, C]
  std::vector<float> part1 = buffer(hid * ch), part2 = buffer(ch * hid);         // per chunk

  for (std::int64_t n0 = 0; n0 < p.n; n0 += chunk) {
    const std::int64_t count = std::min(chunk, p.n - n0), rows = count * len;
    const bool examples_in_parallel = count > 1 && rows * ch > kMinParallelWork;
#pragma omp parallel if (examples_in_parallel)
    {
      std::vector<float> x(static_cast<std::size_t>(plane));
#pragma omp for schedule(static)
      for (std::int64_t i = 0; i < count; ++i) {
        conv_norm_example<T>(p, w.data(), n0 + i, x.data(), y.data() + i * plane, true);
      }
    }
    gemm_nt(rows, hid, ch, y.data(), ch, w1.data(), ch, g.data(), hid);  // h
#pragma omp parallel for schedule(static) if (rows * hid > kMinParallelWork)
    for (std::int64_t r = 0; r < rows; ++r) {
      float* gr = g.data() + r * hid;
      float* gpr = gp.data() + r * hid;
      for (std::int64_t j = 0; j < hid; ++j) {
        gpr[j] = gelu_tanh_grad(gr[j]);
        gr[j] = gelu_tanh(gr[j]);
      }
      const T* gout = row_of<T>(p.grad_out, n0 + r / len, r % len);
      float* dzr = dz.data() + r * ch;
      for (std::int64_t c = 0; c < ch; ++c) dzr[c] = p.residual_scale * to_float(gout[c]);
    }
    gemm_nt(rows, hid, ch, dz.data(), ch, w2t.data(), ch, dh.data(), hid);  // dg = dz W2
#pragma omp parallel for schedule(static) if (rows * hid > kMinParallelWork)
    for (std::int64_t r = 0; r < rows; ++r) {
      float* dhr = dh.data() + r * hid;
      const float* gpr = gp.data() + r * hid;
      for (std::int64_t j = 0; j < hid; ++j) dhr[j] *= gpr[j];
    }
    // grad_w2 += dz^T g and grad_w1 += dh^T y over the chunk's rows, added in chunk order
    transpose(dz.data(), rows, ch, dzt.data());
    transpose(g.data(), rows, hid, gt.data());
    transpose(dh.data(), rows, hid, dht.data());
    transpose(y.data(), rows, ch, yt.data());
    gemm_nt(ch, hid, rows, dzt.data(), rows, gt.data(), rows, part2.data(), hid);
    gemm_nt(hid, ch, rows, dht.data(), rows, yt.data(), rows, part1.data(), ch);
    for (std::int64_t i = 0; i < hid * ch; ++i) {
      grad_w2[i] += part2[i];
      grad_w1[i] += part1[i];
    }
    gemm_nt(rows, ch, hid, dh.data(), hid, w1t.data(), hid, dy.data(), ch);  // dy = dh W1
#pragma omp parallel if (examples_in_parallel)
    {
      std::vector<float> x(static_cast<std::size_t>(plane));
#pragma omp for schedule(static)
      for (std::int64_t i = 0; i < count; ++i) {
        conv_norm_backward_example<T>(p, w.data(), n0 + i, y.data() + i * plane,
                                      dy.data() + i * plane, x.data(), true,
                                      partial_w.data() + (n0 + i) * 3 * ch);
      }
    }
  }
  std::vector<double> grad_w(static_cast<std::size_t>(3 * ch), 0.0);
  for (std::int64_t n = 0; n < p.n; ++n) {
    for (std::int64_t i = 0; i < 3 * ch; ++i) grad_w[i] += partial_w[n * 3 * ch + i];
  }
  store_matrix(p.grad_conv_weight, 3, ch, grad_w);
  store_matrix(p.grad_linear1, hid, ch, grad_w1);
  store_matrix(p.grad_linear2, ch, hid, grad_w2);
}

}  // namespace

void dilated_conv_norm_cpu(const CheriBlockParams& p) {
  dispatch_floating(p.dtype, kOp, [&](auto tag) {
    conv_norm_forward<typename HostType<decltype(tag)::value>::type>(p);
  });
}

void dilated_conv_norm_backward_cpu(const CheriBlockParams& p) {
  dispatch_floating(p.dtype, kOp, [&](auto tag) {
    conv_norm_backward<typename HostType<decltype(tag)::value>::type>(p);
  });
}

void cheri_block_cpu(const CheriBlockParams& p) {
  dispatch_floating(p.dtype, kOp, [&](auto tag) {
    block_forward<typename HostType<decltype(tag)::value>::type>(p);
  });
}

void cheri_block_backward_cpu(const CheriBlockParams& p) {
  dispatch_floating(p.dtype, kOp, [&](auto tag) {
    block_backward<typename HostType<decltype(tag)::value>::type>(p);
  });
}

}  // namespace fusekit::detail
