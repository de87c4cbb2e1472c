"""The oracle itself: attention_reference against the most literal loop, and its contracts."""

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cuflash.reference import (
    attention_lowp,
    attention_reference,
    attention_textbook,
    round_to,
)
from .strategies import (NO_INVALID_ARITHMETIC, Shape, assert_close, assert_nan_row, attention_shapes, random_qkv,
                         scales, seeds)

pytestmark = NO_INVALID_ARITHMETIC  # (strategies.py)

# Small enough for the per-(batch, head, query) Python loop of the textbook version.
tiny_shapes = attention_shapes(max_batch=2, max_seqlen=13, max_headdim=16, allow_zero=True)


@settings(deadline=None, max_examples=200)
@given(shape=tiny_shapes, scale=scales, seed=seeds)
def test_reference_matches_textbook(shape, scale, seed):
    q, k, v = random_qkv(shape, np.float64, np.random.default_rng(seed))
    out, lse = attention_reference(q, k, v, causal=shape.causal, softmax_scale=scale)
    out_tb, lse_tb = attention_textbook(q, k, v, shape.causal, scale)

    assert out.dtype == lse.dtype == np.float64
    assert out.shape == shape.q_shape
    assert lse.shape == (shape.batch, shape.nheads, shape.seqlen_q)
    assert_close(out, out_tb, atol=1e-12, rtol=1e-12, name="out")
    assert_close(lse, lse_tb, atol=1e-12, rtol=1e-12, name="lse")


@settings(deadline=None, max_examples=100)
@given(shape=tiny_shapes, scale=scales, seed=seeds)
def test_lse_is_log_sum_exp(shape, seed, scale):
    q, k, v = random_qkv(shape, np.float64, np.random.default_rng(seed))
    _, lse = attention_reference(q, k, v, causal=shape.causal, softmax_scale=scale)

    # Independently: repeat kv heads, materialise all scores, log(sum(exp)) with no shift.
    group = shape.nheads // shape.nheads_kv
    k_rep = np.repeat(k, group, axis=2)
    scale = 1 / np.sqrt(shape.headdim) if scale is None else scale
    s = scale * np.einsum("bihd,bjhd->bhij", q, k_rep)
    i = np.arange(shape.seqlen_q)[:, None]
    j = np.arange(shape.seqlen_k)[None, :]
    visible = (j <= i + shape.seqlen_k - shape.seqlen_q) | (not shape.causal)
    total = np.where(visible, np.exp(s), 0.0).sum(axis=-1)
    expected = np.where(total == 0, np.inf, np.log(np.where(total == 0, 1.0, total)))

    assert_close(lse, expected, atol=1e-12, rtol=1e-12, name="lse")


@pytest.mark.parametrize(
    "seqlen_q, seqlen_k, causal, n_masked",
    [(5, 2, True, 3), (7, 1, True, 6), (4, 0, False, 4), (4, 0, True, 4), (3, 3, True, 0)],
)
def test_fully_masked_rows_give_zero_and_inf(seqlen_q, seqlen_k, causal, n_masked):
    shape = Shape(2, seqlen_q, seqlen_k, 4, 2, 8, causal)
    q, k, v = random_qkv(shape, np.float64, np.random.default_rng())
    out, lse = attention_reference(q, k, v, causal=causal)

    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert np.all(out[:, :n_masked] == 0)
    assert np.all(lse[:, :, :n_masked] == np.inf)
    assert np.isfinite(lse[:, :, n_masked:]).all()
    # Every visible row is a convex combination of v rows, so it cannot be all zero.
    assert np.all(np.abs(out[:, n_masked:]).max(axis=-1) > 0)

    lowp = attention_lowp(q, k, v, causal=causal, dtype=np.float16)
    assert np.all(lowp[:, :n_masked] == 0) and not np.isnan(lowp).any()


@pytest.mark.parametrize("batch, seqlen_q, seqlen_k", [(0, 3, 3), (2, 0, 3), (2, 0, 0)])
def test_zero_length_gives_empty_outputs(batch, seqlen_q, seqlen_k):
    shape = Shape(batch, seqlen_q, seqlen_k, 2, 1, 4, True)
    q, k, v = random_qkv(shape, np.float64, np.random.default_rng())
    out, lse = attention_reference(q, k, v, causal=True)
    assert out.shape == shape.q_shape and out.size == 0
    assert lse.shape == (batch, 2, seqlen_q) and lse.size == 0
    assert attention_lowp(q, k, v, causal=True, dtype=np.float16).shape == shape.q_shape


@settings(deadline=None, max_examples=50)
@given(
    shape=attention_shapes(max_batch=2, max_seqlen=70, max_headdim=64),
    seed=seeds,
    data=st.data(),
)
def test_nan_in_one_query_row_reaches_only_that_row(shape, seed, data):
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(shape, np.float64, rng)
    # Rows below seqlen_q - seqlen_k see no key under causal masking; poison a visible row.
    first_visible = max(0, shape.seqlen_q - shape.seqlen_k) if shape.causal else 0
    b = data.draw(st.integers(0, shape.batch - 1), label="b")
    i = data.draw(st.integers(first_visible, shape.seqlen_q - 1), label="i")
    h = data.draw(st.integers(0, shape.nheads - 1), label="h")
    q[b, i, h, data.draw(st.integers(0, shape.headdim - 1), label="d")] = np.nan

    out, lse = attention_reference(q, k, v, causal=shape.causal)

    assert_nan_row(out, lse, (b, i, h))


@settings(deadline=None, max_examples=30)
@given(shape=attention_shapes(max_batch=2, max_seqlen=70, max_headdim=64), seed=seeds)
def test_lowp_error_is_small_but_real(shape, seed):
    # With a handful of keys per row, rounding P and O to 16 bits cannot come out exact.
    assume(shape.seqlen_k >= 8)
    q, k, v = random_qkv(shape, np.float16, np.random.default_rng(seed))
    out, _ = attention_reference(q, k, v, causal=shape.causal)

    error = {}
    dtypes = {"float16": np.float16, "bfloat16": "bfloat16", "float32": np.float32}
    for name, dtype in dtypes.items():
        lowp = attention_lowp(q, k, v, causal=shape.causal, dtype=dtype)
        assert lowp.dtype == np.float32 and lowp.shape == shape.q_shape
        assert np.array_equal(round_to(lowp, dtype), lowp), f"{name} values not representable"
        error[name] = np.abs(lowp - out).max()

    assert 0 < error["float16"] < 1e-2
    assert 0 < error["bfloat16"] < 1e-1
    assert error["float32"] < 1e-5
    assert error["float32"] < error["float16"]


@pytest.mark.parametrize("causal", [False, True])
def test_lowp_rounds_each_stage_like_float16_tensors(causal):
    shape = Shape(2, 100, 90, 4, 2, 64, causal)
    q, k, v = random_qkv(shape, np.float16, np.random.default_rng())
    lowp = attention_lowp(q, k, v, causal=causal)

    # The same three stages written with NumPy's own float16 casts, one head per kv head.
    f32, f16 = np.float32, np.float16
    k, v = (np.repeat(x, 2, axis=2).astype(f32) for x in (k, v))
    s = np.einsum("bihd,bjhd->bhij", q.astype(f32), k) * f32(1 / np.sqrt(64))
    s = s.astype(f16).astype(f32)
    i, j = np.arange(100)[:, None], np.arange(90)[None, :]
    s = np.where((j <= i - 10) | (not causal), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - np.where(m == -np.inf, 0, m))
    l = p.sum(axis=-1, keepdims=True)
    p = (p / np.where(l == 0, 1, l)).astype(f16).astype(f32)
    expected = np.einsum("bhij,bjhd->bihd", p, v).astype(f16)

    # Only float32 summation order differs. It rarely flips a rounding of S or O by one ulp
    # (an S flip moves its whole output row by up to ~1e-3); skipping any one rounding
    # would change about a third of the outputs.
    assert_close(lowp, expected, atol=2**-8, name="lowp")
    assert (lowp != expected).mean() < 0.03


def test_round_to_bfloat16_ties_to_even():
    # bfloat16 keeps 7 fraction bits, so 2**-8 is half an ulp at 1.
    x = np.array(
        [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -(1 + 2**-8), 2**-8, np.inf, -np.inf, 0.0],
        dtype=np.float32,
    )
    expected = [1.0, 1 + 2**-6, 1 + 2**-7, -1.0, 2**-8, np.inf, -np.inf, 0.0]
    assert round_to(x, "bfloat16").tolist() == expected
    assert np.isnan(round_to(np.array([np.nan, -np.nan], np.float32), "bfloat16")).all()


@settings(deadline=None, max_examples=20)
@given(seed=seeds)
def test_round_to_bfloat16_matches_ml_dtypes(seed):
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed (NumPy bfloat16 for this check)")
    rng = np.random.default_rng(seed)
    # Every float32 bit pattern is fair game: subnormals, huge values that overflow, NaNs,
    # plus exact ties (low 16 bits 0x8000) that a uniform draw would rarely hit.
    bits = rng.integers(0, 2**32, size=20_000, dtype=np.uint32)
    bits[:2000] = (bits[:2000] & np.uint32(0xFFFF0000)) | np.uint32(0x8000)
    x = bits.view(np.float32)

    got = round_to(x, ml_dtypes.bfloat16)
    with np.errstate(invalid="ignore", over="ignore"):  # NumPy flags casts of NaN and huge values
        expected = x.astype(ml_dtypes.bfloat16).astype(np.float32)

    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), expected[~nan].view(np.uint32))


def test_round_to_float16_and_bad_dtype():
    x = np.array([1 + 2**-11, 65520.0, 1e-8, np.nan], dtype=np.float32)
    with np.errstate(over="ignore"):
        expected = x.astype(np.float16)
    assert_close(round_to(x, np.float16), expected, atol=0)
    with pytest.raises(ValueError, match="float64"):
        round_to(x, np.float64)
