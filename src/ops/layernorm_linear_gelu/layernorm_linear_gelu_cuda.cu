// The CUDA backend of layernorm_linear_gelu: one kernel normalises the rows into a workspace in
// x's dtype (a warp per row, float32 statistics in two passes), then one cuBLASLt matrix product
// adds the bias and applies the tanh GELU in its epilogue, in float32, before the single rounding
// of the output. cuBLASLt has no erf GELU, and its tanh is a fast approximation (relative error
// near 2^-11, below half precision's rounding but not float32's), so the exact GELU and every
// GELU of the exact float32 path run as a pass over the output instead.
//
// The algorithm: cuBLASLt's heuristic proposes candidates for the shape, layout and alignments;
// the first call that is not being captured into a graph times them on the real operands (this
// synchronises the stream once) and keeps the fastest for the rest of the process.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "common/cublaslt.h"
#include "common/cuda_check.h"
#include "common/cuda_reduce.cuh"
#include "common/cuda_types.cuh"
#include "common/cuda_workspace.h"
#include "common/dispatch.h"
#include "ops/layernorm_linear_gelu/layernorm_linear_gelu_params.h"

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

// floats as 16 bytes of T, through the cache (the matrix product reads them next).
template <typename T, int V>
__device__ __forceinline__ void store_vec(T* p, const float (&v)[V]) {
  union {
    uint4 raw;
    T e[V];
  } u;
#pragma unroll
  for (int i = 0; i < V; ++i) u.e[i] = from_float<T>(v[i]);
  *reinterpret_cast<uint4*>(p) = u.raw;
}

// One warp per row. With CHUNKS > 0, a contiguous, aligned row of at most CHUNKS * 512 bytes
// whose length is a multiple of 16 bytes is read once into registers (all loads in flight at
// once); every other row is read three times (sum, squared deviations, output) from the cache.
template <typename T, int CHUNKS>
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

  // The sums run on x - x[0]: exact for values near x[0] (within a factor 2), and of the size of
  // the deviations, so a mean far from 0 costs no digits of the variance or of x - mean.
  const float shift = to_float(x[0]);
  auto normalise = [&](float v, std::int64_t q, float mean, float rstd) {
    v = (v - shift - mean) * rstd;
    if (a.ln_weight) v *= load_param<T>(a.ln_weight, a.ln_weight_f32, q, a.ln_weight_stride);
    if (a.ln_bias) v += load_param<T>(a.ln_bias, a.ln_bias_f32, q, a.ln_bias_stride);
    return v;
  };

  if constexpr (CHUNKS > 0) {
    if (vec && a.k % V == 0 && a.k <= CHUNKS * 32 * V) {
      float v[CHUNKS][V];
      float sum = 0.0f;
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) {
        const std::int64_t q = (c * 32 + lane) * V;
        if (q < a.k) {
          load_vec<T, V>(x + q, v[c]);
#pragma unroll
          for (int i = 0; i < V; ++i) sum += v[c][i] - shift;
        }
      }
      const float mean = warp_sum(sum) / static_cast<float>(a.k);
      float sq = 0.0f;
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) {
        if ((c * 32 + lane) * V < a.k) {
#pragma unroll
          for (int i = 0; i < V; ++i) sq += (v[c][i] - shift - mean) * (v[c][i] - shift - mean);
        }
      }
      const float rstd = rsqrtf(warp_sum(sq) / static_cast<float>(a.k) + a.eps);
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) {
        const std::int64_t q = (c * 32 + lane) * V;
        if (q < a.k) {
#pragma unroll
          for (int i = 0; i < V; ++i) v[c][i] = normalise(v[c][i], q + i, mean, rstd);
          store_vec<T, V>(dst + q, v[c]);
        }
      }
      return;
    }
  }

  float sum = 0.0f;
  for (std::int64_t q = lane * V; q < k_vec; q += 32 * V) {
    float v[V];
    load_vec<T, V>(x + q, v);
#pragma unroll
    for (int i = 0; i < V; ++i) sum += v[i] - shift;
  }
  for (std::int64_t q = k_vec + lane; q < a.k; q += 32) sum += to_float(x[q * a.k_stride]) - shift;
  const float mean = warp_sum(sum) / static_cast<float>(a.k);  // of x - shift

  float sq = 0.0f;
  for (std::int64_t q = lane * V; q < k_vec; q += 32 * V) {
    float v[V];
    load_vec<T, V>(x + q, v);
#pragma unroll
    for (int i = 0; i < V; ++i) sq += (v[i] - shift - mean) * (v[i] - shift - mean);
  }
  for (std::int64_t q = k_vec + lane; q < a.k; q += 32) {
    const float d = to_float(x[q * a.k_stride]) - shift - mean;
    sq += d * d;
  }
  const float rstd = rsqrtf(warp_sum(sq) / static_cast<float>(a.k) + a.eps);

  for (std::int64_t q = lane * V; q < k_vec; q += 32 * V) {
    float v[V];
    load_vec<T, V>(x + q, v);
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = normalise(v[i], q + i, mean, rstd);
    store_vec<T, V>(dst + q, v);
  }
  for (std::int64_t q = k_vec + lane; q < a.k; q += 32) {
    dst[q] = from_float<T>(normalise(to_float(x[q * a.k_stride]), q, mean, rstd));
  }
}

// ------------------------------------------------------------------------------------ GELU pass

template <typename T, GeluApproximation A>
__global__ void gelu_rows(T* out, std::int64_t m, std::int64_t n, std::int64_t ld) {
  const std::int64_t total = m * n;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    T* p = out + (i / n) * ld + i % n;
    const float v = to_float(*p);
    if constexpr (A == GeluApproximation::Tanh) {
      *p = from_float<T>(0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v))));
    } else {
      *p = from_float<T>(0.5f * v * (1.0f + erff(v * 0.7071067811865476f)));
    }
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

// Everything the heuristic's choice depends on.
using GemmKey = std::tuple<int, int, bool, std::int64_t, std::int64_t, std::int64_t, bool,
                           std::int64_t, std::int64_t, std::int64_t, std::uint32_t, std::uint32_t,
                           std::uint32_t, std::uint32_t, int>;

// Whether the matrix product applies GELU itself (see the top of the file).
bool gelu_in_epilogue(const LayerNormLinearGeluParams& p) {
  return p.approximate == GeluApproximation::Tanh && (p.dtype != DType::Float32 || p.allow_tf32);
}

constexpr int kCandidates = 16;  // algorithms asked of the heuristic, timed on first use

// Times each candidate a few times on `stream` and returns the index of the fastest.
int fastest(cublasLtHandle_t handle, const LtObjects& lt, const void* a, const void* b, void* d,
            const cublasLtMatmulHeuristicResult_t* results, int count, cudaStream_t stream) {
  std::size_t ws_bytes = 0;
  for (int i = 0; i < count; ++i) ws_bytes = std::max(ws_bytes, results[i].workspaceSize);
  const StreamWorkspace ws(ws_bytes, stream);
  struct Events {  // destroyed on every way out
    cudaEvent_t start = nullptr, stop = nullptr;
    ~Events() {
      if (start) cudaEventDestroy(start);
      if (stop) cudaEventDestroy(stop);
    }
  } ev;
  FUSEKIT_CUDA_CHECK(cudaEventCreate(&ev.start));
  FUSEKIT_CUDA_CHECK(cudaEventCreate(&ev.stop));
  const float alpha = 1.0f, beta = 0.0f;
  // Two rounds over all candidates, each candidate's best round counted: the first round also
  // brings the clocks up, which would otherwise favour whichever candidate runs last.
  constexpr int kRounds = 2, kRuns = 3;
  std::vector<float> ms(count, std::numeric_limits<float>::infinity());
  for (int round = 0; round < kRounds; ++round) {
    for (int i = 0; i < count; ++i) {
      auto run = [&] {
        return cublasLtMatmul(handle, lt.desc, &alpha, a, lt.a, b, lt.b, &beta, d, lt.d, d, lt.d,
                              &results[i].algo, ws.as<void>(), ws_bytes, stream);
      };
      if (run() != CUBLAS_STATUS_SUCCESS) continue;  // a candidate that cannot run is skipped
      FUSEKIT_CUDA_CHECK(cudaEventRecord(ev.start, stream));
      for (int r = 0; r < kRuns; ++r) FUSEKIT_CUBLAS_CHECK(run());
      FUSEKIT_CUDA_CHECK(cudaEventRecord(ev.stop, stream));
      FUSEKIT_CUDA_CHECK(cudaEventSynchronize(ev.stop));
      float t = 0;
      FUSEKIT_CUDA_CHECK(cudaEventElapsedTime(&t, ev.start, ev.stop));
      ms[i] = std::min(ms[i], t);
    }
  }
  // The heuristic's first choice stands unless another is clearly (3%) faster.
  int best = 0;
  for (int i = 1; i < count; ++i) {
    if (ms[i] < ms[best] * (best == 0 ? 0.97f : 1.0f)) best = i;
  }
  return best;
}

// out[M, Nout] = epilogue(xn[M, K] weight^T): in column-major terms D[Nout, M] = op(W) xn^T with
// W read as [K, Nout] (transposed) from a row-major weight, or as [Nout, K] from a transposed one.
void matmul(const LayerNormLinearGeluParams& p, const void* xn, std::int64_t ld_xn, int device,
            cudaStream_t stream) {
  const cudaDataType_t type = cuda_data_type(p.dtype);
  const bool tf32 = p.dtype == DType::Float32 && p.allow_tf32;
  const cublasComputeType_t compute = tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  const bool w_row_major = p.w_stride_k == 1;
  const cublasOperation_t trans_a = w_row_major ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t trans_b = CUBLAS_OP_N;
  const std::int64_t lda = w_row_major ? p.w_stride_n : p.w_stride_k;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  if (gelu_in_epilogue(p)) {
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
  const cublasLtHandle_t handle = lt_handle(device);
  static std::mutex mutex;
  static std::map<GemmKey, cublasLtMatmulHeuristicResult_t> cache;
  cublasLtMatmulHeuristicResult_t chosen{};
  bool cached = false;
  {
    const std::lock_guard lock(mutex);
    if (auto it = cache.find(key); it != cache.end()) {
      chosen = it->second;
      cached = true;
    }
  }
  if (!cached) {
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
    cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
    int found = 0;
    FUSEKIT_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, lt.desc, lt.a, lt.b, lt.d, lt.d,
                                                        lt.pref, kCandidates, results, &found));
    FUSEKIT_CHECK(found > 0, kOp, ": cuBLASLt has no algorithm for M = ", p.m, ", K = ", p.k,
                  ", Nout = ", p.nout, " in ", to_string(p.dtype), " with these alignments (",
                  "weight ", align_a, ", out ", align_d, " bytes)");
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    FUSEKIT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (capture != cudaStreamCaptureStatusNone) {
      chosen = results[0];  // the heuristic's first choice; not remembered, so a later call tunes
    } else {
      // With one candidate there is nothing to time, but the choice is still remembered, so
      // later calls skip the heuristic.
      chosen = found == 1 ? results[0]
                          : results[fastest(handle, lt, p.weight, xn, p.out, results, found, stream)];
      const std::lock_guard lock(mutex);
      cache.emplace(key, chosen);
    }
  }

  const StreamWorkspace ws(chosen.workspaceSize, stream);
  const float alpha = 1.0f, beta = 0.0f;
  FUSEKIT_CUBLAS_CHECK(cublasLtMatmul(handle, lt.desc, &alpha, p.weight, lt.a, xn, lt.b, &beta,
                                      p.out, lt.d, p.out, lt.d, &chosen.algo, ws.as<void>(),
                                      chosen.workspaceSize, stream));
}

template <typename T>
void run(const LayerNormLinearGeluParams& p, int device, cudaStream_t stream) {
  const std::int64_t ld_xn = ceil_div(p.k, 8) * 8;  // rows 16-byte aligned (32 for float32)
  const StreamWorkspace xn_ws(static_cast<std::size_t>(p.m * ld_xn) * sizeof(T), stream);
  T* xn = xn_ws.as<T>();

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
  const std::int64_t chunks = ceil_div(p.k, 32 * kVec16<T>);  // of 16 bytes per lane
  const auto launch = [&](auto kernel) {
    kernel<<<blocks, kRowsPerBlock * 32, 0, stream>>>(a);
    FUSEKIT_CUDA_CHECK_LAUNCH("layernorm_rows");
  };
  if (chunks <= 1) {
    launch(layernorm_rows<T, 1>);
  } else if (chunks <= 2) {
    launch(layernorm_rows<T, 2>);
  } else if (chunks <= 4) {
    launch(layernorm_rows<T, 4>);
  } else if (chunks <= 8) {
    launch(layernorm_rows<T, 8>);
  } else if (chunks <= 16) {
    launch(layernorm_rows<T, 16>);
  } else {
    launch(layernorm_rows<T, 0>);
  }

  matmul(p, xn, ld_xn, device, stream);

  if (!gelu_in_epilogue(p)) {
    const std::int64_t total = p.m * p.nout;
    const auto grid = static_cast<unsigned>(
        std::min<std::int64_t>(ceil_div(total, 256), std::int64_t{multiprocessor_count(device)} * 8));
    auto* out = static_cast<T*>(p.out);
    if (p.approximate == GeluApproximation::Tanh) {
      gelu_rows<T, GeluApproximation::Tanh><<<grid, 256, 0, stream>>>(out, p.m, p.nout, p.out_row_stride);
    } else {
      gelu_rows<T, GeluApproximation::None><<<grid, 256, 0, stream>>>(out, p.m, p.nout, p.out_row_stride);
    }
    FUSEKIT_CUDA_CHECK_LAUNCH("gelu_rows");
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
