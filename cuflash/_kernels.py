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
    kernel = _plan.forward_kernel(q.dtype, head_dim, causal, _vectorizable(q, k, v, out), _shared_limit(q.device))
    function = _compile.load_kernel("fwd.cu", kernel.instance, q.device, kernel.shared_bytes)
    args = _pointers(q, k, v, out, lse)
    args += [ctypes.c_int(n) for n in (seqlen_q, k.shape[1], nheads, nheads // k.shape[2], head_dim)]
    args += _row_strides(q, k, v, out)
    args.append(ctypes.c_float(scale_log2(scale)))
    _launch(function, kernel.grid(batch, nheads, seqlen_q), kernel.threads, kernel.shared_bytes,
            q.device, stream, args)


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


def _launch(function: int, grid, threads: int, shared_bytes: int, device: int, stream: int, args) -> None:
    import cupy
    from cupy_backends.cuda.api import driver
    if _launch_observer is not None:
        _launch_observer([a.value for a in args if isinstance(a, ctypes.c_void_p)], stream)
    params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
    with cupy.cuda.Device(device):
        driver.launchKernel(function, *grid, threads, 1, 1, shared_bytes, stream, ctypes.addressof(params), 0)
