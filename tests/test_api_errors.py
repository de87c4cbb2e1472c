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
                                         (1e39, ValueError), (3e38, ValueError), ("0.1", TypeError),
                                         (True, TypeError)])
def test_softmax_scale(scale, error):
    with pytest.raises(error, match="softmax_scale"):
        cuflash.attention(*qkv(), softmax_scale=scale)


def test_large_finite_softmax_scale_is_accepted():
    """The bound is the scale's own float32 range in log2 units, not a tighter guess:
    whether scores overflow depends on the data, as in any attention."""
    out = cuflash.attention(*qkv(), softmax_scale=1e30)
    assert np.isfinite(out).all()


def test_causal_must_be_bool():
    with pytest.raises(TypeError, match="causal must be a bool, got 'yes'"):
        cuflash.attention(*qkv(), causal="yes")


def test_not_an_array():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="k must be a NumPy, CuPy, PyTorch or JAX array, got list"):
        cuflash.attention(q, k.tolist(), v)


def test_cpu_torch_tensor_is_refused():
    torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")
    q, k, v = (torch.from_numpy(x) for x in qkv())
    with pytest.raises(TypeError, match="q is a torch tensor on cpu"):
        cuflash.attention(q, k, v)


def test_valid_edge_cases_do_not_raise():
    q, k, v = qkv((1, 0, 2, 8), (1, 5, 1, 8))
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    assert out.shape == (1, 0, 2, 8) and lse.shape == (1, 2, 0)
    out = cuflash.attention(*qkv((1, 3, 2, 1), (1, 4, 2, 1)), causal=True, softmax_scale=0.0)
    assert out.shape == (1, 3, 2, 1) and np.isfinite(out).all()


# --- the variants' options ------------------------------------------------------------------

@pytest.mark.parametrize("options,error,message", [
    (dict(window_size=(-2, 0)), ValueError, r"window_size left must be an integer >= -1 \(-1: unbounded\), got -2"),
    (dict(window_size=(0, 1.5)), TypeError, "window_size right must be an integer"),
    (dict(window_size=(True, 0)), TypeError, "window_size left must be an integer"),
    (dict(window_size=3), TypeError, r"window_size must be a pair \(left, right\), got 3"),
    (dict(softcap=-1.0), ValueError, r"softcap must be finite, >= 0 and <= 3.40282e\+38, got -1.0"),
    (dict(softcap=1e39), ValueError, r"softcap must be finite, >= 0 and <= 3.40282e\+38, got 1e\+39"),
    (dict(softcap=math.inf), ValueError, "softcap must be finite"),
    (dict(dropout_p=1.0), ValueError, r"dropout_p must be finite, >= 0 and < 1, got 1.0"),
    (dict(dropout_p=-0.1), ValueError, "dropout_p must be finite"),
    (dict(dropout_p=math.nan), ValueError, "dropout_p must be finite"),
    (dict(dropout_p=True), TypeError, "dropout_p must be a real number, got True"),
    (dict(dropout_p=0.1, seed=-1), ValueError, r"seed must be an integer in \[0, 2\*\*64\), got -1"),
    (dict(dropout_p=0.1, seed=True), TypeError, "seed must be an integer, got True"),
    (dict(dropout_p=0.1, seed=1.0), TypeError, "seed must be an integer, got 1.0"),
    (dict(rng_offset=2**64), ValueError, "rng_offset must be an integer"),
    (dict(rng_offset=True), TypeError, "rng_offset must be an integer, got True"),
    (dict(rng_offset=np.bool_(True)), TypeError, "rng_offset must be an integer, got "),
    (dict(alibi_slopes=np.ones(3, np.float32)), ValueError, r"alibi_slopes must have shape \(4,\) or \(2, 4\), got \(3,\)"),
    (dict(alibi_slopes=np.ones(4, np.float64)), TypeError, "alibi_slopes must be float32, got float64"),
    (dict(alibi_slopes=[0.5] * 4), TypeError, "alibi_slopes must be a NumPy, CuPy, PyTorch or JAX array"),
    (dict(alibi_slopes=np.array([0.5, np.inf, 0.1, np.nan], np.float32)), ValueError,
     r"alibi_slopes must be finite, got \[inf, nan\]"),
])
def test_variant_options(options, error, message):
    with pytest.raises(error, match=message):
        cuflash.attention(*qkv(), **options)


def test_dropout_backward_needs_the_forward_seed():
    q, k, v = qkv()
    out, lse = cuflash.attention(q, k, v, dropout_p=0.2, seed=7, return_lse=True)
    with pytest.raises(ValueError, match="seed is required for the backward with dropout_p > 0"):
        cuflash.attention_backward(out, q, k, v, out, lse, dropout_p=0.2)


def packed(total_q=10, total_k=12):
    rng = np.random.default_rng(1)
    return (rng.standard_normal((total_q, 4, 16)).astype(np.float32),
            rng.standard_normal((total_k, 2, 16)).astype(np.float32),
            rng.standard_normal((total_k, 2, 16)).astype(np.float32))


@pytest.mark.parametrize("cu_q,cu_k,max_q,max_k,error,message", [
    (np.array([0, 4, 10], np.int64), np.array([0, 5, 12], np.int32), 6, 7, TypeError, "cu_seqlens_q must be int32, got int64"),
    (np.array([0, 6, 4, 10], np.int32), np.array([0, 5, 5, 12], np.int32), 6, 7, ValueError,
     r"cu_seqlens_q must start at 0 and never decrease, got \[0, 6, 4, 10\]"),
    (np.array([1, 4, 10], np.int32), np.array([0, 5, 12], np.int32), 6, 7, ValueError, "must start at 0"),
    (np.array([0, 4, 9], np.int32), np.array([0, 5, 12], np.int32), 6, 7, ValueError,
     "cu_seqlens_q must end at the number of packed rows 10, got 9"),
    (np.array([0, 4, 10], np.int32), np.array([0, 12], np.int32), 6, 12, ValueError,
     r"cu_seqlens_q and cu_seqlens_k must have one length \(batch \+ 1\), got 3 and 2"),
    (np.array([0, 4, 10], np.int32), np.array([0, 5, 12], np.int32), 5, 7, ValueError,
     "max_seqlen_q must be at least the longest sequence, 6, got 5"),
    (np.array([0, 4, 10], np.int32), np.array([0, 5, 12], np.int32), 6, 6, ValueError,
     "max_seqlen_k must be at least the longest sequence, 7, got 6"),
    (np.array([[0, 4, 10]], np.int32), np.array([0, 5, 12], np.int32), 6, 7, ValueError,
     r"cu_seqlens_q must have shape \(batch \+ 1,\)"),
])
def test_varlen_packing(cu_q, cu_k, max_q, max_k, error, message):
    with pytest.raises(error, match=message):
        cuflash.attention_varlen(*packed(), cu_q, cu_k, max_q, max_k)


def test_varlen_layout():
    q, k, v = packed()
    cu_q, cu_k = np.array([0, 4, 10], np.int32), np.array([0, 5, 12], np.int32)
    with pytest.raises(ValueError, match=r"q must have 3 dimensions \(total, nheads, headdim\)"):
        cuflash.attention_varlen(q[None], k, v, cu_q, cu_k, 6, 7)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, 6, 7, causal=True, return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, 10)


@pytest.mark.parametrize("name,make,error,message", [
    ("lse", lambda lse: np.ascontiguousarray(lse.transpose(0, 2, 1)).transpose(0, 2, 1), ValueError,
     r"lse must be contiguous, got strides"),
    ("lse", lambda lse: lse[..., :-1], ValueError, r"lse must have shape \(2, 4, 8\), got \(2, 4, 7\)"),
    ("lse", lambda lse: lse.astype(np.float64), TypeError, "lse must have dtype float32, got float64"),
    ("out", lambda out: out[:, :-1], ValueError, r"out must have shape \(2, 8, 4, 16\), got \(2, 7, 4, 16\)"),
    ("out", lambda out: out.astype(np.float64), TypeError, "out must have dtype float32, got float64"),
    ("dout", lambda dout: dout[..., :8], ValueError, "dout must have shape"),
])
def test_backward_buffers(name, make, error, message):
    """The backward's out, dout and lse are held to one layout contract on every backend
    (the CPU path could read a strided lse, the kernels cannot)."""
    q, k, v = qkv()
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    arrays = dict(dout=out.copy(), out=out, lse=lse)
    arrays[name] = make(arrays[name])
    with pytest.raises(error, match=message):
        cuflash.attention_backward(arrays["dout"], q, k, v, arrays["out"], arrays["lse"])


def test_lse_with_unit_dimensions_of_any_stride_is_contiguous():
    q, k, v = qkv((1, 8, 1, 16), (1, 8, 1, 16))
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    strided = np.lib.stride_tricks.as_strided(lse, lse.shape, (4096, 4096, 4))
    cuflash.attention_backward(out, q, k, v, out, strided)
