// float64 evaluation of the cheri_block family straight from the formulas: what the tests and
// `fusekit check` compare the backends against. x is [N, L, C]; the weights have the shapes of
// CheriBlockWeights; mean and rstd are [N]. The backward references take mean and rstd as given
// (the forward's, possibly rounded to float32 as the training forward stores them) and recompute
// conv, y and h from x, as the backends do; the gradients are the chain rule written out in
// float64 (tests check them against finite differences of the forward).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "fusekit/ops/cheri_block.h"
#include "testing/host_tensor.h"

namespace fusekit::testing {

/// The block's parameters, or their gradients, as float64 host tensors.
struct CheriHostWeights {
  HostTensor conv_weight;  // [3, C]
  HostTensor linear1;      // [E C, C]
  HostTensor linear2;      // [C, E C]
};

struct ConvNormResult {
  HostTensor y;           // [N, L, C]
  HostTensor mean, rstd;  // [N]
};

struct ConvNormGradients {
  HostTensor grad_x;            // [N, L, C]
  HostTensor grad_conv_weight;  // [3, C]
};

struct CheriBlockResult {
  HostTensor out;         // [N, L, C]
  HostTensor mean, rstd;  // [N]
};

struct CheriBlockGradients {
  HostTensor grad_x;       // [N, L, C]
  CheriHostWeights grads;  // the weights' gradients
  // [3, C]: the scale of grads.conv_weight's error on paths whose products round their operands
  // (TF32, float16). Each product's rounding errs on the scale of the root sum of squares of its
  // terms, not of its sum; the norm's backward takes out of grad_conv the directions that scale or
  // shift a plane, so grad_conv_weight can be far smaller than those terms (few rows, few
  // channels). Per element: sqrt(sum over n, l of (x_tap rstd_n s_dy)^2), s_dy the same measure of
  // dL/dy's terms through both linear layers (on the scale of |dL/dy| where they do not cancel).
  HostTensor conv_weight_spread;
};

namespace cheri_detail {

inline constexpr double kGeluScale = 0.79788456080286535588;  // sqrt(2 / pi)
inline constexpr double kGeluCubic = 0.044715;

inline double gelu_tanh(double h) {
  return 0.5 * h * (1.0 + std::tanh(kGeluScale * (h + kGeluCubic * h * h * h)));
}

inline double gelu_tanh_grad(double h) {
  const double t = std::tanh(kGeluScale * (h + kGeluCubic * h * h * h));
  return 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * kGeluScale * (1.0 + 3.0 * kGeluCubic * h * h);
}

// conv [L, C] of example n.
inline std::vector<double> conv_of(const HostTensor& x, const HostTensor& w, std::int64_t n,
                                   std::int64_t dilation) {
  const std::int64_t len = x.shape[1], ch = x.shape[2];
  std::vector<double> conv(static_cast<std::size_t>(len * ch));
  const double* xn = x.values.data() + n * len * ch;
  for (std::int64_t l = 0; l < len; ++l) {
    for (std::int64_t c = 0; c < ch; ++c) {
      double v = w.values[ch + c] * xn[l * ch + c];
      if (l - dilation >= 0) v += w.values[c] * xn[(l - dilation) * ch + c];
      if (l + dilation < len) v += w.values[2 * ch + c] * xn[(l + dilation) * ch + c];
      conv[l * ch + c] = v;
    }
  }
  return conv;
}

// h [L, E C] = y [L, C] linear1^T.
inline std::vector<double> hidden_of(const std::vector<double>& y, const HostTensor& linear1,
                                     std::int64_t len, std::int64_t ch) {
  const std::int64_t hid = linear1.shape[0];
  std::vector<double> h(static_cast<std::size_t>(len * hid));
  for (std::int64_t l = 0; l < len; ++l) {
    for (std::int64_t j = 0; j < hid; ++j) {
      double acc = 0;
      for (std::int64_t c = 0; c < ch; ++c) acc += y[l * ch + c] * linear1.values[j * ch + c];
      h[l * hid + j] = acc;
    }
  }
  return h;
}

// The norm's and the convolution's backward for example n: dy [L, C] of y = (conv - mean) rstd
// gives grad_x (added to what is there) and adds the example's part of grad_w [3, C].
inline void conv_norm_backward_of(const HostTensor& x, const HostTensor& w, std::int64_t n,
                                  std::int64_t dilation, const std::vector<double>& y,
                                  const std::vector<double>& dy, double rstd, double* grad_x,
                                  double* grad_w) {
  const std::int64_t len = x.shape[1], ch = x.shape[2], plane = len * ch;
  double mean_dy = 0, mean_dy_y = 0;
  for (std::int64_t i = 0; i < plane; ++i) {
    mean_dy += dy[i];
    mean_dy_y += dy[i] * y[i];
  }
  mean_dy /= static_cast<double>(plane);
  mean_dy_y /= static_cast<double>(plane);
  std::vector<double> dconv(static_cast<std::size_t>(plane));
  for (std::int64_t i = 0; i < plane; ++i) dconv[i] = rstd * (dy[i] - mean_dy - y[i] * mean_dy_y);
  const double* xn = x.values.data() + n * plane;
  for (std::int64_t l = 0; l < len; ++l) {
    for (std::int64_t c = 0; c < ch; ++c) {
      double g = w.values[ch + c] * dconv[l * ch + c];
      if (l + dilation < len) g += w.values[c] * dconv[(l + dilation) * ch + c];
      if (l - dilation >= 0) g += w.values[2 * ch + c] * dconv[(l - dilation) * ch + c];
      grad_x[l * ch + c] += g;
      grad_w[ch + c] += dconv[l * ch + c] * xn[l * ch + c];
      if (l - dilation >= 0) grad_w[c] += dconv[l * ch + c] * xn[(l - dilation) * ch + c];
      if (l + dilation < len) grad_w[2 * ch + c] += dconv[l * ch + c] * xn[(l + dilation) * ch + c];
    }
  }
}

// y [L, C] of example n from the given statistics.
inline std::vector<double> y_of(const HostTensor& x, const HostTensor& w, std::int64_t n,
                                std::int64_t dilation, double mean, double rstd) {
  std::vector<double> y = conv_of(x, w, n, dilation);
  for (double& v : y) v = (v - mean) * rstd;
  return y;
}

}  // namespace cheri_detail

inline ConvNormResult dilated_conv_norm_reference(const HostTensor& x, const HostTensor& conv_weight,
                                                  std::int64_t dilation, double eps) {
  const std::int64_t n_size = x.shape[0], len = x.shape[1], ch = x.shape[2], plane = len * ch;
  ConvNormResult r{HostTensor(x.shape), HostTensor({n_size}), HostTensor({n_size})};
#pragma omp parallel for schedule(static)
  for (std::int64_t n = 0; n < n_size; ++n) {
    const std::vector<double> conv = cheri_detail::conv_of(x, conv_weight, n, dilation);
    double mean = 0, var = 0;
    for (double v : conv) mean += v;
    mean /= static_cast<double>(plane);
    for (double v : conv) var += (v - mean) * (v - mean);
    var /= static_cast<double>(plane);
    const double rstd = 1.0 / std::sqrt(var + eps);
    for (std::int64_t i = 0; i < plane; ++i) r.y.values[n * plane + i] = (conv[i] - mean) * rstd;
    r.mean.values[n] = mean;
    r.rstd.values[n] = rstd;
  }
  return r;
}

inline ConvNormGradients dilated_conv_norm_backward_reference(
    const HostTensor& grad_y, const HostTensor& x, const HostTensor& conv_weight,
    const HostTensor& mean, const HostTensor& rstd, std::int64_t dilation) {
  const std::int64_t n_size = x.shape[0], ch = x.shape[2], plane = x.shape[1] * ch;
  ConvNormGradients g{HostTensor(x.shape), HostTensor({3, ch})};
  std::vector<double> partial(static_cast<std::size_t>(n_size * 3 * ch), 0.0);
#pragma omp parallel for schedule(static)
  for (std::int64_t n = 0; n < n_size; ++n) {
    const std::vector<double> y =
        cheri_detail::y_of(x, conv_weight, n, dilation, mean.values[n], rstd.values[n]);
    const std::vector<double> dy(grad_y.values.begin() + n * plane,
                                 grad_y.values.begin() + (n + 1) * plane);
    cheri_detail::conv_norm_backward_of(x, conv_weight, n, dilation, y, dy, rstd.values[n],
                                        g.grad_x.values.data() + n * plane,
                                        partial.data() + n * 3 * ch);
  }
  for (std::int64_t n = 0; n < n_size; ++n) {
    for (std::int64_t i = 0; i < 3 * ch; ++i) g.grad_conv_weight.values[i] += partial[n * 3 * ch + i];
  }
  return g;
}

inline CheriBlockResult cheri_block_reference(const HostTensor& x, const CheriHostWeights& w,
                                              std::int64_t dilation, double residual_scale,
                                              double eps) {
  const std::int64_t n_size = x.shape[0], len = x.shape[1], ch = x.shape[2], plane = len * ch;
  const std::int64_t hid = w.linear1.shape[0];
  ConvNormResult norm = dilated_conv_norm_reference(x, w.conv_weight, dilation, eps);
  CheriBlockResult r{HostTensor(x.shape), std::move(norm.mean), std::move(norm.rstd)};
#pragma omp parallel for schedule(static)
  for (std::int64_t n = 0; n < n_size; ++n) {
    const std::vector<double> y(norm.y.values.begin() + n * plane,
                                norm.y.values.begin() + (n + 1) * plane);
    std::vector<double> g = cheri_detail::hidden_of(y, w.linear1, len, ch);
    for (double& v : g) v = cheri_detail::gelu_tanh(v);
    for (std::int64_t l = 0; l < len; ++l) {
      for (std::int64_t c = 0; c < ch; ++c) {
        double acc = 0;
        for (std::int64_t j = 0; j < hid; ++j) acc += g[l * hid + j] * w.linear2.values[c * hid + j];
        const std::int64_t i = n * plane + l * ch + c;
        r.out.values[i] = x.values[i] + residual_scale * acc;
      }
    }
  }
  return r;
}

inline CheriBlockGradients cheri_block_backward_reference(const HostTensor& grad_out,
                                                          const HostTensor& x,
                                                          const CheriHostWeights& w,
                                                          const HostTensor& mean,
                                                          const HostTensor& rstd,
                                                          std::int64_t dilation,
                                                          double residual_scale) {
  const std::int64_t n_size = x.shape[0], len = x.shape[1], ch = x.shape[2], plane = len * ch;
  const std::int64_t hid = w.linear1.shape[0];
  CheriBlockGradients r{grad_out,
                        {HostTensor({3, ch}), HostTensor({hid, ch}), HostTensor({ch, hid})},
                        HostTensor({3, ch})};
  // per-example partial sums of the weight gradients, added in example order
  std::vector<double> part_w(static_cast<std::size_t>(n_size * 3 * ch), 0.0);
  std::vector<double> part_w1(static_cast<std::size_t>(n_size * hid * ch), 0.0);
  std::vector<double> part_w2(static_cast<std::size_t>(n_size * ch * hid), 0.0);
  std::vector<double> part_spread(static_cast<std::size_t>(n_size * 3 * ch), 0.0);  // squares
#pragma omp parallel for schedule(static)
  for (std::int64_t n = 0; n < n_size; ++n) {
    const std::vector<double> y =
        cheri_detail::y_of(x, w.conv_weight, n, dilation, mean.values[n], rstd.values[n]);
    const std::vector<double> h = cheri_detail::hidden_of(y, w.linear1, len, ch);
    std::vector<double> dz(static_cast<std::size_t>(plane));
    for (std::int64_t i = 0; i < plane; ++i) dz[i] = residual_scale * grad_out.values[n * plane + i];
    double* gw1 = part_w1.data() + n * hid * ch;
    double* gw2 = part_w2.data() + n * ch * hid;
    std::vector<double> dh(static_cast<std::size_t>(len * hid));
    std::vector<double> dh_spread(static_cast<std::size_t>(len * hid));
    for (std::int64_t l = 0; l < len; ++l) {
      for (std::int64_t j = 0; j < hid; ++j) {
        const double hv = h[l * hid + j], g = cheri_detail::gelu_tanh(hv);
        double dg = 0, dg_squares = 0;
        for (std::int64_t c = 0; c < ch; ++c) {
          const double term = dz[l * ch + c] * w.linear2.values[c * hid + j];
          dg += term;
          dg_squares += term * term;
          gw2[c * hid + j] += dz[l * ch + c] * g;
        }
        const double gelu_grad = cheri_detail::gelu_tanh_grad(hv);
        dh[l * hid + j] = dg * gelu_grad;
        dh_spread[l * hid + j] = std::abs(gelu_grad) * std::sqrt(dg_squares);
      }
    }
    std::vector<double> dy(static_cast<std::size_t>(plane), 0.0);
    std::vector<double> dy_squares(static_cast<std::size_t>(plane), 0.0);
    for (std::int64_t l = 0; l < len; ++l) {
      for (std::int64_t j = 0; j < hid; ++j) {
        const double d = dh[l * hid + j], d_spread = dh_spread[l * hid + j];
        for (std::int64_t c = 0; c < ch; ++c) {
          dy[l * ch + c] += d * w.linear1.values[j * ch + c];
          gw1[j * ch + c] += d * y[l * ch + c];
          const double term = d_spread * w.linear1.values[j * ch + c];
          dy_squares[l * ch + c] += term * term;
        }
      }
    }
    {
      const double* xn = x.values.data() + n * plane;
      double* spread = part_spread.data() + n * 3 * ch;
      for (std::int64_t l = 0; l < len; ++l) {
        for (std::int64_t c = 0; c < ch; ++c) {
          const double s = rstd.values[n] * std::sqrt(dy_squares[l * ch + c]);
          for (std::int64_t k = 0; k < 3; ++k) {  // tap k reads x at l + (k - 1) d
            const std::int64_t at = l + (k - 1) * dilation;
            if (at < 0 || at >= len) continue;
            const double term = xn[at * ch + c] * s;
            spread[k * ch + c] += term * term;
          }
        }
      }
    }
    cheri_detail::conv_norm_backward_of(x, w.conv_weight, n, dilation, y, dy, rstd.values[n],
                                        r.grad_x.values.data() + n * plane,
                                        part_w.data() + n * 3 * ch);
  }
  for (std::int64_t n = 0; n < n_size; ++n) {
    for (std::int64_t i = 0; i < 3 * ch; ++i) {
      r.grads.conv_weight.values[i] += part_w[n * 3 * ch + i];
      r.conv_weight_spread.values[i] += part_spread[n * 3 * ch + i];
    }
    for (std::int64_t i = 0; i < hid * ch; ++i) {
      r.grads.linear1.values[i] += part_w1[n * hid * ch + i];
      r.grads.linear2.values[i] += part_w2[n * ch * hid + i];
    }
  }
  for (double& v : r.conv_weight_spread.values) v = std::sqrt(v);
  return r;
}

}  // namespace fusekit::testing
