"""The float64 oracle of the inference call: attention over a KV cache with in-place append,
rotary embedding, paged caches, and the merge of partial results.

Written as the contract reads (flash-attn 2.8's ``flash_attn_with_kvcache``), one sequence at
a time, on top of ``reference.attention_reference``. NumPy or CuPy arrays, as there.

For sequence b of the batch (``cache_seqlens[b]`` keys already in its cache, ``seqlen_new``
new ones in k and v, ``leftpad = cache_leftpad[b]`` or 0):

- its cache is row ``cache_batch_idx[b]`` (default b) of k_cache and v_cache, or, paged,
  logical row t lives in page ``block_table[b, t // page_size]`` at slot ``t % page_size``;
- the new keys and values go to rows ``cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1``;
  with ``rotary_cos`` / ``rotary_sin`` ((seqlen_ro, rotary_dim / 2)) the keys are rotated
  first, key j at position ``cache_seqlens[b] + j``;
- the queries are rotated at positions ``cache_seqlens[b] + i`` when causal or windowed
  (a window side at least the cache's length being unbounded, as below), else all at
  ``cache_seqlens[b]``;
- the keys attended to are rows ``leftpad .. cache_seqlens[b] + seqlen_new - 1``: a sequence
  of that length, whose key positions (masks, ALiBi) count from leftpad, with the mask's
  diagonal aligned bottom-right as everywhere else. A window side is unbounded when
  negative or at least the cache's length (seqlen_cache, or max_blocks * page_size when
  paged), as flash-attn decides it, not the sequence's.

Rotary embedding rotates the first rotary_dim features in pairs by the angle whose cosine and
sine are ``rotary_cos[p, i]``, ``rotary_sin[p, i]`` for position p and pair i: the pairs are
(2i, 2i + 1) when interleaved, else (i, i + rotary_dim / 2) (GPT-NeoX).
"""
from __future__ import annotations

import numpy

from .reference import _array_module, attention_reference, normalized_window

__all__ = ["attention_kvcache_reference", "apply_rotary", "merge_states_reference", "cache_rows"]


def apply_rotary(x, cos, sin, positions, interleaved=True):
    """x (..., seqlen, nheads, d) rotated at ``positions`` ((..., seqlen) ints, indices into
    cos and sin): the first 2 * cos.shape[1] features, in float64; the rest unchanged."""
    xp = _array_module(x)
    x = x.astype(xp.float64)
    half = cos.shape[1]
    c = xp.asarray(cos, dtype=xp.float64)[positions][..., None, :]  # (..., seqlen, 1, half)
    s = xp.asarray(sin, dtype=xp.float64)[positions][..., None, :]
    if interleaved:
        first, second = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
    else:
        first, second = x[..., :half], x[..., half:2 * half]
    out = x.copy()
    rotated_first, rotated_second = first * c - second * s, first * s + second * c
    if interleaved:
        out[..., 0:2 * half:2], out[..., 1:2 * half:2] = rotated_first, rotated_second
    else:
        out[..., :half], out[..., half:2 * half] = rotated_first, rotated_second
    return out


def cache_rows(b, positions, cache_batch_idx=None, block_table=None, page_size=None):
    """Where logical rows ``positions`` of sequence b's cache live: (cache batch row or
    page, row in it) as two int arrays."""
    positions = numpy.asarray(positions, dtype=numpy.int64)
    if block_table is not None:
        pages = numpy.asarray(_host(block_table)[b], dtype=numpy.int64)
        return pages[positions // page_size], positions % page_size
    row = b if cache_batch_idx is None else int(_host(cache_batch_idx)[b])
    return numpy.full_like(positions, row), positions


def attention_kvcache_reference(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, cache_batch_idx=None,
                                cache_leftpad=None, block_table=None, rotary_cos=None, rotary_sin=None,
                                rotary_interleaved=True, causal=False, window_size=(-1, -1), softcap=0.0,
                                alibi_slopes=None, softmax_scale=None):
    """(out, lse, k_cache, v_cache): out float64 (batch, seqlen_q, nheads, d), lse float64
    (batch, nheads, seqlen_q), and copies of the caches with the new keys and values
    appended (rotated keys rounded to the cache's dtype)."""
    xp = _array_module(q)
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_new = 0 if k is None else k.shape[1]
    page_size = k_cache.shape[1] if block_table is not None else None
    capacity = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    lengths = _lengths(cache_seqlens, batch)
    leftpads = [0] * batch if cache_leftpad is None else [int(x) for x in _host(cache_leftpad)]
    k_cache, v_cache = k_cache.copy(), v_cache.copy()
    rotary = rotary_cos is not None
    # q rotates row by row under a mask that is causal or a window (sides at least the
    # cache's length being no window, as flash-attn decides it).
    local = normalized_window(window_size, causal, capacity) != (-1, -1)
    out = xp.zeros((batch, seqlen_q, nheads, v_cache.shape[-1]), dtype=xp.float64)
    lse = xp.full((batch, nheads, seqlen_q), numpy.inf, dtype=xp.float64)
    for b in range(batch):
        length = lengths[b]
        if seqlen_new:
            new_k = k[b]
            if rotary:
                new_k = apply_rotary(new_k, rotary_cos, rotary_sin, numpy.arange(length, length + seqlen_new),
                                     rotary_interleaved)
            where = cache_rows(b, numpy.arange(length, length + seqlen_new), cache_batch_idx, block_table, page_size)
            k_cache[where] = new_k.astype(k_cache.dtype)
            v_cache[where] = v[b]
        end = length + seqlen_new
        keys = cache_rows(b, numpy.arange(leftpads[b], end), cache_batch_idx, block_table, page_size)
        q_b = q[b]
        if rotary:
            positions = numpy.arange(length, length + seqlen_q) if local else numpy.full(seqlen_q, length)
            q_b = apply_rotary(q_b, rotary_cos, rotary_sin, positions, rotary_interleaved)
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.ndim == 1 else alibi_slopes[b]
        o, l = attention_reference(q_b[None], k_cache[keys][None], v_cache[keys][None], causal=causal,
                                   softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                                   alibi_slopes=slopes, window_limit=capacity)
        out[b], lse[b] = o[0], l[0]
    return out, lse, k_cache, v_cache


def merge_states_reference(outs, lses):
    """Combine partial attention results over disjoint key sets: outs (parts, batch,
    seqlen_q, nheads, d), lses (parts, batch, nheads, seqlen_q), natural-log LSEs with
    +inf or -inf for a part that saw no key. Returns float64 (out, lse): out = sum_i
    exp(lse_i - lse) out_i with lse = log sum_i exp(lse_i); a row no part saw: out 0, lse +inf."""
    xp = _array_module(outs)
    outs, lses = xp.asarray(outs, dtype=xp.float64), xp.asarray(lses, dtype=xp.float64)
    empty = xp.isinf(lses)
    finite = xp.where(empty, -xp.inf, lses)
    top = finite.max(axis=0)
    seen = xp.isfinite(top)
    weights = xp.where(empty, 0.0, xp.exp(finite - xp.where(seen, top, 0.0)))  # (parts, batch, nheads, seqlen_q)
    total = weights.sum(axis=0)
    lse = xp.where(seen, top + xp.log(xp.where(seen, total, 1.0)), xp.inf)
    share = weights / xp.where(seen, total, 1.0)
    out = (share.transpose(0, 1, 3, 2)[..., None] * outs).sum(axis=0)
    return out, lse


def _lengths(cache_seqlens, batch):
    if isinstance(cache_seqlens, (int, numpy.integer)):
        return [int(cache_seqlens)] * batch
    return [int(x) for x in _host(cache_seqlens)]


def _host(x):
    return x.get() if hasattr(x, "get") else numpy.asarray(x)
