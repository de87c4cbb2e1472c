"""The sm_90a family's plans and variants (cuda/sm90/: TMA, wgmma, warp specialisation;
compute capability 9.0 only): the forward (persistent grid, tile scheduler, the tail cut
along its keys) and the backward, what each takes, their tiles."""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from .._params import Params, Sm90BackwardModParams, Sm90BackwardParams, Sm90ModParams, Sm90Params
from .mma_sync import BACKWARD_POINTERS, FORWARD_POINTERS, backward_rows
from .plan import Plan, Step, call_params, group_size, tensor_map, vectorizable, with_mods
from .variants import DTYPES, Elementwise, head_dim_bucket

if TYPE_CHECKING:
    from .._arrays import ArrayInfo
    from .._options import Options, Varlen


class Sm90Forward(NamedTuple):
    """The sm_90a forward (cuda/sm90/fwd.cu: TMA, wgmma) for head dims up to ``head_dim``
    (64, 128, 192 or 256; a smaller one rides on the copy engine's zero columns): a producer
    warpgroup and ``consumers`` consumer warpgroups of 64 query rows, key tiles and K/V
    stages (SM90_TILES); ``extras``: softcap, ALiBi, dropout or mods may be on, ``mods`` the
    call's score_mod / mask_mod as CUDA text (cuflash.mod.kernel_source) or "", ``blocks``
    whether a block mask comes with them."""
    dtype: str
    head_dim: int
    local: bool
    extras: bool
    block_n: int  # keys a tile
    stages: int  # K/V tiles in flight
    consumers: int  # consumer warpgroups: 2 or 3
    mods: str = ""
    blocks: bool = False
    source = "sm90/fwd.cu"
    arch = "sm_90a"

    @classmethod
    def of(cls, dtype: str, head_dim: int, local: bool, extras: bool, short: bool = False,
           mods: str = "", blocks: bool = False, mod_tensors: bool = False) -> Sm90Forward:
        """The variant with the planner's tile (SM90_TILES; under a causal mask or a window
        SM90_BANDED_TILES, with softcap, ALiBi or dropout SM90_BANDED_EXTRAS_TILES, and
        ``short``, a causal or block-masked call of fewer than SM90_SHORT_CAUSAL_ROWS query
        rows, SM90_SHORT_CAUSAL_TILES, where they name the head dim; with mods SM90_MODS_TILES,
        which names the head dims whose calls with mods it takes, or on the plain instance
        (mask_mod alone with its block mask: not ``extras``) SM90_MASK_TILES, or where it loads
        from ``mod_tensors`` SM90_MASK_TENSOR_TILES)."""
        tile = SM90_TILES[head_dim]
        if local:
            tile = SM90_BANDED_TILES.get(head_dim, tile)
            tile = SM90_BANDED_EXTRAS_TILES.get(head_dim, tile) if extras else tile
            tile = SM90_SHORT_CAUSAL_TILES.get(head_dim, tile) if short else tile
        if mods:
            tile = mods_tile(head_dim, extras)
            if not extras and mod_tensors:
                tile = SM90_MASK_TENSOR_TILES.get(head_dim, tile)
            tile = SM90_SHORT_CAUSAL_TILES.get(head_dim, tile) if short and not extras else tile
        return cls(dtype, head_dim, local, extras, *tile, mods, blocks)

    @property
    def block_m(self) -> int:
        return 64 * self.consumers

    @property
    def key_bit_bytes(self) -> int:
        """With a block mask, two rounds' KeyTileBits (mods.cuh): two bit words and a count
        for each of MAX_KEY_TILE_BITS key tiles."""
        return 2 * (2 * MAX_KEY_TILE_BITS // 32 + 1) * 4 if self.blocks else 0

    @property
    def instance(self) -> str:
        mods = ", cuflash::UserMods" if self.mods else ""  # (the struct self.mods defines; mods.cuh)
        return (f"cuflash::attention_forward_sm90<{DTYPES[self.dtype]}, {self.head_dim}, {self.block_n}, "
                f"{self.consumers}, {self.stages}, {'true' if self.local else 'false'}, "
                f"{'true' if self.extras else 'false'}{mods}>")

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + 1)

    @property
    def shared_layout(self) -> str:
        bits = f", {self.key_bit_bytes}" if self.blocks else ""
        return f"cuflash::Sm90Shared<{self.head_dim}, {self.block_m}, {self.block_n}, {self.stages}{bits}>"

    @property
    def shared_bytes(self) -> int:
        """``Sm90Shared<...>::kBytes``: Q, the K and V stages, the barriers (a landed and a
        released one for Q and for each stage, or with two stages for each stage's K and V:
        kApart), the loaded tile's number (8 bytes), a sink word for each of up to 16 warps
        and 1024 bytes of alignment; with a block mask its key tiles' bits."""
        stage_barriers = (2 if self.stages == 2 else 1) * self.stages
        return (2 * self.head_dim * (self.block_m + 2 * self.stages * self.block_n) + (2 + 2 * stage_barriers) * 8
                + 8 + 16 * 4 + self.key_bit_bytes + 1024)

    def grid(self, rows: int, heads: int, batch: int, multiprocessors: int = 0) -> tuple[int, int, int]:
        """A CTA per tile, or at most one per multiprocessor (one fits: its registers), each
        taking tiles until none is left (fwd.cu, Sm90Tiles)."""
        tiles = -(-rows // self.block_m) * heads * batch
        return (min(tiles, multiprocessors) if multiprocessors else tiles), 1, 1


# The sm_90a forward runs on a persistent grid (a CTA a multiprocessor): the producer loads
# the next tile's Q and keys while the consumers finish a tile. Tiles alike go in turn; under a
# causal mask or a window, whose tiles differ in length, each CTA takes the next from a counter
# as it gets free (static shares came out uneven); tuning.md, "The Hopper forward".

# Under a causal mask, from SM90_SECTION_ROWS query rows, the scheduler takes the longest tiles
# first across a section of (head, sequence) pairs whose K and V fit SM90_SECTION_BYTES of L2
# (sm90_section, fwd.cu's Sm90Tiles): 16 MiB was best or within 1% from 2k rows, and below 2k
# sections gained nothing (tuning.md, "The Hopper forward").
SM90_SECTION_BYTES = 16 << 20
SM90_SECTION_ROWS = 2048
# Head dim -> (keys a tile, K/V stages, consumer warpgroups), after FlashAttention-3: S, P and O
# fit a consumer's 240 registers, or at d 64 its 160 with a third consumer serving each K/V tile
# (d 128 spills there). Two stages keep up at d 128-256 only because each stage's K and V
# are released apart (Sm90Shared::kApart); tuning.md, "The Hopper forward".
SM90_TILES = {64: (128, 3, 3), 128: (176, 2, 2), 192: (80, 2, 2), 256: (80, 2, 2)}
# Under a causal mask or a window d 128 keeps 128 keys in three stages (FlashAttention-3's
# causal tile): a diagonal tile masks more of 176 keys, and short calls have few key tiles a row.
SM90_BANDED_TILES = {128: (128, 3, 2)}
# With softcap, ALiBi or dropout too, d 256 keeps 64 keys: 80 spill 4 bytes.
SM90_BANDED_EXTRAS_TILES = {256: (64, 2, 2)}
# A causal call of fewer than SM90_SHORT_CAUSAL_ROWS query rows at d 64 keeps two consumers:
# three consumers' 192-row tiles are too few, and too long, to share out (tuning.md, "The Hopper forward").
SM90_SHORT_CAUSAL_TILES = {64: (128, 3, 2)}
SM90_SHORT_CAUSAL_ROWS = 2048
# With score_mod, or mask_mod without a block mask (the extras' instance): head dim -> tile, two
# consumers and 64 keys a tile (a tile lies in one of a block mask's 128 x 128 blocks; with 128
# keys the mods' evaluation spilled), head dims up to 128. Empty: such calls take the mma.sync
# forward, which ran a mask_mod without its block mask 1.3x faster (tuning.md);
# experiment.override(sm90_mods_tiles={64: (64, 4, 2), 128: (64, 3, 2)}) sends them here.
SM90_MODS_TILES: dict[int, tuple[int, int, int]] = {}
# mask_mod alone with its block mask (no score_mod, softcap, ALiBi or dropout; dense or packed)
# rides on the plain instance, its hidden scores -inf before the exp as a causal mask's: head dim
# -> tile, 128 keys (one block of a block mask), the causal tiles (d 64: three consumers, 192
# rows over two rows of blocks; below SM90_SHORT_CAUSAL_ROWS two); tuning.md.
SM90_MASK_TILES = {64: (128, 3, 3), 128: (128, 3, 2)}
# A mask_mod that loads from its mod tensors (a document's ids) keeps two consumers: its loads
# spilled three consumers' 160 registers (same_document at d 64: 20 bytes, 0.89x; tuning.md).
SM90_MASK_TENSOR_TILES = {64: (128, 3, 2)}
# With a block mask a row's key tiles are walked as bits in shared memory (mods.cuh kMaxKeyTileBits):
# longer rows take the mma.sync forward.
MAX_KEY_TILE_BITS = 2048
SM90_HEAD_DIMS = tuple(SM90_TILES)


class Sm90Backward(NamedTuple):
    """The sm_90a backward (cuda/sm90/bwd.cu: TMA, wgmma) for head dims up to ``head_dim``
    (64 or 128; one between rides on the copy engine's zero columns): a producer warpgroup
    and two consumer warpgroups of 64 keys each (a block of 128), ``block_m`` query rows a
    step in ``stages`` Q/dO stages (SM90_BACKWARD_TILES); ``extras``: softcap, ALiBi,
    dropout or mods may be on, ``mods`` the call's score_mod / mask_mod as CUDA text
    (cuflash.mod.kernel_source) or ""."""
    dtype: str
    head_dim: int
    local: bool
    extras: bool
    block_m: int
    stages: int
    mods: str = ""
    kind = "backward_sm90"
    source = "sm90/bwd.cu"
    arch = "sm_90a"
    block_n = 128
    threads = 384

    @classmethod
    def of(cls, dtype: str, head_dim: int, local: bool, extras: bool = False, mods: str = "",
           dense: bool = False) -> Sm90Backward:
        """The variant with the planner's tile: SM90_BACKWARD_TILES, with extras
        SM90_BACKWARD_EXTRAS_TILES, and for ``dense`` calls (``takes_dense_tile``)
        SM90_BACKWARD_DENSE_TILES where it names the head dim."""
        tiles = SM90_BACKWARD_EXTRAS_TILES if extras else SM90_BACKWARD_TILES
        if dense and not (extras or mods) and head_dim in SM90_BACKWARD_DENSE_TILES:
            tiles = SM90_BACKWARD_DENSE_TILES
        return cls(dtype, head_dim, local, extras, *tiles[head_dim], mods)

    @property
    def instance(self) -> str:
        flags = ", ".join("true" if flag else "false" for flag in (self.local, self.extras))
        mods = ", cuflash::UserMods" if self.mods else ""  # (the struct self.mods defines; mods.cuh)
        return (f"cuflash::attention_backward_sm90<{DTYPES[self.dtype]}, {self.head_dim}, {self.block_m}, "
                f"{self.stages}, {flags}{mods}>")

    @property
    def transposed_dq(self) -> bool:
        """dQ^T = K^T dS^T, staged in DqAccum's transposed order: a step's rows are no
        multiple of wgmma's 64 (bwd.cu, kTransposedDq)."""
        return self.block_m % 64 != 0

    @property
    def shared_layout(self) -> str:
        return f"cuflash::Sm90BackwardShared<{self.head_dim}, {self.block_m}, {self.block_n}, {self.stages}>"

    @property
    def shared_bytes(self) -> int:
        """``Sm90BackwardShared<...>::kBytes``: K and V, the Q and dO stages, two dS tiles,
        each stage's LSE and D rows, dQ in fp32 and its groups' addresses, the dQ turn, the barriers
        (K/V's, a landed and a released one a stage, a staged and a drained one a consumer)
        and 1024 bytes of alignment."""
        d, m, n, stages = self.head_dim, self.block_m, self.block_n, self.stages
        return (2 * 2 * n * d + 2 * stages * 2 * m * d + 2 * 2 * n * m + 2 * stages * 4 * m + 4 * m * d + 2 * m
                + 16 + (1 + 2 * stages + 4) * 8 + 1024)


class Sm90WideBackward(NamedTuple):
    """The sm_90a backward for wide head dims (cuda/sm90/bwd_wide.cu: FlashAttention-3's d 256
    structure): a CTA a block of 80 keys, 64 query rows a step, Q in two stages, dO, P and dS
    in one (P and dS two buffers); the two consumer warpgroups split the scores by keys and
    dK^T, dV^T, dQ^T by head dim (128 columns each). Head dims of SM90_WIDE_BACKWARD_BUCKETS,
    those below 256 on the copy engine's zero columns; no softcap, ALiBi, dropout, mods or
    deterministic order (those calls stay on the mma.sync backward)."""
    dtype: str
    head_dim: int
    local: bool
    kind = "backward_sm90_wide"
    source = "sm90/bwd_wide.cu"
    arch = "sm_90a"
    extras = False
    mods = ""
    block_m = 64
    block_n = 80
    q_stages = 2
    threads = 384

    @classmethod
    def of(cls, dtype: str, head_dim: int, local: bool) -> Sm90WideBackward:
        return cls(dtype, head_dim, local)

    @property
    def instance(self) -> str:
        return (f"cuflash::attention_backward_sm90_wide<{DTYPES[self.dtype]}, {self.head_dim}, "
                f"{'true' if self.local else 'false'}>")

    @property
    def shared_layout(self) -> str:
        return (f"cuflash::Sm90WideBackwardSharedLayout<{self.head_dim}, {self.block_m}, {self.block_n}, "
                f"{self.q_stages}>")

    @property
    def shared_bytes(self) -> int:
        """``Sm90WideBackwardSharedLayout<...>::kBytes``: K and V, the Q stages, dO, two P and two
        dS tiles (80 x 64), each Q stage's LSE row and dO's D row, the barriers (K/V's, a landed
        and a released one for each Q stage and for dO) and 1024 bytes of alignment."""
        d, m, n, stages = self.head_dim, self.block_m, self.block_n, self.q_stages
        return (2 * 2 * n * d + (stages + 1) * 2 * m * d + 2 * 2 * 2 * n * m + (stages + 1) * 4 * m
                + (1 + 2 * stages + 2) * 8 + 1024)


# The head-dim buckets (variants.head_dim_bucket) whose calls without extras, mods or the
# deterministic order take Sm90WideBackward on sm_90a, the kernel's head dim 256 (161-192 and
# 225-256; 129-160 and 193-224 stay on the mma.sync backward, most of a 256-column product
# being zeros there). experiment.override(sm90_wide_backward_buckets=()) sends them back.
SM90_WIDE_BACKWARD_BUCKETS = (192, 256)
SM90_WIDE_BACKWARD_HEAD_DIM = 256
# Under a causal mask or a window the backwards' key blocks start longest first across groups
# of (KV head, sequence) pairs whose Q, dO and dQ's accumulator fit these bytes of L2
# (backward_section); experiment.override(sm90_backward_section_bytes=...) changes them.
SM90_BACKWARD_SECTION_BYTES = 32 << 20


# The sm_90a backward: head dim -> (query rows a step, Q/dO stages). A consumer keeps dK
# and dV of its 64 keys (2 x d / 2 registers a thread) beside S^T and dP^T of a step's
# query rows (2 x rows / 4): FlashAttention-3's 64 rows at d 128 (its 80 on dense calls
# below), 128 at d 64 (bwd.cu, kEarlyValues: the order of the products that fits the 240
# registers).
SM90_BACKWARD_TILES = {64: (128, 2), 128: (64, 2)}
# Calls on dense rows whose count is a multiple of 8, without softcap, ALiBi, dropout or mods,
# not deterministic (takes_dense_tile): FlashAttention-3's 80 query rows a step at d 128,
# dQ^T staged in its fragments' order (bwd.cu, kTransposedDq; DqAccum's transposed order,
# rounded by attention_backward_convert_dq_transposed[_by_head]); forward + backward
# 1.02-1.05x the 64-row tile from 2k without a mask (tuning.md).
# experiment.override(sm90_backward_dense_tiles={}) leaves them on SM90_BACKWARD_TILES.
SM90_BACKWARD_DENSE_TILES = {128: (80, 2)}
# Under a causal mask or a window, only calls whose key blocks see this many query rows or
# more (a narrower band spends more of its steps on the diagonal: d 128 causal 1k / 2k / 4k /
# 8k / 16k measured 0.95 / 0.97 / 1.01 / 1.04 / 1.04x the 64-row tile, tuning.md);
# experiment.override(sm90_backward_dense_band_rows=...) changes it.
SM90_BACKWARD_DENSE_BAND_ROWS = 4096
# With softcap, ALiBi, dropout or mods (P^T and dS^T made together, their arithmetic beside them):
# the head dims it takes such calls at (faster than the mma.sync backward at both, 1.3-2.2x at
# d 64: tuning.md); experiment.override(sm90_backward_extras_tiles=...) changes them.
SM90_BACKWARD_EXTRAS_TILES = {64: (128, 2), 128: (64, 2)}
SM90_BACKWARD_HEAD_DIMS = tuple(SM90_BACKWARD_TILES)


def extras_instance(options: Options) -> bool:
    """Does a call take the sm_90a kernels' extras instances? Softcap, ALiBi, dropout or
    mods, but mask_mod alone with its block mask, which rides on the plain ones (without a
    block mask, evaluated at every score, it spilled the plain d 64 backward)."""
    mods = options.mods
    blocked_mask = mods is not None and mods.mask_only and mods.blocks is not None
    return options.extras and not (blocked_mask and options.softcap == 0 and options.alibi is None
                                   and options.dropout_p == 0)


def mods_tile(head_dim: int, extras: bool) -> tuple[int, int, int] | None:
    """The forward's tile for a call with mods on the extras' instance (SM90_MODS_TILES) or
    the plain one (SM90_MASK_TILES); None where the table does not name the head dim."""
    return (SM90_MODS_TILES if extras else SM90_MASK_TILES).get(head_dim)


def takes(q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, out: ArrayInfo, options: Options,
          varlen: Varlen | None) -> bool:
    """Does the sm_90a forward take this call? Head dims 64 to 256; arrays the copy engine
    can read (16-byte aligned, head dim contiguous, every stride a multiple of 16 bytes)
    and that hold keys."""
    if not 64 <= q.shape[-1] <= 256 or q.dtype not in DTYPES or not vectorizable(q, k, v, out):
        return False
    seqlen_k = varlen.max_seqlen_k if varlen else k.shape[1]
    if options.mods is not None:
        extras = extras_instance(options)
        tile = mods_tile(next(d for d in SM90_HEAD_DIMS if d >= q.shape[-1]), extras)
        if tile is None or options.mods.blocks is not None and seqlen_k > MAX_KEY_TILE_BITS * tile[0]:
            return False
    if any(a.strides[-1] != 1 for a in (q, k, v)):
        return False
    return k.shape[-3] > 0 and seqlen_k > 0


def forward(q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, out: ArrayInfo, options: Options, varlen: Varlen | None,
            multiprocessors: int) -> Plan:
    """The sm_90a forward's plan (``takes`` said it takes the call): its Params, and the maps
    of Q, K and V (packed arrays as one batch of all rows; each tile starts at its
    sequence's first); at most ``multiprocessors`` CTAs (0: no limit). Under a causal mask,
    a window or a block mask the CTAs take tiles from a counter (fwd.cu, Sm90Tiles), the
    plan's workspace, which the launcher zeroes."""
    p, batch = call_params(q, k, v, options, varlen, o=out)
    head_dim = next(d for d in SM90_HEAD_DIMS if d >= q.shape[-1])
    blocks = options.mods is not None and options.mods.blocks is not None
    short = (options.window == (-1, 0) or blocks) and p.seqlen_q < SM90_SHORT_CAUSAL_ROWS  # (packed: the longest)
    kernel = Sm90Forward.of(q.dtype, head_dim, options.local, extras_instance(options), short,
                            "" if options.mods is None else options.mods.source, blocks,
                            options.mods is not None and options.mods.reads_tensors)
    maps = [tensor_map(name, a, varlen, rows) for name, a, rows in
            (("q", q, kernel.block_m), ("k", k, kernel.block_n), ("v", v, kernel.block_n))]
    tiles, key_tiles = -(-p.seqlen_q // kernel.block_m) * p.nheads * batch, -(-p.seqlen_k // kernel.block_n)
    tail_start, tail_ctas = tiles, 0
    if not options.local and varlen is None and options.mods is None:  # (a block mask's walk: whole tiles)
        tail_start, tail_ctas = sm90_tail(tiles, key_tiles, multiprocessors)
    steps = ()
    if batch and p.seqlen_q and p.nheads:
        grid = kernel.grid(p.seqlen_q, p.nheads, batch, multiprocessors)
        steps = (Step(kernel, (max(grid[0], tail_ctas), *grid[1:])),)
    # (a block mask's rows taken as a causal mask's: a lower-triangular one's longest first)
    window = (-1, 0) if kernel.blocks else options.window
    section = sm90_section(window, p.seqlen_q, p.seqlen_k, head_dim, p.heads_per_kv, p.nheads * batch)
    pointers, workspace = tuple(f"p.{n}" for n in FORWARD_POINTERS), ()
    if options.local or kernel.blocks:  # (tiles of uneven length: taken from a counter)
        pointers, workspace = pointers + ("tile_counter",), (("tile_counter", (1,), "int32"),)
    if tail_ctas:  # a slot for each (tail tile, CTA) that meet; a counter for each tail tile's warps
        slots, warps = tiles - tail_start + tail_ctas - 1, 4 * kernel.consumers
        pointers += ("partial_o", "partial_lse", "arrivals")
        workspace = (("partial_o", (slots, kernel.block_m, head_dim), "float32"),
                     ("partial_lse", (slots, kernel.block_m), "float32"),
                     ("arrivals", (tiles - tail_start, warps), "int32"))
    p, struct = with_mods(p, options)
    struct = Sm90Params if struct is Params else Sm90ModParams
    params = struct(p=p, batch=batch, section=section, tail_start=tail_start, tail_ctas=tail_ctas,
                    tail_key_tiles=key_tiles)
    counters = tuple(name for name, _, _ in workspace if name in ("tile_counter", "arrivals"))
    return Plan(bytes(params), pointers, steps, struct, workspace, tuple(maps), counters)


# Without a mask the tiles short of a full last wave are cut along their keys (sm90/tile_scheduler.cuh),
# each into as many pieces, so that a head's pieces read the same K and V from L2 together; the last
# to finish merges them. A share takes SM90_TAIL_MIN_TURNS key tiles at least, a tile SM90_TAIL_MAX_PIECES
# pieces at most (one warp merges them), and a cut needs a share plus SM90_TAIL_PIECE_TURNS (a piece's
# own costs, fitted on the H100) to be fewer turns than a tile; tuning.md, "The Hopper forward".
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


def backward_section(seqlen_q: int, head_dim: int, heads_per_kv: int, pairs: int) -> int:
    """(KV head, sequence) pairs a group of the sm_90a backwards' tile-major order under a
    causal mask or a window (GridTile in cuda/common.cuh: key block 0 of every pair of a
    group, the longest, then key block 1, ...; the short blocks fill the last wave): at
    most as many as keep their Q, dO and dQ's accumulator within SM90_BACKWARD_SECTION_BYTES
    of L2, in groups of equal size."""
    pair_bytes = seqlen_q * head_dim * heads_per_kv * (2 + 2 + 4)
    return group_size(pairs, SM90_BACKWARD_SECTION_BYTES // max(1, pair_bytes))


def backward_orders(head_dim: int, extras: bool, block_mask: bool, sm90a: bool) -> bool:
    """May a deterministic backward of this head dim run on the sm_90a kernel (dQ added in
    a fixed order; backward_workspace's ``ordered``)? ``extras``: softcap, ALiBi, dropout or
    mods (SM90_BACKWARD_EXTRAS_TILES' head dims). Not with a block mask (``block_mask``): its
    steps leave out pairs that the turns count."""
    return sm90a and not block_mask and _backward_head_dim(head_dim, extras) is not None


def _backward_head_dim(head_dim: int, extras: bool) -> int | None:
    """The sm_90a backward's head dim for this one (None: it has none), with extras or not."""
    if not 64 <= head_dim <= max(SM90_BACKWARD_HEAD_DIMS):
        return None
    bucket = next(d for d in SM90_BACKWARD_HEAD_DIMS if d >= head_dim)
    return bucket if not extras or bucket in SM90_BACKWARD_EXTRAS_TILES else None


def backward_takes(dout: ArrayInfo, q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, dq: ArrayInfo, dk: ArrayInfo,
                   dv: ArrayInfo, options: Options) -> bool:
    """Does the sm_90a backward take this call? Head dims 64 to 128 (with softcap, ALiBi,
    dropout or mods those of SM90_BACKWARD_EXTRAS_TILES) and the wide kernel's
    (``wide_backward``); arrays the copy engine can read (16-byte aligned, head dim
    contiguous, every stride a multiple of 16 bytes)."""
    if q.dtype not in DTYPES:
        return False
    if _backward_head_dim(q.shape[-1], extras_instance(options)) is None and not wide_backward(q.shape[-1], options):
        return False
    return vectorizable(dout, q, k, v, dq, dk, dv) and all(a.strides[-1] == 1 for a in (dout, q, k, v))


def wide_backward(head_dim: int, options: Options) -> bool:
    """Does a call of this head dim take the wide sm_90a backward (Sm90WideBackward), given
    that the sm_90a backward may run it? Its buckets (SM90_WIDE_BACKWARD_BUCKETS), none of
    softcap, ALiBi, dropout or mods. (Deterministic calls never reach it: ``backward_orders``
    is False at these head dims, so they get no dQ accumulator and take the mma.sync passes.)"""
    return (head_dim > max(SM90_BACKWARD_HEAD_DIMS) and head_dim_bucket(head_dim) in SM90_WIDE_BACKWARD_BUCKETS
            and not options.extras)


def takes_dense_tile(options: Options, varlen: Varlen | None, seqlen_q: int, ordered: bool) -> bool:
    """May the call take SM90_BACKWARD_DENSE_TILES? Dense rows, a multiple of 8 of them a
    sequence (each group of 8 rows of dQ's accumulator then belongs to one sequence, and
    every step's dQ goes by the copy engine), no extras, not ``ordered`` (deterministic);
    under a mask or window, a band of SM90_BACKWARD_DENSE_BAND_ROWS query rows or more a key
    block (the window's width and a block, or all rows where a side is unbounded)."""
    if options.extras or ordered or varlen is not None or seqlen_q % 8:
        return False
    left, right = options.window
    band = seqlen_q if left < 0 or right < 0 else min(seqlen_q, left + right + Sm90Backward.block_n)
    return not options.local or band >= SM90_BACKWARD_DENSE_BAND_ROWS


def backward(dout: ArrayInfo, q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, out: ArrayInfo, dq: ArrayInfo,
             dk: ArrayInfo, dv: ArrayInfo, dq_accum: ArrayInfo, options: Options, varlen: Varlen | None,
             dependent: bool = False, ordered: bool = False) -> Plan:
    """The sm_90a backward's plan (``backward_takes`` said it takes the call): the
    preprocess, the kernel (a CTA a block of 128 keys, or of 80 at the wide kernel's head
    dims), dQ's conversion (beside the kernel's last CTAs where the device takes ``dependent``
    launches: ``converts_beside``); the Params inside the struct of the maps, the
    elementwise steps given its ``p``. ``ordered``: deterministic (dQ's semaphores)."""
    p, batch = call_params(q, k, v, options, varlen, o=out, dout=dout, dq=dq, dk=dk, dv=dv)
    nheads_kv = k.shape[-2]
    accum_cols = dq_accum.shape[2] * dq_accum.shape[-1]  # (rows / 8, nheads, cols / 16, 8, 16)
    rows = backward_rows(p, batch, q, varlen, accum_cols)
    per_row, tasks = rows.args, rows.tasks
    if wide_backward(p.headdim, options):
        tiled = Sm90WideBackward.of(q.dtype, SM90_WIDE_BACKWARD_HEAD_DIM, options.local)
    else:
        tiled = Sm90Backward.of(q.dtype, next(d for d in SM90_BACKWARD_HEAD_DIMS if d >= p.headdim), options.local,
                                extras_instance(options), "" if options.mods is None else options.mods.source,
                                takes_dense_tile(options, varlen, p.seqlen_q, ordered))
    beside = dependent and converts_beside(tiled, p, varlen)
    steps = []
    if tasks:
        steps.append(Step(Elementwise("backward_preprocess", q.dtype), rows.preprocess_grid, per_row, argument="p"))
    if batch and p.seqlen_k and nheads_kv:
        steps.append(Step(tiled, (-(-p.seqlen_k // tiled.block_n), nheads_kv, batch)))
    # dQ^T in DqAccum's transposed order: 16 threads a block of 8 rows x 16 columns
    transposed = isinstance(tiled, Sm90Backward) and tiled.transposed_dq
    if tasks and beside:  # (a grid column a (sequence, head), 256 / lanes rows a CTA; the kernel's key blocks)
        threads = p.seqlen_q * accum_cols // 8 if transposed else p.seqlen_q * per_row[-1]
        steps.append(Step(Elementwise("backward_convert_dq_transposed_by_head" if transposed
                                      else "backward_convert_dq_by_head", q.dtype),
                          (-(-threads // 256), p.nheads, batch), (*per_row, -(-p.seqlen_k // tiled.block_n)),
                          argument="p", dependent=True))
    elif tasks and transposed:
        steps.append(Step(Elementwise("backward_convert_dq_transposed", q.dtype),
                          (-(-batch * p.seqlen_q * p.nheads * accum_cols // (8 * 256)), 1, 1), per_row, argument="p"))
    elif tasks:
        steps.append(Step(Elementwise("backward_convert_dq", q.dtype), rows.convert_grid, per_row, argument="p"))
    maps = tuple(tensor_map(name, a, varlen, rows) for name, a, rows in
                 (("q", q, tiled.block_m), ("k", k, tiled.block_n), ("v", v, tiled.block_n),
                  ("dout", dout, tiled.block_m)))
    if options.local:  # (deterministic calls and mods keep the grid's order: bwd.cu)
        p.tile_group = backward_section(p.seqlen_q, tiled.head_dim, p.heads_per_kv, batch * nheads_kv)
    p, struct = with_mods(p, options)
    struct = Sm90BackwardParams if struct is Params else Sm90BackwardModParams
    params = struct(p=p, batch=batch, accum_cols=accum_cols, count_done=int(beside))
    return Plan(bytes(params), tuple(f"p.{n}" for n in BACKWARD_POINTERS), tuple(steps), struct, maps=maps)


def converts_beside(kernel, p, varlen: Varlen | None) -> bool:
    """Does dQ's conversion run beside the sm_90a backward's last CTAs (each CTA counts its
    end on its (sequence, KV head)'s counter, the conversion by head waits for its head's
    count)? On dense rows, where every CTA of the grid counts (a packed call's CTAs past a
    sequence's keys end at once), at the tiles of 64 and 80 query rows (dQ by the copy engine:
    d 65 to 128); at d 64 (dQ added by the consumers) it measured slower (docs/tuning.md), and
    the wide kernel's consumers add dQ too."""
    return varlen is None and p.seqlen_k > 0 and isinstance(kernel, Sm90Backward) and kernel.block_m != 128
