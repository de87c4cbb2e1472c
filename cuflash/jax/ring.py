"""Context parallelism in JAX: ring attention over a mesh axis, inside ``jax.shard_map``.

    import cuflash.jax
    ring = jax.shard_map(functools.partial(cuflash.jax.ring_attention, axis_name="sp", causal=True),
                         mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    out = jax.jit(ring)(q, k, v)   # q, k, v sharded along the sequence over the axis "sp"

Each device of the mesh axis holds a shard of one long sequence (``layout`` says which
tokens), as ``cuflash.torch.ring_attention``'s ranks do. The devices form a ring: at every
step a device attends its queries to the K/V block it holds (``cuflash.jax.attention`` with
``return_lse``), merges the result into a running (out, lse) by the LSEs
(``cuflash.jax.merge_states``, in float32), and passes the block on to the next device
with ``jax.lax.ppermute``. The transfer is issued before the step's attention, which does
not depend on it, so XLA may overlap the two. Only the KV heads travel (GQA stays packed).

The backward is a ``jax.custom_vjp``, the standard ring backward: K/V go around once more
and each step runs cuflash's backward for the local queries and the block held with the
final out and LSE (each block's P = exp(S - LSE) is then exact: nothing is merged or
recomputed beyond that backward); dQ accumulates locally, and the block's dK/dV
accumulators (float32) travel behind K/V, back with their owner after one full turn.
Letting JAX differentiate the forward instead would be correct (the ppermutes transpose to
the reverse ring, and each step's attention has its own custom_vjp) but keeps every step's
K/V block and partial out as residuals: the whole sequence's K/V on every device, which is
the memory that context parallelism exists to split.

Causal masking is over global positions. The device's index on the axis is a traced value
(one program runs on every device), so which part of a block is visible is chosen by
``jax.lax.cond``: only the branch a device takes runs there. A (local query chunk, remote
key chunk) pair is fully visible, diagonal (the device's own block: plain causal, as the
chunks have one length) or invisible (skipped). With ``layout="zigzag"`` every step but
the first does the same amount of work on every device.

Importing this module imports jax; it is reached through ``cuflash.jax``.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .. import _options
from .._options import RING_ALL, RingBlock
from . import calls
from .calls import _varying, _vma  # (the callbacks' results typed varying over the mesh axes)

__all__ = ["ring_attention"]


def ring_attention(q, k, v, *, axis_name, causal: bool = False, softmax_scale: float | None = None,
                   layout: str = "zigzag", return_lse: bool = False):
    """Attention over a sequence sharded across the devices of the mesh axis ``axis_name``;
    call it inside ``jax.shard_map`` (or ``jax.experimental.shard_map.shard_map``) on this
    device's shard. Differentiable with respect to q, k and v; works under jax.jit.

    q (batch, seqlen_local, nheads, headdim), k and v (batch, seqlen_local, nheads_kv,
    headdim): this device's shard. ``layout="contiguous"``: device i of the axis holds
    tokens [i * seqlen_local, (i + 1) * seqlen_local). ``layout="zigzag"``: the sequence is
    cut into 2 * n chunks of seqlen_local / 2 tokens (n devices), and device i holds chunk i
    followed by chunk 2 * n - 1 - i (balances causal work; seqlen_local must be even).
    ``causal`` masks by global position; ``softmax_scale`` as in ``cuflash.attention``.
    Returns out like q, or (out, lse) with ``return_lse``: lse float32 (batch, nheads,
    seqlen_local), natural log, differentiable too.
    """
    scale = _check(q, k, v, causal, softmax_scale, layout, return_lse)
    size = _axis_size(axis_name)
    # The mesh axes the results vary over (the ring makes them vary over axis_name at least).
    axes = tuple(sorted(_vma(q, k, v) | {axis_name}, key=str))
    out, lse = _ring(q, k, v, _Ring(axis_name, size, causal, scale, layout, axes))
    return (out, lse) if return_lse else out


def _check(q, k, v, causal, softmax_scale, layout, return_lse) -> float:
    """Every argument checked while tracing; returns the softmax scale."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, jax.Array):
            raise TypeError(f"{name} must be a JAX array, got {type(x).__module__}.{type(x).__qualname__}")
    return _options.check_ring_shard(*(calls._describe(x, q) for x in (q, k, v)), causal, softmax_scale, layout,
                                     return_lse, "device")


def _axis_size(axis_name) -> int:
    """The number of devices on the axis (static inside shard_map)."""
    try:
        return jax.lax.axis_size(axis_name) if hasattr(jax.lax, "axis_size") else jax.lax.psum(1, axis_name)
    except NameError as error:  # JAX's "unbound axis name"
        raise NameError(f"ring_attention must be called inside jax.shard_map over a mesh with an axis named "
                        f"{axis_name!r} ({error})") from None


class _Ring(NamedTuple):
    """The static part of a call (hashable: custom_vjp's non-differentiable argument)."""
    axis_name: object
    size: int
    causal: bool
    scale: float
    layout: str
    axes: tuple  # the mesh axes that q, k or v vary over, and axis_name

    def shift(self, arrays):
        """``arrays`` of every device, moved to the next device on the axis."""
        return jax.lax.ppermute(arrays, self.axis_name, [(i, (i + 1) % self.size) for i in range(self.size)])


def _visit(ring: _Ring, step: int, seqlen: int, compute, state):
    """``state`` after ``step``: ``compute(state, block)`` for the visible part of the block
    held, the one this device's (traced) index selects; unchanged where none is."""
    if not ring.causal:
        return compute(state, RingBlock(RING_ALL, RING_ALL, False))
    if step == 0:  # the device's own block: local order is global order, so plain causal
        return compute(state, RingBlock(RING_ALL, RING_ALL, True))
    # The block held comes from device (index - step) mod size, which precedes this one iff index >= step.
    earlier = jax.lax.axis_index(ring.axis_name) >= step
    if ring.layout == "contiguous":
        return jax.lax.cond(earlier, lambda s: compute(s, RingBlock(RING_ALL, RING_ALL, False)), lambda s: s, state)
    half = seqlen // 2
    # From an earlier device its early chunk precedes both of ours (its late chunk follows
    # both); from a later one, both its chunks precede only our late chunk.
    return jax.lax.cond(earlier, lambda s: compute(s, RingBlock(RING_ALL, slice(0, half), False)),
                        lambda s: compute(s, RingBlock(slice(half, None), RING_ALL, False)), state)


def _accumulator(dtype):
    """float32, or float64 for float64 inputs."""
    return jnp.promote_types(dtype, jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ring(q, k, v, ring: _Ring):
    return _forward(q, k, v, ring)


def _ring_fwd(q, k, v, ring: _Ring):
    out, lse = _forward(q, k, v, ring)
    return (out, lse), (q, k, v, out, lse)


def _ring_bwd(ring: _Ring, residuals, cotangents):
    return _backward(*cotangents, *residuals, ring)


_ring.defvjp(_ring_fwd, _ring_bwd)


def _forward(q, k, v, ring: _Ring):
    """(out like q, lse float32): ``size`` steps of attention and merge, the next block in flight."""

    def attention(q, k, v, causal):
        return tuple(_varying(x, ring.axes) for x in calls.attention(q, k, v, causal=causal, softmax_scale=ring.scale,
                                                                 return_lse=True))

    def attend(kv, state, block: RingBlock):
        out, lse = state
        kb, vb = (x[:, block.keys] for x in kv)
        part, part_lse = attention(q[:, block.queries], kb, vb, block.causal)
        rows = block.queries
        merged, merged_lse = calls.merge_states([out[:, rows], part.astype(out.dtype)], [lse[:, :, rows], part_lse])
        return out.at[:, rows].set(merged), lse.at[:, :, rows].set(merged_lse)

    held, state = (k, v), None
    for step in range(ring.size):
        incoming = ring.shift(held) if step + 1 < ring.size else None
        if step == 0:  # the own block, which every query row sees (causal: its diagonal)
            part, lse = attention(q, k, v, ring.causal)
            state = (part.astype(_accumulator(q.dtype)), lse)
        else:
            state = _visit(ring, step, q.shape[1], functools.partial(attend, held), state)
        held = incoming
    out, lse = state
    return out.astype(q.dtype), lse


def _backward(dout, dlse, q, k, v, out, lse, ring: _Ring):
    """(dq, dk, dv): each step's block gradients from cuflash's backward with the final out
    and LSE; dK/dV accumulate in float32 as they travel behind K/V back to their owner."""
    acc = _accumulator(q.dtype)

    def differentiate(kv, state, block: RingBlock):
        dq, dk, dv = state
        rows, keys = block.queries, block.keys
        kb, vb = (x[:, keys] for x in kv)
        dqb, dkb, dvb = _block_backward(dout[:, rows], dlse[:, :, rows], q[:, rows], kb, vb, out[:, rows],
                                        lse[:, :, rows], block.causal, ring.scale)
        dqb, dkb, dvb = (_varying(x.astype(acc), ring.axes) for x in (dqb, dkb, dvb))
        return dq.at[:, rows].add(dqb), dk.at[:, keys].add(dkb), dv.at[:, keys].add(dvb)

    held = (k, v)
    dq, *grads = (_varying(jnp.zeros(x.shape, acc), ring.axes) for x in (q, k, v))  # grads: the block held's
    for step in range(ring.size):
        incoming = ring.shift(held) if step + 1 < ring.size else None
        dq, *grads = _visit(ring, step, q.shape[1], functools.partial(differentiate, held), (dq, *grads))
        if ring.size > 1:  # after the last step's transfer each accumulator is back with its owner
            grads = ring.shift(tuple(grads))
        held = incoming
    dk, dv = grads
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _block_backward(dout, dlse, q, k, v, out, lse, causal: bool, scale: float):
    """cuflash.jax.attention's backward for one block, fed the final out and LSE."""
    config, extras = calls._prepare(q=q, k=k, v=v, varlen=None, causal=causal, softmax_scale=scale,
                                    deterministic=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                    dropout_p=0.0, seed=None)
    return calls._backward(dout, dlse, q, k, v, out, lse, extras, config)
