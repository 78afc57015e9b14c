"""Benchmark of mhc_post (forward and backward) against PyTorch eager, torch.compile and the seed
Triton kernel, on model-shaped inputs. Needs a CUDA device.

    python bench/mhc_post.py                      # the default shapes, bf16
    python bench/mhc_post.py --peers DIR          # add the seed kernel from DIR/mhc_post_seed.py
    python bench/mhc_post.py --shapes 4096,7168,4 --dtype fp16 --json results.json

Every implementation is first checked against a float64 reference; a wrong result is printed as
FAIL and not timed. Each row gives the median time of one call (timing.bench: L2 flushed before
each run, or CUDA-graph replay over input copies larger than L2 for the smallest shapes), the
achieved bandwidth with bytes counted as every input read once and every output written once,
its fraction of the device-copy ceiling measured in the same run, and the same for FLOP/s
against a bf16 GEMM.
"""

import argparse
import math

import torch

from common import import_seed, load_fusekit, print_header, timing_fields, write_json
from timing import bench, copy_ceiling, gemm_ceiling, l2_cache_bytes, rel_err

FORWARD_SHAPES = [  # (N tokens, H hidden, hc streams)
    (4096, 1280, 4),
    (4096, 2560, 4),
    (4096, 7168, 4),
    (16384, 7168, 4),
    (4096, 4096, 2),
    (8, 7168, 4),
]
BACKWARD_SHAPES = [(4096, 7168, 4)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GRAPH_BELOW_BYTES = 8 * 2**20  # calls moving less than this are timed by CUDA-graph replay


def parse_shape(text):
    n, h, hc = (int(v) for v in text.split(","))
    return n, h, hc


# ------------------------------------------------------------------------------ the baselines


def torch_forward(x, residual, post_layer_mix, comb_res_mix):
    """The seed's PyTorch formula (mhc_post_ref): float32 math, one rounding to x's dtype."""
    y = x.unsqueeze(-2) * post_layer_mix + torch.bmm(comb_res_mix.mT, residual.float())
    return y.type_as(x)


def torch_backward(grad_out, x, residual, post_layer_mix, comb_res_mix):
    """The gradients of torch_forward written out, for eager and torch.compile alike."""
    acc = post_layer_mix.dtype  # float32 (float64 for the reference)
    g = grad_out.to(acc)
    post = post_layer_mix.reshape(*post_layer_mix.shape[:2], 1)
    grad_x = (g * post).sum(1).to(x.dtype)
    grad_residual = (comb_res_mix @ g).to(x.dtype)
    grad_post = (g * x.to(acc).unsqueeze(1)).sum(-1).reshape(post_layer_mix.shape)
    grad_comb = residual.to(acc) @ g.mT
    return grad_x, grad_residual, grad_post, grad_comb


def reference_forward(x, residual, post_layer_mix, comb_res_mix):
    x, residual, post, comb = (t.double() for t in (x, residual, post_layer_mix, comb_res_mix))
    return x.unsqueeze(-2) * post.reshape(*post.shape[:2], 1) + comb.mT @ residual


def reference_backward(grad_out, x, residual, post_layer_mix, comb_res_mix):
    return torch_backward(*(t.double() for t in (grad_out, x, residual, post_layer_mix, comb_res_mix)))


# ------------------------------------------------------------------------------ rows


class Table:
    def __init__(self, copy_gbs, gemm_tflops):
        self.copy_gbs, self.gemm_tflops, self.rows = copy_gbs, gemm_tflops, []
        print(f"{'op':18s} {'shape':22s} {'impl':14s} {'time us':>9s} {'GB/s':>7s} {'%copy':>6s} "
              f"{'TFLOP/s':>8s} {'%gemm':>6s} {'rel err':>8s}  method")

    def add(self, op, shape, impl, nbytes, flops, err, timing=None, note=""):
        row = dict(op=op, shape=shape, impl=impl, bytes=nbytes, flops=flops, rel_err=err,
                   ok=timing is not None, note=note)
        line = f"{op:18s} {shape:22s} {impl:14s} "
        if timing is not None:
            sec = timing.median_us * 1e-6
            row.update(timing_fields(timing), gbs=nbytes / sec / 1e9, tflops=flops / sec / 1e12)
            row.update(copy_fraction=row["gbs"] / self.copy_gbs,
                       gemm_fraction=row["tflops"] / self.gemm_tflops)
            line += (f"{timing.median_us:9.1f} {row['gbs']:7.0f} {100 * row['copy_fraction']:5.1f}% "
                     f"{row['tflops']:8.2f} {100 * row['gemm_fraction']:5.2f}% {err:8.1e}  {timing.method}")
        else:
            line += f"{'-':>9s} {'':7s} {'':6s} {'':8s} {'':6s} {err:8.1e}  FAIL {note}"
        self.rows.append(row)
        print(line, flush=True)


def time_impl(fn, copies_fn, nbytes, use_graph):
    """Timing of fn; by CUDA-graph replay over input copies for the smallest calls."""
    if use_graph and nbytes < GRAPH_BELOW_BYTES:
        try:
            return bench(copies_fn(), cuda_graph=True)
        except Exception as e:  # noqa: BLE001  (a baseline that cannot be captured)
            print(f"#   graph capture failed ({type(e).__name__}: {str(e)[:80]}); timing with events")
            torch.cuda.synchronize()
    return bench(fn)


def input_copies(make, nbytes):
    """Enough independent input sets that one rotation through them overflows L2 three times."""
    count = min(256, max(1, math.ceil(3 * l2_cache_bytes() / max(nbytes, 1))))
    return [make() for _ in range(count)]


def run_forward(table, impls, shapes, dtype, tol, use_graph):
    for n, h, hc in shapes:
        shape = f"N{n} H{h} hc{hc}"

        def make():
            return (torch.randn(n, h, dtype=dtype, device="cuda"),
                    torch.randn(n, hc, h, dtype=dtype, device="cuda"),
                    2 * torch.sigmoid(torch.randn(n, hc, 1, device="cuda")),
                    torch.randn(n, hc, hc, device="cuda"))

        inputs = make()
        ref = reference_forward(*inputs)
        esize = inputs[0].element_size()
        nbytes = n * h * esize * (1 + 2 * hc) + n * hc * (1 + hc) * 4
        flops = 2 * n * hc * h * (1 + hc)
        copies = None
        for name, fn in impls.items():
            err = rel_err(fn(*inputs), ref)
            if not err < tol:
                table.add("mhc_post", shape, name, nbytes, flops, err, note=f"error above {tol:g}")
                continue
            if copies is None and use_graph and nbytes < GRAPH_BELOW_BYTES:
                copies = input_copies(make, nbytes)
            timing = time_impl(lambda: fn(*inputs), lambda: [lambda c=c: fn(*c) for c in copies],
                               nbytes, use_graph)
            table.add("mhc_post", shape, name, nbytes, flops, err, timing)
        del inputs, ref, copies
        torch.cuda.empty_cache()


def run_backward(table, impls, shapes, dtype, tol, use_graph):
    for n, h, hc in shapes:
        shape = f"N{n} H{h} hc{hc}"

        def make():
            return (torch.randn(n, hc, h, dtype=dtype, device="cuda"),
                    torch.randn(n, h, dtype=dtype, device="cuda"),
                    torch.randn(n, hc, h, dtype=dtype, device="cuda"),
                    2 * torch.sigmoid(torch.randn(n, hc, 1, device="cuda")),
                    torch.randn(n, hc, hc, device="cuda"))

        inputs = make()
        refs = reference_backward(*inputs)
        esize = inputs[1].element_size()
        nbytes = n * h * esize * (2 + 3 * hc) + 2 * n * hc * (1 + hc) * 4
        flops = 4 * n * hc * h * (1 + hc)
        copies = None
        for name, fn in impls.items():
            err = max(rel_err(g, r) for g, r in zip(fn(*inputs), refs))
            if not err < tol:
                table.add("mhc_post_backward", shape, name, nbytes, flops, err, note=f"error above {tol:g}")
                continue
            if copies is None and use_graph and nbytes < GRAPH_BELOW_BYTES:
                copies = input_copies(make, nbytes)
            timing = time_impl(lambda: fn(*inputs), lambda: [lambda c=c: fn(*c) for c in copies],
                               nbytes, use_graph)
            table.add("mhc_post_backward", shape, name, nbytes, flops, err, timing)
        del inputs, refs, copies
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ main


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", type=parse_shape, metavar="N,H,hc",
                        help="forward shapes (default: the model-shaped list)")
    parser.add_argument("--backward-shapes", nargs="*", type=parse_shape, metavar="N,H,hc",
                        help="backward shapes (default: 4096,7168,4; none to skip)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--peers", metavar="DIR", help="folder holding mhc_post_seed.py (the seed)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    parser.add_argument("--no-graph", action="store_true",
                        help="time every row with events and L2 flushes, never by graph replay")
    parser.add_argument("--json", metavar="FILE", help="write the rows to FILE")
    args = parser.parse_args()

    fusekit = load_fusekit("bench/mhc_post.py")

    dtype = DTYPES[args.dtype]
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    forward_shapes = args.shapes or FORWARD_SHAPES
    backward_shapes = BACKWARD_SHAPES if args.backward_shapes is None else args.backward_shapes

    forward = {"fusekit": fusekit.mhc_post, "torch eager": torch_forward}
    backward = {"fusekit": fusekit.mhc_post_backward, "torch eager": torch_backward}
    if not args.no_compile:
        forward["torch.compile"] = torch.compile(torch_forward)
        backward["torch.compile"] = torch.compile(torch_backward)
    mhc_post_seed = import_seed(args.peers, "mhc_post_seed") if args.peers else None
    if mhc_post_seed is not None:
        forward["seed triton"] = mhc_post_seed.mhc_post

    info = fusekit.build_info()
    print_header(info, f"dtype {args.dtype}")
    copy_gbs, gemm_tflops = copy_ceiling(), gemm_ceiling()
    print(f"# ceilings: device copy {copy_gbs:.0f} GB/s (1 GiB, read + write), "
          f"bf16 GEMM {gemm_tflops:.0f} TFLOP/s (8192^3)")
    table = Table(copy_gbs, gemm_tflops)
    run_forward(table, forward, forward_shapes, dtype, tol, not args.no_graph)
    run_backward(table, backward, backward_shapes, dtype, tol, not args.no_graph)

    if args.json:
        write_json(args.json, info, dtype=args.dtype,
                   ceilings=dict(copy_gbs=copy_gbs, gemm_tflops=gemm_tflops), rows=table.rows)


if __name__ == "__main__":
    main()
