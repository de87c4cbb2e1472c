"""Time several copies of the cuflash package side by side (A/B of kernel changes).

    python scripts/ab.py --mode fwd --d 128,256 .baseline/cuflash_prev .baseline/cuflash_x cuflash

Each folder is imported under its own name (bench._load_baseline), so every copy
compiles and caches its own kernels; all copies run in one process on the same inputs
(SDPA-flash on inputs of the same shape), taking turns call by call (bench._median_ms_each).
Prints TFLOP/s per copy and SDPA-flash's on the standard grid's shapes.
"""
import argparse

import torch

from cuflash import bench


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("fwd", "fwdbwd", "all"), default="fwd")
    parser.add_argument("--d", default="128")
    parser.add_argument("--seqlens", default="2048,8192")
    parser.add_argument("--causal", choices=("both", "on", "off"), default="both")
    parser.add_argument("packages", nargs="+")
    args = parser.parse_args()
    modules = {path.rstrip("/").split("/")[-1]: bench._load_baseline(path) for path in args.packages}
    for mode in ("fwd", "fwdbwd") if args.mode == "all" else (args.mode,):
        _table(modules, mode == "fwdbwd", args)


def _table(modules: dict, backward: bool, args) -> None:
    print(f"{'fwdbwd' if backward else 'fwd'} TFLOP/s: " + " | ".join(modules) + " | sdpa-flash")
    for d in map(int, args.d.split(",")):
        for causal in {"both": (False, True), "on": (True,), "off": (False,)}[args.causal]:
            for s in map(int, args.seqlens.split(",")):
                b, h = bench.TOKENS // s, bench.HIDDEN // d
                flops = 4 * b * h * s * s * d / (2 if causal else 1) * (3.5 if backward else 1)
                impls = bench._implementations(torch, b, s, h, d, causal, backward)
                x = [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
                fns = {name: (lambda module=module: bench._run(module, *x, backward, causal=causal))
                       for name, module in modules.items()}
                ms = bench._median_ms_each({**fns, "sdpa-flash": impls["sdpa-flash"]}, torch)
                print(f"d {d:3d} causal {causal!s:5} seqlen {s:5d}: " +
                      " | ".join(f"{flops / t / 1e9:6.1f}" for t in ms.values()), flush=True)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
