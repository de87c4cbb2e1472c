"""The sm_90a forward (cuda/sm90/fwd.cu: TMA and wgmma), launched on its own while it is
brought up beside the mma.sync kernels: dense CuPy arrays, head dim 128, fp16 or bf16,
causal or not. The planner does not choose it yet."""
from __future__ import annotations

import ctypes
import functools

from . import _arrays, _compile, _driver, _options, _plan, _tensormap

CONSUMERS, BLOCK_N, STAGES = 2, 128, 2
BLOCK_M = 64 * CONSUMERS
HEAD_DIM = 128
DTYPES = {"float16": "cuflash::half_t", "bfloat16": "cuflash::bfloat16_t"}


def shared_bytes(head_dim: int = HEAD_DIM, block_m: int = BLOCK_M, block_n: int = BLOCK_N,
                 stages: int = STAGES) -> int:
    """``Sm90Shared<...>::kBytes``: Q, the K and V stages, the barriers (Q's, and a landed
    and a released one a stage) and 1024 bytes of alignment."""
    return 2 * head_dim * (block_m + 2 * stages * block_n) + (2 * stages + 1) * 8 + 1024


def instance(dtype: str, causal: bool, specialised: bool) -> str:
    """The kernel: with ``specialised``, a producer warpgroup beside the consumers."""
    name = "attention_forward_sm90_ws" if specialised else "attention_forward_sm90"
    return (f"cuflash::{name}<{DTYPES[dtype]}, {HEAD_DIM}, {BLOCK_N}, {CONSUMERS}, {STAGES}, "
            f"{'true' if causal else 'false'}>")


def threads(specialised: bool) -> int:
    return 128 * (CONSUMERS + specialised)


@functools.cache
def _function(name: str, device: int, shared: int) -> int:
    compiled = _compile.compile_kernel("sm90/fwd.cu", name, "sm_90a")
    return _driver.load_function(compiled.cubin, compiled.lowered_name, device, shared)


def arguments(params: ctypes.Structure, maps: list) -> ctypes.Array:
    """``Sm90Params``: the Params, then the three maps from the next 64-byte boundary."""
    head = bytes(params)
    head += bytes(-len(head) % 64)
    return ctypes.create_string_buffer(head + b"".join(bytes(m) for m in maps), len(head) + 128 * len(maps))


def forward(q, k, v, *, causal: bool = False, softmax_scale=None, specialised: bool = True):
    """(out, lse) of attention on CuPy arrays (batch, seqlen, heads, 128) through the sm_90a
    kernel, on the current stream."""
    import cupy
    infos = {name: _arrays.inspect(x, name) for name, x in (("q", q), ("k", k), ("v", v))}
    qi, ki, vi = infos["q"], infos["k"], infos["v"]
    _options.check_qkv(qi, ki, vi, packed=False)
    if qi.shape[-1] != HEAD_DIM or qi.dtype not in DTYPES:
        raise ValueError(f"the sm_90a forward takes head dim {HEAD_DIM} in float16 or bfloat16, got "
                         f"{qi.shape[-1]} {qi.dtype}")
    options = _options.make_options(qi, ki, causal, softmax_scale, (-1, -1), 0.0, None, 0.0, None, 0,
                                    backward=False)
    batch, seqlen_q, heads, _ = qi.shape
    out = cupy.empty(q.shape, q.dtype)
    lse = cupy.empty((batch, heads, seqlen_q), cupy.float32)
    params, _ = _plan._params(qi, ki, vi, options, None, o=_arrays.inspect(out, "out"))
    params.q.ptr, params.k.ptr, params.v.ptr, params.o.ptr, params.lse = q.data.ptr, k.data.ptr, v.data.ptr, \
        out.data.ptr, lse.data.ptr
    maps = [_tensormap.encode(a.ptr, a.dtype, a.shape, a.strides, rows)
            for a, rows in ((qi, BLOCK_M), (ki, BLOCK_N), (vi, BLOCK_N))]
    args = arguments(params, maps)
    shared = shared_bytes()
    function = _function(instance(qi.dtype, options.local, specialised), qi.device, shared)
    launch, _ = _driver.launcher()
    pointers = (ctypes.c_void_p * 1)(ctypes.addressof(args))
    if batch and seqlen_q and heads:
        launch(function, -(-seqlen_q // BLOCK_M), heads, batch, threads(specialised), 1, 1, shared,
               cupy.cuda.get_current_stream().ptr, ctypes.addressof(pointers), 0)
    return out, lse
