"""The KV-cache call and merge_states on the GPU (decode/split_kv.cu, decode/merge.cu)
against the float64 oracle (cuflash.reference_kvcache) by flash-attn's rule (tests/rule.py):
the output and the LSE, outputs in NaN-poisoned memory, and the cache rows the call writes;
inputs on which a lost key tile fails, up to 128k keys, pages of 1 to 256 rows, every split
count and both merge steps; paged against contiguous, rows that must never be read filled
with NaN, CUDA-graph replay with growing lengths."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cuflash
from cuflash.reference_kvcache import attention_kvcache_reference

from .rule import (check_attention, check_kvcache, check_lse, check_merge, check_output, kvcache_lowp_error,
                   tile_marked_cache)
from .strategies import check_paged_is_bitwise_contiguous, kvcache_calls, paged_caches
from .test_gpu_forward import cupy_dtype, poisoned_allocations

pytestmark = pytest.mark.gpu


def small_calls(paged: bool):
    """kvcache_calls past one tile: capacities up to 200, head dims 4 to 64."""
    return kvcache_calls(paged=paged, max_capacity=200, headdims=(4, 8, 12, 32, 59, 64))


@st.composite
def long_calls(draw):
    """kvcache_calls' options at sizes of several key tiles and splits: head dims of every
    bucket (and unaligned ones), GQA groups that fill a row block and more, drawn windows."""
    c = draw(kvcache_calls(paged=draw(st.booleans()), max_capacity=700, headdims=(32, 59, 64, 96, 128, 160, 256)))
    c["nheads"] = c["nheads_k"] * draw(st.sampled_from([1, 4, 8]))
    if c["rotary_dim"]:
        c["rotary_dim"] = draw(st.sampled_from([2, 16, c["d"] // 2 * 2]))
    if c["page_size"]:
        c["page_size"] = draw(st.sampled_from([1, 3, 16, 17, 24, 63, 65, 256]))
    c["num_splits"] = draw(st.sampled_from([0, 1, 2, 3, 7]))
    return c


def make_call(c: dict, dtype: str, rng, nan_outside=False):
    """(q, k_cache, v_cache, k, v, keywords) of the drawn call ``c`` as NumPy arrays of
    ``dtype`` (the oracle's inputs); with ``nan_outside`` every cache row the call must not
    read holds NaN."""
    np_dtype = cupy_dtype(dtype)
    batch, nheads_k, d = c["batch"], c["nheads_k"], c["d"]

    def normal(*shape):
        return rng.standard_normal(shape).astype(np_dtype)

    q = normal(batch, c["seqlen_q"], c["nheads"], d)
    kw = dict(cache_seqlens=np.array(c["lengths"], np.int32), causal=c["causal"], window_size=c["window"],
              softcap=c["softcap"], num_splits=c.get("num_splits", 0))
    if c["page_size"]:
        table, k_cache, v_cache, _, _ = paged_caches(rng, batch, c["capacity"], c["page_size"], nheads_k, d,
                                                     np.float32, spare=2)
        k_cache, v_cache = k_cache.astype(np_dtype), v_cache.astype(np_dtype)
        kw["block_table"] = table
    else:
        caches = batch + 2 if c["batch_idx"] else batch
        k_cache, v_cache = normal(caches, c["capacity"], nheads_k, d), normal(caches, c["capacity"], nheads_k, d)
        if c["batch_idx"]:
            kw["cache_batch_idx"] = rng.permutation(caches)[:batch].astype(np.int32)
    k = v = None
    if c["seqlen_new"]:
        k, v = normal(batch, c["seqlen_new"], nheads_k, d), normal(batch, c["seqlen_new"], nheads_k, d)
    if any(c["leftpads"]):
        kw["cache_leftpad"] = np.array(c["leftpads"], np.int32)
    if c["rotary_dim"]:
        angle = rng.uniform(0, 2 * np.pi, (c["capacity"] + c["seqlen_q"], c["rotary_dim"] // 2))
        table_dtype = np.float32 if rng.random() < 0.5 else np_dtype
        kw.update(rotary_cos=np.cos(angle).astype(table_dtype), rotary_sin=np.sin(angle).astype(table_dtype),
                  rotary_interleaved=c["interleaved"])
    if c["alibi"]:
        kw["alibi_slopes"] = rng.uniform(0, 0.5, (batch, c["nheads"])).astype(np.float32)
    if nan_outside:
        for b in range(batch):
            for cache in (k_cache, v_cache):
                keep = cache_rows_of(kw, b, c["leftpads"][b], c["lengths"][b], cache.shape[1])
                saved = cache[keep].copy()
                if "block_table" in kw:
                    cache[kw["block_table"][b]] = np.nan
                else:
                    cache[kw.get("cache_batch_idx", np.arange(batch))[b]] = np.nan
                cache[keep] = saved
    return q, k_cache, v_cache, k, v, kw


def cache_rows_of(kw, b, begin, end, page_size):
    """Index of rows [begin, end) of sequence b's cache (contiguous or paged)."""
    from cuflash.reference_kvcache import cache_rows
    return cache_rows(b, np.arange(begin, end), kw.get("cache_batch_idx"), kw.get("block_table"), page_size)


def on_gpu(x):
    import cupy
    return cupy.asarray(x) if isinstance(x, np.ndarray) else x


def run(q, k_cache, v_cache, k, v, kw):
    """The GPU call on CuPy copies: (out, lse, k_cache, v_cache) back on the host."""
    import cupy
    args = [on_gpu(x) for x in (q, k_cache, v_cache, k, v)]
    with poisoned_allocations():
        out, lse = cuflash.attention_with_kvcache(*args, return_lse=True,
                                                  **{n: on_gpu(x) for n, x in kw.items()})
    assert type(out) is cupy.ndarray and out.dtype == args[0].dtype and out.shape == q.shape
    return out.get(), lse.get(), args[1].get(), args[2].get()


def check(c: dict, dtype: str, nan_outside=False):
    rng = np.random.default_rng(c["seed"])
    q, k_cache, v_cache, k, v, kw = make_call(c, dtype, rng, nan_outside)
    out, lse, got_k, got_v = run(q, k_cache, v_cache, k, v, kw)
    want_k, want_v = check_kvcache(q, k_cache, v_cache, k, v, kw, out, lse)
    check_appended(got_k, got_v, want_k, want_v, dtype)


def check_appended(got_k, got_v, want_k, want_v, dtype: str) -> None:
    """The append: values bitwise, rotated keys within one rounding of the float64 rotation;
    every other row untouched (NaN included). NumPy arrays of 16-bit floats."""
    np.testing.assert_array_equal(got_v.view(np.uint16), want_v.view(np.uint16))
    want_k64, got_k64 = want_k.astype(np.float64), got_k.astype(np.float64)
    # (one unit in the last place of the dtype; fp16's subnormals are 2**-24 apart)
    ulp = np.maximum(np.spacing(np.abs(want_k).astype(np.float32)) * (2.0**13 if dtype == "float16" else 2.0**16),
                     2.0**-24)
    same = (got_k.view(np.uint16) == want_k.view(np.uint16)) | (np.abs(got_k64 - want_k64) <= ulp)
    assert same.all(), "k_cache"


@settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(call=small_calls(paged=False) | small_calls(paged=True), dtype=st.sampled_from(["float16", "bfloat16"]))
def test_small_calls_match_the_oracle(call, dtype):
    check(call, dtype)


@settings(deadline=None, max_examples=120, suppress_health_check=[HealthCheck.too_slow])
@given(call=long_calls(), dtype=st.sampled_from(["float16", "bfloat16"]))
def test_long_calls_match_the_oracle(call, dtype):
    check(call, dtype)


@pytest.fixture(params=["cluster", "merge kernel"])
def merge_step(request):
    """Where a split call's parts merge: in the splits' thread block cluster (the default
    from sm_90) or in the merge kernel (before sm_90, and with CUFLASH_PORTABLE). The
    planned calls are forgotten on both sides of the test (experiment.override)."""
    from cuflash import _device, experiment
    if request.param == "cluster" and _device.facts(0).capability < (9, 0):
        pytest.skip("thread block clusters need compute capability 9.0")
    with experiment.override(clusters=None if request.param == "cluster" else False):
        yield request.param


@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(call=long_calls(), dtype=st.sampled_from(["float16", "bfloat16"]))
def test_both_merge_steps_match_the_oracle(merge_step, call, dtype):
    check({**call, "num_splits": max(call.get("num_splits", 0), 2)}, dtype)


@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(call=long_calls(), dtype=st.sampled_from(["float16", "bfloat16"]))
def test_rows_outside_the_sequences_are_never_read(call, dtype):
    """Cache rows past a sequence's length, before its left padding and in the unused rows
    of its pages hold NaN (as freshly allocated caches may): nothing of it reaches out."""
    check(call, dtype, nan_outside=True)


# (keys, page size, num_splits): at 200 and 700 keys one lost key fails, at 20k a lost tile
# of 64 keys, at 128k one of 128 (tests/test_rule.py); contiguous and in pages of 1, 16, 17 and 256 rows, split
# counts from 1 to 16 and the planner's.
TILE_CASES = [(n, page, splits) for n in (200, 700, 20000, 131072)
              for page, splits in ((0, 0), (1, 3), (16, 16), (17, 7), (256, 1))]


@pytest.mark.parametrize("seqlen_k,page_size,num_splits", TILE_CASES)
def test_every_key_tile_counts(merge_step, seqlen_k, page_size, num_splits):
    """Inputs on which a lost key tile, page or split fails the rule (tests/rule.py,
    tile_marked_cache: every key weighs the same, each run of keys marks its own feature,
    rows past the lengths NaN): two sequences, GQA 4:1, two queries, causal or not."""
    dtype = "bfloat16" if (seqlen_k + page_size) % 2 else "float16"
    rng = np.random.default_rng(seqlen_k + page_size)
    q, k_cache, v_cache, kw = tile_marked_cache(rng, [seqlen_k, seqlen_k - 37], seqlen_k, 8, 2, 64,
                                                cupy_dtype(dtype), seqlen_q=2, page_size=page_size)
    kw.update(num_splits=num_splits, causal=num_splits % 2 == 1)
    out, lse, _, _ = run(q, k_cache, v_cache, None, None, kw)
    check_kvcache(q, k_cache, v_cache, None, None, kw, out, lse)


def decode_case(rng, dtype="bfloat16", batch=3, capacity=1000, nheads=8, nheads_k=2, d=128, seqlen_q=1):
    import cupy
    np_dtype = cupy_dtype(dtype)
    q = cupy.asarray(rng.standard_normal((batch, seqlen_q, nheads, d)).astype(np_dtype))
    k_cache, v_cache = (cupy.asarray(rng.standard_normal((batch, capacity, nheads_k, d)).astype(np_dtype))
                        for _ in "kv")
    lengths = cupy.asarray(rng.integers(1, capacity - seqlen_q, batch).astype(np.int32))
    return q, k_cache, v_cache, lengths


@pytest.mark.parametrize("page_size", [1, 3, 8, 16, 17, 24, 63, 65, 256])
def test_paged_is_bitwise_the_contiguous_call(page_size):
    import cupy
    check_paged_is_bitwise_contiguous(cupy, page_size, capacity=600, nheads=8, nheads_k=2, d=64, num_splits=3)


@pytest.mark.parametrize("page_size", [8, 16, 256])
def test_paged_is_bitwise_the_contiguous_call_on_the_wide_tile(page_size):
    """An unsplit grid of 128 CTAs: the eight-warp tile, over pages that are whole runs of
    8 rows as over the contiguous cache. (Other pages go to the four-warp tile, whose
    bits the contiguous call has with num_splits > 1 or deterministic=True.)"""
    import cupy
    check_paged_is_bitwise_contiguous(cupy, page_size, capacity=700, nheads=32, nheads_k=8, d=128, batch=16,
                                      num_splits=1)


def oracle_of(q, k_cache, v_cache, **kw):
    """(out, lse, lowp yardstick) of a call without an append on these CuPy arrays."""
    host = [x.get() for x in (q, k_cache, v_cache)]
    kw = {name: x.get() if hasattr(x, "get") else x for name, x in kw.items()}
    want, want_lse, _, _ = attention_kvcache_reference(*host, **kw)
    return want, want_lse, kvcache_lowp_error(*host, kw)


def check_against(oracle, out, lse, name="out") -> None:
    want, want_lse, yardstick = oracle
    check_output(out, want, yardstick, str(out.dtype), name=name)
    check_lse(lse, want_lse, name=f"lse of {name}")


@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_every_split_count_matches_the_oracle_and_each_is_reproducible(merge_step, seqlen_q):
    rng = np.random.default_rng(seqlen_q)
    q, k_cache, v_cache, lengths = decode_case(rng, seqlen_q=seqlen_q)
    oracle = oracle_of(q, k_cache, v_cache, cache_seqlens=lengths, causal=True)
    for splits in (1, 2, 7, 16, 0, 40):
        with poisoned_allocations():
            runs = [cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True,
                                                   num_splits=splits, return_lse=True) for _ in range(2)]
        assert (runs[0][0] == runs[1][0]).all() and (runs[0][1] == runs[1][1]).all(), splits
        check_against(oracle, *runs[0], name=f"{splits} splits")


@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_deterministic_results_depend_on_neither_splits_nor_the_batch(seqlen_q):
    """deterministic=True: each sequence's output and LSE are the same whatever num_splits,
    and whether it shares the batch with sequences of other lengths or runs alone in a
    cache of another capacity; within rounding of the default call."""
    import cupy
    rng = np.random.default_rng(10 + seqlen_q)
    q, k_cache, v_cache, _ = decode_case(rng, batch=5, capacity=9000, seqlen_q=seqlen_q)
    lengths = cupy.asarray(np.array([5000, 1, 77, 9000 - seqlen_q, 999], np.int32))
    kw = dict(causal=True, return_lse=True, deterministic=True)
    with poisoned_allocations():
        out, lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, **kw)
    for splits in (1, 3, 16, 200):
        again = cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, num_splits=splits, **kw)
        assert (again[0] == out).all() and (again[1] == lse).all(), splits
    for b in range(5):
        roomier = [cupy.zeros((1, 12000, *c.shape[2:]), c.dtype) for c in (k_cache, v_cache)]
        for room, c in zip(roomier, (k_cache, v_cache)):
            room[:, :9000] = c[b]
        alone = cuflash.attention_with_kvcache(q[b:b + 1], *roomier, cache_seqlens=lengths[b:b + 1], **kw)
        assert (alone[0] == out[b:b + 1]).all() and (alone[1] == lse[b:b + 1]).all(), b
    with poisoned_allocations():
        default = cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True,
                                                 return_lse=True)
    oracle = oracle_of(q, k_cache, v_cache, cache_seqlens=lengths, causal=True)
    check_against(oracle, out, lse, name="deterministic")
    check_against(oracle, *default, name="default")


@pytest.mark.parametrize("length", [0, 1, 63, 64, 65, 999, 1000])
def test_lengths_at_the_edges(length):
    """Empty, one key, a tile +- 1, a full cache (capacity 1000)."""
    import cupy
    rng = np.random.default_rng(length)
    q, k_cache, v_cache, _ = decode_case(rng, batch=2)
    lengths = cupy.asarray(np.array([length, 1000 - length], np.int32))
    with poisoned_allocations():
        out, lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, return_lse=True)
    check_against(oracle_of(q, k_cache, v_cache, cache_seqlens=lengths), out, lse)


def test_warm_calls_are_checked_like_the_first():
    """A warm KV-cache call (its signature's checks and launch remembered) reads its own
    arrays, keys an int cache_seqlens by value, and still refuses a value equal to a valid
    one but of another type."""
    import cupy
    rng = np.random.default_rng(9)
    q, k_cache, v_cache, _ = decode_case(rng, batch=1)
    for length, num_splits in ((10, 1), (10, 1), (700, 1), (700, 1), (700, 3), (700, 3)):
        q = cupy.asarray(rng.standard_normal(q.shape).astype(q.dtype))
        with poisoned_allocations():
            out, lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=length,
                                                      num_splits=num_splits, return_lse=True)
        check_against(oracle_of(q, k_cache, v_cache, cache_seqlens=np.array([length], np.int32)), out, lse)
    with pytest.raises(TypeError, match="num_splits must be an integer"):
        cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=700, num_splits=True)


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_cuda_graph_replays_with_growing_lengths(deterministic):
    """One captured decode step (append one token, attend), replayed while cache_seqlens
    grows on the device: each replay is the eager call at that length. (On sm_90 the
    default call's splits merge in a cluster, the deterministic call's in the merge kernel,
    launched as a programmatic dependent of the split kernel.)"""
    torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")
    import cuflash.torch
    gen = torch.Generator(device="cuda").manual_seed(0)
    batch, capacity, nheads, nheads_k, d = 2, 300, 8, 2, 64

    def normal(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    k_cache, v_cache = normal(batch, capacity, nheads_k, d), normal(batch, capacity, nheads_k, d)
    angle = torch.rand(capacity + 1, d // 4, device="cuda", generator=gen) * 6
    cos, sin = angle.cos(), angle.sin()
    q, k, v = normal(batch, 1, nheads, d), normal(batch, 1, nheads_k, d), normal(batch, 1, nheads_k, d)
    lengths = torch.tensor([5, 100], device="cuda", dtype=torch.int32)
    caches0 = (k_cache.clone(), v_cache.clone())

    def step():
        return cuflash.torch.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                                    rotary_cos=cos, rotary_sin=sin, causal=True,
                                                    deterministic=deterministic)

    step()  # compile and load outside the capture
    k_cache.copy_(caches0[0]), v_cache.copy_(caches0[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    k_eager, v_eager = caches0[0].clone(), caches0[1].clone()
    k_cache.copy_(caches0[0]), v_cache.copy_(caches0[1])
    for _ in range(6):
        graph.replay()
        want = cuflash.torch.attention_with_kvcache(q, k_eager, v_eager, k, v, cache_seqlens=lengths,
                                                    rotary_cos=cos, rotary_sin=sin, causal=True,
                                                    deterministic=deterministic)
        assert torch.equal(out, want) and torch.equal(k_cache, k_eager) and torch.equal(v_cache, v_eager)
        lengths += 1


def test_torch_and_flash_attn_interface_on_the_gpu():
    torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")
    from cuflash.flash_attn_interface import flash_attn_with_kvcache
    rng = np.random.default_rng(5)
    q, k_cache, v_cache, lengths = decode_case(rng, dtype="float16", seqlen_q=2)
    t = [torch.as_tensor(x, device="cuda") for x in (q, k_cache, v_cache, lengths)]
    out, lse = flash_attn_with_kvcache(t[0], t[1], t[2], cache_seqlens=t[3], causal=True, return_softmax_lse=True)
    with poisoned_allocations():
        want, want_lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True,
                                                        return_lse=True)
    check_against(oracle_of(q, k_cache, v_cache, cache_seqlens=lengths, causal=True), want, want_lse)
    assert torch.equal(out, torch.as_tensor(want, device="cuda")) and torch.equal(lse, torch.as_tensor(want_lse))


@settings(deadline=None, max_examples=60)
@given(parts=st.integers(1, 9), dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
       d=st.sampled_from([1, 8, 59, 128, 256]), seed=st.integers(0, 2**32 - 1))
def test_merge_states_matches_the_oracle(parts, dtype, d, seed):
    import cupy
    rng = np.random.default_rng(seed)
    np_dtype = np.float32 if dtype == "float32" else cupy_dtype(dtype)
    outs = rng.standard_normal((parts, 2, 3, 4, d)).astype(np_dtype)
    lses = rng.normal(0, 3, (parts, 2, 4, 3)).astype(np.float32)
    lses[rng.random(lses.shape) < 0.3] = np.inf  # empty parts
    lses[rng.random(lses.shape) < 0.1] = -np.inf
    lses[:, 0, 0, 0] = np.inf  # a row no part saw
    outs_gpu, lses_gpu = cupy.asarray(outs), cupy.asarray(lses)
    for given_parts in (outs_gpu, [outs_gpu[i] for i in range(parts)]):
        with poisoned_allocations():
            out, lse = cuflash.merge_states(given_parts, lses_gpu if given_parts is outs_gpu else list(lses_gpu))
        assert type(out) is cupy.ndarray and out.dtype == outs.dtype and lse.dtype == np.float32
        check_merge(outs, lses, out, lse)
        assert (out.get()[0, 0, 0] == 0).all() and np.isposinf(lse.get()[0, 0, 0])
    # Parts of equal LSE: each weighs 1 / parts, so a part left out moves the LSE by log(parts / (parts - 1)).
    lses = np.full_like(lses, 1.5)
    with poisoned_allocations():
        out, lse = cuflash.merge_states(outs_gpu, cupy.asarray(lses))
    check_merge(outs, lses, out, lse)


@pytest.mark.parametrize("jit", [False, True])
def test_jax_on_the_gpu(jit):
    """cuflash.jax's KV-cache call on GPU arrays: the CuPy call's results bit for bit, the
    caches returned with the append (and, donated under jit, written in place)."""
    jax = pytest.importorskip("jax", reason="JAX is not installed: pip install -e '.[jax]'")
    import jax.numpy as jnp

    import cuflash.jax
    gpu = jax.devices("gpu")[0]
    rng = np.random.default_rng(9)
    c = dict(batch=2, nheads=8, nheads_k=2, d=64, seqlen_q=2, seqlen_new=2, capacity=300, lengths=[10, 250],
             leftpads=[0, 3], rotary_dim=32, interleaved=False, causal=True, window=(-1, -1), softcap=0.0,
             alibi=True, batch_idx=False, page_size=17, seed=9, num_splits=3)
    q, k_cache, v_cache, k, v, kw = make_call(c, "float16", rng)
    want_out, want_lse, want_k, want_v = run(q, k_cache, v_cache, k, v, kw)
    check_kvcache(q, k_cache, v_cache, k, v, kw, want_out, want_lse)
    arrays = {name: jax.device_put(x, gpu) for name, x in kw.items() if isinstance(x, np.ndarray)}
    static = {name: x for name, x in kw.items() if name not in arrays}

    def step(q, k_cache, v_cache, k, v, arrays):
        return cuflash.jax.attention_with_kvcache(q, k_cache, v_cache, k, v, return_lse=True, **arrays, **static)

    caches = [jnp.asarray(x, device=gpu) for x in (k_cache, v_cache)]
    pointers = [x.unsafe_buffer_pointer() for x in caches]
    call = jax.jit(step, donate_argnums=(1, 2)) if jit else step
    out, lse, new_k, new_v = call(jax.device_put(q, gpu), *caches, jax.device_put(k, gpu), jax.device_put(v, gpu),
                                  arrays)
    assert (np.asarray(out) == want_out).all() and (np.asarray(lse) == want_lse).all()
    assert (np.asarray(new_k) == want_k).all() and (np.asarray(new_v) == want_v).all()
    if jit:
        assert [x.unsafe_buffer_pointer() for x in (new_k, new_v)] == pointers


@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.tuples(st.integers(0, 24), st.integers(0, 400)), min_size=1, max_size=4),
       page_size=st.sampled_from([1, 16, 17, 256]), causal=st.booleans(), window=st.sampled_from([(-1, -1), (40, 3)]),
       group=st.sampled_from([1, 4]), d=st.sampled_from([59, 64, 128]), dtype=st.sampled_from(["float16", "bfloat16"]),
       seed=st.integers(0, 2**32 - 1))
def test_paged_varlen_matches_the_packed_call(lengths, page_size, causal, window, group, d, dtype, seed):
    """attention_varlen(block_table=...) on the GPU (the split kernel over pages) against
    the oracle by the rule, sequence by sequence."""
    import cupy
    rng = np.random.default_rng(seed)
    np_dtype, nheads_k = cupy_dtype(dtype), 2
    seqlens_q, seqlens_k = (np.array(x, np.int32) for x in zip(*lengths))
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (seqlens_q, seqlens_k))
    q = rng.standard_normal((cu_q[-1], nheads_k * group, d)).astype(np_dtype)
    k, v = (rng.standard_normal((cu_k[-1], nheads_k, d)).astype(np_dtype) for _ in "kv")
    max_blocks = max(1, -(-int(seqlens_k.max()) // page_size))
    pages = len(lengths) * max_blocks + 2
    table = rng.permutation(pages)[:len(lengths) * max_blocks].reshape(len(lengths), max_blocks).astype(np.int32)
    k_pages, v_pages = (np.full((pages, page_size, nheads_k, d), np.nan, np.float32).astype(np_dtype) for _ in "kv")
    for b, n in enumerate(seqlens_k):
        for pool, x in ((k_pages, k), (v_pages, v)):
            rows = pool[table[b]].reshape(-1, nheads_k, d)
            rows[:n] = x[cu_k[b]:cu_k[b + 1]]
            pool[table[b]] = rows.reshape(max_blocks, page_size, nheads_k, d)
    g = {name: cupy.asarray(x) for name, x in dict(q=q, k=k, v=v, k_pages=k_pages, v_pages=v_pages, cu_q=cu_q,
                                                   cu_k=cu_k, table=table).items()}
    max_q, max_k = int(seqlens_q.max()), int(seqlens_k.max())
    with poisoned_allocations():
        out, lse = cuflash.attention_varlen(g["q"], g["k_pages"], g["v_pages"], g["cu_q"], g["cu_k"], max_q, max_k,
                                            block_table=g["table"], causal=causal, window_size=window,
                                            return_lse=True)
    check_packed(q, k, v, cu_q, cu_k, out.get(), lse.get(), causal=causal, window_size=window)


def check_packed(q, k, v, cu_q, cu_k, out, lse, **options) -> None:
    """A packed call's out (total_q, nheads, d) and lse (nheads, total_q) against the oracle
    by the rule, sequence by sequence (NumPy or CuPy arrays; cu_q, cu_k NumPy)."""
    for b in range(len(cu_q) - 1):
        rows_q, rows_k = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        check_attention(q[None, rows_q], k[None, rows_k], v[None, rows_k], out[None, rows_q], lse[None, :, rows_q],
                        **options)


def test_paged_varlen_through_torch_and_jax():
    torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")
    jax = pytest.importorskip("jax", reason="JAX is not installed: pip install -e '.[jax]'")
    import cuflash.jax
    from cuflash.flash_attn_interface import flash_attn_varlen_func
    rng = np.random.default_rng(4)
    cu_q, cu_k = np.array([0, 1, 5, 6], np.int32), np.array([0, 300, 301, 700], np.int32)
    q = rng.standard_normal((6, 8, 64)).astype(np.float16)
    pools = [rng.standard_normal((24, 64, 2, 64)).astype(np.float16) for _ in "kv"]
    table = rng.permutation(24)[:21].reshape(3, 7).astype(np.int32)  # 448 rows a sequence
    want, want_lse = cuflash.attention_varlen(*[on_gpu(x) for x in (q, *pools, cu_q, cu_k)], 4, 400,
                                              block_table=on_gpu(table), causal=True, return_lse=True)
    t = [torch.as_tensor(x, device="cuda") for x in (q, *pools, cu_q, cu_k, table)]
    with torch.no_grad():
        out, lse, _ = flash_attn_varlen_func(*t[:5], 4, 400, causal=True, block_table=t[5], return_attn_probs=True)
    assert torch.equal(out, torch.as_tensor(want, device="cuda")) and torch.equal(lse, torch.as_tensor(want_lse))
    gpu = jax.devices("gpu")[0]
    j = [jax.device_put(x, gpu) for x in (q, *pools, cu_q, cu_k, table)]
    out, lse = jax.jit(lambda *a: cuflash.jax.attention_varlen(*a[:5], 4, 400, causal=True, block_table=a[5],
                                                               return_lse=True))(*j)
    assert (np.asarray(out) == want.get()).all() and (np.asarray(lse) == want_lse.get()).all()


# flash-attn's test_flash_attn_kvcache grid on the GPU at its own sizes: its eleven seqlen
# pairs (up to 128k keys), six head dims and MHA/MQA/GQA, with every case of the CPU grid in
# tests/test_torch_kvcache.py (its inputs made by torch on the GPU), through
# cuflash.attention_with_kvcache on CuPy views of them into poisoned memory, bf16 and fp16
# in turn. Its whole product is 1,782 calls; these 324 hold every (seqlen pair, case)
# once, the head dims and head layouts taken in turn (128k keys with d <= 64, for the
# float64 oracle's time), and 225 more drawn from the rest with a fixed seed.
def _flash_attn_kvcache_cells():
    import itertools
    import random
    pairs = [(1, 128), (1, 339), (3, 1024), (64, 800), (64, 256), (3, 799), (64, 2048), (16, 20000),
             (1, 128 * 1024), (16, 128 * 1024), (128, 128)]
    dims, layouts = [32, 59, 64, 80, 128, 256], ["mha", "mqa", "gqa"]
    cases = ["plain", "new_kv", "rotary_half", "rotary_full_interleaved", "local_alibi", "leftpad", "batch_idx",
             "paged", "new_kv_shorter_causal"]
    cells = []
    for i, ((seqlen_q, seqlen_k), case) in enumerate(itertools.product(pairs, cases)):
        d = dims[i % (3 if seqlen_k > 20000 else 6)]
        cells.append((seqlen_q, seqlen_k, d, layouts[i // 6 % 3], case))
    rest = [(q, k, d, m, c) for (q, k), d, m, c in itertools.product(pairs, dims, layouts, cases)
            if k <= 20000 and (q, k, d, m, c) not in cells]
    return cells + random.Random(0).sample(rest, 225)


@pytest.mark.parametrize("seqlen_q,seqlen_k,d,mha_type,case", _flash_attn_kvcache_cells())
def test_flash_attn_kvcache_grid_on_the_gpu(seqlen_q, seqlen_k, d, mha_type, case):
    torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")
    import cupy

    from .test_torch_kvcache import flash_attn_case
    dtype = "bfloat16" if (seqlen_q + d + len(case)) % 2 else "float16"
    q, k_cache, v_cache, k, v, kw = flash_attn_case(seqlen_q, seqlen_k, d, mha_type, case, getattr(torch, dtype),
                                                    device="cuda")
    host = {name: x.cpu().numpy() if isinstance(x, torch.Tensor) else x for name, x in kw.items()}
    as_numpy = [None if x is None else x.float().cpu().numpy().astype(cupy_dtype(dtype))
                for x in (q, k_cache, v_cache, k, v)]
    views = [None if x is None else cupy.from_dlpack(x) for x in (q, k_cache, v_cache, k, v)]
    with poisoned_allocations():
        out, lse = cuflash.attention_with_kvcache(*views, num_splits=0, return_lse=True,
                                                  **{name: cupy.from_dlpack(x) if isinstance(x, torch.Tensor) else x
                                                     for name, x in kw.items()})
    want_k, want_v = check_kvcache(*as_numpy, host, out.get(), lse.get())
    check_appended(*(x.get() for x in views[1:3]), want_k, want_v, dtype)


# flash-attn's paged varlen test (test_flash_attn_varlen_causal with paged_kv_block_size)
# on the GPU at its own sizes: its seqlen pairs, both orders, pages of 256 and 512 rows,
# causal and local, a subset of its head dims; bf16 and fp16 in turn. The CPU grid is in
# tests/test_torch_kvcache.py.
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 239), (3, 799), (127, 512), (127, 513), (113, 203), (128, 217),
                                               (113, 211), (108, 256), (256, 512), (1023, 1024)])
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("d", [59, 128, 256])
@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize("block", [256, 512])
def test_flash_attn_paged_varlen_grid_on_the_gpu(seqlen_q, seqlen_k, swap, d, local, block):
    torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")
    import cupy

    from .test_torch_kvcache import flash_attn_paged_varlen_case
    dtype = "bfloat16" if (seqlen_q + d + block + local) % 2 else "float16"
    case = flash_attn_paged_varlen_case(seqlen_q, seqlen_k, swap, d, local, block, getattr(torch, dtype), "cuda")
    q, k_pages, v_pages, table, cu_q, cu_k, max_q, max_k, window = case[:9]
    k_dense, v_dense, lengths_k = case[9], case[10], case[12]
    with poisoned_allocations():
        out, lse = cuflash.attention_varlen(*(cupy.from_dlpack(x) for x in (q, k_pages, v_pages, cu_q, cu_k)), max_q,
                                            max_k, block_table=cupy.from_dlpack(table), causal=True,
                                            window_size=tuple(int(w) for w in window), return_lse=True)
    # The oracle on the GPU, on the keys each sequence's pages hold (in the dtype, as the kernel read them).
    keys = [x.to("cuda", getattr(torch, dtype)) for x in (k_dense, v_dense)]
    packed_k, packed_v = (cupy.from_dlpack(torch.cat([x[b, :n] for b, n in enumerate(lengths_k.tolist())]))
                          for x in keys)
    cu_k_host = np.concatenate([[0], np.cumsum(lengths_k.cpu().numpy())])
    check_packed(cupy.from_dlpack(q), packed_k, packed_v, cu_q.cpu().numpy(), cu_k_host, out, lse, causal=True,
                 window_size=tuple(int(w) for w in window))


def test_a_compiled_decode_step_on_the_gpu():
    """torch.compile(fullgraph=True) of the KV-cache call on CUDA tensors: step after step
    the append lands in the caches in place and out and lse match the oracle."""
    torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")
    import cuflash.torch
    gen = torch.Generator(device="cuda").manual_seed(3)
    k_cache, v_cache = (torch.randn(2, 300, 2, 64, device="cuda", dtype=torch.float16, generator=gen) for _ in "kv")
    angle = torch.rand(302, 16, device="cuda", generator=gen) * 6
    cos, sin = angle.cos(), angle.sin()
    step = torch.compile(lambda q, k, v, n: cuflash.torch.attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=n, rotary_cos=cos, rotary_sin=sin, causal=True, return_lse=True),
        fullgraph=True)
    lengths = torch.tensor([3, 250], device="cuda", dtype=torch.int32)
    for _ in range(4):
        q, k, v = (torch.randn(2, 2, h, 64, device="cuda", dtype=torch.float16, generator=gen) for h in (8, 2, 2))
        host = [x.cpu().numpy() for x in (q, k_cache, v_cache, k, v)]
        kw = dict(cache_seqlens=lengths.cpu().numpy(), rotary_cos=cos.cpu().numpy(), rotary_sin=sin.cpu().numpy(),
                  causal=True)
        out, lse = step(q, k, v, lengths)
        want_k, want_v = check_kvcache(*host, kw, out.cpu().numpy(), lse.cpu().numpy())
        check_appended(k_cache.cpu().numpy(), v_cache.cpu().numpy(), want_k, want_v, "float16")
        lengths += 2
