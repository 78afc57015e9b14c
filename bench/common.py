"""What every fusekit benchmark script does besides timing: checking that it can run, loading the
seed kernel, the header, the rows of a table measured against a floor, and the JSON file.

    fusekit = load_fusekit("bench/trimul.py", "trimul")
    seed = import_seed(args.peers, "trimul_seed")            # None when it cannot be imported
    print_header(fusekit.build_info(), "x and weights float32")
    table = FloorTable(copy_gbs, gemm_tflops, shape_width=32, impl_width=14)
    write_json(args.json, fusekit.build_info(), ceilings=..., rows=table.rows)
"""

import importlib
import json
import math
import sys

import torch

# The message of a backend that raises because it is not written yet: such rows print as skipped.
NOT_IMPLEMENTED = "the CUDA backend is not implemented yet"


def die(script, message):
    print(f"{script}: {message}", file=sys.stderr)
    sys.exit(1)


def load_fusekit(script, op=None, with_torch=False):
    """The fusekit module, after checking that torch sees a GPU and that fusekit was built with
    its CUDA backend (and has `op`, when given); exits with the reason otherwise. with_torch:
    import fusekit.torch too (its modules)."""
    if not torch.cuda.is_available():
        die(script, "needs a CUDA device, and torch sees none (torch.cuda.is_available() is "
                    "False); run it on a GPU machine")
    try:
        import fusekit
        if with_torch:
            import fusekit.torch  # noqa: F401
    except ImportError as e:
        die(script, f"cannot import fusekit ({e}); build it first with `pip install .`")
    if not fusekit.build_info()["with_cuda"]:
        die(script, "this fusekit was built without the CUDA backend; rebuild it where nvcc is "
                    "found")
    if op is not None and not hasattr(fusekit, op):
        die(script, f"this fusekit has no {op}; rebuild it from this checkout")
    return fusekit


def import_seed(peers, module):
    """The seed kernel's module from the folder `peers`, or None (said in a line) when it cannot
    be imported."""
    sys.path.insert(0, peers)
    try:
        return importlib.import_module(module)
    except ImportError as e:
        print(f"# seed kernel skipped: cannot import {module} from {peers} ({e})")
        return None


def print_header(info, inputs):
    """The first line: the device, the versions and what the inputs are."""
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, fusekit {info['version']} "
          f"(CUDA architectures {info['cuda_architectures']}), {inputs}")


def write_json(path, info, **fields):
    """Writes the device, the versions and `fields` (in their order) to `path`."""
    with open(path, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       fusekit=info, **fields), f, indent=1)
    print(f"# rows written to {path}")


def raised_note(e):
    """The note of a row whose call raised `e`."""
    return f"{type(e).__name__}: {str(e)[:80]}"


def timing_fields(timing):
    """The fields of a timed row that come from its Timing."""
    return dict(us=timing.median_us, p20_us=timing.p20_us, p80_us=timing.p80_us,
                method=timing.method)


def geomean(values):
    return math.exp(sum(math.log(v) for v in values) / len(values))


class FloorTable:
    """Rows of time, TFLOP/s and fraction of the shape's floor: the larger of its bytes at the
    device-copy bandwidth and its FLOPs at a GEMM rate (gemm_tflops: one rate, or a dict of
    them), both ceilings measured in the same run."""

    def __init__(self, copy_gbs, gemm_tflops, shape_width, impl_width):
        self.copy_gbs, self.gemm_tflops, self.rows, self.floors = copy_gbs, gemm_tflops, [], {}
        self.shape_width, self.impl_width = shape_width, impl_width
        print(f"{'shape':{shape_width}s} {'impl':{impl_width}s} {'time us':>9s} {'TFLOP/s':>8s} "
              f"{'%floor':>7s} {'rel err':>8s}  method")

    def keep_floor(self, shape, nbytes, flops, gemm_tflops):
        """Keeps the shape's floor; returns (floor, memory, compute) in microseconds."""
        memory_us = nbytes / (self.copy_gbs * 1e9) * 1e6
        compute_us = flops / (gemm_tflops * 1e12) * 1e6
        self.floors[shape] = max(memory_us, compute_us)
        return self.floors[shape], memory_us, compute_us

    def add_row(self, row, timing=None, gbs=False):
        """Completes and prints `row`, which holds at least shape, impl, bytes, flops, floor_us,
        rel_err and note (and skipped, for a row that did not run): with the timing's fields,
        TFLOP/s, GB/s when `gbs`, and the fraction of the floor."""
        err, note = row["rel_err"], row["note"]
        line = f"{row['shape']:{self.shape_width}s} {row['impl']:{self.impl_width}s} "
        if timing is not None:
            sec = timing.median_us * 1e-6
            tflops = row["flops"] / sec / 1e12
            row.update(timing_fields(timing), tflops=tflops)
            if gbs:
                row["gbs"] = row["bytes"] / sec / 1e9
            row["floor_fraction"] = row["floor_us"] / timing.median_us
            line += (f"{timing.median_us:9.1f} {tflops:8.1f} {100 * row['floor_fraction']:6.1f}% "
                     f"{err:8.1e}  {timing.method}")
        elif row.get("skipped"):
            line += f"{'-':>9s} {'':8s} {'':7s} {'':8s}  skipped: {note}"
        else:
            shown = f"{err:8.1e}" if err is not None else f"{'-':>8s}"
            line += f"{'-':>9s} {'':8s} {'':7s} {shown}  FAIL {note}"
        self.rows.append(row)
        print(line, flush=True)
