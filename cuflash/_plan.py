"""Which kernel runs: variant, tile shape, grid and shared memory from shapes and arch.

This is the one dispatch table. A variant is a template instance of one of the
tiled kernels in ``cuda/`` (``KINDS``); its tile shape is the first entry of the
kind's table, per head-dim bucket, whose shared memory fits the arch. Register
budgets behind these choices are checked by ``python -m cuflash compile``.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Callable

HEAD_DIM_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]
DTYPES = {"float16": "cuflash::half_t", "bfloat16": "cuflash::bfloat16_t"}

# Opt-in dynamic shared memory per block (CUDA programming guide, "Compute
# Capabilities"); used when there is no device to ask, e.g. compile-all in CI.
SHARED_MEMORY_LIMIT = {
    "sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_87": 163 * 1024, "sm_89": 99 * 1024,
    "sm_90": 227 * 1024, "sm_100": 227 * 1024, "sm_120": 99 * 1024,
}


@dataclasses.dataclass(frozen=True)
class Tile:
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


@dataclasses.dataclass(frozen=True)
class Kind:
    source: str
    template: str
    tiles: dict[int, tuple[Tile, ...]]  # head-dim bucket -> candidates, preferred first
    shared_bytes: Callable[[Tile, int], int]
    grid_rows: str  # the tile dimension the grid's x runs over: "block_m" or "block_n"
    has_col_split: bool
    # Tiles of the instances with softcap, ALiBi or dropout where they differ (None: the same).
    extras_tiles: dict[int, tuple[Tile, ...]] | None = None

    def candidates(self, bucket: int, extras: bool) -> tuple[Tile, ...]:
        tiles = self.extras_tiles if extras and self.extras_tiles is not None else self.tiles
        return tiles.get(bucket, ())


_T = Tile
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
    }, lambda t, d: (t.block_m + 2 * t.stages * t.block_n) * _row_bytes(d), "block_m", False),
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
                     + 2 * t.block_m * (t.block_n + 8) * 2), "block_n", False,
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
        "block_n", True),
    # Q tile + dO tile + stages x (K tile + V tile)
    "backward_dq": Kind("bwd_two_kernel.cu", "attention_backward_dq", {
        32: (_T(64, 128, 4, 2),), 64: (_T(64, 64, 4, 2),), 96: (_T(64, 64, 4, 2),),
        128: (_T(64, 32, 4, 2), _T(64, 32, 4, 1)),
        **{d: (_T(64, 32, 4, 2), _T(64, 32, 4, 1), _T(32, 32, 2, 1)) for d in (160, 192, 224, 256)},
    }, lambda t, d: (2 * t.block_m + 2 * t.stages * t.block_n) * _row_bytes(d), "block_m", True),
}

# Untiled helpers of the backward, one instance per dtype.
ELEMENTWISE = {"backward_preprocess": ("bwd.cu", "attention_backward_preprocess", 256),
               "backward_convert_dq": ("bwd.cu", "attention_backward_convert_dq", 256)}


def head_dim_bucket(head_dim: int) -> int:
    return next(b for b in HEAD_DIM_BUCKETS if head_dim <= b)


def shared_memory_limit(arch: str) -> int:
    return SHARED_MEMORY_LIMIT.get(arch, 99 * 1024)


@dataclasses.dataclass(frozen=True)
class Kernel:
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
        return f"cuflash::{kind.template}<{', '.join(map(str, args))}>"

    @property
    def shared_bytes(self) -> int:
        return KINDS[self.kind].shared_bytes(self.tile, self.head_dim)

    @property
    def threads(self) -> int:
        return self.tile.warps * 32

    def grid(self, rows: int, heads: int, batch: int) -> tuple[int, int, int]:
        """Tiles over ``rows`` (query rows, or key rows for dK/dV), heads, batch."""
        tile_rows = getattr(self.tile, KINDS[self.kind].grid_rows)
        return (-(-rows // tile_rows), heads, batch)


@dataclasses.dataclass(frozen=True)
class Elementwise:
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


def all_kernels(arch: str) -> list[Kernel | Elementwise]:
    """Every variant cuflash can launch on ``arch``."""
    limit = shared_memory_limit(arch)
    flags = (False, True)
    tiled = [kernel(kind, dtype, bucket, local, vec, extras, limit)
             for kind, dtype, bucket, local, vec, extras in
             itertools.product(KINDS, DTYPES, HEAD_DIM_BUCKETS, flags, flags, flags)
             if has_tile(kind, bucket, extras, limit)]
    return tiled + [Elementwise(kind, dtype) for kind, dtype in itertools.product(ELEMENTWISE, DTYPES)]


def covering_sample(archs: tuple[str, ...]) -> list[tuple[str, Kernel | Elementwise]]:
    """A few (arch, variant) pairs that between them reach every template branch of
    ``all_kernels``: each kind with every head-dim bucket and tile, every combination
    of its flags (band, vectorized, extras), each dtype, each arch with each (band,
    extras) pair, and every elementwise instance. A compile of these catches what a
    compile of everything would, in a tenth of the time (44 of 968 for sm_80 + sm_90)."""
    def reaches(arch: str, k: Kernel | Elementwise) -> set:
        if isinstance(k, Elementwise):
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
