"""The executable specification of each operator: its formula in a few lines of PyTorch.

Called on float64 tensors it is the reference the tests compare against, and float64 autograd
through it gives the reference gradients. Called on the operator's own dtypes it is "the same
formula computed by PyTorch in that dtype", the yardstick of the low-precision error budget.
"""

import torch
import torch.nn.functional as F


def mhc_post(x, residual, post_layer_mix, comb_res_mix):
    """out[n, i, h] = post_layer_mix[n, i] * x[n, h] + sum_j comb_res_mix[n, j, i] * residual[n, j, h]

    x [N, H], residual [N, hc, H], post_layer_mix [N, hc] or [N, hc, 1], comb_res_mix [N, hc, hc].
    The products and sums are done in the mixes' dtype (float32 for the operator, float64 for the
    reference); the result is rounded once to x's dtype.
    """
    n, hc = comb_res_mix.shape[:2]
    post = post_layer_mix.reshape(n, hc, 1)
    acc = post * x.unsqueeze(-2).to(post.dtype) + comb_res_mix.mT @ residual.to(comb_res_mix.dtype)
    return acc.to(x.dtype)


def mhc_post_abs(x, residual, post_layer_mix, comb_res_mix):
    """sum over the terms of mhc_post of |term|, in float64: the magnitude that rounding errors of
    the sum scale with (so that cancellation does not turn them into large relative errors)."""
    return mhc_post(*(t.double().abs() for t in (x, residual, post_layer_mix, comb_res_mix)))


def mhc_post_backward(grad_out, x, residual, post_layer_mix, comb_res_mix):
    """(grad_x, grad_residual, grad_post_layer_mix, grad_comb_res_mix): autograd through
    mhc_post, in the inputs' dtypes (float64 inputs give the reference gradients)."""
    inputs = [t.detach().requires_grad_() for t in (x, residual, post_layer_mix, comb_res_mix)]
    with torch.enable_grad():
        out = mhc_post(*inputs)
    return torch.autograd.grad(out, inputs, grad_out.to(out.dtype))


def mhc_post_backward_abs(grad_out, x, residual, post_layer_mix, comb_res_mix):
    """The sums of |term| behind each gradient element, in float64 (see mhc_post_abs)."""
    return mhc_post_backward(*(t.double().abs() for t in (grad_out, x, residual, post_layer_mix,
                                                           comb_res_mix)))


def layernorm_linear_gelu(x, weight, bias=None, ln_weight=None, ln_bias=None, eps=1e-5,
                          approximate="tanh"):
    """out = GELU(LayerNorm(x) @ weight^T + bias), unfused: F.layer_norm, F.linear, F.gelu.

    x [..., K], weight [Nout, K], bias [Nout] or None, ln_weight and ln_bias [K] or None. Every
    step runs in x's dtype (the LayerNorm and Linear parameters are cast to it), so that on
    float64 tensors this is the reference and on a low-precision dtype it is PyTorch's own error
    for the same formula.
    """
    cast = lambda t: None if t is None else t.to(x.dtype)  # noqa: E731
    xn = F.layer_norm(x, x.shape[-1:], cast(ln_weight), cast(ln_bias), eps)
    return F.gelu(F.linear(xn, cast(weight), cast(bias)), approximate=approximate)


def layernorm_linear_gelu_abs(x, weight, bias=None, ln_weight=None, ln_bias=None, eps=1e-5):
    """sum over the terms of each pre-activation of |term|, in float64:
    (|xn * ln_weight| + |ln_bias|) @ |weight|^T + |bias| with xn the normalised x. Rounding the
    normalised rows or the products scales with it (see mhc_post_abs)."""
    x = x.double()
    terms = F.layer_norm(x, x.shape[-1:], None, None, eps).abs()
    if ln_weight is not None:
        terms = terms * ln_weight.double().abs()
    if ln_bias is not None:
        terms = terms + ln_bias.double().abs()
    out = terms @ weight.double().abs().mT
    return out if bias is None else out + bias.double().abs()
