"""The NumPy blockwise online-softmax backend against the float64 oracle."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuflash.cpu import attention_forward
from cuflash.reference import attention_lowp, attention_reference, round_to
from .strategies import (NO_INVALID_ARITHMETIC, Shape, assert_close, assert_nan_row, attention_shapes, blocks,
                         cpu_path_draws, random_qkv, seeds)

pytestmark = NO_INVALID_ARITHMETIC  # (strategies.py)

shapes = attention_shapes(max_batch=2, max_seqlen=70, max_headdim=64, allow_zero=True)

# Error allowed relative to the output's scale, by input dtype. float64 inputs still return
# a float32 lse (the contract), so their lse is only as exact as float32.
OUT_TOL = {np.float32: 1e-5, np.float64: 1e-10}
LSE_TOL = {np.float32: 1e-5, np.float64: 1e-6}


def _scale_of(x):
    """The largest finite magnitude, at least 1: tolerances are relative to it."""
    finite = np.abs(x[np.isfinite(x)])
    return max(1.0, float(finite.max(initial=0.0)))


def _forward(q, k, v, shape, **kwargs):
    kwargs.setdefault("softmax_scale", None)
    out, lse = attention_forward(q, k, v, causal=shape.causal, **kwargs)
    assert out.dtype == q.dtype and out.shape == shape.q_shape
    assert lse.dtype == np.float32 and lse.shape == (shape.batch, shape.nheads, shape.seqlen_q)
    return out, lse


@settings(deadline=None, max_examples=150)
@cpu_path_draws(shapes)
def test_matches_reference(shape, dtype, scale, block_q, block_k, seed):
    q, k, v = random_qkv(shape, dtype, np.random.default_rng(seed))
    out, lse = _forward(q, k, v, shape, softmax_scale=scale, block_q=block_q, block_k=block_k)
    out_ref, lse_ref = attention_reference(q, k, v, causal=shape.causal, softmax_scale=scale)

    assert_close(out, out_ref, atol=OUT_TOL[dtype] * _scale_of(out_ref), name="out")
    assert_close(lse, lse_ref, atol=LSE_TOL[dtype] * _scale_of(lse_ref), name="lse")


@settings(deadline=None, max_examples=10)
@given(
    shape=attention_shapes(max_batch=2, max_seqlen=300, max_headdim=64, max_nheads_kv=2),
    seed=seeds,
)
def test_default_blocks_match_reference(shape, seed):
    q, k, v = random_qkv(shape, np.float32, np.random.default_rng(seed))
    out, lse = _forward(q, k, v, shape)
    out_ref, lse_ref = attention_reference(q, k, v, causal=shape.causal)

    assert_close(out, out_ref, atol=1e-5 * _scale_of(out_ref), name="out")
    assert_close(lse, lse_ref, atol=1e-5 * _scale_of(lse_ref), name="lse")


@settings(deadline=None, max_examples=30)
@given(shape=shapes, block_q=blocks, block_k=blocks, seed=seeds)
def test_float16_within_flash_attn_tolerance(shape, block_q, block_k, seed):
    q, k, v = random_qkv(shape, np.float16, np.random.default_rng(seed))
    out, _ = _forward(q, k, v, shape, block_q=block_q, block_k=block_k)
    out_ref, _ = attention_reference(q, k, v, causal=shape.causal)
    out_lowp = attention_lowp(q, k, v, causal=shape.causal)

    # flash-attn's rule: at most twice the error of plain fp16 attention, plus the noise of
    # twice the noise of merely storing the exact answer in fp16.
    floor = 2 * np.abs(round_to(out_ref, np.float16) - out_ref).max(initial=0.0)
    error = np.abs(out.astype(np.float64) - out_ref).max(initial=0.0)
    assert not np.isnan(out).any()
    assert error <= 2 * np.abs(out_lowp - out_ref).max(initial=0.0) + floor


@pytest.mark.parametrize("block_q, block_k", [(1, 1), (3, 2), (128, 128)])
@pytest.mark.parametrize(
    "seqlen_q, seqlen_k, causal, n_masked",
    [(5, 2, True, 3), (70, 3, True, 67), (4, 0, False, 4), (4, 0, True, 4)],
)
def test_fully_masked_rows_give_zero_and_inf(
    seqlen_q, seqlen_k, causal, n_masked, block_q, block_k
):
    shape = Shape(2, seqlen_q, seqlen_k, 4, 2, 8, causal)
    q, k, v = random_qkv(shape, np.float32, np.random.default_rng())
    out, lse = _forward(q, k, v, shape, block_q=block_q, block_k=block_k)

    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert np.all(out[:, :n_masked] == 0)
    assert np.all(lse[:, :, :n_masked] == np.inf)
    assert np.isfinite(lse[:, :, n_masked:]).all()


@pytest.mark.parametrize("batch, seqlen_q, seqlen_k", [(0, 3, 3), (2, 0, 3), (2, 0, 0), (1, 1, 1)])
def test_tiny_and_empty(batch, seqlen_q, seqlen_k):
    shape = Shape(batch, seqlen_q, seqlen_k, 2, 1, 4, True)
    q, k, v = random_qkv(shape, np.float32, np.random.default_rng())
    out, lse = _forward(q, k, v, shape)
    out_ref, lse_ref = attention_reference(q, k, v, causal=True)
    assert_close(out, out_ref, atol=1e-6, name="out")
    assert_close(lse, lse_ref, atol=1e-6, name="lse")


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(9, 13), (13, 9), (1, 7)])
@pytest.mark.parametrize("block_q, block_k", [(1, 1), (4, 3), (128, 128)])
def test_zero_scale_is_the_mean_of_visible_values(seqlen_q, seqlen_k, block_q, block_k):
    shape = Shape(2, seqlen_q, seqlen_k, 6, 3, 5, True)
    q, k, v = random_qkv(shape, np.float64, np.random.default_rng())
    out, lse = _forward(q, k, v, shape, softmax_scale=0.0, block_q=block_q, block_k=block_k)

    # Every score is 0, so row i averages the values of keys 0 .. i + seqlen_k - seqlen_q.
    n_visible = np.clip(np.arange(seqlen_q) + seqlen_k - seqlen_q + 1, 0, seqlen_k)
    prefix_sums = np.concatenate([np.zeros_like(v[:, :1]), np.cumsum(v, axis=1)], axis=1)
    mean = prefix_sums[:, n_visible] / np.maximum(n_visible, 1)[None, :, None, None]
    expected = np.repeat(mean, 2, axis=2)  # query head h reads kv head h // 2
    expected_lse = np.where(n_visible > 0, np.log(np.maximum(n_visible, 1)), np.inf)

    assert_close(out, expected, atol=1e-12, name="out")
    assert_close(lse, np.broadcast_to(expected_lse, lse.shape), atol=1e-6, name="lse")


@settings(deadline=None, max_examples=50)
@given(
    shape=attention_shapes(max_batch=2, max_seqlen=70, max_headdim=64),
    block_q=blocks,
    block_k=blocks,
    seed=seeds,
    data=st.data(),
)
def test_nan_in_one_query_row_reaches_only_that_row(shape, block_q, block_k, seed, data):
    q, k, v = random_qkv(shape, np.float32, np.random.default_rng(seed))
    # Rows below seqlen_q - seqlen_k see no key under causal masking; poison a visible row.
    first_visible = max(0, shape.seqlen_q - shape.seqlen_k) if shape.causal else 0
    b = data.draw(st.integers(0, shape.batch - 1), label="b")
    i = data.draw(st.integers(first_visible, shape.seqlen_q - 1), label="i")
    h = data.draw(st.integers(0, shape.nheads - 1), label="h")
    q[b, i, h, data.draw(st.integers(0, shape.headdim - 1), label="d")] = np.nan

    out, lse = _forward(q, k, v, shape, block_q=block_q, block_k=block_k)
    out_ref, lse_ref = attention_reference(q, k, v, causal=shape.causal)

    assert_nan_row(out, lse, (b, i, h))
    assert_close(out, out_ref, atol=1e-5 * _scale_of(out_ref), name="out")
    assert_close(lse, lse_ref, atol=1e-5 * _scale_of(lse_ref), name="lse")
