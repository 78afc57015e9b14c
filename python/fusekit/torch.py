"""fusekit's operators as torch.library ops, with autograd and torch.compile support.

    torch.ops.fusekit.mhc_post(x, residual, post_layer_mix, comb_res_mix) -> out
    torch.ops.fusekit.mhc_post_backward(grad_out, x, residual, post_layer_mix, comb_res_mix)
        -> (grad_x, grad_residual, grad_post_layer_mix, grad_comb_res_mix)
    torch.ops.fusekit.layernorm_linear_gelu(x, weight, bias=None, ln_weight=None, ln_bias=None,
                                            eps=1e-5, approximate="tanh", allow_tf32=True) -> out
    torch.ops.fusekit.trimul(x, mask, norm_weight, norm_bias, left_proj, right_proj, left_gate,
                             right_gate, out_gate, to_out_norm_weight, to_out_norm_bias, to_out,
                             direction="outgoing", eps=1e-5) -> out
    torch.ops.fusekit.causal_attention(q, k, v, n_padd=0, n_padd_per_sequence=None, scale=None,
                                       allow_tf32=False) -> (out, lse)
    torch.ops.fusekit.dilated_conv_norm(x, conv_weight, dilation, eps=1e-3) -> (y, mean, rstd)
    torch.ops.fusekit.dilated_conv_norm_backward(grad_y, x, conv_weight, mean, rstd, dilation,
                                                 eps=1e-3) -> (grad_x, grad_conv_weight)
    torch.ops.fusekit.cheri_block(x, conv_weight, linear1_weight, linear2_weight, dilation,
                                  residual_scale=0.15, eps=1e-3, allow_tf32=True)
        -> (out, mean, rstd, saved)
    torch.ops.fusekit.cheri_block_backward(grad_out, x, conv_weight, linear1_weight,
                                           linear2_weight, mean, rstd, dilation,
                                           residual_scale=0.15, eps=1e-3, allow_tf32=True,
                                           saved=None)
        -> (grad_x, grad_conv_weight, grad_linear1_weight, grad_linear2_weight)
    torch.ops.fusekit.cheri_block_inference(x, conv_weight, linear1_weight, linear2_weight,
                                            dilation, residual_scale=0.15, eps=1e-3) -> out

and the modules LayerNormLinearGELU, TriangleMultiplication and CheriBlock, which call
fusekit.layernorm_linear_gelu, fusekit.trimul and fusekit.cheri_block.

`import fusekit` registers them when torch is installed. Each op allocates its outputs
(contiguous) on the inputs' device and runs the C++ library on the current stream of that device.
The fake implementations give the same shapes, dtypes and strides without running anything, so
torch.compile and torch.export trace through them. The autograd formulas of mhc_post,
dilated_conv_norm and cheri_block (the training forward) are their backward ops (mean, rstd
and cheri_block's saved, the rows its backward reads where the library keeps them, are not
differentiable); layernorm_linear_gelu, trimul, causal_attention and
cheri_block_inference are forward only, and backpropagating through them raises fusekit.Error.
In plain eager autograd fusekit.mhc_post, fusekit.dilated_conv_norm and fusekit.cheri_block
record MhcPostFunction, DilatedConvNormFunction and CheriBlockFunction instead: the same
forward and backward calls of the library, without the ops' Python autograd wrappers. Under a
torch.func transform they take each Function's form for those (_functorch_form): grad and vjp
differentiate through it; vmap or jacrev of a differentiable call, jvp and nested transforms
raise fusekit.Error.
"""

import contextlib
import math
from typing import Optional

import torch
import torch.utils.dlpack
from torch import Tensor
from torch.autograd.function import once_differentiable

import fusekit

from . import _C

__all__ = [
    "CheriBlock",
    "LayerNormLinearGELU",
    "TriangleMultiplication",
    "causal_attention",
    "cheri_block",
    "cheri_block_backward",
    "cheri_block_inference",
    "dilated_conv_norm",
    "dilated_conv_norm_backward",
    "layernorm_linear_gelu",
    "mhc_post",
    "mhc_post_backward",
    "trimul",
]

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
if _raw_stream is None:

    def _raw_stream(index):
        return torch.cuda.current_stream(index).cuda_stream


def _stream(t):
    """The current torch stream of t's CUDA device, as an int; 0 on the CPU."""
    return _raw_stream(t.get_device()) if t.is_cuda else 0


# The tensor -> DLPack capsule exporter implemented in C++. nanobind takes the capsule as it takes
# the tensor, but skipping Tensor.__dlpack__'s Python wrapper saves about 2 us per tensor, and it
# also exports tensors that require grad (the kernels only read their data).
_dl = torch.utils.dlpack.to_dlpack


def _refuse_backward(op, name, message=None):
    """Registers, for the forward-only `op`, a backward that raises `message` (by default: the
    operator is forward only). Autograd then records a call of the op, so that forward passes with
    parameters that require grad still run, and backward fails with this message rather than
    torch's generic one."""
    message = message or (f"{name}: backward was called, but the operator is forward only; "
                           "expected it under torch.no_grad() or torch.inference_mode(), or on "
                           "tensors that do not require grad")

    def setup_context(ctx, inputs, output):
        pass  # nothing to save: the backward only reports that there is none

    def backward(ctx, *grads):
        raise _C.Error(message)

    op.register_autograd(backward, setup_context=setup_context)


def _outside_transform():
    """A context in which the innermost torch.func transform, if one is in effect, is set aside
    (tensors made there are plain tensors)."""
    if torch._C._functorch.peek_interpreter_stack() is None:
        return contextlib.nullcontext()  # a vjp's function called after the transform returned
    from torch._functorch.pyfunctorch import temporarily_pop_interpreter_stack

    return temporarily_pop_interpreter_stack()


def _functorch_form(name, function, run, setup_context, materialize_grads=True):
    """Attaches to the eager autograd Function `function` (its forward `run` then
    `setup_context`) the form torch.func transforms take, as function.functorch: the same forward,
    context and backward with the context set up apart from the forward, which torch.func.grad
    and vjp require (the transform calls the forward on the tensors it wraps, which the library
    reads). Transforms that batch the differentiable call (vmap, and jacrev, which vmaps the
    backward) or push tangents forward (jvp, jacfwd) are refused with an error (naming the
    operator `name`) that says so."""
    functorch = torch._C._functorch

    def plain(t):
        """t, or the tensor a single torch.func wrapper holds (the library reads plain tensors);
        nested transforms are refused rather than differentiated as constants."""
        if t is None or not functorch.is_functorch_wrapped_tensor(t):
            return t
        if functorch.is_batchedtensor(t):  # jacrev's vmap of the backward
            raise refusal("vmap (or jacrev)")
        inner = functorch.get_unwrapped(t)
        if functorch.is_functorch_wrapped_tensor(inner):
            raise _C.Error(f"{name}: nested torch.func transforms (such as grad of grad, or vmap "
                           "of grad) are not supported; expected a single torch.func.grad or vjp")
        return inner

    class Unwrapped:
        """The backward's context with its saved tensors as plain tensors."""

        def __init__(self, ctx):
            self.ctx = ctx
            self.saved_tensors = tuple(plain(t) for t in ctx.saved_tensors)

        def __getattr__(self, attribute):
            return getattr(self.ctx, attribute)

    def refusal(transform):
        return _C.Error(f"{name}: torch.func {transform} of a call that autograd records is not "
                        "supported; expected torch.func.grad or vjp, or the call under "
                        "torch.no_grad() (where vmap runs it example by example)")

    def refuse(transform):
        def method(*args, **kwargs):
            raise refusal(transform)

        return staticmethod(method)

    class Functorch(torch.autograd.Function):
        @staticmethod
        def forward(*inputs):
            return run(*(plain(t) if isinstance(t, torch.Tensor) else t for t in inputs))

        @staticmethod
        def setup_context(ctx, inputs, output):
            setup_context(ctx, inputs, output)
            ctx.set_materialize_grads(materialize_grads)

        @staticmethod
        def backward(ctx, *grads):
            # the transform's backward runs under its level: the library's calls, and the
            # gradients they are given to fill, step out of it
            grads, unwrapped = tuple(plain(g) for g in grads), Unwrapped(ctx)
            with _outside_transform():
                return function.backward(unwrapped, *grads)

        vmap = refuse("vmap (or jacrev)")
        jvp = refuse("jvp (or jacfwd)")

    Functorch.__name__ = Functorch.__qualname__ = f"{function.__name__}Functorch"
    function.functorch = Functorch
    return function


def _refuse_out_under_autograd(op, tensors):
    """Raises when autograd records a call given out= (one of `tensors` requires grad): the copy
    into out would not be differentiable."""
    if torch.is_grad_enabled():
        for t in tensors:
            if t is not None and t.requires_grad:
                raise _C.Error(f"{op}: out= was given while autograd records the call (a tensor "
                               "requires grad); expected out=None under autograd")


def _copy_out(op, out, result):
    """out, after copying result into it (a copy a compiler can fuse), when the two match."""
    if out.shape != result.shape or out.dtype != result.dtype or out.device != result.device:
        raise _C.Error(f"{op}: out is {_describe(out)}, expected {_describe(result)}")
    return out.copy_(result)


def _empty(t):
    """A contiguous tensor of t's shape, dtype and device (also under fake tensor modes)."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


# ------------------------------------------------------------------------------ mhc_post


def run_mhc_post(x, residual, post_layer_mix, comb_res_mix):
    """The library's mhc_post on torch tensors, out allocated here (the op's body, and the eager
    Function's)."""
    out = _empty(residual)
    _C.mhc_post(_dl(out), _dl(x), _dl(residual), _dl(post_layer_mix), _dl(comb_res_mix),
                _stream(x))
    return out


def run_mhc_post_backward(grad_out, x, residual, post_layer_mix, comb_res_mix):
    """The library's mhc_post_backward on torch tensors, the gradients allocated here."""
    grads = (_empty(x), _empty(residual), _empty(post_layer_mix), _empty(comb_res_mix))
    _C.mhc_post_backward(*(_dl(g) for g in grads), _dl(grad_out), _dl(x), _dl(residual),
                         _dl(post_layer_mix), _dl(comb_res_mix), _stream(x))
    return grads


@torch.library.custom_op("fusekit::mhc_post", mutates_args=())
def mhc_post(x: Tensor, residual: Tensor, post_layer_mix: Tensor, comb_res_mix: Tensor) -> Tensor:
    """out[n, i, h] = post_layer_mix[n, i] * x[n, h] + sum_j comb_res_mix[n, j, i] * residual[n, j, h]"""
    return run_mhc_post(x, residual, post_layer_mix, comb_res_mix)


@mhc_post.register_fake
def _mhc_post_fake(x, residual, post_layer_mix, comb_res_mix):
    return _empty(residual)


@torch.library.custom_op("fusekit::mhc_post_backward", mutates_args=())
def mhc_post_backward(grad_out: Tensor, x: Tensor, residual: Tensor, post_layer_mix: Tensor,
                      comb_res_mix: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(grad_x, grad_residual, grad_post_layer_mix, grad_comb_res_mix) of mhc_post, each shaped
    and typed like its input."""
    return run_mhc_post_backward(grad_out, x, residual, post_layer_mix, comb_res_mix)


@mhc_post_backward.register_fake
def _mhc_post_backward_fake(grad_out, x, residual, post_layer_mix, comb_res_mix):
    return _empty(x), _empty(residual), _empty(post_layer_mix), _empty(comb_res_mix)


def _mhc_post_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _mhc_post_autograd(ctx, grad_out):
    # grad_post_layer_mix comes back in post_layer_mix's own shape, [N, hc] or [N, hc, 1].
    return mhc_post_backward(grad_out, *ctx.saved_tensors)


mhc_post.register_autograd(_mhc_post_autograd, setup_context=_mhc_post_setup_context)


class MhcPostFunction(torch.autograd.Function):
    """mhc_post under eager autograd: the op's body, context and formula, with the backward
    called directly rather than through its op (the ops' Python autograd wrappers cost far more
    host time than the calls: see _eager_autograd_call in fusekit/__init__.py). The forward sets
    up its context itself: with a setup_context apart, torch binds the arguments through
    inspect.signature at every call, tens of microseconds of host time (the eager Functions
    below do the same)."""

    @staticmethod
    def forward(ctx, *inputs):
        output = run_mhc_post(*inputs)
        _mhc_post_setup_context(ctx, inputs, output)
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        return run_mhc_post_backward(grad_out, *ctx.saved_tensors)


_functorch_form("mhc_post", MhcPostFunction, run_mhc_post, _mhc_post_setup_context)


def call_mhc_post(x, residual, post_layer_mix, comb_res_mix, out=None):
    """fusekit.mhc_post through the op, for autograd, compilers and tensor subclasses. `out` is
    filled by a copy, which a compiler can fuse; it is refused when autograd records the call."""
    if out is None:
        return mhc_post(x, residual, post_layer_mix, comb_res_mix)
    _refuse_out_under_autograd("mhc_post", (x, residual, post_layer_mix, comb_res_mix, out))
    result = mhc_post(x, residual, post_layer_mix, comb_res_mix)
    return _copy_out("mhc_post", out, result)


def _describe(t):
    """"bfloat16 [4096, 4, 7168] on cuda:0", as the library describes tensors."""
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} on {t.device}"


# -------------------------------------------------------------------------- layernorm_linear_gelu


def _llg_empty(x, weight):
    """The contiguous output [..., Nout] in x's dtype on x's device (also under fake modes)."""
    return x.new_empty((*x.shape[:-1], *weight.shape[:1]))


def _gelu_tanh(approximate):
    if approximate == "tanh":
        return True
    if approximate == "none":
        return False
    raise ValueError(f"layernorm_linear_gelu: approximate is {approximate!r}, expected 'tanh' or "
                     "'none'")


def _dl_optional(t):
    return None if t is None else _dl(t)


@torch.library.custom_op("fusekit::layernorm_linear_gelu", mutates_args=())
def layernorm_linear_gelu(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                          ln_weight: Optional[Tensor] = None, ln_bias: Optional[Tensor] = None,
                          eps: float = 1e-5, approximate: str = "tanh",
                          allow_tf32: bool = True) -> Tensor:
    """out = GELU(LayerNorm(x) @ weight.T + bias), forward only."""
    out = _llg_empty(x, weight)
    _C.layernorm_linear_gelu(_dl(out), _dl(x), _dl(weight), _dl_optional(bias),
                             _dl_optional(ln_weight), _dl_optional(ln_bias), eps,
                             _gelu_tanh(approximate), allow_tf32, _stream(x))
    return out


@layernorm_linear_gelu.register_fake
def _layernorm_linear_gelu_fake(x, weight, bias=None, ln_weight=None, ln_bias=None, eps=1e-5,
                                approximate="tanh", allow_tf32=True):
    _gelu_tanh(approximate)
    return _llg_empty(x, weight)


_refuse_backward(layernorm_linear_gelu, "layernorm_linear_gelu")


def call_layernorm_linear_gelu(x, weight, bias, ln_weight, ln_bias, eps, approximate, allow_tf32,
                               out=None):
    """fusekit.layernorm_linear_gelu through the op, for autograd, compilers and tensor
    subclasses. `out` is filled by a copy, which a compiler can fuse; it is refused when autograd
    records the call."""
    result = layernorm_linear_gelu(x, weight, bias, ln_weight, ln_bias, eps, approximate,
                                   allow_tf32)
    if out is None:
        return result
    _refuse_out_under_autograd("layernorm_linear_gelu",
                               (x, weight, bias, ln_weight, ln_bias, out))
    return _copy_out("layernorm_linear_gelu", out, result)


class LayerNormLinearGELU(torch.nn.Module):
    """GELU(Linear(LayerNorm(x))) in one fusekit call: torch.nn.LayerNorm(in_features, eps,
    elementwise_affine), then torch.nn.Linear(in_features, out_features, bias), then
    torch.nn.GELU(approximate).

    Parameters: weight [out_features, in_features] and bias [out_features] (when bias=True),
    initialised as torch.nn.Linear does; with elementwise_affine, ln_weight and ln_bias
    [in_features], initialised to ones and zeros as torch.nn.LayerNorm does. Set `allow_tf32` to
    False for full float32 matrix products on CUDA.

    Forward only: training through it raises fusekit.Error on backward. Under torch.compile, run
    it where autograd does not record (torch.no_grad(), torch.inference_mode(), or parameters
    that do not require grad): otherwise the compiler traces the backward ahead of time and
    fails with that error.
    """

    def __init__(self, in_features, out_features, bias=True, elementwise_affine=False, eps=1e-5,
                 approximate="tanh", device=None, dtype=None):
        super().__init__()
        _gelu_tanh(approximate)
        factory = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.out_features = out_features
        self.elementwise_affine = elementwise_affine
        self.eps = eps
        self.approximate = approximate
        self.allow_tf32 = True
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, **factory))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        if elementwise_affine:
            self.ln_weight = torch.nn.Parameter(torch.empty(in_features, **factory))
            self.ln_bias = torch.nn.Parameter(torch.empty(in_features, **factory))
        else:
            self.register_parameter("ln_weight", None)
            self.register_parameter("ln_bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        # torch.nn.Linear's initialisation, then torch.nn.LayerNorm's.
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            torch.nn.init.uniform_(self.bias, -bound, bound)
        if self.ln_weight is not None:
            torch.nn.init.ones_(self.ln_weight)
            torch.nn.init.zeros_(self.ln_bias)

    def forward(self, x):
        return fusekit.layernorm_linear_gelu(x, self.weight, self.bias, ln_weight=self.ln_weight,
                                             ln_bias=self.ln_bias, eps=self.eps,
                                             approximate=self.approximate,
                                             allow_tf32=self.allow_tf32)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, elementwise_affine={self.elementwise_affine}, "
                f"eps={self.eps}, approximate={self.approximate!r}")


# ------------------------------------------------------------------------------------ trimul


def _trimul_incoming(direction):
    if direction == "outgoing":
        return False
    if direction == "incoming":
        return True
    raise ValueError(f"trimul: direction is {direction!r}, expected 'outgoing' or 'incoming'")


@torch.library.custom_op("fusekit::trimul", mutates_args=())
def trimul(x: Tensor, mask: Optional[Tensor], norm_weight: Tensor, norm_bias: Tensor,
           left_proj: Tensor, right_proj: Tensor, left_gate: Tensor, right_gate: Tensor,
           out_gate: Tensor, to_out_norm_weight: Tensor, to_out_norm_bias: Tensor, to_out: Tensor,
           direction: str = "outgoing", eps: float = 1e-5) -> Tensor:
    """The triangle multiplicative update, forward only: x [B, N, N, C] -> out [B, N, N, C]; the
    weights as in fusekit::TrimulWeights (include/fusekit/ops/trimul.h)."""
    out = _empty(x)
    weights = (norm_weight, norm_bias, left_proj, right_proj, left_gate, right_gate, out_gate,
               to_out_norm_weight, to_out_norm_bias, to_out)
    _C.trimul(_dl(out), _dl(x), _dl_optional(mask), *[_dl(w) for w in weights],
              _trimul_incoming(direction), eps, _stream(x))
    return out


@trimul.register_fake
def _trimul_fake(x, mask, norm_weight, norm_bias, left_proj, right_proj, left_gate, right_gate,
                 out_gate, to_out_norm_weight, to_out_norm_bias, to_out, direction="outgoing",
                 eps=1e-5):
    _trimul_incoming(direction)
    return _empty(x)


_refuse_backward(trimul, "trimul")


def call_trimul(x, mask, weights, direction, eps, out=None):
    """fusekit.trimul through the op (x [B, N, N, C], `weights` in the op's order), for autograd,
    compilers and tensor subclasses. `out` is filled by a copy, which a compiler can fuse; it is
    refused when autograd records the call."""
    result = trimul(x, mask, *weights, direction, eps)
    if out is None:
        return result
    _refuse_out_under_autograd("trimul", (x, mask, *weights, out))
    return _copy_out("trimul", out, result)


class TriangleMultiplication(torch.nn.Module):
    """The triangle multiplicative update of AlphaFold 3 (outgoing or incoming edges) in one
    fusekit call, with the submodules of the usual PyTorch formulation, so that its state dict
    loads unchanged:

        norm                  torch.nn.LayerNorm(dim)
        left_proj, right_proj, left_gate, right_gate, out_gate
                              torch.nn.Linear(dim, hidden_dim, bias=False)
        to_out_norm           torch.nn.LayerNorm(hidden_dim)
        to_out                torch.nn.Linear(hidden_dim, dim, bias=False)

    forward(x, mask=None): x [B, N, N, dim] or [N, N, dim], mask [B, N, N] (or [N, N]) or None;
    returns fusekit.trimul(x, mask, <the parameters>, direction=direction, eps=eps). The
    submodules are initialised as torch.nn initialises them; `eps` is that of both LayerNorms.

    Forward only: training through it raises fusekit.Error on backward. Under torch.compile, run
    it where autograd does not record (torch.no_grad(), torch.inference_mode(), or parameters
    that do not require grad): otherwise the compiler traces the backward ahead of time and
    fails with that error.
    """

    def __init__(self, dim, hidden_dim, direction="outgoing", eps=1e-5, device=None, dtype=None):
        super().__init__()
        _trimul_incoming(direction)
        factory = {"device": device, "dtype": dtype}
        self.dim = dim
        self.hidden_dim = hidden_dim
        self.direction = direction
        self.eps = eps
        self.norm = torch.nn.LayerNorm(dim, eps=eps, **factory)
        self.left_proj = torch.nn.Linear(dim, hidden_dim, bias=False, **factory)
        self.right_proj = torch.nn.Linear(dim, hidden_dim, bias=False, **factory)
        self.left_gate = torch.nn.Linear(dim, hidden_dim, bias=False, **factory)
        self.right_gate = torch.nn.Linear(dim, hidden_dim, bias=False, **factory)
        self.out_gate = torch.nn.Linear(dim, hidden_dim, bias=False, **factory)
        self.to_out_norm = torch.nn.LayerNorm(hidden_dim, eps=eps, **factory)
        self.to_out = torch.nn.Linear(hidden_dim, dim, bias=False, **factory)

    def forward(self, x, mask=None):
        weights = [self.norm.weight, self.norm.bias, self.left_proj.weight,
                   self.right_proj.weight, self.left_gate.weight, self.right_gate.weight,
                   self.out_gate.weight, self.to_out_norm.weight, self.to_out_norm.bias,
                   self.to_out.weight]  # in the order of fusekit._TRIMUL_KEYS
        return fusekit._trimul(x, mask, weights, self.direction, self.eps, None)

    def extra_repr(self):
        return (f"dim={self.dim}, hidden_dim={self.hidden_dim}, direction={self.direction!r}, "
                f"eps={self.eps}")


# ---------------------------------------------------------------------------- causal_attention


def _lse_empty(q):
    """The float32 log-sum-exp [B, H, T] (or [T]) of q's rows, on q's device."""
    return q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("fusekit::causal_attention", mutates_args=())
def causal_attention(q: Tensor, k: Tensor, v: Tensor, n_padd: int = 0,
                     n_padd_per_sequence: Optional[Tensor] = None, scale: Optional[float] = None,
                     allow_tf32: bool = False) -> tuple[Tensor, Tensor]:
    """Causal self-attention over left-padded sequences, forward only: (out, lse) of q [B, H, T, D]
    and k, v [B, Hkv, T, D] (or all [T, D]), padded by n_padd tokens, or by the int32 counts
    n_padd_per_sequence [B] when given. lse is float32 [B, H, T], always computed (it costs one
    float per row)."""
    out, lse = _empty(q), _lse_empty(q)
    _C.causal_attention(_dl(out), _dl(lse), _dl(q), _dl(k), _dl(v), n_padd,
                        _dl_optional(n_padd_per_sequence), scale, allow_tf32, _stream(q))
    return out, lse


@causal_attention.register_fake
def _causal_attention_fake(q, k, v, n_padd=0, n_padd_per_sequence=None, scale=None,
                           allow_tf32=False):
    return _empty(q), _lse_empty(q)


_refuse_backward(causal_attention, "causal_attention")


def call_causal_attention(q, k, v, n_padd, n_padd_per_sequence, scale, allow_tf32, out=None):
    """fusekit.causal_attention through the op, for autograd, compilers and tensor subclasses:
    (out, lse). `out` is filled by a copy, which a compiler can fuse; it is refused when autograd
    records the call."""
    if out is None:
        return causal_attention(q, k, v, n_padd, n_padd_per_sequence, scale, allow_tf32)
    _refuse_out_under_autograd("causal_attention", (q, k, v, out))
    result, lse = causal_attention(q, k, v, n_padd, n_padd_per_sequence, scale, allow_tf32)
    return _copy_out("causal_attention", out, result), lse


# ---------------------------------------------------------------------------------- cheri_block


def _stats_empty(x):
    """The float32 per-example statistics [N] of x [N, L, C], on x's device."""
    return x.new_empty(x.shape[:1], dtype=torch.float32)


def _contiguous_last(t):
    """t with a unit stride on its last axis, as the library reads gradients (autograd hands the
    backward whatever layout the next op produced, e.g. stride 0 from a sum)."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def run_dilated_conv_norm(x, conv_weight, dilation, eps):
    """The library's dilated_conv_norm on torch tensors: (y, mean, rstd), allocated here."""
    y, mean, rstd = _empty(x), _stats_empty(x), _stats_empty(x)
    _C.dilated_conv_norm(_dl(y), _dl(mean), _dl(rstd), _dl(x), _dl(conv_weight), dilation, eps,
                         _stream(x))
    return y, mean, rstd


def run_dilated_conv_norm_backward(grad_y, x, conv_weight, mean, rstd, dilation, eps):
    """The library's dilated_conv_norm_backward on torch tensors: (grad_x, grad_conv_weight)."""
    grad_x, grad_conv = _empty(x), _empty(conv_weight)
    _C.dilated_conv_norm_backward(_dl(grad_x), _dl(grad_conv), _dl(grad_y), _dl(x),
                                  _dl(conv_weight), _dl(mean), _dl(rstd), dilation, eps,
                                  _stream(x))
    return grad_x, grad_conv


@torch.library.custom_op("fusekit::dilated_conv_norm", mutates_args=())
def dilated_conv_norm(x: Tensor, conv_weight: Tensor, dilation: int,
                      eps: float = 1e-3) -> tuple[Tensor, Tensor, Tensor]:
    """(y, mean, rstd): the dilated 3-tap depthwise convolution of x [N, L, C] normalised over
    each example's (L, C) plane; mean and rstd float32 [N]."""
    return run_dilated_conv_norm(x, conv_weight, dilation, eps)


@dilated_conv_norm.register_fake
def _dilated_conv_norm_fake(x, conv_weight, dilation, eps=1e-3):
    return _empty(x), _stats_empty(x), _stats_empty(x)


@torch.library.custom_op("fusekit::dilated_conv_norm_backward", mutates_args=())
def dilated_conv_norm_backward(grad_y: Tensor, x: Tensor, conv_weight: Tensor, mean: Tensor,
                               rstd: Tensor, dilation: int,
                               eps: float = 1e-3) -> tuple[Tensor, Tensor]:
    """(grad_x, grad_conv_weight) of dilated_conv_norm given grad_y and the forward's mean and
    rstd."""
    return run_dilated_conv_norm_backward(grad_y, x, conv_weight, mean, rstd, dilation, eps)


@dilated_conv_norm_backward.register_fake
def _dilated_conv_norm_backward_fake(grad_y, x, conv_weight, mean, rstd, dilation, eps=1e-3):
    return _empty(x), _empty(conv_weight)


def _dilated_conv_norm_setup_context(ctx, inputs, output):
    x, conv_weight, dilation, eps = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, conv_weight, mean, rstd)
    ctx.dilation, ctx.eps = dilation, eps


def _dilated_conv_norm_autograd(ctx, grad_y, grad_mean, grad_rstd):
    # mean and rstd are statistics the backward consumes, not outputs to differentiate.
    x, conv_weight, mean, rstd = ctx.saved_tensors
    grad_x, grad_conv = dilated_conv_norm_backward(_contiguous_last(grad_y), x, conv_weight, mean,
                                                   rstd, ctx.dilation, ctx.eps)
    return grad_x, grad_conv, None, None


dilated_conv_norm.register_autograd(_dilated_conv_norm_autograd,
                                    setup_context=_dilated_conv_norm_setup_context)


class DilatedConvNormFunction(torch.autograd.Function):
    """dilated_conv_norm under eager autograd (as MhcPostFunction): (y, mean, rstd), mean and
    rstd not differentiable, and no zero gradients made for them."""

    @staticmethod
    def forward(ctx, *inputs):
        output = run_dilated_conv_norm(*inputs)
        _dilated_conv_norm_setup_context(ctx, inputs, output)
        ctx.set_materialize_grads(False)
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y, grad_mean, grad_rstd):
        if grad_y is None:
            return None, None, None, None
        grads = run_dilated_conv_norm_backward(_contiguous_last(grad_y), *ctx.saved_tensors,
                                               ctx.dilation, ctx.eps)
        return (*grads, None, None)


_functorch_form("dilated_conv_norm", DilatedConvNormFunction, run_dilated_conv_norm,
                _dilated_conv_norm_setup_context, materialize_grads=False)


def _cheri_saved_empty(x, linear1_weight, allow_tf32):
    """The buffer the training forward fills for the backward to read (uint8, as many bytes as
    the library asks for these shapes, dtype, device and options; often none)."""
    size = 0
    if x.dtype in (torch.float32, torch.float16, torch.bfloat16) and x.dim() == 3:
        n, length, c = x.shape
        device = -1  # the CPU (and meta tensors): nothing kept
        if x.device.type == "cuda":
            device = torch.cuda.current_device() if x.device.index is None else x.device.index
        size = _C.cheri_block_saved_bytes(n, length, c, linear1_weight.shape[0],
                                          str(x.dtype).removeprefix("torch."), device, allow_tf32)
    return torch.empty(size, dtype=torch.uint8, device=x.device)


def _dl_saved(saved):
    """`saved` for _C: None where nothing is kept."""
    return _dl(saved) if saved is not None and saved.numel() > 0 else None


def _run_cheri_block(x, conv_weight, linear1_weight, linear2_weight, dilation, residual_scale,
                     eps, allow_tf32, saved):
    out, mean, rstd = _empty(x), _stats_empty(x), _stats_empty(x)
    _C.cheri_block(_dl(out), _dl(mean), _dl(rstd), _dl_saved(saved), _dl(x), _dl(conv_weight),
                   _dl(linear1_weight), _dl(linear2_weight), dilation, residual_scale, eps,
                   allow_tf32, _stream(x))
    return out, mean, rstd


def run_cheri_block(x, conv_weight, linear1_weight, linear2_weight, dilation, residual_scale,
                    eps, allow_tf32):
    """The library's training forward on torch tensors: (out, mean, rstd, saved), allocated here;
    saved is what the backward reads besides mean and rstd (uint8, often empty)."""
    saved = _cheri_saved_empty(x, linear1_weight, allow_tf32)
    return (*_run_cheri_block(x, conv_weight, linear1_weight, linear2_weight, dilation,
                              residual_scale, eps, allow_tf32, saved), saved)


def run_cheri_block_unsaved(x, conv_weight, linear1_weight, linear2_weight, dilation,
                            residual_scale, eps, allow_tf32):
    """The library's training forward on torch tensors, keeping nothing beyond what it returns:
    (out, mean, rstd) for cheri_block_backward (which recomputes the rest)."""
    return _run_cheri_block(x, conv_weight, linear1_weight, linear2_weight, dilation,
                            residual_scale, eps, allow_tf32, None)


def run_cheri_block_backward(grad_out, x, conv_weight, linear1_weight, linear2_weight, mean,
                             rstd, dilation, residual_scale, eps, allow_tf32, saved=None):
    """The library's cheri_block_backward on torch tensors, the four gradients allocated here."""
    grads = (_empty(x), _empty(conv_weight), _empty(linear1_weight), _empty(linear2_weight))
    _C.cheri_block_backward(*(_dl(g) for g in grads), _dl(grad_out), _dl(x), _dl(conv_weight),
                            _dl(linear1_weight), _dl(linear2_weight), _dl(mean), _dl(rstd),
                            _dl_saved(saved), dilation, residual_scale, eps, allow_tf32,
                            _stream(x))
    return grads


@torch.library.custom_op("fusekit::cheri_block", mutates_args=())
def cheri_block(x: Tensor, conv_weight: Tensor, linear1_weight: Tensor, linear2_weight: Tensor,
                dilation: int, residual_scale: float = 0.15, eps: float = 1e-3,
                allow_tf32: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The Cheri block's training forward: (out, mean, rstd, saved), out [N, L, C] in x's dtype,
    mean and rstd float32 [N] and saved uint8 (often empty): what the backward reads."""
    return run_cheri_block(x, conv_weight, linear1_weight, linear2_weight, dilation,
                           residual_scale, eps, allow_tf32)


@cheri_block.register_fake
def _cheri_block_fake(x, conv_weight, linear1_weight, linear2_weight, dilation,
                      residual_scale=0.15, eps=1e-3, allow_tf32=True):
    return (_empty(x), _stats_empty(x), _stats_empty(x),
            _cheri_saved_empty(x, linear1_weight, allow_tf32))


@torch.library.custom_op("fusekit::cheri_block_backward", mutates_args=())
def cheri_block_backward(grad_out: Tensor, x: Tensor, conv_weight: Tensor, linear1_weight: Tensor,
                         linear2_weight: Tensor, mean: Tensor, rstd: Tensor, dilation: int,
                         residual_scale: float = 0.15, eps: float = 1e-3,
                         allow_tf32: bool = True, saved: Optional[Tensor] = None
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(grad_x, grad_conv_weight, grad_linear1_weight, grad_linear2_weight) of the training
    forward, each shaped and typed like its input; `saved` is the forward's, or None."""
    return run_cheri_block_backward(grad_out, x, conv_weight, linear1_weight, linear2_weight,
                                    mean, rstd, dilation, residual_scale, eps, allow_tf32, saved)


@cheri_block_backward.register_fake
def _cheri_block_backward_fake(grad_out, x, conv_weight, linear1_weight, linear2_weight, mean,
                               rstd, dilation, residual_scale=0.15, eps=1e-3, allow_tf32=True,
                               saved=None):
    return _empty(x), _empty(conv_weight), _empty(linear1_weight), _empty(linear2_weight)


def _cheri_block_setup_context(ctx, inputs, output):
    x, conv_weight, linear1_weight, linear2_weight, dilation, residual_scale, eps, allow_tf32 = (
        inputs)
    _, mean, rstd, saved = output
    ctx.mark_non_differentiable(mean, rstd, saved)
    ctx.save_for_backward(x, conv_weight, linear1_weight, linear2_weight, mean, rstd, saved)
    ctx.options = (dilation, residual_scale, eps, allow_tf32)


def _cheri_block_autograd(ctx, grad_out, grad_mean, grad_rstd, grad_saved):
    # What the backward needs besides x, the weights, the statistics and `saved` is recomputed.
    *tensors, saved = ctx.saved_tensors
    grads = cheri_block_backward(_contiguous_last(grad_out), *tensors, *ctx.options, saved=saved)
    return (*grads, None, None, None, None)


cheri_block.register_autograd(_cheri_block_autograd, setup_context=_cheri_block_setup_context)


@torch.library.custom_op("fusekit::cheri_block_inference", mutates_args=())
def cheri_block_inference(x: Tensor, conv_weight: Tensor, linear1_weight: Tensor,
                          linear2_weight: Tensor, dilation: int, residual_scale: float = 0.15,
                          eps: float = 1e-3) -> Tensor:
    """The Cheri block's inference forward: out [N, L, C] in x's dtype, nothing saved."""
    out = _empty(x)
    _C.cheri_block_inference(_dl(out), _dl(x), _dl(conv_weight), _dl(linear1_weight),
                             _dl(linear2_weight), dilation, residual_scale, eps, _stream(x))
    return out


@cheri_block_inference.register_fake
def _cheri_block_inference_fake(x, conv_weight, linear1_weight, linear2_weight, dilation,
                                residual_scale=0.15, eps=1e-3):
    return _empty(x)


# fusekit.cheri_block never routes autograd here: only a direct call of the op reaches this.
_refuse_backward(cheri_block_inference, "cheri_block_inference",
                 "cheri_block_inference: backward was called, but the inference forward saves "
                 "nothing to differentiate; expected fusekit.cheri_block (which takes the "
                 "training path under autograd) or torch.ops.fusekit.cheri_block")


class CheriBlockFunction(torch.autograd.Function):
    """The Cheri block's training forward under eager autograd (as MhcPostFunction): (out, mean,
    rstd, saved), the last three not differentiable, and no zero gradients made for them; the
    backward reads them and recomputes everything else."""

    @staticmethod
    def forward(ctx, *inputs):
        output = run_cheri_block(*inputs)
        _cheri_block_setup_context(ctx, inputs, output)
        ctx.set_materialize_grads(False)
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_mean, grad_rstd, grad_saved):
        if grad_out is None:
            return (None,) * 8
        *tensors, saved = ctx.saved_tensors
        grads = run_cheri_block_backward(_contiguous_last(grad_out), *tensors, *ctx.options,
                                         saved)
        return (*grads, None, None, None, None)


_functorch_form("cheri_block", CheriBlockFunction, run_cheri_block, _cheri_block_setup_context,
                materialize_grads=False)


def call_cheri_block(x, conv_weight, linear1_weight, linear2_weight, dilation, residual_scale,
                     eps, allow_tf32, out=None):
    """fusekit.cheri_block through the ops, for autograd, compilers and tensor subclasses: the
    training forward (differentiable) when autograd records the call, else the inference forward.
    `out` is filled by a copy, which a compiler can fuse; it is refused when autograd records the
    call."""
    weights = (conv_weight, linear1_weight, linear2_weight)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, *weights)):
        if out is not None:
            raise _C.Error("cheri_block: out= was given while autograd records the call (a "
                           "tensor requires grad); expected out=None under autograd")
        return cheri_block(x, *weights, dilation, residual_scale, eps, allow_tf32)[0]
    result = cheri_block_inference(x, *weights, dilation, residual_scale, eps)
    if out is None:
        return result
    return _copy_out("cheri_block", out, result)


class CheriBlock(torch.nn.Module):
    """The Cheri block of a genomics sequence-to-function model (a ConvNeXt-style block) in fused
    fusekit calls, with the parameters of its usual PyTorch formulation, so that its state dict
    loads unchanged:

        conv_weight   [3, n_filters], the left, centre and right taps of the depthwise convolution
        linear1       torch.nn.Linear(n_filters, expansion * n_filters, bias=False)
        linear2       torch.nn.Linear(expansion * n_filters, n_filters, bias=False)

    forward(x): x [N, L, n_filters] -> x + residual_scale * linear2(GELU_tanh(linear1(
    dilated_conv_norm(x)))), with eps 1e-3 in the per-example normalisation. Under autograd
    (grad enabled and x or a parameter requiring grad) it runs the training forward and its
    backward; otherwise (torch.no_grad(), torch.inference_mode(), frozen parameters) the
    inference forward. The parameters are passed as they are on every call (float32 parameters
    with bfloat16 activations included): nothing is converted or cached, so changes to them,
    in place or not, show in the next call. Set `allow_tf32` to False for full float32 products
    in training on CUDA.
    """

    def __init__(self, n_filters, dilation, expansion=2, residual_scale=0.15, eps=1e-3,
                 device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.n_filters = n_filters
        self.dilation = dilation
        self.expansion = expansion
        self.residual_scale = residual_scale
        self.eps = eps
        self.allow_tf32 = True
        hidden = expansion * n_filters
        self.conv_weight = torch.nn.Parameter(torch.empty(3, n_filters, **factory))
        self.linear1 = torch.nn.Linear(n_filters, hidden, bias=False, **factory)
        self.linear2 = torch.nn.Linear(hidden, n_filters, bias=False, **factory)
        self.reset_parameters()

    def reset_parameters(self):
        # The model's own initialisation: truncated normals of standard deviation 0.02.
        for w in (self.conv_weight, self.linear1.weight, self.linear2.weight):
            torch.nn.init.trunc_normal_(w, std=0.02)

    def forward(self, x):
        return fusekit._cheri_block(x, self.conv_weight, self.linear1.weight, self.linear2.weight,
                                    self.dilation, self.residual_scale, self.eps, self.allow_tf32,
                                    None)

    def extra_repr(self):
        return (f"n_filters={self.n_filters}, dilation={self.dilation}, "
                f"expansion={self.expansion}, residual_scale={self.residual_scale}, "
                f"eps={self.eps}")
