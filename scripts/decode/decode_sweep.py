"""Time the KV-cache call's candidate tiles, split counts and merge steps beside cuDNN, in one
process, on the GPU machine (graph replay, ``bench --decode``'s timing rules):

    PYTHONPATH=. python scripts/decode/decode_sweep.py --tiles 16x64x4x2,16x128x8x2 --splits 0,1,2 \
        --merge cluster,kernel [--dependent on,off] --cells 1x4096,16x4096,64x16384 [--d 128] [--heads-k 8] \
        [--page-size 16]

Every combination of tiles (block_m x block_n x warps x stages, for both decode kinds),
num_splits (0: the planner's), merge step (``cluster``: where the planner gives one;
``kernel``: the merge kernel always) and launch (``--dependent on``: each kernel a
programmatic dependent of the one before, as planned on sm_90; ``off``: one after the
other) is timed on each ``batch x L`` cell, GB/s of K+V read. Used to choose the entries of
``cuflash/_plan/variants.py``; not part of the package.
"""
import argparse
import itertools

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import cuflash.torch
from cuflash import _plan, experiment
from cuflash.bench import decode as bench_decode
from cuflash.bench.timing import graph_and_plain

NHEADS = bench_decode.NHEADS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiles", default="16x64x4x2")
    parser.add_argument("--splits", default="0")
    parser.add_argument("--merge", default="cluster")
    parser.add_argument("--dependent", default="on")
    parser.add_argument("--cells", default="1x4096,1x16384,16x4096,64x4096")
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--heads-k", type=int, default=8)
    parser.add_argument("--page-size", type=int, default=0)
    args = parser.parse_args()
    bucket = _plan.head_dim_bucket(args.d)
    tiles = [_plan.Tile(*map(int, t.split("x"))) for t in args.tiles.split(",")]
    print(f"KV-cache call, GQA {NHEADS}/{args.heads_k}, d {args.d}, bf16, pages {args.page_size or '-'}: GB/s "
          "(graph replay) by tile / num_splits / merge step")
    for cell in args.cells.split(","):
        batch, length = map(int, cell.split("x"))
        caches, table, kv_bytes = bench_decode.cycled_caches(torch, batch, length, args.heads_k, args.d,
                                                             args.page_size)
        q = torch.randn(batch, 1, NHEADS, args.d, device="cuda", dtype=torch.bfloat16)
        lengths = torch.full((batch,), length, device="cuda", dtype=torch.int32)
        views = [(k.transpose(1, 2), v.transpose(1, 2)) for k, v in caches] if table is None else []
        row = []
        if views:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                us, _ = graph_and_plain(torch, [
                    lambda k=k, v=v: sdpa(q.transpose(1, 2), k, v, enable_gqa=args.heads_k != NHEADS)
                    for k, v in views])
            row.append(f"cudnn {kv_bytes / (us * 1e3):6.0f}")
        for tile, splits, merge, launch in itertools.product(tiles, map(int, args.splits.split(",")),
                                                             args.merge.split(","), args.dependent.split(",")):
            name = f"{tile.block_n}x{tile.warps}x{tile.stages}/{splits}/{merge}/{launch}"
            try:
                with experiment.override(tiles={"decode": {bucket: tile}, "decode_cluster": {bucket: tile}},
                                         clusters=merge == "cluster", dependent_launches=launch == "on"):
                    us, _ = graph_and_plain(torch, [
                        lambda k=k, v=v: cuflash.torch.attention_with_kvcache(q, k, v, cache_seqlens=lengths,
                                                                              block_table=table, num_splits=splits)
                        for k, v in caches])
                row.append(f"{name} {kv_bytes / (us * 1e3):6.0f}")
            except Exception as e:  # a tile that does not fit or fails to compile
                row.append(f"{name} {type(e).__name__}: {str(e)[:60]}")
        print(f"batch {batch:3d} L {length:6d}: " + "  ".join(row), flush=True)
        caches.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
