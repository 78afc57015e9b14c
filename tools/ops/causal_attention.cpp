// causal_attention in `fusekit check` and `fusekit bench`.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "common/memory.h"
#include "fusekit/error.h"
#include "fusekit/ops/causal_attention.h"
#include "ops.h"
#include "ops/causal_attention/causal_attention_reference.h"
#include "ops/causal_attention/causal_attention_tolerances.h"
#include "testing/host_tensor.h"

namespace fusekit::tools {

namespace {

using testing::DeviceTensor;
using testing::HostTensor;
using testing::Layout;

constexpr const char* kOp = "causal_attention";
constexpr DType kF32 = DType::Float32, kBF16 = DType::BFloat16, kF16 = DType::Float16;

// ---------------------------------------------------------------------------------- layouts

enum class LayoutKind {
  Contiguous,
  Bthd,        // [B, T, H, D] in memory viewed as [B, H, T, D]
  Misaligned,  // every base pointer one element past an aligned address
  Padded,      // gaps after every row of D
};

const char* layout_name(LayoutKind kind) {
  switch (kind) {
    case LayoutKind::Contiguous: return "contiguous";
    case LayoutKind::Bthd: return "bthd";
    case LayoutKind::Misaligned: return "misaligned";
    case LayoutKind::Padded: return "padded";
  }
  throw Error("check: unknown causal_attention layout");
}

// The layout of a tensor of `ndim` dims (4 or 2; lse 3 or 1).
Layout layout_for(LayoutKind kind, int ndim) {
  switch (kind) {
    case LayoutKind::Contiguous: return {};
    case LayoutKind::Bthd:
      if (ndim == 4) return {.order = {0, 2, 1, 3}};
      if (ndim == 3) return {.order = {0, 2, 1}};
      return {};
    case LayoutKind::Misaligned: return {.order = {}, .offset_elements = 1};
    case LayoutKind::Padded: return {.order = {}, .pad_inner = 3};
  }
  throw Error("check: unknown causal_attention layout");
}

// ---------------------------------------------------------------------------------- check

struct CheckCase {
  std::int64_t b, hq, hkv, t, d;
  DType dtype;
  bool per_sequence = false;         // int32 counts, else one count for the batch
  std::int64_t pad = 0;              // the batch's count
  std::vector<std::int64_t> counts = {};  // per_sequence: one per sequence; {}: drawn from [0, T]
  LayoutKind layout = LayoutKind::Contiguous;
  bool single_head = false;          // the [T, D] form
  std::optional<double> scale = {};  // default 1 / sqrt(D)
};

// Empty inputs; one token; D of 1 to 256 (odd ones too); grouped-query heads; padding of 0, T - 1
// and T, for the batch and per sequence; the single-head form; every layout; a sharp softmax;
// and the GPT-2 shape of the benchmark. Kept small enough for the float64 reference.
const std::vector<CheckCase> kCases = {
    {.b = 0, .hq = 4, .hkv = 2, .t = 16, .d = 32, .dtype = kF32},
    {.b = 2, .hq = 4, .hkv = 2, .t = 0, .d = 32, .dtype = kBF16, .per_sequence = true,
     .counts = {0, 0}},
    {.b = 1, .hq = 1, .hkv = 1, .t = 1, .d = 1, .dtype = kF32},
    {.b = 2, .hq = 3, .hkv = 1, .t = 17, .d = 1, .dtype = kF16, .per_sequence = true,
     .counts = {0, 16}},
    {.b = 2, .hq = 4, .hkv = 2, .t = 17, .d = 80, .dtype = kBF16, .pad = 16},
    {.b = 2, .hq = 2, .hkv = 2, .t = 33, .d = 64, .dtype = kF32, .pad = 33},
    {.b = 4, .hq = 8, .hkv = 2, .t = 256, .d = 64, .dtype = kF32, .per_sequence = true},
    {.b = 4, .hq = 8, .hkv = 2, .t = 256, .d = 64, .dtype = kBF16, .per_sequence = true},
    {.b = 3, .hq = 4, .hkv = 4, .t = 200, .d = 128, .dtype = kF16, .per_sequence = true,
     .counts = {200, 0, 199}},
    {.b = 1, .hq = 2, .hkv = 1, .t = 300, .d = 256, .dtype = kBF16, .pad = 7},
    {.b = 2, .hq = 6, .hkv = 3, .t = 130, .d = 96, .dtype = kF32, .per_sequence = true,
     .scale = 1.0},
    {.b = 1, .hq = 1, .hkv = 1, .t = 500, .d = 64, .dtype = kF32, .pad = 10, .single_head = true},
    {.b = 1, .hq = 1, .hkv = 1, .t = 77, .d = 40, .dtype = kF16, .per_sequence = true,
     .counts = {30}, .layout = LayoutKind::Padded, .single_head = true},
    {.b = 2, .hq = 4, .hkv = 2, .t = 150, .d = 64, .dtype = kBF16, .per_sequence = true,
     .layout = LayoutKind::Bthd},
    {.b = 2, .hq = 4, .hkv = 1, .t = 150, .d = 72, .dtype = kF16, .pad = 20,
     .layout = LayoutKind::Misaligned},
    {.b = 2, .hq = 2, .hkv = 2, .t = 150, .d = 33, .dtype = kF32, .per_sequence = true,
     .layout = LayoutKind::Padded},
    {.b = 1, .hq = 12, .hkv = 12, .t = 1024, .d = 64, .dtype = kBF16, .pad = 100},
};

// The bounds of the library's tolerance policy (ops/causal_attention/causal_attention_tolerances.h,
// held by the C++ tests too), for unit-size inputs at the case's `scale` and the default options.
testing::AttentionPrecision precision_of(const CheckCase& c, double scale) {
  return {.dtype = c.dtype,
          .allow_tf32 = CausalAttentionOptions{}.allow_tf32,
          .d = c.d,
          .score_size = testing::attention_score_size(scale, 1.0, c.d)};
}

// "B4 Hq8 Hkv2 T256 D64", "B1 H12 T1024 D64" (Hq = Hkv), "T500 D64" (the single-head form).
std::string shape_name(const CheckCase& c) {
  if (c.single_head) return fmt::format("T{} D{}", c.t, c.d);
  if (c.hq == c.hkv) return fmt::format("B{} H{} T{} D{}", c.b, c.hq, c.t, c.d);
  return fmt::format("B{} Hq{} Hkv{} T{} D{}", c.b, c.hq, c.hkv, c.t, c.d);
}

// The layout, then the padding (pad<n> for the batch, pad-seq per sequence) and any scale.
std::string layout_text(const CheckCase& c) {
  std::string text = layout_name(c.layout);
  text += c.per_sequence ? std::string(" pad-seq") : fmt::format(" pad{}", c.pad);
  if (c.scale) text += fmt::format(" scale{:g}", *c.scale);
  return text;
}

// The inputs in float64, rounded to the dtype, N(0, 1); every padding row of q, k and v NaN.
struct Inputs {
  HostTensor q, k, v;  // [B, Hq, T, D] and [B, Hkv, T, D]
  std::vector<std::int64_t> n_padd;
};

Inputs random_inputs(const CheckCase& c, std::mt19937_64& rng) {
  Inputs in;
  in.q = testing::random_normal({c.b, c.hq, c.t, c.d}, rng);
  in.k = testing::random_normal({c.b, c.hkv, c.t, c.d}, rng);
  in.v = testing::random_normal({c.b, c.hkv, c.t, c.d}, rng);
  for (HostTensor* x : {&in.q, &in.k, &in.v}) testing::round_to(*x, c.dtype);
  if (!c.per_sequence) {
    in.n_padd.assign(static_cast<std::size_t>(c.b), c.pad);
  } else if (!c.counts.empty()) {
    in.n_padd = c.counts;
  } else {
    std::uniform_int_distribution<std::int64_t> count(0, c.t);
    for (std::int64_t b = 0; b < c.b; ++b) in.n_padd.push_back(count(rng));
  }
  for (HostTensor* x : {&in.q, &in.k, &in.v}) {
    const std::int64_t heads = x->shape[1];
    for (std::int64_t b = 0; b < c.b; ++b) {
      const std::int64_t row = c.d, head = c.t * row;
      for (std::int64_t h = 0; h < heads; ++h) {
        double* first = x->values.data() + (b * heads + h) * head;
        std::fill(first, first + in.n_padd[b] * row, std::numeric_limits<double>::quiet_NaN());
      }
    }
  }
  return in;
}

HostTensor reshaped(HostTensor t, std::vector<std::int64_t> shape) {
  t.shape = std::move(shape);
  return t;
}

void check_case(const CheckContext& ctx, const CheckCase& c, std::mt19937_64& rng) {
  const Inputs in = random_inputs(c, rng);
  std::vector<std::int64_t> q_shape{c.b, c.hq, c.t, c.d}, kv_shape{c.b, c.hkv, c.t, c.d},
      lse_shape{c.b, c.hq, c.t};
  if (c.single_head) {
    q_shape = kv_shape = {c.t, c.d};
    lse_shape = {c.t};
  }
  const int ndim = static_cast<int>(q_shape.size());
  CausalAttentionOptions options;
  options.scale = c.scale;
  auto run_on = [&](Device device) {
    auto input = [&](const HostTensor& x, const std::vector<std::int64_t>& shape) {
      return testing::upload(reshaped(x, shape), c.dtype, device, layout_for(c.layout, ndim));
    };
    const DeviceTensor q = input(in.q, q_shape), k = input(in.k, kv_shape),
                       v = input(in.v, kv_shape);
    const DeviceTensor counts =
        c.per_sequence ? testing::upload_padding_counts(in.n_padd, device) : DeviceTensor{};
    std::vector<DeviceTensor> outs;
    outs.push_back(
        testing::empty_poisoned(q_shape, c.dtype, device, layout_for(c.layout, ndim)));
    outs.push_back(testing::empty_poisoned(lse_shape, kF32, device,
                                           layout_for(c.layout, ndim - 1)));
    causal_attention(outs[0].view, outs[1].view, q.view, k.view, v.view,
                     LeftPadding{c.per_sequence ? 0 : c.pad, counts.view}, options);
    detail::synchronize(device);
    return outs;
  };
  const double scale = c.scale ? *c.scale : 1.0 / std::sqrt(static_cast<double>(c.d));
  testing::CausalAttentionResult reference =
      testing::causal_attention_reference(in.q, in.k, in.v, in.n_padd, scale);
  const testing::AttentionPrecision precision = precision_of(c, scale);
  const bool cuda = ctx.device.kind == DeviceKind::CUDA;
  const testing::Tolerance cpu_out = testing::attention_cpu_out_tolerance(precision),
                           cpu_lse = testing::attention_cpu_lse_tolerance(precision);
  ctx.runner->run(
      {kOp, "forward", shape_name(c), layout_text(c), c.dtype}, run_on,
      {{"out", reshaped(std::move(reference.out), q_shape),
        cuda ? testing::attention_cuda_out_tolerance(precision) : cpu_out, cpu_out},
       {"lse", reshaped(std::move(reference.lse), lse_shape),
        cuda ? testing::attention_cuda_lse_tolerance(precision) : cpu_lse, cpu_lse}});
}

void check(const CheckContext& ctx) { check_each(ctx, kCases, check_case); }

// ---------------------------------------------------------------------------------- bench

struct BenchCase {
  std::int64_t b, h, t, d, pad;
  DType dtype;
  bool on_cpu = false;  // the CPU run stays at about a minute in all
  bool quick = false;   // one of the few rows of --quick
};

// GPT-2 small (12 heads of 64) over 1024 tokens: one sequence left-padded by 100 in bfloat16 and
// float32, and a batch of 8 without padding. On the CPU only the first: one run takes about a
// second there.
const std::vector<BenchCase> kBenchCases = {
    {1, 12, 1024, 64, 100, kBF16, true, true},
    {1, 12, 1024, 64, 100, kF32},
    {8, 12, 1024, 64, 0, kBF16, false, true},
};

std::string bench_shape_name(const BenchCase& c) {
  return fmt::format("B{} H{} T{} D{} pad{}", c.b, c.h, c.t, c.d, c.pad);
}

void bench(const BenchContext& ctx) {
  const Device device = ctx.device;
  bench_each(ctx, kBenchCases, [&](const BenchCase& c, std::uint64_t seed) {
    const std::vector<std::int64_t> shape{c.b, c.h, c.t, c.d};
    const DeviceTensor q = testing::upload(bench_input(shape, seed), c.dtype, device);
    const DeviceTensor k = testing::upload(bench_input(shape, seed + 1), c.dtype, device);
    const DeviceTensor v = testing::upload(bench_input(shape, seed + 2), c.dtype, device);
    const DeviceTensor out = testing::empty_poisoned(shape, c.dtype, device);

    const detail::Timing t = detail::time_it(device, {}, [&] {
      causal_attention(out.view, {}, q.view, k.view, v.view, LeftPadding{c.pad});
    }, ctx.timer);
    const auto elements = static_cast<double>(c.b * c.h * c.t * c.d);
    const auto b = static_cast<double>(c.b), h = static_cast<double>(c.h),
               tt = static_cast<double>(c.t), d = static_cast<double>(c.d);
    BenchRow row{kOp, "forward", bench_shape_name(c), c.dtype, device};
    row.set_timing(t);
    row.bytes = 4 * elements * double(element_size(c.dtype));  // q, k, v and out once
    row.flops = 2 * b * h * tt * tt * d;  // the causal half of the two products, padding counted
    ctx.record(row);
  });
}

}  // namespace

Op causal_attention_op() {
  return {
      .name = kOp,
      .summary = "causal self-attention over left-padded sequences (grouped-query heads), "
                 "forward",
      .bench_shapes =
          "causal_attention, no lse (B batch, H heads, T tokens, D head dim, pad the left padding "
          "of every sequence): B1 H12 T1024 D64 pad100 bfloat16, B1 H12 T1024 D64 pad100 float32 "
          "(not on the CPU), B8 H12 T1024 D64 pad0 bfloat16 (not on the CPU). Bytes: q, k, v and "
          "out once; TFLOP/s: 2 B H T^2 D (the causal half of both products, padding included). "
          "--quick: the first and the third.",
      .check = check,
      .bench = bench,
  };
}

}  // namespace fusekit::tools
