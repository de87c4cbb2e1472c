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
import re
from typing import NamedTuple

import numpy as np

from . import _arrays
from ._arrays import ArrayInfo

GPU_DTYPES = ("float16", "bfloat16")
CPU_DTYPES = ("float16", "float32", "float64")
# The largest head dim the kernels take: the planner's last head-dim bucket (the checks come
# before the planner and import none of it; tests/test_plan.py holds the two equal).
MAX_HEAD_DIM = 256


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
    mods: DeviceMods | None = None  # score_mod / mask_mod on CUDA arrays

    @property
    def local(self) -> bool:
        return self.window != (-1, -1)

    @property
    def extras(self) -> bool:
        """Softcap, ALiBi, dropout or mods: the kernels' instances with extras."""
        return self.softcap > 0 or self.alibi is not None or self.dropout_p > 0 or self.mods is not None


class DeviceMods(NamedTuple):
    """score_mod and mask_mod of a call on CUDA arrays: the CUDA text the kernels compile
    with (``cuflash.mod.kernel_source``), the mod tensors, in order, and the statuses of the
    call's block mask (``cuflash.mod.BlockMask``), or None."""
    source: str
    tensors: tuple[ArrayInfo, ...]
    blocks: ArrayInfo | None = None

    @property
    def mask_only(self) -> bool:
        """mask_mod without score_mod: the scores stay as they are, hidden ones -inf."""
        return "kScore = false" in self.source  # (cuflash.mod.kernel_source's struct)

    @property
    def reads_tensors(self) -> bool:
        """Does a mod load elements of its tensors (their registers count: sm90 tiles)?"""
        return re.search(r"\bt\d+\[", self.source) is not None  # (cuflash.mod.to_cuda's loads: t0[offset])


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


def check_qkv(q, k, v, *, packed: bool, names: tuple[str, str, str] = ("q", "k", "v"),
              same_batch: bool = True) -> None:
    ndim = 3 if packed else 4
    layout = "(total, nheads, headdim)" if packed else "(batch, seqlen, nheads, headdim)"
    arrays = dict(zip(names, (q, k, v)))
    together = f"{names[0]}, {names[1]} and {names[2]}"
    for name, a in arrays.items():
        if len(a.shape) != ndim:
            raise ValueError(f"{name} must have {ndim} dimensions {layout}, got shape {a.shape}")
    if len({a.framework for a in arrays.values()}) > 1:
        raise TypeError(f"{together} must be the same kind of array, got {q.framework}, {k.framework}, {v.framework}")
    if len({a.device for a in arrays.values()}) > 1:
        raise ValueError(f"{together} must be on one device, got {q.where}, {k.where}, {v.where}")
    if len({a.dtype for a in arrays.values()}) > 1:
        raise TypeError(f"{together} must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    allowed = GPU_DTYPES if q.device is not None else CPU_DTYPES
    if q.dtype not in allowed:
        hint = "; cast to float16 or bfloat16" if q.device is not None else ""
        raise TypeError(f"dtype must be one of {', '.join(allowed)} on {q.where}, got {q.dtype}{hint}")
    kv = f"{names[1]} and {names[2]}"
    if k.shape != v.shape:
        raise ValueError(f"{kv} must have one shape {layout}, got {k.shape} and {v.shape}")
    if same_batch and not packed and k.shape[0] != q.shape[0]:
        raise ValueError(f"{kv} must have q's batch size {q.shape[0]}, got {k.shape[0]}")
    head_dim, nheads, nheads_kv = q.shape[-1], q.shape[-2], k.shape[-2]
    if k.shape[-1] != head_dim:
        raise ValueError(f"{kv} must have q's head dim {head_dim}, got {k.shape[-1]}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in 1..{MAX_HEAD_DIM}, got {head_dim}")
    if nheads_kv == 0 or nheads % nheads_kv:
        raise ValueError(f"q's nheads must be a multiple of {names[1]}/{names[2]}'s nheads, "
                         f"got {nheads} and {nheads_kv}")
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
        if a.framework != q.framework or a.device != q.device:
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
    if dlse.framework != q.framework or dlse.device != q.device:
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


def has_mods(score_mod, mask_mod, mod_tensors) -> bool:
    """Whether a call asks for programmable attention (cuflash.mod)."""
    return score_mod is not None or mask_mod is not None or not (isinstance(mod_tensors, (tuple, list))
                                                                  and not mod_tensors)


def check_mods(q: ArrayInfo, score_mod, mask_mod, mod_tensors) -> None:
    """score_mod and mask_mod functions (or None) with a tuple of mod tensors. Their tracing
    (cuflash.mod.trace on the NumPy path, ``device_mods`` on CUDA arrays) checks the
    functions themselves and each tensor, naming the function."""
    for name, fn, signature in (("score_mod", score_mod, "(score, b, h, q_idx, kv_idx, *mod_tensors) -> score"),
                                ("mask_mod", mask_mod, "(b, h, q_idx, kv_idx, *mod_tensors) -> bool")):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be a function {signature}, or None, got {fn!r}")
    if not isinstance(mod_tensors, (tuple, list)):
        raise TypeError(f"mod_tensors must be a tuple of arrays (the extra arguments of score_mod and mask_mod), "
                        f"got {type(mod_tensors).__name__}")
    if score_mod is None and mask_mod is None:
        raise ValueError("mod_tensors are the extra arguments of score_mod and mask_mod: pass one of them too")


def block_mask_mods(block_mask, mask_mod, mod_tensors) -> tuple:
    """(mask_mod, mod_tensors) of a call with ``block_mask``, which carries both: the call
    may pass its mask_mod (the same function) and its mod_tensors (the same arrays), or leave
    them out."""
    from .mod import BlockMask
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a cuflash.mod.BlockMask (cuflash.mod.create_block_mask), got "
                        f"{type(block_mask).__name__}")
    if mask_mod is not None and mask_mod is not block_mask.mask_mod:
        raise ValueError(f"mask_mod must be block_mask's own ({block_mask.tree.name}), or None: block_mask carries "
                         f"it; got another function")
    if not isinstance(mod_tensors, (tuple, list)):
        raise TypeError(f"mod_tensors must be a tuple of arrays, got {type(mod_tensors).__name__}")
    if mod_tensors and (len(mod_tensors) != len(block_mask.mod_tensors)
                        or any(a is not b for a, b in zip(mod_tensors, block_mask.mod_tensors))):
        raise ValueError(f"mod_tensors must be block_mask's own {len(block_mask.mod_tensors)} arrays (the same "
                         f"objects), or (): block_mask carries them")
    return block_mask.mask_mod, block_mask.mod_tensors


def check_block_mask(block_mask, q: ArrayInfo, *, batch: int, seqlen_q: int, seqlen_k: int,
                     statuses: ArrayInfo | None = None) -> ArrayInfo:
    """A block mask made for this dense call's shapes, its statuses beside q: returns them
    described (``statuses``: as a front end describes them, where it has)."""
    nheads = q.shape[-2]
    for name, made, given in (("batch", block_mask.batch, batch), ("heads", block_mask.heads, nheads),
                              ("seqlen_q", block_mask.seqlen_q, seqlen_q), ("seqlen_k", block_mask.seqlen_k, seqlen_k)):
        if made is not None and made != given:
            raise ValueError(f"block_mask was made for {name} {made}, this call has {given} "
                             f"(block_mask {block_mask.shape}: batch {block_mask.batch}, heads {block_mask.heads}, "
                             f"seqlen_q {block_mask.seqlen_q}, seqlen_k {block_mask.seqlen_k})")
    if statuses is None:
        statuses = block_mask.statuses
    if not isinstance(statuses, ArrayInfo):
        statuses = _arrays.inspect(statuses, "block_mask")
    if statuses.framework != q.framework or statuses.where != q.where:
        raise TypeError(f"block_mask's statuses must be the same kind of array on the same device as q "
                        f"({q.framework} on {q.where}), got {statuses.framework} on {statuses.where}: make it "
                        f"with create_block_mask(..., like=q)")
    blocks = (-(-seqlen_q // 128), -(-seqlen_k // 128))
    if statuses.dtype != "int8" or len(statuses.shape) != 4 or statuses.shape[2:] != blocks \
            or statuses.shape[0] not in (1, batch) or statuses.shape[1] not in (1, nheads) \
            or (math.prod(statuses.shape) and statuses.strides[-1] != 1):
        raise ValueError(f"block_mask's statuses must be int8 (1 or batch {batch}, 1 or heads {nheads}, "
                         f"{blocks[0]}, {blocks[1]}) with contiguous rows, got {statuses.dtype} {statuses.shape}")
    return statuses


def device_mods(q: ArrayInfo, score_mod, mask_mod, mod_tensors, *, batch: int, seqlen_q: int,
                seqlen_k: int, blocks: ArrayInfo | None = None) -> DeviceMods:
    """The mods of a call on CUDA arrays (``check_mods`` passed): each mod tensor is an
    array of q's kind on q's device, of a dtype and rank the kernels take; the functions
    are traced over the tensors' shapes and dtypes, and their indices checked over the
    call's positions (``cuflash.mod.index_ranges``: the NumPy path's IndexError, up front).
    ``blocks``: the statuses of the call's block mask (``check_block_mask``), or None."""
    from . import mod
    from ._params import MAX_MOD_DIMS, MAX_MOD_TENSORS
    if len(mod_tensors) > MAX_MOD_TENSORS:
        raise ValueError(f"mod_tensors: the CUDA kernels take at most {MAX_MOD_TENSORS} mod tensors, got "
                         f"{len(mod_tensors)}")
    infos = []
    for i, t in enumerate(mod_tensors):
        name = f"mod_tensors[{i}]"
        a = t if isinstance(t, ArrayInfo) else _arrays.inspect(t, name)
        check_beside(name, a, q)
        if a.dtype not in mod.TENSOR_DTYPES:
            raise TypeError(f"{name} must have a dtype among {', '.join(mod.TENSOR_DTYPES)}, got {a.dtype}")
        if len(a.shape) > MAX_MOD_DIMS:
            raise ValueError(f"{name} must have at most {MAX_MOD_DIMS} dimensions on the GPU, got shape {a.shape}")
        if not all(0 < n < 2**31 for n in a.shape):
            raise ValueError(f"{name} must have sizes in [1, 2**31) on the GPU, got shape {a.shape}")
        infos.append(a)
    specs = tuple(mod.TensorSpec(i, None, a.shape, a.dtype) for i, a in enumerate(infos))
    score = None if score_mod is None else mod.trace(score_mod, "score", specs)
    mask = None if mask_mod is None else mod.trace(mask_mod, "mask", specs)
    if batch and q.shape[-2] and seqlen_q and seqlen_k:
        domain = {"b": (0, batch - 1), "h": (0, q.shape[-2] - 1), "q_idx": (0, seqlen_q - 1),
                  "kv_idx": (0, seqlen_k - 1)}
        for tree in (score, mask):
            if tree is not None:
                mod.index_ranges(tree, domain)
    return DeviceMods(mod.kernel_source(score, mask, blocks is not None), tuple(infos), blocks)


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


# Ring attention's shard layouts: shard i holds rows [i L, (i + 1) L) of the sequence, or
# chunks i and 2n - 1 - i of its 2n chunks (zigzag: every shard's causal work equal).
RING_LAYOUTS = ("contiguous", "zigzag")


class RingBlock(NamedTuple):
    """What a ring step computes: the local query rows against these key rows of the block
    held, causal or not."""
    queries: slice
    keys: slice
    causal: bool


RING_ALL = slice(None)  # every row


def check_ring_shard(q, k, v, causal, softmax_scale, layout, return_lse, holder: str) -> float:
    """Ring attention's arguments (q, k, v: ArrayInfo of one shard, (batch, seqlen_local,
    heads, headdim)), for cuflash.torch's and cuflash.jax's rings; returns the softmax
    scale. ``holder`` names a shard's owner in messages ("rank", "device")."""
    if layout not in RING_LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, RING_LAYOUTS))}, got {layout!r}")
    check_bool("return_lse", return_lse)
    check_qkv(q, k, v, packed=False)
    seqlen = q.shape[1]
    if k.shape[1] != seqlen:
        raise ValueError(f"k and v must hold as many tokens as q (one shard of one sequence), got seqlen_local "
                         f"{k.shape[1]} and {seqlen}")
    if seqlen == 0:
        raise ValueError(f"seqlen_local must be positive, got shape {tuple(q.shape)}")
    if layout == "zigzag" and seqlen % 2:
        raise ValueError(f"seqlen_local must be even with layout='zigzag' (two equal chunks a {holder}), "
                         f"got seqlen_local {seqlen}")
    return scalar_options(q.shape[-1], seqlen, causal=causal, softmax_scale=softmax_scale).scale


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
    if a.framework != q.framework or a.device != q.device:
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
        if a.framework != q.framework or a.device != q.device:
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
    CUDA-graph capture, or where they do not exist yet (a JAX tracer): the values then go
    to the kernel unchecked."""
    if a.framework == "torch" and a.device is not None:
        import torch
        if torch.cuda.is_current_stream_capturing():
            return None
    if a.framework == "cupy":
        import cupy
        if cupy.cuda.get_current_stream().is_capturing():
            return None
    if a.framework == "jax":
        import jax
        if isinstance(a.obj, jax.core.Tracer):  # traced: no values yet
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


# -- the KV-cache call -----------------------------------------------------------------------

class KVCache(NamedTuple):
    """The cache arguments of an ``attention_with_kvcache`` call, validated. ``lengths``:
    cache_seqlens' values where they can be read (None under CUDA-graph capture)."""
    cache_seqlens: ArrayInfo | int
    lengths: np.ndarray | None
    batch_idx: ArrayInfo | None
    leftpad: ArrayInfo | None
    block_table: ArrayInfo | None
    page_size: int  # rows of a page; 0: contiguous caches
    capacity: int  # the rows a sequence's cache holds
    seqlen_new: int
    rotary_cos: ArrayInfo | None
    rotary_sin: ArrayInfo | None
    rotary_interleaved: bool
    num_splits: int
    deterministic: bool = False  # parts fixed by each sequence's keys (_plan.decode)


def kvcache(arrays: dict, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, rotary_cos, rotary_sin,
            rotary_interleaved, causal, window_size, num_splits, deterministic=False) -> KVCache:
    """Check a KV-cache call's arrays (``arrays``: q, k_cache, v_cache and, when given, k and
    v, described) and cache arguments; the values of the small integer arrays where they
    can be read: every position, page and cache row in range before anything runs."""
    q, k_cache, v_cache = arrays["q"], arrays["k_cache"], arrays["v_cache"]
    check_qkv(q, k_cache, v_cache, packed=False, names=("q", "k_cache", "v_cache"), same_batch=False)
    batch, seqlen_q, _, head_dim = q.shape
    nheads_k = k_cache.shape[2]
    k, v = arrays.get("k"), arrays.get("v")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new keys and values to append), or neither")
    seqlen_new = 0
    if k is not None:
        for name, a in (("k", k), ("v", v)):
            check_beside(name, a, q)
            if a.shape[:1] + a.shape[2:] != (batch, nheads_k, head_dim):
                raise ValueError(f"{name} must have shape (batch {batch}, seqlen_new, nheads_k {nheads_k}, "
                                 f"headdim {head_dim}), got {a.shape}")
            if a.dtype != q.dtype:
                raise TypeError(f"{name} must have q's dtype {q.dtype}, got {a.dtype}")
            if q.device is not None:
                check_last_dim_contiguous(name, a)
        if k.shape != v.shape:
            raise ValueError(f"k and v must have one shape, got {k.shape} and {v.shape}")
        seqlen_new = k.shape[1]
    table = _int32_array("block_table", block_table, q, ndim=2)
    batch_idx = _int32_array("cache_batch_idx", cache_batch_idx, q, ndim=1)
    leftpad = _int32_array("cache_leftpad", cache_leftpad, q, ndim=1)
    for name, a in (("cache_batch_idx", batch_idx), ("cache_leftpad", leftpad)):
        if a is not None and a.shape != (batch,):
            raise ValueError(f"{name} must have shape (batch {batch},), got {a.shape}")
    if table is not None:
        if table.shape[0] != batch or table.shape[1] < 1:
            raise ValueError(f"block_table must have shape (batch {batch}, max_blocks >= 1), got {table.shape}")
        if batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table: the table's rows pick the pages")
        page_size, capacity = k_cache.shape[1], table.shape[1] * k_cache.shape[1]
    else:
        page_size, capacity = 0, k_cache.shape[1]
        if batch_idx is None and k_cache.shape[0] != batch:
            raise ValueError(f"k_cache and v_cache must hold one cache per sequence, batch {batch}, or "
                             f"cache_batch_idx must pick them; got {k_cache.shape[0]} caches")
    lengths, seqlens = _cache_seqlens(cache_seqlens, q)
    check_bool("causal", causal)
    # Rotary positions follow the mask: q rotates row by row under causal or a window.
    local = window(window_size, bool(causal), capacity) != (-1, -1)
    if not isinstance(num_splits, numbers.Integral) or isinstance(num_splits, (bool, np.bool_)) or \
            not 0 <= num_splits < 2**16:
        raise TypeError(f"num_splits must be an integer in [0, 65536) (0: chosen for the shapes), got {num_splits!r}")
    check_bool("rotary_interleaved", rotary_interleaved)
    check_bool("deterministic", deterministic)
    cos, sin = _rotary(rotary_cos, rotary_sin, q, k)
    if lengths is None and isinstance(seqlens, ArrayInfo):
        lengths = _values_on_host(seqlens)
    if table is not None:
        check_table_capacity(seqlens if lengths is None else lengths, seqlen_new, table.shape[1], page_size)
    _check_positions(lengths, seqlen_new, seqlen_q, capacity, local, cos, page_size, table, k_cache.shape[0],
                     batch_idx, leftpad)
    return KVCache(seqlens, lengths, batch_idx, leftpad, table, page_size, capacity, seqlen_new, cos, sin,
                   bool(rotary_interleaved), int(num_splits), bool(deterministic))


def paged_varlen(q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 block_table) -> tuple[Varlen, KVCache]:
    """Check the varlen call over a paged cache: q packed (total_q, nheads, d), k and v page
    pools (num_pages, page_size, nheads_k, d) with ``block_table`` (batch, max_blocks), and
    sequence b's keys the first cu_seqlens_k[b + 1] - cu_seqlens_k[b] rows of its pages. The
    offsets are read (as every varlen call reads them) where they can be."""
    if len(q.shape) != 3:
        raise ValueError(f"q must be packed (total_q, nheads, headdim), got shape {q.shape}")
    if len(k.shape) != 4:
        raise ValueError(f"k must be a page pool (num_pages, page_size, nheads_k, headdim) with block_table, "
                         f"got shape {k.shape}")
    # (q as a batch of one sequence, so that the dense checks apply: kinds, devices, dtypes,
    # head dims, GQA, the last dimension contiguous)
    check_qkv(_arrays.ArrayInfo(q.obj, q.framework, q.ptr, (1, *q.shape), (0, *q.strides), q.dtype, q.device), k, v,
              packed=False, names=("q", "k", "v"), same_batch=False)
    table = _int32_array("block_table", block_table, q, ndim=2)
    infos = {}
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        infos[name] = _int32_array(name, cu, q, ndim=1)
    values_q, values_k = (host_values(infos[name]) for name in ("cu_seqlens_q", "cu_seqlens_k"))
    check_cu_seqlens("cu_seqlens_q", infos["cu_seqlens_q"].shape, "int32", values_q, q.shape[0], max_seqlen_q)
    check_cu_seqlens("cu_seqlens_k", infos["cu_seqlens_k"].shape, "int32", values_k,
                     None if values_k is None else int(values_k[-1]), max_seqlen_k)
    check_batches(infos["cu_seqlens_q"].shape, infos["cu_seqlens_k"].shape)
    batch = infos["cu_seqlens_q"].shape[0] - 1
    if table.shape[0] != batch or table.shape[1] < 1:
        raise ValueError(f"block_table must have shape (batch {batch}, max_blocks >= 1), got {table.shape}")
    page_size, capacity = k.shape[1], table.shape[1] * k.shape[1]
    lengths = None if values_k is None else np.diff(values_k)
    if lengths is not None and (lengths > capacity).any():
        b = int(np.argmax(lengths > capacity))
        raise ValueError(f"block_table holds {capacity} rows a sequence (max_blocks * page_size), but sequence {b} "
                         f"has {int(lengths[b])} keys (cu_seqlens_k)")
    _check_positions(lengths, 0, 0, capacity, False, None, page_size, table, k.shape[0], None, None)
    varlen = Varlen(infos["cu_seqlens_q"], infos["cu_seqlens_k"], int(max_seqlen_q), int(max_seqlen_k))
    return varlen, KVCache(0, lengths, None, None, table, page_size, capacity, 0, None, None, True, 0)


def check_beside(name: str, a: ArrayInfo, q: ArrayInfo) -> None:
    """``a`` is the same kind of array as q, on q's device."""
    if a.framework != q.framework or a.device != q.device:
        raise TypeError(f"{name} must be the same kind of array on the same device as q "
                        f"({q.framework} on {q.where}), got {a.framework} on {a.where}")


def _int32_array(name: str, x, q: ArrayInfo, *, ndim: int) -> ArrayInfo | None:
    if x is None:
        return None
    a = x if isinstance(x, ArrayInfo) else _arrays.inspect(x, name)  # (front ends may describe their own)
    check_beside(name, a, q)
    if a.dtype != "int32":
        raise TypeError(f"{name} must be int32, got {a.dtype}")
    if len(a.shape) != ndim:
        raise ValueError(f"{name} must have {ndim} dimension{'s' * (ndim > 1)}, got shape {a.shape}")
    if not is_contiguous(a):
        raise ValueError(f"{name} must be contiguous, got strides {a.strides} for shape {a.shape}")
    return a


def _cache_seqlens(cache_seqlens, q: ArrayInfo) -> tuple[np.ndarray | None, ArrayInfo | int]:
    """(lengths on the host or None, the argument as the kernels take it)."""
    batch = q.shape[0]
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, (bool, np.bool_)):
        if not 0 <= cache_seqlens < 2**31:
            raise ValueError(f"cache_seqlens must be in [0, 2**31), got {cache_seqlens}")
        return np.full(batch, int(cache_seqlens), dtype=np.int32), int(cache_seqlens)
    if cache_seqlens is None or isinstance(cache_seqlens, (bool, np.bool_, numbers.Number)):
        raise TypeError(f"cache_seqlens must be an int or an int32 array of shape (batch {batch},), "
                        f"got {cache_seqlens!r}")
    a = _int32_array("cache_seqlens", cache_seqlens, q, ndim=1)  # int64 read as int32 would be wrong lengths
    if a.shape != (batch,):
        raise ValueError(f"cache_seqlens must have shape (batch {batch},), got {a.shape}")
    return None, a


def _rotary(rotary_cos, rotary_sin, q: ArrayInfo, k: ArrayInfo | None):
    if rotary_cos is None and rotary_sin is None:
        return None, None
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together, or neither")
    if k is None:
        raise ValueError("rotary_cos and rotary_sin rotate the new keys on their way into the cache: "
                         "pass k and v too")
    cos, sin = (x if isinstance(x, ArrayInfo) else _arrays.inspect(x, name)
                for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)))
    for name, a in (("rotary_cos", cos), ("rotary_sin", sin)):
        check_beside(name, a, q)
        if a.dtype not in (q.dtype, "float32"):
            raise TypeError(f"{name} must have q's dtype {q.dtype} or float32, got {a.dtype}")
        if len(a.shape) != 2 or not 1 <= 2 * a.shape[1] <= q.shape[-1]:
            raise ValueError(f"{name} must have shape (seqlen_ro, rotary_dim / 2) with 2 <= rotary_dim <= headdim "
                             f"{q.shape[-1]}, got {a.shape}")
        if not is_contiguous(a):
            raise ValueError(f"{name} must be contiguous, got strides {a.strides} for shape {a.shape}")
    if cos.shape != sin.shape or cos.dtype != sin.dtype:
        raise ValueError(f"rotary_cos and rotary_sin must have one shape and dtype, got {cos.shape} {cos.dtype} "
                         f"and {sin.shape} {sin.dtype}")
    return cos, sin


def check_table_capacity(cache_seqlens, seqlen_new: int, max_blocks: int, page_size: int) -> None:
    """A paged KV-cache call's lengths within its block table: cache_seqlens[b] + seqlen_new
    at most max_blocks * page_size, the rows the table addresses (flash-attn's check, whose
    error is a RuntimeError naming block_table). ``cache_seqlens``: host values, or the
    array (described or not). Lengths on a GPU are read, one synchronisation, except where
    host_values cannot (CUDA-graph capture, JAX tracing): the kernel clamps each length to
    the table's capacity there (decode/cache.cuh), so its reads stay inside the table."""
    if isinstance(cache_seqlens, np.ndarray):
        lengths = cache_seqlens
    else:
        a = cache_seqlens if isinstance(cache_seqlens, ArrayInfo) else _arrays.inspect(cache_seqlens, "cache_seqlens")
        lengths = host_values(a)
    if lengths is None:
        return
    ends = np.asarray(lengths, dtype=np.int64) + seqlen_new
    capacity = max_blocks * page_size
    if (ends > capacity).any():
        b = int(np.argmax(ends > capacity))
        raise RuntimeError(f"block_table addresses max_blocks {max_blocks} * page_size {page_size} = {capacity} rows "
                           f"a sequence, but sequence {b} needs cache_seqlens[{b}] + seqlen_new = "
                           f"{int(ends[b]) - seqlen_new} + {seqlen_new} = {int(ends[b])}: give block_table more "
                           f"columns")


def _values_on_host(a: ArrayInfo) -> np.ndarray | None:
    """The values of a KV-cache call's integer array where they are on the host. On a GPU
    they are not read (a paged call's lengths excepted: check_table_capacity): a decode
    step is a few microseconds of GPU time, and reading them would wait for the GPU at
    every step (and break CUDA-graph capture). The kernel clamps
    instead (decode/cache.cuh, decode/rotary.cuh): lengths into the cache, leftpad into the
    length, cache indices into the caches, positions into the rotary tables, and rows of a
    page index out of range read as zeros and are never written."""
    return host_values(a) if a.device is None else None


def _check_positions(lengths, seqlen_new, seqlen_q, capacity, local, cos, page_size, table, caches, batch_idx,
                     leftpad) -> None:
    """Every row the call writes or reads inside the cache, every page and cache index valid."""
    if lengths is None:  # not readable here (graph capture): the kernels clamp instead
        return
    lengths = np.asarray(lengths, dtype=np.int64)
    if (lengths < 0).any():
        raise ValueError(f"cache_seqlens must be >= 0, got {lengths.tolist()}")
    ends = lengths + seqlen_new
    if table is None and (ends > capacity).any():  # (a paged cache's: check_table_capacity)
        b = int(np.argmax(ends > capacity))
        raise ValueError(f"cache_seqlens[{b}] + seqlen_new must be at most the cache's length (seqlen_cache) "
                         f"{capacity}, got {int(lengths[b])} + {seqlen_new}")
    if cos is not None:
        needed = int((lengths + max(seqlen_new, seqlen_q if local else 1)).max(initial=0))
        if cos.shape[0] < needed:
            raise ValueError(f"rotary_cos and rotary_sin must have a row for every position they rotate, "
                             f"{needed} rows, got {cos.shape[0]}")
    values = None if batch_idx is None else _values_on_host(batch_idx)
    if values is not None and ((values < 0) | (values >= caches)).any():
        raise ValueError(f"cache_batch_idx must name caches in [0, {caches}), got {values.tolist()}")
    values = None if leftpad is None else _values_on_host(leftpad)
    if values is not None and ((values < 0) | (values > lengths)).any():
        raise ValueError(f"cache_leftpad[b] must be in [0, cache_seqlens[b]], got {values.tolist()} for "
                         f"cache_seqlens {lengths.tolist()}")
    if table is not None:
        values = _values_on_host(table)
        if values is not None:
            for b, end in enumerate(ends):
                used = values[b, :-(-int(end) // page_size)]
                if ((used < 0) | (used >= caches)).any():
                    raise ValueError(f"block_table[{b}] must name pages in [0, {caches}) for the "
                                     f"{-(-int(end) // page_size)} pages sequence {b} uses, got {used.tolist()}")


def check_merge(outs: list[ArrayInfo], lses: list[ArrayInfo]) -> None:
    """merge_states' parts: one per LSE, one kind and device, one shape and dtype of out
    (batch, seqlen_q, nheads, d), LSEs float32 (batch, nheads, seqlen_q)."""
    if len(outs) != len(lses):
        raise ValueError(f"outs and lses must hold one entry per part, got {len(outs)} and {len(lses)}")
    first = outs[0]
    for name, a in [*((f"outs[{i}]", a) for i, a in enumerate(outs)), *((f"lses[{i}]", a)
                                                                          for i, a in enumerate(lses))]:
        if a.framework != first.framework or a.device != first.device:
            raise TypeError(f"{name} must be the same kind of array on the same device as outs[0] "
                            f"({first.framework} on {first.where}), got {a.framework} on {a.where}")
    if len(first.shape) != 4:
        raise ValueError(f"outs' parts must have 4 dimensions (batch, seqlen_q, nheads, d), got shape {first.shape}")
    batch, seqlen_q, nheads, _ = first.shape
    for i, (out, lse) in enumerate(zip(outs, lses)):
        if out.shape != first.shape or out.dtype != first.dtype:
            raise ValueError(f"outs' parts must have one shape and dtype, got {first.shape} {first.dtype} and "
                             f"{out.shape} {out.dtype} (part {i})")
        if lse.shape != (batch, nheads, seqlen_q):
            raise ValueError(f"lses[{i}] must have shape (batch, nheads, seqlen_q) {(batch, nheads, seqlen_q)}, "
                             f"got {lse.shape}")
        if lse.dtype != "float32":
            raise TypeError(f"lses[{i}] must be float32, got {lse.dtype}")
    if first.dtype not in ("float16", "bfloat16", "float32", "float64"):
        raise TypeError(f"outs must be float16, bfloat16, float32 or float64, got {first.dtype}")
