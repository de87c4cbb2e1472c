"""Bad input gets a clear exception (argument, expected, given) before any launch."""
import math

import numpy as np
import pytest

import cuflash


def qkv(q_shape=(2, 8, 4, 16), kv_shape=(2, 8, 2, 16), dtype=np.float32):
    rng = np.random.default_rng(0)
    return (rng.standard_normal(q_shape).astype(dtype), rng.standard_normal(kv_shape).astype(dtype),
            rng.standard_normal(kv_shape).astype(dtype))


@pytest.mark.parametrize("which", [0, 1, 2])
def test_wrong_ndim(which):
    args = list(qkv())
    args[which] = args[which][0]
    name = "qkv"[which]
    with pytest.raises(ValueError, match=rf"{name} must have 4 dimensions .* got shape \(8, "):
        cuflash.attention(*args)


@pytest.mark.parametrize("kv_shape,message", [
    ((3, 8, 2, 16), "batch size 2, got 3"),
    ((2, 8, 2, 32), "head dim 16, got 32"),
    ((2, 8, 3, 16), "multiple of k/v's nheads, got 4 and 3"),
])
def test_mismatched_k_and_v_shapes(kv_shape, message):
    q, _, _ = qkv()
    _, k, v = qkv(kv_shape=kv_shape)
    with pytest.raises(ValueError, match=message):
        cuflash.attention(q, k, v)


def test_k_and_v_must_agree():
    q, k, _ = qkv()
    _, _, v = qkv(kv_shape=(2, 9, 2, 16))
    with pytest.raises(ValueError, match=r"k and v must have one shape .* got \(2, 8, 2, 16\) and \(2, 9, 2, 16\)"):
        cuflash.attention(q, k, v)


def test_dtypes():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="one dtype, got float32, float32, float64"):
        cuflash.attention(q, k, v.astype(np.float64))
    with pytest.raises(TypeError, match="dtype must be one of float16, float32, float64 on cpu, got int32"):
        cuflash.attention(*(x.astype(np.int32) for x in (q, k, v)))


def test_head_dim_limits():
    with pytest.raises(ValueError, match=r"head dim must be in 1\.\.256, got 257"):
        cuflash.attention(*qkv((1, 4, 1, 257), (1, 4, 1, 257)))
    with pytest.raises(ValueError, match=r"head dim must be in 1\.\.256, got 0"):
        cuflash.attention(*qkv((1, 4, 1, 0), (1, 4, 1, 0)))


@pytest.mark.parametrize("scale,error", [(-1.0, ValueError), (math.inf, ValueError), (math.nan, ValueError),
                                         ("0.1", TypeError), (True, TypeError)])
def test_softmax_scale(scale, error):
    with pytest.raises(error, match="softmax_scale"):
        cuflash.attention(*qkv(), softmax_scale=scale)


def test_causal_must_be_bool():
    with pytest.raises(TypeError, match="causal must be a bool, got 'yes'"):
        cuflash.attention(*qkv(), causal="yes")


def test_not_an_array():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="k must be a NumPy, CuPy, PyTorch or JAX array, got list"):
        cuflash.attention(q, k.tolist(), v)


def test_cpu_torch_tensor_is_refused():
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(x) for x in qkv())
    with pytest.raises(TypeError, match="q is a torch tensor on cpu"):
        cuflash.attention(q, k, v)


def test_valid_edge_cases_do_not_raise():
    q, k, v = qkv((1, 0, 2, 8), (1, 5, 1, 8))
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    assert out.shape == (1, 0, 2, 8) and lse.shape == (1, 2, 0)
    out = cuflash.attention(*qkv((1, 3, 2, 1), (1, 4, 2, 1)), causal=True, softmax_scale=0.0)
    assert out.shape == (1, 3, 2, 1) and np.isfinite(out).all()
