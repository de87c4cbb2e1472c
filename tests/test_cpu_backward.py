"""The backward pass: the float64 gradient oracle, its low-precision yardstick, and the NumPy
blockwise (FlashAttention-2) backward against both."""

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cuflash.cpu import attention_backward, attention_forward
from cuflash.reference import (
    attention_lowp_backward,
    attention_reference,
    attention_reference_backward,
    attention_textbook_backward,
    round_to,
)
from .strategies import (Shape, assert_close, attention_shapes, blocks, random_dout, random_qkv, rounding_floor, scales,
                         seeds)

# NumPy reports invalid arithmetic (such as -inf - -inf) as RuntimeWarning: none may occur.
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

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


def _finite_difference(f, x, step=1e-6):
    """Central differences of the scalar f() in every element of x, which f reads in place."""
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        saved = x[index]
        x[index] = saved + step
        above = f()
        x[index] = saved - step
        below = f()
        x[index] = saved
        grad[index] = (above - below) / (2 * step)
    return grad


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
        assert_close(grad, _finite_difference(loss, x), atol=1e-7, rtol=1e-6, name=name)
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
@given(
    shape=shapes,
    dtype=st.sampled_from([np.float32, np.float64]),
    scale=scales,
    block_q=blocks,
    block_k=blocks,
    seed=seeds,
)
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
    torch = pytest.importorskip("torch")
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
