// What the trimul tests share between the CPU and the CUDA suites: the cases, the inputs (rounded
// to the dtypes they are stored in), the layouts, one checked run on any device, and the
// tolerances.
#pragma once

#include <algorithm>
#include <cmath>
#include <numbers>
#include <ostream>
#include <string>
#include <vector>

#include "common/memory.h"
#include "ops/trimul/trimul_reference.h"
#include "test_support.h"

namespace fusekit_test {

using fusekit::TrimulDirection;
using fusekit::TrimulOptions;
using fusekit::testing::TrimulHostWeights;

// ------------------------------------------------------------------------------------ cases

enum class TrimulMask {
  None,        // no mask argument
  Random,      // 0 or 1 with equal odds, in mask_dtype
  Bool,        // 0 or 1 with equal odds, as bool
  UInt8,       // 0, 1 or 2 with equal odds, as uint8 (the value multiplies the row)
  Fractional,  // uniform in [0, 1), in mask_dtype
};

enum class TrimulDist {
  Normal,  // x ~ N(0, 1)
  Cauchy,  // x ~ Cauchy(0, 2): heavy tails, rows dominated by one value
};

struct TrimulCase {
  std::int64_t b, n, c, h;
  TrimulDirection direction = TrimulDirection::Outgoing;
  TrimulMask mask = TrimulMask::None;
  TrimulDist dist = TrimulDist::Normal;
  DType dtype = DType::Float32;         // of x and out
  DType weight_dtype = DType::Float32;  // of every weight: float32 or dtype
  DType mask_dtype = DType::Float32;    // of Random and Fractional masks
  double eps = 1e-5;
};

/// The case with x, out and (when `weights_too`) the weights in `dtype`.
inline TrimulCase with_dtype(TrimulCase c, DType dtype, bool weights_too = false) {
  c.dtype = dtype;
  if (weights_too) c.weight_dtype = dtype;
  return c;
}

/// The dtype the case's mask is stored in.
inline DType mask_dtype_of(const TrimulCase& c) {
  switch (c.mask) {
    case TrimulMask::Bool: return DType::Bool;
    case TrimulMask::UInt8: return DType::UInt8;
    default: return c.mask_dtype;
  }
}

inline const char* trimul_mask_name(TrimulMask mask) {
  switch (mask) {
    case TrimulMask::None: return "nomask";
    case TrimulMask::Random: return "mask";
    case TrimulMask::Bool: return "mask_bool";
    case TrimulMask::UInt8: return "mask_uint8";
    case TrimulMask::Fractional: return "mask_fractional";
  }
  return "unknown_mask";
}

/// "B2_N33_C40_H24_incoming_mask_float16_cauchy_bfloat16_w_bfloat16": what differs from the
/// defaults (outgoing, float32 masks and weights, eps 1e-5) is named.
inline std::string trimul_case_name(const TrimulCase& c) {
  std::string s = "B" + std::to_string(c.b) + "_N" + std::to_string(c.n) + "_C" +
                  std::to_string(c.c) + "_H" + std::to_string(c.h);
  s += c.direction == TrimulDirection::Incoming ? "_incoming" : "_outgoing";
  s += std::string("_") + trimul_mask_name(c.mask);
  if ((c.mask == TrimulMask::Random || c.mask == TrimulMask::Fractional) &&
      c.mask_dtype != DType::Float32) {
    s += "_" + dtype_name(c.mask_dtype);
  }
  if (c.dist == TrimulDist::Cauchy) s += "_cauchy";
  s += "_" + dtype_name(c.dtype);
  if (c.weight_dtype != DType::Float32) s += "_w_" + dtype_name(c.weight_dtype);
  if (c.eps != 1e-5) s += "_eps" + std::to_string(static_cast<int>(std::round(c.eps * 1000))) + "m";
  return s;
}

inline void PrintTo(const TrimulCase& c, std::ostream* os) { *os << trimul_case_name(c); }

// ------------------------------------------------------------------------------------ layouts

/// How each tensor is laid out (Layout{order, pad_inner, offset_elements}).
struct TrimulLayouts {
  Layout out = {}, x = {}, mask = {};
  Layout matrices = {};  // the five [H, C] projections and to_out [C, H]
  // The [C] and [H] LayerNorm parameters, laid out as an [n, 1] column and viewed as [n]: the
  // column's pad_inner spaces the elements apart (stride pad_inner + 1).
  Layout vectors = {};
  // A dim of B, N, N along which x and out are viewed through a negative stride; -1: none.
  int flip_dim = -1;
};

/// A named set of layouts, for parameterised tests.
struct TrimulLayoutCase {
  const char* name;
  TrimulLayouts layouts;
};
inline void PrintTo(const TrimulLayoutCase& c, std::ostream* os) { *os << c.name; }

/// The layouts both backends are tested with.
inline const TrimulLayoutCase kTrimulLayouts[] = {
    {"contiguous", {}},
    // gaps after every row of C (x, out) or N (mask) or C / H (the weights), strided vectors
    {"padded",
     {.out = {{}, 5, 0},
      .x = {{}, 3, 0},
      .mask = {{}, 2, 0},
      .matrices = {{}, 7, 0},
      .vectors = {{}, 1, 0}}},
    // row pitch C + 1: in float16 and bfloat16 every other row of x and out starts misaligned
    {"odd_pitch", {.out = {{}, 1, 0}, .x = {{}, 1, 0}}},
    // x with i outermost, out with j before i, the mask transposed, the weights transposed
    {"permuted",
     {.out = {{0, 2, 1, 3}, 0, 0},
      .x = {{1, 0, 2, 3}, 0, 0},
      .mask = {{2, 1, 0}, 0, 0},
      .matrices = {{1, 0}, 0, 0}}},
    // every base pointer one element past an aligned address
    {"misaligned",
     {.out = {{}, 0, 1},
      .x = {{}, 0, 1},
      .mask = {{}, 0, 1},
      .matrices = {{}, 0, 1},
      .vectors = {{}, 0, 1}}},
    {"out_misaligned", {.out = {{}, 0, 3}}},
    // x and out read and written along j through a negative stride
    {"flipped_j", {.flip_dim = 2}},
    {"flipped_b_padded", {.out = {{}, 2, 0}, .x = {{}, 4, 0}, .flip_dim = 0}},
};

// ------------------------------------------------------------------------------------ inputs

/// Inputs in float64, rounded to what they will be on the device. An absent mask is empty.
struct TrimulInputs {
  HostTensor x, mask;
  TrimulHostWeights weights;
};

/// The inputs of one case, fresh from `rng`, with the scales of the module's benchmark: LayerNorm
/// weights and biases N(0, 1), projections N(0, 1) / sqrt(H), to_out N(0, 1) / sqrt(C).
inline TrimulInputs make_trimul_inputs(const TrimulCase& c, std::mt19937_64& rng) {
  using fusekit::testing::random_normal;
  using fusekit::testing::round_to;
  TrimulInputs in;
  if (c.dist == TrimulDist::Normal) {
    in.x = random_normal({c.b, c.n, c.n, c.c}, rng);
  } else {
    in.x = HostTensor({c.b, c.n, c.n, c.c});
    std::uniform_real_distribution<double> uniform(0.0, 1.0);
    // float16 holds at most 65504: the rare draws beyond it would be inf in x
    const double limit = c.dtype == DType::Float16 ? 65504.0 : 1e30;
    for (double& v : in.x.values) {
      v = std::clamp(2.0 * std::tan(std::numbers::pi * (uniform(rng) - 0.5)), -limit, limit);
    }
  }
  round_to(in.x, c.dtype);

  if (c.mask != TrimulMask::None) {
    in.mask = HostTensor({c.b, c.n, c.n});
    std::uniform_real_distribution<double> uniform(0.0, 1.0);
    std::bernoulli_distribution coin(0.5);
    std::uniform_int_distribution<int> small_count(0, 2);
    for (double& v : in.mask.values) {
      switch (c.mask) {
        case TrimulMask::Fractional: v = uniform(rng); break;
        case TrimulMask::UInt8: v = small_count(rng); break;
        default: v = coin(rng); break;
      }
    }
    if (mask_dtype_of(c) != DType::Bool && mask_dtype_of(c) != DType::UInt8) {
      round_to(in.mask, mask_dtype_of(c));
    }
  }

  auto weight = [&](std::vector<std::int64_t> shape, double stddev) {
    HostTensor t = random_normal(std::move(shape), rng, stddev);
    round_to(t, c.weight_dtype);
    return t;
  };
  const double proj_scale = 1.0 / std::sqrt(double(c.h)), out_scale = 1.0 / std::sqrt(double(c.c));
  TrimulHostWeights& w = in.weights;
  w.norm_weight = weight({c.c}, 1.0);
  w.norm_bias = weight({c.c}, 1.0);
  w.left_proj = weight({c.h, c.c}, proj_scale);
  w.right_proj = weight({c.h, c.c}, proj_scale);
  w.left_gate = weight({c.h, c.c}, proj_scale);
  w.right_gate = weight({c.h, c.c}, proj_scale);
  w.out_gate = weight({c.h, c.c}, proj_scale);
  w.to_out_norm_weight = weight({c.h}, 1.0);
  w.to_out_norm_bias = weight({c.h}, 1.0);
  w.to_out = weight({c.c, c.h}, out_scale);
  return in;
}

/// The float64 result of the case's formula on its (rounded) inputs: [B, N, N, C].
inline HostTensor trimul_float64(const TrimulInputs& in, const TrimulCase& c) {
  return fusekit::testing::trimul_reference(in.x, in.mask, in.weights, c.direction, c.eps);
}

// ------------------------------------------------------------------------------------ devices

/// A [n] vector laid out as an [n, 1] column in `layout` and viewed as [n] (see TrimulLayouts).
inline DeviceTensor upload_vector(const HostTensor& t, DType dtype, Device device,
                                  const Layout& layout) {
  HostTensor column = t;
  column.shape = {t.numel(), 1};
  DeviceTensor d = fusekit::testing::upload(column, dtype, device, layout);
  d.view.ndim = 1;
  return d;
}

/// The weights of one call on a device.
struct TrimulDeviceWeights {
  DeviceTensor norm_weight, norm_bias, left_proj, right_proj, left_gate, right_gate, out_gate,
      to_out_norm_weight, to_out_norm_bias, to_out;

  fusekit::TrimulWeights views() const {
    return {norm_weight.view,      norm_bias.view,  left_proj.view, right_proj.view,
            left_gate.view,        right_gate.view, out_gate.view,  to_out_norm_weight.view,
            to_out_norm_bias.view, to_out.view};
  }
};

/// The device tensors of one call, with the output poisoned (NaN in every byte pattern).
struct TrimulTensors {
  DeviceTensor out, x, mask;  // mask: an empty view when the case has none
  TrimulDeviceWeights weights;
};

inline TrimulTensors upload_trimul(const TrimulInputs& in, const TrimulCase& c, Device device,
                                   const TrimulLayouts& layouts = {}) {
  using fusekit::testing::upload;
  TrimulTensors t;
  const bool flip = layouts.flip_dim >= 0;
  t.x = upload(flip ? flipped(in.x, layouts.flip_dim) : in.x, c.dtype, device, layouts.x);
  t.out = fusekit::testing::empty_poisoned({c.b, c.n, c.n, c.c}, c.dtype, device, layouts.out);
  if (flip) {
    flip_view(t.x, layouts.flip_dim);
    flip_view(t.out, layouts.flip_dim);
  }
  if (c.mask != TrimulMask::None) {
    t.mask = fusekit::testing::upload_trimul_mask(in.mask, mask_dtype_of(c), device, layouts.mask);
  }
  const TrimulHostWeights& w = in.weights;
  TrimulDeviceWeights& d = t.weights;
  const DType wd = c.weight_dtype;
  auto matrix = [&](const HostTensor& m) { return upload(m, wd, device, layouts.matrices); };
  auto vector = [&](const HostTensor& v) { return upload_vector(v, wd, device, layouts.vectors); };
  d.norm_weight = vector(w.norm_weight);
  d.norm_bias = vector(w.norm_bias);
  d.left_proj = matrix(w.left_proj);
  d.right_proj = matrix(w.right_proj);
  d.left_gate = matrix(w.left_gate);
  d.right_gate = matrix(w.right_gate);
  d.out_gate = matrix(w.out_gate);
  d.to_out_norm_weight = vector(w.to_out_norm_weight);
  d.to_out_norm_bias = vector(w.to_out_norm_bias);
  d.to_out = matrix(w.to_out);
  return t;
}

inline void run_trimul(const TrimulTensors& t, const TrimulCase& c, fusekit::Stream stream = {}) {
  const TrimulOptions options{.direction = c.direction, .eps = c.eps};
  fusekit::trimul(t.out.view, t.x.view, t.mask.view, t.weights.views(), options, stream);
}

/// The output read back as float64 [B, N, N, C].
inline HostTensor download_trimul(const TrimulTensors& t) {
  return fusekit::testing::download(t.out.view);
}

/// Inputs that share memory: x with stride 0 over B (every batch the same rows) and the mask
/// with stride 0 over i (mask[b, i, j] = m[b, j]). `in` holds the values the views show; the
/// views live as long as the struct (inputs may share addresses; only out may not).
struct BroadcastTrimul {
  TrimulInputs in;
  TrimulTensors t;
  DeviceTensor x_shared, mask_shared;
};

inline BroadcastTrimul upload_broadcast_trimul(const TrimulCase& c, std::mt19937_64& rng,
                                               Device device) {
  using fusekit::testing::upload;
  BroadcastTrimul s;
  s.in = make_trimul_inputs(c, rng);
  const std::int64_t n = c.n, row = n * n * c.c;
  for (std::int64_t b = 1; b < c.b; ++b) {
    for (std::int64_t k = 0; k < row; ++k) s.in.x.values[b * row + k] = s.in.x.values[k];
  }
  HostTensor mask_rows({c.b, n});
  for (std::int64_t b = 0; b < c.b; ++b) {
    for (std::int64_t j = 0; j < n; ++j) mask_rows.at({b, j}) = s.in.mask.at({b, 0, j});
    for (std::int64_t i = 0; i < n; ++i) {
      for (std::int64_t j = 0; j < n; ++j) s.in.mask.at({b, i, j}) = mask_rows.at({b, j});
    }
  }
  s.t = upload_trimul(s.in, c, device);
  HostTensor x_one = s.in.x;
  x_one.shape[0] = 1;
  x_one.values.resize(row);
  s.x_shared = upload(x_one, c.dtype, device);
  s.mask_shared = upload(mask_rows, DType::Float32, device);
  s.t.x.view = s.x_shared.view;
  s.t.x.view.shape[0] = c.b;
  s.t.x.view.strides[0] = 0;
  s.t.mask.view =
      TensorView(s.mask_shared.view.data, DType::Float32, {c.b, n, n}, {n, 0, 1}, device);
  return s;
}

/// One checked run on `device`: uploads the inputs, calls `run(tensors)` into a poisoned output,
/// waits for the device, checks that nothing outside out's view was written, and returns out.
template <typename Run>
HostTensor run_trimul_checked_with(const TrimulInputs& in, const TrimulCase& c, Device device,
                                   const TrimulLayouts& layouts, Run&& run) {
  const TrimulTensors t = upload_trimul(in, c, device, layouts);
  // The uploads and the poison went through the legacy stream; a call on a non-blocking stream
  // is not ordered after them.
  fusekit::detail::synchronize(device);
  run(t);
  fusekit::detail::synchronize(device);
  expect_only_view_written(t.out, "out");
  return download_trimul(t);
}

/// The same for fusekit::trimul on `stream`.
inline HostTensor run_trimul_checked(const TrimulInputs& in, const TrimulCase& c, Device device,
                                     const TrimulLayouts& layouts = {},
                                     fusekit::Stream stream = {}) {
  return run_trimul_checked_with(in, c, device, layouts,
                                 [&](const TrimulTensors& t) { run_trimul(t, c, stream); });
}

// ------------------------------------------------------------------------------------ tolerances
//
// The outputs are sums over H of normalised, gated values of unit size times to_out ~ N(0, 1/C):
// of size about sqrt(H / C). The backends' errors scale with the terms of the sums, so absolute
// errors are judged at that size, and so is the Frobenius error where the outputs nearly cancel
// (with C = 1 every row is one sum of the same H terms, up to its mask; such a sum can come out
// far below its terms, and its relative error far above theirs).

/// The size of the outputs (see above), for the absolute tolerances.
inline double trimul_output_scale(const TrimulCase& c) {
  return std::sqrt(static_cast<double>(c.h) / static_cast<double>(c.c));
}

/// How far the norm of `expected` falls below a quarter of that of outputs of the size above: a
/// factor >= 1 for the Frobenius bound (1 for every case but nearly cancelling ones, whose norms
/// are at least 0.4 of the typical).
inline double trimul_cancellation(const TrimulCase& c, const HostTensor& expected) {
  double sq = 0;
  for (double v : expected.values) sq += v * v;
  const double typical =
      trimul_output_scale(c) * std::sqrt(static_cast<double>(expected.numel()));
  return sq > 0 ? std::max(1.0, 0.25 * typical / std::sqrt(sq)) : 1.0;
}

/// The CPU backend against float64 (`expected`): float32 sums of C, N and H terms, whose errors
/// stay within 1e-5 of the output size per element and 4e-7 of it in norm (3e-6 relative at a
/// cancellation of 4), then, for float16 and bfloat16, one rounding of the output (relative u).
inline Tolerance trimul_cpu_tolerance(const TrimulCase& c, const HostTensor& expected) {
  const double scale = trimul_output_scale(c), cancel = trimul_cancellation(c, expected);
  if (c.dtype == DType::Float32) return {2e-5 * scale, 1e-5, 4e-6 * cancel};
  const double u = unit_roundoff(c.dtype);
  return {2e-5 * scale, u, u + 4e-6 * cancel};
}

/// How much noisier the Frobenius error is for tiny C * H than at the model's sizes: below 256
/// products per output the error is an average over a handful of roundings (with C = 1 every
/// output is the same sum), and a fixed bound fails a few runs in a hundred without any defect.
/// 1 from C * H = 256 up, so every shape the issue names keeps its 1e-3.
inline double trimul_few_products(const TrimulCase& c) {
  return std::sqrt(std::max(1.0, 256.0 / static_cast<double>(c.c * c.h)));
}

/// The same for few rows (b, i, j), as the Python tests have it (FEW_ROWS there): every output of
/// a row shares the roundings of its H intermediates (one LayerNorm over H of one row of p), so
/// below 16 rows the Frobenius error is an average over a handful of them, not a settled mean. At
/// N = 1, C = 40, H = 24 with Cauchy x a fixed 1e-3 fails about 3 draws in 100 (an emulation of
/// the float16 roundings in numpy: median 4.9e-4, 99th percentile 1.2e-3; 2.3e-3 at most in 900
/// draws on an H100), and that case failed one run of the projection tests at 1.1e-3. The bound
/// grows as sqrt(16 / rows) there (4e-3 at one row); from 16 rows on it is the rule's 1e-3.
inline double trimul_few_rows(const TrimulCase& c) {
  return std::sqrt(std::max(1.0, 16.0 / static_cast<double>(c.b * c.n * c.n)));
}

/// The bound the CUDA backend is held to against float64, float16 tensor cores throughout:
/// relative Frobenius error 1e-3 (times the cancellation, few-products and few-rows factors) and
/// every element within atol = rtol = 2e-2, plus, for float16 and bfloat16 outputs, their
/// rounding (relative u).
inline Tolerance trimul_cuda_tolerance(const TrimulCase& c, const HostTensor& expected) {
  const double u = c.dtype == DType::Float32 ? 0.0 : unit_roundoff(c.dtype);
  const double frobenius =
      1e-3 * trimul_cancellation(c, expected) * trimul_few_products(c) * trimul_few_rows(c);
  return {2e-2, 2e-2 + u, frobenius + u};
}

}  // namespace fusekit_test
