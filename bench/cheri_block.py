"""Benchmark of cheri_block (the Cheri block of a genomics model: dilated depthwise conv,
per-example normalisation, MLP, residual) against PyTorch eager and the seed Triton kernels, at
the model's shapes. Needs a CUDA device.

    python bench/cheri_block.py                               # the issue's shapes
    python bench/cheri_block.py --peers DIR                   # and the seed, DIR/cheri_seed.py
    python bench/cheri_block.py --shapes infer,512,1024,128,4,bf16 train,64,2114,128,4,fp32

Inputs x [N, L, C] ~ N(0, 1) in the shape's dtype; the block's weights float32 (as the model
keeps them), drawn larger than its initialisation (taps ~ N(0, 0.25), Linear weights ~
N(0, 1 / fan_in)) so that the MLP branch matters in the check; expansion 2, residual scale 0.15.

Inference rows time one forward under torch.no_grad(): fusekit.cheri_block, the seed block
(its no-grad megakernel) and the formula in PyTorch eager in the shape's dtype. Training rows
time a forward and backward under autograd (x and the weights require grad, TF32 allowed as the
model trains): fusekit.torch.CheriBlock, the seed block (its Triton conv-norm and PyTorch MLP)
and PyTorch eager. Every implementation is first checked against a float64 evaluation (out,
and for training the gradient of x); a result whose relative Frobenius error is above the bound
is printed as FAIL and not timed. fusekit rows print as skipped while its CUDA backend of
cheri_block is not implemented.

Each row gives the median time (timing.bench: CUDA events, L2 flushed before each run), its
TFLOP/s counting the block's products (inference 4 N L C H with H = 2 C the hidden width;
training three times that: the forward's two products and the backward's four) and its
fraction of the shape's floor: the larger of its bytes at the device-copy bandwidth (inference:
x read and out written; training: x read twice, out and grad_x written, grad_out read) and its
FLOPs at the GEMM rate (bf16 for inference, whose products may run in half precision; TF32 for
training), both ceilings measured in the same run.
"""

import argparse
import math
from collections import namedtuple

import torch
import torch.nn.functional as F

from common import (NOT_IMPLEMENTED, FloorTable, import_seed, load_fusekit, print_header,
                    raised_note, write_json)
from timing import bench, copy_ceiling, gemm_ceiling, rel_err

Shape = namedtuple("Shape", "mode n l c d dtype")
SHAPES = [  # the model's blocks at its training and inference batch sizes
    Shape("infer", 512, 1024, 128, 4, "fp32"),
    Shape("infer", 512, 1024, 128, 4, "bf16"),
    Shape("infer", 64, 2114, 128, 4, "fp32"),
    Shape("train", 512, 1024, 128, 4, "fp32"),
    Shape("train", 64, 2114, 128, 4, "fp32"),
]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
EXPANSION, RESIDUAL_SCALE, EPS = 2, 0.15, 1e-3
# Relative Frobenius error bounds of out (and of grad_x in training): the inference path may
# run its products in bfloat16, the training path in TF32.
REL_ERR_BOUND = {"infer": {"fp32": 2e-3, "fp16": 5e-3, "bf16": 1e-2},
                 "train": {"fp32": 5e-3, "fp16": 5e-3, "bf16": 2e-2}}


def parse_shape(text):
    mode, n, length, c, d, dtype = text.split(",")
    if mode not in ("infer", "train") or dtype not in DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MODE,N,L,C,d,dtype with MODE infer "
                                         f"or train and dtype in {tuple(DTYPES)}")
    return Shape(mode, int(n), int(length), int(c), int(d), dtype)


# ------------------------------------------------------------------------------ the formula


def eager_block(x, conv_weight, linear1_weight, linear2_weight, dilation):
    """The block in PyTorch eager, every step in x's dtype (the weights cast to it)."""
    n, length, c = x.shape
    w = conv_weight.to(x.dtype)
    padded = F.pad(x, (0, 0, dilation, dilation))
    conv = (w[0] * padded[:, :length] + w[1] * padded[:, dilation:dilation + length]
            + w[2] * padded[:, 2 * dilation:2 * dilation + length])
    mean = conv.mean(dim=(1, 2), keepdim=True)
    var = (conv - mean).square().mean(dim=(1, 2), keepdim=True)
    y = (conv - mean) * (var + EPS).rsqrt()
    h = F.gelu(y @ linear1_weight.to(x.dtype).mT, approximate="tanh")
    return x + RESIDUAL_SCALE * (h @ linear2_weight.to(x.dtype).mT)


def make_weights(c, generator):
    hidden = EXPANSION * c
    conv = 0.5 * torch.randn(3, c, device="cuda", generator=generator)
    w1 = torch.randn(hidden, c, device="cuda", generator=generator) / math.sqrt(c)
    w2 = torch.randn(c, hidden, device="cuda", generator=generator) / math.sqrt(hidden)
    return conv, w1, w2


def reference(x, weights, dilation, grad_out=None):
    """out (and, given grad_out, grad_x) of the formula in float64."""
    x64 = x.double().requires_grad_(grad_out is not None)
    with torch.enable_grad():
        out = eager_block(x64, *(w.double() for w in weights), dilation)
    if grad_out is None:
        return out.detach(), None
    (grad_x,) = torch.autograd.grad(out, x64, grad_out.double())
    return out.detach(), grad_x


# ------------------------------------------------------------------------------ implementations

# prepare(x, weights, dilation) does what a caller does once (modules, casts) and returns the
# call of no arguments that is timed, giving out (inference) or (out, grad_x) (training).
Impl = namedtuple("Impl", "prepare modes")


def load_block(module_class, weights, dilation):
    c = weights[0].shape[1]
    block = module_class(c, dilation, EXPANSION, RESIDUAL_SCALE).cuda()
    block.load_state_dict({"conv_weight": weights[0], "linear1.weight": weights[1],
                           "linear2.weight": weights[2]})
    return block


def train_call(forward, x, params):
    """A training step's forward and backward through `forward`: returns (out, grad_x)."""
    xg = x.clone().requires_grad_()
    grad_out = torch.randn_like(x)

    def call():
        xg.grad = None
        for p in params:
            p.grad = None
        out = forward(xg)
        out.backward(grad_out)
        return out, xg.grad

    return call, grad_out


def fusekit_impl(fusekit):
    def prepare(mode, x, weights, dilation):
        if mode == "infer":
            return lambda: fusekit.cheri_block(x, *weights, dilation, RESIDUAL_SCALE), None
        block = load_block(fusekit.torch.CheriBlock, weights, dilation)
        return train_call(block, x, list(block.parameters()))

    return Impl(prepare, modes=("infer", "train"))


def eager_impl():
    def prepare(mode, x, weights, dilation):
        if mode == "infer":
            cast = [w.to(x.dtype) for w in weights]
            return lambda: eager_block(x, *cast, dilation), None
        params = [w.clone().requires_grad_() for w in weights]
        return train_call(lambda xg: eager_block(xg, *params, dilation), x, params)

    return Impl(prepare, modes=("infer", "train"))


def seed_impl(cheri_seed):
    def prepare(mode, x, weights, dilation):
        block = load_block(cheri_seed.CheriBlock, weights, dilation)
        if mode == "infer":
            return lambda: block(x), None
        return train_call(block, x, list(block.parameters()))

    return Impl(prepare, modes=("infer", "train"))


# ------------------------------------------------------------------------------ rows


def flops_of(s):
    forward = 4 * s.n * s.l * s.c * EXPANSION * s.c
    return forward if s.mode == "infer" else 3 * forward


def bytes_of(s):
    activations = s.n * s.l * s.c * DTYPES[s.dtype].itemsize
    weights = 4 * s.c * (3 + 2 * EXPANSION * s.c)
    return (2 if s.mode == "infer" else 5) * activations + weights


def describe(s):
    return f"{s.mode} N{s.n} L{s.l} C{s.c} d{s.d} {s.dtype}"


class Table(FloorTable):
    def __init__(self, copy_gbs, gemm_tflops):
        super().__init__(copy_gbs, gemm_tflops, shape_width=34, impl_width=22)

    def add_floor(self, s):
        rate = "bf16" if s.mode == "infer" else "tf32"
        floor_us, memory_us, compute_us = self.keep_floor(describe(s), bytes_of(s), flops_of(s),
                                                          self.gemm_tflops[rate])
        print(f"# {describe(s)}: floor {floor_us:.1f} us ({bytes_of(s) / 1e6:.0f} "
              f"MB at the copy bandwidth {memory_us:.1f} us, {flops_of(s) / 1e9:.1f} GFLOP at the "
              f"{rate} GEMM rate {compute_us:.1f} us)", flush=True)

    def add(self, s, impl, err=None, timing=None, note="", skipped=False):
        shape = describe(s)
        self.add_row(dict(op="cheri_block", shape=shape, impl=impl, mode=s.mode, n=s.n, l=s.l,
                          c=s.c, d=s.d, dtype=s.dtype, bytes=bytes_of(s), flops=flops_of(s),
                          floor_us=self.floors[shape], rel_err=err, ok=timing is not None,
                          skipped=skipped, note=note), timing, gbs=True)


def run(table, impls, shapes):
    for i, s in enumerate(shapes):
        g = torch.Generator(device="cuda").manual_seed(2000 + i)
        x = torch.randn(s.n, s.l, s.c, device="cuda", generator=g).to(DTYPES[s.dtype])
        weights = make_weights(s.c, g)
        table.add_floor(s)
        refs = {}
        for name, impl in impls.items():
            if s.mode not in impl.modes:
                continue
            try:
                fn, grad_out = impl.prepare(s.mode, x, weights, s.d)
                if s.mode == "infer":
                    with torch.no_grad():
                        got = (fn(),)
                else:
                    got = fn()
            except Exception as e:  # noqa: BLE001  (an implementation that cannot run this shape)
                if NOT_IMPLEMENTED in str(e):
                    table.add(s, name, skipped=True, note="no CUDA backend of cheri_block yet")
                else:
                    table.add(s, name, note=raised_note(e))
                continue
            key = id(grad_out) if grad_out is not None else None
            if key not in refs:
                refs = {key: reference(x, weights, s.d, grad_out)}
            err = max(rel_err(a, r) for a, r in zip(got, refs[key]) if r is not None)
            del got
            bound = REL_ERR_BOUND[s.mode][s.dtype]
            if not err < bound:
                table.add(s, name, err, note=f"error above {bound:g}")
                continue
            if s.mode == "infer":
                def timed(fn=fn):
                    with torch.no_grad():
                        return fn()
            else:
                timed = fn
            table.add(s, name, err, bench(timed))
            del fn, timed
        del x, weights, refs
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ main


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", type=parse_shape, metavar="MODE,N,L,C,d,DTYPE",
                        help="shapes, e.g. infer,512,1024,128,4,bf16 or train,64,2114,128,4,fp32 "
                             "(default: the model's, inference in fp32 and bf16, training in fp32)")
    parser.add_argument("--peers", metavar="DIR", help="folder holding cheri_seed.py (the seed)")
    parser.add_argument("--json", metavar="FILE", help="write the rows to FILE")
    args = parser.parse_args()

    fusekit = load_fusekit("bench/cheri_block.py", "cheri_block", with_torch=True)

    # As the model trains: TF32 products in float32 (the training rows and the TF32 ceiling).
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    impls = {"fusekit": fusekit_impl(fusekit), "torch eager": eager_impl()}
    cheri_seed = import_seed(args.peers, "cheri_seed") if args.peers else None
    if cheri_seed is not None:
        impls["seed triton"] = seed_impl(cheri_seed)

    info = fusekit.build_info()
    print_header(info, "x ~ N(0, 1), float32 weights")
    copy_gbs = copy_ceiling()
    gemm_tflops = {"bf16": gemm_ceiling(dtype=torch.bfloat16),
                   "tf32": gemm_ceiling(m=4096, dtype=torch.float32)}
    print(f"# ceilings: device copy {copy_gbs:.0f} GB/s (1 GiB, read + write), bf16 GEMM "
          f"{gemm_tflops['bf16']:.0f} TFLOP/s (8192^3), TF32 GEMM {gemm_tflops['tf32']:.0f} "
          f"TFLOP/s (4096^3), torch.matmul")
    table = Table(copy_gbs, gemm_tflops)
    run(table, impls, args.shapes or SHAPES)

    if args.json:
        write_json(args.json, info, ceilings=dict(copy_gbs=copy_gbs, gemm_tflops=gemm_tflops),
                   rows=table.rows)


if __name__ == "__main__":
    main()
