"""fusekit.mhc_post and fusekit.mhc_post_backward against the float64 reference (reference.py).

Cases: every dtype on CPU and CUDA (skipped with a reason without a GPU), numpy inputs, awkward
sizes (N = 0, 1, 7; H = 1, 127, 1280; every hc), both shapes of post_layer_mix, non-contiguous
and misaligned views with NaN in the memory they must not read, NaN-poisoned outputs, the error
budget against PyTorch in the same dtype, bitwise determinism, autograd, torch.compile,
torch.library.opcheck, CUDA streams and graphs, and the error messages.
"""

import math

import numpy as np
import pytest
import torch

import fusekit
import reference
from compare import assert_bitwise_equal, assert_close, max_abs_error, to_torch64
from conftest import DEVICES, requires_cuda

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ARGS = ("x", "residual", "post_layer_mix", "comb_res_mix")
GRADS = ("grad_x", "grad_residual", "grad_post_layer_mix", "grad_comb_res_mix")


def make_inputs(rng, n, h, hc, dtype=torch.float32, device="cpu", post_dims=3):
    """Model-like inputs: activations ~ N(0, 1) in `dtype`, post mix in (0, 2), comb mix ~ N(0, 1),
    both mixes in float32."""
    x = rng.randn(n, h, dtype=dtype, device=device)
    residual = rng.randn(n, hc, h, dtype=dtype, device=device)
    post = 2 * torch.sigmoid(rng.randn(n, hc, *([1] if post_dims == 3 else []), device=device))
    comb = rng.randn(n, hc, hc, device=device)
    return x, residual, post, comb


def describe_case(rng, **kw):
    return f"seed {rng.seed}, " + ", ".join(f"{k}={v}" for k, v in kw.items())


def check_forward(out, inputs, context):
    ref64 = [to_torch64(t) for t in inputs]
    expected = reference.mhc_post(*ref64)
    scale = reference.mhc_post_abs(*ref64).clamp_min(1)
    assert_close(out, expected, scale=scale, dtype=inputs[0].dtype, name="out", context=context)


def check_backward(grads, grad_out, inputs, context):
    ref64 = [to_torch64(t) for t in (grad_out, *inputs)]
    expected = reference.mhc_post_backward(*ref64)
    scales = reference.mhc_post_backward_abs(*ref64)
    for name, got, exp, scale, like in zip(GRADS, grads, expected, scales, inputs):
        assert_close(got, exp, scale=scale.clamp_min(1), dtype=like.dtype, name=name, context=context)


# Views of the same values in other memory layouts. The memory around and between the elements is
# NaN, so that a kernel reading what it must not leaks NaN into the result.
LAYOUTS = {
    "contiguous": "a plain contiguous tensor",
    "offset1": "base pointer one element past an aligned allocation",
    "padded": "rows padded by 8 elements (row starts stay 16-byte aligned)",
    "shifted": "rows padded and starting one element in (misaligned rows)",
    "strided": "last axis with stride 2",
    "transposed": "last two axes swapped in memory",
}


def relayout(t, layout):
    """(view, buffer): a view holding t's values in `layout`, and the NaN-filled buffer under it."""
    shape, last = tuple(t.shape), t.shape[-1]
    full = lambda *s: torch.full(s, math.nan, dtype=t.dtype, device=t.device)  # noqa: E731
    if layout == "contiguous":
        buf = full(*shape)
        view = buf
    elif layout == "offset1":
        buf = full(t.numel() + 1)
        view = buf[1:].view(shape)
    elif layout == "padded":
        buf = full(*shape[:-1], last + 8)
        view = buf[..., :last]
    elif layout == "shifted":
        buf = full(*shape[:-1], last + 3)
        view = buf[..., 1 : last + 1]
    elif layout == "strided":
        buf = full(*shape[:-1], 2 * last)
        view = buf[..., ::2]
    elif layout == "transposed":
        buf = full(*shape[:-2], shape[-1], shape[-2])
        view = buf.transpose(-1, -2)
    else:
        raise ValueError(layout)
    view.copy_(t)
    return view, buf


def untouched_nan_count(buf, view):
    """How many NaN the buffer must still hold outside the view after an output was written."""
    return buf.numel() - view.numel()


# ------------------------------------------------------------------------------ forward


@pytest.mark.parametrize("post_dims", [2, 3])
@pytest.mark.parametrize("hc", [1, 3, 4, 8])
@pytest.mark.parametrize("h", [1, 127, 1280])
@pytest.mark.parametrize("n", [0, 1, 7])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_forward(rng, device, dtype, n, h, hc, post_dims):
    inputs = make_inputs(rng, n, h, hc, dtype, device, post_dims)
    out = fusekit.mhc_post(*inputs)
    assert isinstance(out, torch.Tensor) and out.device == inputs[0].device
    assert out.is_contiguous()
    check_forward(out, inputs, describe_case(rng, device=device, N=n, H=h, hc=hc, post_dims=post_dims))


@pytest.mark.parametrize("h", [264, 263], ids=["vector_path", "scalar_path"])
@pytest.mark.parametrize("hc", range(1, 9))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_forward_every_hc(rng, device, dtype, hc, h):
    """One case per compiled kernel: each hc, with H a multiple of the vector width or not."""
    inputs = make_inputs(rng, 5, h, hc, dtype, device)
    check_forward(fusekit.mhc_post(*inputs), inputs, describe_case(rng, device=device, hc=hc, H=h))


@pytest.mark.parametrize("h", [1280, 127])
@pytest.mark.parametrize(
    "arg,layout",
    [("x", lay) for lay in ("offset1", "padded", "shifted", "strided")]
    + [("residual", lay) for lay in ("offset1", "padded", "shifted", "strided", "transposed")]
    + [("post_layer_mix", lay) for lay in ("offset1", "strided", "transposed")]
    + [("comb_res_mix", lay) for lay in ("offset1", "transposed")]
    + [("all", "shifted"), ("all", "transposed")],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_forward_input_layouts(rng, device, dtype, arg, layout, h):
    inputs = make_inputs(rng, 7, h, 4, dtype, device)
    views = list(inputs)
    for i, name in enumerate(ARGS):
        if arg in (name, "all"):
            views[i], _ = relayout(inputs[i], layout)
    out = fusekit.mhc_post(*views)
    check_forward(out, inputs, describe_case(rng, device=device, arg=arg, layout=LAYOUTS[layout], H=h))


@pytest.mark.parametrize("layout", ["contiguous", "offset1", "padded", "shifted", "strided", "transposed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_forward_out_poisoned(rng, device, dtype, layout):
    """out= filled with NaN beforehand: every element is written, nothing around it is."""
    inputs = make_inputs(rng, 7, 1280, 4, dtype, device)
    out, buf = relayout(torch.empty(7, 4, 1280, dtype=dtype, device=device), layout)
    out.fill_(math.nan)
    got = fusekit.mhc_post(*inputs, out=out)
    assert got is out
    check_forward(out, inputs, describe_case(rng, device=device, out_layout=LAYOUTS[layout]))
    assert int(torch.isnan(buf).sum()) == untouched_nan_count(buf, out), "wrote outside out"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_forward_deterministic(rng, device, dtype):
    inputs = make_inputs(rng, 64, 1280, 4, dtype, device)
    assert_bitwise_equal(fusekit.mhc_post(*inputs), fusekit.mhc_post(*inputs), name="out",
                         context=describe_case(rng, device=device))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_error_budget(rng, device, dtype):
    """The fast path's error against float64 is at most twice that of the same formula computed
    by PyTorch in the operator's dtypes (activations in `dtype`, mixes in float32)."""
    n, h, hc = 64, 1280, 4
    inputs = make_inputs(rng, n, h, hc, dtype, device)
    grad_out = rng.randn(n, hc, h, dtype=dtype, device=device)
    ref64 = [to_torch64(t) for t in inputs]
    context = describe_case(rng, device=device, N=n, H=h, hc=hc)

    def budget(name, ours, torch_same_dtype, exact):
        # A floor of 16 float32 ulps of the largest value keeps an exact PyTorch result from
        # demanding exactness.
        floor = 2**-20 * to_torch64(exact).abs().max().item()
        err, base = max_abs_error(ours, exact), max_abs_error(torch_same_dtype, exact)
        assert err <= 2 * base + floor, (
            f"{name}: max |error| {err:.3g} exceeds twice PyTorch's {base:.3g} (+ {floor:.2g}) [{context}]")

    budget("out", fusekit.mhc_post(*inputs), reference.mhc_post(*inputs), reference.mhc_post(*ref64))
    ours = fusekit.mhc_post_backward(grad_out, *inputs)
    torch_same = reference.mhc_post_backward(grad_out, *inputs)
    exact = reference.mhc_post_backward(to_torch64(grad_out), *ref64)
    for name, a, b, e in zip(GRADS, ours, torch_same, exact):
        budget(name, a, b, e)


# ------------------------------------------------------------------------------ backward


@pytest.mark.parametrize("post_dims", [2, 3])
@pytest.mark.parametrize("hc", [1, 3, 4, 8])
@pytest.mark.parametrize("h", [1, 127, 1280])
@pytest.mark.parametrize("n", [0, 1, 7])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_backward(rng, device, dtype, n, h, hc, post_dims):
    inputs = make_inputs(rng, n, h, hc, dtype, device, post_dims)
    grad_out = rng.randn(n, hc, h, dtype=dtype, device=device)
    grads = fusekit.mhc_post_backward(grad_out, *inputs)
    assert isinstance(grads, tuple) and len(grads) == 4
    for g, like in zip(grads, inputs):
        assert g.shape == like.shape and g.device == like.device
    check_backward(grads, grad_out, inputs,
                   describe_case(rng, device=device, N=n, H=h, hc=hc, post_dims=post_dims))


@pytest.mark.parametrize("hc", range(1, 9))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_backward_every_hc(rng, device, dtype, hc):
    # N = 2 and a long row, so that CUDA splits rows into chunks and adds its reduction pass.
    inputs = make_inputs(rng, 2, 8192, hc, dtype, device)
    grad_out = rng.randn(2, hc, 8192, dtype=dtype, device=device)
    check_backward(fusekit.mhc_post_backward(grad_out, *inputs), grad_out, inputs,
                   describe_case(rng, device=device, hc=hc))


@pytest.mark.parametrize(
    "arg,layout",
    [("grad_out", lay) for lay in ("offset1", "shifted", "strided", "transposed", "expanded")]
    + [("x", "shifted"), ("residual", "transposed"), ("post_layer_mix", "strided"),
       ("comb_res_mix", "transposed"), ("all", "shifted")],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_backward_input_layouts(rng, device, dtype, arg, layout):
    n, h, hc = 7, 1280, 4
    inputs = make_inputs(rng, n, h, hc, dtype, device)
    grad_out = rng.randn(n, hc, h, dtype=dtype, device=device)
    if layout == "expanded":  # what out.sum().backward() hands over: one value, stride 0
        grad_out = grad_out[:1, :1, :1].expand(n, hc, h)
    views = [grad_out, *inputs]
    for i, name in enumerate(("grad_out", *ARGS)):
        if arg in (name, "all") and layout != "expanded":
            views[i], _ = relayout(views[i], layout)
    grads = fusekit.mhc_post_backward(*views)
    check_backward(grads, grad_out, inputs, describe_case(rng, device=device, arg=arg, layout=layout))


@pytest.mark.parametrize("shape", [(3, 8192, 4), (64, 1280, 4), (7, 127, 3)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_backward_deterministic(rng, device, dtype, shape):
    n, h, hc = shape
    inputs = make_inputs(rng, n, h, hc, dtype, device)
    grad_out = rng.randn(n, hc, h, dtype=dtype, device=device)
    first = fusekit.mhc_post_backward(grad_out, *inputs)
    second = fusekit.mhc_post_backward(grad_out, *inputs)
    for name, a, b in zip(GRADS, first, second):
        assert_bitwise_equal(a, b, name=name, context=describe_case(rng, device=device, shape=shape))


# ------------------------------------------------------------------------------ numpy


@pytest.mark.parametrize("layout", ["contiguous", "shifted", "transposed"])
@pytest.mark.parametrize("post_dims", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_numpy(rng, dtype, post_dims, layout):
    inputs = make_inputs(rng, 7, 127, 4, dtype, post_dims=post_dims)
    grad_out = rng.randn(7, 4, 127, dtype=dtype)
    arrays = [relayout(t, layout)[0].numpy() for t in inputs]
    context = describe_case(rng, layout=layout, post_dims=post_dims)
    out = fusekit.mhc_post(*arrays)
    assert type(out) is np.ndarray and out.dtype == arrays[0].dtype
    check_forward(out, inputs, context)
    grads = fusekit.mhc_post_backward(grad_out.numpy(), *arrays)
    assert all(type(g) is np.ndarray for g in grads)
    check_backward(grads, grad_out, inputs, context)


def test_numpy_out(rng):
    inputs = make_inputs(rng, 7, 1280, 4)
    out = np.full((7, 4, 1280), np.nan, dtype=np.float32)
    got = fusekit.mhc_post(*(t.numpy() for t in inputs), out=out)
    assert got is out
    check_forward(out, inputs, describe_case(rng))


# ------------------------------------------------------------------------------ autograd


@pytest.mark.parametrize("post_dims", [2, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_autograd(rng, device, dtype, post_dims):
    inputs = make_inputs(rng, 7, 1280, 4, dtype, device, post_dims)
    leaves = [t.clone().requires_grad_() for t in inputs]
    grad_out = rng.randn(7, 4, 1280, dtype=dtype, device=device)
    out = fusekit.mhc_post(*leaves)
    assert out.requires_grad and out.grad_fn is not None
    context = describe_case(rng, device=device, post_dims=post_dims)
    check_forward(out.detach(), inputs, context)
    out.backward(grad_out)
    check_backward([t.grad for t in leaves], grad_out, inputs, context)


@pytest.mark.parametrize("device", DEVICES)
def test_eager_autograd_matches_the_op(rng, device):
    """Eager autograd takes fusekit's autograd.Function (tens of microseconds of host time where
    the op's wrapper costs hundreds), bitwise the registered op's out and gradients."""
    inputs = make_inputs(rng, 7, 1280, 4, torch.bfloat16, device, 2)
    grad_out = rng.randn(7, 4, 1280, dtype=torch.bfloat16, device=device)
    context = describe_case(rng, device=device)
    results = []
    for call in (fusekit.mhc_post, torch.ops.fusekit.mhc_post):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = call(*leaves)
        out.backward(grad_out)
        results.append((out.detach(), [t.grad for t in leaves], type(out.grad_fn).__name__))
    (out, grads, node), (op_out, op_grads, _) = results
    assert node == "MhcPostFunctionBackward", node
    assert_bitwise_equal(out, op_out, name="out", context=context)
    for name, g, op_g in zip(("grad_x", "grad_residual", "grad_post", "grad_comb"), grads,
                             op_grads):
        assert_bitwise_equal(g, op_g, name=name, context=context)


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # vmap's loop over the op
@pytest.mark.parametrize("device", DEVICES)
def test_torch_func_grad(rng, device):
    """torch.func.grad and vjp differentiate through the eager Function's torch.func form, bitwise
    as torch.autograd does; under vmap (whose tensors do not require grad) the call takes the
    registered op, which torch runs slice by slice, and autograd outside differentiates that."""
    inputs = make_inputs(rng, 7, 256, 4, torch.bfloat16, device, 2)
    grad_out = rng.randn(7, 4, 256, dtype=torch.bfloat16, device=device)
    context = describe_case(rng, device=device)
    leaves = [t.clone().requires_grad_() for t in inputs]
    fusekit.mhc_post(*leaves).backward(grad_out)
    grads = torch.func.grad(lambda *a: (fusekit.mhc_post(*a).float() * grad_out).sum(),
                            argnums=(0, 1, 2, 3))(*inputs)
    _, vjp = torch.func.vjp(fusekit.mhc_post, *inputs)
    for name, g, v, leaf in zip(("grad_x", "grad_residual", "grad_post", "grad_comb"), grads,
                                vjp(grad_out), leaves):
        assert_bitwise_equal(g, leaf.grad, name=f"torch.func.grad {name}", context=context)
        assert_bitwise_equal(v, leaf.grad, name=f"vjp {name}", context=context)
    batched = [torch.stack([t, t]).requires_grad_() for t in inputs]
    torch.func.vmap(fusekit.mhc_post)(*batched).backward(torch.stack([grad_out, grad_out]))
    for name, b, leaf in zip(("grad_x", "grad_residual", "grad_post", "grad_comb"), batched,
                             leaves):
        for i in range(2):
            assert_bitwise_equal(b.grad[i], leaf.grad, name=f"vmap {name} {i}", context=context)


@pytest.mark.parametrize("device", DEVICES)
def test_autograd_sum(rng, device):
    """out.sum().backward() hands the backward a stride-0 gradient."""
    inputs = make_inputs(rng, 7, 1280, 4, torch.bfloat16, device)
    leaves = [t.clone().requires_grad_() for t in inputs]
    fusekit.mhc_post(*leaves).sum().backward()
    grad_out = torch.ones(7, 4, 1280, dtype=torch.bfloat16, device=device)
    check_backward([t.grad for t in leaves], grad_out, inputs, describe_case(rng, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_with_leaves_that_require_grad(rng, device):
    inputs = make_inputs(rng, 7, 127, 4, torch.float32, device)
    leaves = [t.clone().requires_grad_() for t in inputs]
    with torch.no_grad():
        out = fusekit.mhc_post(*leaves)
    assert not out.requires_grad
    check_forward(out, inputs, describe_case(rng, device=device))


# ------------------------------------------------------------------------------ torch.library


def opcheck_inputs(rng, device, dtype, post_dims, requires_grad):
    inputs = make_inputs(rng, 5, 96, 4, dtype, device, post_dims)
    return [t.requires_grad_(requires_grad) for t in inputs]


@pytest.mark.parametrize("post_dims", [2, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_forward(rng, device, dtype, post_dims):
    inputs = opcheck_inputs(rng, device, dtype, post_dims, requires_grad=True)
    torch.library.opcheck(torch.ops.fusekit.mhc_post.default, tuple(inputs))


@pytest.mark.parametrize("post_dims", [2, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_backward(rng, device, dtype, post_dims):
    inputs = opcheck_inputs(rng, device, dtype, post_dims, requires_grad=False)
    grad_out = rng.randn(5, 4, 96, dtype=dtype, device=device)
    torch.library.opcheck(torch.ops.fusekit.mhc_post_backward.default, (grad_out, *inputs))


def compiled_step(fn, inputs, grad_out):
    """Runs fn(*inputs) forward and backward; returns the output and the input gradients."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves]


def post_mix(x, residual, post_layer_mix, comb_res_mix):
    return fusekit.mhc_post(x, residual, post_layer_mix, comb_res_mix)


@pytest.mark.parametrize("post_dims", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compile_aot_eager(rng, dtype, post_dims):
    torch._dynamo.reset()
    inputs = make_inputs(rng, 7, 1280, 4, dtype, "cpu", post_dims)
    grad_out = rng.randn(7, 4, 1280, dtype=dtype)
    fn = torch.compile(post_mix, backend="aot_eager", fullgraph=True)
    out, grads = compiled_step(fn, inputs, grad_out)
    context = describe_case(rng, backend="aot_eager", post_dims=post_dims)
    check_forward(out, inputs, context)
    check_backward(grads, grad_out, inputs, context)


def test_compile_dynamic_shapes(rng):
    torch._dynamo.reset()
    fn = torch.compile(post_mix, backend="aot_eager", fullgraph=True, dynamic=True)
    for n, h in [(7, 1280), (3, 127)]:
        inputs = make_inputs(rng, n, h, 4)
        check_forward(fn(*inputs), inputs, describe_case(rng, N=n, H=h, dynamic=True))


def test_compile_out(rng):
    torch._dynamo.reset()

    def fill(x, residual, post_layer_mix, comb_res_mix, out):
        return fusekit.mhc_post(x, residual, post_layer_mix, comb_res_mix, out=out)

    inputs = make_inputs(rng, 7, 1280, 4)
    out = torch.full((7, 4, 1280), math.nan)
    got = torch.compile(fill, backend="aot_eager", fullgraph=True)(*inputs, out)
    check_forward(out, inputs, describe_case(rng, compiled_out=True))
    check_forward(got, inputs, describe_case(rng, compiled_out=True))


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compile_inductor_cuda(rng, dtype):
    torch._dynamo.reset()

    def block(x, residual, post_layer_mix, comb_res_mix):  # a neighbour for inductor to fuse
        return fusekit.mhc_post(x * 2, residual, post_layer_mix, comb_res_mix) + 1

    inputs = make_inputs(rng, 7, 1280, 4, dtype, "cuda")
    grad_out = rng.randn(7, 4, 1280, dtype=dtype, device="cuda")
    out, grads = compiled_step(torch.compile(block, fullgraph=True), inputs, grad_out)
    ref_out, ref_grads = compiled_step(block, inputs, grad_out)
    context = describe_case(rng, backend="inductor")
    assert_close(out, ref_out, name="out", context=context)
    for name, g, r in zip(GRADS, grads, ref_grads):
        assert_close(g, r, name=name, context=context)


# ------------------------------------------------------------------------------ CUDA specifics


@requires_cuda
def test_cuda_runs_on_current_stream(rng):
    """On a side stream, and captured into a CUDA graph (which fails if any work went to
    another stream)."""
    inputs = make_inputs(rng, 7, 1280, 4, torch.bfloat16, "cuda")
    grad_out = rng.randn(7, 4, 1280, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = fusekit.mhc_post(*inputs)
        grads = fusekit.mhc_post_backward(grad_out, *inputs)
    side.synchronize()
    context = describe_case(rng, stream="side")
    check_forward(out, inputs, context)
    check_backward(grads, grad_out, inputs, context)

    graph = torch.cuda.CUDAGraph()
    out.fill_(math.nan)
    with torch.cuda.graph(graph):
        fusekit.mhc_post(*inputs, out=out)
        captured_grads = fusekit.mhc_post_backward(grad_out, *inputs)
    graph.replay()
    torch.cuda.synchronize()
    context = describe_case(rng, stream="graph replay")
    check_forward(out, inputs, context)
    check_backward(captured_grads, grad_out, inputs, context)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_second_device(rng):
    """Both devices in one process, each called while device 0 is current: what a kernel sets up
    once (its shared-memory opt-in, library handles, workspaces) is per device."""
    for device in ("cuda:0", "cuda:1"):
        inputs = make_inputs(rng, 7, 1280, 4, torch.bfloat16, device)
        grad_out = rng.randn(7, 4, 1280, dtype=torch.bfloat16, device=device)
        with torch.cuda.device(0):
            out = fusekit.mhc_post(*inputs)
            grads = fusekit.mhc_post_backward(grad_out, *inputs)
        assert out.device == torch.device(device)
        context = describe_case(rng, device=device)
        check_forward(out, inputs, context)
        check_backward(grads, grad_out, inputs, context)


# ------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("device", DEVICES)
def test_error_wrong_dtype(rng, device):
    x, residual, post, comb = make_inputs(rng, 3, 5, 4, torch.float32, device)
    with pytest.raises(fusekit.Error, match=r"^mhc_post: x has dtype float64, expected bfloat16, "
                                            r"float16 or float32$"):
        fusekit.mhc_post(x.double(), residual, post, comb)
    with pytest.raises(fusekit.Error, match=r"^mhc_post: residual has dtype bfloat16 but x has float32"):
        fusekit.mhc_post(x, residual.bfloat16(), post, comb)
    with pytest.raises(fusekit.Error, match=r"^mhc_post: post_layer_mix has dtype bfloat16, expected float32$"):
        fusekit.mhc_post(x, residual, post.bfloat16(), comb)
    # the same message through the autograd op
    with pytest.raises(fusekit.Error, match=r"^mhc_post: x has dtype float64, expected bfloat16"):
        fusekit.mhc_post(x.double().requires_grad_(), residual, post, comb)


@pytest.mark.parametrize("device", DEVICES)
def test_error_shape_mismatch(rng, device):
    x, residual, post, comb = make_inputs(rng, 3, 5, 4, torch.float32, device)
    with pytest.raises(fusekit.Error, match=r"^mhc_post: x has shape \[3, 6\], expected \[N, H\] = \[3, 5\]$"):
        fusekit.mhc_post(torch.zeros(3, 6, device=device), residual, post, comb)
    with pytest.raises(fusekit.Error, match=r"^mhc_post: comb_res_mix has shape \[3, 4, 3\], "
                                            r"expected \[N, hc, hc\] = \[3, 4, 4\]$"):
        fusekit.mhc_post(x, residual, post, comb[..., :3])
    with pytest.raises(fusekit.Error, match=r"^mhc_post: residual \[3, 9, 5\] has hc = 9 streams, "
                                            r"expected 1 <= hc <= 8$"):
        fusekit.mhc_post(x, torch.zeros(3, 9, 5, device=device), post, comb)
    grad_out = torch.zeros(3, 4, 6, device=device)
    with pytest.raises(fusekit.Error, match=r"^mhc_post_backward: grad_out has shape \[3, 4, 6\], "
                                            r"expected \[N, hc, H\] = \[3, 4, 5\]$"):
        fusekit.mhc_post_backward(grad_out, x, residual, post, comb)


@requires_cuda
def test_error_mixed_devices(rng):
    x, residual, post, comb = make_inputs(rng, 3, 5, 4, torch.float32, "cuda")
    with pytest.raises(fusekit.Error, match=r"^mhc_post: residual is on cpu but x is on cuda:0; "
                                            r"expected one device$"):
        fusekit.mhc_post(x, residual.cpu(), post, comb)
    with pytest.raises(fusekit.Error, match=r"^mhc_post: comb_res_mix is on cpu but x is on cuda:0"):
        fusekit.mhc_post(x, residual, post, comb.cpu())


def test_error_mixed_frameworks(rng):
    x, residual, post, comb = make_inputs(rng, 3, 5, 4)
    with pytest.raises(fusekit.Error, match=r"^mhc_post: residual is a numpy.ndarray but x is a "
                                            r"torch.Tensor; expected arrays of one framework$"):
        fusekit.mhc_post(x, residual.numpy(), post, comb)
    with pytest.raises(fusekit.Error, match=r"^mhc_post: comb_res_mix is a torch.Tensor but x is a "
                                            r"numpy.ndarray"):
        fusekit.mhc_post(x.numpy(), residual.numpy(), post.numpy(), comb)
    with pytest.raises(fusekit.Error, match=r"^mhc_post: x is a list, expected a torch.Tensor or a "
                                            r"numpy.ndarray$"):
        fusekit.mhc_post(x.tolist(), residual, post, comb)


@pytest.mark.parametrize("device", DEVICES)
def test_error_out(rng, device):
    inputs = make_inputs(rng, 3, 5, 4, torch.float32, device)
    with pytest.raises(fusekit.Error, match=r"^mhc_post: out has shape \[3, 4, 6\], expected "
                                            r"\[N, hc, H\] = \[3, 4, 5\]$"):
        fusekit.mhc_post(*inputs, out=torch.empty(3, 4, 6, device=device))
    with pytest.raises(fusekit.Error, match=r"^mhc_post: out has dtype bfloat16 but x has float32"):
        fusekit.mhc_post(*inputs, out=torch.empty(3, 4, 5, dtype=torch.bfloat16, device=device))
    with pytest.raises(fusekit.Error, match=r"^mhc_post: out overlaps residual in memory"):
        fusekit.mhc_post(*inputs, out=inputs[1])
    with pytest.raises(fusekit.Error, match=r"^mhc_post: out is a numpy.ndarray but the inputs are "
                                            r"torch.Tensors; expected out of the inputs' framework$"):
        fusekit.mhc_post(*inputs, out=np.empty((3, 4, 5), np.float32))
    leaves = [t.clone().requires_grad_() for t in inputs]
    with pytest.raises(fusekit.Error, match=r"^mhc_post: out= was given while autograd records"):
        fusekit.mhc_post(*leaves, out=torch.empty(3, 4, 5, device=device))


def test_error_compiled_out_wrong_shape(rng):
    torch._dynamo.reset()

    def fill(x, residual, post_layer_mix, comb_res_mix, out):
        return fusekit.mhc_post(x, residual, post_layer_mix, comb_res_mix, out=out)

    inputs = make_inputs(rng, 3, 5, 4)
    fn = torch.compile(fill, backend="aot_eager")
    with pytest.raises(Exception, match=r"mhc_post: out is float32 \[2, 3, 4, 5\] on cpu, expected "
                                        r"float32 \[3, 4, 5\] on cpu"):
        fn(*inputs, torch.empty(2, 3, 4, 5))
