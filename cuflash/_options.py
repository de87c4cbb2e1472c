"""The attention's arguments: one immutable ``Options`` value built by one function,
``make_options``, from what a caller passes, and the checks every front end shares
(``cuflash.api`` and through it the CPU path, ``cuflash.torch``, ``cuflash.jax``,
``cuflash.flash_attn_interface``). No other place computes a default scale, normalises a
window or decides what a valid seed is.

Every user error becomes an exception here, before anything runs, naming the argument,
what was expected and what was given.
"""
from __future__ import annotations

import math
import numbers
import os
from typing import NamedTuple

import numpy as np

from . import _arrays, _plan
from ._arrays import ArrayInfo

GPU_DTYPES = ("float16", "bfloat16")
CPU_DTYPES = ("float16", "float32", "float64")


class Options(NamedTuple):
    """What a call asks for, validated. window: (left, right) with -1 = unbounded,
    causal already folded in (right = 0)."""
    causal: bool = False
    scale: float = 1.0
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: ArrayInfo | None = None  # float32 (nheads,) or (batch, nheads)
    dropout_p: float = 0.0
    seed: int = 0
    rng_offset: int = 0

    @property
    def local(self) -> bool:
        return self.window != (-1, -1)

    @property
    def extras(self) -> bool:
        return self.softcap > 0 or self.alibi is not None or self.dropout_p > 0


class Varlen(NamedTuple):
    """Packed sequences: sequence b is rows cu_seqlens[b]:cu_seqlens[b + 1]."""
    cu_seqlens_q: ArrayInfo  # int32 (batch + 1,)
    cu_seqlens_k: ArrayInfo
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1


def default_scale(head_dim: int) -> float:
    """softmax_scale when none is given: 1 / sqrt(headdim)."""
    return 1.0 / math.sqrt(head_dim)


def check_qkv(q, k, v, *, packed: bool) -> None:
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
            check_last_dim_contiguous(name, a)
        if nheads > 65535 or (not packed and q.shape[0] > 65535):
            raise ValueError(f"batch and nheads must be at most 65535 on the GPU, got shape {q.shape}")


def check_last_dim_contiguous(name: str, a: ArrayInfo) -> None:
    if a.strides[-1] != 1 and a.shape[-1] > 1 and math.prod(a.shape):
        raise ValueError(f"{name} must be contiguous in its last dimension (stride 1), got strides {a.strides}")


def check_outputs(arrays: dict, lse_shape) -> None:
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
            check_last_dim_contiguous(name, a)
    lse = arrays["lse"]  # contiguous on every backend: one layout contract, whoever runs it
    if not is_contiguous(lse):
        raise ValueError(f"lse must be contiguous, got strides {lse.strides} for shape {lse.shape}")


def check_dlse(arrays: dict) -> None:
    """dlse, where given, held to lse's contract (lse itself passed check_outputs)."""
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
    if not is_contiguous(dlse):
        raise ValueError(f"dlse must be contiguous, got strides {dlse.strides} for shape {dlse.shape}")


def is_contiguous(a: ArrayInfo) -> bool:
    """Row-major and dense; the stride of a dimension of size 1 never matters."""
    if not math.prod(a.shape):
        return True
    return all(n == 1 or s == c for n, s, c in zip(a.shape, a.strides, _arrays.contiguous_strides(a.shape)))


def check_bool(name: str, value) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r}")


# The kernels compute in float32, the scale in log2 units (scale * log2(e)): beyond
# these bounds a finite Python float becomes inf there and the output NaN.
FLOAT32_MAX = float(np.finfo(np.float32).max)
SCALE_MAX = FLOAT32_MAX / math.log2(math.e)


def check_real(name: str, value, *, low: float, high: float = FLOAT32_MAX, high_open: bool = False) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if not (math.isfinite(value) and value >= low and (value < high if high_open else value <= high)):
        raise ValueError(f"{name} must be finite, >= {low} and {'<' if high_open else '<='} {high:.6g}, got {value!r}")
    return value


def check_integer(name: str, value, bits: int = 64) -> int:
    """An integer in [0, 2**bits): not a bool (True is no seed), not a float."""
    if not isinstance(value, numbers.Integral) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if not 0 <= value < 2**bits:
        raise ValueError(f"{name} must be an integer in [0, 2**{bits}), got {value!r}")
    return int(value)


def make_options(q: ArrayInfo, k: ArrayInfo, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p,
                 seed, rng_offset, *, backward: bool, batch: int | None = None,
                 seqlen_k: int | None = None) -> Options:
    """The Options of a call on q and k (dense, or packed with the batch and max_seqlen_k
    of its ``Varlen``). Without a seed, a forward with dropout draws one."""
    options = scalar_options(q.shape[-1], k.shape[1] if seqlen_k is None else seqlen_k, causal=causal,
                             softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                             dropout_p=dropout_p, seed=seed, rng_offset=rng_offset, backward=backward)
    if seed is None and options.dropout_p > 0:
        options = options._replace(seed=int.from_bytes(os.urandom(8), "little"))
    if alibi_slopes is None:
        return options
    return options._replace(alibi=alibi(alibi_slopes, q, q.shape[0] if batch is None else batch))


def scalar_options(head_dim: int, seqlen_k: int, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                   softcap=0.0, dropout_p=0.0, seed=None, rng_offset=0, backward: bool = False) -> Options:
    """``make_options`` of every argument but the arrays (alibi stays None, and seed 0
    where none is given: ``make_options`` draws one): what the framework front ends
    check before their values become a custom op's or a traced computation's."""
    check_bool("causal", causal)
    scale = default_scale(head_dim) if softmax_scale is None else check_real("softmax_scale", softmax_scale, low=0,
                                                                             high=SCALE_MAX)
    softcap = check_real("softcap", softcap, low=0)
    dropout_p = check_real("dropout_p", dropout_p, low=0, high=1, high_open=True)
    rng_offset = check_integer("rng_offset", rng_offset)
    if seed is None and dropout_p > 0 and backward:
        raise ValueError("seed is required for the backward with dropout_p > 0: pass the forward's seed")
    seed = 0 if seed is None else check_integer("seed", seed)
    return Options(bool(causal), scale, window(window_size, bool(causal), seqlen_k), softcap, None, dropout_p, seed,
                   rng_offset)


def window(window_size, causal: bool, seqlen_k: int) -> tuple[int, int]:
    """flash-attn's normalisation: >= seqlen_k is unbounded (-1); causal is right = 0."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(f"window_size must be a pair (left, right), got {window_size!r}") from None
    for name, w in (("left", left), ("right", right)):
        if not isinstance(w, numbers.Integral) or isinstance(w, (bool, np.bool_)):
            raise TypeError(f"window_size {name} must be an integer >= -1 (-1: unbounded), got {w!r}")
        if w < -1:
            raise ValueError(f"window_size {name} must be an integer >= -1 (-1: unbounded), got {w!r}")
    left, right = (-1 if w >= seqlen_k else int(w) for w in (left, right))
    return (left, 0) if causal else (left, right)


def alibi(alibi_slopes, q: ArrayInfo, batch: int) -> ArrayInfo:
    """alibi_slopes beside q: float32 (nheads,) or (batch, nheads), finite where its
    values can be read."""
    a = _arrays.inspect(alibi_slopes, "alibi_slopes")
    if a.framework != q.framework or a.where != q.where:
        raise TypeError(f"alibi_slopes must be the same kind of array on the same device as q "
                        f"({q.framework} on {q.where}), got {a.framework} on {a.where}")
    check_alibi_layout(a.shape, a.dtype, q.shape[-2], batch)
    if a.strides[-1] != 1 and q.shape[-2] > 1:
        raise ValueError(f"alibi_slopes must be contiguous in its last dimension, got strides {a.strides}")
    check_finite("alibi_slopes", host_values(a))
    return a


def check_alibi_layout(shape: tuple, dtype: str, nheads: int, batch: int) -> None:
    if dtype != "float32":
        raise TypeError(f"alibi_slopes must be float32, got {dtype}")
    if tuple(shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}), got {tuple(shape)}")


def check_finite(name: str, values: np.ndarray | None) -> None:
    """Every value finite (None: not readable here, e.g. traced or under graph capture)."""
    if values is not None and not np.isfinite(values).all():
        flat = np.asarray(values).ravel()
        raise ValueError(f"{name} must be finite, got {flat[~np.isfinite(flat)][:4].tolist()} among its values")


def varlen(q: ArrayInfo, k: ArrayInfo, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> Varlen:
    """Check the packing: int32 offsets from 0, monotone, ending at the totals, and
    maxima no smaller than any length. Reading the offsets costs one small copy."""
    infos = {}
    for name, cu, total, max_len in (("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
                                     ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)):
        a = _arrays.inspect(cu, name)
        if a.framework != q.framework or a.where != q.where:
            raise TypeError(f"{name} must be the same kind of array on the same device as q "
                            f"({q.framework} on {q.where}), got {a.framework} on {a.where}")
        check_cu_seqlens(name, a.shape, a.dtype, None, total, max_len)
        if a.strides[0] != 1 and a.shape[0] > 1:
            raise ValueError(f"{name} must be contiguous, got strides {a.strides}")
        check_cu_seqlens(name, a.shape, a.dtype, to_numpy(a), total, max_len)
        infos[name] = a
    check_batches(infos["cu_seqlens_q"].shape, infos["cu_seqlens_k"].shape)
    return Varlen(infos["cu_seqlens_q"], infos["cu_seqlens_k"], int(max_seqlen_q), int(max_seqlen_k))


def check_cu_seqlens(name: str, shape: tuple, dtype: str, values: np.ndarray | None, total: int, max_len) -> None:
    """One side's offsets (cu_seqlens_q or cu_seqlens_k) and its max_seqlen; the values'
    checks where they can be read (None: traced)."""
    max_name = name.replace("cu_seqlens", "max_seqlen")
    if dtype != "int32":
        raise TypeError(f"{name} must be int32, got {dtype}")
    if len(shape) != 1 or shape[0] < 1:
        raise ValueError(f"{name} must have shape (batch + 1,), got {tuple(shape)}")
    check_integer(max_name, max_len, bits=31)
    if values is None:
        return
    if values[0] != 0 or (np.diff(values) < 0).any():
        raise ValueError(f"{name} must start at 0 and never decrease, got {values.tolist()}")
    if values[-1] != total:
        raise ValueError(f"{name} must end at the number of packed rows {total}, got {int(values[-1])}")
    longest = int(np.diff(values).max(initial=0))
    if max_len < longest:
        raise ValueError(f"{max_name} must be at least the longest sequence, {longest}, got {max_len}")


def check_batches(shape_q: tuple, shape_k: tuple) -> None:
    if tuple(shape_q) != tuple(shape_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one length (batch + 1), got "
                         f"{shape_q[0]} and {shape_k[0]}")


def host_values(a: ArrayInfo) -> np.ndarray | None:
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
    return to_numpy(a)


def to_numpy(a: ArrayInfo) -> np.ndarray:
    if a.framework == "numpy":
        return a.obj
    if a.framework == "torch":
        return a.obj.detach().cpu().numpy()
    if a.framework == "cupy":
        return a.obj.get()
    return np.asarray(a.obj)
