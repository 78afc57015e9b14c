// fusekit._C: the nanobind binding of the fusekit C++ API, one function per C++ entry point.
//
// Arrays of any framework come in through DLPack (torch tensors, numpy arrays, ...) and reach the
// library as TensorViews of the very same memory: data pointer, dtype, device, shape and strides
// in elements. Nothing is converted, copied or made contiguous here; the library validates and
// rejects what it does not support. Outputs come first, as in C++. The C++ call runs without the
// GIL, and fusekit::Error surfaces as fusekit.Error (a RuntimeError) with the library's message.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <optional>
#include <string>

#include "fusekit/fusekit.h"
#include "fusekit/ops/cheri_block.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using fusekit::detail::concat;

// Inputs only need a read-only export; outputs must be writable.
using InArray = nb::ndarray<nb::ro>;
using OutArray = nb::ndarray<>;

std::string dlpack_dtype_name(nb::dlpack::dtype dt) {
  using Code = nb::dlpack::dtype_code;
  const char* kind = nullptr;
  switch (static_cast<Code>(dt.code)) {
    case Code::Int: kind = "int"; break;
    case Code::UInt: kind = "uint"; break;
    case Code::Float: kind = "float"; break;
    case Code::Bfloat: kind = "bfloat"; break;
    case Code::Complex: kind = "complex"; break;
    case Code::Bool: kind = "bool"; break;
    default: return concat("DLPack type code ", int(dt.code), " of ", int(dt.bits), " bits");
  }
  std::string name = concat(kind, int(dt.bits));
  if (dt.lanes != 1) name += concat("x", dt.lanes);
  return name;
}

fusekit::DType to_dtype(nb::dlpack::dtype dt, const char* op, const char* arg) {
  using Code = nb::dlpack::dtype_code;
  using fusekit::DType;
  if (dt.lanes == 1) {
    switch (static_cast<Code>(dt.code)) {
      case Code::Float:
        if (dt.bits == 32) return DType::Float32;
        if (dt.bits == 16) return DType::Float16;
        if (dt.bits == 64) return DType::Float64;
        break;
      case Code::Bfloat:
        if (dt.bits == 16) return DType::BFloat16;
        break;
      case Code::Int:
        if (dt.bits == 32) return DType::Int32;
        if (dt.bits == 64) return DType::Int64;
        break;
      case Code::UInt:
        if (dt.bits == 8) return DType::UInt8;
        break;
      case Code::Bool:
        if (dt.bits == 8) return DType::Bool;
        break;
      default:
        break;
    }
  }
  throw fusekit::Error(concat(op, ": ", arg, " has dtype ", dlpack_dtype_name(dt),
                              ", which fusekit does not handle; expected float32, float16, "
                              "bfloat16, float64, int32, int64, uint8 or bool"));
}

const char* dlpack_device_name(int type) {
  switch (type) {
    case 1: return "cpu";
    case 2: return "cuda";
    case 3: return "cuda_host";
    case 4: return "opencl";
    case 7: return "vulkan";
    case 8: return "metal";
    case 10: return "rocm";
    case 11: return "rocm_host";
    case 13: return "cuda_managed";
    case 14: return "oneapi";
    default: return "unknown";
  }
}

fusekit::Device to_device(int type, int id, const char* op, const char* arg) {
  switch (type) {
    case nb::device::cpu::value: return fusekit::Device::cpu();
    case nb::device::cuda::value: return fusekit::Device::cuda(id);
    default:
      throw fusekit::Error(concat(op, ": ", arg, " lives on DLPack device ", type, " (",
                                  dlpack_device_name(type), ":", id,
                                  "), expected a cpu or cuda device"));
  }
}

template <typename... Ts>
fusekit::TensorView to_view(const nb::ndarray<Ts...>& a, const char* op, const char* arg) {
  const auto ndim = static_cast<int>(a.ndim());
  if (ndim > fusekit::kMaxDims) {
    throw fusekit::Error(concat(op, ": ", arg, " has ", ndim, " dims, expected at most ",
                                fusekit::kMaxDims));
  }
  std::int64_t shape[fusekit::kMaxDims];    // [ndim] sizes
  std::int64_t strides[fusekit::kMaxDims];  // [ndim] strides in elements (DLPack's unit)
  for (int d = 0; d < ndim; ++d) {
    shape[d] = static_cast<std::int64_t>(a.shape(d));
    strides[d] = a.stride(d);
  }
  void* data = const_cast<void*>(static_cast<const void*>(a.data()));
  return fusekit::TensorView::from_arrays(data, to_dtype(a.dtype(), op, arg), ndim, shape, strides,
                                          to_device(a.device_type(), a.device_id(), op, arg));
}

fusekit::Stream to_stream(std::uintptr_t handle) {
  return fusekit::Stream{reinterpret_cast<void*>(handle)};
}

// ------------------------------------------------------------------------------------ mhc_post

void mhc_post(const OutArray& out, const InArray& x, const InArray& residual,
              const InArray& post_layer_mix, const InArray& comb_res_mix, std::uintptr_t stream) {
  constexpr const char* op = "mhc_post";
  const fusekit::TensorView v_out = to_view(out, op, "out");
  const fusekit::TensorView v_x = to_view(x, op, "x");
  const fusekit::TensorView v_residual = to_view(residual, op, "residual");
  const fusekit::TensorView v_post = to_view(post_layer_mix, op, "post_layer_mix");
  const fusekit::TensorView v_comb = to_view(comb_res_mix, op, "comb_res_mix");
  nb::gil_scoped_release release;
  fusekit::mhc_post(v_out, v_x, v_residual, v_post, v_comb, to_stream(stream));
}

void mhc_post_backward(const OutArray& grad_x, const OutArray& grad_residual,
                       const OutArray& grad_post_layer_mix, const OutArray& grad_comb_res_mix,
                       const InArray& grad_out, const InArray& x, const InArray& residual,
                       const InArray& post_layer_mix, const InArray& comb_res_mix,
                       std::uintptr_t stream) {
  constexpr const char* op = "mhc_post_backward";
  const fusekit::TensorView v_grad_x = to_view(grad_x, op, "grad_x");
  const fusekit::TensorView v_grad_residual = to_view(grad_residual, op, "grad_residual");
  const fusekit::TensorView v_grad_post = to_view(grad_post_layer_mix, op, "grad_post_layer_mix");
  const fusekit::TensorView v_grad_comb = to_view(grad_comb_res_mix, op, "grad_comb_res_mix");
  const fusekit::TensorView v_grad_out = to_view(grad_out, op, "grad_out");
  const fusekit::TensorView v_x = to_view(x, op, "x");
  const fusekit::TensorView v_residual = to_view(residual, op, "residual");
  const fusekit::TensorView v_post = to_view(post_layer_mix, op, "post_layer_mix");
  const fusekit::TensorView v_comb = to_view(comb_res_mix, op, "comb_res_mix");
  nb::gil_scoped_release release;
  fusekit::mhc_post_backward(v_grad_x, v_grad_residual, v_grad_post, v_grad_comb, v_grad_out, v_x,
                             v_residual, v_post, v_comb, to_stream(stream));
}

// ------------------------------------------------------------------------- layernorm_linear_gelu

// An optional array: None arrives as an invalid ndarray and becomes the empty TensorView that
// the C++ API reads as "not given".
template <typename... Ts>
fusekit::TensorView to_optional_view(const nb::ndarray<Ts...>& a, const char* op,
                                     const char* arg) {
  return a.is_valid() ? to_view(a, op, arg) : fusekit::TensorView{};
}

void layernorm_linear_gelu(const OutArray& out, const InArray& x, const InArray& weight,
                           const InArray& bias, const InArray& ln_weight, const InArray& ln_bias,
                           double eps, bool approximate_tanh, bool allow_tf32,
                           std::uintptr_t stream) {
  constexpr const char* op = "layernorm_linear_gelu";
  const fusekit::TensorView v_out = to_view(out, op, "out");
  const fusekit::TensorView v_x = to_view(x, op, "x");
  const fusekit::TensorView v_weight = to_view(weight, op, "weight");
  const fusekit::TensorView v_bias = to_optional_view(bias, op, "bias");
  const fusekit::TensorView v_ln_weight = to_optional_view(ln_weight, op, "ln_weight");
  const fusekit::TensorView v_ln_bias = to_optional_view(ln_bias, op, "ln_bias");
  fusekit::LayerNormLinearGeluOptions options;
  options.eps = eps;
  options.approximate = approximate_tanh ? fusekit::GeluApproximation::Tanh
                                         : fusekit::GeluApproximation::None;
  options.allow_tf32 = allow_tf32;
  nb::gil_scoped_release release;
  fusekit::layernorm_linear_gelu(v_out, v_x, v_weight, v_bias, v_ln_weight, v_ln_bias, options,
                                 to_stream(stream));
}

// ------------------------------------------------------------------------------------ trimul

void trimul(const OutArray& out, const InArray& x, const InArray& mask, const InArray& norm_weight,
            const InArray& norm_bias, const InArray& left_proj, const InArray& right_proj,
            const InArray& left_gate, const InArray& right_gate, const InArray& out_gate,
            const InArray& to_out_norm_weight, const InArray& to_out_norm_bias,
            const InArray& to_out, bool incoming, double eps, std::uintptr_t stream) {
  constexpr const char* op = "trimul";
  const fusekit::TensorView v_out = to_view(out, op, "out");
  const fusekit::TensorView v_x = to_view(x, op, "x");
  const fusekit::TensorView v_mask = to_optional_view(mask, op, "mask");
  fusekit::TrimulWeights weights;
  weights.norm_weight = to_view(norm_weight, op, "norm_weight");
  weights.norm_bias = to_view(norm_bias, op, "norm_bias");
  weights.left_proj = to_view(left_proj, op, "left_proj");
  weights.right_proj = to_view(right_proj, op, "right_proj");
  weights.left_gate = to_view(left_gate, op, "left_gate");
  weights.right_gate = to_view(right_gate, op, "right_gate");
  weights.out_gate = to_view(out_gate, op, "out_gate");
  weights.to_out_norm_weight = to_view(to_out_norm_weight, op, "to_out_norm_weight");
  weights.to_out_norm_bias = to_view(to_out_norm_bias, op, "to_out_norm_bias");
  weights.to_out = to_view(to_out, op, "to_out");
  fusekit::TrimulOptions options;
  options.direction =
      incoming ? fusekit::TrimulDirection::Incoming : fusekit::TrimulDirection::Outgoing;
  options.eps = eps;
  nb::gil_scoped_release release;
  fusekit::trimul(v_out, v_x, v_mask, weights, options, to_stream(stream));
}

// ---------------------------------------------------------------------------- causal_attention

void causal_attention(const OutArray& out, const OutArray& lse, const InArray& q,
                      const InArray& k, const InArray& v, std::int64_t n_padd,
                      const InArray& n_padd_per_sequence, std::optional<double> scale,
                      bool allow_tf32, std::uintptr_t stream) {
  constexpr const char* op = "causal_attention";
  const fusekit::TensorView v_out = to_view(out, op, "out");
  const fusekit::TensorView v_lse = to_optional_view(lse, op, "lse");
  const fusekit::TensorView v_q = to_view(q, op, "q");
  const fusekit::TensorView v_k = to_view(k, op, "k");
  const fusekit::TensorView v_v = to_view(v, op, "v");
  fusekit::LeftPadding padding;
  padding.all = n_padd;
  padding.per_sequence = to_optional_view(n_padd_per_sequence, op, "padding.per_sequence");
  fusekit::CausalAttentionOptions options;
  options.scale = scale;
  options.allow_tf32 = allow_tf32;
  nb::gil_scoped_release release;
  fusekit::causal_attention(v_out, v_lse, v_q, v_k, v_v, padding, options, to_stream(stream));
}

// ---------------------------------------------------------------------------------- cheri_block

fusekit::CheriBlockWeights cheri_weights(const InArray& conv_weight, const InArray& linear1_weight,
                                         const InArray& linear2_weight, const char* op) {
  fusekit::CheriBlockWeights w;
  w.conv_weight = to_view(conv_weight, op, "conv_weight");
  w.linear1_weight = to_view(linear1_weight, op, "linear1_weight");
  w.linear2_weight = to_view(linear2_weight, op, "linear2_weight");
  return w;
}

fusekit::CheriBlockOptions cheri_options(std::int64_t dilation, double residual_scale, double eps,
                                         bool allow_tf32) {
  fusekit::CheriBlockOptions options;
  options.dilation = dilation;
  options.residual_scale = residual_scale;
  options.eps = eps;
  options.allow_tf32 = allow_tf32;
  return options;
}

fusekit::DilatedConvNormOptions conv_norm_options(std::int64_t dilation, double eps) {
  fusekit::DilatedConvNormOptions options;
  options.dilation = dilation;
  options.eps = eps;
  return options;
}

void dilated_conv_norm(const OutArray& y, const OutArray& mean, const OutArray& rstd,
                       const InArray& x, const InArray& conv_weight, std::int64_t dilation,
                       double eps, std::uintptr_t stream) {
  constexpr const char* op = "dilated_conv_norm";
  const fusekit::TensorView v_y = to_view(y, op, "y");
  const fusekit::TensorView v_mean = to_optional_view(mean, op, "mean");
  const fusekit::TensorView v_rstd = to_optional_view(rstd, op, "rstd");
  const fusekit::TensorView v_x = to_view(x, op, "x");
  const fusekit::TensorView v_conv = to_view(conv_weight, op, "conv_weight");
  const fusekit::DilatedConvNormOptions options = conv_norm_options(dilation, eps);
  nb::gil_scoped_release release;
  fusekit::dilated_conv_norm(v_y, v_mean, v_rstd, v_x, v_conv, options, to_stream(stream));
}

void dilated_conv_norm_backward(const OutArray& grad_x, const OutArray& grad_conv_weight,
                                const InArray& grad_y, const InArray& x,
                                const InArray& conv_weight, const InArray& mean,
                                const InArray& rstd, std::int64_t dilation, double eps,
                                std::uintptr_t stream) {
  constexpr const char* op = "dilated_conv_norm_backward";
  const fusekit::TensorView v_grad_x = to_view(grad_x, op, "grad_x");
  const fusekit::TensorView v_grad_conv = to_view(grad_conv_weight, op, "grad_conv_weight");
  const fusekit::TensorView v_grad_y = to_view(grad_y, op, "grad_y");
  const fusekit::TensorView v_x = to_view(x, op, "x");
  const fusekit::TensorView v_conv = to_view(conv_weight, op, "conv_weight");
  const fusekit::TensorView v_mean = to_view(mean, op, "mean");
  const fusekit::TensorView v_rstd = to_view(rstd, op, "rstd");
  const fusekit::DilatedConvNormOptions options = conv_norm_options(dilation, eps);
  nb::gil_scoped_release release;
  fusekit::dilated_conv_norm_backward(v_grad_x, v_grad_conv, v_grad_y, v_x, v_conv, v_mean,
                                      v_rstd, options, to_stream(stream));
}

std::int64_t cheri_block_saved_bytes(std::int64_t n, std::int64_t l, std::int64_t c,
                                     std::int64_t hidden, const std::string& dtype,
                                     int cuda_device, bool allow_tf32) {
  constexpr const char* op = "cheri_block_saved_bytes";
  fusekit::DType dt = fusekit::DType::Float32;
  if (dtype == "float16") {
    dt = fusekit::DType::Float16;
  } else if (dtype == "bfloat16") {
    dt = fusekit::DType::BFloat16;
  } else if (dtype != "float32") {
    throw fusekit::Error(concat(op, ": dtype is '", dtype,
                                "', expected 'float32', 'float16' or 'bfloat16'"));
  }
  const fusekit::Device device =
      cuda_device < 0 ? fusekit::Device::cpu() : fusekit::Device::cuda(cuda_device);
  // Only the shapes, dtype, device and options are read: views without data.
  fusekit::CheriBlockWeights weights;
  weights.linear1_weight = fusekit::TensorView(nullptr, dt, {hidden, c}, device);
  weights.linear2_weight = fusekit::TensorView(nullptr, dt, {c, hidden}, device);
  fusekit::CheriBlockOptions options;
  options.allow_tf32 = allow_tf32;
  return fusekit::cheri_block_saved_bytes(fusekit::TensorView(nullptr, dt, {n, l, c}, device),
                                          weights, options);
}

void cheri_block(const OutArray& out, const OutArray& mean, const OutArray& rstd,
                 const OutArray& saved, const InArray& x,
                 const InArray& conv_weight, const InArray& linear1_weight,
                 const InArray& linear2_weight, std::int64_t dilation, double residual_scale,
                 double eps, bool allow_tf32, std::uintptr_t stream) {
  constexpr const char* op = "cheri_block";
  const fusekit::TensorView v_out = to_view(out, op, "out");
  const fusekit::TensorView v_mean = to_view(mean, op, "mean");
  const fusekit::TensorView v_rstd = to_view(rstd, op, "rstd");
  const fusekit::TensorView v_saved = to_optional_view(saved, op, "saved");
  const fusekit::TensorView v_x = to_view(x, op, "x");
  const fusekit::CheriBlockWeights weights =
      cheri_weights(conv_weight, linear1_weight, linear2_weight, op);
  const fusekit::CheriBlockOptions options =
      cheri_options(dilation, residual_scale, eps, allow_tf32);
  nb::gil_scoped_release release;
  fusekit::cheri_block(v_out, v_mean, v_rstd, v_saved, v_x, weights, options, to_stream(stream));
}

void cheri_block_backward(const OutArray& grad_x, const OutArray& grad_conv_weight,
                          const OutArray& grad_linear1_weight,
                          const OutArray& grad_linear2_weight, const InArray& grad_out,
                          const InArray& x, const InArray& conv_weight,
                          const InArray& linear1_weight, const InArray& linear2_weight,
                          const InArray& mean, const InArray& rstd,
                          const InArray& saved, std::int64_t dilation,
                          double residual_scale, double eps, bool allow_tf32,
                          std::uintptr_t stream) {
  constexpr const char* op = "cheri_block_backward";
  const fusekit::TensorView v_grad_x = to_view(grad_x, op, "grad_x");
  fusekit::CheriBlockWeights grads;
  grads.conv_weight = to_view(grad_conv_weight, op, "grad_conv_weight");
  grads.linear1_weight = to_view(grad_linear1_weight, op, "grad_linear1_weight");
  grads.linear2_weight = to_view(grad_linear2_weight, op, "grad_linear2_weight");
  const fusekit::TensorView v_grad_out = to_view(grad_out, op, "grad_out");
  const fusekit::TensorView v_x = to_view(x, op, "x");
  const fusekit::CheriBlockWeights weights =
      cheri_weights(conv_weight, linear1_weight, linear2_weight, op);
  const fusekit::TensorView v_mean = to_view(mean, op, "mean");
  const fusekit::TensorView v_rstd = to_view(rstd, op, "rstd");
  const fusekit::TensorView v_saved = to_optional_view(saved, op, "saved");
  const fusekit::CheriBlockOptions options =
      cheri_options(dilation, residual_scale, eps, allow_tf32);
  nb::gil_scoped_release release;
  fusekit::cheri_block_backward(v_grad_x, grads, v_grad_out, v_x, weights, v_mean, v_rstd,
                                v_saved, options, to_stream(stream));
}

void cheri_block_inference(const OutArray& out, const InArray& x, const InArray& conv_weight,
                           const InArray& linear1_weight, const InArray& linear2_weight,
                           std::int64_t dilation, double residual_scale, double eps,
                           std::uintptr_t stream) {
  constexpr const char* op = "cheri_block_inference";
  const fusekit::TensorView v_out = to_view(out, op, "out");
  const fusekit::TensorView v_x = to_view(x, op, "x");
  const fusekit::CheriBlockWeights weights =
      cheri_weights(conv_weight, linear1_weight, linear2_weight, op);
  const fusekit::CheriBlockOptions options = cheri_options(dilation, residual_scale, eps, true);
  nb::gil_scoped_release release;
  fusekit::cheri_block_inference(v_out, v_x, weights, options, to_stream(stream));
}

// ------------------------------------------------------------------------------------ runtime

nb::dict build_info() {
  const fusekit::BuildInfo& b = fusekit::build_info();
  nb::dict d;
  d["version"] = b.version;
  d["with_cuda"] = b.with_cuda;
  d["cuda_architectures"] = b.cuda_architectures;
  d["with_openmp"] = b.with_openmp;
  return d;
}

nb::dict cuda_device_info(int index) {
  const fusekit::CudaDeviceInfo info = fusekit::cuda_device_info(index);
  nb::dict d;
  d["index"] = info.index;
  d["name"] = info.name;
  d["sm"] = nb::make_tuple(info.sm_major, info.sm_minor);
  d["multiprocessors"] = info.multiprocessors;
  d["global_memory_bytes"] = info.global_memory_bytes;
  d["l2_cache_bytes"] = info.l2_cache_bytes;
  return d;
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "fusekit's C++ operators on DLPack arrays (low level; use the fusekit package)";

  nb::exception<fusekit::Error>(m, "Error", PyExc_RuntimeError);

  m.def("mhc_post", &mhc_post, "out"_a.noconvert(), "x"_a.noconvert(), "residual"_a.noconvert(),
        "post_layer_mix"_a.noconvert(), "comb_res_mix"_a.noconvert(), "stream"_a,
        "out[n, i, h] = post_layer_mix[n, i] * x[n, h] + sum_j comb_res_mix[n, j, i] * "
        "residual[n, j, h], written into `out` (see include/fusekit/ops/mhc_post.h). `stream` is "
        "a cudaStream_t as an int (0: the legacy default stream; ignored on the CPU).");
  m.def("mhc_post_backward", &mhc_post_backward, "grad_x"_a.noconvert(),
        "grad_residual"_a.noconvert(), "grad_post_layer_mix"_a.noconvert(),
        "grad_comb_res_mix"_a.noconvert(), "grad_out"_a.noconvert(), "x"_a.noconvert(),
        "residual"_a.noconvert(), "post_layer_mix"_a.noconvert(), "comb_res_mix"_a.noconvert(),
        "stream"_a,
        "The gradients of mhc_post given grad_out, written into the four outputs (see "
        "include/fusekit/ops/mhc_post.h).");

  m.def("layernorm_linear_gelu", &layernorm_linear_gelu, "out"_a.noconvert(), "x"_a.noconvert(),
        "weight"_a.noconvert(), "bias"_a.noconvert().none(), "ln_weight"_a.noconvert().none(),
        "ln_bias"_a.noconvert().none(), "eps"_a, "approximate_tanh"_a, "allow_tf32"_a, "stream"_a,
        "out = GELU(LayerNorm(x) @ weight^T + bias), written into `out` (see "
        "include/fusekit/ops/layernorm_linear_gelu.h). bias, ln_weight and ln_bias may be None. "
        "approximate_tanh selects the tanh GELU (else the exact erf one); allow_tf32 lets float32 "
        "products use TF32. `stream` is a cudaStream_t as an int (0: the legacy default stream; "
        "ignored on the CPU).");

  m.def("trimul", &trimul, "out"_a.noconvert(), "x"_a.noconvert(), "mask"_a.noconvert().none(),
        "norm_weight"_a.noconvert(), "norm_bias"_a.noconvert(), "left_proj"_a.noconvert(),
        "right_proj"_a.noconvert(), "left_gate"_a.noconvert(), "right_gate"_a.noconvert(),
        "out_gate"_a.noconvert(), "to_out_norm_weight"_a.noconvert(),
        "to_out_norm_bias"_a.noconvert(), "to_out"_a.noconvert(), "incoming"_a, "eps"_a,
        "stream"_a,
        "The triangle multiplicative update of AlphaFold 3, outgoing (or incoming when "
        "`incoming`), written into `out` [B, N, N, C] (see include/fusekit/ops/trimul.h). mask "
        "[B, N, N] may be None. The weights are the module's parameters, named as in "
        "fusekit::TrimulWeights. `stream` is a cudaStream_t as an int (0: the legacy default "
        "stream; ignored on the CPU).");

  m.def("causal_attention", &causal_attention, "out"_a.noconvert(), "lse"_a.noconvert().none(),
        "q"_a.noconvert(), "k"_a.noconvert(), "v"_a.noconvert(), "n_padd"_a,
        "n_padd_per_sequence"_a.noconvert().none(), "scale"_a.none(), "allow_tf32"_a, "stream"_a,
        "Causal self-attention over left-padded sequences, written into `out` [B, H, T, D] and, "
        "unless it is None, `lse` [B, H, T] (float32); q [B, H, T, D], k and v [B, Hkv, T, D], or "
        "all without B and H (see include/fusekit/ops/causal_attention.h). Every sequence is "
        "padded by `n_padd` tokens, or by its entry of `n_padd_per_sequence` (int32 [B]) when "
        "that is given. `scale` None means 1 / sqrt(D); allow_tf32 lets float32 products use "
        "TF32. `stream` is a cudaStream_t as an int (0: the legacy default stream; ignored on "
        "the CPU).");

  m.def("dilated_conv_norm", &dilated_conv_norm, "y"_a.noconvert(), "mean"_a.noconvert().none(),
        "rstd"_a.noconvert().none(), "x"_a.noconvert(), "conv_weight"_a.noconvert(),
        "dilation"_a, "eps"_a, "stream"_a,
        "y = the dilated 3-tap depthwise convolution of x [N, L, C] normalised over each "
        "example's (L, C) plane, written into `y`, and its float32 mean and rstd [N] unless they "
        "are None (see include/fusekit/ops/cheri_block.h). `stream` is a cudaStream_t as an int "
        "(0: the legacy default stream; ignored on the CPU).");
  m.def("dilated_conv_norm_backward", &dilated_conv_norm_backward, "grad_x"_a.noconvert(),
        "grad_conv_weight"_a.noconvert(), "grad_y"_a.noconvert(), "x"_a.noconvert(),
        "conv_weight"_a.noconvert(), "mean"_a.noconvert(), "rstd"_a.noconvert(), "dilation"_a,
        "eps"_a, "stream"_a,
        "The gradients of dilated_conv_norm given grad_y and the forward's mean and rstd, "
        "written into grad_x and grad_conv_weight (see include/fusekit/ops/cheri_block.h).");
  m.def("cheri_block_saved_bytes", &cheri_block_saved_bytes, "n"_a, "l"_a, "c"_a, "hidden"_a,
        "dtype"_a, "cuda_device"_a, "allow_tf32"_a,
        "The size in bytes of what the Cheri block's training forward can keep for its backward "
        "(`saved`) for x [n, l, c] of `dtype` ('float32', 'float16' or 'bfloat16') on CUDA "
        "device `cuda_device` (-1: the CPU) and E C = hidden, or 0 where the backward would not "
        "read it (see include/fusekit/ops/cheri_block.h).");
  m.def("cheri_block", &cheri_block, "out"_a.noconvert(), "mean"_a.noconvert(),
        "rstd"_a.noconvert(), "saved"_a.noconvert().none(), "x"_a.noconvert(),
        "conv_weight"_a.noconvert(),
        "linear1_weight"_a.noconvert(), "linear2_weight"_a.noconvert(), "dilation"_a,
        "residual_scale"_a, "eps"_a, "allow_tf32"_a, "stream"_a,
        "The Cheri block's training forward: out = x + residual_scale * GELU_tanh(y @ "
        "linear1_weight^T) @ linear2_weight^T with y = dilated_conv_norm(x), written into `out` "
        "[N, L, C], the float32 mean and rstd [N] the backward needs and, unless it is None, "
        "`saved` (uint8 [cheri_block_saved_bytes]) for the backward to read (see "
        "include/fusekit/ops/cheri_block.h). allow_tf32 lets float32 products use TF32. `stream` "
        "is a cudaStream_t as an int (0: the legacy default stream; ignored on the CPU).");
  m.def("cheri_block_backward", &cheri_block_backward, "grad_x"_a.noconvert(),
        "grad_conv_weight"_a.noconvert(), "grad_linear1_weight"_a.noconvert(),
        "grad_linear2_weight"_a.noconvert(), "grad_out"_a.noconvert(), "x"_a.noconvert(),
        "conv_weight"_a.noconvert(), "linear1_weight"_a.noconvert(),
        "linear2_weight"_a.noconvert(), "mean"_a.noconvert(), "rstd"_a.noconvert(),
        "saved"_a.noconvert().none(), "dilation"_a, "residual_scale"_a, "eps"_a, "allow_tf32"_a,
        "stream"_a,
        "The gradients of the Cheri block's training forward given grad_out and the forward's "
        "mean, rstd and (unless it is None) saved, written into the four outputs (see "
        "include/fusekit/ops/cheri_block.h).");
  m.def("cheri_block_inference", &cheri_block_inference, "out"_a.noconvert(), "x"_a.noconvert(),
        "conv_weight"_a.noconvert(), "linear1_weight"_a.noconvert(),
        "linear2_weight"_a.noconvert(), "dilation"_a, "residual_scale"_a, "eps"_a, "stream"_a,
        "The Cheri block's inference forward, written into `out` [N, L, C]; nothing is saved "
        "(see include/fusekit/ops/cheri_block.h).");

  m.def("build_info", &build_info,
        "What this build contains: version, with_cuda, cuda_architectures, with_openmp.");
  m.def("cuda_device_count", &fusekit::cuda_device_count,
        nb::call_guard<nb::gil_scoped_release>(),
        "CUDA devices usable by this build (0 without CUDA support, driver or device).");
  m.def("cuda_device_info", &cuda_device_info, "index"_a,
        "Name, compute capability, multiprocessors, memory and L2 size of a CUDA device.");
}
