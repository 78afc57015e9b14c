"""Benchmark of layernorm_linear_gelu against PyTorch eager, torch.compile and the seed Triton
kernel, at the shapes of a transformer MLP's first layer. Needs a CUDA device.

    python bench/layernorm_linear_gelu.py                    # the default shapes, fp16
    python bench/layernorm_linear_gelu.py --peers DIR        # and the seed, DIR/lola_seed.py
    python bench/layernorm_linear_gelu.py --shapes 512,1024,4096 --dtype bf16 --json results.json

The operation is the seed's: LayerNorm without parameters, a Linear layer with a bias, GELU with
the tanh approximation. Every implementation is first checked against a float64 reference; a
result whose relative error is above the bound is printed as FAIL and not timed. Each row gives
the median time of one call (timing.bench: CUDA events, L2 flushed before each run), its TFLOP/s
(2 M K N) and their fraction of an 8192^3 GEMM in the same dtype, and its fraction of the
weight-read floor: the time to read the weight once at the device-copy bandwidth. Both ceilings
are measured in the same run.
"""

import argparse
import math

import torch
import torch.nn.functional as F

from common import import_seed, load_fusekit, print_header, raised_note, timing_fields, write_json
from timing import bench, copy_ceiling, gemm_ceiling, read_ceiling, rel_err

SHAPES = [  # (M rows, K in, N out)
    (512, 1024, 4096),     # prefill of 512 tokens, hidden 1024
    (8192, 1024, 4096),    # prefill of 8192 tokens
    (8192, 4096, 16384),   # prefill of 8192 tokens, hidden 4096
    (16, 4096, 16384),     # a decode step: the weight read is the whole cost
]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# Catches wrong results; loose enough for the seed, whose float16 accumulation reaches about
# 1.7e-2. The rel err column shows each result's precision.
REL_ERR_BOUND = 2e-2


def parse_shape(text):
    m, k, n = (int(v) for v in text.split(","))
    return m, k, n


# ------------------------------------------------------------------------------ the baselines


def torch_forward(x, weight, bias):
    """The seed's PyTorch formula (torch_lola), with weight in torch Linear layout [N, K]."""
    x = F.layer_norm(x, (x.shape[-1],))
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


def reference(x, weight, bias):
    return torch_forward(x.double(), weight.double(), bias.double())


def seed_prepare(x, weight, bias):
    """The seed's arguments: the weight as [K, N] and its column sums."""
    w_kn = weight.t().contiguous()
    return x, w_kn, w_kn.float().sum(0).to(x.dtype), bias


# ------------------------------------------------------------------------------ rows


class Table:
    def __init__(self, copy_gbs, gemm_tflops, read_gbs):
        self.copy_gbs, self.gemm_tflops, self.read_gbs, self.rows = copy_gbs, gemm_tflops, read_gbs, []
        print(f"{'shape':20s} {'impl':14s} {'time us':>9s} {'TFLOP/s':>8s} {'%gemm':>6s} "
              f"{'%wfloor':>7s} {'rel err':>8s}  method")

    def add(self, shape, impl, sizes, err, timing=None, note=""):
        m, k, n, esize = sizes
        flops = 2 * m * k * n
        weight_bytes = k * n * esize
        row = dict(op="layernorm_linear_gelu", shape=shape, impl=impl, m=m, k=k, n=n,
                   bytes=(m * k + k * n + n + m * n) * esize, weight_bytes=weight_bytes,
                   flops=flops, rel_err=err, ok=timing is not None, note=note)
        line = f"{shape:20s} {impl:14s} "
        if timing is not None:
            sec = timing.median_us * 1e-6
            floor_us = weight_bytes / (self.copy_gbs * 1e9) * 1e6
            tflops = flops / sec / 1e12
            row.update(timing_fields(timing), tflops=tflops, gemm_fraction=tflops / self.gemm_tflops,
                       weight_floor_us=floor_us, weight_floor_fraction=floor_us / timing.median_us)
            line += (f"{timing.median_us:9.1f} {tflops:8.1f} {100 * row['gemm_fraction']:5.1f}% "
                     f"{100 * row['weight_floor_fraction']:6.1f}% {err:8.1e}  {timing.method}")
        else:
            line += f"{'-':>9s} {'':8s} {'':6s} {'':7s} {err:8.1e}  FAIL {note}"
        self.rows.append(row)
        print(line, flush=True)


def run(table, impls, shapes, dtype):
    for m, k, n in shapes:
        shape = f"M{m} K{k} N{n}"
        x = torch.randn(m, k, dtype=dtype, device="cuda")
        weight = (torch.randn(n, k, device="cuda") / math.sqrt(k)).to(dtype)  # torch Linear layout
        bias = torch.randn(n, dtype=dtype, device="cuda")
        ref = reference(x, weight, bias)
        sizes = (m, k, n, x.element_size())
        print(f"# {shape}: {2 * m * k * n / (table.gemm_tflops * 1e12) * 1e6:.1f} us at the GEMM "
              f"ceiling, {k * n * x.element_size() / (table.copy_gbs * 1e9) * 1e6:.1f} us to read "
              f"the weight at the copy bandwidth, "
              f"{k * n * x.element_size() / (table.read_gbs * 1e9) * 1e6:.1f} us reading alone", flush=True)
        for name, (prepare, fn) in impls.items():
            args = prepare(x, weight, bias)
            try:
                err = rel_err(fn(*args), ref)
            except Exception as e:  # noqa: BLE001  (a baseline that cannot run this shape)
                table.add(shape, name, sizes, math.inf, note=raised_note(e))
                continue
            if not err < REL_ERR_BOUND:
                table.add(shape, name, sizes, err, note=f"error above {REL_ERR_BOUND:g}")
                continue
            table.add(shape, name, sizes, err, bench(lambda: fn(*args)))
        del x, weight, bias, ref
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ main


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", type=parse_shape, metavar="M,K,N",
                        help="shapes (default: the four MLP shapes)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    parser.add_argument("--peers", metavar="DIR", help="folder holding lola_seed.py (the seed)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    parser.add_argument("--json", metavar="FILE", help="write the rows to FILE")
    args = parser.parse_args()

    fusekit = load_fusekit("bench/layernorm_linear_gelu.py", "layernorm_linear_gelu")

    dtype = DTYPES[args.dtype]

    def as_is(*inputs):
        return inputs

    # name: (the arguments made from x, weight [N, K] and bias, the call)
    impls = {"fusekit": (as_is, fusekit.layernorm_linear_gelu),
             "torch eager": (as_is, torch_forward)}
    if not args.no_compile:
        # static shapes: compiled for each shape, as a model of fixed shapes would be
        impls["torch.compile"] = (as_is, torch.compile(torch_forward, dynamic=False))
    lola_seed = import_seed(args.peers, "lola_seed") if args.peers else None
    if lola_seed is not None:
        if dtype == torch.float16:
            impls["seed triton"] = (seed_prepare, lola_seed.triton_lola_ws)
        else:
            print("# seed kernel skipped: it computes in float16 only")

    info = fusekit.build_info()
    print_header(info, f"dtype {args.dtype}")
    copy_gbs, gemm_tflops = copy_ceiling(), gemm_ceiling(dtype=dtype)
    read_gbs = read_ceiling()
    # The flush before each timed run writes, and the dirty lines it leaves in L2 are written
    # back during the next run; reading after a flush by reading shows what that costs.
    read_clean_gbs = read_ceiling(flush_by_reading=True)
    print(f"# ceilings: device copy {copy_gbs:.0f} GB/s (1 GiB, read + write), "
          f"{args.dtype} GEMM {gemm_tflops:.0f} TFLOP/s (8192^3, torch.matmul); reading alone "
          f"{read_gbs:.0f} GB/s (256 MiB, torch.sum), {read_clean_gbs:.0f} GB/s when L2 was "
          f"flushed by reading")
    table = Table(copy_gbs, gemm_tflops, read_gbs)
    run(table, impls, args.shapes or SHAPES, dtype)

    if args.json:
        write_json(args.json, info, dtype=args.dtype,
                   ceilings=dict(copy_gbs=copy_gbs, gemm_tflops=gemm_tflops, read_gbs=read_gbs,
                                 read_clean_l2_gbs=read_clean_gbs),
                   rows=table.rows)


if __name__ == "__main__":
    main()
