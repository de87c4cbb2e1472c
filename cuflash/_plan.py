"""Which kernels a call launches: variant, tile shape, grid, shared memory and Params,
from shapes, dtypes, options and the device's shared memory. Nothing here compiles or
touches a GPU: ``_kernels`` binds a plan to compiled kernels and launches it.

This is the one dispatch table. A variant is a template instance of one of the
tiled kernels in ``cuda/`` (``KINDS``); its tile shape is the first entry of the
kind's table, per head-dim bucket, whose shared memory fits the arch. Register
budgets behind these choices are checked by ``python -m cuflash compile``.
"""
from __future__ import annotations

import functools
import itertools
import math
from typing import TYPE_CHECKING, Callable, NamedTuple

from ._params import ArrayView, DecodeParams, MergeParams, Params, Sm90BackwardParams, Sm90Params, field_offset

if TYPE_CHECKING:
    from ._arrays import ArrayInfo
    from ._options import KVCache, Options, Varlen

HEAD_DIM_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]
DTYPES = {"float16": "cuflash::half_t", "bfloat16": "cuflash::bfloat16_t"}

# Opt-in dynamic shared memory per block (CUDA programming guide, "Compute
# Capabilities"); used when there is no device to ask, e.g. compile-all in CI.
SHARED_MEMORY_LIMIT = {
    "sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_87": 163 * 1024, "sm_89": 99 * 1024,
    "sm_90": 227 * 1024, "sm_90a": 227 * 1024, "sm_100": 227 * 1024, "sm_120": 99 * 1024,
}


class Tile(NamedTuple):
    """@block_m query rows and @block_n key rows per tile, @warps warps per CTA,
    @stages shared buffers for the streamed operand, @col_split passes over the
    head dim (backward only: keeps the gradient accumulators in registers)."""
    block_m: int
    block_n: int
    warps: int
    stages: int
    col_split: int = 1


def _row_bytes(d: int) -> int:
    """Bytes of one shared-memory row of a head-dim-wide tile (layout.cuh, HeadDimLayout):
    swizzled whole 128-byte lines at d 64, 128 and 256, else padded by 8 elements."""
    return d * 2 if d in (64, 128, 256) else (d + 8) * 2


class Kind(NamedTuple):
    source: str
    template: str
    tiles: dict[int, tuple[Tile, ...]]  # head-dim bucket -> candidates, preferred first
    # Dynamic shared memory of a tile at a head-dim bucket: the size of the kernel's own
    # layout, the template ``layout``<head dim, block_m, block_n, stages> in ``source``
    # (tests/test_plan.py compiles the one against the other for every variant).
    shared_bytes: Callable[[Tile, int], int]
    grid_rows: str  # the tile dimension the grid's x runs over: "block_m" or "block_n"
    has_col_split: bool
    layout: str
    # Tiles of the instances with softcap, ALiBi or dropout where they differ (None: the same).
    extras_tiles: dict[int, tuple[Tile, ...]] | None = None
    # Template arguments after the flags (and col_split).
    suffix: tuple[str, ...] = ()
    # Launched in thread block clusters (Step.cluster CTAs along x): sm_90 and later only.
    clustered: bool = False

    def candidates(self, bucket: int, extras: bool) -> tuple[Tile, ...]:
        tiles = self.extras_tiles if extras and self.extras_tiles is not None else self.tiles
        return tiles.get(bucket, ())


_T = Tile
# The KV-cache call (decode/split_kv.cu): 16 packed query rows + stages x (K tile + V
# tile); the warps split each key tile, 16 keys each. Two stages of about 32 KB: three
# CTAs share a multiprocessor (at d 128), so that their warps hide each other's
# latencies while about 100 KB of loads are in flight. (One CTA of four warps with four
# stages kept 96 KB in flight but issued one instruction at a time: 1.3 TB/s at batch
# 64; with the strided copies, at batch 1 and 64k keys, 2.1 TB/s against 3.3.)
DECODE_TILES = {
    **{d: (_T(16, 128, 4, 2),) for d in (32, 64)},
    **{d: (_T(16, 64, 4, 2),) for d in (96, 128)},
    **{d: (_T(16, 32, 2, 2),) for d in (160, 192, 224, 256)},
}


# Grids that are not split (batch x KV heads fill the GPU) take eight warps over 128-key
# tiles: one CTA a multiprocessor (135 KB at d 128), two warps a scheduler, where four warps
# of a CTA each left one warp a scheduler to issue a tile's chain of dependent
# instructions alone (ncu, batch 16, 4k keys, 128 CTAs: 6% of warp slots active, the warps
# stalled most on fixed-latency dependencies). H200, GQA 32/8, bf16, graph replay, GB/s,
# 64-key four-warp tile -> this one (cuDNN, same run): d 128 batch 16 4k 3,722 -> 3,879
# (4,015), 16k 4,165 -> 4,370 (4,395), batch 64 4k 3,876 -> 4,194, 16k 3,997 -> 4,479
# (4,415); MHA batch 16 4k 3,778 -> 4,283 (4,338); d 64 (against its 128-key four-warp
# tile) batch 64 4k 3,885 -> 4,118, batch 16 4k 3,509 -> 3,482. Split grids keep
# DECODE_TILES: with 128-key tiles a split holds half the tiles, and batch 1 read 0.76-0.96x;
# so do pages shorter than 128 rows (decode).
DECODE_WIDE_TILES = {d: (_T(16, 128, 8, 2),) for d in (64, 128)}


def _decode_shared(t: Tile, d: int) -> int:
    return (t.block_m + 2 * t.stages * t.block_n) * _row_bytes(d)


# Splits of a row block that merge in a thread block cluster at most (split_kv.cu,
# kMaxClusterSplits): Hopper schedules clusters of up to 16 CTAs (above 8 by the kernel's
# leave, _driver.NON_PORTABLE_CLUSTER_SIZE_ALLOWED).
MAX_CLUSTER_SPLITS = 16


def _decode_cluster_shared(t: Tile, d: int) -> int:
    """The stages, then the inbox of the rows this CTA merges: (block_m + MAX_CLUSTER_SPLITS)
    entries of an fp32 row of d and an LSE (ClusterDecodeShared)."""
    return _decode_shared(t, d) + (t.block_m + MAX_CLUSTER_SPLITS) * (d + 1) * 4


KINDS = {
    # Q tile + stages x (K tile + V tile)
    "forward": Kind("fwd.cu", "attention_forward", {
        # 32 query rows per warp up to d 128 (each K/V fragment read from shared
        # memory feeds two m16 tiles). Above, the O accumulator only fits 16 rows: 4
        # warps with one K and one V buffer (fwd.cu) take half the shared memory of
        # two stages, so two CTAs share an SM and hide each other's barriers and loads
        # (FlashAttention-2's H100 choice; 1.04-1.10x the 128 x 64 x 8-warp, 2-stage
        # tile at d 256 in a tile sweep, docs/tuning.md "Forward tiles").
        # At d 96, 64-key tiles: +5-8% over the same tiles taken 32 keys at a time (which
        # were themselves +6-8% over 128 x 32 tiles, not causal) in A/B rounds; with
        # softcap, ALiBi or dropout their S, softmax and P V go 32 keys at a time (fwd.cu,
        # kSubN; a 64-key S spilled). At d 128 a 64-key S spills; 32-key steps of 128 x 64
        # gain 3-5% causal on the swizzled tiles but spill 8 bytes in the causal variant
        # on sm_90, and without the spill (fewer k16 steps overlapped) lose 1.6-4.5%.
        32: (_T(128, 64, 4, 2),), 64: (_T(128, 64, 4, 2),), 96: (_T(128, 64, 4, 2),), 128: (_T(128, 32, 4, 2),),
        **{d: (_T(64, 64, 4, 1), _T(64, 32, 4, 1)) for d in (160, 192, 224, 256)},
    }, lambda t, d: (t.block_m + 2 * t.stages * t.block_n) * _row_bytes(d), "block_m", False, "ForwardShared"),
    # One-pass backward, dQ by atomics. K and V tiles + stages x (Q tile + dO tile + LSE + D)
    # + P and dS tiles. Warps own 32 rows of each product (bwd_one_pass.cu) and multiples of 8
    # columns of dK, dV and dQ (24 at d 96, 40 at d 160: an odd n8 tile, mma.cuh).
    # Softcap, ALiBi and dropout take the two-kernel path up to d 128: their per-element
    # arithmetic spills these tiles, and the tiles that fit them (64 x 128 at d 64,
    # 128 x 64 at d 128) ran no faster than the two kernels without extras (tile sweep,
    # docs/tuning.md "Backward structure").
    # Three Q/dO buffers (loads two steps ahead) at d 64 where shared memory allows: +1-2%
    # over two in two A/B rounds (up to +6% at 1k); at d 128 they lost 0.5-3%.
    "backward": Kind("bwd_one_pass.cu", "attention_backward", {
        32: (_T(128, 128, 8, 2), _T(128, 128, 8, 1)),
        # (128 x 128 with one Q/dO buffer, for sm_80's shared memory, spills under CUDA 12.9.)
        64: (_T(128, 128, 8, 3), _T(128, 128, 8, 2), _T(64, 128, 8, 1)),
        # (FlashAttention-2's d 96 tile; 64 x 64 fits the shared memory of sm_86.)
        96: (_T(64, 128, 8, 2), _T(64, 64, 8, 2), _T(64, 64, 8, 1)),
        128: (_T(64, 128, 8, 2), _T(64, 64, 8, 2), _T(64, 64, 8, 1)),
        **{d: (_T(64, 64, 8, 2), _T(64, 64, 8, 1)) for d in (160, 192, 224, 256)},
    }, lambda t, d: (2 * t.block_n * _row_bytes(d) + t.stages * (2 * t.block_m * _row_bytes(d) + 8 * t.block_m)
                     + 2 * t.block_m * (t.block_n + 8) * 2), "block_n", False, "BackwardShared",
        extras_tiles={d: (_T(64, 64, 8, 2), _T(64, 64, 8, 1)) for d in (160, 192, 224, 256)}),
    # The deterministic path: dK/dV here, dQ in its own pass (below).
    # K and V tiles + stages x (Q tile + dO tile + LSE + D)
    "backward_dkdv": Kind("bwd_two_kernel.cu", "attention_backward_dkdv", {
        32: (_T(64, 64, 4, 2),), 64: (_T(64, 64, 4, 2),), 96: (_T(32, 32, 2, 2),),
        128: (_T(32, 64, 4, 2), _T(32, 64, 4, 1)),
        # Above d 128, dK and dV of 16 keys per warp fit in registers only in two
        # column halves (each half recomputes S and dP).
        **{d: (_T(32, 64, 4, 2, 2), _T(32, 64, 4, 1, 2), _T(32, 32, 2, 1, 2)) for d in (160, 192, 256)},
        # At d 224 the halves (112 columns) spill under CUDA 12's ptxas in some variants.
        224: (_T(32, 64, 4, 2, 7), _T(32, 64, 4, 1, 7)),
    }, lambda t, d: 2 * t.block_n * _row_bytes(d) + t.stages * (2 * t.block_m * _row_bytes(d) + 8 * t.block_m),
        "block_n", True, "BackwardDkDvShared"),
    # Q tile + dO tile + stages x (K tile + V tile)
    "backward_dq": Kind("bwd_two_kernel.cu", "attention_backward_dq", {
        32: (_T(64, 128, 4, 2),), 64: (_T(64, 64, 4, 2),), 96: (_T(64, 64, 4, 2),),
        128: (_T(64, 32, 4, 2), _T(64, 32, 4, 1)),
        **{d: (_T(64, 32, 4, 2), _T(64, 32, 4, 1), _T(32, 32, 2, 1)) for d in (160, 192, 224, 256)},
    }, lambda t, d: (2 * t.block_m + 2 * t.stages * t.block_n) * _row_bytes(d), "block_m", True,
        "BackwardDqShared"),
    "decode": Kind("decode/split_kv.cu", "attention_decode", DECODE_TILES, _decode_shared, "block_m", False,
                   "DecodeShared", suffix=("false",)),
    # The same kernel for grids that are not split (DECODE_WIDE_TILES).
    "decode_wide": Kind("decode/split_kv.cu", "attention_decode", DECODE_WIDE_TILES, _decode_shared, "block_m",
                        False, "DecodeShared", suffix=("false",)),
    # The same with the splits of a row block in one thread block cluster, merging their
    # results in shared memory (sm_90): no merge kernel, no workspace.
    # (More stages ran slower at batch 1, GQA d 128: three (100 KB) 0.92-0.94x two, four
    # (135 KB) 0.59-0.64x, when a cluster of 16 CTAs needs 16 multiprocessors of one GPC.)
    "decode_cluster": Kind("decode/split_kv.cu", "attention_decode", DECODE_TILES, _decode_cluster_shared, "block_m",
                           False, "ClusterDecodeShared", suffix=("true",), clustered=True),
}

# Untiled helpers of the backward, one instance per dtype.
ELEMENTWISE = {"backward_preprocess": ("bwd.cu", "attention_backward_preprocess", 256),
               "backward_convert_dq": ("bwd.cu", "attention_backward_convert_dq", 256)}


# The merge of partial results (decode/merge.cu): (parts' dtype, output dtype) pairs, the
# KV-cache call's fp32 splits into its output and merge_states' parts of one dtype.
MERGE_DTYPES = {"float32": "float", **DTYPES}
MERGES = (*(("float32", d) for d in DTYPES), *((d, d) for d in MERGE_DTYPES))
MERGE_WARPS = 4  # warps per output row, one row a CTA (merge.cu, kMergeWarps)


def head_dim_bucket(head_dim: int) -> int:
    return next(b for b in HEAD_DIM_BUCKETS if head_dim <= b)


def shared_memory_limit(arch: str) -> int:
    return SHARED_MEMORY_LIMIT.get(arch, 99 * 1024)


def copy_run_rows(head_dim: int, tile: Tile) -> int:
    """Rows a thread copies one after another in a key tile of a paged cache (copy.cuh's
    ChunkLanes and load_run): pages a whole number of them long are copied in runs, a
    page-table entry a thread a tile, as fast as a contiguous cache."""
    chunks, threads = head_dim // 8, 32 * tile.warps
    lanes = min(chunks & -chunks, threads // 8)
    return tile.block_n // (threads // lanes)


class Kernel(NamedTuple):
    """One template instance of a tiled kernel with its launch shape."""
    kind: str
    dtype: str
    head_dim: int  # bucket
    tile: Tile
    local: bool  # causal or sliding-window band
    vectorized: bool  # 16-byte aligned rows, head dim % 8 == 0
    extras: bool  # softcap, ALiBi or dropout

    @property
    def source(self) -> str:
        return KINDS[self.kind].source

    @property
    def instance(self) -> str:
        t, kind = self.tile, KINDS[self.kind]
        args = [DTYPES[self.dtype], self.head_dim, t.block_m, t.block_n, t.warps, t.stages,
                *(str(flag).lower() for flag in (self.local, self.vectorized, self.extras))]
        if kind.has_col_split:
            args.append(t.col_split)
        args.extend(kind.suffix)
        return f"cuflash::{kind.template}<{', '.join(map(str, args))}>"

    @property
    def shared_bytes(self) -> int:
        return KINDS[self.kind].shared_bytes(self.tile, self.head_dim)

    @property
    def shared_layout(self) -> str:
        """The kernel's own shared-memory layout type (its ``kBytes`` is ``shared_bytes``)."""
        t = self.tile
        return f"cuflash::{KINDS[self.kind].layout}<{self.head_dim}, {t.block_m}, {t.block_n}, {t.stages}>"

    @property
    def threads(self) -> int:
        return self.tile.warps * 32

    def grid(self, rows: int, heads: int, batch: int) -> tuple[int, int, int]:
        """Tiles over ``rows`` (query rows, or key rows for dK/dV), heads, batch."""
        tile_rows = getattr(self.tile, KINDS[self.kind].grid_rows)
        return (-(-rows // tile_rows), heads, batch)


class Elementwise(NamedTuple):
    kind: str
    dtype: str

    @property
    def source(self) -> str:
        return ELEMENTWISE[self.kind][0]

    @property
    def instance(self) -> str:
        return f"cuflash::{ELEMENTWISE[self.kind][1]}<{DTYPES[self.dtype]}>"

    @property
    def threads(self) -> int:
        return ELEMENTWISE[self.kind][2]

    shared_bytes = 0


class Merge(NamedTuple):
    """The merge kernel of parts of ``parts_dtype`` into an output of ``out_dtype``."""
    parts_dtype: str
    out_dtype: str
    source = "decode/merge.cu"
    threads = 32 * MERGE_WARPS
    shared_bytes = 0

    @property
    def instance(self) -> str:
        return f"cuflash::merge_states<{MERGE_DTYPES[self.parts_dtype]}, {MERGE_DTYPES[self.out_dtype]}>"


class Sm90Forward(NamedTuple):
    """The sm_90a forward (cuda/sm90/fwd.cu: TMA, wgmma) for head dims up to ``head_dim``
    (64, 128 or 256; a smaller one rides on the copy engine's zero columns): a producer
    warpgroup and ``consumers`` consumer warpgroups of 64 query rows, key tiles and K/V
    stages (SM90_TILES); ``extras``: softcap, ALiBi or dropout may be on."""
    dtype: str
    head_dim: int
    local: bool
    extras: bool
    block_n: int  # keys a tile
    stages: int  # K/V tiles in flight
    consumers: int  # consumer warpgroups: 2 or 3
    source = "sm90/fwd.cu"
    arch = "sm_90a"

    @classmethod
    def of(cls, dtype: str, head_dim: int, local: bool, extras: bool, short: bool = False) -> Sm90Forward:
        """The variant with the planner's tile (SM90_TILES; under a causal mask or a window
        SM90_BANDED_TILES, with softcap, ALiBi or dropout SM90_BANDED_EXTRAS_TILES, and
        ``short``, a causal call of fewer than SM90_SHORT_CAUSAL_ROWS query rows,
        SM90_SHORT_CAUSAL_TILES, where they name the head dim)."""
        tile = SM90_TILES[head_dim]
        if local:
            tile = SM90_BANDED_TILES.get(head_dim, tile)
            tile = SM90_BANDED_EXTRAS_TILES.get(head_dim, tile) if extras else tile
            tile = SM90_SHORT_CAUSAL_TILES.get(head_dim, tile) if short else tile
        return cls(dtype, head_dim, local, extras, *tile)

    @property
    def block_m(self) -> int:
        return 64 * self.consumers

    @property
    def instance(self) -> str:
        return (f"cuflash::attention_forward_sm90<{DTYPES[self.dtype]}, {self.head_dim}, {self.block_n}, "
                f"{self.consumers}, {self.stages}, {'true' if self.local else 'false'}, "
                f"{'true' if self.extras else 'false'}>")

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + 1)

    @property
    def shared_layout(self) -> str:
        return f"cuflash::Sm90Shared<{self.head_dim}, {self.block_m}, {self.block_n}, {self.stages}>"

    @property
    def shared_bytes(self) -> int:
        """``Sm90Shared<...>::kBytes``: Q, the K and V stages, the barriers (a landed and a
        released one for Q and for each stage, or with two stages for each stage's K and V:
        kApart), the loaded tile's number (8 bytes), a sink word for each of up to 16 warps
        and 1024 bytes of alignment."""
        stage_barriers = (2 if self.stages == 2 else 1) * self.stages
        return (2 * self.head_dim * (self.block_m + 2 * self.stages * self.block_n) + (2 + 2 * stage_barriers) * 8
                + 8 + 16 * 4 + 1024)

    def grid(self, rows: int, heads: int, batch: int, multiprocessors: int = 0) -> tuple[int, int, int]:
        """A CTA per tile, or at most one per multiprocessor (one fits: its registers), each
        taking tiles until none is left (fwd.cu, Sm90Tiles)."""
        tiles = -(-rows // self.block_m) * heads * batch
        return (min(tiles, multiprocessors) if multiprocessors else tiles), 1, 1


# The sm_90a forward runs on a persistent grid (a CTA a multiprocessor): the producer loads
# the next tile's Q and keys while the consumers finish a tile and store it (H200, d 128
# bf16, 16k tokens, no mask: 1.00-1.05x a CTA per tile, most at 1k). Where every tile sees
# the same keys the CTAs take tiles in turn; under a causal mask or a window, whose tiles
# differ in length, each takes the next in order as it gets free, from a counter (in static
# shares the longest tiles first ran 0.91-0.99x a CTA per tile at 4k-16k).

# Under a causal mask the scheduler takes the longest tiles first across a section of
# (head, sequence) pairs (sm90_section, fwd.cu's Sm90Tiles) rather than pair after pair,
# from SM90_SECTION_ROWS query rows, its section's K and V in SM90_SECTION_BYTES of L2.
# Sections against pair after pair (H100, bf16, causal, 16k tokens, `scripts/sm90_bench.py
# --sections`), at 2k / 4k / 8k / 16k: 16 MiB d 64 1.02 / 1.03 / 1.03 / 1.03x, d 128 1.03 /
# 1.03 / 1.03 / 1.00x, d 256 1.05 / 1.08 / 1.08 / 1.00x; 8 MiB d 256 1.03 / 1.02 / 1.00 /
# 1.00x; 32 MiB (FlashAttention-3's figure) d 128 0.99 / 1.03 / 1.04 / 1.00x. At 512 and 1k
# sections lost up to 9% (d 256 at 512 with 32 MiB; d 128 with 16 MiB 0.95x and 0.96x) and
# gained at most 2%. (Measured on a grid of a CTA a tile, which the hardware hands out in order.)
SM90_SECTION_BYTES = 16 << 20
SM90_SECTION_ROWS = 2048
# Head dim -> (keys a tile, K/V stages, consumer warpgroups). At d 128 FlashAttention-3's
# tile of 176 keys (m64n176 products: S, P and O in a consumer's 240 registers) in two
# stages, 209 KiB of shared memory with Q. A consumer holds a tile's V until its next
# turn; with two stages the copy engine keeps up only because each stage's K and V are
# released apart (Sm90Shared::kApart): before that split, two stages of 128 keys ran 502
# against 651 TFLOP/s for three at 16k, and 176 keys 0.81-0.87x the three-stage ring. With
# it, 176 keys ran 0.97-1.04x the 128-key, three-stage tile without a mask, 1.02-1.04x
# from 8k (H100, bf16 and fp16, 16k tokens, `bench --baseline`; 1.00-1.04x from 1k in
# `scripts/sm90_bench.py`): fewer turns, barriers and softmax passes a key. At d 256
# FlashAttention-3's tile of 80 keys keeps S, P and O in a consumer's 240 registers, and
# two stages fit beside Q (225 KiB): 1.03-1.08x the 64-key tile at 1k-16k, causal or not
# (bf16, same run). The causal or windowed variant with softcap, ALiBi or dropout spills 4
# bytes with 80 keys and keeps 64 (SM90_BANDED_EXTRAS_TILES). At d 64 a consumer's S, P
# and O fit in 160 registers, so three consumers share the multiprocessor:
# FlashAttention-3's d64 tile of 192 query rows. Each K/V tile loaded serves half as many
# rows again, and two consumers' products can run through the third's softmax; with three
# stages of 128 keys it takes 121 KiB of shared memory (H200, 16k tokens, bf16, two ->
# three consumers: not causal 1.12-1.28x at 2k-16k, 434 -> 557 TFLOP/s at 16k; causal
# 1.06-1.16x, but 0.93x at 1k, where 192-row tiles leave fewer of them to share the
# multiprocessors; fp16 alike). (At d 128 a consumer's S, P and O spill out of 160
# registers.)
SM90_TILES = {64: (128, 3, 3), 128: (176, 2, 2), 256: (80, 2, 2)}
# Under a causal mask or a window d 128 keeps 128 keys in three stages (FlashAttention-3's
# causal tile too): a 128-row block's diagonal tile hides more of 176 keys, and short calls
# have few key tiles a row. 176 keys against it, bf16 / fp16 (H100, bench --baseline, one
# run): causal 512 0.91 / 0.93x, 1k 0.95x, 2k 0.98x, 4k 0.99x, 8k 1.01 / 1.02x, 16k 1.01 /
# 1.02x; identical kernels timed the same way read 0.95-1.03x each other.
SM90_BANDED_TILES = {128: (128, 3, 2)}
SM90_BANDED_EXTRAS_TILES = {256: (64, 2, 2)}
# A causal call of fewer than SM90_SHORT_CAUSAL_ROWS query rows at d 64 keeps two consumers
# (128-row tiles): three consumers' 192-row tiles are fewer, and longer, to share out among
# the multiprocessors (H200, bf16, 16k tokens, `scripts/sm90_bench.py --head-dim 64 --tile
# 128,3,2`, three consumers against two: 1k 0.93x, 2k 1.06x, 4k-16k 1.08-1.16x; on the H100
# with the later scheduler 0.93x, 1.06x and 1.09-1.18x).
SM90_SHORT_CAUSAL_TILES = {64: (128, 3, 2)}
SM90_SHORT_CAUSAL_ROWS = 2048
SM90_HEAD_DIMS = tuple(SM90_TILES)


class Sm90Backward(NamedTuple):
    """The sm_90a backward (cuda/sm90/bwd.cu: TMA, wgmma) for head dims up to ``head_dim``
    (64 or 128; one between rides on the copy engine's zero columns): a producer warpgroup
    and two consumer warpgroups of 64 keys each (a block of 128), ``block_m`` query rows a
    step in ``stages`` Q/dO stages (SM90_BACKWARD_TILES)."""
    dtype: str
    head_dim: int
    local: bool
    block_m: int
    stages: int
    kind = "backward_sm90"
    source = "sm90/bwd.cu"
    arch = "sm_90a"
    block_n = 128
    threads = 384

    @classmethod
    def of(cls, dtype: str, head_dim: int, local: bool) -> Sm90Backward:
        return cls(dtype, head_dim, local, *SM90_BACKWARD_TILES[head_dim])

    @property
    def instance(self) -> str:
        return (f"cuflash::attention_backward_sm90<{DTYPES[self.dtype]}, {self.head_dim}, {self.block_m}, "
                f"{self.stages}, {'true' if self.local else 'false'}>")

    @property
    def shared_layout(self) -> str:
        return f"cuflash::Sm90BackwardShared<{self.head_dim}, {self.block_m}, {self.block_n}, {self.stages}>"

    @property
    def shared_bytes(self) -> int:
        """``Sm90BackwardShared<...>::kBytes``: K and V, the Q and dO stages, two dS^T tiles,
        each stage's LSE and D rows, the barriers (K/V's, and a landed and a released one a
        stage) and 1024 bytes of alignment."""
        d, m, n, stages = self.head_dim, self.block_m, self.block_n, self.stages
        return 2 * 2 * n * d + 2 * stages * 2 * m * d + 2 * 2 * n * m + 2 * stages * 4 * m + (1 + 2 * stages) * 8 + 1024


# The sm_90a backward: head dim -> (query rows a step, Q/dO stages). A consumer keeps dK
# and dV of its 64 keys (2 x d / 2 registers a thread) beside S^T and dP^T of a step's
# query rows (2 x rows / 4): FlashAttention-3's 64 rows at d 128, 128 at d 64 (bwd.cu,
# kEarlyValues: the order of the products that fits the 240 registers).
SM90_BACKWARD_TILES = {64: (128, 2), 128: (64, 2)}


def has_tile(kind: str, head_dim: int, extras: bool, shared_limit: int) -> bool:
    """Does ``kind`` have an instance for this head dim and extras within this much
    shared memory?"""
    bucket = head_dim_bucket(head_dim)
    return any(KINDS[kind].shared_bytes(t, bucket) <= shared_limit for t in KINDS[kind].candidates(bucket, extras))


@functools.cache  # the plan of a call signature never changes: look it up once
def kernel(kind: str, dtype: str, head_dim: int, local: bool, vectorized: bool, extras: bool,
           shared_limit: int) -> Kernel:
    bucket = head_dim_bucket(head_dim)
    for tile in KINDS[kind].candidates(bucket, extras):
        if KINDS[kind].shared_bytes(tile, bucket) <= shared_limit:
            return Kernel(kind, dtype, bucket, tile, local, vectorized, extras)
    raise RuntimeError(f"no {kind} tile for head dim {bucket} fits {shared_limit} bytes of shared memory")


def all_kernels(arch: str) -> list[Kernel | Elementwise | Merge | Sm90Forward | Sm90Backward]:
    """Every variant cuflash can launch on ``arch``: for sm_90a the sm90 kernels (the
    mma.sync ones run on compute capability 9.0 as sm_90)."""
    if arch == "sm_90a":
        variants = itertools.product(DTYPES, SM90_HEAD_DIMS, (False, True), (False, True), (False, True))
        forwards = dict.fromkeys(Sm90Forward.of(*v) for v in variants)  # (short: the same but for some causal ones)
        backwards = [Sm90Backward.of(*v) for v in itertools.product(DTYPES, SM90_BACKWARD_TILES, (False, True))]
        return [*forwards, *backwards]
    limit = shared_memory_limit(arch)
    flags = (False, True)
    kinds = [kind for kind in KINDS if not KINDS[kind].clustered or int(arch[3:5]) >= 90]
    tiled = [kernel(kind, dtype, bucket, local, vec, extras, limit)
             for kind, dtype, bucket, local, vec, extras in
             itertools.product(kinds, DTYPES, HEAD_DIM_BUCKETS, flags, flags, flags)
             if has_tile(kind, bucket, extras, limit)]
    return (tiled + [Elementwise(kind, dtype) for kind, dtype in itertools.product(ELEMENTWISE, DTYPES)]
            + [Merge(*pair) for pair in MERGES])


def covering_sample(archs: tuple[str, ...]) -> list[tuple[str, Kernel | Elementwise | Merge]]:
    """A few (arch, variant) pairs that between them reach every template branch of
    ``all_kernels``: each kind with every head-dim bucket and tile, every combination
    of its flags (band, vectorized, extras), each dtype, each arch with each (band,
    extras) pair, and every elementwise instance. A compile of these catches what a
    compile of everything would, in a tenth of the time (44 of 968 for sm_80 + sm_90)."""
    def reaches(arch: str, k: Kernel | Elementwise | Merge) -> set:
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


# -- plans ---------------------------------------------------------------------------------

class Step(NamedTuple):
    """One kernel launch: the variant, its grid, its int arguments after the Params, the
    (head, batch) pairs its tile-major grid groups (``_kernels.tile_group``; 0: none), the
    field of the plan's struct that is its argument ("": the whole struct), the CTAs of
    a thread block cluster along x (1: no clusters), and whether it is launched as a
    programmatic dependent of the step before (``dependent``, sm_90: it may start as that
    one ends and waits for its results in the kernel, wait_for_prerequisites in common.cuh)."""
    kernel: Kernel | Elementwise | Merge
    grid: tuple[int, int, int]
    args: tuple[int, ...] = ()
    grouped_heads: int = 0
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


FORWARD_POINTERS = ("q", "k", "v", "o", "lse")
BACKWARD_POINTERS = ("dout", "q", "k", "v", "o", "lse", "dlse", "dq", "dk", "dv", "delta", "dq_accum")
PREPROCESS_ROWS = 4  # (row, head) tasks per thread of the backward's preprocess (bwd.cu, kPreprocessRows)
_FLOAT32_TINY = 2.0 ** -126


def forward(q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, out: ArrayInfo, options: Options, varlen: Varlen | None,
            shared_limit: int, sm90a: bool = False, multiprocessors: int = 0) -> Plan:
    """out = attention(q, k, v) (and its LSE where the launch is given a pointer); with
    ``sm90a`` (a compute capability 9.0 device) through the sm_90a forward where it
    takes the call, on a persistent grid of a CTA per multiprocessor (with
    ``multiprocessors`` 0, a CTA per tile)."""
    p, batch = _params(q, k, v, options, varlen, o=out)
    if sm90a and sm90_takes(q, k, v, out, options, varlen):
        return _sm90_forward(p, batch, q, k, v, options, varlen, multiprocessors)
    kernel = _kernel("forward", q, options, vectorizable(q, k, v, out), shared_limit)
    steps = ()
    if batch and p.seqlen_q and p.nheads:
        steps = (Step(kernel, kernel.grid(p.seqlen_q, p.nheads, batch), (), batch * p.nheads),)
    return Plan(bytes(p), FORWARD_POINTERS, steps)


def sm90_takes(q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, out: ArrayInfo, options: Options,
               varlen: Varlen | None) -> bool:
    """Does the sm_90a forward take this call? Head dims 64 to 256; arrays the copy engine
    can read (16-byte aligned, head dim contiguous, every stride a multiple of 16 bytes)
    and that hold keys."""
    if not 64 <= q.shape[-1] <= 256 or q.dtype not in DTYPES or not vectorizable(q, k, v, out):
        return False
    if any(a.strides[-1] != 1 for a in (q, k, v)):
        return False
    seqlen_k = varlen.max_seqlen_k if varlen else k.shape[1]
    return k.shape[-3] > 0 and seqlen_k > 0


def _sm90_forward(p: Params, batch: int, q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, options: Options,
                  varlen: Varlen | None, multiprocessors: int) -> Plan:
    """The sm_90a forward's plan: its Params, and the maps of Q, K and V (packed arrays as
    one batch of all rows; each tile starts at its sequence's first); at most
    ``multiprocessors`` CTAs (0: no limit). Under a causal mask or a window the CTAs take
    tiles from a counter (fwd.cu, Sm90Tiles), the plan's workspace, which the launcher
    zeroes."""
    head_dim = next(d for d in SM90_HEAD_DIMS if d >= q.shape[-1])
    short = options.window == (-1, 0) and p.seqlen_q < SM90_SHORT_CAUSAL_ROWS  # (packed: the longest sequence)
    kernel = Sm90Forward.of(q.dtype, head_dim, options.local, options.extras, short)
    maps = [_tensor_map(name, a, varlen, rows) for name, a, rows in
            (("q", q, kernel.block_m), ("k", k, kernel.block_n), ("v", v, kernel.block_n))]
    tiles, key_tiles = -(-p.seqlen_q // kernel.block_m) * p.nheads * batch, -(-p.seqlen_k // kernel.block_n)
    tail_start, tail_ctas = tiles, 0
    if not options.local and varlen is None:
        tail_start, tail_ctas = sm90_tail(tiles, key_tiles, multiprocessors)
    steps = ()
    if batch and p.seqlen_q and p.nheads:
        grid = kernel.grid(p.seqlen_q, p.nheads, batch, multiprocessors)
        steps = (Step(kernel, (max(grid[0], tail_ctas), *grid[1:])),)
    section = sm90_section(options.window, p.seqlen_q, p.seqlen_k, head_dim, p.heads_per_kv, p.nheads * batch)
    pointers, workspace = tuple(f"p.{n}" for n in FORWARD_POINTERS), ()
    if options.local:
        pointers, workspace = pointers + ("tile_counter",), (("tile_counter", (1,), "int32"),)
    if tail_ctas:  # a slot for each (tail tile, CTA) that meet; a counter for each tail tile's warps
        slots, warps = tiles - tail_start + tail_ctas - 1, 4 * kernel.consumers
        pointers += ("partial_o", "partial_lse", "arrivals")
        workspace = (("partial_o", (slots, kernel.block_m, head_dim), "float32"),
                     ("partial_lse", (slots, kernel.block_m), "float32"),
                     ("arrivals", (tiles - tail_start, warps), "int32"))
    params = Sm90Params(p=p, batch=batch, section=section, tail_start=tail_start, tail_ctas=tail_ctas,
                        tail_key_tiles=key_tiles)
    counters = tuple(name for name, _, _ in workspace if name in ("tile_counter", "arrivals"))
    return Plan(bytes(params), pointers, steps, Sm90Params, workspace, tuple(maps), counters)


# Without a mask (every tile as long) the tiles that do not fill the last wave are cut along
# their keys among more CTAs (fwd.cu's tile scheduler, sm90/tile_scheduler.cuh), each piece's
# result merged by the last to finish. Each tile of the tail goes to the same number of
# CTAs, so that every share is a piece of one tile and the pieces of a head's tiles cover
# the same keys at the same time: shared out evenly over all CTAs (Stream-K's way), the
# shares start at different keys in each tile, the tiles of a head no longer read their K
# and V together from L2, and a batch of one with 1k query rows over 64k keys ran 0.57x
# uncut (H100). A share takes SM90_TAIL_MIN_TURNS key tiles at least, a tile goes to
# SM90_TAIL_MAX_PIECES pieces at most (the merging warp reads them all), and the cut is
# made where a share and SM90_TAIL_PIECE_TURNS (a piece's own costs: its Q, the ring
# filling, its result stored and merged; fitted to the H100's: d 64 with 16 key tiles a
# tile in 3 pieces 0.99-1.00x, with 32 1.01-1.02x, d 64 1k in 2 pieces of 4 0.96-0.99x)
# are fewer turns than a tile.
SM90_TAIL_MIN_TURNS = 4
SM90_TAIL_MAX_PIECES = 16
SM90_TAIL_PIECE_TURNS = 6


def sm90_tail(tiles: int, key_tiles: int, multiprocessors: int) -> tuple[int, int]:
    """(tail_start, tail_ctas): the first tile of the last wave, when ``tiles`` of
    ``key_tiles`` key tiles each run on ``multiprocessors`` CTAs, and the CTAs that share
    out its key tiles, as many for each; (tiles, 0) where it is not cut (a full last wave,
    a CTA a tile, more than half the CTAs busy, too little to gain)."""
    if not multiprocessors or tiles % multiprocessors == 0:
        return tiles, 0
    start = tiles - tiles % multiprocessors
    tail = tiles - start
    pieces = min(multiprocessors // tail, key_tiles // SM90_TAIL_MIN_TURNS, SM90_TAIL_MAX_PIECES)
    ctas, units = tail * pieces, tail * key_tiles
    if pieces < 2 or units * ctas >= 2 ** 31 or -(-key_tiles // pieces) + SM90_TAIL_PIECE_TURNS >= key_tiles:
        return tiles, 0  # (the kernel's shares: 32-bit products of units and CTAs)
    return start, ctas


def sm90_section(window: tuple[int, int], seqlen_q: int, seqlen_k: int, head_dim: int, heads_per_kv: int,
                 pairs: int) -> int:
    """(head, sequence) pairs whose tiles the sm_90a scheduler interleaves, the longest
    first (fwd.cu, Sm90Tiles). Where a tile's keys grow with its query block (a causal
    mask, any window unbounded on the left and bounded on the right) and there are
    SM90_SECTION_ROWS query rows or more: at most as many pairs as keep their K and V
    within SM90_SECTION_BYTES of L2 (whole groups of heads sharing keys), in sections of
    equal size. Otherwise one, pair after pair."""
    if window[0] != -1 or window[1] == -1 or seqlen_q < SM90_SECTION_ROWS:
        return 1
    kv_heads = max(1, SM90_SECTION_BYTES // (4 * seqlen_k * head_dim))  # K and V, 2 bytes an element
    return group_size(pairs, kv_heads * heads_per_kv)


def group_size(pairs: int, most: int) -> int:
    """The size of the tile-major order's groups (tile_major in cuda/common.cuh) of at most
    ``most`` of ``pairs`` (head, sequence) pairs, as few groups as that allows, of equal
    size: a short last group would run its long tiles alone."""
    groups = -(-pairs // max(1, most))
    return -(-pairs // groups)


def backward(dout: ArrayInfo, q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, out: ArrayInfo, dq: ArrayInfo,
             dk: ArrayInfo, dv: ArrayInfo, dq_accum: ArrayInfo | None, options: Options, varlen: Varlen | None,
             shared_limit: int, sm90a: bool = False) -> Plan:
    """dq, dk, dv: the one-pass kernel (dQ by atomics into ``dq_accum``) where it has a
    tile, else the dQ pass and the dK/dV pass (bitwise reproducible); with ``sm90a`` (a
    compute capability 9.0 device) the sm_90a backward where it takes the call."""
    p, batch = _params(q, k, v, options, varlen, o=out, dout=dout, dq=dq, dk=dk, dv=dv)
    vec = vectorizable(dout, q, k, v, dq, dk, dv)
    nheads_kv = k.shape[-2]
    rows_per_batch = p.seqlen_q if varlen is None else q.shape[0]
    groups = batch if varlen is None else 1
    tasks = groups * rows_per_batch * p.nheads
    one_pass = dq_accum is not None and has_tile("backward", p.headdim, options.extras, shared_limit)
    accum_cols = dq_accum.shape[2] * dq_accum.shape[-1] if one_pass else 0  # (rows / 8, nheads, cols / 8, 8, 8)
    # Lanes per (row, head) of the elementwise kernels: one per 16 bytes of the row, 4-32.
    lanes = min(32, max(4, 1 << (-(-p.headdim // 8) - 1).bit_length()))
    per_row = (groups, rows_per_batch, accum_cols, lanes)
    elementwise_grid = (-(-tasks * lanes // 256), 1, 1)
    preprocess_grid = (-(-(-(-tasks // PREPROCESS_ROWS)) * lanes // 256), 1, 1)
    if sm90a and one_pass and sm90_backward_takes(dout, q, k, v, dq, dk, dv, options):
        kernel = Sm90Backward.of(q.dtype, next(d for d in SM90_BACKWARD_TILES if d >= p.headdim), options.local)
        steps = []
        if tasks:
            steps.append(Step(Elementwise("backward_preprocess", q.dtype), preprocess_grid, per_row, argument="p"))
        if batch and p.seqlen_k and nheads_kv:
            steps.append(Step(kernel, (-(-p.seqlen_k // kernel.block_n), nheads_kv, batch)))
        if tasks:
            steps.append(Step(Elementwise("backward_convert_dq", q.dtype), elementwise_grid, per_row, argument="p"))
        maps = tuple(_tensor_map(name, a, varlen, rows) for name, a, rows in
                     (("q", q, kernel.block_m), ("k", k, kernel.block_n), ("v", v, kernel.block_n),
                      ("dout", dout, kernel.block_m)))
        params = Sm90BackwardParams(p=p, batch=batch, accum_cols=accum_cols)
        return Plan(bytes(params), tuple(f"p.{n}" for n in BACKWARD_POINTERS), tuple(steps), Sm90BackwardParams,
                    maps=maps)
    steps = []
    if tasks:
        steps.append(Step(Elementwise("backward_preprocess", q.dtype), preprocess_grid, per_row))
        if not one_pass:
            kernel = _kernel("backward_dq", q, options, vec, shared_limit)
            steps.append(Step(kernel, kernel.grid(p.seqlen_q, p.nheads, batch), (), batch * p.nheads))
    if batch and p.seqlen_k and nheads_kv:
        kernel = _kernel("backward" if one_pass else "backward_dkdv", q, options, vec, shared_limit)
        # (backward_dkdv goes head by head: no tile group)
        steps.append(Step(kernel, kernel.grid(p.seqlen_k, nheads_kv, batch), (), batch * nheads_kv * one_pass))
    if tasks and one_pass:
        steps.append(Step(Elementwise("backward_convert_dq", q.dtype), elementwise_grid, per_row))
    # dq_accum stays unset without the one-pass kernel: nothing reads it then.
    pointers = BACKWARD_POINTERS if one_pass else BACKWARD_POINTERS[:-1]
    return Plan(bytes(p), pointers, tuple(steps))


def sm90_backward_takes(dout: ArrayInfo, q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, dq: ArrayInfo, dk: ArrayInfo,
                        dv: ArrayInfo, options: Options) -> bool:
    """Does the sm_90a backward take this call (dQ by atomics: not deterministic)? Head dims
    64 to 128 without softcap, ALiBi or dropout; arrays the copy engine can read (16-byte
    aligned, head dim contiguous, every stride a multiple of 16 bytes)."""
    if not 64 <= q.shape[-1] <= max(SM90_BACKWARD_TILES) or q.dtype not in DTYPES or options.extras:
        return False
    return vectorizable(dout, q, k, v, dq, dk, dv) and all(a.strides[-1] == 1 for a in (dout, q, k, v))


def _tensor_map(name: str, a: ArrayInfo, varlen: Varlen | None, rows: int) -> TensorMapSpec:
    """The map of the struct's field ``name`` over ``a`` (packed arrays as one batch of all rows)."""
    shape, strides = (a.shape, a.strides) if varlen is None else ((1, *a.shape), (a.shape[0] * a.strides[0], *a.strides))
    return TensorMapSpec(name, f"p.{name}", a.dtype, tuple(shape), tuple(strides), rows)


DECODE_POINTERS = ("q", "o", "k_cache", "v_cache", "k_new", "v_new", "lse", "partial_o", "partial_lse",
                   "cache_seqlens", "cache_batch_idx", "cache_leftpad", "block_table", "rotary_cos", "rotary_sin",
                   "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k", "merge.parts", "merge.lses", "merge.out",
                   "merge.out_lse")
MAX_SPLITS = 256
# Parts of a sequence's keys in a deterministic call: each sequence's tiles cut into
# min(DETERMINISTIC_PARTS, tiles / MIN_SPLIT_TILES) parts (as many as a batch of one needs to
# fill the GPU), whatever the batch and the splits.
DETERMINISTIC_PARTS = 16
# Key tiles a split takes at least: a split's fixed costs (its lengths, Q, the first load's
# latency, its partial result and its share of the merge) are those of a few tiles; with
# two CTAs a multiprocessor, of more.
MIN_SPLIT_TILES = 4
SPLIT_TILES_TWO_PER_SM = 8


def decode(q: ArrayInfo, k_cache: ArrayInfo, v_cache: ArrayInfo, k: ArrayInfo | None, v: ArrayInfo | None,
           out: ArrayInfo, cache: KVCache, options: Options, shared_limit: int, multiprocessors: int,
           varlen: Varlen | None = None, clusters: bool = False, dependent_launch: bool = False) -> Plan:
    """The KV-cache call: the split kernel, then, with more than one part of the keys, the
    merge of their results (the workspace's partial_o and partial_lse) into ``out``; or,
    where the GPU has thread block ``clusters`` (sm_90), the splits of a row block merge in
    their cluster. With ``dependent_launch`` (sm_90) the merge kernel is launched as a
    programmatic dependent of the split kernel: it starts as the splits finish their keys
    and reads nothing before the split kernel has ended. (The split kernel launched so
    after the kernel before it gained nothing: H200, GQA 32/8 d 128 batch 1, 1,520 against
    1,549 GB/s at 4k keys, 2,590 against 2,706 at 16k, where the next call's clusters
    started beside the last one's merge; docs/tuning.md.) The launch is given
    DECODE_POINTERS: the merge's parts and lses are the workspace, its out and out_lse the
    call's. With ``varlen``, the varlen call over a paged cache: q and out packed
    (total_q, nheads, d), sequence b's keys the first cu_seqlens_k[b + 1] - cu_seqlens_k[b]
    rows of its pages (cu_seqlens_q and cu_seqlens_k given at launch)."""
    if varlen is None:
        batch, seqlen_q, nheads, head_dim = q.shape
        query_rows = batch * seqlen_q
    else:
        (query_rows, nheads, head_dim), batch, seqlen_q = q.shape, varlen.batch, varlen.max_seqlen_q
    nheads_k = k_cache.shape[2]
    p = DecodeParams()
    for name, a in dict(q=q, o=out, k_cache=k_cache, v_cache=v_cache, k_new=k, v_new=v).items():
        setattr(p, name, _view(a))
    p.seqlen_cache_all = cache.cache_seqlens if isinstance(cache.cache_seqlens, int) else 0
    p.caches, p.capacity = k_cache.shape[0], cache.capacity
    p.page_size = cache.page_size or cache.capacity
    if cache.block_table is not None:
        p.block_table_stride = cache.block_table.strides[0]
    p.seqlen_q, p.seqlen_new, p.nheads, p.headdim = seqlen_q, cache.seqlen_new, nheads, head_dim
    p.query_rows = query_rows
    # The LSE: (batch, nheads, seqlen_q), or (nheads, total_q) packed
    p.lse_batch_stride, p.lse_head_stride = (nheads * seqlen_q, seqlen_q) if varlen is None else (0, query_rows)
    p.heads_per_kv = nheads // max(nheads_k, 1)
    if cache.rotary_cos is not None:
        p.rotary_rows, p.rotary_dim = cache.rotary_cos.shape[0], 2 * cache.rotary_cos.shape[1]
        p.rotary_interleaved, p.rotary_float32 = cache.rotary_interleaved, cache.rotary_cos.dtype == "float32"
    if options.alibi is not None:
        p.alibi_batch_stride = options.alibi.strides[0] if len(options.alibi.shape) == 2 else 0
    p.window_left, p.window_right = options.window
    p.scale, p.scale_log2, p.softcap = options.scale, scale_log2(options.scale), options.softcap
    extras = options.softcap > 0 or options.alibi is not None
    vectorized = vectorizable(*(a for a in (q, k_cache, v_cache, k, v, out) if a is not None))
    chosen = kernel("decode", q.dtype, head_dim, options.local, vectorized, extras, shared_limit)
    row_blocks = -(-p.heads_per_kv * seqlen_q // chosen.tile.block_m)
    tiles = -(-cache.capacity // chosen.tile.block_n)
    # Pages shorter than a tile and not a whole number of runs are copied row by row.
    def row_by_row(k: Kernel) -> bool:
        return 0 < cache.page_size < k.tile.block_n and cache.page_size % copy_run_rows(k.head_dim, k.tile) != 0
    small_pages = row_by_row(chosen)
    splits = cache.num_splits or decode_splits(batch * nheads_k * row_blocks, tiles, multiprocessors, small_pages)
    parts = splits
    p.max_parts, p.min_part_tiles = DETERMINISTIC_PARTS, MIN_SPLIT_TILES
    if cache.deterministic:  # each sequence's parts from its own tiles; the workspace holds the most
        p.deterministic = 1
        parts = min(DETERMINISTIC_PARTS, -(-tiles // MIN_SPLIT_TILES))
        splits = min(splits, parts)
    p.num_splits, p.parts = splits, parts
    if not (batch and seqlen_q and nheads and query_rows):
        return Plan(bytes(p), DECODE_POINTERS, (), DecodeParams)
    # An unsplit grid takes the wide tile, except in a deterministic call (one kernel
    # whatever the grid: its bits may not depend on the batch) and over pages copied row
    # by row (MHA, d 128, pages of 16 rows before they were copied in runs, batch 64 and
    # 4k keys read 2,824 GB/s with it, 3,730 without).
    if parts == 1 and not cache.deterministic and has_tile("decode_wide", head_dim, extras, shared_limit):
        wide = kernel("decode_wide", q.dtype, head_dim, options.local, vectorized, extras, shared_limit)
        if not row_by_row(wide):
            chosen = wide
    grid = (splits * row_blocks, nheads_k, batch)
    # Clusters where the grid is one wave of a CTA a multiprocessor (H200, GQA 32/8 d 128,
    # graph replay: batch 1 and 4k keys, 16 splits, 1,374 GB/s against 1,071 with the merge
    # kernel; 16k 2,470 against 2,181). With two CTAs a multiprocessor they ran 0.78-0.87x
    # (batch 4 at 16k keys, MHA at 4k): a cluster's CTAs wait for its slowest at the
    # merge, holding their multiprocessors. A deterministic call merges in the merge
    # kernel's order whatever its splits.
    ctas = splits * row_blocks * nheads_k * batch
    if clusters and not cache.deterministic and 1 < splits <= MAX_CLUSTER_SPLITS and ctas <= multiprocessors:
        clustered = kernel("decode_cluster", q.dtype, head_dim, options.local, vectorized, extras, shared_limit)
        return Plan(bytes(p), DECODE_POINTERS, (Step(clustered, grid, cluster=splits),), DecodeParams)
    steps = [Step(chosen, grid)]
    workspace = ()
    if parts > 1:
        # Parts (parts, query rows, nheads, d) and LSEs (parts, nheads, query rows), the
        # query rows of a dense call being (batch, seqlen_q), of a packed one q's rows (a
        # batch of one sequence of total_q, whose LSE layout is the packed call's).
        m = p.merge
        m_batch, m_seqlen = (batch, seqlen_q) if varlen is None else (1, query_rows)
        m.count, m.batch, m.seqlen_q, m.nheads, m.headdim = parts, m_batch, m_seqlen, nheads, head_dim
        m.head_stride, m.row_stride = head_dim, nheads * head_dim
        m.batch_stride, m.part_stride = m_seqlen * m.row_stride, query_rows * m.row_stride
        m.lse_head_stride, m.lse_batch_stride, m.lse_part_stride = query_rows, m_seqlen, nheads * query_rows
        out_strides = out.strides if len(out.shape) == 4 else (0, *out.strides)
        m.out_batch_stride, m.out_row_stride, m.out_head_stride = out_strides[:3]
        workspace = (("partial_o", (parts, query_rows, nheads, head_dim), "float32"),
                     ("partial_lse", (parts, nheads, query_rows), "float32"))
        steps.append(Step(Merge("float32", q.dtype), _merge_grid(query_rows * nheads), argument="merge",
                          dependent=dependent_launch))
    return Plan(bytes(p), DECODE_POINTERS, tuple(steps), DecodeParams, workspace)


def decode_splits(ctas: int, tiles: int, multiprocessors: int, small_pages: bool = False) -> int:
    """Splits of the keys for a KV-cache call whose unsplit grid has ``ctas`` CTAs, over a
    cache of ``tiles`` key tiles, from the shapes alone (no sequence's length: those stay on
    the device). A grid that fills half the multiprocessors is not split (the merge would
    cost more than it brings), nor, with ``small_pages`` (pages copied row by row: shorter
    than a key tile and not a whole number of runs, copy_run_rows; a longer wait a tile),
    one that fills two CTAs a multiprocessor;
    else two CTAs a multiprocessor where that leaves a split SPLIT_TILES_TWO_PER_SM tiles,
    or one, each MIN_SPLIT_TILES tiles or more; then as few splits as take the same tiles
    each (no split left empty). Measured on the H200 (GQA 32/8 and MHA, d 128, graph
    replay, GB/s by splits; docs/tuning.md): batch 1 GQA, 16 splits (1 CTA a
    multiprocessor) beat 8, 24 and 32 at 4k and 16k keys, tie 24-32 at 64k; batch 1 MHA and
    batch 4 GQA, 8 splits (2 a multiprocessor) beat 5, 12 and 16; batch 16 GQA, one split
    beat two by 6% at 4k keys and tied at 16k, but with pages of 16 rows two beat one by
    1.5-1.7x."""
    if ctas == 0 or 2 * ctas >= multiprocessors * (4 if small_pages else 1):
        return 1
    splits = 2 * multiprocessors // ctas
    if tiles < SPLIT_TILES_TWO_PER_SM * splits:
        splits = multiprocessors // ctas
    splits = max(1, min(splits, -(-tiles // MIN_SPLIT_TILES), MAX_SPLITS))
    return -(-tiles // -(-tiles // splits))


MERGE_POINTERS = ("parts", "lses", "out", "out_lse")


def merge(parts: ArrayInfo, lses: ArrayInfo, out: ArrayInfo) -> Plan:
    """merge_states of stacked parts (parts, batch, seqlen_q, nheads, d) with their LSEs
    (parts, batch, nheads, seqlen_q) into ``out`` (batch, seqlen_q, nheads, d) and a
    contiguous LSE (batch, nheads, seqlen_q)."""
    count, batch, seqlen_q, nheads, head_dim = parts.shape
    m = MergeParams()
    m.count, m.batch, m.seqlen_q, m.nheads, m.headdim = count, batch, seqlen_q, nheads, head_dim
    m.part_stride, m.batch_stride, m.row_stride, m.head_stride = parts.strides[:4]
    m.lse_part_stride, m.lse_batch_stride, m.lse_head_stride = lses.strides[:3]
    m.out_batch_stride, m.out_row_stride, m.out_head_stride = out.strides[:3]
    rows = batch * seqlen_q * nheads
    steps = (Step(Merge(parts.dtype, out.dtype), _merge_grid(rows)),) if rows and head_dim else ()
    return Plan(bytes(m), MERGE_POINTERS, steps, MergeParams)


def _merge_grid(rows: int) -> tuple[int, int, int]:
    return (rows, 1, 1)


def backward_workspace(q_shape, deterministic: bool = False,
                       extras: bool = False) -> dict[str, tuple[tuple[int, ...], str]]:
    """Scratch buffers of the backward (contents on entry do not matter): D = rowsum(dO * O),
    laid out like the LSE, and, unless ``deterministic``, dQ's fp32 accumulator in 8 x 8
    blocks, (rows / 8, nheads, head-dim bucket / 8, 8, 8) (dq_accum.cuh, DqAccum), where the
    one-pass kernel has a tile for this head dim and ``extras`` (softcap, ALiBi or dropout on)."""
    *rows, nheads, head_dim = q_shape
    work = {"delta": (((rows[0], nheads, rows[1]) if len(rows) == 2 else (nheads, rows[0])), "float32")}
    bucket = head_dim_bucket(head_dim)
    if not deterministic and KINDS["backward"].candidates(bucket, extras):
        work["dq_accum"] = ((-(-math.prod(rows) // 8), nheads, bucket // 8, 8, 8), "float32")
    return work


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


def _kernel(kind: str, q: ArrayInfo, options: Options, vectorized: bool, shared_limit: int) -> Kernel:
    return kernel(kind, q.dtype, q.shape[-1], options.local, vectorized, options.extras, shared_limit)


def _view(a: ArrayInfo | None) -> ArrayView:
    if a is None:
        return ArrayView()
    strides = a.strides if len(a.shape) == 4 else (0, *a.strides)  # packed: no batch stride
    return ArrayView(0, *strides[:3])


def _params(q, k, v, options: Options, varlen: Varlen | None, **arrays) -> tuple[Params, int]:
    """The Params of a call but its array pointers, and the number of (batch) sequences."""
    p = Params()
    for name, a in dict(q=q, k=k, v=v, **arrays).items():
        setattr(p, name, _view(a))
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


def pointer_offsets(struct: type, names: tuple[str, ...]) -> tuple[int, ...]:
    """Where each named pointer lies in the struct (an ArrayView's pointer is its first field)."""
    return tuple(field_offset(struct, name) for name in names)
