"""cuflash.attention_with_kvcache and cuflash.merge_states on the CPU path against the
float64 oracle (cuflash.reference_kvcache): the output, the LSE, and the caches the call
writes in place."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash
from cuflash.reference_kvcache import attention_kvcache_reference, merge_states_reference

from .strategies import assert_close, assert_lse_close, check_paged_is_bitwise_contiguous, kvcache_calls, paged_caches

TOLERANCE = {np.float32: 2e-5, np.float16: 4e-3}


def make_call(c: dict, dtype, rng):
    """(q, k_cache, v_cache, k, v, keywords) of the drawn call ``c``: caches contiguous
    (one per sequence, or picked by cache_batch_idx) or, with a page size, in shuffled
    pages with a block table."""
    batch, nheads_k, d = c["batch"], c["nheads_k"], c["d"]
    q = rng.standard_normal((batch, c["seqlen_q"], c["nheads"], d)).astype(dtype)
    kw = dict(cache_seqlens=np.array(c["lengths"], np.int32), causal=c["causal"], window_size=c["window"],
              softcap=c["softcap"])
    if c["page_size"]:
        kw["block_table"], k_cache, v_cache, _, _ = paged_caches(rng, batch, c["capacity"], c["page_size"], nheads_k,
                                                                 d, dtype, spare=2)
    else:
        caches = batch + 2 if c["batch_idx"] else batch
        k_cache, v_cache = (rng.standard_normal((caches, c["capacity"], nheads_k, d)).astype(dtype) for _ in "kv")
        if c["batch_idx"]:
            kw["cache_batch_idx"] = rng.permutation(caches)[:batch].astype(np.int32)
    k = v = None
    if c["seqlen_new"]:
        k, v = (rng.standard_normal((batch, c["seqlen_new"], nheads_k, d)).astype(dtype) for _ in "kv")
    if any(c["leftpads"]):
        kw["cache_leftpad"] = np.array(c["leftpads"], np.int32)
    if c["rotary_dim"]:
        angle = rng.uniform(0, 2 * np.pi, (c["capacity"] + c["seqlen_q"], c["rotary_dim"] // 2))
        kw.update(rotary_cos=np.cos(angle).astype(np.float32), rotary_sin=np.sin(angle).astype(np.float32),
                  rotary_interleaved=c["interleaved"])
    if c["alibi"]:
        kw["alibi_slopes"] = rng.uniform(0, 0.5, (batch, c["nheads"])).astype(np.float32)
    return q, k_cache, v_cache, k, v, kw


def check_call(c: dict, dtype):
    rng = np.random.default_rng(c["seed"])
    q, k_cache, v_cache, k, v, kw = make_call(c, dtype, rng)
    want_out, want_lse, want_k, want_v = attention_kvcache_reference(q, k_cache, v_cache, k, v, **kw)
    out, lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, k, v, return_lse=True, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.dtype == np.float32
    tol = TOLERANCE[dtype]
    assert_close(out, want_out, atol=tol * (1 + np.abs(want_out).max(initial=0)), name="out")
    assert_lse_close(lse, want_lse, atol=4 * tol)
    # The append: values bitwise, rotated keys within one rounding of the float64 rotation.
    assert (v_cache == want_v).all()
    ulp = np.spacing(np.abs(want_k).astype(dtype)).astype(np.float64)
    assert (np.abs(k_cache.astype(np.float64) - want_k.astype(np.float64)) <= ulp + 1e-6).all()


@settings(deadline=None, max_examples=150)
@given(call=kvcache_calls(), dtype=st.sampled_from([np.float32, np.float16]))
def test_matches_the_oracle(call, dtype):
    check_call(call, dtype)


@settings(deadline=None, max_examples=100)
@given(call=kvcache_calls(paged=True), dtype=st.sampled_from([np.float32, np.float16]))
def test_paged_caches_match_the_oracle(call, dtype):
    check_call(call, dtype)


@pytest.mark.parametrize("page_size", [1, 3, 16, 17, 64, 256])
def test_paged_is_bitwise_the_contiguous_call(page_size):
    check_paged_is_bitwise_contiguous(np, page_size, capacity=300, nheads=4, nheads_k=2, d=32)


def test_decoding_token_by_token_is_attention_over_the_whole_sequence():
    """Append one token a step, each attending to the cache so far: the outputs are the
    rows of one causal attention over the whole sequence."""
    rng = np.random.default_rng(1)
    steps, nheads, nheads_k, d = 9, 4, 2, 16
    q, k, v = (rng.standard_normal((1, steps, h, d)).astype(np.float32) for h in (nheads, nheads_k, nheads_k))
    k_cache, v_cache = np.zeros((1, 12, nheads_k, d), np.float32), np.zeros((1, 12, nheads_k, d), np.float32)
    want = cuflash.attention(q, k, v, causal=True)
    for t in range(steps):
        out = cuflash.attention_with_kvcache(q[:, t:t + 1], k_cache, v_cache, k[:, t:t + 1], v[:, t:t + 1],
                                             cache_seqlens=t, causal=True)
        assert_close(out[:, 0], want[:, t], atol=1e-5)
    assert (k_cache[:, :steps] == k[:, :steps]).all() and (k_cache[:, steps:] == 0).all()


def test_num_splits_and_deterministic_change_nothing_here():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 2, 4, 8)).astype(np.float32)
    caches = [rng.standard_normal((2, 30, 2, 8)).astype(np.float32) for _ in "kv"]
    lens = np.array([17, 29], np.int32)
    results = [cuflash.attention_with_kvcache(q, *caches, cache_seqlens=lens, num_splits=n, deterministic=det)
               for n in (0, 1, 2, 7) for det in (False, True)]
    assert all((r == results[0]).all() for r in results)
    with pytest.raises(TypeError, match="deterministic"):
        cuflash.attention_with_kvcache(q, *caches, cache_seqlens=lens, deterministic=1)


def test_empty_sequences_give_zero_and_infinite_lse():
    q = np.ones((2, 1, 2, 8), np.float32)
    caches = [np.ones((2, 4, 1, 8), np.float32) for _ in "kv"]
    out, lse = cuflash.attention_with_kvcache(q, *caches, cache_seqlens=np.array([0, 3], np.int32),
                                              cache_leftpad=np.array([0, 3], np.int32), return_lse=True)
    assert (out == 0).all() and np.isposinf(lse).all()


@settings(deadline=None, max_examples=100)
@given(parts=st.integers(1, 4), dtype=st.sampled_from([np.float32, np.float16]), seed=st.integers(0, 2**32 - 1),
       stacked=st.booleans())
def test_merge_states_matches_the_oracle(parts, dtype, seed, stacked):
    rng = np.random.default_rng(seed)
    outs = rng.standard_normal((parts, 2, 3, 4, 8)).astype(dtype)
    lses = rng.uniform(-5, 5, (parts, 2, 4, 3)).astype(np.float32)
    lses[rng.random(lses.shape) < 0.3] = np.inf  # parts that saw no key of a row
    lses[rng.random(lses.shape) < 0.1] = -np.inf
    want_out, want_lse = merge_states_reference(outs, lses)
    out, lse = cuflash.merge_states(outs if stacked else list(outs), lses if stacked else list(lses))
    assert out.dtype == dtype and lse.dtype == np.float32
    assert_close(out, want_out, atol=TOLERANCE[dtype] * (1 + np.abs(want_out).max(initial=0)))
    assert_lse_close(lse, want_lse, atol=1e-5)


def test_merging_the_halves_of_a_kvcache_call():
    """Two calls over the two halves of a cache (the second with left padding), merged:
    the call over the whole cache, the way cascade attention is built."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 1, 4, 16)).astype(np.float32)
    caches = [rng.standard_normal((1, 40, 2, 16)).astype(np.float32) for _ in "kv"]
    whole = cuflash.attention_with_kvcache(q, *caches, cache_seqlens=40, return_lse=True)
    first = cuflash.attention_with_kvcache(q, *caches, cache_seqlens=25, return_lse=True)
    second = cuflash.attention_with_kvcache(q, *caches, cache_seqlens=40, return_lse=True,
                                            cache_leftpad=np.array([25], np.int32))
    out, lse = cuflash.merge_states([first[0], second[0]], [first[1], second[1]])
    assert_close(out, whole[0], atol=1e-5)
    assert_close(lse, whole[1], atol=1e-5)


@settings(deadline=None, max_examples=60)
@given(lengths=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 40)), min_size=1, max_size=4),
       page_size=st.sampled_from([1, 3, 16, 17]), causal=st.booleans(), window=st.sampled_from([(-1, -1), (3, 1)]),
       group=st.sampled_from([1, 3]), seed=st.integers(0, 2**32 - 1))
def test_paged_varlen_is_the_packed_varlen_call(lengths, page_size, causal, window, group, seed):
    """attention_varlen(block_table=...): each sequence's keys read from its pages give the
    packed call's output and LSE, on the rows of the pages it uses."""
    rng = np.random.default_rng(seed)
    nheads_k, d = 2, 8
    seqlens_q, seqlens_k = (np.array(x, np.int32) for x in zip(*lengths))
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (seqlens_q, seqlens_k))
    q = rng.standard_normal((cu_q[-1], nheads_k * group, d)).astype(np.float32)
    k, v = (rng.standard_normal((cu_k[-1], nheads_k, d)).astype(np.float32) for _ in "kv")
    max_blocks = max(1, -(-int(seqlens_k.max()) // page_size))
    pages = len(lengths) * max_blocks + 2
    table = rng.permutation(pages)[:len(lengths) * max_blocks].reshape(len(lengths), max_blocks).astype(np.int32)
    k_pages, v_pages = (np.full((pages, page_size, nheads_k, d), np.nan, np.float32) for _ in "kv")
    for b, n in enumerate(seqlens_k):
        for pool, x in ((k_pages, k), (v_pages, v)):
            rows = pool[table[b]].reshape(-1, nheads_k, d)
            rows[:n] = x[cu_k[b]:cu_k[b + 1]]
            pool[table[b]] = rows.reshape(max_blocks, page_size, nheads_k, d)
    kw = dict(causal=causal, window_size=window, return_lse=True)
    max_q, max_k = int(seqlens_q.max()), int(seqlens_k.max())
    want = cuflash.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
    got = cuflash.attention_varlen(q, k_pages, v_pages, cu_q, cu_k, max_q, max_k, block_table=table, **kw)
    assert (got[0] == want[0]).all() and (got[1] == want[1]).all()


def test_paged_varlen_checks():
    q = np.ones((3, 2, 8), np.float32)
    pool = np.ones((4, 2, 1, 8), np.float32)
    cu_q, cu_k = np.array([0, 1, 3], np.int32), np.array([0, 2, 7], np.int32)
    table = np.array([[0, 1], [2, 3]], np.int32)
    with pytest.raises(ValueError, match="sequence 1 has 5 keys"):
        cuflash.attention_varlen(q, pool, pool, cu_q, cu_k, 2, 5, block_table=table)  # (4 rows a sequence)
    with pytest.raises(ValueError, match="block_table must have shape"):
        cuflash.attention_varlen(q, pool, pool, cu_q, np.array([0, 2, 3], np.int32), 2, 3, block_table=table[:1])
    with pytest.raises(ValueError, match="must name pages"):
        cuflash.attention_varlen(q, pool, pool, cu_q, np.array([0, 2, 3], np.int32), 2, 3, block_table=table + 2)
    with pytest.raises(ValueError, match="k must be a page pool"):
        cuflash.attention_varlen(q, q, q, cu_q, cu_k, 2, 3, block_table=table)
    with pytest.raises(ValueError, match="dropout_p must be 0"):
        cuflash.attention_varlen(q, pool, pool, cu_q, cu_k, 2, 3, block_table=table, dropout_p=0.1)


def test_paged_varlen_of_empty_sequences():
    q = np.ones((0, 2, 8), np.float32)
    pool = np.ones((2, 4, 1, 8), np.float32)
    zeros = np.zeros(2, np.int32)
    out, lse = cuflash.attention_varlen(q, pool, pool, zeros, zeros, 0, 0, block_table=np.zeros((1, 1), np.int32),
                                        return_lse=True)
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_the_rotated_queries_are_rounded_to_the_input_dtype(interleaved, causal):
    """As flash-attn: q is rotated, then rounded to its dtype before the scores (the new keys
    too, on their way into the cache). On inputs whose rotation is exact in float32 (q and
    k multiples of 1/32 below 2, tables multiples of 1/128: every rotated value a multiple
    of 2^-12 below 4, more bits than float16 keeps), the call with rotary tables gives the
    bits of the call without them on q and k rotated and rounded to float16 beforehand."""
    from cuflash.reference_kvcache import apply_rotary
    rng = np.random.default_rng(2 * causal + interleaved)
    batch, seqlen, nheads, nheads_k, d, capacity = 2, 3, 4, 2, 32, 40
    q = (rng.integers(-64, 64, (batch, seqlen, nheads, d)) / 32).astype(np.float16)
    k, v = ((rng.integers(-64, 64, (batch, seqlen, nheads_k, d)) / 32).astype(np.float16) for _ in "kv")
    caches = [rng.standard_normal((batch, capacity, nheads_k, d)).astype(np.float16) for _ in "kv"]
    cos, sin = ((rng.integers(-128, 129, (capacity + seqlen, 12)) / 128).astype(np.float32) for _ in "cs")
    lengths = np.array([0, 17], np.int32)
    kw = dict(cache_seqlens=lengths, causal=causal, return_lse=True)
    rotated_caches = [x.copy() for x in caches]
    out, lse = cuflash.attention_with_kvcache(q, *rotated_caches, k, v, rotary_cos=cos, rotary_sin=sin,
                                              rotary_interleaved=interleaved, **kw)
    q_pre, k_pre = np.empty_like(q), np.empty_like(k)
    for b, n in enumerate(lengths):
        q_at = np.arange(n, n + seqlen) if causal else np.full(seqlen, n)
        q_pre[b] = apply_rotary(q[b], cos, sin, q_at, interleaved).astype(np.float16)
        k_pre[b] = apply_rotary(k[b], cos, sin, np.arange(n, n + seqlen), interleaved).astype(np.float16)
    assert not (q_pre == q).all()
    want, want_lse = cuflash.attention_with_kvcache(q_pre, *caches, k_pre, v, **kw)
    assert (out.view(np.uint16) == want.view(np.uint16)).all() and (lse.view(np.uint32) == want_lse.view(np.uint32)).all()
    assert all((got.view(np.uint16) == cache.view(np.uint16)).all() for got, cache in zip(rotated_caches, caches))
