"""flash-attn's tolerance rule, the one every GPU test applies, and inputs on which a lost
key tile cannot hide.

The rule: max|out - ref64| <= 2 * max|out_lowp - ref64| + floor, where ref64 is the float64
oracle, out_lowp a plain attention rounded to the input dtype at every stage
(cuflash.reference.attention_lowp) and floor half an ulp at 1 of the dtype; 3x for
gradients, whose floor is one ulp at the gradient's scale. The LSE (fp32 arithmetic on
exact inputs) within LSE_ATOL + LSE_RTOL |lse|. NaN and +-inf positions must match
(strategies.assert_close).

A random input spreads its softmax over every key, so dropping a few keys out of thousands
moves the output by less than the rule allows. ``tile_marked`` builds inputs whose scores
are all equal (q = 0: every visible key weighs the same, LSE = log of their count) and whose
values are one-hot per run of RUN keys (run r of kv head h: feature (r + h) mod d holds
MARK): a lost run of n keys of N moves one output feature by MARK * n / N (half that when it
straddles two runs) and the LSE by -log(1 - n / N), so the rule catches it
(``tests/test_rule.py`` drops key tiles from the oracle's inputs and shows it).
"""
import numpy as np

from cuflash.reference import attention_lowp, attention_reference, normalized_window, round_to
from cuflash.reference_kvcache import apply_rotary, attention_kvcache_reference, cache_rows, merge_states_reference

from .strategies import assert_close

# Half an ulp at 1 of the dtype (float32: the merge kernel's parts in float32).
FLOOR = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-16}
LSE_ATOL, LSE_RTOL = 1e-3, 1e-5  # LSE is fp32 arithmetic on exact low-precision inputs

RUN, MARK = 256, 256.0  # keys a one-hot run; its value (exact in fp16 and bf16)


def dtype_name(x) -> str:
    """"float16", "bfloat16" or "float32" of a NumPy, CuPy or torch array."""
    return str(x.dtype).removeprefix("torch.")


def _host64(x):
    return np.asarray(x.get() if hasattr(x, "get") else x, dtype=np.float64)


def lowp_error(lowp, ref) -> float:
    """max|lowp - ref| over the finite positions of ref (0 for an empty array)."""
    lowp, ref = _host64(lowp), _host64(ref)
    finite = np.isfinite(ref)
    return float(np.abs(np.where(finite, lowp - ref, 0.0)).max(initial=0.0))


def check_output(got, ref, lowp_err: float, dtype: str, name="out") -> None:
    """The rule for an output: within 2 * lowp_err + the dtype's floor."""
    assert_close(got, ref, atol=2 * lowp_err + FLOOR[dtype], name=name)


def check_lse(got, ref, name="lse") -> None:
    assert_close(got, ref, atol=LSE_ATOL, rtol=LSE_RTOL, name=name)


def check_gradient(got, ref, lowp, dtype: str, name: str, slack: float = 0.0) -> None:
    """The rule for a gradient: within 3 * its lowp error + one ulp at its scale (+ slack)."""
    if not ref.size:
        return
    scale = float(np.abs(_host64(ref)).max())
    assert_close(got, ref, atol=3 * lowp_error(lowp, ref) + 2 * FLOOR[dtype] * (1.0 + scale) + slack, name=name)


def check_attention(q, k, v, out, lse, **options) -> None:
    """out and lse of a dense call against the oracle by the rule (NumPy or CuPy arrays;
    ``options`` as cuflash.reference takes them)."""
    ref, ref_lse = attention_reference(q, k, v, **options)
    check_output(out, ref, lowp_error(attention_lowp(q, k, v, **options), ref), dtype_name(q))
    check_lse(lse, ref_lse)


# --- the KV-cache call and merge_states ---------------------------------------------------------


def kvcache_lowp_error(q, k_cache, v_cache, kw: dict) -> float:
    """The lowp yardstick of a KV-cache call: over each sequence's keys in the caches as the
    call leaves them (the oracle's), plain attention in q's dtype (the rotated queries
    rounded to it) against float64 with the same mask."""
    table = kw.get("block_table")
    page_size = k_cache.shape[1] if table is not None else None
    lengths = np.broadcast_to(np.asarray(kw["cache_seqlens"]), (q.shape[0],))
    new = kw.get("seqlen_new", 0)
    leftpad = kw.get("cache_leftpad")
    alibi = kw.get("alibi_slopes")
    q = rotated_queries(q, kw, capacity_of(k_cache, kw))
    error = 0.0
    for b in range(q.shape[0]):
        rows = cache_rows(b, np.arange(0 if leftpad is None else int(leftpad[b]), int(lengths[b]) + new),
                          kw.get("cache_batch_idx"), table, page_size)
        options = dict(causal=kw.get("causal", False), window_size=kw.get("window_size", (-1, -1)),
                       softcap=kw.get("softcap", 0.0), softmax_scale=kw.get("softmax_scale"),
                       alibi_slopes=None if alibi is None else (alibi if alibi.ndim == 1 else alibi[b]))
        args = (q[b][None], k_cache[rows][None], v_cache[rows][None])
        ref, _ = attention_reference(*args, **options)
        error = max(error, lowp_error(attention_lowp(*args, **options), ref))
    return error


def check_kvcache(q, k_cache, v_cache, k, v, kw: dict, out, lse):
    """out and lse of a KV-cache call (its NumPy inputs as they were before it) against
    the oracle by the rule. Returns the caches the oracle leaves (the append made).

    The oracle sees the rotated queries as the kernels read them, rounded to q's dtype
    (flash-attn's contract); unrounded, they would move a bf16 LSE by about 2^-9 |score|."""
    kw = {name: x for name, x in kw.items() if name not in ("num_splits", "deterministic")}
    _, _, want_k, want_v = attention_kvcache_reference(q, k_cache, v_cache, k, v, **kw)
    new = 0 if k is None else k.shape[1]
    attend = {name: x for name, x in kw.items() if name not in ("rotary_cos", "rotary_sin", "rotary_interleaved")}
    attend["cache_seqlens"] = np.broadcast_to(np.asarray(kw["cache_seqlens"]), (q.shape[0],)) + new
    want, want_lse, _, _ = attention_kvcache_reference(rotated_queries(q, kw, capacity_of(k_cache, kw)), want_k,
                                                       want_v, **attend)
    yardstick = kvcache_lowp_error(q, want_k, want_v, dict(kw, seqlen_new=new))
    check_output(out, want, yardstick, dtype_name(q))
    check_lse(lse, want_lse)
    return want_k, want_v


def capacity_of(k_cache, kw: dict) -> int:
    table = kw.get("block_table")
    return k_cache.shape[1] * (table.shape[1] if table is not None else 1)


def rotated_queries(q, kw: dict, capacity: int):
    """q as a KV-cache call with rotary tables attends with it: each sequence's queries
    rotated at their positions (cuflash.reference_kvcache) and rounded to q's dtype."""
    if kw.get("rotary_cos") is None:
        return q
    lengths = np.broadcast_to(np.asarray(kw["cache_seqlens"]), (q.shape[0],))
    local = normalized_window(kw.get("window_size", (-1, -1)), kw.get("causal", False), capacity) != (-1, -1)
    rotated = np.empty(q.shape, np.float32)
    for b, n in enumerate(lengths.tolist()):
        positions = np.arange(n, n + q.shape[1]) if local else np.full(q.shape[1], n)
        rotated[b] = apply_rotary(q[b], kw["rotary_cos"], kw["rotary_sin"], positions,
                                  kw.get("rotary_interleaved", True)).astype(np.float32)
    return rotated.astype(q.dtype)


def check_merge(outs, lses, out, lse) -> None:
    """merge_states' out and lse against the oracle by the rule; the lowp yardstick is the
    oracle's result stored in the parts' dtype."""
    want, want_lse = merge_states_reference(_host64(outs), _host64(lses))
    dtype = dtype_name(outs)
    check_output(out, want, lowp_error(round_to(want.astype(np.float32), dtype), want), dtype)
    check_lse(lse, want_lse)


# --- inputs on which every key tile counts ------------------------------------------------------


def tile_marked_values(seqlen, nheads_kv, d, dtype, xp=np):
    """(seqlen, nheads_kv, d) values: key j of kv head h holds MARK in feature
    (j // RUN + h) % d, 0 elsewhere."""
    runs = (xp.arange(seqlen)[:, None] // RUN + xp.arange(nheads_kv)[None, :]) % d
    values = (runs[..., None] == xp.arange(d)).astype(xp.float32) * MARK
    return values.astype(dtype)


def tile_marked(batch, seqlen_q, seqlen_k, nheads, nheads_kv, d, dtype, rng, xp=np):
    """Dense (q, k, v) on which a lost key tile fails the rule: q = 0 (every visible key
    the same weight), k drawn (it must not matter), v ``tile_marked_values`` (each batch
    element's runs shifted by a drawn offset)."""
    q = xp.zeros((batch, seqlen_q, nheads, d), dtype=xp.float32).astype(dtype)
    k = xp.asarray(rng.standard_normal((batch, seqlen_k, nheads_kv, d)).astype(np.float32)).astype(dtype)
    shift = int(rng.integers(RUN))
    marked = tile_marked_values(seqlen_k + shift + batch, nheads_kv, d, dtype, xp)
    v = xp.stack([marked[shift + b:shift + b + seqlen_k] for b in range(batch)])
    return q, k, v


def tile_marked_cache(rng, lengths, capacity, nheads, nheads_k, d, dtype, seqlen_q=1, page_size=0):
    """(q, k_cache, v_cache, keywords) of a KV-cache call (NumPy) on which a lost key tile
    fails the rule: q = 0, sequence b's first lengths[b] cache rows hold drawn keys and
    ``tile_marked_values`` (shifted by b), every other row NaN (never to be read);
    contiguous, or in shuffled pages of ``page_size`` rows with a block table."""
    batch = len(lengths)
    q = np.zeros((batch, seqlen_q, nheads, d), dtype)
    rows = -(-capacity // page_size) * page_size if page_size else capacity
    k_dense = np.full((batch, rows, nheads_k, d), np.nan, np.float32)
    v_dense = k_dense.copy()
    marked = tile_marked_values(max(lengths) + batch, nheads_k, d, np.float32)
    for b, n in enumerate(lengths):
        k_dense[b, :n] = rng.standard_normal((n, nheads_k, d))
        v_dense[b, :n] = marked[b:b + n]
    kw = dict(cache_seqlens=np.array(lengths, np.int32))
    if not page_size:
        return q, k_dense[:, :capacity].astype(dtype), v_dense[:, :capacity].astype(dtype), kw
    per_seq = rows // page_size
    kw["block_table"] = rng.permutation(batch * per_seq + 2)[:batch * per_seq].reshape(batch, per_seq).astype(np.int32)
    pools = []
    for dense in (k_dense, v_dense):
        pool = np.full((batch * per_seq + 2, page_size, nheads_k, d), np.nan, np.float32)
        pool[kw["block_table"]] = dense.reshape(batch, per_seq, page_size, nheads_k, d)
        pools.append(pool.astype(dtype))
    return q, *pools, kw
