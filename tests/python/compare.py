"""The one comparison helper of the Python tests, and the tolerances, stated once per dtype.

assert_close() compares a result (torch tensor or numpy array, any dtype and device) with a
float64 reference and, on failure, reports everything needed to judge it: shapes and dtypes,
NaN/inf parity, the worst element with its index and both values, the largest relative error and
the number of mismatching elements. Never a bare allclose.
"""

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Tol:
    rtol: float
    atol: float


# Keyed by the dtype of the result being checked. For float16 and bfloat16 the relative tolerance
# is twice the worst relative rounding error of one conversion from float32 (half a unit in the
# last place: 2^-11 and 2^-8), i.e. at most about twice the error of the same formula computed by
# PyTorch and rounded to that dtype. The absolute term multiplies the sum of |terms| behind each
# element (see `scale`), so that float32 accumulation error under cancellation is allowed for and
# nothing more.
TOLERANCES = {
    "float32": Tol(rtol=1e-5, atol=1e-5),
    "float16": Tol(rtol=2**-10, atol=1e-5),
    "bfloat16": Tol(rtol=2**-7, atol=1e-5),
}


def dtype_name(a):
    """"float32", "bfloat16", ... for a torch tensor, a numpy array or a dtype."""
    dt = getattr(a, "dtype", a)
    return str(dt).removeprefix("torch.")


def to_torch64(a):
    """A float64 CPU torch tensor with the values of `a` (torch tensor or numpy array)."""
    if isinstance(a, np.ndarray):
        a = torch.from_numpy(np.ascontiguousarray(a))
    return a.detach().to(device="cpu", dtype=torch.float64)


def _report(name, context, lines):
    head = f"{name}: " + "; ".join(lines)
    return head + (f"\n  [{context}]" if context else "")


def assert_close(actual, expected, *, tol=None, scale=None, dtype=None, name="result", context=""):
    """Fails unless |actual - expected| <= tol.atol * scale + tol.rtol * |expected| everywhere,
    with NaN and inf exactly where the reference has them.

    actual:   the result (torch tensor or numpy array).
    expected: the reference, float64 preferred.
    tol:      a Tol; defaults to TOLERANCES[dtype of actual].
    scale:    per-element magnitude of the absolute term (e.g. the sum of |terms|, floored at 1);
              broadcastable to the shape; defaults to 1.
    dtype:    if given, the dtype actual must have.
    context:  what reproduces the case (seed, shape, layout), printed with every failure.
    """
    __tracebackhide__ = True
    a_dtype = dtype_name(actual)
    if dtype is not None and a_dtype != dtype_name(dtype):
        raise AssertionError(_report(name, context, [f"dtype {a_dtype}, expected {dtype_name(dtype)}"]))
    a, e = to_torch64(actual), to_torch64(expected)
    if tuple(a.shape) != tuple(e.shape):
        raise AssertionError(_report(name, context, [f"shape {list(a.shape)}, expected {list(e.shape)}"]))
    if tol is None:
        tol = TOLERANCES[a_dtype]
    s = torch.ones(()) if scale is None else to_torch64(scale)
    s = s.broadcast_to(e.shape) if e.dim() else s

    a_nan, e_nan = torch.isnan(a), torch.isnan(e)
    a_inf, e_inf = torch.isinf(a), torch.isinf(e)
    parity = (a_nan != e_nan) | (a_inf != e_inf) | (a_inf & e_inf & (torch.sign(a) != torch.sign(e)))
    finite = torch.isfinite(a) & torch.isfinite(e)
    err = torch.where(finite, (a - e).abs(), torch.zeros_like(e))
    bound = tol.atol * s + tol.rtol * e.abs()
    bad = (finite & (err > bound)) | parity
    n_bad = int(bad.sum())
    if n_bad == 0:
        return

    lines = [f"{n_bad} of {e.numel()} elements mismatch (dtype {a_dtype}, shape {list(e.shape)}, "
             f"rtol {tol.rtol:.3g}, atol {tol.atol:.3g} x scale)"]
    n_parity = int(parity.sum())
    if n_parity:
        idx = tuple(int(i) for i in torch.nonzero(parity)[0])
        lines.append(f"{n_parity} NaN/inf parity breaks, first at {list(idx)}: got {a[idx].item()!r}, "
                     f"expected {e[idx].item()!r}")
    if finite.any():
        excess = torch.where(finite, err / bound.clamp_min(1e-300), torch.zeros_like(e))
        idx = tuple(int(i) for i in np.unravel_index(int(excess.argmax()), tuple(e.shape)))
        rel = (err / e.abs().clamp_min(1e-300))[finite]
        lines.append(f"worst at {list(idx)}: got {a[idx].item()!r}, expected {e[idx].item()!r}, "
                     f"|diff| {err[idx].item():.3g} vs allowed {bound[idx].item():.3g}")
        lines.append(f"max |diff| {err.max().item():.3g}, max relative {rel.max().item():.3g}")
    raise AssertionError(_report(name, context, lines))


def assert_bitwise_equal(a, b, *, name="result", context=""):
    """Fails unless a and b have the same shape, dtype and bytes (NaN payloads included)."""
    __tracebackhide__ = True
    if dtype_name(a) != dtype_name(b) or tuple(a.shape) != tuple(b.shape):
        raise AssertionError(_report(name, context, [f"{dtype_name(a)} {list(a.shape)} vs "
                                                     f"{dtype_name(b)} {list(b.shape)}"]))
    ab, bb = _as_bits(a), _as_bits(b)
    diff = ab != bb
    n = int(diff.sum())
    if n:
        idx = tuple(int(i) for i in np.argwhere(diff)[0])
        raise AssertionError(_report(name, context, [
            f"{n} of {diff.size} elements differ bitwise, first at {list(idx)}: "
            f"{to_torch64(a)[idx].item()!r} vs {to_torch64(b)[idx].item()!r}"]))


def _as_bits(a):
    """The raw bits of each element as a numpy integer array of a's shape."""
    if isinstance(a, np.ndarray):
        return np.ascontiguousarray(a).view(f"u{a.itemsize}")
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.detach().cpu().contiguous().view(ints).numpy()


def max_abs_error(actual, expected):
    """max |actual - expected| in float64, NaN counting as infinite (for error-budget rules)."""
    a, e = to_torch64(actual), to_torch64(expected)
    if a.numel() == 0:
        return 0.0
    return (a - e).abs().nan_to_num(nan=float("inf")).max().item()
