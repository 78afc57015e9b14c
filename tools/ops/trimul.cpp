// trimul in `fusekit check` and `fusekit bench`.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "common/memory.h"
#include "fusekit/error.h"
#include "fusekit/ops/trimul.h"
#include "ops.h"
#include "ops/trimul/trimul_reference.h"
#include "testing/host_tensor.h"

namespace fusekit::tools {

namespace {

using testing::DeviceTensor;
using testing::HostTensor;
using testing::Layout;
using testing::TrimulHostWeights;

constexpr const char* kOp = "trimul";
constexpr DType kF32 = DType::Float32, kBF16 = DType::BFloat16, kF16 = DType::Float16;
constexpr TrimulDirection kIn = TrimulDirection::Incoming, kOut = TrimulDirection::Outgoing;

// ---------------------------------------------------------------------------------- layouts

enum class LayoutKind {
  Contiguous,
  Misaligned,  // every base pointer one element past an aligned address
  Padded,      // gaps after every row of x, out, the mask and the weights
  Permuted,    // x with i outermost, out with j before i, the mask and the weights transposed
};

const char* layout_name(LayoutKind kind) {
  switch (kind) {
    case LayoutKind::Contiguous: return "contiguous";
    case LayoutKind::Misaligned: return "misaligned";
    case LayoutKind::Padded: return "padded";
    case LayoutKind::Permuted: return "permuted";
  }
  throw Error("check: unknown trimul layout");
}

enum class Role { X, Out, Mask, Matrix, Vector };

Layout layout_for(LayoutKind kind, Role role) {
  switch (kind) {
    case LayoutKind::Contiguous: return {};
    case LayoutKind::Misaligned: return {.order = {}, .offset_elements = 1};
    case LayoutKind::Padded:
      return role == Role::Vector ? Layout{} : Layout{.order = {}, .pad_inner = 3};
    case LayoutKind::Permuted:
      switch (role) {
        case Role::X: return {.order = {1, 0, 2, 3}};
        case Role::Out: return {.order = {0, 2, 1, 3}};
        case Role::Mask: return {.order = {2, 1, 0}};
        case Role::Matrix: return {.order = {1, 0}};
        case Role::Vector: return {};
      }
      break;
  }
  throw Error("check: unknown trimul layout");
}

// ---------------------------------------------------------------------------------- check

enum class MaskKind { None, Random, Bool, UInt8, Fractional };
enum class Dist { Normal, Cauchy };

struct CheckCase {
  std::int64_t b, n, c, h;
  DType dtype;
  TrimulDirection direction = kOut;
  MaskKind mask = MaskKind::None;
  Dist dist = Dist::Normal;
  LayoutKind layout = LayoutKind::Contiguous;
  bool weights_in_x_dtype = false;  // else float32
  double eps = 1e-5;
};

// Both directions, every mask dtype, normal and Cauchy inputs, weights in float32 and in x's
// dtype, the awkward sizes (no rows, N, C and H of 1, odd N and C) and the benchmark's widths
// (C of 128 and 384, H of 128), each layout, kept small enough for the float64 reference.
const std::vector<CheckCase> kCases = {
    {.b = 0, .n = 8, .c = 32, .h = 16, .dtype = kF32},
    {.b = 2, .n = 0, .c = 32, .h = 16, .dtype = kF16},
    {.b = 1, .n = 1, .c = 1, .h = 1, .dtype = kF32},
    {.b = 1, .n = 7, .c = 1, .h = 24, .dtype = kBF16, .mask = MaskKind::Random},
    {.b = 2, .n = 7, .c = 40, .h = 1, .dtype = kF16, .direction = kIn},
    {.b = 1, .n = 33, .c = 40, .h = 24, .dtype = kF32, .mask = MaskKind::Random},
    {.b = 2, .n = 33, .c = 40, .h = 24, .dtype = kF32, .direction = kIn,
     .mask = MaskKind::Random, .dist = Dist::Cauchy},
    {.b = 1, .n = 64, .c = 128, .h = 128, .dtype = kF32},
    {.b = 1, .n = 64, .c = 128, .h = 128, .dtype = kF32, .direction = kIn,
     .mask = MaskKind::Random},
    {.b = 2, .n = 32, .c = 128, .h = 128, .dtype = kF32, .dist = Dist::Cauchy},
    {.b = 1, .n = 48, .c = 384, .h = 128, .dtype = kF32, .mask = MaskKind::Random},
    {.b = 1, .n = 48, .c = 128, .h = 128, .dtype = kBF16, .direction = kIn,
     .mask = MaskKind::Bool},
    {.b = 1, .n = 48, .c = 128, .h = 128, .dtype = kF16, .mask = MaskKind::UInt8,
     .dist = Dist::Cauchy},
    {.b = 2, .n = 40, .c = 96, .h = 64, .dtype = kF32, .direction = kIn,
     .mask = MaskKind::Fractional},
    {.b = 1, .n = 32, .c = 128, .h = 64, .dtype = kBF16, .weights_in_x_dtype = true},
    {.b = 1, .n = 32, .c = 128, .h = 64, .dtype = kF16, .direction = kIn,
     .mask = MaskKind::Random, .weights_in_x_dtype = true},
    {.b = 1, .n = 17, .c = 64, .h = 32, .dtype = kF32, .mask = MaskKind::Random, .eps = 0.1},
    {.b = 2, .n = 33, .c = 72, .h = 40, .dtype = kF32, .mask = MaskKind::Random,
     .layout = LayoutKind::Misaligned},
    {.b = 1, .n = 33, .c = 40, .h = 24, .dtype = kF16, .direction = kIn,
     .mask = MaskKind::Bool, .layout = LayoutKind::Misaligned},
    {.b = 2, .n = 24, .c = 128, .h = 64, .dtype = kBF16, .mask = MaskKind::Fractional,
     .layout = LayoutKind::Padded},
    {.b = 1, .n = 31, .c = 37, .h = 24, .dtype = kF32, .direction = kIn,
     .mask = MaskKind::UInt8, .layout = LayoutKind::Padded},
    {.b = 2, .n = 24, .c = 128, .h = 64, .dtype = kF32, .direction = kIn,
     .mask = MaskKind::Random, .layout = LayoutKind::Permuted},
    {.b = 1, .n = 33, .c = 40, .h = 24, .dtype = kBF16, .mask = MaskKind::Bool,
     .layout = LayoutKind::Permuted},
};

DType mask_dtype(const CheckCase& c) {
  switch (c.mask) {
    case MaskKind::Bool: return DType::Bool;
    case MaskKind::UInt8: return DType::UInt8;
    default: return kF32;
  }
}

DType weight_dtype(const CheckCase& c) { return c.weights_in_x_dtype ? c.dtype : kF32; }

// The size of the outputs: sums over H of normalised, gated values of unit size times
// to_out ~ N(0, 1/C).
double output_scale(const CheckCase& c) { return std::sqrt(double(c.h) / double(c.c)); }

// Errors against float64. The backends' errors scale with the terms of the sums, so absolute
// errors are judged at the outputs' size, and the Frobenius bound widens by how far the outputs'
// norm falls below a quarter of that of outputs of that size (nearly cancelling sums; see
// tests/cpp/trimul_support.h). CPU: float32 sums, then for float16 and bfloat16 the rounding of
// the output (relative u). CUDA: float16 tensor cores throughout, held to a Frobenius error of
// 1e-3 and every element within atol = rtol = 2e-2, plus the output's rounding.
testing::Tolerance tolerance(const CheckCase& c, Device device, const HostTensor& reference) {
  double sq = 0;
  for (double v : reference.values) sq += v * v;
  const double typical = output_scale(c) * std::sqrt(static_cast<double>(reference.numel()));
  const double cancel = sq > 0 ? std::max(1.0, 0.25 * typical / std::sqrt(sq)) : 1.0;
  double u = 0;
  switch (c.dtype) {
    case DType::Float32: u = 0; break;
    case DType::Float16: u = 0x1p-11; break;
    case DType::BFloat16: u = 0x1p-8; break;
    default: throw Error(detail::concat("check: no tolerance for dtype ", to_string(c.dtype)));
  }
  if (device.kind == DeviceKind::CPU) {
    return {.atol = 2e-5 * output_scale(c), .rtol = std::max(u, 1e-5), .rel = u + 4e-6 * cancel};
  }
  return {.atol = 2e-2, .rtol = 2e-2 + u, .rel = 1e-3 * cancel + u};
}

std::string shape_name(const CheckCase& c) {
  return fmt::format("B{} N{} C{} H{}", c.b, c.n, c.c, c.h);
}

// The layout, then what differs from the default call: the direction, the mask, Cauchy inputs,
// weights in x's dtype, eps.
std::string layout_text(const CheckCase& c) {
  std::string text = layout_name(c.layout);
  text += c.direction == kIn ? " in" : " out";
  switch (c.mask) {
    case MaskKind::None: break;
    case MaskKind::Random: text += " mask"; break;
    case MaskKind::Bool: text += " mask-bool"; break;
    case MaskKind::UInt8: text += " mask-u8"; break;
    case MaskKind::Fractional: text += " mask-frac"; break;
  }
  if (c.dist == Dist::Cauchy) text += " cauchy";
  if (c.weights_in_x_dtype) text += " w-xdtype";
  if (c.eps != 1e-5) text += fmt::format(" eps{:g}", c.eps);
  return text;
}

// The inputs of one case in float64, already rounded to the dtypes they are stored in, at the
// module's scales: LayerNorm parameters N(0, 1), projections N(0, 1) / sqrt(H), to_out
// N(0, 1) / sqrt(C); x ~ N(0, 1) or Cauchy(0, 2).
struct Inputs {
  HostTensor x, mask;  // mask: empty when the case has none
  TrimulHostWeights w;
};

HostTensor random_rounded(std::vector<std::int64_t> shape, DType dtype, std::mt19937_64& rng,
                          double stddev = 1.0) {
  HostTensor t = testing::random_normal(std::move(shape), rng, stddev);
  testing::round_to(t, dtype);
  return t;
}

Inputs random_inputs(const CheckCase& c, std::mt19937_64& rng) {
  Inputs in;
  if (c.dist == Dist::Normal) {
    in.x = testing::random_normal({c.b, c.n, c.n, c.c}, rng);
  } else {
    in.x = HostTensor({c.b, c.n, c.n, c.c});
    std::uniform_real_distribution<double> uniform(0.0, 1.0);
    const double limit = c.dtype == kF16 ? 65504.0 : 1e30;  // finite in x's dtype
    for (double& v : in.x.values) {
      v = std::clamp(2.0 * std::tan(std::numbers::pi * (uniform(rng) - 0.5)), -limit, limit);
    }
  }
  testing::round_to(in.x, c.dtype);
  if (c.mask != MaskKind::None) {
    in.mask = HostTensor({c.b, c.n, c.n});
    std::uniform_real_distribution<double> uniform(0.0, 1.0);
    std::bernoulli_distribution coin(0.5);
    for (double& v : in.mask.values) v = c.mask == MaskKind::Fractional ? uniform(rng) : coin(rng);
    if (c.mask == MaskKind::Fractional) testing::round_to(in.mask, kF32);
  }
  const DType wd = weight_dtype(c);
  const double proj = 1.0 / std::sqrt(double(c.h)), out = 1.0 / std::sqrt(double(c.c));
  in.w.norm_weight = random_rounded({c.c}, wd, rng);
  in.w.norm_bias = random_rounded({c.c}, wd, rng);
  in.w.left_proj = random_rounded({c.h, c.c}, wd, rng, proj);
  in.w.right_proj = random_rounded({c.h, c.c}, wd, rng, proj);
  in.w.left_gate = random_rounded({c.h, c.c}, wd, rng, proj);
  in.w.right_gate = random_rounded({c.h, c.c}, wd, rng, proj);
  in.w.out_gate = random_rounded({c.h, c.c}, wd, rng, proj);
  in.w.to_out_norm_weight = random_rounded({c.h}, wd, rng);
  in.w.to_out_norm_bias = random_rounded({c.h}, wd, rng);
  in.w.to_out = random_rounded({c.c, c.h}, wd, rng, out);
  return in;
}

struct DeviceInputs {
  DeviceTensor x, mask;  // mask: an empty view when the case has none
  DeviceTensor norm_weight, norm_bias, left_proj, right_proj, left_gate, right_gate, out_gate,
      to_out_norm_weight, to_out_norm_bias, to_out;

  TrimulWeights weights() const {
    return {norm_weight.view,      norm_bias.view,  left_proj.view, right_proj.view,
            left_gate.view,        right_gate.view, out_gate.view,  to_out_norm_weight.view,
            to_out_norm_bias.view, to_out.view};
  }
};

DeviceInputs upload_inputs(const Inputs& in, const CheckCase& c, Device device) {
  DeviceInputs d;
  d.x = testing::upload(in.x, c.dtype, device, layout_for(c.layout, Role::X));
  if (c.mask != MaskKind::None) {
    d.mask = testing::upload_trimul_mask(in.mask, mask_dtype(c), device,
                                         layout_for(c.layout, Role::Mask));
  }
  const DType wd = weight_dtype(c);
  auto vector = [&](const HostTensor& t) {
    return testing::upload(t, wd, device, layout_for(c.layout, Role::Vector));
  };
  auto matrix = [&](const HostTensor& t) {
    return testing::upload(t, wd, device, layout_for(c.layout, Role::Matrix));
  };
  d.norm_weight = vector(in.w.norm_weight);
  d.norm_bias = vector(in.w.norm_bias);
  d.left_proj = matrix(in.w.left_proj);
  d.right_proj = matrix(in.w.right_proj);
  d.left_gate = matrix(in.w.left_gate);
  d.right_gate = matrix(in.w.right_gate);
  d.out_gate = matrix(in.w.out_gate);
  d.to_out_norm_weight = vector(in.w.to_out_norm_weight);
  d.to_out_norm_bias = vector(in.w.to_out_norm_bias);
  d.to_out = matrix(in.w.to_out);
  return d;
}

void check_case(const CheckContext& ctx, const CheckCase& c, std::mt19937_64& rng) {
  const Inputs in = random_inputs(c, rng);
  const TrimulOptions options{.direction = c.direction, .eps = c.eps};
  auto run_on = [&](Device device) {
    const DeviceInputs d = upload_inputs(in, c, device);
    std::vector<DeviceTensor> outs;
    outs.push_back(testing::empty_poisoned({c.b, c.n, c.n, c.c}, c.dtype, device,
                                           layout_for(c.layout, Role::Out)));
    trimul(outs[0].view, d.x.view, d.mask.view, d.weights(), options);
    detail::synchronize(device);
    return outs;
  };
  HostTensor reference = testing::trimul_reference(in.x, in.mask, in.w, c.direction, c.eps);
  const testing::Tolerance tol = tolerance(c, ctx.device, reference);
  ctx.runner->run({kOp, "forward", shape_name(c), layout_text(c), c.dtype}, run_on,
                  {{"out", std::move(reference), tol}});
}

void check(const CheckContext& ctx) { check_each(ctx, kCases, check_case); }

// ---------------------------------------------------------------------------------- bench

struct BenchCase {
  std::int64_t n, b, c;
  bool mask = false;    // a random 0/1 float32 mask, else none
  bool cauchy = false;  // x ~ Cauchy(0, 2), else uniform of unit variance
  bool on_cpu = false;  // the CPU run stays at about a minute in all
  bool quick = false;   // one of the few rows of --quick
};

// The seven benchmark shapes of the module (sequence length, batch, C, mask, distribution),
// hidden 128, x and weights in float32. On the CPU only the smallest: one takes seconds there.
const std::vector<BenchCase> kBenchCases = {
    {256, 2, 128, false, false, true, true},
    {768, 1, 128, false, true},
    {256, 2, 384, true, false},
    {512, 1, 128, false, false},
    {1024, 1, 128, false, true},
    {768, 1, 384, true, false},
    {1024, 1, 384, false, false, false, true},
};
constexpr std::int64_t kBenchHidden = 128;
constexpr DType kBenchDType = DType::Float32;

std::string bench_shape_name(const BenchCase& c) {
  return fmt::format("N{} B{} C{}{}{}", c.n, c.b, c.c, c.mask ? " mask" : "",
                     c.cauchy ? " cauchy" : "");
}

// bench_input's uniform values of unit variance, scaled by `stddev`.
DeviceTensor upload_scaled(std::vector<std::int64_t> shape, double stddev, Device device,
                           std::uint64_t seed) {
  HostTensor t = bench_input(std::move(shape), seed);
  for (double& v : t.values) v *= stddev;
  return testing::upload(t, kBenchDType, device);
}

void bench(const BenchContext& ctx) {
  const Device device = ctx.device;
  bench_each(ctx, kBenchCases, [&](const BenchCase& c, std::uint64_t seed) {
    const std::int64_t h = kBenchHidden;
    HostTensor x = bench_input({c.b, c.n, c.n, c.c}, seed);
    if (c.cauchy) {
      // uniform in [-sqrt 3, sqrt 3) to u in [0, 1), then Cauchy(0, 2) by the inverse CDF
      const auto count = static_cast<std::int64_t>(x.values.size());
      double* values = x.values.data();
#pragma omp parallel for schedule(static)
      for (std::int64_t k = 0; k < count; ++k) {
        const double u = values[k] / (2.0 * std::sqrt(3.0)) + 0.5;
        values[k] = 2.0 * std::tan(std::numbers::pi * (u - 0.5));
      }
    }
    const DeviceTensor xd = testing::upload(x, kBenchDType, device);
    DeviceTensor mask;
    if (c.mask) {
      HostTensor m = bench_input({c.b, c.n, c.n}, seed + 1);
      for (double& v : m.values) v = v > 0 ? 1.0 : 0.0;
      mask = testing::upload(m, kBenchDType, device);
    }
    const double proj = 1.0 / std::sqrt(double(h)), to_out = 1.0 / std::sqrt(double(c.c));
    const DeviceTensor norm_weight = upload_scaled({c.c}, 1.0, device, seed + 2);
    const DeviceTensor norm_bias = upload_scaled({c.c}, 1.0, device, seed + 3);
    std::vector<DeviceTensor> projections;
    for (std::uint64_t k = 0; k < 5; ++k) {
      projections.push_back(upload_scaled({h, c.c}, proj, device, seed + 4 + k));
    }
    const DeviceTensor out_norm_weight = upload_scaled({h}, 1.0, device, seed + 9);
    const DeviceTensor out_norm_bias = upload_scaled({h}, 1.0, device, seed + 10);
    const DeviceTensor to_out_w = upload_scaled({c.c, h}, to_out, device, seed + 11);
    const TrimulWeights w{norm_weight.view,     norm_bias.view,       projections[0].view,
                          projections[1].view,  projections[2].view,  projections[3].view,
                          projections[4].view,  out_norm_weight.view, out_norm_bias.view,
                          to_out_w.view};
    const DeviceTensor out = testing::empty_poisoned({c.b, c.n, c.n, c.c}, kBenchDType, device);

    const detail::Timing t = detail::time_it(device, {}, [&] {
      trimul(out.view, xd.view, mask.view, w);
    }, ctx.timer);
    const double m = static_cast<double>(c.b * c.n * c.n), cc = static_cast<double>(c.c),
                 hh = static_cast<double>(h), b = static_cast<double>(c.b),
                 n = static_cast<double>(c.n);
    BenchRow row{kOp, "forward", bench_shape_name(c), kBenchDType, device};
    row.set_timing(t);
    // x and out once, the mask once, the weights once; float32 throughout
    row.bytes = (2 * m * cc + (c.mask ? m : 0) + 6 * hh * cc + 2 * cc + 2 * hh) * 4.0;
    row.flops = 2 * m * cc * 5 * hh + 2 * b * hh * n * n * n + 2 * m * hh * cc;
    ctx.record(row);
  });
}

}  // namespace

Op trimul_op() {
  return {
      .name = kOp,
      .summary = "AlphaFold-3 triangle multiplicative update (outgoing or incoming), forward",
      .bench_shapes =
          "trimul, outgoing, hidden 128, x and weights float32 (N sequence length, B batch, C "
          "channels; a random 0/1 mask where marked, x ~ Cauchy(0, 2) where marked, else "
          "uniform): N256 B2 C128, N768 B1 C128 cauchy (not on the CPU), N256 B2 C384 mask (not "
          "on the CPU), N512 B1 C128 (not on the CPU), N1024 B1 C128 cauchy (not on the CPU), "
          "N768 B1 C384 mask (not on the CPU), N1024 B1 C384 (not on the CPU). Bytes: x, out, "
          "the mask and the weights once; TFLOP/s: 2 M C 5H + 2 B H N^3 + 2 M H C with M = B N^2. "
          "--quick: N256 B2 C128 and N1024 B1 C384.",
      .check = check,
      .bench = bench,
  };
}

}  // namespace fusekit::tools
