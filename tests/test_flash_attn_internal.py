"""flash-attn 2.8's internal functions (``_flash_attn_forward``, ``_flash_attn_backward`` and
their varlen twins in cuflash.flash_attn_interface), the paged KV-cache call's capacity
guard (flash-attn's test_flash_attn_kvcache_paged_block_table_bounds) and the paged
flash_attn_varlen_func on tensors that require grad. CPU tensors run the NumPy path
against the float64 oracle; the tests marked gpu run the kernels through the same code."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")

import cuflash  # noqa: E402
import cuflash.torch  # noqa: E402
from cuflash import _philox  # noqa: E402
from cuflash.flash_attn_interface import (  # noqa: E402
    _flash_attn_backward,
    _flash_attn_forward,
    _flash_attn_varlen_backward,
    _flash_attn_varlen_forward,
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)
from cuflash.reference import (  # noqa: E402
    attention_reference,
    attention_reference_backward,
    attention_reference_varlen,
    attention_reference_varlen_backward,
)

from .strategies import assert_close, attention_shapes, variants, varlen_shapes  # noqa: E402


def _close(got, want, name):
    """Agreement with the oracle of a float64 computation (whose lse, and so the backward's
    recomputed P, is float32)."""
    got = got.detach().cpu().double().numpy() if isinstance(got, torch.Tensor) else got
    assert_close(got, want, atol=1e-6 * max(1.0, float(np.abs(want[np.isfinite(want)]).max(initial=0))), name=name)


def _randn(generator, *shape, dtype=torch.float64, device="cpu"):
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)


def _flash_options(variant, causal):
    """The internal functions' positional options after dropout_p: softmax_scale, causal,
    window_size_left, window_size_right, softcap, alibi_slopes."""
    slopes = None if variant.alibi_slopes is None else torch.from_numpy(np.ascontiguousarray(variant.alibi_slopes))
    return (None, causal, *variant.window_size, variant.softcap, slopes)


def _nan_like(x):
    return torch.full_like(x, float("nan"))  # in-place results must overwrite every element


def kept(s_dmask, seqlen_q, seqlen_k):
    """The keep mask S_dmask encodes: a dropped probability is negative (its sign bit set)."""
    return ~torch.signbit(s_dmask[..., :seqlen_q, :seqlen_k])


# --- the dense pair ----------------------------------------------------------------------------


@settings(deadline=None, max_examples=60)
@given(data=st.data(), shape=attention_shapes(max_batch=2, max_seqlen=24, max_headdim=16))
def test_forward_and_backward_are_the_oracle(data, shape):
    """out, softmax_lse and the dropout mask (S_dmask) of _flash_attn_forward; dq, dk, dv
    written in place and softmax_d of _flash_attn_backward given the forward's rng_state."""
    variant = data.draw(variants(shape.batch, shape.nheads, max(shape.seqlen_q, shape.seqlen_k)), label="variant")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31), label="seed"))
    q, k, v = (_randn(g, *s) for s in (shape.q_shape, shape.kv_shape, shape.kv_shape))
    dout = _randn(g, *shape.q_shape)
    p = variant.dropout_p
    options = _flash_options(variant, shape.causal)
    out, lse, s_dmask, rng_state = _flash_attn_forward(q, k, v, p, *options, True)
    assert (s_dmask is None) == (p == 0)
    keep = None if s_dmask is None else kept(s_dmask, shape.seqlen_q, shape.seqlen_k).numpy()
    arrays = [x.numpy() for x in (q, k, v)]
    ref = dict(causal=shape.causal, **variant.reference_options(keep))
    want_out, want_lse = attention_reference(*arrays, **ref)
    _close(out, want_out, "out")
    assert lse.dtype == torch.float32 and lse.shape == (shape.batch, shape.nheads, shape.seqlen_q)
    _close(lse, want_lse, "softmax_lse")

    dq, dk, dv = _nan_like(q), _nan_like(k), _nan_like(v)
    softmax_d = _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, p, *options, False, rng_state)
    for grad, want, name in zip((dq, dk, dv), attention_reference_backward(dout.numpy(), *arrays, **ref),
                                ("dq", "dk", "dv")):
        _close(grad, want, name)
    # flash-attn's D: rowsum(dout * out), scaled by the keep probability
    assert softmax_d.dtype == torch.float32 and softmax_d.shape == lse.shape
    _close(softmax_d, (1 - p) * (dout.numpy() * want_out).sum(-1).transpose(0, 2, 1), "softmax_d")

    _, _, s_dmask, _ = _flash_attn_forward(q, k, v, p, *options, False)
    assert s_dmask.shape == (0,) and s_dmask.dtype == q.dtype  # flash-attn's empty tensor


def test_gradients_given_as_none_are_computed_and_dropped():
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = _randn(g, 2, 13, 4, 8), _randn(g, 2, 9, 2, 8), _randn(g, 2, 9, 2, 8), _randn(g, 2, 13, 4, 8)
    out, lse, _, rng_state = _flash_attn_forward(q, k, v, 0.0, 0.3, True, -1, -1, 0.0, None, False)
    grads = [torch.empty_like(x) for x in (q, k, v)]
    want_d = _flash_attn_backward(dout, q, k, v, out, lse, *grads, 0.0, 0.3, True, -1, -1, 0.0, None, False, rng_state)
    d = _flash_attn_backward(dout, q, k, v, out, lse, None, None, None, 0.0, 0.3, True, -1, -1, 0.0, None, False)
    assert torch.equal(d, want_d)
    dk = _nan_like(k)
    _flash_attn_backward(dout, q, k, v, out, lse, None, dk, None, 0.0, 0.3, True, -1, -1, 0.0, None, False)
    assert torch.equal(dk, grads[1])


def test_the_internal_functions_are_flash_attn_func():
    """Under one torch seed, the forward draws flash_attn_func's dropout mask, and the
    backward given its rng_state is the autograd gradient, bit for bit; another call's
    rng_state is another mask."""
    g = torch.Generator().manual_seed(1)
    q, k, v = _randn(g, 2, 17, 4, 8), _randn(g, 2, 21, 2, 8), _randn(g, 2, 21, 2, 8)
    dout = _randn(g, 2, 17, 4, 8)
    options = (0.4, None, True, 5, -1, 0.0, None)
    torch.manual_seed(7)
    out, lse, mask, rng_state = _flash_attn_forward(q, k, v, *options, True)
    _, _, other_mask, other_state = _flash_attn_forward(q, k, v, *options, True)
    assert rng_state.dtype == torch.int64 and rng_state.shape == (2,)
    assert not torch.equal(mask, other_mask) and not torch.equal(rng_state, other_state)
    seed, offset = cuflash.torch.calls._from_rng_state(rng_state)
    assert torch.equal(kept(mask, 17, 21), torch.from_numpy(_philox.keep_mask(seed, offset, 2, 4, 17, 21, 0.4)))

    torch.manual_seed(7)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    want, want_lse, want_mask = flash_attn_func(*leaves, 0.4, causal=True, window_size=(5, -1), deterministic=True,
                                                return_attn_probs=True)
    assert torch.equal(out, want.detach()) and torch.equal(lse, want_lse.detach()) and torch.equal(mask, want_mask)
    want_grads = torch.autograd.grad(want, leaves, dout)
    grads = [torch.empty_like(x) for x in (q, k, v)]
    _flash_attn_backward(dout, q, k, v, out, lse, *grads, *options[:-1], None, True, rng_state)
    for grad, expected in zip(grads, want_grads):
        assert torch.equal(grad, expected)
    again = [torch.empty_like(x) for x in (q, k, v)]
    _flash_attn_backward(dout, q, k, v, out, lse, *again, *options[:-1], None, True, other_state)
    assert not torch.equal(again[0], grads[0])


def test_gradient_targets_are_checked():
    q, k = torch.zeros(1, 3, 2, 8), torch.zeros(1, 4, 1, 8)
    out, lse, _, _ = _flash_attn_forward(q, k, k, 0.0, None, False, -1, -1, 0.0, None, False)
    args = (0.0, None, False, -1, -1, 0.0, None, False)
    with pytest.raises(ValueError, match=r"dk must have k's shape \(1, 4, 1, 8\), dtype torch.float32"):
        _flash_attn_backward(q, q, k, k, out, lse, None, torch.zeros(1, 4, 2, 8), None, *args)
    with pytest.raises(ValueError, match="dq must have q's shape"):
        _flash_attn_backward(q, q, k, k, out, lse, q.double(), None, None, *args)
    with pytest.raises(TypeError, match="dv must be None or a torch.Tensor, got ndarray"):
        _flash_attn_backward(q, q, k, k, out, lse, None, None, k.numpy(), *args)


def test_a_compiled_step_is_one_graph():
    """Forward and backward (the gradients written into given tensors) under
    torch.compile(fullgraph=True): the custom ops as opaque nodes, the copies traced."""
    def step(q, k, v, dout, dq, dk, dv):
        out, lse, _, rng_state = _flash_attn_forward(q, k, v, 0.0, 0.25, True, -1, -1, 0.0, None, False)
        return out, _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, 0.25, True, -1, -1, 0.0, None,
                                         False, rng_state)

    g = torch.Generator().manual_seed(2)
    inputs = [_randn(g, *s, dtype=torch.float32) for s in ((1, 5, 2, 8), (1, 7, 1, 8), (1, 7, 1, 8), (1, 5, 2, 8))]
    eager, compiled = ([torch.zeros_like(x) for x in inputs[:3]] for _ in range(2))
    want = step(*inputs, *eager)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*inputs, *compiled)  # (inductor: slow to build)
    for a, b in zip((*got, *compiled), (*want, *eager)):
        assert torch.equal(a, b)


# --- the varlen pair ---------------------------------------------------------------------------


@settings(deadline=None, max_examples=50)
@given(data=st.data(), shape=varlen_shapes(max_batch=3, max_seqlen=16, max_headdim=16))
def test_varlen_forward_and_backward_are_the_oracle(data, shape):
    variant = data.draw(variants(shape.batch, shape.nheads, max(shape.max_seqlen_q, shape.max_seqlen_k, 1)),
                        label="variant")
    zero_tensors = data.draw(st.booleans(), label="zero_tensors")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31), label="seed"))
    q, k, v = (_randn(g, *s) for s in (shape.q_shape, shape.kv_shape, shape.kv_shape))
    dout = _randn(g, *shape.q_shape)
    cu_q, cu_k = torch.from_numpy(shape.cu_seqlens_q), torch.from_numpy(shape.cu_seqlens_k)
    packing = (cu_q, cu_k, shape.max_seqlen_q, shape.max_seqlen_k)
    p = variant.dropout_p
    options = _flash_options(variant, shape.causal)
    out, lse, s_dmask, rng_state = _flash_attn_varlen_forward(q, k, v, *packing, p, *options, return_softmax=True,
                                                              zero_tensors=zero_tensors)
    keep = None if s_dmask is None else [kept(s_dmask[b:b + 1], sq, sk).numpy()
                                         for b, (sq, sk) in enumerate(zip(shape.seqlens_q, shape.seqlens_k))]
    arrays = [x.numpy() for x in (q, k, v, cu_q, cu_k)]
    ref = dict(causal=shape.causal, **variant.reference_options(keep))
    want_out, want_lse = attention_reference_varlen(*arrays, **ref)
    _close(out, want_out, "out")
    assert lse.dtype == torch.float32 and lse.shape == (shape.nheads, q.shape[0])
    _close(lse, want_lse, "softmax_lse")

    dq, dk, dv = _nan_like(q), _nan_like(k), _nan_like(v)
    softmax_d = _flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, *packing, p, *options, False,
                                            rng_state, zero_tensors)
    wants = attention_reference_varlen_backward(dout.numpy(), *arrays, **ref)
    for grad, want, name in zip((dq, dk, dv), wants, ("dq", "dk", "dv")):
        _close(grad, want, name)
    assert softmax_d.dtype == torch.float32 and softmax_d.shape == lse.shape
    _close(softmax_d, (1 - p) * (dout.numpy() * want_out).sum(-1).T, "softmax_d")


def test_varlen_arguments_cuflash_lacks_are_refused():
    q, cu = torch.zeros(3, 2, 8), torch.tensor([0, 3], dtype=torch.int32)
    args = (q, q, q, cu, cu, 3, 3, 0.0, None, False)
    for name in ("leftpad_k", "seqused_k"):
        with pytest.raises(ValueError, match=f"{name} must be None"):
            _flash_attn_varlen_forward(*args, **{name: torch.zeros(1, dtype=torch.int32)})
    with pytest.raises(TypeError, match="zero_tensors must be a bool"):
        _flash_attn_varlen_forward(*args, zero_tensors=1)
    with pytest.raises(RuntimeError, match="num_splits > 1 is not supported"):
        _flash_attn_varlen_forward(*args, num_splits=2)
    for splits in (-1, 1.0, True):
        with pytest.raises(TypeError, match="num_splits must be a non-negative int"):
            _flash_attn_varlen_forward(*args, num_splits=splits)


# --- the paged varlen call ---------------------------------------------------------------------


def _paged_case(requires_grad=False, device="cpu"):
    """(q, k_pages, v_pages, block_table, cu_q, cu_k, k, v): three sequences' keys in pages
    of 4 rows handed out in reverse, and the same keys packed."""
    g = torch.Generator().manual_seed(3)
    dtype = torch.float64 if device == "cpu" else torch.float16
    lengths_q, lengths_k = [2, 5, 1], [6, 0, 11]
    q = _randn(g, sum(lengths_q), 4, 8, dtype=dtype, device=device)
    table = torch.arange(9, dtype=torch.int32).flip(0).reshape(3, 3)
    pools = [_randn(g, 9, 4, 2, 8, dtype=dtype) for _ in "kv"]
    k, v = (torch.cat([pool[table[b].long()].reshape(12, 2, 8)[:n] for b, n in enumerate(lengths_k)])
            for pool in pools)
    cu_q, cu_k = (torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32, device=device)
                  for n in (lengths_q, lengths_k))
    pools = [x.to(device).requires_grad_(requires_grad) for x in pools]
    return q.requires_grad_(requires_grad), *pools, table.to(device), cu_q, cu_k, k.to(device), v.to(device)


def test_the_internal_paged_varlen_forward():
    q, k_pages, v_pages, table, cu_q, cu_k, k, v = _paged_case(requires_grad=True)
    out, lse, s_dmask, rng_state = _flash_attn_varlen_forward(q, k_pages, v_pages, cu_q, cu_k, 5, 11, 0.0, None, True,
                                                              return_softmax=True, block_table=table)
    want, want_lse, _, _ = _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 5, 11, 0.0, None, True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert s_dmask is None and torch.equal(rng_state, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="dropout_p must be 0 with block_table"):
        _flash_attn_varlen_forward(q, k_pages, v_pages, cu_q, cu_k, 5, 11, 0.1, None, True, block_table=table)


def test_the_paged_varlen_forward_takes_seqused_k_and_num_splits():
    """flash-attn's paged varlen call with seqused_k (each sequence's keys in its pages)
    equals the call with cu_seqlens_k of those lengths; num_splits 0 and 1 equal the
    default, more is refused."""
    q, k_pages, v_pages, table, cu_q, cu_k, k, v = _paged_case()
    used = torch.tensor([5, 0, 9], dtype=torch.int32)  # fewer keys than cu_k's ranges (6, 0, 11)
    cu_used = torch.tensor([0, 5, 5, 14], dtype=torch.int32)
    want, want_lse, _, _ = _flash_attn_varlen_forward(q, k_pages, v_pages, cu_q, cu_used, 5, 11, 0.0, None, True,
                                                      block_table=table)
    for splits in (0, 1):
        out, lse, _, _ = _flash_attn_varlen_forward(q, k_pages, v_pages, cu_q, cu_k, 5, 11, 0.0, None, True,
                                                    block_table=table, seqused_k=used, num_splits=splits)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
    with pytest.raises(RuntimeError, match="num_splits > 1 is not supported"):
        _flash_attn_varlen_forward(q, k_pages, v_pages, cu_q, cu_k, 5, 11, 0.0, None, True, block_table=table,
                                   seqused_k=used, num_splits=2)
    for bad, match in ((used.long(), "seqused_k must be int32 of shape \\(3,\\)"),
                       (used[:2], "seqused_k must be int32 of shape \\(3,\\)"),
                       (used.tolist(), "seqused_k must be None or a torch.Tensor")):
        with pytest.raises((TypeError, ValueError), match=match):
            _flash_attn_varlen_forward(q, k_pages, v_pages, cu_q, cu_k, 5, 11, 0.0, None, True, block_table=table,
                                       seqused_k=bad)


def _check_paged_varlen_func_trains_forward_only(device):
    q, k_pages, v_pages, table, cu_q, cu_k, k, v = _paged_case(requires_grad=True, device=device)
    out, lse, mask = flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 5, 11, causal=True, block_table=table,
                                            return_attn_probs=True)
    with torch.no_grad():
        want, want_lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 11, causal=True, return_attn_probs=True)
    assert mask is None and out.requires_grad and lse.requires_grad
    torch.testing.assert_close(out, want, rtol=0, atol=0 if device == "cpu" else 5e-3)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0 if device == "cpu" else 1e-4)
    for loss in (out.sum(), lse.sum()):
        with pytest.raises(RuntimeError, match="block_table: flash_attn_varlen_func over paged k and v has no "
                                               "backward"):
            loss.backward()


def test_the_paged_varlen_func_runs_forward_on_tensors_that_require_grad():
    _check_paged_varlen_func_trains_forward_only("cpu")


# --- the block table's capacity (flash-attn's test_flash_attn_kvcache_paged_block_table_bounds) ---


def _bounds_case(xp, append, page_size=256, device="cpu"):
    """flash-attn's case: one sequence, one page in its table, four pages in the pool. Over
    capacity: a length of page_size + 1, or page_size with one key appended."""
    rng = np.random.default_rng(append)
    arrays = dict(q=rng.standard_normal((1, 1, 1, 64)), k_cache=rng.standard_normal((4, page_size, 1, 64)),
                  v_cache=rng.standard_normal((4, page_size, 1, 64)))
    if append:
        arrays.update(k=rng.standard_normal((1, 1, 1, 64)), v=rng.standard_normal((1, 1, 1, 64)))
    arrays = {name: x.astype(np.float16) for name, x in arrays.items()}
    arrays.update(block_table=np.zeros((1, 1), np.int32), over=np.full(1, page_size + 1 - append, np.int32),
                  full=np.full(1, page_size, np.int32))
    if xp == "numpy":
        return arrays
    return {name: torch.from_numpy(x).to(device) for name, x in arrays.items()}


_FRONT_ENDS = {
    "numpy": lambda a, lengths, new: cuflash.attention_with_kvcache(
        a["q"], a["k_cache"], a["v_cache"], *new, cache_seqlens=lengths, block_table=a["block_table"]),
    "torch": lambda a, lengths, new: cuflash.torch.attention_with_kvcache(
        a["q"], a["k_cache"], a["v_cache"], *new, cache_seqlens=lengths, block_table=a["block_table"]),
    "flash_attn": lambda a, lengths, new: flash_attn_with_kvcache(
        a["q"], a["k_cache"], a["v_cache"], *new, cache_seqlens=lengths, block_table=a["block_table"]),
}


def _check_bounds(front_end, append, device="cpu"):
    a = _bounds_case("numpy" if front_end == "numpy" else "torch", append, device=device)
    call = _FRONT_ENDS[front_end]
    new = (a["k"], a["v"]) if append else ()
    with pytest.raises(RuntimeError, match="block_table") as error:
        call(a, a["over"], new)
    assert "cache_seqlens[0] + seqlen_new" in str(error.value) and "256" in str(error.value)
    out = call(a, a["full"], ())  # exactly at capacity, no appended keys
    values = out if isinstance(out, np.ndarray) else out.float().cpu().numpy()
    assert out.shape == (1, 1, 1, 64) and not np.isnan(values).any()


@pytest.mark.parametrize("append", [False, True])
@pytest.mark.parametrize("front_end", list(_FRONT_ENDS))
def test_the_block_table_bounds_its_sequences(front_end, append):
    _check_bounds(front_end, append)


def test_the_block_table_bound_counts_every_sequence():
    """The sequence past its table is named; an int cache_seqlens is checked too, and
    flash_attn_with_kvcache's cache_seqlens=None (every cache full) is at capacity."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((3, 2, 2, 8)).astype(np.float32)
    pages = rng.standard_normal((9, 5, 1, 8)).astype(np.float32)
    table = np.arange(6, dtype=np.int32).reshape(3, 2)
    with pytest.raises(RuntimeError, match=r"sequence 2 needs cache_seqlens\[2\] \+ seqlen_new = 9 \+ 2 = 11"):
        cuflash.attention_with_kvcache(q, pages, pages, q[:, :, :1], q[:, :, :1],
                                       cache_seqlens=np.array([0, 8, 9], np.int32), block_table=table)
    with pytest.raises(RuntimeError, match="block_table addresses max_blocks 2 \\* page_size 5 = 10 rows"):
        cuflash.attention_with_kvcache(q, pages, pages, cache_seqlens=11, block_table=table)
    t = [torch.from_numpy(x) for x in (q, pages, table)]
    assert flash_attn_with_kvcache(t[0], t[1], t[1], block_table=t[2]).shape == q.shape


# --- on the GPU --------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [False, True])
def test_the_internal_functions_on_the_gpu(varlen):
    """The kernels through the internal functions: the autograd gradient of flash_attn_func
    / flash_attn_varlen_func under the same seed, bit for bit (deterministic), dropout
    included, and softmax_d from the outputs."""
    g = torch.Generator().manual_seed(4)
    if varlen:
        cu = torch.tensor([0, 70, 70, 201], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, 45, 145, 290], dtype=torch.int32, device="cuda")
        shapes, packing = ((201, 8, 64), (290, 2, 64), (290, 2, 64)), (cu, cu_k, 131, 145)
    else:
        shapes, packing = ((2, 130, 8, 64), (2, 97, 2, 64), (2, 97, 2, 64)), ()
    q, k, v = (_randn(g, *s, dtype=torch.bfloat16, device="cuda") for s in shapes)
    dout = _randn(g, *shapes[0], dtype=torch.bfloat16, device="cuda")
    options = (0.2, None, True, 40, 3, 0.0, None)
    forward, backward, public = ((_flash_attn_varlen_forward, _flash_attn_varlen_backward, flash_attn_varlen_func)
                                 if varlen else (_flash_attn_forward, _flash_attn_backward, flash_attn_func))
    torch.manual_seed(5)
    out, lse, mask, rng_state = forward(q, k, v, *packing, *options, True)
    torch.manual_seed(5)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    want, want_lse, want_mask = public(*leaves, *packing, 0.2, causal=True, window_size=(40, 3), deterministic=True,
                                       return_attn_probs=True)
    assert torch.equal(out, want.detach()) and torch.equal(lse, want_lse.detach()) and torch.equal(mask, want_mask)
    grads = [_nan_like(x) for x in (q, k, v)]
    softmax_d = backward(dout, q, k, v, out, lse, *grads, *packing, *options[:-1], None, True, rng_state)
    for grad, expected in zip(grads, torch.autograd.grad(want, leaves, dout)):
        assert torch.equal(grad, expected)
    expected_d = 0.8 * (dout.float() * out.float()).sum(-1).movedim(-1, -2)
    torch.testing.assert_close(softmax_d, expected_d, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_the_paged_varlen_func_on_the_gpu():
    _check_paged_varlen_func_trains_forward_only("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("append", [False, True])
@pytest.mark.parametrize("front_end", ["torch", "flash_attn"])
def test_the_block_table_bounds_its_sequences_on_the_gpu(front_end, append):
    """The lengths are read from the GPU, on a warm call (the same signature again) too."""
    a = _bounds_case("torch", append, device="cuda")
    _FRONT_ENDS[front_end](a, a["full"], ())
    _check_bounds(front_end, append, device="cuda")


@pytest.mark.gpu
def test_the_block_table_bound_with_cupy():
    import cupy
    a = {name: cupy.asarray(x) for name, x in _bounds_case("numpy", True).items()}
    with pytest.raises(RuntimeError, match="block_table"):
        _FRONT_ENDS["numpy"](a, a["full"], (a["k"], a["v"]))


@pytest.mark.gpu
def test_the_block_table_bound_is_skipped_under_graph_capture():
    """Captured, the lengths are not read (that would end the capture): no error, and the
    kernel clamps a length past the table to its capacity."""
    a = _bounds_case("torch", False, device="cuda")
    lengths = a["full"].clone()

    def step():
        return cuflash.torch.attention_with_kvcache(a["q"], a["k_cache"], a["v_cache"], cache_seqlens=lengths,
                                                    block_table=a["block_table"])

    want = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    lengths.fill_(257)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, want, rtol=0, atol=0)


# --- S_dmask: flash-attn's probabilities ---------------------------------------------------------


def _decoded_probabilities(s_dmask, q, k, lse, scale, causal, window_size, softcap, slopes):
    """S_dmask undone as flash-attn's tests undo theirs: block j of _get_block_size_n() keys
    times exp(m_j - lse), m_j the row's largest score in that block and the ones after it;
    and the probabilities of the float64 scores, both (nheads, seqlen_q, seqlen_k)."""
    from cuflash.flash_attn_interface import _get_block_size_n
    from cuflash.reference import _visible
    sq, sk, nheads = q.shape[0], k.shape[0], q.shape[1]
    kr = np.repeat(k.double().numpy(), nheads // k.shape[1], axis=1)
    s = np.einsum("qhd,khd->hqk", q.double().numpy(), kr) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    if slopes is not None:
        offset = np.arange(sk)[None, :] - np.arange(sq)[:, None] - (sk - sq)
        s = s - slopes.numpy()[:, None, None] * np.abs(offset)
    s = np.where(_visible(np, sq, sk, causal, window_size), s, -np.inf)
    block = _get_block_size_n(q.device, q.shape[-1], True, causal)
    decoded = np.abs(s_dmask[:, :sq, :sk].double().numpy())
    lse = lse.double().numpy()[:, :, None]
    for start in range(0, sk, block):
        m = s[:, :, start:].max(axis=-1, keepdims=True)
        decoded[:, :, start:start + block] *= np.exp(np.where(np.isinf(m), -np.inf, m - lse))
    return decoded, np.exp(s - lse)


@pytest.mark.parametrize("causal,window_size,softcap,alibi", [
    (False, (-1, -1), 0.0, False), (True, (-1, -1), 0.0, True), (False, (40, 7), 0.0, False),
    (True, (-1, -1), 5.0, False)])
def test_s_dmask_holds_flash_attn_probabilities_and_the_keep_mask(causal, window_size, softcap, alibi):
    """flash-attn's tests read S_dmask's sign as the keep mask and scale its blocks back into
    the probabilities: both hold, dense (several key blocks, sq != sk) and packed."""
    g = torch.Generator().manual_seed(4)
    q, k, v = _randn(g, 2, 150, 4, 16, dtype=torch.float16), _randn(g, 2, 300, 2, 16, dtype=torch.float16), \
        _randn(g, 2, 300, 2, 16, dtype=torch.float16)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]) if alibi else None
    options = (0.25, causal, *window_size, softcap, slopes)
    out, lse, s_dmask, rng_state = _flash_attn_forward(q, k, v, 0.3, *options, True)
    assert s_dmask.shape == (2, 4, 256, 384) and s_dmask.dtype == q.dtype
    seed, offset = cuflash.torch.calls._from_rng_state(rng_state)
    assert torch.equal(kept(s_dmask, 150, 300), torch.from_numpy(_philox.keep_mask(seed, offset, 2, 4, 150, 300, 0.3)))
    for b in range(2):
        decoded, want = _decoded_probabilities(s_dmask[b], q[b], k[b], lse[b], 0.25, causal, window_size, softcap,
                                               slopes)
        assert_close(decoded, want, atol=2e-3, name="probabilities")

    cu = torch.tensor([0, 120, 300], dtype=torch.int32), torch.tensor([0, 250, 600], dtype=torch.int32)
    qp, kp, vp = (x.reshape(-1, *x.shape[2:]) for x in (q, k, v))
    out, lse, s_dmask, rng_state = _flash_attn_varlen_forward(qp, kp, vp, *cu, 180, 350, 0.3, 0.25, causal,
                                                              *window_size, softcap, slopes, True)
    assert s_dmask.shape == (2, 4, 256, 384)
    for b in range(2):
        rows, keys = slice(*cu[0][b:b + 2].tolist()), slice(*cu[1][b:b + 2].tolist())
        decoded, want = _decoded_probabilities(s_dmask[b], qp[rows], kp[keys], lse[:, rows], 0.25, causal,
                                               window_size, softcap, slopes)
        assert_close(decoded, want, atol=2e-3, name="probabilities")
