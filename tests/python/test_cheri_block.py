"""fusekit.cheri_block, cheri_block_train, cheri_block_backward, dilated_conv_norm (and its
backward) and fusekit.torch.CheriBlock against a float64 PyTorch evaluation of the formula
(reference.cheri_block; float64 autograd through it gives the reference gradients).

Cases: C in {1, 3, 48, 80, 128} with dilations 1 to 256 (d >= L included, and L = 300 with
d < L up to 256), L = 1, N = 0; float32 within 1e-5 (relative to the largest element of each
result), float16 and bfloat16 within their rounding; float32 weights with half-precision
activations; zero MLP weights give exactly x; views over NaN-filled memory and NaN-poisoned
outputs; the seed model's CheriBlock state dict loading unchanged, with the same outputs and
gradients; the training path under autograd and the inference path without it; weights changed
in place between calls (nothing stale is served); bitwise determinism; numpy inputs;
torch.library.opcheck; torch.compile; CUDA streams and graphs; the error messages.

The CUDA parametrisations skip with "no CUDA backend yet" while fusekit's CUDA backend of this
operator only raises its "not implemented yet" error, and run for real once it lands.
"""

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fusekit
import fusekit.torch
import reference
from compare import Tol, assert_bitwise_equal, assert_close, dtype_name, to_torch64
from conftest import cuda_backend_mark, requires_cuda


def _tiny_call():
    x = torch.zeros(1, 4, 8, device="cuda")
    fusekit.cheri_block(x, torch.zeros(3, 8, device="cuda"), torch.zeros(16, 8, device="cuda"),
                        torch.zeros(8, 16, device="cuda"), 1)


requires_cuda_backend = cuda_backend_mark("cheri_block", _tiny_call)
DEVICES = ["cpu", pytest.param("cuda", marks=[requires_cuda, requires_cuda_backend])]
# Validation and empty inputs return before a backend is chosen: those cases run on CUDA already.
VALIDATION_DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
HALF_DTYPES = [torch.float16, torch.bfloat16]

# |got - expected| <= atol * max|expected| + rtol * |expected|, keyed by the activations' dtype:
# errors relative to the largest element of each result, since the weight gradients are sums
# over N L terms that cancel. float32 is held to 1e-5 (the CPU computes in float32 and the
# products of the training path run without TF32 in these checks); half precision to its
# rounding (one rounding of each result and of the intermediates the backends keep in it).
TOLERANCES = {
    "float32": Tol(rtol=1e-5, atol=1e-5),
    "float16": Tol(rtol=2**-9, atol=2**-9),
    "bfloat16": Tol(rtol=2**-6, atol=2**-6),
}
# float32 on CUDA where products run with 10-bit mantissas: the inference path (float16 operands)
# and the training path with TF32 (allow_tf32, the default). Their bound is 1e-3 relative on the
# whole tensor (the C++ CUDA suite checks it so); element by element, relative to the largest
# element, 4e-3: an element summing few products does not average their roundings out.
CUDA_FAST_FLOAT32 = Tol(rtol=4e-3, atol=4e-3)
CUDA_INFERENCE_FLOAT32 = CUDA_FAST_FLOAT32
RESIDUAL_SCALE = 0.15
WEIGHTS = ("conv_weight", "linear1_weight", "linear2_weight")
GRADS = ("grad_x", "grad_conv_weight", "grad_linear1_weight", "grad_linear2_weight")


# ------------------------------------------------------------------------------ helpers


def make_inputs(rng, n, length, c, *, expansion=2, dtype=torch.float32, weight_dtype=None,
                device="cpu"):
    """x [N, L, C] ~ N(0, 1) in dtype and the three weights (float32 unless weight_dtype): taps
    ~ N(0, 0.5^2), Linear weights ~ N(0, 1 / fan_in), larger than the model's initialisation so
    that the MLP branch matters in every check."""
    weight_dtype = weight_dtype or torch.float32
    hidden = expansion * c
    x = rng.randn(n, length, c, dtype=dtype, device=device)
    conv = (0.5 * rng.randn(3, c)).to(weight_dtype).to(device)
    w1 = (rng.randn(hidden, c) / math.sqrt(c)).to(weight_dtype).to(device)
    w2 = (rng.randn(c, hidden) / math.sqrt(hidden)).to(weight_dtype).to(device)
    return x, conv, w1, w2


def describe_case(rng, **kw):
    return f"seed {rng.seed}, " + ", ".join(f"{k}={v}" for k, v in kw.items())


def tol_for(dtype, device="cpu", inference=False):
    name = dtype_name(dtype)
    if name == "float32" and inference and str(device).startswith("cuda"):
        return CUDA_INFERENCE_FLOAT32
    return TOLERANCES[name]


def check(got, expected, like, name, context, tol, scale=None):
    """got against the float64 `expected`, in like's dtype, within tol relative to the largest
    element (or to `scale`, the magnitude behind each element, where given)."""
    __tracebackhide__ = True
    if scale is None and expected.numel():
        scale = to_torch64(expected).abs().max().clamp_min(1e-30)
    assert_close(got, expected, tol=tol, scale=scale, dtype=like.dtype, name=name,
                 context=context)


def check_out(out, inputs, dilation, context, *, inference, device="cpu"):
    __tracebackhide__ = True
    expected = reference.cheri_block(*(to_torch64(t) for t in inputs), dilation, RESIDUAL_SCALE)
    check(out, expected, inputs[0], "out", context, tol_for(inputs[0].dtype, device, inference))


def check_grads(grads, grad_out, inputs, dilation, context):
    __tracebackhide__ = True
    expected = reference.cheri_block_backward(to_torch64(grad_out),
                                              *(to_torch64(t) for t in inputs), dilation,
                                              RESIDUAL_SCALE)
    # autograd takes the training path with its default allow_tf32
    tf32 = inputs[0].is_cuda and inputs[0].dtype == torch.float32
    tol = CUDA_FAST_FLOAT32 if tf32 else tol_for(inputs[0].dtype)
    conv_scale = to_torch64(reference.conv_weight_grad_abs(grad_out, *inputs[:2], dilation,
                                                           *inputs[2:], RESIDUAL_SCALE))
    scales = (None, conv_scale.clamp_min(to_torch64(expected[1]).abs().max()), None, None)
    for name, got, exp, like, scale in zip(GRADS, grads, expected, inputs, scales):
        check(got, exp, like, name, context, tol, scale)


def check_stats(mean, rstd, x, conv, dilation, context):
    __tracebackhide__ = True
    _, exp_mean, exp_rstd = reference.dilated_conv_norm(to_torch64(x), to_torch64(conv), dilation)
    tol = TOLERANCES["float32"]
    for name, got, exp in (("mean", mean, exp_mean), ("rstd", rstd, exp_rstd)):
        assert_close(got, exp, tol=tol, dtype=torch.float32, name=name, context=context)


def nan_like(shape, t):
    return torch.full(shape, math.nan, dtype=t.dtype, device=t.device)


def block_step(inputs, grad_out, dilation):
    """fusekit.cheri_block forward and backward under autograd: (out, grads of the inputs)."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = fusekit.cheri_block(*leaves, dilation)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves]


# ------------------------------------------------------------------------------ inference


CHANNELS = [1, 3, 48, 80, 128]
DILATIONS = [1, 2, 4, 16, 36, 37, 256]  # with L = 37: d = L - 1, d = L and d >> L


@pytest.mark.parametrize("dilation", DILATIONS)
@pytest.mark.parametrize("c", CHANNELS)
@pytest.mark.parametrize("device", DEVICES)
def test_inference(rng, device, c, dilation):
    inputs = make_inputs(rng, 2, 37, c, device=device)
    out = fusekit.cheri_block(*inputs, dilation)
    assert isinstance(out, torch.Tensor) and out.device == inputs[0].device
    assert out.shape == inputs[0].shape and out.dtype == torch.float32 and out.is_contiguous()
    assert not out.requires_grad
    check_out(out, inputs, dilation, describe_case(rng, device=device, C=c, d=dilation),
              inference=True, device=device)


@pytest.mark.parametrize("dilation", [1, 64, 255, 256, 299, 300])
@pytest.mark.parametrize("device", DEVICES)
def test_long_sequence(rng, device, dilation):
    """L = 300: dilations below L up to 256, and d = L - 1, L."""
    inputs = make_inputs(rng, 2, 300, 48, device=device)
    context = describe_case(rng, device=device, L=300, d=dilation)
    check_out(fusekit.cheri_block(*inputs, dilation), inputs, dilation, context, inference=True,
              device=device)
    out, mean, rstd = fusekit.cheri_block_train(*inputs, dilation, allow_tf32=False)
    check_out(out, inputs, dilation, context, inference=False)
    grad_out = rng.randn(2, 300, 48, device=device)
    grads = fusekit.cheri_block_backward(grad_out, *inputs, mean, rstd, dilation,
                                         allow_tf32=False)
    check_grads(grads, grad_out, inputs, dilation, context)


@pytest.mark.parametrize("weights", ["float32", "same"])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_half_precision(rng, device, dtype, weights):
    """float16 and bfloat16 activations with float32 weights (the model's) or weights in x's
    dtype: inference, training forward and backward within the dtype's rounding."""
    weight_dtype = torch.float32 if weights == "float32" else dtype
    inputs = make_inputs(rng, 2, 45, 48, dtype=dtype, weight_dtype=weight_dtype, device=device)
    context = describe_case(rng, device=device, dtype=dtype, weights=weights)
    out = fusekit.cheri_block(*inputs, 3)
    assert out.dtype == dtype
    check_out(out, inputs, 3, context, inference=True, device=device)
    out, mean, rstd = fusekit.cheri_block_train(*inputs, 3)
    check_out(out, inputs, 3, context, inference=False)
    grad_out = rng.randn(2, 45, 48, dtype=dtype, device=device)
    grads = fusekit.cheri_block_backward(grad_out, *inputs, mean, rstd, 3)
    for g, t in zip(grads, inputs):
        assert g.dtype == t.dtype and g.shape == t.shape
    check_grads(grads, grad_out, inputs, 3, context)


@pytest.mark.parametrize("expansion", [1, 3, 4])
@pytest.mark.parametrize("device", DEVICES)
def test_expansions(rng, device, expansion):
    inputs = make_inputs(rng, 2, 20, 24, expansion=expansion, device=device)
    context = describe_case(rng, device=device, expansion=expansion)
    check_out(fusekit.cheri_block(*inputs, 2), inputs, 2, context, inference=True, device=device)
    grad_out = rng.randn(2, 20, 24, device=device)
    out, mean, rstd = fusekit.cheri_block_train(*inputs, 2, allow_tf32=False)
    check_grads(fusekit.cheri_block_backward(grad_out, *inputs, mean, rstd, 2, allow_tf32=False),
                grad_out, inputs, 2, context)


@pytest.mark.parametrize("residual_scale,eps", [(1.0, 1e-3), (0.15, 1e-5), (-0.5, 0.1)])
@pytest.mark.parametrize("device", DEVICES)
def test_residual_scale_and_eps(rng, device, residual_scale, eps):
    inputs = make_inputs(rng, 2, 20, 16, device=device)
    grad_out = rng.randn(2, 20, 16, device=device)
    context = describe_case(rng, device=device, residual_scale=residual_scale, eps=eps)
    ref = [to_torch64(t) for t in inputs]
    expected = reference.cheri_block(*ref, 5, residual_scale, eps)
    tol = TOLERANCES["float32"]
    check(fusekit.cheri_block(*inputs, 5, residual_scale, eps=eps), expected, inputs[0], "out",
          context, tol_for(torch.float32, device, inference=True))
    out, mean, rstd = fusekit.cheri_block_train(*inputs, 5, residual_scale, eps=eps,
                                                allow_tf32=False)
    check(out, expected, inputs[0], "out", context, tol)
    grads = fusekit.cheri_block_backward(grad_out, *inputs, mean, rstd, 5, residual_scale,
                                         eps=eps, allow_tf32=False)
    expected = reference.cheri_block_backward(to_torch64(grad_out), *ref, 5, residual_scale, eps)
    conv_scale = reference.conv_weight_grad_abs(grad_out, *inputs[:2], 5, *inputs[2:],
                                                residual_scale, eps)
    for name, g, e, like in zip(GRADS, grads, expected, inputs):
        check(g, e, like, name, context, tol, conv_scale if name == GRADS[1] else None)


@pytest.mark.parametrize("zero", ["linear1", "linear2", "both"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_zero_mlp_weights_give_x(rng, device, dtype, zero):
    """GELU(0) = 0: with either Linear weight zero the block is exactly the identity."""
    x, conv, w1, w2 = make_inputs(rng, 3, 29, 48, dtype=dtype, device=device)
    if zero in ("linear1", "both"):
        w1 = torch.zeros_like(w1)
    if zero in ("linear2", "both"):
        w2 = torch.zeros_like(w2)
    context = describe_case(rng, device=device, zero=zero)
    assert_bitwise_equal(fusekit.cheri_block(x, conv, w1, w2, 4), x, name="inference out",
                         context=context)
    assert_bitwise_equal(fusekit.cheri_block_train(x, conv, w1, w2, 4)[0], x,
                         name="training out", context=context)


@pytest.mark.parametrize("dilation", [1, 5])
@pytest.mark.parametrize("c", [1, 48])
@pytest.mark.parametrize("device", DEVICES)
def test_single_position(rng, device, c, dilation):
    """L = 1 (every dilation reaches outside the sequence): only the centre tap counts."""
    inputs = make_inputs(rng, 3, 1, c, device=device)
    context = describe_case(rng, device=device, C=c, d=dilation)
    check_out(fusekit.cheri_block(*inputs, dilation), inputs, dilation, context, inference=True,
              device=device)
    out, mean, rstd = fusekit.cheri_block_train(*inputs, dilation, allow_tf32=False)
    check_out(out, inputs, dilation, context, inference=False)
    grad_out = rng.randn(3, 1, c, device=device)
    check_grads(fusekit.cheri_block_backward(grad_out, *inputs, mean, rstd, dilation,
                                             allow_tf32=False),
                grad_out, inputs, dilation, context)


@pytest.mark.parametrize("device", VALIDATION_DEVICES)
def test_empty(device):
    """N = 0: empty results of the right shapes; the weight gradients are zero."""
    x = torch.empty(0, 7, 8, device=device)
    conv, w1, w2 = (torch.ones(s, device=device) for s in ((3, 8), (16, 8), (8, 16)))
    assert fusekit.cheri_block(x, conv, w1, w2, 2).shape == (0, 7, 8)
    out, mean, rstd = fusekit.cheri_block_train(x, conv, w1, w2, 2)
    assert out.shape == (0, 7, 8) and mean.shape == (0,) and rstd.shape == (0,)
    grads = fusekit.cheri_block_backward(x, x, conv, w1, w2, mean, rstd, 2)
    assert grads[0].shape == (0, 7, 8)
    for g, w in zip(grads[1:], (conv, w1, w2)):
        assert g.shape == w.shape and bool((g == 0).all())


# ------------------------------------------------------------------------------ training


@pytest.mark.parametrize("dilation", DILATIONS)
@pytest.mark.parametrize("c", CHANNELS)
@pytest.mark.parametrize("device", DEVICES)
def test_train_and_backward(rng, device, c, dilation):
    inputs = make_inputs(rng, 2, 37, c, device=device)
    context = describe_case(rng, device=device, C=c, d=dilation)
    out, mean, rstd = fusekit.cheri_block_train(*inputs, dilation, allow_tf32=False)
    assert out.shape == inputs[0].shape and mean.shape == (2,) and rstd.shape == (2,)
    assert mean.dtype == torch.float32 and rstd.dtype == torch.float32
    check_out(out, inputs, dilation, context, inference=False)
    check_stats(mean, rstd, inputs[0], inputs[1], dilation, context)
    grad_out = rng.randn(2, 37, c, device=device)
    grads = fusekit.cheri_block_backward(grad_out, *inputs, mean, rstd, dilation,
                                         allow_tf32=False)
    for g, t in zip(grads, inputs):
        assert g.shape == t.shape and g.dtype == t.dtype and g.device == t.device
    check_grads(grads, grad_out, inputs, dilation, context)


@pytest.mark.parametrize("dilation", [1, 7, 37, 256])
@pytest.mark.parametrize("c", [1, 3, 80])
@pytest.mark.parametrize("device", DEVICES)
def test_dilated_conv_norm(rng, device, c, dilation):
    x, conv, _, _ = make_inputs(rng, 3, 37, c, device=device)
    context = describe_case(rng, device=device, C=c, d=dilation)
    y, mean, rstd = fusekit.dilated_conv_norm(x, conv, dilation)
    exp_y, _, _ = reference.dilated_conv_norm(to_torch64(x), to_torch64(conv), dilation)
    tol = TOLERANCES["float32"]
    check(y, exp_y, x, "y", context, tol)
    check_stats(mean, rstd, x, conv, dilation, context)
    grad_y = rng.randn(3, 37, c, device=device)
    grad_x, grad_conv = fusekit.dilated_conv_norm_backward(grad_y, x, conv, mean, rstd, dilation)
    exp = reference.dilated_conv_norm_backward(to_torch64(grad_y), to_torch64(x),
                                               to_torch64(conv), dilation)
    check(grad_x, exp[0], x, "grad_x", context, tol)
    check(grad_conv, exp[1], conv, "grad_conv_weight", context, tol,
          reference.conv_weight_grad_abs(grad_y, x, conv, dilation))


@pytest.mark.parametrize("device", DEVICES)
def test_dilated_conv_norm_autograd(rng, device):
    x, conv, _, _ = make_inputs(rng, 2, 30, 16, device=device)
    leaves = [t.clone().requires_grad_() for t in (x, conv)]
    y, mean, rstd = fusekit.dilated_conv_norm(*leaves, 4)
    assert y.grad_fn is not None and not mean.requires_grad and not rstd.requires_grad
    grad_y = rng.randn(2, 30, 16, device=device)
    y.backward(grad_y)
    exp = reference.dilated_conv_norm_backward(to_torch64(grad_y), to_torch64(x),
                                               to_torch64(conv), 4)
    context = describe_case(rng, device=device)
    tol = TOLERANCES["float32"]
    check(leaves[0].grad, exp[0], x, "grad_x", context, tol)
    check(leaves[1].grad, exp[1], conv, "grad_conv_weight", context, tol,
          reference.conv_weight_grad_abs(grad_y, x, conv, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_autograd(rng, device, dtype):
    """fusekit.cheri_block under autograd takes the training path and its backward."""
    inputs = make_inputs(rng, 2, 33, 48, dtype=dtype, device=device)
    grad_out = rng.randn(2, 33, 48, dtype=dtype, device=device)
    out, grads = block_step(inputs, grad_out, 4)
    context = describe_case(rng, device=device, dtype=dtype)
    # TF32 products are allowed here (the default); the CPU has none.
    tol = tol_for(dtype) if device == "cpu" or dtype != torch.float32 else CUDA_INFERENCE_FLOAT32
    expected = reference.cheri_block(*(to_torch64(t) for t in inputs), 4)
    check(out, expected, inputs[0], "out", context, tol)
    train_out = fusekit.cheri_block_train(*inputs, 4)[0]
    assert_bitwise_equal(out, train_out, name="autograd out vs cheri_block_train",
                         context=context)
    check_grads(grads, grad_out, inputs, 4, context)


def eager_and_op_steps(fn, op, inputs, grad_out, *args):
    """(out, grads) of one step through `fn` (eager autograd) and one through the registered
    torch `op` under autograd, on fresh leaves of `inputs`; fn's graph must be fusekit's
    autograd.Function."""
    results = []
    for call in (fn, lambda *a: op(*a)[0]):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = call(*leaves, *args)
        out.backward(grad_out)
        results.append((out.detach(), [t.grad for t in leaves], type(out.grad_fn).__name__))
    return results


@pytest.mark.parametrize("device", DEVICES)
def test_eager_autograd_matches_the_op(rng, device):
    """Eager autograd takes fusekit's autograd.Function (tens of microseconds of host time where
    the op's wrapper costs hundreds), bitwise the registered op's out and gradients; so does
    dilated_conv_norm's."""
    inputs = make_inputs(rng, 2, 33, 48, device=device)
    grad_out = rng.randn(2, 33, 48, device=device)
    context = describe_case(rng, device=device)
    (out, grads, node), (op_out, op_grads, _) = eager_and_op_steps(
        fusekit.cheri_block, torch.ops.fusekit.cheri_block, inputs, grad_out, 4)
    assert node == "CheriBlockFunctionBackward", node
    assert_bitwise_equal(out, op_out, name="out", context=context)
    for name, g, op_g in zip(("grad_x", "grad_conv", "grad_w1", "grad_w2"), grads, op_grads):
        assert_bitwise_equal(g, op_g, name=name, context=context)
    (y, grads, node), (op_y, op_grads, _) = eager_and_op_steps(
        lambda *a: fusekit.dilated_conv_norm(*a)[0], torch.ops.fusekit.dilated_conv_norm,
        inputs[:2], grad_out, 4)
    assert node == "DilatedConvNormFunctionBackward", node
    assert_bitwise_equal(y, op_y, name="y", context=context)
    for name, g, op_g in zip(("grad_x", "grad_conv"), grads, op_grads):
        assert_bitwise_equal(g, op_g, name=name, context=context)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_func_grad_and_vjp(rng, device):
    """torch.func.grad and vjp differentiate through the eager Functions' torch.func form:
    bitwise the gradients of torch.autograd, for fusekit.cheri_block (x and the weights) and
    dilated_conv_norm."""
    inputs = make_inputs(rng, 2, 33, 48, device=device)
    grad_out = rng.randn(2, 33, 48, device=device)
    context = describe_case(rng, device=device)
    leaves = [t.clone().requires_grad_() for t in inputs]
    fusekit.cheri_block(*leaves, 4).backward(grad_out)
    grads = torch.func.grad(lambda *a: (fusekit.cheri_block(*a, 4) * grad_out).sum(),
                            argnums=(0, 1, 2, 3))(*inputs)
    for name, g, leaf in zip(("grad_x", "grad_conv", "grad_w1", "grad_w2"), grads, leaves):
        assert_bitwise_equal(g, leaf.grad, name=f"torch.func.grad {name}", context=context)
    out, vjp = torch.func.vjp(lambda x: fusekit.cheri_block(x, *inputs[1:], 4), inputs[0])
    assert_bitwise_equal(vjp(grad_out)[0], leaves[0].grad, name="vjp grad_x", context=context)
    x = inputs[0].clone().requires_grad_()
    fusekit.dilated_conv_norm(x, inputs[1], 4)[0].backward(grad_out)
    g = torch.func.grad(lambda a: (fusekit.dilated_conv_norm(a, inputs[1], 4)[0] * grad_out).sum())
    assert_bitwise_equal(g(inputs[0]), x.grad, name="dilated_conv_norm grad_x", context=context)


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # vmap's loop over the op
@pytest.mark.parametrize("device", DEVICES)
def test_torch_func_module(rng, device):
    """CheriBlock's parameters differentiated by torch.func.grad over functional_call, as
    torch.autograd does; under torch.no_grad(), vmap runs the block example by example."""
    block = fusekit.torch.CheriBlock(16, 3).to(device)
    x = rng.randn(2, 21, 16, device=device)
    params = dict(block.named_parameters())
    grads = torch.func.grad(
        lambda p: torch.func.functional_call(block, p, (x,)).square().sum())(params)
    block(x).square().sum().backward()
    context = describe_case(rng, device=device)
    for name, p in block.named_parameters():
        assert_bitwise_equal(grads[name], p.grad, name=name, context=context)
    with torch.no_grad():
        batched = torch.func.vmap(block)(torch.stack([x, 2 * x]))
        for i, scale in enumerate((1, 2)):
            assert_bitwise_equal(batched[i], block(scale * x), name=f"vmap {i}", context=context)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_func_refused(rng, device):
    """The transforms the torch.func form does not take end in fusekit.Error, naming the op and
    what to do instead, never in a wrong result: vmap and jacrev of a differentiable call, jvp,
    and nested transforms."""
    block = fusekit.torch.CheriBlock(16, 3).to(device)
    x = rng.randn(2, 5, 16, device=device)
    square = lambda a: block(a).square().sum()  # noqa: E731
    cases = {
        "vmap": (lambda: torch.func.vmap(block)(torch.stack([x, x])), "vmap"),
        "jacrev": (lambda: torch.func.jacrev(block)(x[:1, :2]), "vmap (or jacrev)"),
        "jvp": (lambda: torch.func.jvp(block, (x,), (x,)), "jvp (or jacfwd)"),
        "grad of grad": (lambda: torch.func.grad(lambda a: torch.func.grad(square)(a).sum())(x),
                         "nested torch.func transforms"),
        "vmap of grad": (lambda: torch.func.vmap(torch.func.grad(square))(torch.stack([x, x])),
                         "vmap"),
    }
    for name, (call, message) in cases.items():
        with pytest.raises(fusekit.Error, match=f"cheri_block: .*{re.escape(message)}"):
            call()


@pytest.mark.parametrize("device", DEVICES)
def test_autograd_sum(rng, device):
    """out.sum().backward() hands the backward a stride-0 gradient."""
    inputs = make_inputs(rng, 2, 21, 16, device=device)
    leaves = [t.clone().requires_grad_() for t in inputs]
    fusekit.cheri_block(*leaves, 2).sum().backward()
    grad_out = torch.ones(2, 21, 16, device=device)
    check_grads([t.grad for t in leaves], grad_out, inputs, 2, describe_case(rng, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_autograd_partial(rng, device):
    """Only some inputs require grad: the others get none, the rest match the reference."""
    inputs = make_inputs(rng, 2, 21, 16, device=device)
    x = inputs[0].clone().requires_grad_()
    w2 = inputs[3].clone().requires_grad_()
    grad_out = rng.randn(2, 21, 16, device=device)
    fusekit.cheri_block(x, inputs[1], inputs[2], w2, 3).backward(grad_out)
    expected = reference.cheri_block_backward(to_torch64(grad_out),
                                              *(to_torch64(t) for t in inputs), 3)
    context = describe_case(rng, device=device)
    # autograd takes the training path with its default allow_tf32 (TF32 on CUDA)
    tol = CUDA_FAST_FLOAT32 if x.is_cuda else TOLERANCES["float32"]
    check(x.grad, expected[0], x, "grad_x", context, tol)
    check(w2.grad, expected[3], w2, "grad_linear2_weight", context, tol)


@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_takes_inference_path(rng, device):
    inputs = make_inputs(rng, 2, 21, 16, device=device)
    leaves = [t.clone().requires_grad_() for t in inputs]
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            out = fusekit.cheri_block(*leaves, 3)
        assert not out.requires_grad and out.grad_fn is None
        check_out(out, inputs, 3, describe_case(rng, device=device, mode=mode.__name__),
                  inference=True, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_deterministic(rng, device, dtype):
    inputs = make_inputs(rng, 3, 70, 48, dtype=dtype, device=device)
    grad_out = rng.randn(3, 70, 48, dtype=dtype, device=device)
    context = describe_case(rng, device=device, dtype=dtype)
    assert_bitwise_equal(fusekit.cheri_block(*inputs, 4), fusekit.cheri_block(*inputs, 4),
                         name="inference out", context=context)
    first = fusekit.cheri_block_train(*inputs, 4)
    second = fusekit.cheri_block_train(*inputs, 4)
    for name, a, b in zip(("out", "mean", "rstd"), first, second):
        assert_bitwise_equal(a, b, name=name, context=context)
    grads = [fusekit.cheri_block_backward(grad_out, *inputs, *first[1:], 4) for _ in range(2)]
    for name, a, b in zip(GRADS, *grads):
        assert_bitwise_equal(a, b, name=name, context=context)
    y = [fusekit.dilated_conv_norm(inputs[0], inputs[1], 4) for _ in range(2)]
    for name, a, b in zip(("y", "mean", "rstd"), *y):
        assert_bitwise_equal(a, b, name=name, context=context)


# ------------------------------------------------------------------------------ layouts


def strided_x(x, layout):
    """(view, buffer): x's values in a view with a contiguous last axis over NaN-filled memory."""
    n, length, c = x.shape
    if layout == "offset1":
        buf = nan_like((x.numel() + 1,), x)
        view = buf[1:].view(x.shape)
    elif layout == "padded":  # rows of C padded by 8
        buf = nan_like((n, length, c + 8), x)
        view = buf[..., :c]
    elif layout == "lnc":  # stored [L, N, C]
        buf = nan_like((length, n, c), x)
        view = buf.transpose(0, 1)
    else:
        raise ValueError(layout)
    view.copy_(x)
    return view, buf


@pytest.mark.parametrize("layout", ["offset1", "padded", "lnc"])
@pytest.mark.parametrize("device", DEVICES)
def test_input_layouts(rng, device, layout):
    """x with any strides but the last, the weights transposed views (any strides): read in place,
    NaN around them never read."""
    inputs = make_inputs(rng, 2, 25, 24, device=device)
    x_view, _ = strided_x(inputs[0], layout)
    w1_view = inputs[2].t().contiguous().t()  # column-major [E C, C]
    conv_view = nan_like((3, 48), inputs[1])[:, ::2]
    conv_view.copy_(inputs[1])
    views = (x_view, conv_view, w1_view, inputs[3])
    grad_out, _ = strided_x(rng.randn(2, 25, 24, device=device), layout)
    context = describe_case(rng, device=device, layout=layout)
    check_out(fusekit.cheri_block(*views, 3), inputs, 3, context, inference=True, device=device)
    out, mean, rstd = fusekit.cheri_block_train(*views, 3, allow_tf32=False)
    check_out(out, inputs, 3, context, inference=False)
    check_grads(fusekit.cheri_block_backward(grad_out, *views, mean, rstd, 3, allow_tf32=False),
                grad_out, inputs, 3, context)


@pytest.mark.parametrize("layout", ["contiguous", "padded", "lnc"])
@pytest.mark.parametrize("device", DEVICES)
def test_out_poisoned(rng, device, layout):
    """out= over NaN-filled memory: every element written, nothing around it."""
    inputs = make_inputs(rng, 2, 25, 24, device=device)
    if layout == "contiguous":
        out = buf = nan_like(inputs[0].shape, inputs[0])
    else:
        out, buf = strided_x(nan_like(inputs[0].shape, inputs[0]), layout)
    assert fusekit.cheri_block(*inputs, 2, out=out) is out
    check_out(out, inputs, 2, describe_case(rng, device=device, layout=layout), inference=True,
              device=device)
    assert int(torch.isnan(buf).sum()) == buf.numel() - out.numel(), "wrote outside out"


# ------------------------------------------------------------------------------ the module


def _seed_conv_norm(x, w, dilation, eps=1e-3):
    """The seed model's CPU path of the dilated convolution and normalisation, as it defines
    it: F.conv1d over [N, C, L], then statistics over each example."""
    n, length, c = x.shape
    y = F.conv1d(x.transpose(1, 2), w.t().unsqueeze(1), padding=dilation, dilation=dilation,
                 groups=c).transpose(1, 2)
    flat = y.reshape(n, -1)
    mean = flat.mean(dim=1, keepdim=True)
    var = flat.var(dim=1, keepdim=True, unbiased=False)
    return ((flat - mean) * (var + eps).rsqrt()).reshape(n, length, c)


class SeedCheriBlock(torch.nn.Module):
    """The seed model's block, its parameters and reference forward, to load state dicts from."""

    def __init__(self, n_filters, dilation, expansion=2, residual_scale=0.15):
        super().__init__()
        self.dilation, self.residual_scale = dilation, residual_scale
        hidden = expansion * n_filters
        self.conv_weight = torch.nn.Parameter(torch.randn(3, n_filters))
        self.linear1 = torch.nn.Linear(n_filters, hidden, bias=False)
        self.linear2 = torch.nn.Linear(hidden, n_filters, bias=False)
        self.activation = torch.nn.GELU(approximate="tanh")

    def forward(self, x):
        y = _seed_conv_norm(x, self.conv_weight, self.dilation)
        return x + self.linear2(self.activation(self.linear1(y))) * self.residual_scale


def seed_block(rng, c, dilation, device="cpu"):
    """A seed block with weights large enough that every part of the block matters."""
    block = SeedCheriBlock(c, dilation).to(device)
    _, conv, w1, w2 = make_inputs(rng, 1, 1, c, device=device)
    with torch.no_grad():
        block.conv_weight.copy_(conv)
        block.linear1.weight.copy_(w1)
        block.linear2.weight.copy_(w2)
    return block


def test_module_parameters():
    block = fusekit.torch.CheriBlock(48, 4)
    assert sorted(block.state_dict()) == ["conv_weight", "linear1.weight", "linear2.weight"]
    assert block.conv_weight.shape == (3, 48)
    assert block.linear1.weight.shape == (96, 48) and block.linear2.weight.shape == (48, 96)
    assert block.linear1.bias is None and block.linear2.bias is None
    for p in block.parameters():  # (truncated) normal of std 0.02
        assert 0.01 < float(p.detach().std()) < 0.03
    assert "n_filters=48, dilation=4, expansion=2, residual_scale=0.15" in repr(block)
    assert fusekit.torch.CheriBlock(8, 1, expansion=3).linear1.weight.shape == (24, 8)


@pytest.mark.parametrize("dilation", [1, 4, 64])
@pytest.mark.parametrize("device", DEVICES)
def test_module_loads_seed_state_dict(rng, device, dilation):
    """The seed block's state dict loads unchanged (strict), and the two give the same outputs
    and gradients (both against the seed block in float64); the way back loads too."""
    seed = seed_block(rng, 48, dilation, device)
    block = fusekit.torch.CheriBlock(48, dilation).to(device)
    block.load_state_dict(seed.state_dict())
    seed64 = SeedCheriBlock(48, dilation).to(device).double()
    seed64.load_state_dict(seed.state_dict())
    x = rng.randn(2, 70, 48, device=device)
    context = describe_case(rng, device=device, d=dilation)
    with torch.no_grad():
        expected = seed64(x.double())
        check(block(x), expected, x, "inference out", context,
              tol_for(torch.float32, device, inference=True))
        check(seed(x), expected, x, "seed out", context, TOLERANCES["float32"])

    block.allow_tf32 = False
    grad_out = rng.randn(2, 70, 48, device=device)
    xg, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    out = block(xg)
    assert out.grad_fn is not None
    check(out.detach(), expected, x, "training out", context, TOLERANCES["float32"])
    out.backward(grad_out)
    seed64(x64).backward(grad_out.double())
    named = dict(block.named_parameters())
    check(xg.grad, x64.grad, x, "grad_x", context, TOLERANCES["float32"])
    conv_scale = reference.conv_weight_grad_abs(grad_out, x, seed.conv_weight, dilation,
                                                seed.linear1.weight, seed.linear2.weight)
    for name, p in seed64.named_parameters():
        check(named[name].grad, p.grad, named[name], f"grad {name}", context,
              TOLERANCES["float32"], conv_scale if name == "conv_weight" else None)

    back = SeedCheriBlock(48, dilation).to(device)
    back.load_state_dict(block.state_dict())
    for name, p in back.named_parameters():
        assert torch.equal(p, named[name])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_module_no_stale_weights(rng, device, dtype):
    """Weights changed in place between calls (as an optimiser step or load_state_dict does)
    show in the next call, on both paths and with bfloat16 activations over float32 weights."""
    block = fusekit.torch.CheriBlock(32, 3).to(device)
    block.load_state_dict(seed_block(rng, 32, 3, device).state_dict())
    x = rng.randn(2, 40, 32, dtype=dtype, device=device)
    updates = {
        "linear1.weight": lambda p: p.mul_(-1.5),
        "linear2.weight": lambda p: p.add_(0.1),
        "conv_weight": lambda p: p.copy_(p.flip(0)),
    }
    params = dict(block.named_parameters())

    def expected():
        weights = (block.conv_weight, block.linear1.weight, block.linear2.weight)
        return reference.cheri_block(to_torch64(x), *(to_torch64(w) for w in weights), 3)

    for name, update in updates.items():
        with torch.no_grad():
            before = block(x)
            update(params[name])
            after = block(x)
        context = describe_case(rng, device=device, dtype=dtype, changed=name)
        assert not torch.equal(before, after), f"{name} changed but the output did not [{context}]"
        check(after, expected(), x, "inference out", context,
              tol_for(dtype, device, inference=True))
        trained = block(x)
        assert trained.grad_fn is not None
        # the training path under autograd: TF32 products on CUDA, as the model trains
        check(trained.detach(), expected(), x, "training out", context,
              tol_for(dtype, device, inference=str(device).startswith("cuda")))
    with torch.no_grad():
        fresh = seed_block(rng, 32, 3, device).state_dict()
        block.load_state_dict(fresh)
        check(block(x), expected(), x, "out after load_state_dict",
              describe_case(rng, device=device), tol_for(dtype, device, inference=True))


@pytest.mark.parametrize("device", DEVICES)
def test_module_paths(rng, device):
    """Grad enabled with parameters requiring grad: the training path (a graph, bitwise
    cheri_block_train's out); frozen parameters and x without grad: the inference path."""
    block = fusekit.torch.CheriBlock(16, 2).to(device)
    x = rng.randn(2, 30, 16, device=device)
    weights = (block.conv_weight, block.linear1.weight, block.linear2.weight)
    out = block(x)
    assert out.grad_fn is not None
    assert_bitwise_equal(out.detach(), fusekit.cheri_block_train(x, *weights, 2)[0], name="out")
    block.requires_grad_(False)
    out = block(x)
    assert out.grad_fn is None
    assert_bitwise_equal(out, fusekit.cheri_block(x, *weights, 2), name="out")


# ------------------------------------------------------------------------------ numpy


@pytest.mark.parametrize("layout", ["contiguous", "lnc", "reversed"])
def test_numpy(rng, layout):
    """numpy arrays, any strides but the last (negative included): every function."""
    inputs = make_inputs(rng, 2, 25, 24)
    grad_out = rng.randn(2, 25, 24)
    arrays = [t.numpy() for t in inputs]
    g = grad_out.numpy()
    if layout == "lnc":
        arrays[0] = np.ascontiguousarray(arrays[0].transpose(1, 0, 2)).transpose(1, 0, 2)
    elif layout == "reversed":  # x reversed along L, so the reference gets it reversed too
        arrays[0] = arrays[0][:, ::-1]
        inputs = (torch.from_numpy(arrays[0].copy()), *inputs[1:])
    context = describe_case(rng, layout=layout)
    out = fusekit.cheri_block(*arrays, 3)
    assert type(out) is np.ndarray and out.dtype == np.float32 and out.shape == (2, 25, 24)
    check_out(out, inputs, 3, context, inference=True)
    out, mean, rstd = fusekit.cheri_block_train(*arrays, 3, allow_tf32=False)
    assert type(mean) is np.ndarray and mean.dtype == np.float32 and mean.shape == (2,)
    check_out(out, inputs, 3, context, inference=False)
    grads = fusekit.cheri_block_backward(g, *arrays, mean, rstd, 3)
    assert all(type(t) is np.ndarray for t in grads)
    check_grads(grads, grad_out, inputs, 3, context)
    y, mean2, rstd2 = fusekit.dilated_conv_norm(arrays[0], arrays[1], 3)
    exp = reference.dilated_conv_norm(to_torch64(inputs[0]), to_torch64(inputs[1]), 3)
    check(y, exp[0], inputs[0], "y", context, TOLERANCES["float32"])
    gx, gw = fusekit.dilated_conv_norm_backward(g, arrays[0], arrays[1], mean2, rstd2, 3)
    exp = reference.dilated_conv_norm_backward(to_torch64(grad_out), to_torch64(inputs[0]),
                                               to_torch64(inputs[1]), 3)
    check(gx, exp[0], inputs[0], "grad_x", context, TOLERANCES["float32"])
    check(gw, exp[1], inputs[1], "grad_conv_weight", context, TOLERANCES["float32"],
          reference.conv_weight_grad_abs(grad_out, inputs[0], inputs[1], 3))


def test_numpy_out(rng):
    inputs = make_inputs(rng, 2, 25, 24)
    out = np.full((2, 25, 24), np.nan, dtype=np.float32)
    assert fusekit.cheri_block(*(t.numpy() for t in inputs), 3, out=out) is out
    check_out(out, inputs, 3, describe_case(rng), inference=True)


# ------------------------------------------------------------------------------ torch.library


@pytest.mark.parametrize("device", DEVICES)
def test_training_forward_keeps_rows_where_the_backward_reads_them(rng, device):
    # float32 with TF32 at C of 64 and 128, E = 2, on sm_90a: y in float16 (2 bytes a value)
    hopper = (device == "cuda" and torch.cuda.get_device_capability() == (9, 0)
              and "90a" in fusekit.build_info()["cuda_architectures"].split())
    for c, dtype, allow_tf32, kept in ((64, torch.float32, True, hopper),
                                       (128, torch.float32, True, hopper),
                                       (128, torch.float32, False, False),
                                       (128, torch.bfloat16, True, False),
                                       (48, torch.float32, True, False)):
        inputs = make_inputs(rng, 2, 9, c, dtype=dtype, device=device)
        saved = torch.ops.fusekit.cheri_block(*inputs, 2, allow_tf32=allow_tf32)[3]
        assert saved.dtype == torch.uint8 and saved.device == inputs[0].device
        assert saved.numel() == (2 * 9 * c * 2 if kept else 0), (c, dtype, allow_tf32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(rng, device, dtype):
    inputs = make_inputs(rng, 2, 9, 8, dtype=dtype, device=device)
    leaves = [t.clone().requires_grad_() for t in inputs]
    ops = torch.ops.fusekit
    torch.library.opcheck(ops.cheri_block.default, (*leaves, 2))
    torch.library.opcheck(ops.cheri_block.default, (*inputs, 3, 0.5, 1e-2, False))
    torch.library.opcheck(ops.cheri_block_inference.default, (*inputs, 2))
    torch.library.opcheck(ops.dilated_conv_norm.default, (*leaves[:2], 2))
    out, mean, rstd, saved = ops.cheri_block(*inputs, 2)
    grad_out = rng.randn(2, 9, 8, dtype=dtype, device=device)
    torch.library.opcheck(ops.cheri_block_backward.default, (grad_out, *inputs, mean, rstd, 2))
    # C = 64: on sm_90a the float32 forward keeps rows for the backward (saved not empty)
    wide = make_inputs(rng, 2, 9, 64, dtype=dtype, device=device)
    torch.library.opcheck(ops.cheri_block.default, (*wide, 2))
    out, mean, rstd, saved = ops.cheri_block(*wide, 2)
    grad_wide = rng.randn(2, 9, 64, dtype=dtype, device=device)
    torch.library.opcheck(ops.cheri_block_backward.default, (grad_wide, *wide, mean, rstd, 2),
                          {"saved": saved})
    _, mean, rstd = ops.dilated_conv_norm(*inputs[:2], 2)
    torch.library.opcheck(ops.dilated_conv_norm_backward.default,
                          (grad_out, *inputs[:2], mean, rstd, 2))


def test_inference_op_is_forward_only(rng):
    inputs = make_inputs(rng, 2, 9, 8)
    out = torch.ops.fusekit.cheri_block_inference(inputs[0].requires_grad_(), *inputs[1:], 2)
    with pytest.raises(fusekit.Error, match=r"^cheri_block_inference: backward was called"):
        out.sum().backward()


def train_step(block, x, grad_out):
    out = block(x)
    out.backward(grad_out)
    return out.detach()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compile_aot_eager(rng, dtype):
    """The module compiled whole: a training step (forward and backward through the ops) and an
    inference call, the same values as eager."""
    torch._dynamo.reset()
    block = fusekit.torch.CheriBlock(32, 4)
    block.load_state_dict(seed_block(rng, 32, 4).state_dict())
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    x = rng.randn(2, 40, 32, dtype=dtype)
    grad_out = rng.randn(2, 40, 32, dtype=dtype)
    context = describe_case(rng, backend="aot_eager", dtype=dtype)
    xg = x.clone().requires_grad_()
    out = train_step(compiled, xg, grad_out)
    grads = [xg.grad] + [p.grad for p in (block.conv_weight, block.linear1.weight,
                                          block.linear2.weight)]
    eager_x = x.clone().requires_grad_()
    block.zero_grad(set_to_none=True)
    eager_out = train_step(block, eager_x, grad_out)
    assert_bitwise_equal(out, eager_out, name="out", context=context)
    eager = [eager_x.grad] + [p.grad for p in (block.conv_weight, block.linear1.weight,
                                               block.linear2.weight)]
    for name, a, b in zip(GRADS, grads, eager):
        assert_bitwise_equal(a, b, name=name, context=context)
    with torch.no_grad():
        assert_bitwise_equal(compiled(x), block(x), name="inference out", context=context)


def test_compile_dynamic_shapes(rng):
    torch._dynamo.reset()

    def fn(x, conv, w1, w2):
        return fusekit.cheri_block(x, conv, w1, w2, 3)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    for n, length in [(2, 17), (3, 40), (1, 5)]:
        inputs = make_inputs(rng, n, length, 16)
        check_out(compiled(*inputs), inputs, 3, describe_case(rng, N=n, L=length),
                  inference=True)


@requires_cuda
@requires_cuda_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compile_inductor_cuda(rng, dtype):
    torch._dynamo.reset()
    block = fusekit.torch.CheriBlock(64, 4).cuda()
    block.load_state_dict(seed_block(rng, 64, 4, "cuda").state_dict())

    def model(x):  # neighbours for inductor to fuse
        return block(x * 2) + 1

    x = rng.randn(2, 128, 64, dtype=dtype, device="cuda")
    grad_out = rng.randn(2, 128, 64, dtype=dtype, device="cuda")
    compiled = train_step(torch.compile(model, fullgraph=True), x.clone().requires_grad_(),
                          grad_out)
    eager = train_step(model, x.clone().requires_grad_(), grad_out)
    assert_bitwise_equal(compiled, eager, name="out",
                         context=describe_case(rng, backend="inductor"))


# ------------------------------------------------------------------------------ CUDA specifics


@requires_cuda
@requires_cuda_backend
def test_cuda_runs_on_current_stream(rng):
    """On a side stream, and captured into a CUDA graph (which fails if any work went to another
    stream or synchronised)."""
    inputs = make_inputs(rng, 4, 512, 128, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = fusekit.cheri_block(*inputs, 4)
        train = fusekit.cheri_block_train(*inputs, 4)
    side.synchronize()
    context = describe_case(rng, stream="side")
    check_out(out, inputs, 4, context, inference=True, device="cuda")
    check_out(train[0], inputs, 4, context, inference=False)

    graph = torch.cuda.CUDAGraph()
    out.fill_(math.nan)
    grad_out = torch.ones_like(out)
    with torch.cuda.graph(graph):
        fusekit.cheri_block(*inputs, 4, out=out)
        grads = fusekit.cheri_block_backward(grad_out, *inputs, *train[1:], 4)
    graph.replay()
    torch.cuda.synchronize()
    context = describe_case(rng, stream="graph replay")
    check_out(out, inputs, 4, context, inference=True, device="cuda")
    check_grads(grads, grad_out, inputs, 4, context)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@requires_cuda_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_second_device(rng, dtype):
    """Both devices in one process, each called while device 0 is current: what a kernel sets up
    once (its shared-memory opt-in, library handles, workspaces) is per device."""
    # C = 128: the warpgroup kernels of inference, training and backward
    for device in ("cuda:0", "cuda:1"):
        inputs = make_inputs(rng, 2, 129, 128, dtype=dtype, device=device)
        grad_out = rng.randn(2, 129, 128, dtype=dtype, device=device)
        with torch.cuda.device(0):
            out = fusekit.cheri_block(*inputs, 2)
            step_out, grads = block_step(inputs, grad_out, 2)
        assert out.device == step_out.device == torch.device(device)
        assert all(g.device == torch.device(device) for g in grads)
        context = describe_case(rng, device=device, dtype=dtype)
        check_out(out, inputs, 2, context, inference=True, device=device)
        # under autograd TF32 products are allowed (the default), as in inference
        check_out(step_out, inputs, 2, context, inference=True, device=device)
        check_grads(grads, grad_out, inputs, 2, context)


# ------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("device", VALIDATION_DEVICES)
def test_error_dtype(rng, device):
    x, conv, w1, w2 = make_inputs(rng, 2, 5, 8, device=device)
    for fn in (fusekit.cheri_block, fusekit.cheri_block_train):
        with pytest.raises(fusekit.Error, match=r"^cheri_block\w*: x has dtype float64"):
            fn(x.double(), conv, w1, w2, 1)
        with pytest.raises(fusekit.Error, match=r"^cheri_block\w*: weights\.linear1_weight has "
                                                r"dtype float16, expected float32 or x's dtype "
                                                r"float32$"):
            fn(x, conv, w1.half(), w2, 1)
    with pytest.raises(fusekit.Error, match=r"^dilated_conv_norm: conv_weight has dtype int64, "
                                            r"expected float32 or x's dtype float32$"):
        fusekit.dilated_conv_norm(x, torch.ones(3, 8, dtype=torch.int64, device=device), 1)
    # the same message through the autograd op
    with pytest.raises(fusekit.Error, match=r"^cheri_block: weights\.linear1_weight has dtype "
                                            r"float16"):
        fusekit.cheri_block(x.requires_grad_(), conv, w1.half(), w2, 1)


@pytest.mark.parametrize("device", VALIDATION_DEVICES)
def test_error_shape(rng, device):
    x, conv, w1, w2 = make_inputs(rng, 2, 5, 8, device=device)
    cases = [
        ((x[0], conv, w1, w2), r"x has 2 dims \[5, 8\], expected 3 dims \[N, L, C\]"),
        ((x, conv[:2], w1, w2),
         r"weights\.conv_weight has shape \[2, 8\], expected \[3, C\] = \[3, 8\]"),
        ((x, conv, w1[:, :4], w2),
         r"weights\.linear1_weight has shape \[16, 4\], expected \[E C, C\] = \[16, 8\]"),
        ((x, conv, w1, w2[:, :8]),
         r"weights\.linear2_weight has shape \[8, 8\], expected \[C, E C\] = \[8, 16\]"),
    ]
    for args, message in cases:
        for fn in (fusekit.cheri_block, fusekit.cheri_block_train):
            with pytest.raises(fusekit.Error, match=rf"^cheri_block\w*: {message}$"):
                fn(*args, 1)
    with pytest.raises(fusekit.Error, match=r"^cheri_block_backward: mean has shape \[3\], "
                                            r"expected \[N\] = \[2\]$"):
        fusekit.cheri_block_backward(x, x, conv, w1, w2, torch.zeros(3, device=device),
                                     torch.ones(2, device=device), 1)


@pytest.mark.parametrize("device", VALIDATION_DEVICES)
def test_error_options(rng, device):
    inputs = make_inputs(rng, 2, 5, 8, device=device)
    for bad in (0, -1):
        with pytest.raises(fusekit.Error, match=rf"^cheri_block\w*: options\.dilation is {bad}, "
                                                rf"expected >= 1$"):
            fusekit.cheri_block(*inputs, bad)
        with pytest.raises(fusekit.Error, match=rf"^dilated_conv_norm: options\.dilation is "
                                                rf"{bad}, expected >= 1$"):
            fusekit.dilated_conv_norm(*inputs[:2], bad)
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(fusekit.Error, match=r"^cheri_block: options\.eps is .*, expected a "
                                                r"finite value >= 0$"):
            fusekit.cheri_block_train(*inputs, 1, eps=bad)


@pytest.mark.parametrize("device", VALIDATION_DEVICES)
def test_error_layout(rng, device):
    """x and out need a unit stride on C; nothing is copied to make one."""
    x, conv, w1, w2 = make_inputs(rng, 2, 5, 8, device=device)
    strided = torch.zeros(2, 5, 16, device=device)[..., ::2]
    with pytest.raises(fusekit.Error, match=r"^cheri_block\w*: x \[2, 5, 8\] has strides "
                                            r"\(80, 16, 2\); expected a unit stride on C"):
        fusekit.cheri_block(strided, conv, w1, w2, 1)
    with pytest.raises(fusekit.Error, match=r"^cheri_block\w*: out \[2, 5, 8\] has strides "
                                            r"\(80, 16, 2\); expected a unit stride on C"):
        fusekit.cheri_block(x, conv, w1, w2, 1, out=strided)


@pytest.mark.parametrize("device", VALIDATION_DEVICES)
def test_error_out(rng, device):
    x, conv, w1, w2 = make_inputs(rng, 2, 5, 8, device=device)
    with pytest.raises(fusekit.Error, match=r"^cheri_block\w*: out has shape \[2, 5, 4\], "
                                            r"expected \[N, L, C\] = \[2, 5, 8\]$"):
        fusekit.cheri_block(x, conv, w1, w2, 1, out=torch.empty(2, 5, 4, device=device))
    with pytest.raises(fusekit.Error, match=r"^cheri_block\w*: out overlaps x in memory"):
        fusekit.cheri_block(x, conv, w1, w2, 1, out=x)
    with pytest.raises(fusekit.Error, match=r"^cheri_block: out is a numpy.ndarray but the "
                                            r"inputs are torch.Tensors"):
        fusekit.cheri_block(x, conv, w1, w2, 1, out=np.empty((2, 5, 8), np.float32))
    with pytest.raises(fusekit.Error, match=r"^cheri_block: out= was given while autograd "
                                            r"records the call"):
        fusekit.cheri_block(x.clone().requires_grad_(), conv, w1, w2, 1, out=torch.empty_like(x))


@requires_cuda
def test_error_mixed_devices(rng):
    x, conv, w1, w2 = make_inputs(rng, 2, 5, 8, device="cuda")
    with pytest.raises(fusekit.Error, match=r"^cheri_block\w*: weights\.linear2_weight is on "
                                            r"cpu"):
        fusekit.cheri_block(x, conv, w1, w2.cpu(), 1)


def test_error_mixed_frameworks(rng):
    x, conv, w1, w2 = make_inputs(rng, 2, 5, 8)
    with pytest.raises(fusekit.Error, match=r"^cheri_block: conv_weight is a numpy.ndarray but x "
                                            r"is a torch.Tensor; expected arrays of one "
                                            r"framework$"):
        fusekit.cheri_block(x, conv.numpy(), w1, w2, 1)
    with pytest.raises(fusekit.Error, match=r"^cheri_block: linear2_weight is a torch.Tensor but "
                                            r"x is a numpy.ndarray"):
        fusekit.cheri_block_train(x.numpy(), conv.numpy(), w1.numpy(), w2, 1)
    with pytest.raises(fusekit.Error, match=r"^cheri_block_backward: mean is a list"):
        fusekit.cheri_block_backward(x, x, conv, w1, w2, [0.0, 0.0], torch.ones(2), 1)
    with pytest.raises(fusekit.Error, match=r"^dilated_conv_norm: x is a list, expected a "
                                            r"torch.Tensor or a numpy.ndarray$"):
        fusekit.dilated_conv_norm(x.tolist(), conv, 1)
