// The cheri_block family in `fusekit check` and `fusekit bench`: dilated_conv_norm forward and
// backward, the block's training forward, backward and inference forward.
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "common/memory.h"
#include "fusekit/error.h"
#include "fusekit/ops/cheri_block.h"
#include "ops.h"
#include "ops/cheri_block/cheri_block_reference.h"
#include "ops/cheri_block/cheri_block_tolerances.h"
#include "testing/host_tensor.h"

namespace fusekit::tools {

namespace {

using testing::DeviceTensor;
using testing::HostTensor;
using testing::Layout;

constexpr const char* kOp = "cheri_block";
constexpr DType kF32 = DType::Float32, kBF16 = DType::BFloat16, kF16 = DType::Float16;

// ---------------------------------------------------------------------------------- layouts

enum class LayoutKind {
  Contiguous,
  Lnc,         // [L, N, C] in memory viewed as [N, L, C]; weights transposed in memory
  Misaligned,  // every base pointer one element past an aligned address
  Padded,      // gaps after every row
};

const char* layout_name(LayoutKind kind) {
  switch (kind) {
    case LayoutKind::Contiguous: return "contiguous";
    case LayoutKind::Lnc: return "lnc weights^T";
    case LayoutKind::Misaligned: return "misaligned";
    case LayoutKind::Padded: return "padded";
  }
  throw Error("check: unknown cheri_block layout");
}

// The layout of a tensor of `ndim` dims: 3 ([N, L, C]), 2 (a weight) or 1 (mean, rstd).
Layout layout_for(LayoutKind kind, int ndim) {
  switch (kind) {
    case LayoutKind::Contiguous: return {};
    case LayoutKind::Lnc:
      if (ndim == 3) return {.order = {1, 0, 2}};
      if (ndim == 2) return {.order = {1, 0}};
      return {};
    case LayoutKind::Misaligned: return {.order = {}, .offset_elements = 1};
    case LayoutKind::Padded: return {.order = {}, .pad_inner = ndim == 1 ? 0 : 3};
  }
  throw Error("check: unknown cheri_block layout");
}

// ---------------------------------------------------------------------------------- check

struct CheckCase {
  std::int64_t n, l, c, expansion, dilation;
  DType dtype;
  DType weight_dtype = kF32;
  LayoutKind layout = LayoutKind::Contiguous;
};

// An empty batch; L = 1; C of 1 to 128; dilations 1 to 256 (d >= L too); E of 1, 2 and 4; weights
// in x's dtype; every layout; the model's C = 128, d = 4 at a few hundred positions. Kept small
// enough for the float64 reference.
const std::vector<CheckCase> kCases = {
    {0, 16, 8, 2, 1, kF32},
    {3, 1, 3, 2, 4, kF32},
    {2, 9, 1, 4, 2, kBF16},
    {2, 7, 48, 2, 7, kF16},
    {2, 33, 80, 2, 64, kF32},
    {2, 300, 16, 1, 256, kBF16},
    {2, 256, 128, 2, 4, kF32},
    {2, 256, 128, 2, 4, kBF16, kBF16},
    {2, 200, 64, 4, 8, kF16, kF16},
    {3, 100, 32, 2, 3, kF32, kF32, LayoutKind::Lnc},
    {3, 100, 32, 2, 3, kBF16, kF32, LayoutKind::Misaligned},
    {3, 100, 33, 2, 5, kF16, kF32, LayoutKind::Padded},
};

std::string shape_name(const CheckCase& c) {
  return fmt::format("N{} L{} C{} E{} d{}", c.n, c.l, c.c, c.expansion, c.dilation);
}

std::string layout_text(const CheckCase& c) {
  std::string text = layout_name(c.layout);
  if (c.weight_dtype != kF32) text += fmt::format(" w:{}", to_string(c.weight_dtype));
  return text;
}

struct Inputs {
  HostTensor x, grad_out;  // [N, L, C]
  testing::CheriHostWeights w;
  HostTensor mean, rstd;  // [N], the float64 forward's rounded to float32
};

Inputs random_inputs(const CheckCase& c, std::mt19937_64& rng) {
  Inputs in;
  const std::int64_t hidden = c.expansion * c.c;
  in.x = testing::random_normal({c.n, c.l, c.c}, rng);
  in.grad_out = testing::random_normal({c.n, c.l, c.c}, rng);
  in.w.conv_weight = testing::random_normal({3, c.c}, rng);
  in.w.linear1 = testing::random_normal({hidden, c.c}, rng, 1.0 / std::sqrt(double(c.c)));
  in.w.linear2 = testing::random_normal({c.c, hidden}, rng, 1.0 / std::sqrt(double(hidden)));
  testing::round_to(in.x, c.dtype);
  testing::round_to(in.grad_out, c.dtype);
  for (HostTensor* t : {&in.w.conv_weight, &in.w.linear1, &in.w.linear2}) {
    testing::round_to(*t, c.weight_dtype);
  }
  const testing::ConvNormResult norm =
      testing::dilated_conv_norm_reference(in.x, in.w.conv_weight, c.dilation, 1e-3);
  in.mean = norm.mean;
  in.rstd = norm.rstd;
  testing::round_to(in.mean, kF32);
  testing::round_to(in.rstd, kF32);
  return in;
}

// The inputs on a device.
struct Tensors {
  DeviceTensor x, grad_out, conv_weight, linear1, linear2, mean_in, rstd_in;

  CheriBlockWeights weights() const { return {conv_weight.view, linear1.view, linear2.view}; }
};

Tensors upload_inputs(const Inputs& in, const CheckCase& c, Device device) {
  auto up = [&](const HostTensor& t, DType dtype) {
    return testing::upload(t, dtype, device, layout_for(c.layout, static_cast<int>(t.shape.size())));
  };
  return {up(in.x, c.dtype),           up(in.grad_out, c.dtype),
          up(in.w.conv_weight, c.weight_dtype), up(in.w.linear1, c.weight_dtype),
          up(in.w.linear2, c.weight_dtype), up(in.mean, kF32),
          up(in.rstd, kF32)};
}

// One output of a pass: its shape and dtype, made poisoned in the case's layout.
struct OutSpec {
  std::vector<std::int64_t> shape;
  DType dtype;
};

// Runs one pass as a check case: uploads the inputs, makes the poisoned outputs of `out_specs` and
// hands both to `call`, which runs the pass into them.
template <class Call>
void run_pass(const CheckContext& ctx, const CaseInfo& info, const Inputs& in, const CheckCase& c,
              const std::vector<OutSpec>& out_specs, Call call,
              const std::vector<ExpectedOutput>& expected) {
  ctx.runner->run(
      info,
      [&](Device device) {
        const Tensors t = upload_inputs(in, c, device);
        std::vector<DeviceTensor> outs;
        for (const OutSpec& o : out_specs) {
          const int ndim = static_cast<int>(o.shape.size());
          outs.push_back(
              testing::empty_poisoned(o.shape, o.dtype, device, layout_for(c.layout, ndim)));
        }
        call(t, outs);
        detail::synchronize(device);
        return outs;
      },
      expected);
}

void check_case(const CheckContext& ctx, const CheckCase& c, std::mt19937_64& rng) {
  const Inputs in = random_inputs(c, rng);
  const std::int64_t hidden = c.expansion * c.c;
  const std::vector<std::int64_t> act{c.n, c.l, c.c};
  const DilatedConvNormOptions conv_options{c.dilation, 1e-3};
  CheriBlockOptions options;
  options.dilation = c.dilation;
  // The library's tolerance policy (ops/cheri_block/cheri_block_tolerances.h, held by the C++
  // tests too): element-wise for the exact paths (every CPU path, the plane passes, the training
  // path in half precision), relative to the tensor for the CUDA fast paths: the inference kernel
  // (float16 operands) and the float32 training path with TF32 products (the options' default).
  const bool cuda = ctx.device.kind == DeviceKind::CUDA;
  const bool tf32 = cuda && c.dtype == kF32 && options.allow_tf32;
  const testing::Tolerance tol = testing::cheri_elementwise_tolerance(c.dtype);
  const testing::Tolerance wtol = testing::cheri_weight_grad_tolerance(c.weight_dtype, c.n * c.l);
  const double tf32_weights = testing::cheri_tf32_weight_grad_bound(c.n * c.l);
  const auto training = [&](const HostTensor& expected, const testing::Tolerance& exact,
                            double bound) {
    return tf32 ? testing::cheri_relative_to_max(expected, bound) : exact;
  };
  const std::string shape = shape_name(c), layout = layout_text(c);
  using Outs = std::vector<DeviceTensor>;

  const testing::ConvNormResult norm =
      testing::dilated_conv_norm_reference(in.x, in.w.conv_weight, c.dilation, 1e-3);
  run_pass(
      ctx, {"dilated_conv_norm", "forward", shape, layout, c.dtype}, in, c,
      {{act, c.dtype}, {{c.n}, kF32}, {{c.n}, kF32}},
      [&](const Tensors& t, Outs& outs) {
        dilated_conv_norm(outs[0].view, outs[1].view, outs[2].view, t.x.view, t.conv_weight.view,
                          conv_options);
      },
      {{"y", norm.y, tol},
       {"mean", norm.mean, testing::cheri_mean_tolerance(norm.rstd)},
       {"rstd", norm.rstd, testing::cheri_stat_tolerance()}});

  const testing::ConvNormGradients conv_grads = testing::dilated_conv_norm_backward_reference(
      in.grad_out, in.x, in.w.conv_weight, in.mean, in.rstd, c.dilation);
  run_pass(
      ctx, {"dilated_conv_norm", "backward", shape, layout, c.dtype}, in, c,
      {{act, c.dtype}, {{3, c.c}, c.weight_dtype}},
      [&](const Tensors& t, Outs& outs) {
        dilated_conv_norm_backward(outs[0].view, outs[1].view, t.grad_out.view, t.x.view,
                                   t.conv_weight.view, t.mean_in.view, t.rstd_in.view,
                                   conv_options);
      },
      {{"grad_x", conv_grads.grad_x, tol}, {"grad_conv_weight", conv_grads.grad_conv_weight, wtol}});

  const testing::CheriBlockResult block =
      testing::cheri_block_reference(in.x, in.w, c.dilation, options.residual_scale, 1e-3);
  run_pass(
      ctx, {kOp, "forward", shape, layout, c.dtype}, in, c,
      {{act, c.dtype}, {{c.n}, kF32}, {{c.n}, kF32}},
      [&](const Tensors& t, Outs& outs) {
        cheri_block(outs[0].view, outs[1].view, outs[2].view, t.x.view, t.weights(), options);
      },
      {{"out", block.out, training(block.out, tol, 1e-3), tol},
       {"mean", block.mean, testing::cheri_mean_tolerance(block.rstd)},
       {"rstd", block.rstd, testing::cheri_stat_tolerance()}});
  run_pass(
      ctx, {kOp, "inference", shape, layout, c.dtype}, in, c, {{act, c.dtype}},
      [&](const Tensors& t, Outs& outs) {
        cheri_block_inference(outs[0].view, t.x.view, t.weights(), options);
      },
      {{"out", block.out,
        cuda ? testing::cheri_relative_to_max(block.out, testing::cheri_fast_path_bound(c.dtype))
             : tol,
        tol}});

  const testing::CheriBlockGradients grads = testing::cheri_block_backward_reference(
      in.grad_out, in.x, in.w, in.mean, in.rstd, c.dilation, options.residual_scale);
  run_pass(
      ctx, {kOp, "backward", shape, layout, c.dtype}, in, c,
      {{act, c.dtype}, {{3, c.c}, c.weight_dtype}, {{hidden, c.c}, c.weight_dtype},
       {{c.c, hidden}, c.weight_dtype}},
      [&](const Tensors& t, Outs& outs) {
        cheri_block_backward(outs[0].view, {outs[1].view, outs[2].view, outs[3].view},
                             t.grad_out.view, t.x.view, t.weights(), t.mean_in.view,
                             t.rstd_in.view, options);
      },
      {{"grad_x", grads.grad_x, training(grads.grad_x, tol, 1e-3), tol},
       {"grads.conv_weight", grads.grads.conv_weight,
        tf32 ? testing::cheri_tf32_conv_weight_grad_tolerance(
                   grads.grads.conv_weight, grads.conv_weight_spread, tf32_weights)
             : wtol,
        wtol},
       {"grads.linear1_weight", grads.grads.linear1,
        training(grads.grads.linear1, wtol, tf32_weights), wtol},
       {"grads.linear2_weight", grads.grads.linear2,
        training(grads.grads.linear2, wtol, tf32_weights), wtol}});
}

void check(const CheckContext& ctx) { check_each(ctx, kCases, check_case); }

// ---------------------------------------------------------------------------------- bench

struct BenchCase {
  std::int64_t n, l, c, dilation;
  DType dtype;
  bool training = false;  // forward and backward, else the inference forward
  bool on_cpu = false;    // the CPU run stays at a few seconds in all
  bool quick = false;     // one of the few rows of --quick
};

constexpr std::int64_t kExpansion = 2;  // the model's E

// The model's shapes (C = 128, E = 2, d = 4): inference over N512 L1024 in float32 and bfloat16
// and over N64 L2114 in float32; training (forward and backward) over both in float32. On the
// CPU the same rows with N = 8 instead.
const std::vector<BenchCase> kBenchCases = {
    {512, 1024, 128, 4, kF32, false, false, true},
    {512, 1024, 128, 4, kBF16},
    {64, 2114, 128, 4, kF32},
    {512, 1024, 128, 4, kF32, true, false, true},
    {64, 2114, 128, 4, kF32, true},
    {8, 1024, 128, 4, kF32, false, true, true},
    {8, 1024, 128, 4, kBF16, false, true},
    {8, 1024, 128, 4, kF32, true, true, true},
};

std::string bench_shape_name(const BenchCase& c) {
  return fmt::format("N{} L{} C{} E{} d{}", c.n, c.l, c.c, kExpansion, c.dilation);
}

void bench(const BenchContext& ctx) {
  const Device device = ctx.device;
  bench_each(ctx, kBenchCases, [&](const BenchCase& c, std::uint64_t seed) {
    if (device.kind != DeviceKind::CPU && c.on_cpu) return;  // the CPU's smaller rows
    const std::int64_t hidden = kExpansion * c.c;
    const std::vector<std::int64_t> act{c.n, c.l, c.c};
    const DeviceTensor x = testing::upload(bench_input(act, seed), c.dtype, device);
    const DeviceTensor conv = testing::upload(bench_input({3, c.c}, seed + 1), kF32, device);
    HostTensor w1 = bench_input({hidden, c.c}, seed + 2), w2 = bench_input({c.c, hidden}, seed + 3);
    for (double& v : w1.values) v /= std::sqrt(double(c.c));
    for (double& v : w2.values) v /= std::sqrt(double(hidden));
    const DeviceTensor l1 = testing::upload(w1, kF32, device), l2 = testing::upload(w2, kF32, device);
    const CheriBlockWeights weights{conv.view, l1.view, l2.view};
    const DeviceTensor out = testing::empty_poisoned(act, c.dtype, device);
    CheriBlockOptions options;
    options.dilation = c.dilation;

    const auto rows = static_cast<double>(c.n * c.l);
    const double act_bytes = rows * static_cast<double>(c.c * element_size(c.dtype));
    const double product_flops = 2 * rows * static_cast<double>(c.c * hidden);
    BenchRow row{kOp, c.training ? "fwd+bwd" : "inference", bench_shape_name(c), c.dtype, device};
    if (!c.training) {
      const detail::Timing t = detail::time_it(device, {}, [&] {
        cheri_block_inference(out.view, x.view, weights, options);
      }, ctx.timer);
      row.set_timing(t);
      row.bytes = 2 * act_bytes;         // x read, out written once
      row.flops = 2 * product_flops;     // the two products
    } else {
      const DeviceTensor grad_out = testing::upload(bench_input(act, seed + 4), c.dtype, device);
      const DeviceTensor grad_x = testing::empty_poisoned(act, c.dtype, device);
      const DeviceTensor mean = testing::empty_poisoned({c.n}, kF32, device);
      const DeviceTensor rstd = testing::empty_poisoned({c.n}, kF32, device);
      const DeviceTensor g_conv = testing::empty_poisoned({3, c.c}, kF32, device);
      const DeviceTensor g_l1 = testing::empty_poisoned({hidden, c.c}, kF32, device);
      const DeviceTensor g_l2 = testing::empty_poisoned({c.c, hidden}, kF32, device);
      // what the forward keeps for the backward, where it keeps anything
      const std::int64_t saved_bytes = cheri_block_saved_bytes(x.view, weights, options);
      const DeviceTensor saved = saved_bytes > 0
                                     ? testing::empty_poisoned({saved_bytes}, DType::UInt8, device)
                                     : DeviceTensor{};
      const detail::Timing t = detail::time_it(device, {}, [&] {
        cheri_block(out.view, mean.view, rstd.view, saved.view, x.view, weights, options);
        cheri_block_backward(grad_x.view, {g_conv.view, g_l1.view, g_l2.view}, grad_out.view,
                             x.view, weights, mean.view, rstd.view, saved.view, options);
      }, ctx.timer);
      row.set_timing(t);
      row.bytes = 5 * act_bytes;      // x, out; x again, grad_out, grad_x
      row.flops = 8 * product_flops;  // 2 forward; h again and 5 more in the backward
    }
    ctx.record(row);
  });
}

}  // namespace

Op cheri_block_op() {
  return {
      .name = kOp,
      .summary = "Cheri block (dilated depthwise conv, per-example norm, GELU MLP, scaled "
                 "residual) and dilated_conv_norm, forward and backward",
      .bench_shapes =
          "cheri_block, C128 E2 d4, float32 weights: inference N512 L1024 float32 and bfloat16, "
          "N64 L2114 float32; training forward + backward N512 L1024 and N64 L2114 float32 (those "
          "on CUDA devices). On the CPU: N8 L1024 inference float32 and bfloat16, training "
          "float32. Bytes: the [N, L, C] tensors once per pass; TFLOP/s: the products, "
          "2 N L C E C each (2 for inference, 8 for training). --quick: N512 L1024 float32 "
          "inference and training (CPU: N8 float32 inference and training).",
      .check = check,
      .bench = bench,
      .has_cuda_backend = true,
  };
}

}  // namespace fusekit::tools
