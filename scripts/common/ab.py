"""Time several copies of the cuflash package side by side (A/B of kernel changes).

    python scripts/common/ab.py --mode fwd --d 128,256 .baseline/cuflash_prev .baseline/cuflash_x cuflash

Each folder is imported under its own name (bench._load_baseline), so every copy
compiles and caches its own kernels; all copies run in one process on the same inputs
(SDPA-flash on inputs of the same shape), taking turns call by call (bench._median_ms_each).
Prints TFLOP/s per copy and SDPA-flash's on the standard grid's shapes.

With --back-to-back N each measurement is N calls issued back to back between two events
(the host's time per call hidden behind the GPU's), the copies taking turns in five
rounds, the order reversed every other round, median of the five: the GPU time alone,
where the default (each call timed alone) also counts each call's host time.
"""
import argparse
import statistics

import torch

from cuflash import bench


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("fwd", "fwdbwd", "all"), default="fwd")
    parser.add_argument("--d", default="128")
    parser.add_argument("--seqlens", default="2048,8192")
    parser.add_argument("--causal", choices=("both", "on", "off"), default="both")
    parser.add_argument("--back-to-back", type=int, default=0, metavar="N",
                        help="time N calls back to back a measurement (GPU time) instead of each call alone")
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
                fns["sdpa-flash"] = impls["sdpa-flash"]
                ms = _back_to_back(fns, args.back_to_back) if args.back_to_back else bench._median_ms_each(fns, torch)
                print(f"d {d:3d} causal {causal!s:5} seqlen {s:5d}: " +
                      " | ".join(f"{flops / t / 1e9:6.1f}" for t in ms.values()), flush=True)
                torch.cuda.empty_cache()


def _back_to_back(fns: dict, calls: int) -> dict:
    """name -> median ms a call over five rounds of ``calls`` calls issued back to back."""
    def per_call(fn) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls

    for fn in fns.values():  # (warm-up: compiled, allocated)
        for _ in range(5):
            fn()
    times = {name: [] for name in fns}
    for r in range(5):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            times[name].append(per_call(fns[name]))
    return {name: statistics.median(t) for name, t in times.items()}


if __name__ == "__main__":
    main()
