"""The inference call: new queries attending to a KV cache, flash-attn's
``flash_attn_with_kvcache``, and the merge of partial attention results.

    out = cuflash.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                         rotary_cos=cos, rotary_sin=sin, causal=True)

The semantics (append, rotary positions, paged caches, left padding, windows) are stated in
``cuflash.reference_kvcache``, the float64 oracle. NumPy arrays run the CPU path here: the
append in place, then the blockwise forward of ``cuflash.cpu`` over each sequence's keys,
computing in float32 as the kernels do. CUDA arrays (CuPy, PyTorch, JAX) raise
NotImplementedError: the decode kernel that serves them is not part of this version.
"""
from __future__ import annotations

import numpy as np

from . import _arrays, _options, cpu

__all__ = ["attention_with_kvcache", "merge_states"]


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, cache_batch_idx=None,
                           cache_leftpad=None, block_table=None, rotary_cos=None, rotary_sin=None,
                           rotary_interleaved=True, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, softmax_scale=None, num_splits=0, return_lse=False):
    """Attention of q over each sequence's cached keys and values, after appending k and v
    (when given) to the caches in place: flash-attn 2.8's ``flash_attn_with_kvcache``.

    q (batch, seqlen_q, nheads, d); k_cache and v_cache (batch_cache, seqlen_cache,
    nheads_k, d), or paged (num_pages, page_size, nheads_k, d) with ``block_table`` int32
    (batch, max_blocks): logical row t of sequence b lies in page block_table[b, t //
    page_size], row t % page_size (any page size). k and v (batch, seqlen_new, nheads_k, d)
    are written at rows cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1, then attended
    to. ``cache_seqlens``: an int or int32 (batch,); ``cache_batch_idx`` int32 (batch,): the
    cache row of each sequence; ``cache_leftpad`` int32 (batch,): rows before it are
    padding, and key positions count from it. ``rotary_cos`` / ``rotary_sin`` (seqlen_ro,
    rotary_dim / 2) rotate the first rotary_dim features of the new keys at positions
    cache_seqlens[b] + j, and of q at cache_seqlens[b] + i when causal or windowed, else
    at cache_seqlens[b]; ``rotary_interleaved`` pairs features (0, 1), (2, 3), ... (else
    the two halves, GPT-NeoX). causal (bottom-right to the sequence's keys), window_size,
    softcap, alibi_slopes and softmax_scale as in ``cuflash.attention``; a window side at
    least the cache's length is unbounded. ``num_splits``: how many parts of the keys the
    GPU kernel splits a sequence into (0: chosen from the shapes); the result does not
    depend on it beyond rounding. Returns out like q, or (out, lse) with ``return_lse``,
    lse float32 (batch, nheads, seqlen_q) (+inf for a row that sees no key).
    """
    arrays = {name: _arrays.inspect(x, name) for name, x in
              (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)) if x is not None}
    cache = _options.kvcache(arrays, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, rotary_cos,
                             rotary_sin, rotary_interleaved, causal, window_size, num_splits)
    options = _options.make_options(arrays["q"], arrays["k_cache"], causal, softmax_scale, window_size, softcap,
                                    alibi_slopes, 0.0, None, 0, backward=False, seqlen_k=cache.capacity)
    _options.check_bool("return_lse", return_lse)
    if arrays["q"].device is not None:
        raise NotImplementedError("attention_with_kvcache runs on NumPy arrays (the CPU path) in this version; "
                                  "CUDA arrays need the decode kernel, which it does not have")
    out, lse = _cpu_forward(q, k_cache, v_cache, k, v, cache, options)
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
    if infos[0].device is not None:
        raise NotImplementedError("merge_states runs on NumPy arrays (the CPU path) in this version; CUDA arrays "
                                  "need its kernel, which it does not have")
    return merge_stacked(np.stack(parts_out), np.stack(parts_lse), np)


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


# -- the CPU path ----------------------------------------------------------------------------

def _cpu_forward(q, k_cache, v_cache, k, v, cache: _options.KVCache, options: _options.Options):
    batch, seqlen_q, nheads, _ = q.shape
    nheads_k = k_cache.shape[2]
    acc = np.float64 if q.dtype == np.float64 else np.float32
    lengths = cache.lengths.astype(np.int64)
    batch_idx = None if cache.batch_idx is None else np.asarray(cache.batch_idx.obj)
    table = None if cache.block_table is None else np.asarray(cache.block_table.obj)
    leftpad = np.zeros(batch, np.int64) if cache.leftpad is None else np.asarray(cache.leftpad.obj)
    cos = sin = None
    if cache.rotary_cos is not None:
        cos, sin = (np.asarray(a.obj).astype(acc) for a in (cache.rotary_cos, cache.rotary_sin))
    local = options.window != (-1, -1)
    alibi = None if options.alibi is None else np.broadcast_to(np.asarray(options.alibi.obj), (batch, nheads))

    out = np.empty(q.shape[:3] + v_cache.shape[-1:], dtype=q.dtype)
    lse = np.empty((batch, nheads, seqlen_q), dtype=np.float32)
    for b in range(batch):
        n = int(lengths[b])
        if cache.seqlen_new:
            new_k = k[b]
            if cos is not None:  # rotated in the accumulator type, stored in the cache's
                new_k = _rotate(new_k.astype(acc), cos, sin, np.arange(n, n + cache.seqlen_new),
                                cache.rotary_interleaved)
            where = _rows(b, np.arange(n, n + cache.seqlen_new), batch_idx, table, cache.page_size)
            k_cache[where] = new_k.astype(k_cache.dtype)
            v_cache[where] = v[b]
        keys = _rows(b, np.arange(int(leftpad[b]), n + cache.seqlen_new), batch_idx, table, cache.page_size)
        q_b = q[b]
        if cos is not None:
            positions = np.arange(n, n + seqlen_q) if local else np.full(seqlen_q, n)
            q_b = _rotate(q_b.astype(acc), cos, sin, positions, cache.rotary_interleaved).astype(q.dtype)
        variant = cpu._Variant(
            seqlen_q, len(keys[0]), nheads, nheads_k, acc, causal=options.causal, scale=options.scale,
            window_size=options.window, softcap=options.softcap,
            alibi=None if alibi is None else alibi[b:b + 1], dropout_p=0.0, seed=0, rng_offset=0,
            batch_index=np.array([b]), window_limit=cache.capacity)
        o, l = cpu._forward(q_b[None], k_cache[keys][None], v_cache[keys][None], variant, 128, 128)
        out[b], lse[b] = o[0], l[0]
    return out, lse


def _rows(b, positions, batch_idx, table, page_size):
    """(cache row or page, row in it) of sequence b's logical rows ``positions``."""
    if table is not None:
        return table[b].astype(np.int64)[positions // page_size], positions % page_size
    return np.full(len(positions), b if batch_idx is None else int(batch_idx[b])), positions


def _rotate(x, cos, sin, positions, interleaved):
    """x (seqlen, nheads, d) with its first 2 * cos.shape[1] features rotated at ``positions``."""
    half = cos.shape[1]
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    pairs = (slice(0, 2 * half, 2), slice(1, 2 * half, 2)) if interleaved else (slice(0, half), slice(half, 2 * half))
    first, second = x[..., pairs[0]], x[..., pairs[1]]
    out = x.copy()
    out[..., pairs[0]], out[..., pairs[1]] = first * c - second * s, first * s + second * c
    return out


def _parts(name: str, parts) -> list:
    if isinstance(parts, (list, tuple)):
        if not parts:
            raise ValueError(f"{name} must hold at least one part")
        return list(parts)
    if not hasattr(parts, "shape") or len(parts.shape) < 1 or parts.shape[0] < 1:
        raise TypeError(f"{name} must be a sequence of arrays or an array whose first axis runs over the parts, "
                        f"got {type(parts).__qualname__}")
    return [parts[i] for i in range(parts.shape[0])]
