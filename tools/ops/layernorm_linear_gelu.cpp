// layernorm_linear_gelu in `fusekit check` and `fusekit bench`.
#include <cmath>
#include <cstdint>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "fusekit/error.h"
#include "fusekit/ops/layernorm_linear_gelu.h"
#include "ops.h"
#include "ops/layernorm_linear_gelu/layernorm_linear_gelu_reference.h"
#include "testing/host_tensor.h"

namespace fusekit::tools {

namespace {

using testing::DeviceTensor;
using testing::HostTensor;
using testing::Layout;

constexpr const char* kOp = "layernorm_linear_gelu";
constexpr DType kF32 = DType::Float32, kBF16 = DType::BFloat16, kF16 = DType::Float16;

// ---------------------------------------------------------------------------------- layouts

enum class LayoutKind {
  Contiguous,
  WeightTransposed,  // weight is the transpose of a row-major [K, Nout]: the column-major path
  Misaligned,        // every base pointer one element past an aligned address
  WeightTransposedMisaligned,
  Padded,     // gaps between the rows of x, weight and out; the LayerNorm parameters strided
  XStrided,   // x's K axis is its outermost in memory; the LayerNorm parameters strided
};

const char* layout_name(LayoutKind kind) {
  switch (kind) {
    case LayoutKind::Contiguous: return "contiguous";
    case LayoutKind::WeightTransposed: return "weight^T";
    case LayoutKind::Misaligned: return "misaligned";
    case LayoutKind::WeightTransposedMisaligned: return "weight^T misaligned";
    case LayoutKind::Padded: return "padded";
    case LayoutKind::XStrided: return "x strided";
  }
  throw Error("check: unknown layernorm_linear_gelu layout");
}

enum class Role { X, Weight, Bias, LnParam, Out };

std::vector<int> reversed_dims(int ndim) {
  std::vector<int> order(ndim);
  std::iota(order.rbegin(), order.rend(), 0);
  return order;
}

Layout layout_for(LayoutKind kind, Role role, int ndim) {
  switch (kind) {
    case LayoutKind::Contiguous: return {};
    case LayoutKind::WeightTransposed:
      return role == Role::Weight ? Layout{.order = {1, 0}} : Layout{};
    case LayoutKind::Misaligned: return {.order = {}, .offset_elements = 1};
    case LayoutKind::WeightTransposedMisaligned:
      return {.order = role == Role::Weight ? std::vector<int>{1, 0} : std::vector<int>{},
              .offset_elements = 1};
    case LayoutKind::Padded:
      switch (role) {
        case Role::X:
        case Role::Weight:
        case Role::Out: return {.order = {}, .pad_inner = 8};
        case Role::Bias:
        case Role::LnParam: return {};  // LayerNorm parameters: see strided_ln_params
      }
      break;
    case LayoutKind::XStrided:
      return role == Role::X ? Layout{.order = reversed_dims(ndim)} : Layout{};
  }
  throw Error("check: unknown layernorm_linear_gelu layout");
}

bool strided_ln_params(LayoutKind kind) {
  return kind == LayoutKind::Padded || kind == LayoutKind::XStrided;
}

// ---------------------------------------------------------------------------------- check

enum class LnParams { None, XDType, Float32 };

struct CheckCase {
  std::vector<std::int64_t> lead;  // x's leading dims; M is their product
  std::int64_t k, nout;
  DType dtype;
  LayoutKind layout = LayoutKind::Contiguous;
  bool bias = true;
  LnParams ln = LnParams::XDType;
  GeluApproximation approximate = GeluApproximation::Tanh;
  bool allow_tf32 = true;  // float32 only
  double eps = 1e-5;
  double x_mean = 0;  // x ~ N(x_mean, 1): a large mean tests the two-pass statistics
};

// The odd sizes (K and Nout of 1, 3 and 1000, no rows, no outputs, x without leading dims or with
// three), each option (bias, LayerNorm parameters in x's dtype, in float32 or absent, both GELUs,
// float32 with and without TF32, eps) and each weight layout, misaligned and strided, kept small
// enough for the float64 reference.
const std::vector<CheckCase> kCases = {
    {.lead = {0}, .k = 64, .nout = 32, .dtype = kF32},
    {.lead = {4}, .k = 64, .nout = 0, .dtype = kF16},
    {.lead = {1}, .k = 1, .nout = 1, .dtype = kF32},
    {.lead = {1}, .k = 1, .nout = 1, .dtype = kBF16},
    {.lead = {7}, .k = 3, .nout = 3, .dtype = kF16},
    {.lead = {7}, .k = 127, .nout = 1000, .dtype = kF32},
    {.lead = {7}, .k = 127, .nout = 1000, .dtype = kF32, .allow_tf32 = false},
    {.lead = {7}, .k = 127, .nout = 1000, .dtype = kBF16},
    {.lead = {7}, .k = 127, .nout = 1000, .dtype = kF16},
    {.lead = {64}, .k = 1000, .nout = 1000, .dtype = kF16},
    {.lead = {64}, .k = 1000, .nout = 1000, .dtype = kBF16,
     .approximate = GeluApproximation::None},
    {.lead = {64}, .k = 1000, .nout = 1000, .dtype = kF32,
     .approximate = GeluApproximation::None, .allow_tf32 = false},
    {.lead = {2, 3, 5}, .k = 256, .nout = 384, .dtype = kBF16},
    {.lead = {}, .k = 64, .nout = 128, .dtype = kF16},
    {.lead = {16}, .k = 1024, .nout = 1, .dtype = kF16},
    {.lead = {33}, .k = 1000, .nout = 3, .dtype = kF32},
    {.lead = {300}, .k = 512, .nout = 520, .dtype = kF16},
    {.lead = {16}, .k = 4096, .nout = 1000, .dtype = kBF16},
    {.lead = {64}, .k = 512, .nout = 256, .dtype = kF16, .bias = false},
    {.lead = {64}, .k = 512, .nout = 256, .dtype = kBF16, .ln = LnParams::None},
    {.lead = {64}, .k = 1024, .nout = 512, .dtype = kF16, .bias = false, .ln = LnParams::None},
    {.lead = {64}, .k = 512, .nout = 256, .dtype = kF16, .ln = LnParams::Float32},
    {.lead = {64}, .k = 512, .nout = 256, .dtype = kBF16, .ln = LnParams::Float32,
     .approximate = GeluApproximation::None},
    {.lead = {16}, .k = 3, .nout = 64, .dtype = kF32, .allow_tf32 = false, .eps = 0.1},
    {.lead = {64}, .k = 1000, .nout = 256, .dtype = kF16, .x_mean = 300},
    {.lead = {64}, .k = 1000, .nout = 256, .dtype = kF32, .x_mean = 100},
    {.lead = {64}, .k = 1000, .nout = 1000, .dtype = kF16, .layout = LayoutKind::WeightTransposed},
    {.lead = {7}, .k = 127, .nout = 3, .dtype = kF32, .layout = LayoutKind::WeightTransposed},
    {.lead = {7}, .k = 127, .nout = 300, .dtype = kBF16, .layout = LayoutKind::WeightTransposed,
     .approximate = GeluApproximation::None},
    {.lead = {33}, .k = 256, .nout = 1000, .dtype = kF32, .layout = LayoutKind::WeightTransposed,
     .allow_tf32 = false},
    {.lead = {64}, .k = 1000, .nout = 1000, .dtype = kF16, .layout = LayoutKind::Misaligned},
    {.lead = {7}, .k = 127, .nout = 3, .dtype = kBF16, .layout = LayoutKind::Misaligned},
    {.lead = {7}, .k = 128, .nout = 256, .dtype = kF32, .layout = LayoutKind::Misaligned,
     .ln = LnParams::Float32},
    {.lead = {64}, .k = 512, .nout = 1000, .dtype = kF16,
     .layout = LayoutKind::WeightTransposedMisaligned},
    {.lead = {2, 32}, .k = 512, .nout = 256, .dtype = kBF16, .layout = LayoutKind::Padded},
    {.lead = {64}, .k = 127, .nout = 1000, .dtype = kF32, .layout = LayoutKind::Padded,
     .ln = LnParams::Float32},
    {.lead = {7}, .k = 127, .nout = 300, .dtype = kF16, .layout = LayoutKind::XStrided},
    {.lead = {2, 3}, .k = 64, .nout = 64, .dtype = kF32, .layout = LayoutKind::XStrided,
     .allow_tf32 = false},
};

// Errors against float64, for outputs of unit size (normalised rows, weights of norm 1 per
// output). The normalised rows are rounded to the operand precision u (float16 and TF32 keep 11
// significant bits, bfloat16 8); summed with random signs over K that is an error near u at the
// outputs' scale, and the rounding of the output adds up to u relative. TF32 rounds both operands
// (possibly by truncation), so it counts twice. float32 without TF32: float32 sums.
testing::Tolerance tolerance(const CheckCase& c) {
  if (c.dtype == kF32 && !c.allow_tf32) return {.atol = 2e-5, .rtol = 1e-5, .rel = 1e-5};
  double u = 0;
  switch (c.dtype) {
    case DType::Float32: u = 0x1p-10; break;  // TF32, both operands rounded
    case DType::Float16: u = 0x1p-11; break;
    case DType::BFloat16: u = 0x1p-8; break;
    default: throw Error(detail::concat("check: no tolerance for dtype ", to_string(c.dtype)));
  }
  return {.atol = 6 * u, .rtol = 4 * u, .rel = 3 * u};
}

std::int64_t rows_of(const CheckCase& c) {
  return std::accumulate(c.lead.begin(), c.lead.end(), std::int64_t{1}, std::multiplies<>());
}

// "M2x3x5 K256 N384"; x without leading dims: "K64 N128".
std::string shape_name(const CheckCase& c) {
  if (c.lead.empty()) return fmt::format("K{} N{}", c.k, c.nout);
  return fmt::format("M{} K{} N{}", fmt::join(c.lead, "x"), c.k, c.nout);
}

// The layout, then what differs from the default call: no bias, no or float32 LayerNorm
// parameters, exact GELU, full float32 products, eps, a large mean of x.
std::string layout_text(const CheckCase& c) {
  std::string text = layout_name(c.layout);
  if (!c.bias) text += " nobias";
  if (c.ln == LnParams::None) text += " noln";
  if (c.ln == LnParams::Float32) text += " ln-f32";
  if (c.approximate == GeluApproximation::None) text += " erf";
  if (c.dtype == kF32 && !c.allow_tf32) text += " notf32";
  if (c.eps != 1e-5) text += fmt::format(" eps{:g}", c.eps);
  if (c.x_mean != 0) text += fmt::format(" mean{:g}", c.x_mean);
  return text;
}

// The inputs of one case in float64, already rounded to the dtypes they are stored in; x as
// [M, K]. An absent argument is an empty HostTensor.
struct Inputs {
  HostTensor x, weight, bias, ln_weight, ln_bias;
};

HostTensor random_rounded(std::vector<std::int64_t> shape, DType dtype, std::mt19937_64& rng,
                          double stddev = 1.0, double mean = 0.0) {
  HostTensor t = testing::random_normal(std::move(shape), rng, stddev);
  for (double& v : t.values) v += mean;
  testing::round_to(t, dtype);
  return t;
}

DType ln_dtype(const CheckCase& c) { return c.ln == LnParams::Float32 ? kF32 : c.dtype; }

Inputs random_inputs(const CheckCase& c, std::mt19937_64& rng) {
  Inputs in;
  in.x = random_rounded({rows_of(c), c.k}, c.dtype, rng, 1.0, c.x_mean);
  // torch Linear's scale, so that the outputs are of unit size for any K
  in.weight = random_rounded({c.nout, c.k}, c.dtype, rng, 1.0 / std::sqrt(double(c.k)));
  if (c.bias) in.bias = random_rounded({c.nout}, c.dtype, rng, 0.5);
  if (c.ln != LnParams::None) {
    in.ln_weight = random_rounded({c.k}, ln_dtype(c), rng, 0.25, 1.0);
    in.ln_bias = random_rounded({c.k}, ln_dtype(c), rng, 0.25);
  }
  return in;
}

std::vector<std::int64_t> with_last(std::vector<std::int64_t> lead, std::int64_t last) {
  lead.push_back(last);
  return lead;
}

// A [K] parameter whose elements lie every other one, with NaN between them.
DeviceTensor upload_strided_vector(const HostTensor& t, DType dtype, Device device) {
  const std::int64_t n = t.numel(), stride = 2;
  HostTensor column = t;
  column.shape = {n, 1};
  DeviceTensor d = testing::upload(column, dtype, device, {.order = {}, .pad_inner = stride - 1});
  d.view = TensorView::from_arrays(d.view.data, dtype, 1, &n, &stride, device);
  return d;
}

struct DeviceInputs {
  DeviceTensor x, weight, bias, ln_weight, ln_bias;  // absent ones hold an empty view
};

DeviceInputs upload_inputs(const Inputs& in, const CheckCase& c, Device device) {
  const auto x_shape = with_last(c.lead, c.k);
  HostTensor x = in.x;
  x.shape = x_shape;
  DeviceInputs d;
  d.x = testing::upload(x, c.dtype, device,
                        layout_for(c.layout, Role::X, static_cast<int>(x_shape.size())));
  d.weight = testing::upload(in.weight, c.dtype, device, layout_for(c.layout, Role::Weight, 2));
  if (c.bias) {
    d.bias = testing::upload(in.bias, c.dtype, device, layout_for(c.layout, Role::Bias, 1));
  }
  if (c.ln != LnParams::None) {
    auto upload_ln = [&](const HostTensor& t) {
      return strided_ln_params(c.layout)
                 ? upload_strided_vector(t, ln_dtype(c), device)
                 : testing::upload(t, ln_dtype(c), device, layout_for(c.layout, Role::LnParam, 1));
    };
    d.ln_weight = upload_ln(in.ln_weight);
    d.ln_bias = upload_ln(in.ln_bias);
  }
  return d;
}

void check_case(const CheckContext& ctx, const CheckCase& c, std::mt19937_64& rng) {
  const Inputs in = random_inputs(c, rng);
  const auto out_shape = with_last(c.lead, c.nout);
  const LayerNormLinearGeluOptions options{
      .eps = c.eps, .approximate = c.approximate, .allow_tf32 = c.allow_tf32};
  auto run_on = [&](Device device) {
    const DeviceInputs d = upload_inputs(in, c, device);
    std::vector<DeviceTensor> outs;
    outs.push_back(testing::empty_poisoned(
        out_shape, c.dtype, device,
        layout_for(c.layout, Role::Out, static_cast<int>(out_shape.size()))));
    layernorm_linear_gelu(outs[0].view, d.x.view, d.weight.view, d.bias.view, d.ln_weight.view,
                          d.ln_bias.view, options);
    detail::synchronize(device);
    return outs;
  };
  HostTensor reference = testing::layernorm_linear_gelu_reference(
      in.x, in.weight, in.bias, in.ln_weight, in.ln_bias, c.eps, c.approximate);
  reference.shape = out_shape;
  ctx.runner->run({kOp, "forward", shape_name(c), layout_text(c), c.dtype}, run_on,
                  {{"out", std::move(reference), tolerance(c)}});
}

void check(const CheckContext& ctx) { check_each(ctx, kCases, check_case); }

// ---------------------------------------------------------------------------------- bench

struct BenchCase {
  std::int64_t m, k, nout;
  bool on_cpu = false;  // the CPU run stays at about a minute in all
  bool quick = false;   // one of the few rows of --quick
};

// A transformer MLP's first layer at a prefill of 512 and 8192 tokens (hidden 1024 and 4096) and
// at a decode step of 16 tokens, where the weight read is the whole cost. float16, with a bias
// and without LayerNorm parameters, as the seed kernel computes it.
const std::vector<BenchCase> kBenchCases = {
    {512, 1024, 4096, true, true},
    {8192, 1024, 4096},
    {8192, 4096, 16384},
    {16, 4096, 16384, false, true},
};
constexpr DType kBenchDType = DType::Float16;

std::string bench_shape_name(const BenchCase& c) {
  return fmt::format("M{} K{} N{}", c.m, c.k, c.nout);
}

// [Nout, K] at torch Linear's scale, so that GELU sees values of unit size.
DeviceTensor upload_weight(const BenchCase& c, Device device, std::uint64_t seed) {
  HostTensor w = bench_input({c.nout, c.k}, seed);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.k));
  for (double& v : w.values) v *= scale;
  return testing::upload(w, kBenchDType, device);
}

void bench(const BenchContext& ctx) {
  const Device device = ctx.device;
  bench_each(ctx, kBenchCases, [&](const BenchCase& c, std::uint64_t seed) {
    const DeviceTensor x = testing::upload(bench_input({c.m, c.k}, seed), kBenchDType, device);
    const DeviceTensor weight = upload_weight(c, device, seed + 1);
    const DeviceTensor bias = testing::upload(bench_input({c.nout}, seed + 2), kBenchDType, device);
    const DeviceTensor out = testing::empty_poisoned({c.m, c.nout}, kBenchDType, device);

    const detail::Timing t = detail::time_it(device, {}, [&] {
      layernorm_linear_gelu(out.view, x.view, weight.view, bias.view);
    }, ctx.timer);
    const auto m = static_cast<double>(c.m), k = static_cast<double>(c.k),
               nout = static_cast<double>(c.nout);
    BenchRow row{kOp, "forward", bench_shape_name(c), kBenchDType, device};
    row.set_timing(t);
    row.bytes = (m * k + nout * k + nout + m * nout) * double(element_size(kBenchDType));
    row.flops = 2 * m * k * nout;
    ctx.record(row);
  });
}

}  // namespace

Op layernorm_linear_gelu_op() {
  return {
      .name = kOp,
      .summary = "LayerNorm, then a Linear layer, then GELU, forward",
      .bench_shapes =
          "layernorm_linear_gelu, float16, with a bias, no LayerNorm parameters (M rows, K in, "
          "N out): M512 K1024 N4096, M8192 K1024 N4096 (not on the CPU), M8192 K4096 N16384 "
          "(not on the CPU), M16 K4096 N16384 (not on the CPU). Bytes: x, weight, bias and out "
          "once; TFLOP/s: 2 M K N. --quick: M512 K1024 N4096 and M16 K4096 N16384.",
      .check = check,
      .bench = bench,
  };
}

}  // namespace fusekit::tools
