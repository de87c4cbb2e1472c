"""The KV-cache call's speed on decode shapes (``python -m cuflash bench --decode``), beside
torch SDPA's cuDNN and flash backends on the same caches.

One new query token per sequence, bf16, GQA 32/8 and MHA 32/32, head dims 64 and 128; batch
1 with L = 4k, 16k, 64k keys cached and batch 16 and 64 with 4k and 16k (``--quick``: batch 1
and 16 at 4k and 16k). The cache is contiguous, or paged with pages of 16 and 256 rows
(shuffled pages; SDPA has no paged call, so its columns come from the contiguous layout).
Caches are cycled through copies of at least ``CYCLE_BYTES`` together (L2 holds 50-60 MB),
so every call reads them from HBM. Two ways: calls replayed from a CUDA graph (the GPU's
time) and plain back-to-back calls (the host's time included); CUDA events, median of
``timing.ROUNDS`` rounds. Figures are GB/s of K and V bytes read. ``append`` is cuflash's
call with a new key and value appended and rotated (the decode step of a serving loop),
graph replay.
"""
from __future__ import annotations

import csv

from . import plot
from .timing import ROUNDS, graph_and_plain

NHEADS = 32
CYCLE_BYTES = 400e6
GRID = ((1, 4096), (1, 16384), (1, 65536), (16, 4096), (16, 16384), (64, 4096), (64, 16384))
QUICK_GRID = ((1, 4096), (1, 16384), (16, 4096), (16, 16384))
LAYOUTS = ("contiguous", "paged16", "paged256")
COLUMNS = ("cuflash", "cuflash-plain", "append", "sdpa-cudnn", "sdpa-cudnn-plain", "sdpa-flash", "sdpa-flash-plain")


def paged(torch, cache, page_size: int, order):
    """A contiguous cache (batch, L, h, d) as pages: page j of sequence b in slot
    order[b * pages a sequence + j] (``order`` a permutation; the block table is it, reshaped)."""
    batch, length = cache.shape[:2]
    per_seq = -(-length // page_size)
    pages = torch.empty(batch * per_seq, page_size, *cache.shape[2:], device=cache.device, dtype=cache.dtype)
    padded = torch.zeros(batch, per_seq * page_size, *cache.shape[2:], device=cache.device, dtype=cache.dtype)
    padded[:, :length] = cache
    pages[order] = padded.reshape(batch * per_seq, page_size, *cache.shape[2:])
    return pages


def cycled_caches(torch, batch: int, length: int, nheads_k: int, d: int, page_size: int = 0):
    """(caches, block_table, K+V bytes of one): copies of a bf16 (batch, length, nheads_k, d)
    K/V cache, at least CYCLE_BYTES together, contiguous or (``page_size``) every copy in the
    same shuffled pages, whose block table is returned (else None)."""
    kv_bytes = 2 * batch * length * nheads_k * d * 2
    copies = max(2, min(16, int(-(-CYCLE_BYTES // kv_bytes))))
    dense = [tuple(torch.randn(batch, length, nheads_k, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
             for _ in range(copies)]
    if not page_size:
        return dense, None, kv_bytes
    per_seq = -(-length // page_size)
    order = torch.randperm(batch * per_seq, device="cuda")
    table = order.reshape(batch, per_seq).to(torch.int32)
    return [(paged(torch, k, page_size, order), paged(torch, v, page_size, order)) for k, v in dense], table, kv_bytes


def step_inputs(torch, batch: int, length: int, nheads_k: int, d: int) -> tuple:
    """A decode step's other arguments, on the GPU: (q (batch, 1, NHEADS, d), the new key and
    value (batch, 1, nheads_k, d), bf16; the cache lengths with and before that token, int32;
    rotary cos and sin over the L positions, float32)."""
    def randn(heads):
        return torch.randn(batch, 1, heads, d, device="cuda", dtype=torch.bfloat16)
    lengths = torch.full((batch,), length, device="cuda", dtype=torch.int32)
    angle = torch.rand(length, d // 2, device="cuda")
    return randn(NHEADS), randn(nheads_k), randn(nheads_k), lengths, lengths - 1, angle.cos(), angle.sin()


def cell(torch, batch: int, length: int, nheads_k: int, d: int, layout: str) -> dict:
    """GB/s of every column for one shape (the SDPA columns with the contiguous layout only)."""
    import cuflash.torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    page_size = 0 if layout == "contiguous" else int(layout.removeprefix("paged"))
    caches, table, kv_bytes = cycled_caches(torch, batch, length, nheads_k, d, page_size)
    q, new_k, new_v, lengths, before, cos, sin = step_inputs(torch, batch, length, nheads_k, d)
    us = {}
    calls = [lambda k=k, v=v: cuflash.torch.attention_with_kvcache(q, k, v, cache_seqlens=lengths, block_table=table)
             for k, v in caches]
    us["cuflash"], us["cuflash-plain"] = graph_and_plain(torch, calls)
    # The decode step: the new token appended (rotated) at length - 1, then attended to.
    calls = [lambda k=k, v=v: cuflash.torch.attention_with_kvcache(q, k, v, new_k, new_v, cache_seqlens=before,
                                                                   block_table=table, rotary_cos=cos, rotary_sin=sin,
                                                                   causal=True) for k, v in caches]
    us["append"], _ = graph_and_plain(torch, calls)
    if layout == "contiguous":
        qt = q.transpose(1, 2)
        views = [(k.transpose(1, 2), v.transpose(1, 2)) for k, v in caches]
        for name, backend in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    calls = [lambda k=k, v=v: sdpa(qt, k, v, enable_gqa=nheads_k != NHEADS) for k, v in views]
                    us[name], us[name + "-plain"] = graph_and_plain(torch, calls)
            except RuntimeError:  # a backend that does not take this shape or build
                pass
    caches.clear()
    torch.cuda.empty_cache()
    return {name: kv_bytes / (t * 1e3) for name, t in us.items()}


def main(args, torch, gpu: str) -> int:
    """The decode table (and its CSV and plot, as ``args`` asks)."""
    grid = QUICK_GRID if args.quick else GRID
    dims = args.head_dims or (64, 128)
    rows = []
    print(f"KV-cache decode, {gpu}, bf16, one query token, torch {torch.__version__}: GB/s of K+V read "
          f"(graph replay; -plain: back-to-back calls), median of {ROUNDS}")
    print(f"{'layout':>10} {'heads':>6} {'d':>4} {'batch':>5} {'L':>6} " + " ".join(f"{c:>16}" for c in COLUMNS)
          + f" {'cuflash/cudnn':>13}")
    for layout in LAYOUTS:
        for nheads_k in (8, NHEADS):
            for d in dims:
                for batch, length in grid:
                    gbs = cell(torch, batch, length, nheads_k, d, layout)
                    row = {"layout": layout, "heads": f"{NHEADS}/{nheads_k}", "d": d, "batch": batch,
                           "L": length, **gbs}
                    rows.append(row)
                    ratio = f"{gbs['cuflash'] / gbs['sdpa-cudnn']:13.2f}" if "sdpa-cudnn" in gbs else f"{'-':>13}"
                    print(f"{layout:>10} {row['heads']:>6} {d:4d} {batch:5d} {length:6d} "
                          + " ".join(f"{gbs[c]:16.0f}" if c in gbs else f"{'-':>16}" for c in COLUMNS) + " "
                          + ratio, flush=True)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["layout", "heads", "d", "batch", "L", *COLUMNS])
            writer.writeheader()
            writer.writerows(rows)
    if args.plot:
        plot.decode(rows, args.plot, f"{gpu}, bf16, KV-cache decode (graph replay)")
    return 0

