"""The backward pass: the float64 gradient oracle, its low-precision yardstick, and the NumPy
blockwise (FlashAttention-2) backward against both."""

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import _philox
from cuflash.cpu import attention_backward, attention_forward
from cuflash.reference import (
    attention_lowp_backward,
    attention_reference,
    attention_reference_backward,
    attention_reference_varlen_backward,
    attention_textbook_backward,
    round_to,
)
from .strategies import (NO_INVALID_ARITHMETIC, Shape, VarlenShape, assert_close, attention_shapes, blocks,
                         cpu_path_draws, finite_difference, random_dout, random_qkv, reference_options, rounding_floor,
                         scales, seeds)

pytestmark = NO_INVALID_ARITHMETIC  # (strategies.py)

shapes = attention_shapes(max_batch=2, max_seqlen=70, max_headdim=64, allow_zero=True)
# Small enough for Python loops over every element (finite differences, the textbook).
tiny_shapes = attention_shapes(max_batch=2, max_seqlen=13, max_headdim=16, allow_zero=True)

# Gradient error allowed relative to the gradient's scale times (1 + max |lse|): recomputing
# P = exp(scale * S - lse) loses about one rounding of S and lse, relative to their size.
# float64 inputs still receive a float32 lse (the forward's contract), which limits them.
GRAD_TOL = {np.float32: 5e-6, np.float64: 5e-7}


def _scale_of(x):
    """The largest finite magnitude, at least 1: tolerances are relative to it."""
    finite = np.abs(x[np.isfinite(x)])
    return max(1.0, float(finite.max(initial=0.0)))


def _max_finite(x):
    return float(np.abs(x[np.isfinite(x)]).max(initial=0.0))


def _data(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(shape, dtype, rng)
    return random_dout(shape, dtype, rng), q, k, v


def _backward(dout, q, k, v, shape, softmax_scale=None, **blocks):
    """cpu.attention_backward fed by cpu.attention_forward, with its contracts checked."""
    out, lse = attention_forward(q, k, v, causal=shape.causal, softmax_scale=softmax_scale)
    grads = attention_backward(
        dout, q, k, v, out, lse, causal=shape.causal, softmax_scale=softmax_scale, **blocks
    )
    for grad, like in zip(grads, (q, k, v)):
        assert grad.dtype == like.dtype and grad.shape == like.shape
    return grads, lse


# --- the float64 oracle ------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [
        Shape(1, 3, 4, 2, 1, 3, False),
        Shape(2, 4, 3, 4, 2, 2, True),  # GQA, seqlen_q > seqlen_k: row 0 sees no key
        Shape(1, 2, 5, 3, 3, 3, True),  # seqlen_q < seqlen_k
        Shape(1, 3, 1, 2, 2, 2, True),  # two fully masked rows, one key
    ],
)
@pytest.mark.parametrize("softmax_scale", [None, 1.3])
def test_reference_gradients_match_finite_differences(shape, softmax_scale):
    dout, q, k, v = _data(shape, np.float64, seed=None)
    dq, dk, dv = attention_reference_backward(
        dout, q, k, v, causal=shape.causal, softmax_scale=softmax_scale
    )

    def loss():  # <dout, out>, whose gradient is the backward of dout
        out, _ = attention_reference(q, k, v, causal=shape.causal, softmax_scale=softmax_scale)
        return float((dout * out).sum())

    for name, grad, x in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        assert grad.dtype == np.float64 and grad.shape == x.shape
        assert_close(grad, finite_difference(loss, x), atol=1e-7, rtol=1e-6, name=name)
    if shape.causal and shape.seqlen_q > shape.seqlen_k:
        assert np.all(dq[:, : shape.seqlen_q - shape.seqlen_k] == 0)


@settings(deadline=None, max_examples=100)
@given(shape=tiny_shapes, scale=scales, seed=seeds)
def test_reference_gradients_match_textbook(shape, scale, seed):
    dout, q, k, v = _data(shape, np.float64, seed)
    grads = attention_reference_backward(dout, q, k, v, causal=shape.causal, softmax_scale=scale)
    expected = attention_textbook_backward(dout, q, k, v, shape.causal, scale)

    for name, grad, want, x in zip(("dq", "dk", "dv"), grads, expected, (q, k, v)):
        assert grad.dtype == np.float64 and grad.shape == x.shape
        assert_close(grad, want, atol=1e-12 * _scale_of(want), rtol=1e-12, name=name)


# --- the CPU backward against the oracle -------------------------------------------------


@settings(deadline=None, max_examples=200)
@cpu_path_draws(shapes)
def test_matches_reference(shape, dtype, scale, block_q, block_k, seed):
    dout, q, k, v = _data(shape, dtype, seed)
    grads, lse = _backward(
        dout, q, k, v, shape, softmax_scale=scale, block_q=block_q, block_k=block_k
    )
    expected = attention_reference_backward(
        dout, q, k, v, causal=shape.causal, softmax_scale=scale
    )

    for name, grad, want in zip(("dq", "dk", "dv"), grads, expected):
        atol = GRAD_TOL[dtype] * _scale_of(want) * (1 + _max_finite(lse))
        assert_close(grad, want, atol=atol, name=name)


@settings(deadline=None, max_examples=50)
@given(shape=shapes, scale=scales, block_q=blocks, block_k=blocks, seed=seeds)
def test_float64_with_exact_lse_is_exact(shape, scale, block_q, block_k, seed):
    # Given the float64 lse instead of the forward's float32 one, nothing limits float64.
    dout, q, k, v = _data(shape, np.float64, seed)
    out, lse = attention_reference(q, k, v, causal=shape.causal, softmax_scale=scale)
    grads = attention_backward(
        dout, q, k, v, out, lse,
        causal=shape.causal, softmax_scale=scale, block_q=block_q, block_k=block_k,
    )
    expected = attention_reference_backward(
        dout, q, k, v, causal=shape.causal, softmax_scale=scale
    )
    for name, grad, want in zip(("dq", "dk", "dv"), grads, expected):
        atol = 1e-11 * _scale_of(want) * (1 + _max_finite(lse))
        assert_close(grad, want, atol=atol, name=name)


@settings(deadline=None, max_examples=10)
@given(
    shape=attention_shapes(max_batch=2, max_seqlen=300, max_headdim=64, max_nheads_kv=2),
    seed=seeds,
)
def test_default_blocks_match_reference(shape, seed):
    dout, q, k, v = _data(shape, np.float32, seed)
    grads, lse = _backward(dout, q, k, v, shape)
    expected = attention_reference_backward(dout, q, k, v, causal=shape.causal)

    for name, grad, want in zip(("dq", "dk", "dv"), grads, expected):
        atol = GRAD_TOL[np.float32] * _scale_of(want) * (1 + _max_finite(lse))
        assert_close(grad, want, atol=atol, name=name)


@pytest.mark.parametrize("block_q, block_k", [(1, 1), (3, 2), (128, 128)])
@pytest.mark.parametrize(
    "seqlen_q, seqlen_k, causal, n_masked",
    [(5, 2, True, 3), (70, 3, True, 67), (4, 0, False, 4), (4, 0, True, 4), (1, 1, True, 0)],
)
def test_fully_masked_rows_give_zero_gradients(
    seqlen_q, seqlen_k, causal, n_masked, block_q, block_k
):
    shape = Shape(2, seqlen_q, seqlen_k, 4, 2, 8, causal)
    dout, q, k, v = _data(shape, np.float32, seed=None)
    (dq, dk, dv), _ = _backward(dout, q, k, v, shape, block_q=block_q, block_k=block_k)
    dq_ref, dk_ref, dv_ref = attention_reference_backward(dout, q, k, v, causal=causal)
    dq_low, dk_low, dv_low = attention_lowp_backward(dout, q, k, v, causal=causal, dtype=np.float16)

    for grad in (dq, dk, dv, dq_ref, dk_ref, dv_ref, dq_low, dk_low, dv_low):
        assert not np.isnan(grad).any()
    assert np.all(dq[:, :n_masked] == 0)
    assert np.all(dq_ref[:, :n_masked] == 0)
    assert np.all(dq_low[:, :n_masked] == 0)
    for name, grad, want in (("dq", dq, dq_ref), ("dk", dk, dk_ref), ("dv", dv, dv_ref)):
        assert_close(grad, want, atol=1e-5 * _scale_of(want), name=name)


@settings(deadline=None, max_examples=40)
@given(
    shape=attention_shapes(max_batch=2, max_seqlen=70, max_headdim=32, causal=True),
    block_q=blocks,
    block_k=blocks,
    seed=seeds,
    data=st.data(),
)
def test_keys_no_gradient_carrying_row_sees_get_zero(shape, block_q, block_k, seed, data):
    # Under bottom-right causal masking the last query sees every key, so zero the upstream
    # gradient of rows r.. : then only rows < r carry gradient and key j reaches none of
    # them iff j > r - 1 + seqlen_k - seqlen_q. Its dk and dv must be exactly 0, and so
    # must dq of the rows with no gradient. A missed mask in any tile breaks this.
    r = data.draw(st.integers(0, shape.seqlen_q), label="r")
    dout, q, k, v = _data(shape, np.float32, seed)
    dout[:, r:] = 0
    first_unseen = max(0, r + shape.seqlen_k - shape.seqlen_q)

    (dq, dk, dv), _ = _backward(dout, q, k, v, shape, block_q=block_q, block_k=block_k)
    dq_ref, dk_ref, dv_ref = attention_reference_backward(dout, q, k, v, causal=True)

    for grad in (dk, dv, dk_ref, dv_ref):
        assert np.all(grad[:, first_unseen:] == 0)
    assert np.all(dq[:, r:] == 0) and np.all(dq_ref[:, r:] == 0)
    assert not any(np.isnan(grad).any() for grad in (dq, dk, dv))


@pytest.mark.parametrize(
    "batch, seqlen_q, seqlen_k", [(0, 3, 3), (2, 0, 3), (2, 0, 0), (2, 3, 0), (1, 1, 1)]
)
def test_tiny_and_empty(batch, seqlen_q, seqlen_k):
    shape = Shape(batch, seqlen_q, seqlen_k, 2, 1, 4, True)
    dout, q, k, v = _data(shape, np.float32, seed=None)
    grads, _ = _backward(dout, q, k, v, shape)
    expected = attention_reference_backward(dout, q, k, v, causal=True)
    for name, grad, want in zip(("dq", "dk", "dv"), grads, expected):
        assert_close(grad, want, atol=1e-6, name=name)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(9, 13), (13, 9), (1, 7)])
@pytest.mark.parametrize("block_q, block_k", [(1, 1), (4, 3), (128, 128)])
def test_zero_scale_gradients(seqlen_q, seqlen_k, block_q, block_k):
    shape = Shape(2, seqlen_q, seqlen_k, 6, 3, 5, True)
    dout, q, k, v = _data(shape, np.float64, seed=None)
    (dq, dk, dv), _ = _backward(
        dout, q, k, v, shape, softmax_scale=0.0, block_q=block_q, block_k=block_k
    )

    # Scores do not depend on q or k, so dq = dk = 0; each row averages its visible values,
    # so key j's dv sums dout_i / n_visible_i over the rows i that see it and both query
    # heads of its kv head.
    n_visible = np.clip(np.arange(seqlen_q) + seqlen_k - seqlen_q + 1, 0, seqlen_k)
    seen = np.arange(seqlen_k)[None, :] < n_visible[:, None]
    weights = seen / np.maximum(n_visible, 1)[:, None]
    expected_dv = np.einsum("ij,bihd->bjhd", weights, dout).reshape(2, seqlen_k, 3, 2, 5).sum(3)

    # P comes from the float32 lse = log(n_visible), good to about 1e-7.
    assert np.all(dq == 0) and np.all(dk == 0)
    assert_close(dv, expected_dv, atol=1e-6, name="dv")


# --- the low-precision yardstick and flash-attn's gradient rule --------------------------


def _stagewise_float16_backward(dout, q, k, v, causal, scale):
    """attention_lowp_backward's stages written with NumPy's float16 casts, kv heads repeated
    to every query head and the GQA sum taken at the end."""
    f32, f16 = np.float32, np.float16

    def r(x):
        return x.astype(f16).astype(f32)

    batch, seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    dout, q = dout.astype(f32), q.astype(f32)
    k, v = (np.repeat(x, group, axis=2).astype(f32) for x in (k, v))
    scale = f32(scale)

    s = r(np.einsum("bihd,bjhd->bhij", q, k) * scale)
    i, j = np.arange(seqlen_q)[:, None], np.arange(seqlen_k)[None, :]
    s = np.where((j <= i + seqlen_k - seqlen_q) | (not causal), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - np.where(m == -np.inf, 0, m))
    l = p.sum(axis=-1, keepdims=True)
    p = r(p / np.where(l == 0, 1, l))

    dv = r(np.einsum("bhij,bihd->bjhd", p, dout))
    dp = r(np.einsum("bihd,bjhd->bhij", dout, v))
    ds = r(p * (dp - (p * dp).sum(axis=-1, keepdims=True)))
    dq = r(np.einsum("bhij,bjhd->bihd", ds, k) * scale)
    dk = r(np.einsum("bhij,bihd->bjhd", ds, q) * scale)

    def group_sum(x):
        return r(x.reshape(batch, seqlen_k, nheads_kv, group, d).sum(axis=3))

    return dq, group_sum(dk), group_sum(dv)


@pytest.mark.parametrize("causal", [False, True])
def test_lowp_backward_rounds_each_stage_like_float16_tensors(causal):
    # Head dim 48: a scale that is no power of two, so where it is applied matters.
    shape = Shape(2, 100, 90, 4, 2, 48, causal)
    dout, q, k, v = _data(shape, np.float16, seed=None)
    grads = attention_lowp_backward(dout, q, k, v, causal=causal)
    expected = _stagewise_float16_backward(dout, q, k, v, causal, 1 / math.sqrt(48))

    # Only float32 summation order differs. It rarely flips a rounding by one ulp, which can
    # carry into later stages; skipping any one rounding would change most of the outputs.
    for name, grad, want in zip(("dq", "dk", "dv"), grads, expected):
        assert grad.dtype == np.float32
        assert_close(grad, want, atol=2**-6 * _scale_of(want), name=name)
        assert (grad != want).mean() < 0.03, name


@pytest.mark.parametrize("causal", [False, True])
def test_lowp_backward_matches_torch_float16_autograd(causal):
    torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")
    shape = Shape(2, 40, 33, 4, 2, 16, causal)
    dout, q, k, v = _data(shape, np.float16, seed=None)
    # A power of two: torch's scaled product is two ops, whose second rounding is then exact.
    scale = 0.25
    grads = attention_lowp_backward(dout, q, k, v, causal=causal, softmax_scale=scale)

    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    s = torch.einsum("bihd,bjhd->bhij", tq, tk.repeat_interleave(2, dim=2)) * scale
    i, j = torch.arange(40)[:, None], torch.arange(33)[None, :]
    s = s.masked_fill(~((j <= i - 7) | (not causal)), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # fully masked rows: 0, not NaN
    out = torch.einsum("bhij,bjhd->bihd", p, tv.repeat_interleave(2, dim=2))
    out.backward(torch.tensor(dout))

    for name, grad, t in zip(("dq", "dk", "dv"), grads, (tq, tk, tv)):
        want = t.grad.float().numpy()
        assert_close(grad, want, atol=2**-6 * _scale_of(want), name=name)
        assert (grad != want).mean() < 0.03, name


@settings(deadline=None, max_examples=20)
@given(shape=attention_shapes(max_batch=2, max_seqlen=70, max_headdim=64), seed=seeds)
def test_lowp_backward_error_is_small_but_real(shape, seed):
    # With a handful of keys per row, rounding every stage to 16 bits cannot come out exact.
    assume(shape.seqlen_k >= 8)
    dout, q, k, v = _data(shape, np.float16, seed)
    expected = attention_reference_backward(dout, q, k, v, causal=shape.causal)

    dtypes = {"float16": np.float16, "bfloat16": "bfloat16", "float32": np.float32}
    for name, dtype in dtypes.items():
        grads = attention_lowp_backward(dout, q, k, v, causal=shape.causal, dtype=dtype)
        for grad, want, x in zip(grads, expected, (q, k, v)):
            assert grad.dtype == np.float32 and grad.shape == x.shape
            assert np.array_equal(round_to(grad, dtype), grad), f"{name} not representable"
            error = np.abs(grad - want).max() / _scale_of(want)
            assert error < {"float16": 2e-2, "bfloat16": 2e-1, "float32": 1e-5}[name], name
            if name != "float32":
                assert error > 0, name


@settings(deadline=None, max_examples=60)
@given(shape=shapes, block_q=blocks, block_k=blocks, seed=seeds)
def test_float16_within_flash_attn_gradient_rule(shape, block_q, block_k, seed):
    dout, q, k, v = _data(shape, np.float16, seed)
    grads, _ = _backward(dout, q, k, v, shape, block_q=block_q, block_k=block_k)
    expected = attention_reference_backward(dout, q, k, v, causal=shape.causal)
    lowp = attention_lowp_backward(dout, q, k, v, causal=shape.causal)
    # The exact gradients with D = rowsum(dO O) from the stored fp16 out, as FlashAttention
    # takes it: at head dim 1, D's rounding alone reached 1.9 ulp of dk (seed 1428), over
    # three times the yardstick's error.
    stored_out, _ = attention_forward(q, k, v, causal=shape.causal, softmax_scale=None)
    with_stored_out = attention_reference_backward(dout, q, k, v, causal=shape.causal, out=stored_out)

    # flash-attn's rule for gradients: at most three times the error of plain fp16
    # attention's backward, plus the fp16 noise of merely storing the exact answer, plus
    # what D inherits from the stored out.
    for name, grad, want, yardstick, inherited in zip(("dq", "dk", "dv"), grads, expected, lowp, with_stored_out):
        assert not np.isnan(grad).any(), name
        error = np.abs(grad.astype(np.float64) - want).max(initial=0.0)
        allowed = (3 * np.abs(yardstick - want).max(initial=0.0) + rounding_floor(want)
                   + np.abs(inherited - want).max(initial=0.0))
        assert error <= allowed, f"{name}: error {error:.3e} > allowed {allowed:.3e}"


# --- the gradient of the LSE -------------------------------------------------------------
#
# lse_i = logsumexp_j(s_ij), so d lse_i / d s_ij = P_ij: a loss that uses lse adds
# P ∘ dLSE to dS, which the backward folds into its row term, D - dLSE. Rows that see no
# key have lse = +inf and P = 0; whatever their dlse (a loss over +inf sends NaN), it must
# not reach any gradient.


def _dlse(lse, seed, poison=np.nan):
    """A standard normal float32 gradient laid out like lse, `poison` on the rows whose lse
    is +inf."""
    dlse = np.random.default_rng(seed).standard_normal(lse.shape).astype(np.float32)
    return np.where(np.isinf(lse), np.float32(poison), dlse)


@pytest.mark.parametrize(
    "shape",
    [
        Shape(1, 3, 4, 2, 1, 3, False),
        Shape(2, 4, 3, 4, 2, 2, True),  # GQA, seqlen_q > seqlen_k: row 0 sees no key
        Shape(1, 3, 1, 2, 2, 2, True),  # two fully masked rows, one key
    ],
)
@pytest.mark.parametrize("options", [{}, dict(softcap=0.7, softmax_scale=1.3), dict(window_size=(1, 0))])
def test_reference_lse_gradients_match_finite_differences(shape, options):
    dout, q, k, v = _data(shape, np.float64, seed=None)
    options = dict(options, causal=shape.causal)
    _, lse = attention_reference(q, k, v, **options)
    seen = np.isfinite(lse)
    dlse = _dlse(lse, seed=1).astype(np.float64)
    grads = attention_reference_backward(dout, q, k, v, dlse=dlse, **options)

    def loss():  # <dout, out> + <dlse, lse> over the rows that see a key
        out, lse = attention_reference(q, k, v, **options)
        return float((dout * out).sum() + (np.where(seen, dlse, 0) * np.where(seen, lse, 0)).sum())

    for name, grad, x in (("dq", grads[0], q), ("dk", grads[1], k), ("dv", grads[2], v)):
        assert_close(grad, finite_difference(loss, x), atol=1e-7, rtol=1e-6, name=name)


@settings(deadline=None, max_examples=100)
@cpu_path_draws(shapes)
def test_lse_gradient_matches_reference(shape, dtype, scale, block_q, block_k, seed):
    dout, q, k, v = _data(shape, dtype, seed)
    out, lse = attention_forward(q, k, v, causal=shape.causal, softmax_scale=scale)
    dlse = _dlse(lse, seed)
    grads = attention_backward(dout, q, k, v, out, lse, causal=shape.causal, softmax_scale=scale,
                               block_q=block_q, block_k=block_k, dlse=dlse)
    expected = attention_reference_backward(dout, q, k, v, causal=shape.causal, softmax_scale=scale, dlse=dlse)
    for name, grad, want in zip(("dq", "dk", "dv"), grads, expected):
        atol = GRAD_TOL[dtype] * _scale_of(want) * (1 + _max_finite(lse))
        assert_close(grad, want, atol=atol, name=name)


@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("block_q, block_k", [(3, 2), (128, 128)])
def test_lse_gradient_of_rows_that_see_no_key_is_ignored(poison, block_q, block_k):
    shape = Shape(2, 70, 3, 4, 2, 8, True)  # rows 0..66 see no key
    dout, q, k, v = _data(shape, np.float32, seed=None)
    out, lse = attention_forward(q, k, v, causal=True, softmax_scale=None)
    options = dict(causal=True, softmax_scale=None, block_q=block_q, block_k=block_k)
    poisoned = attention_backward(dout, q, k, v, out, lse, dlse=_dlse(lse, 0, poison), **options)
    clean = attention_backward(dout, q, k, v, out, lse, dlse=_dlse(lse, 0, 0.0), **options)
    for name, grad, want in zip(("dq", "dk", "dv"), poisoned, clean):
        assert np.isfinite(grad).all(), name
        np.testing.assert_array_equal(grad, want, err_msg=name)
    assert np.all(poisoned[0][:, :67] == 0)


def test_lowp_backward_with_dlse_at_float32_is_the_reference():
    shape = Shape(2, 40, 33, 4, 2, 16, True)
    dout, q, k, v = _data(shape, np.float32, seed=None)
    _, lse = attention_reference(q, k, v, causal=True)
    dlse = _dlse(lse, seed=2)
    expected = attention_reference_backward(dout, q, k, v, causal=True, dlse=dlse)
    for name, grad, want in zip(("dq", "dk", "dv"),
                                attention_lowp_backward(dout, q, k, v, causal=True, dtype=np.float32, dlse=dlse),
                                expected):
        assert_close(grad, want, atol=1e-5 * _scale_of(want), name=name)


# --- cuflash.attention_backward(..., dlse=) on NumPy arrays --------------------------------

_SLOPES = np.array([[0.5, 0.25, 0.125, 0.0625], [0.3, 0.1, 0.05, 0.7], [0.01, 0.2, 0.4, 0.0]], dtype=np.float32)
_API_OPTIONS = {
    "plain": {},
    "everything": dict(window_size=(9, 0), softcap=3.0, dropout_p=0.2, seed=11),  # with (batch, nheads) slopes
}


@pytest.mark.parametrize("name", list(_API_OPTIONS))
def test_api_backward_with_dlse_matches_reference(name):
    shape = Shape(3, 29, 21, 4, 2, 16, True)  # rows 0..7 see no key
    dout, q, k, v = _data(shape, np.float64, seed=3)
    options = dict(_API_OPTIONS[name], causal=True)
    if name == "everything":
        options["alibi_slopes"] = _SLOPES
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    dlse = _dlse(lse, seed=4)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, dlse=dlse, **options)
    keep = None
    if options.get("dropout_p", 0) > 0:
        keep = _philox.keep_mask(options["seed"], 0, 3, 4, 29, 21, options["dropout_p"])
    expected = attention_reference_backward(dout, q, k, v, dlse=dlse, **reference_options(options, keep))
    for grad_name, grad, want in zip(("dq", "dk", "dv"), grads, expected):
        assert_close(grad, want, atol=2e-6 * _scale_of(want), name=grad_name)

    # dlse=None is lse unused, as are zeros; and a warm call (validated once) reads its own
    # dlse. (dv = Pᵀ dO never sees it.)
    without = cuflash.attention_backward(dout, q, k, v, out, lse, **options)
    zeros = cuflash.attention_backward(dout, q, k, v, out, lse, dlse=np.zeros_like(lse), **options)
    again = cuflash.attention_backward(dout, q, k, v, out, lse, dlse=dlse, **options)
    for a, b, c, d in zip(without, zeros, again, grads):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(c, d)
    assert not np.array_equal(without[0], grads[0]) and not np.array_equal(without[1], grads[1])
    np.testing.assert_array_equal(without[2], grads[2])


def test_api_varlen_backward_with_dlse_matches_reference():
    shape = VarlenShape((9, 0, 17, 4), (12, 5, 0, 4), 4, 2, 16, True)  # sequence 2 sees no key
    dout, q, k, v = _data(shape, np.float64, seed=5)
    cu_q, cu_k = shape.cu_seqlens_q, shape.cu_seqlens_k
    options = dict(causal=True, window_size=(6, -1), softcap=2.0, alibi_slopes=np.vstack([_SLOPES, _SLOPES[:1]]),
                   dropout_p=0.2, seed=3)
    packing = (cu_q, cu_k, shape.max_seqlen_q, shape.max_seqlen_k)
    out, lse = cuflash.attention_varlen(q, k, v, *packing, return_lse=True, **options)
    assert np.isinf(lse[:, 9:9 + 17]).any()
    dlse = _dlse(lse, seed=6)
    grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, *packing, dlse=dlse, **options)
    keep = _philox.varlen_keep_masks(3, 0, 4, shape.seqlens_q, shape.seqlens_k, 0.2)
    expected = attention_reference_varlen_backward(dout, q, k, v, cu_q, cu_k, dlse=dlse,
                                                   **reference_options(options, keep))
    for name, grad, want in zip(("dq", "dk", "dv"), grads, expected):
        assert np.isfinite(grad).all(), name
        assert_close(grad, want, atol=2e-6 * _scale_of(want), name=name)


@pytest.mark.parametrize("make,error,message", [
    (lambda lse: lse[..., :-1], ValueError, r"dlse must have lse's shape \(2, 4, 8\), got \(2, 4, 7\)"),
    (lambda lse: lse.astype(np.float64), TypeError, "dlse must have dtype float32, got float64"),
    (lambda lse: np.ascontiguousarray(lse.transpose(0, 2, 1)).transpose(0, 2, 1), ValueError,
     "dlse must be contiguous, got strides"),
    (lambda lse: lse.tolist(), TypeError, "dlse must be a NumPy, CuPy, PyTorch or JAX array"),
])
def test_api_dlse_errors(make, error, message):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((2, 8, 4, 16), (2, 8, 2, 16), (2, 8, 2, 16)))
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(error, match=message):
        cuflash.attention_backward(out, q, k, v, out, lse, dlse=make(lse))
    packed = [x[0] for x in (q, k, v, out)]
    cu = np.array([0, 3, 8], np.int32)
    packed_lse = np.ascontiguousarray(lse[0])
    with pytest.raises(ValueError, match=r"dlse must have lse's shape \(4, 8\)"):
        cuflash.attention_varlen_backward(packed[3], *packed, packed_lse, cu, cu, 5, 5, dlse=lse)
