"""fusekit.causal_attention against a float64 PyTorch evaluation of the formula
(reference.causal_attention: F.scaled_dot_product_attention with the boolean mask).

Cases: T in {1, 17, 1000} (and 4096 on CUDA) with n_padd = 0, T/3, T - 1 and T, normal and peaked
scores; float32 within 1e-5, float16 and bfloat16 within twice the error of PyTorch's own SDPA in
that dtype, float32 with allow_tf32 on CUDA within twice the error of the formula with TF32 operands
(on the CPU, which has no TF32, bitwise the float32 result); per-sequence padding that differs
across the batch (int32 tensors, on the CPU and the inputs' device); grouped-query heads; the
single-head form [T, D]; the scale; views over memory poisoned with NaN (misaligned, padded rows,
[B, T, H, D] storage, packed q/k/v, broadcast k/v), NaN in padding queries, keys and values,
NaN-poisoned outputs and exact zeros in padding rows; rows that one key carries, reached past a
lagging running max (within 0.55 ulp); lse; empty inputs; bitwise determinism; numpy inputs
(negative strides included); autograd (forward only); torch.library.opcheck; torch.compile; CUDA
streams and graphs; every error message.

The CUDA parametrisations skip with "no CUDA backend yet" while fusekit's CUDA backend of this
operator only raises its "not implemented yet" error, and run for real once it lands.
"""

import math

import numpy as np
import pytest
import torch

import fusekit
import reference
from compare import (Tol, assert_bitwise_equal, assert_close, dtype_name, max_abs_error,
                     to_torch64)
from conftest import cuda_backend_mark, requires_cuda

OP = torch.ops.fusekit.causal_attention.default


def _tiny_call():
    q = torch.zeros(1, 8, device="cuda")
    fusekit.causal_attention(q, q, q)


requires_cuda_backend = cuda_backend_mark("causal_attention", _tiny_call)
DEVICES = ["cpu", pytest.param("cuda", marks=[requires_cuda, requires_cuda_backend])]
# Validation and empty inputs return before a backend is chosen: those cases run on CUDA already.
VALIDATION_DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
HALF_DTYPES = [torch.float16, torch.bfloat16]

# float32 results: |got - expected| <= atol * scale + rtol * |expected|, where scale is the sum of
# |terms| behind each element (reference.causal_attention_abs): sum_j p_ij |v_j| for out, and
# 1 + sum_j p_ij |scale| |q_i| . |k_j| for lse, what rounding the products and sums scales with.
# The same bound holds for lse of half-precision inputs, whose products are exact in float32.
FLOAT32_TOL = Tol(rtol=1e-5, atol=1e-5)
# CUDA multiplies float32 as three TF32 products (the dropped part about 2^-22 of each product,
# against float32's 2^-24): element by element twice the bound, and the issue's 1e-5 relative
# error in norm checked on top.
CUDA_FLOAT32_TOL = Tol(rtol=2e-5, atol=2e-5)
FLOAT32_NORM_BOUND = 1e-5
# A score s computed in float32 is off by about |s| times the rounding, and a weight exp(s - m)
# by that much relatively: past scaled scores of SHARP_SCORE the float32 bounds grow with them.
SHARP_SCORE = 10.0

# n_padd of a case, by name, for a sequence length T.
PADS = {"0": lambda t: 0, "T/3": lambda t: t // 3, "T-1": lambda t: t - 1, "T": lambda t: t}

# Scores ~ N(0, 1) ("normal") or N(0, 16) ("peaked": few keys carry each row, and the running
# maximum of an online softmax moves often).
Q_SCALE = {"normal": 1.0, "peaked": 4.0}


# ------------------------------------------------------------------------------ helpers


def make_qkv(rng, b, h, t, d, *, hkv=None, dtype=torch.float32, device="cpu", dist="normal"):
    """q [B, H, T, D] and k, v [B, Hkv, T, D] (Hkv = H unless given) ~ N(0, 1), q scaled by
    Q_SCALE[dist], rounded to dtype."""
    hkv = h if hkv is None else hkv
    q = (Q_SCALE[dist] * rng.randn(b, h, t, d)).to(dtype=dtype, device=device)
    k = rng.randn(b, hkv, t, d, dtype=dtype, device=device)
    v = rng.randn(b, hkv, t, d, dtype=dtype, device=device)
    return q, k, v


def as64(t):
    """t (torch or numpy) as float64 torch values on its own device; other values unchanged."""
    if isinstance(t, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(t))
    if isinstance(t, torch.Tensor) and t.is_floating_point():
        return t.detach().double()
    return t


def padding_of(n_padd):
    """n_padd as the reference takes it: an int, or a tensor [B] (from torch or numpy)."""
    if isinstance(n_padd, np.ndarray):
        return torch.from_numpy(n_padd)
    return n_padd


def describe_case(rng, **kw):
    return f"seed {rng.seed}, " + ", ".join(f"{k}={v}" for k, v in kw.items())


def padding_rows(n_padd, shape):
    """A bool mask of out's rows [B, H, T] (or [T]) that are padding: i < n_padd[b]."""
    t = shape[-2]
    pad = torch.as_tensor(padding_of(n_padd)).reshape(-1, 1, 1).cpu()
    rows = torch.arange(t)[None, None, :] < pad  # [B or 1, 1, T]
    return rows.expand(shape[:-1]) if len(shape) == 4 else rows[0, 0]


def score_magnitude(q64, k64, scale):
    """The largest |scale q . k| over the finite scores (padding rows may hold NaN)."""
    if q64.dim() == 4 and k64.shape[1] != q64.shape[1]:
        k64 = k64.repeat_interleave(q64.shape[1] // k64.shape[1], dim=1)
    scores = (q64 @ k64.transpose(-1, -2)).abs() * (scale or q64.shape[-1] ** -0.5)
    finite = scores[torch.isfinite(scores)]
    return float(finite.max()) if finite.numel() else 0.0


def check(out, q, k, v, n_padd, context, *, scale=None, lse=None, name="out"):
    """out (and lse, when given) against the float64 reference: float32 within FLOAT32_TOL,
    float16 and bfloat16 within twice the error of PyTorch's SDPA in that dtype. Padding rows of
    out must be exactly zero and their lse -inf."""
    __tracebackhide__ = True
    pad = padding_of(n_padd)
    q64, k64, v64 = as64(q), as64(k), as64(v)
    expected = reference.causal_attention(q64, k64, v64, pad, scale)
    out_scale, lse_scale = reference.causal_attention_abs(q64, k64, v64, pad, scale)
    dtype = dtype_name(q)
    float32_tol = CUDA_FLOAT32_TOL if getattr(out, "is_cuda", False) else FLOAT32_TOL
    sharpness = max(1.0, score_magnitude(q64, k64, scale) / SHARP_SCORE)
    float32_tol = Tol(rtol=float32_tol.rtol * sharpness, atol=float32_tol.atol * sharpness)
    if dtype == "float32":
        assert_close(out, expected, tol=float32_tol, scale=out_scale, dtype=dtype, name=name,
                     context=context)
        got64, expected64 = to_torch64(out), to_torch64(expected)
        norm = float((got64 - expected64).norm() / expected64.norm().clamp_min(1e-300))
        assert norm <= FLOAT32_NORM_BOUND * sharpness, (
            f"{name}: relative error {norm:.3g} in norm, expected at most "
            f"{FLOAT32_NORM_BOUND * sharpness:.3g} [{context}]")
    else:
        assert dtype_name(out) == dtype, f"{name}: dtype {dtype_name(out)}, expected {dtype}"
        check_error_budget(out, expected, reference.causal_attention(q, k, v, pad, scale),
                           context, name=name)
    rows = padding_rows(pad, tuple(out.shape))
    padded = to_torch64(out)[rows]
    assert bool((padded == 0).all()), (
        f"{name}: {int((padded != 0).sum())} elements of padding rows are not 0 (NaN included) "
        f"[{context}]")
    if lse is not None:
        expected_lse = reference.causal_attention_lse(q64, k64, pad, scale)
        assert_close(lse, expected_lse, tol=float32_tol, scale=lse_scale, dtype=torch.float32,
                     name="lse", context=context)


def check_error_budget(out, expected, torch_same, context, *, name="out"):
    """The accuracy criterion for half precision: the largest error against float64 at most
    twice that of PyTorch's SDPA in the same dtype on the same device (plus 16 float32 ulps of
    the largest value, so that an exact PyTorch result does not demand exactness)."""
    __tracebackhide__ = True
    floor = 2**-20 * to_torch64(expected).abs().max().item() if expected.numel() else 0.0
    err, base = max_abs_error(out, expected), max_abs_error(torch_same, expected)
    assert err <= 2 * base + floor, (
        f"{name}: max |error| {err:.3g} exceeds twice PyTorch's SDPA {base:.3g} (+ {floor:.2g}) "
        f"[{context}]")


def nan_buffer(shape, like):
    return torch.full(shape, math.nan, dtype=like.dtype, device=like.device)


def relayout(t, layout):
    """(view, values): a view of t's values (or, for "broadcast", of t's first sequence repeated)
    in `layout` over a buffer that is NaN everywhere else; a kernel reading what it must not
    leaks NaN into the result."""
    b, h, n, d = t.shape
    if layout == "offset1":  # base pointer one element past an aligned allocation
        view = nan_buffer((t.numel() + 1,), t)[1:].view(t.shape)
    elif layout == "padded":  # rows of D padded by 8 elements
        view = nan_buffer((b, h, n, d + 8), t)[..., :d]
    elif layout == "shifted":  # padded, every row starting one element in
        view = nan_buffer((b, h, n, d + 3), t)[..., 1 : d + 1]
    elif layout == "bthd":  # stored [B, T, H, D], as a projection writes it
        view = nan_buffer((b, n, h, d), t).transpose(1, 2)
    elif layout == "broadcast":  # one sequence shared by the batch: stride 0 on B
        first = nan_buffer((1, h, n, d), t).copy_(t[:1])
        return first.expand(t.shape), t[:1].expand(t.shape)
    else:
        raise ValueError(layout)
    view.copy_(t)
    return view, t


def packed(q, k, v):
    """Views of q, k and v into one NaN-padded buffer [B, T, H + 2 Hkv, D + 4], as a fused QKV
    projection writes them: heads and time swapped, rows of D padded."""
    b, h, t, d = q.shape
    hkv = k.shape[1]
    buf = nan_buffer((b, t, h + 2 * hkv, d + 4), q)
    views = (buf[:, :, :h, :d], buf[:, :, h : h + hkv, :d], buf[:, :, h + hkv :, :d])
    views = tuple(view.transpose(1, 2) for view in views)
    for view, src in zip(views, (q, k, v)):
        view.copy_(src)
    return views


def poison_padding(t, n_padd):
    """A copy of t [B, H, T, D] with NaN in the rows i < n_padd[b] (never read)."""
    t = t.clone()
    t[padding_rows(n_padd, tuple(t.shape)).to(t.device)] = math.nan
    return t


def tf32(t):
    """float32 values rounded to TF32 as tensor cores take them (10 mantissa bits, to nearest,
    ties away from zero: cvt.rna)."""
    bits = t.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & -0x2000).view(torch.float32)


def attention_tf32(q, k, v, n_padd):
    """(out, lse) of the formula with TF32 operands, in float64 otherwise: q and k rounded to TF32
    for the scores, the weights p and v rounded to TF32 for p @ v, the row sums of unrounded p.
    The yardstick of allow_tf32: PyTorch's own float32 matmuls under allow_tf32 leave the choice
    of tensor cores to cuBLAS's heuristics, which may compute small products in full float32."""
    t = q.shape[-2]
    q, k, v = (tf32(x).double() for x in (q, k, v))
    squeeze = q.dim() == 2
    if squeeze:
        q, k, v = q[None, None], k[None, None], v[None, None]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    keep = reference.causal_attention_mask(t, n_padd, q.device)  # [B or 1, 1, T, T]
    valid = keep.any(-1, keepdim=True)  # [B or 1, 1, T, 1]
    q, k, v = (x.masked_fill(~valid, 0) for x in (q, k, v))
    scores = (q @ k.mT * q.shape[-1] ** -0.5).masked_fill(~keep, -torch.inf)
    m = torch.where(valid, scores.amax(-1, keepdim=True), 0)
    p = torch.exp(scores - m)  # [B, H, T, T], 0 off the mask
    total = torch.where(valid, p.sum(-1, keepdim=True), 1)
    out = torch.where(valid, (tf32(p).double() @ v) / total, 0)
    lse = torch.where(valid, m + torch.log(total), -torch.inf)[..., 0]
    return (out[0, 0], lse[0, 0]) if squeeze else (out, lse)


# ------------------------------------------------------------------------------ forward


@pytest.mark.parametrize("dist", list(Q_SCALE))
@pytest.mark.parametrize("pad", list(PADS))
@pytest.mark.parametrize("t", [1, 17, 1000])
@pytest.mark.parametrize("device", DEVICES)
def test_forward(rng, device, t, pad, dist):
    q, k, v = make_qkv(rng, 2, 2, t, 64, device=device, dist=dist)
    n_padd = PADS[pad](t)
    out = fusekit.causal_attention(q, k, v, n_padd)
    assert isinstance(out, torch.Tensor) and out.device == q.device
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    check(out, q, k, v, n_padd, describe_case(rng, device=device, T=t, n_padd=n_padd, dist=dist))


@pytest.mark.parametrize("pad", ["0", "T/3", "T-1"])
@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES], ids=str)
@requires_cuda
@requires_cuda_backend
def test_forward_cuda_long(rng, dtype, pad):
    """T = 4096, grouped-query heads, peaked scores."""
    q, k, v = make_qkv(rng, 1, 4, 4096, 64, hkv=2, dtype=dtype, device="cuda", dist="peaked")
    n_padd = PADS[pad](4096)
    out, lse = fusekit.causal_attention(q, k, v, n_padd, return_lse=True)
    check(out, q, k, v, n_padd, describe_case(rng, T=4096, n_padd=n_padd), lse=lse)


@pytest.mark.parametrize("pad", ["0", "T/3"])
@pytest.mark.parametrize("t", [17, 1000])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_forward_half_precision(rng, device, dtype, t, pad):
    """float16 and bfloat16: at most twice the error of PyTorch's SDPA in the same dtype."""
    q, k, v = make_qkv(rng, 2, 2, t, 64, dtype=dtype, device=device)
    n_padd = PADS[pad](t)
    out = fusekit.causal_attention(q, k, v, n_padd)
    assert out.dtype == dtype and out.shape == q.shape
    check(out, q, k, v, n_padd, describe_case(rng, device=device, T=t, n_padd=n_padd))


def carried_key_score(dtype):
    """A key component k0 in `dtype` (scores q . k / 8 with q = e_0) whose weight against a score
    of 0, p = 2^(k0 log2(e) / 8) in (2^6, 2^8), sits about 0.4 of a step between two neighbours
    of `dtype`: rounded to `dtype` it moves by about 0.4 of a step, far from a tie."""
    best = None
    for k0 in torch.linspace(33.5, 44.0, 4001).to(dtype).unique().double().tolist():
        p = 2.0 ** (k0 * math.log2(math.e) / 8)
        step = 2.0 ** (math.floor(math.log2(p)) - (7 if dtype == torch.bfloat16 else 10))
        off = abs((p / step) % 1.0 - 0.4)
        if best is None or off < best[0]:
            best = (off, k0)
    return best[1]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_forward_weight_past_the_running_max(rng, device, dtype, d):
    """Rows that one key carries, reached after key tiles whose max was 0: keys 0, 64 and 128
    score 0 (values 0), key 192 scores about 7 in log2 units (values ~ N(0, 1)), every other key
    about -60. A kernel that lets its running max lag (taking that weight, about 2^7, rounded to
    half precision for P V) must still weigh the values in P's own proportions: out within 0.55
    of an ulp of the float64 result on rows 192 and on, where a sum over the unrounded weights
    is off by about 0.4 of an ulp before out is rounded."""
    t = 256
    q = torch.zeros(1, 2, t, d, dtype=torch.float64)
    q[..., 0] = 1.0
    k = torch.zeros(1, 2, t, d, dtype=torch.float64)
    k[..., 0] = -60.0 * 8 / math.log2(math.e)
    k[:, :, [0, 64, 128], 0] = 0.0
    k[:, :, 192, 0] = carried_key_score(dtype)
    v = rng.randn(1, 2, t, d).double()
    v[:, :, [0, 64, 128]] = 0.0
    q, k, v = (x.to(dtype=dtype, device=device) for x in (q, k, v))
    out = fusekit.causal_attention(q, k, v)
    expected = to_torch64(reference.causal_attention(as64(q), as64(k), as64(v)))[..., 192:, :]
    mant = 7 if dtype == torch.bfloat16 else 10
    ulp = torch.exp2(torch.floor(torch.log2(expected.abs().clamp_min(2.0**-14))) - mant)
    ulps = float(((to_torch64(out)[..., 192:, :] - expected).abs() / ulp).max())
    assert ulps <= 0.55, (
        f"out: {ulps:.3f} ulps from the float64 result, expected at most 0.55 "
        f"[{describe_case(rng, device=device, D=d)}]")


@pytest.mark.parametrize("t", [17, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_forward_per_sequence_padding(rng, device, dtype, t):
    """One count per sequence, differing across the batch: none, one, a third, T - 1, all."""
    q, k, v = make_qkv(rng, 5, 2, t, 32, dtype=dtype, device=device)
    n_padd = torch.tensor([0, 1, t // 3, t - 1, t], dtype=torch.int32, device=device)
    out = fusekit.causal_attention(q, k, v, n_padd)
    check(out, q, k, v, n_padd.cpu(), describe_case(rng, device=device, T=t,
                                                    n_padd=n_padd.tolist()))


@pytest.mark.parametrize("device", DEVICES)
def test_forward_per_sequence_equals_all(rng, device):
    """Per-sequence counts that are all equal give bitwise the result of the one count."""
    q, k, v = make_qkv(rng, 3, 2, 40, 32, device=device)
    counts = torch.full((3,), 7, dtype=torch.int32, device=device)
    assert_bitwise_equal(fusekit.causal_attention(q, k, v, counts),
                         fusekit.causal_attention(q, k, v, 7), name="out",
                         context=describe_case(rng, device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hkv", [1, 2, 3, 6])
@pytest.mark.parametrize("device", DEVICES)
def test_forward_grouped_query_heads(rng, device, hkv, dtype):
    """H = 6 query heads over Hkv key/value heads: head h reads key/value head h // (6 / Hkv)."""
    q, k, v = make_qkv(rng, 2, 6, 33, 64, hkv=hkv, dtype=dtype, device=device)
    out = fusekit.causal_attention(q, k, v, 5)
    assert out.shape == q.shape
    check(out, q, k, v, 5, describe_case(rng, device=device, Hkv=hkv))


@pytest.mark.parametrize("d", [1, 3, 8, 40, 64, 80, 128, 200, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_forward_head_dims(rng, device, dtype, d):
    q, k, v = make_qkv(rng, 1, 2, 70, d, dtype=dtype, device=device)
    check(fusekit.causal_attention(q, k, v, 3), q, k, v, 3,
          describe_case(rng, device=device, D=d))


@pytest.mark.parametrize("dist", list(Q_SCALE))
@pytest.mark.parametrize("t", [17, 1000])
@pytest.mark.parametrize("device", DEVICES)
def test_forward_tf32(rng, device, t, dist):
    """allow_tf32: on CUDA out and lse within twice the error of the formula with TF32 operands
    (attention_tf32) on the same inputs; on the CPU, which has no TF32, bitwise the float32
    result."""
    q, k, v = make_qkv(rng, 2, 4, t, 64, hkv=2, device=device, dist=dist)
    n_padd = torch.tensor([0, t // 3], dtype=torch.int32, device=device)
    out, lse = fusekit.causal_attention(q, k, v, n_padd, return_lse=True, allow_tf32=True)
    context = describe_case(rng, device=device, T=t, dist=dist)
    if device == "cpu":
        exact, exact_lse = fusekit.causal_attention(q, k, v, n_padd, return_lse=True)
        assert_bitwise_equal(out, exact, name="out", context=context)
        assert_bitwise_equal(lse, exact_lse, name="lse", context=context)
        return
    pad = n_padd.cpu()
    q64, k64, v64 = as64(q), as64(k), as64(v)
    model_out, model_lse = attention_tf32(q, k, v, pad)
    check_error_budget(out, reference.causal_attention(q64, k64, v64, pad), model_out, context)
    rows = padding_rows(pad, tuple(out.shape))
    assert bool((to_torch64(out)[rows] == 0).all()), f"out: padding rows not 0 [{context}]"
    lse64 = to_torch64(lse)
    assert bool((lse64[rows] == -math.inf).all()), f"lse: padding rows not -inf [{context}]"
    expected_lse = to_torch64(reference.causal_attention_lse(q64, k64, pad))
    check_error_budget(lse64[~rows], expected_lse[~rows], to_torch64(model_lse)[~rows], context,
                       name="lse")


@pytest.mark.parametrize("pad", list(PADS))
@pytest.mark.parametrize("device", DEVICES)
def test_forward_single_head(rng, device, pad):
    """q, k, v [T, D]: out [T, D] and lse [T]; per-sequence padding as an int32 [1]."""
    q, k, v = (t[0, 0] for t in make_qkv(rng, 1, 1, 50, 64, device=device))
    n_padd = PADS[pad](50)
    out, lse = fusekit.causal_attention(q, k, v, n_padd, return_lse=True)
    assert out.shape == (50, 64) and lse.shape == (50,)
    context = describe_case(rng, device=device, n_padd=n_padd)
    check(out, q, k, v, n_padd, context, lse=lse)
    counts = torch.tensor([n_padd], dtype=torch.int32, device=device)
    assert_bitwise_equal(fusekit.causal_attention(q, k, v, counts), out, name="out",
                         context=context)


@pytest.mark.parametrize("scale", [0.05, 0.3, 2.0])
@pytest.mark.parametrize("device", DEVICES)
def test_forward_scale(rng, device, scale):
    q, k, v = make_qkv(rng, 2, 2, 33, 64, device=device)
    out, lse = fusekit.causal_attention(q, k, v, 4, scale=scale, return_lse=True)
    check(out, q, k, v, 4, describe_case(rng, device=device, scale=scale), scale=scale, lse=lse)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_default_scale(rng, device):
    """scale=None is 1 / sqrt(D), bit for bit."""
    q, k, v = make_qkv(rng, 2, 2, 33, 40, device=device)
    assert_bitwise_equal(fusekit.causal_attention(q, k, v, 2),
                         fusekit.causal_attention(q, k, v, 2, scale=1 / math.sqrt(40)),
                         name="out", context=describe_case(rng, device=device))


@pytest.mark.parametrize("shape", [(0, 2, 5, 8), (2, 2, 0, 8), (0, 8)],
                         ids=lambda s: f"q{list(s)}")
@pytest.mark.parametrize("device", VALIDATION_DEVICES)
def test_forward_empty(device, shape):
    """No sequences or T = 0: empty results of the right shapes."""
    q = torch.empty(shape, device=device)
    out, lse = fusekit.causal_attention(q, q.clone(), q.clone(), 0, return_lse=True)
    assert out.shape == shape and lse.shape == shape[:-1] and lse.dtype == torch.float32


# ------------------------------------------------------------------------------ lse


@pytest.mark.parametrize("pad", ["0", "T/3", "T"])
@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_lse(rng, device, dtype, pad):
    """return_lse: (out, lse), lse float32 [B, H, T], -inf on padding rows."""
    q, k, v = make_qkv(rng, 2, 4, 65, 64, hkv=2, dtype=dtype, device=device, dist="peaked")
    n_padd = PADS[pad](65)
    result = fusekit.causal_attention(q, k, v, n_padd, return_lse=True)
    assert isinstance(result, tuple) and len(result) == 2
    out, lse = result
    assert lse.shape == (2, 4, 65) and lse.dtype == torch.float32 and lse.device == q.device
    check(out, q, k, v, n_padd, describe_case(rng, device=device, n_padd=n_padd), lse=lse)
    without = fusekit.causal_attention(q, k, v, n_padd)
    assert_bitwise_equal(out, without, name="out with lse vs without",
                         context=describe_case(rng, device=device))


# ------------------------------------------------------------------------------ layouts and poison


@pytest.mark.parametrize(
    "arg,layout",
    [(arg, lay) for arg in ("q", "k", "v") for lay in ("offset1", "padded", "shifted", "bthd")]
    + [("k", "broadcast"), ("v", "broadcast")],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_forward_input_layouts(rng, device, dtype, arg, layout):
    """Any strides with a unit stride on D, read in place (views over NaN-filled memory)."""
    inputs = dict(zip("qkv", make_qkv(rng, 2, 4, 33, 64, hkv=2, dtype=dtype, device=device)))
    views = dict(inputs)
    views[arg], inputs[arg] = relayout(inputs[arg], layout)
    n_padd = torch.tensor([3, 11], dtype=torch.int32, device=device)
    out = fusekit.causal_attention(views["q"], views["k"], views["v"], n_padd)
    check(out, inputs["q"], inputs["k"], inputs["v"], n_padd.cpu(),
          describe_case(rng, device=device, arg=arg, layout=layout))


@pytest.mark.parametrize("hkv", [4, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_forward_packed_qkv(rng, device, dtype, hkv):
    """q, k and v as strided views of one fused-projection buffer [B, T, H + 2 Hkv, D + 4]."""
    q, k, v = make_qkv(rng, 2, 4, 33, 64, hkv=hkv, dtype=dtype, device=device)
    out = fusekit.causal_attention(*packed(q, k, v), 6)
    check(out, q, k, v, 6, describe_case(rng, device=device, Hkv=hkv))


@pytest.mark.parametrize("t", [17, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_nan_in_padding_does_not_leak(rng, device, dtype, t):
    """NaN in the padding rows of q, k and v, and in out before the call: out and lse are finite
    (zero and -inf on padding rows) and match the reference."""
    q, k, v = make_qkv(rng, 4, 2, t, 64, dtype=dtype, device=device)
    n_padd = torch.tensor([0, 1, t // 2, t], dtype=torch.int32, device=device)
    q, k, v = (poison_padding(x, n_padd.cpu()) for x in (q, k, v))
    out = torch.full_like(q, math.nan)
    got, lse = fusekit.causal_attention(q, k, v, n_padd, out=out, return_lse=True)
    assert got is out
    check(out, q, k, v, n_padd.cpu(), describe_case(rng, device=device, T=t), lse=lse)
    assert not bool(torch.isnan(out).any()) and not bool(torch.isnan(lse).any())


@pytest.mark.parametrize("layout", ["contiguous", "offset1", "padded", "bthd"])
@pytest.mark.parametrize("device", DEVICES)
def test_forward_out_poisoned(rng, device, layout):
    """out= over a NaN-filled buffer: every element written, nothing around it."""
    q, k, v = make_qkv(rng, 2, 2, 33, 64, device=device)
    if layout == "contiguous":
        buf = nan_buffer(q.shape, q)
        out = buf
    else:
        out, _ = relayout(nan_buffer(q.shape, q), layout)
        buf = out._base
    n_padd = torch.tensor([0, 9], dtype=torch.int32, device=device)
    assert fusekit.causal_attention(q, k, v, n_padd, out=out) is out
    check(out, q, k, v, n_padd.cpu(), describe_case(rng, device=device, out_layout=layout))
    assert int(torch.isnan(buf).sum()) == buf.numel() - out.numel(), "wrote outside out"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_forward_deterministic(rng, device, dtype):
    q, k, v = make_qkv(rng, 2, 4, 300, 64, hkv=2, dtype=dtype, device=device)
    first = fusekit.causal_attention(q, k, v, 20, return_lse=True)
    second = fusekit.causal_attention(q, k, v, 20, return_lse=True)
    context = describe_case(rng, device=device)
    assert_bitwise_equal(first[0], second[0], name="out", context=context)
    assert_bitwise_equal(first[1], second[1], name="lse", context=context)


# ------------------------------------------------------------------------------ numpy


@pytest.mark.parametrize("padding", ["int", "numpy_int", "array"])
@pytest.mark.parametrize("layout", ["contiguous", "bthd", "reversed_heads"])
def test_numpy(rng, layout, padding):
    """numpy arrays in any layout with a unit stride on D (negative strides included); n_padd an
    int, a numpy integer or an int32 array."""
    q, k, v = (t.numpy() for t in make_qkv(rng, 2, 4, 33, 64, hkv=2))
    if layout == "bthd":
        q, k, v = (np.ascontiguousarray(t.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
                   for t in (q, k, v))
    elif layout == "reversed_heads":
        q, k, v = (t[:, ::-1] for t in (q, k, v))
    n_padd = {"int": 5, "numpy_int": np.int64(5),
              "array": np.array([5, 30], dtype=np.int32)}[padding]
    out = fusekit.causal_attention(q, k, v, n_padd)
    assert type(out) is np.ndarray and out.dtype == np.float32 and out.shape == q.shape
    check(out, q, k, v, n_padd, describe_case(rng, layout=layout, padding=padding))


def test_numpy_out_and_lse(rng):
    q, k, v = (t.numpy() for t in make_qkv(rng, 2, 2, 33, 64))
    out = np.full(q.shape, np.nan, dtype=np.float32)
    got, lse = fusekit.causal_attention(q, k, v, 4, out=out, return_lse=True)
    assert got is out and type(lse) is np.ndarray and lse.dtype == np.float32
    assert lse.shape == (2, 2, 33)
    check(out, q, k, v, 4, describe_case(rng), lse=lse)


def test_numpy_single_head(rng):
    q, k, v = (t[0, 0].numpy() for t in make_qkv(rng, 1, 1, 33, 64))
    out = fusekit.causal_attention(q, k, v, np.array([2], dtype=np.int32))
    check(out, q, k, v, 2, describe_case(rng))


# ------------------------------------------------------------------------------ autograd


@pytest.mark.parametrize("device", DEVICES)
def test_autograd_forward_only(rng, device):
    """Inputs that require grad: the forward runs and is recorded; backward raises."""
    q, k, v = make_qkv(rng, 1, 2, 17, 64, device=device)
    out, lse = fusekit.causal_attention(q.clone().requires_grad_(), k, v, 3, return_lse=True)
    assert out.requires_grad and out.grad_fn is not None and lse.requires_grad
    check(out.detach(), q, k, v, 3, describe_case(rng, device=device), lse=lse.detach())
    with pytest.raises(fusekit.Error, match=r"^causal_attention: backward was called, but the "
                                            r"operator is forward only"):
        out.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_with_leaves_that_require_grad(rng, device):
    q, k, v = make_qkv(rng, 1, 2, 17, 64, device=device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            out = fusekit.causal_attention(*leaves, 3)
        assert not out.requires_grad
        check(out, q, k, v, 3, describe_case(rng, device=device, mode=mode.__name__))


# ------------------------------------------------------------------------------ torch.library


@pytest.mark.parametrize("padding", ["int", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(rng, device, dtype, padding):
    q, k, v = make_qkv(rng, 2, 4, 9, 16, hkv=2, dtype=dtype, device=device)
    if padding == "int":
        torch.library.opcheck(OP, (q, k, v))
        torch.library.opcheck(OP, (q, k, v, 3, None, 0.5, True))
    else:
        counts = torch.tensor([2, 9], dtype=torch.int32, device=device)
        torch.library.opcheck(OP, (q, k, v, 0, counts))
    torch.library.opcheck(OP, (q[0, 0], k[0, 0], v[0, 0], 4))


def test_op_defaults_and_direct_call(rng):
    """torch.ops.fusekit.causal_attention with its schema defaults, as a user may call it:
    (out, lse)."""
    q, k, v = make_qkv(rng, 2, 2, 17, 64)
    out, lse = torch.ops.fusekit.causal_attention(q, k, v)
    check(out, q, k, v, 0, describe_case(rng), lse=lse)
    counts = torch.tensor([1, 5], dtype=torch.int32)
    out, lse = torch.ops.fusekit.causal_attention(q, k, v, n_padd_per_sequence=counts)
    check(out, q, k, v, counts, describe_case(rng, n_padd=counts.tolist()), lse=lse)


def attend(q, k, v, n_padd):
    return fusekit.causal_attention(q, k, v, n_padd, return_lse=True)


@pytest.mark.parametrize("padding", ["int", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compile_aot_eager(rng, dtype, padding):
    torch._dynamo.reset()
    q, k, v = make_qkv(rng, 2, 4, 17, 64, hkv=2, dtype=dtype)
    n_padd = 5 if padding == "int" else torch.tensor([5, 0], dtype=torch.int32)
    out, lse = torch.compile(attend, backend="aot_eager", fullgraph=True)(q, k, v, n_padd)
    check(out, q, k, v, n_padd, describe_case(rng, backend="aot_eager", padding=padding), lse=lse)


def test_compile_dynamic_shapes(rng):
    """Sequence lengths and padding counts that change between calls."""
    torch._dynamo.reset()
    fn = torch.compile(attend, backend="aot_eager", fullgraph=True, dynamic=True)
    for b, t, n_padd in [(2, 17, 3), (1, 40, 12), (3, 9, 0)]:
        q, k, v = make_qkv(rng, b, 2, t, 32)
        out, lse = fn(q, k, v, n_padd)
        check(out, q, k, v, n_padd, describe_case(rng, B=b, T=t, n_padd=n_padd, dynamic=True),
              lse=lse)


def test_compile_out(rng):
    torch._dynamo.reset()

    def fill(q, k, v, out):
        return fusekit.causal_attention(q, k, v, 4, out=out)

    q, k, v = make_qkv(rng, 2, 2, 17, 64)
    out = torch.full_like(q, math.nan)
    got = torch.compile(fill, backend="aot_eager", fullgraph=True)(q, k, v, out)
    for result in (out, got):
        check(result, q, k, v, 4, describe_case(rng, compiled_out=True))


@requires_cuda
@requires_cuda_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compile_inductor_cuda(rng, dtype):
    torch._dynamo.reset()

    def block(q, k, v, n_padd):  # neighbours for inductor to fuse
        return fusekit.causal_attention(q * 2, k, v, n_padd) + 1

    q, k, v = make_qkv(rng, 2, 4, 256, 64, hkv=2, dtype=dtype, device="cuda")
    n_padd = torch.tensor([0, 100], dtype=torch.int32, device="cuda")
    out = torch.compile(block, fullgraph=True)(q, k, v, n_padd)
    assert_close(out, block(q, k, v, n_padd), name="out",
                 context=describe_case(rng, backend="inductor"))


# ------------------------------------------------------------------------------ CUDA specifics


@requires_cuda
@requires_cuda_backend
def test_cuda_runs_on_current_stream(rng):
    """On a side stream, and captured into a CUDA graph (which fails if any work went to another
    stream); per-sequence counts are read on the device, never synchronised on."""
    q, k, v = make_qkv(rng, 2, 4, 512, 64, dtype=torch.bfloat16, device="cuda")
    n_padd = torch.tensor([0, 100], dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = fusekit.causal_attention(q, k, v, n_padd)
    side.synchronize()
    check(out, q, k, v, n_padd.cpu(), describe_case(rng, stream="side"))

    graph = torch.cuda.CUDAGraph()
    out.fill_(math.nan)
    with torch.cuda.graph(graph):
        fusekit.causal_attention(q, k, v, n_padd, out=out)
    graph.replay()
    torch.cuda.synchronize()
    check(out, q, k, v, n_padd.cpu(), describe_case(rng, stream="graph replay"))


@requires_cuda
@requires_cuda_backend
def test_cuda_counts_outside_are_clamped(rng):
    """On CUDA per-sequence counts are not read back to the host: -3 reads as 0, T + 5 as T."""
    q, k, v = make_qkv(rng, 2, 2, 33, 64, device="cuda")
    out = fusekit.causal_attention(q, k, v, torch.tensor([-3, 38], dtype=torch.int32,
                                                         device="cuda"))
    check(out, q, k, v, torch.tensor([0, 33]), describe_case(rng))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@requires_cuda_backend
@pytest.mark.parametrize("d,dtype", [(64, torch.bfloat16), (128, torch.float16),
                                     (64, torch.float32), (40, torch.bfloat16)], ids=str)
def test_cuda_second_device(rng, d, dtype):
    """Both devices in one process, each called while device 0 is current: what a kernel sets up
    once (its shared-memory opt-in, library handles, workspaces) is per device."""
    for device in ("cuda:0", "cuda:1"):
        q, k, v = make_qkv(rng, 2, 2, 65, d, dtype=dtype, device=device)
        with torch.cuda.device(0):
            out = fusekit.causal_attention(q, k, v, 7)
        assert out.device == torch.device(device)
        check(out, q, k, v, 7, describe_case(rng, device=device, D=d))


# ------------------------------------------------------------------------------ errors


def attention(q, k, v, n_padd=0, **kw):
    return fusekit.causal_attention(q, k, v, n_padd, **kw)


@pytest.mark.parametrize("device", VALIDATION_DEVICES)
def test_error_dtype(rng, device):
    q, k, v = make_qkv(rng, 2, 2, 5, 8, device=device)
    with pytest.raises(fusekit.Error, match=r"^causal_attention: q has dtype float64, expected "
                                            r"bfloat16, float16 or float32$"):
        attention(q.double(), k.double(), v.double())
    with pytest.raises(fusekit.Error, match=r"^causal_attention: k has dtype bfloat16 but q has "
                                            r"float32; expected the same dtype$"):
        attention(q, k.bfloat16(), v)
    with pytest.raises(fusekit.Error, match=r"^causal_attention: v has dtype float16 but q has "
                                            r"float32"):
        attention(q, k, v.half())
    # the same message through the autograd op
    with pytest.raises(fusekit.Error, match=r"^causal_attention: k has dtype bfloat16 but q"):
        attention(q.requires_grad_(), k.bfloat16(), v)


@pytest.mark.parametrize("device", VALIDATION_DEVICES)
def test_error_padding_dtype(rng, device):
    """Per-sequence counts are int32; other integer dtypes are refused, not converted."""
    q, k, v = make_qkv(rng, 2, 2, 5, 8, device=device)
    for dtype in (torch.int64, torch.int16, torch.uint8, torch.float32, torch.bool):
        counts = torch.tensor([1, 2], device=device).to(dtype)
        name = str(dtype).removeprefix("torch.")
        with pytest.raises(fusekit.Error, match=rf"^causal_attention: padding\.per_sequence has "
                                                rf"dtype {name}(, expected int32|, which fusekit "
                                                rf"does not handle)"):
            attention(q, k, v, counts)
    with pytest.raises(fusekit.Error, match=r"^causal_attention: padding\.per_sequence has dtype "
                                            r"int64, expected int32$"):
        attention(q.cpu().numpy(), k.cpu().numpy(), v.cpu().numpy(), np.array([1, 2]))


@pytest.mark.parametrize("device", VALIDATION_DEVICES)
def test_error_padding_values(rng, device):
    q, k, v = make_qkv(rng, 2, 2, 5, 8, device=device)
    with pytest.raises(fusekit.Error, match=r"^causal_attention: padding\.all is -1, expected a "
                                            r"count in \[0, T\] = \[0, 5\]$"):
        attention(q, k, v, -1)
    with pytest.raises(fusekit.Error, match=r"^causal_attention: padding\.all is 6, expected a "
                                            r"count in \[0, T\] = \[0, 5\]$"):
        attention(q, k, v, 6)
    with pytest.raises(fusekit.Error, match=r"^causal_attention: padding\.per_sequence has shape "
                                            r"\[3\], expected \[B\] = \[2\]$"):
        attention(q, k, v, torch.zeros(3, dtype=torch.int32, device=device))
    with pytest.raises(fusekit.Error, match=r"^causal_attention: padding\.per_sequence has shape "
                                            r"\[\], expected \[B\] = \[2\]$"):
        attention(q, k, v, torch.tensor(1, dtype=torch.int32, device=device))
    for bad in (2.0, "3", [1, 2], None, True):
        with pytest.raises(fusekit.Error, match=r"^causal_attention: n_padd is a \w+, expected an "
                                                r"int or an int32 array \[B\]"):
            attention(q, k, v, bad)


def test_error_padding_counts_on_cpu(rng):
    """On the CPU every per-sequence count is checked to lie in [0, T]."""
    q, k, v = make_qkv(rng, 2, 2, 5, 8)
    with pytest.raises(fusekit.Error, match=r"^causal_attention: padding\.per_sequence\[1\] is 6, "
                                            r"expected a count in \[0, T\] = \[0, 5\]$"):
        attention(q, k, v, torch.tensor([0, 6], dtype=torch.int32))
    with pytest.raises(fusekit.Error, match=r"^causal_attention: padding\.per_sequence\[0\] is -1"):
        attention(q, k, v, torch.tensor([-1, 0], dtype=torch.int32))


@pytest.mark.parametrize("device", VALIDATION_DEVICES)
def test_error_shape(rng, device):
    q, k, v = make_qkv(rng, 2, 4, 5, 8, hkv=2, device=device)
    with pytest.raises(fusekit.Error, match=r"^causal_attention: q has 3 dims \[4, 5, 8\], "
                                            r"expected 4 dims \[B, Hq, T, D\] or 2 dims \[T, D\]$"):
        attention(q[0], k[0], v[0])
    with pytest.raises(fusekit.Error, match=r"^causal_attention: k has 2 dims \[5, 8\] but q has "
                                            r"4 dims \[2, 4, 5, 8\]; expected k \[B, Hkv, T, D\]$"):
        attention(q, k[0, 0], v)
    with pytest.raises(fusekit.Error, match=r"^causal_attention: k \[2, 3, 5, 8\] has Hkv = 3 "
                                            r"heads, expected Hkv >= 1 dividing q's Hq = 4"):
        attention(q, torch.zeros(2, 3, 5, 8, device=device), v)
    with pytest.raises(fusekit.Error, match=r"^causal_attention: k has shape \[2, 2, 6, 8\], "
                                            r"expected \[B, Hkv, T, D\] = \[2, 2, 5, 8\]$"):
        attention(q, torch.zeros(2, 2, 6, 8, device=device), v)
    with pytest.raises(fusekit.Error, match=r"^causal_attention: v has shape \[2, 1, 5, 8\], "
                                            r"expected \[B, Hkv, T, D\] = \[2, 2, 5, 8\]$"):
        attention(q, k, v[:, :1])
    with pytest.raises(fusekit.Error, match=r"^causal_attention: v has shape \[5, 7\], expected "
                                            r"\[T, D\] = \[5, 8\]$"):
        attention(q[0, 0], k[0, 0], v[0, 0, :, :7])
    with pytest.raises(fusekit.Error, match=r"^causal_attention: q \[1, 1, 3, 257\] has D = 257, "
                                            r"expected 1 <= D <= 256$"):
        z = torch.zeros(1, 1, 3, 257, device=device)
        attention(z, z, z)
    with pytest.raises(fusekit.Error, match=r"^causal_attention: q \[2, 4, 5, 0\] has D = 0"):
        attention(q[..., :0], k[..., :0], v[..., :0])


@pytest.mark.parametrize("device", VALIDATION_DEVICES)
def test_error_layout(rng, device):
    """q, k, v and out need a unit stride on D; nothing is copied to make one."""
    q, k, v = make_qkv(rng, 2, 2, 5, 8, device=device)
    strided = torch.zeros(2, 2, 5, 16, device=device)[..., ::2]
    for i, name in enumerate("qkv"):
        args = [q, k, v]
        args[i] = strided
        with pytest.raises(fusekit.Error, match=rf"^causal_attention: {name} \[2, 2, 5, 8\] has "
                                                rf"strides \(160, 80, 16, 2\); expected a unit "
                                                rf"stride on D \(the last dim\)$"):
            attention(*args)
    with pytest.raises(fusekit.Error, match=r"^causal_attention: out \[2, 2, 5, 8\] has strides "
                                            r"\(160, 80, 16, 2\); expected a unit stride on D"):
        attention(q, k, v, out=strided)


@pytest.mark.parametrize("device", VALIDATION_DEVICES)
def test_error_out(rng, device):
    q, k, v = make_qkv(rng, 2, 2, 5, 8, device=device)
    with pytest.raises(fusekit.Error, match=r"^causal_attention: out has shape \[2, 2, 5, 4\], "
                                            r"expected \[B, Hq, T, D\] = \[2, 2, 5, 8\]$"):
        attention(q, k, v, out=torch.empty(2, 2, 5, 4, device=device))
    with pytest.raises(fusekit.Error, match=r"^causal_attention: out has 3 dims"):
        attention(q, k, v, out=torch.empty(2, 5, 8, device=device))
    with pytest.raises(fusekit.Error, match=r"^causal_attention: out has dtype bfloat16 but q has "
                                            r"float32"):
        attention(q, k, v, out=torch.empty_like(q, dtype=torch.bfloat16))
    with pytest.raises(fusekit.Error, match=r"^causal_attention: out overlaps v in memory"):
        attention(q, k, v, out=v)
    with pytest.raises(fusekit.Error, match=r"^causal_attention: output out has stride 0"):
        attention(q, k, v, out=torch.empty(1, 2, 5, 8, device=device).expand(2, 2, 5, 8))
    with pytest.raises(fusekit.Error, match=r"^causal_attention: out is a numpy.ndarray but the "
                                            r"inputs are torch.Tensors"):
        attention(q, k, v, out=np.empty(tuple(q.shape), np.float32))
    with pytest.raises(fusekit.Error, match=r"^causal_attention: out= was given while autograd "
                                            r"records"):
        attention(q.clone().requires_grad_(), k, v, out=torch.empty_like(q))


@pytest.mark.parametrize("device", VALIDATION_DEVICES)
def test_error_scale(rng, device):
    q, k, v = make_qkv(rng, 2, 2, 5, 8, device=device)
    for bad in (0.0, -1.0, math.inf, math.nan, 1e300):
        with pytest.raises(fusekit.Error, match=r"^causal_attention: options\.scale is .*, "
                                                r"expected a finite value > 0"):
            attention(q, k, v, scale=bad)


@requires_cuda
def test_error_mixed_devices(rng):
    q, k, v = make_qkv(rng, 2, 2, 5, 8, device="cuda")
    with pytest.raises(fusekit.Error, match=r"^causal_attention: k is on cpu but q is on cuda:0; "
                                            r"expected one device$"):
        attention(q, k.cpu(), v)
    with pytest.raises(fusekit.Error, match=r"^causal_attention: padding\.per_sequence is on cpu "
                                            r"but q is on cuda:0"):
        attention(q, k, v, torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(fusekit.Error, match=r"^causal_attention: out is on cpu but q is on "
                                            r"cuda:0"):
        attention(q, k, v, out=torch.empty(q.shape))


def test_error_mixed_frameworks(rng):
    q, k, v = make_qkv(rng, 2, 2, 5, 8)
    with pytest.raises(fusekit.Error, match=r"^causal_attention: v is a numpy.ndarray but q is a "
                                            r"torch.Tensor; expected arrays of one framework$"):
        attention(q, k, v.numpy())
    with pytest.raises(fusekit.Error, match=r"^causal_attention: n_padd is a numpy.ndarray but q "
                                            r"is a torch.Tensor"):
        attention(q, k, v, np.array([1, 2], dtype=np.int32))
    with pytest.raises(fusekit.Error, match=r"^causal_attention: n_padd is a torch.Tensor but q "
                                            r"is a numpy.ndarray"):
        attention(q.numpy(), k.numpy(), v.numpy(), torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(fusekit.Error, match=r"^causal_attention: q is a list, expected a "
                                            r"torch.Tensor or a numpy.ndarray$"):
        attention(q.tolist(), k, v)
