// The CUDA backend of layernorm_linear_gelu: one kernel normalises the rows into a workspace in
// x's dtype (a warp per row, float32 statistics in two passes), then one cuBLASLt matrix product
// adds the bias and applies GELU in its epilogue, in float32, before the single rounding of the
// output. The exact (erf) GELU has no cuBLASLt epilogue, so it runs as a pass over the output.
#include <cublasLt.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

#include "common/cuda_check.h"
#include "common/cuda_types.cuh"
#include "common/cuda_workspace.h"
#include "common/dispatch.h"
#include "ops/layernorm_linear_gelu/layernorm_linear_gelu_params.h"

#define FUSEKIT_CUBLAS_CHECK(call)                                                         \
  do {                                                                                     \
    const cublasStatus_t fusekit_status_ = (call);                                         \
    if (fusekit_status_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                             \
      throw ::fusekit::Error(::fusekit::detail::concat(                                    \
          "cuBLASLt error ", cublasLtGetStatusName(fusekit_status_), " (",                 \
          cublasLtGetStatusString(fusekit_status_), ") in " #call " at ", __FILE__, ":", \
          __LINE__));                                                                      \
  } while (0)

namespace fusekit::detail {

namespace {

constexpr const char* kOp = "layernorm_linear_gelu";
constexpr int kRowsPerBlock = 8;  // one warp per row
constexpr std::size_t kMaxGemmWorkspace = std::size_t{32} << 20;

// ------------------------------------------------------------------------------------ LayerNorm

struct LayerNormArgs {
  std::int64_t m, k;
  const void* x;
  int lead_ndim;
  std::int64_t lead_shape[kMaxDims], lead_stride[kMaxDims];
  std::int64_t k_stride;
  const void* ln_weight;
  std::int64_t ln_weight_stride;
  bool ln_weight_f32;
  const void* ln_bias;
  std::int64_t ln_bias_stride;
  bool ln_bias_f32;
  float eps;
  void* xn;        // [M, ld] in x's dtype
  std::int64_t ld; // a multiple of 16 bytes
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

template <typename T>
__device__ __forceinline__ float load_param(const void* p, bool is_f32, std::int64_t i,
                                            std::int64_t stride) {
  return is_f32 ? static_cast<const float*>(p)[i * stride]
                : to_float(static_cast<const T*>(p)[i * stride]);
}

// 16 bytes of T as floats, through the cache (the row is read three times).
template <typename T, int V>
__device__ __forceinline__ void load_vec(const T* p, float (&v)[V]) {
  union {
    uint4 raw;
    T e[V];
  } u;
  u.raw = *reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int i = 0; i < V; ++i) v[i] = to_float(u.e[i]);
}

template <typename T>
__global__ void __launch_bounds__(kRowsPerBlock * 32) layernorm_rows(LayerNormArgs a) {
  constexpr int V = kVec16<T>;
  const int lane = threadIdx.x & 31;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= a.m) return;

  std::int64_t offset = 0, r = row;
  for (int d = a.lead_ndim - 1; d >= 0; --d) {
    offset += (r % a.lead_shape[d]) * a.lead_stride[d];
    r /= a.lead_shape[d];
  }
  const T* x = static_cast<const T*>(a.x) + offset;
  T* dst = static_cast<T*>(a.xn) + row * a.ld;
  // The 16-byte part of a contiguous, aligned row, then the rest element by element.
  const bool vec = a.k_stride == 1 && is_aligned(x, 16);
  const std::int64_t k_vec = vec ? a.k / V * V : 0;

  float sum = 0.0f;
  for (std::int64_t q = lane * V; q < k_vec; q += 32 * V) {
    float v[V];
    load_vec<T, V>(x + q, v);
#pragma unroll
    for (int i = 0; i < V; ++i) sum += v[i];
  }
  for (std::int64_t q = k_vec + lane; q < a.k; q += 32) sum += to_float(x[q * a.k_stride]);
  const float mean = warp_sum(sum) / static_cast<float>(a.k);

  float sq = 0.0f;
  for (std::int64_t q = lane * V; q < k_vec; q += 32 * V) {
    float v[V];
    load_vec<T, V>(x + q, v);
#pragma unroll
    for (int i = 0; i < V; ++i) sq += (v[i] - mean) * (v[i] - mean);
  }
  for (std::int64_t q = k_vec + lane; q < a.k; q += 32) {
    const float d = to_float(x[q * a.k_stride]) - mean;
    sq += d * d;
  }
  const float rstd = rsqrtf(warp_sum(sq) / static_cast<float>(a.k) + a.eps);

  auto normalise = [&](float v, std::int64_t q) {
    v = (v - mean) * rstd;
    if (a.ln_weight) v *= load_param<T>(a.ln_weight, a.ln_weight_f32, q, a.ln_weight_stride);
    if (a.ln_bias) v += load_param<T>(a.ln_bias, a.ln_bias_f32, q, a.ln_bias_stride);
    return v;
  };
  for (std::int64_t q = lane * V; q < k_vec; q += 32 * V) {
    float v[V];
    load_vec<T, V>(x + q, v);
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = normalise(v[i], q + i);
    store_floats<T, V>(dst + q, v);
  }
  for (std::int64_t q = k_vec + lane; q < a.k; q += 32) {
    dst[q] = from_float<T>(normalise(to_float(x[q * a.k_stride]), q));
  }
}

// ------------------------------------------------------------------------------------ exact GELU

template <typename T>
__global__ void gelu_erf_rows(T* out, std::int64_t m, std::int64_t n, std::int64_t ld) {
  const std::int64_t total = m * n;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    T* p = out + (i / n) * ld + i % n;
    const float v = to_float(*p);
    *p = from_float<T>(0.5f * v * (1.0f + erff(v * 0.7071067811865476f)));
  }
}

// ------------------------------------------------------------------------------------ cuBLASLt

cudaDataType_t cuda_data_type(DType dtype) {
  switch (dtype) {
    case DType::Float32: return CUDA_R_32F;
    case DType::Float16: return CUDA_R_16F;
    case DType::BFloat16: return CUDA_R_16BF;
    default: break;
  }
  throw Error(concat(kOp, ": no cuBLASLt type for dtype ", to_string(dtype)));
}

// The largest power of two (at most 256) dividing the address: what cuBLASLt may assume.
std::uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  std::uint32_t align = 256;
  while (align > 1 && a % align != 0) align /= 2;
  return align;
}

// One cuBLASLt handle per device, made on first use and kept for the life of the process.
cublasLtHandle_t lt_handle(int device) {
  static std::mutex mutex;
  static std::map<int, cublasLtHandle_t> handles;
  const std::lock_guard lock(mutex);
  auto it = handles.find(device);
  if (it == handles.end()) {
    cublasLtHandle_t handle = nullptr;
    FUSEKIT_CUBLAS_CHECK(cublasLtCreate(&handle));
    it = handles.emplace(device, handle).first;
  }
  return it->second;
}

// Everything the heuristic's choice depends on.
using GemmKey = std::tuple<int, int, bool, std::int64_t, std::int64_t, std::int64_t, bool,
                           std::int64_t, std::int64_t, std::int64_t, std::uint32_t, std::uint32_t,
                           std::uint32_t, std::uint32_t, int>;

// RAII for the descriptors of one call.
struct LtObjects {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  LtObjects() = default;
  LtObjects(const LtObjects&) = delete;
  LtObjects& operator=(const LtObjects&) = delete;
  ~LtObjects() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

template <typename V>
void set_desc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const V& value) {
  FUSEKIT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)));
}

// out[M, Nout] = epilogue(xn[M, K] weight^T): in column-major terms D[Nout, M] = op(W) xn^T with
// W read as [K, Nout] (transposed) from a row-major weight, or as [Nout, K] from a transposed one.
void matmul(const LayerNormLinearGeluParams& p, const void* xn, std::int64_t ld_xn, int device,
            cudaStream_t stream, void* workspace, std::size_t workspace_bytes,
            cublasLtMatmulHeuristicResult_t* chosen) {
  const cudaDataType_t type = cuda_data_type(p.dtype);
  const bool tf32 = p.dtype == DType::Float32 && p.allow_tf32;
  const cublasComputeType_t compute = tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  const bool w_row_major = p.w_stride_k == 1;
  const cublasOperation_t trans_a = w_row_major ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t trans_b = CUBLAS_OP_N;
  const std::int64_t lda = w_row_major ? p.w_stride_n : p.w_stride_k;
  const bool gelu_in_epilogue = p.approximate == GeluApproximation::Tanh;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  if (gelu_in_epilogue) {
    epilogue = p.bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
  } else if (p.bias) {
    epilogue = CUBLASLT_EPILOGUE_BIAS;
  }

  LtObjects lt;
  FUSEKIT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&lt.desc, compute, CUDA_R_32F));
  set_desc(lt.desc, CUBLASLT_MATMUL_DESC_TRANSA, trans_a);
  set_desc(lt.desc, CUBLASLT_MATMUL_DESC_TRANSB, trans_b);
  set_desc(lt.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
  if (p.bias) set_desc(lt.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, p.bias);
  const auto u64 = [](std::int64_t v) { return static_cast<std::uint64_t>(v); };
  if (w_row_major) {
    FUSEKIT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lt.a, type, u64(p.k), u64(p.nout), lda));
  } else {
    FUSEKIT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lt.a, type, u64(p.nout), u64(p.k), lda));
  }
  FUSEKIT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lt.b, type, u64(p.k), u64(p.m), ld_xn));
  FUSEKIT_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&lt.d, type, u64(p.nout), u64(p.m), p.out_row_stride));

  const std::uint32_t align_a = alignment_of(p.weight), align_b = alignment_of(xn),
                      align_d = alignment_of(p.out),
                      align_bias = p.bias ? alignment_of(p.bias) : 256;
  const GemmKey key{device, static_cast<int>(p.dtype), tf32, p.m, p.nout, p.k, w_row_major,
                    lda, ld_xn, p.out_row_stride, align_a, align_b, align_d, align_bias,
                    static_cast<int>(epilogue)};
  static std::mutex mutex;
  static std::map<GemmKey, cublasLtMatmulHeuristicResult_t> cache;
  {
    const std::lock_guard lock(mutex);
    auto it = cache.find(key);
    if (it == cache.end()) {
      FUSEKIT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&lt.pref));
      const std::uint64_t max_ws = kMaxGemmWorkspace;
      FUSEKIT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
          lt.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_ws, sizeof(max_ws)));
      const std::pair<cublasLtMatmulPreferenceAttributes_t, std::uint32_t> aligns[] = {
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a},
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b},
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_d},
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d}};
      for (const auto& [attr, value] : aligns) {
        FUSEKIT_CUBLAS_CHECK(
            cublasLtMatmulPreferenceSetAttribute(lt.pref, attr, &value, sizeof(value)));
      }
      cublasLtMatmulHeuristicResult_t result{};
      int found = 0;
      FUSEKIT_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt_handle(device), lt.desc, lt.a, lt.b,
                                                          lt.d, lt.d, lt.pref, 1, &result, &found));
      FUSEKIT_CHECK(found > 0, kOp, ": cuBLASLt has no algorithm for M = ", p.m, ", K = ", p.k,
                    ", Nout = ", p.nout, " in ", to_string(p.dtype), " with these alignments (",
                    "weight ", align_a, ", out ", align_d, " bytes)");
      it = cache.emplace(key, result).first;
    }
    *chosen = it->second;
  }
  if (workspace == nullptr) return;  // sizing call: the caller allocates chosen->workspaceSize

  const float alpha = 1.0f, beta = 0.0f;
  FUSEKIT_CUBLAS_CHECK(cublasLtMatmul(lt_handle(device), lt.desc, &alpha, p.weight, lt.a, xn, lt.b,
                                      &beta, p.out, lt.d, p.out, lt.d, &chosen->algo, workspace,
                                      workspace_bytes, stream));
}

template <typename T>
void run(const LayerNormLinearGeluParams& p, int device, cudaStream_t stream) {
  constexpr std::int64_t V = kVec16<T>;
  const std::int64_t ld_xn = ceil_div(p.k, 8) * 8;  // rows 16-byte aligned (32 for float32)
  const std::size_t xn_bytes =
      static_cast<std::size_t>(ceil_div(p.m * ld_xn * static_cast<std::int64_t>(sizeof(T)), 256) * 256);
  static_assert(V >= 4);

  // The algorithm (and its workspace size) is chosen before anything is allocated; the
  // normalised rows start 256-byte aligned in the workspace, as the choice assumed.
  cublasLtMatmulHeuristicResult_t chosen{};
  {
    LayerNormLinearGeluParams sizing = p;
    matmul(sizing, reinterpret_cast<const void*>(std::uintptr_t{256}), ld_xn, device, stream,
           nullptr, 0, &chosen);
  }
  StreamWorkspace ws(xn_bytes + chosen.workspaceSize, stream);
  T* xn = ws.as<T>();

  LayerNormArgs a{};
  a.m = p.m;
  a.k = p.k;
  a.x = p.x;
  a.lead_ndim = p.x_lead_ndim;
  for (int d = 0; d < p.x_lead_ndim; ++d) {
    a.lead_shape[d] = p.x_lead_shape[d];
    a.lead_stride[d] = p.x_lead_stride[d];
  }
  a.k_stride = p.x_k_stride;
  a.ln_weight = p.ln_weight;
  a.ln_weight_stride = p.ln_weight_stride;
  a.ln_weight_f32 = p.ln_weight_dtype == DType::Float32;
  a.ln_bias = p.ln_bias;
  a.ln_bias_stride = p.ln_bias_stride;
  a.ln_bias_f32 = p.ln_bias_dtype == DType::Float32;
  a.eps = p.eps;
  a.xn = xn;
  a.ld = ld_xn;
  const auto blocks = static_cast<unsigned>(ceil_div(p.m, kRowsPerBlock));
  layernorm_rows<T><<<blocks, kRowsPerBlock * 32, 0, stream>>>(a);
  FUSEKIT_CUDA_CHECK_LAUNCH("layernorm_rows");

  matmul(p, xn, ld_xn, device, stream, reinterpret_cast<char*>(xn) + xn_bytes,
         chosen.workspaceSize, &chosen);

  if (p.approximate == GeluApproximation::None) {
    const std::int64_t total = p.m * p.nout;
    const auto grid = static_cast<unsigned>(
        std::min<std::int64_t>(ceil_div(total, 256), std::int64_t{multiprocessor_count(device)} * 8));
    gelu_erf_rows<T><<<grid, 256, 0, stream>>>(static_cast<T*>(p.out), p.m, p.nout, p.out_row_stride);
    FUSEKIT_CUDA_CHECK_LAUNCH("gelu_erf_rows");
  }
}

}  // namespace

void launch_layernorm_linear_gelu(const LayerNormLinearGeluParams& p, int device, Stream stream) {
  const CudaDeviceGuard guard(device);
  const auto s = static_cast<cudaStream_t>(stream.handle);
  dispatch_floating(p.dtype, kOp, [&](auto tag) {
    run<typename CudaType<decltype(tag)::value>::type>(p, device, s);
  });
}

}  // namespace fusekit::detail
