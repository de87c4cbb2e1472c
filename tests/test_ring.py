"""cuflash.torch.ring_attention: context parallelism over torch.distributed.

Two and three CPU processes (torch.multiprocessing.spawn) on the gloo backend run the
NumPy path. Every rank draws the whole sequence from one seed, runs the ring on its shard
(contiguous or zigzag, causal or not, GQA, float32 and float16) and checks its shard of
out, lse and the gradients of q, k and v (through out and lse) against the float64 oracle
over the whole sequence, by flash-attn's rule: out within 2x, gradients within 3x the error
of plain attention in the input dtype, plus that dtype's rounding floor. The LSE is held to
twice the error of one cuflash call over the whole sequence, plus float32's floor.
"""
import datetime
import re
import socket

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")
dist = pytest.importorskip("torch.distributed", reason="this torch has no torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed's gloo backend is not available in this torch build", allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402

import cuflash  # noqa: E402
import cuflash.torch  # noqa: E402
from cuflash.reference import (attention_lowp, attention_lowp_backward, attention_reference,  # noqa: E402
                               attention_reference_backward)

from .strategies import assert_close, rounding_floor  # noqa: E402

# (layout, causal, dtype, return_lse): every layout with and without the mask, both CPU
# dtypes; one call whose loss reads out alone.
CASES = [(layout, causal, dtype, True) for layout in ("contiguous", "zigzag") for causal in (False, True)
         for dtype in ("float32", "float16")] + [("zigzag", True, "float32", False)]

# (batch, seqlen_local, nheads, nheads_kv, headdim) per world size: odd chunk lengths (13, 9).
SHAPES = {2: (1, 26, 4, 2, 32), 3: (2, 18, 4, 2, 16)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shard(x: np.ndarray, rank: int, world: int, layout: str, axis: int) -> np.ndarray:
    """This rank's tokens of x along ``axis``, as ``layout`` deals them out."""
    if layout == "contiguous":
        return np.split(x, world, axis=axis)[rank]
    chunks = np.split(x, 2 * world, axis=axis)
    return np.concatenate([chunks[rank], chunks[2 * world - 1 - rank]], axis=axis)


def _check_case(rank, ranks_in_ring, group, shape, layout, causal, dtype, return_lse, seed):
    """One ring call on this rank's shard against the float64 oracle over the whole sequence."""
    batch, seqlen_local, nheads, nheads_kv, headdim = shape
    seqlen = seqlen_local * ranks_in_ring
    rng = np.random.default_rng(seed)  # the same draw on every rank: the whole sequence
    np_dtype = np.dtype(dtype).type
    q = rng.standard_normal((batch, seqlen, nheads, headdim)).astype(np_dtype)
    k, v = (rng.standard_normal((batch, seqlen, nheads_kv, headdim)).astype(np_dtype) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(np_dtype)
    dlse = rng.standard_normal((batch, nheads, seqlen)).astype(np.float32) if return_lse else None

    def mine(x, axis=1):
        return np.ascontiguousarray(_shard(x, rank, ranks_in_ring, layout, axis))

    tq, tk, tv = (torch.from_numpy(mine(x)).requires_grad_() for x in (q, k, v))
    result = cuflash.torch.ring_attention(tq, tk, tv, group=group, causal=causal, layout=layout,
                                          return_lse=return_lse)
    out, lse = result if return_lse else (result, None)
    assert out.dtype == tq.dtype and out.shape == tq.shape
    outputs, grads_in = [out], [torch.from_numpy(mine(dout))]
    if return_lse:
        assert lse.dtype == torch.float32 and lse.shape == (batch, nheads, seqlen_local)
        outputs.append(lse)
        grads_in.append(torch.from_numpy(mine(dlse, axis=2)))
    torch.autograd.backward(outputs, grads_in)

    where = f"rank {rank}/{ranks_in_ring} {layout} causal={causal} {dtype}"
    out_ref, lse_ref = attention_reference(q, k, v, causal=causal)
    out_low = attention_lowp(q, k, v, causal=causal)
    allowed = 2 * np.abs(out_low - out_ref).max() + rounding_floor(out_ref, np_dtype)
    assert_close(out.detach().numpy(), mine(out_ref), atol=allowed, name=f"out ({where})")
    if return_lse:
        _, lse_one = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        allowed = 2 * np.abs(lse_one - lse_ref).max() + rounding_floor(lse_ref, np.float32)
        assert_close(lse.detach().numpy(), mine(lse_ref, axis=2), atol=allowed, name=f"lse ({where})")

    want = attention_reference_backward(dout, q, k, v, causal=causal, dlse=dlse)
    lowp = attention_lowp_backward(dout, q, k, v, causal=causal, dlse=dlse)
    # D = rowsum(dO O) comes from the out stored in the input dtype, as FlashAttention takes it.
    stored = attention_reference_backward(dout, q, k, v, causal=causal, dlse=dlse, out=out_ref.astype(np_dtype))
    for name, t, exact, yardstick, inherited in zip(("dq", "dk", "dv"), (tq, tk, tv), want, lowp, stored):
        assert t.grad.dtype == t.dtype and t.grad.shape == t.shape
        allowed = (3 * np.abs(yardstick - exact).max() + rounding_floor(exact, np_dtype)
                   + np.abs(inherited - exact).max())
        assert_close(t.grad.numpy(), mine(exact), atol=allowed, name=f"{name} ({where})")


def _ranks(rank: int, world: int, port: int) -> None:
    """One process of the ring: every case, then (three ranks) a ring over a subgroup."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        for seed, (layout, causal, dtype, return_lse) in enumerate(CASES):
            _check_case(rank, world, None, SHAPES[world], layout, causal, dtype, return_lse, seed)
        if world == 3:
            # Global ranks 0 and 2 as a ring of two: the neighbours are global ranks, not group ranks.
            members = [0, 2]
            group = dist.new_group(members)
            if rank in members:
                _check_case(members.index(rank), 2, group, SHAPES[world], "zigzag", True, "float32", True, 99)
            else:
                t = torch.zeros(1, 4, 2, 16)
                with pytest.raises(ValueError, match="not a member of group"):
                    cuflash.torch.ring_attention(t, t, t, group=group)
            dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_ring_matches_the_whole_sequence(world, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the ranks share the cores: one BLAS thread each
    mp.spawn(_ranks, args=(world, _free_port()), nprocs=world, join=True)


def test_one_rank_is_plain_attention(monkeypatch):
    """A world of one: no transfer, the call is cuflash.torch.attention with the same result."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    mp.spawn(_one_rank, args=(_free_port(),), nprocs=1, join=True)


def _one_rank(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 10, 4, 16, generator=g).requires_grad_() for _ in range(3))
        out, lse = cuflash.torch.ring_attention(q, k, v, causal=True, return_lse=True)
        grads = torch.autograd.grad((out.sum() + lse.sum()), (q, k, v))
        want, want_lse = cuflash.torch.attention(q, k, v, causal=True, return_lse=True)
        want_grads = torch.autograd.grad((want.sum() + want_lse.sum()), (q, k, v))
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
        for got, expected in zip(grads, want_grads):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


# --- input errors: raised before any transfer, so no process group is needed ---------------------


def _qkv(seqlen=8, dtype=torch.float32):
    return torch.zeros(1, seqlen, 4, 16, dtype=dtype), torch.zeros(1, seqlen, 2, 16, dtype=dtype), \
        torch.zeros(1, seqlen, 2, 16, dtype=dtype)


@pytest.mark.parametrize("call,error,message", [
    (lambda: cuflash.torch.ring_attention(*_qkv(), layout="striped"), ValueError,
     "layout must be one of 'contiguous', 'zigzag', got 'striped'"),
    (lambda: cuflash.torch.ring_attention(*_qkv(7)), ValueError,
     "seqlen_local must be even with layout='zigzag'"),
    (lambda: cuflash.torch.ring_attention(*_qkv(0), layout="contiguous"), ValueError,
     "seqlen_local must be positive"),
    (lambda: cuflash.torch.ring_attention(_qkv()[0], *_qkv(6)[1:]), ValueError,
     "k and v must hold as many tokens as q"),
    (lambda: cuflash.torch.ring_attention(_qkv()[0].numpy(), *_qkv()[1:]), TypeError,
     "q must be a torch.Tensor"),
    (lambda: cuflash.torch.ring_attention(_qkv()[0][:, :, :3], *_qkv()[1:]), ValueError,
     "q's nheads must be a multiple of k/v's nheads"),
    (lambda: cuflash.torch.ring_attention(*_qkv(dtype=torch.bfloat16)), TypeError,
     "dtype must be one of float16, float32, float64 on cpu"),
    (lambda: cuflash.torch.ring_attention(*_qkv(), causal=1), TypeError, "causal must be a bool"),
    (lambda: cuflash.torch.ring_attention(*_qkv(), softmax_scale=-1.0), ValueError, "softmax_scale must be"),
    (lambda: cuflash.torch.ring_attention(*_qkv(), return_lse="yes"), TypeError, "return_lse must be a bool"),
    (lambda: cuflash.torch.ring_attention(*_qkv()), RuntimeError, "torch.distributed.init_process_group"),
], ids=["layout", "zigzag-odd", "empty", "seqlen-mismatch", "not-a-tensor", "gqa", "bfloat16-cpu", "causal",
        "scale", "return-lse", "no-process-group"])
def test_input_errors(call, error, message):
    assert not dist.is_initialized()
    with pytest.raises(error, match=re.escape(message)):
        call()
