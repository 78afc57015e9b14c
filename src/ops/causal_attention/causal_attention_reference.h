// float64 evaluation of causal_attention straight from the formula: what the tests and `fusekit
// check` compare the backends against. q is [B, Hq, T, D], k and v [B, Hkv, T, D] (the
// single-head form as B = Hq = Hkv = 1), n_padd one count per sequence. Padding rows of q and
// padding keys and values are never read (they may hold NaN). Also the upload of per-sequence
// counts as int32 (testing::upload stores floating dtypes only).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common/memory.h"
#include "fusekit/ops/causal_attention.h"
#include "testing/host_tensor.h"

namespace fusekit::testing {

struct CausalAttentionResult {
  HostTensor out;  // [B, Hq, T, D]; zeros on padding rows
  HostTensor lse;  // [B, Hq, T]; -inf on padding rows
};

inline CausalAttentionResult causal_attention_reference(const HostTensor& q, const HostTensor& k,
                                                        const HostTensor& v,
                                                        const std::vector<std::int64_t>& n_padd,
                                                        double scale) {
  const std::int64_t b_size = q.shape[0], hq = q.shape[1], t = q.shape[2], d = q.shape[3];
  const std::int64_t hkv = k.shape[1], group = hq / hkv;
  CausalAttentionResult r{HostTensor({b_size, hq, t, d}),
                          HostTensor({b_size, hq, t}, -std::numeric_limits<double>::infinity())};
  std::vector<double> scores(static_cast<std::size_t>(t));  // [T] one row's scaled scores
#pragma omp parallel for schedule(dynamic) collapse(3) firstprivate(scores)
  for (std::int64_t b = 0; b < b_size; ++b) {
    for (std::int64_t h = 0; h < hq; ++h) {
      for (std::int64_t i = 0; i < t; ++i) {
        const std::int64_t start = n_padd[b];
        if (i < start) continue;  // padding row: out stays 0, lse -inf
        const double* q_row = q.values.data() + ((b * hq + h) * t + i) * d;
        const std::int64_t kv_head = (b * hkv + h / group) * t;  // row index of (b, g, 0)
        // scores over the keys start <= j <= i, then their softmax and its product with v
        double max = -std::numeric_limits<double>::infinity();
        for (std::int64_t j = start; j <= i; ++j) {
          const double* k_row = k.values.data() + (kv_head + j) * d;
          double dot = 0;
          for (std::int64_t c = 0; c < d; ++c) dot += q_row[c] * k_row[c];
          scores[j] = scale * dot;
          max = std::max(max, scores[j]);
        }
        double sum = 0;
        for (std::int64_t j = start; j <= i; ++j) {
          scores[j] = std::exp(scores[j] - max);
          sum += scores[j];
        }
        double* out_row = r.out.values.data() + ((b * hq + h) * t + i) * d;
        for (std::int64_t j = start; j <= i; ++j) {
          const double weight = scores[j] / sum;
          const double* v_row = v.values.data() + (kv_head + j) * d;
          for (std::int64_t c = 0; c < d; ++c) out_row[c] += weight * v_row[c];
        }
        r.lse.values[(b * hq + h) * t + i] = max + std::log(sum);
      }
    }
  }
  return r;
}

/// `counts` as int32 [B] on `device`, `stride` elements apart; the elements between them hold
/// INT32_MAX, a count the CPU's range check rejects should it ever be read.
inline DeviceTensor upload_padding_counts(const std::vector<std::int64_t>& counts, Device device,
                                          std::int64_t stride = 1) {
  const auto n = static_cast<std::int64_t>(counts.size());
  std::vector<std::int32_t> host(static_cast<std::size_t>(n == 0 ? 0 : (n - 1) * stride + 1),
                                 std::numeric_limits<std::int32_t>::max());
  for (std::int64_t i = 0; i < n; ++i) host[i * stride] = static_cast<std::int32_t>(counts[i]);
  DeviceTensor d;
  d.buffer = detail::Buffer(device, host.size() * sizeof(std::int32_t));
  if (!host.empty()) d.buffer.copy_from_host(host.data(), host.size() * sizeof(std::int32_t));
  d.view = TensorView(d.buffer.data(), DType::Int32, {n}, {stride}, device);
  return d;
}

}  // namespace fusekit::testing
