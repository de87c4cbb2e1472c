"""Launch the CUDA kernels on buffers that already exist.

Every buffer is an ``ArrayInfo`` (pointer, shape, strides in elements, dtype,
device); options are an ``Options`` (validated by ``api``). The framework glue
(torch custom op, JAX buffer_callback) calls these directly with buffers its
framework allocated and the stream it runs on. Dense arrays are (batch, seqlen,
nheads, headdim); packed variable-length arrays are (total, nheads, headdim) with
a ``Varlen`` describing the sequences.
"""
from __future__ import annotations

import ctypes
import functools
import math
import struct
from typing import NamedTuple

import numpy as np

from . import _compile, _plan
from ._arrays import ArrayInfo
from ._options import Options, Varlen
from ._params import ArrayView, Params

_FLOAT32_TINY = float(np.finfo(np.float32).tiny)

# Tests set this to a callable(pointers, stream) to see every launch's array
# pointers and stream (zero-copy and stream-order checks).
_launch_observer = None


def dropout_threshold(p: float) -> int:
    """A probability is dropped iff its 32-bit Philox word is below this."""
    return min(int(p * 2**32), 2**32 - 1)


def scale_log2(scale: float) -> float:
    """The softmax scale in log2 units (kernels use exp2). A zero scale becomes the
    smallest normal float so that masked scores (-inf) times it stay -inf, not NaN."""
    return max(scale * math.log2(math.e), _FLOAT32_TINY)


def forward(q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, out: ArrayInfo, lse: ArrayInfo | None, options: Options, *,
            stream: int, varlen: Varlen | None = None, key=None) -> None:
    """out = attention(q, k, v) and its LSE ((batch, nheads, seqlen_q), or (nheads, total_q);
    contiguous, or None: not written).
    ``key``: the caller's own cache key for this call but its pointers, if it has one
    (``api`` passes its validated signature; out is then its own allocation)."""
    plan = _cached(_forward_plans, key or _plan_key((q, k, v, out), options, varlen), options, varlen,
                   lambda: _forward_plan(q, k, v, out, lse, options, varlen))
    plan.launch(stream, q.ptr, k.ptr, v.ptr, out.ptr, 0 if lse is None else lse.ptr)


class LaunchPlan(NamedTuple):
    """What a call launches, all but its array pointers: the Params with the pointers
    left to fill in at ``offsets``, then each kernel's launch configuration (function,
    grid, block, shared memory) and its arguments after the Params."""
    params: bytes
    offsets: tuple[int, ...]
    launches: tuple[tuple[tuple, tuple], ...]
    device: int

    def launch(self, stream: int, *pointers: int) -> None:
        p = Params.from_buffer_copy(self.params)
        for offset, pointer in zip(self.offsets, pointers):
            _put_pointer(p, offset, pointer)  # (a nested field's setattr costs 3x as much)
        for config, args in self.launches:
            _launch_configured(config, self.device, stream, p, *args)


_put_pointer = struct.Struct("<Q").pack_into


def _offsets(*names: str) -> tuple[int, ...]:
    """Where each named pointer lies in Params (an ArrayView's pointer is its first field)."""
    return tuple(getattr(Params, name).offset for name in names)


_FORWARD_POINTERS = _offsets("q", "k", "v", "o", "lse")
_BACKWARD_POINTERS = _offsets("dout", "q", "k", "v", "o", "lse", "dlse", "dq", "dk", "dv", "delta", "dq_accum")


def _forward_plan(q, k, v, out, lse, options: Options, varlen: Varlen | None) -> LaunchPlan:
    p, batch = _params(q, k, v, lse, options, varlen, o=out)
    kernel = _kernel("forward", q, options, _vectorizable(q, k, v, out))
    launches = ()
    if batch and p.seqlen_q and p.nheads:
        p.tile_group = tile_group(kernel, batch * p.nheads, q.device)
        launches = ((_config(kernel, kernel.grid(p.seqlen_q, p.nheads, batch), q.device), ()),)
    return LaunchPlan(bytes(p), _FORWARD_POINTERS, launches, q.device)


# Warm calls: what a dense call signature launches is worked out once. ALiBi (its
# pointer), dropout (a fresh seed each call) and packed sequences take the full path.
_forward_plans: dict = {}
_backward_plans: dict = {}


def _cached(plans: dict, key, options: Options, varlen: Varlen | None, make) -> LaunchPlan:
    plan = plans.get(key) if key else None
    if plan is None:
        plan = make()
        if key and _cacheable(options, varlen) and len(plans) < 4096:
            plans[key] = plan
    return plan


def _cacheable(options: Options, varlen: Varlen | None) -> bool:
    return varlen is None and options.alibi is None and options.dropout_p == 0


def _plan_key(arrays, options: Options, varlen: Varlen | None):
    if not _cacheable(options, varlen):
        return None
    return tuple((a.shape, a.strides, a.dtype, a.device, a.ptr % 16 == 0) for a in arrays if a is not None), options


PREPROCESS_ROWS = 4  # (row, head) tasks per thread of the backward's preprocess (bwd.cu, kPreprocessRows)


def backward_workspace(q_shape, deterministic: bool = False,
                       extras: bool = False) -> dict[str, tuple[tuple[int, ...], str]]:
    """Scratch buffers of ``backward`` (contents on entry do not matter): D = rowsum(dO * O),
    laid out like the LSE, and, unless ``deterministic``, dQ's fp32 accumulator in 8 x 8
    blocks, (rows / 8, nheads, head-dim bucket / 8, 8, 8) (dq_accum.cuh, DqAccum), where the
    one-pass kernel has a tile for this head dim and ``extras`` (softcap, ALiBi or dropout on)."""
    *rows, nheads, head_dim = q_shape
    work = {"delta": (((rows[0], nheads, rows[1]) if len(rows) == 2 else (nheads, rows[0])), "float32")}
    bucket = _plan.head_dim_bucket(head_dim)
    if not deterministic and _plan.KINDS["backward"].candidates(bucket, extras):
        work["dq_accum"] = ((-(-math.prod(rows) // 8), nheads, bucket // 8, 8, 8), "float32")
    return work


def backward(dout: ArrayInfo, q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, out: ArrayInfo, lse: ArrayInfo,
             dq: ArrayInfo, dk: ArrayInfo, dv: ArrayInfo, delta: ArrayInfo, options: Options, *, stream: int,
             varlen: Varlen | None = None, dq_accum: ArrayInfo | None = None, dlse: ArrayInfo | None = None,
             key=None) -> None:
    """dq, dk, dv of attention; delta and dq_accum come from ``backward_workspace``.
    ``dlse``: the loss's gradient with respect to lse (laid out like it), or None where
    the loss does not use lse.
    With dq_accum, where the one-pass kernel has an instance (head dim, no softcap,
    ALiBi or dropout, shared memory of the device), it computes all three, dQ through
    fp32 atomics; otherwise dQ has its own pass and every gradient is bitwise
    reproducible. ``key`` as for ``forward`` (dq, dk, dv, delta and dq_accum are then
    the caller's own allocations)."""
    arrays = (dout, q, k, v, out, lse, dlse, dq, dk, dv, delta, dq_accum)
    plan = _cached(_backward_plans, key or _plan_key(arrays, options, varlen), options, varlen,
                   lambda: _backward_plan(*arrays, options, varlen))
    plan.launch(stream, *(0 if a is None else a.ptr for a in arrays))


def _backward_plan(dout, q, k, v, out, lse, dlse, dq, dk, dv, delta, dq_accum, options: Options,
                   varlen: Varlen | None) -> LaunchPlan:
    # (dlse, like every pointer, is filled in at launch: the plan is the same with or without it)
    p, batch = _params(q, k, v, lse, options, varlen, o=out, dout=dout, dq=dq, dk=dk, dv=dv)
    vec = _vectorizable(dout, q, k, v, dq, dk, dv)
    nheads_kv = k.shape[-2]
    rows_per_batch = p.seqlen_q if varlen is None else q.shape[0]
    groups = batch if varlen is None else 1
    tasks = groups * rows_per_batch * p.nheads
    one_pass = dq_accum is not None and _plan.has_tile("backward", p.headdim, options.extras,
                                                      _shared_limit(q.device))
    accum_cols = dq_accum.shape[2] * dq_accum.shape[-1] if one_pass else 0  # (rows / 8, nheads, cols / 8, 8, 8)
    # Lanes per (row, head) of the elementwise kernels: one per 16 bytes of the row, 4-32.
    lanes = min(32, max(4, 1 << (-(-p.headdim // 8) - 1).bit_length()))
    per_row = tuple(map(ctypes.c_int, (groups, rows_per_batch, accum_cols, lanes)))
    elementwise_grid = (-(-tasks * lanes // 256), 1, 1)
    preprocess_grid = (-(-(-(-tasks // PREPROCESS_ROWS)) * lanes // 256), 1, 1)
    launches = []
    if tasks:
        launches.append((_config(_plan.Elementwise("backward_preprocess", q.dtype), preprocess_grid, q.device),
                         per_row))
        if not one_pass:
            kernel = _kernel("backward_dq", q, options, vec)
            p.tile_group = tile_group(kernel, batch * p.nheads, q.device)
            launches.append((_config(kernel, kernel.grid(p.seqlen_q, p.nheads, batch), q.device), ()))
    if batch and p.seqlen_k and nheads_kv:
        kernel = _kernel("backward" if one_pass else "backward_dkdv", q, options, vec)
        if one_pass:  # (backward_dkdv goes head by head)
            p.tile_group = tile_group(kernel, batch * nheads_kv, q.device)
        launches.append((_config(kernel, kernel.grid(p.seqlen_k, nheads_kv, batch), q.device), ()))
    if tasks and one_pass:
        launches.append((_config(_plan.Elementwise("backward_convert_dq", q.dtype), elementwise_grid, q.device),
                         per_row))
    # dq_accum stays unset without the one-pass kernel: nothing reads it then.
    offsets = _BACKWARD_POINTERS if one_pass else _BACKWARD_POINTERS[:-1]
    return LaunchPlan(bytes(p), offsets, tuple(launches), q.device)


def _kernel(kind: str, q: ArrayInfo, options: Options, vectorized: bool) -> _plan.Kernel:
    return _plan.kernel(kind, q.dtype, q.shape[-1], options.local, vectorized, options.extras,
                        _shared_limit(q.device))


def _view(a: ArrayInfo | None) -> ArrayView:
    if a is None:
        return ArrayView()
    strides = a.strides if len(a.shape) == 4 else (0, *a.strides)  # packed: no batch stride
    return ArrayView(a.ptr, *strides[:3])


def _params(q, k, v, lse, options: Options, varlen: Varlen | None, **arrays) -> tuple[Params, int]:
    """The Params of a call, and the number of (batch) sequences."""
    p = Params()
    for name, a in dict(q=q, k=k, v=v, **arrays).items():
        setattr(p, name, _view(a))
    p.lse = None if lse is None else lse.ptr
    head_dim, nheads, nheads_kv = q.shape[-1], q.shape[-2], k.shape[-2]
    # The LSE is contiguous: (batch, nheads, seqlen_q), or (nheads, total_q) when packed.
    if varlen is None:
        batch, p.seqlen_q, p.seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        p.lse_batch_stride, p.lse_head_stride = nheads * p.seqlen_q, p.seqlen_q
    else:
        batch, p.seqlen_q, p.seqlen_k = varlen.batch, varlen.max_seqlen_q, varlen.max_seqlen_k
        p.lse_batch_stride, p.lse_head_stride = 0, q.shape[0]
        p.cu_seqlens_q, p.cu_seqlens_k = varlen.cu_seqlens_q.ptr, varlen.cu_seqlens_k.ptr
    p.nheads, p.heads_per_kv, p.headdim = nheads, nheads // max(nheads_kv, 1), head_dim
    p.window_left, p.window_right = options.window  # normalised per sequence by the kernel (mask.cuh)
    p.scale, p.scale_log2, p.softcap = options.scale, scale_log2(options.scale), options.softcap
    if options.alibi is not None:
        p.alibi_slopes = options.alibi.ptr
        p.alibi_batch_stride = options.alibi.strides[0] if len(options.alibi.shape) == 2 else 0
    if options.dropout_p > 0:
        p.dropout_threshold = dropout_threshold(options.dropout_p)
        p.dropout_scale = 1.0 / (1.0 - options.dropout_p)
        p.seed, p.rng_offset = options.seed, options.rng_offset
    return p, batch


def _vectorizable(*arrays: ArrayInfo) -> bool:
    """Can every row be moved in 16-byte chunks? (cp.async needs aligned addresses.)"""
    if arrays[0].shape[-1] % 8:
        return False
    return all(a.ptr % 16 == 0 and all(s % 8 == 0 for s in a.strides[:-1]) for a in arrays)


def tile_group(kernel: _plan.Kernel, heads: int, device: int) -> int:
    """(head, batch) pairs per group of the tile-major order of banded grids (GridTile in
    cuda/common.cuh): at most a quarter of the CTAs resident at once, so that a head's
    CTAs run together and keep the rows they share in L2, in groups of equal size (a
    small last group ran its long tiles alone: forward d 224 causal 2k was 10.7% slower
    with 72 pairs in groups of 66 and 6; docs/tuning.md, "Tile-major causal grids")."""
    most = max(1, _multiprocessors(device) * _resident_ctas(kernel, device) // 4)
    groups = -(-heads // most)
    return -(-heads // groups)


@functools.cache
def _multiprocessors(device: int) -> int:
    import cupy
    return cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, device)


@functools.cache
def _resident_ctas(kernel: _plan.Kernel, device: int) -> int:
    from cupy.cuda import driver
    return max(1, driver.occupancyMaxActiveBlocksPerMultiprocessor(_function(kernel, device), kernel.threads,
                                                                   kernel.shared_bytes))


_shared_limits: dict[int, int] = {}


def _shared_limit(device: int) -> int:
    if device not in _shared_limits:
        import cupy
        attr = cupy.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin
        _shared_limits[device] = cupy.cuda.runtime.deviceGetAttribute(attr, device)
    return _shared_limits[device]


@functools.cache
def _function(kernel, device: int) -> int:
    return _compile.load_kernel(kernel.source, kernel.instance, device, kernel.shared_bytes)


def _config(kernel, grid, device: int) -> tuple:
    """launchKernel's leading arguments: function, grid, block, dynamic shared memory."""
    return (_function(kernel, device), *grid, kernel.threads, 1, 1, kernel.shared_bytes)


_POINTER_ARRAYS = [ctypes.c_void_p * n for n in range(8)]


def _launch_configured(config: tuple, device: int, stream: int, *args) -> None:
    cupy, driver = _cuda()
    if _launch_observer is not None:
        _launch_observer(args[0].pointers(), stream)
    params = _POINTER_ARRAYS[len(args)](*map(ctypes.addressof, args))
    if cupy.cuda.runtime.getDevice() == device:  # entering a Device costs more than asking
        if not driver.ctxGetCurrent():
            # A thread with no CUDA runtime call behind it yet (autograd's device thread)
            # has no current context: cudaSetDevice makes the primary one current.
            cupy.cuda.runtime.setDevice(device)
        driver.launchKernel(*config, stream, ctypes.addressof(params), 0)
    else:
        with cupy.cuda.Device(device):
            driver.launchKernel(*config, stream, ctypes.addressof(params), 0)


@functools.cache  # an import statement per launch costs microseconds
def _cuda():
    import cupy
    from cupy_backends.cuda.api import driver
    return cupy, driver
