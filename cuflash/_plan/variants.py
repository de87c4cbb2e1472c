"""The catalog: every kernel variant cuflash can compile, as values with one interface
(``Variant``: the source file, the template instance, the arch it needs, threads, dynamic
shared memory), and the tile tables of the tiled kinds. The sm_90a variants live with
their family (``sm90``); ``all_kernels`` (the package) lists every family's."""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Protocol


class Variant(Protocol):
    """What the launcher and the compile sweep need of a variant: ``source`` (a file of
    ``cuda/``), ``instance`` (the template instance, by name), ``arch`` (the arch it needs;
    "": the device's own), ``threads`` (a CTA's) and ``shared_bytes`` (dynamic shared memory);
    where they apply, ``mods`` (CUDA text compiled in front of the source) and ``clustered``
    (launched in thread block clusters)."""
    source: str
    instance: str
    arch: str
    threads: int
    shared_bytes: int


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
# The KV-cache call (decode/split_kv.cu): 16 packed query rows + stages x (K tile + V tile);
# the warps split each key tile, 16 keys each. Two stages of about 32 KB let three CTAs share
# a multiprocessor (d 128) and hide each other's latencies (tuning.md, "KV-cache decode").
DECODE_TILES = {
    **{d: (_T(16, 128, 4, 2),) for d in (32, 64)},
    **{d: (_T(16, 64, 4, 2),) for d in (96, 128)},
    **{d: (_T(16, 32, 2, 2),) for d in (160, 192, 224, 256)},
}


# Grids that are not split take eight warps over 128-key tiles: two warps a scheduler hide a
# tile's chain of dependent instructions, where one issued it alone. Split grids keep
# DECODE_TILES (a split would hold half the tiles), as do pages shorter than 128 rows (decode);
# tuning.md, "KV-cache decode".
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
        # 32 query rows a warp up to d 128: each K/V fragment read feeds two m16 tiles. 32-key
        # tiles at d 128 (a 64-key S spills); d 96's 64-key tiles go 32 keys a step with softcap,
        # ALiBi or dropout (fwd.cu, kSubN). Above d 128 O fits 16 rows a warp, and one K and one V
        # buffer let two CTAs share an SM (FlashAttention-2's); tuning.md, "Forward tiles per head dim".
        32: (_T(128, 64, 4, 2),), 64: (_T(128, 64, 4, 2),), 96: (_T(128, 64, 4, 2),), 128: (_T(128, 32, 4, 2),),
        **{d: (_T(64, 64, 4, 1), _T(64, 32, 4, 1)) for d in (160, 192, 224, 256)},
    }, lambda t, d: (t.block_m + 2 * t.stages * t.block_n) * _row_bytes(d), "block_m", False, "ForwardShared"),
    # One-pass backward, dQ by atomics. K and V tiles + stages x (Q tile + dO tile + LSE + D)
    # + P and dS tiles. Warps own 32 rows of each product (bwd_one_pass.cu) and multiples of 8
    # columns of dK, dV and dQ (24 at d 96, 40 at d 160: an odd n8 tile, mma.cuh).
    # Softcap, ALiBi, dropout and the mods spill the larger tiles: 64 x 64 at every head dim
    # (1.3-1.5x the two-kernel path's forward + backward at d 64 and 128). Three Q/dO buffers
    # at d 64 where shared memory allows: they gained there and lost at d 128 (tuning.md,
    # "Backward structure").
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
        extras_tiles={d: (_T(64, 64, 8, 2), _T(64, 64, 8, 1)) for d in HEAD_DIM_BUCKETS}),
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
    # results in shared memory (sm_90): no merge kernel, no workspace. Two stages: larger CTAs
    # leave a 16-CTA cluster waiting for room in one GPC (tuning.md, "KV-cache decode").
    "decode_cluster": Kind("decode/split_kv.cu", "attention_decode", DECODE_TILES, _decode_cluster_shared, "block_m",
                           False, "ClusterDecodeShared", suffix=("true",), clustered=True),
}

# Untiled helpers of the backward, one instance per dtype.
ELEMENTWISE = {"backward_preprocess": ("bwd.cu", "attention_backward_preprocess", 256),
               "backward_convert_dq": ("bwd.cu", "attention_backward_convert_dq", 256),
               "backward_convert_dq_by_head": ("bwd.cu", "attention_backward_convert_dq_by_head", 256),
               "backward_convert_dq_transposed": ("bwd.cu", "attention_backward_convert_dq_transposed", 256),
               "backward_convert_dq_transposed_by_head": ("bwd.cu", "attention_backward_convert_dq_transposed_by_head",
                                                          256)}


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
    extras: bool  # softcap, ALiBi, dropout or mods
    mods: str = ""  # the call's score_mod / mask_mod as CUDA text (cuflash.mod.kernel_source), or ""
    arch = ""  # the device's own

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
        if self.mods:  # (the struct self.mods defines; mods.cuh)
            args.append("cuflash::UserMods")
        return f"cuflash::{kind.template}<{', '.join(map(str, args))}>"

    @property
    def shared_bytes(self) -> int:
        return KINDS[self.kind].shared_bytes(self.tile, self.head_dim)

    @property
    def clustered(self) -> bool:
        return KINDS[self.kind].clustered

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
    arch = ""

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
    arch = ""
    threads = 32 * MERGE_WARPS
    shared_bytes = 0

    @property
    def instance(self) -> str:
        return f"cuflash::merge_states<{MERGE_DTYPES[self.parts_dtype]}, {MERGE_DTYPES[self.out_dtype]}>"


def has_tile(kind: str, head_dim: int, extras: bool, shared_limit: int) -> bool:
    """Does ``kind`` have an instance for this head dim and extras within this much
    shared memory?"""
    bucket = head_dim_bucket(head_dim)
    return any(KINDS[kind].shared_bytes(t, bucket) <= shared_limit for t in KINDS[kind].candidates(bucket, extras))


@functools.cache  # the plan of a call signature never changes: look it up once
def kernel(kind: str, dtype: str, head_dim: int, local: bool, vectorized: bool, extras: bool,
           shared_limit: int, mods: str = "") -> Kernel:
    bucket = head_dim_bucket(head_dim)
    for tile in KINDS[kind].candidates(bucket, extras):
        if KINDS[kind].shared_bytes(tile, bucket) <= shared_limit:
            return Kernel(kind, dtype, bucket, tile, local, vectorized, extras, mods)
    raise RuntimeError(f"no {kind} tile for head dim {bucket} fits {shared_limit} bytes of shared memory")
