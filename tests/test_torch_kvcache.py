"""The KV-cache call and merge_states through cuflash.torch and flash-attn's
flash_attn_with_kvcache, on CPU tensors: the same results as the NumPy call, the caches
written in place through the custom op (opcheck, torch.compile), and flash-attn's own
test grid, scaled down, against the float64 oracle."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")

import cuflash  # noqa: E402
import cuflash.torch  # noqa: E402
from cuflash.flash_attn_interface import flash_attn_with_kvcache  # noqa: E402
from cuflash.reference_kvcache import attention_kvcache_reference  # noqa: E402

from .strategies import assert_close, kvcache_calls  # noqa: E402
from .test_kvcache import make_call  # noqa: E402


def _tensors(kw: dict) -> dict:
    return {name: torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x
            for name, x in kw.items()}


@settings(deadline=None, max_examples=60)
@given(call=st.one_of(kvcache_calls(), kvcache_calls(paged=True)))
def test_the_torch_call_is_the_numpy_call(call):
    rng = np.random.default_rng(call["seed"])
    q, k_cache, v_cache, k, v, kw = make_call(call, np.float32, rng)
    tq, tk_cache, tv_cache, tk, tv = (None if x is None else torch.from_numpy(x.copy())
                                      for x in (q, k_cache, v_cache, k, v))
    want_out, want_lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, k, v, return_lse=True, **kw)
    out, lse = cuflash.torch.attention_with_kvcache(tq, tk_cache, tv_cache, tk, tv, return_lse=True, **_tensors(kw))
    assert (out.numpy() == want_out).all() and (lse.numpy() == want_lse).all()
    assert (tk_cache.numpy() == k_cache).all() and (tv_cache.numpy() == v_cache).all()  # written in place


def test_the_op_passes_opcheck():
    q, k, v = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 2, 16), torch.randn(2, 3, 2, 16)
    k_cache, v_cache = torch.randn(2, 20, 2, 16), torch.randn(2, 20, 2, 16)
    angle = torch.rand(24, 4) * 6
    args = (q, k_cache, v_cache, k, v, torch.tensor([5, 0], dtype=torch.int32), None, None, None, angle.cos(),
            angle.sin(), True, True, None, -1, -1, 0.0, None, 0, False)
    torch.library.opcheck(torch.ops.cuflash.attention_with_kvcache.default, args)


def test_a_compiled_decode_step_appends_and_attends():
    k_cache, v_cache = torch.zeros(1, 16, 2, 8), torch.zeros(1, 16, 2, 8)
    step = torch.compile(lambda q, k, v, n: cuflash.torch.attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=n, causal=True), fullgraph=True)
    q, k, v = (torch.randn(6, 1, 1, h, 8) for h in (4, 2, 2))
    for t in range(6):
        out = step(q[t], k[t], v[t], torch.tensor([t], dtype=torch.int32))
        want = cuflash.torch.attention(q[t], k_cache[:, :t + 1], v_cache[:, :t + 1], causal=True)
        torch.testing.assert_close(out, want)
    assert (k_cache[0, :6] == k[:, 0, 0]).all() and (k_cache[0, 6:] == 0).all()


def test_merge_states_of_tensors():
    outs, lses = torch.randn(3, 2, 5, 4, 8), torch.randn(3, 2, 4, 5)
    lses[0, 0, 0, 0] = math.inf
    lses[:, 1, 2, 3] = math.inf  # a row no part saw
    want_out, want_lse = cuflash.merge_states(outs.numpy(), lses.numpy())
    for parts in ((outs, lses), (list(outs), list(lses))):
        out, lse = cuflash.torch.merge_states(*parts)
        assert_close(out.numpy(), want_out, atol=1e-6)
        assert (lse.isinf().numpy() == np.isinf(want_lse)).all() and (out[1, 3, 2] == 0).all()


def test_merged_halves_train_like_the_whole():
    """Attention over two halves of the keys, merged by the LSE: the output and the
    gradients of attention over all keys (ring attention's step)."""
    q, k, v = (torch.randn(2, 6, 4, 16, requires_grad=True) for _ in range(3))
    dout = torch.randn(2, 6, 4, 16)
    whole = cuflash.torch.attention(q, k, v)
    halves = [cuflash.torch.attention(q, k[:, s], v[:, s], return_lse=True) for s in (slice(0, 2), slice(2, 6))]
    merged, _ = cuflash.torch.merge_states([h[0] for h in halves], [h[1] for h in halves])
    torch.testing.assert_close(merged, whole, atol=1e-5, rtol=0)
    for got, want in zip(torch.autograd.grad(merged, (q, k, v), dout), torch.autograd.grad(whole, (q, k, v), dout)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_flash_attn_conventions():
    q, k, v = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    k_cache, v_cache = torch.randn(2, 10, 2, 16), torch.randn(2, 10, 2, 16)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=4, return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == (2, 4, 1) and lse.dtype == torch.float32
    assert (k_cache[:, 4] == k[:, 0]).all()
    assert isinstance(flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5), torch.Tensor)
    # cache_seqlens=None: every cache is full.
    full = flash_attn_with_kvcache(q, k_cache, v_cache)
    torch.testing.assert_close(full, cuflash.torch.attention(q, k_cache, v_cache))


# flash-attn's test_flash_attn_kvcache grid, scaled to the CPU: its seqlen pairs, head
# dims, MHA/MQA/GQA, new keys or not (seqlen_new = seqlen_q or fewer), rotary fractions and
# layouts, causal and local, ALiBi, left padding, batch_idx, paged (page 256) or not.
CASES = ["plain", "new_kv", "rotary_half", "rotary_full_interleaved", "local_alibi", "leftpad", "batch_idx", "paged",
         "new_kv_shorter_causal"]


def flash_attn_case(seqlen_q, seqlen_k, d, mha_type, case, dtype=torch.float32, device="cpu", batch=2, nheads=6):
    """(q, k_cache, v_cache, k, v, keywords) of one case of flash-attn's
    test_flash_attn_kvcache: q, the caches, k and v of ``dtype`` on ``device``, the integer
    arrays, rotary tables and ALiBi slopes (float32) on ``device`` too."""
    rng = np.random.default_rng(hash((seqlen_q, seqlen_k, d, mha_type, case)) % 2**32)
    nheads_k = {"mha": 6, "mqa": 1, "gqa": 3}[mha_type]
    new_kv = case in ("new_kv", "rotary_half", "rotary_full_interleaved", "paged", "new_kv_shorter_causal")
    seqlen_new = (max(1, seqlen_q // 2) if case == "new_kv_shorter_causal" else seqlen_q) if new_kv else 0
    causal = case in ("new_kv_shorter_causal", "rotary_half", "paged")
    window = (int(rng.integers(0, seqlen_k)), int(rng.integers(0, seqlen_k))) if case == "local_alibi" else (-1, -1)
    rotary_dim = {"rotary_half": math.floor(d * 0.5 / 16) * 16, "rotary_full_interleaved": d // 16 * 16}.get(case, 0)
    q = torch.from_numpy(rng.standard_normal((batch, seqlen_q, nheads, d)).astype(np.float32))
    k = v = None
    if new_kv:
        k, v = (torch.from_numpy(rng.standard_normal((batch, seqlen_new, nheads_k, d)).astype(np.float32))
                for _ in "kv")
    rows = seqlen_q if (causal or window != (-1, -1)) and rotary_dim else seqlen_new
    lengths = rng.integers(0 if new_kv else 1, seqlen_k - rows + 1, batch).astype(np.int32)
    kw = dict(cache_seqlens=torch.from_numpy(lengths), causal=causal, window_size=window)
    caches = batch + 2 if case == "batch_idx" else batch
    if case == "paged":
        page = 256
        per_seq = -(-seqlen_k // page)
        pages = per_seq * batch * 3
        kw["block_table"] = torch.from_numpy(rng.permutation(pages)[:batch * per_seq].reshape(batch, per_seq)
                                             .astype(np.int32))
        k_cache, v_cache = (torch.from_numpy(rng.standard_normal((pages, page, nheads_k, d)).astype(np.float32))
                            for _ in "kv")
    else:
        k_cache, v_cache = (torch.from_numpy(rng.standard_normal((caches, seqlen_k, nheads_k, d)).astype(np.float32))
                            for _ in "kv")
    if case == "batch_idx":
        kw["cache_batch_idx"] = torch.from_numpy(rng.permutation(caches)[:batch].astype(np.int32))
    if case == "leftpad":
        kw["cache_leftpad"] = torch.from_numpy(np.array([rng.integers(0, n) if n else 0 for n in lengths], np.int32))
    if case == "local_alibi":
        kw["alibi_slopes"] = torch.from_numpy((rng.random((batch, nheads)) * 0.3).astype(np.float32))
    if rotary_dim:
        angle = rng.random((seqlen_k if "block_table" not in kw else pages * 256, rotary_dim // 2)) * 2 * math.pi
        kw.update(rotary_cos=torch.from_numpy(np.cos(angle).astype(np.float32)),
                  rotary_sin=torch.from_numpy(np.sin(angle).astype(np.float32)),
                  rotary_interleaved=case == "rotary_full_interleaved")
    kw = {name: x.to(device) if isinstance(x, torch.Tensor) else x for name, x in kw.items()}
    return (*(None if x is None else x.to(device, dtype) for x in (q, k_cache, v_cache, k, v)), kw)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 128), (1, 339), (3, 1024), (64, 256), (3, 799)])
@pytest.mark.parametrize("d", [32, 59, 64])
@pytest.mark.parametrize("mha_type", ["mha", "mqa", "gqa"])
@pytest.mark.parametrize("case", CASES)
def test_flash_attn_kvcache_grid(seqlen_q, seqlen_k, d, mha_type, case):
    q, k_cache, v_cache, k, v, kw = flash_attn_case(seqlen_q, seqlen_k, d, mha_type, case)
    numpy_kw = {name: x.numpy() if isinstance(x, torch.Tensor) else x for name, x in kw.items()}
    want_out, _, want_k, want_v = attention_kvcache_reference(
        q.numpy(), k_cache.numpy(), v_cache.numpy(), None if k is None else k.numpy(),
        None if v is None else v.numpy(), **numpy_kw)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, num_splits=0, **kw)
    assert_close(out.numpy(), want_out, atol=2e-5 * (1 + np.abs(want_out).max()))
    assert np.allclose(k_cache.numpy(), want_k, atol=1e-5) and (v_cache.numpy() == want_v).all()


# flash-attn's test_flash_attn_varlen_causal with paged_kv_block_size (its paged varlen
# test): batch 8, nheads 9, every sequence up to 20 rows shorter than the longest (its
# "random" padding), causal, local with a window drawn by torch.randint, pages of 256 or
# 512 rows, three times the pages needed handed out in random order.
def flash_attn_paged_varlen_case(seqlen_q, seqlen_k, swap, d, local, block, dtype=torch.float32, device="cpu",
                                 batch=8, nheads=9):
    """(q, k_pages, v_pages, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, window_size, k_dense, v_dense, lengths_q, lengths_k): q packed, the
    pages and table on ``device``, the window as flash-attn's test makes it (a tensor of
    two), the contiguous caches the pages hold (batch, seqlen_k, nheads, d) and the
    lengths (CPU, float32) for the oracle."""
    if swap:
        seqlen_q, seqlen_k = seqlen_k, seqlen_q
    g = torch.Generator().manual_seed(hash((seqlen_q, seqlen_k, d, local, block)) % 2**31)
    window = torch.randint(0, seqlen_k, (2,), generator=g) if local else (-1, -1)
    q = torch.randn(batch, seqlen_q, nheads, d, generator=g)
    blocks = -(-seqlen_k // block) * batch * 3
    k_pages, v_pages = (torch.randn(blocks, block, nheads, d, generator=g) for _ in "kv")
    table = torch.randperm(blocks, generator=g).reshape(batch, -1).to(torch.int32)
    k_dense, v_dense = (x[table.long().flatten()].reshape(batch, -1, nheads, d)[:, :seqlen_k] for x in (k_pages, v_pages))
    lengths_q, lengths_k = (torch.randint(max(1, n - 20), n + 1, (batch,), generator=g) for n in (seqlen_q, seqlen_k))
    cu_q, cu_k = (torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)]).to(torch.int32)
                  for n in (lengths_q, lengths_k))
    packed = torch.cat([q[b, :lengths_q[b]] for b in range(batch)])
    on = {name: x.to(device) for name, x in dict(q=packed, k=k_pages, v=v_pages, table=table, cu_q=cu_q,
                                                 cu_k=cu_k).items()}
    return (on["q"].to(dtype), on["k"].to(dtype), on["v"].to(dtype), on["table"], on["cu_q"], on["cu_k"], seqlen_q,
            seqlen_k, window, k_dense, v_dense, lengths_q, lengths_k)


def check_flash_attn_paged_varlen(case, out, atol_scale, xp=np):
    """out (total_q, nheads, d) of flash_attn_varlen_func on a flash_attn_paged_varlen_case
    against the float64 oracle, sequence by sequence (on ``xp``'s arrays: NumPy or CuPy)."""
    from cuflash.reference import attention_reference
    q, *_, cu_q, _, _, _, window, k_dense, v_dense, lengths_q, lengths_k = case
    q = q.float().cpu().numpy()
    window = tuple(int(w) for w in window)
    got = out.float().cpu().numpy().astype(np.float64)
    for b, (n_q, n_k) in enumerate(zip(lengths_q.tolist(), lengths_k.tolist())):
        rows = slice(int(cu_q[b]), int(cu_q[b]) + n_q)
        want, _ = attention_reference(*(xp.asarray(x) for x in (q[None, rows], k_dense[b:b + 1, :n_k].numpy(),
                                                                 v_dense[b:b + 1, :n_k].numpy())),
                                      causal=True, window_size=window)
        want = want.get() if hasattr(want, "get") else want
        assert_close(got[rows], want[0], atol=atol_scale * (1 + np.abs(want).max(initial=0)), name=f"sequence {b}")


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 239), (3, 799), (113, 203)])
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("d", [32, 59])
@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize("block", [256, 512])
def test_flash_attn_paged_varlen_grid(seqlen_q, seqlen_k, swap, d, local, block):
    from cuflash.flash_attn_interface import flash_attn_varlen_func
    case = flash_attn_paged_varlen_case(seqlen_q, seqlen_k, swap, d, local, block)
    q, k_pages, v_pages, table, cu_q, cu_k, max_q, max_k, window = case[:9]
    out = flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max_q, max_k, 0.0, causal=True,
                                 window_size=window, block_table=table)
    check_flash_attn_paged_varlen(case, out, 2e-5)


def test_flash_attn_interface_raises_what_flash_attn_raises():
    """flash-attn's C++ checks raise RuntimeError naming the argument: a sequence outgrowing
    its pages names block_table (flash-attn #2709), a wrong dtype names the array."""
    q = torch.ones(2, 1, 2, 8)
    pages = torch.ones(4, 4, 1, 8)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block_table"):
        flash_attn_with_kvcache(q, pages, pages, cache_seqlens=torch.tensor([3, 9], dtype=torch.int32),
                                block_table=table)
    with pytest.raises(RuntimeError, match="cache_seqlens must be int32"):
        flash_attn_with_kvcache(q, pages, pages, cache_seqlens=torch.tensor([3, 4]), block_table=table)
    from cuflash.flash_attn_interface import flash_attn_varlen_func
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block_table"):
        flash_attn_varlen_func(q[:, 0], pages, pages, cu, torch.tensor([0, 1, 10], dtype=torch.int32), 1, 9,
                               block_table=table)
