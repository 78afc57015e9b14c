// What the C++ tests share: the per-test random seed, the tolerances (stated once per dtype), the
// mhc_post inputs and layouts, views through negative strides, and checks of raw buffers and of
// error messages.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "fusekit/fusekit.h"
#include "ops/mhc_post/mhc_post_params.h"
#include "ops/mhc_post/mhc_post_reference.h"
#include "testing/host_tensor.h"

namespace fusekit {
/// dtypes by name in gtest's messages ("GetParam() = bfloat16").
inline void PrintTo(DType dtype, std::ostream* os) { *os << to_string(dtype); }
}  // namespace fusekit

namespace fusekit::detail {
inline const char* path_name(MhcPostConfig::Path path) {
  switch (path) {
    case MhcPostConfig::Path::Scalar: return "scalar";
    case MhcPostConfig::Path::Vector: return "vector";
    case MhcPostConfig::Path::Bulk: return "bulk";
  }
  return "unknown path";
}
/// Forward kernel paths by name in gtest's messages.
inline void PrintTo(MhcPostConfig::Path path, std::ostream* os) { *os << path_name(path); }
}  // namespace fusekit::detail

namespace fusekit_test {

using fusekit::Device;
using fusekit::DType;
using fusekit::TensorView;
using fusekit::testing::Comparison;
using fusekit::testing::DeviceTensor;
using fusekit::testing::HostTensor;
using fusekit::testing::Layout;
using fusekit::testing::Tolerance;

// ------------------------------------------------------------------------------------ seeds

/// FUSEKIT_TEST_SEED when set (to replay a failure), else a fresh seed from std::random_device.
inline std::uint64_t test_seed() {
  if (const char* env = std::getenv("FUSEKIT_TEST_SEED"); env != nullptr && *env != '\0') {
    return std::stoull(env, nullptr, 0);
  }
  std::random_device device;
  return (static_cast<std::uint64_t>(device()) << 32) ^ device();
}

/// A test (or parameterised test, via Base) with its own random generator. The seed is part of
/// every failure message, so any failure can be replayed with FUSEKIT_TEST_SEED.
template <typename Base = ::testing::Test>
class Seeded : public Base {
 protected:
  std::uint64_t seed_ = test_seed();
  std::mt19937_64 rng_{seed_};

 private:
  ::testing::ScopedTrace trace_{__FILE__, __LINE__,
                                "random inputs from seed " + std::to_string(seed_) +
                                    " (replay with FUSEKIT_TEST_SEED=" + std::to_string(seed_) +
                                    ")"};
};

// ------------------------------------------------------------------------------------ tolerances

/// The largest relative error of one rounding to nearest in `dtype`: 2^-p for p significand bits.
inline double unit_roundoff(DType dtype) {
  switch (dtype) {
    case DType::Float32: return 0x1p-24;
    case DType::BFloat16: return 0x1p-8;
    case DType::Float16: return 0x1p-11;
    case DType::Float64: return 0x1p-53;
    default: break;
  }
  ADD_FAILURE() << "no unit roundoff for dtype " << fusekit::to_string(dtype);
  return 0;
}

/// The element-wise outputs (out, grad_x, grad_residual) against the float64 reference evaluated
/// on the same inputs rounded to the dtype. The only errors are the float32 sum of at most 9
/// products of unit-scale values (absolute error well below 1e-5) and one rounding of the result
/// to the dtype (relative error at most the unit roundoff u, nearly reached just above a power of
/// two). For float32 that rounding is part of the accumulation error: 1e-5 per element, and 1e-6
/// in norm relative to the terms' norm (mhc_post_terms), since a sum of a few products can cancel
/// to far below its terms.
inline Tolerance elementwise_tolerance(DType dtype) {
  if (dtype == DType::Float32) return {1e-5, 1e-5, 1e-6};
  const double u = unit_roundoff(dtype);
  return {1e-5, u, u};
}

/// Two backends against each other (CUDA against the CPU): both sum in float32, in a different
/// order, then round once, so their results may sit one unit in the last place apart, which is
/// 2u relative just above a power of two; atol covers the float32 accumulation.
inline Tolerance backend_tolerance(DType dtype) {
  if (dtype == DType::Float32) return {1e-5, 1e-5, 1e-6};
  const double u = unit_roundoff(dtype);
  return {1e-5, 2 * u, 2 * u};
}

/// grad_post_layer_mix and grad_comb_res_mix: float32 sums over H (thousands of products of
/// unit-scale values, with cancellation) in every dtype, against float64 or another backend.
/// With H up to 65536 the errors seen on the GPU stay within a third of this.
inline Tolerance reduction_tolerance() { return {1e-4, 1e-4, 1e-5}; }

// ------------------------------------------------------------------------------------ checks

/// Compares and, on failure, reports the full comparison (shape, worst element, counts). With
/// `scale`, the norm bound is relative to it (fusekit::testing::compare).
inline void expect_close(const HostTensor& got, const HostTensor& expected, const Tolerance& tol,
                         const std::string& what, const HostTensor* scale = nullptr) {
  const Comparison c = fusekit::testing::compare(got, expected, tol, scale);
  EXPECT_TRUE(c.ok) << what << ": " << c.message;
}

/// Every byte of `t`'s allocation, wherever it lives.
inline std::vector<unsigned char> raw_bytes(const DeviceTensor& t) {
  std::vector<unsigned char> bytes(t.buffer.bytes());
  t.buffer.copy_to_host(bytes.data(), bytes.size());
  return bytes;
}

/// The bytes of `t`'s allocation that its view does not reach (padding, the offset before the
/// view) still hold the poison 0xff: the call wrote nothing outside the view.
inline void expect_only_view_written(const DeviceTensor& t, const std::string& what) {
  const TensorView& v = t.view;
  const std::int64_t esize = static_cast<std::int64_t>(fusekit::element_size(v.dtype));
  std::vector<bool> in_view(t.buffer.bytes(), false);
  if (v.numel() > 0) {
    const std::int64_t base =
        static_cast<const char*>(v.data) - static_cast<const char*>(t.buffer.data());
    std::vector<std::int64_t> idx(v.ndim, 0);
    for (std::int64_t flat = 0; flat < v.numel(); ++flat) {
      std::int64_t off = 0;
      for (int d = 0; d < v.ndim; ++d) off += idx[d] * v.strides[d];
      for (std::int64_t b = 0; b < esize; ++b) in_view[base + off * esize + b] = true;
      for (int d = v.ndim - 1; d >= 0 && ++idx[d] == v.shape[d]; --d) idx[d] = 0;
    }
  }
  const std::vector<unsigned char> bytes = raw_bytes(t);
  std::int64_t touched = 0, first = -1;
  for (std::size_t b = 0; b < bytes.size(); ++b) {
    if (!in_view[b] && bytes[b] != 0xff) {
      ++touched;
      if (first < 0) first = static_cast<std::int64_t>(b);
    }
  }
  EXPECT_EQ(touched, 0) << what << ": " << touched << " bytes outside the view "
                        << v.describe() << " were written, the first at byte " << first
                        << " of the allocation";
}

/// The message of the fusekit::Error that `f` throws; a test failure if it throws none.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const fusekit::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a fusekit::Error, but the call returned";
  return "(no error)";
}

/// The callable (the rest of the arguments, so that it may hold commas) throws a fusekit::Error
/// whose message contains `text`.
#define EXPECT_ERROR_CONTAINS(text, ...) \
  EXPECT_PRED_FORMAT2(::testing::IsSubstring, text, ::fusekit_test::error_of(__VA_ARGS__))

// ------------------------------------------------------------------------------------ mhc_post

/// Inputs of mhc_post in float64, already rounded to what they will be on the device: x and
/// residual to `dtype`, post_layer_mix and comb_res_mix to float32.
struct MhcInputs {
  HostTensor x, residual, post, comb;
};

inline MhcInputs make_mhc_inputs(std::int64_t n, std::int64_t hc, std::int64_t h, DType dtype,
                                 std::mt19937_64& rng, bool post_3d = false) {
  MhcInputs in;
  in.x = fusekit::testing::random_normal({n, h}, rng);
  in.residual = fusekit::testing::random_normal({n, hc, h}, rng);
  in.post = post_3d ? fusekit::testing::random_normal({n, hc, 1}, rng)
                    : fusekit::testing::random_normal({n, hc}, rng);
  in.comb = fusekit::testing::random_normal({n, hc, hc}, rng);
  fusekit::testing::round_to(in.x, dtype);
  fusekit::testing::round_to(in.residual, dtype);
  fusekit::testing::round_to(in.post, DType::Float32);
  fusekit::testing::round_to(in.comb, DType::Float32);
  return in;
}

/// grad_out of the backward, rounded to `dtype`.
inline HostTensor make_grad_out(std::int64_t n, std::int64_t hc, std::int64_t h, DType dtype,
                                std::mt19937_64& rng) {
  HostTensor g = fusekit::testing::random_normal({n, hc, h}, rng);
  fusekit::testing::round_to(g, dtype);
  return g;
}

/// Layouts of the operator's tensors; the gradients of the backward take the layout of the
/// tensor they belong to (grad_out that of out, grad_x that of x, ...).
struct MhcLayouts {
  Layout out = {}, x = {}, residual = {}, post = {}, comb = {};
};

/// The inputs on a device.
struct MhcDeviceInputs {
  DeviceTensor x, residual, post, comb;
};

inline MhcDeviceInputs upload_mhc_inputs(const MhcInputs& in, DType dtype, Device device,
                                         const MhcLayouts& layouts = {}) {
  using fusekit::testing::upload;
  return {upload(in.x, dtype, device, layouts.x), upload(in.residual, dtype, device, layouts.residual),
          upload(in.post, DType::Float32, device, layouts.post),
          upload(in.comb, DType::Float32, device, layouts.comb)};
}

/// Poisoned outputs of the backward.
struct MhcGradTensors {
  DeviceTensor grad_x, grad_residual, grad_post, grad_comb;
};

inline MhcGradTensors empty_mhc_grads(const MhcInputs& in, DType dtype, Device device,
                                      const MhcLayouts& layouts = {}) {
  using fusekit::testing::empty_poisoned;
  return {empty_poisoned(in.x.shape, dtype, device, layouts.x),
          empty_poisoned(in.residual.shape, dtype, device, layouts.residual),
          empty_poisoned(in.post.shape, DType::Float32, device, layouts.post),
          empty_poisoned(in.comb.shape, DType::Float32, device, layouts.comb)};
}

inline void run_mhc_post(const DeviceTensor& out, const MhcDeviceInputs& d,
                         fusekit::Stream stream = {}) {
  fusekit::mhc_post(out.view, d.x.view, d.residual.view, d.post.view, d.comb.view, stream);
}

inline void run_mhc_post_backward(const MhcGradTensors& g, const DeviceTensor& grad_out,
                                  const MhcDeviceInputs& d, fusekit::Stream stream = {}) {
  fusekit::mhc_post_backward(g.grad_x.view, g.grad_residual.view, g.grad_post.view,
                             g.grad_comb.view, grad_out.view, d.x.view, d.residual.view,
                             d.post.view, d.comb.view, stream);
}

/// The four gradients read back as float64.
inline fusekit::testing::MhcPostGradients download_grads(const MhcGradTensors& g) {
  using fusekit::testing::download;
  return {download(g.grad_x.view), download(g.grad_residual.view), download(g.grad_post.view),
          download(g.grad_comb.view)};
}

/// Compares all four gradients: the element-wise ones with `elementwise`, the sums over H with
/// the reduction tolerance; with `terms`, each norm bound relative to its gradient's terms.
inline void expect_grads_close(const fusekit::testing::MhcPostGradients& got,
                               const fusekit::testing::MhcPostGradients& expected,
                               const Tolerance& elementwise, const std::string& what,
                               const fusekit::testing::MhcPostGradients* terms = nullptr) {
  expect_close(got.grad_x, expected.grad_x, elementwise, what + " grad_x",
               terms ? &terms->grad_x : nullptr);
  expect_close(got.grad_residual, expected.grad_residual, elementwise, what + " grad_residual",
               terms ? &terms->grad_residual : nullptr);
  expect_close(got.grad_post, expected.grad_post, reduction_tolerance(),
               what + " grad_post_layer_mix", terms ? &terms->grad_post : nullptr);
  expect_close(got.grad_comb, expected.grad_comb, reduction_tolerance(),
               what + " grad_comb_res_mix", terms ? &terms->grad_comb : nullptr);
}

/// The scales of the norm bounds for these inputs (fusekit::testing::mhc_post_terms).
inline HostTensor mhc_post_terms(const MhcInputs& in) {
  return fusekit::testing::mhc_post_terms(in.x, in.residual, in.post, in.comb);
}
inline fusekit::testing::MhcPostGradients mhc_post_backward_terms(const HostTensor& grad_out,
                                                                  const MhcInputs& in) {
  return fusekit::testing::mhc_post_backward_terms(grad_out, in.x, in.residual, in.post, in.comb);
}

/// out, or the four gradients, against the float64 reference on the same inputs, within
/// elementwise_tolerance and the reduction tolerance, the norms relative to the terms.
inline void expect_out_matches_float64(const HostTensor& got, const MhcInputs& in, DType dtype,
                                       const std::string& what = "out") {
  const HostTensor terms = mhc_post_terms(in);
  expect_close(got, fusekit::testing::mhc_post_reference(in.x, in.residual, in.post, in.comb),
               elementwise_tolerance(dtype), what, &terms);
}
inline void expect_grads_match_float64(const fusekit::testing::MhcPostGradients& got,
                                       const HostTensor& grad_out, const MhcInputs& in,
                                       DType dtype, const std::string& what = "backward") {
  const fusekit::testing::MhcPostGradients terms = mhc_post_backward_terms(grad_out, in);
  expect_grads_close(got,
                     fusekit::testing::mhc_post_backward_reference(grad_out, in.x, in.residual,
                                                                   in.post, in.comb),
                     elementwise_tolerance(dtype), what, &terms);
}

// H = 0 is valid (see the header): the forward has nothing to write, the backward's sums over H
// are 0. The tensors are laid out as TensorView lays out any contiguous tensor, so a row stride
// is H = 0; an output with no elements has no two elements at one address, and the check of
// outputs must not reject it.
inline void expect_zero_hidden_is_valid(Device device, DType dtype, std::mt19937_64& rng) {
  const std::int64_t n = 3, hc = 4;
  const MhcInputs in = make_mhc_inputs(n, hc, 0, dtype, rng);
  const MhcDeviceInputs d = upload_mhc_inputs(in, dtype, device);
  const DeviceTensor out = fusekit::testing::empty_poisoned({n, hc, 0}, dtype, device);
  EXPECT_NO_THROW(run_mhc_post(out, d));
  const HostTensor grad_out = make_grad_out(n, hc, 0, dtype, rng);
  const DeviceTensor g = fusekit::testing::upload(grad_out, dtype, device);
  const MhcGradTensors grads = empty_mhc_grads(in, dtype, device);
  ASSERT_NO_THROW(run_mhc_post_backward(grads, g, d));
  expect_grads_close(download_grads(grads),
                     mhc_post_backward_reference(grad_out, in.x, in.residual, in.post, in.comb),
                     {0, 0, 0}, "backward");
}

inline void expect_grads_only_view_written(const MhcGradTensors& g) {
  expect_only_view_written(g.grad_x, "grad_x");
  expect_only_view_written(g.grad_residual, "grad_residual");
  expect_only_view_written(g.grad_post, "grad_post_layer_mix");
  expect_only_view_written(g.grad_comb, "grad_comb_res_mix");
}

/// `t` stored reversed along its last dim and viewed through a stride of -1: the view reads as `t`.
inline DeviceTensor upload_reversed(const HostTensor& t, DType dtype, Device device) {
  HostTensor flipped = t;
  const std::int64_t last = t.shape.back();
  for (std::int64_t row = 0; row < t.numel() / last; ++row) {
    for (std::int64_t k = 0; k < last; ++k) {
      flipped.values[row * last + k] = t.values[row * last + (last - 1 - k)];
    }
  }
  DeviceTensor d = fusekit::testing::upload(flipped, dtype, device);
  d.view.data = static_cast<char*>(d.view.data) + (last - 1) * fusekit::element_size(dtype);
  d.view.strides[d.view.ndim - 1] = -1;
  return d;
}

/// A poisoned output viewed through a stride of -1 in its last dim, as upload_reversed.
inline DeviceTensor empty_reversed(const std::vector<std::int64_t>& shape, DType dtype,
                                   Device device) {
  DeviceTensor d = fusekit::testing::empty_poisoned(shape, dtype, device);
  d.view.data = static_cast<char*>(d.view.data) + (shape.back() - 1) * fusekit::element_size(dtype);
  d.view.strides[d.view.ndim - 1] = -1;
  return d;
}

/// `t` with its values reversed along `dim`: uploaded so and viewed through a negative stride
/// along `dim` (see flip_view), it reads as `t`.
inline HostTensor flipped(const HostTensor& t, int dim) {
  HostTensor f = t;
  std::int64_t inner = 1;
  for (std::size_t d = dim + 1; d < t.shape.size(); ++d) inner *= t.shape[d];
  const std::int64_t size = t.shape[dim];
  const std::int64_t outer = t.numel() / std::max<std::int64_t>(1, size * inner);
  for (std::int64_t o = 0; o < outer; ++o) {
    for (std::int64_t k = 0; k < size; ++k) {
      for (std::int64_t q = 0; q < inner; ++q) {
        f.values[(o * size + k) * inner + q] = t.values[(o * size + size - 1 - k) * inner + q];
      }
    }
  }
  return f;
}

/// Views `t` along `dim` backwards: from its last element there, through the negated stride.
inline void flip_view(DeviceTensor& t, int dim) {
  TensorView& v = t.view;
  if (v.shape[dim] == 0) return;
  const auto esize = static_cast<std::int64_t>(fusekit::element_size(v.dtype));
  v.data = static_cast<char*>(v.data) + (v.shape[dim] - 1) * v.strides[dim] * esize;
  v.strides[dim] = -v.strides[dim];
}

/// The params the entry point hands to the backends for these (valid) views: what the launch
/// config selectors see, so that a test can ask which branch a call takes.
inline fusekit::detail::MhcPostParams mhc_post_params_of(const TensorView& out, const TensorView& x,
                                                         const TensorView& residual,
                                                         const TensorView& post,
                                                         const TensorView& comb) {
  fusekit::detail::MhcPostParams p;
  p.n = residual.shape[0];
  p.hc = static_cast<int>(residual.shape[1]);
  p.h = residual.shape[2];
  p.dtype = x.dtype;
  p.out = out.data;
  p.x = x.data;
  p.residual = residual.data;
  p.post = post.data_as<const float>();
  p.comb = comb.data_as<const float>();
  for (int d = 0; d < 3; ++d) {
    p.out_stride[d] = out.strides[d];
    p.residual_stride[d] = residual.strides[d];
    p.comb_stride[d] = comb.strides[d];
  }
  for (int d = 0; d < 2; ++d) {
    p.x_stride[d] = x.strides[d];
    p.post_stride[d] = post.strides[d];
  }
  return p;
}

inline fusekit::detail::MhcPostBackwardParams mhc_post_backward_params_of(
    const TensorView& grad_x, const TensorView& grad_residual, const TensorView& grad_post,
    const TensorView& grad_comb, const TensorView& grad_out, const TensorView& x,
    const TensorView& residual, const TensorView& post, const TensorView& comb) {
  fusekit::detail::MhcPostBackwardParams p;
  p.n = residual.shape[0];
  p.hc = static_cast<int>(residual.shape[1]);
  p.h = residual.shape[2];
  p.dtype = x.dtype;
  p.grad_x = grad_x.data;
  p.grad_residual = grad_residual.data;
  p.grad_post = grad_post.data_as<float>();
  p.grad_comb = grad_comb.data_as<float>();
  p.grad_out = grad_out.data;
  p.x = x.data;
  p.residual = residual.data;
  p.post = post.data_as<const float>();
  p.comb = comb.data_as<const float>();
  for (int d = 0; d < 3; ++d) {
    p.grad_residual_stride[d] = grad_residual.strides[d];
    p.grad_comb_stride[d] = grad_comb.strides[d];
    p.grad_out_stride[d] = grad_out.strides[d];
    p.residual_stride[d] = residual.strides[d];
    p.comb_stride[d] = comb.strides[d];
  }
  for (int d = 0; d < 2; ++d) {
    p.grad_x_stride[d] = grad_x.strides[d];
    p.grad_post_stride[d] = grad_post.strides[d];
    p.x_stride[d] = x.strides[d];
    p.post_stride[d] = post.strides[d];
  }
  return p;
}

inline std::string dtype_name(DType dtype) { return fusekit::to_string(dtype); }

}  // namespace fusekit_test
