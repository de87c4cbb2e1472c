"""Context parallelism on torch.distributed: ring attention over cuflash's attention.

    import cuflash.torch
    out = cuflash.torch.ring_attention(q, k, v, causal=True)   # q, k, v: this rank's shard

Each rank of a process group holds a shard of one long sequence (``layout`` says which
tokens). The ranks form a ring: at every step a rank attends its queries to the K/V block
it holds, with ``return_lse``, merges the result into a running (out, lse) in fp32 by the
LSEs (``cuflash.torch.merge_states``), and passes the block on to the next rank. The
transfer of the next block (``torch.distributed.batch_isend_irecv``) is posted before the
step's attention and waited for after it, so communication overlaps computation. Only the
KV heads travel (GQA stays packed).

The backward is the standard one for ring attention: each step calls cuflash's backward
op (``cuflash::attention_backward``) for the local queries and the block held, with the
final out and the final LSE, which make each block's P = exp(S - LSE) exact, so nothing
is merged or recomputed beyond what that backward does. dQ accumulates locally; the
block's dK/dV accumulators (fp32) travel around the ring behind K/V and are back with
their owner after one full turn.

Causal masking is over global positions. A (local query chunk, remote key chunk) pair is
fully visible, diagonal (the rank's own block: with equal-length chunks, cuflash's
bottom-right causal mask is the plain causal one) or invisible (skipped). With
``layout="zigzag"`` every step but the first does the same amount of work on every rank.

Importing this module imports torch; it is reached through ``cuflash.torch``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import _options
from .._options import RING_ALL, RingBlock
from . import calls

__all__ = ["ring_attention"]


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, causal: bool = False,
                   softmax_scale: Optional[float] = None, layout: str = "zigzag", return_lse: bool = False):
    """Attention over a sequence sharded across the ranks of ``group`` (default: the
    world), differentiable with respect to q, k and v.

    q (batch, seqlen_local, nheads, headdim), k and v (batch, seqlen_local, nheads_kv,
    headdim): this rank's shard, every rank's of one shape. ``layout="contiguous"``: rank r
    holds tokens [r * seqlen_local, (r + 1) * seqlen_local). ``layout="zigzag"``: the
    sequence is cut into 2 * world chunks of seqlen_local / 2 tokens, and rank r holds
    chunk r followed by chunk 2 * world - 1 - r (balances causal work; seqlen_local must
    be even). ``causal`` masks by global position; ``softmax_scale`` as in
    ``cuflash.attention``. Returns out like q, or (out, lse) with ``return_lse``: lse
    float32 (batch, nheads, seqlen_local), natural log, differentiable too.

    Every rank must call it with the same shapes, options and layout: those are checked
    on each rank, not across ranks (that would cost a collective); a mismatch fails in
    the transfers or hangs.
    """
    scale = _check(q, k, v, causal, softmax_scale, layout, return_lse)
    ring = _Ring(group)
    out, lse = _RingAttention.apply(q, k, v, ring, causal, scale, layout)
    return (out, lse) if return_lse else out


def _check(q, k, v, causal, softmax_scale, layout, return_lse) -> float:
    """Every argument checked before any transfer (a rank that raises after posting one
    would leave its neighbours waiting); returns the softmax scale."""
    tensors = dict(q=q, k=k, v=v)
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__module__}.{type(t).__qualname__}")
    return _options.check_ring_shard(*(calls._describe(t) for t in tensors.values()), causal, softmax_scale, layout,
                                     return_lse, "rank")


class _Ring:
    """This rank's place in the group and the global ranks of its two neighbours."""

    def __init__(self, group):
        if not dist.is_available():
            raise RuntimeError("ring_attention needs torch.distributed, which this build of torch does not have")
        if not dist.is_initialized():
            raise RuntimeError("ring_attention needs an initialised process group: call "
                               "torch.distributed.init_process_group first")
        self.group = group
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError("ring_attention: this process is not a member of group")
        self.size = dist.get_world_size(group)
        neighbours = [(self.rank + 1) % self.size, (self.rank - 1) % self.size]
        # P2POp takes global ranks whatever the group (group_peer is newer than torch 2.4).
        self.next, self.prev = neighbours if group is None else [dist.get_global_rank(group, r) for r in neighbours]

    def source(self, step: int) -> int:
        """The rank whose block this rank holds at ``step``."""
        return (self.rank - step) % self.size

    def shift(self, tensors: tuple, into: tuple) -> list:
        """Post the sends of ``tensors`` to the next rank and the receives into ``into``
        from the previous one; returns the requests to wait for."""
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in into]
        return dist.batch_isend_irecv(ops)


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


def _block(rank: int, source: int, seqlen: int, layout: str, causal: bool) -> Optional[RingBlock]:
    """The visible part of ``source``'s block to ``rank``'s queries; None where none is."""
    if not causal:
        return RingBlock(RING_ALL, RING_ALL, False)
    if source == rank:  # local order is global order within a rank: the diagonal is plain causal
        return RingBlock(RING_ALL, RING_ALL, True)
    if layout == "contiguous":
        return RingBlock(RING_ALL, RING_ALL, False) if source < rank else None
    half = seqlen // 2
    if source < rank:  # its early chunk precedes both of ours, its late chunk follows both
        return RingBlock(RING_ALL, slice(0, half), False)
    return RingBlock(slice(half, None), RING_ALL, False)  # only our late chunk follows its two


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, causal, scale, layout):
        ctx.set_materialize_grads(False)  # an unused lse gets no zero gradient made for it
        k, v = k.contiguous(), v.contiguous()  # they are sent whole
        out, lse = _forward(q, k, v, ring, causal, scale, layout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.causal, ctx.scale, ctx.layout = ring, causal, scale, layout
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None and dlse is None:
            return (None,) * 7
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        dlse = None if dlse is None else dlse.contiguous()
        return (*_backward(dout, dlse, q, k, v, out, lse, ctx.ring, ctx.causal, ctx.scale, ctx.layout),
                None, None, None, None)


def _forward(q, k, v, ring: _Ring, causal: bool, scale: float, layout: str):
    """(out like q, lse float32): W steps of attention and merge, the next block in flight."""
    held, spare, requests = (k, v), None, []
    out = lse = None
    for step in range(ring.size):
        if step + 1 < ring.size:
            incoming = spare or tuple(map(torch.empty_like, held))
            requests = ring.shift(held, incoming)
        block = _block(ring.rank, ring.source(step), q.shape[1], layout, causal)
        if block is not None:
            kb, vb = (t[:, block.keys] for t in held)
            part, part_lse = calls.attention(q[:, block.queries], kb, vb, causal=block.causal, softmax_scale=scale,
                                             return_lse=True)
            if out is None:  # step 0: the rank's own block, which every query row sees
                out, lse = part.float(), part_lse
            else:
                rows = block.queries
                out[:, rows], lse[:, :, rows] = calls.merge_states([out[:, rows], part.float()],
                                                                   [lse[:, :, rows], part_lse])
        if step + 1 < ring.size:
            _wait(requests)
            spare = held if step else None  # the caller's k and v are never received into
            held = incoming
    return out.to(q.dtype), lse


def _backward(dout, dlse, q, k, v, out, lse, ring: _Ring, causal: bool, scale: float, layout: str):
    """(dq, dk, dv): each step's block gradients from cuflash's backward op with the final
    out and LSE; dK/dV accumulate in fp32 as they travel behind K/V back to their owner."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    rows_of = _QueryRows(dout, q, out, lse, dlse)
    held, spare, requests = (k, v), None, []
    grads, received, spare_grads, grad_requests = None, None, None, []
    for step in range(ring.size):
        last = step + 1 == ring.size
        if not last:
            incoming = spare or tuple(map(torch.empty_like, held))
            requests = ring.shift(held, incoming)
        block = _block(ring.rank, ring.source(step), q.shape[1], layout, causal)
        if block is not None:
            do, qb, ob, lb, dlb = rows_of(block.queries)
            kb, vb = (t[:, block.keys] for t in held)
            dqb, dkb, dvb = calls.attention_backward(do, qb, kb, vb, ob, lb, block.causal, scale, False, dlse=dlb)
            dq[:, block.queries] += dqb
        if step == 0:  # the rank's own block, which its own queries always see
            grads = (dkb.float(), dvb.float())
        else:
            _wait(grad_requests)
            grads = received
            if block is not None:
                grads[0][:, block.keys] += dkb
                grads[1][:, block.keys] += dvb
        if not last:
            _wait(requests)
            spare = held if step else None
            held = incoming
        if ring.size > 1:  # after the last step's send, each accumulator reaches its owner
            received = spare_grads or tuple(map(torch.empty_like, grads))
            grad_requests = ring.shift(grads, received)
            spare_grads = grads
    if ring.size > 1:
        _wait(grad_requests)
        grads = received
    return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype)


class _QueryRows:
    """dout, q, out, lse and dlse restricted to a slice of the local query rows, the LSEs
    contiguous as the backward op requires; made once per slice."""

    def __init__(self, dout, q, out, lse, dlse):
        self.tensors = (dout, q, out, lse, dlse)
        self.made = {}

    def __call__(self, rows: slice) -> tuple:
        key = (rows.start, rows.stop)
        if key not in self.made:
            dout, q, out, lse, dlse = self.tensors
            self.made[key] = (dout[:, rows], q[:, rows], out[:, rows], lse[:, :, rows].contiguous(),
                              None if dlse is None else dlse[:, :, rows].contiguous())
        return self.made[key]
