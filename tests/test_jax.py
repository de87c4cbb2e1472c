"""cuflash.jax: custom_vjp over buffer_callback, eagerly, under jax.jit and jax.vmap.

CPU arrays go through the same buffer_callback route into the NumPy path, so the CPU tests
check the glue (shapes, jit, grad, vmap, errors) wherever JAX is installed. The tests marked
gpu run the CUDA kernels on XLA's buffers and check them against the float64 oracle with
flash-attn's gradient rule: max|grad - ref64| <= 3 * max|grad_lowp - ref64| + floor.
"""
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="JAX is not installed: pip install -e '.[jax]'")
pytest.importorskip("jax.experimental.buffer_callback", reason="cuflash.jax needs JAX 0.7 or newer")

import jax.numpy as jnp  # noqa: E402

import cuflash  # noqa: E402
import cuflash.jax  # noqa: E402
from cuflash import _philox  # noqa: E402
from cuflash.reference import (  # noqa: E402
    attention_lowp,
    attention_reference,
    attention_reference_backward,
    attention_reference_varlen,
    attention_reference_varlen_backward,
)

from .strategies import (FRONT_END_SLOPES, Launches, Shape, VarlenShape, assert_close,  # noqa: E402
                         front_end_variants, numpy_options, reference_options)


def make_inputs(shape: Shape, dtype, seed=0):
    """Fresh standard normal q, k, v and dout as JAX arrays on the default device."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    sizes = (shape.q_shape, shape.kv_shape, shape.kv_shape, shape.q_shape)
    return [jax.random.normal(key, size, dtype=jnp.float32).astype(dtype) for key, size in zip(keys, sizes)]


def loss_and_grads(causal, softmax_scale=None, deterministic=False, jit=True):
    """(q, k, v, dout) -> gradients of sum(out * dout), i.e. the backward fed dout."""
    def loss(q, k, v, dout):
        out = cuflash.jax.attention(q, k, v, causal, softmax_scale, deterministic=deterministic)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    return jax.jit(grad) if jit else grad


# --- CPU: the glue itself ------------------------------------------------------------------


@pytest.fixture
def cpu():
    """Put arrays and jitted work on the CPU even where a GPU is the default device: that is
    also the device cuflash.jax assumes while tracing (a tracer has none yet)."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def test_import_cuflash_does_not_import_jax():
    code = "import sys, cuflash; assert 'jax' not in sys.modules, 'import cuflash imported jax'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
@pytest.mark.parametrize("shape", [Shape(2, 37, 29, 4, 2, 16, True), Shape(1, 20, 45, 3, 1, 8, False)])
@pytest.mark.parametrize("jit", [False, True])
def test_cpu_is_the_numpy_path(cpu, shape, dtype, jit):
    """Eager or jitted, forward and gradients are exactly cuflash.attention /
    attention_backward on the same NumPy arrays, and that is the attention gradient."""
    q, k, v, dout = make_inputs(shape, dtype, seed=shape.seqlen_q)
    forward = jax.jit(cuflash.jax.attention, static_argnums=(3,)) if jit else cuflash.jax.attention
    out = forward(q, k, v, shape.causal)
    grads = loss_and_grads(shape.causal, jit=jit)(q, k, v, dout)

    arrays = [np.asarray(x) for x in (q, k, v)]
    want_out, lse = cuflash.attention(*arrays, causal=shape.causal, return_lse=True)
    # The loss's gradient reaches out through a float32 cast: dout rounded to the input dtype.
    dout_in = np.asarray(dout.astype(jnp.float32)).astype(arrays[0].dtype)
    want = cuflash.attention_backward(dout_in, *arrays, want_out, lse, causal=shape.causal)
    assert isinstance(out, jax.Array) and out.dtype == q.dtype and out.shape == q.shape
    np.testing.assert_array_equal(np.asarray(out), want_out)
    for grad, expected, like in zip(grads, want, (q, k, v)):
        assert grad.dtype == like.dtype and grad.shape == like.shape
        np.testing.assert_array_equal(np.asarray(grad), expected)
    refs = attention_reference_backward(dout_in, *arrays, causal=shape.causal)
    for grad, ref, name in zip(grads, refs, ("dq", "dk", "dv")):  # a wiring check, not accuracy
        assert_close(np.asarray(grad), ref, atol=1e-2 * max(1.0, float(abs(ref).max())), name=name)


def test_cpu_softmax_scale_and_vmap(cpu):
    shape = Shape(2, 19, 23, 4, 2, 8, True)
    q, k, v, _ = make_inputs(shape, jnp.float32)
    out = cuflash.jax.attention(q, k, v, True, 0.3)
    ref, _ = attention_reference(*(np.asarray(x) for x in (q, k, v)), causal=True, softmax_scale=0.3)
    assert_close(np.asarray(out), ref, atol=1e-5)
    # vmap over a leading axis: one call per mapped element.
    stacked = [jnp.stack([x, 2 * x]) for x in (q, k, v)]
    outs = jax.jit(jax.vmap(lambda q, k, v: cuflash.jax.attention(q, k, v, True, 0.3)))(*stacked)
    np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(out))
    doubled = cuflash.jax.attention(2 * q, 2 * k, 2 * v, True, 0.3)
    np.testing.assert_array_equal(np.asarray(outs[1]), np.asarray(doubled))


def test_cpu_gradients_inside_shard_map(cpu):
    # q split over the mesh axis, k and v shared: their gradients are summed over it, and
    # the custom_vjp's results carry the axis (JAX refuses mismatched types otherwise).
    from jax.sharding import Mesh, PartitionSpec as P
    shape = Shape(2, 19, 23, 4, 2, 8, True)
    q, k, v, _ = make_inputs(shape, jnp.float32)
    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("x",))

    def loss(q, k, v):
        out, lse = cuflash.jax.attention(q, k, v, True, return_lse=True)
        return (out ** 2).sum() + lse.sum()

    sharded = jax.shard_map(jax.grad(loss, argnums=(0, 1, 2)), mesh=mesh, in_specs=(P("x"), P(), P()),
                            out_specs=(P("x"), P(), P()))
    got = jax.jit(sharded)(q, k, v)
    want = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


def test_cpu_errors_are_raised_while_tracing(cpu):
    q = jnp.zeros((1, 8, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="k and v must have one shape"):
        jax.jit(cuflash.jax.attention)(q, q[..., :8], q)
    with pytest.raises(TypeError, match="one dtype"):
        cuflash.jax.attention(q, q, q.astype(jnp.float16))
    with pytest.raises(ValueError, match="softmax_scale must be finite"):
        cuflash.jax.attention(q, q, q, False, -1.0)


# --- CPU: the flash-attn options ----------------------------------------------------------

_SLOPES = FRONT_END_SLOPES
VARIANTS = front_end_variants(_SLOPES)  # (NumPy slopes: _for_batch makes them JAX arrays)


def _for_batch(kwargs: dict, batch: int) -> dict:
    """kwargs with (batch, nheads) ALiBi slopes cut to `batch` rows, as a JAX array."""
    kwargs = dict(kwargs)
    slopes = kwargs.get("alibi_slopes")
    if slopes is not None:
        kwargs["alibi_slopes"] = jnp.asarray(slopes[:batch] if slopes.ndim == 2 else slopes)
    return kwargs


def _close(got, want, name):
    """Agreement with the float64 oracle of a float32 computation."""
    assert_close(np.asarray(got), want, atol=2e-5 * max(1.0, float(abs(want).max(initial=0))), name=name)


def _loss(attention, *args, **kwargs):
    def loss(q, k, v, dout, *traced):
        out = attention(q, k, v, *args, *traced, **kwargs)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))
    return loss


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("jit", [False, True])
def test_cpu_options_are_the_numpy_path(cpu, name, jit):
    """Every option, eager or jitted, forward and gradients: exactly cuflash.attention /
    attention_backward on the same NumPy arrays, and the oracle's."""
    causal, kwargs = VARIANTS[name]
    shape = Shape(2, 23, 31, 4, 2, 16, causal)
    kwargs = _for_batch(kwargs, shape.batch)
    q, k, v, dout = make_inputs(shape, jnp.float32, seed=1)

    def forward(q, k, v):
        return cuflash.jax.attention(q, k, v, causal, **kwargs)

    grad = jax.grad(_loss(cuflash.jax.attention, causal, **kwargs), argnums=(0, 1, 2))
    if jit:
        forward, grad = jax.jit(forward), jax.jit(grad)
    out, grads = forward(q, k, v), grad(q, k, v, dout)

    arrays = [np.asarray(x) for x in (q, k, v, dout)]
    options = numpy_options(kwargs, causal=causal)
    want_out, lse = cuflash.attention(*arrays[:3], return_lse=True, **options)
    want = cuflash.attention_backward(arrays[3], *arrays[:3], want_out, lse, **options)
    np.testing.assert_array_equal(np.asarray(out), want_out)
    for got, expected in zip(grads, want):
        np.testing.assert_array_equal(np.asarray(got), expected)

    keep = None
    if kwargs.get("dropout_p", 0) > 0:
        keep = _philox.keep_mask(kwargs["seed"], 0, shape.batch, shape.nheads, shape.seqlen_q, shape.seqlen_k,
                                 kwargs["dropout_p"])
    ref_options = reference_options(kwargs, keep, causal=causal)
    _close(out, attention_reference(*arrays[:3], **ref_options)[0], "out")
    refs = attention_reference_backward(arrays[3], *arrays[:3], **ref_options)
    for got, ref, grad_name in zip(grads, refs, ("dq", "dk", "dv")):
        _close(got, ref, grad_name)


def test_cpu_dropout_seed_forms(cpu):
    """A Python int, two uint32 words [low, high] (traced under jit), a scalar integer array
    and a typed PRNG key (its key data as the words) name the same masks."""
    q, k, v, dout = make_inputs(Shape(1, 20, 24, 2, 1, 8, False), jnp.float32)
    seed = 2**40 + 12345

    def attention(seed):
        return cuflash.jax.attention(q, k, v, dropout_p=0.3, seed=seed)

    by_int = attention(seed)
    words = jnp.array([seed & 0xFFFFFFFF, seed >> 32], jnp.uint32)
    by_words = jax.jit(attention)(words)
    np.testing.assert_array_equal(np.asarray(by_int), np.asarray(by_words))
    np.testing.assert_array_equal(np.asarray(attention(5)), np.asarray(jax.jit(attention)(jnp.uint32(5))))
    key = jax.random.key(7)  # threefry key data [0, 7]: the seed 7 << 32
    np.testing.assert_array_equal(np.asarray(attention(key)), np.asarray(attention(7 << 32)))
    assert not np.array_equal(np.asarray(by_int), np.asarray(attention(seed + 1)))
    keep = _philox.keep_mask(seed, 0, 1, 2, 20, 24, 0.3)
    ref, _ = attention_reference(*(np.asarray(x) for x in (q, k, v)), dropout_p=0.3, dropout_keep=keep)
    _close(by_int, ref, "out")
    # The backward of a traced seed regenerates the forward's mask.
    def loss(q, k, v, dout, seed):
        return jnp.sum(cuflash.jax.attention(q, k, v, dropout_p=0.3, seed=seed) * dout)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    for a, b in zip(grad(q, k, v, dout, seed), jax.jit(grad)(q, k, v, dout, words)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    refs = attention_reference_backward(*(np.asarray(x) for x in (dout, q, k, v)), dropout_p=0.3, dropout_keep=keep)
    for got, ref, name in zip(grad(q, k, v, dout, seed), refs, ("dq", "dk", "dv")):
        _close(got, ref, name)


@pytest.mark.parametrize("jit", [False, True])
def test_cpu_varlen_is_the_numpy_path(cpu, jit):
    """attention_varlen with every option (empty sequences included), eager or jitted:
    exactly cuflash.attention_varlen on NumPy arrays, and the oracle's."""
    shape = VarlenShape((9, 0, 17, 4), (12, 5, 0, 4), 4, 2, 16, True)
    q, k, v, dout = make_inputs(shape, jnp.float32, seed=2)
    cu_q, cu_k = shape.cu_seqlens_q, shape.cu_seqlens_k
    kwargs = dict(window_size=(6, -1), softcap=2.0, alibi_slopes=jnp.asarray(_SLOPES), dropout_p=0.2, seed=3)
    packing = (shape.max_seqlen_q, shape.max_seqlen_k, True)

    def forward(q, k, v, cu_q, cu_k):
        return cuflash.jax.attention_varlen(q, k, v, cu_q, cu_k, *packing, **kwargs)

    def loss(q, k, v, dout, cu_q, cu_k):
        return jnp.sum(forward(q, k, v, cu_q, cu_k) * dout)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    if jit:
        forward, grad = jax.jit(forward), jax.jit(grad)
    out, grads = forward(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k)), grad(q, k, v, dout, cu_q, cu_k)

    arrays = [np.asarray(x) for x in (q, k, v, dout)]
    options = numpy_options(kwargs, causal=True)
    want_out, lse = cuflash.attention_varlen(*arrays[:3], cu_q, cu_k, *packing[:2], return_lse=True, **options)
    want = cuflash.attention_varlen_backward(arrays[3], *arrays[:3], want_out, lse, cu_q, cu_k, *packing[:2],
                                             **options)
    np.testing.assert_array_equal(np.asarray(out), want_out)
    for got, expected in zip(grads, want):
        np.testing.assert_array_equal(np.asarray(got), expected)
    keep = _philox.varlen_keep_masks(3, 0, 4, shape.seqlens_q, shape.seqlens_k, 0.2)
    ref_options = reference_options(kwargs, keep, causal=True)
    _close(out, attention_reference_varlen(*arrays[:3], cu_q, cu_k, **ref_options)[0], "out")
    refs = attention_reference_varlen_backward(arrays[3], *arrays[:3], cu_q, cu_k, **ref_options)
    for got, ref, name in zip(grads, refs, ("dq", "dk", "dv")):
        _close(got, ref, name)


def test_cpu_options_and_vmap(cpu):
    """vmap maps one call per element; with the same seed each element gets the same mask."""
    shape = Shape(2, 19, 23, 4, 2, 8, True)
    q, k, v, _ = make_inputs(shape, jnp.float32)
    options = dict(window_size=(3, 0), softcap=2.0, alibi_slopes=jnp.asarray(_SLOPES[2]), dropout_p=0.2, seed=4)
    out = cuflash.jax.attention(q, k, v, True, **options)
    stacked = [jnp.stack([x, 2 * x]) for x in (q, k, v)]
    outs = jax.jit(jax.vmap(lambda q, k, v: cuflash.jax.attention(q, k, v, True, **options)))(*stacked)
    np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(out))
    doubled = cuflash.jax.attention(2 * q, 2 * k, 2 * v, True, **options)
    np.testing.assert_array_equal(np.asarray(outs[1]), np.asarray(doubled))


def test_cpu_option_errors_are_raised_while_tracing(cpu):
    q = jnp.zeros((2, 8, 4, 16), jnp.float32)
    attention = jax.jit(cuflash.jax.attention, static_argnames=("window_size", "dropout_p", "softcap"))
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        attention(q, q, q, alibi_slopes=jnp.ones(3, jnp.float32))
    with pytest.raises(TypeError, match="alibi_slopes must be float32"):
        attention(q, q, q, alibi_slopes=jnp.ones(4, jnp.float16))
    with pytest.raises(ValueError, match="window_size"):
        attention(q, q, q, window_size=(-2, 0))
    with pytest.raises(ValueError, match="softcap"):
        attention(q, q, q, softcap=-1.0)
    with pytest.raises(ValueError, match="needs a seed"):
        attention(q, q, q, dropout_p=0.1)
    with pytest.raises(TypeError, match="seed must be"):
        attention(q, q, q, dropout_p=0.1, seed=jnp.ones(2, jnp.float32))
    with pytest.raises(ValueError, match="at most 64 bits"):
        attention(q, q, q, dropout_p=0.1, seed=jnp.ones(3, jnp.uint32))
    packed = q[0]
    cu = jnp.array([0, 3, 8], jnp.int32)
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        cuflash.jax.attention_varlen(packed, packed, packed, cu.astype(jnp.int16), cu, 5, 5)
    with pytest.raises(ValueError, match="max_seqlen_k must be at least"):
        cuflash.jax.attention_varlen(packed, packed, packed, cu, cu, 5, 4)
    with pytest.raises(ValueError, match="end at the number of packed rows"):
        cuflash.jax.attention_varlen(packed, packed, packed, cu, jnp.array([0, 3, 7], jnp.int32), 5, 5)
    with pytest.raises(TypeError, match="max_seqlen_q must be an integer"):
        cuflash.jax.attention_varlen(packed, packed, packed, cu, cu, 5.0, 5)

def test_missing_buffer_callback_names_the_jax_version(monkeypatch):
    monkeypatch.setattr(cuflash.jax.calls, "buffer_callback", None)
    q = jnp.zeros((1, 8, 2, 16), jnp.float32)
    with pytest.raises(ImportError, match="JAX 0.7 or newer"):
        cuflash.jax.attention(q, q, q)


# --- CPU: the gradient of the LSE --------------------------------------------------------
#
# The oracle: cuflash.reference's float64 gradients of <dout, out> + <dlse, lse>
# (d lse_i / d s_ij = P_ij), themselves checked against finite differences in
# test_cpu_backward.py.


def _lse_gradient(lse, seed):
    """A standard normal gradient for lse, NaN on the rows whose lse is +inf (rows that see
    no key, whose lse gradient must be ignored)."""
    lse = np.asarray(lse)
    dlse = np.random.default_rng(seed).standard_normal(lse.shape).astype(np.float32)
    return np.where(np.isinf(lse), np.float32(np.nan), dlse)


def _vjp(attention, *args):
    """(q, k, v, dout, dlse, *args) -> q, k, v's gradients of attention's (out, lse)."""
    def grads(q, k, v, dout, dlse, *rest):
        _, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, *args, *rest), q, k, v)
        return vjp((dout, dlse))
    return grads


@pytest.mark.parametrize("jit", [False, True])
def test_cpu_lse_gradients_match_reference(cpu, jit):
    """The vjp of (out, lse) (NaN on the lse of rows that see no key) is the oracle's; a loss
    over out and the finite lse gives the same under jax.grad."""
    shape = Shape(2, 37, 29, 4, 2, 16, True)  # GQA, rows 0..7 see no key
    kwargs = dict(window_size=(9, 0), softcap=3.0, alibi_slopes=jnp.asarray(_SLOPES[1]))
    q, k, v, dout = make_inputs(shape, jnp.float32, seed=4)

    def attention(q, k, v):
        return cuflash.jax.attention(q, k, v, True, return_lse=True, **kwargs)

    out, lse = attention(q, k, v)
    dlse = _lse_gradient(lse, seed=5)
    vjp = jax.jit(_vjp(attention)) if jit else _vjp(attention)
    grads = vjp(q, k, v, dout, jnp.asarray(dlse))
    arrays = [np.asarray(x) for x in (dout, q, k, v)]
    options = reference_options(kwargs, None, causal=True)
    want_out, want_lse = cuflash.attention(*arrays[1:], return_lse=True, **numpy_options(kwargs, causal=True))
    np.testing.assert_array_equal(np.asarray(out), want_out)
    np.testing.assert_array_equal(np.asarray(lse), want_lse)
    refs = attention_reference_backward(*arrays, dlse=dlse, **options)
    for got, ref, name in zip(grads, refs, ("dq", "dk", "dv")):
        assert np.isfinite(np.asarray(got)).all(), name
        _close(got, ref, name)

    def loss(q, k, v, dout, dlse):
        out, lse = attention(q, k, v)
        seen = jnp.isfinite(lse)
        return jnp.sum(out * dout) + jnp.sum(jnp.where(seen, lse, 0.0) * jnp.where(seen, dlse, 0.0))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    for got, expected in zip((jax.jit(grad) if jit else grad)(q, k, v, dout, jnp.asarray(dlse)), grads):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_cpu_varlen_lse_gradients_match_reference(cpu):
    """Packed sequences (one with no rows, one with no keys), jitted: the vjp of (out, lse)."""
    shape = VarlenShape((9, 0, 17, 4), (12, 5, 0, 4), 4, 2, 16, True)
    q, k, v, dout = make_inputs(shape, jnp.float32, seed=6)
    cu_q, cu_k = shape.cu_seqlens_q, shape.cu_seqlens_k
    kwargs = dict(window_size=(6, -1), softcap=2.0)

    def attention(q, k, v, cu_q, cu_k):
        return cuflash.jax.attention_varlen(q, k, v, cu_q, cu_k, shape.max_seqlen_q, shape.max_seqlen_k, True,
                                            return_lse=True, **kwargs)

    out, lse = attention(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k))
    assert lse.shape == (4, q.shape[0]) and np.isinf(np.asarray(lse)).any()
    dlse = _lse_gradient(lse, seed=7)
    grads = jax.jit(_vjp(attention))(q, k, v, dout, jnp.asarray(dlse), jnp.asarray(cu_q), jnp.asarray(cu_k))
    arrays = [np.asarray(x) for x in (dout, q, k, v)]
    refs = attention_reference_varlen_backward(*arrays, cu_q, cu_k, dlse=dlse,
                                               **reference_options(kwargs, None, causal=True))
    for got, ref, name in zip(grads, refs, ("dq", "dk", "dv")):
        assert np.isfinite(np.asarray(got)).all(), name
        _close(got, ref, name)


def merged_by_lse(q, k, v, split, **kwargs):
    """Attention over keys [:split] and over keys [split:], merged by their LSEs (in float32):
    lse = logaddexp(lse1, lse2), out = out1 exp(lse1 - lse) + out2 exp(lse2 - lse)."""
    out1, lse1 = cuflash.jax.attention(q, k[:, :split], v[:, :split], return_lse=True, **kwargs)
    out2, lse2 = cuflash.jax.attention(q, k[:, split:], v[:, split:], return_lse=True, **kwargs)
    lse = jnp.logaddexp(lse1, lse2)

    def weighted(out, part_lse):  # lse (batch, nheads, seqlen_q) -> (batch, seqlen_q, nheads, 1)
        return out.astype(jnp.float32) * jnp.exp(part_lse - lse).transpose(0, 2, 1)[..., None]

    return (weighted(out1, lse1) + weighted(out2, lse2)).astype(q.dtype), lse


def test_cpu_merging_halves_by_lse_is_full_attention(cpu):
    """Two halves of the keys merged by their LSEs, jitted: full attention's out, lse and
    gradients (which reach q, k and v through both LSEs)."""
    q, k, v, dout = make_inputs(Shape(2, 33, 50, 4, 2, 16, False), jnp.float32, seed=8)

    def loss(attention):
        return lambda q, k, v, dout: jnp.sum(attention(q, k, v)[0] * dout)

    def full(q, k, v):
        return cuflash.jax.attention(q, k, v, return_lse=True)

    def merged(q, k, v):
        return merged_by_lse(q, k, v, 23)

    for got, want, name in zip(jax.jit(merged)(q, k, v), full(q, k, v), ("out", "lse")):
        assert_close(np.asarray(got), np.asarray(want), atol=1e-5 * max(1.0, float(jnp.abs(want).max())), name=name)
    got = jax.jit(jax.grad(loss(merged), argnums=(0, 1, 2)))(q, k, v, dout)
    want = jax.grad(loss(full), argnums=(0, 1, 2))(q, k, v, dout)
    refs = attention_reference_backward(*(np.asarray(x) for x in (dout, q, k, v)))
    for g, w, ref, name in zip(got, want, refs, ("dq", "dk", "dv")):
        _close(g, np.asarray(w), name)
        _close(g, ref, name)


# --- GPU: the CUDA kernels on XLA's buffers ------------------------------------------------


def check_output(out, q, k, v, causal):
    """flash-attn's rule for the forward: max|out - ref64| <= 2 * max|out_lowp - ref64| + floor."""
    import cupy

    from .test_gpu_forward import FLOOR
    q, k, v = (cupy.from_dlpack(x) for x in (q, k, v))
    ref, _ = attention_reference(q, k, v, causal=causal)
    lowp_err = float(abs(attention_lowp(q, k, v, causal=causal) - ref).max()) if ref.size else 0.0
    assert_close(cupy.from_dlpack(out), ref, atol=2 * lowp_err + FLOOR[str(q.dtype)], name="out")


def check_gradients(grads, dout, q, k, v, causal, softmax_scale=None, dlse=None):
    """The GPU backward tests' rule (flash-attn's, with NaN/inf parity), on JAX arrays; with
    dlse (a NumPy array), for the gradients of out and lse together."""
    import cupy

    from .test_gpu_backward import check_gradients as check_cupy_gradients
    dout, q, k, v = (cupy.from_dlpack(x) for x in (dout, q, k, v))
    check_cupy_gradients(dout, q, k, v, [cupy.from_dlpack(g) for g in grads], causal, softmax_scale,
                         dlse=None if dlse is None else cupy.asarray(dlse))


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", [
    (Shape(2, 129, 65, 4, 2, 64, True), "bfloat16"),  # causal, seqlen_q > seqlen_k: masked rows
    (Shape(1, 200, 333, 6, 2, 128, False), "float16"),
    (Shape(2, 77, 300, 4, 1, 96, True), "bfloat16"),  # MQA, causal, seqlen_q < seqlen_k
    (Shape(1, 150, 150, 2, 2, 59, True), "float16"),  # odd head dim
])
@pytest.mark.parametrize("jit", [False, True])
def test_gradients_match_reference(shape, dtype, jit):
    q, k, v, dout = make_inputs(shape, getattr(jnp, dtype), seed=shape.seqlen_q)
    forward = jax.jit(cuflash.jax.attention, static_argnums=(3,)) if jit else cuflash.jax.attention
    out = forward(q, k, v, shape.causal)
    assert isinstance(out, jax.Array) and out.dtype == q.dtype and out.shape == q.shape
    check_output(out, q, k, v, shape.causal)
    grads = loss_and_grads(shape.causal, jit=jit)(q, k, v, dout)
    for grad, like in zip(grads, (q, k, v)):
        assert grad.dtype == like.dtype and grad.shape == like.shape
    check_gradients(grads, dout, q, k, v, shape.causal)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", [
    (Shape(2, 191, 300, 4, 2, 64, True), "bfloat16"),
    (Shape(1, 200, 333, 6, 2, 128, False), "float16"),
])
def test_zero_copy(shape, dtype):
    """The kernel reads q, k, v where JAX keeps them and writes the buffer JAX hands back."""
    q, k, v, _ = make_inputs(shape, getattr(jnp, dtype))
    with Launches() as launches:
        out = cuflash.jax.attention(q, k, v, shape.causal)
        out.block_until_ready()
    (pointers, stream), = launches.calls
    assert pointers[:3] == [x.unsafe_buffer_pointer() for x in (q, k, v)]
    assert pointers[3] == out.unsafe_buffer_pointer()


@pytest.mark.gpu
def test_deterministic_gradients_are_bitwise_reproducible():
    shape = Shape(2, 384, 1024, 8, 2, 64, True)
    q, k, v, dout = make_inputs(shape, jnp.bfloat16, seed=7)
    grads = loss_and_grads(True, deterministic=True)
    first = grads(q, k, v, dout)
    for _ in range(3):
        for a, b in zip(first, grads(q, k, v, dout)):
            assert bool(jnp.array_equal(a, b))
    check_gradients(first, dout, q, k, v, causal=True)


# --- GPU: the options on XLA's buffers ---------------------------------------------------


def _kernel_options(kwargs: dict, causal: bool) -> dict:
    """cuflash.attention's keywords (CuPy slopes, an int seed) for test_gpu_variants' checks."""
    import cupy
    options = dict(kwargs, causal=causal)
    if options.get("alibi_slopes") is not None:
        options["alibi_slopes"] = cupy.asarray(np.asarray(options["alibi_slopes"]))
    return options


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_options_match_reference(name, dtype):
    """Every option under jit on the GPU, forward and gradients, against the oracle; the
    dropout seed traced (two uint32 words read by the callback)."""
    import cupy

    from .test_gpu_variants import check_forward, check_gradients as check_variant_gradients
    causal, kwargs = VARIANTS[name]
    shape = Shape(2, 150, 230, 4, 2, 64, causal)
    kwargs = _for_batch(kwargs, shape.batch)
    seed = kwargs.pop("seed", 0)
    words = jnp.array([seed & 0xFFFFFFFF, seed >> 32], jnp.uint32)
    q, k, v, dout = make_inputs(shape, getattr(jnp, dtype), seed=3)

    def attention(q, k, v, words):
        return cuflash.jax.attention(q, k, v, causal, seed=words, **kwargs)

    def loss(q, k, v, dout, words):
        return jnp.sum(attention(q, k, v, words).astype(jnp.float32) * dout.astype(jnp.float32))

    out = jax.jit(attention)(q, k, v, words)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, dout, words)
    options = _kernel_options(dict(kwargs, seed=seed), causal)
    as_cupy = [cupy.from_dlpack(x) for x in (dout, q, k, v, out)]
    _, lse = cuflash.attention(*as_cupy[1:4], return_lse=True, **options)  # cuflash.jax returns out only
    check_forward(*as_cupy[1:], lse, options)
    check_variant_gradients(*as_cupy[:4], [cupy.from_dlpack(g) for g in grads], options, out=as_cupy[4])


@pytest.mark.gpu
def test_static_and_traced_seeds_agree_on_gpu():
    q, k, v, _ = make_inputs(Shape(2, 190, 260, 4, 2, 128, True), jnp.bfloat16, seed=5)
    seed = 2**33 + 7
    words = jnp.array([seed & 0xFFFFFFFF, seed >> 32], jnp.uint32)
    static = cuflash.jax.attention(q, k, v, True, dropout_p=0.3, seed=seed)
    traced = jax.jit(lambda q, k, v, w: cuflash.jax.attention(q, k, v, True, dropout_p=0.3, seed=w))(q, k, v, words)
    assert bool(jnp.array_equal(static, traced))


@pytest.mark.gpu
def test_varlen_on_gpu():
    """Packed sequences (one empty on each side) with every option, jitted, against the oracle."""
    import cupy

    from .test_gpu_variants import check_forward, check_gradients as check_variant_gradients
    shape = VarlenShape((100, 0, 257, 64), (130, 40, 0, 300), 4, 2, 128, False)
    q, k, v, dout = make_inputs(shape, jnp.bfloat16, seed=6)
    cu_q, cu_k = jnp.asarray(shape.cu_seqlens_q), jnp.asarray(shape.cu_seqlens_k)
    kwargs = dict(window_size=(50, 10), softcap=8.0, alibi_slopes=jnp.asarray(_SLOPES), dropout_p=0.15, seed=21)
    lengths = (shape.max_seqlen_q, shape.max_seqlen_k)

    def attention(q, k, v, cu_q, cu_k):
        return cuflash.jax.attention_varlen(q, k, v, cu_q, cu_k, *lengths, **kwargs)

    def loss(q, k, v, dout, cu_q, cu_k):
        return jnp.sum(attention(q, k, v, cu_q, cu_k).astype(jnp.float32) * dout.astype(jnp.float32))

    out = jax.jit(attention)(q, k, v, cu_q, cu_k)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, dout, cu_q, cu_k)
    options = _kernel_options(kwargs, False)
    as_cupy = [cupy.from_dlpack(x) for x in (dout, q, k, v, out, cu_q, cu_k)]
    _, lse = cuflash.attention_varlen(*as_cupy[1:4], *as_cupy[5:], *lengths, return_lse=True, **options)
    check_forward(*as_cupy[1:5], lse, options, varlen=as_cupy[5:])
    check_variant_gradients(*as_cupy[:4], [cupy.from_dlpack(g) for g in grads], options, varlen=as_cupy[5:],
                            out=as_cupy[4])


# --- GPU: the gradient of the LSE ----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", [
    (Shape(2, 129, 65, 4, 2, 64, True), "bfloat16"),  # causal, seqlen_q > seqlen_k: rows that see no key
    (Shape(1, 150, 150, 2, 2, 59, True), "float16"),  # odd head dim
])
@pytest.mark.parametrize("jit", [False, True])
def test_lse_gradients_match_reference(shape, dtype, jit):
    """The vjp of (out, lse) on the GPU, NaN on the lse of rows that see no key, against the
    oracle's gradients with flash-attn's rule."""
    q, k, v, dout = make_inputs(shape, getattr(jnp, dtype), seed=shape.seqlen_q)

    def attention(q, k, v):
        return cuflash.jax.attention(q, k, v, shape.causal, return_lse=True)

    _, lse = attention(q, k, v)
    dlse = _lse_gradient(lse, seed=1)
    vjp = jax.jit(_vjp(attention)) if jit else _vjp(attention)
    grads = vjp(q, k, v, dout, jnp.asarray(dlse))
    for grad, like in zip(grads, (q, k, v)):
        assert grad.dtype == like.dtype and bool(jnp.isfinite(grad).all())
    check_gradients(grads, dout, q, k, v, shape.causal, dlse=dlse)


@pytest.mark.gpu
def test_merging_halves_by_lse_on_gpu():
    """Two halves of the keys merged by their LSEs, jitted on the GPU: full attention's
    gradients by flash-attn's rule."""
    q, k, v, dout = make_inputs(Shape(2, 200, 333, 4, 2, 64, False), jnp.bfloat16, seed=9)

    def loss(q, k, v, dout):
        return jnp.sum(merged_by_lse(q, k, v, 130)[0].astype(jnp.float32) * dout.astype(jnp.float32))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, dout)
    check_gradients(grads, dout, q, k, v, causal=False)
