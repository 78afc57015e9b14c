"""Shared fixtures of the Python tests: fresh random inputs with a recorded seed, and devices.

Every test that draws inputs takes the `rng` fixture. Its seed is new on every run; a failing
test prints it, and FUSEKIT_TEST_SEED=<seed> draws the same inputs again.
"""

import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # reference.py, compare.py

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device visible to torch")
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


def cuda_backend_mark(op, call):
    """A skip while the CUDA backend of `op` raises its "not implemented yet" error, found by
    call(), one call of the operator on a tiny CUDA input. Any other outcome (a result, another
    error) lets the CUDA cases run and report it."""
    import fusekit

    missing = False
    if HAS_CUDA:
        try:
            call()
        except fusekit.Error as e:
            missing = str(e).startswith(f"{op}: the CUDA backend is not implemented yet")
    return pytest.mark.skipif(missing, reason="no CUDA backend yet")


class Rng:
    """A seeded torch generator (on the CPU: the same values on every device) for one test."""

    def __init__(self, seed):
        self.seed = seed
        self.gen = torch.Generator().manual_seed(seed)

    def randn(self, *shape, dtype=torch.float32, device="cpu"):
        return torch.randn(shape, generator=self.gen).to(dtype=dtype, device=device)

    def rand(self, *shape, dtype=torch.float32, device="cpu"):
        return torch.rand(shape, generator=self.gen).to(dtype=dtype, device=device)


@pytest.fixture
def rng(request):
    env = os.environ.get("FUSEKIT_TEST_SEED")
    seed = int(env) if env else random.SystemRandom().randrange(2**31)
    request.node.fusekit_seed = seed
    return Rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed = getattr(item, "fusekit_seed", None)
    if report.failed and seed is not None:
        report.sections.append(("random inputs", f"seed {seed}: rerun with FUSEKIT_TEST_SEED={seed}"))
