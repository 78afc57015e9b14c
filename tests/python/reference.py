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


def causal_attention_mask(t, n_padd, device=None):
    """keep [B or 1, 1, T, T], True where query i may attend key j: n_padd[b] <= j <= i. n_padd is
    an int or a tensor [B]."""
    pad = torch.as_tensor(n_padd, device=device).reshape(-1, 1, 1, 1)
    i = torch.arange(t, device=device)[:, None]  # query
    j = torch.arange(t, device=device)[None, :]  # key
    return (j <= i) & (j >= pad)


def _attention_heads(q, k, v):
    """q [B, H, T, D] and k, v [B, H, T, D] with each key/value head repeated for the H / Hkv
    query heads that share it; [T, D] arguments become one head of one sequence."""
    if q.dim() == 2:
        q, k, v = q[None, None], k[None, None], v[None, None]
    group = q.shape[1] // k.shape[1]
    return q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def causal_attention(q, k, v, n_padd=0, scale=None):
    """out of causal self-attention over left-padded sequences, by F.scaled_dot_product_attention
    with the boolean mask of causal_attention_mask, in q's dtype: on float64 tensors the
    reference, on a half-precision dtype PyTorch's own SDPA in that precision.

    q [B, H, T, D], k and v [B, Hkv, T, D] (Hkv dividing H), or all [T, D]; n_padd an int or a
    tensor [B]. Padding rows of out (i < n_padd[b]) are zeros. Padding keys, values and queries
    are zeroed before use: they are never read, and NaN there must not reach the result.
    """
    squeeze = q.dim() == 2
    q, k, v = _attention_heads(q, k, v)
    keep = causal_attention_mask(q.shape[-2], n_padd, q.device)  # [B or 1, 1, T, T]
    valid = keep.any(-1, keepdim=True)  # [B or 1, 1, T, 1]: i >= n_padd[b]
    q, k, v = (t.masked_fill(~valid, 0) for t in (q, k, v))
    # A padding row attends nothing, which SDPA would turn into NaN: let it see every (zeroed)
    # key, then zero it.
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep | ~valid, scale=scale)
    out = torch.where(valid, out, 0)
    return out[0, 0] if squeeze else out


def causal_attention_lse(q, k, n_padd=0, scale=None):
    """lse [B, H, T] (or [T]) = log sum_j exp(scale * q_i . k_j) over the keys each row attends,
    -inf on padding rows, in q's dtype."""
    squeeze = q.dim() == 2
    q, k, _ = _attention_heads(q, k, k)
    keep = causal_attention_mask(q.shape[-2], n_padd, q.device)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.mT * scale).masked_fill(~keep, -torch.inf)  # NaN in padding rows masked too
    lse = torch.logsumexp(scores, -1)
    return lse[0, 0] if squeeze else lse


def causal_attention_abs(q, k, v, n_padd=0, scale=None):
    """(out_scale, lse_scale) in float64: sum_j p_ij |v_j| behind each element of out, and
    1 + sum_j p_ij |scale| (|q_i| . |k_j|) behind each lse, with p the attention weights. Rounding
    the products and sums scales with them (see mhc_post_abs); padding rows get 1."""
    q, k, v = (t.double() for t in (q, k, v))
    squeeze = q.dim() == 2
    q, k, v = _attention_heads(q, k, v)
    keep = causal_attention_mask(q.shape[-2], n_padd, q.device)
    valid = keep.any(-1, keepdim=True)
    q, k, v = (t.masked_fill(~valid, 0) for t in (q, k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.mT * scale).masked_fill(~keep, -torch.inf)
    p = torch.where(valid, torch.softmax(scores, -1), 0)  # [B, H, T, T]
    out_scale = torch.where(valid, p @ v.abs(), 1)
    lse_scale = 1 + (p * (q.abs() @ k.abs().mT * abs(scale))).sum(-1)
    if squeeze:
        return out_scale[0, 0], lse_scale[0, 0]
    return out_scale, lse_scale


def dilated_conv(x, conv_weight, dilation):
    """conv[n, l, c] = w[0, c] x[n, l - d, c] + w[1, c] x[n, l, c] + w[2, c] x[n, l + d, c], x
    zero outside 0 <= l < L, in x's dtype (the weight is cast to it)."""
    n, length, c = x.shape
    d = int(dilation)
    w = conv_weight.to(x.dtype)
    padded = F.pad(x, (0, 0, d, d))  # [N, L + 2d, C]
    return (w[0] * padded[:, :length] + w[1] * padded[:, d : d + length]
            + w[2] * padded[:, 2 * d : 2 * d + length])


def dilated_conv_norm(x, conv_weight, dilation, eps=1e-3):
    """(y, mean, rstd): the convolution normalised over each example's (L, C) plane (biased
    variance from the squared deviations), in x's dtype; mean and rstd [N]."""
    return _normalise(dilated_conv(x, conv_weight, dilation), eps)


def _normalise(conv, eps):
    mean = conv.mean(dim=(1, 2), keepdim=True)
    var = (conv - mean).square().mean(dim=(1, 2), keepdim=True)
    rstd = (var + eps).rsqrt()
    return (conv - mean) * rstd, mean.flatten(), rstd.flatten()


def cheri_block(x, conv_weight, linear1_weight, linear2_weight, dilation, residual_scale=0.15,
                eps=1e-3):
    """out = x + residual_scale * GELU_tanh(dilated_conv_norm(x) @ linear1_weight^T)
    @ linear2_weight^T, every step in x's dtype (the weights cast to it)."""
    y = dilated_conv_norm(x, conv_weight, dilation, eps)[0]
    return x + _mlp(y, linear1_weight, linear2_weight, residual_scale)


def _mlp(y, linear1_weight, linear2_weight, residual_scale):
    h = F.gelu(y @ linear1_weight.to(y.dtype).mT, approximate="tanh")
    return residual_scale * (h @ linear2_weight.to(y.dtype).mT)


def _grads(fn, grad_out, inputs):
    leaves = [t.detach().requires_grad_() for t in inputs]
    with torch.enable_grad():
        out = fn(*leaves)
    return torch.autograd.grad(out, leaves, grad_out.to(out.dtype))


def dilated_conv_norm_backward(grad_y, x, conv_weight, dilation, eps=1e-3):
    """(grad_x, grad_conv_weight): autograd through dilated_conv_norm's y."""
    return _grads(lambda a, w: dilated_conv_norm(a, w, dilation, eps)[0], grad_y, (x, conv_weight))


def cheri_block_backward(grad_out, x, conv_weight, linear1_weight, linear2_weight, dilation,
                         residual_scale=0.15, eps=1e-3):
    """(grad_x, grad_conv_weight, grad_linear1_weight, grad_linear2_weight): autograd through
    cheri_block (float64 inputs give the reference gradients)."""
    return _grads(lambda *a: cheri_block(*a, dilation, residual_scale, eps), grad_out,
                  (x, conv_weight, linear1_weight, linear2_weight))


def conv_weight_grad_abs(grad_out, x, conv_weight, dilation, linear1_weight=None,
                         linear2_weight=None, residual_scale=0.15, eps=1e-3):
    """sum over n, l of |dconv[n, l, c]| |x[n, l + (k - 1) d, c]| in float64, the magnitude behind
    each element of the conv weight's gradient (dconv the gradient of the convolution's output),
    of dilated_conv_norm, or of cheri_block when the Linear weights are given. The normalisation
    makes dconv nearly orthogonal to the convolution, so the gradient itself can be far smaller
    than its terms (see mhc_post_abs)."""
    x, w = x.detach().double(), conv_weight.detach().double()
    conv = dilated_conv(x, w, dilation).requires_grad_()
    with torch.enable_grad():
        out = _normalise(conv, eps)[0]
        if linear1_weight is not None:
            out = x + _mlp(out, linear1_weight.double(), linear2_weight.double(), residual_scale)
        (dconv,) = torch.autograd.grad(out, conv, grad_out.double())
        leaf = w.clone().requires_grad_()
        (scale,) = torch.autograd.grad(dilated_conv(x.abs(), leaf, dilation), leaf, dconv.abs())
    return scale
