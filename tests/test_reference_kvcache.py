"""The KV-cache oracle against independent statements of the contract: rotary embedding as
complex multiplication, attention written the way flash-attn's own test builds it (the whole
cache with a key-padding mask), paged caches against contiguous ones, and merging partial
results against attention over all the keys."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuflash.reference import attention_reference
from cuflash.reference_kvcache import (apply_rotary, attention_kvcache_reference, cache_rows,
                                       merge_states_reference)

from .strategies import assert_close, assert_lse_close, kvcache_calls, paged_caches


def test_rotary_is_complex_multiplication():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 10))  # seqlen, heads, d; rotary_dim 8
    angle = rng.uniform(0, 2 * np.pi, (7, 4))
    positions = np.array([6, 0, 3, 3, 1])
    turn = np.exp(1j * angle[positions])[:, None, :]
    interleaved = apply_rotary(x, np.cos(angle), np.sin(angle), positions, interleaved=True)
    z = (x[..., 0:8:2] + 1j * x[..., 1:8:2]) * turn
    assert_close(interleaved[..., 0:8:2], z.real, atol=1e-12)
    assert_close(interleaved[..., 1:8:2], z.imag, atol=1e-12)
    halves = apply_rotary(x, np.cos(angle), np.sin(angle), positions, interleaved=False)
    z = (x[..., :4] + 1j * x[..., 4:8]) * turn
    assert_close(halves[..., :4], z.real, atol=1e-12)
    assert_close(halves[..., 4:8], z.imag, atol=1e-12)
    assert (interleaved[..., 8:] == x[..., 8:]).all() and (halves[..., 8:] == x[..., 8:]).all()


def _flash_attn_style(q_ro, k_cache, v_cache, lengths, leftpads, causal, window, softcap, slopes, scale):
    """Attention over the whole (already appended and gathered) cache rows with a key
    padding mask, key columns shifted by the left padding, as flash-attn's test builds its
    reference: an independent statement of the masking rules."""
    batch, seqlen_q, nheads, d = q_ro.shape
    seqlen_k, nheads_k = k_cache.shape[1], k_cache.shape[2]
    group = nheads // nheads_k
    k_rep, v_rep = np.repeat(k_cache, group, axis=2), np.repeat(v_cache, group, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q_ro, k_rep) * scale
    if softcap > 0:
        scores = softcap * np.tanh(scores / softcap)
    out = np.zeros((batch, seqlen_q, nheads, v_cache.shape[-1]))
    lse = np.full((batch, nheads, seqlen_q), np.inf)
    for b in range(batch):
        col = np.arange(seqlen_k) - leftpads[b]  # positions count from the left padding
        valid = (col >= 0) & (np.arange(seqlen_k) < lengths[b])
        sk = lengths[b] - leftpads[b]
        row = np.arange(seqlen_q)[:, None] + sk - seqlen_q
        left, right = (-1 if side >= k_cache.shape[1] else side for side in window)  # as flash-attn's kernel
        right = 0 if causal else right
        visible = valid[None, :] & np.ones((seqlen_q, 1), bool)
        if right >= 0:
            visible &= col[None, :] <= row + right
        if left >= 0:
            visible &= col[None, :] >= row - left
        s = scores[b].copy()
        if slopes is not None:
            s -= slopes[b][:, None, None] * np.abs(row - col[None, :])[None]
        s = np.where(visible[None], s, -np.inf)
        top = s.max(axis=-1, keepdims=True)
        seen = np.isfinite(top)
        p = np.where(seen, np.exp(s - np.where(seen, top, 0)), 0)
        total = p.sum(axis=-1, keepdims=True)
        out[b] = np.einsum("hqk,khd->qhd", p / np.where(seen, total, 1), v_rep[b])
        lse[b] = np.where(seen[..., 0], (top + np.log(np.where(seen, total, 1)))[..., 0], np.inf)
    return out, lse


@settings(deadline=None, max_examples=150)
@given(call=kvcache_calls())
def test_the_oracle_matches_flash_attn_style_masking(call):
    c = call
    rng = np.random.default_rng(c["seed"])
    batch_cache = c["batch"] + 2 if c["batch_idx"] else c["batch"]
    q = rng.standard_normal((c["batch"], c["seqlen_q"], c["nheads"], c["d"]))
    k_cache = rng.standard_normal((batch_cache, c["capacity"], c["nheads_k"], c["d"]))
    v_cache = rng.standard_normal((batch_cache, c["capacity"], c["nheads_k"], c["d"]))
    k = v = None
    if c["seqlen_new"]:
        k = rng.standard_normal((c["batch"], c["seqlen_new"], c["nheads_k"], c["d"]))
        v = rng.standard_normal((c["batch"], c["seqlen_new"], c["nheads_k"], c["d"]))
    batch_idx = rng.permutation(batch_cache)[:c["batch"]].astype(np.int32) if c["batch_idx"] else None
    cos = sin = None
    if c["rotary_dim"]:
        angle = rng.uniform(0, 2 * np.pi, (c["capacity"] + c["seqlen_q"], c["rotary_dim"] // 2))
        cos, sin = np.cos(angle), np.sin(angle)
    slopes = rng.uniform(0, 0.5, (c["batch"], c["nheads"])) if c["alibi"] else None
    lengths = np.array(c["lengths"], dtype=np.int32)
    leftpads = np.array(c["leftpads"], dtype=np.int32)
    out, lse, k_new, v_new = attention_kvcache_reference(
        q, k_cache, v_cache, k, v, cache_seqlens=lengths, cache_batch_idx=batch_idx, cache_leftpad=leftpads,
        rotary_cos=cos, rotary_sin=sin, rotary_interleaved=c["interleaved"], causal=c["causal"],
        window_size=c["window"], softcap=c["softcap"], alibi_slopes=slopes)

    # The appended rows, and nothing else, changed.
    rows = np.arange(batch_cache) if batch_idx is None else batch_idx
    expected_k, expected_v = k_cache.copy(), v_cache.copy()
    # flash-attn rotates q row by row when its mask, after the cache's length bounds the
    # window's sides, is causal or a window.
    local = c["causal"] or any(0 <= side < c["capacity"] for side in c["window"])
    q_ro = q.copy()
    for b in range(c["batch"]):
        n = lengths[b]
        if k is not None:
            k_b = k[b] if cos is None else apply_rotary(k[b], cos, sin, np.arange(n, n + c["seqlen_new"]),
                                                        c["interleaved"])
            expected_k[rows[b], n:n + c["seqlen_new"]] = k_b
            expected_v[rows[b], n:n + c["seqlen_new"]] = v[b]
        if cos is not None:
            positions = np.arange(n, n + c["seqlen_q"]) if local else np.full(c["seqlen_q"], n)
            q_ro[b] = apply_rotary(q[b], cos, sin, positions, c["interleaved"])
    assert (k_new == expected_k).all() and (v_new == expected_v).all()

    gathered_k, gathered_v = expected_k[rows[:c["batch"]]], expected_v[rows[:c["batch"]]]
    want_out, want_lse = _flash_attn_style(q_ro, gathered_k, gathered_v, lengths + c["seqlen_new"], leftpads,
                                           c["causal"], c["window"], c["softcap"], slopes, 1 / np.sqrt(c["d"]))
    assert_close(out, want_out, atol=1e-10)
    assert_lse_close(lse, want_lse, atol=1e-10)


@pytest.mark.parametrize("page_size", [1, 3, 16, 17])
def test_paged_caches_are_contiguous_caches_in_pages(page_size):
    rng = np.random.default_rng(page_size)
    batch, capacity, nheads_k, d = 3, 40, 2, 8
    block_table, k_paged, v_paged, k_dense, v_dense = paged_caches(rng, batch, capacity, page_size, nheads_k, d,
                                                                   np.float16, spare=5)
    num_pages = len(k_paged)
    q = rng.standard_normal((batch, 2, 4, d))
    k = rng.standard_normal((batch, 2, nheads_k, d)).astype(np.float16)
    v = rng.standard_normal((batch, 2, nheads_k, d)).astype(np.float16)
    lengths = np.array([0, 17, capacity - 2], dtype=np.int32)
    angle = rng.uniform(0, 6, (capacity + 2, 2))
    kwargs = dict(cache_seqlens=lengths, rotary_cos=np.cos(angle), rotary_sin=np.sin(angle), causal=True)
    dense = attention_kvcache_reference(q, k_dense, v_dense, k, v, **kwargs)
    paged = attention_kvcache_reference(q, k_paged, v_paged, k, v, block_table=block_table, **kwargs)
    assert (dense[0] == paged[0]).all() and (dense[1] == paged[1]).all()
    for cache_dense, cache_paged in zip(dense[2:], paged[2:]):
        assert (cache_paged[block_table].reshape(batch, -1, nheads_k, d)[:, :capacity] == cache_dense).all()
    untouched = np.setdiff1d(np.arange(num_pages), block_table)
    assert (paged[2][untouched] == k_paged[untouched]).all()


def test_cache_rows():
    table = np.array([[4, 2], [0, 3]], dtype=np.int32)
    pages, slots = cache_rows(1, [0, 4, 5, 9], block_table=table, page_size=5)
    assert pages.tolist() == [0, 0, 3, 3] and slots.tolist() == [0, 4, 0, 4]
    rows, positions = cache_rows(1, [2, 3], cache_batch_idx=np.array([5, 7]))
    assert rows.tolist() == [7, 7] and positions.tolist() == [2, 3]


@settings(deadline=None, max_examples=100)
@given(parts=st.integers(1, 4), seed=st.integers(0, 2**32 - 1), causal=st.booleans())
def test_merging_parts_over_disjoint_keys_is_attention_over_all(parts, seed, causal):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 5, 4, 8))
    k = rng.standard_normal((2, 13, 2, 8))
    v = rng.standard_normal((2, 13, 2, 8))
    want_out, want_lse = attention_reference(q, k, v, causal=causal)
    cuts = np.sort(rng.integers(0, 14, parts - 1))
    bounds = [0, *cuts.tolist(), 13]
    outs, lses = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        # keys lo..hi-1 alone, with the causal mask of the whole sequence: a bias of -inf
        # on the keys a row must not see, written as the window of the full problem.
        o, l = _attention_over(q, k, v, lo, hi, causal)
        outs.append(o)
        lses.append(l)
    out, lse = merge_states_reference(np.stack(outs), np.stack(lses))
    assert_close(out, want_out, atol=1e-12)
    assert np.allclose(lse, want_lse, atol=1e-12) and (np.isinf(lse) == np.isinf(want_lse)).all()
    # Associative: merging merged halves gives the same.
    if parts >= 2:
        first = merge_states_reference(np.stack(outs[:1]), np.stack(lses[:1]))
        rest = merge_states_reference(np.stack(outs[1:]), np.stack(lses[1:]))
        again = merge_states_reference(np.stack([first[0], rest[0]]), np.stack([first[1], rest[1]]))
        assert_close(again[0], out, atol=1e-12)


def _attention_over(q, k, v, lo, hi, causal):
    """Attention of q over keys lo..hi-1 only, masked as in the full problem."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    scores = np.einsum("bqhd,bkhd->bhqk", q, np.repeat(k, 2, axis=2)) / np.sqrt(q.shape[-1])
    keep = np.zeros((seqlen_q, seqlen_k), bool)
    keep[:, lo:hi] = True
    if causal:
        keep &= np.arange(seqlen_k)[None, :] <= np.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q
    s = np.where(keep, scores, -np.inf)
    top = s.max(-1, keepdims=True)
    seen = np.isfinite(top)
    p = np.where(seen, np.exp(s - np.where(seen, top, 0)), 0)
    total = p.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", p / np.where(seen, total, 1), np.repeat(v, 2, axis=2))
    lse = np.where(seen[..., 0], (top + np.log(np.where(seen, total, 1)))[..., 0], np.inf)
    return out, lse


def test_merging_empty_parts():
    out = np.ones((2, 1, 1, 1, 3))
    lse = np.array([np.inf, -np.inf]).reshape(2, 1, 1, 1)
    merged_out, merged_lse = merge_states_reference(out, lse)
    assert (merged_out == 0).all() and np.isposinf(merged_lse).all()
    lse = np.array([np.inf, 0.5]).reshape(2, 1, 1, 1)
    out[1] = 7.0
    merged_out, merged_lse = merge_states_reference(out, lse)
    assert (merged_out == 7.0).all() and (merged_lse == 0.5).all()
