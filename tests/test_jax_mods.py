"""score_mod / mask_mod through cuflash.jax: custom_vjp, eagerly and under jax.jit.

CPU arrays take the NumPy path inside the same buffer_callback, in float32, against the
float64 oracle (cuflash.reference with the same functions): outputs, LSE and the gradients
of both. The functions: a relative bias read from an array, a document mask read from
arrays, a softcap written with tanh; block masks (cuflash.mod.create_block_mask, a pytree) of
a causal, a document and a sliding-window mask. The tests marked gpu run the same calls on
GPU arrays (the mma.sync kernels compiled with the functions) by flash-attn's rule
(tests/rule.py).
"""
import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="JAX is not installed: pip install -e '.[jax]'")
pytest.importorskip("jax.experimental.buffer_callback", reason="cuflash.jax needs JAX 0.7 or newer")

import jax.numpy as jnp  # noqa: E402

import cuflash.jax  # noqa: E402
from cuflash import mod  # noqa: E402
from cuflash.reference import (attention_reference, attention_reference_backward,  # noqa: E402
                               attention_reference_varlen, attention_reference_varlen_backward)

from .mod_cases import (BATCH, BLOCK_CASES, BLOCK_SEQLEN_K, BLOCK_SEQLEN_Q, CASES, HEADDIM,  # noqa: E402
                        NHEADS, NHEADS_KV, RADIUS, SEQLEN_K, SEQLEN_Q, block_mask_misuses, relative_bias, softcap)
from .strategies import assert_close  # noqa: E402


@pytest.fixture(autouse=True)
def cpu(request):
    """CPU arrays (the NumPy path) for the CPU tests, the default device for the gpu ones."""
    if request.node.get_closest_marker("gpu"):
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _tensors(case: str, rng, batch: int, seqlen_q: int, seqlen_k: int) -> tuple:
    bias = rng.standard_normal((NHEADS, 2 * RADIUS + 1)).astype(np.float32)
    docs = tuple(np.sort(rng.integers(0, 3, (batch, n)), axis=1).astype(np.int32) for n in (seqlen_q, seqlen_k))
    return {"bias": (bias,), "document": docs, "softcap": (), "both": (bias, *docs)}[case]


def _case(case: str, varlen: bool, dtype=np.float32, seed: int = 0):
    """(host inputs q, k, v, dout, dlse; packing or None; host mod tensors; oracle (out, lse); oracle grads)."""
    score_mod, mask_mod, options = CASES[case]
    rng = np.random.default_rng(seed)
    if varlen:
        lengths_q, lengths_k = (9, 0, 13), (11, 6, 17)
        cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k))
        q_shape, kv_shape, lse_shape = (cu_q[-1], NHEADS, HEADDIM), (cu_k[-1], NHEADS_KV, HEADDIM), (NHEADS, cu_q[-1])
        host = _tensors(case, rng, 3, max(lengths_q), max(lengths_k))
        packing = (cu_q, cu_k, max(lengths_q), max(lengths_k))
    else:
        q_shape, kv_shape = (BATCH, SEQLEN_Q, NHEADS, HEADDIM), (BATCH, SEQLEN_K, NHEADS_KV, HEADDIM)
        lse_shape = (BATCH, NHEADS, SEQLEN_Q)
        host = _tensors(case, rng, BATCH, SEQLEN_Q, SEQLEN_K)
        packing = None
    q, k, v, dout = (rng.standard_normal(s).astype(dtype) for s in (q_shape, kv_shape, kv_shape, q_shape))
    dlse = rng.standard_normal(lse_shape).astype(np.float32)
    mods = dict(score_mod=score_mod, mask_mod=mask_mod, mod_tensors=host)
    if varlen:
        ref = attention_reference_varlen(q, k, v, *packing[:2], **options, **mods)
        grads = attention_reference_varlen_backward(dout, q, k, v, *packing[:2], dlse=dlse, **options, **mods)
    else:
        ref = attention_reference(q, k, v, **options, **mods)
        grads = attention_reference_backward(dout, q, k, v, dlse=dlse, **options, **mods)
    return (q, k, v, dout, dlse), packing, host, ref, grads


def _loss(case: str, packing):
    """(q, k, v, dout, dlse, *mod_tensors) -> (sum(out * dout) + sum(lse * dlse), (out, lse))."""
    score_mod, mask_mod, options = CASES[case]

    def loss(q, k, v, dout, dlse, *tensors):
        mods = dict(score_mod=score_mod, mask_mod=mask_mod, mod_tensors=tensors, return_lse=True, **options)
        if packing is None:
            out, lse = cuflash.jax.attention(q, k, v, **mods)
        else:
            out, lse = cuflash.jax.attention_varlen(q, k, v, jnp.asarray(packing[0]), jnp.asarray(packing[1]),
                                                    *packing[2:], **mods)
        total = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)) + jnp.sum(lse * dlse)
        return total, (out, lse)

    return loss


def _check(out, lse, grads, ref, ref_grads, atol=2e-5):
    """float32 against float64: the tolerance scales with each quantity."""
    assert_close(np.asarray(out), ref[0], atol=atol)
    assert_close(np.asarray(lse), ref[1], atol=atol * (1 + np.abs(ref[1][np.isfinite(ref[1])]).max(initial=0.0)),
                 name="lse")
    for name, g, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(np.asarray(g), want, atol=atol * (1 + np.abs(want).max(initial=0.0)), name=name)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("varlen", [False, True])
def test_cpu_mods_match_the_oracle_under_jit(case, varlen):
    inputs, packing, host, ref, ref_grads = _case(case, varlen)
    step = jax.jit(jax.value_and_grad(_loss(case, packing), argnums=(0, 1, 2), has_aux=True))
    (_, (out, lse)), grads = step(*inputs, *host)
    _check(out, lse, grads, ref, ref_grads)


def test_cpu_mods_eagerly_and_without_lse():
    inputs, _, host, ref, ref_grads = _case("both", False)
    (_, (out, lse)), grads = jax.value_and_grad(_loss("both", None), argnums=(0, 1, 2), has_aux=True)(*inputs, *host)
    _check(out, lse, grads, ref, ref_grads)
    score_mod, mask_mod, options = CASES["both"]
    plain = cuflash.jax.attention(*inputs[:3], score_mod=score_mod, mask_mod=mask_mod, mod_tensors=host, **options)
    assert_close(np.asarray(plain), ref[0], atol=2e-5)


def test_cpu_mods_are_static_by_their_text():
    """Two function objects of one traced text make equal static configurations (one
    executable); another text another."""
    q, k, v = (jnp.asarray(x) for x in _case("softcap", False)[0][:3])

    def config(score_mod):
        return cuflash.jax.calls._prepare(q, k, v, None, False, None, False, (-1, -1), 0.0, None, 0.0, None,
                                          score_mod)[0]

    same = config(lambda s, b, h, i, j: 2.0 * mod.tanh(s / 2.0))
    assert same == config(softcap) and hash(same) == hash(config(softcap))
    assert same != config(lambda s, b, h, i, j: 3.0 * mod.tanh(s / 3.0))


def test_cpu_mod_tensors_get_zero_gradients():
    inputs, _, host, _, _ = _case("bias", False)
    grad = jax.grad(lambda bias: _loss("bias", None)(*inputs, bias)[0])(jnp.asarray(host[0]))
    assert grad.shape == host[0].shape and not np.asarray(grad).any()


def test_cpu_mod_errors():
    q, k, v = (jnp.asarray(x) for x in _case("bias", False)[0][:3])
    bias = jnp.zeros((NHEADS, 2 * RADIUS + 1))
    with pytest.raises(ValueError, match="pass one of them too"):
        cuflash.jax.attention(q, k, v, mod_tensors=(bias,))
    with pytest.raises(TypeError, match="score_mod 'relative_bias'"):
        cuflash.jax.attention(q, k, v, score_mod=relative_bias)  # (its tensor missing)
    with pytest.raises(IndexError, match="relative_bias"):  # found while tracing, before the callback
        jax.jit(lambda q, k, v, bias: cuflash.jax.attention(q, k, v, score_mod=relative_bias,
                                                            mod_tensors=(bias,)))(q, k, v, bias[:, :3])
    with pytest.raises(NotImplementedError, match="block_table"):
        cuflash.jax.attention_varlen(q[0], k[0], v[0], jnp.array([0, SEQLEN_Q], jnp.int32),
                                     jnp.array([0, SEQLEN_K], jnp.int32), SEQLEN_Q, SEQLEN_K,
                                     block_table=jnp.zeros((1, 1), jnp.int32), score_mod=softcap)


# --- block masks ----------------------------------------------------------------------------


def _blocks(case: str, dtype=np.float32, seed: int = 2, host: tuple | None = None):
    """(host inputs q, k, v, dout, dlse; host mod tensors; oracle (out, lse); oracle grads) of a
    block mask's case: the oracle with its mask_mod. ``host``: the mod tensors, by default
    the case's drawn from ``seed + 1``."""
    score_mod, mask_mod, options = BLOCK_CASES[case]
    if host is None:
        host = _tensors("both", np.random.default_rng(seed + 1), BATCH, BLOCK_SEQLEN_Q,
                        BLOCK_SEQLEN_K) if case == "document" else ()
    rng = np.random.default_rng(seed)
    q_shape, kv_shape = (BATCH, BLOCK_SEQLEN_Q, NHEADS, HEADDIM), (BATCH, BLOCK_SEQLEN_K, NHEADS_KV, HEADDIM)
    q, k, v, dout = (rng.standard_normal(s).astype(dtype) for s in (q_shape, kv_shape, kv_shape, q_shape))
    dlse = rng.standard_normal((BATCH, NHEADS, BLOCK_SEQLEN_Q)).astype(np.float32)
    mods = dict(score_mod=score_mod, mask_mod=mask_mod, mod_tensors=host)
    ref = attention_reference(q, k, v, **options, **mods)
    grads = attention_reference_backward(dout, q, k, v, dlse=dlse, **options, **mods)
    return (q, k, v, dout, dlse), host, ref, grads


def _block_mask(case: str, host: tuple, like):
    return mod.create_block_mask(BLOCK_CASES[case][1], BATCH, NHEADS, BLOCK_SEQLEN_Q, BLOCK_SEQLEN_K,
                                 mod_tensors=tuple(jnp.asarray(t) for t in host), like=like)


def _block_loss(case: str):
    """(q, k, v, dout, dlse, block_mask) -> (sum(out * dout) + sum(lse * dlse), (out, lse))."""
    score_mod, _, options = BLOCK_CASES[case]

    def loss(q, k, v, dout, dlse, block_mask):
        out, lse = cuflash.jax.attention(q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True,
                                         **options)
        total = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)) + jnp.sum(lse * dlse)
        return total, (out, lse)

    return loss


@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_cpu_block_masks_give_what_their_mask_mod_gives_under_jit(case):
    """A block mask (made with like=q: JAX statuses) as an argument of a jitted step: outputs
    and gradients equal the step's with its mask_mod alone (bitwise: the same scores are
    masked) and the oracle's."""
    inputs, host, ref, ref_grads = _blocks(case)
    block_mask = _block_mask(case, host, jnp.asarray(inputs[0]))
    assert isinstance(block_mask.statuses, jax.Array) and block_mask.statuses.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(block_mask.statuses), mod.create_block_mask(
        block_mask.mask_mod, BATCH, NHEADS, BLOCK_SEQLEN_Q, BLOCK_SEQLEN_K, mod_tensors=host).statuses)
    assert {mod.EMPTY, mod.PARTIAL} <= set(np.unique(np.asarray(block_mask.statuses)).tolist())
    step = jax.jit(jax.value_and_grad(_block_loss(case), argnums=(0, 1, 2), has_aux=True))
    (_, (out, lse)), grads = step(*inputs, block_mask)
    _check(out, lse, grads, ref, ref_grads)
    score_mod, mask_mod, options = BLOCK_CASES[case]

    def alone(q, k, v, dout, dlse, *tensors):
        out, lse = cuflash.jax.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, mod_tensors=tensors,
                                         return_lse=True, **options)
        return jnp.sum(out * dout) + jnp.sum(lse * dlse), (out, lse)

    (_, plain), plain_grads = jax.jit(jax.value_and_grad(alone, argnums=(0, 1, 2), has_aux=True))(*inputs, *host)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (*plain, *plain_grads)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)


def test_cpu_packed_calls_take_a_block_mask_over_their_sequences():
    """attention_varlen with a block mask made over (sequences, heads, max_seqlen_q,
    max_seqlen_k), under jit: outputs and gradients equal the call's with its mask_mod alone
    (bitwise), sequences of different lengths reading their own rows of the statuses."""
    (q, k, v, _, _), host, _, _ = _blocks("document")
    block_mask = _block_mask("document", host, jnp.asarray(q))
    lengths_q, lengths_k = (BLOCK_SEQLEN_Q, BLOCK_SEQLEN_Q // 3), (BLOCK_SEQLEN_K // 2, BLOCK_SEQLEN_K)
    cu_q, cu_k = (np.array([0, n[0], n[0] + n[1]], np.int32) for n in (lengths_q, lengths_k))
    packed = [np.concatenate([x[b, :n] for b, n in enumerate(lengths)])
              for x, lengths in ((q, lengths_q), (k, lengths_k), (v, lengths_k))]
    dout = np.random.default_rng(5).standard_normal(packed[0].shape).astype(packed[0].dtype)
    score_mod, mask_mod, options = BLOCK_CASES["document"]

    def loss(q, k, v, **mods):
        out = cuflash.jax.attention_varlen(q, k, v, cu_q, cu_k, BLOCK_SEQLEN_Q, BLOCK_SEQLEN_K, score_mod=score_mod,
                                           **options, **mods)
        return jnp.sum(out * dout), out

    step = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    (_, out), grads = jax.jit(lambda q, k, v, bm: step(q, k, v, block_mask=bm))(*packed, block_mask)
    (_, plain), plain_grads = step(*packed, mask_mod=mask_mod, mod_tensors=tuple(jnp.asarray(t) for t in host))
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (plain, *plain_grads)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)


def test_cpu_block_mask_is_an_input_under_jit():
    """Another block mask of the same shapes (other documents) reuses the executable, with its
    own statuses and tensors; one closed over is a constant; eagerly, and one made with NumPy
    (like=None), give the same."""
    inputs, host, ref, ref_grads = _blocks("document")
    block_mask = _block_mask("document", host, jnp.asarray(inputs[0]))
    traces = []

    def loss(*args):
        traces.append(1)
        return _block_loss("document")(*args)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    (_, (out, lse)), grads = step(*inputs, block_mask)
    _check(out, lse, grads, ref, ref_grads)
    bias, doc_q, doc_k = host
    merged = (bias, (doc_q > 0).astype(doc_q.dtype), (doc_k > 0).astype(doc_k.dtype))  # (documents 1 and 2 as one)
    _, _, other_ref, other_grads = _blocks("document", host=merged)
    other = _block_mask("document", merged, jnp.asarray(inputs[0]))
    assert not np.array_equal(np.asarray(other.statuses), np.asarray(block_mask.statuses))
    (_, (out, lse)), grads = step(*inputs, other)
    _check(out, lse, grads, other_ref, other_grads)
    assert len(traces) == 1
    closed = jax.jit(jax.value_and_grad(lambda *args: _block_loss("document")(*args, block_mask), argnums=(0, 1, 2),
                                        has_aux=True))
    (_, (out, lse)), grads = closed(*inputs)
    _check(out, lse, grads, ref, ref_grads)
    numpy_mask = mod.create_block_mask(block_mask.mask_mod, BATCH, NHEADS, BLOCK_SEQLEN_Q, BLOCK_SEQLEN_K,
                                       mod_tensors=host)
    (_, (out, lse)), grads = jax.value_and_grad(_block_loss("document"), argnums=(0, 1, 2), has_aux=True)(
        *inputs, numpy_mask)
    _check(out, lse, grads, ref, ref_grads)


def test_cpu_block_mask_errors():
    """Each misuse raises while tracing, before any callback, naming block_mask (or the argument)."""
    inputs, host, _, _ = _blocks("document")
    q, k, v = (jnp.asarray(x) for x in inputs[:3])
    block_mask = _block_mask("document", host, q)
    mask_mod, tensors = block_mask.mask_mod, block_mask.mod_tensors
    score_mod = BLOCK_CASES["document"][0]

    def made(batch=BATCH, heads=NHEADS, seqlen_q=BLOCK_SEQLEN_Q, seqlen_k=BLOCK_SEQLEN_K):
        return mod.create_block_mask(mask_mod, batch, heads, seqlen_q, seqlen_k, mod_tensors=tensors, like=q)

    listed = mod.BlockMask(mask_mod, tensors, block_mask.tree, np.asarray(block_mask.statuses).tolist(), BATCH,
                           NHEADS, BLOCK_SEQLEN_Q, BLOCK_SEQLEN_K)  # (as a torch or CuPy one would be refused)
    cases = [
        *block_mask_misuses(made, block_mask),
        (dict(block_mask=block_mask, mod_tensors=(jnp.array(tensors[0]), *tensors[1:])), ValueError,
         "mod_tensors must be block_mask's own 3 arrays"),
        (dict(block_mask=listed), TypeError,
         "block_mask's statuses must be a JAX or NumPy array, got builtins.list.*like=q"),
        (dict(block_mask="no"), TypeError, "block_mask must be a cuflash.mod.BlockMask"),
    ]
    for extra, error, message in cases:
        with pytest.raises(error, match=message):
            cuflash.jax.attention(q, k, v, score_mod=score_mod, **extra)
        with pytest.raises(error, match=message):  # (while tracing)
            jax.jit(lambda q, k, v: cuflash.jax.attention(q, k, v, score_mod=score_mod, **extra))(q, k, v)
    cuflash.jax.attention(q, k, v, score_mod=score_mod, block_mask=block_mask, mask_mod=mask_mod,
                          mod_tensors=tensors)  # (the same: accepted)
    with pytest.raises(TypeError, match="call it outside jax.jit"):
        jax.jit(lambda q, *tensors: mod.create_block_mask(mask_mod, BATCH, NHEADS, BLOCK_SEQLEN_Q, BLOCK_SEQLEN_K,
                                                          mod_tensors=tensors, like=q).statuses)(q, *tensors)
    with pytest.raises(TypeError, match=r"mod_tensors\[0\] must be a jax array \(like is a jax array\)"):
        mod.create_block_mask(mask_mod, BATCH, NHEADS, BLOCK_SEQLEN_Q, BLOCK_SEQLEN_K, mod_tensors=host, like=q)
    with pytest.raises(ValueError, match=f"block_mask was made for batch {BATCH}, this call has 1"):  # (packed)
        cuflash.jax.attention_varlen(q[0], k[0], v[0], jnp.array([0, BLOCK_SEQLEN_Q], jnp.int32),
                                     jnp.array([0, BLOCK_SEQLEN_K], jnp.int32), BLOCK_SEQLEN_Q, BLOCK_SEQLEN_K,
                                     block_mask=block_mask)


# --- GPU: the kernels inside the same callbacks ---------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("varlen", [False, True])
def test_gpu_mods_match_the_oracle_under_jit(case, varlen):
    """float16 GPU arrays under jit, by flash-attn's rule against the oracle."""
    (q, k, v, dout, _), packing, host, _, _ = _case(case, varlen, np.float16)
    score_mod, mask_mod, options = CASES[case]
    mods = dict(score_mod=score_mod, mask_mod=mask_mod, mod_tensors=host)
    dlse = np.zeros((NHEADS, q.shape[0]) if varlen else (BATCH, NHEADS, SEQLEN_Q), np.float32)
    step = jax.jit(jax.value_and_grad(_loss(case, packing), argnums=(0, 1, 2), has_aux=True))
    (_, (out, lse)), grads = step(q, k, v, dout, dlse, *host)
    _check_against_the_oracle(out, lse, grads, (q, k, v, dout), mods, options, packing[:2] if varlen else None)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_gpu_block_masks_match_the_oracle_under_jit(case):
    """float16 GPU arrays under jit with a block mask made on the GPU (like=q), by flash-attn's
    rule against the oracle with its mask_mod."""
    (q, k, v, dout, _), host, _, _ = _blocks(case, np.float16)
    score_mod, mask_mod, options = BLOCK_CASES[case]
    block_mask = _block_mask(case, host, jnp.asarray(q))
    assert block_mask.statuses.devices() == jnp.asarray(q).devices()
    np.testing.assert_array_equal(np.asarray(block_mask.statuses), mod.create_block_mask(
        mask_mod, BATCH, NHEADS, BLOCK_SEQLEN_Q, BLOCK_SEQLEN_K, mod_tensors=host).statuses)  # (CuPy's = NumPy's)
    dlse = np.zeros((BATCH, NHEADS, BLOCK_SEQLEN_Q), np.float32)
    step = jax.jit(jax.value_and_grad(_block_loss(case), argnums=(0, 1, 2), has_aux=True))
    (_, (out, lse)), grads = step(q, k, v, dout, dlse, block_mask)
    mods = dict(score_mod=score_mod, mask_mod=mask_mod, mod_tensors=host)
    _check_against_the_oracle(out, lse, grads, (q, k, v, dout), mods, options)


def _check_against_the_oracle(out, lse, grads, inputs, mods, options, packing=None):
    """float16 out, lse and gradients against the float64 oracle with the mods, by flash-attn's
    rule (tests/rule.py: the yardstick is plain low-precision attention's error without them);
    packing: (cu_seqlens_q, cu_seqlens_k) of packed sequences."""
    from cuflash.reference import (attention_lowp, attention_lowp_backward, attention_lowp_varlen,
                                   attention_lowp_varlen_backward)

    from .rule import FLOOR, check_lse, check_output, lowp_error
    q, k, v, dout = inputs
    if packing is not None:
        ref, ref_lse = attention_reference_varlen(q, k, v, *packing, **mods, **options)
        low, plain = (attention_lowp_varlen(q, k, v, *packing, **options),
                      attention_reference_varlen(q, k, v, *packing, **options)[0])
        refs = attention_reference_varlen_backward(dout, q, k, v, *packing, **mods, **options)
        lows = attention_lowp_varlen_backward(dout, q, k, v, *packing, **options)
        plains = attention_reference_varlen_backward(dout, q, k, v, *packing, **options)
    else:
        ref, ref_lse = attention_reference(q, k, v, **mods, **options)
        low, plain = attention_lowp(q, k, v, **options), attention_reference(q, k, v, **options)[0]
        refs = attention_reference_backward(dout, q, k, v, **mods, **options)
        lows = attention_lowp_backward(dout, q, k, v, **options)
        plains = attention_reference_backward(dout, q, k, v, **options)
    check_output(np.asarray(out), ref, lowp_error(low, plain), "float16")
    check_lse(np.asarray(lse), ref_lse)
    for name, g, want, lw, pl in zip(("dq", "dk", "dv"), grads, refs, lows, plains):
        scale = float(np.abs(want).max(initial=0.0))
        assert_close(np.asarray(g), want, atol=3 * lowp_error(lw, pl) + 2 * FLOOR["float16"] * (1.0 + scale),
                     name=name)
