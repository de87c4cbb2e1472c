"""Time candidate tile shapes beside SDPA-flash, in one process, on the GPU machine.

    python scripts/common/tile_sweep.py --mode fwd --d 128 --tiles "forward=128x64x4x2,128x32x4x2"
    python scripts/common/tile_sweep.py --mode fwdbwd --d 128 \
        --tiles "backward_dkdv=32x64x4x2;backward_dq=64x32x4x2,64x64x4x2"

Each ``kind=tile,tile`` list replaces that kind's table entry for the head dim
(tile = block_m x block_n x warps x stages [x col_split]); every combination of
the lists is timed on the standard grid's shapes (bf16, hidden 2048, 16k tokens).
Used to choose the entries of ``cuflash/_plan/variants.py``; not part of the package.
"""
import argparse
import itertools

import torch

from cuflash import _plan, bench, experiment


def parse_tiles(spec: str) -> dict[str, list[_plan.Tile]]:
    kinds = {}
    for part in filter(None, spec.split(";")):
        kind, tiles = part.split("=")
        kinds[kind] = [_plan.Tile(*map(int, t.split("x"))) for t in tiles.split(",")]
    return kinds


def precompile(kinds: dict[str, list[_plan.Tile]], d: int) -> None:
    """NVRTC holds the GIL: fill the disk cache from a process pool first."""
    import concurrent.futures
    from cuflash import _compile
    arch = _compile.device_arch(0)
    jobs = [_plan.Kernel(kind, "bfloat16", d, tile, local, True, False)
            for kind, tiles in kinds.items() for tile in tiles for local in (False, True)]
    with concurrent.futures.ProcessPoolExecutor() as pool:
        list(pool.map(_compile.compile_kernel, [k.source for k in jobs], [k.instance for k in jobs],
                      [arch] * len(jobs)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("fwd", "fwdbwd"), default="fwd")
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--seqlens", default="2048,8192")
    parser.add_argument("--tiles", required=True)
    args = parser.parse_args()
    backward = args.mode == "fwdbwd"
    kinds = parse_tiles(args.tiles)
    precompile(kinds, args.d)
    print(f"{args.mode} d {args.d}, TFLOP/s (cuflash / sdpa-flash)")
    for causal in (False, True):
        for s in map(int, args.seqlens.split(",")):
            b, h = bench.TOKENS // s, bench.HIDDEN // args.d
            flops = 4 * b * h * s * s * args.d / (2 if causal else 1) * (3.5 if backward else 1)
            impls = bench._implementations(torch, b, s, h, args.d, causal, backward)
            flash = flops / (bench._median_ms(impls["sdpa-flash"], torch) * 1e-3) / 1e12
            cells = []
            for combo in itertools.product(*kinds.values()):
                try:
                    with experiment.override(tiles={kind: {args.d: tile} for kind, tile in zip(kinds, combo)}):
                        tflops = flops / (bench._median_ms(impls["cuflash"], torch) * 1e-3) / 1e12
                    cells.append(f"{'/'.join(f'{t.block_m}x{t.block_n}x{t.warps}x{t.stages}x{t.col_split}' for t in combo)}"
                                 f" {tflops:6.1f} ({tflops / flash:.3f})")
                except Exception as e:  # a tile that does not fit or fails to compile
                    cells.append(f"{combo}: {type(e).__name__}: {str(e)[:80]}")
            print(f"causal {causal!s:5} seqlen {s:5d}  flash {flash:6.1f} | " + " | ".join(cells), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
