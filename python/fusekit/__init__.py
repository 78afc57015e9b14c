"""fusekit: fused deep-learning operators for CPU and CUDA.

    import fusekit
    out = fusekit.mhc_post(x, residual, post_layer_mix, comb_res_mix)
    y = fusekit.layernorm_linear_gelu(x, weight, bias, ln_weight=gamma, ln_bias=beta)
    z = fusekit.trimul(pair, mask, module.state_dict(), direction="incoming")
    o = fusekit.causal_attention(q, k, v, n_padd)
    h = fusekit.cheri_block(x, conv_weight, linear1_weight, linear2_weight, dilation=4)

Arrays are torch tensors or numpy arrays, all of one framework. They reach the C++ library as they
are: any strides, no copy, no dtype cast, no device move. The library validates them and raises
fusekit.Error (a RuntimeError) saying what it expected and what came. Outputs are allocated,
contiguous, with the caller's framework on the inputs' device (torch.empty_like, so PyTorch's
caching allocator serves them; np.empty for numpy) and returned in it. A torch CUDA call is
enqueued on the current torch stream of the inputs' device and does not synchronise.

With torch installed, every operator is also a torch.library op (torch.ops.fusekit.*, registered
by fusekit.torch) with torch.compile support, and autograd where the operator has a backward. The
functions here take that route when autograd or a compiler is involved, and call the C++ library
directly otherwise.

Each operator's manual (formula, shapes, dtypes, aliasing, determinism) is its C++ header,
include/fusekit/ops/<op>.h.
"""

from collections.abc import Mapping as _Mapping
from operator import index as _index

try:  # torch first: its CUDA runtime library then also serves the extension module
    import torch as _torch
except ImportError:
    _torch = None
try:
    import numpy as _np
except ImportError:
    _np = None

from . import _C
from ._C import Error, build_info, cuda_device_count, cuda_device_info

__version__ = build_info()["version"]
__all__ = [
    "Error",
    "build_info",
    "causal_attention",
    "cheri_block",
    "cheri_block_backward",
    "cheri_block_train",
    "cuda_device_count",
    "cuda_device_info",
    "dilated_conv_norm",
    "dilated_conv_norm_backward",
    "layernorm_linear_gelu",
    "mhc_post",
    "mhc_post_backward",
    "trimul",
]

_Tensor = _torch.Tensor if _torch is not None else None
_ndarray = _np.ndarray if _np is not None else None

if _torch is not None:
    from . import torch as _ops  # registers torch.ops.fusekit.*
    from .torch import _dl, _empty, _stream

    _PLAIN_TENSORS = (_Tensor, _torch.nn.Parameter)  # a Parameter's data is a plain tensor's
    _is_compiling = _torch.compiler.is_compiling
    _grad_enabled = _torch.is_grad_enabled
    _dispatch_modes = getattr(_torch._C, "_len_torch_dispatch_stack", lambda: 0)
    # the innermost torch.func transform (grad, vmap, ...) in effect, or None
    _functorch_transform = getattr(getattr(_torch._C, "_functorch", None),
                                   "peek_interpreter_stack", lambda: None)


# ------------------------------------------------------------------------------ shared helpers


def _type_name(obj):
    t = type(obj)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _framework(op, names, arrays):
    """The array type shared by all `arrays` (torch.Tensor or numpy.ndarray); raises Error
    naming the first argument that differs."""
    first = arrays[0]
    if _Tensor is not None and isinstance(first, _Tensor):
        kind = _Tensor
    elif _ndarray is not None and isinstance(first, _ndarray):
        kind = _ndarray
    else:
        raise Error(f"{op}: {names[0]} is a {_type_name(first)}, expected a torch.Tensor or a "
                    "numpy.ndarray")
    for name, a in zip(names, arrays):
        if not isinstance(a, kind):
            raise Error(f"{op}: {name} is a {_type_name(a)} but {names[0]} is a "
                        f"{_type_name(first)}; expected arrays of one framework")
    return kind


def _check_out(op, out, kind, example):
    if not isinstance(out, kind):
        raise Error(f"{op}: out is a {_type_name(out)} but the inputs are "
                    f"{_type_name(example)}s; expected out of the inputs' framework")


def _needs_torch_op(tensors):
    """True when the call must go through the registered torch op: a compiler is tracing, a
    torch dispatch mode or torch.func transform is active, a tensor subclass (fake, functional,
    ...) is involved, or autograd has to record the call."""
    if _is_compiling() or _dispatch_modes() or _functorch_transform():
        return True
    for t in tensors:
        if type(t) is not _Tensor:
            return True
    if _grad_enabled():
        for t in tensors:
            if t.requires_grad:
                return True
    return False


# ------------------------------------------------------------------------------ mhc_post

_MHC_POST_ARGS = ("x", "residual", "post_layer_mix", "comb_res_mix")
_MHC_POST_BACKWARD_ARGS = ("grad_out",) + _MHC_POST_ARGS


def mhc_post(x, residual, post_layer_mix, comb_res_mix, out=None):
    """out[n, i, h] = post_layer_mix[n, i] * x[n, h] + sum_j comb_res_mix[n, j, i] * residual[n, j, h]

    x [N, H] and residual [N, hc, H] in float32, float16 or bfloat16 (one dtype); post_layer_mix
    [N, hc] or [N, hc, 1] and comb_res_mix [N, hc, hc] in float32; 1 <= hc <= 8. Returns out
    [N, hc, H] in x's dtype. If `out` is given it is written and returned; it must not overlap an
    input, and cannot be used when autograd records the call. Differentiable through torch
    autograd; see include/fusekit/ops/mhc_post.h.
    """
    inputs = (x, residual, post_layer_mix, comb_res_mix)
    kind = _framework("mhc_post", _MHC_POST_ARGS, inputs)
    if kind is _Tensor:
        if out is not None:
            _check_out("mhc_post", out, kind, x)
        if _needs_torch_op(inputs if out is None else inputs + (out,)):
            if out is None and _eager_autograd_call(inputs):
                return _eager(_ops.MhcPostFunction).apply(*inputs)
            return _ops.call_mhc_post(x, residual, post_layer_mix, comb_res_mix, out)
        if out is None:
            out = _empty(residual)
        _C.mhc_post(_dl(out), _dl(x), _dl(residual), _dl(post_layer_mix), _dl(comb_res_mix),
                    _stream(x))
        return out
    if out is None:
        out = _np.empty(residual.shape, dtype=residual.dtype)
    else:
        _check_out("mhc_post", out, kind, x)
    _C.mhc_post(out, x, residual, post_layer_mix, comb_res_mix, 0)
    return out


def mhc_post_backward(grad_out, x, residual, post_layer_mix, comb_res_mix):
    """The gradients of mhc_post given grad_out [N, hc, H] (x's dtype).

    Returns (grad_x, grad_residual, grad_post_layer_mix, grad_comb_res_mix), each in the shape
    of its input (grad_post_layer_mix as post_layer_mix: [N, hc] or [N, hc, 1]); grad_x and
    grad_residual in x's dtype, the other two in float32. Bitwise deterministic for a given
    device, shape and stride pattern.
    """
    inputs = (grad_out, x, residual, post_layer_mix, comb_res_mix)
    kind = _framework("mhc_post_backward", _MHC_POST_BACKWARD_ARGS, inputs)
    if kind is _Tensor:
        if _needs_torch_op(inputs):
            return tuple(_torch.ops.fusekit.mhc_post_backward(*inputs))
        return _ops.run_mhc_post_backward(*inputs)
    grads = tuple(_np.empty(t.shape, dtype=t.dtype) for t in inputs[1:])
    _C.mhc_post_backward(*grads, *inputs, 0)
    return grads


# -------------------------------------------------------------------------- layernorm_linear_gelu

_LLG_ARGS = ("x", "weight", "bias", "ln_weight", "ln_bias")
_GELU_TANH = {"tanh": True, "none": False}


def _direct_torch_call(tensors):
    """True when the C++ library can be called directly on `tensors` (None entries skipped): all
    are plain torch.Tensors or nn.Parameters, no compiler or torch dispatch mode is active, and
    autograd has nothing to record, under no torch.func transform. The cheap test of the common
    case; everything else takes the general path."""
    if _Tensor is None or _is_compiling() or _dispatch_modes() or _functorch_transform():
        return False
    grad = _grad_enabled()
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN_TENSORS or (grad and t.requires_grad)):
            return False
    return True


def _eager_autograd_call(tensors):
    """True when autograd records the call in plain eager mode (`tensors`, None entries skipped,
    are plain torch.Tensors or nn.Parameters, one of them requires grad; no compiler or torch
    dispatch mode is active; grad is enabled). Such calls take the operator's
    torch.autograd.Function (_eager), which calls the library directly: the registered op's
    Python autograd wrapper costs several hundred microseconds of host time a call, more than a
    small training step's kernels take. Compilers, modes and subclasses keep the registered op."""
    if _Tensor is None or _is_compiling() or _dispatch_modes() or not _grad_enabled():
        return False
    grad = False
    for t in tensors:
        if t is not None:
            if type(t) not in _PLAIN_TENSORS:
                return False
            grad = grad or t.requires_grad
    return grad


def _eager(function):
    """The eager autograd Function `function`, or under a torch.func transform its form for
    those (function.functorch: torch.func.grad and vjp differentiate through it; vmap and jvp
    are refused with an error that says what to do instead)."""
    return function.functorch if _functorch_transform() is not None else function


def layernorm_linear_gelu(x, weight, bias=None, *, ln_weight=None, ln_bias=None, eps=1e-5,
                          approximate="tanh", out=None, allow_tf32=True):
    """out = GELU(LayerNorm(x) @ weight.T + bias)

    LayerNorm over the last axis (biased variance, eps; then * ln_weight + ln_bias when given),
    a Linear layer, and GELU with approximate "tanh" or "none" (exact, erf), named as in
    torch.nn.functional.gelu.

    x [..., K] in float32, float16 or bfloat16, any strides; weight [Nout, K] in x's dtype with
    one axis contiguous (a row-major [Nout, K], or the transpose of a row-major [K, Nout]); bias
    [Nout] in x's dtype, contiguous; ln_weight and ln_bias [K] in x's dtype or float32. bias,
    ln_weight and ln_bias may be None. Returns out [..., Nout] in x's dtype. If `out` is given it
    is written and returned; its last axis must be contiguous and it must not overlap an input.
    allow_tf32 lets float32 matrix products use TF32 tensor cores on CUDA.

    Forward only: autograd records the call, but backpropagating through it raises
    fusekit.Error. See include/fusekit/ops/layernorm_linear_gelu.h.
    """
    tanh = _GELU_TANH.get(approximate) if type(approximate) is str else None
    if tanh is None:
        raise ValueError(f"layernorm_linear_gelu: approximate is {approximate!r}, expected "
                         "'tanh' or 'none'")
    if _direct_torch_call((x, weight, bias, ln_weight, ln_bias, out)):
        if out is None:
            out = x.new_empty((*x.shape[:-1], *weight.shape[:1]))
        _C.layernorm_linear_gelu(_dl(out), _dl(x), _dl(weight),
                                 None if bias is None else _dl(bias),
                                 None if ln_weight is None else _dl(ln_weight),
                                 None if ln_bias is None else _dl(ln_bias),
                                 eps, tanh, allow_tf32, _stream(x))
        return out

    given = [(name, t) for name, t in zip(_LLG_ARGS, (x, weight, bias, ln_weight, ln_bias))
             if t is not None]
    kind = _framework("layernorm_linear_gelu", *zip(*given))
    if out is not None:
        _check_out("layernorm_linear_gelu", out, kind, x)
    if kind is _Tensor:
        return _ops.call_layernorm_linear_gelu(x, weight, bias, ln_weight, ln_bias, eps,
                                               approximate, allow_tf32, out)
    if out is None:
        out = _np.empty((*x.shape[:-1], *weight.shape[:1]), dtype=x.dtype)
    _C.layernorm_linear_gelu(out, x, weight, bias, ln_weight, ln_bias, eps, tanh, allow_tf32, 0)
    return out


# ------------------------------------------------------------------------------------ trimul

# The parameters in the order of the binding's arguments (fusekit::TrimulWeights), keyed by their
# names in the PyTorch module (fusekit.torch.TriangleMultiplication, and the reference TriMul).
_TRIMUL_KEYS = (
    "norm.weight",
    "norm.bias",
    "left_proj.weight",
    "right_proj.weight",
    "left_gate.weight",
    "right_gate.weight",
    "out_gate.weight",
    "to_out_norm.weight",
    "to_out_norm.bias",
    "to_out.weight",
)
_TRIMUL_INCOMING = {"outgoing": False, "incoming": True}


def trimul(x, mask, weights, *, direction="outgoing", eps=1e-5, out=None):
    """The triangle multiplicative update of AlphaFold 3, forward:

        xn    = LayerNorm(x) * norm.weight + norm.bias
        left  = (xn @ left_proj.weight.T)  * mask * sigmoid(xn @ left_gate.weight.T)
        right = (xn @ right_proj.weight.T) * mask * sigmoid(xn @ right_gate.weight.T)
        gate  = sigmoid(xn @ out_gate.weight.T)
        p     = sum_k left[b, i, k] * right[b, j, k]      direction "outgoing"
                sum_k left[b, k, i] * right[b, k, j]      direction "incoming"
        out   = ((LayerNorm(p) * to_out_norm.weight + to_out_norm.bias) * gate) @ to_out.weight.T

    with the LayerNorms over the last axis (C, then H). x [B, N, N, C] or [N, N, C] in float32,
    float16 or bfloat16 with its last axis contiguous (other strides any; any other x raises
    fusekit.Error, it is not copied); mask [B, N, N] (or [N, N]) in float32, float16, bfloat16,
    bool or uint8, or None for no mask. `weights` is a dict of the module's parameters keyed by their names, as a state
    dict of fusekit.torch.TriangleMultiplication (or of the reference TriMul module) has them:
    norm.weight, norm.bias [C]; left_proj.weight, right_proj.weight, left_gate.weight,
    right_gate.weight, out_gate.weight [H, C]; to_out_norm.weight, to_out_norm.bias [H];
    to_out.weight [C, H]; each float32 or x's dtype, any strides. eps is that of both
    LayerNorms. Returns out in x's shape and dtype. If `out` is given it is written and
    returned; its last axis must be contiguous and it must not overlap an input.

    Forward only: autograd records the call, but backpropagating through it raises
    fusekit.Error. On CUDA the products run on tensor cores with float16 operands; see
    include/fusekit/ops/trimul.h for the precision, memory and determinism.
    """
    return _trimul(x, mask, _trimul_weights(weights), direction, eps, out)


def _trimul(x, mask, weights, direction, eps, out):
    """fusekit.trimul with the weights as a list in _TRIMUL_KEYS order."""
    incoming = _TRIMUL_INCOMING.get(direction) if type(direction) is str else None
    if incoming is None:
        raise ValueError(f"trimul: direction is {direction!r}, expected 'outgoing' or 'incoming'")
    # x is required, and _direct_torch_call passes over None
    if x is not None and _direct_torch_call((x, mask, out, *weights)):
        if out is None:
            out = x.new_empty(x.shape)
        xb, mask_b, out_b = _trimul_batched(x, mask, out)
        _C.trimul(_dl(out_b), _dl(xb), None if mask_b is None else _dl(mask_b),
                  *[_dl(w) for w in weights], incoming, eps, _stream(x))
        return out

    names, arrays = ["x", *_TRIMUL_KEYS], [x, *weights]
    if mask is not None:
        names.insert(1, "mask")
        arrays.insert(1, mask)
    kind = _framework("trimul", names, arrays)
    if out is not None:
        _check_out("trimul", out, kind, x)
    if kind is _Tensor:
        xb, mask_b, out_b = _trimul_batched(x, mask, out)
        result = _ops.call_trimul(xb, mask_b, weights, direction, eps, out_b)
        if out is not None:
            return out
        return result if xb is x else result[0]
    if out is None:
        out = _np.empty(x.shape, dtype=x.dtype)
    xb, mask_b, out_b = _trimul_batched(x, mask, out)
    _C.trimul(out_b, xb, mask_b, *weights, incoming, eps, 0)
    return out


def _trimul_batched(x, mask, out):
    """(x, mask, out) with a batch axis: for x [N, N, C], views with B = 1 (mask and out may be
    None)."""
    if x.ndim == 4:
        return x, mask, out
    if x.ndim != 3:
        raise Error(f"trimul: x has {x.ndim} dims {list(x.shape)}, expected 4 dims [B, N, N, C] "
                    "or 3 dims [N, N, C]")
    for name, a, ndim, dims in (("mask", mask, 2, "[N, N]"), ("out", out, 3, "[N, N, C]")):
        if a is not None and a.ndim != ndim:
            raise Error(f"trimul: {name} has {a.ndim} dims {list(a.shape)} but x {list(x.shape)} "
                        f"has no batch axis; expected {name} {dims}")
    return x[None], None if mask is None else mask[None], None if out is None else out[None]


def _trimul_weights(weights):
    """The parameters in _TRIMUL_KEYS order, looked up in the dict `weights`."""
    try:
        values = [weights[k] for k in _TRIMUL_KEYS]
        if len(weights) == len(values):
            for v in values:
                if v is None:
                    break
            else:
                return values
    except (KeyError, TypeError):
        pass
    raise _trimul_weights_error(weights)


def _trimul_weights_error(weights):
    """The Error saying what is wrong with `weights`: no dict, or keys missing, None or extra."""
    expected = f"expected exactly the keys {', '.join(_TRIMUL_KEYS)}"
    if not isinstance(weights, _Mapping):
        return Error(f"trimul: weights is a {_type_name(weights)}, expected a dict of the module's "
                     f"parameters keyed by name; {expected}")
    missing = [k for k in _TRIMUL_KEYS if k not in weights]
    if missing:
        return Error(f"trimul: weights has no {', '.join(map(repr, missing))}; {expected}")
    unset = [k for k in _TRIMUL_KEYS if weights[k] is None]
    if unset:
        return Error(f"trimul: weights[{unset[0]!r}] is None, expected an array")
    extra = [k for k in weights if k not in _TRIMUL_KEYS]
    return Error(f"trimul: weights has the unexpected key{'s' if len(extra) > 1 else ''} "
                 f"{', '.join(map(repr, extra))}; {expected}")


# ---------------------------------------------------------------------------- causal_attention


def causal_attention(q, k, v, n_padd=0, *, scale=None, out=None, return_lse=False,
                     allow_tf32=False):
    """Causal self-attention over left-padded sequences, forward: query i of sequence b attends
    keys j with n_padd[b] <= j <= i,

        out[b, h, i] = softmax_j(scale * q[b, h, i] . k[b, g, j]) @ v[b, g, j]   i >= n_padd[b]
        out[b, h, i] = 0                                                        i <  n_padd[b]
        lse[b, h, i] = log sum_j exp(scale * q[b, h, i] . k[b, g, j])  (-inf where i < n_padd[b])

    with g = h // (H // Hkv), the key/value head of query head h (grouped-query attention).

    q [B, H, T, D] in float32, float16 or bfloat16; k and v [B, Hkv, T, D] in q's dtype, Hkv
    dividing H; or all three [T, D], a single head. Any strides with a unit stride on D; nothing
    is copied (any other layout raises fusekit.Error). n_padd is an int, the same count for every
    sequence, or an int32 array [B] (torch.Tensor on the inputs' device, or numpy.ndarray), one
    count per sequence; each count in [0, T]. Other integer dtypes raise fusekit.Error rather
    than being converted. (The library's messages call the two padding.all and
    padding.per_sequence, as the C++ API does.) scale defaults to 1 / sqrt(D); allow_tf32 lets
    float32 products use TF32 tensor cores on CUDA.

    Returns out in q's shape and dtype, or (out, lse) with return_lse, lse float32 [B, H, T]
    (or [T]). Padding rows of out are zeros, and padding keys, values and queries are never read.
    If `out` is given it is written and returned; its D axis must be contiguous and it must not
    overlap an input. Forward only: autograd records the call, but backpropagating through it
    raises fusekit.Error. See include/fusekit/ops/causal_attention.h.
    """
    if type(n_padd) is int:
        per_sequence = None
    else:
        n_padd, per_sequence = _left_padding(n_padd)
    if _direct_torch_call((q, k, v, per_sequence, out)):
        if out is None:
            out = _empty(q)
        lse = q.new_empty(q.shape[:-1], dtype=_torch.float32) if return_lse else None
        _C.causal_attention(_dl(out), None if lse is None else _dl(lse), _dl(q), _dl(k), _dl(v),
                            n_padd, None if per_sequence is None else _dl(per_sequence), scale,
                            allow_tf32, _stream(q))
        return (out, lse) if return_lse else out

    names, arrays = ["q", "k", "v"], [q, k, v]
    if per_sequence is not None:
        names.append("n_padd")
        arrays.append(per_sequence)
    kind = _framework("causal_attention", names, arrays)
    if out is not None:
        _check_out("causal_attention", out, kind, q)
    if kind is _Tensor:
        out, lse = _ops.call_causal_attention(q, k, v, n_padd, per_sequence, scale, allow_tf32,
                                              out)
        return (out, lse) if return_lse else out
    if out is None:
        out = _np.empty(q.shape, dtype=q.dtype)
    lse = _np.empty(q.shape[:-1], dtype=_np.float32) if return_lse else None
    _C.causal_attention(out, lse, q, k, v, n_padd, per_sequence, scale, allow_tf32, 0)
    return (out, lse) if return_lse else out


def _left_padding(n_padd):
    """(count, per_sequence) of an n_padd argument: an integer is one count for all sequences
    (count, None); an array is one count per sequence (0, array), checked by the library."""
    if (_Tensor is not None and isinstance(n_padd, _Tensor)) or (
            _ndarray is not None and isinstance(n_padd, _ndarray)):
        return 0, n_padd
    if _torch is not None and isinstance(n_padd, _torch.SymInt):  # traced by a compiler
        return n_padd, None
    if not isinstance(n_padd, bool):
        try:
            return _index(n_padd), None
        except TypeError:
            pass
    raise Error(f"causal_attention: n_padd is a {_type_name(n_padd)}, expected an int or an "
                "int32 array [B] (torch.Tensor or numpy.ndarray)")


# ---------------------------------------------------------------------------------- cheri_block

_CHERI_ARGS = ("x", "conv_weight", "linear1_weight", "linear2_weight")
_CHERI_BACKWARD_ARGS = ("grad_out",) + _CHERI_ARGS + ("mean", "rstd")


def cheri_block(x, conv_weight, linear1_weight, linear2_weight, dilation, residual_scale=0.15, *,
                eps=1e-3, out=None, allow_tf32=True):
    """The Cheri block (a ConvNeXt-style block of a genomics model), forward:

        conv[n, l, c] = w[0, c] x[n, l - d, c] + w[1, c] x[n, l, c] + w[2, c] x[n, l + d, c]
        y             = (conv - mean_n) * rstd_n    over each example's (L, C) plane, eps
        out           = x + residual_scale * GELU_tanh(y @ linear1_weight.T) @ linear2_weight.T

    with x zero outside 0 <= l < L and d = dilation >= 1 (d >= L included). x [N, L, C] in
    float32, float16 or bfloat16 with its last axis contiguous (other strides any; nothing is
    copied); conv_weight [3, C] (conv_weight[k, c] the tap of x[l + (k - 1) d], as the model's
    parameter is laid out), linear1_weight [E C, C] and linear2_weight [C, E C] (the Linear
    layers' weights), each float32 or x's dtype, any strides. Returns out in x's shape and dtype.
    If `out` is given it is written and returned; its last axis must be contiguous and it must
    not overlap an input.

    Without autograd this is the inference forward (on CUDA its products may run in half
    precision). When autograd records the call (grad enabled and an input requiring grad) it
    runs the training forward instead, differentiable through torch autograd, with TF32 products
    for float32 inputs on CUDA unless allow_tf32 is False; `out` is refused then. See
    include/fusekit/ops/cheri_block.h.
    """
    return _cheri_block(x, conv_weight, linear1_weight, linear2_weight, dilation, residual_scale,
                        eps, allow_tf32, out)


def _cheri_block(x, conv_weight, linear1_weight, linear2_weight, dilation, residual_scale, eps,
                 allow_tf32, out):
    """fusekit.cheri_block with positional arguments (the module's call)."""
    if _direct_torch_call((x, conv_weight, linear1_weight, linear2_weight, out)):
        if out is None:
            out = _empty(x)
        _C.cheri_block_inference(_dl(out), _dl(x), _dl(conv_weight), _dl(linear1_weight),
                                 _dl(linear2_weight), dilation, residual_scale, eps, _stream(x))
        return out
    inputs = (x, conv_weight, linear1_weight, linear2_weight)
    if out is None and _eager_autograd_call(inputs):
        return _eager(_ops.CheriBlockFunction).apply(*inputs, dilation, residual_scale, eps,
                                                     allow_tf32)[0]
    kind = _framework("cheri_block", _CHERI_ARGS, inputs)
    if out is not None:
        _check_out("cheri_block", out, kind, x)
    if kind is _Tensor:
        return _ops.call_cheri_block(*inputs, dilation, residual_scale, eps, allow_tf32, out)
    if out is None:
        out = _np.empty(x.shape, dtype=x.dtype)
    _C.cheri_block_inference(out, *inputs, dilation, residual_scale, eps, 0)
    return out


def cheri_block_train(x, conv_weight, linear1_weight, linear2_weight, dilation,
                      residual_scale=0.15, *, eps=1e-3, allow_tf32=True):
    """The Cheri block's training forward: (out, mean, rstd), out as fusekit.cheri_block's (in x's
    shape and dtype), mean and rstd the float32 statistics [N] of each example's normalisation,
    which cheri_block_backward takes. Differentiable through torch autograd (out; mean and rstd
    are not). allow_tf32 lets float32 products use TF32 tensor cores on CUDA.
    """
    inputs = (x, conv_weight, linear1_weight, linear2_weight)
    if _direct_torch_call(inputs):
        return _ops.run_cheri_block_unsaved(*inputs, dilation, residual_scale, eps, allow_tf32)
    if _eager_autograd_call(inputs):
        return _eager(_ops.CheriBlockFunction).apply(*inputs, dilation, residual_scale, eps,
                                                     allow_tf32)[:3]
    kind = _framework("cheri_block", _CHERI_ARGS, inputs)
    if kind is _Tensor:
        return tuple(_torch.ops.fusekit.cheri_block(*inputs, dilation, residual_scale, eps,
                                                    allow_tf32))[:3]
    out = _np.empty(x.shape, dtype=x.dtype)
    mean, rstd = (_np.empty(x.shape[:1], dtype=_np.float32) for _ in range(2))
    _C.cheri_block(out, mean, rstd, None, *inputs, dilation, residual_scale, eps, allow_tf32, 0)
    return out, mean, rstd


def cheri_block_backward(grad_out, x, conv_weight, linear1_weight, linear2_weight, mean, rstd,
                         dilation, residual_scale=0.15, *, eps=1e-3, allow_tf32=True):
    """The gradients of the Cheri block's training forward given grad_out [N, L, C] (x's dtype,
    last axis contiguous) and the forward's mean and rstd: (grad_x, grad_conv_weight,
    grad_linear1_weight, grad_linear2_weight), each in its input's shape and dtype. Everything
    else is recomputed. Bitwise deterministic.
    """
    inputs = (grad_out, x, conv_weight, linear1_weight, linear2_weight, mean, rstd)
    if _direct_torch_call(inputs):
        return _ops.run_cheri_block_backward(*inputs, dilation, residual_scale, eps, allow_tf32)
    kind = _framework("cheri_block_backward", _CHERI_BACKWARD_ARGS, inputs)
    if kind is _Tensor:
        return tuple(_torch.ops.fusekit.cheri_block_backward(*inputs, dilation, residual_scale,
                                                             eps, allow_tf32))
    grads = tuple(_np.empty(t.shape, dtype=t.dtype) for t in inputs[1:5])
    _C.cheri_block_backward(*grads, *inputs, None, dilation, residual_scale, eps, allow_tf32, 0)
    return grads


def dilated_conv_norm(x, conv_weight, dilation, *, eps=1e-3):
    """The first half of the Cheri block: (y, mean, rstd), y the dilated 3-tap depthwise
    convolution of x normalised over each example's (L, C) plane (see fusekit.cheri_block), in
    x's shape and dtype; mean and rstd its float32 statistics [N]. Differentiable through torch
    autograd (y; mean and rstd are not).
    """
    inputs = (x, conv_weight)
    if _direct_torch_call(inputs):
        return _ops.run_dilated_conv_norm(x, conv_weight, dilation, eps)
    if _eager_autograd_call(inputs):
        return _eager(_ops.DilatedConvNormFunction).apply(x, conv_weight, dilation, eps)
    kind = _framework("dilated_conv_norm", ("x", "conv_weight"), inputs)
    if kind is _Tensor:
        return tuple(_torch.ops.fusekit.dilated_conv_norm(x, conv_weight, dilation, eps))
    y = _np.empty(x.shape, dtype=x.dtype)
    mean, rstd = (_np.empty(x.shape[:1], dtype=_np.float32) for _ in range(2))
    _C.dilated_conv_norm(y, mean, rstd, x, conv_weight, dilation, eps, 0)
    return y, mean, rstd


def dilated_conv_norm_backward(grad_y, x, conv_weight, mean, rstd, dilation, *, eps=1e-3):
    """The gradients of dilated_conv_norm given grad_y and the forward's mean and rstd:
    (grad_x, grad_conv_weight), in the shapes and dtypes of x and conv_weight.
    """
    inputs = (grad_y, x, conv_weight, mean, rstd)
    if _direct_torch_call(inputs):
        return _ops.run_dilated_conv_norm_backward(*inputs, dilation, eps)
    kind = _framework("dilated_conv_norm_backward",
                      ("grad_y", "x", "conv_weight", "mean", "rstd"), inputs)
    if kind is _Tensor:
        return tuple(_torch.ops.fusekit.dilated_conv_norm_backward(*inputs, dilation, eps))
    grads = (_np.empty(x.shape, dtype=x.dtype), _np.empty(conv_weight.shape,
                                                          dtype=conv_weight.dtype))
    _C.dilated_conv_norm_backward(*grads, *inputs, dilation, eps, 0)
    return grads
