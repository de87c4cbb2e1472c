"""The forward on a Hopper GPU at one head dim: the sm_90a kernel and the mma.sync kernel
(what CUFLASH_PORTABLE=1 runs) beside torch SDPA's cuDNN and flash backends, on the same
tensors: TFLOP/s, CUDA events, median of rounds taken in turns after a warm-up
(bench's timing rules).

    PYTHONPATH=. python scripts/sm90/sm90_bench.py [--dtype float16] [--batch-tokens 16384] [--head-dim 128]
                                                   [--tile 80,2[,2]] [--blocks] [--sections 0,8,32]
                                                   [--causal-only] [--whole] [--shapes 512x16384,...]
"""
import argparse

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

from cuflash import _arrays, _kernels, _options, _plan, bench, experiment


def forward_call(q, k, v, out, causal: bool, sm90a: bool, tile=None, persistent=True, section_bytes=None,
                 cut=True):
    """The forward of q, k, v into out on one path, planned once (on the sm_90a kernel with
    ``tile``, (keys, stages[, consumers]), instead of the planner's, its consumers where
    left out; a CTA per tile unless ``persistent``; the scheduler's sections sized by
    ``section_bytes`` instead of SM90_SECTION_BYTES; the last wave left whole unless
    ``cut``): a zero-argument call."""
    infos = [_arrays.inspect(x, name) for name, x in (("q", q), ("k", k), ("v", v), ("out", out))]
    options = _options.make_options(infos[0], infos[1], causal, None, (-1, -1), 0.0, None, 0.0, None, 0,
                                    backward=False)
    entry = next(d for d in _plan.SM90_HEAD_DIMS if d >= q.shape[-1])

    def tiled(table):  # (every table, with or without a mask: the tile given, the rest the planner's)
        planned = table.get(entry, _plan.SM90_TILES[entry])
        return {entry: (*tile, *planned[len(tile):])} if tile else None

    with experiment.override(sm90_tiles=tiled(_plan.SM90_TILES), sm90_banded_tiles=tiled(_plan.SM90_BANDED_TILES),
                             sm90_banded_extras_tiles=tiled(_plan.SM90_BANDED_EXTRAS_TILES),
                             sm90_short_causal_tiles=tiled(_plan.SM90_SHORT_CAUSAL_TILES),
                             sm90_section_bytes=section_bytes,
                             sm90_tail=None if cut else lambda tiles, key_tiles, multiprocessors: (tiles, 0)):
        facts = _kernels.device_facts(q.device.index)
        plan = _plan.forward(*infos, options, None,
                             facts._replace(sm90a=sm90a, multiprocessors=facts.multiprocessors if persistent else 0))
    assert (plan.struct.__name__ == "Sm90Params") == sm90a, "the sm_90a forward does not take this call"
    launcher = _kernels.Launcher(plan, q.device.index)
    work = [torch.empty(shape, dtype=getattr(torch, dtype), device=q.device) for _, shape, dtype in plan.workspace]
    pointers = [x.data_ptr() for x in (q, k, v, out)] + [0] + [w.data_ptr() for w in work]
    return lambda: launcher(torch.cuda.current_stream().cuda_stream, *pointers)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--batch-tokens", type=int, default=16384, help="batch x seqlen of every cell")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tile", help="KEYS,STAGES[,CONSUMERS]: also time the sm_90a kernel with this tile "
                                       "(column 'tile'; e.g. 128,3,2 at d 64: two consumers beside the planner's "
                                       "three), and print how far its output is from the planner's tile's")
    parser.add_argument("--blocks", action="store_true",
                        help="also time the sm_90a kernel on a grid of a CTA per tile (column 'blocks')")
    parser.add_argument("--sections", help="MIB,...: also time the sm_90a kernel with the scheduler's sections "
                                           "sized for this much L2 (columns 's<MIB>'; 0: a pair a section, "
                                           "head after head)")
    parser.add_argument("--causal-only", action="store_true", help="only the causal calls")
    parser.add_argument("--whole", action="store_true",
                        help="also time the sm_90a kernel with the last wave left whole, not cut along the keys "
                             "(column 'whole'), and print how far its output is from the cut one's")
    parser.add_argument("--shapes", help="SEQLEN_QxSEQLEN_K,...: a batch of one of each instead of the square "
                                         "grid (few query rows, many keys: a call the tail's cut spreads out)")
    args = parser.parse_args()
    d = args.head_dim
    kernel_dim = next(k for k in _plan.SM90_HEAD_DIMS if k >= d)
    tile = tuple(map(int, args.tile.split(","))) if args.tile else None
    dtype = getattr(torch, args.dtype)
    heads = 2048 // d
    sections = [int(x) for x in args.sections.split(",")] if args.sections else []
    columns = ("sm90", *(("whole",) if args.whole else ()), *(("tile",) if tile else ()),
               *(("blocks",) if args.blocks else ()),
               *(f"s{mib}" for mib in sections), "mma.sync",
               "sdpa-cudnn", "sdpa-flash")
    banded = _plan.SM90_BANDED_TILES.get(kernel_dim, _plan.SM90_TILES[kernel_dim])
    print(f"forward, d {d}, {heads} heads, {args.dtype}, TFLOP/s; sm90 (keys a tile, stages, consumers): "
          f"{_plan.SM90_TILES[kernel_dim]}, causal {banded}; tile: {tile}")
    other = "tile" if tile else "whole" if args.whole else None  # max |out - sm90's out| of this column
    print(f"{'seqlen':>11} {'causal':>6} " + " ".join(f"{c:>11}" for c in columns) + f" {'sm90/cudnn':>10}"
          + (f" {other + ' err':>10}" if other else ""))
    shapes = [(n, n) for n in (512, 1024, 2048, 4096, 8192, 16384)]
    if args.shapes:
        shapes = [tuple(map(int, shape.split("x"))) for shape in args.shapes.split(",")]
    for seqlen, seqlen_k in shapes:
        batch = 1 if args.shapes else max(1, args.batch_tokens // seqlen)
        # (--shapes: not causal; SDPA aligns a causal mask of sq != sk to the top left, cuflash to the bottom right)
        for causal in (False,) if args.shapes else (True,) if args.causal_only else (False, True):
            q = torch.randn(batch, seqlen, heads, d, device="cuda", dtype=dtype)
            k, v = (torch.randn(batch, seqlen_k, heads, d, device="cuda", dtype=dtype) for _ in range(2))
            out = torch.empty_like(q)
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            calls = {"sm90": forward_call(q, k, v, out, causal, True),
                     "mma.sync": forward_call(q, k, v, out, causal, False)}
            if tile:  # (into an output of its own, held against the planner's tile's below)
                other_out = torch.empty_like(q)
                calls["tile"] = forward_call(q, k, v, other_out, causal, True, tile)
            elif args.whole:
                other_out = torch.empty_like(q)
                calls["whole"] = forward_call(q, k, v, other_out, causal, True, cut=False)
            if args.blocks:
                calls["blocks"] = forward_call(q, k, v, out, causal, True, persistent=False)
            for mib in sections:
                calls[f"s{mib}"] = forward_call(q, k, v, out, causal, True, section_bytes=mib << 20)
            for name, backend in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
                def call(backend=backend):
                    with sdpa_kernel(backend):
                        sdpa(qt, kt, vt, is_causal=causal)
                calls[name] = call
            ms = bench._median_ms_each(calls, torch)
            flops = 4 * batch * heads * seqlen * seqlen_k * d / (2 if causal else 1)
            tflops = {name: flops / (t * 1e9) for name, t in ms.items()}
            differs = ""
            if other:
                calls["sm90"](), calls[other]()
                differs = f" {(out.float() - other_out.float()).abs().max().item():10.2e}"
            label = str(seqlen) if seqlen == seqlen_k else f"{seqlen}x{seqlen_k}"
            print(f"{label:>11} {str(causal):>6} " + " ".join(f"{tflops[c]:11.1f}" for c in columns)
                  + f" {tflops['sm90'] / tflops['sdpa-cudnn']:10.2f}" + differs, flush=True)


if __name__ == "__main__":
    main()
