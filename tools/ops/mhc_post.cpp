// mhc_post in `fusekit check` and `fusekit bench`.
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "common/memory.h"
#include "fusekit/error.h"
#include "fusekit/ops/mhc_post.h"
#include "ops.h"
#include "ops/mhc_post/mhc_post_reference.h"
#include "testing/host_tensor.h"

namespace fusekit::tools {

namespace {

using testing::DeviceTensor;
using testing::HostTensor;
using testing::Layout;

constexpr const char* kOp = "mhc_post";

// ---------------------------------------------------------------------------------- layouts

enum class LayoutKind {
  Contiguous,
  Post3d,      // contiguous, post_layer_mix (and its gradient) as [N, hc, 1]
  Misaligned,  // every base pointer one element past an aligned address: no vector path
  Padded,      // gaps between rows that keep 16-byte alignment, residual hc-major: strided rows
               // that still take the vector path
  Transposed,  // H is not the innermost axis: the element-wise path
};

const char* layout_name(LayoutKind kind) {
  switch (kind) {
    case LayoutKind::Contiguous: return "contiguous";
    case LayoutKind::Post3d: return "post3d";
    case LayoutKind::Misaligned: return "misaligned";
    case LayoutKind::Padded: return "padded";
    case LayoutKind::Transposed: return "transposed";
  }
  throw Error("check: unknown mhc_post layout");
}

bool post_is_3d(LayoutKind kind) {
  return kind == LayoutKind::Post3d || kind == LayoutKind::Padded;
}

// What a tensor is to the operator, which decides how a layout kind lays it out.
enum class Role {
  Rows3,  // [N, hc, H]: residual, out, grad_out, grad_residual
  Rows2,  // [N, H]: x, grad_x
  Post,   // [N, hc] or [N, hc, 1]
  Comb,   // [N, hc, hc]
};

std::vector<int> reversed_dims(int ndim) {
  std::vector<int> order(ndim);
  std::iota(order.rbegin(), order.rend(), 0);
  return order;
}

Layout layout_for(LayoutKind kind, Role role, int ndim) {
  switch (kind) {
    case LayoutKind::Contiguous:
    case LayoutKind::Post3d: return {};
    case LayoutKind::Misaligned: return {.order = {}, .offset_elements = 1};
    case LayoutKind::Padded:
      switch (role) {
        case Role::Rows3: return {.order = {1, 0, 2}, .pad_inner = 8};
        case Role::Rows2: return {.order = {}, .pad_inner = 8};
        case Role::Post: return {.order = {}, .pad_inner = 1};
        case Role::Comb: return {.order = {0, 2, 1}};
      }
      break;
    case LayoutKind::Transposed:
      switch (role) {
        case Role::Rows3: return {.order = {0, 2, 1}};
        case Role::Rows2:
        case Role::Post:
        case Role::Comb: return {.order = reversed_dims(ndim)};
      }
      break;
  }
  throw Error("check: unknown mhc_post layout");
}

// ---------------------------------------------------------------------------------- check

struct CheckCase {
  std::int64_t n, h, hc;
  DType dtype;
  LayoutKind layout = LayoutKind::Contiguous;
};

constexpr DType kF32 = DType::Float32, kBF16 = DType::BFloat16, kF16 = DType::Float16;

// Every dispatch branch (vector and element-wise paths, one and several H chunks in the backward,
// each hc) and the awkward sizes, kept small enough for the CPU's float64 reference.
const std::vector<CheckCase> kForwardCases = {
    {0, 1280, 4, kF32},
    {1, 1, 1, kF32},
    {1, 1, 1, kBF16},
    {7, 127, 3, kF32},
    {7, 127, 3, kBF16},
    {7, 127, 3, kF16},
    {64, 1280, 4, kF32},
    {64, 1280, 4, kBF16, LayoutKind::Post3d},
    {64, 1280, 4, kF16},
    {8, 7168, 8, kBF16},
    {7, 7168, 1, kF16},
    {64, 1280, 4, kBF16, LayoutKind::Misaligned},
    {7, 127, 3, kF32, LayoutKind::Misaligned},
    {64, 1280, 4, kBF16, LayoutKind::Padded},
    {7, 1280, 2, kF16, LayoutKind::Transposed},
    {64, 7168, 4, kBF16},
    {1, 7168, 8, kF32},
    {64, 1, 4, kBF16},
    {7, 127, 3, kF16, LayoutKind::Misaligned},
    {64, 1280, 4, kF32, LayoutKind::Padded},
    {64, 1280, 8, kBF16, LayoutKind::Transposed},
};

const std::vector<CheckCase> kBackwardCases = {
    {0, 127, 4, kF32},
    {1, 1, 1, kF32},
    {7, 127, 3, kF32},
    {7, 127, 3, kBF16},
    {7, 127, 3, kF16},
    {64, 1280, 4, kF32},
    {64, 1280, 4, kBF16, LayoutKind::Post3d},
    {8, 7168, 4, kBF16},
    {7, 7168, 8, kF16},
    {64, 1280, 4, kBF16, LayoutKind::Misaligned},
    {64, 1280, 4, kBF16, LayoutKind::Padded},
    {7, 1280, 2, kF32, LayoutKind::Transposed},
    {64, 7168, 4, kBF16},
    {64, 512, 4, kF16},
    {1, 7168, 8, kF32},
    {64, 127, 1, kF16},
    {7, 127, 3, kF16, LayoutKind::Misaligned},
    {64, 1280, 4, kF32, LayoutKind::Padded},
    {7, 1280, 4, kBF16, LayoutKind::Transposed},
};

std::string shape_name(std::int64_t n, std::int64_t h, std::int64_t hc) {
  return fmt::format("N{} H{} hc{}", n, h, hc);
}

// The inputs of one case in float64, already rounded to the dtypes they are stored in.
struct Inputs {
  HostTensor x, residual, post, comb;
};

HostTensor random_rounded(std::vector<std::int64_t> shape, DType dtype, std::mt19937_64& rng) {
  HostTensor t = testing::random_normal(std::move(shape), rng);
  testing::round_to(t, dtype);
  return t;
}

std::vector<std::int64_t> post_shape(const CheckCase& c) {
  if (post_is_3d(c.layout)) return {c.n, c.hc, 1};
  return {c.n, c.hc};
}

Inputs random_inputs(const CheckCase& c, std::mt19937_64& rng) {
  return {random_rounded({c.n, c.h}, c.dtype, rng), random_rounded({c.n, c.hc, c.h}, c.dtype, rng),
          random_rounded(post_shape(c), kF32, rng), random_rounded({c.n, c.hc, c.hc}, kF32, rng)};
}

struct DeviceInputs {
  DeviceTensor x, residual, post, comb;
};

DeviceInputs upload_inputs(const Inputs& in, const CheckCase& c, Device device) {
  const int post_ndim = static_cast<int>(in.post.shape.size());
  return {testing::upload(in.x, c.dtype, device, layout_for(c.layout, Role::Rows2, 2)),
          testing::upload(in.residual, c.dtype, device, layout_for(c.layout, Role::Rows3, 3)),
          testing::upload(in.post, kF32, device, layout_for(c.layout, Role::Post, post_ndim)),
          testing::upload(in.comb, kF32, device, layout_for(c.layout, Role::Comb, 3))};
}

void check_forward(const CheckContext& ctx, const CheckCase& c, std::mt19937_64& rng) {
  const Inputs in = random_inputs(c, rng);
  auto run_on = [&](Device device) {
    const DeviceInputs d = upload_inputs(in, c, device);
    std::vector<DeviceTensor> outs;
    outs.push_back(testing::empty_poisoned({c.n, c.hc, c.h}, c.dtype, device,
                                           layout_for(c.layout, Role::Rows3, 3)));
    mhc_post(outs[0].view, d.x.view, d.residual.view, d.post.view, d.comb.view);
    detail::synchronize(device);
    return outs;
  };
  ctx.runner->run({kOp, "forward", shape_name(c.n, c.h, c.hc), layout_name(c.layout), c.dtype},
                  run_on,
                  {{"out", testing::mhc_post_reference(in.x, in.residual, in.post, in.comb),
                    elementwise_tolerance(c.dtype), {},
                    testing::mhc_post_terms(in.x, in.residual, in.post, in.comb)}});
}

void check_backward(const CheckContext& ctx, const CheckCase& c, std::mt19937_64& rng) {
  const Inputs in = random_inputs(c, rng);
  const HostTensor grad_out = random_rounded({c.n, c.hc, c.h}, c.dtype, rng);
  auto run_on = [&](Device device) {
    const DeviceInputs d = upload_inputs(in, c, device);
    const DeviceTensor g =
        testing::upload(grad_out, c.dtype, device, layout_for(c.layout, Role::Rows3, 3));
    const int post_ndim = static_cast<int>(in.post.shape.size());
    std::vector<DeviceTensor> outs;
    outs.push_back(testing::empty_poisoned({c.n, c.h}, c.dtype, device,
                                           layout_for(c.layout, Role::Rows2, 2)));
    outs.push_back(testing::empty_poisoned({c.n, c.hc, c.h}, c.dtype, device,
                                           layout_for(c.layout, Role::Rows3, 3)));
    outs.push_back(testing::empty_poisoned(in.post.shape, kF32, device,
                                           layout_for(c.layout, Role::Post, post_ndim)));
    outs.push_back(testing::empty_poisoned({c.n, c.hc, c.hc}, kF32, device,
                                           layout_for(c.layout, Role::Comb, 3)));
    mhc_post_backward(outs[0].view, outs[1].view, outs[2].view, outs[3].view, g.view, d.x.view,
                      d.residual.view, d.post.view, d.comb.view);
    detail::synchronize(device);
    return outs;
  };
  testing::MhcPostGradients ref =
      testing::mhc_post_backward_reference(grad_out, in.x, in.residual, in.post, in.comb);
  testing::MhcPostGradients t =
      testing::mhc_post_backward_terms(grad_out, in.x, in.residual, in.post, in.comb);
  ctx.runner->run(
      {kOp, "backward", shape_name(c.n, c.h, c.hc), layout_name(c.layout), c.dtype}, run_on,
      {{"grad_x", std::move(ref.grad_x), elementwise_tolerance(c.dtype), {}, std::move(t.grad_x)},
       {"grad_residual", std::move(ref.grad_residual), elementwise_tolerance(c.dtype), {},
        std::move(t.grad_residual)},
       {"grad_post_layer_mix", std::move(ref.grad_post), reduction_tolerance(c.h), {},
        std::move(t.grad_post)},
       {"grad_comb_res_mix", std::move(ref.grad_comb), reduction_tolerance(c.h), {},
        std::move(t.grad_comb)}});
}

void check(const CheckContext& ctx) {
  check_each(ctx, kForwardCases, check_forward, 0);
  check_each(ctx, kBackwardCases, check_backward, 1);
}

// ---------------------------------------------------------------------------------- bench

struct BenchCase {
  std::int64_t n, h, hc;
  bool backward = false;
  bool on_cpu = true;  // too slow for a CPU run of about a minute otherwise
  bool quick = false;  // one of the few rows of --quick
};

// Model-shaped defaults (hidden sizes of 1280 to 7168, 4 streams; N8 is a decode step), bfloat16.
const std::vector<BenchCase> kBenchCases = {
    {4096, 1280, 4, false, true, true},
    {4096, 2560, 4},
    {4096, 7168, 4},
    {16384, 7168, 4, false, false},
    {4096, 4096, 2},
    {8, 7168, 4, false, true, true},
    {4096, 7168, 4, true},
    {8, 7168, 4, true, true, true},
};
constexpr DType kBenchDType = DType::BFloat16;

// Each bench input from its own seed: the row's index and the tensor's position.
DeviceTensor upload_random(std::vector<std::int64_t> shape, DType dtype, Device device,
                           std::uint64_t seed) {
  return testing::upload(bench_input(std::move(shape), seed), dtype, device);
}

void bench(const BenchContext& ctx) {
  const Device device = ctx.device;
  bench_each(ctx, kBenchCases, [&](const BenchCase& c, std::uint64_t seed) {
    const DeviceTensor x = upload_random({c.n, c.h}, kBenchDType, device, seed);
    const DeviceTensor residual = upload_random({c.n, c.hc, c.h}, kBenchDType, device, seed + 1);
    const DeviceTensor post = upload_random({c.n, c.hc, 1}, kF32, device, seed + 2);
    const DeviceTensor comb = upload_random({c.n, c.hc, c.hc}, kF32, device, seed + 3);
    // Bytes of one [N, H] tensor, and of post + comb in float32.
    const double big = static_cast<double>(c.n * c.h) * double(element_size(kBenchDType));
    const double mix = static_cast<double>(c.n * c.hc * (1 + c.hc)) * 4.0;

    BenchRow row{kOp, c.backward ? "backward" : "forward", shape_name(c.n, c.h, c.hc), kBenchDType,
                 device};
    detail::Timing t;
    if (!c.backward) {
      const DeviceTensor out = testing::empty_poisoned({c.n, c.hc, c.h}, kBenchDType, device);
      t = detail::time_it(device, {}, [&] {
        mhc_post(out.view, x.view, residual.view, post.view, comb.view);
      }, ctx.timer);
      row.bytes = big * static_cast<double>(1 + 2 * c.hc) + mix;  // x, residual, out; post, comb
    } else {
      const DeviceTensor grad_out = upload_random({c.n, c.hc, c.h}, kBenchDType, device, seed + 4);
      const DeviceTensor grad_x = testing::empty_poisoned({c.n, c.h}, kBenchDType, device);
      const DeviceTensor grad_residual =
          testing::empty_poisoned({c.n, c.hc, c.h}, kBenchDType, device);
      const DeviceTensor grad_post = testing::empty_poisoned({c.n, c.hc, 1}, kF32, device);
      const DeviceTensor grad_comb = testing::empty_poisoned({c.n, c.hc, c.hc}, kF32, device);
      t = detail::time_it(device, {}, [&] {
        mhc_post_backward(grad_x.view, grad_residual.view, grad_post.view, grad_comb.view,
                          grad_out.view, x.view, residual.view, post.view, comb.view);
      }, ctx.timer);
      // grad_out, x, residual read; grad_x, grad_residual written; the float32 mixes read and
      // their gradients written.
      row.bytes = big * static_cast<double>(2 + 3 * c.hc) + 2 * mix;
    }
    row.set_timing(t);
    ctx.record(row);
  });
}

}  // namespace

Op mhc_post_op() {
  return {
      .name = kOp,
      .summary = "post mix of mHC hyper-connections, forward and backward",
      .bench_shapes =
          "mhc_post, bfloat16: forward N4096 H1280 hc4, N4096 H2560 hc4, N4096 H7168 hc4, "
          "N16384 H7168 hc4 (not on the CPU), N4096 H4096 hc2, N8 H7168 hc4; backward N4096 H7168 "
          "hc4, N8 H7168 hc4. --quick: forward N4096 H1280 hc4 and N8 H7168 hc4, backward "
          "N8 H7168 hc4.",
      .check = check,
      .bench = bench,
  };
}

}  // namespace fusekit::tools
