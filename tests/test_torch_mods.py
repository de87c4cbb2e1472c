"""score_mod / mask_mod through cuflash.torch: autograd, the mod custom ops, torch.compile.

CPU tensors take the NumPy path through the same ops, in float64, against the float64
oracle (cuflash.reference with the same functions): outputs, LSE and the gradients of both.
The functions: a relative bias read from a tensor, a document mask read from tensors, a
softcap written with tanh; block masks (cuflash.mod.create_block_mask with like=q) of a
causal, a document and a sliding-window mask. The tests marked gpu run the same calls on
CUDA tensors (the mma.sync kernels compiled with the functions) by flash-attn's rule
(tests/rule.py).
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")

import cuflash.torch  # noqa: E402
from cuflash import mod  # noqa: E402
from cuflash.reference import (attention_reference, attention_reference_backward,  # noqa: E402
                               attention_reference_varlen, attention_reference_varlen_backward)

from .mod_cases import (BATCH, BLOCK_CASES, BLOCK_SEQLEN_K, BLOCK_SEQLEN_Q, CASES, HEADDIM,  # noqa: E402
                        NHEADS, NHEADS_KV, RADIUS, SEQLEN_K, SEQLEN_Q, block_mask_misuses, relative_bias, softcap)
from .strategies import assert_close  # noqa: E402


def _tensors(case: str, rng, batch: int, seqlen_q: int, seqlen_k: int) -> tuple:
    """The case's mod tensors (NumPy; b indexes the batch or the sequences)."""
    bias = rng.standard_normal((NHEADS, 2 * RADIUS + 1))
    docs = (np.sort(rng.integers(0, 3, (batch, seqlen_q)), axis=1).astype(np.int32),
            np.sort(rng.integers(0, 3, (batch, seqlen_k)), axis=1).astype(np.int64))
    return {"bias": (bias,), "document": docs, "softcap": (), "both": (bias, *docs)}[case]


def _inputs(rng, q_shape, kv_shape):
    q, k, v, dout = (torch.from_numpy(rng.standard_normal(s)) for s in (q_shape, kv_shape, kv_shape, q_shape))
    dlse = torch.from_numpy(rng.standard_normal((q_shape[0], q_shape[2], q_shape[1]) if len(q_shape) == 4
                                                else (q_shape[1], q_shape[0])))
    return [x.requires_grad_() for x in (q, k, v)], dout, dlse


def _dense(case: str, seed: int = 0):
    """(inputs, host mod tensors, kwargs, oracle's (out, lse), oracle's gradients)."""
    score_mod, mask_mod, options = CASES[case]
    rng = np.random.default_rng(seed)
    host = _tensors(case, rng, BATCH, SEQLEN_Q, SEQLEN_K)
    (q, k, v), dout, dlse = _inputs(rng, (BATCH, SEQLEN_Q, NHEADS, HEADDIM), (BATCH, SEQLEN_K, NHEADS_KV, HEADDIM))
    arrays = [x.detach().numpy() for x in (q, k, v)]
    mods = dict(score_mod=score_mod, mask_mod=mask_mod, mod_tensors=host)
    ref = attention_reference(*arrays, **options, **mods)
    grads = attention_reference_backward(dout.numpy(), *arrays, dlse=dlse.numpy(), **options, **mods)
    kwargs = dict(options, score_mod=score_mod, mask_mod=mask_mod,
                  mod_tensors=tuple(torch.from_numpy(t) for t in host))
    return (q, k, v, dout, dlse), kwargs, ref, grads


def _check(out, lse, got, ref, grads):
    assert_close(out.detach().numpy(), ref[0], atol=1e-10)
    assert_close(lse.detach().numpy(), ref[1], atol=1e-5, name="lse")  # (lse is float32)
    for name, g, want in zip(("dq", "dk", "dv"), got, grads):  # (P is recomputed from the float32 lse)
        assert_close(g.numpy(), want, atol=1e-6 * (1 + np.abs(want).max(initial=0.0)), name=name)


@pytest.mark.parametrize("case", list(CASES))
def test_cpu_mods_match_the_oracle_with_gradients(case):
    (q, k, v, dout, dlse), kwargs, ref, grads = _dense(case)
    out, lse = cuflash.torch.attention(q, k, v, return_lse=True, **kwargs)
    got = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), (q, k, v))
    _check(out, lse, got, ref, grads)
    with torch.no_grad():  # inference: the call itself, no op
        assert_close(cuflash.torch.attention(q, k, v, **kwargs).numpy(), ref[0], atol=1e-10)


def _varlen(case: str, seed: int = 1):
    score_mod, mask_mod, options = CASES[case]
    rng = np.random.default_rng(seed)
    lengths_q, lengths_k = (9, 0, 13), (11, 6, 17)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k))
    host = _tensors(case, rng, 3, max(lengths_q), max(lengths_k))
    (q, k, v), dout, dlse = _inputs(rng, (cu_q[-1], NHEADS, HEADDIM), (cu_k[-1], NHEADS_KV, HEADDIM))
    arrays = [x.detach().numpy() for x in (q, k, v)]
    mods = dict(score_mod=score_mod, mask_mod=mask_mod, mod_tensors=host)
    ref = attention_reference_varlen(*arrays, cu_q, cu_k, **options, **mods)
    grads = attention_reference_varlen_backward(dout.numpy(), *arrays, cu_q, cu_k, dlse=dlse.numpy(), **options,
                                                **mods)
    kwargs = dict(options, score_mod=score_mod, mask_mod=mask_mod,
                  mod_tensors=tuple(torch.from_numpy(t) for t in host))
    packing = (torch.from_numpy(cu_q), torch.from_numpy(cu_k), max(lengths_q), max(lengths_k))
    return (q, k, v, dout, dlse), packing, kwargs, ref, grads


@pytest.mark.parametrize("case", ["bias", "both"])
def test_cpu_varlen_mods_match_the_oracle_with_gradients(case):
    (q, k, v, dout, dlse), packing, kwargs, ref, grads = _varlen(case)
    out, lse = cuflash.torch.attention_varlen(q, k, v, *packing, return_lse=True, **kwargs)
    got = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), (q, k, v))
    _check(out, lse, got, ref, grads)


def test_cpu_torch_compile_fullgraph_with_mods():
    """No graph break: the functions become a registry key while torch.compile traces, the
    mod ops run them; forward and backward against the oracle."""
    (q, k, v, dout, dlse), kwargs, ref, grads = _dense("both")
    tensors = kwargs.pop("mod_tensors")

    def loss(q, k, v, bias, doc_q, doc_k):
        out, lse = cuflash.torch.attention(q, k, v, return_lse=True, mod_tensors=(bias, doc_q, doc_k), **kwargs)
        return (out * dout).sum() + (lse * dlse).sum(), out, lse

    assert torch._dynamo.explain(loss)(q, k, v, *tensors).graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    total, out, lse = compiled(q, k, v, *tensors)
    _check(out, lse, torch.autograd.grad(total, (q, k, v)), ref, grads)


def test_cpu_torch_compile_varlen_with_a_lambda():
    """A function made inside the compiled region (a new object each trace) works too."""
    (q, k, v, dout, dlse), packing, kwargs, ref, grads = _varlen("softcap")

    def loss(q, k, v):
        out, lse = cuflash.torch.attention_varlen(
            q, k, v, *packing, return_lse=True, window_size=(5, 3),
            score_mod=lambda s, b, h, i, j: 2.0 * mod.tanh(s / 2.0))
        return (out * dout).sum() + (lse * dlse).sum(), out, lse

    total, out, lse = torch.compile(loss, fullgraph=True, backend="aot_eager")(q, k, v)
    _check(out, lse, torch.autograd.grad(total, (q, k, v)), ref, grads)


def test_cpu_mod_ops_opcheck():
    """torch.library.opcheck of the mod ops: schema, fake tensors, autograd registration."""
    (q, k, v, dout, dlse), kwargs, _, _ = _dense("both")
    key, tensors = cuflash.torch.calls._mod_arguments(kwargs["score_mod"], kwargs["mask_mod"], kwargs["mod_tensors"])
    options = (False, None, False, -1, -1, 3.0, None, 0.0, None)
    torch.library.opcheck(cuflash.torch.attention_mod_forward, (q, k, v, *options, key, tensors))
    out, lse, rng_state = cuflash.torch.attention_mod_forward(*(x.detach() for x in (q, k, v)), *options, key,
                                                              tensors)
    backward = (dout, *(x.detach() for x in (q, k, v)), out, lse, *options[:-1], rng_state)
    torch.library.opcheck(cuflash.torch.attention_mod_backward, (*backward, dlse.float(), key, tensors))
    torch.library.opcheck(cuflash.torch.attention_mod_backward, (*backward, None, key, tensors))


def test_cpu_varlen_mod_ops_opcheck():
    (q, k, v, dout, dlse), packing, kwargs, _, _ = _varlen("both")
    key, tensors = cuflash.torch.calls._mod_arguments(kwargs["score_mod"], kwargs["mask_mod"], kwargs["mod_tensors"])
    options = (True, 0.5, False, -1, -1, 3.0, None, 0.0, None)
    torch.library.opcheck(cuflash.torch.attention_varlen_mod_forward, (q, k, v, *packing, *options, key, tensors))
    out, lse, rng_state = cuflash.torch.attention_varlen_mod_forward(*(x.detach() for x in (q, k, v)), *packing,
                                                                     *options, key, tensors)
    backward = (dout, *(x.detach() for x in (q, k, v)), out, lse, *packing, *options[:-1], rng_state)
    torch.library.opcheck(cuflash.torch.attention_varlen_mod_backward, (*backward, dlse.float(), key, tensors))


def test_cpu_mod_errors():
    (q, k, v, _, _), kwargs, _, _ = _dense("bias")
    bias = kwargs["mod_tensors"][0]
    with pytest.raises(ValueError, match=r"mod_tensors\[0\] requires grad"):
        cuflash.torch.attention(q, k, v, score_mod=relative_bias, mod_tensors=(bias.clone().requires_grad_(),))
    with pytest.raises(ValueError, match=r"mod_tensors\[0\] requires grad"):
        cuflash.torch.attention_varlen(q[0], k[0], v[0], torch.tensor([0, SEQLEN_Q], dtype=torch.int32),
                                       torch.tensor([0, SEQLEN_K], dtype=torch.int32), SEQLEN_Q, SEQLEN_K,
                                       score_mod=relative_bias, mod_tensors=(bias.clone().requires_grad_(),))
    with torch.no_grad():  # no gradient is computed, so none is lost
        cuflash.torch.attention(q, k, v, score_mod=relative_bias, mod_tensors=(bias.clone().requires_grad_(),))
    with pytest.raises(ValueError, match=r"one device.*mod_tensors\[0\]"):
        cuflash.torch.attention(q, k, v, score_mod=relative_bias, mod_tensors=(bias.to("meta"),))
    with pytest.raises(TypeError, match=r"mod_tensors\[0\] must be a torch.Tensor"):
        cuflash.torch.attention(q, k, v, score_mod=relative_bias, mod_tensors=(bias.numpy(),))
    with pytest.raises(ValueError, match="pass one of them too"):
        cuflash.torch.attention(q, k, v, mod_tensors=(bias,))
    with pytest.raises(TypeError, match="score_mod 'relative_bias'"):
        cuflash.torch.attention(q, k, v, score_mod=relative_bias)  # (its tensor missing)
    with pytest.raises(NotImplementedError, match="block_table"):
        cuflash.torch.attention_varlen(q[0], k[0], v[0], torch.tensor([0, SEQLEN_Q], dtype=torch.int32),
                                       torch.tensor([0, SEQLEN_K], dtype=torch.int32), SEQLEN_Q, SEQLEN_K,
                                       block_table=torch.zeros((1, 1), dtype=torch.int32), score_mod=softcap)
    with pytest.raises(ValueError, match="no score_mod / mask_mod registered"):
        cuflash.torch.attention_mod_forward(*(x.detach() for x in (q, k, v)), False, None, False, -1, -1, 0.0, None,
                                            0.0, None, "not a key", [])


# --- block masks ----------------------------------------------------------------------------


def _blocks(case: str, seed: int = 2, host: tuple | None = None):
    """(inputs, the block mask (made with like=q), kwargs beside it, oracle's (out, lse), oracle's
    gradients): the oracle with the block mask's mask_mod. ``host``: the mod tensors (NumPy),
    by default the case's drawn from ``seed + 1``."""
    score_mod, mask_mod, options = BLOCK_CASES[case]
    if host is None:
        host = _tensors("both", np.random.default_rng(seed + 1), BATCH, BLOCK_SEQLEN_Q,
                        BLOCK_SEQLEN_K) if case == "document" else ()
    (q, k, v), dout, dlse = _inputs(np.random.default_rng(seed), (BATCH, BLOCK_SEQLEN_Q, NHEADS, HEADDIM),
                                    (BATCH, BLOCK_SEQLEN_K, NHEADS_KV, HEADDIM))
    arrays = [x.detach().numpy() for x in (q, k, v)]
    mods = dict(score_mod=score_mod, mask_mod=mask_mod, mod_tensors=host)
    ref = attention_reference(*arrays, **options, **mods)
    grads = attention_reference_backward(dout.numpy(), *arrays, dlse=dlse.numpy(), **options, **mods)
    block_mask = mod.create_block_mask(mask_mod, BATCH, NHEADS, BLOCK_SEQLEN_Q, BLOCK_SEQLEN_K,
                                       mod_tensors=tuple(torch.from_numpy(t) for t in host), like=q)
    return (q, k, v, dout, dlse), block_mask, dict(options, score_mod=score_mod), ref, grads


@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_cpu_block_masks_give_what_their_mask_mod_gives(case):
    """Outputs and gradients with the block mask equal the call's with its mask_mod alone
    (bitwise: the same scores are masked) and the oracle's; its statuses, a CPU tensor, are
    NumPy's."""
    (q, k, v, dout, dlse), block_mask, kwargs, ref, grads = _blocks(case)
    statuses = block_mask.statuses
    assert isinstance(statuses, torch.Tensor) and statuses.dtype == torch.int8
    host = tuple(t.numpy() for t in block_mask.mod_tensors)
    np.testing.assert_array_equal(statuses.numpy(), mod.create_block_mask(
        block_mask.mask_mod, BATCH, NHEADS, BLOCK_SEQLEN_Q, BLOCK_SEQLEN_K, mod_tensors=host).statuses)
    assert {mod.EMPTY, mod.PARTIAL} <= set(statuses.unique().tolist())
    results = []
    for mods in (dict(block_mask=block_mask), dict(mask_mod=block_mask.mask_mod, mod_tensors=block_mask.mod_tensors)):
        out, lse = cuflash.torch.attention(q, k, v, return_lse=True, **kwargs, **mods)
        got = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), (q, k, v))
        _check(out, lse, got, ref, grads)
        results.append((out, lse, *got))
    for name, with_blocks, alone in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert torch.equal(with_blocks, alone), name
    with torch.no_grad():  # inference: the call itself, no op
        assert torch.equal(cuflash.torch.attention(q, k, v, block_mask=block_mask, **kwargs), results[1][0])


def test_cpu_packed_calls_take_a_block_mask_over_their_sequences():
    """attention_varlen with a block mask made over (sequences, heads, max_seqlen_q,
    max_seqlen_k): outputs and gradients equal the call with its mask_mod alone (bitwise),
    the sequences of different lengths reading their own rows of the statuses."""
    (q, k, v, _, _), block_mask, kwargs, _, _ = _blocks("document")
    lengths_q, lengths_k = (BLOCK_SEQLEN_Q, BLOCK_SEQLEN_Q // 3), (BLOCK_SEQLEN_K // 2, BLOCK_SEQLEN_K)
    cu_q, cu_k = (torch.tensor([0, n[0], n[0] + n[1]], dtype=torch.int32) for n in (lengths_q, lengths_k))
    packed = [torch.cat([x[b, :n] for b, n in enumerate(lengths)]).detach().requires_grad_()
              for x, lengths in ((q, lengths_q), (k, lengths_k), (v, lengths_k))]
    dout = torch.randn(packed[0].shape, dtype=packed[0].dtype, generator=torch.Generator().manual_seed(4))
    packing = (cu_q, cu_k, BLOCK_SEQLEN_Q, BLOCK_SEQLEN_K)
    results = []
    for mods in (dict(block_mask=block_mask), dict(mask_mod=block_mask.mask_mod, mod_tensors=block_mask.mod_tensors)):
        out, lse = cuflash.torch.attention_varlen(*packed, *packing, return_lse=True, **kwargs, **mods)
        results.append((out, lse, *torch.autograd.grad((out * dout).sum(), packed)))
    for name, with_blocks, alone in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert torch.equal(with_blocks, alone), name
    with pytest.raises(ValueError, match="block_mask was made for seqlen_q"):
        cuflash.torch.attention_varlen(*packed, cu_q, cu_k, BLOCK_SEQLEN_Q + 1, BLOCK_SEQLEN_K, block_mask=block_mask,
                                       **kwargs)


def test_cpu_torch_compile_fullgraph_with_a_block_mask():
    """No graph break: the block mask's statuses and mod tensors are inputs of the graph. A
    second block mask of the same shapes (other documents) reuses the graph with its own."""
    (q, k, v, dout, dlse), block_mask, kwargs, ref, grads = _blocks("document")

    def loss(q, k, v, block_mask):
        out, lse = cuflash.torch.attention(q, k, v, return_lse=True, block_mask=block_mask, **kwargs)
        return (out * dout).sum() + (lse * dlse).sum(), out, lse

    assert torch._dynamo.explain(loss)(q, k, v, block_mask).graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    total, out, lse = compiled(q, k, v, block_mask)
    _check(out, lse, torch.autograd.grad(total, (q, k, v)), ref, grads)
    bias, doc_q, doc_k = (t.numpy() for t in block_mask.mod_tensors)
    merged = (bias, (doc_q > 0).astype(doc_q.dtype), (doc_k > 0).astype(doc_k.dtype))  # (documents 1 and 2 as one)
    (q, k, v, _, _), other, _, ref, grads = _blocks("document", host=merged)  # (the same q, k, v, dout, dlse)
    assert not torch.equal(other.statuses, block_mask.statuses)
    with torch.compiler.set_stance("fail_on_recompile"):
        total, out, lse = compiled(q, k, v, other)
    _check(out, lse, torch.autograd.grad(total, (q, k, v)), ref, grads)


def test_cpu_mod_ops_opcheck_with_block_statuses():
    """The mod ops' optional last input, block_statuses: schema, fake tensors, autograd."""
    (q, k, v, dout, dlse), block_mask, kwargs, _, _ = _blocks("document")
    key, tensors = cuflash.torch.calls._mod_arguments(kwargs["score_mod"], block_mask.mask_mod, block_mask.mod_tensors)
    options = (False, None, False, -1, -1, 0.0, None, 0.0, None)
    forward = (*(x.detach() for x in (q, k, v)), *options, key, tensors, block_mask.statuses)
    torch.library.opcheck(cuflash.torch.attention_mod_forward, forward)
    out, lse, rng_state = cuflash.torch.attention_mod_forward(*forward)
    backward = (dout, *(x.detach() for x in (q, k, v)), out, lse, *options[:-1], rng_state)
    torch.library.opcheck(cuflash.torch.attention_mod_backward, (*backward, dlse.float(), key, tensors,
                                                                 block_mask.statuses))


def test_cpu_block_mask_errors(monkeypatch):
    """Each misuse raises before anything runs, naming block_mask (or the argument)."""
    (q, k, v, _, _), block_mask, kwargs, _, _ = _blocks("document")
    monkeypatch.setattr(cuflash.api, "attention", lambda *args, **kwargs: pytest.fail("ran"))  # (the ops' one run)
    mask_mod, tensors = block_mask.mask_mod, block_mask.mod_tensors

    def made(batch=BATCH, heads=NHEADS, seqlen_q=BLOCK_SEQLEN_Q, seqlen_k=BLOCK_SEQLEN_K, **kwargs):
        return mod.create_block_mask(mask_mod, batch, heads, seqlen_q, seqlen_k, **{"mod_tensors": tensors,
                                                                                       "like": q, **kwargs})

    cases = [
        *block_mask_misuses(made, block_mask),
        (dict(block_mask=block_mask, mod_tensors=(tensors[0].clone(), *tensors[1:])), ValueError,
         "mod_tensors must be block_mask's own 3 arrays"),
        (dict(block_mask=made(mod_tensors=tuple(t.numpy() for t in tensors), like=None)), TypeError,
         r"block_mask's statuses must be a torch tensor on q's device, got numpy.ndarray.*like=q"),
        (dict(block_mask="no"), TypeError, "block_mask must be a cuflash.mod.BlockMask"),
    ]
    for extra, error, message in cases:
        with pytest.raises(error, match=message):
            cuflash.torch.attention(q, k, v, **kwargs, **extra)
    short = made(seqlen_k=7)
    # (found while torch.compile traces; fullgraph=True wraps it in torch's "Observed exception")
    with pytest.raises(Exception, match="block_mask was made for seqlen_k 7"):
        torch.compile(lambda q, k, v: cuflash.torch.attention(q, k, v, block_mask=short, **kwargs),
                      fullgraph=True, backend="aot_eager")(q, k, v)
    with pytest.raises(TypeError, match=r"mod_tensors\[0\] must be a torch tensor \(like is a torch tensor\)"):
        made(mod_tensors=tuple(t.numpy() for t in tensors))
    with pytest.raises(ValueError, match=f"block_mask was made for batch {BATCH}, this call has 1"):  # (packed)
        cuflash.torch.attention_varlen(q[0], k[0], v[0], torch.tensor([0, BLOCK_SEQLEN_Q], dtype=torch.int32),
                                       torch.tensor([0, BLOCK_SEQLEN_K], dtype=torch.int32), BLOCK_SEQLEN_Q,
                                       BLOCK_SEQLEN_K, block_mask=block_mask, **kwargs)


# --- GPU: the kernels through the same ops -------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("varlen", [False, True])
def test_gpu_mods_match_the_oracle(case, varlen):
    """float16 CUDA tensors through autograd, by flash-attn's rule against the oracle."""
    from cuflash.reference import (attention_lowp, attention_lowp_backward, attention_lowp_varlen,
                                   attention_lowp_varlen_backward)
    if varlen:
        (q, k, v, dout, _), packing, kwargs, _, _ = _varlen(case)
    else:
        (q, k, v, dout, _), kwargs, _, _ = _dense(case)
    options = CASES[case][2]
    host = [t.numpy() for t in kwargs["mod_tensors"]]
    mods = dict(score_mod=kwargs["score_mod"], mask_mod=kwargs["mask_mod"])
    arrays = [x.detach().half().numpy() for x in (q, k, v, dout)]
    cuda = [torch.from_numpy(x).cuda().requires_grad_(i < 3) for i, x in enumerate(arrays)]
    tensors = tuple(torch.from_numpy(t).cuda() for t in host)
    if varlen:
        cu = [x.numpy() for x in packing[:2]]
        out, lse = cuflash.torch.attention_varlen(*cuda[:3], *(x.cuda() for x in packing[:2]), *packing[2:],
                                                  return_lse=True, mod_tensors=tensors, **mods, **options)
        ref, ref_lse = attention_reference_varlen(*arrays[:3], *cu, mod_tensors=host, **mods, **options)
        low, plain = attention_lowp_varlen(*arrays[:3], *cu, **options), attention_reference_varlen(
            *arrays[:3], *cu, **options)[0]
        refs = attention_reference_varlen_backward(arrays[3], *arrays[:3], *cu, mod_tensors=host, **mods, **options)
        lows = attention_lowp_varlen_backward(arrays[3], *arrays[:3], *cu, **options)
        plains = attention_reference_varlen_backward(arrays[3], *arrays[:3], *cu, **options)
    else:
        out, lse = cuflash.torch.attention(*cuda[:3], return_lse=True, mod_tensors=tensors, **mods, **options)
        ref, ref_lse = attention_reference(*arrays[:3], mod_tensors=host, **mods, **options)
        low, plain = attention_lowp(*arrays[:3], **options), attention_reference(*arrays[:3], **options)[0]
        refs = attention_reference_backward(arrays[3], *arrays[:3], mod_tensors=host, **mods, **options)
        lows = attention_lowp_backward(arrays[3], *arrays[:3], **options)
        plains = attention_reference_backward(arrays[3], *arrays[:3], **options)
    grads = torch.autograd.grad(out, cuda[:3], cuda[3])
    _check_by_the_rule(out, lse, grads, (ref, ref_lse), refs, (low, plain), lows, plains)


def _check_by_the_rule(out, lse, grads, ref, refs, lowp, lows, plains):
    """float16 results against the oracle's (out, lse) and gradients, by flash-attn's rule:
    twice (three times for gradients) plain attention's float16 error (``lowp``: its float16
    and float64 out, ``lows`` and ``plains``: its gradients)."""
    from .rule import FLOOR, check_lse, check_output, lowp_error
    check_output(out.detach().cpu().numpy(), ref[0], lowp_error(*lowp), "float16")
    check_lse(lse.detach().cpu().numpy(), ref[1])
    for name, g, want, lw, pl in zip(("dq", "dk", "dv"), grads, refs, lows, plains):
        scale = float(np.abs(want).max(initial=0.0))
        assert_close(g.cpu().numpy(), want, atol=3 * lowp_error(lw, pl) + 2 * FLOOR["float16"] * (1.0 + scale),
                     name=name)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_gpu_block_masks_match_the_oracle(case):
    """float16 CUDA tensors through autograd with a block mask made on the GPU (like=q), by
    flash-attn's rule against the oracle with its mask_mod."""
    from cuflash.reference import attention_lowp, attention_lowp_backward
    (q, k, v, dout, _), cpu_mask, kwargs, _, _ = _blocks(case)
    score_mod, mask_mod, options = BLOCK_CASES[case]
    host = [t.numpy() for t in cpu_mask.mod_tensors]
    arrays = [x.detach().half().numpy() for x in (q, k, v, dout)]
    cuda = [torch.from_numpy(x).cuda().requires_grad_(i < 3) for i, x in enumerate(arrays)]
    block_mask = mod.create_block_mask(mask_mod, BATCH, NHEADS, BLOCK_SEQLEN_Q, BLOCK_SEQLEN_K,
                                       mod_tensors=tuple(torch.from_numpy(t).cuda() for t in host), like=cuda[0])
    assert block_mask.statuses.is_cuda and torch.equal(block_mask.statuses.cpu(), cpu_mask.statuses)
    out, lse = cuflash.torch.attention(*cuda[:3], return_lse=True, block_mask=block_mask, **kwargs)
    grads = torch.autograd.grad(out, cuda[:3], cuda[3])
    mods = dict(score_mod=score_mod, mask_mod=mask_mod, mod_tensors=host)
    ref = attention_reference(*arrays[:3], **mods, **options)
    refs = attention_reference_backward(arrays[3], *arrays[:3], **mods, **options)
    lowp = (attention_lowp(*arrays[:3], **options), attention_reference(*arrays[:3], **options)[0])
    _check_by_the_rule(out, lse, grads, ref, refs, lowp, attention_lowp_backward(arrays[3], *arrays[:3], **options),
                       attention_reference_backward(arrays[3], *arrays[:3], **options))
