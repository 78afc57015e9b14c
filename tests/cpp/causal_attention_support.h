// What the causal_attention tests share between the CPU suite and the CUDA suite: the cases, the
// inputs (rounded to the dtype, NaN in every padding row of q, k and v), the layouts (q, k and v
// packed in one buffer too), one checked run on any device, and the tolerances of each backend.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "common/memory.h"
#include "ops/causal_attention/causal_attention_params.h"
#include "ops/causal_attention/causal_attention_reference.h"
#include "ops/causal_attention/causal_attention_tolerances.h"
#include "test_support.h"

namespace fusekit_test {

using fusekit::CausalAttentionOptions;
using fusekit::LeftPadding;
using fusekit::testing::CausalAttentionResult;

// ------------------------------------------------------------------------------------ cases

enum class PaddingKind {
  All,          // LeftPadding{all}: one count for every sequence
  PerSequence,  // int32 [B], one count per sequence
};

struct AttentionCase {
  std::int64_t b, hq, hkv, t, d;
  PaddingKind padding = PaddingKind::All;
  // All: {the count} ({}: 0). PerSequence: one count per sequence ({}: each drawn from [0, T]
  // on every run).
  std::vector<std::int64_t> pad = {};
  DType dtype = DType::Float32;      // of q, k, v and out
  bool single_head = false;          // the [T, D] form; b = hq = hkv = 1
  std::optional<double> scale = {};  // of the scores; default 1 / sqrt(D)
  double q_stddev = 1.0;             // larger values sharpen the softmax
  bool allow_tf32 = false;           // CausalAttentionOptions::allow_tf32
  // The CUDA kernel: Auto runs fusekit::causal_attention; the CUDA suite runs a named one through
  // the library's internal parameters.
  fusekit::detail::AttentionKernel kernel = fusekit::detail::AttentionKernel::Auto;
};

inline std::string kernel_name(fusekit::detail::AttentionKernel k) {
  switch (k) {
    case fusekit::detail::AttentionKernel::Auto: return "auto";
    case fusekit::detail::AttentionKernel::MmaSync: return "mma_sync";
    case fusekit::detail::AttentionKernel::Warpgroup: return "warpgroup";
  }
  return "unknown";
}

/// The count of PaddingKind::All.
inline std::int64_t pad_all_of(const AttentionCase& c) { return c.pad.empty() ? 0 : c.pad[0]; }

inline AttentionCase with_dtype(AttentionCase c, DType dtype) {
  c.dtype = dtype;
  return c;
}

/// "B2_Hq4_Hkv2_T17_D32_pad_seq_0_16_bfloat16": what differs from the defaults is named.
inline std::string attention_case_name(const AttentionCase& c) {
  std::string s;
  if (c.single_head) {
    s = "TD";
  } else {
    s += "B" + std::to_string(c.b) + "_Hq" + std::to_string(c.hq) + "_Hkv" + std::to_string(c.hkv);
  }
  s += "_T" + std::to_string(c.t) + "_D" + std::to_string(c.d);
  if (c.padding == PaddingKind::All) {
    s += "_pad" + std::to_string(pad_all_of(c));
  } else if (c.pad.empty()) {
    s += "_pad_seq_random";
  } else {
    s += "_pad_seq";
    for (std::int64_t n : c.pad) s += "_" + std::to_string(n);
  }
  if (c.scale) s += "_scale" + std::to_string(static_cast<int>(std::round(*c.scale * 1000))) + "m";
  if (c.q_stddev != 1.0) s += "_qsd" + std::to_string(static_cast<int>(std::round(c.q_stddev)));
  s += "_" + dtype_name(c.dtype);
  if (c.allow_tf32) s += "_tf32";
  if (c.kernel != fusekit::detail::AttentionKernel::Auto) s += "_" + kernel_name(c.kernel);
  return s;
}

inline void PrintTo(const AttentionCase& c, std::ostream* os) { *os << attention_case_name(c); }

inline double scale_of(const AttentionCase& c) {
  return c.scale ? *c.scale : 1.0 / std::sqrt(static_cast<double>(c.d));
}

// ------------------------------------------------------------------------------------ layouts

/// How each tensor is laid out (Layout{order, pad_inner, offset_elements}); orders have one entry
/// per dim of the case's form ([B, H, T, D] and [B, H, T], or [T, D] and [T]).
struct AttentionLayouts {
  Layout out = {}, lse = {}, q = {}, k = {}, v = {};
  // A dim of (B, H, T) (or T of the [T, D] form: 0) along which q, k, v, out and lse are viewed
  // through a negative stride; -1: none.
  int flip_dim = -1;
  bool flip_outputs_only = false;  // flip_dim for out and lse, q, k and v as they are
  std::int64_t counts_stride = 1;  // per-sequence counts this many int32 apart
};

/// A named set of layouts, for parameterised tests.
struct AttentionLayoutCase {
  const char* name;
  AttentionLayouts layouts;
};
inline void PrintTo(const AttentionLayoutCase& c, std::ostream* os) { *os << c.name; }

/// The layouts of the [B, H, T, D] form.
inline const AttentionLayoutCase kAttentionLayouts[] = {
    {"contiguous", {}},
    // [B, T, H, D] in memory viewed as [B, H, T, D] (the usual projection output, permuted)
    {"bthd",
     {.out = {{0, 2, 1, 3}, 0, 0},
      .lse = {{0, 2, 1}, 0, 0},
      .q = {{0, 2, 1, 3}, 0, 0},
      .k = {{0, 2, 1, 3}, 0, 0},
      .v = {{0, 2, 1, 3}, 0, 0}}},
    // gaps after every row of D (odd ones: rows misaligned in half precision), strided counts
    {"padded",
     {.out = {{}, 2, 0},
      .lse = {{}, 1, 0},
      .q = {{}, 3, 0},
      .k = {{}, 1, 0},
      .v = {{}, 5, 0},
      .counts_stride = 3}},
    // every base pointer one element past an aligned address, out three
    {"misaligned",
     {.out = {{}, 0, 3}, .lse = {{}, 0, 1}, .q = {{}, 0, 1}, .k = {{}, 0, 1}, .v = {{}, 0, 1}}},
    // each tensor differently: q [B, T, H, D] misaligned, k heads outermost, v with odd row
    // pitch, out and lse with T outermost
    {"mixed",
     {.out = {{2, 0, 1, 3}, 0, 0},
      .lse = {{2, 0, 1}, 0, 0},
      .q = {{0, 2, 1, 3}, 0, 1},
      .k = {{1, 0, 2, 3}, 0, 0},
      .v = {{}, 1, 0},
      .counts_stride = 2}},
    // T read and written backwards
    {"flipped_t", {.flip_dim = 2}},
    // heads backwards, rows padded
    {"flipped_h_padded",
     {.out = {{}, 1, 0}, .q = {{}, 2, 0}, .k = {{}, 3, 0}, .v = {{}, 1, 0}, .flip_dim = 1}},
    // T backwards in out and lse only (the inputs fit tensor maps, out does not)
    {"flipped_t_out", {.flip_dim = 2, .flip_outputs_only = true}},
    // the batch backwards in [B, T, H, D] memory
    {"flipped_b_bthd",
     {.out = {{0, 2, 1, 3}, 0, 0},
      .lse = {{0, 2, 1}, 0, 0},
      .q = {{0, 2, 1, 3}, 0, 0},
      .k = {{0, 2, 1, 3}, 0, 0},
      .v = {{0, 2, 1, 3}, 0, 0},
      .flip_dim = 0}},
};

/// The layouts of the [T, D] form.
inline const AttentionLayoutCase kSingleHeadLayouts[] = {
    {"contiguous", {}},
    {"padded", {.out = {{}, 3, 0}, .q = {{}, 1, 0}, .k = {{}, 2, 0}, .v = {{}, 5, 0}}},
    {"misaligned",
     {.out = {{}, 0, 1}, .lse = {{}, 0, 1}, .q = {{}, 0, 1}, .k = {{}, 0, 3}, .v = {{}, 0, 1}}},
    {"flipped_t", {.q = {{}, 1, 0}, .flip_dim = 0}},
};

// ------------------------------------------------------------------------------------ inputs

/// Inputs in float64, rounded to the dtype; NaN in every padding row of q, k and v (all heads),
/// which the operator must never read. Always [B, H, T, D], also for the [T, D] form.
struct AttentionInputs {
  HostTensor q, k, v;
  std::vector<std::int64_t> n_padd;  // [B]
};

inline AttentionInputs make_attention_inputs(const AttentionCase& c, std::mt19937_64& rng) {
  using fusekit::testing::random_normal;
  using fusekit::testing::round_to;
  AttentionInputs in;
  in.q = random_normal({c.b, c.hq, c.t, c.d}, rng, c.q_stddev);
  in.k = random_normal({c.b, c.hkv, c.t, c.d}, rng);
  in.v = random_normal({c.b, c.hkv, c.t, c.d}, rng);
  round_to(in.q, c.dtype);
  round_to(in.k, c.dtype);
  round_to(in.v, c.dtype);
  if (c.padding == PaddingKind::All) {
    in.n_padd.assign(static_cast<std::size_t>(c.b), pad_all_of(c));
  } else if (!c.pad.empty()) {
    in.n_padd = c.pad;
  } else {
    std::uniform_int_distribution<std::int64_t> count(0, c.t);
    for (std::int64_t b = 0; b < c.b; ++b) in.n_padd.push_back(count(rng));
  }
  const double nan = std::numeric_limits<double>::quiet_NaN();
  auto poison = [&](HostTensor& x) {
    const std::int64_t heads = x.shape[1];
    for (std::int64_t b = 0; b < c.b; ++b) {
      for (std::int64_t h = 0; h < heads; ++h) {
        for (std::int64_t i = 0; i < in.n_padd[b]; ++i) {
          for (std::int64_t e = 0; e < c.d; ++e) x.at({b, h, i, e}) = nan;
        }
      }
    }
  };
  poison(in.q);
  poison(in.k);
  poison(in.v);
  return in;
}

/// The float64 result of the case's formula on its (rounded) inputs: out [B, Hq, T, D] and
/// lse [B, Hq, T].
inline CausalAttentionResult attention_float64(const AttentionInputs& in, const AttentionCase& c) {
  return fusekit::testing::causal_attention_reference(in.q, in.k, in.v, in.n_padd, scale_of(c));
}

// ------------------------------------------------------------------------------------ devices

/// `t` with another shape of as many elements (the [T, D] form of a [1, 1, T, D] tensor).
inline HostTensor reshaped(HostTensor t, std::vector<std::int64_t> shape) {
  t.shape = std::move(shape);
  return t;
}

/// The device tensors of one call; out and lse poisoned (NaN in every byte pattern).
struct AttentionTensors {
  DeviceTensor out, lse, q, k, v;  // lse: an empty view when not asked for
  DeviceTensor counts;             // an empty view for PaddingKind::All
  std::int64_t pad_all = 0;

  LeftPadding padding() const { return LeftPadding{pad_all, counts.view}; }
};

inline AttentionTensors upload_attention(const AttentionInputs& in, const AttentionCase& c,
                                         Device device, const AttentionLayouts& layouts = {},
                                         bool with_lse = true) {
  using fusekit::testing::empty_poisoned;
  using fusekit::testing::upload;
  std::vector<std::int64_t> q_shape{c.b, c.hq, c.t, c.d}, kv_shape{c.b, c.hkv, c.t, c.d},
      lse_shape{c.b, c.hq, c.t};
  if (c.single_head) {
    q_shape = kv_shape = {c.t, c.d};
    lse_shape = {c.t};
  }
  const bool flip = layouts.flip_dim >= 0, flip_inputs = flip && !layouts.flip_outputs_only;
  auto input = [&](const HostTensor& x, const std::vector<std::int64_t>& shape,
                   const Layout& layout) {
    const HostTensor shaped = reshaped(x, shape);
    DeviceTensor d =
        upload(flip_inputs ? flipped(shaped, layouts.flip_dim) : shaped, c.dtype, device, layout);
    if (flip_inputs) flip_view(d, layouts.flip_dim);
    return d;
  };
  AttentionTensors t;
  t.q = input(in.q, q_shape, layouts.q);
  t.k = input(in.k, kv_shape, layouts.k);
  t.v = input(in.v, kv_shape, layouts.v);
  t.out = empty_poisoned(q_shape, c.dtype, device, layouts.out);
  if (with_lse) t.lse = empty_poisoned(lse_shape, DType::Float32, device, layouts.lse);
  if (flip) {
    flip_view(t.out, layouts.flip_dim);
    if (with_lse) flip_view(t.lse, layouts.flip_dim);
  }
  if (c.padding == PaddingKind::All) {
    t.pad_all = pad_all_of(c);
  } else {
    t.counts = fusekit::testing::upload_padding_counts(in.n_padd, device, layouts.counts_stride);
  }
  return t;
}

/// As upload_attention, but q, k and v are rows of one buffer [B, T, Hq + 2 Hkv, D] (a fused
/// projection's output: q's heads, then k's, then v's, for each token), `pad_inner` unused
/// elements after every row of D and the buffer's view `offset_elements` into its allocation.
/// Everything outside the three views is NaN. The [B, H, T, D] form only; q owns the buffer.
inline AttentionTensors upload_packed_attention(const AttentionInputs& in, const AttentionCase& c,
                                                Device device, std::int64_t pad_inner = 0,
                                                std::int64_t offset_elements = 0) {
  const std::int64_t heads = c.hq + 2 * c.hkv;
  HostTensor packed({c.b, c.t, heads, c.d});  // [B, T, Hq + 2 Hkv, D]
  auto place = [&](const HostTensor& x, std::int64_t h0) {
    for (std::int64_t b = 0; b < c.b; ++b) {
      for (std::int64_t h = 0; h < x.shape[1]; ++h) {
        for (std::int64_t i = 0; i < c.t; ++i) {
          for (std::int64_t e = 0; e < c.d; ++e) {
            packed.at({b, i, h0 + h, e}) = x.at({b, h, i, e});
          }
        }
      }
    }
  };
  place(in.q, 0);
  place(in.k, c.hq);
  place(in.v, c.hq + c.hkv);
  DeviceTensor buffer =
      fusekit::testing::upload(packed, c.dtype, device, Layout{{}, pad_inner, offset_elements});
  const TensorView& all = buffer.view;
  auto heads_from = [&](std::int64_t h0, std::int64_t count) {
    char* data = static_cast<char*>(all.data) +
                 h0 * all.strides[2] * static_cast<std::int64_t>(fusekit::element_size(c.dtype));
    return TensorView(data, c.dtype, {c.b, count, c.t, c.d},
                      {all.strides[0], all.strides[2], all.strides[1], all.strides[3]}, device);
  };
  AttentionTensors t = upload_attention(in, c, device);
  t.q = DeviceTensor{std::move(buffer.buffer), heads_from(0, c.hq)};
  t.k = DeviceTensor{{}, heads_from(c.hq, c.hkv)};
  t.v = DeviceTensor{{}, heads_from(c.hq + c.hkv, c.hkv)};
  return t;
}

/// The options of case c.
inline CausalAttentionOptions attention_options(const AttentionCase& c) {
  CausalAttentionOptions options;
  options.scale = c.scale;
  options.allow_tf32 = c.allow_tf32;
  return options;
}

inline void run_attention(const AttentionTensors& t, const AttentionCase& c,
                          fusekit::Stream stream = {}) {
  fusekit::causal_attention(t.out.view, t.lse.view, t.q.view, t.k.view, t.v.view, t.padding(),
                            attention_options(c), stream);
}

/// out and lse (when asked for) read back as float64 in the reference's shapes.
inline CausalAttentionResult download_attention(const AttentionTensors& t, const AttentionCase& c) {
  CausalAttentionResult r;
  r.out = reshaped(fusekit::testing::download(t.out.view), {c.b, c.hq, c.t, c.d});
  if (t.lse.view.ndim != 0) {
    r.lse = reshaped(fusekit::testing::download(t.lse.view), {c.b, c.hq, c.t});
  }
  return r;
}

/// One checked run on `device`: uploads the inputs, calls `run(tensors)` into poisoned outputs,
/// waits for the device, checks that nothing outside the outputs' views was written, and returns
/// them.
template <typename Run>
CausalAttentionResult run_attention_checked_with(const AttentionInputs& in, const AttentionCase& c,
                                                 Device device, const AttentionLayouts& layouts,
                                                 Run&& run) {
  const AttentionTensors t = upload_attention(in, c, device, layouts);
  run(t);
  fusekit::detail::synchronize(device);
  expect_only_view_written(t.out, "out");
  expect_only_view_written(t.lse, "lse");
  return download_attention(t, c);
}

/// The same for fusekit::causal_attention on `stream`.
inline CausalAttentionResult run_attention_checked(const AttentionInputs& in,
                                                   const AttentionCase& c, Device device,
                                                   const AttentionLayouts& layouts = {},
                                                   fusekit::Stream stream = {}) {
  return run_attention_checked_with(in, c, device, layouts,
                                    [&](const AttentionTensors& t) { run_attention(t, c, stream); });
}

/// Padding rows exactly as promised: out +0 (not -0, not NaN, not a small number) and lse -inf.
inline void expect_padding_rows_exact(const CausalAttentionResult& got,
                                      const std::vector<std::int64_t>& n_padd) {
  const std::int64_t b_size = got.out.shape[0], hq = got.out.shape[1], t = got.out.shape[2],
                     d = got.out.shape[3];
  std::int64_t bad_out = 0, bad_lse = 0;
  for (std::int64_t b = 0; b < b_size; ++b) {
    for (std::int64_t h = 0; h < hq; ++h) {
      for (std::int64_t i = 0; i < std::min(n_padd[b], t); ++i) {
        for (std::int64_t e = 0; e < d; ++e) {
          const double v = got.out.at({b, h, i, e});
          bad_out += (v != 0.0 || std::signbit(v)) ? 1 : 0;
        }
        if (got.lse.numel() != 0) {
          const double l = got.lse.at({b, h, i});
          bad_lse += (l != -std::numeric_limits<double>::infinity()) ? 1 : 0;
        }
      }
    }
  }
  EXPECT_EQ(bad_out, 0) << "elements of padding rows of out that are not +0";
  EXPECT_EQ(bad_lse, 0) << "padding rows whose lse is not -inf";
}

// ------------------------------------------------------------------------------------ tolerances
//
// The policy is the library's own (ops/causal_attention/causal_attention_tolerances.h, shared with
// `fusekit check`, which says why each bound is what it is); a case gives its dtype, TF32 switch,
// head dimension and the size of its scores.

inline fusekit::testing::AttentionPrecision precision_of(const AttentionCase& c) {
  return {c.dtype, c.allow_tf32, c.d,
          fusekit::testing::attention_score_size(scale_of(c), c.q_stddev, c.d)};
}

/// out of the CPU backend against float64.
inline Tolerance attention_out_tolerance(const AttentionCase& c) {
  return fusekit::testing::attention_cpu_out_tolerance(precision_of(c));
}

/// lse of the CPU backend against float64.
inline Tolerance attention_lse_tolerance(const AttentionCase& c) {
  return fusekit::testing::attention_cpu_lse_tolerance(precision_of(c));
}

/// Compares out and lse with float64 and checks the padding rows.
inline void expect_attention_close(const CausalAttentionResult& got,
                                   const CausalAttentionResult& expected,
                                   const std::vector<std::int64_t>& n_padd,
                                   const AttentionCase& c) {
  expect_close(got.out, expected.out, attention_out_tolerance(c), "out");
  if (!got.lse.shape.empty()) {  // lse was asked for
    expect_close(got.lse, expected.lse, attention_lse_tolerance(c), "lse");
  }
  expect_padding_rows_exact(got, n_padd);
}

// ------------------------------------------------------------------------------------ CUDA

/// out of the CUDA backend against float64.
inline Tolerance attention_cuda_out_tolerance(const AttentionCase& c) {
  return fusekit::testing::attention_cuda_out_tolerance(precision_of(c));
}

/// lse of the CUDA backend against float64, element by element.
inline Tolerance attention_cuda_lse_tolerance(const AttentionCase& c) {
  return fusekit::testing::attention_cuda_lse_tolerance(precision_of(c));
}

/// Compares the CUDA backend's out and lse with `expected` (float64, or another backend's result
/// with its own error bound added to ours) and checks the padding rows.
inline void expect_attention_cuda_close(const CausalAttentionResult& got,
                                        const CausalAttentionResult& expected,
                                        const std::vector<std::int64_t>& n_padd,
                                        const AttentionCase& c, const Tolerance& extra_out = {},
                                        const Tolerance& extra_lse = {}) {
  auto plus = [](Tolerance a, const Tolerance& b) {
    return Tolerance{a.atol + b.atol, a.rtol + b.rtol, a.rel + b.rel};
  };
  expect_close(got.out, expected.out, plus(attention_cuda_out_tolerance(c), extra_out), "out");
  if (!got.lse.shape.empty()) {  // lse was asked for
    expect_close(got.lse, expected.lse, plus(attention_cuda_lse_tolerance(c), extra_lse), "lse");
  }
  expect_padding_rows_exact(got, n_padd);
}

}  // namespace fusekit_test
