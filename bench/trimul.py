"""Benchmark of trimul (AlphaFold 3's triangle multiplicative update, outgoing, forward) against
PyTorch eager in float32, torch.compile and the seed Triton kernel, at the seven shapes of the
GPU MODE benchmark. Needs a CUDA device.

    python bench/trimul.py                               # the seven shapes
    python bench/trimul.py --peers DIR                   # and the seed, DIR/trimul_seed.py
    python bench/trimul.py --shapes 512,1,128,none,normal --json results.json

Inputs as the GPU MODE benchmark draws them: x float32 [B, N, N, C] from N(0, 1) or Cauchy(0, 2),
a random 0/1 mask or none, the weights a dict of float32 tensors keyed by the module's parameter
names, hidden size 128. Every implementation is first checked against a float64 reference with
GPU MODE's rule (every element within atol = rtol = 2e-2) and by its relative Frobenius error; a
result that fails either is printed as FAIL and not timed. Each row gives the median time of one
call (timing.bench: CUDA events, L2 flushed before each run), its TFLOP/s and its fraction of the
shape's floor: the larger of the time to read x and write out at the device-copy bandwidth and
the time of its FLOPs at the fp16 GEMM rate, both ceilings measured in the same run. The
geometric means over the shapes, GPU MODE's ranking, close the table.
"""

import argparse
import math

import torch
import torch.nn.functional as F

from common import (FloorTable, geomean, import_seed, load_fusekit, print_header, raised_note,
                    write_json)
from timing import bench, copy_ceiling, gemm_ceiling, rel_err

SHAPES = [  # (N, B, C, mask, distribution) of the GPU MODE benchmark
    (256, 2, 128, "none", "normal"),
    (768, 1, 128, "none", "cauchy"),
    (256, 2, 384, "random", "normal"),
    (512, 1, 128, "none", "normal"),
    (1024, 1, 128, "none", "cauchy"),
    (768, 1, 384, "random", "normal"),
    (1024, 1, 384, "none", "normal"),
]
HIDDEN = 128
MASKS = ("none", "random")
DISTRIBUTIONS = ("normal", "cauchy")
# GPU MODE's check: every element within atol + rtol * |expected|.
ATOL = RTOL = 2e-2
# Catches wrong results that pass the element check by luck; loose enough for float16 products.
REL_ERR_BOUND = 2e-2


def parse_shape(text):
    n, b, c, mask, dist = text.split(",")
    if mask not in MASKS or dist not in DISTRIBUTIONS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected N,B,C,mask,distribution with mask "
                                         f"in {MASKS} and distribution in {DISTRIBUTIONS}")
    return int(n), int(b), int(c), mask, dist


# ------------------------------------------------------------------------------ inputs


def make_inputs(n, b, c, mask, dist, seed):
    """(x, mask or None, weights) on the GPU, scaled as the GPU MODE benchmark scales them."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def draw(*shape):
        return torch.randn(shape, device="cuda", generator=g)

    x = torch.empty(b, n, n, c, device="cuda")
    x = x.normal_(generator=g) if dist == "normal" else x.cauchy_(0.0, 2.0, generator=g)
    keep = None
    if mask == "random":
        keep = torch.randint(0, 2, (b, n, n), device="cuda", generator=g).float()
    weights = {"norm.weight": draw(c), "norm.bias": draw(c)}
    for name in ("left_proj", "right_proj", "left_gate", "right_gate", "out_gate"):
        weights[f"{name}.weight"] = draw(HIDDEN, c) / math.sqrt(HIDDEN)
    weights["to_out_norm.weight"] = draw(HIDDEN)
    weights["to_out_norm.bias"] = draw(HIDDEN)
    weights["to_out.weight"] = draw(c, HIDDEN) / math.sqrt(c)
    return x, keep, weights


# ------------------------------------------------------------------------------ the baselines


def torch_forward(x, mask, w):
    """The reference module's formula in PyTorch, in x's dtype."""
    xn = F.layer_norm(x, x.shape[-1:], w["norm.weight"], w["norm.bias"])
    left = F.linear(xn, w["left_proj.weight"]) * F.linear(xn, w["left_gate.weight"]).sigmoid()
    right = F.linear(xn, w["right_proj.weight"]) * F.linear(xn, w["right_gate.weight"]).sigmoid()
    if mask is not None:
        left = left * mask.unsqueeze(-1)
        right = right * mask.unsqueeze(-1)
    p = torch.einsum("... i k d, ... j k d -> ... i j d", left, right)
    p = F.layer_norm(p, p.shape[-1:], w["to_out_norm.weight"], w["to_out_norm.bias"])
    return F.linear(p * F.linear(xn, w["out_gate.weight"]).sigmoid(), w["to_out.weight"])


def reference(x, mask, w):
    return torch_forward(x.double(), None if mask is None else mask.double(),
                         {k: v.double() for k, v in w.items()})


def seed_call(trimul_seed):
    """The seed's entry point, which applies its mask only when the config says nomask=False."""

    def call(x, mask, w):
        config = {"dim": x.shape[-1], "hidden_dim": HIDDEN, "nomask": mask is None}
        return trimul_seed.custom_kernel((x, mask, w, config))

    return call


# ------------------------------------------------------------------------------ rows


def flops_of(n, b, c):
    """The five projections, the pairwise products over k, the output projection."""
    m = b * n * n
    return 2 * m * c * 5 * HIDDEN + 2 * b * HIDDEN * n**3 + 2 * m * HIDDEN * c


def bytes_of(n, b, c):
    """x read and out written once, float32."""
    return 2 * b * n * n * c * 4


class Table(FloorTable):
    def __init__(self, copy_gbs, gemm_tflops):
        super().__init__(copy_gbs, gemm_tflops, shape_width=32, impl_width=14)

    def add_floor(self, shape, n, b, c):
        """Prints the shape's floor and keeps it: the larger of its memory and compute times."""
        floor_us, memory_us, compute_us = self.keep_floor(shape, bytes_of(n, b, c),
                                                          flops_of(n, b, c), self.gemm_tflops)
        print(f"# {shape}: floor {floor_us:.1f} us (x and out at the copy bandwidth "
              f"{memory_us:.1f} us, {flops_of(n, b, c) / 1e9:.1f} GFLOP at the fp16 GEMM rate "
              f"{compute_us:.1f} us)", flush=True)

    def add(self, shape, impl, sizes, err, timing=None, note=""):
        n, b, c = sizes
        self.add_row(dict(op="trimul", shape=shape, impl=impl, n=n, b=b, c=c, h=HIDDEN,
                          bytes=bytes_of(n, b, c), flops=flops_of(n, b, c),
                          floor_us=self.floors[shape], rel_err=err, ok=timing is not None,
                          note=note), timing)

    def geomeans(self, n_shapes):
        """The geometric mean of each implementation's times over the shapes (only for those
        that ran all of them), and of the floors."""
        times = {}
        for r in self.rows:
            times.setdefault(r["impl"], []).append(r.get("us"))
        means = {impl: geomean(ts) for impl, ts in times.items()
                 if len(ts) == n_shapes and None not in ts}
        means["floor"] = geomean(list(self.floors.values()))
        label = f"geomean of {n_shapes} shapes"
        for impl, us in means.items():
            line = f"{label:32s} {impl:14s} {us:9.1f}"
            if impl != "floor":
                line += f" {'':8s} {100 * means['floor'] / us:6.1f}%"
            print(line)
        return means


def violations(out, ref):
    """The fraction of elements outside GPU MODE's tolerance (NaN counts as outside)."""
    inside = (out.double() - ref).abs() <= ATOL + RTOL * ref.abs()
    return 1.0 - inside.double().mean().item()


def run(table, impls, shapes):
    for i, (n, b, c, mask, dist) in enumerate(shapes):
        shape = f"N{n} B{b} C{c} H{HIDDEN} {'mask' if mask == 'random' else 'nomask'} {dist}"
        x, keep, w = make_inputs(n, b, c, mask, dist, seed=1000 + i)
        ref = reference(x, keep, w)
        table.add_floor(shape, n, b, c)
        for name, fn in impls.items():
            try:
                out = fn(x, keep, w)
            except Exception as e:  # noqa: BLE001  (a baseline that cannot run this shape)
                table.add(shape, name, (n, b, c), math.inf, note=raised_note(e))
                continue
            err, bad = rel_err(out, ref), violations(out, ref)
            del out
            if bad > 0 or not err < REL_ERR_BOUND:
                table.add(shape, name, (n, b, c), err,
                          note=f"{bad:.1e} of the elements outside atol = rtol = {ATOL:g}"
                          if bad > 0 else f"error above {REL_ERR_BOUND:g}")
                continue
            table.add(shape, name, (n, b, c), err, bench(lambda: fn(x, keep, w)))
        del x, keep, w, ref
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ main


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", type=parse_shape, metavar="N,B,C,MASK,DIST",
                        help="shapes, e.g. 1024,1,384,none,cauchy (default: the seven GPU MODE "
                             "shapes)")
    parser.add_argument("--peers", metavar="DIR", help="folder holding trimul_seed.py (the seed)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    parser.add_argument("--json", metavar="FILE", help="write the rows to FILE")
    args = parser.parse_args()

    fusekit = load_fusekit("bench/trimul.py", "trimul")

    # name: the call on (x, mask or None, weights)
    impls = {"fusekit": fusekit.trimul, "torch eager": torch_forward}
    if not args.no_compile:
        # static shapes: compiled for each shape, as a model of fixed shapes would be
        impls["torch.compile"] = torch.compile(torch_forward, dynamic=False)
    trimul_seed = import_seed(args.peers, "trimul_seed") if args.peers else None
    if trimul_seed is not None:
        impls["seed triton"] = seed_call(trimul_seed)

    info = fusekit.build_info()
    print_header(info, f"x and weights float32, hidden {HIDDEN}")
    copy_gbs, gemm_tflops = copy_ceiling(), gemm_ceiling(dtype=torch.float16)
    print(f"# ceilings: device copy {copy_gbs:.0f} GB/s (1 GiB, read + write), "
          f"fp16 GEMM {gemm_tflops:.0f} TFLOP/s (8192^3, torch.matmul)")
    table = Table(copy_gbs, gemm_tflops)
    shapes = args.shapes or SHAPES
    run(table, impls, shapes)
    geomeans = table.geomeans(len(shapes))

    if args.json:
        write_json(args.json, info, dtype="fp32", hidden=HIDDEN,
                   ceilings=dict(copy_gbs=copy_gbs, gemm_tflops=gemm_tflops), rows=table.rows,
                   geomeans=geomeans)


if __name__ == "__main__":
    main()
