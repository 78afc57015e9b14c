// float64 evaluation of layernorm_linear_gelu straight from the formula: what the tests and
// `fusekit check` compare the backends against. x is [M, K] (leading dims flattened), weight
// [Nout, K]; bias [Nout], ln_weight and ln_bias [K] are used when they have values.
#pragma once

#include <cmath>

#include "fusekit/ops/layernorm_linear_gelu.h"
#include "testing/host_tensor.h"

namespace fusekit::testing {

inline double gelu_reference(double v, GeluApproximation approximate) {
  if (approximate == GeluApproximation::Tanh) {
    return 0.5 * v * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (v + 0.044715 * v * v * v)));
  }
  return 0.5 * v * (1.0 + std::erf(v / std::sqrt(2.0)));
}

inline HostTensor layernorm_linear_gelu_reference(const HostTensor& x, const HostTensor& weight,
                                                  const HostTensor& bias,
                                                  const HostTensor& ln_weight,
                                                  const HostTensor& ln_bias, double eps,
                                                  GeluApproximation approximate) {
  const std::int64_t m = x.shape[0], k = x.shape[1], nout = weight.shape[0];
  HostTensor out({m, nout});
  std::vector<double> xn(static_cast<std::size_t>(k));
#pragma omp parallel for schedule(static) firstprivate(xn)
  for (std::int64_t i = 0; i < m; ++i) {
    double mean = 0, var = 0;
    for (std::int64_t q = 0; q < k; ++q) mean += x.values[i * k + q];
    mean /= static_cast<double>(k);
    for (std::int64_t q = 0; q < k; ++q) var += std::pow(x.values[i * k + q] - mean, 2);
    var /= static_cast<double>(k);
    for (std::int64_t q = 0; q < k; ++q) {
      xn[q] = (x.values[i * k + q] - mean) / std::sqrt(var + eps);
      if (ln_weight.numel()) xn[q] *= ln_weight.values[q];
      if (ln_bias.numel()) xn[q] += ln_bias.values[q];
    }
    for (std::int64_t j = 0; j < nout; ++j) {
      double acc = bias.numel() ? bias.values[j] : 0.0;
      for (std::int64_t q = 0; q < k; ++q) acc += xn[q] * weight.values[j * k + q];
      out.values[i * nout + j] = gelu_reference(acc, approximate);
    }
  }
  return out;
}

}  // namespace fusekit::testing
