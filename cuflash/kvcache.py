"""The inference call: new queries attending to a KV cache, flash-attn's
``flash_attn_with_kvcache``, and the merge of partial attention results.

    out = cuflash.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                         rotary_cos=cos, rotary_sin=sin, causal=True)

The semantics (append, rotary positions, paged caches, left padding, windows) are stated in
``cuflash.reference_kvcache``, the float64 oracle. NumPy arrays run the CPU path
(``cpu.attention_with_kvcache``): the append in place, then the blockwise forward over each
sequence's keys, computing in float32 as the kernels do. CUDA arrays (CuPy, PyTorch, JAX) run
the split-KV kernel (cuda/decode/split_kv.cu) and its merge (cuda/decode/merge.cu).
"""
from __future__ import annotations

import contextlib
import math
import operator

import numpy as np

from . import _arrays, _kernels, _options
from . import _warm as _warm_calls

__all__ = ["attention_with_kvcache", "merge_states"]


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, cache_batch_idx=None,
                           cache_leftpad=None, block_table=None, rotary_cos=None, rotary_sin=None,
                           rotary_interleaved=True, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, softmax_scale=None, num_splits=0, deterministic=False,
                           return_lse=False, score_mod=None, mask_mod=None, mod_tensors=()):
    """Attention of q over each sequence's cached keys and values, after appending k and v
    (when given) to the caches in place: flash-attn 2.8's ``flash_attn_with_kvcache``.

    q (batch, seqlen_q, nheads, d); k_cache and v_cache (batch_cache, seqlen_cache,
    nheads_k, d), or paged (num_pages, page_size, nheads_k, d) with ``block_table`` int32
    (batch, max_blocks): logical row t of sequence b lies in page block_table[b, t //
    page_size], row t % page_size (any page size); a length past the table's rows
    (cache_seqlens[b] + seqlen_new > max_blocks * page_size) raises RuntimeError naming
    block_table, the lengths read from the GPU for it except under CUDA-graph capture. k
    and v (batch, seqlen_new, nheads_k, d) are written at rows cache_seqlens[b] ..
    cache_seqlens[b] + seqlen_new - 1, then attended to. ``cache_seqlens``: an int or
    int32 (batch,); ``cache_batch_idx`` int32 (batch,): the cache row of each sequence;
    ``cache_leftpad`` int32 (batch,): rows before it are padding, and key positions count
    from it. ``rotary_cos`` / ``rotary_sin`` (seqlen_ro,
    rotary_dim / 2) rotate the first rotary_dim features of the new keys at positions
    cache_seqlens[b] + j, and of q at cache_seqlens[b] + i when causal or windowed, else
    at cache_seqlens[b]; ``rotary_interleaved`` pairs features (0, 1), (2, 3), ... (else
    the two halves, GPT-NeoX). causal (bottom-right to the sequence's keys), window_size,
    softcap, alibi_slopes and softmax_scale as in ``cuflash.attention``; a window side at
    least the cache's length is unbounded. ``num_splits``: how many parts of the keys the
    GPU kernel splits a sequence into (0: chosen from the shapes); the result does not
    depend on it beyond rounding. ``deterministic``: on the GPU, the bits of a sequence's
    result depend neither on num_splits nor on the rest of the batch (each sequence's keys
    cut into parts by its own length; 0.55-1.0x the default's speed, slowest from batch 16
    on short caches, see docs/performance.md). Returns out like q, or (out, lse) with
    ``return_lse``, lse float32 (batch, nheads, seqlen_q) (+inf for a row that sees no key).
    ``score_mod``, ``mask_mod`` and ``mod_tensors`` are refused (NotImplementedError): the
    decode kernels do not take programmable attention.
    """
    if _options.has_mods(score_mod, mask_mod, mod_tensors):
        raise NotImplementedError("attention_with_kvcache does not take score_mod, mask_mod or mod_tensors: the "
                                  "KV-cache (decode) kernels have no programmable attention; call "
                                  "cuflash.attention over the cache's keys instead")
    return _attention_with_kvcache((q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad,
                                    block_table, rotary_cos, rotary_sin, alibi_slopes), rotary_interleaved, causal,
                                    window_size, softcap, softmax_scale, num_splits, deterministic, return_lse)


_ARRAY_ARGUMENTS = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "cache_batch_idx", "cache_leftpad",
                    "block_table", "rotary_cos", "rotary_sin", "alibi_slopes")


def _attention_with_kvcache(given: tuple, rotary_interleaved, causal, window_size, softcap, softmax_scale, num_splits,
                            deterministic, return_lse):
    """attention_with_kvcache with its array arguments ``given`` in _ARRAY_ARGUMENTS' order
    (the torch front end's eager calls come here directly)."""
    q, k_cache, v_cache, k, v, cache_seqlens, *_, alibi_slopes = given
    scalars = (rotary_interleaved, causal, window_size, softcap, softmax_scale, num_splits, deterministic, return_lse,
               cache_seqlens if cache_seqlens.__class__ is int else None)
    key = _key(given, scalars)
    warm = _warm_calls.lookup(_warm, key)
    if warm is not None:
        block_table = given[8]
        if block_table is not None and cache_seqlens.__class__ is not int:  # (an int is part of the key: checked)
            _options.check_table_capacity(cache_seqlens, 0 if k is None else k.shape[1], block_table.shape[1],
                                          k_cache.shape[1])
        return _decode_warm(warm, given)
    infos = {name: _arrays.inspect(x, name) for name, x in zip(_ARRAY_ARGUMENTS, given)
             if x is not None and _is_array(x)}
    arrays = {name: infos[name] for name in ("q", "k_cache", "v_cache", "k", "v") if name in infos}
    cache = _options.kvcache(arrays, infos.get("cache_seqlens", cache_seqlens), infos.get("cache_batch_idx"),
                             infos.get("cache_leftpad"), infos.get("block_table"), infos.get("rotary_cos"),
                             infos.get("rotary_sin"), rotary_interleaved, causal, window_size, num_splits,
                             deterministic)
    options = _options.make_options(arrays["q"], arrays["k_cache"], causal, softmax_scale, window_size, softcap,
                                    alibi_slopes, 0.0, None, 0, backward=False, seqlen_k=cache.capacity)
    _options.check_bool("return_lse", return_lse)
    if infos["q"].device is None:
        from . import cpu  # (the CPU path only: a GPU process need not import it)
        out, lse = cpu.attention_with_kvcache(q, k_cache, v_cache, k, v, cache, options)
        return (out, lse) if return_lse else out
    q_info = infos["q"]
    lse_shape = (q_info.shape[0], q_info.shape[2], q_info.shape[1])
    out, lse, launcher = _decode_gpu(infos, lse_shape, return_lse,
                                     lambda out: _kernels.decode_launcher(arrays, out, cache, options))
    if key is not None:
        _warm_calls.remember(_warm, key, _Warm(launcher, _arrays.library(q), q_info.device, tuple(infos),
                                               q_info.shape, q_info.dtype, lse_shape if return_lse else None))
    return (out, lse) if return_lse else out


# Warm calls (_warm) on the GPU. On a GPU no check reads an array's values; on the CPU
# they are read, so every call there is checked (NumPy arrays make no key).
class _Warm:
    """A KV-cache call signature that passed the checks, bound to its launcher: what a
    call needs to allocate its results and launch. ``present``: where the given arrays
    lie among the arguments; ``order`` picks the launch's pointers (DECODE_POINTERS) from
    [0, the given arrays' pointers, out, lse, partial_o, partial_lse]."""
    __slots__ = ("launcher", "calls", "device", "present", "order", "out_shape", "dtype", "lse_shape", "work")

    def __init__(self, launcher, calls, device: int, arrays: tuple, out_shape: tuple, dtype: str, lse_shape):
        self.launcher, self.calls, self.device = launcher, calls, device
        self.present = tuple(_ARRAY_ARGUMENTS.index(name) for name in arrays)
        # (decode_pointers over stand-ins 1, 2, ...: each slot's source, kept in one place)
        stand_ins = _kernels.decode_pointers({name: 1 + i for i, name in enumerate(arrays)},
                                             *range(1 + len(arrays), 5 + len(arrays)))
        self.order = operator.itemgetter(*stand_ins)
        self.out_shape, self.dtype, self.lse_shape = out_shape, calls.dtype(dtype), lse_shape
        self.work = _workspace(launcher)


_warm: dict = {}


def _key(given: tuple, scalars: tuple):
    """The warm key: the given arrays' signatures, which arguments they are, the rest."""
    present = tuple([i for i, x in enumerate(given) if x is not None and x.__class__ is not int])
    return _warm_calls.key(tuple([given[i] for i in present]), (*scalars, present), pair=2)


def _decode_warm(warm: _Warm, given: tuple):
    """The split kernel (decode/split_kv.cu) and, over several splits, the merge, on the
    caller's stream; out (like q), lse and the splits' workspace allocated by the
    caller's library. Returns out, or (out, lse) where the signature returns it."""
    calls, device = warm.calls, warm.device
    pointer, float32 = calls.pointer, calls.dtype("float32")
    out = calls.empty(warm.out_shape, warm.dtype, device)
    lse = None if warm.lse_shape is None else calls.empty(warm.lse_shape, float32, device)
    partial_o = partial_lse = 0
    if warm.work is not None:
        work = calls.empty((warm.work[0],), float32, device)
        partial_o = pointer(work)
        partial_lse = partial_o + warm.work[1]
    pointers = [0, *[pointer(given[i]) for i in warm.present], pointer(out), 0 if lse is None else pointer(lse),
                partial_o, partial_lse]
    warm.launcher(calls.stream(device), *warm.order(pointers))
    return out if lse is None else (out, lse)


def _is_array(x) -> bool:
    return hasattr(x, "shape") and not isinstance(x, np.generic)


def _workspace(launcher) -> tuple[int, int] | None:
    """The splits' results (partial O, then partial LSE) as one float32 allocation: its
    length and partial LSE's byte offset; None where the plan has a single split."""
    if not launcher.plan.workspace:
        return None
    (_, o_shape, _), (_, partial_lse_shape, _) = launcher.plan.workspace
    return math.prod(o_shape) + math.prod(partial_lse_shape), 4 * math.prod(o_shape)


def _decode_gpu(infos: dict, lse_shape: tuple, return_lse: bool, launcher_for):
    """``_decode_warm`` for described arrays of any library (JAX's too): ``launcher_for(out)``
    the launcher. Returns (out, lse or None) of the caller's kind, and the launcher."""
    q = infos["q"]
    framework = _arrays.Framework(q)
    out = framework.empty(q.shape, q.dtype)
    lse = framework.empty(lse_shape, "float32") if return_lse else None
    launcher = launcher_for(out)
    partial_o = partial_lse = 0
    sizes = _workspace(launcher)
    if sizes is not None:  # (held until the launch)
        work = framework.empty((sizes[0],), "float32")
        partial_o, partial_lse = work.ptr, work.ptr + sizes[1]
    pointers = {name: a.ptr for name, a in infos.items()}
    launcher(framework.stream, *_kernels.decode_pointers(pointers, out.ptr, 0 if lse is None else lse.ptr,
                                                         partial_o, partial_lse))
    return framework.finish(out.obj), None if lse is None else framework.finish(lse.obj), launcher


def attention_varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, *,
                           causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           return_lse=False):
    """``cuflash.attention_varlen`` with ``block_table``: packed queries over keys and values
    in pages (flash-attn 2.8's ``flash_attn_varlen_func(..., block_table=...)``). k and v
    are page pools (num_pages, page_size, nheads_k, d); sequence b's keys are the first
    cu_seqlens_k[b + 1] - cu_seqlens_k[b] rows of its pages block_table[b]. Forward only.
    On the GPU it runs the KV-cache call's split kernel, whose tiles hold 16 query rows
    (a KV head's query heads packed): made for short runs of queries (decoding, speculation,
    chunks of a prompt); a long prompt is better served by the contiguous call."""
    infos = {name: _arrays.inspect(x, name) for name, x in (("q", q), ("k_cache", k), ("v_cache", v))}
    varlen, cache = _options.paged_varlen(infos["q"], infos["k_cache"], infos["v_cache"], cu_seqlens_q, cu_seqlens_k,
                                          max_seqlen_q, max_seqlen_k, block_table)
    options = _options.make_options(infos["q"], infos["k_cache"], causal, softmax_scale, window_size, softcap,
                                    alibi_slopes, 0.0, None, 0, backward=False, batch=varlen.batch,
                                    seqlen_k=varlen.max_seqlen_k)
    _options.check_bool("return_lse", return_lse)
    if infos["q"].device is None:  # the pages gathered into packed k and v, then the varlen call
        from . import cpu
        table, lengths = np.asarray(cache.block_table.obj), cache.lengths
        pages = [table[b, :-(-int(n) // cache.page_size)] for b, n in enumerate(lengths)]
        k_packed, v_packed = (np.concatenate([x[p].reshape(-1, *x.shape[2:])[:n] for p, n in zip(pages, lengths)])
                              for x in (k, v))
        cu_k = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        out, lse = cpu.attention_varlen_forward(q, k_packed, v_packed, np.asarray(cu_seqlens_q), cu_k, max_seqlen_q,
                                                max_seqlen_k, causal=options.causal, softmax_scale=options.scale,
                                                window_size=options.window, softcap=options.softcap,
                                                alibi_slopes=alibi_slopes)
        return (out, lse) if return_lse else out
    infos.update(block_table=cache.block_table, cu_seqlens_q=varlen.cu_seqlens_q, cu_seqlens_k=varlen.cu_seqlens_k)
    if options.alibi is not None:
        infos["alibi_slopes"] = options.alibi
    arrays = {name: infos[name] for name in ("q", "k_cache", "v_cache")}
    out, lse, _ = _decode_gpu(infos, (q.shape[1], q.shape[0]), return_lse,
                              lambda out: _kernels.decode_launcher(arrays, out, cache, options, varlen))
    return (out, lse) if return_lse else out


def merge_states(outs, lses):
    """Combine attention results over disjoint sets of keys: the result of attention over
    their union. ``outs``: a sequence of parts (batch, seqlen_q, nheads, d), or one array
    (parts, batch, seqlen_q, nheads, d); ``lses``: their LSEs, float32 (batch, nheads,
    seqlen_q) each, natural log, +inf or -inf for a row whose part saw no key. Returns
    (out, lse): out = sum_i exp(lse_i - lse) out_i, lse = log sum_i exp(lse_i); a row no
    part saw gives out 0 and lse +inf. out has the parts' dtype, lse float32.
    """
    parts_out, parts_lse = _parts("outs", outs), _parts("lses", lses)
    infos = [_arrays.inspect(x, f"outs[{i}]") for i, x in enumerate(parts_out)]
    _options.check_merge(infos, [_arrays.inspect(x, f"lses[{i}]") for i, x in enumerate(parts_lse)])
    if infos[0].device is None:
        return merge_stacked(np.stack(parts_out), np.stack(parts_lse), np)
    return _merge_gpu(parts_out, parts_lse, infos[0])


def _merge_gpu(parts_out: list, parts_lse: list, first: _arrays.ArrayInfo):
    """The merge kernel (decode/merge.cu) over the parts, stacked once (a part list has
    no common stride)."""
    if first.dtype == "float64":
        raise TypeError("merge_states on the GPU takes float16, bfloat16 or float32 parts, got float64")
    framework = _arrays.Framework(first)
    if first.framework == "torch":
        import torch as xp
    elif first.framework == "jax":
        import jax.numpy as xp
    else:
        import cupy as xp
    with framework.calls.on(first.device) if first.framework == "cupy" else contextlib.nullcontext():
        outs, lses = xp.stack(parts_out), xp.stack(parts_lse)
    if first.framework == "jax":
        outs.block_until_ready(), lses.block_until_ready()
    parts, part_lses = _arrays.inspect(outs, "outs"), _arrays.inspect(lses, "lses")
    out = framework.empty(first.shape, first.dtype)
    lse = framework.empty((first.shape[0], first.shape[2], first.shape[1]), "float32")
    _kernels.merge_launcher(parts, part_lses, out)(framework.stream, parts.ptr, part_lses.ptr, out.ptr, lse.ptr)
    return framework.finish(out.obj), framework.finish(lse.obj)


def merge_stacked(outs, lses, xp):
    """merge_states of checked, stacked parts: outs (parts, batch, seqlen_q, nheads, d),
    lses (parts, batch, nheads, seqlen_q), with ``xp`` NumPy or jax.numpy. Computes in
    float32 (float64 for float64 parts); differentiable where xp is."""
    acc = xp.float64 if outs.dtype == xp.float64 else xp.float32
    lses = lses.astype(acc)
    empty = xp.isinf(lses)
    finite = xp.where(empty, -xp.inf, lses)
    top = finite.max(axis=0)
    seen = xp.isfinite(top)
    weights = xp.where(empty, 0, xp.exp(finite - xp.where(seen, top, 0)))  # exp(-inf - 0) = 0: no NaN
    total = weights.sum(axis=0)
    lse = xp.where(seen, top + xp.log(xp.where(seen, total, 1)), xp.inf).astype(xp.float32)
    share = xp.expand_dims((weights / xp.where(seen, total, 1)).transpose(0, 1, 3, 2), -1)  # (parts, b, s, h, 1)
    return (share * outs.astype(acc)).sum(axis=0).astype(outs.dtype), lse


def _parts(name: str, parts) -> list:
    if isinstance(parts, (list, tuple)):
        if not parts:
            raise ValueError(f"{name} must hold at least one part")
        return list(parts)
    if not hasattr(parts, "shape") or len(parts.shape) < 1 or parts.shape[0] < 1:
        raise TypeError(f"{name} must be a sequence of arrays or an array whose first axis runs over the parts, "
                        f"got {type(parts).__qualname__}")
    return [parts[i] for i in range(parts.shape[0])]
