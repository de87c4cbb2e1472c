"""Launch the CUDA kernels on buffers that already exist.

Every buffer is an ``ArrayInfo`` (pointer, shape, strides in elements, dtype,
device); inputs are validated by the caller (``api``). The framework glue
(torch custom op, JAX buffer_callback) calls these directly with buffers its
framework allocated and the stream it runs on.
"""
from __future__ import annotations

import ctypes
import math

import numpy as np

from . import _compile, _plan
from ._arrays import ArrayInfo

_FLOAT32_TINY = float(np.finfo(np.float32).tiny)

# Tests set this to a callable(pointers, stream) to see every launch's array
# pointers and stream (zero-copy and stream-order checks).
_launch_observer = None


def forward(q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, out: ArrayInfo, lse: ArrayInfo, *,
            causal: bool, scale: float, stream: int) -> None:
    """out = softmax(scale q k^T) v and lse (contiguous float32 (batch, nheads, seqlen_q))."""
    batch, seqlen_q, nheads, head_dim = q.shape
    if not math.prod(q.shape):
        return
    kernel = _plan.kernel("forward", q.dtype, head_dim, causal, _vectorizable(q, k, v, out), _shared_limit(q.device))
    args = _pointers(q, k, v, out, lse)
    args += [ctypes.c_int(n) for n in (seqlen_q, k.shape[1], nheads, nheads // k.shape[2], head_dim)]
    args += _row_strides(q, k, v, out)
    args.append(ctypes.c_float(scale_log2(scale)))
    _launch(kernel, kernel.grid(seqlen_q, nheads, batch), q.device, stream, args)


def backward_workspace(q_shape) -> dict[str, tuple[tuple[int, ...], str]]:
    """Scratch buffers of ``backward`` (contents on entry do not matter): D = rowsum(dO * O)
    per (batch, head, row), and the fp32 dQ accumulator, (batch, seqlen_q, nheads, headdim)."""
    batch, seqlen_q, nheads, head_dim = q_shape
    return {"delta": ((batch, nheads, seqlen_q), "float32"), "dq_accum": (tuple(q_shape), "float32")}


def backward(dout: ArrayInfo, q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, out: ArrayInfo, lse: ArrayInfo,
             dq: ArrayInfo, dk: ArrayInfo, dv: ArrayInfo, delta: ArrayInfo, dq_accum: ArrayInfo, *,
             causal: bool, scale: float, deterministic: bool, stream: int) -> None:
    """dq, dk, dv of attention (lse contiguous; dq contiguous: the non-deterministic path
    converts the fp32 accumulator into it element by element)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    _, seqlen_k, nheads_kv, _ = k.shape
    vec = _vectorizable(dout, q, k, v, dq, dk, dv)
    limit = _shared_limit(q.device)
    accumulate = ctypes.c_void_p(None if deterministic else dq_accum.ptr)
    sizes = [ctypes.c_int(n) for n in (seqlen_q, seqlen_k, nheads, nheads // nheads_kv, head_dim)]
    scales = [ctypes.c_float(scale), ctypes.c_float(scale_log2(scale))]

    rows = batch * seqlen_q * nheads
    if rows:  # D, and a zeroed dQ accumulator
        pre = _plan.Elementwise("backward_preprocess", q.dtype)
        args = _pointers(dout, out, delta) + [accumulate]
        args += [ctypes.c_int(n) for n in (batch, seqlen_q, nheads, head_dim)] + _row_strides(dout, out)
        _launch(pre, (-(-rows // 8), 1, 1), q.device, stream, args)
    if batch * seqlen_k * nheads_kv:
        kernel = _plan.kernel("backward_dkdv", q.dtype, head_dim, causal, vec, limit)
        args = _pointers(dout, q, k, v, lse, delta, dk, dv) + [accumulate] + sizes
        args += _row_strides(dout, q, k, v, dk, dv) + scales
        _launch(kernel, kernel.grid(seqlen_k, nheads_kv, batch), q.device, stream, args)
    if not rows:
        return
    if deterministic:
        kernel = _plan.kernel("backward_dq", q.dtype, head_dim, causal, vec, limit)
        args = _pointers(dout, q, k, v, lse, delta, dq) + sizes + _row_strides(dout, q, k, v, dq) + scales
        _launch(kernel, kernel.grid(seqlen_q, nheads, batch), q.device, stream, args)
    else:
        convert = _plan.Elementwise("backward_convert_dq", q.dtype)
        n = rows * head_dim
        args = _pointers(dq_accum, dq) + [ctypes.c_int64(n), ctypes.c_float(scale)]
        _launch(convert, (min(-(-n // convert.threads), 4096), 1, 1), q.device, stream, args)


def scale_log2(scale: float) -> float:
    """The softmax scale in log2 units (kernels use exp2). A zero scale becomes the
    smallest normal float so that masked scores (-inf) times it stay -inf, not NaN."""
    return max(scale * math.log2(math.e), _FLOAT32_TINY)


def _pointers(*arrays: ArrayInfo) -> list:
    return [ctypes.c_void_p(a.ptr) for a in arrays]


def _row_strides(*arrays: ArrayInfo) -> list:
    """(batch, seqlen, head) strides of (batch, seqlen, nheads, headdim) arrays."""
    return [ctypes.c_int64(s) for a in arrays for s in a.strides[:3]]


def _vectorizable(*arrays: ArrayInfo) -> bool:
    """Can every row be moved in 16-byte chunks? (cp.async needs aligned addresses.)"""
    if arrays[0].shape[3] % 8:
        return False
    return all(a.ptr % 16 == 0 and all(s % 8 == 0 for s in a.strides[:3]) for a in arrays)


_shared_limits: dict[int, int] = {}


def _shared_limit(device: int) -> int:
    if device not in _shared_limits:
        import cupy
        attr = cupy.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin
        _shared_limits[device] = cupy.cuda.runtime.deviceGetAttribute(attr, device)
    return _shared_limits[device]


def _launch(kernel, grid, device: int, stream: int, args) -> None:
    """Launch ``kernel`` (a _plan.Kernel or Elementwise) on ``stream``, compiling it on first use."""
    import cupy
    from cupy_backends.cuda.api import driver
    function = _compile.load_kernel(kernel.source, kernel.instance, device, kernel.shared_bytes)
    if _launch_observer is not None:
        _launch_observer([a.value for a in args if isinstance(a, ctypes.c_void_p)], stream)
    params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
    with cupy.cuda.Device(device):
        driver.launchKernel(function, *grid, kernel.threads, 1, 1, kernel.shared_bytes, stream,
                            ctypes.addressof(params), 0)
