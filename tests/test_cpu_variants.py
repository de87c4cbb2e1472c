"""flash-attn's variants (sliding window, softcap, ALiBi, dropout, variable length) on the
CPU: the Philox dropout generator against Random123's known answers, the float64 oracle
against the literal loop and finite differences, and the blockwise NumPy path against the
oracle, forward and backward, each feature alone and in combination."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuflash import _philox, cpu
from cuflash.reference import (attention_lowp, attention_lowp_backward, attention_lowp_varlen,
                               attention_lowp_varlen_backward, attention_reference, attention_reference_backward,
                               attention_reference_varlen, attention_reference_varlen_backward, attention_textbook,
                               attention_textbook_backward, normalized_window, round_to)
from .test_cpu_backward import GRAD_TOL, _data, _max_finite, _scale_of
from .strategies import (NO_INVALID_ARITHMETIC, Shape, Variant, VarlenShape, assert_close, attention_shapes,
                         blocked_draws, cpu_path_draws, finite_difference, random_qkv, rounding_floor, scales, seeds,
                         seqlens, variants, varlen_shapes, window_sizes)

pytestmark = NO_INVALID_ARITHMETIC  # (strategies.py)

# Error allowed relative to the result's scale (see test_cpu.py and test_cpu_backward.py).
OUT_TOL = {np.float32: 1e-5, np.float64: 1e-10}
LSE_TOL = {np.float32: 1e-5, np.float64: 1e-6}


def _keep(shape, variant):
    """The fixed-length keep mask cuflash.cpu draws for `variant` (None without dropout)."""
    if variant.dropout_p == 0:
        return None
    return _philox.keep_mask(variant.seed, variant.rng_offset, shape.batch, shape.nheads,
                             shape.seqlen_q, shape.seqlen_k, variant.dropout_p)


def _varlen_keep(shape, variant):
    if variant.dropout_p == 0:
        return None
    return _philox.varlen_keep_masks(variant.seed, variant.rng_offset, shape.nheads,
                                     shape.seqlens_q, shape.seqlens_k, variant.dropout_p)


def _varlen_args(shape):
    return (shape.cu_seqlens_q, shape.cu_seqlens_k, shape.max_seqlen_q, shape.max_seqlen_k)


# --- Philox4x32-10 --------------------------------------------------------------------------

MASK32 = 0xFFFFFFFF


def _philox_scalar(counter, key):
    """Random123's philox4x32_10 on Python integers, one counter at a time."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        product0, product1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (
            (product1 >> 32) ^ c1 ^ k0,
            product1 & MASK32,
            (product0 >> 32) ^ c3 ^ k1,
            product0 & MASK32,
        )
        k0, k1 = (k0 + 0x9E3779B9) & MASK32, (k1 + 0xBB67AE85) & MASK32
    return c0, c1, c2, c3


# Random123's kat_vectors for philox4x32_10: counter, key, expected output.
PHILOX_KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((MASK32,) * 4, (MASK32,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter, key, expected", PHILOX_KNOWN_ANSWERS)
def test_philox_known_answers(counter, key, expected):
    words = _philox.philox4x32(tuple(np.uint32(c) for c in counter), key)
    assert all(w.dtype == np.uint32 for w in words)
    assert tuple(int(w) for w in words) == expected
    assert _philox_scalar(counter, key) == expected


def test_philox_vectorised_matches_scalar():
    rng = np.random.default_rng(7)
    counters = rng.integers(0, 2**32, size=(4, 300), dtype=np.uint64).astype(np.uint32)
    counters[:, :8] = MASK32  # the carries of the largest products
    for key in ((0, 0), (MASK32, MASK32), (0x12345678, 0x9ABCDEF0)):
        words = np.stack(_philox.philox4x32(tuple(counters), key))
        for n in range(counters.shape[1]):
            expected = _philox_scalar(tuple(int(c) for c in counters[:, n]), key)
            assert tuple(int(w) for w in words[:, n]) == expected


def test_dropout_threshold():
    assert _philox.dropout_threshold(0.0) == 0
    assert _philox.dropout_threshold(0.5) == 2**31
    assert _philox.dropout_threshold(0.1) == int(0.1 * 2**32)
    assert _philox.dropout_threshold(2.0**-33) == 0
    assert _philox.dropout_threshold(1 - 2.0**-40) == 2**32 - 1
    assert _philox.dropout_threshold(1.0) == 2**32 - 1


@settings(deadline=None, max_examples=15)
@given(
    seed=st.integers(0, 2**64 - 1),
    offset=st.integers(0, 2**64 - 1),
    p=st.floats(0.0, 0.99),
)
def test_keep_mask_follows_the_documented_counter(seed, offset, p):
    # The exact contract the GPU kernels implement, element by element.
    batch, nheads, seqlen_q, seqlen_k = 2, 3, 5, 11
    mask = _philox.keep_mask(seed, offset, batch, nheads, seqlen_q, seqlen_k, p)
    assert mask.dtype == bool and mask.shape == (batch, nheads, seqlen_q, seqlen_k)
    key = (seed & MASK32, seed >> 32)
    threshold = min(int(p * 2**32), 2**32 - 1)
    for b, h, i, j in np.ndindex(mask.shape):
        counter = (j >> 2, i, b * nheads + h, offset & MASK32)
        word = _philox_scalar(counter, key)[j & 3]
        assert mask[b, h, i, j] == (word >= threshold), (b, h, i, j)


@settings(deadline=None, max_examples=30)
@given(
    seed=st.integers(0, 2**64 - 1),
    p=st.floats(0.0, 0.9),
    rows=st.tuples(st.integers(0, 40), st.integers(0, 40)).map(sorted),
    cols=st.tuples(st.integers(0, 40), st.integers(0, 40)).map(sorted),
    batch=st.lists(st.integers(0, 3), min_size=1, max_size=3, unique=True),
)
def test_keep_block_is_a_tile_of_keep_mask(seed, p, rows, cols, batch):
    mask = _philox.keep_mask(seed, 5, 4, 2, 40, 40, p)
    tile = _philox.keep_block(seed, 5, p, 2, batch, *rows, *cols)
    assert np.array_equal(tile, mask[batch, :, rows[0] : rows[1], cols[0] : cols[1]])


def test_varlen_masks_are_tiles_of_the_padded_mask():
    # Counters depend on (batch, head, row, col) only, never on the sequence lengths.
    seqlens_q, seqlens_k = (7, 0, 13, 2), (9, 4, 0, 13)
    masks = _philox.varlen_keep_masks(99, 3, 2, seqlens_q, seqlens_k, 0.3)
    padded = _philox.keep_mask(99, 3, 4, 2, 13, 13, 0.3)
    for b, (mask, sq, sk) in enumerate(zip(masks, seqlens_q, seqlens_k)):
        assert np.array_equal(mask, padded[b : b + 1, :, :sq, :sk])


@pytest.mark.parametrize("p", [0.0, 0.05, 0.3, 0.5, 0.85])
def test_kept_fraction_is_one_minus_p(p):
    mask = _philox.keep_mask(2024, 17, 2, 4, 256, 512, p)
    assert abs(mask.mean() - (1 - p)) < 0.01
    # Every row and every head alike: no stuck counter word.
    assert abs(mask.mean(axis=(0, 1, 2)) - (1 - p)).max() < 0.1


def test_same_seed_and_offset_same_mask_otherwise_different():
    def mask(seed, offset):
        return _philox.keep_mask(seed, offset, 2, 2, 33, 47, 0.5)

    reference = mask(12345, 6)
    assert np.array_equal(reference, mask(12345, 6))
    for seed, offset in ((12346, 6), (12345, 7), (12345 + 2**32, 6), (0, 0)):
        other = mask(seed, offset)
        assert 0.3 < (other != reference).mean() < 0.7, (seed, offset)
    # The counter holds the low 32 bits of the offset.
    assert np.array_equal(reference, mask(12345, 6 + 2**32))


# --- the oracle: textbook loop, finite differences, conventions ------------------------------

tiny_shapes = attention_shapes(max_batch=2, max_seqlen=9, max_headdim=8, allow_zero=True)


@settings(deadline=None, max_examples=200)
@given(shape=tiny_shapes, scale=scales, data=st.data(), seed=seeds)
def test_reference_matches_textbook(shape, scale, data, seed):
    variant = data.draw(variants(shape.batch, shape.nheads, 10), label="variant")
    q, k, v = random_qkv(shape, np.float64, np.random.default_rng(seed))
    options = variant.reference_options(_keep(shape, variant))
    out, lse = attention_reference(q, k, v, causal=shape.causal, softmax_scale=scale, **options)
    out_tb, lse_tb = attention_textbook(q, k, v, shape.causal, scale, **options)

    assert out.dtype == lse.dtype == np.float64
    assert_close(out, out_tb, atol=1e-12, rtol=1e-12, name="out")
    assert_close(lse, lse_tb, atol=1e-12, rtol=1e-12, name="lse")


@settings(deadline=None, max_examples=200)
@given(shape=tiny_shapes, scale=scales, data=st.data(), seed=seeds)
def test_reference_gradients_match_textbook(shape, scale, data, seed):
    variant = data.draw(variants(shape.batch, shape.nheads, 10), label="variant")
    dout, q, k, v = _data(shape, np.float64, seed)
    options = dict(softmax_scale=scale, **variant.reference_options(_keep(shape, variant)))
    grads = attention_reference_backward(dout, q, k, v, causal=shape.causal, **options)
    options["scale"] = options.pop("softmax_scale")
    expected = attention_textbook_backward(dout, q, k, v, shape.causal, **options)

    for name, grad, want in zip(("dq", "dk", "dv"), grads, expected):
        assert_close(grad, want, atol=1e-12 * _scale_of(want), rtol=1e-12, name=name)


FD_VARIANTS = {
    "softcap": Variant(softcap=0.7),
    "alibi per head": Variant(alibi_slopes=np.array([0.5, 0.25, 0.125, 1.0], np.float32)),
    "alibi per batch and head": Variant(
        alibi_slopes=np.array([[0.3, 0.2, 0.9, 0.0], [1.0, 0.5, 0.1, 0.7]], np.float32)
    ),
    "window": Variant(window_size=(1, 0)),
    "asymmetric window": Variant(window_size=(0, 2)),
    "dropout": Variant(dropout_p=0.4, seed=3),
    "everything": Variant(
        window_size=(2, 1), softcap=1.5, alibi_slopes=np.full(4, 0.3, np.float32),
        dropout_p=0.25, seed=11,
    ),
}


@pytest.mark.parametrize(
    "shape",
    [
        Shape(2, 3, 4, 4, 2, 3, False),  # GQA
        Shape(2, 4, 3, 4, 1, 2, True),  # MQA, seqlen_q > seqlen_k: row 0 sees no key
        Shape(2, 2, 5, 4, 4, 3, True),  # seqlen_q < seqlen_k
    ],
)
@pytest.mark.parametrize("variant", FD_VARIANTS.values(), ids=FD_VARIANTS.keys())
def test_reference_gradients_match_finite_differences(shape, variant):
    dout, q, k, v = _data(shape, np.float64, seed=None)
    options = variant.reference_options(_keep(shape, variant))
    dq, dk, dv = attention_reference_backward(dout, q, k, v, causal=shape.causal, **options)

    def loss():  # <dout, out>, whose gradient is the backward of dout
        out, _ = attention_reference(q, k, v, causal=shape.causal, **options)
        return float((dout * out).sum())

    for name, grad, x in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        assert_close(grad, finite_difference(loss, x), atol=1e-7, rtol=1e-6, name=name)


def test_reference_backward_takes_d_from_the_given_out():
    shape = Shape(2, 9, 12, 4, 2, 8, True)
    dout, q, k, v = _data(shape, np.float64, seed=None)
    options = Variant(window_size=(4, -1), softcap=2.0, dropout_p=0.3, seed=1).reference_options(
        _philox.keep_mask(1, 0, 2, 4, 9, 12, 0.3)
    )
    out, _ = attention_reference(q, k, v, causal=True, **options)
    exact = attention_reference_backward(dout, q, k, v, causal=True, **options)
    given = attention_reference_backward(dout, q, k, v, causal=True, out=out, **options)
    for a, b in zip(exact, given):
        assert_close(a, b, atol=1e-13, name="grad")
    # D = rowsum(dO O) enters dS = P (dP - D) only: a shifted out moves dq and dk, never dv.
    shifted = attention_reference_backward(dout, q, k, v, causal=True, out=out + 0.01, **options)
    assert np.array_equal(shifted[2], exact[2])
    assert np.abs(shifted[0] - exact[0]).max() > 1e-4


def test_visibility_pattern_written_out():
    # seqlen_q 4, seqlen_k 6: query i's diagonal key is i + 2; window (1, 1) keeps keys
    # i + 1 .. i + 3; causal with left 1 keeps i + 1 .. i + 2.
    shape = Shape(1, 4, 6, 1, 1, 2, False)
    q, k, v = random_qkv(shape, np.float64, np.random.default_rng(0))
    v = np.eye(6)[None, :, None, :]  # out row = the attention weights themselves
    for causal, expected in (
        (False, ["011100", "001110", "000111", "000011"]),
        (True, ["011000", "001100", "000110", "000011"]),
    ):
        out, _ = attention_reference(q, k, v, causal=causal, window_size=(1, 1))
        seen = ["".join("1" if w > 0 else "0" for w in row) for row in out[0, :, 0]]
        assert seen == expected, causal


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(7, 7), (9, 4), (3, 8)])
def test_window_conventions(seqlen_q, seqlen_k):
    shape = Shape(2, seqlen_q, seqlen_k, 2, 1, 4, False)
    q, k, v = random_qkv(shape, np.float64, np.random.default_rng(1))

    def ref(causal=False, window_size=(-1, -1)):
        return attention_reference(q, k, v, causal=causal, window_size=window_size)

    def same(a, b):
        return all(np.array_equal(x, y) for x, y in zip(a, b))

    plain, causal = ref(), ref(causal=True)
    assert same(ref(window_size=(seqlen_k, seqlen_k + 5)), plain)  # >= seqlen_k: unbounded
    assert same(ref(window_size=(-7, -1)), plain)  # any negative: unbounded
    assert same(ref(window_size=(-1, 0)), causal)
    assert same(ref(causal=True, window_size=(-1, 3)), causal)  # causal overrides right
    assert same(ref(causal=True, window_size=(2, -1)), ref(window_size=(2, 0)))
    assert normalized_window((5, seqlen_k), False, seqlen_k) == (5 if 5 < seqlen_k else -1, -1)


def test_alibi_per_head_equals_per_batch_and_head_repeated():
    shape = Shape(3, 6, 9, 4, 2, 5, True)
    q, k, v = random_qkv(shape, np.float64, np.random.default_rng(2))
    slopes = np.array([0.5, 0.25, 0.1, 0.0], np.float32)
    per_head = attention_reference(q, k, v, causal=True, alibi_slopes=slopes)
    per_batch = attention_reference(q, k, v, causal=True, alibi_slopes=np.tile(slopes, (3, 1)))
    assert all(np.array_equal(a, b) for a, b in zip(per_head, per_batch))


def test_alibi_is_minus_slope_times_distance_in_the_lse():
    # One key per row (window (0, 0)): the LSE is that key's score alone.
    shape = Shape(1, 5, 8, 2, 2, 3, False)
    q, k, v = random_qkv(shape, np.float64, np.random.default_rng(3))
    slopes = np.array([0.5, 2.0], np.float32)
    _, lse = attention_reference(q, k, v, window_size=(0, 0), alibi_slopes=slopes)
    diagonal = np.arange(5) + 3
    expected = np.einsum("ihd,ihd->hi", q[0], k[0, diagonal]) / np.sqrt(3)
    assert_close(lse[0], expected, atol=1e-12, name="lse")  # distance 0: no bias

    _, lse = attention_reference(q, k, v, window_size=(1, -1), alibi_slopes=slopes, causal=True)
    # Keys diagonal - 1 and diagonal: log(exp(s0 - slope) + exp(s1)).
    s0 = np.einsum("ihd,ihd->hi", q[0], k[0, diagonal - 1]) / np.sqrt(3)
    expected2 = np.logaddexp(s0 - slopes[:, None].astype(np.float64), expected)
    assert_close(lse[0], expected2, atol=1e-12, name="lse")


@pytest.mark.parametrize("p", [0.2, 0.7])
def test_dropout_changes_out_never_the_lse(p):
    shape = Shape(2, 11, 13, 4, 2, 8, True)
    q, k, v = random_qkv(shape, np.float64, np.random.default_rng(4))
    keep = _philox.keep_mask(1, 2, 2, 4, 11, 13, p)
    out, lse = attention_reference(q, k, v, causal=True, dropout_p=p, dropout_keep=keep)
    plain, plain_lse = attention_reference(q, k, v, causal=True)
    assert np.array_equal(lse, plain_lse)
    assert not np.allclose(out[:, 2:], plain[:, 2:])
    # Keeping everything at p = 0 is plain attention.
    all_kept = np.ones_like(keep)
    assert np.array_equal(attention_reference(q, k, v, causal=True, dropout_keep=all_kept)[0], plain)
    with pytest.raises(ValueError, match="dropout_keep"):
        attention_reference(q, k, v, dropout_p=p)


def test_softcap_bounds_the_scores():
    shape = Shape(1, 4, 5, 1, 1, 16, False)
    q, k, v = random_qkv(shape, np.float64, np.random.default_rng(5))
    q *= 100  # scores far beyond the cap
    _, lse = attention_reference(q, k, v, softcap=2.0)
    assert np.all(lse <= 2.0 + np.log(5) + 1e-12)
    assert np.all(lse >= -2.0 + np.log(5) - 1e-12)


@settings(deadline=None, max_examples=40)
@given(shape=varlen_shapes(max_batch=4, max_seqlen=12, max_headdim=8), data=st.data(), seed=seeds)
def test_reference_varlen_is_the_textbook_of_each_sequence(shape, data, seed):
    variant = data.draw(variants(shape.batch, shape.nheads, 13), label="variant")
    dout, q, k, v = _data(shape, np.float64, seed)
    keep = _varlen_keep(shape, variant)
    options = variant.reference_options(keep)
    out, lse = attention_reference_varlen(q, k, v, shape.cu_seqlens_q, shape.cu_seqlens_k,
                                          causal=shape.causal, **options)
    grads = attention_reference_varlen_backward(dout, q, k, v, shape.cu_seqlens_q,
                                                shape.cu_seqlens_k, causal=shape.causal, **options)
    assert out.shape == q.shape and lse.shape == (shape.nheads, q.shape[0])

    cu_q, cu_k = shape.cu_seqlens_q, shape.cu_seqlens_k
    for b in range(shape.batch):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        slopes = variant.alibi_slopes
        if slopes is not None and slopes.ndim == 2:
            slopes = slopes[b : b + 1]
        own = dict(options, alibi_slopes=slopes, dropout_keep=None if keep is None else keep[b])
        args = [x[None, rows] for x, rows in ((q, rows_q), (k, rows_k), (v, rows_k))]
        out_tb, lse_tb = attention_textbook(*args, shape.causal, **own)
        assert_close(out[rows_q], out_tb[0], atol=1e-12, rtol=1e-12, name=f"out[{b}]")
        assert_close(lse[:, rows_q], lse_tb[0], atol=1e-12, rtol=1e-12, name=f"lse[{b}]")
        expected = attention_textbook_backward(dout[None, rows_q], *args, shape.causal, **own)
        for name, grad, want, rows in zip(("dq", "dk", "dv"), grads, expected, (rows_q, rows_k, rows_k)):
            assert_close(grad[rows], want[0], atol=1e-12 * _scale_of(want), name=f"{name}[{b}]")


@settings(deadline=None, max_examples=30)
@given(shape=attention_shapes(max_batch=2, max_seqlen=40, max_headdim=32), data=st.data(), seed=seeds)
def test_lowp_yardstick_error_is_small_but_real(shape, data, seed):
    variant = data.draw(variants(shape.batch, shape.nheads, 40), label="variant")
    dout, q, k, v = _data(shape, np.float16, seed)
    options = variant.reference_options(_keep(shape, variant))
    out_ref, _ = attention_reference(q, k, v, causal=shape.causal, **options)
    grads_ref = attention_reference_backward(dout, q, k, v, causal=shape.causal, **options)
    for dtype, bound in ((np.float16, 5e-2), ("bfloat16", 4e-1), (np.float32, 1e-4)):
        out = attention_lowp(q, k, v, causal=shape.causal, dtype=dtype, **options)
        grads = attention_lowp_backward(dout, q, k, v, causal=shape.causal, dtype=dtype, **options)
        for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (out_ref, *grads_ref)):
            assert got.dtype == np.float32 and got.shape == want.shape
            assert np.array_equal(round_to(got, dtype), got), f"{name} not {dtype}"
            assert not np.isnan(got).any(), name
            assert np.abs(got - want).max(initial=0.0) <= bound * _scale_of(want), (name, dtype)


# --- the CPU path against the oracle ---------------------------------------------------------


def _cpu_forward(q, k, v, shape, variant, softmax_scale=None, **kwargs):
    out, lse = cpu.attention_forward(q, k, v, causal=shape.causal, softmax_scale=softmax_scale,
                                     **variant.options(), **kwargs)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == (shape.batch, shape.nheads, shape.seqlen_q)
    return out, lse


def _cpu_backward(dout, q, k, v, shape, variant, softmax_scale=None, **kwargs):
    out, lse = _cpu_forward(q, k, v, shape, variant, softmax_scale)
    grads = cpu.attention_backward(dout, q, k, v, out, lse, causal=shape.causal,
                                   softmax_scale=softmax_scale, **variant.options(), **kwargs)
    for grad, like in zip(grads, (q, k, v)):
        assert grad.dtype == like.dtype and grad.shape == like.shape
    return grads, lse


def _check_forward(out, lse, out_ref, lse_ref, dtype):
    assert_close(out, out_ref, atol=OUT_TOL[dtype] * _scale_of(out_ref), name="out")
    assert_close(lse, lse_ref, atol=LSE_TOL[dtype] * _scale_of(lse_ref), name="lse")


def _check_grads(grads, expected, lse, dtype):
    for name, grad, want in zip(("dq", "dk", "dv"), grads, expected):
        atol = GRAD_TOL[dtype] * _scale_of(want) * (1 + _max_finite(lse))
        assert_close(grad, want, atol=atol, name=name)


cpu_shapes = attention_shapes(max_batch=2, max_seqlen=70, max_headdim=32, allow_zero=True)


@settings(deadline=None, max_examples=150)
@cpu_path_draws(cpu_shapes, data=st.data())
def test_forward_matches_reference(shape, dtype, scale, block_q, block_k, data, seed):
    variant = data.draw(variants(shape.batch, shape.nheads, 70), label="variant")
    q, k, v = random_qkv(shape, dtype, np.random.default_rng(seed))
    out, lse = _cpu_forward(q, k, v, shape, variant, scale, block_q=block_q, block_k=block_k)
    out_ref, lse_ref = attention_reference(
        q, k, v, causal=shape.causal, softmax_scale=scale,
        **variant.reference_options(_keep(shape, variant)),
    )
    _check_forward(out, lse, out_ref, lse_ref, dtype)


@settings(deadline=None, max_examples=150)
@cpu_path_draws(cpu_shapes, data=st.data())
def test_backward_matches_reference(shape, dtype, scale, block_q, block_k, data, seed):
    variant = data.draw(variants(shape.batch, shape.nheads, 70), label="variant")
    dout, q, k, v = _data(shape, dtype, seed)
    grads, lse = _cpu_backward(dout, q, k, v, shape, variant, scale, block_q=block_q,
                               block_k=block_k)
    expected = attention_reference_backward(
        dout, q, k, v, causal=shape.causal, softmax_scale=scale,
        **variant.reference_options(_keep(shape, variant)),
    )
    _check_grads(grads, expected, lse, np.float32 if dtype == np.float32 else np.float64)


FEATURES = ("window", "softcap", "alibi", "dropout")
COMBINATIONS = [
    dict(zip(FEATURES, flags)) for flags in itertools.product([False, True], repeat=len(FEATURES))
]


def _fixed_variant(batch, nheads, window=False, softcap=False, alibi=False, dropout=False):
    return Variant(
        window_size=(9, 4) if window else (-1, -1),
        softcap=3.0 if softcap else 0.0,
        alibi_slopes=(np.linspace(0.05, 0.6, batch * nheads, dtype=np.float32).reshape(batch, nheads)
                      if alibi else None),
        dropout_p=0.3 if dropout else 0.0,
        seed=2**63 + 12345,
        rng_offset=77,
    )


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "features", COMBINATIONS, ids=["+".join(f for f in FEATURES if c[f]) or "plain" for c in COMBINATIONS]
)
def test_every_combination_fixed_length(features, causal):
    shape = Shape(2, 37, 53, 6, 2, 16, causal)  # GQA 3:1
    variant = _fixed_variant(2, 6, **features)
    dout, q, k, v = _data(shape, np.float32, seed=None)
    grads, lse = _cpu_backward(dout, q, k, v, shape, variant, block_q=16, block_k=16)
    out, lse = _cpu_forward(q, k, v, shape, variant, block_q=16, block_k=16)

    options = variant.reference_options(_keep(shape, variant))
    out_ref, lse_ref = attention_reference(q, k, v, causal=causal, **options)
    _check_forward(out, lse, out_ref, lse_ref, np.float32)
    expected = attention_reference_backward(dout, q, k, v, causal=causal, **options)
    _check_grads(grads, expected, lse, np.float32)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "features", COMBINATIONS, ids=["+".join(f for f in FEATURES if c[f]) or "plain" for c in COMBINATIONS]
)
def test_every_combination_varlen(features, causal):
    # Zero-length sequences on either side, seqlen_q > seqlen_k and the reverse.
    shape = VarlenShape((37, 0, 20, 5, 1), (53, 11, 0, 30, 1), 6, 2, 16, causal)
    variant = _fixed_variant(shape.batch, 6, **features)
    dout, q, k, v = _data(shape, np.float32, seed=None)
    grads, out, lse = _cpu_varlen(dout, q, k, v, shape, variant, block_q=16, block_k=16)

    options = variant.reference_options(_varlen_keep(shape, variant))
    cu = (shape.cu_seqlens_q, shape.cu_seqlens_k)
    out_ref, lse_ref = attention_reference_varlen(q, k, v, *cu, causal=causal, **options)
    _check_forward(out, lse, out_ref, lse_ref, np.float32)
    expected = attention_reference_varlen_backward(dout, q, k, v, *cu, causal=causal, **options)
    _check_grads(grads, expected, lse, np.float32)
    assert np.all(lse[:, 37:57] == np.inf)  # sequence 2 has no keys


def _cpu_varlen(dout, q, k, v, shape, variant, **kwargs):
    options = dict(causal=shape.causal, softmax_scale=None, **variant.options(), **kwargs)
    out, lse = cpu.attention_varlen_forward(q, k, v, *_varlen_args(shape), **options)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == (shape.nheads, q.shape[0])
    grads = cpu.attention_varlen_backward(dout, q, k, v, out, lse, *_varlen_args(shape), **options)
    for grad, like in zip(grads, (q, k, v)):
        assert grad.dtype == like.dtype and grad.shape == like.shape
    return grads, out, lse


@settings(deadline=None, max_examples=100)
@blocked_draws(varlen_shapes(max_batch=4, max_seqlen=50, max_headdim=32), data=st.data())
def test_varlen_matches_reference(shape, block_q, block_k, data, seed):
    variant = data.draw(variants(shape.batch, shape.nheads, 50), label="variant")
    dout, q, k, v = _data(shape, np.float32, seed)
    grads, out, lse = _cpu_varlen(dout, q, k, v, shape, variant, block_q=block_q, block_k=block_k)

    options = variant.reference_options(_varlen_keep(shape, variant))
    cu = (shape.cu_seqlens_q, shape.cu_seqlens_k)
    out_ref, lse_ref = attention_reference_varlen(q, k, v, *cu, causal=shape.causal, **options)
    _check_forward(out, lse, out_ref, lse_ref, np.float32)
    expected = attention_reference_varlen_backward(dout, q, k, v, *cu, causal=shape.causal, **options)
    _check_grads(grads, expected, lse, np.float32)


@settings(deadline=None, max_examples=30)
@given(
    shape=attention_shapes(max_batch=3, max_seqlen=40, max_headdim=16, allow_zero=True),
    data=st.data(),
    seed=seeds,
)
def test_varlen_of_equal_lengths_is_the_fixed_length_batch(shape, data, seed):
    # Same sequences packed: same results, dropout included (batch index b in the counter).
    variant = data.draw(variants(shape.batch, shape.nheads, 40), label="variant")
    dout, q, k, v = _data(shape, np.float32, seed)
    grads, lse = _cpu_backward(dout, q, k, v, shape, variant, block_q=16, block_k=16)
    out, lse = _cpu_forward(q, k, v, shape, variant, block_q=16, block_k=16)

    packed = VarlenShape((shape.seqlen_q,) * shape.batch, (shape.seqlen_k,) * shape.batch,
                         shape.nheads, shape.nheads_kv, shape.headdim, shape.causal)

    def pack(x):
        return x.reshape(-1, *x.shape[2:])

    grads_v, out_v, lse_v = _cpu_varlen(*map(pack, (dout, q, k, v)), packed, variant,
                                        block_q=16, block_k=16)
    assert_close(out_v, pack(out), atol=1e-6 * _scale_of(out), name="out")
    expected_lse = lse.transpose(1, 0, 2).reshape(shape.nheads, -1)
    assert_close(lse_v, expected_lse, atol=1e-6 * _scale_of(lse), name="lse")
    for name, got, want in zip(("dq", "dk", "dv"), grads_v, grads):
        assert_close(got, pack(want), atol=1e-6 * _scale_of(want), name=name)


def test_varlen_rejects_a_sequence_longer_than_max_seqlen():
    shape = VarlenShape((3, 5), (4, 4), 2, 1, 8, False)
    q, k, v = random_qkv(shape, np.float32, np.random.default_rng())
    with pytest.raises(ValueError, match="max_seqlen_q"):
        cpu.attention_varlen_forward(q, k, v, shape.cu_seqlens_q, shape.cu_seqlens_k, 4, 4,
                                     causal=False, softmax_scale=None)


@pytest.mark.parametrize(
    "seqlen_q, seqlen_k, causal, window_size",
    [
        (9, 4, True, (-1, -1)),  # rows 0..4 see no key
        (9, 4, False, (-1, 0)),  # the same as causal
        (12, 5, False, (2, 1)),  # rows 0..5 see no key
        (10, 3, False, (-1, 2)),  # rows 0..4 see no key
    ],
)
@pytest.mark.parametrize("block_q, block_k", [(1, 1), (4, 3), (128, 128)])
def test_rows_outside_every_window_give_zero_and_inf(seqlen_q, seqlen_k, causal, window_size,
                                                      block_q, block_k):
    shape = Shape(2, seqlen_q, seqlen_k, 4, 2, 8, causal)
    variant = Variant(window_size=window_size, softcap=5.0,
                      alibi_slopes=np.full(4, 0.2, np.float32), dropout_p=0.1, seed=5)
    dout, q, k, v = _data(shape, np.float32, seed=None)
    (dq, dk, dv), lse = _cpu_backward(dout, q, k, v, shape, variant, block_q=block_q,
                                      block_k=block_k)
    out, _ = _cpu_forward(q, k, v, shape, variant, block_q=block_q, block_k=block_k)
    left, right = normalized_window(window_size, causal, seqlen_k)
    blind = np.arange(seqlen_q) + seqlen_k - seqlen_q + right < 0  # rows that see no key

    assert blind.any()
    assert not any(np.isnan(x).any() for x in (out, lse, dq, dk, dv))
    assert np.all(out[:, blind] == 0) and np.all(dq[:, blind] == 0)
    assert np.all(lse[:, :, blind] == np.inf) and np.isfinite(lse[:, :, ~blind]).all()


def _band(seqlen_q, seqlen_k, causal, window_size):
    """visible[i, j], from the documented rule."""
    left, right = normalized_window(window_size, causal, seqlen_k)
    i, j = np.arange(seqlen_q)[:, None], np.arange(seqlen_k)[None, :]
    diagonal = i + seqlen_k - seqlen_q
    return ((left < 0) | (j >= diagonal - left)) & ((right < 0) | (j <= diagonal + right))


@settings(deadline=None, max_examples=100)
@given(
    seqlen_q=seqlens(200),
    seqlen_k=seqlens(200),
    causal=st.booleans(),
    window_size=window_sizes(60),
    block_q=st.integers(1, 40),
    block_k=st.integers(1, 40),
    data=st.data(),
)
def test_tiles_outside_the_window_are_never_read(seqlen_q, seqlen_k, causal, window_size,
                                                 block_q, block_k, data):
    # NaN in a tile the kernel touches reaches the output (0 * NaN = NaN in P V, and in the
    # backward's products), so NaN planted in every tile wholly outside the band of one block
    # proves those tiles are skipped. Tiles are aligned at multiples of the block sizes.
    shape = Shape(1, seqlen_q, seqlen_k, 2, 1, 4, causal)
    variant = Variant(window_size=window_size)
    dout, q, k, v = _data(shape, np.float64, seed=None)
    visible = _band(seqlen_q, seqlen_k, causal, window_size)
    blocks = {"block_q": block_q, "block_k": block_k}

    # Forward: one query block; NaN keys and values in the key blocks it cannot see.
    q_start = data.draw(st.integers(0, (seqlen_q - 1) // block_q), label="q block") * block_q
    rows = slice(q_start, min(q_start + block_q, seqlen_q))
    k_bad, v_bad = k.copy(), v.copy()
    for k_start in range(0, seqlen_k, block_k):
        cols = slice(k_start, k_start + block_k)
        if not visible[rows, cols].any():
            k_bad[:, cols] = v_bad[:, cols] = np.nan
    out, lse = _cpu_forward(q, k_bad, v_bad, shape, variant, **blocks)
    out_ref, lse_ref = attention_reference(q, k, v, causal=causal, window_size=window_size)
    assert_close(out[:, rows], out_ref[:, rows], atol=1e-10, name="out")
    assert_close(lse[:, :, rows], lse_ref[:, :, rows], atol=1e-6, name="lse")

    # Backward: one key block; NaN queries and upstream gradients in the query blocks that
    # cannot see it.
    k_start = data.draw(st.integers(0, (seqlen_k - 1) // block_k), label="k block") * block_k
    cols = slice(k_start, min(k_start + block_k, seqlen_k))
    out, lse = _cpu_forward(q, k, v, shape, variant)
    q_bad, dout_bad = q.copy(), dout.copy()
    for q_start in range(0, seqlen_q, block_q):
        rows = slice(q_start, q_start + block_q)
        if not visible[rows, cols].any():
            q_bad[:, rows] = dout_bad[:, rows] = np.nan
    _, dk, dv = cpu.attention_backward(dout_bad, q_bad, k, v, out, lse, causal=causal,
                                       softmax_scale=None, window_size=window_size, **blocks)
    _, dk_ref, dv_ref = attention_reference_backward(dout, q, k, v, causal=causal,
                                                     window_size=window_size)
    scale = 1 + _max_finite(lse)
    assert_close(dk[:, cols], dk_ref[:, cols], atol=1e-6 * scale * _scale_of(dk_ref), name="dk")
    assert_close(dv[:, cols], dv_ref[:, cols], atol=1e-6 * scale * _scale_of(dv_ref), name="dv")


def test_dropout_mask_is_generated_tile_by_tile(monkeypatch):
    tiles = []
    keep_block = _philox.keep_block

    def recording(seed, offset, p, nheads, batch, row_start, row_stop, col_start, col_stop, **kw):
        tiles.append((row_stop - row_start, col_stop - col_start))
        return keep_block(seed, offset, p, nheads, batch, row_start, row_stop, col_start,
                          col_stop, **kw)

    monkeypatch.setattr(_philox, "keep_block", recording)
    shape = Shape(1, 300, 260, 2, 1, 8, False)
    variant = Variant(dropout_p=0.2, seed=8, rng_offset=9)
    dout, q, k, v = _data(shape, np.float32, seed=None)
    blocks = dict(block_q=64, block_k=32)
    out, lse = _cpu_forward(q, k, v, shape, variant, **blocks)
    grads = cpu.attention_backward(dout, q, k, v, out, lse, causal=False, softmax_scale=None,
                                   **variant.options(), **blocks)
    assert tiles and max(r for r, _ in tiles) <= 64 and max(c for _, c in tiles) <= 32

    monkeypatch.undo()
    expected = attention_reference_backward(dout, q, k, v,
                                            **variant.reference_options(_keep(shape, variant)))
    _check_grads(grads, expected, lse, np.float32)


def test_dropout_depends_on_seed_and_offset_not_on_tiles():
    shape = Shape(2, 45, 50, 4, 2, 8, True)
    q, k, v = random_qkv(shape, np.float64, np.random.default_rng(6))
    variant = Variant(dropout_p=0.5, seed=31, rng_offset=4)
    out, _ = _cpu_forward(q, k, v, shape, variant, block_q=128, block_k=128)
    for block_q, block_k in ((1, 1), (7, 5), (16, 64)):
        other, _ = _cpu_forward(q, k, v, shape, variant, block_q=block_q, block_k=block_k)
        assert_close(other, out, atol=1e-12, name=f"out with blocks {block_q}x{block_k}")
    for seed, offset in ((32, 4), (31, 5)):
        other, _ = _cpu_forward(q, k, v, shape, Variant(dropout_p=0.5, seed=seed, rng_offset=offset))
        assert np.abs(other - out).max() > 0.1, (seed, offset)
    with pytest.raises(ValueError, match="seed"):
        cpu.attention_forward(q, k, v, causal=False, softmax_scale=None, dropout_p=0.5)


FP16_HALF_ULP = 2.0**-11  # half an ulp at 1, the GPU tests' FLOOR for float16


@settings(deadline=None, max_examples=50)
@blocked_draws(attention_shapes(max_batch=2, max_seqlen=70, max_headdim=32), data=st.data())
def test_float16_within_flash_attn_rules(shape, block_q, block_k, data, seed):
    # The yardstick GPU tests use, with every variant: out within 2x plain fp16 attention's
    # error, gradients within 3x, plus the noise of storing the exact answer in fp16.
    variant = data.draw(variants(shape.batch, shape.nheads, 70), label="variant")
    dout, q, k, v = _data(shape, np.float16, seed)
    grads, _ = _cpu_backward(dout, q, k, v, shape, variant, block_q=block_q, block_k=block_k)
    out, _ = _cpu_forward(q, k, v, shape, variant, block_q=block_q, block_k=block_k)
    options = dict(causal=shape.causal, **variant.reference_options(_keep(shape, variant)))
    out_ref, _ = attention_reference(q, k, v, **options)
    out_lowp = attention_lowp(q, k, v, **options)
    grads_ref = attention_reference_backward(dout, q, k, v, **options)
    grads_lowp = attention_lowp_backward(dout, q, k, v, **options)

    # Floors: forward, the noise of storing the exact out in fp16; gradients, the GPU tests'
    # one ulp at the gradient's scale plus the effect of D = rowsum(dO O) being taken from
    # the fp16 out (FlashAttention's D; plain attention's backward takes it from P and dP),
    # measured exactly by the oracle given that out. Dropout's 1 / (1 - p) enlarges out and
    # with it that effect, which the ulp floor alone does not cover.
    grads_given_out = attention_reference_backward(dout, q, k, v, out=out, **options)
    floors = [rounding_floor(out_ref)]
    floors += [
        2 * FP16_HALF_ULP * (1 + np.abs(want).max(initial=0.0)) + np.abs(given - want).max(initial=0.0)
        for want, given in zip(grads_ref, grads_given_out)
    ]
    for name, got, want, lowp, factor, floor in zip(
        ("out", "dq", "dk", "dv"), (out, *grads), (out_ref, *grads_ref), (out_lowp, *grads_lowp),
        (2, 3, 3, 3), floors,
    ):
        assert not np.isnan(got).any(), name
        error = np.abs(got.astype(np.float64) - want).max(initial=0.0)
        allowed = factor * np.abs(lowp - want).max(initial=0.0) + floor
        assert error <= allowed, f"{name}: error {error:.3e} > allowed {allowed:.3e}"


def test_lowp_varlen_is_lowp_of_each_sequence():
    shape = VarlenShape((5, 0, 9), (7, 3, 0), 4, 2, 8, True)
    variant = _fixed_variant(3, 4, window=True, softcap=True, alibi=True, dropout=True)
    dout, q, k, v = _data(shape, np.float16, seed=None)
    keep = _varlen_keep(shape, variant)
    options = variant.reference_options(keep)
    cu = (shape.cu_seqlens_q, shape.cu_seqlens_k)
    out = attention_lowp_varlen(q, k, v, *cu, causal=True, **options)
    grads = attention_lowp_varlen_backward(dout, q, k, v, *cu, causal=True, **options)
    own = dict(options, alibi_slopes=variant.alibi_slopes[:1], dropout_keep=keep[0])
    assert np.array_equal(out[:5], attention_lowp(q[None, :5], k[None, :7], v[None, :7],
                                                  causal=True, **own)[0])
    expected = attention_lowp_backward(dout[None, :5], q[None, :5], k[None, :7], v[None, :7],
                                       causal=True, **own)
    for got, want, rows in zip(grads, expected, (slice(0, 5), slice(0, 7), slice(0, 7))):
        assert np.array_equal(got[rows], want[0])
    assert np.all(out[5:] == 0) and np.all(grads[1][7:] == 0)
