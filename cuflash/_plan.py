"""Which kernel runs: variant, tile shape, grid and shared memory from shapes and arch.

This is the one dispatch table. A variant is a template instance of
``attention_forward`` in ``cuda/fwd.cu``; the tile shape is chosen per head-dim
bucket as the first entry of ``FORWARD_TILES`` whose shared memory fits the arch.
"""
from __future__ import annotations

import dataclasses
import itertools

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
    """@block_m query rows per CTA, @block_n key rows per step, @warps warps per
    CTA (each owns block_m / warps rows, a multiple of 16), @stages K/V buffers."""
    block_m: int
    block_n: int
    warps: int
    stages: int

    def shared_bytes(self, head_dim: int) -> int:
        # Q tile + stages x (K tile + V tile), rows padded by 8 elements (copy.cuh).
        return (self.block_m + 2 * self.stages * self.block_n) * (head_dim + 8) * 2


# Candidates in order of preference; the first that fits the arch is used.
FORWARD_TILES = {
    32: (Tile(128, 64, 4, 2),),
    64: (Tile(128, 64, 4, 2),),
    96: (Tile(64, 64, 4, 2),),
    128: (Tile(64, 64, 4, 2),),
    160: (Tile(64, 64, 4, 2), Tile(64, 32, 4, 2)),
    192: (Tile(64, 64, 4, 2), Tile(64, 32, 4, 2)),
    224: (Tile(64, 64, 4, 2), Tile(64, 32, 4, 2)),
    256: (Tile(64, 64, 4, 2), Tile(64, 32, 4, 2), Tile(64, 32, 4, 1)),
}


def head_dim_bucket(head_dim: int) -> int:
    return next(b for b in HEAD_DIM_BUCKETS if head_dim <= b)


def shared_memory_limit(arch: str) -> int:
    return SHARED_MEMORY_LIMIT.get(arch, 99 * 1024)


def forward_tile(bucket: int, shared_limit: int) -> Tile:
    for tile in FORWARD_TILES[bucket]:
        if tile.shared_bytes(bucket) <= shared_limit:
            return tile
    raise RuntimeError(f"no forward tile for head dim {bucket} fits {shared_limit} bytes of shared memory")


@dataclasses.dataclass(frozen=True)
class ForwardKernel:
    """One template instance of attention_forward with its launch shape."""
    dtype: str
    head_dim: int  # bucket
    tile: Tile
    causal: bool
    vectorized: bool

    @property
    def instance(self) -> str:
        t = self.tile
        flags = ", ".join("true" if f else "false" for f in (self.causal, self.vectorized))
        return (f"cuflash::attention_forward<{DTYPES[self.dtype]}, {self.head_dim}, "
                f"{t.block_m}, {t.block_n}, {t.warps}, {t.stages}, {flags}>")

    @property
    def shared_bytes(self) -> int:
        return self.tile.shared_bytes(self.head_dim)

    @property
    def threads(self) -> int:
        return self.tile.warps * 32

    def grid(self, batch: int, nheads: int, seqlen_q: int) -> tuple[int, int, int]:
        return (-(-seqlen_q // self.tile.block_m), nheads, batch)


def forward_kernel(dtype: str, head_dim: int, causal: bool, vectorized: bool, shared_limit: int) -> ForwardKernel:
    bucket = head_dim_bucket(head_dim)
    return ForwardKernel(dtype, bucket, forward_tile(bucket, shared_limit), causal, vectorized)


def all_forward_kernels(arch: str) -> list[ForwardKernel]:
    """Every variant the forward can launch on ``arch``."""
    limit = shared_memory_limit(arch)
    return [forward_kernel(dtype, bucket, causal, vec, limit)
            for dtype, bucket, causal, vec in itertools.product(DTYPES, HEAD_DIM_BUCKETS, (False, True), (True, False))]
