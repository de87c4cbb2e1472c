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
    infos = {name: _arrays.inspect(x, name) for name, x in (("q", q), ("k", k), ("v", v))}
    qi, ki, vi = infos["q"], infos["k"], infos["v"]
    _options.check_qkv(qi, ki, vi, packed=False)
    if qi.shape[-1] != _plan.Sm90Forward.head_dim or qi.dtype not in _plan.DTYPES:
        raise ValueError(f"the sm_90a forward takes head dim {_plan.Sm90Forward.head_dim} in float16 or bfloat16, "
                         f"got {qi.shape[-1]} {qi.dtype}")
    options = _options.make_options(qi, ki, causal, softmax_scale, window_size, softcap, None, 0.0, None, 0,
                                    backward=False)
    batch, seqlen_q, heads, _ = qi.shape
    out = cupy.empty(q.shape, q.dtype)
    lse = cupy.empty((batch, heads, seqlen_q), cupy.float32)
    params, _ = _plan._params(qi, ki, vi, options, None, o=_arrays.inspect(out, "out"))
    params.q.ptr, params.k.ptr, params.v.ptr, params.o.ptr, params.lse = q.data.ptr, k.data.ptr, v.data.ptr, \
        out.data.ptr, lse.data.ptr
    kernel = _plan.Sm90Forward(qi.dtype, options.local, options.extras, specialised)
    maps = [_tensormap.encode(a.ptr, a.dtype, a.shape, a.strides, rows)
            for a, rows in ((qi, kernel.block_m), (ki, kernel.block_n), (vi, kernel.block_n))]
    args = arguments(params, maps)
    function = _function(kernel, qi.device)
    launch, _ = _driver.launcher()
    pointers = (ctypes.c_void_p * 1)(ctypes.addressof(args))
    if batch and seqlen_q and heads:
        launch(function, -(-seqlen_q // kernel.block_m), heads, batch, kernel.threads, 1, 1, kernel.shared_bytes,
               cupy.cuda.get_current_stream().ptr, ctypes.addressof(pointers), 0)
    return out, lse
