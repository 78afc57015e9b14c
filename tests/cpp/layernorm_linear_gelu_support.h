// What the layernorm_linear_gelu tests share between the CPU and the CUDA suites: the cases, the
// inputs (rounded to the device dtype), one checked run on any device, and the tolerances.
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "ops/layernorm_linear_gelu/layernorm_linear_gelu_reference.h"
#include "test_support.h"

namespace fusekit_test {

using fusekit::GeluApproximation;
using fusekit::LayerNormLinearGeluOptions;

struct LolaCase {
  std::vector<std::int64_t> lead;  // x's leading dims (their product is M)
  std::int64_t k, nout;
  bool bias = true, affine = false;
  GeluApproximation approximate = GeluApproximation::Tanh;
  double mean = 0, stddev = 1;  // of x
};

inline void PrintTo(const LolaCase& c, std::ostream* os) {
  *os << "lead [";
  for (std::size_t d = 0; d < c.lead.size(); ++d) *os << (d ? ", " : "") << c.lead[d];
  *os << "] K=" << c.k << " Nout=" << c.nout << (c.bias ? " bias" : "")
      << (c.affine ? " affine" : "")
      << (c.approximate == GeluApproximation::None ? " erf" : " tanh") << " x~N(" << c.mean << ", "
      << c.stddev << ")";
}

inline std::string lola_case_name(const LolaCase& c) {
  std::string s = "M";
  for (std::size_t d = 0; d < c.lead.size(); ++d) {
    if (d) s += 'x';
    s += std::to_string(c.lead[d]);
  }
  s += "_K";
  s += std::to_string(c.k);
  s += "_N";
  s += std::to_string(c.nout);
  if (!c.bias) s += "_nobias";
  if (c.affine) s += "_affine";
  if (c.approximate == GeluApproximation::None) s += "_erf";
  if (c.mean != 0) {
    s += c.mean < 0 ? "_mean_minus" : "_mean";
    s += std::to_string(static_cast<int>(std::abs(c.mean)));
  }
  return s;
}

/// How each tensor is laid out (Layout{order, pad_inner, offset_elements}).
struct LolaLayouts {
  Layout out = {}, x = {}, weight = {}, bias = {}, ln_weight = {}, ln_bias = {};
};

/// A named set of layouts, for parameterised tests.
struct LolaLayoutCase {
  const char* name;
  LolaLayouts layouts;
};
inline void PrintTo(const LolaLayoutCase& c, std::ostream* os) { *os << c.name; }

/// The layouts both backends are tested with.
inline const LolaLayoutCase kLolaLayouts[] = {
    {"contiguous", {}},
    // x[i, j, q] with dims ordered (1, 0, 2) in memory: leading dims that do not collapse
    {"x_lead_permuted", {.x = {{1, 0, 2}, 0, 0}}},
    // x with its K axis outermost: a non-unit stride along K
    {"x_k_strided", {.x = {{2, 0, 1}, 0, 0}}},
    // weight given as the transpose of a row-major [K, Nout]
    {"weight_transposed", {.weight = {{1, 0}, 0, 0}}},
    {"padded_rows", {.out = {{}, 5, 0}, .x = {{}, 3, 0}, .weight = {{}, 7, 0}}},
    {"ln_params_strided", {.ln_weight = {{}, 1, 0}, .ln_bias = {{}, 2, 0}}},
    // every base pointer one element past an aligned address
    {"misaligned",
     {.out = {{}, 0, 1},
      .x = {{}, 0, 1},
      .weight = {{}, 0, 1},
      .bias = {{}, 0, 1},
      .ln_weight = {{}, 0, 1},
      .ln_bias = {{}, 0, 1}}},
    {"misaligned_weight_transposed", {.weight = {{1, 0}, 0, 1}}},
    {"out_misaligned", {.out = {{}, 0, 3}}},
};

/// Inputs in float64, rounded to what they will be on the device; x is kept as [M, K].
struct LolaInputs {
  HostTensor x, weight, bias, ln_weight, ln_bias;
};

inline std::int64_t rows_of(const LolaCase& c) {
  std::int64_t m = 1;
  for (std::int64_t d : c.lead) m *= d;
  return m;
}

inline LolaInputs make_lola_inputs(const LolaCase& c, DType dtype, std::mt19937_64& rng,
                                   DType ln_dtype = DType::Float32) {
  LolaInputs in;
  const std::int64_t m = rows_of(c);
  in.x = fusekit::testing::random_normal({m, c.k}, rng, c.stddev);
  for (double& v : in.x.values) v += c.mean;
  // torch Linear's scale: the products stay of unit size whatever K is
  in.weight = fusekit::testing::random_normal({c.nout, c.k}, rng, 1.0 / std::sqrt(double(c.k)));
  fusekit::testing::round_to(in.x, dtype);
  fusekit::testing::round_to(in.weight, dtype);
  if (c.bias) {
    in.bias = fusekit::testing::random_normal({c.nout}, rng);
    fusekit::testing::round_to(in.bias, dtype);
  }
  if (c.affine) {
    in.ln_weight = fusekit::testing::random_normal({c.k}, rng);
    in.ln_bias = fusekit::testing::random_normal({c.k}, rng);
    fusekit::testing::round_to(in.ln_weight, ln_dtype);
    fusekit::testing::round_to(in.ln_bias, ln_dtype);
  }
  return in;
}

inline fusekit::testing::HostTensor lola_reference(const LolaInputs& in, const LolaCase& c,
                                                   double eps = 1e-5) {
  return fusekit::testing::layernorm_linear_gelu_reference(in.x, in.weight, in.bias, in.ln_weight,
                                                           in.ln_bias, eps, c.approximate);
}

/// A [M, K] host tensor viewed with x's leading dims: the same values, the shape lead + [K].
inline HostTensor with_shape(HostTensor t, std::vector<std::int64_t> shape) {
  t.shape = std::move(shape);
  return t;
}

/// The device tensors of one call, and the poisoned output.
struct LolaTensors {
  DeviceTensor out, x, weight, bias, ln_weight, ln_bias;
};

inline LolaTensors upload_lola(const LolaInputs& in, const LolaCase& c, DType dtype, Device device,
                               const LolaLayouts& layouts = {}, DType ln_dtype = DType::Float32) {
  using fusekit::testing::upload;
  std::vector<std::int64_t> x_shape = c.lead, out_shape = c.lead;
  x_shape.push_back(c.k);
  out_shape.push_back(c.nout);
  LolaTensors t;
  t.x = upload(with_shape(in.x, x_shape), dtype, device, layouts.x);
  t.weight = upload(in.weight, dtype, device, layouts.weight);
  if (c.bias) t.bias = upload(in.bias, dtype, device, layouts.bias);
  if (c.affine) {
    t.ln_weight = upload(in.ln_weight, ln_dtype, device, layouts.ln_weight);
    t.ln_bias = upload(in.ln_bias, ln_dtype, device, layouts.ln_bias);
  }
  t.out = fusekit::testing::empty_poisoned(out_shape, dtype, device, layouts.out);
  return t;
}

inline void run_lola(const LolaTensors& t, const LolaCase& c,
                     LayerNormLinearGeluOptions options = {}, fusekit::Stream stream = {}) {
  options.approximate = c.approximate;
  fusekit::layernorm_linear_gelu(t.out.view, t.x.view, t.weight.view, t.bias.view,
                                 t.ln_weight.view, t.ln_bias.view, options, stream);
}

/// The output read back as [M, Nout].
inline HostTensor download_lola(const LolaTensors& t, const LolaCase& c) {
  return with_shape(fusekit::testing::download(t.out.view), {rows_of(c), c.nout});
}

// ------------------------------------------------------------------------------------ tolerances
//
// The outputs are of unit size (normalised rows, weights of norm 1 per output, a unit bias), so
// absolute errors are judged at that scale: atol covers results near 0 (where GELU flattens
// them), rtol the rest.

/// The CPU backend: float32 throughout, one rounding of the output to the dtype. The whole
/// float32 output is held to 1e-5 of its norm, as each element: a handful of outputs on GELU's
/// flat side carry errors of their pre-GELU size (float32 sums over K = 1000 of unit terms,
/// 5.5e-7), which against their own small norm has been seen at 2.4e-6 (M = 5, Nout = 1).
inline Tolerance lola_cpu_tolerance(DType dtype) {
  if (dtype == DType::Float32) return {2e-5, 1e-5, 1e-5};
  const double u = unit_roundoff(dtype);
  return {2e-5, u, u};
}

/// The CUDA backend: the normalised rows are rounded to the dtype, so every product carries an
/// error of up to u of its size; summed with random signs over K that stays near u times the
/// output's scale (under 6u at the extreme of a million outputs), then the output rounding adds
/// up to u relative. TF32 (float32 by default) rounds both operands, the weight as well, to 11
/// significant bits: each product then carries up to 2 * 2^-11, so u counts twice. The error of
/// the whole output is judged against 4u of its norm: with a handful of outputs on GELU's flat
/// side (small values, errors of the pre-GELU size) the ratio has been seen at 2.5u.
inline Tolerance lola_cuda_tolerance(DType dtype, bool tf32 = true) {
  if (dtype == DType::Float32 && !tf32) return lola_cpu_tolerance(dtype);  // float32 products
  const double u = dtype == DType::Float32 ? 2 * 0x1p-11 : unit_roundoff(dtype);
  return {8 * u, 2 * u, 4 * u};
}

}  // namespace fusekit_test
