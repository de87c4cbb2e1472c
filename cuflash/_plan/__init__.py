"""Which kernels a call launches: variant, tile shape, grid, shared memory and Params,
from shapes, dtypes, options and the device's facts (``_device.Device``, one value). A
plan is final when it leaves the planner: ``_kernels`` binds it to compiled kernels and
launches it as it is. Nothing here compiles or touches a GPU but through the device's
``resident_ctas``, the one fact of a compiled kernel a plan takes (``tile_group``).

One module a concern: ``variants`` (the catalog: every variant as a value with one
interface, the tiled kinds' tile tables), ``plan`` (steps, tensor maps, plans and the
kernels' Params), and one module a kernel family: ``mma_sync`` (sm_80 and newer, the
fallback), ``sm90`` (Hopper's sm_90a kernels) and ``decoding`` (the KV-cache call). This
module picks the family of each call. A tiled variant's tile is the first entry of its
kind's table, per head-dim bucket, whose shared memory fits the arch; register budgets
behind these choices are checked by ``python -m cuflash compile``.
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from . import decoding, mma_sync, sm90
from .decoding import DECODE_POINTERS, MERGE_POINTERS, decode, decode_splits, merge
from .mma_sync import BACKWARD_POINTERS, FORWARD_POINTERS, PREPROCESS_ROWS, backward_workspace
from .plan import (Plan, Step, TensorMapSpec, dropout_threshold, field_offset, group_size, pointer_offsets, scale_log2,
                   tile_group, vectorizable)
from .sm90 import (SM90_BACKWARD_DENSE_BAND_ROWS, SM90_BACKWARD_DENSE_TILES, SM90_BACKWARD_EXTRAS_TILES,
                   SM90_BACKWARD_HEAD_DIMS, SM90_BACKWARD_SECTION_BYTES, SM90_BACKWARD_TILES, SM90_BANDED_EXTRAS_TILES,
                   SM90_BANDED_TILES, SM90_HEAD_DIMS, SM90_MASK_TENSOR_TILES, SM90_MASK_TILES, SM90_MODS_TILES,
                   SM90_SECTION_BYTES, SM90_SECTION_ROWS, SM90_SHORT_CAUSAL_ROWS, SM90_SHORT_CAUSAL_TILES,
                   SM90_TAIL_MAX_PIECES, SM90_TAIL_MIN_TURNS, SM90_TAIL_PIECE_TURNS, SM90_TILES,
                   SM90_WIDE_BACKWARD_BUCKETS, SM90_WIDE_BACKWARD_HEAD_DIM, Sm90Backward, Sm90Forward,
                   Sm90WideBackward, backward_orders, backward_section, sm90_section, sm90_tail)
from .variants import (DTYPES, ELEMENTWISE, HEAD_DIM_BUCKETS, KINDS, MAX_HEAD_DIM, MERGES, SHARED_MEMORY_LIMIT,
                       Elementwise, Kernel, Kind, Merge, Tile, Variant, copy_run_rows, has_tile, head_dim_bucket,
                       kernel, shared_memory_limit)

if TYPE_CHECKING:
    from .._arrays import ArrayInfo
    from .._device import Device
    from .._options import Options, Varlen


def forward(q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, out: ArrayInfo, options: Options, varlen: Varlen | None,
            device: Device) -> Plan:
    """out = attention(q, k, v) (and its LSE where the launch is given a pointer); on a
    device with the sm_90a kernels through the sm_90a forward where it takes the call, on a
    persistent grid of a CTA per multiprocessor (with ``multiprocessors`` 0, a CTA per tile)."""
    if device.sm90a and sm90.takes(q, k, v, out, options, varlen):
        return sm90.forward(q, k, v, out, options, varlen, device.multiprocessors)
    return mma_sync.forward(q, k, v, out, options, varlen, device)


def backward(dout: ArrayInfo, q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, out: ArrayInfo, dq: ArrayInfo,
             dk: ArrayInfo, dv: ArrayInfo, dq_accum: ArrayInfo | None, options: Options, varlen: Varlen | None,
             device: Device, dq_semaphore: ArrayInfo | None = None) -> Plan:
    """dq, dk, dv: the one-pass kernel (dQ by atomics into ``dq_accum``) where it has a
    tile, else the dQ pass and the dK/dV pass (bitwise reproducible); on a device with the
    sm_90a kernels the sm_90a backward where it takes the call, with ``dq_semaphore``
    (deterministic) adding dQ in a fixed order."""
    ordered = dq_semaphore is not None
    usable = dq_accum is not None and (ordered or has_tile("backward", q.shape[-1], options.extras,
                                                              device.shared_limit))
    if device.sm90a and usable and sm90.backward_takes(dout, q, k, v, dq, dk, dv, options):
        return sm90.backward(dout, q, k, v, out, dq, dk, dv, dq_accum, options, varlen, device.dependent_launches,
                             ordered)
    return mma_sync.backward(dout, q, k, v, out, dq, dk, dv, None if ordered else dq_accum, options, varlen, device)


def all_kernels(arch: str) -> list[Variant]:
    """Every variant cuflash can launch on ``arch``: for sm_90a the sm90 kernels (the
    mma.sync ones run on compute capability 9.0 as sm_90)."""
    if arch == "sm_90a":
        flags = [(False, True)] * 3  # (local, extras and, for the forward, short: the same but for some causal ones)
        forwards = dict.fromkeys(Sm90Forward.of(*v) for v in itertools.product(DTYPES, SM90_HEAD_DIMS, *flags))
        backwards = [Sm90Backward.of(dtype, d, local, extras)
                     for dtype, d, local, extras in itertools.product(DTYPES, SM90_BACKWARD_HEAD_DIMS, *flags[:2])
                     if not extras or d in SM90_BACKWARD_EXTRAS_TILES]
        backwards += [Sm90Backward.of(dtype, d, local, dense=True)
                      for dtype, d, local in itertools.product(DTYPES, SM90_BACKWARD_DENSE_TILES, flags[0])]
        wide = [Sm90WideBackward.of(dtype, SM90_WIDE_BACKWARD_HEAD_DIM, local)
                for dtype, local in itertools.product(DTYPES, flags[0])]
        return [*forwards, *backwards, *wide]
    limit = shared_memory_limit(arch)
    flags = (False, True)
    kinds = [kind for kind in KINDS if not KINDS[kind].clustered or int(arch[3:5]) >= 90]
    tiled = [kernel(kind, dtype, bucket, local, vec, extras, limit)
             for kind, dtype, bucket, local, vec, extras in
             itertools.product(kinds, DTYPES, HEAD_DIM_BUCKETS, flags, flags, flags)
             if has_tile(kind, bucket, extras, limit)]
    return (tiled + [Elementwise(kind, dtype) for kind, dtype in itertools.product(ELEMENTWISE, DTYPES)]
            + [Merge(*pair) for pair in MERGES])


def covering_sample(archs: tuple[str, ...]) -> list[tuple[str, Variant]]:
    """A few (arch, variant) pairs that between them reach every template branch of
    ``all_kernels``: each kind with every head-dim bucket and tile, every combination
    of its flags (band, vectorized, extras), each dtype, each arch with each (band,
    extras) pair, and every elementwise instance. A compile of these catches what a
    compile of everything would, in a tenth of the time (44 of 968 for sm_80 + sm_90)."""
    def reaches(arch: str, k: Variant) -> set:
        if not isinstance(k, Kernel):
            return {(arch, k)}
        return {("tile", k.kind, k.head_dim, k.tile), ("flags", k.kind, k.local, k.vectorized, k.extras),
                ("dtype", k.kind, k.dtype), ("arch", arch, k.kind, k.local, k.extras)}

    variants = [(arch, k) for arch in archs for k in all_kernels(arch)]
    missing = set().union(*(reaches(*v) for v in variants))
    chosen = []
    while missing:  # greedy set cover: the variant that reaches the most still missing
        best = max(variants, key=lambda v: len(reaches(*v) & missing))
        chosen.append(best)
        missing -= reaches(*best)
    return chosen
