"""The NumPy-like public functions: validate -> plan -> launch."""
from __future__ import annotations

import math
import numbers

import numpy as np

from . import _arrays, _kernels, _plan

GPU_DTYPES = ("float16", "bfloat16")
CPU_DTYPES = ("float16", "float32", "float64")


def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None, return_lse: bool = False):
    """Exact softmax attention, softmax(scale * q k^T) v, as FlashAttention.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim)
    with nheads % nheads_kv == 0 (GQA/MQA: query head h reads KV head
    h // (nheads // nheads_kv)). ``causal`` is aligned bottom-right: query i sees
    key j iff j <= i + seqlen_k - seqlen_q. ``softmax_scale`` defaults to
    1 / sqrt(headdim). CUDA arrays (CuPy, PyTorch, JAX; float16 or bfloat16) run
    the tensor-core kernel on the caller's stream and return the same kind of
    array; NumPy arrays run the CPU path. Returns ``out`` (like q) or, with
    ``return_lse``, ``(out, lse)`` where lse is float32 (batch, nheads, seqlen_q),
    the natural log-sum-exp of the scaled scores (+inf for a row that sees no key).
    """
    qi, ki, vi = (_arrays.inspect(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    scale = _check(qi, ki, vi, causal, softmax_scale)
    if qi.device is None:
        from . import cpu
        out, lse = cpu.attention_forward(q, k, v, causal=bool(causal), softmax_scale=scale)
    else:
        out, lse = _forward_gpu(qi, ki, vi, bool(causal), scale)
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out, lse, *, causal: bool = False, softmax_scale: float | None = None,
                       deterministic: bool = False):
    """Gradients (dq, dk, dv) of ``attention`` given the upstream gradient ``dout``.

    ``out`` and ``lse`` are what ``attention(q, k, v, ..., return_lse=True)``
    returned for the same arguments; P is recomputed from ``lse``, never stored.
    With GQA, dk and dv are summed over the query heads that share a KV head.
    ``deterministic=True`` gives bitwise-identical results from run to run (dQ is
    then computed by its own pass instead of fp32 atomics; see docs/api.md for the
    cost). Same array kinds, devices and streams as ``attention``.
    """
    qi, ki, vi = (_arrays.inspect(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    scale = _check(qi, ki, vi, causal, softmax_scale)
    doi, oi, li = (_arrays.inspect(x, name) for x, name in ((dout, "dout"), (out, "out"), (lse, "lse")))
    for name, a in (("dout", doi), ("out", oi)):
        _check_like(name, a, qi, qi.shape, qi.dtype)
    lse_shape = (qi.shape[0], qi.shape[2], qi.shape[1])
    _check_like("lse", li, qi, lse_shape, "float32")
    if li.device is not None and math.prod(lse_shape) and li.strides != _arrays.contiguous_strides(lse_shape):
        raise ValueError(f"lse must be contiguous, got strides {li.strides} for shape {li.shape}")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    if qi.device is None:
        from . import cpu
        return cpu.attention_backward(dout, q, k, v, out, lse, causal=bool(causal), softmax_scale=scale)
    framework = _arrays.Framework(qi)
    grads = [framework.empty(a.shape, a.dtype) for a in (qi, ki, vi)]
    work = {name: framework.empty(shape, dtype) for name, (shape, dtype) in _kernels.backward_workspace(qi.shape).items()}
    _kernels.backward(doi, qi, ki, vi, oi, li, *(g.info for g in grads), work["delta"].info, work["dq_accum"].info,
                      causal=bool(causal), scale=scale, deterministic=bool(deterministic), stream=framework.stream)
    return tuple(framework.finish(g.array) for g in grads)


def _check_like(name: str, a: _arrays.ArrayInfo, q: _arrays.ArrayInfo, shape, dtype: str) -> None:
    """``a`` must be ``shape`` and ``dtype``, and live where q does."""
    if a.framework != q.framework or a.where != q.where:
        raise TypeError(f"{name} must be the same kind of array on the same device as q "
                        f"({q.framework} on {q.where}), got {a.framework} on {a.where}")
    if a.shape != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {a.shape}")
    if a.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {a.dtype}")
    if a.device is not None and len(shape) == 4 and shape[3] > 1 and math.prod(shape) and a.strides[3] != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride 1), got strides {a.strides}")


def _check(q: _arrays.ArrayInfo, k: _arrays.ArrayInfo, v: _arrays.ArrayInfo, causal, softmax_scale) -> float:
    """Every user error becomes an exception here, before anything is launched.
    Returns the softmax scale."""
    arrays = {"q": q, "k": k, "v": v}
    for name, a in arrays.items():
        if len(a.shape) != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, seqlen, nheads, headdim), got shape {a.shape}")
    kinds = {a.framework for a in arrays.values()}
    if len(kinds) > 1:
        raise TypeError(f"q, k and v must be the same kind of array, got {q.framework}, {k.framework}, {v.framework}")
    if len({a.where for a in arrays.values()}) > 1:
        raise ValueError(f"q, k and v must be on one device, got {q.where}, {k.where}, {v.where}")
    if len({a.dtype for a in arrays.values()}) > 1:
        raise TypeError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    allowed = GPU_DTYPES if q.device is not None else CPU_DTYPES
    if q.dtype not in allowed:
        hint = "; cast to float16 or bfloat16" if q.device is not None else ""
        raise TypeError(f"dtype must be one of {', '.join(allowed)} on {q.where}, got {q.dtype}{hint}")

    batch, seqlen_q, nheads, head_dim = q.shape
    _, seqlen_k, nheads_kv, _ = k.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape (batch, seqlen_k, nheads_kv, headdim), got {k.shape} and {v.shape}")
    if k.shape[0] != batch:
        raise ValueError(f"k and v must have q's batch size {batch}, got {k.shape[0]}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k and v must have q's head dim {head_dim}, got {k.shape[3]}")
    if not 1 <= head_dim <= _plan.MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in 1..{_plan.MAX_HEAD_DIM}, got {head_dim}")
    if nheads_kv == 0 or nheads % nheads_kv:
        raise ValueError(f"q's nheads must be a multiple of k/v's nheads, got {nheads} and {nheads_kv}")
    if q.device is not None:
        for name, a in arrays.items():
            if a.strides[3] != 1 and head_dim > 1 and math.prod(a.shape):
                raise ValueError(f"{name} must be contiguous in its last dimension (stride 1), got strides {a.strides}")
        if batch > 65535 or nheads > 65535:
            raise ValueError(f"batch and nheads must be at most 65535 on the GPU, got {batch} and {nheads}")

    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not isinstance(softmax_scale, numbers.Real) or isinstance(softmax_scale, bool):
        raise TypeError(f"softmax_scale must be a real number or None, got {softmax_scale!r}")
    if not math.isfinite(softmax_scale) or softmax_scale < 0:
        raise ValueError(f"softmax_scale must be finite and >= 0, got {softmax_scale}")
    return float(softmax_scale)


def _forward_gpu(q, k, v, causal: bool, scale: float):
    framework = _arrays.Framework(q)
    out = framework.empty(q.shape, q.dtype)
    lse = framework.empty((q.shape[0], q.shape[2], q.shape[1]), "float32")
    _kernels.forward(q, k, v, out.info, lse.info, causal=causal, scale=scale, stream=framework.stream)
    return framework.finish(out.array), framework.finish(lse.array)
