"""The sm_90a forward (cuda/sm90/fwd.cu: TMA and wgmma), launched on its own while it is
brought up beside the mma.sync kernels: dense CuPy arrays, head dim 128, fp16 or bf16,
causal, windows, softcap. The planner does not choose it yet."""
from __future__ import annotations

import ctypes
import functools

from . import _arrays, _compile, _driver, _options, _plan, _tensormap

@functools.cache
def _function(kernel: _plan.Sm90Forward, device: int) -> int:
    compiled = _compile.compile_kernel(kernel.source, kernel.instance, "sm_90a")
    return _driver.load_function(compiled.cubin, compiled.lowered_name, device, kernel.shared_bytes)


def arguments(params: ctypes.Structure, maps: list) -> ctypes.Array:
    """``Sm90Params``: the Params, then the three maps from the next 64-byte boundary."""
    head = bytes(params)
    head += bytes(-len(head) % 64)
    return ctypes.create_string_buffer(head + b"".join(bytes(m) for m in maps), len(head) + 128 * len(maps))


def forward(q, k, v, *, causal: bool = False, softmax_scale=None, window_size=(-1, -1), softcap: float = 0.0,
            specialised: bool = True):
    """(out, lse) of attention on CuPy arrays (batch, seqlen, heads, 128) through the sm_90a
    kernel, on the current stream; options as ``cuflash.attention``'s."""
    import cupy
    qi, ki, vi = (_arrays.inspect(x, name) for name, x in (("q", q), ("k", k), ("v", v)))
    _options.check_qkv(qi, ki, vi, packed=False)
    options = _options.make_options(qi, ki, causal, softmax_scale, window_size, softcap, None, 0.0, None, 0,
                                    backward=False)
    batch, seqlen_q, heads, _ = qi.shape
    out = cupy.empty(q.shape, q.dtype)
    lse = cupy.empty((batch, heads, seqlen_q), cupy.float32)
    _launch(qi, ki, vi, out, lse, options, None, specialised, (qi.shape, ki.shape, vi.shape), batch, seqlen_q)
    return out, lse


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                   causal: bool = False, softmax_scale=None, window_size=(-1, -1), softcap: float = 0.0,
                   specialised: bool = True):
    """(out, lse) of the varlen call on CuPy arrays (q (total_q, heads, 128), k and v
    (total_k, heads_k, 128), int32 offsets) through the sm_90a kernel: the maps see one
    batch of all rows, each CTA starts at its sequence's first."""
    import cupy
    qi, ki, vi = (_arrays.inspect(x, name) for name, x in (("q", q), ("k", k), ("v", v)))
    _options.check_qkv(qi, ki, vi, packed=True)
    cu_q, cu_k = (_arrays.inspect(x, name) for name, x in (("cu_seqlens_q", cu_seqlens_q),
                                                            ("cu_seqlens_k", cu_seqlens_k)))
    varlen = _options.Varlen(cu_q, cu_k, int(max_seqlen_q), int(max_seqlen_k))
    options = _options.make_options(qi, ki, causal, softmax_scale, window_size, softcap, None, 0.0, None, 0,
                                    backward=False, batch=varlen.batch, seqlen_k=varlen.max_seqlen_k)
    out = cupy.empty(q.shape, q.dtype)
    lse = cupy.empty((q.shape[1], q.shape[0]), cupy.float32)
    shapes = tuple((1, *a.shape) for a in (qi, ki, vi))
    _launch(qi, ki, vi, out, lse, options, varlen, specialised, shapes, varlen.batch, varlen.max_seqlen_q)
    return out, lse


def _launch(qi, ki, vi, out, lse, options, varlen, specialised: bool, shapes: tuple, batch: int,
            seqlen_q: int) -> None:
    """The Params and maps of one call, then the launch on the current stream; ``shapes``:
    q's, k's and v's as the maps see them (batch, seqlen, heads, headdim)."""
    import cupy
    if qi.shape[-1] != _plan.Sm90Forward.head_dim or qi.dtype not in _plan.DTYPES:
        raise ValueError(f"the sm_90a forward takes head dim {_plan.Sm90Forward.head_dim} in float16 or bfloat16, "
                         f"got {qi.shape[-1]} {qi.dtype}")
    params, _ = _plan._params(qi, ki, vi, options, varlen, o=_arrays.inspect(out, "out"))
    params.q.ptr, params.k.ptr, params.v.ptr, params.o.ptr, params.lse = qi.ptr, ki.ptr, vi.ptr, out.data.ptr, \
        lse.data.ptr
    if varlen is not None:
        params.cu_seqlens_q, params.cu_seqlens_k = varlen.cu_seqlens_q.ptr, varlen.cu_seqlens_k.ptr
    kernel = _plan.Sm90Forward(qi.dtype, options.local, options.extras, specialised)
    maps = []
    for a, shape, rows in ((qi, shapes[0], kernel.block_m), (ki, shapes[1], kernel.block_n),
                           (vi, shapes[2], kernel.block_n)):
        strides = a.strides if len(a.strides) == 4 else (shape[1] * a.strides[0], *a.strides)
        maps.append(_tensormap.encode(a.ptr, a.dtype, shape, strides, rows))
    args = arguments(params, maps)
    function = _function(kernel, qi.device)
    launch, _ = _driver.launcher()
    pointers = (ctypes.c_void_p * 1)(ctypes.addressof(args))
    heads = qi.shape[-2]
    if batch and seqlen_q and heads:
        launch(function, -(-seqlen_q // kernel.block_m), heads, batch, kernel.threads, 1, 1, kernel.shared_bytes,
               cupy.cuda.get_current_stream().ptr, ctypes.addressof(pointers), 0)
