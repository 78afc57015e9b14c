"""fusekit.layernorm_linear_gelu and fusekit.torch.LayerNormLinearGELU against the float64
reference (reference.py).

Cases: every dtype on CPU and CUDA (skipped with a reason without a GPU), float32 with and without
TF32, numpy inputs, three input distributions (centred, shifted, large mean), sizes K and Nout
in {1, 3, 1000}, one row, no rows, leading dims, every optional argument given or not, both GELU
forms, non-contiguous and misaligned views with NaN in the memory they must not read, a
transposed weight, NaN-poisoned outputs, the error budget against PyTorch in the same dtype,
bitwise determinism, autograd (forward only), torch.compile, torch.library.opcheck, CUDA streams
and graphs, the error messages, and the module.
"""

import math

import numpy as np
import pytest
import torch

import fusekit
import reference
from compare import Tol, assert_bitwise_equal, assert_close, max_abs_error, to_torch64
from conftest import DEVICES, requires_cuda
from fusekit.torch import LayerNormLinearGELU

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ARGS = ("x", "weight", "bias", "ln_weight", "ln_bias")
OP = torch.ops.fusekit.layernorm_linear_gelu.default

# Tolerances, once per dtype, for |got - expected| <= atol * scale + rtol * |expected|, where
# scale is the sum of |terms| behind each pre-activation (reference.layernorm_linear_gelu_abs).
# float16 / bfloat16: twice the two roundings the operator makes, the normalised rows to that
# dtype (half an ulp: 2^-11 / 2^-8, relative to each term) and the output (relative to it).
# TF32 rounds both operands of each product to a 10-bit mantissa. Full float32 allows some
# accumulation error over K. GELU's slope is at most 1.13, so errors of the pre-activation pass
# through about unchanged.
TOLERANCES = {
    "float32": Tol(rtol=1e-5, atol=1e-5),
    "tf32": Tol(rtol=1e-3, atol=1e-3),
    "float16": Tol(rtol=2**-10, atol=2**-10),
    "bfloat16": Tol(rtol=2**-7, atol=2**-7),
}

# Input distributions: LayerNorm must not lose the variance to a large mean.
X_KINDS = {
    "centred": (0.0, 1.0),
    "shifted": (-2.3, 0.5),
    "large_mean": (100.0, 1.0),
}


def dtype_key(dtype, device, allow_tf32):
    name = str(dtype).removeprefix("torch.")
    return "tf32" if name == "float32" and allow_tf32 and str(device).startswith("cuda") else name


def make_inputs(rng, lead, k, nout, dtype=torch.float32, device="cpu", *, x_kind="centred",
                bias=True, ln_weight=True, ln_bias=True, ln_dtype=None):
    """(x, weight, bias, ln_weight, ln_bias), None where not wanted. x [*lead, K] from X_KINDS;
    weight [Nout, K] ~ N(0, 1/K) (torch.nn.Linear's scale); bias ~ N(0, 1/4); ln_weight ~ N(1, 1/4)
    and ln_bias ~ N(0, 1/4), far from LayerNorm's 1 and 0, in ln_dtype (default x's dtype)."""
    ln_dtype = ln_dtype or dtype
    loc, scale = X_KINDS[x_kind]
    x = (loc + scale * rng.randn(*lead, k, dtype=torch.float64)).to(dtype=dtype, device=device)
    w = (rng.randn(nout, k, dtype=torch.float64) / math.sqrt(k)).to(dtype=dtype, device=device)
    b = 0.5 * rng.randn(nout, dtype=dtype, device=device) if bias else None
    g = (1 + 0.5 * rng.randn(k, dtype=torch.float64)).to(ln_dtype).to(device) if ln_weight else None
    beta = 0.5 * rng.randn(k, dtype=ln_dtype, device=device) if ln_bias else None
    return x, w, b, g, beta


def describe_case(rng, **kw):
    return f"seed {rng.seed}, " + ", ".join(f"{k}={v}" for k, v in kw.items())


def statistics_error(x, weight, ln_weight, eps):
    """What float32 statistics may add to each pre-activation, in float64: a mean of K values is
    off by up to about (2 + log2 K) float32 ulps of max |x|, which shifts each normalised element
    by that times 1/std and reaches the output through |ln_weight| @ |weight|^T."""
    k = x.shape[-1]
    rstd = (x.var(-1, unbiased=False, keepdim=True) + eps).rsqrt()
    shift = 2**-24 * (2 + math.log2(k)) * x.abs().amax(-1, keepdim=True) * rstd  # [..., 1]
    g = torch.ones(k, dtype=torch.float64) if ln_weight is None else ln_weight.abs()
    return shift * (g @ weight.abs().mT)  # [..., Nout]


def check(out, inputs, context, *, eps=1e-5, approximate="tanh", allow_tf32=True,
          expected=None, name="out"):
    """out against the float64 reference (or `expected`) within the tolerance of x's dtype (TF32
    on CUDA when allowed for float32)."""
    x = inputs[0]
    ref64 = [None if t is None else to_torch64(t) for t in inputs]
    if expected is None:
        expected = reference.layernorm_linear_gelu(*ref64, eps=eps, approximate=approximate)
    tol = TOLERANCES[dtype_key(x.dtype, x.device, allow_tf32)]
    scale = reference.layernorm_linear_gelu_abs(*ref64, eps=eps)
    if x.numel() > 0:
        scale = scale + statistics_error(ref64[0], ref64[1], ref64[3], eps) / tol.atol
    assert_close(out, expected, tol=tol, scale=scale, dtype=x.dtype, name=name, context=context)


def call(inputs, **kw):
    x, weight, bias, ln_weight, ln_bias = inputs
    return fusekit.layernorm_linear_gelu(x, weight, bias, ln_weight=ln_weight, ln_bias=ln_bias,
                                         **kw)


# ------------------------------------------------------------------------------ forward


@pytest.mark.parametrize("nout", [1, 3, 1000])
@pytest.mark.parametrize("k", [1, 3, 1000])
@pytest.mark.parametrize("x_kind", list(X_KINDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_forward(rng, device, dtype, x_kind, k, nout):
    inputs = make_inputs(rng, (7,), k, nout, dtype, device, x_kind=x_kind)
    out = call(inputs)
    assert isinstance(out, torch.Tensor) and out.device == inputs[0].device
    assert out.shape == (7, nout) and out.is_contiguous()
    check(out, inputs, describe_case(rng, device=device, x=x_kind, K=k, Nout=nout))


@pytest.mark.parametrize("x_kind", list(X_KINDS))
@pytest.mark.parametrize("device", DEVICES)
def test_forward_float32_exact(rng, device, x_kind):
    """allow_tf32=False: full float32 products (TF32 off on CUDA; the CPU never uses it)."""
    inputs = make_inputs(rng, (33,), 1000, 1000, torch.float32, device, x_kind=x_kind)
    out = call(inputs, allow_tf32=False)
    check(out, inputs, describe_case(rng, device=device, x=x_kind), allow_tf32=False)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize(
    "given",
    ["all", "no_bias", "no_ln", "ln_weight_only", "ln_bias_only", "none", "ln_float32"],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_forward_optional_args(rng, device, dtype, given, approximate):
    """Each optional argument present or None; LayerNorm parameters also as float32 beside
    half-precision activations; both forms of GELU."""
    inputs = make_inputs(rng, (7,), 127, 129, dtype, device,
                         bias=given not in ("no_bias", "none"),
                         ln_weight=given in ("all", "no_bias", "ln_weight_only", "ln_float32"),
                         ln_bias=given in ("all", "no_bias", "ln_bias_only", "ln_float32"),
                         ln_dtype=torch.float32 if given == "ln_float32" else None)
    out = call(inputs, approximate=approximate)
    check(out, inputs, describe_case(rng, device=device, given=given, approximate=approximate),
          approximate=approximate)


@pytest.mark.parametrize(
    "lead", [(), (1,), (2, 3), (2, 1, 3), (0,), (2, 0)], ids=lambda s: f"lead{list(s)}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_forward_leading_dims(rng, device, dtype, lead):
    """x [*lead, K] -> out [*lead, Nout]: no leading dim (one row), one row, several leading
    dims, and no rows at all."""
    inputs = make_inputs(rng, lead, 127, 33, dtype, device)
    out = call(inputs)
    assert out.shape == (*lead, 33) and out.is_contiguous()
    check(out, inputs, describe_case(rng, device=device, lead=list(lead)))


@pytest.mark.parametrize("device", DEVICES)
def test_forward_no_outputs(rng, device):
    """Nout = 0: weight [0, K], an empty result."""
    x, w, _, g, beta = make_inputs(rng, (7,), 127, 0, torch.float32, device)
    out = call((x, w, torch.empty(0, device=device), g, beta))
    assert out.shape == (7, 0)


@pytest.mark.parametrize("eps", [0.0, 1e-6, 0.5])
@pytest.mark.parametrize("device", DEVICES)
def test_forward_eps(rng, device, eps):
    inputs = make_inputs(rng, (7,), 127, 33, torch.float32, device, x_kind="shifted")
    check(call(inputs, eps=eps), inputs, describe_case(rng, device=device, eps=eps), eps=eps)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_constant_rows(rng, device):
    """A row of equal values has no variance: LayerNorm gives ln_bias (rstd = 1/sqrt(eps))."""
    x, w, b, g, beta = make_inputs(rng, (4,), 127, 33, torch.float32, device)
    x = torch.full_like(x, 3.25)
    inputs = (x, w, b, g, beta)
    check(call(inputs), inputs, describe_case(rng, device=device))


# ------------------------------------------------------------------------------ layouts


def nan_buffer(shape, like):
    return torch.full(shape, math.nan, dtype=like.dtype, device=like.device)


def relayout(t, layout):
    """(view, values): a view in `layout` over a buffer that is NaN everywhere else (a kernel
    reading what it must not leaks NaN into the result), and the values it holds (t's, but for
    broadcast_rows)."""
    shape, last = tuple(t.shape), t.shape[-1]
    if layout == "offset1":  # base pointer one element past an aligned allocation
        view = nan_buffer((t.numel() + 1,), t)[1:].view(shape)
    elif layout == "padded":  # rows 8 elements apart beyond their length
        view = nan_buffer((*shape[:-1], last + 8), t)[..., :last]
    elif layout == "shifted":  # padded rows starting one element in: every row misaligned
        view = nan_buffer((*shape[:-1], last + 3), t)[..., 1 : last + 1]
    elif layout == "strided":  # last axis with stride 2
        view = nan_buffer((*shape[:-1], 2 * last), t)[..., ::2]
    elif layout == "transposed":  # the transpose of a row-major [last, first] (the weight as W.T)
        view = nan_buffer(shape[::-1], t).mT
    elif layout == "transposed_padded":
        view = nan_buffer((shape[1], shape[0] + 8), t)[:, : shape[0]].mT
    elif layout == "lead_swapped":  # x [A, B, K] stored as [B, A, K]
        view = nan_buffer((shape[1], shape[0], last), t).transpose(0, 1)
    elif layout == "broadcast_rows":  # t's first row repeated through a zero row stride
        row = nan_buffer((1, last), t).copy_(t[:1])
        return row.expand(shape), t[:1].expand(shape)
    else:
        raise ValueError(layout)
    view.copy_(t)
    return view, t


@pytest.mark.parametrize("k,nout", [(1000, 1000), (127, 3)], ids=["K1000_N1000", "K127_N3"])
@pytest.mark.parametrize(
    "arg,layout",
    [("x", lay) for lay in ("offset1", "padded", "shifted", "strided", "broadcast_rows")]
    + [("weight", lay) for lay in ("transposed", "transposed_padded", "offset1", "padded",
                                   "shifted")]
    + [("bias", "offset1")]
    + [("ln_weight", lay) for lay in ("offset1", "strided")]
    + [("ln_bias", lay) for lay in ("offset1", "strided")],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_forward_input_layouts(rng, device, dtype, arg, layout, k, nout):
    inputs = list(make_inputs(rng, (7,), k, nout, dtype, device))
    views = list(inputs)
    i = ARGS.index(arg)
    views[i], inputs[i] = relayout(inputs[i], layout)
    out = call(views)
    check(out, inputs, describe_case(rng, device=device, arg=arg, layout=layout, K=k, Nout=nout))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_forward_x_leading_dims_any_strides(rng, device, dtype):
    """x's leading dims need not collapse to one row stride (out's are allocated contiguous)."""
    inputs = list(make_inputs(rng, (3, 5), 127, 33, dtype, device))
    views = list(inputs)
    views[0], _ = relayout(inputs[0], "lead_swapped")
    check(call(views), inputs, describe_case(rng, device=device))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_forward_all_misaligned(rng, device, dtype):
    """Every argument one element off its allocation, x and weight with padded rows."""
    inputs = list(make_inputs(rng, (7,), 1000, 1000, dtype, device))
    views = [relayout(inputs[0], "shifted")[0], relayout(inputs[1], "transposed_padded")[0]]
    views += [relayout(t, "offset1")[0] for t in inputs[2:]]
    out, buf = out_view((7,), 1000, dtype, device, "shifted")
    call(views, out=out)
    check(out, inputs, describe_case(rng, device=device))
    assert int(torch.isnan(buf).sum()) == buf.numel() - out.numel(), "wrote outside out"


def out_view(lead, nout, dtype, device, layout):
    """(out, buffer): an output view in `layout` over a NaN-filled buffer."""
    m = math.prod(lead)
    like = torch.empty(0, dtype=dtype, device=device)
    if layout == "contiguous":
        buf = nan_buffer((*lead, nout), like)
        return buf, buf
    if layout == "offset1":
        buf = nan_buffer((m * nout + 1,), like)
        return buf[1:].view(*lead, nout), buf
    pad, start = {"padded": (8, 0), "shifted": (3, 1)}[layout]
    buf = nan_buffer((m, nout + pad), like)
    # leading dims that collapse to one row stride of nout + pad
    return buf[:, start : start + nout].unflatten(0, lead), buf


@pytest.mark.parametrize("lead", [(7,), (2, 3)], ids=lambda s: f"lead{list(s)}")
@pytest.mark.parametrize("layout", ["contiguous", "offset1", "padded", "shifted"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_forward_out_poisoned(rng, device, dtype, layout, lead):
    """out= filled with NaN beforehand: every element is written, nothing around it is."""
    inputs = make_inputs(rng, lead, 127, 129, dtype, device)
    out, buf = out_view(lead, 129, dtype, device, layout)
    got = call(inputs, out=out)
    assert got is out
    check(out, inputs, describe_case(rng, device=device, out_layout=layout, lead=list(lead)))
    assert int(torch.isnan(buf).sum()) == buf.numel() - out.numel(), "wrote outside out"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_forward_deterministic(rng, device, dtype):
    inputs = make_inputs(rng, (64,), 1000, 1000, dtype, device, x_kind="shifted")
    assert_bitwise_equal(call(inputs), call(inputs), name="out",
                         context=describe_case(rng, device=device))


@requires_cuda
@pytest.mark.parametrize("shape", [(256, 1000, 1000), (2048, 3, 127), (2048, 1000, 1)],
                         ids=lambda s: "M{}_K{}_N{}".format(*s))
@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("x_kind", list(X_KINDS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_error_budget(rng, dtype, x_kind, approximate, shape):
    """The accuracy criterion for half precision: the error against float64 is at most twice
    that of PyTorch's unfused formula (F.layer_norm -> F.linear -> F.gelu) in the same dtype on
    the same GPU. (On the CPU, where PyTorch's half-precision products are no yardstick, the
    fixed tolerances above apply.)"""
    m, k, nout = shape
    inputs = make_inputs(rng, (m,), k, nout, dtype, "cuda", x_kind=x_kind)
    ref64 = [to_torch64(t) for t in inputs]
    exact = reference.layernorm_linear_gelu(*ref64, approximate=approximate)
    ours = call(inputs, approximate=approximate)
    torch_same = reference.layernorm_linear_gelu(*inputs, approximate=approximate)
    # A floor of 16 float32 ulps of the largest value keeps an exact PyTorch result from
    # demanding exactness.
    floor = 2**-20 * exact.abs().max().item()
    err, base = max_abs_error(ours, exact), max_abs_error(torch_same, exact)
    assert err <= 2 * base + floor, (
        f"max |error| {err:.3g} exceeds twice PyTorch's {base:.3g} (+ {floor:.2g}) "
        f"[{describe_case(rng, x=x_kind, approximate=approximate, shape=shape)}]")


# ------------------------------------------------------------------------------ numpy


@pytest.mark.parametrize("given", ["all", "none"])
@pytest.mark.parametrize("layout", ["contiguous", "shifted", "transposed_weight"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_numpy(rng, dtype, layout, given):
    inputs = list(make_inputs(rng, (2, 3), 127, 33, dtype, bias=given == "all",
                              ln_weight=given == "all", ln_bias=given == "all"))
    views = list(inputs)
    if layout == "shifted":
        views[0] = relayout(inputs[0], "shifted")[0]
    elif layout == "transposed_weight":
        views[1] = relayout(inputs[1], "transposed")[0]
    arrays = [None if t is None else t.numpy() for t in views]
    out = call(arrays)
    assert type(out) is np.ndarray and out.dtype == arrays[0].dtype and out.shape == (2, 3, 33)
    check(out, inputs, describe_case(rng, layout=layout, given=given))


def test_numpy_out(rng):
    inputs = make_inputs(rng, (7,), 127, 33, x_kind="large_mean")
    out = np.full((7, 33), np.nan, dtype=np.float32)
    got = call([t.numpy() for t in inputs], out=out, approximate="none")
    assert got is out
    check(out, inputs, describe_case(rng), approximate="none")


# ------------------------------------------------------------------------------ autograd


@pytest.mark.parametrize("device", DEVICES)
def test_autograd_forward_only(rng, device):
    """Inputs that require grad: the forward runs and is recorded; backward raises."""
    inputs = make_inputs(rng, (7,), 127, 33, torch.float32, device)
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = call(leaves)
    assert out.requires_grad and out.grad_fn is not None
    check(out.detach(), inputs, describe_case(rng, device=device))
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: backward was called, but "
                                            r"the operator is forward only"):
        out.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_with_leaves_that_require_grad(rng, device):
    inputs = make_inputs(rng, (7,), 127, 33, torch.float32, device)
    leaves = [t.clone().requires_grad_() for t in inputs]
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            out = call(leaves)
        assert not out.requires_grad
        check(out, inputs, describe_case(rng, device=device, mode=mode.__name__))


# ------------------------------------------------------------------------------ torch.library


@pytest.mark.parametrize("given", ["all", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(rng, device, dtype, given):
    inputs = make_inputs(rng, (2, 5), 96, 40, dtype, device, bias=given == "all",
                         ln_weight=given == "all", ln_bias=given == "all")
    torch.library.opcheck(OP, inputs)
    torch.library.opcheck(OP, (*inputs, 1e-3, "none", False))


def test_op_defaults_and_direct_call(rng):
    """torch.ops.fusekit.layernorm_linear_gelu with its schema defaults, as a user may call it."""
    x, w, b, _, _ = make_inputs(rng, (7,), 127, 33)
    out = torch.ops.fusekit.layernorm_linear_gelu(x, w, b)
    check(out, (x, w, b, None, None), describe_case(rng))
    with pytest.raises(ValueError, match=r"^layernorm_linear_gelu: approximate is 'erf', "
                                         r"expected 'tanh' or 'none'$"):
        torch.ops.fusekit.layernorm_linear_gelu(x, w, b, approximate="erf")


def llg(x, weight, bias, ln_weight, ln_bias):
    return fusekit.layernorm_linear_gelu(x, weight, bias, ln_weight=ln_weight, ln_bias=ln_bias)


@pytest.mark.parametrize("given", ["all", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compile_aot_eager(rng, dtype, given):
    torch._dynamo.reset()
    inputs = make_inputs(rng, (2, 7), 127, 33, dtype, bias=given == "all",
                         ln_weight=given == "all", ln_bias=given == "all")
    out = torch.compile(llg, backend="aot_eager", fullgraph=True)(*inputs)
    check(out, inputs, describe_case(rng, backend="aot_eager", given=given))


def test_compile_dynamic_shapes(rng):
    torch._dynamo.reset()
    fn = torch.compile(llg, backend="aot_eager", fullgraph=True, dynamic=True)
    for lead, k, nout in [((7,), 127, 33), ((2, 3), 64, 5)]:
        inputs = make_inputs(rng, lead, k, nout)
        check(fn(*inputs), inputs, describe_case(rng, lead=lead, K=k, Nout=nout, dynamic=True))


def test_compile_out(rng):
    torch._dynamo.reset()

    def fill(x, weight, bias, out):
        return fusekit.layernorm_linear_gelu(x, weight, bias, approximate="none", out=out)

    x, w, b, _, _ = make_inputs(rng, (7,), 127, 33)
    out = torch.full((7, 33), math.nan)
    got = torch.compile(fill, backend="aot_eager", fullgraph=True)(x, w, b, out)
    for result in (out, got):
        check(result, (x, w, b, None, None), describe_case(rng, compiled_out=True),
              approximate="none")


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compile_inductor_cuda(rng, dtype):
    torch._dynamo.reset()

    def block(x, weight, bias, ln_weight, ln_bias):  # neighbours for inductor to fuse
        return llg(x * 2, weight, bias, ln_weight, ln_bias) + 1

    inputs = make_inputs(rng, (7,), 1000, 1000, dtype, "cuda")
    out = torch.compile(block, fullgraph=True)(*inputs)
    assert_close(out, block(*inputs), name="out", context=describe_case(rng, backend="inductor"))


# ------------------------------------------------------------------------------ CUDA specifics


@requires_cuda
def test_cuda_runs_on_current_stream(rng):
    """On a side stream, and captured into a CUDA graph (which fails if any work went to
    another stream)."""
    inputs = make_inputs(rng, (7,), 1000, 1000, torch.bfloat16, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = call(inputs)
    side.synchronize()
    check(out, inputs, describe_case(rng, stream="side"))

    graph = torch.cuda.CUDAGraph()
    out.fill_(math.nan)
    with torch.cuda.graph(graph):
        call(inputs, out=out)
    graph.replay()
    torch.cuda.synchronize()
    check(out, inputs, describe_case(rng, stream="graph replay"))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
# cuBLASLt (K odd, and 700 rows), the warpgroup product (7 rows); float32 through cuBLASLt
@pytest.mark.parametrize("rows,k,nout,dtype", [(7, 127, 33, torch.bfloat16),
                                               (7, 128, 96, torch.bfloat16),
                                               (700, 256, 200, torch.bfloat16),
                                               (70, 64, 48, torch.float32)], ids=str)
def test_cuda_second_device(rng, rows, k, nout, dtype):
    """Both devices in one process, each called while device 0 is current: what a kernel sets up
    once (its shared-memory opt-in, library handles, workspaces) is per device."""
    for device in ("cuda:0", "cuda:1"):
        inputs = make_inputs(rng, (rows,), k, nout, dtype, device)
        with torch.cuda.device(0):
            out = call(inputs)
        assert out.device == torch.device(device)
        check(out, inputs, describe_case(rng, device=device))


# ------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("device", DEVICES)
def test_error_wrong_dtype(rng, device):
    x, w, b, g, beta = make_inputs(rng, (3,), 5, 4, torch.float32, device)
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: x has dtype float64, "
                                            r"expected bfloat16, float16 or float32$"):
        llg(x.double(), w.double(), b.double(), g, beta)
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: weight has dtype bfloat16 "
                                            r"but x has float32"):
        llg(x, w.bfloat16(), b, g, beta)
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: bias has dtype float16 "
                                            r"but x has float32"):
        llg(x, w, b.half(), g, beta)
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: ln_weight has dtype "
                                            r"float64, expected float32"):
        llg(x, w, b, g.double(), beta)
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: ln_bias has dtype bfloat16, "
                                            r"expected float16 or float32$"):
        llg(x.half(), w.half(), b.half(), g, beta.bfloat16())
    # the same message through the autograd op
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: weight has dtype bfloat16"):
        llg(x.requires_grad_(), w.bfloat16(), b, g, beta)


@pytest.mark.parametrize("device", DEVICES)
def test_error_shape(rng, device):
    x, w, b, g, beta = make_inputs(rng, (3,), 5, 4, torch.float32, device)
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: weight has shape \[4, 6\], "
                                            r"expected \[Nout, K\] = \[4, 5\]$"):
        llg(x, torch.zeros(4, 6, device=device), b, g, beta)
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: weight has 1 dims \[5\], "
                                            r"expected 2 dims \[Nout, K\]$"):
        llg(x, w[0], None, g, beta)
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: bias has shape \[5\], "
                                            r"expected \[Nout\] = \[4\]$"):
        llg(x, w, torch.zeros(5, device=device), g, beta)
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: ln_weight has shape \[4\], "
                                            r"expected \[K\] = \[5\]$"):
        llg(x, w, b, g[:4], beta)
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: ln_bias has shape \[1, 5\], "
                                            r"expected \[K\] = \[5\]$"):
        llg(x, w, b, g, beta[None])
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: x has 0 dims"):
        llg(x[0, 0], w, b, g, beta)
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: x \[3, 0\] has K = 0"):
        llg(x[:, :0], w[:, :0], b, None, None)


@pytest.mark.parametrize("device", DEVICES)
def test_error_layout(rng, device):
    x, w, b, g, beta = make_inputs(rng, (3,), 5, 4, torch.float32, device)
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: weight \[4, 5\] has strides "
                                            r"\(10, 2\); expected a unit stride on one axis"):
        llg(x, torch.zeros(4, 10, device=device)[:, ::2], b, g, beta)
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: bias has stride 2, "
                                            r"expected a contiguous \[Nout\] vector$"):
        llg(x, w, torch.zeros(8, device=device)[::2], g, beta)
    out = torch.empty(3, 8, device=device)[:, ::2]
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: out \[3, 4\] has strides "
                                            r"\(8, 2\); expected a contiguous last dim"):
        llg_out(x, w, b, out)
    out = torch.empty(2, 3, 4, device=device).transpose(0, 1)
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: out \[3, 2, 4\] has strides "
                                            r"\(4, 12, 1\); expected .* leading dims that "
                                            r"collapse"):
        llg_out(torch.zeros(3, 2, 5, device=device), w, b, out)


def llg_out(x, weight, bias, out):
    return fusekit.layernorm_linear_gelu(x, weight, bias, out=out)


@pytest.mark.parametrize("device", DEVICES)
def test_error_out(rng, device):
    x, w, b, _, _ = make_inputs(rng, (3,), 5, 4, torch.float32, device)
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: out \[3, 5\] has 5 features "
                                            r"in its last dim, expected Nout = 4"):
        llg_out(x, w, b, torch.empty(3, 5, device=device))
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: out \[4, 4\] has size 4 in "
                                            r"dim 0, expected 3"):
        llg_out(x, w, b, torch.empty(4, 4, device=device))
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: out has dtype bfloat16 but x "
                                            r"has float32"):
        llg_out(x, w, b, torch.empty(3, 4, dtype=torch.bfloat16, device=device))
    buf = torch.zeros(3, 5, device=device)
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: out overlaps x in memory"):
        llg_out(buf, w, b, buf[:, :4])
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: out is a numpy.ndarray but "
                                            r"the inputs are torch.Tensors"):
        llg_out(x, w, b, np.empty((3, 4), np.float32))
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: out= was given while "
                                            r"autograd records"):
        llg_out(*leaves, torch.empty(3, 4, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_error_options(rng, device):
    x, w, b, _, _ = make_inputs(rng, (3,), 5, 4, torch.float32, device)
    for bad in ("erf", "Tanh", None, True):
        with pytest.raises(ValueError, match=r"^layernorm_linear_gelu: approximate is .*, "
                                             r"expected 'tanh' or 'none'$"):
            fusekit.layernorm_linear_gelu(x, w, b, approximate=bad)
    with pytest.raises(ValueError, match=r"^layernorm_linear_gelu: approximate is 'exact'"):
        fusekit.layernorm_linear_gelu(x.numpy() if device == "cpu" else x,
                                      w.numpy() if device == "cpu" else w, approximate="exact")
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: options.eps is -1, expected "
                                            r"a finite value >= 0$"):
        fusekit.layernorm_linear_gelu(x, w, b, eps=-1.0)
    with pytest.raises(fusekit.Error, match=r"eps is nan"):
        fusekit.layernorm_linear_gelu(x, w, b, eps=math.nan)


@requires_cuda
def test_error_mixed_devices(rng):
    x, w, b, g, beta = make_inputs(rng, (3,), 5, 4, torch.float32, "cuda")
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: weight is on cpu but x is on "
                                            r"cuda:0; expected one device$"):
        llg(x, w.cpu(), b, g, beta)
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: ln_bias is on cpu but x is "
                                            r"on cuda:0"):
        llg(x, w, b, g, beta.cpu())
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: out is on cpu but x is on "
                                            r"cuda:0"):
        llg_out(x, w, b, torch.empty(3, 4))


def test_error_mixed_frameworks(rng):
    x, w, b, g, beta = make_inputs(rng, (3,), 5, 4)
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: weight is a numpy.ndarray "
                                            r"but x is a torch.Tensor; expected arrays of one "
                                            r"framework$"):
        llg(x, w.numpy(), b, g, beta)
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: ln_bias is a torch.Tensor "
                                            r"but x is a numpy.ndarray"):
        llg(x.numpy(), w.numpy(), None, None, beta)
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: x is a list, expected a "
                                            r"torch.Tensor or a numpy.ndarray$"):
        llg(x.tolist(), w, b, g, beta)


# ------------------------------------------------------------------------------ the module


@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_module_parameters(bias, affine):
    m = LayerNormLinearGELU(300, 7, bias=bias, elementwise_affine=affine)
    names = {"weight"} | ({"bias"} if bias else set())
    names |= {"ln_weight", "ln_bias"} if affine else set()
    assert set(dict(m.named_parameters())) == names == set(m.state_dict())
    assert m.weight.shape == (7, 300)
    bound = 1 / math.sqrt(300)  # torch.nn.Linear's initialisation
    assert m.weight.abs().max() <= bound and m.weight.std() > bound / 3
    if bias:
        assert m.bias.shape == (7,) and m.bias.abs().max() <= bound
    else:
        assert m.bias is None
    if affine:  # torch.nn.LayerNorm's initialisation
        assert m.ln_weight.shape == m.ln_bias.shape == (300,)
        assert (m.ln_weight == 1).all() and (m.ln_bias == 0).all()
    else:
        assert m.ln_weight is None and m.ln_bias is None
    assert "in_features=300, out_features=7" in repr(m)


@pytest.mark.parametrize("device", DEVICES)
def test_module_factory_kwargs(device):
    m = LayerNormLinearGELU(16, 8, elementwise_affine=True, device=device, dtype=torch.bfloat16)
    for p in m.parameters():
        assert p.dtype == torch.bfloat16 and p.device.type == device


def test_module_rejects_bad_approximate():
    with pytest.raises(ValueError, match=r"approximate is 'erf'"):
        LayerNormLinearGELU(16, 8, approximate="erf")


def randomise(m, rng):
    """Parameters away from their initial values (LayerNorm's are 1 and 0 at first): ln_weight
    ~ N(1, 1/4), the others ~ N(0, 1/4)."""
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(0.5 * rng.randn(*p.shape) + (name == "ln_weight"))


@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_module_forward(rng, device, dtype, bias, affine, approximate):
    """The module gives the functional op's result, and matches torch.nn.LayerNorm ->
    torch.nn.Linear -> torch.nn.GELU with the same parameters in float64."""
    m = LayerNormLinearGELU(127, 33, bias=bias, elementwise_affine=affine, eps=1e-4,
                            approximate=approximate, device=device, dtype=dtype)
    randomise(m, rng)
    x = rng.randn(2, 5, 127, dtype=dtype, device=device)
    with torch.no_grad():
        out = m(x)
        functional = fusekit.layernorm_linear_gelu(x, m.weight, m.bias, ln_weight=m.ln_weight,
                                                   ln_bias=m.ln_bias, eps=1e-4,
                                                   approximate=approximate)
    assert_bitwise_equal(out, functional, name="module vs functional")

    ln = torch.nn.LayerNorm(127, eps=1e-4, elementwise_affine=affine, dtype=torch.float64)
    lin = torch.nn.Linear(127, 33, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        ln.load_state_dict({k.removeprefix("ln_"): v for k, v in m.state_dict().items()
                            if k.startswith("ln_")})
        lin.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("ln_")})
        unfused = torch.nn.Sequential(ln, lin, torch.nn.GELU(approximate=approximate))(
            to_torch64(x))
    params = [None if p is None else p.detach() for p in (x, m.weight, m.bias, m.ln_weight,
                                                          m.ln_bias)]
    check(out, params, describe_case(rng, device=device, bias=bias, affine=affine), eps=1e-4,
          expected=unfused, name="module vs torch.nn")


def test_module_state_dict_round_trip(rng):
    m = LayerNormLinearGELU(127, 33, elementwise_affine=True, approximate="none")
    randomise(m, rng)
    copy = LayerNormLinearGELU(127, 33, elementwise_affine=True, approximate="none")
    copy.load_state_dict(m.state_dict())
    for name, p in m.state_dict().items():
        assert_bitwise_equal(copy.state_dict()[name], p, name=name)
    x = rng.randn(7, 127)
    with torch.no_grad():
        assert_bitwise_equal(copy(x), m(x), name="out", context=describe_case(rng))
    without_affine = LayerNormLinearGELU(127, 33)
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: \"ln_weight\""):
        without_affine.load_state_dict(m.state_dict())


@pytest.mark.parametrize("device", DEVICES)
def test_module_forward_only(rng, device):
    """With parameters that require grad the forward runs; backward raises."""
    m = LayerNormLinearGELU(127, 33, device=device)
    x = rng.randn(7, 127, device=device)
    out = m(x)
    assert out.requires_grad
    with pytest.raises(fusekit.Error, match=r"^layernorm_linear_gelu: backward was called"):
        out.sum().backward()


def test_module_compile_aot_eager(rng):
    torch._dynamo.reset()
    m = LayerNormLinearGELU(127, 33, elementwise_affine=True)
    randomise(m, rng)
    x = rng.randn(2, 7, 127)
    with torch.no_grad():
        out = torch.compile(m, backend="aot_eager", fullgraph=True)(x)
        assert_bitwise_equal(out, m(x), name="out", context=describe_case(rng))


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_module_compile_inductor_cuda(rng, dtype):
    torch._dynamo.reset()
    m = LayerNormLinearGELU(1000, 1000, elementwise_affine=True, device="cuda", dtype=dtype)
    randomise(m, rng)
    block = torch.nn.Sequential(m, torch.nn.Linear(1000, 8, device="cuda", dtype=dtype))
    x = rng.randn(3, 7, 1000, dtype=dtype, device="cuda")
    with torch.inference_mode():
        out = torch.compile(block, fullgraph=True)(x)
        expected = block(x)
    assert_close(out, expected, name="out", context=describe_case(rng, backend="inductor"))
