// causal_attention on the CPU backend: against the float64 reference in every dtype, with
// grouped-query heads and the single-head form, left padding of 0, T - 1 and T for the whole batch
// and per sequence, sequences of 1 to 4096 tokens and head dims of 1 to 256, every layout, sharp
// and flat softmaxes, empty inputs, determinism, and every validation error. NaN fills every
// padding row of q, k and v, and the outputs start as NaN.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "causal_attention_support.h"

namespace {

using namespace fusekit_test;
using fusekit::testing::empty_poisoned;
using fusekit::testing::upload_padding_counts;

constexpr Device kCpu = Device::cpu();
constexpr DType kDtypes[] = {DType::Float32, DType::BFloat16, DType::Float16};
constexpr auto kAll = PaddingKind::All;
constexpr auto kPerSeq = PaddingKind::PerSequence;

void check_cpu(const AttentionCase& c, std::mt19937_64& rng, const AttentionLayouts& layouts = {}) {
  const AttentionInputs in = make_attention_inputs(c, rng);
  expect_attention_close(run_attention_checked(in, c, kCpu, layouts), attention_float64(in, c),
                         in.n_padd, c);
}

/// The bytes of out (and lse) after one run of `c` on `in`, as laid out by `layouts`.
std::vector<unsigned char> output_bytes(const AttentionInputs& in, const AttentionCase& c,
                                        bool with_lse = true,
                                        const CausalAttentionOptions* options = nullptr) {
  const AttentionTensors t = upload_attention(in, c, kCpu, {}, with_lse);
  if (options != nullptr) {
    fusekit::causal_attention(t.out.view, t.lse.view, t.q.view, t.k.view, t.v.view, t.padding(),
                              *options);
  } else {
    run_attention(t, c);
  }
  std::vector<unsigned char> bytes = raw_bytes(t.out);
  if (with_lse) {
    const std::vector<unsigned char> lse = raw_bytes(t.lse);
    bytes.insert(bytes.end(), lse.begin(), lse.end());
  }
  return bytes;
}

// ------------------------------------------------------------------------------------ shapes

// One token; D of 1, 32, 33, 64, 80, 128 and 256; query heads per key/value head of 1, 2, 3 and
// 4; padding of 0, some, T - 1 and T, for the batch and per sequence (fixed and drawn per run);
// T of 1, 17, 70, 100, 129 (two blocks of keys and one more) and 1000.
const AttentionCase kCases[] = {
    {1, 1, 1, 1, 1},
    {1, 1, 1, 1, 1, kAll, {1}},
    {1, 3, 1, 17, 1, kPerSeq, {4}},
    {2, 4, 2, 17, 32, kPerSeq, {0, 16}},
    {2, 2, 2, 17, 80, kAll, {16}},
    {2, 2, 1, 17, 64, kAll, {17}},
    {3, 4, 4, 100, 33, kPerSeq, {}},
    {4, 6, 2, 70, 128, kPerSeq, {70, 0, 69, 13}},
    {1, 2, 1, 129, 256, kPerSeq, {3}},
    {2, 4, 1, 1000, 64, kPerSeq, {}},
};

class AttentionCpu : public Seeded<::testing::TestWithParam<std::tuple<DType, AttentionCase>>> {};

TEST_P(AttentionCpu, MatchesFloat64) {
  const auto [dtype, c] = GetParam();
  check_cpu(with_dtype(c, dtype), rng_);
}

INSTANTIATE_TEST_SUITE_P(All, AttentionCpu,
                         ::testing::Combine(::testing::ValuesIn(kDtypes),
                                            ::testing::ValuesIn(kCases)),
                         [](const auto& info) {
                           return attention_case_name(
                               with_dtype(std::get<1>(info.param), std::get<0>(info.param)));
                         });

// ------------------------------------------------------------------------------------ layouts

class AttentionCpuLayouts
    : public Seeded<::testing::TestWithParam<std::tuple<DType, AttentionLayoutCase>>> {};

TEST_P(AttentionCpuLayouts, MatchesFloat64) {
  const auto [dtype, l] = GetParam();
  check_cpu({2, 4, 2, 70, 40, kPerSeq, {}, dtype}, rng_, l.layouts);
  check_cpu({3, 3, 1, 33, 17, kAll, {5}, dtype}, rng_, l.layouts);
}

INSTANTIATE_TEST_SUITE_P(All, AttentionCpuLayouts,
                         ::testing::Combine(::testing::ValuesIn(kDtypes),
                                            ::testing::ValuesIn(kAttentionLayouts)),
                         [](const auto& info) {
                           return dtype_name(std::get<0>(info.param)) + "_" +
                                  std::get<1>(info.param).name;
                         });

// The [T, D] form (lse [T]), padded for the batch of one or by a per-sequence count [1].
class AttentionCpuSingleHead
    : public Seeded<::testing::TestWithParam<std::tuple<DType, AttentionLayoutCase>>> {};

TEST_P(AttentionCpuSingleHead, MatchesFloat64) {
  const auto [dtype, l] = GetParam();
  AttentionCase all{1, 1, 1, 150, 48, kAll, {7}, dtype};
  all.single_head = true;
  check_cpu(all, rng_, l.layouts);
  AttentionCase per_sequence{1, 1, 1, 65, 96, kPerSeq, {50}, dtype};
  per_sequence.single_head = true;
  check_cpu(per_sequence, rng_, l.layouts);
}

INSTANTIATE_TEST_SUITE_P(All, AttentionCpuSingleHead,
                         ::testing::Combine(::testing::ValuesIn(kDtypes),
                                            ::testing::ValuesIn(kSingleHeadLayouts)),
                         [](const auto& info) {
                           return dtype_name(std::get<0>(info.param)) + "_" +
                                  std::get<1>(info.param).name;
                         });

// ------------------------------------------------------------------------------------ the rest

class AttentionCpuMisc : public Seeded<> {};

TEST_F(AttentionCpuMisc, LongSequence) {
  check_cpu({1, 1, 1, 4096, 64, kAll, {100}}, rng_);
}

TEST_F(AttentionCpuMisc, SharpAndFlatSoftmax) {
  // Scores of size 32 (a softmax close to one-hot: the running max must be subtracted before any
  // exp) and of size 0.01 (nearly uniform weights).
  AttentionCase sharp{2, 2, 1, 150, 64, kPerSeq, {3, 40}};
  sharp.scale = 1.0;
  sharp.q_stddev = 4.0;
  check_cpu(sharp, rng_);
  check_cpu(with_dtype(sharp, DType::BFloat16), rng_);
  AttentionCase flat{2, 2, 2, 150, 64, kAll, {9}};
  flat.scale = 0.01;
  check_cpu(flat, rng_);
}

TEST_F(AttentionCpuMisc, DefaultScaleIsOneOverSqrtD) {
  const AttentionCase c{2, 2, 1, 40, 80, kPerSeq, {0, 7}};
  const AttentionInputs in = make_attention_inputs(c, rng_);
  AttentionCase explicit_scale = c;
  explicit_scale.scale = 1.0 / std::sqrt(80.0);
  EXPECT_EQ(output_bytes(in, c), output_bytes(in, explicit_scale));
  AttentionCase other = c;
  other.scale = 0.5;
  EXPECT_NE(output_bytes(in, c), output_bytes(in, other));
}

/// Heads [h0, h0 + heads) of sequences [b0, b0 + batch) of a [B, H, T, D] tensor.
HostTensor slice(const HostTensor& x, std::int64_t b0, std::int64_t batch, std::int64_t h0,
                 std::int64_t heads) {
  const std::int64_t t = x.shape[2], d = x.shape[3];
  HostTensor s({batch, heads, t, d});
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t h = 0; h < heads; ++h) {
      const double* src = x.values.data() + ((b0 + b) * x.shape[1] + h0 + h) * t * d;
      std::copy_n(src, t * d, s.values.data() + (b * heads + h) * t * d);
    }
  }
  return s;
}

TEST_F(AttentionCpuMisc, PerSequencePaddingIsEachSequenceOnItsOwn) {
  // A batch whose sequences are padded differently gives, sequence by sequence, the result of
  // that sequence alone padded by its count: no count leaks into another sequence.
  const AttentionCase c{4, 2, 1, 50, 24, kPerSeq, {50, 0, 17, 49}};
  const AttentionInputs in = make_attention_inputs(c, rng_);
  const CausalAttentionResult batch = run_attention_checked(in, c, kCpu);
  for (std::int64_t b = 0; b < c.b; ++b) {
    const AttentionCase one{1, 2, 1, 50, 24, kAll, {c.pad[b]}};
    const AttentionInputs alone{slice(in.q, b, 1, 0, 2), slice(in.k, b, 1, 0, 1),
                                slice(in.v, b, 1, 0, 1), {c.pad[b]}};
    const CausalAttentionResult single = run_attention_checked(alone, one, kCpu);
    const std::int64_t out_size = single.out.numel(), lse_size = single.lse.numel();
    EXPECT_TRUE(std::equal(single.out.values.begin(), single.out.values.end(),
                           batch.out.values.begin() + b * out_size) &&
                std::equal(single.lse.values.begin(), single.lse.values.end(),
                           batch.lse.values.begin() + b * lse_size))
        << "sequence " << b << " (padding " << c.pad[b] << ") differs from its run alone";
  }
}

TEST_F(AttentionCpuMisc, GroupedHeadsReadTheirKeyValueHead) {
  // Hq = 6 over Hkv = 2 (query heads 0-2 read head 0, 3-5 head 1) gives the bytes of Hkv = 6 with
  // each key/value head repeated for its group.
  const AttentionCase gqa{2, 6, 2, 45, 32, kPerSeq, {2, 11}};
  const AttentionInputs in = make_attention_inputs(gqa, rng_);
  AttentionCase mha = gqa;
  mha.hkv = 6;
  AttentionInputs repeated = in;
  for (HostTensor* x : {&repeated.k, &repeated.v}) {
    const HostTensor grouped = *x;  // [2, 2, 45, 32]
    *x = HostTensor({2, 6, 45, 32});
    for (std::int64_t b = 0; b < 2; ++b) {
      for (std::int64_t h = 0; h < 6; ++h) {
        const HostTensor head = slice(grouped, b, 1, h / 3, 1);
        std::copy(head.values.begin(), head.values.end(),
                  x->values.begin() + (b * 6 + h) * 45 * 32);
      }
    }
  }
  EXPECT_EQ(output_bytes(in, gqa), output_bytes(repeated, mha));
}

TEST_F(AttentionCpuMisc, BroadcastKeysAndValues) {
  // One key/value head for all four query heads: as Hkv = 1, and as k and v [B, 4, T, D] viewed
  // through a head stride of 0 (inputs may share addresses; only the outputs may not).
  const AttentionCase mqa{2, 4, 1, 45, 32, kPerSeq, {2, 11}};
  const AttentionInputs in = make_attention_inputs(mqa, rng_);
  const AttentionTensors t = upload_attention(in, mqa, kCpu);
  AttentionTensors broadcast = upload_attention(in, mqa, kCpu);
  AttentionCase mha = mqa;
  mha.hkv = 4;
  for (DeviceTensor* x : {&broadcast.k, &broadcast.v}) {
    x->view.shape[1] = 4;
    x->view.strides[1] = 0;
  }
  run_attention(t, mqa);
  run_attention(broadcast, mha);
  EXPECT_EQ(raw_bytes(t.out), raw_bytes(broadcast.out));
  EXPECT_EQ(raw_bytes(t.lse), raw_bytes(broadcast.lse));
  expect_attention_close(download_attention(t, mqa), attention_float64(in, mqa), in.n_padd, mqa);
}

TEST_F(AttentionCpuMisc, LseIsOptionalAndTf32ChangesNothing) {
  const AttentionCase c{2, 4, 2, 90, 48, kPerSeq, {5, 60}, DType::BFloat16};
  const AttentionInputs in = make_attention_inputs(c, rng_);
  const std::vector<unsigned char> with_lse = output_bytes(in, c);
  const std::vector<unsigned char> without = output_bytes(in, c, false);
  EXPECT_TRUE(std::equal(without.begin(), without.end(), with_lse.begin()))
      << "out differs with and without lse";
  CausalAttentionOptions tf32;
  tf32.allow_tf32 = true;
  const AttentionCase f32 = with_dtype(c, DType::Float32);
  const AttentionInputs in32 = make_attention_inputs(f32, rng_);
  EXPECT_EQ(output_bytes(in32, f32), output_bytes(in32, f32, true, &tf32));
}

TEST_F(AttentionCpuMisc, BitwiseDeterministicAcrossThreadCounts) {
  const AttentionCase c{2, 4, 2, 300, 64, kPerSeq, {}, DType::Float16};
  const AttentionInputs in = make_attention_inputs(c, rng_);
  const std::vector<unsigned char> first = output_bytes(in, c);
  EXPECT_EQ(first, output_bytes(in, c));
#ifdef _OPENMP
  const int threads = omp_get_max_threads();
  for (int n : {1, 3}) {
    omp_set_num_threads(n);
    EXPECT_EQ(first, output_bytes(in, c)) << "with " << n << " threads";
  }
  omp_set_num_threads(threads);
#endif
}

TEST_F(AttentionCpuMisc, EmptyInputsWriteNothing) {
  // B = 0 or T = 0: nothing to compute; out and lse (allocations of poison, or views of none)
  // stay as they were.
  AttentionCase single{1, 1, 1, 0, 16};
  single.single_head = true;
  for (const AttentionCase& c : {AttentionCase{0, 4, 2, 9, 16, kPerSeq, {}},
                                 AttentionCase{2, 4, 2, 0, 16, kPerSeq, {0, 0}},
                                 AttentionCase{3, 2, 2, 0, 8}, single}) {
    SCOPED_TRACE(attention_case_name(c));
    const AttentionInputs in = make_attention_inputs(c, rng_);
    const AttentionTensors t = upload_attention(
        in, c, kCpu, {.out = {{}, 0, 2}, .lse = {{}, 0, 1}});
    EXPECT_NO_THROW(run_attention(t, c));
    expect_only_view_written(t.out, "out");
    expect_only_view_written(t.lse, "lse");
  }
}

// ------------------------------------------------------------------------------------ errors

class AttentionErrors : public Seeded<> {
 protected:
  AttentionCase c_{2, 4, 2, 5, 8, kPerSeq, {1, 2}, DType::Float16};
  AttentionInputs in_ = make_attention_inputs(c_, rng_);
  AttentionTensors t_ = upload_attention(in_, c_, kCpu);

  void call(const TensorView& out, const TensorView& lse, const TensorView& q,
            const TensorView& k, const TensorView& v, const LeftPadding& padding,
            CausalAttentionOptions options = {}) {
    fusekit::causal_attention(out, lse, q, k, v, padding, options);
  }
  // The valid call with one argument replaced.
  void with_q(const TensorView& q) {
    call(t_.out.view, t_.lse.view, q, t_.k.view, t_.v.view, t_.padding());
  }
  void with_k(const TensorView& k) {
    call(t_.out.view, t_.lse.view, t_.q.view, k, t_.v.view, t_.padding());
  }
  void with_v(const TensorView& v) {
    call(t_.out.view, t_.lse.view, t_.q.view, t_.k.view, v, t_.padding());
  }
  void with_out(const TensorView& out) {
    call(out, t_.lse.view, t_.q.view, t_.k.view, t_.v.view, t_.padding());
  }
  void with_lse(const TensorView& lse) {
    call(t_.out.view, lse, t_.q.view, t_.k.view, t_.v.view, t_.padding());
  }
  void with_padding(const LeftPadding& padding) {
    call(t_.out.view, t_.lse.view, t_.q.view, t_.k.view, t_.v.view, padding);
  }
  void with_options(const CausalAttentionOptions& options) {
    call(t_.out.view, t_.lse.view, t_.q.view, t_.k.view, t_.v.view, t_.padding(), options);
  }
  DeviceTensor tensor(std::vector<std::int64_t> shape, DType dtype = DType::Float16,
                      Layout layout = {}) {
    return empty_poisoned(shape, dtype, kCpu, layout);
  }
};

TEST_F(AttentionErrors, TheValidCallsRun) {
  EXPECT_NO_THROW(with_padding(t_.padding()));
  EXPECT_NO_THROW(with_padding(LeftPadding{5}));
  EXPECT_NO_THROW(with_lse({}));
}

TEST_F(AttentionErrors, Shapes) {
  const DeviceTensor q3 = tensor({2, 4, 5});
  EXPECT_ERROR_CONTAINS("causal_attention: q has 3 dims [2, 4, 5], expected 4 dims [B, Hq, T, D] "
                        "or 2 dims [T, D]",
                        [&] { with_q(q3.view); });
  const DeviceTensor td = tensor({5, 8});
  EXPECT_ERROR_CONTAINS("causal_attention: k has 2 dims [5, 8] but q has 4 dims [2, 4, 5, 8]; "
                        "expected k [B, Hkv, T, D]",
                        [&] { with_k(td.view); });
  EXPECT_ERROR_CONTAINS("v has 2 dims [5, 8] but q has 4 dims", [&] { with_v(td.view); });
  EXPECT_ERROR_CONTAINS("out has 2 dims [5, 8] but q has 4 dims [2, 4, 5, 8]; expected out "
                        "[B, Hq, T, D]",
                        [&] { with_out(td.view); });
  const DeviceTensor q_h0 = tensor({2, 0, 5, 8});
  EXPECT_ERROR_CONTAINS("q [2, 0, 5, 8] has Hq = 0 heads, expected Hq >= 1",
                        [&] { with_q(q_h0.view); });
  const DeviceTensor q_d0 = tensor({2, 4, 5, 0}), q_d257 = tensor({2, 4, 5, 257});
  EXPECT_ERROR_CONTAINS("q [2, 4, 5, 0] has D = 0, expected 1 <= D <= 256",
                        [&] { with_q(q_d0.view); });
  EXPECT_ERROR_CONTAINS("q [2, 4, 5, 257] has D = 257, expected 1 <= D <= 256",
                        [&] { with_q(q_d257.view); });
  const DeviceTensor kv3 = tensor({2, 3, 5, 8}), kv0 = tensor({2, 0, 5, 8});
  EXPECT_ERROR_CONTAINS("k [2, 3, 5, 8] has Hkv = 3 heads, expected Hkv >= 1 dividing q's Hq = 4 "
                        "(grouped-query attention)",
                        [&] { call(t_.out.view, t_.lse.view, t_.q.view, kv3.view, kv3.view,
                                   t_.padding()); });
  EXPECT_ERROR_CONTAINS("k [2, 0, 5, 8] has Hkv = 0 heads",
                        [&] { call(t_.out.view, t_.lse.view, t_.q.view, kv0.view, kv0.view,
                                   t_.padding()); });
  const DeviceTensor k_t = tensor({2, 2, 6, 8}), k_b = tensor({3, 2, 5, 8}),
                     v_h = tensor({2, 1, 5, 8}), v_d = tensor({2, 2, 5, 4});
  EXPECT_ERROR_CONTAINS("k has shape [2, 2, 6, 8], expected [B, Hkv, T, D] = [2, 2, 5, 8]",
                        [&] { with_k(k_t.view); });
  EXPECT_ERROR_CONTAINS("k has shape [3, 2, 5, 8], expected [B, Hkv, T, D] = [2, 2, 5, 8]",
                        [&] { with_k(k_b.view); });
  EXPECT_ERROR_CONTAINS("v has shape [2, 1, 5, 8], expected [B, Hkv, T, D] = [2, 2, 5, 8]",
                        [&] { with_v(v_h.view); });
  EXPECT_ERROR_CONTAINS("v has shape [2, 2, 5, 4], expected [B, Hkv, T, D] = [2, 2, 5, 8]",
                        [&] { with_v(v_d.view); });
  const DeviceTensor out_bad = tensor({2, 4, 5, 9});
  EXPECT_ERROR_CONTAINS("out has shape [2, 4, 5, 9], expected [B, Hq, T, D] = [2, 4, 5, 8]",
                        [&] { with_out(out_bad.view); });
  const DeviceTensor lse_2d = tensor({2, 4}, DType::Float32);
  const DeviceTensor lse_t = tensor({2, 4, 6}, DType::Float32);
  EXPECT_ERROR_CONTAINS("lse has shape [2, 4], expected [B, Hq, T] = [2, 4, 5]",
                        [&] { with_lse(lse_2d.view); });
  EXPECT_ERROR_CONTAINS("lse has shape [2, 4, 6], expected [B, Hq, T] = [2, 4, 5]",
                        [&] { with_lse(lse_t.view); });

  // the single-head form
  const DeviceTensor q = tensor({5, 8}), k_bad = tensor({5, 7}), out = tensor({5, 8}),
                     lse_bad = tensor({1, 5}, DType::Float32), kv4 = tensor({1, 1, 5, 8});
  EXPECT_ERROR_CONTAINS("k has shape [5, 7], expected [T, D] = [5, 8]",
                        [&] { call(out.view, {}, q.view, k_bad.view, td.view, {}); });
  EXPECT_ERROR_CONTAINS("k has 4 dims [1, 1, 5, 8] but q has 2 dims [5, 8]; expected k [T, D]",
                        [&] { call(out.view, {}, q.view, kv4.view, td.view, {}); });
  EXPECT_ERROR_CONTAINS("lse has shape [1, 5], expected [T] = [5]",
                        [&] { call(out.view, lse_bad.view, q.view, td.view, td.view, {}); });
}

TEST_F(AttentionErrors, Dtypes) {
  const DeviceTensor q64 = tensor({2, 4, 5, 8}, DType::Float64);
  const DeviceTensor out64 = tensor({2, 4, 5, 8}, DType::Float64);
  EXPECT_ERROR_CONTAINS("causal_attention: q has dtype float64, expected bfloat16, float16 or "
                        "float32",
                        [&] { call(out64.view, t_.lse.view, q64.view, t_.k.view, t_.v.view,
                                   t_.padding()); });
  const DeviceTensor k32 = tensor({2, 2, 5, 8}, DType::Float32);
  const DeviceTensor vbf = tensor({2, 2, 5, 8}, DType::BFloat16);
  const DeviceTensor out32 = tensor({2, 4, 5, 8}, DType::Float32);
  EXPECT_ERROR_CONTAINS("k has dtype float32 but q has float16; expected the same dtype",
                        [&] { with_k(k32.view); });
  EXPECT_ERROR_CONTAINS("v has dtype bfloat16 but q has float16; expected the same dtype",
                        [&] { with_v(vbf.view); });
  EXPECT_ERROR_CONTAINS("out has dtype float32 but q has float16; expected the same dtype",
                        [&] { with_out(out32.view); });
  const DeviceTensor lse16 = tensor({2, 4, 5}, DType::Float16);
  EXPECT_ERROR_CONTAINS("lse has dtype float16, expected float32", [&] { with_lse(lse16.view); });
  const DeviceTensor counts64 = tensor({2}, DType::Int64);
  EXPECT_ERROR_CONTAINS("padding.per_sequence has dtype int64, expected int32",
                        [&] { with_padding(LeftPadding{0, counts64.view}); });
}

TEST_F(AttentionErrors, Devices) {
  auto on_cuda = [](TensorView t) {
    t.device = Device::cuda(0);
    return t;
  };
  EXPECT_ERROR_CONTAINS("k is on cuda:0 but q is on cpu; expected one device",
                        [&] { with_k(on_cuda(t_.k.view)); });
  EXPECT_ERROR_CONTAINS("v is on cuda:0 but q is on cpu; expected one device",
                        [&] { with_v(on_cuda(t_.v.view)); });
  EXPECT_ERROR_CONTAINS("out is on cuda:0 but q is on cpu; expected one device",
                        [&] { with_out(on_cuda(t_.out.view)); });
  EXPECT_ERROR_CONTAINS("lse is on cuda:0 but q is on cpu; expected one device",
                        [&] { with_lse(on_cuda(t_.lse.view)); });
  EXPECT_ERROR_CONTAINS("padding.per_sequence is on cuda:0 but q is on cpu; expected one device",
                        [&] { with_padding(LeftPadding{0, on_cuda(t_.counts.view)}); });
}

TEST_F(AttentionErrors, NullData) {
  auto null = [](TensorView t) {
    t.data = nullptr;
    return t;
  };
  EXPECT_ERROR_CONTAINS("q (float16 [2, 4, 5, 8] on cpu) has a null data pointer",
                        [&] { with_q(null(t_.q.view)); });
  EXPECT_ERROR_CONTAINS("k (float16 [2, 2, 5, 8] on cpu) has a null data pointer",
                        [&] { with_k(null(t_.k.view)); });
  EXPECT_ERROR_CONTAINS("v (float16 [2, 2, 5, 8] on cpu) has a null data pointer",
                        [&] { with_v(null(t_.v.view)); });
  EXPECT_ERROR_CONTAINS("out (float16 [2, 4, 5, 8] on cpu) has a null data pointer",
                        [&] { with_out(null(t_.out.view)); });
  EXPECT_ERROR_CONTAINS("lse (float32 [2, 4, 5] on cpu) has a null data pointer",
                        [&] { with_lse(null(t_.lse.view)); });
  EXPECT_ERROR_CONTAINS("padding.per_sequence (int32 [2] on cpu) has a null data pointer",
                        [&] { with_padding(LeftPadding{0, null(t_.counts.view)}); });
}

TEST_F(AttentionErrors, Padding) {
  for (std::int64_t all : {-1, 6}) {
    const std::string expected = "causal_attention: padding.all is " + std::to_string(all) +
                                 ", expected a count in [0, T] = [0, 5]";
    EXPECT_ERROR_CONTAINS(expected.c_str(), [&] { with_padding(LeftPadding{all}); });
  }
  EXPECT_ERROR_CONTAINS("padding.all is 2 and padding.per_sequence is given; expected one of the "
                        "two (padding.all = 0 with per_sequence)",
                        [&] { with_padding(LeftPadding{2, t_.counts.view}); });
  const DeviceTensor counts3 = upload_padding_counts({0, 1, 2}, kCpu);
  EXPECT_ERROR_CONTAINS("padding.per_sequence has shape [3], expected [B] = [2]",
                        [&] { with_padding(LeftPadding{0, counts3.view}); });
  const DeviceTensor too_many = upload_padding_counts({0, 6}, kCpu);
  const DeviceTensor negative = upload_padding_counts({-1, 0}, kCpu);
  EXPECT_ERROR_CONTAINS("padding.per_sequence[1] is 6, expected a count in [0, T] = [0, 5]",
                        [&] { with_padding(LeftPadding{0, too_many.view}); });
  EXPECT_ERROR_CONTAINS("padding.per_sequence[0] is -1, expected a count in [0, T] = [0, 5]",
                        [&] { with_padding(LeftPadding{0, negative.view}); });
  // the single-head form is a batch of one
  const DeviceTensor q = tensor({5, 8}), k = tensor({5, 8}), out = tensor({5, 8});
  EXPECT_ERROR_CONTAINS("padding.per_sequence has shape [2], expected [B] = [1]", [&] {
    call(out.view, {}, q.view, k.view, k.view, LeftPadding{0, t_.counts.view});
  });
}

TEST_F(AttentionErrors, Options) {
  for (double scale : {0.0, -1.0, std::nan(""), std::numeric_limits<double>::infinity(), 1e-60,
                       1e300}) {
    CausalAttentionOptions options;
    options.scale = scale;
    EXPECT_ERROR_CONTAINS("causal_attention: options.scale is ", [&] { with_options(options); });
    EXPECT_ERROR_CONTAINS(", expected a finite value > 0", [&] { with_options(options); });
  }
}

TEST_F(AttentionErrors, Layouts) {
  // D not the innermost axis
  const Layout d_outer{{3, 0, 1, 2}, 0, 0};
  const DeviceTensor q_bad = tensor({2, 4, 5, 8}, DType::Float16, d_outer);
  EXPECT_ERROR_CONTAINS("causal_attention: q [2, 4, 5, 8] has strides (20, 5, 1, 40); expected a "
                        "unit stride on D (the last dim)",
                        [&] { with_q(q_bad.view); });
  const DeviceTensor kv_bad = tensor({2, 2, 5, 8}, DType::Float16, d_outer);
  EXPECT_ERROR_CONTAINS("k [2, 2, 5, 8] has strides (10, 5, 1, 20); expected a unit stride on D",
                        [&] { with_k(kv_bad.view); });
  EXPECT_ERROR_CONTAINS("v [2, 2, 5, 8] has strides (10, 5, 1, 20); expected a unit stride on D",
                        [&] { with_v(kv_bad.view); });
  const DeviceTensor out_bad = tensor({2, 4, 5, 8}, DType::Float16, d_outer);
  EXPECT_ERROR_CONTAINS("out [2, 4, 5, 8] has strides (20, 5, 1, 40); expected a unit stride on D",
                        [&] { with_out(out_bad.view); });
  TensorView q_reversed = t_.q.view;  // a stride of -1 on D is not a unit stride
  q_reversed.data = static_cast<char*>(q_reversed.data) + 7 * 2;
  q_reversed.strides[3] = -1;
  EXPECT_ERROR_CONTAINS("expected a unit stride on D", [&] { with_q(q_reversed); });
  // outputs whose elements share addresses
  TensorView out_bcast = t_.out.view;
  out_bcast.strides[1] = 0;
  EXPECT_ERROR_CONTAINS("output out has stride 0 in dim 1", [&] { with_out(out_bcast); });
  TensorView lse_bcast = t_.lse.view;
  lse_bcast.strides[2] = 0;
  EXPECT_ERROR_CONTAINS("output lse has stride 0 in dim 2", [&] { with_lse(lse_bcast); });
  TensorView lse_shared = t_.lse.view;  // heads 1 and 2 of sequence 0 on one row
  lse_shared.strides[1] = 2;
  EXPECT_ERROR_CONTAINS("output lse [2, 4, 5] has strides that make elements share addresses",
                        [&] { with_lse(lse_shared); });
}

TEST_F(AttentionErrors, Overlap) {
  EXPECT_ERROR_CONTAINS("causal_attention: out overlaps q in memory", [&] { with_out(t_.q.view); });
  // out [2, 4, 5, 8] (320 float16 elements) at the start of a buffer, k [2, 2, 5, 8] (160) and
  // v on its second half and beyond
  const DeviceTensor big = tensor({4, 4, 5, 8});
  TensorView out_in_big = t_.out.view, k_in_big = t_.k.view, v_in_big = t_.v.view;
  out_in_big.data = big.view.data;
  k_in_big.data = static_cast<char*>(big.view.data) + 160 * 2;
  v_in_big.data = static_cast<char*>(big.view.data) + 300 * 2;
  EXPECT_ERROR_CONTAINS("out overlaps k in memory", [&] {
    call(out_in_big, t_.lse.view, t_.q.view, k_in_big, t_.v.view, t_.padding());
  });
  EXPECT_ERROR_CONTAINS("out overlaps v in memory", [&] {
    call(out_in_big, t_.lse.view, t_.q.view, t_.k.view, v_in_big, t_.padding());
  });
  // lse [2, 4, 5] float32 inside q, k or v, and out and lse on one buffer
  const TensorView lse_in_q(t_.q.view.data, DType::Float32, {2, 4, 5});
  EXPECT_ERROR_CONTAINS("lse overlaps q in memory", [&] { with_lse(lse_in_q); });
  const TensorView lse_in_k(t_.k.view.data, DType::Float32, {2, 4, 5});
  EXPECT_ERROR_CONTAINS("lse overlaps k in memory", [&] { with_lse(lse_in_k); });
  const TensorView lse_in_v(t_.v.view.data, DType::Float32, {2, 4, 5});
  EXPECT_ERROR_CONTAINS("lse overlaps v in memory", [&] { with_lse(lse_in_v); });
  const TensorView lse_in_out(t_.out.view.data, DType::Float32, {2, 4, 5});
  EXPECT_ERROR_CONTAINS("out overlaps lse in memory", [&] { with_lse(lse_in_out); });
  // the counts (valid ones) in out's or lse's memory
  const std::int32_t valid[2] = {1, 2};
  std::memcpy(t_.out.view.data, valid, sizeof(valid));
  const TensorView counts_in_out(t_.out.view.data, DType::Int32, {2});
  EXPECT_ERROR_CONTAINS("out overlaps padding.per_sequence in memory",
                        [&] { with_padding(LeftPadding{0, counts_in_out}); });
  std::memcpy(t_.lse.view.data, valid, sizeof(valid));
  const TensorView counts_in_lse(t_.lse.view.data, DType::Int32, {2});
  EXPECT_ERROR_CONTAINS("lse overlaps padding.per_sequence in memory",
                        [&] { with_padding(LeftPadding{0, counts_in_lse}); });
}

}  // namespace
