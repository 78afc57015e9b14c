"""fusekit's operators as torch.library ops, with autograd and torch.compile support.

    torch.ops.fusekit.mhc_post(x, residual, post_layer_mix, comb_res_mix) -> out
    torch.ops.fusekit.mhc_post_backward(grad_out, x, residual, post_layer_mix, comb_res_mix)
        -> (grad_x, grad_residual, grad_post_layer_mix, grad_comb_res_mix)

`import fusekit` registers them when torch is installed. Each op allocates its outputs with
torch.empty_like (contiguous) on the inputs' device and runs the C++ library on the current stream
of that device. The fake implementations give the same shapes, dtypes and strides without running
anything, so torch.compile and torch.export trace through them; the autograd formula of each
forward op is its backward op.
"""

import torch
import torch.utils.dlpack
from torch import Tensor

from . import _C

__all__ = ["mhc_post", "mhc_post_backward"]

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


def _empty(t):
    """A contiguous tensor of t's shape, dtype and device (also under fake tensor modes)."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


# ------------------------------------------------------------------------------ mhc_post


@torch.library.custom_op("fusekit::mhc_post", mutates_args=())
def mhc_post(x: Tensor, residual: Tensor, post_layer_mix: Tensor, comb_res_mix: Tensor) -> Tensor:
    """out[n, i, h] = post_layer_mix[n, i] * x[n, h] + sum_j comb_res_mix[n, j, i] * residual[n, j, h]"""
    out = _empty(residual)
    _C.mhc_post(_dl(out), _dl(x), _dl(residual), _dl(post_layer_mix), _dl(comb_res_mix),
                _stream(x))
    return out


@mhc_post.register_fake
def _mhc_post_fake(x, residual, post_layer_mix, comb_res_mix):
    return _empty(residual)


@torch.library.custom_op("fusekit::mhc_post_backward", mutates_args=())
def mhc_post_backward(grad_out: Tensor, x: Tensor, residual: Tensor, post_layer_mix: Tensor,
                      comb_res_mix: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(grad_x, grad_residual, grad_post_layer_mix, grad_comb_res_mix) of mhc_post, each shaped
    and typed like its input."""
    grads = (_empty(x), _empty(residual), _empty(post_layer_mix), _empty(comb_res_mix))
    _C.mhc_post_backward(*(_dl(g) for g in grads), _dl(grad_out), _dl(x), _dl(residual),
                         _dl(post_layer_mix), _dl(comb_res_mix), _stream(x))
    return grads


@mhc_post_backward.register_fake
def _mhc_post_backward_fake(grad_out, x, residual, post_layer_mix, comb_res_mix):
    return _empty(x), _empty(residual), _empty(post_layer_mix), _empty(comb_res_mix)


def _mhc_post_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _mhc_post_autograd(ctx, grad_out):
    # grad_post_layer_mix comes back in post_layer_mix's own shape, [N, hc] or [N, hc, 1].
    return mhc_post_backward(grad_out, *ctx.saved_tensors)


mhc_post.register_autograd(_mhc_post_autograd, setup_context=_mhc_post_setup_context)


def call_mhc_post(x, residual, post_layer_mix, comb_res_mix, out=None):
    """fusekit.mhc_post through the op, for autograd, compilers and tensor subclasses. `out` is
    filled by a copy, which a compiler can fuse; it is refused when autograd records the call."""
    if out is None:
        return mhc_post(x, residual, post_layer_mix, comb_res_mix)
    if torch.is_grad_enabled():
        for t in (x, residual, post_layer_mix, comb_res_mix, out):
            if t.requires_grad:
                raise _C.Error("mhc_post: out= was given while autograd records the call (a "
                               "tensor requires grad); expected out=None under autograd")
    result = mhc_post(x, residual, post_layer_mix, comb_res_mix)
    if out.shape != result.shape or out.dtype != result.dtype or out.device != result.device:
        raise _C.Error(f"mhc_post: out is {_describe(out)}, expected {_describe(result)}")
    return out.copy_(result)


def _describe(t):
    """"bfloat16 [4096, 4, 7168] on cuda:0", as the library describes tensors."""
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} on {t.device}"
