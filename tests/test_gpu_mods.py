"""Programmable attention on the GPU: score_mod and mask_mod compiled into the mma.sync
kernels, forward and backward, dense and varlen, with and without a block mask, against the
float64 oracle (cuflash.reference with the same functions) by flash-attn's rule (tests/rule.py).

The low-precision yardstick is plain attention's (cuflash.reference.attention_lowp, with the
call's built-in options but without the mods, which it does not take) on the same inputs: the
rounding of P and of the products is the same. Every case compiles its own kernels once
(its functions' text keys them); hypothesis varies the shapes (GQA, ragged lengths: 1,
tile + 1, primes; seqlen_q != seqlen_k) and the inputs, outputs land in NaN-poisoned memory.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import mod
from cuflash.reference import (attention_lowp, attention_lowp_backward, attention_lowp_varlen,
                               attention_lowp_varlen_backward, attention_reference, attention_reference_backward,
                               attention_reference_varlen, attention_reference_varlen_backward)

from .rule import FLOOR, check_lse, check_output, lowp_error
from .strategies import assert_close
from .test_gpu_forward import cupy_dtype, poisoned_allocations

pytestmark = pytest.mark.gpu

LENGTHS = (1, 2, 17, 31, 33, 64, 65, 127, 129, 131, 257)
RADIUS = 16  # the relative bias's buckets: distances -RADIUS .. RADIUS


def relative_bias(s, b, h, q_idx, kv_idx, bias):  # T5's, clipped to RADIUS
    return s + bias[h, mod.minimum(mod.maximum(q_idx - kv_idx, -RADIUS), RADIUS) + RADIUS]


def alibi(s, b, h, q_idx, kv_idx, slopes, diagonal):
    return s - slopes[h] * abs(q_idx + diagonal[()] - kv_idx)


def softcap(s, b, h, q_idx, kv_idx):
    return 8.0 * mod.tanh(s / 8.0)


def same_document(b, h, q_idx, kv_idx, doc_q, doc_k):
    return doc_q[b, q_idx] == doc_k[b, kv_idx]


def prefix_lm(b, h, q_idx, kv_idx, is_prefix, diagonal):
    return (kv_idx <= q_idx + diagonal[()]) | is_prefix[b, kv_idx]


def window_with_sinks(b, h, q_idx, kv_idx, diagonal):
    distance = q_idx + diagonal[()] - kv_idx
    return ((distance >= 0) & (distance <= 48)) | (kv_idx < 4)


def tensor_bias(s, b, h, q_idx, kv_idx, bias):
    return s + bias[b, h, q_idx, kv_idx]


def _tensors(case: str, rng, batch, nheads, seqlen_q, seqlen_k):
    """The case's mod tensors as NumPy arrays (b indexes the batch or the sequences)."""
    diagonal = np.array(seqlen_k - seqlen_q, np.int32)
    if case == "t5":
        return (rng.standard_normal((nheads, 2 * RADIUS + 1)).astype(np.float32),)
    if case == "alibi":
        import ml_dtypes
        return (rng.uniform(0.01, 0.5, nheads).astype(ml_dtypes.bfloat16), diagonal)
    if case == "document":
        docs = max(1, seqlen_k // 40)
        return (np.sort(rng.integers(0, docs, (batch, seqlen_q)), axis=1).astype(np.int32),
                np.sort(rng.integers(0, docs, (batch, seqlen_k)), axis=1).astype(np.int64))
    if case == "prefix":
        return (np.arange(seqlen_k)[None, :] < rng.integers(0, seqlen_k + 1, (batch, 1)), diagonal)
    if case == "sinks":
        return (diagonal,)
    if case == "bias":
        return (rng.standard_normal((batch, nheads, seqlen_q, seqlen_k)).astype(np.float16),)
    return ()


# case: (score_mod, mask_mod, dtype, head dim, built-in options, varlen)
CASES = {
    "t5": (relative_bias, None, "float16", 64, {}, False),
    "alibi": (alibi, None, "bfloat16", 128, {"causal": True}, False),
    "softcap": (softcap, None, "float16", 128, {"window_size": (40, 8)}, True),
    "document": (None, same_document, "bfloat16", 64, {}, False),
    "document_varlen": (relative_bias, same_document, "float16", 64, {}, True),
    "prefix": (None, prefix_lm, "bfloat16", 128, {"softcap": 20.0}, False),
    "sinks": (None, window_with_sinks, "float16", 256, {}, True),
    "bias": (tensor_bias, None, "bfloat16", 96, {"softcap": 30.0, "causal": True}, False),
}


def _run(case: str, shape, seed: int, deterministic: bool):
    import cupy
    score_mod, mask_mod, dtype, head_dim, options, varlen = CASES[case]
    batch, seqlen_q, seqlen_k, nheads_kv, group = shape
    nheads = nheads_kv * group
    tensor_case = "document" if case == "document_varlen" else case
    rng = np.random.default_rng(seed)
    host = _tensors(tensor_case, rng, batch, nheads, seqlen_q, seqlen_k)
    if case == "document_varlen":
        host = _tensors("t5", rng, batch, nheads, seqlen_q, seqlen_k) + host
        score_mod = relative_bias_then_documents
        mask_mod = same_document_after_bias
    element = cupy_dtype(dtype)
    q = rng.standard_normal((batch, seqlen_q, nheads, head_dim)).astype(element)
    k, v = (rng.standard_normal((batch, seqlen_k, nheads_kv, head_dim)).astype(element) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(element)
    mods = dict(score_mod=score_mod, mask_mod=mask_mod)
    device = [cupy.asarray(t) for t in (q, k, v, dout)]
    device_tensors = tuple(cupy.asarray(t) for t in host)
    if varlen:  # the batch packed, with the sequences' own lengths: the first full, the others shorter
        lengths_q = [seqlen_q] + [int(n) for n in rng.integers(1, seqlen_q + 1, batch - 1)]
        lengths_k = [seqlen_k] + [int(n) for n in rng.integers(1, seqlen_k + 1, batch - 1)]
        cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k))
        q, dout = (np.concatenate([x[b, :n] for b, n in enumerate(lengths_q)]) for x in (q, dout))
        k, v = (np.concatenate([x[b, :n] for b, n in enumerate(lengths_k)]) for x in (k, v))
        cq, ck, cv, cdout = (cupy.asarray(x) for x in (q, k, v, dout))
        ccu_q, ccu_k = cupy.asarray(cu_q), cupy.asarray(cu_k)
        with poisoned_allocations():
            out, lse = cuflash.attention_varlen(cq, ck, cv, ccu_q, ccu_k, seqlen_q, seqlen_k, return_lse=True,
                                                mod_tensors=device_tensors, **mods, **options)
            grads = cuflash.attention_varlen_backward(cdout, cq, ck, cv, out, lse, ccu_q, ccu_k, seqlen_q, seqlen_k,
                                                      deterministic=deterministic, mod_tensors=device_tensors,
                                                      **mods, **options)
        ref, ref_lse = attention_reference_varlen(q, k, v, cu_q, cu_k, mod_tensors=host, **mods, **options)
        lowp = attention_lowp_varlen(q, k, v, cu_q, cu_k, **options)
        plain = attention_reference_varlen(q, k, v, cu_q, cu_k, **options)[0]
        refs = attention_reference_varlen_backward(dout, q, k, v, cu_q, cu_k, mod_tensors=host, **mods, **options)
        lowps = attention_lowp_varlen_backward(dout, q, k, v, cu_q, cu_k, **options)
        plains = attention_reference_varlen_backward(dout, q, k, v, cu_q, cu_k, **options)
    else:
        cq, ck, cv, cdout = device
        with poisoned_allocations():
            out, lse = cuflash.attention(cq, ck, cv, return_lse=True, mod_tensors=device_tensors, **mods, **options)
            grads = cuflash.attention_backward(cdout, cq, ck, cv, out, lse, deterministic=deterministic,
                                               mod_tensors=device_tensors, **mods, **options)
        ref, ref_lse = attention_reference(q, k, v, mod_tensors=host, **mods, **options)
        lowp = attention_lowp(q, k, v, **options)
        plain = attention_reference(q, k, v, **options)[0]
        refs = attention_reference_backward(dout, q, k, v, mod_tensors=host, **mods, **options)
        lowps = attention_lowp_backward(dout, q, k, v, **options)
        plains = attention_reference_backward(dout, q, k, v, **options)
    check_results(out, lse, grads, (q, k, v), dtype, (ref, ref_lse, lowp, plain), (refs, lowps, plains))


def check_results(out, lse, grads, inputs, dtype, forward, backward) -> None:
    """out, lse and (dq, dk, dv) of a call with mods against the oracle by the rule, the
    yardstick plain attention's lowp error: forward = (ref, ref_lse, lowp, plain) and
    backward = (refs, lowps, plains), each a triple of gradients."""
    ref, ref_lse, lowp, plain = forward
    check_output(out, ref, lowp_error(lowp, plain), dtype)
    check_lse(lse, ref_lse)
    for name, grad, reference, low, plain_grad, like in zip(("dq", "dk", "dv"), grads, *backward, inputs):
        assert grad.shape == like.shape and grad.dtype == like.dtype, name
        # The gradient rule (tests/rule.py, check_gradient) with plain attention's yardstick.
        scale = float(np.abs(reference).max(initial=0.0))
        assert_close(grad, reference, atol=3 * lowp_error(low, plain_grad) + 2 * FLOOR[dtype] * (1.0 + scale),
                     name=name)


def relative_bias_then_documents(s, b, h, q_idx, kv_idx, bias, doc_q, doc_k):
    return relative_bias(s, b, h, q_idx, kv_idx, bias)


def same_document_after_bias(b, h, q_idx, kv_idx, bias, doc_q, doc_k):
    return same_document(b, h, q_idx, kv_idx, doc_q, doc_k)


shapes = st.tuples(st.integers(1, 2), st.sampled_from(LENGTHS), st.sampled_from(LENGTHS), st.integers(1, 2),
                   st.integers(1, 3))


@pytest.mark.parametrize("case", list(CASES))
@settings(deadline=None, max_examples=8, suppress_health_check=[HealthCheck.too_slow])
@given(shape=shapes, seed=st.integers(0, 2**32 - 1), deterministic=st.booleans())
def test_mods_match_the_oracle(case, shape, seed, deterministic):
    _run(case, shape, seed, deterministic)


def test_a_fully_masked_row_gives_zero_and_infinite_lse():
    """mask_mod hiding every key of some rows: out 0, LSE +inf, gradients 0 there."""
    import cupy
    rng = np.random.default_rng(3)
    q, k, v, dout = (cupy.asarray(rng.standard_normal((1, 65, 2, 64)).astype(np.float16)) for _ in range(4))
    hidden = cupy.asarray(np.arange(65) % 7 == 0)

    def rows_hidden(b, h, q_idx, kv_idx, hidden):
        return ~hidden[q_idx]

    with poisoned_allocations():
        out, lse = cuflash.attention(q, k, v, mask_mod=rows_hidden, mod_tensors=(hidden,), return_lse=True)
        dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, mask_mod=rows_hidden, mod_tensors=(hidden,))
    rows = np.flatnonzero(np.arange(65) % 7 == 0)
    assert bool((out[0, rows] == 0).all()) and bool(cupy.isinf(lse[0][:, rows]).all())
    assert bool((dq[0, rows] == 0).all()) and bool(cupy.isfinite(dk).all()) and bool(cupy.isfinite(dv).all())
    assert bool(cupy.isfinite(out).all()) and bool(cupy.isfinite(dq).all())


def test_plans_stay_on_the_mma_sync_kernels(monkeypatch):
    """On any GPU (a Hopper one included) a forward with mods launches the mma.sync kernels
    compiled with its functions (the sm_90a forward does not take them)."""
    import cupy
    from cuflash import _kernels
    q, k, v = (cupy.asarray(np.random.default_rng(0).standard_normal((1, 128, 2, 128)).astype(np.float16))
               for _ in range(3))
    launched = []
    original = _kernels.Launcher.__init__

    def record(self, plan, device):
        launched.extend(step.kernel for step in plan.steps)
        original(self, plan, device)

    monkeypatch.setattr(_kernels.Launcher, "__init__", record)
    cuflash.attention(q, k, v, score_mod=softcap)
    assert [k.kind for k in launched] == ["forward"] and "cuflash::UserMods" in launched[0].instance


# -- block masks (cuflash.mod.create_block_mask) ----------------------------------------------------

def hidden_rows_and_keys(b, h, q_idx, kv_idx, diagonal):
    """Query rows 128 .. 255 see nothing (a fully masked block row), keys 128 .. 255 are seen by
    no one (a fully masked block column), the rest is causal."""
    rows = (q_idx < 128) | (q_idx >= 256)
    keys = (kv_idx < 128) | (kv_idx >= 256)
    return rows & keys & (kv_idx <= q_idx + diagonal[()])


def causal_mask(b, h, q_idx, kv_idx, diagonal):
    return kv_idx <= q_idx + diagonal[()]


def softcap_beside_tensors(s, b, h, q_idx, kv_idx, *mod_tensors):  # (the block mask's tensors are score_mod's too)
    return softcap(s, b, h, q_idx, kv_idx)


# case: (score_mod, mask_mod, tensor case, dtype, head dim, built-in options)
BLOCK_CASES = {
    "causal": (None, causal_mask, "sinks", "bfloat16", 64, {}),
    "document": (None, same_document, "document", "float16", 128, {}),
    "t5_document": (relative_bias_then_documents, same_document_after_bias, "t5_document", "bfloat16", 64, {}),
    "prefix": (None, prefix_lm, "prefix", "float16", 256, {"softcap": 20.0}),
    "sinks": (softcap_beside_tensors, window_with_sinks, "sinks", "bfloat16", 96, {}),
    "hidden": (None, hidden_rows_and_keys, "sinks", "float16", 128, {"window_size": (200, 0)}),
    "hidden_256": (None, hidden_rows_and_keys, "sinks", "bfloat16", 256, {}),
}
BLOCK_LENGTHS = (1, 17, 128, 129, 131, 257, 300, 383, 512)


def _run_blocks(case: tuple, shape, seed: int, deterministic: bool):
    """The call with a block mask (made on the GPU) against the oracle with its mask_mod."""
    import cupy
    score_mod, mask_mod, tensor_case, dtype, head_dim, options = case
    batch, seqlen_q, seqlen_k, nheads_kv, group = shape
    nheads = nheads_kv * group
    rng = np.random.default_rng(seed)
    if tensor_case == "t5_document":
        host = _tensors("t5", rng, batch, nheads, seqlen_q, seqlen_k) + \
            _tensors("document", rng, batch, nheads, seqlen_q, seqlen_k)
    else:
        host = _tensors(tensor_case, rng, batch, nheads, seqlen_q, seqlen_k)
    element = cupy_dtype(dtype)
    q = rng.standard_normal((batch, seqlen_q, nheads, head_dim)).astype(element)
    k, v = (rng.standard_normal((batch, seqlen_k, nheads_kv, head_dim)).astype(element) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(element)
    cq, ck, cv, cdout = (cupy.asarray(x) for x in (q, k, v, dout))
    device_tensors = tuple(cupy.asarray(t) for t in host)
    block_mask = mod.create_block_mask(mask_mod, batch, nheads, seqlen_q, seqlen_k, mod_tensors=device_tensors,
                                       like=cq)
    host_mask = mod.create_block_mask(mask_mod, batch, nheads, seqlen_q, seqlen_k, mod_tensors=host)
    np.testing.assert_array_equal(cupy.asnumpy(block_mask.statuses), host_mask.statuses)  # (CuPy's = NumPy's)
    with poisoned_allocations():
        out, lse = cuflash.attention(cq, ck, cv, return_lse=True, score_mod=score_mod, block_mask=block_mask,
                                     **options)
        grads = cuflash.attention_backward(cdout, cq, ck, cv, out, lse, deterministic=deterministic,
                                           score_mod=score_mod, block_mask=block_mask, **options)
    mods = dict(score_mod=score_mod, mask_mod=mask_mod, mod_tensors=host)
    forward = (*attention_reference(q, k, v, **mods, **options), attention_lowp(q, k, v, **options),
               attention_reference(q, k, v, **options)[0])
    backward = (attention_reference_backward(dout, q, k, v, **mods, **options),
                attention_lowp_backward(dout, q, k, v, **options), attention_reference_backward(dout, q, k, v, **options))
    check_results(out, lse, grads, (q, k, v), dtype, forward, backward)


block_shapes = st.tuples(st.integers(1, 2), st.sampled_from(BLOCK_LENGTHS), st.sampled_from(BLOCK_LENGTHS),
                         st.integers(1, 2), st.integers(1, 2))


@pytest.mark.parametrize("case", list(BLOCK_CASES))
@settings(deadline=None, max_examples=6, suppress_health_check=[HealthCheck.too_slow])
@given(shape=block_shapes, seed=st.integers(0, 2**32 - 1), deterministic=st.booleans())
def test_block_masks_match_the_oracle(case, shape, seed, deterministic):
    """Forward and backward (both backward paths: the two-kernel one when deterministic, the
    one-pass one otherwise) with a block mask against the oracle with its mask_mod."""
    _run_blocks(BLOCK_CASES[case], shape, seed, deterministic)


def causal_of_indices(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def band_of_indices(b, h, q_idx, kv_idx):  # 100 keys up to the diagonal, and the first 4
    return ((kv_idx <= q_idx) & (kv_idx > q_idx - 100)) | (kv_idx < 4)


def hidden_of_indices(b, h, q_idx, kv_idx):  # rows 128 .. 255 see nothing, keys 128 .. 255 seen by no one
    return (kv_idx <= q_idx) & ((q_idx < 128) | (q_idx >= 256)) & ((kv_idx < 128) | (kv_idx >= 256))


# d 64's block-masked forward on 192-row tiles (three consumers; SM90_MASK_TILES), which span
# two rows of blocks: masks that load no mod tensor (those that do keep two consumers).
TWO_ROW_CASES = {
    "causal": (None, causal_of_indices, None, "bfloat16", 64, {}),
    "band": (None, band_of_indices, None, "float16", 64, {}),
    "hidden": (None, hidden_of_indices, None, "bfloat16", 64, {}),
}
TWO_ROW_LENGTHS = (1, 100, 129, 191, 193, 257, 385, 449, 640)


@pytest.mark.parametrize("case", list(TWO_ROW_CASES))
@settings(deadline=None, max_examples=6, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.tuples(st.integers(1, 2), st.sampled_from(TWO_ROW_LENGTHS), st.sampled_from(TWO_ROW_LENGTHS),
                       st.integers(1, 2), st.integers(1, 2)), seed=st.integers(0, 2**32 - 1))
def test_block_masks_on_tiles_over_two_rows_of_blocks(case, shape, seed):
    """The 192-row tiles (forced on short calls too) skip a key tile only where both its blocks
    are empty and skip mask_mod only where both are full: against the oracle."""
    from cuflash import experiment
    with experiment.override(sm90_short_causal_tiles={64: (128, 3, 3)}):
        _run_blocks(TWO_ROW_CASES[case], shape, seed, deterministic=False)


def test_long_block_masked_rows_on_three_consumers():
    """A causal mask_mod over 2113 rows (SM90_SHORT_CAUSAL_ROWS and more: 192-row tiles by
    default, the last one short) against the oracle."""
    _run_blocks(TWO_ROW_CASES["causal"], (1, 2113, 2113, 1, 2), 7, deterministic=False)


@pytest.mark.parametrize("head_dim,deterministic", [(64, False), (128, True), (256, False), (256, True)])
def test_empty_blocks_are_never_read(head_dim, deterministic):
    """NaN in the K and V rows of a block column nobody sees, and in the Q and dO rows of a block
    row that sees nothing: the kernels never load those tiles for a product, so every output is
    finite and equals the oracle's on the same inputs with those rows zeroed; the hidden rows get
    out 0, lse +inf and dq 0, the unseen keys dk = dv = 0."""
    import cupy
    rng = np.random.default_rng(head_dim)
    q, k, v, dout = (rng.standard_normal((2, 384, 2, head_dim)).astype(np.float16) for _ in range(4))
    diagonal = np.array(0, np.int32)
    for x in (q, dout):
        x[:, 128:256] = np.nan
    for x in (k, v):
        x[:, 128:256] = np.nan
    cq, ck, cv, cdout = (cupy.asarray(x) for x in (q, k, v, dout))
    block_mask = mod.create_block_mask(hidden_rows_and_keys, None, None, 384, 384,
                                       mod_tensors=(cupy.asarray(diagonal),), like=cq)
    statuses = cupy.asnumpy(block_mask.statuses)[0, 0]
    assert (statuses[1, :] == mod.EMPTY).all() and (statuses[:, 1] == mod.EMPTY).all()
    with poisoned_allocations():
        out, lse = cuflash.attention(cq, ck, cv, return_lse=True, block_mask=block_mask)
        dq, dk, dv = cuflash.attention_backward(cdout, cq, ck, cv, out, lse, block_mask=block_mask,
                                                deterministic=deterministic)
    for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert bool(cupy.isfinite(x).all()), name
    assert bool((out[:, 128:256] == 0).all()) and bool(cupy.isinf(lse[:, :, 128:256]).all())
    assert bool((dq[:, 128:256] == 0).all()) and bool((dk[:, 128:256] == 0).all()) and bool((dv[:, 128:256] == 0).all())
    clean = [np.nan_to_num(x, nan=0.0) for x in (q, k, v, dout)]
    mods = dict(mask_mod=hidden_rows_and_keys, mod_tensors=(diagonal,))
    ref, ref_lse = attention_reference(*clean[:3], **mods)
    lowp, plain = attention_lowp(*clean[:3]), attention_reference(*clean[:3])[0]
    check_output(out, ref, lowp_error(lowp, plain), "float16")
    check_lse(lse, ref_lse)
    refs = attention_reference_backward(clean[3], *clean[:3], **mods)
    lowps = attention_lowp_backward(clean[3], *clean[:3])
    plains = attention_reference_backward(clean[3], *clean[:3])
    for name, grad, reference, low, plain_grad in zip(("dq", "dk", "dv"), (dq, dk, dv), refs, lowps, plains):
        scale = float(np.abs(reference).max(initial=0.0))
        assert_close(grad, reference, atol=3 * lowp_error(low, plain_grad) + 2 * FLOOR["float16"] * (1.0 + scale),
                     name=name)


@pytest.mark.parametrize("head_dim,dtype,causal", [(64, "float16", False), (128, "bfloat16", True)])
def test_packed_block_masks_match_the_oracle(head_dim, dtype, causal):
    """A packed call's block mask, made on the GPU over (sequences, heads, max_seqlen_q,
    max_seqlen_k) with positions within each sequence (the first sequence full, the others
    shorter, one empty): forward and backward against the oracle with its mask_mod."""
    import cupy
    rng = np.random.default_rng(head_dim)
    lengths_q, lengths_k = (383, 0, 129, 257), (300, 17, 131, 512)
    batch, max_q, max_k, nheads = len(lengths_q), max(lengths_q), max(lengths_k), 4
    host = _tensors("document", rng, batch, nheads, max_q, max_k)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k))
    element = cupy_dtype(dtype)
    q = rng.standard_normal((int(cu_q[-1]), nheads, head_dim)).astype(element)
    k, v = (rng.standard_normal((int(cu_k[-1]), 2, head_dim)).astype(element) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(element)
    cq, ck, cv, cdout, ccu_q, ccu_k = (cupy.asarray(x) for x in (q, k, v, dout, cu_q, cu_k))
    device_tensors = tuple(cupy.asarray(t) for t in host)
    block_mask = mod.create_block_mask(same_document, batch, nheads, max_q, max_k, mod_tensors=device_tensors,
                                       like=cq)
    statuses = cupy.asnumpy(block_mask.statuses)
    assert (statuses == mod.EMPTY).any() and (statuses == mod.PARTIAL).any()
    packing = (max_q, max_k)
    with poisoned_allocations():
        out, lse = cuflash.attention_varlen(cq, ck, cv, ccu_q, ccu_k, *packing, causal=causal, return_lse=True,
                                            block_mask=block_mask)
        grads = cuflash.attention_varlen_backward(cdout, cq, ck, cv, out, lse, ccu_q, ccu_k, *packing,
                                                  causal=causal, block_mask=block_mask)
    mods = dict(mask_mod=same_document, mod_tensors=host)
    forward = (*attention_reference_varlen(q, k, v, cu_q, cu_k, causal=causal, **mods),
               attention_lowp_varlen(q, k, v, cu_q, cu_k, causal=causal),
               attention_reference_varlen(q, k, v, cu_q, cu_k, causal=causal)[0])
    backward = (attention_reference_varlen_backward(dout, q, k, v, cu_q, cu_k, causal=causal, **mods),
                attention_lowp_varlen_backward(dout, q, k, v, cu_q, cu_k, causal=causal),
                attention_reference_varlen_backward(dout, q, k, v, cu_q, cu_k, causal=causal))
    check_results(out, lse, grads, (q, k, v), dtype, forward, backward)
