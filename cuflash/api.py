"""The NumPy-like public functions: validate -> plan -> launch."""
from __future__ import annotations

import math
import numbers
import os

import numpy as np

from . import _arrays, _kernels, _plan
from ._kernels import Options, Varlen

GPU_DTYPES = ("float16", "bfloat16")
CPU_DTYPES = ("float16", "float32", "float64")

_OPTIONS_DOC = """
    Options (flash-attn's semantics; scores s = scale q.k, diagonal = seqlen_k - seqlen_q):
    ``causal``: query i sees key j iff j <= i + diagonal (aligned bottom-right).
    ``softmax_scale``: default 1 / sqrt(headdim).
    ``window_size=(left, right)``: keys in [i + diagonal - left, i + diagonal + right];
    -1 (or >= seqlen_k) is unbounded; causal means right = 0.
    ``softcap > 0``: s = softcap * tanh(s / softcap).
    ``alibi_slopes``: float32 (nheads,) or (batch, nheads): s -= slope * |i + diagonal - j|.
    ``dropout_p``: drop normalised probabilities with this probability, scale the kept
    ones by 1 / (1 - p); the mask is a counter-based Philox stream keyed by (``seed``,
    ``rng_offset``, batch, head, row, col) (``cuflash._philox.keep_mask``), so a seed
    reproduces it exactly. Without a seed one is drawn per call (pass one to run the
    backward). LSE is unaffected by dropout.
"""


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, dropout_p=0.0, seed=None, rng_offset=0, return_lse=False):
    """Exact softmax attention, softmax(scale * q k^T) v, as FlashAttention.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim)
    with nheads % nheads_kv == 0 (GQA/MQA: query head h reads KV head
    h // (nheads // nheads_kv)). CUDA arrays (CuPy, PyTorch, JAX; float16 or
    bfloat16) run the tensor-core kernel on the caller's stream and return the same
    kind of array; NumPy arrays run the CPU path. Returns ``out`` (like q) or, with
    ``return_lse``, ``(out, lse)`` where lse is float32 (batch, nheads, seqlen_q),
    the natural log-sum-exp of the modified scores (+inf for a row that sees no key).
    Both are differentiable: ``attention_backward`` takes the gradients of out and lse.
    """
    arrays = _inspect(q=q, k=k, v=v)
    key = _signature(arrays, alibi_slopes, dropout_p, causal, softmax_scale, window_size, softcap, seed, rng_offset)
    options = _validated.get(key)
    if options is None:
        _check_qkv(*arrays.values(), packed=False)
        options = _options(arrays["q"], arrays["k"], causal, softmax_scale, window_size, softcap, alibi_slopes,
                           dropout_p, seed, rng_offset, backward=False)
        _remember(key, options)
    if arrays["q"].device is None:
        from . import cpu
        out, lse = cpu.attention_forward(q, k, v, **_cpu_options(options, alibi_slopes))
    else:
        out, lse = _forward_gpu(*arrays.values(), options, None, return_lse, key)
    return (out, lse) if return_lse else out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                     seed=None, rng_offset=0, return_lse=False):
    """``attention`` over packed sequences of different lengths, with no padding.

    q: (total_q, nheads, headdim), k and v: (total_k, nheads_kv, headdim); sequence b
    is rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b + 1]
    of k and v (int32, shape (batch + 1,), starting at 0; empty sequences allowed);
    max_seqlen_q/k bound the lengths. Every option applies per sequence (causal and
    windows use that sequence's own lengths; ALiBi slopes of shape (batch, nheads)
    and the dropout stream use its index b). lse is float32 (nheads, total_q).
    """
    arrays = _inspect(q=q, k=k, v=v)
    _check_qkv(*arrays.values(), packed=True)
    varlen = _varlen(arrays["q"], arrays["k"], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    options = _options(arrays["q"], arrays["k"], causal, softmax_scale, window_size, softcap, alibi_slopes,
                       dropout_p, seed, rng_offset, backward=False, batch=varlen.batch,
                       seqlen_k=varlen.max_seqlen_k)
    if arrays["q"].device is None:
        from . import cpu
        out, lse = cpu.attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                **_cpu_options(options, alibi_slopes))
    else:
        out, lse = _forward_gpu(*arrays.values(), options, varlen, return_lse)
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                       softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=None, rng_offset=0,
                       deterministic=False, dlse=None):
    """Gradients (dq, dk, dv) of ``attention`` given the upstream gradient ``dout``.

    ``out`` and ``lse`` are what ``attention(..., return_lse=True)`` returned for the
    same arguments (with dropout: the same ``seed`` and ``rng_offset``); P is
    recomputed from ``lse``, never stored. lse is differentiable too: ``dlse``, the
    loss's gradient with respect to lse (float32, lse's shape, contiguous, beside q),
    adds its share (d lse_i / d s_ij = P_ij, the probabilities before dropout); None
    when the loss does not use lse. Rows that see no key (lse +inf) ignore their
    dlse and get zero gradients. With GQA, dk and dv are summed over the
    query heads that share a KV head. dq is accumulated with fp32 atomics, so its
    last bits can differ between runs; ``deterministic=True`` computes it in a pass
    of its own instead (slower), and every gradient is bitwise reproducible. dk and
    dv always are.
    """
    arrays = _inspect(dout=dout, q=q, k=k, v=v, out=out, lse=lse, **({} if dlse is None else {"dlse": dlse}))
    qi, ki, vi = arrays["q"], arrays["k"], arrays["v"]
    key = _signature(arrays, alibi_slopes, dropout_p, causal, softmax_scale, window_size, softcap, seed, rng_offset,
                     deterministic)
    options = _validated.get(key)
    if options is None:
        _check_qkv(qi, ki, vi, packed=False)
        _check_outputs(arrays, (qi.shape[0], qi.shape[2], qi.shape[1]))
        _check_dlse(arrays)
        options = _options(qi, ki, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, seed,
                           rng_offset, backward=True)
        _check_bool("deterministic", deterministic)
        _remember(key, options)
    if qi.device is None:
        from . import cpu
        return cpu.attention_backward(dout, q, k, v, out, lse, dlse=dlse, **_cpu_options(options, alibi_slopes))
    return _backward_gpu(arrays, options, None, deterministic, key)


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                              causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, dropout_p=0.0, seed=None, rng_offset=0, deterministic=False,
                              dlse=None):
    """Gradients (dq, dk, dv) of ``attention_varlen``; see ``attention_backward``
    (``dlse`` is laid out like lse, (nheads, total_q))."""
    arrays = _inspect(dout=dout, q=q, k=k, v=v, out=out, lse=lse, **({} if dlse is None else {"dlse": dlse}))
    qi, ki, vi = arrays["q"], arrays["k"], arrays["v"]
    _check_qkv(qi, ki, vi, packed=True)
    _check_outputs(arrays, (qi.shape[1], qi.shape[0]))
    _check_dlse(arrays)
    varlen = _varlen(qi, ki, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    options = _options(qi, ki, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, seed,
                       rng_offset, backward=True, batch=varlen.batch, seqlen_k=varlen.max_seqlen_k)
    _check_bool("deterministic", deterministic)
    if qi.device is None:
        from . import cpu
        return cpu.attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                             max_seqlen_k, dlse=dlse, **_cpu_options(options, alibi_slopes))
    return _backward_gpu(arrays, options, varlen, deterministic)


for _f in (attention, attention_varlen, attention_backward, attention_varlen_backward):
    _f.__doc__ += _OPTIONS_DOC


# -- GPU ---------------------------------------------------------------------------------

def _forward_gpu(q, k, v, options: Options, varlen: Varlen | None, return_lse: bool, key=None):
    framework = _arrays.Framework(q)
    out = framework.empty(q.shape, q.dtype)
    lse = None
    if return_lse:  # (the kernel skips the LSE's stores otherwise)
        lse = framework.empty((q.shape[0], q.shape[2], q.shape[1]) if varlen is None else (q.shape[1], q.shape[0]),
                              "float32")
    _kernels.forward(q, k, v, out, lse, options, stream=framework.stream, varlen=varlen, key=key)
    return framework.finish(out.obj), None if lse is None else framework.finish(lse.obj)


def _backward_gpu(arrays: dict, options: Options, varlen: Varlen | None, deterministic: bool, key=None):
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    framework = _arrays.Framework(q)
    grads = [framework.empty(a.shape, a.dtype) for a in (q, k, v)]
    work = {name: framework.empty(shape, dtype)
            for name, (shape, dtype) in _kernels.backward_workspace(q.shape, deterministic, options.extras).items()}
    _kernels.backward(arrays["dout"], q, k, v, arrays["out"], arrays["lse"], *grads,
                      work["delta"], options, stream=framework.stream, varlen=varlen, dq_accum=work.get("dq_accum"),
                      dlse=arrays.get("dlse"), key=key)
    return tuple(framework.finish(g.obj) for g in grads)


def _cpu_options(options: Options, alibi_slopes) -> dict:
    return dict(causal=options.causal, softmax_scale=options.scale, window_size=options.window,
                softcap=options.softcap, alibi_slopes=alibi_slopes, dropout_p=options.dropout_p,
                seed=options.seed, rng_offset=options.rng_offset)


# -- validation: every user error becomes an exception here, before anything runs ---------

# Warm calls skip the checks: a signature (every array's kind, device, shape, strides
# and dtype, and every option with its type) that passed once passes again. ALiBi
# and dropout calls are always checked (their arrays and seeds vary).
_validated: dict = {}


def _signature(arrays: dict, alibi_slopes, dropout_p, *scalars):
    if alibi_slopes is not None or dropout_p.__class__ not in (int, float) or dropout_p != 0 \
            or len(_validated) > 4096:
        return None
    # repr tells apart what == would not (True / 1 / 1.0, a list from a tuple). The
    # pointers' 16-byte alignment picks the kernel's copy width.
    return (tuple([(a.framework, a.device, a.shape, a.strides, a.dtype, a.ptr % 16 == 0) for a in arrays.values()]),
            repr((dropout_p, *scalars)))


def _remember(key, options: Options) -> None:
    if key is not None:
        _validated[key] = options



def _inspect(**arrays) -> dict[str, _arrays.ArrayInfo]:
    return {name: _arrays.inspect(x, name) for name, x in arrays.items()}


def _check_qkv(q, k, v, *, packed: bool) -> None:
    ndim = 3 if packed else 4
    layout = "(total, nheads, headdim)" if packed else "(batch, seqlen, nheads, headdim)"
    arrays = {"q": q, "k": k, "v": v}
    for name, a in arrays.items():
        if len(a.shape) != ndim:
            raise ValueError(f"{name} must have {ndim} dimensions {layout}, got shape {a.shape}")
    if len({a.framework for a in arrays.values()}) > 1:
        raise TypeError(f"q, k and v must be the same kind of array, got {q.framework}, {k.framework}, {v.framework}")
    if len({a.where for a in arrays.values()}) > 1:
        raise ValueError(f"q, k and v must be on one device, got {q.where}, {k.where}, {v.where}")
    if len({a.dtype for a in arrays.values()}) > 1:
        raise TypeError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    allowed = GPU_DTYPES if q.device is not None else CPU_DTYPES
    if q.dtype not in allowed:
        hint = "; cast to float16 or bfloat16" if q.device is not None else ""
        raise TypeError(f"dtype must be one of {', '.join(allowed)} on {q.where}, got {q.dtype}{hint}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape {layout}, got {k.shape} and {v.shape}")
    if not packed and k.shape[0] != q.shape[0]:
        raise ValueError(f"k and v must have q's batch size {q.shape[0]}, got {k.shape[0]}")
    head_dim, nheads, nheads_kv = q.shape[-1], q.shape[-2], k.shape[-2]
    if k.shape[-1] != head_dim:
        raise ValueError(f"k and v must have q's head dim {head_dim}, got {k.shape[-1]}")
    if not 1 <= head_dim <= _plan.MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in 1..{_plan.MAX_HEAD_DIM}, got {head_dim}")
    if nheads_kv == 0 or nheads % nheads_kv:
        raise ValueError(f"q's nheads must be a multiple of k/v's nheads, got {nheads} and {nheads_kv}")
    if q.device is not None:
        for name, a in arrays.items():
            _check_last_dim_contiguous(name, a)
        if nheads > 65535 or (not packed and q.shape[0] > 65535):
            raise ValueError(f"batch and nheads must be at most 65535 on the GPU, got shape {q.shape}")


def _check_last_dim_contiguous(name: str, a: _arrays.ArrayInfo) -> None:
    if a.strides[-1] != 1 and a.shape[-1] > 1 and math.prod(a.shape):
        raise ValueError(f"{name} must be contiguous in its last dimension (stride 1), got strides {a.strides}")


def _check_outputs(arrays: dict, lse_shape) -> None:
    """dout and out shaped and typed like q, lse float32 and contiguous, all beside q."""
    q = arrays["q"]
    for name, shape, dtype in (("dout", q.shape, q.dtype), ("out", q.shape, q.dtype), ("lse", lse_shape, "float32")):
        a = arrays[name]
        if a.framework != q.framework or a.where != q.where:
            raise TypeError(f"{name} must be the same kind of array on the same device as q "
                            f"({q.framework} on {q.where}), got {a.framework} on {a.where}")
        if a.shape != tuple(shape):
            raise ValueError(f"{name} must have shape {tuple(shape)}, got {a.shape}")
        if a.dtype != dtype:
            raise TypeError(f"{name} must have dtype {dtype}, got {a.dtype}")
        if q.device is not None and name != "lse":
            _check_last_dim_contiguous(name, a)
    lse = arrays["lse"]  # contiguous on every backend: one layout contract, whoever runs it
    if not _is_contiguous(lse):
        raise ValueError(f"lse must be contiguous, got strides {lse.strides} for shape {lse.shape}")


def _check_dlse(arrays: dict) -> None:
    """dlse, where given, held to lse's contract (lse itself passed _check_outputs)."""
    dlse, lse, q = arrays.get("dlse"), arrays["lse"], arrays["q"]
    if dlse is None:
        return
    if dlse.framework != q.framework or dlse.where != q.where:
        raise TypeError(f"dlse must be the same kind of array on the same device as q "
                        f"({q.framework} on {q.where}), got {dlse.framework} on {dlse.where}")
    if dlse.shape != lse.shape:
        raise ValueError(f"dlse must have lse's shape {lse.shape}, got {dlse.shape}")
    if dlse.dtype != "float32":
        raise TypeError(f"dlse must have dtype float32, got {dlse.dtype}")
    if not _is_contiguous(dlse):
        raise ValueError(f"dlse must be contiguous, got strides {dlse.strides} for shape {dlse.shape}")


def _is_contiguous(a: _arrays.ArrayInfo) -> bool:
    """Row-major and dense; the stride of a dimension of size 1 never matters."""
    if not math.prod(a.shape):
        return True
    return all(n == 1 or s == c for n, s, c in zip(a.shape, a.strides, _arrays.contiguous_strides(a.shape)))


def _check_bool(name: str, value) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r}")


# The kernels compute in float32, the scale in log2 units (scale * log2(e)): beyond
# these bounds a finite Python float becomes inf there and the output NaN.
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_SCALE_MAX = _FLOAT32_MAX / math.log2(math.e)


def _check_real(name: str, value, *, low: float, high: float = _FLOAT32_MAX, high_open: bool = False) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if not (math.isfinite(value) and value >= low and (value < high if high_open else value <= high)):
        raise ValueError(f"{name} must be finite, >= {low} and {'<' if high_open else '<='} {high:.6g}, got {value!r}")
    return value


def _check_integer(name: str, value, high: int) -> int:
    """An integer in [0, high): not a bool (True is no seed), not a float."""
    if not isinstance(value, numbers.Integral) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if not 0 <= value < high:
        raise ValueError(f"{name} must be an integer in [0, 2**64), got {value!r}")
    return int(value)


def _options(q, k, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, seed, rng_offset, *,
             backward: bool, batch: int | None = None, seqlen_k: int | None = None) -> Options:
    _check_bool("causal", causal)
    scale = (1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None
             else _check_real("softmax_scale", softmax_scale, low=0, high=_SCALE_MAX))
    window = _window(window_size, bool(causal), k.shape[1] if seqlen_k is None else seqlen_k)
    softcap = _check_real("softcap", softcap, low=0)
    dropout_p = _check_real("dropout_p", dropout_p, low=0, high=1, high_open=True)
    alibi = None if alibi_slopes is None else _alibi(alibi_slopes, q, q.shape[0] if batch is None else batch)
    rng_offset = _check_integer("rng_offset", rng_offset, 2**64)
    if seed is None:
        if dropout_p > 0 and backward:
            raise ValueError("seed is required for the backward with dropout_p > 0: pass the forward's seed")
        seed = int.from_bytes(os.urandom(8), "little") if dropout_p > 0 else 0
    seed = _check_integer("seed", seed, 2**64)
    return Options(bool(causal), scale, window, softcap, alibi, dropout_p, seed, rng_offset)


def _window(window_size, causal: bool, seqlen_k: int) -> tuple[int, int]:
    """flash-attn's normalisation: >= seqlen_k is unbounded (-1); causal is right = 0."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(f"window_size must be a pair (left, right), got {window_size!r}") from None
    for name, w in (("left", left), ("right", right)):
        if not isinstance(w, numbers.Integral) or isinstance(w, bool) or w < -1:
            raise ValueError(f"window_size {name} must be an integer >= -1 (-1: unbounded), got {w!r}")
    left, right = (-1 if w >= seqlen_k else int(w) for w in (left, right))
    return (left, 0) if causal else (left, right)


def _alibi(alibi_slopes, q: _arrays.ArrayInfo, batch: int) -> _arrays.ArrayInfo:
    a = _arrays.inspect(alibi_slopes, "alibi_slopes")
    nheads = q.shape[-2]
    if a.framework != q.framework or a.where != q.where:
        raise TypeError(f"alibi_slopes must be the same kind of array on the same device as q "
                        f"({q.framework} on {q.where}), got {a.framework} on {a.where}")
    if a.dtype != "float32":
        raise TypeError(f"alibi_slopes must be float32, got {a.dtype}")
    if a.shape not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}), got {a.shape}")
    if a.strides[-1] != 1 and nheads > 1:
        raise ValueError(f"alibi_slopes must be contiguous in its last dimension, got strides {a.strides}")
    values = _host_values(a)
    if values is not None and not np.isfinite(values).all():
        raise ValueError(f"alibi_slopes must be finite, got {values.ravel()[~np.isfinite(values.ravel())][:4].tolist()}"
                         f" among its values")
    return a


def _varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> Varlen:
    """Check the packing: int32 offsets from 0, monotone, ending at the totals, and
    maxima no smaller than any length. Reading the offsets costs one small copy."""
    infos = {}
    lengths = {}
    for name, cu, total, max_name, max_len in (("cu_seqlens_q", cu_seqlens_q, q.shape[0], "max_seqlen_q", max_seqlen_q),
                                                ("cu_seqlens_k", cu_seqlens_k, k.shape[0], "max_seqlen_k", max_seqlen_k)):
        a = _arrays.inspect(cu, name)
        if a.framework != q.framework or a.where != q.where:
            raise TypeError(f"{name} must be the same kind of array on the same device as q "
                            f"({q.framework} on {q.where}), got {a.framework} on {a.where}")
        if a.dtype != "int32":
            raise TypeError(f"{name} must be int32, got {a.dtype}")
        if len(a.shape) != 1 or a.shape[0] < 1:
            raise ValueError(f"{name} must have shape (batch + 1,), got {a.shape}")
        if a.strides[0] != 1 and a.shape[0] > 1:
            raise ValueError(f"{name} must be contiguous, got strides {a.strides}")
        values = _to_numpy(a)
        if values[0] != 0 or (np.diff(values) < 0).any():
            raise ValueError(f"{name} must start at 0 and never decrease, got {values.tolist()}")
        if values[-1] != total:
            raise ValueError(f"{name} must end at the number of packed rows {total}, got {int(values[-1])}")
        if not isinstance(max_len, numbers.Integral) or isinstance(max_len, bool):
            raise TypeError(f"{max_name} must be an integer, got {max_len!r}")
        longest = int(np.diff(values).max(initial=0))
        if max_len < longest:
            raise ValueError(f"{max_name} must be at least the longest sequence, {longest}, got {max_len}")
        infos[name], lengths[name] = a, int(max_len)
    if infos["cu_seqlens_q"].shape != infos["cu_seqlens_k"].shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one length (batch + 1), got "
                         f"{infos['cu_seqlens_q'].shape[0]} and {infos['cu_seqlens_k'].shape[0]}")
    return Varlen(infos["cu_seqlens_q"], infos["cu_seqlens_k"], lengths["cu_seqlens_q"], lengths["cu_seqlens_k"])


def _host_values(a: _arrays.ArrayInfo) -> np.ndarray | None:
    """A small array's values for a check, or None where reading them would break a
    CUDA-graph capture (the values then go to the kernel unchecked)."""
    if a.framework == "torch" and a.device is not None:
        import torch
        if torch.cuda.is_current_stream_capturing():
            return None
    if a.framework == "cupy":
        import cupy
        if cupy.cuda.get_current_stream().is_capturing():
            return None
    return _to_numpy(a)


def _to_numpy(a: _arrays.ArrayInfo) -> np.ndarray:
    if a.framework == "numpy":
        return a.obj
    if a.framework == "torch":
        return a.obj.detach().cpu().numpy()
    if a.framework == "cupy":
        return a.obj.get()
    return np.asarray(a.obj)
