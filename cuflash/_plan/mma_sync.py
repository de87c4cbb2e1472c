"""The mma.sync family's plans (cuda/fwd.cu, cuda/bwd*.cu; sm_80 and newer, the fallback
on Hopper): the forward, the backward (one pass with dQ by atomics, or the deterministic
dQ and dK/dV passes) and the backward's scratch buffers."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

from .plan import Plan, Step, call_params, tile_group, vectorizable, with_mods
from .variants import KINDS, Elementwise, Kernel, has_tile, head_dim_bucket, kernel

if TYPE_CHECKING:
    from .._arrays import ArrayInfo
    from .._device import Device
    from .._options import Options, Varlen

FORWARD_POINTERS = ("q", "k", "v", "o", "lse")
BACKWARD_POINTERS = ("dout", "q", "k", "v", "o", "lse", "dlse", "dq", "dk", "dv", "delta", "dq_accum", "dq_semaphore")
PREPROCESS_ROWS = 4  # (row, head) tasks per thread of the backward's preprocess (bwd.cu, kPreprocessRows)


def forward(q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, out: ArrayInfo, options: Options, varlen: Varlen | None,
            device: Device) -> Plan:
    """out = attention(q, k, v) (and its LSE where the launch is given a pointer)."""
    p, batch = call_params(q, k, v, options, varlen, o=out)
    tiled = _kernel("forward", q, options, vectorizable(q, k, v, out), device.shared_limit)
    steps = ()
    if batch and p.seqlen_q and p.nheads:
        steps = (Step(tiled, tiled.grid(p.seqlen_q, p.nheads, batch)),)
        p.tile_group = tile_group(tiled, batch * p.nheads, device)
    p, struct = with_mods(p, options)
    return Plan(bytes(p), FORWARD_POINTERS, steps, struct)


class BackwardRows(NamedTuple):
    """The (row, head) tasks of the backward's elementwise kernels (bwd.cu): their int
    arguments after the Params and their grids."""
    args: tuple[int, int, int, int]
    preprocess_grid: tuple[int, int, int]
    convert_grid: tuple[int, int, int]
    tasks: int


def backward_rows(p, batch: int, q: ArrayInfo, varlen: Varlen | None, accum_cols: int) -> BackwardRows:
    rows_per_batch = p.seqlen_q if varlen is None else q.shape[0]
    groups = batch if varlen is None else 1
    tasks = groups * rows_per_batch * p.nheads
    # Lanes per (row, head) of the elementwise kernels: one per 16 bytes of the row, 4-32.
    lanes = min(32, max(4, 1 << (-(-p.headdim // 8) - 1).bit_length()))
    preprocess_grid = (-(-(-(-tasks // PREPROCESS_ROWS)) * lanes // 256), 1, 1)
    return BackwardRows((groups, rows_per_batch, accum_cols, lanes), preprocess_grid,
                        (-(-tasks * lanes // 256), 1, 1), tasks)


def backward(dout: ArrayInfo, q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, out: ArrayInfo, dq: ArrayInfo,
             dk: ArrayInfo, dv: ArrayInfo, dq_accum: ArrayInfo | None, options: Options, varlen: Varlen | None,
             device: Device) -> Plan:
    """dq, dk, dv: the one-pass kernel (dQ by atomics into ``dq_accum``) where it has a
    tile, else the dQ pass and the dK/dV pass (bitwise reproducible). The dQ pass and the
    one-pass kernel run tile-major (``tile_group``); the dK/dV pass goes head by head."""
    p, batch = call_params(q, k, v, options, varlen, o=out, dout=dout, dq=dq, dk=dk, dv=dv)
    shared_limit = device.shared_limit
    vec = vectorizable(dout, q, k, v, dq, dk, dv)
    nheads_kv = k.shape[-2]
    one_pass = dq_accum is not None and has_tile("backward", p.headdim, options.extras, shared_limit)
    accum_cols = dq_accum.shape[2] * dq_accum.shape[-1] if one_pass else 0  # (rows / 8, nheads, cols / 16, 8, 16)
    rows = backward_rows(p, batch, q, varlen, accum_cols)
    per_row, tasks = rows.args, rows.tasks
    steps = []
    if tasks:
        steps.append(Step(Elementwise("backward_preprocess", q.dtype), rows.preprocess_grid, per_row))
        if not one_pass:
            tiled = _kernel("backward_dq", q, options, vec, shared_limit)
            steps.append(Step(tiled, tiled.grid(p.seqlen_q, p.nheads, batch)))
            p.tile_group = tile_group(tiled, batch * p.nheads, device)
    if batch and p.seqlen_k and nheads_kv:
        tiled = _kernel("backward" if one_pass else "backward_dkdv", q, options, vec, shared_limit)
        steps.append(Step(tiled, tiled.grid(p.seqlen_k, nheads_kv, batch)))
        if one_pass:
            p.tile_group = tile_group(tiled, batch * nheads_kv, device)
    if tasks and one_pass:
        steps.append(Step(Elementwise("backward_convert_dq", q.dtype), rows.convert_grid, per_row))
    # dq_accum stays unset without the one-pass kernel: nothing reads it then (nor, here, dq_semaphore).
    pointers = BACKWARD_POINTERS[:-1] if one_pass else BACKWARD_POINTERS[:-2]
    p, struct = with_mods(p, options)  # (the elementwise kernels read the Params at its start)
    return Plan(bytes(p), pointers, tuple(steps), struct)


def backward_workspace(q_shape, deterministic: bool = False, extras: bool = False,
                       ordered: bool = False) -> dict[str, tuple[tuple[int, ...], str]]:
    """Scratch buffers of the backward (contents on entry do not matter): D = rowsum(dO * O),
    laid out like the LSE, and dQ's fp32 accumulator in blocks of 8 x 16, (rows / 8, nheads,
    head-dim bucket / 16, 8, 16) (dq_accum.cuh, DqAccum), then whole groups of 8 rows more
    for its counters (an int32 a sequence and query head, zeroed with it: the sm_90a
    backward counts its finished key blocks there): unless ``deterministic``, where the
    one-pass kernel has a tile for this head dim and ``extras`` (softcap, ALiBi or dropout
    on); when ``deterministic`` and ``ordered`` (the device runs the sm_90a backward, which
    adds dQ in a fixed order: ``sm90.backward_orders``), with the order's semaphores, int32
    laid out like D."""
    *rows, nheads, head_dim = q_shape
    delta_shape = (rows[0], nheads, rows[1]) if len(rows) == 2 else (nheads, rows[0])
    work = {"delta": (delta_shape, "float32")}
    bucket = head_dim_bucket(head_dim)
    counters = math.prod(rows[:-1]) * nheads  # (a sequence's query heads; packed rows: one sequence)
    groups = -(-math.prod(rows) // 8) + -(-counters // (8 * nheads * bucket))
    accum = ((groups, nheads, bucket // 16, 8, 16), "float32")
    if not deterministic and KINDS["backward"].candidates(bucket, extras):
        work["dq_accum"] = accum
    elif deterministic and ordered:
        work["dq_accum"], work["dq_semaphore"] = accum, (delta_shape, "int32")
    return work


def _kernel(kind: str, q: ArrayInfo, options: Options, vectorized: bool, shared_limit: int) -> Kernel:
    return kernel(kind, q.dtype, q.shape[-1], options.local, vectorized, options.extras, shared_limit,
                  "" if options.mods is None else options.mods.source)
