// The CPU backend of causal_attention, in float32 with an online softmax.
//
// One task per (b, h, block of query rows), the tasks in parallel. A task walks the keys from the
// sequence's first real token to its last query row in blocks; key blocks wholly before the
// padding or wholly after the causal diagonal are never visited, and within a block a row reads
// only its keys j <= i. Each row keeps a running max m of its scores, the running sum l of
// exp(s - m) and the running output acc = sum exp(s - m) v; when a block raises the max, l and
// acc are rescaled by exp(m_old - m_new). The row's result is acc / l, and lse = m + log(l).
//
// A block of keys is converted to float32 once for the whole block of query rows, K transposed
// to [D, keys]: a row's scores are then a loop over keys and its product with V a loop over D,
// both vectorisable without reordering any sum. Every row is computed the same way whichever
// thread takes it, so the result is bitwise deterministic.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common/dispatch.h"
#include "common/half.h"
#include "ops/causal_attention/causal_attention_params.h"

namespace fusekit::detail {

namespace {

constexpr const char* kOp = "causal_attention";
constexpr std::int64_t kQueryBlock = 64;  // query rows per task
constexpr std::int64_t kKeyBlock = 64;    // keys converted to float32 at a time

// One thread's float32 scratch.
struct Scratch {
  std::vector<float> q;       // [kQueryBlock, D] the task's query rows
  std::vector<float> k;       // [D, kKeyBlock] the block's keys, transposed
  std::vector<float> v;       // [kKeyBlock, D] the block's values
  std::vector<float> acc;     // [kQueryBlock, D] running sum of exp(s - m) v per row
  std::vector<float> scores;  // [kKeyBlock] one row's scores, then exp(s - m)
  std::vector<float> max;     // [kQueryBlock] running max m per row
  std::vector<float> sum;     // [kQueryBlock] running sum l per row

  explicit Scratch(std::int64_t d)
      : q(static_cast<std::size_t>(kQueryBlock * d)),
        k(static_cast<std::size_t>(d * kKeyBlock)),
        v(static_cast<std::size_t>(kKeyBlock * d)),
        acc(static_cast<std::size_t>(kQueryBlock * d)),
        scores(static_cast<std::size_t>(kKeyBlock)),
        max(static_cast<std::size_t>(kQueryBlock)),
        sum(static_cast<std::size_t>(kQueryBlock)) {}
};

std::int64_t padding_of(const CausalAttentionParams& p, std::int64_t b) {
  return p.padding ? p.padding[b * p.padding_stride] : p.padding_all;
}

// Rows [i0, i1) of query head h of sequence b, whose real tokens start at `start`.
template <typename T>
void attend_rows(const CausalAttentionParams& p, std::int64_t b, std::int64_t h, std::int64_t i0,
                 std::int64_t i1, std::int64_t start, Scratch& s) {
  const std::int64_t d = p.d, g = h / p.group();
  const T* q = static_cast<const T*>(p.q) + b * p.q_stride[0] + h * p.q_stride[1];
  const T* k = static_cast<const T*>(p.k) + b * p.k_stride[0] + g * p.k_stride[1];
  const T* v = static_cast<const T*>(p.v) + b * p.v_stride[0] + g * p.v_stride[1];
  T* out = static_cast<T*>(p.out) + b * p.out_stride[0] + h * p.out_stride[1];
  float* lse = p.lse ? p.lse + b * p.lse_stride[0] + h * p.lse_stride[1] : nullptr;

  // Padding rows: zeros, and an lse of -inf (an empty sum); their q is never read.
  const std::int64_t first = std::clamp(start, i0, i1);
  for (std::int64_t i = i0; i < first; ++i) {
    std::fill_n(out + i * p.out_stride[2], d, from_float<T>(0.0f));
    if (lse) lse[i * p.lse_stride[2]] = -std::numeric_limits<float>::infinity();
  }
  const std::int64_t rows = i1 - first;
  if (rows == 0) return;

  for (std::int64_t r = 0; r < rows; ++r) {
    const T* src = q + (first + r) * p.q_stride[2];
    for (std::int64_t c = 0; c < d; ++c) s.q[r * d + c] = to_float(src[c]);
  }
  std::fill_n(s.max.begin(), rows, -std::numeric_limits<float>::infinity());
  std::fill_n(s.sum.begin(), rows, 0.0f);
  std::fill_n(s.acc.begin(), rows * d, 0.0f);

  // Keys [start, i1): the last row's causal range, never a padding key.
  for (std::int64_t j0 = start; j0 < i1; j0 += kKeyBlock) {
    const std::int64_t keys = std::min(kKeyBlock, i1 - j0);
    for (std::int64_t j = 0; j < keys; ++j) {
      const T* k_row = k + (j0 + j) * p.k_stride[2];
      const T* v_row = v + (j0 + j) * p.v_stride[2];
      for (std::int64_t c = 0; c < d; ++c) {
        s.k[c * kKeyBlock + j] = to_float(k_row[c]);
        s.v[j * d + c] = to_float(v_row[c]);
      }
    }
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t i = first + r;
      if (i < j0) continue;  // the whole block lies after this row's diagonal
      const std::int64_t n = std::min(keys, i - j0 + 1);  // keys j0 .. i of this block
      float* scores = s.scores.data();
      std::fill_n(scores, n, 0.0f);
      const float* q_row = s.q.data() + r * d;
      for (std::int64_t c = 0; c < d; ++c) {
        const float qc = q_row[c];
        const float* k_col = s.k.data() + c * kKeyBlock;
        for (std::int64_t j = 0; j < n; ++j) scores[j] += qc * k_col[j];
      }
      float block_max = s.max[r];
      for (std::int64_t j = 0; j < n; ++j) {
        scores[j] *= p.scale;
        block_max = std::max(block_max, scores[j]);
      }
      const float rescale = std::exp(s.max[r] - block_max);  // 0 on the row's first block
      float block_sum = 0.0f;
      for (std::int64_t j = 0; j < n; ++j) {
        scores[j] = std::exp(scores[j] - block_max);
        block_sum += scores[j];
      }
      s.max[r] = block_max;
      s.sum[r] = s.sum[r] * rescale + block_sum;
      float* acc = s.acc.data() + r * d;
      for (std::int64_t c = 0; c < d; ++c) acc[c] *= rescale;
      for (std::int64_t j = 0; j < n; ++j) {
        const float weight = scores[j];
        const float* v_row = s.v.data() + j * d;
        for (std::int64_t c = 0; c < d; ++c) acc[c] += weight * v_row[c];
      }
    }
  }

  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t i = first + r;
    T* dst = out + i * p.out_stride[2];
    const float* acc = s.acc.data() + r * d;
    for (std::int64_t c = 0; c < d; ++c) dst[c] = from_float<T>(acc[c] / s.sum[r]);
    if (lse) lse[i * p.lse_stride[2]] = s.max[r] + std::log(s.sum[r]);
  }
}

template <typename T>
void run(const CausalAttentionParams& p) {
  const std::int64_t blocks = (p.t + kQueryBlock - 1) / kQueryBlock;
  const std::int64_t tasks = p.b * p.hq * blocks;
#pragma omp parallel if (tasks > 1)
  {
    Scratch scratch(p.d);
    // Dynamic: the tasks differ in work by the length of their causal range, so the last blocks
    // of every head (the longest) are handed out first.
#pragma omp for schedule(dynamic)
    for (std::int64_t task = 0; task < tasks; ++task) {
      const std::int64_t heads = p.b * p.hq;
      const std::int64_t block = blocks - 1 - task / heads, bh = task % heads;
      const std::int64_t b = bh / p.hq, h = bh % p.hq;
      const std::int64_t i0 = block * kQueryBlock, i1 = std::min(p.t, i0 + kQueryBlock);
      attend_rows<T>(p, b, h, i0, i1, padding_of(p, b), scratch);
    }
  }
}

}  // namespace

void causal_attention_cpu(const CausalAttentionParams& p) {
  dispatch_floating(p.dtype, kOp, [&](auto tag) {
    run<typename HostType<decltype(tag)::value>::type>(p);
  });
}

}  // namespace fusekit::detail
