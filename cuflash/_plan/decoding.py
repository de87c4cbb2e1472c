"""The KV-cache call's plans (cuda/decode/): the split-KV forward with its splits, packing
and merge steps, and merge_states."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .._params import DecodeParams, MergeParams
from .plan import Plan, Step, scale_log2, vectorizable, view
from .variants import MAX_CLUSTER_SPLITS, Merge, copy_run_rows, has_tile, kernel

if TYPE_CHECKING:
    from .._arrays import ArrayInfo
    from .._device import Device
    from .._options import KVCache, Options, Varlen
    from .variants import Kernel


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
           out: ArrayInfo, cache: KVCache, options: Options, device: Device, varlen: Varlen | None = None) -> Plan:
    """The KV-cache call: the split kernel, then, with more than one part of the keys, the
    merge of their results (the workspace's partial_o and partial_lse) into ``out``; or,
    where the device takes thread block ``clusters`` (sm_90), the splits of a row block merge
    in their cluster. Where it takes ``dependent_launches`` (sm_90) the merge kernel is
    launched as a programmatic dependent of the split kernel: it starts as the splits finish their keys
    and reads nothing before the split kernel has ended. (The split kernel launched so
    after the kernel before it gained nothing: docs/tuning.md, "KV-cache decode".) The launch is given
    DECODE_POINTERS: the merge's parts and lses are the workspace, its out and out_lse the
    call's. With ``varlen``, the varlen call over a paged cache: q and out packed
    (total_q, nheads, d), sequence b's keys the first cu_seqlens_k[b + 1] - cu_seqlens_k[b]
    rows of its pages (cu_seqlens_q and cu_seqlens_k given at launch)."""
    shared_limit, multiprocessors = device.shared_limit, device.multiprocessors
    if varlen is None:
        batch, seqlen_q, nheads, head_dim = q.shape
        query_rows = batch * seqlen_q
    else:
        (query_rows, nheads, head_dim), batch, seqlen_q = q.shape, varlen.batch, varlen.max_seqlen_q
    nheads_k = k_cache.shape[2]
    p = DecodeParams()
    for name, a in dict(q=q, o=out, k_cache=k_cache, v_cache=v_cache, k_new=k, v_new=v).items():
        setattr(p, name, view(a))
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
    # by row (slower with it; tuning.md, "KV-cache decode").
    if parts == 1 and not cache.deterministic and has_tile("decode_wide", head_dim, extras, shared_limit):
        wide = kernel("decode_wide", q.dtype, head_dim, options.local, vectorized, extras, shared_limit)
        if not row_by_row(wide):
            chosen = wide
    grid = (splits * row_blocks, nheads_k, batch)
    # Clusters only where the grid is one wave of a CTA a multiprocessor: with two a
    # multiprocessor a cluster's CTAs wait for its slowest at the merge, holding their
    # multiprocessors (tuning.md, "KV-cache decode"). A deterministic call merges in the
    # merge kernel's order whatever its splits.
    ctas = splits * row_blocks * nheads_k * batch
    if device.clusters and not cache.deterministic and 1 < splits <= MAX_CLUSTER_SPLITS and ctas <= multiprocessors:
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
                          dependent=device.dependent_launches))
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
    each (no split left empty); the measurements: docs/tuning.md, "KV-cache decode"."""
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
