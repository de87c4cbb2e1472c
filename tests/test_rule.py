"""The GPU tests' rule (tests/rule.py) on inputs where every key tile counts: a kernel that
lost one tile of keys, simulated by dropping those keys from the float64 oracle's inputs
and rounding its output to the dtype, fails the check wherever the tile lies; the same
oracle without the loss passes."""
import numpy as np
import pytest

from cuflash.reference import attention_reference, round_to

from .rule import RUN, check_attention, check_kvcache, tile_marked, tile_marked_cache
from .strategies import assert_close

DTYPES = ["float16", "bfloat16"]


def _dtype(name):
    if name == "float16":
        return np.float16
    return pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed (NumPy bfloat16)").bfloat16


def _starts(seqlen_k, lost):
    """Where a lost tile may lie: first, last, astride the end of a run of marked keys
    (where it moves two features by half as much)."""
    return sorted({0, min(RUN - lost // 2, seqlen_k - lost), seqlen_k - lost})


def _as_kernel(out, lse, dtype):
    """The oracle's results as a kernel returns them: out in the dtype, lse in float32."""
    return round_to(out.astype(np.float32), dtype), lse.astype(np.float32)


# (keys, keys lost): one of 200 and of 700, a 128-key tile of 20k, 1,024 keys and a
# 128-key tile of 128k.
LOSSES = [(200, 1), (700, 1), (20000, 128), (131072, 1024), (131072, 128)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqlen_k,lost", LOSSES)
def test_a_dense_call_that_loses_a_key_tile_fails_the_rule(seqlen_k, lost, dtype):
    rng = np.random.default_rng(seqlen_k + lost)
    q, k, v = tile_marked(1, 2, seqlen_k, 2, 1, 64, _dtype(dtype), rng)
    check_attention(q, k, v, *_as_kernel(*attention_reference(q, k, v), dtype))
    for start in _starts(seqlen_k, lost):
        kept = np.r_[0:start, start + lost:seqlen_k]
        simulated = _as_kernel(*attention_reference(q, k[:, kept], v[:, kept]), dtype)
        with pytest.raises(AssertionError):
            check_attention(q, k, v, *simulated)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqlen_k,lost", LOSSES[:3])
def test_a_kv_cache_call_that_loses_a_key_tile_fails_the_rule(seqlen_k, lost, dtype):
    """Two sequences (the second 37 keys shorter), GQA 4:1, two queries; the lost tile in
    the first sequence."""
    from cuflash.reference_kvcache import attention_kvcache_reference
    rng = np.random.default_rng(seqlen_k - lost)
    lengths = [seqlen_k, seqlen_k - 37]
    q, k_cache, v_cache, kw = tile_marked_cache(rng, lengths, seqlen_k, 4, 1, 64, _dtype(dtype), seqlen_q=2)
    out, lse, _, _ = attention_kvcache_reference(q, k_cache, v_cache, **kw)
    check_kvcache(q, k_cache, v_cache, None, None, kw, *_as_kernel(out, lse, dtype))
    for start in _starts(seqlen_k, lost):
        kept = np.r_[0:start, start + lost:seqlen_k]
        short = dict(kw, cache_seqlens=np.array([seqlen_k - lost, lengths[1]], np.int32))
        first, first_lse, _, _ = attention_kvcache_reference(q[:1], k_cache[:1, kept], v_cache[:1, kept],
                                                             **dict(short, cache_seqlens=short["cache_seqlens"][:1]))
        simulated = out.copy(), lse.copy()
        simulated[0][:1], simulated[1][:1] = first, first_lse
        with pytest.raises(AssertionError):
            check_kvcache(q, k_cache, v_cache, None, None, kw, *_as_kernel(*simulated, dtype))


def test_the_marked_inputs_weigh_every_key_alike():
    """q = 0: the LSE is the log of the visible keys' count, and each output feature the
    share of the visible keys whose run marks it."""
    rng = np.random.default_rng(0)
    q, k, v = tile_marked(2, 3, 1000, 4, 2, 16, np.float16, rng)
    out, lse = attention_reference(q, k, v, causal=True)
    assert_close(lse[:, :, -1], np.full((2, 4), np.log(1000.0)), atol=1e-12)
    assert_close(out[:, -1], np.repeat(v.astype(np.float64).mean(axis=1), 2, axis=1), atol=1e-12)
    assert sorted(np.unique(v.astype(np.float64))) == [0.0, 256.0] and (v.astype(np.float64).sum(-1) == 256.0).all()
