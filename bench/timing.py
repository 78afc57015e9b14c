"""The one timing helper of the fusekit benchmarks (GPU only).

    from timing import bench, copy_ceiling, gemm_ceiling
    t = bench(lambda: fusekit.mhc_post(x, res, post, comb))          # -> Timing
    t = bench([fn_on_copy_0, fn_on_copy_1, ...], cuda_graph=True)     # microsecond kernels

bench() warms up, then times many runs with CUDA events and reports the median (with the 20th and
80th percentiles). By default the L2 cache is flushed before every timed run, so each run reads
its inputs from device memory as a large model layer does. For kernels of a few microseconds,
where launch overhead and event resolution would dominate, cuda_graph=True captures a batch of
calls in a CUDA graph and times its replays; pass several callables over distinct input copies
(together larger than L2) to keep those calls reading from device memory too.

copy_ceiling() and gemm_ceiling() measure, in the same process and on the same device, the
bandwidth of a large device-to-device copy and the throughput of a large GEMM (bf16 unless told):
the ceilings each row is compared with.
"""

import math
import statistics
from dataclasses import dataclass

import torch


@dataclass
class Timing:
    median_us: float
    p20_us: float
    p80_us: float
    runs: int
    method: str  # "events+flush", "events" or "graph"


def l2_cache_bytes(device=None):
    props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)


_flush_buffers = {}


def flush_l2(device=None, by_reading=False):
    """Overwrites a buffer of twice the L2 size, evicting whatever the last run left in L2 (and
    leaving L2 full of dirty lines, which the next run's misses write back, as a flush by
    writing does in every common benchmark harness). by_reading: reads the buffer instead, so
    that L2 is left holding clean lines."""
    device = torch.device("cuda", torch.cuda.current_device() if device is None else device)
    buf = _flush_buffers.get(device)
    if buf is None:
        buf = _flush_buffers[device] = torch.empty(2 * l2_cache_bytes(device), dtype=torch.int8,
                                                   device=device)
    if by_reading:
        buf.view(torch.int32).sum()
    else:
        buf.zero_()


def _percentiles(times_ms, scale):
    times = sorted(t * scale for t in times_ms)
    q = statistics.quantiles(times, n=5) if len(times) > 1 else [times[0]] * 4
    return statistics.median(times), q[0], q[3]


def _event_time_ms(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def bench(fns, *, warmup_ms=25.0, rep_ms=100.0, min_runs=10, max_runs=1000, flush=True,
          flush_by_reading=False, cuda_graph=False, calls_per_graph=None):
    """Median time of one call, in microseconds.

    fns:        a callable, or a list of callables timed in rotation (distinct input copies).
    warmup_ms:  device time spent warming up after a first (compiling/autotuning) call.
    rep_ms:     device time spent measuring; the number of runs is clamped to [min_runs, max_runs].
    flush:      flush L2 before every timed run (event timing only; graphs rotate copies instead).
    flush_by_reading: flush by reading a buffer rather than writing it (see flush_l2).
    cuda_graph: time replays of a CUDA graph holding `calls_per_graph` calls (default: enough calls
                for about 200 us), and divide by the number of calls.
    """
    fns = list(fns) if isinstance(fns, (list, tuple)) else [fns]
    for f in fns:  # first calls: lazy initialisation, compilation, autotuning
        f()
    torch.cuda.synchronize()
    per_call_ms = max(min(_event_time_ms(fns[0]) for _ in range(3)), 1e-4)

    if cuda_graph:
        return _bench_graph(fns, per_call_ms, rep_ms, min_runs, max_runs, calls_per_graph)

    n_warmup = max(1, int(warmup_ms / per_call_ms))
    n_runs = max(min_runs, min(max_runs, int(rep_ms / per_call_ms)))
    for i in range(n_warmup):
        fns[i % len(fns)]()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_runs)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_runs)]
    for i in range(n_runs):
        if flush:
            flush_l2(by_reading=flush_by_reading)
        starts[i].record()
        fns[i % len(fns)]()
        ends[i].record()
    torch.cuda.synchronize()
    med, p20, p80 = _percentiles([s.elapsed_time(e) for s, e in zip(starts, ends)], 1e3)
    return Timing(med, p20, p80, n_runs, "events+flush" if flush else "events")


def _bench_graph(fns, per_call_ms, rep_ms, min_runs, max_runs, calls_per_graph):
    calls = calls_per_graph or max(len(fns), int(0.2 / per_call_ms))
    calls = -(-calls // len(fns)) * len(fns)  # whole rotations
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on the capture stream, as torch.cuda.graph advises
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    replay_ms = _event_time_ms(graph.replay)
    n_runs = max(min_runs, min(max_runs, int(rep_ms / max(replay_ms, 1e-3))))
    for _ in range(max(1, n_runs // 10)):
        graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_runs)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_runs)]
    for i in range(n_runs):
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    med, p20, p80 = _percentiles([s.elapsed_time(e) for s, e in zip(starts, ends)], 1e3 / calls)
    del graph
    return Timing(med, p20, p80, n_runs * calls, "graph")


def copy_ceiling(nbytes=2**30):
    """Achieved bandwidth of a device-to-device copy of `nbytes`, in GB/s (read + write)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src), flush=False)
    del src, dst
    return 2 * nbytes / (t.median_us * 1e-6) / 1e9


def read_ceiling(nbytes=2**28, flush_by_reading=False):
    """Achieved bandwidth of reading `nbytes` once (a float32 sum), in GB/s (bytes read only),
    after a flush of L2 by writing (as every timing here) or, flush_by_reading, by reading."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
    t = bench(lambda: src.sum(), flush=True, flush_by_reading=flush_by_reading)
    del src
    return nbytes / (t.median_us * 1e-6) / 1e9


def gemm_ceiling(m=8192, dtype=torch.bfloat16):
    """Achieved throughput of an m x m x m matrix product in `dtype` (torch.matmul), in TFLOP/s."""
    a = torch.randn(m, m, dtype=dtype, device="cuda")
    b = torch.randn(m, m, dtype=dtype, device="cuda")
    t = bench(lambda: a @ b, flush=False)
    del a, b
    return 2 * m**3 / (t.median_us * 1e-6) / 1e12


def rel_err(got, ref):
    """Relative Frobenius error of got against ref, in float64; inf when got is not finite."""
    got, ref = got.double(), ref.double()
    if not torch.isfinite(got).all():
        return math.inf
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
