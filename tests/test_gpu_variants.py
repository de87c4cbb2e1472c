"""flash-attn's variants on the GPU: sliding windows, causal, softcap, ALiBi, dropout, GQA and
packed variable-length batches, alone and in combination, forward and gradients, against
the float64 oracle.

Rules (flash-attn's, as test_gpu_forward / test_gpu_backward): max|out - ref64| <= 2 *
max|out_lowp - ref64| + floor and max|grad - ref64| <= 3 * max|grad_lowp - ref64| + floor,
where the lowp yardstick is plain attention with the same variant rounded to the input
dtype at every stage; NaN and inf positions must match. Dropout is compared exactly
rule-wise: the oracle applies the keep mask ``cuflash._philox`` generates for the call's
(seed, rng_offset), which is the mask the kernel must have used. Outputs and gradients land
in NaN-poisoned memory, so an element never written fails the NaN check.
"""
import functools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import _philox
from cuflash.reference import (attention_lowp, attention_lowp_backward, attention_lowp_varlen,
                               attention_lowp_varlen_backward, attention_reference, attention_reference_backward,
                               attention_reference_varlen, attention_reference_varlen_backward, round_to)

from .rule import check_gradient, check_lse, check_output, lowp_error
from .strategies import (Shape, Variant, VarlenShape, assert_close, attention_shapes, random_dout, random_qkv,
                         variants, varlen_shapes)
from .test_gpu_forward import FLOOR, LSE_ATOL, Launches, cupy_dtype, poisoned_allocations

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("forward_family")]

DTYPES = st.sampled_from(["float16", "bfloat16"])
SEEDS = st.integers(0, 2**32 - 1)


# --- checks shared with test_torch.py and test_jax.py ------------------------------------------


def api_options(variant: Variant, causal: bool, softmax_scale=None) -> dict:
    """The keywords of cuflash.attention* for `variant`, ALiBi slopes moved to the GPU."""
    import cupy
    options = variant.options()
    if options["alibi_slopes"] is not None:
        options["alibi_slopes"] = cupy.asarray(np.ascontiguousarray(options["alibi_slopes"]), dtype=cupy.float32)
    return dict(options, causal=causal, softmax_scale=softmax_scale)


def reference_options(options: dict, keep) -> dict:
    """api_options as cuflash.reference takes them: dropout by its keep mask."""
    ref = {name: value for name, value in options.items() if name not in ("seed", "rng_offset")}
    ref["dropout_keep"] = keep if options.get("dropout_p", 0.0) > 0 else None
    return ref


def keep_mask(options: dict, batch, nheads, seqlen_q, seqlen_k):
    """The dense keep mask of a call with `options` (None without dropout), on the GPU."""
    import cupy
    p = options.get("dropout_p", 0.0)
    if not p > 0:
        return None
    return _philox.keep_mask(options["seed"], options.get("rng_offset", 0), batch, nheads, seqlen_q, seqlen_k, p,
                             xp=cupy)


def varlen_keep_masks(options: dict, nheads, cu_seqlens_q, cu_seqlens_k):
    import cupy
    p = options.get("dropout_p", 0.0)
    if not p > 0:
        return None
    lengths_q, lengths_k = (np.diff(cupy.asnumpy(cu)) for cu in (cu_seqlens_q, cu_seqlens_k))
    return _philox.varlen_keep_masks(options["seed"], options.get("rng_offset", 0), nheads, lengths_q, lengths_k, p,
                                     xp=cupy)


def check_forward(q, k, v, out, lse, options: dict, varlen=None):
    """flash-attn's rule for out and an absolute bound for lse, for dense (batch, seqlen,
    nheads, d) or packed arrays (varlen = (cu_seqlens_q, cu_seqlens_k)); CuPy arrays."""
    if varlen is None:
        keep = keep_mask(options, q.shape[0], q.shape[2], q.shape[1], k.shape[1])
        ref_options = reference_options(options, keep)
        ref, ref_lse = attention_reference(q, k, v, **ref_options)
        lowp = attention_lowp(q, k, v, **ref_options)
    else:
        keep = varlen_keep_masks(options, q.shape[1], *varlen)
        ref_options = reference_options(options, keep)
        ref, ref_lse = attention_reference_varlen(q, k, v, *varlen, **ref_options)
        lowp = attention_lowp_varlen(q, k, v, *varlen, **ref_options)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == np.float32
    check_output(out, ref, lowp_error(lowp, ref), str(q.dtype))
    check_lse(lse, ref_lse)


def check_gradients(dout, q, k, v, grads, options: dict, varlen=None, out=None):
    """flash-attn's gradient rule (see test_gpu_backward) for dense or packed CuPy arrays,
    plus the effect of D = rowsum(dO * O) being taken from the kernel's own rounded `out`
    (FlashAttention's choice, which the lowp yardstick does not mimic; dropout's 1 / (1 - p)
    makes it visible): `d_slack` bounds it."""
    if varlen is None:
        keep = keep_mask(options, q.shape[0], q.shape[2], q.shape[1], k.shape[1])
        ref_options = reference_options(options, keep)
        refs = attention_reference_backward(dout, q, k, v, **ref_options)
        lowps = attention_lowp_backward(dout, q, k, v, **ref_options)
    else:
        keep = varlen_keep_masks(options, q.shape[1], *varlen)
        ref_options = reference_options(options, keep)
        refs = attention_reference_varlen_backward(dout, q, k, v, *varlen, **ref_options)
        lowps = attention_lowp_varlen_backward(dout, q, k, v, *varlen, **ref_options)
    slacks = d_slack(dout, q, k, v, out, ref_options, varlen)
    for name, grad, ref, lowp, like, slack in zip(("dq", "dk", "dv"), grads, refs, lowps, (q, k, v), slacks):
        assert grad.shape == like.shape and grad.dtype == like.dtype, name
        check_gradient(grad, ref, lowp, str(q.dtype), name, slack)


def d_slack(dout, q, k, v, out, ref_options: dict, varlen=None):
    """Bounds on how far dq, dk (and dv: 0) move when D = rowsum(dO * O) comes from `out`
    (the kernel's output; None: the oracle's rounded to q's dtype) instead of the exact O.

    With delta_i = rowsum(dO * (out - O))_i, dS = P * (dP - D) (times 1 - tanh^2 <= 1 with
    softcap) moves by P_ij delta_i, so |ddq_i| <= scale |delta_i| (P |K|)_i and
    |ddk_j| <= scale (P^T (|delta| |Q|))_j, P the softmax before dropout: two more oracle
    calls, attention of |K| and the dV of the upstream gradient |delta| |Q|."""
    import cupy
    plain = dict(ref_options, dropout_p=0.0, dropout_keep=None)
    if varlen is None:
        forward, backward = attention_reference, attention_reference_backward
    else:
        forward = functools.partial(attention_reference_varlen, cu_seqlens_q=varlen[0], cu_seqlens_k=varlen[1])
        backward = functools.partial(attention_reference_varlen_backward, cu_seqlens_q=varlen[0],
                                     cu_seqlens_k=varlen[1])
    if not q.size or not k.size:
        return 0.0, 0.0, 0.0
    ref_out, _ = forward(q, k, v, **ref_options)
    out = round_to(ref_out.astype(cupy.float32), q.dtype, cupy) if out is None else out
    delta = abs((dout.astype(cupy.float64) * (out.astype(cupy.float64) - ref_out)).sum(axis=-1))[..., None]
    scale = ref_options.get("softmax_scale")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    k_abs, q_abs = abs(k.astype(cupy.float64)), abs(q.astype(cupy.float64))
    p_k, _ = forward(q, k, k_abs, **plain)
    _, _, pt_delta_q = backward(delta * q_abs, q, k, v, **plain)
    return scale * float((delta * p_k).max()), scale * float(pt_delta_q.max()), 0.0


# --- running a case ----------------------------------------------------------------------------


def dense_inputs(shape: Shape, dtype: str, seed: int):
    import cupy
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(shape, cupy_dtype(dtype), rng, xp=cupy)
    return random_dout(shape, cupy_dtype(dtype), rng, xp=cupy), q, k, v


def varlen_inputs(shape: VarlenShape, dtype: str, seed: int):
    import cupy
    dout, q, k, v = dense_inputs(shape, dtype, seed)  # VarlenShape has q_shape and kv_shape
    return dout, q, k, v, cupy.asarray(shape.cu_seqlens_q), cupy.asarray(shape.cu_seqlens_k)


def run_dense(shape: Shape, dtype: str, seed: int, options: dict, deterministic=False):
    dout, q, k, v = dense_inputs(shape, dtype, seed)
    with poisoned_allocations(), Launches() as launches:
        out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **options)
    check_forward(q, k, v, out, lse, options)
    check_gradients(dout, q, k, v, grads, options, out=out)
    return (dout, q, k, v), (out, lse), grads, launches


def run_varlen(shape: VarlenShape, dtype: str, seed: int, options: dict, deterministic=False):
    dout, q, k, v, cu_q, cu_k = varlen_inputs(shape, dtype, seed)
    packing = (cu_q, cu_k, shape.max_seqlen_q, shape.max_seqlen_k)
    with poisoned_allocations(), Launches() as launches:
        out, lse = cuflash.attention_varlen(q, k, v, *packing, return_lse=True, **options)
        assert lse.shape == (shape.nheads, q.shape[0])
        grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, *packing, deterministic=deterministic,
                                                  **options)
    check_forward(q, k, v, out, lse, options, varlen=(cu_q, cu_k))
    check_gradients(dout, q, k, v, grads, options, varlen=(cu_q, cu_k), out=out)
    return (dout, q, k, v, cu_q, cu_k), (out, lse), grads, launches


# --- every feature, in combination, by hypothesis ----------------------------------------------


@st.composite
def dense_cases(draw, max_seqlen=512):
    shape = draw(attention_shapes(max_batch=3, max_seqlen=max_seqlen, max_headdim=256, max_nheads_kv=2,
                                  max_group=4))
    variant = draw(variants(shape.batch, shape.nheads, max_seqlen))
    return shape, variant


@st.composite
def varlen_cases(draw, max_seqlen=300):
    shape = draw(varlen_shapes(max_batch=5, max_seqlen=max_seqlen, max_headdim=256, max_nheads_kv=2, max_group=4))
    variant = draw(variants(shape.batch, shape.nheads, max_seqlen))
    return shape, variant


@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=dense_cases(), dtype=DTYPES, deterministic=st.booleans(), seed=SEEDS)
def test_dense_variants_match_reference(case, dtype, deterministic, seed):
    shape, variant = case
    run_dense(shape, dtype, seed, api_options(variant, shape.causal), deterministic)


@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=varlen_cases(), dtype=DTYPES, deterministic=st.booleans(), seed=SEEDS)
def test_varlen_variants_match_reference(case, dtype, deterministic, seed):
    shape, variant = case
    run_varlen(shape, dtype, seed, api_options(variant, shape.causal), deterministic)


# --- each feature alone, and all of them, at fixed shapes ---------------------------------------

_SLOPES_4 = 2.0 ** (-8.0 * np.arange(1, 5) / 4)
FEATURES = {
    "causal": (True, Variant()),
    "window": (False, Variant(window_size=(37, 5))),
    "window_left_only": (False, Variant(window_size=(100, -1))),
    "window_right_only": (False, Variant(window_size=(-1, 20))),
    "window_causal": (True, Variant(window_size=(64, 9))),  # causal wins: right = 0
    "softcap": (False, Variant(softcap=2.0)),
    "alibi_heads": (False, Variant(alibi_slopes=_SLOPES_4.astype(np.float32))),
    "alibi_batch_heads": (True, Variant(alibi_slopes=np.stack([_SLOPES_4, _SLOPES_4[::-1] / 3]).astype(np.float32))),
    "dropout": (False, Variant(dropout_p=0.17, seed=2024, rng_offset=3)),
    "everything": (True, Variant(window_size=(90, 0), softcap=5.0, alibi_slopes=(_SLOPES_4 / 2).astype(np.float32),
                                 dropout_p=0.3, seed=2**63 + 12345, rng_offset=2**32 - 1)),
}


# The one-pass backward (64 x 64 tiles with the extras) and, deterministic, the two-kernel one.
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("head_dim,deterministic", [(128, False), (128, True), (256, False)])
def test_each_feature_dense(feature, dtype, head_dim, deterministic):
    causal, variant = FEATURES[feature]
    shape = Shape(2, 333, 517, 4, 2, head_dim, causal)  # GQA, lopsided, ragged
    options = api_options(variant, causal)
    _, _, _, launches = run_dense(shape, dtype, 11, options, deterministic)
    if options["alibi_slopes"] is not None:  # the slopes are read where they are
        assert options["alibi_slopes"].data.ptr in launches.calls[0][0]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("head_dim", [64, 192])
def test_each_feature_varlen(feature, dtype, head_dim):
    causal, variant = FEATURES[feature]
    if variant.alibi_slopes is not None and variant.alibi_slopes.ndim == 2:  # one row per sequence
        variant = Variant(**{**variant.__dict__, "alibi_slopes": np.tile(variant.alibi_slopes, (2, 1))[:4]})
    shape = VarlenShape((300, 0, 129, 65), (517, 7, 0, 200), 4, 2, head_dim, causal)
    options = api_options(variant, causal)
    (_, _, _, _, cu_q, cu_k), _, _, launches = run_varlen(shape, dtype, 12, options)
    pointers = launches.calls[0][0]
    assert cu_q.data.ptr in pointers and cu_k.data.ptr in pointers


@pytest.mark.parametrize("deterministic", [True, False])  # the two-kernel and the one-pass backward
def test_negative_alibi_slopes_leave_padded_rows_out(deterministic):
    """The rows of the last query tile past seqlen_q add nothing to dK and dV, even where
    their modified score of 0 (ALiBi with a negative slope: +0.5 per key of distance)
    would overflow exp."""
    variant = Variant(alibi_slopes=np.array([-0.5, -0.25], np.float32))
    run_dense(Shape(1, 70, 300, 2, 1, 128, False), "bfloat16", 5, api_options(variant, False), deterministic)


# --- windows: zero width, fully masked rows ----------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_zero_width_window_sees_one_key_and_masks_rows_before_the_diagonal(dtype):
    """window (0, 0): query i sees only key i + seqlen_k - seqlen_q. With seqlen_q > seqlen_k
    the first seqlen_q - seqlen_k queries see nothing: out 0, lse +inf, dq 0."""
    import cupy
    shape = Shape(2, 300, 200, 4, 2, 64, False)
    options = dict(window_size=(0, 0))
    (dout, q, k, v), (out, lse), (dq, dk, dv), _ = run_dense(shape, dtype, 5, options)
    masked = shape.seqlen_q - shape.seqlen_k
    assert (out[:, :masked] == 0).all() and cupy.isposinf(lse[:, :, :masked]).all()
    assert not cupy.isinf(lse[:, :, masked:]).any()
    assert (dq[:, :masked] == 0).all()
    # One visible key: P = 1, so out is that key's value row.
    expected = cupy.repeat(v, shape.nheads // shape.nheads_kv, axis=2)
    assert_close(out[:, masked:], expected, atol=0, rtol=2 * FLOOR[dtype], name="out")


def test_window_and_causal_mask_every_row_of_a_short_key_sequence():
    """causal with a left window and seqlen_q > seqlen_k: the early rows see no key, later
    rows see at most left + 1 keys; and a window with sides >= seqlen_k is the full mask."""
    import cupy
    shape = Shape(1, 257, 64, 2, 1, 96, True)
    options = dict(causal=True, window_size=(3, 100))
    (_, q, k, v), (out, lse), _, _ = run_dense(shape, "bfloat16", 6, options)
    assert (out[:, :193] == 0).all() and cupy.isposinf(lse[:, :, :193]).all()
    unbounded = cuflash.attention(q, k, v, window_size=(64, 1000), return_lse=True)
    full = cuflash.attention(q, k, v, return_lse=True)
    for a, b in zip(unbounded, full):
        assert_close(a, b, atol=0, name="window >= seqlen_k")


def test_window_skipping_tiles_is_not_observable():
    """A narrow window over long sequences (most key tiles skipped) agrees with the oracle
    and writes every row (the poisoned outputs would show a skipped one). Whether tiles are
    skipped is a performance property: not asserted here."""
    run_dense(Shape(1, 2048, 2048, 4, 2, 128, False), "float16", 7, dict(window_size=(16, 16)), deterministic=True)


def test_varlen_window_is_normalised_per_sequence():
    """A window side >= a sequence's own seqlen_k is unbounded for that sequence, even when
    the batch's max_seqlen_k is larger (here right = 10 >= seqlen_k = 4 but < 300): query 0
    of the short sequence sees every key, not none."""
    shape = VarlenShape((40, 300), (4, 300), 2, 2, 64, False)
    run_varlen(shape, "float16", 8, dict(window_size=(-1, 10)))


# --- dropout ------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keep_rate(p):
    """The generator keeps 1 - p of the probabilities (within 0.01 on 16M draws), and so does
    the kernel, measured without the generator: with q = 0 every row's P is uniform, with
    v = 1 each output is (kept keys) / (seqlen_k (1 - p))."""
    import cupy
    batch, nheads, seqlen_q, seqlen_k = 2, 8, 1024, 1024
    mask = _philox.keep_mask(99, 0, batch, nheads, seqlen_q, seqlen_k, p, xp=cupy)
    kept = float(mask.mean())
    assert abs(kept - (1 - p)) < 0.01
    q = cupy.zeros((batch, seqlen_q, nheads, 64), dtype=cupy.float16)
    v = cupy.ones((batch, seqlen_k, nheads, 64), dtype=cupy.float16)
    out = cuflash.attention(q, v, v, dropout_p=p, seed=99)
    kernel_kept = float(out[..., 0].astype(cupy.float64).mean()) * (1 - p)
    assert abs(kernel_kept - kept) < 1e-3
    # Row by row the kernel kept exactly the mask's keys (fp16 rounds the row's mean).
    per_row = mask.sum(axis=-1).transpose(0, 2, 1) / (seqlen_k * (1 - p))
    assert_close(out[..., 0], per_row, atol=4 * FLOOR["float16"] * (1 + float(per_row.max())), name="row")


def test_dropout_seeds_reproduce_bitwise_and_differ_otherwise():
    import cupy
    shape = Shape(2, 300, 400, 4, 2, 64, True)
    dout, q, k, v = dense_inputs(shape, "bfloat16", 9)
    options = dict(causal=True, dropout_p=0.25, seed=1234, rng_offset=7)

    def run(**changes):
        opts = dict(options, **changes)
        out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=True, **opts)
        return [x.view(cupy.uint16) if x.dtype != cupy.float32 else x.view(cupy.uint32) for x in (out, lse, *grads)]

    first = run()
    for a, b in zip(first, run()):
        assert (a == b).all()
    for changes in (dict(seed=1235), dict(rng_offset=8), dict(seed=1234 + 2**32)):
        other = run(**changes)
        assert not (first[0] == other[0]).all(), changes
        assert (first[1] == other[1]).all(), "lse does not depend on the dropout mask"
    # The LSE is dropout's too: the same as without dropout.
    _, lse_plain = cuflash.attention(q, k, v, causal=True, return_lse=True)
    assert_close(first[1].view(cupy.float32), lse_plain, atol=LSE_ATOL, rtol=1e-5, name="lse")


def test_dropout_without_seed_draws_a_fresh_mask():
    import cupy
    _, q, k, v = dense_inputs(Shape(1, 128, 128, 2, 2, 64, False), "float16", 10)
    a, b = (cuflash.attention(q, k, v, dropout_p=0.5) for _ in range(2))
    assert not (a.view(cupy.uint16) == b.view(cupy.uint16)).all()
    out, lse = cuflash.attention(q, k, v, dropout_p=0.5, return_lse=True)
    with pytest.raises(ValueError, match="seed"):
        cuflash.attention_backward(out, q, k, v, out, lse, dropout_p=0.5)


# --- variable length: empty sequences ------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_zero_length_sequences(causal):
    """Empty query sequences, empty key sequences (their queries see nothing: out 0, lse
    +inf, dq 0) and keys no query reads (dk = dv = 0)."""
    import cupy
    shape = VarlenShape((0, 5, 130, 0, 1, 64), (3, 0, 200, 0, 64, 1), 4, 1, 64, causal)
    variant = Variant(softcap=3.0, dropout_p=0.2, seed=77, alibi_slopes=_SLOPES_4.astype(np.float32))
    (_, q, k, v, cu_q, cu_k), (out, lse), (dq, dk, dv), _ = run_varlen(shape, "float16", 13,
                                                                       api_options(variant, causal))
    rows = slice(0, 5)  # sequence 1: five queries, no keys
    assert (out[rows] == 0).all() and cupy.isposinf(lse[:, rows]).all() and (dq[rows] == 0).all()
    keys = slice(0, 3)  # sequence 0: three keys, no queries
    assert (dk[keys] == 0).all() and (dv[keys] == 0).all()


def test_varlen_all_sequences_empty():
    import cupy
    empty = cupy.empty((0, 2, 64), dtype=cupy.float16)
    cu = cupy.zeros(4, dtype=cupy.int32)
    out, lse = cuflash.attention_varlen(empty, empty, empty, cu, cu, 0, 0, return_lse=True, dropout_p=0.1, seed=1)
    assert out.shape == (0, 2, 64) and lse.shape == (2, 0)
    grads = cuflash.attention_varlen_backward(empty, empty, empty, empty, out, lse, cu, cu, 0, 0, dropout_p=0.1,
                                              seed=1)
    assert all(g.shape == (0, 2, 64) for g in grads)
    # Keys with no queries anywhere: zero gradients.
    k = cupy.ones((9, 2, 64), dtype=cupy.float16)
    cu_k = cupy.asarray([0, 4, 9, 9], dtype=cupy.int32)
    out, lse = cuflash.attention_varlen(empty, k, k, cu, cu_k, 0, 5, return_lse=True)
    dq, dk, dv = cuflash.attention_varlen_backward(empty, empty, k, k, out, lse, cu, cu_k, 0, 5)
    assert dq.shape == (0, 2, 64) and (dk == 0).all() and (dv == 0).all()


def test_varlen_matches_dense_for_equal_lengths():
    """A dense batch packed (every option per sequence, including the dropout stream's
    batch index and per-sequence ALiBi rows): both calls against the oracle."""
    import cupy
    shape = Shape(3, 190, 250, 4, 2, 128, True)
    dout, q, k, v = dense_inputs(shape, "bfloat16", 14)
    slopes = cupy.asarray(np.random.default_rng(0).uniform(0, 0.5, (3, 4)), dtype=cupy.float32)
    options = dict(causal=True, window_size=(70, 0), softcap=4.0, alibi_slopes=slopes, dropout_p=0.2, seed=3)
    with poisoned_allocations():
        out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    check_forward(q, k, v, out, lse, options)
    cu_q = cupy.arange(0, 4 * 190, 190, dtype=cupy.int32)
    cu_k = cupy.arange(0, 4 * 250, 250, dtype=cupy.int32)
    packed = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
    with poisoned_allocations():
        out_v, lse_v = cuflash.attention_varlen(*packed, cu_q, cu_k, 190, 250, return_lse=True, **options)
    check_forward(*packed, out_v, lse_v, options, varlen=(cu_q, cu_k))
