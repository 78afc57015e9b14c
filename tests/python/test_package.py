"""The package itself: build information, the error type, the DLPack binding, imports."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import fusekit
from fusekit import _C


def test_error_type():
    assert fusekit.Error is _C.Error
    assert issubclass(fusekit.Error, RuntimeError)


def test_build_info():
    info = fusekit.build_info()
    assert set(info) == {"version", "with_cuda", "cuda_architectures", "with_openmp"}
    assert info["version"] == fusekit.__version__
    assert isinstance(info["with_cuda"], bool) and isinstance(info["with_openmp"], bool)
    assert (info["cuda_architectures"] != "") == info["with_cuda"]
    count = fusekit.cuda_device_count()
    assert count >= 0
    if not info["with_cuda"]:
        assert count == 0


@pytest.mark.skipif(fusekit.cuda_device_count() == 0, reason="no CUDA device visible to fusekit")
def test_cuda_device_info():
    info = fusekit.cuda_device_info(0)
    assert info["name"] == torch.cuda.get_device_name(0)
    assert info["multiprocessors"] > 0 and info["l2_cache_bytes"] > 0
    with pytest.raises(fusekit.Error, match=r"^cuda_device_info: device 999 requested"):
        fusekit.cuda_device_info(999)


def test_cuda_unsupported_without_cuda_build():
    if fusekit.build_info()["with_cuda"]:
        pytest.skip("this build has the CUDA backend")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch to make a CUDA tensor with")
    z = torch.zeros(1, 1, 1, device="cuda")
    with pytest.raises(fusekit.Error, match=r"this fusekit was built without CUDA"):
        fusekit.mhc_post(z[0], z, z, z)


def test_binding_takes_any_dlpack_array_in_place():
    """_C writes into the caller's memory, torch tensor or numpy array, with no copy."""
    for module in (torch, np):
        x = module.ones((2, 3), dtype=module.float32)
        residual = module.ones((2, 1, 3), dtype=module.float32)
        post = module.ones((2, 1), dtype=module.float32) * 2
        comb = module.ones((2, 1, 1), dtype=module.float32) * 3
        out = module.zeros((2, 1, 3), dtype=module.float32)
        _C.mhc_post(out, x, residual, post, comb, 0)
        assert (out == 5).all(), module.__name__


def test_public_names():
    import fusekit.torch

    assert {"causal_attention", "layernorm_linear_gelu", "mhc_post", "mhc_post_backward",
            "trimul"} <= set(fusekit.__all__)
    assert {"LayerNormLinearGELU", "TriangleMultiplication", "layernorm_linear_gelu"} <= set(
        fusekit.torch.__all__)
    for module in (fusekit, fusekit.torch):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"


def test_binding_optional_arrays_take_none():
    """Optional inputs: None reaches the library as an absent argument."""
    for module in (torch, np):
        x = module.ones((2, 3), dtype=module.float32)
        x[:, 0] = 4  # each row: mean 2, biased variance 2
        weight = module.ones((1, 3), dtype=module.float32)
        out = module.full((2, 1), module.nan, dtype=module.float32)
        _C.layernorm_linear_gelu(out, x, weight, None, None, None, 0.0, False, True, 0)
        assert abs(float(out.sum())) < 1e-5, module.__name__  # LayerNorm rows sum to 0
        bias = module.full((1,), 10, dtype=module.float32)
        _C.layernorm_linear_gelu(out, x, weight, bias, None, None, 0.0, False, True, 0)
        assert abs(float(out[0, 0]) - 10) < 1e-4, module.__name__  # GELU(10) = 10


def test_binding_dtype_errors_name_the_argument():
    x = np.zeros((2, 3), np.int8)
    residual = np.zeros((2, 1, 3), np.float32)
    post, comb = np.zeros((2, 1), np.float32), np.zeros((2, 1, 1), np.float32)
    out = np.zeros((2, 1, 3), np.float32)
    with pytest.raises(fusekit.Error, match=r"^mhc_post: x has dtype int8, which fusekit does not "
                                            r"handle; expected float32, float16, bfloat16"):
        _C.mhc_post(out, x, residual, post, comb, 0)
    with pytest.raises(fusekit.Error, match=r"^mhc_post: comb_res_mix has dtype complex64"):
        _C.mhc_post(out, x.astype(np.float32), residual, post, comb.astype(np.complex64), 0)
    # dtypes the binding maps but the operator does not take: the library's message.
    with pytest.raises(fusekit.Error, match=r"^mhc_post: x has dtype int32, expected bfloat16"):
        _C.mhc_post(out, x.astype(np.int32), residual, post, comb, 0)


def test_binding_rejects_too_many_dims():
    deep = np.zeros((1,) * 9, np.float32)
    with pytest.raises(fusekit.Error, match=r"^mhc_post: residual has 9 dims, expected at most 8$"):
        _C.mhc_post(np.zeros((1, 1, 1), np.float32), np.zeros((1, 1), np.float32), deep,
                    np.zeros((1, 1), np.float32), np.zeros((1, 1, 1), np.float32), 0)


def test_read_only_numpy_inputs():
    x = np.ones((2, 3), np.float32)
    x.flags.writeable = False
    out = fusekit.mhc_post(x, np.ones((2, 1, 3), np.float32), np.ones((2, 1), np.float32),
                           np.zeros((2, 1, 1), np.float32))
    assert (out == 1).all()


def test_import_without_torch():
    """`import fusekit` and numpy calls work where torch cannot be imported."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np, fusekit\n"
        "out = fusekit.mhc_post(np.ones((2, 3), np.float32), np.ones((2, 1, 3), np.float32),\n"
        "                       np.ones((2, 1), np.float32), np.ones((2, 1, 1), np.float32))\n"
        "assert (out == 2).all(), out\n"
        "y = fusekit.layernorm_linear_gelu(np.ones((2, 3), np.float32),\n"
        "                                  np.ones((4, 3), np.float32), np.ones(4, np.float32),\n"
        "                                  approximate='none')\n"
        "assert y.shape == (2, 4) and (abs(y - 0.8413447) < 1e-6).all(), y\n"
        "assert 'torch' not in dir(fusekit)\n"
        "print('ok')\n"
    )
    env = dict(os.environ)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                            cwd=os.path.dirname(os.path.abspath(__file__)))
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
