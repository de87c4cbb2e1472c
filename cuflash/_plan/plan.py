"""What every plan is made of: the launch steps, the tensor maps the launcher encodes, the
plan itself, and the kernels' Params of a call (shapes, strides, options) with its array
pointers left for the launcher to fill in, at the offsets ``field_offset`` finds."""
from __future__ import annotations

import ctypes
import math
from typing import TYPE_CHECKING, NamedTuple

from .._params import ArrayView, ModParams, Params

if TYPE_CHECKING:
    from .._arrays import ArrayInfo
    from .._device import Device
    from .._options import Options, Varlen
    from .variants import Variant


class Step(NamedTuple):
    """One kernel launch: the variant, its grid, its int arguments after the Params, the
    field of the plan's struct that is its argument ("": the whole struct), the CTAs of
    a thread block cluster along x (1: no clusters), and whether it is launched as a
    programmatic dependent of the step before (``dependent``, sm_90: it may start as that
    one ends and waits for its results in the kernel, wait_for_prerequisites in common.cuh)."""
    kernel: Variant
    grid: tuple[int, int, int]
    args: tuple[int, ...] = ()
    argument: str = ""
    cluster: int = 1
    dependent: bool = False


class TensorMapSpec(NamedTuple):
    """A tensor map of the struct's ``field`` that the launcher encodes once it knows the
    address of the array given as ``pointer`` (one of the plan's pointers): ``shape``
    (batch, seqlen, heads, headdim) and ``strides`` in elements, loaded ``rows`` at a time
    (cuflash/_tensormap.py)."""
    field: str
    pointer: str
    dtype: str
    shape: tuple[int, int, int, int]
    strides: tuple[int, int, int, int]
    rows: int


class Plan(NamedTuple):
    """What a call launches, all but its array pointers: the kernels' argument struct
    (``struct``, as bytes) with the pointers left to fill in at ``pointers`` (field names,
    in the order the launcher is given them), then each step. ``workspace``: the scratch
    buffers the caller allocates, (name, shape, dtype) each (``pointers`` names them too);
    ``counters``: those of them the launcher sets to 0 before the steps
    (int32); ``maps``: the tensor maps the launcher encodes from the pointers."""
    params: bytes
    pointers: tuple[str, ...]
    steps: tuple[Step, ...]
    struct: type = Params
    workspace: tuple[tuple[str, tuple[int, ...], str], ...] = ()
    maps: tuple[TensorMapSpec, ...] = ()
    counters: tuple[str, ...] = ()


_FLOAT32_TINY = 2.0 ** -126


def group_size(pairs: int, most: int) -> int:
    """The size of the tile-major order's groups (tile_major in cuda/common.cuh) of at most
    ``most`` of ``pairs`` (head, sequence) pairs, as few groups as that allows, of equal
    size: a short last group would run its long tiles alone."""
    groups = -(-pairs // max(1, most))
    return -(-pairs // groups)


def tile_group(kernel: Variant, pairs: int, device: Device) -> int:
    """(head, batch) pairs per group of the tile-major order of banded grids (GridTile in
    cuda/common.cuh) of ``pairs`` pairs: at most a quarter of the CTAs resident at once, so
    that a head's CTAs run together and keep the rows they share in L2, in groups of equal
    size (a small last group ran its long tiles alone: forward d 224 causal 2k was 10.7%
    slower with 72 pairs in groups of 66 and 6; docs/tuning.md, "Tile-major causal grids").
    The resident CTAs depend on the compiled kernel's registers: the device's
    ``resident_ctas`` reads them as the kernel is loaded."""
    return group_size(pairs, device.multiprocessors * device.resident_ctas(kernel) // 4)


def view(a: ArrayInfo | None) -> ArrayView:
    if a is None:
        return ArrayView()
    strides = a.strides if len(a.shape) == 4 else (0, *a.strides)  # packed: no batch stride
    return ArrayView(0, *strides[:3])


def call_params(q, k, v, options: Options, varlen: Varlen | None, **arrays) -> tuple[Params, int]:
    """The Params of a call but its array pointers, and the number of (batch) sequences."""
    p = Params()
    for name, a in dict(q=q, k=k, v=v, **arrays).items():
        setattr(p, name, view(a))
    head_dim, nheads, nheads_kv = q.shape[-1], q.shape[-2], k.shape[-2]
    # The LSE is contiguous: (batch, nheads, seqlen_q), or (nheads, total_q) when packed.
    if varlen is None:
        batch, p.seqlen_q, p.seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        p.lse_batch_stride, p.lse_head_stride = nheads * p.seqlen_q, p.seqlen_q
    else:
        batch, p.seqlen_q, p.seqlen_k = varlen.batch, varlen.max_seqlen_q, varlen.max_seqlen_k
        p.lse_batch_stride, p.lse_head_stride = 0, q.shape[0]
        p.cu_seqlens_q, p.cu_seqlens_k = varlen.cu_seqlens_q.ptr, varlen.cu_seqlens_k.ptr
    p.nheads, p.heads_per_kv, p.headdim = nheads, nheads // max(nheads_kv, 1), head_dim
    p.window_left, p.window_right = options.window  # normalised per sequence by the kernel (mask.cuh)
    p.scale, p.scale_log2, p.softcap = options.scale, scale_log2(options.scale), options.softcap
    if options.alibi is not None:
        p.alibi_slopes = options.alibi.ptr
        p.alibi_batch_stride = options.alibi.strides[0] if len(options.alibi.shape) == 2 else 0
    if options.dropout_p > 0:
        p.dropout_threshold = dropout_threshold(options.dropout_p)
        p.dropout_scale = 1.0 / (1.0 - options.dropout_p)
        p.seed, p.rng_offset = options.seed, options.rng_offset
    return p, batch


def with_mods(p: Params, options: Options) -> tuple[Params, type]:
    """The kernels' argument and its type: ``p`` itself, or with the call's mods its
    ModParams (p followed by the mod tensors and the block mask's statuses)."""
    if options.mods is None:
        return p, Params
    m = ModParams.from_buffer_copy(bytes(p) + bytes(ctypes.sizeof(ModParams) - ctypes.sizeof(Params)))
    for slot, a in zip(m.tensors, options.mods.tensors):
        slot.ptr = a.ptr
        for axis, (size, stride) in enumerate(zip(a.shape, a.strides)):
            slot.size[axis], slot.stride[axis] = size, stride
    blocks = options.mods.blocks
    if blocks is not None:  # (int8: strides in elements are strides in bytes; 0 where broadcast)
        m.blocks.status = blocks.ptr
        m.blocks.batch_stride, m.blocks.head_stride, m.blocks.row_stride = (
            stride if size > 1 else 0 for size, stride in zip(blocks.shape[:3], blocks.strides[:3]))
    return m, ModParams


def dropout_threshold(p: float) -> int:
    """A probability is dropped iff its 32-bit Philox word is below this."""
    return min(int(p * 2**32), 2**32 - 1)


def scale_log2(scale: float) -> float:
    """The softmax scale in log2 units (kernels use exp2). A zero scale becomes the
    smallest normal float so that masked scores (-inf) times it stay -inf, not NaN."""
    return max(scale * math.log2(math.e), _FLOAT32_TINY)


def vectorizable(*arrays: ArrayInfo) -> bool:
    """Can every row be moved in 16-byte chunks? (cp.async needs aligned addresses.)"""
    if arrays[0].shape[-1] % 8:
        return False
    return all(a.ptr % 16 == 0 and all(s % 8 == 0 for s in a.strides[:-1]) for a in arrays)


def tensor_map(name: str, a: ArrayInfo, varlen: Varlen | None, rows: int) -> TensorMapSpec:
    """The map of the struct's field ``name`` over ``a`` (packed arrays as one batch of all rows)."""
    shape, strides = a.shape, a.strides
    if varlen is not None:
        shape, strides = (1, *a.shape), (a.shape[0] * a.strides[0], *a.strides)
    return TensorMapSpec(name, f"p.{name}", a.dtype, tuple(shape), tuple(strides), rows)


def pointer_offsets(struct: type, names: tuple[str, ...]) -> tuple[int, ...]:
    """Where each named pointer lies in the struct (an ArrayView's pointer is its first field)."""
    return tuple(field_offset(struct, name) for name in names)


def field_offset(struct: type, name: str) -> int:
    """Byte offset of a field, or of a nested one ("merge.out"; an ArrayView's pointer
    is its first field)."""
    offset = 0
    for part in name.split("."):
        offset += getattr(struct, part).offset
        # (a subclass's _fields_ hold only its own fields: ModParams' base's are in Params)
        struct = next(dict(c.__dict__["_fields_"])[part] for c in struct.__mro__
                      if part in dict(c.__dict__.get("_fields_", ())))
    return offset
