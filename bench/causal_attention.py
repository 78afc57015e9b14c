"""Benchmark of causal_attention (causal self-attention over left-padded sequences, forward)
against PyTorch's SDPA with the equivalent boolean mask, SDPA causal without the padding (its
own kernel choice), and the seed Triton kernel, at GPT-2 small's attention shapes. Needs a CUDA
device.

    python bench/causal_attention.py                          # the three shapes
    python bench/causal_attention.py --peers DIR              # and the seed, DIR/attention_seed.py
    python bench/causal_attention.py --shapes 4,12,2048,64,300,bf16 --json results.json

Inputs q, k, v [B, H, T, D] ~ N(0, 1); every sequence padded by n_padd leading tokens. Every
implementation is first checked against a float64 evaluation of the formula (padding rows of the
baselines, which they do not define, are zeroed first); a result whose relative Frobenius error
is above its dtype's bound is printed as FAIL and not timed. The causal SDPA row computes causal
attention without the padding, the work of a kernel that skips nothing, and is checked against
that formula. The seed is single-head and float32: it gets float32 copies of the inputs and one
launch per (sequence, head), as its notebook runs it.

Each row gives the median time of one call (timing.bench: CUDA events, L2 flushed before each
run), its TFLOP/s counting the causal FLOPs 2 B H T^2 D (both products over the lower triangle,
padding included) and its fraction of the shape's floor: the larger of the time to read q, k, v
and write out at the device-copy bandwidth and the time of those FLOPs at the GEMM rate of the
inputs' dtype (float32 GEMM without TF32 for float32), both ceilings measured in the same run.
"""

import argparse
from collections import namedtuple

import torch
import torch.nn.functional as F

from common import (NOT_IMPLEMENTED, FloorTable, import_seed, load_fusekit, print_header,
                    raised_note, write_json)
from timing import bench, copy_ceiling, gemm_ceiling, rel_err

SHAPES = [  # (B, H, T, D, n_padd, dtype): GPT-2 small's attention
    (1, 12, 1024, 64, 100, "bf16"),
    (1, 12, 1024, 64, 100, "fp32"),
    (8, 12, 1024, 64, 0, "bf16"),
]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Relative Frobenius error bounds: float32 keeps float32 accuracy (allow_tf32=False); half
# precision allows a few roundings of the output (2^-8 for bfloat16).
REL_ERR_BOUND = {"fp32": 1e-5, "fp16": 5e-3, "bf16": 2e-2}

# prepare(q, k, v, n_padd) does what a caller does once (masks, float32 copies) and returns the
# call of no arguments that is timed, giving out [B, H, T, D]. padded: whether it computes the
# padded formula (else the one without padding). dtypes: those it runs, None for all.
Impl = namedtuple("Impl", "prepare padded dtypes")


def parse_shape(text):
    b, h, t, d, n_padd, dtype = text.split(",")
    if dtype not in DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r}: expected B,H,T,D,n_padd,dtype with dtype in "
                                         f"{tuple(DTYPES)}")
    return int(b), int(h), int(t), int(d), int(n_padd), dtype


# ------------------------------------------------------------------------------ the formula


def keep_mask(t, n_padd, device="cuda"):
    """keep [T, T], True where query i attends key j: n_padd <= j <= i."""
    i = torch.arange(t, device=device)[:, None]
    j = torch.arange(t, device=device)[None, :]
    return (j <= i) & (j >= n_padd)


def sdpa_mask(t, n_padd):
    """The boolean mask SDPA takes for the padded formula. Padding rows (which attend nothing)
    see key 0 instead, so that SDPA gives finite values there; they are zeroed before the
    check."""
    keep = keep_mask(t, n_padd)
    keep[:n_padd, 0] = True
    return keep


def reference(q, k, v, n_padd):
    """The formula in float64 (SDPA's math over float64 inputs), padding rows zero."""
    q, k, v = (x.double() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask(q.shape[-2], n_padd))
    out[..., :n_padd, :] = 0
    return out


def fusekit_impl(fusekit):
    def prepare(q, k, v, n_padd):
        return lambda: fusekit.causal_attention(q, k, v, n_padd)

    return Impl(prepare, padded=True, dtypes=None)


def sdpa_masked_impl():
    def prepare(q, k, v, n_padd):
        mask = sdpa_mask(q.shape[-2], n_padd)
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return Impl(prepare, padded=True, dtypes=None)


def sdpa_causal_impl():
    # PyTorch's own choice of kernel for causal attention without a mask (its flash or cuDNN
    # kernel on Hopper). No backend context in the timed call: entering one costs more host time
    # than these kernels take, and the timer would measure it.
    def prepare(q, k, v, n_padd):
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return Impl(prepare, padded=False, dtypes=("fp16", "bf16"))


def seed_impl(attention_seed):
    """The seed on every (sequence, head), each its own launch, on float32 copies."""

    def prepare(q, k, v, n_padd):
        b, h = q.shape[:2]
        q, k, v = (x.float() for x in (q, k, v))

        def call():
            heads = [attention_seed.padded_attention(q[i, j], k[i, j], v[i, j], n_padd)
                     for i in range(b) for j in range(h)]
            return torch.stack(heads).unflatten(0, (b, h))

        return call

    return Impl(prepare, padded=True, dtypes=None)


# ------------------------------------------------------------------------------ rows


def flops_of(b, h, t, d):
    """Both products over the causal lower triangle: 2 (QK^T and PV) x 2 B H (T^2 / 2) D."""
    return 2 * b * h * t * t * d


def bytes_of(b, h, t, d, dtype):
    """q, k, v read and out written once."""
    return 4 * b * h * t * d * DTYPES[dtype].itemsize


class Table(FloorTable):
    def __init__(self, copy_gbs, gemm_tflops):
        super().__init__(copy_gbs, gemm_tflops, shape_width=32, impl_width=26)

    def add_floor(self, shape, sizes, dtype):
        """Prints the shape's floor and keeps it: the larger of its memory and compute times."""
        gemm = self.gemm_tflops["fp32" if dtype == "fp32" else "bf16"]
        floor_us, memory_us, compute_us = self.keep_floor(shape, bytes_of(*sizes, dtype),
                                                          flops_of(*sizes), gemm)
        print(f"# {shape}: floor {floor_us:.1f} us (q, k, v and out at the copy "
              f"bandwidth {memory_us:.1f} us, {flops_of(*sizes) / 1e9:.1f} GFLOP at the "
              f"{'fp32' if dtype == 'fp32' else 'bf16'} GEMM rate {compute_us:.1f} us)",
              flush=True)

    def add(self, shape, impl, sizes, dtype, n_padd, err=None, timing=None, note="",
            skipped=False):
        b, h, t, d = sizes
        self.add_row(dict(op="causal_attention", shape=shape, impl=impl, b=b, h=h, t=t, d=d,
                          n_padd=n_padd, dtype=dtype, bytes=bytes_of(*sizes, dtype),
                          flops=flops_of(*sizes), floor_us=self.floors[shape], rel_err=err,
                          ok=timing is not None, skipped=skipped, note=note), timing)


def run(table, impls, shapes):
    for i, (b, h, t, d, n_padd, dtype) in enumerate(shapes):
        shape = f"B{b} H{h} T{t} D{d} pad{n_padd} {dtype}"
        sizes = (b, h, t, d)
        g = torch.Generator(device="cuda").manual_seed(1000 + i)
        q, k, v = (torch.randn(sizes, device="cuda", generator=g).to(DTYPES[dtype])
                   for _ in range(3))
        refs = {True: reference(q, k, v, n_padd)}
        refs[False] = reference(q, k, v, 0) if n_padd else refs[True]
        table.add_floor(shape, sizes, dtype)
        for name, impl in impls.items():
            if impl.dtypes is not None and dtype not in impl.dtypes:
                continue
            fn = impl.prepare(q, k, v, n_padd)
            try:
                out = fn()
            except Exception as e:  # noqa: BLE001  (an implementation that cannot run this shape)
                if NOT_IMPLEMENTED in str(e):
                    table.add(shape, name, sizes, dtype, n_padd, skipped=True,
                              note="no CUDA backend of causal_attention yet")
                else:
                    table.add(shape, name, sizes, dtype, n_padd, note=raised_note(e))
                continue
            out = out.clone()
            if impl.padded:
                out[..., :n_padd, :] = 0
            err = rel_err(out, refs[impl.padded])
            del out
            if not err < REL_ERR_BOUND[dtype]:
                table.add(shape, name, sizes, dtype, n_padd, err,
                          note=f"error above {REL_ERR_BOUND[dtype]:g}")
                continue
            table.add(shape, name, sizes, dtype, n_padd, err, bench(fn))
            del fn
        del q, k, v, refs
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ main


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", type=parse_shape, metavar="B,H,T,D,PAD,DTYPE",
                        help="shapes, e.g. 8,12,1024,64,0,bf16 (default: GPT-2 small's, with "
                             "left padding 100 in bf16 and fp32, and B = 8 in bf16)")
    parser.add_argument("--peers", metavar="DIR", help="folder holding attention_seed.py (the "
                                                       "seed)")
    parser.add_argument("--json", metavar="FILE", help="write the rows to FILE")
    args = parser.parse_args()

    fusekit = load_fusekit("bench/causal_attention.py", "causal_attention")

    impls = {
        "fusekit": fusekit_impl(fusekit),
        "sdpa bool mask": sdpa_masked_impl(),
        "sdpa causal, no pad": sdpa_causal_impl(),
    }
    attention_seed = import_seed(args.peers, "attention_seed") if args.peers else None
    if attention_seed is not None:
        impls["seed triton, fp32 per head"] = seed_impl(attention_seed)

    info = fusekit.build_info()
    print_header(info, "q, k, v ~ N(0, 1)")
    copy_gbs = copy_ceiling()
    gemm_tflops = {"bf16": gemm_ceiling(dtype=torch.bfloat16),
                   "fp32": gemm_ceiling(m=4096, dtype=torch.float32)}
    print(f"# ceilings: device copy {copy_gbs:.0f} GB/s (1 GiB, read + write), bf16 GEMM "
          f"{gemm_tflops['bf16']:.0f} TFLOP/s (8192^3), fp32 GEMM {gemm_tflops['fp32']:.0f} "
          f"TFLOP/s (4096^3, TF32 {'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'}), "
          f"torch.matmul")
    table = Table(copy_gbs, gemm_tflops)
    run(table, impls, args.shapes or SHAPES)

    if args.json:
        write_json(args.json, info, ceilings=dict(copy_gbs=copy_gbs, gemm_tflops=gemm_tflops),
                   rows=table.rows)


if __name__ == "__main__":
    main()
