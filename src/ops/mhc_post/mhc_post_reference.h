// float64 evaluation of mhc_post and its backward, straight from the formula: what the tests and
// `fusekit check` compare the backends against. Inputs: x [N, H], residual [N, hc, H],
// post [N, hc] (or [N, hc, 1]: the same values), comb [N, hc, hc].
#pragma once

#include "testing/host_tensor.h"

namespace fusekit::testing {

inline HostTensor mhc_post_reference(const HostTensor& x, const HostTensor& residual,
                                     const HostTensor& post, const HostTensor& comb) {
  const std::int64_t n_rows = residual.shape[0], hc = residual.shape[1], h = residual.shape[2];
  HostTensor out({n_rows, hc, h});
  for (std::int64_t n = 0; n < n_rows; ++n)
    for (std::int64_t i = 0; i < hc; ++i)
      for (std::int64_t k = 0; k < h; ++k) {
        double acc = post.values[n * hc + i] * x.at({n, k});
        for (std::int64_t j = 0; j < hc; ++j) acc += comb.at({n, j, i}) * residual.at({n, j, k});
        out.at({n, i, k}) = acc;
      }
  return out;
}

struct MhcPostGradients {
  HostTensor grad_x, grad_residual, grad_post, grad_comb;
};

/// grad_post has post's shape.
inline MhcPostGradients mhc_post_backward_reference(const HostTensor& grad_out, const HostTensor& x,
                                                    const HostTensor& residual,
                                                    const HostTensor& post,
                                                    const HostTensor& comb) {
  const std::int64_t n_rows = residual.shape[0], hc = residual.shape[1], h = residual.shape[2];
  MhcPostGradients g{HostTensor({n_rows, h}), HostTensor({n_rows, hc, h}), HostTensor(post.shape),
                     HostTensor({n_rows, hc, hc})};
  for (std::int64_t n = 0; n < n_rows; ++n) {
    for (std::int64_t i = 0; i < hc; ++i) {
      for (std::int64_t k = 0; k < h; ++k) {
        const double go = grad_out.at({n, i, k});
        g.grad_x.at({n, k}) += post.values[n * hc + i] * go;
        g.grad_post.values[n * hc + i] += go * x.at({n, k});
        for (std::int64_t j = 0; j < hc; ++j) {
          g.grad_residual.at({n, j, k}) += comb.at({n, j, i}) * go;
          g.grad_comb.at({n, j, i}) += residual.at({n, j, k}) * go;
        }
      }
    }
  }
  return g;
}

/// The same formulas over the inputs' absolute values: the size of the terms each result sums,
/// to which the float32 sums' rounding errors are proportional (compare's scale, where a sum may
/// cancel to far below its terms).
inline HostTensor mhc_post_terms(const HostTensor& x, const HostTensor& residual,
                                 const HostTensor& post, const HostTensor& comb) {
  return mhc_post_reference(abs(x), abs(residual), abs(post), abs(comb));
}
inline MhcPostGradients mhc_post_backward_terms(const HostTensor& grad_out, const HostTensor& x,
                                                const HostTensor& residual,
                                                const HostTensor& post, const HostTensor& comb) {
  return mhc_post_backward_reference(abs(grad_out), abs(x), abs(residual), abs(post), abs(comb));
}

}  // namespace fusekit::testing
